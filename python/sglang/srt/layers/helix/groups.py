"""Helix process groups: the KVP × TPA grid inside each TP group.

N = KVP × TPA ranks of one (pipeline-stage-local) TP group are laid out as

    tp_rank = tpa_rank * KVP + kvp_rank

- the **KVP group** of a rank is the KVP consecutive TP ranks with its ``tpa_rank``: the ranks
  that hold the same query/KV heads and different sequence shards of the KV cache. The Helix
  All-to-All runs over it.
- the **TPA group** of a rank is the TPA TP ranks, strided by KVP, with its ``kvp_rank``: the
  ranks that together hold all heads for one sequence shard.

Why this order: after the All-to-All, KVP rank ``k`` of TPA slice ``t`` holds exact attention
for query heads ``t*Q/TPA + k*Q/N ... + Q/N``, i.e. heads ``[tp_rank*Q/N, (tp_rank+1)*Q/N)``: exactly
the row shard of ``o_proj`` that plain TP=N gives ``tp_rank``. So o_proj, the MLP, embeddings and
lm_head are untouched TP=N layers, and ``qkv_proj`` is upstream's
``ReplicatedParallelGroup("tp", KVP)`` (rank ``tp_rank // KVP`` of ``TPA``). See docs/helix-design.md (section 1).

Groups are built from each TP group's global ranks, so they stay stage-local with PP > 1.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

GROUP_NAMES = ("helix_kvp_group", "helix_tpa_group")


def helix_ranks(tp_rank: int, kvp_size: int) -> Dict[str, int]:
    """``{"helix_kvp_rank", "helix_tpa_rank"}`` of a TP rank (0, tp_rank when KVP == 1)."""
    return {"helix_kvp_rank": tp_rank % kvp_size, "helix_tpa_rank": tp_rank // kvp_size}


def helix_group_ranks(
    tp_group_ranks: List[List[int]], kvp_size: int
) -> Tuple[List[List[int]], List[List[int]]]:
    """Global ranks of every KVP group and every TPA group, from the TP groups' global ranks.

    Example, one TP group of N=8 with KVP=4 (TPA=2):
        KVP groups: [0, 1, 2, 3], [4, 5, 6, 7]
        TPA groups: [0, 4], [1, 5], [2, 6], [3, 7]
    """
    kvp_groups, tpa_groups = [], []
    for ranks in tp_group_ranks:
        n = len(ranks)
        if kvp_size < 1 or n % kvp_size:
            raise ValueError(f"helix: TP group of {n} ranks is not divisible by --helix-kvp-size {kvp_size}")
        kvp_groups += [ranks[start : start + kvp_size] for start in range(0, n, kvp_size)]
        tpa_groups += [ranks[k::kvp_size] for k in range(kvp_size)]
    return kvp_groups, tpa_groups


# GroupCoordinators of this process, kept so that destroy_helix_groups() can release them.
_GROUPS: Dict[str, object] = {}


def init_helix_groups(
    tp_group_ranks: List[List[int]], kvp_size: int, local_rank: int, backend: str, **kwargs
) -> Dict[str, object]:
    """Build this process's KVP and TPA GroupCoordinators (nothing when KVP == 1).

    Called from ``initialize_model_parallel`` right after the TP groups; ``kwargs`` are the
    ``init_model_parallel_group`` options the other model-parallel groups get there. Returns
    ``{"helix_kvp_group": ..., "helix_tpa_group": ...}`` to publish in the parallel context.
    """
    from sglang.srt.distributed.parallel_state import init_model_parallel_group

    assert not _GROUPS, "helix groups are already initialized"
    if kvp_size == 1:
        return {}
    kvp_groups, tpa_groups = helix_group_ranks(tp_group_ranks, kvp_size)
    for name, ranks in zip(GROUP_NAMES, (kvp_groups, tpa_groups)):
        _GROUPS[name] = init_model_parallel_group(
            ranks, local_rank, backend, group_name=name, **kwargs
        )
    return dict(_GROUPS)


def helix_graph_capture_groups() -> List[object]:
    """The Helix groups a CUDA-graph capture enters (``parallel_state.graph_capture``), so that
    the KVP All-to-All is captured through pynccl; none when Helix is off."""
    return [group for name, group in _GROUPS.items() if name == "helix_kvp_group"]


def destroy_helix_groups() -> None:
    for group in _GROUPS.values():
        group.destroy()
    _GROUPS.clear()


def get_helix_kvp_group():
    """The KVP group of this rank (the All-to-All group). Raises when Helix is off."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().helix_kvp_group


def get_helix_tpa_group():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().helix_tpa_group


def helix_attention_tp(tp_size: int, parallel_group=None):
    """``(attn_tp_size, qkv_parallel_group, helix)``: how an attention layer shards its heads.

    This is how a model opts into Helix. In its attention module's ``__init__``::

        tp_size, qkv_parallel_group, self.helix = helix_attention_tp(tp_size, parallel_group)
        ...  # heads over tp_size as before; QKVParallelLinear(..., parallel_group=qkv_parallel_group)

    and in ``forward``, ``helix_attention(self.attn, q, k, v, forward_batch)`` in place of
    ``self.attn(...)`` when ``self.helix`` (see docs/helix-design.md, "Adding a model").

    Helix off: ``(tp_size, parallel_group, False)``, the layer's own values: it is built exactly as
    before. Helix on: ``(TPA, ReplicatedParallelGroup("tp", KVP), True)``: ``qkv_proj`` is sharded
    over TPA and replicated over the KVP ranks of a TPA slice (rank ``tp_rank // KVP``).
    """
    from sglang.srt.layers.linear import ReplicatedParallelGroup
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if not parallel.helix_enabled:
        return tp_size, parallel_group, False
    return parallel.helix_tpa_size, ReplicatedParallelGroup("tp", parallel.helix_kvp_size), True
