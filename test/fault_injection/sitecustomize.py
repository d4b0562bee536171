"""Fault injection for test/test_helix_kv_leak.py::test_leak_checks_catch_an_injected_fault.

On PYTHONPATH of a CPU server (SGLANG_USE_CPU_ENGINE set) with HELIX_INJECT set, this patches the
paged KV allocator of one TP rank (HELIX_INJECT_RANK) when sglang imports it: at that rank's
HELIX_INJECT_AT-th page release it either keeps the first page (``leak``) or releases the first
page twice (``double_free``). With HELIX_INJECT_WHEN=empties the fault waits past release
#HELIX_INJECT_AT for the first release that leaves the pool empty (a workload's last): a page kept
while requests still run or wait would change that rank's admission and retraction decisions, so
its scheduler would run a different batch from the others' (a collective mismatch), which is a
different failure from the one under test. Every other process, and every process without
HELIX_INJECT, is untouched.
"""
import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") and os.environ.get("HELIX_INJECT"):
    import importlib.abc
    import sys

    MODE = os.environ["HELIX_INJECT"]
    RANK = int(os.environ.get("HELIX_INJECT_RANK", "3"))
    AT = int(os.environ.get("HELIX_INJECT_AT", "20"))
    WHEN = os.environ.get("HELIX_INJECT_WHEN", "at")
    TARGET = "sglang.srt.mem_cache.allocator.paged"

    def patch(mod):
        cls = mod.PagedTokenToKVPoolAllocator
        orig = cls._release_page_ids
        state = {"n": 0, "done": False}

        def _release_page_ids(self, *page_ids):
            from sglang.srt.runtime_context import get_parallel

            if get_parallel().tp_rank == RANK and sum(p.numel() for p in page_ids) > 0:
                import torch

                state["n"] += 1
                ids = torch.cat(page_ids)
                empties = self.available_size() + ids.numel() * self.page_size >= self.size
                if not state["done"] and state["n"] >= AT and (WHEN == "at" or empties):
                    state["done"] = True
                    print(f"HELIX_INJECT {MODE} on TP{RANK}: release #{state['n']} of pages {ids.tolist()}", flush=True)
                    if MODE == "leak":
                        return orig(self, ids[1:]) if ids.numel() > 1 else None
                    if MODE == "double_free":
                        return orig(self, ids, ids[:1])
            return orig(self, *page_ids)

        cls._release_page_ids = _release_page_ids
        print(f"HELIX_INJECT armed in pid {os.getpid()}: {MODE} at release #{AT} on TP{RANK}", flush=True)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = spec.loader
            orig_exec = loader.exec_module

            def exec_module(module):
                orig_exec(module)
                patch(module)

            loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())
