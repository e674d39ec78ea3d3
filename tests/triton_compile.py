"""Compiles every Triton kernel of moekit.moe.triton_experts, at the configurations `variants` lists, for a
CUDA target with Triton's own compiler (source -> TTIR -> TTGIR -> LLVM IR -> PTX -> cubin by its ptxas), on a
machine without a GPU. Run with TRITON_INTERPRET unset (the interpreter replaces the kernels when moekit is imported).
Prints one JSON line per compile: {"kernel", "dtype", "config", "ok", "error", "shared" (bytes of shared memory a
block needs), "seconds"}; fails where a kernel
of the module is missing from POINTERS. Usage: triton_compile.py ARCH DTYPES, e.g. 90 bf16,fp32."""
import itertools
import json
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moekit.moe import triton_experts as tx

INTS = {"counts": "*i32", "hist": "*i32", "prefix": "*i32", "order": "*i64", "ids": "*i64"}
POINTERS = {
    "swiglu_fwd": "h w a", "swiglu_bwd": "dy h w dh dw", "combine_k": "src idx out",
    "gate_up_kernel": "x W order counts w a h", "down_kernel": "a W order counts y",
    "expert_hist_kernel": "ids hist", "counting_sort_kernel": "ids prefix w order w_sorted counts",
    "decode_gate_up_kernel": "x W ids w a SG SU SGATE", "decode_down_kernel": "a W ids y SD",
    "route_kernel": "x W logits ids weights"}


def flags(*names):
    """Every combination of the boolean constexprs `names`, as dicts."""
    return [dict(zip(names, v)) for v in itertools.product((False, True), repeat=len(names))]


def variants(name, dtype):
    """(constexprs, pointer dtype overrides, launch options) of the configurations checked for `name`: every flag
    combination; the GEMMs at each autotuning config; the router and the counting sort at the blocks moekit picks for
    E = 8, 64 and 256; the element-wise kernels at their widest and a narrow block."""
    if name in ("swiglu_fwd", "swiglu_bwd"):
        return [({**c, "BM": 32, "BN": bn}, {}, {}) for c in flags("HAS_W") for bn in (32, 256)]
    if name == "combine_k":
        return [({**c, "BT": 16, "BH": bh}, {"idx": "*i64"} if c["HAS_IDX"] else {}, {})
                for c in flags("HAS_IDX") for bh in (32, 256)]
    if name in ("gate_up_kernel", "down_kernel"):
        return [({**c, "IEEE": dtype == "fp32", "BM": m, "BN": n, "BK": k, "BE": 64}, {},
                 {"num_warps": w, "num_stages": s})
                for m, n, k, w, s in (tx._CONFIGS if dtype != "fp32" else tx._CONFIGS[:1])
                for c in (flags("SAVE_H") if name == "gate_up_kernel" else [{}])]
    blocks = [(E, tx.SORT_TILE // E) for E in (8, 64, 256)]  # (BE, BS) as sort_by_expert picks them
    if name == "expert_hist_kernel":
        return [({"BS": bs, "BE": be}, {}, {}) for be, bs in blocks]
    if name == "counting_sort_kernel":
        return [({**c, "BS": bs, "BE": be}, {} if c["HAS_W"] else {"w": "*i64", "w_sorted": "*i64"}, {})
                for c in flags("HAS_W") for be, bs in blocks]
    if name == "decode_gate_up_kernel":
        return [({"HAS_SHARED": s, "HAS_GATE": g, "BN": 32, "BK": 128}, {}, {})
                for s, g in ((False, False), (True, False), (True, True))]
    if name == "decode_down_kernel":
        return [({**c, "BN": 32, "BK": 128}, {}, {}) for c in flags("HAS_SHARED")]
    if name == "route_kernel":
        return [({**c, "BE": be, "BK": max(16, min(128, 8192 // be)), "BKK": 8}, {}, {})
                for c in flags("SOFTMAX_FIRST") for be in (8, 64, 256)]
    raise KeyError(name)


def signature(fn, dtype, const, overrides, pointers):
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in pointers:
            sig[p.name] = overrides.get(p.name) or INTS.get(p.name) or f"*{dtype}"
        else:
            sig[p.name] = "i32"
    return sig


def main(arch: int, dtypes: list[str]) -> int:
    target, failed = GPUTarget("cuda", arch, 32), 0
    kernels = {n for n, v in vars(tx).items() if isinstance(v, (triton.runtime.JITFunction, triton.runtime.Autotuner))
               and not n.startswith("_")}
    if kernels != set(POINTERS):  # a kernel added to moekit must be added here
        print(json.dumps({"kernel": "(coverage)", "dtype": "", "config": {}, "ok": False, "shared": 0, "seconds": 0,
                          "error": f"kernels not checked: {sorted(kernels - set(POINTERS))}; "
                                   f"checked but gone: {sorted(set(POINTERS) - kernels)}"}))
        failed += 1
    for dtype, (name, pointers) in itertools.product(dtypes, POINTERS.items()):
        if dtype == "fp32" and name not in ("gate_up_kernel", "down_kernel"):
            continue  # in float32 only the GEMMs differ (IEEE tl.dot); the rest load and store any dtype alike
        kernel = getattr(tx, name)
        fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel  # autotuned: wraps the JIT
        for const, overrides, options in variants(name, dtype):
            start = time.time()
            try:
                src = ASTSource(fn, signature(fn, dtype, const, overrides, pointers.split()), const)
                shared, error = triton.compile(src, target=target, options=options).metadata.shared, None
            except Exception as e:  # noqa: BLE001  (reported, one line per configuration)
                shared, error = None, f"{type(e).__name__}: {e}"[:3000]
                failed += 1
            print(json.dumps({"kernel": name, "dtype": dtype, "config": {**const, **options}, "ok": error is None,
                              "error": error, "shared": shared, "seconds": round(time.time() - start, 2)}),
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2].split(",")))
