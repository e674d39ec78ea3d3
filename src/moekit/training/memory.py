"""Bytes a training run holds per device: the arithmetic behind `moekit train|finetune --dry-run`
(moekit.training.plan counts the parameters on the meta device and calls this). Pure functions of counts and shapes.

What is exact and what is an estimate:

* parameters, gradients and optimizer state on one device (torch AdamW, as the Trainer runs it): exact for the
  tensors themselves (tests/test_plan.py compares them with a real run's byte for byte);
* the other engines' rows apply each engine's documented storage convention to the same counts (computed, not
  measured here: there is no multi-GPU machine in the tests);
* activations: an estimate of what autograd saves for the backward (formula in `token_bytes`), checked against the
  tensors a tiny model really saves (tests/test_plan.py, within ACTIVATION_TOLERANCE); the transient buffers of the
  backward itself and the allocator's fragmentation come on top.

Engine conventions (per device, N devices, E_p expert-parallel ranks; "c" = 2 bytes under bf16/fp16, else the
parameters' own size):

* single device / DDP (Trainer + torch AdamW): parameters in the model's dtype, gradients in the same dtype,
  AdamW's exp_avg and exp_avg_sq in the parameter dtype plus a float32 `step` per tensor; no master copy
  (mixed precision is autocast over the stored parameters, which adds bf16 copies of the Linear weights while the
  graph holds them). DDP adds its gradient buckets, a second copy of the gradients (gradient_as_bucket_view=False is
  PyTorch's default and what accelerate passes).
* selective fine-tuning (moekit.selection.finetune): the full expert tensors of the selected layers are rebuilt from
  the frozen tensor and the trainable rows in every forward and kept for the backward: counted as buffers in every
  row.
* DeepSpeed ZeRO-2: parameters (cast to c bytes) replicated; gradients (c bytes) and optimizer state sharded over N;
  the optimizer steps a copy of its partition in the master dtype w (the parameters' stored dtype in these tables:
  float32 is DeepSpeed's default, "K = 12" of the ZeRO paper with AdamW's two states; bfloat16 is its
  `bf16_master_weights_and_grads` with `bf16_optimizer_states`), 3w bytes per trainable parameter. Its reduce and
  all-gather buckets (reduce_bucket_size, allgather_bucket_size) are configuration, not counted.
* DeepSpeed ZeRO-3: as ZeRO-2 with the parameters sharded too, and no copy where the partition is already in the
  master dtype (c = w: DeepSpeed's stage3.py reuses the partition), plus the parameters gathered while a layer runs
  (estimated as two decoder layers at c bytes: the running one and the prefetched one).
* FSDP2 full shard (fully_shard per decoder layer, MixedPrecisionPolicy under bf16): parameters, gradients and AdamW
  state sharded over N in the parameters' stored dtype (the sharded parameters are what the optimizer steps; no
  separate master copy), plus two decoder layers gathered in the compute dtype.
* expert parallelism E_p (transformers' ep_size): each MoE layer's routed experts (their parameters, gradients and
  optimizer state) split over E_p ranks; everything else as DDP (replicated), or, in the "EP + FSDP2" row, sharded
  over N as FSDP2. All-to-all dispatch buffers are not counted.

Activations are per device in every row: these engines shard state, not the micro-batch (DeepSpeed's are those of
its parameters cast to 2 bytes under mixed precision).

Every row of one table keeps its weights, gradients and AdamW state in one dtype w (`shares`' `param_size`): 16
bytes per trainable parameter on every engine with float32 weights under bf16 autocast (ZeRO-2 20 in float32
training: its master partition is a copy), 8 with bfloat16 (ZeRO-2 10).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

ADAM_STEP = 4  # torch AdamW (foreach and fused) keeps `step` as a float32 scalar tensor per parameter tensor
ADAM_STATES = 2  # exp_avg, exp_avg_sq
GATHERED_LAYERS = 2  # decoder layers unsharded at a time under ZeRO-3 / FSDP2 (the running and the prefetched one)
ACTIVATION_TOLERANCE = 0.10  # the estimate vs the tensors autograd saved on tiny models (tests/test_plan.py)


@dataclass(frozen=True)
class Counts:
    """The state a run holds on one device, at the plan's peak stage. `*_bytes` in the dtypes the run stores."""

    params: int  # parameter elements resident (finetune: the full tensors plus the selected rows' trainable copies)
    param_bytes: int
    replicated: int  # of those, elements no engine shards (buffers: a selection's full expert tensors)
    replicated_bytes: int
    trainable: int  # elements that get gradients (the largest stage)
    trainable_bytes: int
    state: int  # elements the optimizer holds state for (union of the stages: AdamW keeps a state once made)
    state_bytes: int
    state_tensors: int
    routed: int = 0  # elements of routed-expert parameters (what expert parallelism splits)
    routed_bytes: int = 0
    routed_trainable: int = 0
    routed_trainable_bytes: int = 0
    routed_state: int = 0
    routed_state_bytes: int = 0
    routed_state_tensors: int = 0
    layer_params: int = 0  # elements of the largest decoder layer (what ZeRO-3 / FSDP2 gather at a time)
    linear_params: int = 0  # elements of Linear weights that autocast copies to the compute dtype
    materialized_bytes: int = 0  # tensors rebuilt each step from frozen and trainable parts (a selection's experts)

    @property
    def grad_bytes(self) -> int:
        return self.trainable_bytes

    @property
    def optimizer_bytes(self) -> int:
        """torch AdamW: two states in the parameter dtype and a float32 step per tensor."""
        return ADAM_STATES * self.state_bytes + ADAM_STEP * self.state_tensors


