"""Bytes a training run holds per device: the arithmetic behind `moekit train|finetune --dry-run`
(moekit.train.plan counts the parameters on the meta device and calls this). Pure functions of counts and shapes.

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
* DeepSpeed ZeRO-2: parameters (cast to c bytes) replicated; gradients (c bytes) and optimizer state sharded over N;
  the optimizer state is 12 bytes per trainable parameter (fp32 master copy, exp_avg, exp_avg_sq: "K = 12" of the
  ZeRO paper; DeepSpeed keeps the fp32 partition in fp32 training too). Its reduce and all-gather buckets
  (reduce_bucket_size, allgather_bucket_size) are configuration, not counted.
* DeepSpeed ZeRO-3: as ZeRO-2 with the parameters sharded too, plus the parameters gathered while a layer runs
  (estimated as two decoder layers at c bytes: the running one and the prefetched one).
* FSDP2 full shard (fully_shard per decoder layer, MixedPrecisionPolicy under bf16): parameters, gradients and AdamW
  state sharded over N in the parameters' stored dtype (the sharded parameters are what the optimizer steps; no
  separate master copy), plus two decoder layers gathered in the compute dtype.
* expert parallelism E_p (transformers' ep_size): each MoE layer's routed experts (their parameters, gradients and
  optimizer state) split over E_p ranks; everything else as DDP (replicated), or, in the "EP + FSDP2" row, sharded
  over N as FSDP2. All-to-all dispatch buffers are not counted.

Activations are per device in every row: these engines shard state, not the micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ADAM_STEP = 4  # torch AdamW (foreach and fused) keeps `step` as a float32 scalar tensor per parameter tensor
ADAM_STATES = 2  # exp_avg, exp_avg_sq
ZERO_OPTIMIZER = 12  # bytes per trainable parameter in DeepSpeed ZeRO: fp32 master + exp_avg + exp_avg_sq
GATHERED_LAYERS = 2  # decoder layers unsharded at a time under ZeRO-3 / FSDP2 (the running and the prefetched one)
ACTIVATION_TOLERANCE = 0.15  # the estimate vs the tensors autograd saved on tiny models (tests/test_plan.py)


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
           param_size: int, ep_reason: str = "") -> list[Share]:
    """Per-device bytes under each engine (see the module docstring). `param_size`: bytes per element of the
    stored parameters; `mixed`: bf16/fp16 mixed precision; `expert_parallel` None: no EP rows (`ep_reason` says
    why)."""
    n, cast = devices, 2 if mixed else param_size
    autocast = 2 * c.linear_params if mixed and param_size > 2 else 0  # bf16 copies of fp32 Linear weights
    gathered = GATHERED_LAYERS * c.layer_params * cast
    rows = [
        Share("single device", c.param_bytes, c.grad_bytes, c.optimizer_bytes, autocast, activations),
        Share(f"DDP × {n}", c.param_bytes, c.grad_bytes, c.optimizer_bytes, autocast + c.grad_bytes, activations,
              "buffers: gradient buckets (a second copy of the gradients)"),
        Share(f"ZeRO-2 × {n}", c.params * cast, _over(c.trainable * cast, n),
              _over(c.state * ZERO_OPTIMIZER, n), 0, activations),
        Share(f"ZeRO-3 × {n}", _over((c.params - c.replicated) * cast, n) + c.replicated * cast,
              _over(c.trainable * cast, n),
              _over(c.state * ZERO_OPTIMIZER, n), gathered, activations,
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


def _over(nbytes: int, n: int) -> int:
    return -(-nbytes // n)  # ceil: the first ranks hold the remainder


def expert_rows(c: Counts, activations: int, devices: int, ep: int, autocast: int, gathered: int) -> list[Share]:
    """Routed experts split over `ep` ranks; the rest replicated (DDP) or sharded over `devices` (FSDP2)."""
    rest_p, rest_g = c.param_bytes - c.routed_bytes, c.grad_bytes - c.routed_trainable_bytes
    rest_o = c.optimizer_bytes - (ADAM_STATES * c.routed_state_bytes + ADAM_STEP * c.routed_state_tensors)
    routed_o = c.optimizer_bytes - rest_o
    ep_p, ep_g, ep_o = _over(c.routed_bytes, ep), _over(c.routed_trainable_bytes, ep), _over(routed_o, ep)
    return [
        Share(f"EP {ep} + DDP", rest_p + ep_p, rest_g + ep_g, rest_o + ep_o, autocast + rest_g, activations,
              "experts split over the EP ranks, the rest replicated; buffers: DDP buckets of the rest"),
        Share(f"EP {ep} + FSDP2 × {devices}",
              _over(rest_p - c.replicated_bytes, devices) + c.replicated_bytes + ep_p, _over(rest_g, devices) + ep_g,
              _over(rest_o, devices) + ep_o, gathered, activations,
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
    trained: bool = True  # dense: its weights train; MoE: the routed experts train
    router_trained: bool = True
    shared_trained: bool = True


@dataclass(frozen=True)
class Layer:
    ffn: Ffn
    attention_trained: bool = True
    norms_trained: bool = True
    active: bool = True  # a trainable parameter at or before this layer: autograd records it
    lora: tuple[tuple[int, int], ...] = ()  # (in_features, r) of each LoRA-wrapped Linear


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
    notes: tuple[str, ...] = field(default=())


def norm_bytes(h: int, p: int, trained: bool) -> int:
    """RMSNorm (as Llama's): its float32 input and 1/rms, and, when its weight trains, x/rms in the parameter
    dtype."""
    return 4 * h + 4 + (p * h if trained else 0)


def ffn_bytes(f: Ffn, h: int, a: int, p: int, aux: bool, casts: bool = False) -> int:
    """Per token. Dense FFN: gate and up outputs and act(gate) (3I; non-gated: act's input, I), plus when its
    weights train the input of gate/up (H, one copy per projection under autocast, `casts`) and of down (I).
    moekit MoE layer: the router input (H, if the router trains), per slot the gathered token (H, if the experts
    train), [gate|up] (2I), silu(g) and silu(g)·u (2I), the weighted activation (I, if I ≤ H and the experts train) or
    the unweighted output (H, if I > H), the output scattered back (H); ids, order and weights (32 B per slot); the
    experts compute in the parameter dtype (grouped_mm runs outside autocast); the aux losses keep 4 float32 values
    per expert."""
    i = f.intermediate
    if not f.experts:
        inputs = (2 if casts and f.gated else 1) * h
        return a * (3 * i if f.gated else i) + (a * (inputs + i) if f.trained else 0)
    k = f.top_k
    slot = p * (4 * i + h + (h if i > h else (i if f.trained else 0)) + (h if f.trained else 0)) + 32
    shared = ffn_bytes(Ffn(f.shared, f.gated, trained=f.shared_trained), h, a, p, aux, casts) if f.shared else 0
    return (a * h if f.router_trained else 0) + k * slot + shared + (16 * f.experts if aux else 0)


def layer_bytes(g: Geometry, layer: Layer, a: int, p: int) -> int:
    """One decoder layer per token: two norms, attention (SDPA keeps q, k, v, its output and a float32 log-sum-exp
    per head; when q/k/v train, their input: one tensor, or one cast per projection under autocast), the FFN, and
    per LoRA-wrapped Linear its dropout's output and mask and A·x."""
    if not layer.active:
        return 0
    h, q, kv, casts = g.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim, a < p
    attention = a * (2 * q + 2 * kv) + 4 * g.heads + (a * h * (3 if casts else 1) if layer.attention_trained else 0)
    lora = sum(d * (a + (1 if g.lora_dropout else 0)) + r * a for d, r in layer.lora)
    return (2 * norm_bytes(h, p, layer.norms_trained) + attention
            + ffn_bytes(layer.ffn, h, a, p, g.aux_losses, casts) + lora)


def head_bytes(g: Geometry, a: int, p: int) -> int:
    """Final norm, the lm_head input (if it trains), token ids and labels (int64), the logits (kept with the
    model's output) and cross-entropy's float32 log-softmax."""
    h = g.hidden
    return norm_bytes(h, p, g.head_trained) + (a * h if g.head_trained else 0) + 16 + g.vocab * (a + 4)


def token_bytes(g: Geometry, act_size: int, param_size: int, checkpointing: bool = False) -> int:
    """Activation bytes per token: Σ over decoder layers + the head (see the functions above); with gradient
    checkpointing, each active layer keeps only its input (H in the parameter dtype) and one layer is recomputed at a
    time in the backward. `act_size`: 2 under bf16/fp16 autocast or for bf16 parameters, else 4."""
    per_layer = [layer_bytes(g, layer, act_size, param_size) for layer in g.layers]
    if checkpointing:
        kept = sum(g.hidden * param_size for layer in g.layers if layer.active)
        body = kept + max(per_layer, default=0)
    else:
        body = sum(per_layer)
    return body + head_bytes(g, act_size, param_size) if any(layer.active for layer in g.layers) or g.head_trained \
        else 0
