"""Moving K/V between logical KV ids in DCP's GQA mode.

A logical id's K/V live on one rank of the DCP group, at the row ``localize_dcp_indices`` gives
it (-1 on the others). Upstream moves K/V inside one pool (``move_kv_cache``): a tree draft's
accepted path to the front of the request's verify window, the prefix tail into each draft
branch's first page. In the GQA mode a source and its target may have different owners (a tree
token's slot and the position its depth gives it), so every rank reads the sources it owns, the
DCP group all-gathers them as bytes (every layer's K and V in one call) and every rank writes
the targets it owns. No host value: the writes of targets this rank does not own go to its
reserved row 0, as a padded token's do.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.dcp.layout import localize_dcp_indices
from sglang.srt.runtime_context import get_parallel


def move_kv_cache_by_owner(pool, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """``pool``'s K/V of the logical ids ``src_loc [M]`` to ``tgt_loc [M]`` on every rank of the DCP
    group (called by all of them): ``pool.k_buffer`` / ``v_buffer`` per layer, ``[rows, K/TPA, D]``.
    """
    if (
        getattr(pool, "use_hnd", False)
        or getattr(pool, "k_scale_buffer", None) is not None
    ):
        raise NotImplementedError(
            "dcp gqa move_kv_cache: a token-major pool without per-token scales only"
        )
    parallel = get_parallel()
    k, n, c, group = (
        parallel.attn_dcp_rank,
        parallel.attn_dcp_size,
        parallel.dcp_interleave_size,
        parallel.dcp_group,
    )
    src_loc, tgt_loc = src_loc.to(torch.int64), tgt_loc.to(torch.int64)
    src_rows = localize_dcp_indices(src_loc, n, k, c)  # [M]
    # [M]; a target another rank owns: row 0
    tgt_rows = localize_dcp_indices(tgt_loc, n, k, c).clamp(min=0)
    buffers = list(pool.k_buffer) + list(pool.v_buffer)  # 2L of [rows, K/TPA, D]
    # [M, 2L, K/TPA, D']
    local = torch.stack(
        [b[src_rows.clamp(min=0)].view(torch.uint8) for b in buffers], dim=1
    )
    local.masked_fill_((src_rows < 0).view(-1, 1, 1, 1), 0)
    gathered = local.new_empty((n,) + local.shape)  # [KVP, M, 2L, K/TPA, D']
    group.all_gather_into_tensor(gathered.view(-1, *local.shape[1:]), local)
    owner = (src_loc // c) % n  # [M] the rank that owns each source
    # [M, 2L, K/TPA, D']
    moved = gathered[owner, torch.arange(owner.shape[0], device=owner.device)]
    for i, b in enumerate(buffers):
        b[tgt_rows] = moved[:, i].view(b.dtype)
