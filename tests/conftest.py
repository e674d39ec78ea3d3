"""Shared pytest setup."""
import os

import torch

# Under pytest-xdist every worker would otherwise start one OpenMP thread per core: with n workers on
# n cores the threads oversubscribe the CPU and OpenMP's spin-waiting makes tiny ops ~100x slower.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
