"""Helix process groups: the KVP group inside each TP group.

N = KVP × TPA ranks of one (pipeline-stage-local) TP group are laid out as

    tp_rank = tpa_rank * KVP + kvp_rank

(``runtime_context`` publishes ``helix_kvp_rank`` and ``helix_tpa_rank``). The **KVP group** of a
rank is the KVP consecutive TP ranks with its ``tpa_rank``: the ranks that hold the same
query/KV heads and different sequence shards of the KV cache. The Helix All-to-All runs over it;
it is the only group Helix adds (``qkv_proj`` is sharded over TPA with upstream's
``ReplicatedParallelGroup("tp", KVP)``, which needs no group of its own).

Why this order: after the All-to-All, KVP rank ``k`` of TPA slice ``t`` holds exact attention
for query heads ``t*Q/TPA + k*Q/N ... + Q/N``, i.e. heads ``[tp_rank*Q/N, (tp_rank+1)*Q/N)``: exactly
the row shard of ``o_proj`` that plain TP=N gives ``tp_rank``. So o_proj, the MLP, embeddings and
lm_head are untouched TP=N layers. See docs/helix-design.md (section 1).

Groups are built from each TP group's global ranks, so they stay stage-local with PP > 1.
"""

from __future__ import annotations

from typing import Dict, List

from sglang.srt.runtime_context import get_parallel

GROUP_NAME = "helix_kvp_group"


def helix_kvp_group_ranks(tp_group_ranks: List[List[int]], kvp_size: int) -> List[List[int]]:
    """Global ranks of every KVP group, from the TP groups' global ranks.

    Example, one TP group of N=8 with KVP=4 (TPA=2): [0, 1, 2, 3], [4, 5, 6, 7].
    """
    kvp_groups = []
    for ranks in tp_group_ranks:
        n = len(ranks)
        if kvp_size < 1 or n % kvp_size:
            raise ValueError(f"helix: TP group of {n} ranks is not divisible by --helix-kvp-size {kvp_size}")
        kvp_groups += [ranks[start : start + kvp_size] for start in range(0, n, kvp_size)]
    return kvp_groups


# The GroupCoordinator of this process, kept so that destroy_helix_groups() can release it.
_GROUPS: Dict[str, object] = {}


def init_helix_groups(
    tp_group_ranks: List[List[int]], kvp_size: int, local_rank: int, backend: str, **kwargs
) -> Dict[str, object]:
    """Build this process's KVP GroupCoordinator (nothing when KVP == 1).

    Called from ``initialize_model_parallel`` right after the TP groups; ``kwargs`` are the
    ``init_model_parallel_group`` options the other model-parallel groups get there. Returns
    ``{"helix_kvp_group": ...}`` to publish in the parallel context.
    """
    # parallel_state imports this module to call this function: import it here, once per process.
    from sglang.srt.distributed.parallel_state import init_model_parallel_group

    assert not _GROUPS, "helix groups are already initialized"
    if kvp_size == 1:
        return {}
    ranks = helix_kvp_group_ranks(tp_group_ranks, kvp_size)
    _GROUPS[GROUP_NAME] = init_model_parallel_group(ranks, local_rank, backend, group_name=GROUP_NAME, **kwargs)
    return dict(_GROUPS)


def helix_graph_capture_groups() -> List[object]:
    """The Helix groups a CUDA-graph capture enters (``parallel_state.graph_capture``), so that
    the KVP All-to-All is captured through pynccl; none when Helix is off."""
    return list(_GROUPS.values())


def destroy_helix_groups() -> None:
    for group in _GROUPS.values():
        group.destroy()
    _GROUPS.clear()


def get_helix_kvp_group():
    """The KVP group of this rank (the All-to-All group). Raises when Helix is off."""
    return get_parallel().helix_kvp_group
