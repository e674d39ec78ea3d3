"""Where a whole moekit model waits for the GPU: host syncs under torch's sync debug mode in a prefill and a
train step (moekit model vs transformers' native Mixtral on the same weights), and whether torch's sorts block
the host (the CPU time to launch each right behind a long matrix product). Prints its findings; GPU only.

    python bench/gpu_sync_probe.py
"""
from __future__ import annotations

import time
import traceback
import warnings

import torch

from model_throughput import moekit_model, native_model


def host_wait(fn, a) -> float:
    """Milliseconds the host spends in fn() launched behind ~20 ms of queued GPU work: ≈ 0 if fn is async."""
    torch.cuda.synchronize()
    for _ in range(10):
        a @ a
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1000 * dt


def main():
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    flat = torch.randint(0, 8, (32768,), device=dev)
    for name, fn in [("argsort stable", lambda: torch.argsort(flat, stable=True)),
                     ("sort", lambda: torch.sort(flat)), ("histc", lambda: torch.histc(flat.int(), 8, 0, 7)),
                     ("cumsum", lambda: torch.cumsum(flat, 0)), ("bincount", lambda: torch.bincount(flat))]:
        fn()
        print(f"host wait {name}: {host_wait(fn, a):.2f} ms", flush=True)
    model = moekit_model(4, None, None).to(dev, torch.bfloat16)
    native = native_model(model, "mixtral")
    native.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, 1000, (4, 256), device=dev)
    for name, m in (("moekit", model), ("mixtral grouped_mm", native)):
        with torch.no_grad():
            m(ids)
            print(f"{name} prefill: host wait {host_wait(lambda: m(ids), a):.2f} ms", flush=True)
            old = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                stack = [f for f in traceback.extract_stack() if "moekit" in f.filename or "transformers" in f.filename]
                print(f"  sync: {str(message)[:60]} at {stack[-1].filename}:{stack[-1].lineno}" if stack else
                      f"  sync: {message}", flush=True)

            warnings.showwarning = show
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                m(ids)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning = old


if __name__ == "__main__":
    main()
