"""Helix KVP x TPA groups: membership for N=4 and N=8 (and with PP), and real gloo groups.

Layout: tp_rank = tpa_rank * KVP + kvp_rank. KVP groups are contiguous blocks of KVP TP ranks; TPA
groups are strided by KVP. After the All-to-All, KVP rank k of TPA slice t holds query heads
[tp_rank * Q/N, (tp_rank + 1) * Q/N): the o_proj shard of plain TP=N.
"""

import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang.srt.layers.helix.groups import helix_group_ranks, helix_ranks


def _check_partition(groups, members, size):
    flat = [r for g in groups for r in g]
    assert sorted(flat) == sorted(members), "groups must partition the ranks (disjoint, complete)"
    assert all(len(g) == size for g in groups)


@pytest.mark.parametrize("n,kvp", [(4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (8, 1)])
def test_membership(n, kvp):
    tpa = n // kvp
    kvp_groups, tpa_groups = helix_group_ranks([list(range(n))], kvp)
    assert len(kvp_groups) == tpa and len(tpa_groups) == kvp
    _check_partition(kvp_groups, range(n), kvp)
    _check_partition(tpa_groups, range(n), tpa)
    for r in range(n):
        ranks = helix_ranks(r, kvp)
        k, t = ranks["helix_kvp_rank"], ranks["helix_tpa_rank"]
        assert r == t * kvp + k
        (mine,) = [g for g in kvp_groups if r in g]
        assert mine.index(r) == k and all(helix_ranks(x, kvp)["helix_tpa_rank"] == t for x in mine)
        (mine,) = [g for g in tpa_groups if r in g]
        assert mine.index(r) == t and all(helix_ranks(x, kvp)["helix_kvp_rank"] == k for x in mine)
        # Every KVP group and TPA group intersect in exactly one rank.
    for g in kvp_groups:
        for h in tpa_groups:
            assert len(set(g) & set(h)) == 1


def test_worked_example_n8_kvp4():
    kvp_groups, tpa_groups = helix_group_ranks([list(range(8))], 4)
    assert kvp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tpa_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_groups_stay_inside_each_pipeline_stage():
    # PP=2, TP=4: TP groups [0..3], [4..7]; Helix groups never cross a stage.
    kvp_groups, tpa_groups = helix_group_ranks([[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    assert kvp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tpa_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_indivisible_is_refused():
    with pytest.raises(ValueError, match="--helix-kvp-size 3"):
        helix_group_ranks([list(range(4))], 3)


def _worker(rank, world, kvp, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from sglang.srt.layers.helix import groups

        built = groups.init_helix_groups([list(range(world))], kvp, local_rank=rank, backend="gloo")
        kvp_group, tpa_group = built["helix_kvp_group"], built["helix_tpa_group"]
        ranks = helix_ranks(rank, kvp)
        assert kvp_group.world_size == kvp and kvp_group.rank_in_group == ranks["helix_kvp_rank"]
        assert tpa_group.world_size == world // kvp and tpa_group.rank_in_group == ranks["helix_tpa_rank"]
        # Real collectives over the real groups: sums of member ranks.
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=kvp_group.device_group)
        t = ranks["helix_tpa_rank"]
        assert x.item() == sum(range(t * kvp, (t + 1) * kvp))
        y = torch.tensor([float(rank)])
        dist.all_reduce(y, group=tpa_group.device_group)
        assert y.item() == sum(range(ranks["helix_kvp_rank"], world, kvp))
        groups.destroy_helix_groups()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,kvp", [(4, 2), (4, 4)])
def test_real_gloo_groups(world, kvp):
    mp.set_forkserver_preload(["sglang.srt.distributed.parallel_state"])
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, kvp, os.path.join(tmp, "init")), nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + 120
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError("helix group workers ran over 120s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