@dataclass(frozen=True)
class Share:
    """Per-device bytes under one engine."""

    engine: str
    params: int
    grads: int
    optimizer: int
    buffers: int  # DDP buckets, gathered layers, autocast weight copies
    activations: int
    note: str = ""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.activations


def shares(c: Counts, activations: int, devices: int, expert_parallel: int | None, mixed: bool,
           param_size: int, ep_reason: str = "", cast_activations: int | None = None) -> list[Share]:
    """Per-device bytes under each engine (see the module docstring). `param_size`: bytes per element of the
    stored parameters, the master dtype of every engine; `mixed`: bf16/fp16 mixed precision; `expert_parallel`
    None: no EP rows (`ep_reason` says why); `cast_activations`: DeepSpeed's, computing on parameters cast to
    2 bytes under mixed precision (default: `activations`)."""
    n, cast = devices, 2 if mixed else param_size
    zero_acts = activations if cast_activations is None else cast_activations
    # bf16 copies of fp32 Linear weights; the full expert tensors a selection's parametrizations rebuild
    autocast = (2 * c.linear_params if mixed and param_size > 2 else 0) + c.materialized_bytes
    gathered = GATHERED_LAYERS * c.layer_params * cast + c.materialized_bytes
    rows = [
        Share("single device", c.param_bytes, c.grad_bytes, c.optimizer_bytes, autocast, activations),
        Share(f"DDP × {n}", c.param_bytes, c.grad_bytes, c.optimizer_bytes, autocast + c.grad_bytes, activations,
              "buffers: gradient buckets (a second copy of the gradients)"),
        Share(f"ZeRO-2 × {n}", c.params * cast, _over(c.trainable * cast, n),
              _over(c.state * zero_optimizer(2, cast, param_size), n), c.materialized_bytes, zero_acts),
        Share(f"ZeRO-3 × {n}", _over((c.params - c.replicated) * cast, n) + c.replicated * cast,
              _over(c.trainable * cast, n),
              _over(c.state * zero_optimizer(3, cast, param_size), n), gathered, zero_acts,
              f"buffers: {GATHERED_LAYERS} decoder layers gathered"),
        Share(f"FSDP2 × {n}", _over(c.param_bytes - c.replicated_bytes, n) + c.replicated_bytes,
              _over(c.grad_bytes, n), _over(c.optimizer_bytes, n),
              gathered, activations, f"buffers: {GATHERED_LAYERS} decoder layers gathered"),
    ]
    if expert_parallel:
        rows += expert_rows(c, activations, devices, expert_parallel, autocast, gathered)
    elif ep_reason:
        rows.append(Share(f"EP: {ep_reason}", 0, 0, 0, 0, 0))
    return rows


def zero_optimizer(stage: int, cast: int, master: int) -> int:
    """Bytes per trainable parameter of DeepSpeed ZeRO's optimizer: the master partition (a copy, except under ZeRO-3
    where the partition is already in the master dtype) and AdamW's two states, all in the master dtype."""
    copy = master if stage == 2 or cast != master else 0
    return copy + ADAM_STATES * master


