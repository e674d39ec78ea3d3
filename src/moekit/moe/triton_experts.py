"""moekit's Triton kernels for gated-SiLU experts (the GPU path of `Experts`; optional: needs `triton`).

Five levels, all deterministic (no atomics) and free of host syncs:

- `decode_experts`: for few tokens without autograd (T·k ≤ E), two matrix-vector kernels that read only the chosen
  experts' rows: no sort, no padding, no routing metadata (the decode path of issue 38); a gated-SiLU shared expert
  (SPRI's, Qwen2-MoE's with its sigmoid gate) is added in the same two launches.
- `route_tokens`: the router at the same sizes in one kernel (logits, top-k, weights), so that a MoE layer's decode
  step is three kernel launches in all.

- `sort_by_expert`: the routing metadata (slots in expert order, per-expert counts, the routing weights in that
  order) by a counting sort; one kernel launch for a few tokens, so a no-grad forward of a few tokens beyond E
  slots is four launches (sort, gate_up, down, k-sum) and no other device op (tests/test_triton_experts.py counts
  them). No shape or allocation depends on the routing: the layer can be captured in a CUDA graph
  (tests/test_gpu.py).

- `swiglu` / `combine`: the element-wise parts around transformers-style `grouped_mm` GEMMs. `swiglu` is
  silu(g) ⊙ u ⊙ w in one pass over h = [g | u] (S, 2I), its backward recomputes the activation from the
  saved pre-activation h (one read of h and dy, one write of dh; dw reduced per row in float32).
  `combine` sums each token's k rows in float32 in one pass (src (S, H), an optional row index) -> (T, H).
- `TritonExperts`: the forward as two grouped GEMM kernels in the layout of vLLM's fused_moe / ScatterMoE:
  (1) the token gather fused into the gate_up GEMM, SwiGLU and the routing weight in its epilogue; (2) the
  down projection writing each row back to its (token, slot) position, so the k-sum is a plain `combine`.
  A program's expert and rows come from the per-expert counts inside the kernel (a prefix sum over E), so
  the grid is an upper bound (⌈S/BM⌉ + E blocks) and blocks past the last expert return at once: no
  padding, no host read-back, and only hit experts' weights are read (the decode case). Its backward runs
  torch's `grouped_mm` (CUTLASS) for the four GEMMs and the `swiglu` backward kernel.

Under `TRITON_INTERPRET=1` the kernels run on CPU tensors (tests/test_triton_experts.py). Triton's
interpreter computes bf16 `tl.dot` wrongly, so CI checks the GEMM kernels in fp32/fp16 and the GPU tests
(tests/test_gpu.py) in bf16.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.compiler import errors as _compile_errors
    from triton.runtime import errors as _runtime_errors

    # a kernel that does not compile or does not fit the device at some configuration
    KERNEL_ERRORS = tuple(getattr(m, n) for m, n in ((_compile_errors, "CompilationError"),
                                                     (_runtime_errors, "OutOfResources"),
                                                     (_runtime_errors, "PTXASError")) if hasattr(m, n))
except ImportError:  # the CPU wheel of torch comes without triton: moekit's other paths run
    triton = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device`: CUDA with triton installed, or any CPU tensor under the
    interpreter."""
    return triton is not None and (device.type == "cuda" or interpreting())


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# (BM, BN, BK, warps, stages); the interpreter gets one small config (each program instance costs ~17 ms there)
_CONFIGS = [(16, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
            (128, 128, 64, 8, 3), (128, 128, 32, 4, 4)]


def _tuned(kernel):
    if interpreting():
        configs = [triton.Config({"BM": 16, "BN": 16, "BK": 16})]
    else:
        configs = [triton.Config({"BM": m, "BN": n, "BK": k}, num_warps=w, num_stages=s)
                   for m, n, k, w, s in _CONFIGS]
    return triton.autotune(configs, key=["S_KEY", "N" if "N" in kernel.arg_names else "I", "K"])(kernel)


if triton is not None:  # module level: a jitted kernel calls another through the module's globals, and
    # TRITON_INTERPRET is read when a kernel is decorated (tests set it before importing moekit)

    @triton.jit
    def swiglu_fwd(h, w, a, S, I, s_h, s_a, HAS_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)  # (BM,)
        rmask = rows < S
        wv = tl.load(w + rows, mask=rmask, other=0.0).to(tl.float32) if HAS_W else 1.0
        for n0 in range(0, I, BN):
            cols = n0 + tl.arange(0, BN)
            m = rmask[:, None] & (cols < I)[None, :]
            g = tl.load(h + rows[:, None] * s_h + cols[None, :], mask=m, other=0.0).to(tl.float32)
            u = tl.load(h + rows[:, None] * s_h + I + cols[None, :], mask=m, other=0.0).to(tl.float32)
            out = g * tl.sigmoid(g) * u
            if HAS_W:
                out = out * wv[:, None]
            tl.store(a + rows[:, None] * s_a + cols[None, :], out.to(a.dtype.element_ty), mask=m)

    @triton.jit
    def swiglu_bwd(dy, h, w, dh, dw, S, I, s_dy, s_h, HAS_W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < S
        wv = tl.load(w + rows, mask=rmask, other=0.0).to(tl.float32) if HAS_W else 1.0
        acc = tl.zeros((BM,), dtype=tl.float32)  # dw per row
        for n0 in range(0, I, BN):
            cols = n0 + tl.arange(0, BN)
            m = rmask[:, None] & (cols < I)[None, :]
            d = tl.load(dy + rows[:, None] * s_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
            g = tl.load(h + rows[:, None] * s_h + cols[None, :], mask=m, other=0.0).to(tl.float32)
            u = tl.load(h + rows[:, None] * s_h + I + cols[None, :], mask=m, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            act = g * sig  # silu(g)
            acc += tl.sum(d * act * u, axis=1)
            dw_ = d * wv[:, None] if HAS_W else d
            tl.store(dh + rows[:, None] * s_h + cols[None, :],
                     (dw_ * u * sig * (1.0 + g * (1.0 - sig))).to(dh.dtype.element_ty), mask=m)
            tl.store(dh + rows[:, None] * s_h + I + cols[None, :], (dw_ * act).to(dh.dtype.element_ty), mask=m)
        if HAS_W:
            tl.store(dw + rows, acc.to(dw.dtype.element_ty), mask=rmask)

    @triton.jit
    def combine_k(src, idx, out, T, H, k, s_src, s_out, HAS_IDX: tl.constexpr, BT: tl.constexpr,
                  BH: tl.constexpr):
        toks = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        tmask = toks < T
        m = tmask[:, None] & (cols < H)[None, :]
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for j in range(0, k):
            slot = toks * k + j
            row = tl.load(idx + slot, mask=tmask, other=0) if HAS_IDX else slot
            acc += tl.load(src + row[:, None] * s_src + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(out + toks[:, None] * s_out + cols[None, :], acc.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def _block(counts, E, BM: tl.constexpr, BE: tl.constexpr):
        """This program's expert, the sorted position of its expert's first row, its rows (BM,) within the
        expert and their mask: block pid of the experts' ⌈count/BM⌉ blocks laid end to end."""
        pid = tl.program_id(0)
        eidx = tl.arange(0, BE)
        cnt = tl.load(counts + eidx, mask=eidx < E, other=0)  # (BE,)
        nb = (cnt + BM - 1) // BM
        cum = tl.cumsum(nb, 0)
        e = tl.sum((cum <= pid).to(tl.int32))
        start = tl.sum(tl.where(eidx < e, cnt, 0))
        n_e = tl.sum(tl.where(eidx == e, cnt, 0))
        rows = (pid - tl.sum(tl.where(eidx < e, nb, 0))) * BM + tl.arange(0, BM)
        return e, start, rows, rows < n_e

    @triton.jit
    def gate_up_kernel(x, W, order, counts, w, a, h, E, I, K, k, s_x, s_we, s_wn, s_a, s_h,
                SAVE_H: tl.constexpr, IEEE: tl.constexpr, S_KEY, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, BE: tl.constexpr):
        """a[pos] = silu(x[tok] W_e,gᵀ) ⊙ (x[tok] W_e,uᵀ) · w[pos] for the rows of one expert; h[pos] = [g | u]."""
        e, start, rows, rmask = _block(counts, E, BM, BE)
        if e >= E:
            return
        pos = start + rows
        tok = tl.load(order + pos, mask=rmask, other=0) // k  # the gather, fused
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < I
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        wbase = W + e.to(tl.int64) * s_we
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            xa = tl.load(x + tok[:, None].to(tl.int64) * s_x + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0)
            bm = kmask[:, None] & cmask[None, :]
            wg = tl.load(wbase + cols[None, :] * s_wn + ks[:, None], mask=bm, other=0.0)  # (BK, BN)
            wu = tl.load(wbase + (I + cols)[None, :] * s_wn + ks[:, None], mask=bm, other=0.0)
            acc_g = tl.dot(xa, wg, acc_g, input_precision="ieee" if IEEE else None)  # float32: no tf32
            acc_u = tl.dot(xa, wu, acc_u, input_precision="ieee" if IEEE else None)
        m = rmask[:, None] & cmask[None, :]
        wv = tl.load(w + pos, mask=rmask, other=0.0).to(tl.float32)
        out = acc_g * tl.sigmoid(acc_g) * acc_u * wv[:, None]
        tl.store(a + pos[:, None].to(tl.int64) * s_a + cols[None, :], out.to(a.dtype.element_ty), mask=m)
        if SAVE_H:
            hp = h + pos[:, None].to(tl.int64) * s_h + cols[None, :]
            tl.store(hp, acc_g.to(h.dtype.element_ty), mask=m)
            tl.store(hp + I, acc_u.to(h.dtype.element_ty), mask=m)

    @triton.jit
    def down_kernel(a, W, order, counts, y, E, N, K, s_a, s_we, s_wn, s_y, IEEE: tl.constexpr, S_KEY,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr):
        """y[slot] = a[pos] W_eᵀ, written at each row's (token, slot) position."""
        e, start, rows, rmask = _block(counts, E, BM, BE)
        if e >= E:
            return
        pos = start + rows
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        wbase = W + e.to(tl.int64) * s_we
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            aa = tl.load(a + pos[:, None].to(tl.int64) * s_a + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0)
            wd = tl.load(wbase + cols[None, :] * s_wn + ks[:, None], mask=kmask[:, None] & cmask[None, :],
                         other=0.0)
            acc = tl.dot(aa, wd, acc, input_precision="ieee" if IEEE else None)
        slot = tl.load(order + pos, mask=rmask, other=0).to(tl.int64)
        tl.store(y + slot[:, None] * s_y + cols[None, :], acc.to(y.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    gate_up_kernel, down_kernel = _tuned(gate_up_kernel), _tuned(down_kernel)

    @triton.jit
    def _one_hot(ids, S, E, BS: tl.constexpr, BE: tl.constexpr):
        """This program's slots (BS,), their mask and one-hot experts (BS, BE) int32 (an id outside [0, E) has
        none: it is neither counted nor placed)."""
        slots = tl.program_id(0) * BS + tl.arange(0, BS)
        smask = slots < S
        e = tl.load(ids + slots, mask=smask, other=-1)
        eidx = tl.arange(0, BE)
        return slots, smask, ((e[:, None] == eidx[None, :]) & (eidx < E)[None, :]).to(tl.int32)

    @triton.jit
    def expert_hist_kernel(ids, hist, S, E, BS: tl.constexpr, BE: tl.constexpr):
        """hist[b, e] = how many of block b's slots chose expert e."""
        eidx = tl.arange(0, BE)
        _, _, hot = _one_hot(ids, S, E, BS, BE)
        tl.store(hist + tl.program_id(0) * E + eidx, tl.sum(hot, 0), mask=eidx < E)

    @triton.jit
    def counting_sort_kernel(ids, prefix, w, order, w_sorted, counts, S, E, NB, HAS_W: tl.constexpr,
                             BS: tl.constexpr, BE: tl.constexpr):
        """order[pos] = slot, stable by expert: pos = (rows of lower experts) + (this expert's rows in earlier
        blocks) + (its rows before the slot in this block); prefix (NB, E) the blocks' inclusive running
        histogram (unused when NB == 1). Also w_sorted[pos] = w[slot] and, in block 0, counts."""
        b = tl.program_id(0)
        eidx = tl.arange(0, BE)
        emask = eidx < E
        slots, smask, hot = _one_hot(ids, S, E, BS, BE)
        mine = tl.sum(hot, 0)  # (BE,)
        if NB == 1:
            total, before = mine, mine * 0
        else:
            total = tl.load(prefix + (NB - 1) * E + eidx, mask=emask, other=0)  # (BE,)
            before = tl.load(prefix + b * E + eidx, mask=emask, other=0) - mine
        start = tl.cumsum(total, 0) - total + before  # (BE,) where this block's rows of each expert begin
        rank = tl.cumsum(hot, 0) - hot  # (BS, BE) rows of the same expert before each slot in this block
        pos = tl.sum(hot * (start[None, :] + rank), 1)  # (BS,)
        placed = smask & (tl.sum(hot, 1) > 0)
        tl.store(order + pos, slots.to(tl.int64), mask=placed)
        if HAS_W:
            tl.store(w_sorted + pos, tl.load(w + slots, mask=placed).to(w_sorted.dtype.element_ty), mask=placed)
        if b == 0:
            tl.store(counts + eidx, total, mask=emask)


    @triton.jit
    def _gate_up_rows(xrow, gbase, ubase, s_n, n, K, cols, BN: tl.constexpr, BK: tl.constexpr):
        """silu(x W_gᵀ) ⊙ (x W_uᵀ) for the BN columns `cols` (< n) in float32: x one row, W_g's rows at gbase and
        W_u's at ubase (row stride s_n). Matrix-vector products reading only those rows."""
        cmask = cols < n
        acc_g = tl.zeros((BN,), dtype=tl.float32)
        acc_u = tl.zeros((BN,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            xv = tl.load(xrow + ks, mask=kmask, other=0.0).to(tl.float32)  # (BK,)
            m = cmask[:, None] & kmask[None, :]
            wg = tl.load(gbase + cols[:, None] * s_n + ks[None, :], mask=m, other=0.0).to(tl.float32)  # (BN, BK)
            wu = tl.load(ubase + cols[:, None] * s_n + ks[None, :], mask=m, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * xv[None, :], axis=1)
            acc_u += tl.sum(wu * xv[None, :], axis=1)
        return acc_g * tl.sigmoid(acc_g) * acc_u

    @triton.jit
    def decode_gate_up_kernel(x, W, ids, w, a, I, K, k, s_x, s_we, s_wn, s_a, S, SG, SU, SGATE, IS, s_sn,
                              HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """a[s] = silu(x[t] W_e,gᵀ) ⊙ (x[t] W_e,uᵀ) · w[s] for one slot s = t·k + j (e = ids[s]) and BN columns,
        reading only expert e's rows. With HAS_SHARED, slots S + t are token t's shared expert (gate SG, up SU,
        IS columns), times sigmoid(x[t] · SGATE) with HAS_GATE."""
        s = tl.program_id(0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        if HAS_SHARED:
            if s >= S:
                t = s - S
                out = _gate_up_rows(x + t * s_x, SG, SU, s_sn, IS, K, cols, BN, BK)
                if HAS_GATE:
                    acc = tl.zeros((BK,), dtype=tl.float32)
                    for k0 in range(0, K, BK):
                        ks = k0 + tl.arange(0, BK)
                        acc += (tl.load(x + t * s_x + ks, mask=ks < K, other=0.0).to(tl.float32)
                                * tl.load(SGATE + ks, mask=ks < K, other=0.0).to(tl.float32))
                    out = out * tl.sigmoid(tl.sum(acc, 0))
                tl.store(a + s * s_a + cols, out.to(a.dtype.element_ty), mask=cols < IS)
                return
        wbase = W + tl.load(ids + s).to(tl.int64) * s_we
        out = _gate_up_rows(x + (s // k) * s_x, wbase, wbase + I * s_wn, s_wn, I, K, cols, BN, BK)
        tl.store(a + s * s_a + cols, (out * tl.load(w + s).to(tl.float32)).to(a.dtype.element_ty), mask=cols < I)

    @triton.jit
    def _down_row(acc, arow, wbase, s_n, cols, N, K, BK: tl.constexpr):
        """acc + a Wᵀ for BN columns `cols` (< N): a one row of K, W's rows at wbase (row stride s_n); float32."""
        cmask = cols < N
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            av = tl.load(arow + ks, mask=kmask, other=0.0).to(tl.float32)  # (BK,)
            wd = tl.load(wbase + cols[:, None] * s_n + ks[None, :], mask=cmask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)  # (BN, BK)
            acc += tl.sum(wd * av[None, :], axis=1)
        return acc

    @triton.jit
    def decode_down_kernel(a, W, ids, y, N, K, k, s_a, s_we, s_wn, s_y, S, SD, IS, s_sn,
                           HAS_SHARED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """y[t] = Σ_j a[t·k + j] W_eᵀ (e = ids[t·k + j]) for BN columns, the k slots (and with HAS_SHARED the
        shared expert's a[S + t] SDᵀ) summed in float32."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in range(0, k):
            s = t * k + j
            acc = _down_row(acc, a + s * s_a, W + tl.load(ids + s).to(tl.int64) * s_we, s_wn, cols, N, K, BK)
        if HAS_SHARED:
            acc = _down_row(acc, a + (S + t) * s_a, SD, s_sn, cols, N, IS, BK)
        tl.store(y + t * s_y + cols, acc.to(y.dtype.element_ty), mask=cols < N)

    @triton.jit
    def route_kernel(x, W, logits, ids, weights, E, K, k, s_x, s_w, s_l, SOFTMAX_FIRST: tl.constexpr,
                     BE: tl.constexpr, BK: tl.constexpr, BKK: tl.constexpr):
        """One token t: logits[t] = x[t] Wᵀ (float32 sums, stored in the logits' dtype), then the top k of them
        (ties to the lower id; NaN above everything, as torch.topk) and their weights, as `moekit.moe.router.route`
        computes them from the stored logits: SOFTMAX_FIRST the top-k of softmax(logits), else the softmax over the
        k chosen logits."""
        t = tl.program_id(0)
        eidx = tl.arange(0, BE)
        emask = eidx < E
        acc = tl.zeros((BE,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            xv = tl.load(x + t * s_x + ks, mask=kmask, other=0.0).to(tl.float32)  # (BK,)
            wv = tl.load(W + eidx[:, None] * s_w + ks[None, :], mask=emask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)  # (BE, BK)
            acc += tl.sum(wv * xv[None, :], axis=1)
        stored = acc.to(logits.dtype.element_ty)
        tl.store(logits + t * s_l + eidx, stored, mask=emask)
        score = tl.where(emask, stored.to(tl.float32), float("-inf"))  # (BE,)
        if SOFTMAX_FIRST:
            p = tl.exp(score - tl.max(score, 0))
            score = p / tl.sum(p, 0)
        key = tl.where(score != score, float("inf"), score)  # NaN first, as torch.topk
        free = emask
        slot = tl.arange(0, BKK)
        top = tl.zeros((BKK,), dtype=tl.float32)
        for j in range(0, k):
            best = tl.max(tl.where(free, key, float("-inf")), 0)
            e = tl.min(tl.where(free & (key == best), eidx, BE), 0)  # < E: `free` holds k - j ≥ 1 experts
            tl.store(ids + t * k + j, e.to(tl.int64))
            top = tl.where(slot == j, tl.sum(tl.where(eidx == e, score, 0.0), 0), top)
            free = free & (eidx != e)
        if not SOFTMAX_FIRST:  # the softmax over the k chosen logits; top[0] is their maximum
            first = tl.sum(tl.where(slot == 0, top, 0.0), 0)
            top = tl.where(slot < k, tl.exp(top - first), 0.0)
            top = top / tl.sum(top, 0)
        tl.store(weights + t * k + slot, top.to(weights.dtype.element_ty), mask=slot < k)


# one-hot elements (slots x experts) of one counting-sort block: 64 experts sort 64 slots per block, 8 experts 512
SORT_TILE = 4096
_SORT_FAILED: set[tuple] = set()  # (device, BS, BE) where the counting sort did not compile or fit


def sort_by_expert(ids: Tensor, num_experts: int, weights: Tensor | None = None,
                   dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """topk ids (T, k) -> order (S,) int64 the slots sorted by expert (stable: what permute.sort_by_expert's
    argsort gives), counts (E,) int32 and, with `weights` (T, k), weights[order] (S, 1) in `dtype`; or None
    where the kernels do not compile or fit the device at this block configuration (the caller sorts otherwise;
    tried once per device and configuration).

    A counting sort (histogram, prefix sum, scatter) instead of a radix sort: one kernel when the S = T·k slots
    fit one block (decode sizes: T·k ≤ SORT_TILE / E), else a per-block histogram, its running sum over
    blocks (torch.cumsum) and the scatter. No host sync, no atomics. Ids outside [0, E) are neither counted
    nor placed (their entries of `order` are left unset)."""
    flat = ids.reshape(-1)  # (S,)
    S, E = flat.numel(), num_experts
    BE = _pow2(E)
    BS = max(16, min(_pow2(S), SORT_TILE // BE))
    NB = triton.cdiv(S, BS)
    config = (flat.device, BS, BE)
    if config in _SORT_FAILED:
        return None
    order = torch.empty(S, dtype=torch.int64, device=flat.device)
    counts = torch.empty(E, dtype=torch.int32, device=flat.device)
    w_sorted = None if weights is None else weights.new_empty(S, 1, dtype=dtype or weights.dtype)
    if S == 0:
        return order, counts.zero_(), w_sorted
    prefix = counts
    try:
        if NB > 1:
            hist = torch.empty(NB, E, dtype=torch.int32, device=flat.device)
            expert_hist_kernel[(NB,)](flat, hist, S, E, BS=BS, BE=BE)
            prefix = torch.cumsum(hist, 0, dtype=torch.int32)  # (NB, E)
        w = flat if weights is None else weights.reshape(-1)
        counting_sort_kernel[(NB,)](flat, prefix, w, order, order if w_sorted is None else w_sorted, counts, S, E,
                                    NB, HAS_W=weights is not None, BS=BS, BE=BE)
    except KERNEL_ERRORS:
        _SORT_FAILED.add(config)
        return None
    return order, counts, w_sorted


def decodes(slots: int, num_experts: int) -> bool:
    """Whether `decode_experts` serves T·k = `slots` slots: when they are at most E, so each hit expert's weights are
    read about once (≤ 1.6 times on average for uniform routing) and no sort pays off. Not yet timed on a GPU."""
    return 0 < slots <= num_experts


def decode_experts(x: Tensor, ids: Tensor, w: Tensor, first: Tensor, down: Tensor,
                   shared: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None) -> Tensor:
    """Gated-SiLU experts for few tokens without autograd, with no sort, no padding and no routing metadata: one
    matrix-vector kernel per projection reading only the chosen experts' rows (each slot its expert's gate_up,
    each token its k experts' down, summed in float32). Two kernel launches in all. x (T, H), ids (T, k) expert
    ids, w (T, k) routing weights, first (E, 2I, H), down (E, H, I) -> (T, H).

    `shared`: a gated-SiLU shared expert added to every token in the same two launches, as (gate (IS, H), up (IS, H),
    down (H, IS), gate row (H,) or None): with a gate row its output is scaled by sigmoid(gate row · x) (SPRI's
    shared expert has none; Qwen2-MoE's shared_expert_gate is one)."""
    (T, k), (E, H, I) = ids.shape, down.shape
    S, IS = T * k, 0 if shared is None else shared[0].shape[0]
    x, flat, wf = x.contiguous(), ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()
    sg, su, sd, gate = (t if t is None else t.contiguous() for t in shared) if shared else (first, first, down, None)
    a, y = x.new_empty(S + (T if shared else 0), max(I, IS)), x.new_empty(T, H)
    bn, bk = (16, 16) if interpreting() else (32, 128)
    decode_gate_up_kernel[(a.shape[0], triton.cdiv(a.shape[1], bn))](
        x, first, flat, wf, a, I, H, k, x.stride(0), first.stride(0), first.stride(1), a.stride(0), S, sg, su,
        x if gate is None else gate, IS, sg.stride(0), HAS_SHARED=shared is not None, HAS_GATE=gate is not None,
        BN=bn, BK=bk)
    decode_down_kernel[(T, triton.cdiv(H, bn))](a, down, flat, y, H, I, k, a.stride(0), down.stride(0),
                                                 down.stride(1), y.stride(0), S, sd, IS, sd.stride(0),
                                                 HAS_SHARED=shared is not None, BN=bn, BK=bk)
    return y


# the largest router (E·H elements) whose decode runs `route_tokens`: one program per token reads the whole weight
# (512 KB in bf16 at this bound, e.g. 128 experts × 2048), where cuBLAS spreads a larger one over the GPU. A guess
# until a GPU times it.
ROUTER_FUSED_MAX = 1 << 18


def routes(slots: int, num_experts: int, hidden: int) -> bool:
    """Whether a router's forward of T·k = `slots` slots runs `route_tokens`: where the decode kernels serve the
    experts (`decodes`) and the router weight is at most ROUTER_FUSED_MAX elements."""
    return decodes(slots, num_experts) and num_experts * hidden <= ROUTER_FUSED_MAX


def route_tokens(x: Tensor, weight: Tensor, top_k: int, softmax_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A linear router's forward in one kernel launch, for few tokens without autograd (the decode path): x (T, H),
    weight (E, H) -> logits (T, E) in x's dtype, weights (T, k) in x's dtype, ids (T, k) int64: what
    `Router.forward` computes (router.route on the logits), with ties among equal logits going to the lower id."""
    (T, H), E = x.shape, weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()
    logits, weights = x.new_empty(T, E), x.new_empty(T, top_k)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    BE = _pow2(E)
    bk = 16 if interpreting() else max(16, min(128, 8192 // BE))
    route_kernel[(T,)](x, weight, logits, ids, weights, E, H, top_k, x.stride(0), weight.stride(0),
                       logits.stride(0), SOFTMAX_FIRST=softmax_first, BE=BE, BK=bk, BKK=_pow2(top_k))
    return logits, weights, ids


def _rows_grid(S: int, E: int, n: int):
    return lambda meta: (triton.cdiv(S, meta["BM"]) + E, triton.cdiv(n, meta["BN"]))


class SwiGLU(torch.autograd.Function):
    """a = silu(g) ⊙ u [⊙ w] for h = [g | u] (S, 2I), w (S, 1) or None; saves h (and w) only."""

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor | None) -> Tensor:
        S, I = h.shape[0], h.shape[1] // 2
        h = h.contiguous()
        a = h.new_empty(S, I)
        if S:
            bm, bn = (16, 16) if interpreting() else (32, min(256, _pow2(I)))
            swiglu_fwd[(triton.cdiv(S, bm),)](h, h if w is None else w, a, S, I, h.stride(0), a.stride(0),
                                              HAS_W=w is not None, BM=bm, BN=bn)
        ctx.save_for_backward(h, w)
        return a

    @staticmethod
    def backward(ctx, dy: Tensor):
        h, w = ctx.saved_tensors
        dh, dw = swiglu_backward(dy, h, w)
        return dh, dw


def swiglu_backward(dy: Tensor, h: Tensor, w: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """dh (S, 2I) and dw (S, 1) (None without w) of a = silu(g) ⊙ u ⊙ w, the activation recomputed from h."""
    S, I = h.shape[0], h.shape[1] // 2
    dy = dy.contiguous()
    dh = torch.empty_like(h)
    dw = None if w is None else torch.empty_like(w)
    if S:
        bm, bn = (16, 16) if interpreting() else (32, min(256, _pow2(I)))
        swiglu_bwd[(triton.cdiv(S, bm),)](dy, h, h if w is None else w, dh, dh if dw is None else dw, S, I,
                                             dy.stride(0), h.stride(0), HAS_W=w is not None, BM=bm, BN=bn)
    return dh, dw


def combine(src: Tensor, k: int, idx: Tensor | None = None) -> Tensor:
    """out[t] = Σ_j src[idx[t·k + j]] (idx None: row t·k + j), summed in float32; src (S, H) -> (T, H)."""
    S, H = src.shape
    T = S // k
    src = src.contiguous()
    out = src.new_empty(T, H)
    if T:
        bt, bh = (16, 16) if interpreting() else (16, min(256, _pow2(H)))
        combine_k[(triton.cdiv(T, bt), triton.cdiv(H, bh))](
            src, src if idx is None else idx, out, T, H, k, src.stride(0), out.stride(0), HAS_IDX=idx is not None,
            BT=bt, BH=bh)
    return out


def inverse(order: Tensor) -> Tensor:
    """inv (S,) with inv[order[i]] = i: where each slot's row sits in expert order."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class TritonExperts(torch.autograd.Function):
    """Gated-SiLU experts without biases, forward in two fused Triton kernels (module docstring).

    x (T, H), w (S, 1) routing weights in expert order, first (E, 2I, H), down (E, H, I), order (S,) slots by
    expert, counts (E,), k -> (T, H). Saves x, h = [g | u] (S, 2I) and the weighted activation a (S, I),
    what the backward's grouped GEMMs read; x's rows are gathered again there rather than kept (S, H).
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, first: Tensor, down: Tensor, order: Tensor, counts: Tensor,
                k: int) -> Tensor:
        S, (E, H, I) = order.numel(), down.shape
        x, counts32 = x.contiguous(), counts.to(torch.int32)
        save_h = any(ctx.needs_input_grad[:4])
        a = x.new_empty(S, I)
        h = x.new_empty(S, 2 * I) if save_h else a
        y = x.new_empty(S, H)  # (S, H) in slot order
        meta = dict(IEEE=x.dtype == torch.float32, S_KEY=_pow2(S), BE=_pow2(E))
        if S:
            gate_up_kernel[_rows_grid(S, E, I)](x, first, order, counts32, w, a, h, E, I, H, k, x.stride(0),
                                                first.stride(0), first.stride(1), a.stride(0), h.stride(0),
                                                SAVE_H=save_h, **meta)
            down_kernel[_rows_grid(S, E, H)](a, down, order, counts32, y, E, H, I, a.stride(0), down.stride(0),
                                               down.stride(1), y.stride(0), **meta)
        if save_h:
            ctx.save_for_backward(x, w, first, down, order, counts, h, a)
            ctx.k = k
        return combine(y, k)

    @staticmethod
    def backward(ctx, dout: Tensor):
        x, w, first, down, order, counts, h, a = ctx.saved_tensors
        need_x, need_w, need_first, need_down = ctx.needs_input_grad[:4]
        offs = torch.cumsum(counts, 0).to(torch.int32)  # (E,)
        token = order // ctx.k  # (S,)
        dy = dout.contiguous().index_select(0, token)  # (S, H) upstream gradient of each row
        da = F.grouped_mm(dy, down, offs=offs)  # (S, I): dy @ down_e
        dh, dw = swiglu_backward(da, h, w)  # (S, 2I), (S, 1)
        ddown = F.grouped_mm(dy.t(), a, offs=offs) if need_down else None  # (E, H, I)
        dfirst = F.grouped_mm(dh.t(), x.index_select(0, token), offs=offs) if need_first else None  # (E, 2I, H)
        dx = combine(F.grouped_mm(dh, first, offs=offs), ctx.k, inverse(order)) if need_x else None  # (T, H)
        return dx, dw if need_w else None, dfirst, ddown, None, None, None


def triton_experts(x: Tensor, w: Tensor, first: Tensor, down: Tensor, order: Tensor, counts: Tensor,
                   k: int) -> Tensor:
    return TritonExperts.apply(x, w, first, down, order, counts, k)

