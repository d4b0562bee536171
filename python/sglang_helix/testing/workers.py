"""Multi-process gloo tests: start ``world`` forkserver children, wait, never leave one behind."""

from __future__ import annotations

import os
import tempfile
import time

import torch.multiprocessing as mp


def run_workers(worker, world: int, timeout_s: float, what: str, preload=(), args=()) -> None:
    """Run ``worker(rank, world, init_file, *args)`` in ``world`` processes (a file:// rendezvous); re-raise
    a child's failure, raise TimeoutError after ``timeout_s``, kill what is left either way."""
    if preload:
        mp.set_forkserver_preload(list(preload))
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            worker, args=(world, os.path.join(tmp, "init"), *args), nprocs=world, join=False, start_method="forkserver"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):  # raises if a child failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} workers ran over {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