def recast(c: Counts, size: int, stored: int) -> Counts:
    """`c` with every parameter (and rebuilt tensor) held in `size` bytes per element instead of `stored`."""
    return replace(c, param_bytes=c.params * size, replicated_bytes=c.replicated * size,
                   trainable_bytes=c.trainable * size, state_bytes=c.state * size, routed_bytes=c.routed * size,
                   routed_trainable_bytes=c.routed_trainable * size, routed_state_bytes=c.routed_state * size,
                   materialized_bytes=c.materialized_bytes * size // stored)


def _over(nbytes: int, n: int) -> int:
    return -(-nbytes // n)  # ceil: the first ranks hold the remainder


def expert_rows(c: Counts, activations: int, devices: int, ep: int, autocast: int, gathered: int) -> list[Share]:
    """Routed experts split over `ep` ranks (a selection's full expert tensors and their rebuilt copies too); the rest
    replicated (DDP) or sharded over `devices` (FSDP2)."""
    experts = c.routed_bytes + c.replicated_bytes
    rest_p, rest_g = c.param_bytes - experts, c.grad_bytes - c.routed_trainable_bytes
    rest_o = c.optimizer_bytes - (ADAM_STATES * c.routed_state_bytes + ADAM_STEP * c.routed_state_tensors)
    routed_o = c.optimizer_bytes - rest_o
    ep_p, ep_g, ep_o = _over(experts, ep), _over(c.routed_trainable_bytes, ep), _over(routed_o, ep)
    rebuilt = c.materialized_bytes - _over(c.materialized_bytes, ep)  # what a rank does not rebuild
    return [
        Share(f"EP {ep} + DDP", rest_p + ep_p, rest_g + ep_g, rest_o + ep_o, autocast - rebuilt + rest_g, activations,
              "experts split over the EP ranks, the rest replicated; buffers: DDP buckets of the rest"),
        Share(f"EP {ep} + FSDP2 × {devices}", _over(rest_p, devices) + ep_p, _over(rest_g, devices) + ep_g,
              _over(rest_o, devices) + ep_o, gathered - rebuilt, activations,
              "experts split over the EP ranks, the rest fully sharded"),
    ]


# ---------------------------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Ffn:
    """One decoder layer's FFN as the estimate sees it: dense (experts == 0) or an MoE layer."""

    intermediate: int  # dense: its intermediate size; MoE: one routed expert's
    gated: bool = True
    experts: int = 0
    top_k: int = 0
    shared: int = 0  # shared expert's intermediate size (0: none)
    trained: bool = True  # dense: its weights train; MoE: the routed experts' first projection (gate|up) trains
    down_trained: bool = True  # MoE: the routed experts' down projection trains
    router_trained: bool = True
    shared_trained: bool = True


@dataclass(frozen=True)
class Lora:
    role: str  # "qkv" (attention inputs), "o" (attention output), "in" (FFN gate/up), "down" (FFN down)
    in_features: int
    r: int


@dataclass(frozen=True)
class Layer:
    ffn: Ffn
    attention_trained: bool = True  # q/k/v/o weights
    norms_trained: bool = True
    active: bool = True  # gradients flow into the layer's input (something before it trains)
    lora: tuple[Lora, ...] = ()


@dataclass(frozen=True)
class Geometry:
    """A decoder-only transformer's shapes (config.json) and, per decoder layer, what trains."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: tuple[Layer, ...]
    head_trained: bool = True  # the final norm / lm_head (tied: the embedding)
    aux_losses: bool = True  # moekit's router losses (method moe) keep softmax and logsumexp of the logits
    lora_dropout: bool = True
    mask_size: int = 1  # bytes per element of a dropout mask: CUDA's fused dropout keeps a bool (CPU: a float)
    notes: tuple[str, ...] = field(default=())


def norm_bytes(h: int, p: int, trained: bool, grad: bool) -> int:
    """RMSNorm (Llama's): when gradients flow through it, its float32 input and 1/rms; when its weight trains,
    x/rms in the parameter dtype."""
    return (4 * h + 4 if grad else 0) + (p * h if trained else 0)


def dense_ffn_bytes(i: int, gated: bool, trained: bool, grad: bool, h: int, a: int, casts: bool) -> int:
    """Dense FFN per token: gate and up outputs and act(gate) (3I; non-gated: act's input, I) once anything in it
    records, and when its weights train the input of gate/up (H, one cast per projection under autocast) and of
    down (I)."""
    if not (grad or trained):
        return 0
    inputs = (2 if casts and gated else 1) * h
    return a * (3 * i if gated else i) + (a * (inputs + i) if trained else 0)


def moe_bytes(f: Ffn, h: int, a: int, p: int, aux: bool, casts: bool, grad: bool) -> int:
    """moekit MoE layer per token: the router's input (H, if the router trains); per routed slot (top-k per token)
    the gathered token (H, if gate|up trains), [gate|up], silu(g), silu(g)·u (4I, once they record), the down
    projection's input (I, if down trains and autograd keeps it apart: weighted for I ≤ H, or not recorded
    before), the unweighted output (H, for I > H), 32 B of ids, order and weights (the k-sum back to the tokens
    keeps only the order: moekit.moe.permute); the experts compute in the parameter dtype (grouped_mm runs outside autocast); the shared expert as a
    dense FFN; the aux losses 4 float32 values per expert."""
    i, k = f.intermediate, f.top_k
    routed = grad or f.router_trained
    recorded = grad or f.trained
    if not (routed or recorded or f.down_trained):
        slot = 0
    else:
        down_in = f.down_trained and (i <= h or not recorded)
        slot = p * ((h if f.trained else 0) + (4 * i if recorded else 0) + (i if down_in else 0)
                    + (h if i > h and routed else 0)) + 32
    shared = dense_ffn_bytes(f.shared, f.gated, f.shared_trained, grad, h, a, casts) if f.shared else 0
    return (a * h if f.router_trained else 0) + k * slot + shared + (16 * f.experts if aux and routed else 0)


def lora_bytes(mods: list[Lora], grad: bool, kept: bool, a: int, g: Geometry) -> int:
    """LoRA-wrapped Linears sharing one input: per module A·x (r); with dropout, its output (in) and, when the input
    carries gradients, its mask; without, the shared input once unless it is kept anyway (`kept`)."""
    if not mods:
        return 0
    rank = sum(m.r for m in mods) * a
    if g.lora_dropout:
        return rank + sum(m.in_features * (a + (g.mask_size if grad else 0)) for m in mods)
    return rank + (0 if kept else max(m.in_features for m in mods) * a)


def layer_bytes(g: Geometry, layer: Layer, a: int, p: int) -> int:
    """One decoder layer per token, in forward order: norm, attention (SDPA keeps q, k, v, its output and a float32
    log-sum-exp per head once anything records; when q/k/v train, their input: one tensor, or one cast per
    projection under autocast), norm, FFN (dense or MoE), with LoRA's share where it wraps a projection."""
    h, q, kv, casts = g.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim, a < p
    role = {r: [m for m in layer.lora if m.role == r] for r in ("qkv", "o", "in", "down")}
    grad, trained = layer.active, layer.attention_trained
    total = norm_bytes(h, p, layer.norms_trained, grad)
    grad = grad or layer.norms_trained
    total += lora_bytes(role["qkv"], grad, trained, a, g) + (a * h * (3 if casts else 1) if trained else 0)
    grad = grad or trained or bool(role["qkv"])
    total += (a * (2 * q + 2 * kv) + 4 * g.heads) if grad else 0
    total += lora_bytes(role["o"], grad, grad, a, g)
    grad = grad or bool(role["o"])
    total += norm_bytes(h, p, layer.norms_trained, grad)
    grad = grad or layer.norms_trained
    f = layer.ffn
    if f.experts:
        return total + moe_bytes(f, h, a, p, g.aux_losses, casts, grad)
    total += lora_bytes(role["in"], grad, f.trained, a, g)
    mid = grad or bool(role["in"])
    total += dense_ffn_bytes(f.intermediate, f.gated, f.trained, mid, h, a, casts)
    return total + lora_bytes(role["down"], mid, f.trained, a, g)


def head_bytes(g: Geometry, a: int, p: int, grad: bool) -> int:
    """Final norm, the lm_head input (if it trains), token ids and labels (int64), the logits (kept with the
    model's output) and cross-entropy's float32 log-softmax."""
    h = g.hidden
    return norm_bytes(h, p, g.head_trained, grad) + (a * h if g.head_trained else 0) + 16 + g.vocab * (a + 4)


def token_bytes(g: Geometry, act_size: int, param_size: int, checkpointing: bool = False) -> int:
    """Activation bytes per token: Σ over decoder layers + the head (the functions above); with gradient
    checkpointing, each layer that records keeps only its input (H in the parameter dtype) and one layer is
    recomputed at a time in the backward. `act_size`: 2 under bf16/fp16 autocast or for bf16 parameters, else 4."""
    per_layer = [layer_bytes(g, layer, act_size, param_size) for layer in g.layers]
    if checkpointing:
        body = sum(g.hidden * param_size for n in per_layer if n) + max(per_layer, default=0)
    else:
        body = sum(per_layer)
    grad = any(per_layer)
    return body + head_bytes(g, act_size, param_size, grad) if grad or g.head_trained else 0
