"""The Helix KVP group: membership for N=4 and N=8 (and with PP), and real gloo groups.

Layout: tp_rank = tpa_rank * KVP + kvp_rank (``runtime_context`` publishes both). KVP groups are
contiguous blocks of KVP TP ranks with one tpa_rank. After the All-to-All, KVP rank k of TPA
slice t holds query heads [tp_rank * Q/N, (tp_rank + 1) * Q/N): the o_proj shard of plain TP=N.
"""

import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang.srt.layers.helix.groups import helix_kvp_group_ranks


def _check_partition(groups, members, size):
    flat = [r for g in groups for r in g]
    assert sorted(flat) == sorted(members), "groups must partition the ranks (disjoint, complete)"
    assert all(len(g) == size for g in groups)


@pytest.mark.parametrize("n,kvp", [(4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (8, 1)])
def test_membership(n, kvp):
    tpa = n // kvp
    kvp_groups = helix_kvp_group_ranks([list(range(n))], kvp)
    assert len(kvp_groups) == tpa
    _check_partition(kvp_groups, range(n), kvp)
    for r in range(n):
        (mine,) = [g for g in kvp_groups if r in g]
        # its place in the group is kvp_rank = tp_rank % KVP; the members share tpa_rank
        assert mine.index(r) == r % kvp and {x // kvp for x in mine} == {r // kvp}


def test_worked_example_n8_kvp4():
    assert helix_kvp_group_ranks([list(range(8))], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_groups_stay_inside_each_pipeline_stage():
    # PP=2, TP=4: TP groups [0..3], [4..7]; Helix groups never cross a stage.
    assert helix_kvp_group_ranks([[0, 1, 2, 3], [4, 5, 6, 7]], 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_indivisible_is_refused():
    with pytest.raises(ValueError, match="--helix-kvp-size 3"):
        helix_kvp_group_ranks([list(range(4))], 3)


def _worker(rank, world, kvp, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from sglang.srt.layers.helix import groups

        built = groups.init_helix_groups([list(range(world))], kvp, local_rank=rank, backend="gloo")
        assert list(built) == ["helix_kvp_group"]  # the only group Helix adds
        kvp_group = built["helix_kvp_group"]
        assert kvp_group.world_size == kvp and kvp_group.rank_in_group == rank % kvp
        # A real collective over the real group: the sum of its member ranks.
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=kvp_group.device_group)
        t = rank // kvp
        assert x.item() == sum(range(t * kvp, (t + 1) * kvp))
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
