"""moekit's Triton kernels through Triton's real compiler for a CUDA target, on a machine without a GPU.

The interpreter (tests/test_triton_experts.py) runs the kernels' Python, not the compiler: a kernel it runs can
still fail to compile (a construct the frontend rejects, a type that does not unify across branches, a block that
does not fit). tests/triton_compile.py compiles every kernel for sm_90 in bf16 (and the GEMMs' fp32 IEEE path) to
cubin by the ptxas Triton ships: every constexpr flag combination, the GEMMs at each autotuning config, the router
and the counting sort at the blocks moekit picks for 8, 64 and 256 experts. Run in a subprocess: the interpreter,
set for the other tests, replaces the kernels at import."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
HERE = Path(__file__).resolve().parent
SM90_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90
KERNELS = ("swiglu_fwd", "swiglu_bwd", "combine_k", "gate_up_kernel", "down_kernel", "expert_hist_kernel",
           "counting_sort_kernel", "decode_gate_up_kernel", "decode_down_kernel", "route_kernel")


def _nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="needs Triton's NVIDIA backend (ptxas)")


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, str(HERE / "triton_compile.py"), "90", "bf16,fp32"], env=env,
                          capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    failed = [f"{r['kernel']} {r['dtype']} {r['config']}: {r['error']}" for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not failed, "\n".join(failed) or proc.stderr[-3000:]

    assert {r["kernel"] for r in rows} == set(KERNELS), rows  # and the script checked that it covers the module
    assert max(r["shared"] for r in rows) <= SM90_SHARED  # every block fits an H100/H200 SM's shared memory
