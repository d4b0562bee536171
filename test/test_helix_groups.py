"""The Helix KVP group is DCP's group: membership for N=4 and N=8 (and with PP), real gloo groups.

Layout: tp_rank = tpa_rank * KVP + kvp_rank, i.e. ``dcp_rank = tp_rank % dcp_size`` as
``runtime_context`` publishes it. KVP groups are contiguous blocks of KVP TP ranks with one
tpa_rank: upstream's DCP group layout, ``parallel_state.dcp_group_ranks(tp_group_ranks, KVP)``.
After the All-to-All, KVP rank k of TPA slice t holds query heads [tp_rank * Q/N, (tp_rank + 1) *
Q/N): the o_proj shard of plain TP=N.

Helix builds no group of its own: ``--helix-kvp-size K`` resolves to ``--dcp-size K``, so
``initialize_model_parallel`` builds the DCP group (``_DCP``, published as
``get_parallel().dcp_group``), over which the All-to-All runs.

The per-prefix check runs this file at the patch "[Distributed] Do not create a PyNccl
communicator for gloo groups": there the multi-process test builds the groups with
``dcp_group_ranks`` + ``init_model_parallel_group`` only, and the ``initialize_model_parallel``
part runs from the patch "[CPU] Decode context parallelism on the CPU engine" on.
"""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

from sglang.srt.distributed import parallel_state
from sglang_helix.testing.workers import run_workers
from sglang.srt.distributed.parallel_state import dcp_group_ranks

# The CPU engine builds DCP groups (the patch "[CPU] Decode context parallel groups on the CPU engine").
DCP_ON_CPU = "_is_xpu or _is_cpu" in open(parallel_state.__file__).read()


def test_helix_builds_no_group_of_its_own():
    assert not [name for name in vars(parallel_state) if "HELIX" in name.upper()]


def _check_partition(groups, members, size):
    flat = [r for g in groups for r in g]
    assert sorted(flat) == sorted(members), "groups must partition the ranks (disjoint, complete)"
    assert all(len(g) == size for g in groups)


@pytest.mark.parametrize("n,kvp", [(4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (8, 1)])
def test_membership(n, kvp):
    tpa = n // kvp
    kvp_groups = dcp_group_ranks([list(range(n))], kvp)
    assert len(kvp_groups) == tpa
    _check_partition(kvp_groups, range(n), kvp)
    for r in range(n):
        (mine,) = [g for g in kvp_groups if r in g]
        # its place in the group is kvp_rank = tp_rank % KVP; the members share tpa_rank
        assert mine.index(r) == r % kvp and {x // kvp for x in mine} == {r // kvp}


def test_worked_example_n8_kvp4():
    assert dcp_group_ranks([list(range(8))], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_groups_stay_inside_each_pipeline_stage():
    # PP=2, TP=4: TP groups [0..3], [4..7]; Helix groups never cross a stage.
    assert dcp_group_ranks([[0, 1, 2, 3], [4, 5, 6, 7]], 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dcp_group_ranks([[0, 1, 2, 3], [4, 5, 6, 7]], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # PP=4, TP=2 with KVP=2: each stage's TP group is one KVP group.
    assert dcp_group_ranks([[0, 1], [2, 3], [4, 5], [6, 7]], 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # The lists are the TP groups' global ranks, whatever they are (e.g. a joiner's rank offset).
    assert dcp_group_ranks([[8, 9, 10, 11]], 2) == [[8, 9], [10, 11]]


def _check_group(group, rank, ranks):
    """A built KVP GroupCoordinator: its members, this rank's place, gloo with no PyNccl, and a
    real collective over it (the sum of the member ranks)."""
    assert group.ranks == ranks and group.world_size == len(ranks)
    assert group.rank_in_group == ranks.index(rank)
    assert group.pynccl_comm is None  # a gloo group: torch.distributed, no PyNccl communicator
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=group.device_group)
    assert x.item() == sum(ranks)


def _publish(world, tp, dcp=1):
    """The widths initialize_model_parallel reads, as a launcher publishes them."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    # destroy_model_parallel() clears every stamp, the WORLD group's too (init_distributed_environment's)
    parallel.override_permanently(world_group=parallel_state._WORLD)
    parallel.override_permanently(
        tp_size=tp, pp_size=world // tp, attn_tp_size=tp, attn_dp_size=1, attn_cp_size=1,
        attn_dcp_size=dcp, moe_ep_size=1, moe_dp_size=1, moe_tp_size=tp, shared_experts_tp_size=tp,
    )  # fmt: skip
    return parallel


def _worker(rank, world, init_file):
    torch.set_num_threads(1)
    parallel_state.set_custom_all_reduce(False)
    parallel_state.init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=f"file://{init_file}", local_rank=rank,
        backend="gloo", timeout=120,
    )  # fmt: skip
    try:
        # 1. The group from its layout: dcp_group_ranks + init_model_parallel_group (the backend
        # picks use_pynccl: none for gloo).
        for kvp in (2, 4):
            all_ranks = dcp_group_ranks([list(range(world))], kvp)
            group = parallel_state.init_model_parallel_group(all_ranks, rank, "gloo", group_name="helix_kvp")
            _check_group(group, rank, [r for r in all_ranks if rank in r][0])
            group.destroy()
        if DCP_ON_CPU:
            # The DCP group on the CPU engine ("[CPU] Decode context parallel groups"): --tp 4
            # --dcp-size 2 builds two gloo groups of consecutive TP ranks, published as dcp_group.
            parallel = _publish(world, 4, dcp=2)
            parallel_state.initialize_model_parallel(backend="gloo")
            assert parallel.dcp_group is parallel_state._DCP
            _check_group(parallel_state._DCP, rank, [r for r in range(world) if r // 2 == rank // 2])
            dist.barrier()
            parallel_state.destroy_model_parallel()
            # The Helix layouts (--helix-kvp-size K resolves to --dcp-size K): PP=2 x TP=2 with
            # KVP=2 (each stage's TP group is one KVP group); TP=4 with KVP=2 and 4.
            for tp, kvp in ((2, 2), (4, 2), (4, 4)):
                parallel = _publish(world, tp, dcp=kvp)
                parallel_state.initialize_model_parallel(backend="gloo")
                tp_ranks = [r for r in range(world) if r // tp == rank // tp]
                assert parallel_state.get_tp_group().ranks == tp_ranks
                assert parallel.dcp_group is parallel_state._DCP
                _check_group(parallel_state._DCP, rank, [r for r in tp_ranks if r // kvp == rank // kvp])
                dist.barrier()
                parallel_state.destroy_model_parallel()
        dist.barrier()  # rank 0 holds the store: nobody leaves while another still needs it
    finally:
        parallel_state.destroy_distributed_environment()


def test_real_gloo_groups(monkeypatch):
    world = 4
    # The CPU engine, as the servers run it (DCP_ON_CPU), with its sgl_kernel import stub.
    from sglang_helix.testing.cpu_env import STUB_DIR

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (STUB_DIR, os.environ.get("PYTHONPATH")) if p))
    # The forkserver imports these once for all children (initialize_model_parallel imports the
    # sampler, a large import).
    preload = ["sglang.srt.distributed.parallel_state"] + (
        ["sglang.srt.layers.sampler"] if DCP_ON_CPU else []
    )
    run_workers(_worker, world, 240, "helix group", preload)
