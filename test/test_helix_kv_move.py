"""``move_kv_cache`` under Helix (``layers/dcp/gqa_kv_move.py``), over gloo with real processes.

A tree draft moves each request's accepted path to the front of its verify window, and copies the
prefix tail into each draft branch's first page: logical KV ids whose K/V live on one rank of the
DCP group each, at a compact local row. A source and its target may have different owners. Every
rank of a ``--tp 4`` grid (KVP 2 or 4) holds the rows it owns of a known logical table; after one
move of random pairs (sources and targets on every owner, a padded pair ``0 -> 0`` as the
scheduler sends) each rank's rows equal the logical table moved, for a bf16 pool and an fp8 one
(stored as bytes), and every other row is untouched.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from sglang_helix.testing.workers import run_workers

WORLD, CHUNK, ROWS, LAYERS, HEADS, DIM = 4, 2, 16, 3, 2, 8


def _logical_table(kvp: int, dtype) -> list:
    """Per layer, ``[k, v]`` of every logical id ``[ROWS * kvp, HEADS, DIM]`` (seeded, the same on every rank)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(LAYERS):
        kv = [torch.randn(ROWS * kvp, HEADS, DIM, generator=g) for _ in range(2)]
        out.append([t.to(dtype) if dtype != torch.uint8 else (t * 20).to(torch.int8).view(torch.uint8) for t in kv])
    return out


def _worker(rank, world, init_file):
    from sglang.srt import runtime_context
    from sglang.srt.distributed.parallel_state import dcp_group_ranks, init_model_parallel_group, set_custom_all_reduce
    from sglang.srt.layers.dcp.layout import localize_dcp_indices
    from sglang.srt.layers.dcp.gqa_kv_move import move_kv_cache_by_owner

    from sglang.srt.distributed import parallel_state

    torch.set_num_threads(1)
    set_custom_all_reduce(False)
    parallel_state._is_cpu = True  # as on the CPU engine: the group's gloo all-gather
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # fmt: skip
    try:
        for kvp in (2, 4):
            group = init_model_parallel_group(dcp_group_ranks([list(range(world))], kvp), rank, "gloo", group_name=f"kvp{kvp}")
            kvp_rank = group.rank_in_group
            runtime_context._PARALLEL = SimpleNamespace(
                attn_dcp_rank=kvp_rank, attn_dcp_size=kvp, dcp_interleave_size=CHUNK, dcp_group=group
            )
            ids = torch.arange(ROWS * kvp)
            rows = localize_dcp_indices(ids, kvp, kvp_rank, CHUNK)
            owned = rows >= 0
            for dtype in (torch.bfloat16, torch.uint8):
                table = _logical_table(kvp, dtype)
                pool = SimpleNamespace(k_buffer=[], v_buffer=[])
                for k, v in table:  # this rank's rows: the logical ids it owns, compactly
                    for buf, full in ((pool.k_buffer, k), (pool.v_buffer, v)):
                        local = torch.zeros((ROWS,) + full.shape[1:], dtype=full.dtype)
                        local[rows[owned]] = full[owned]
                        buf.append(local)
                g = torch.Generator().manual_seed(11 + kvp)
                perm = torch.randperm(ROWS * kvp - CHUNK * kvp, generator=g) + CHUNK * kvp  # past the reserved page
                src, tgt = perm[:9], perm[9:18]
                src, tgt = torch.cat([src, torch.zeros(2, dtype=torch.long)]), torch.cat([tgt, torch.zeros(2, dtype=torch.long)])
                before = [[b.clone() for b in pool.k_buffer], [b.clone() for b in pool.v_buffer]]
                move_kv_cache_by_owner(pool, tgt, src)
                mine = localize_dcp_indices(tgt[:9], kvp, kvp_rank, CHUNK)
                touched = set(mine[mine >= 0].tolist()) | {0}
                for layer, (k, v) in enumerate(table):
                    for buf, old, full in ((pool.k_buffer, before[0], k), (pool.v_buffer, before[1], v)):
                        want = old[layer].clone()
                        for s, t in zip(src[:9].tolist(), tgt[:9].tolist()):
                            r = int(localize_dcp_indices(torch.tensor([t]), kvp, kvp_rank, CHUNK)[0])
                            if r >= 0:
                                want[r] = full[s]
                        untouched = [r for r in range(ROWS) if r not in touched]
                        assert torch.equal(buf[layer][untouched], want[untouched]), (kvp, dtype, layer)
                        moved = sorted(touched - {0})
                        assert torch.equal(buf[layer][moved], want[moved]), (kvp, dtype, layer)
            dist.barrier()
            group.destroy()
    finally:
        dist.destroy_process_group()


def test_move_kv_cache_across_owners():
    run_workers(_worker, WORLD, 180, "kv move", ["sglang.srt.layers.dcp.gqa_kv_move"])
