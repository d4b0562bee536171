"""Decode context parallel (DCP) attention in plain torch: one rank's partial attention.

Under ``--dcp-size D`` a rank stores the K/V of the tokens it owns (``localize_dcp_indices``:
runs of ``interleave_size`` logical KV ids dealt round-robin over the DCP ranks, kept compactly
at ``local row``), so it attends over its own shard and returns a partial output with its
log-sum-exp; the DCP exchange (``cp_lse_ag_out_rs_mha`` or ``dcp_a2a_lse_reduce``) merges the
partials into exact attention. These are the torch pieces of that partial: the torch_native
backend's DCP path runs them on every forward, and they are the reference the Triton kernels'
DCP paths are tested against.

    dcp_owned_kv(locs [L], ...)             -> rows [l], positions [l]    the shard of one request
    partial_attention(q [t, H, D], k [l, Hk, D], v [l, Hk, Dv], ...)
                                            -> out [t, H, Dv], lse [t, H] fp32

A query sees the keys at positions <= its own (``query_pos``; ``None``: every key, a decode);
a rank that owns none of them returns output 0 and LSE ``-inf``, which both exchanges treat as
an empty partial.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from sglang.srt.layers.dcp.layout import localize_dcp_indices

# The most fp32 scores [Hk, g, t, l] held at once (128 MiB): queries go in blocks under it.
_SCORE_ELEMS = 1 << 25


def dcp_owned_kv(
    locs: torch.Tensor,
    dcp_size: int,
    dcp_rank: int,
    interleave_size: int = 1,
    start: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows [l], positions [l])`` of the keys this rank owns among one request's logical KV
    ids ``locs [L]`` at positions ``start, start + 1, ...``: their physical rows in this rank's
    pool, and their positions (ascending)."""
    local = localize_dcp_indices(
        locs.to(torch.int64), dcp_size, dcp_rank, interleave_size
    )
    owned = local >= 0
    positions = torch.arange(start, start + locs.shape[0], device=locs.device)
    return local[owned], positions[owned]


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    query_pos: Optional[torch.Tensor] = None,
    key_pos: Optional[torch.Tensor] = None,
    visible: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of ``q [t, H, D]`` over ``k [l, Hk, D]`` / ``v [l, Hk, Dv]``, grouped by KV head
    (each read once for its ``H / Hk`` query heads); causal by ``query_pos [t]`` / ``key_pos [l]``
    (``query_pos=None``: every key), or by an explicit ``visible [t, l]`` mask (a speculative tree).
    ``(out [t, H, Dv], lse [t, H])``; no visible key: 0, -inf."""
    t, H, D = q.shape
    out = torch.zeros(t, H, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.full((t, H), float("-inf"), dtype=torch.float32, device=q.device)
    if k.shape[0] == 0 or t == 0:
        return out, lse
    k, v = k.float(), v.float()
    block = max(1, _SCORE_ELEMS // (H * k.shape[0]))
    for t0 in range(0, t, block):
        tok = slice(t0, min(t0 + block, t))
        n, mask = k.shape[0], None  # mask [b, n]: the keys each query sees (None: all)
        if query_pos is not None:  # keys past the block's last query are unseen
            n = int(torch.searchsorted(key_pos, query_pos[tok][-1:], right=True)[0])
            mask = key_pos[:n][None, :] <= query_pos[tok][:, None]
        if visible is not None:
            mask = visible[tok][:, :n]
        if n == 0:
            continue
        o, m = _attend(q[tok].float(), k[:n], v[:n], scaling, mask)
        out[tok], lse[tok] = o.to(out.dtype), m
    return out, lse


def _attend(q, k, v, scaling, mask):
    """``q [b, H, D]`` over ``k [n, Hk, D]`` / ``v [n, Hk, Dv]`` (fp32), ``mask [b, n]`` or None:
    ``(out [b, H, Dv], lse [b, H])``; a query that sees no key: 0, -inf."""
    if q.device.type == "cpu":
        return _attend_cpu(q, k, v, scaling, mask)
    return _attend_scores(q, k, v, scaling, mask)


def _attend_cpu(q, k, v, scaling, mask):
    """One fused SDPA call (the CPU flash kernel, which also returns the log-sum-exp): the query
    rows of each KV head are its group's heads x the block's tokens, ``[Hk, g * b, D]``.
    """
    b, H, D = q.shape
    num_kv_heads = k.shape[1]
    group = H // num_kv_heads
    qg = q.view(b, num_kv_heads, group, D).permute(1, 2, 0, 3)  # [Hk, g, b, D]
    bias = None
    if mask is not None:  # additive, the same for the group's heads: [g * b, n]
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, -math.inf)
        bias = bias.repeat(group, 1)
    o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg.reshape(1, num_kv_heads, group * b, D),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        0.0,
        False,
        attn_mask=bias,
        scale=scaling,
    )  # [1, Hk, g * b, Dv], [1, Hk, g * b]
    o = o.view(num_kv_heads, group, b, -1).permute(2, 0, 1, 3).reshape(b, H, -1)
    m = m.view(num_kv_heads, group, b).permute(2, 0, 1).reshape(b, H)
    if mask is not None:  # a query that sees no key here: a neutral partial
        blind = ~mask.any(dim=1)
        o[blind], m[blind] = 0.0, -math.inf
    return o, m


def _attend_scores(q, k, v, scaling, mask):
    """The scores in fp32 ``[Hk, g, b, n]``, softmax by their log-sum-exp (any device)."""
    b, H, D = q.shape
    num_kv_heads = k.shape[1]
    qb = q.view(b, num_kv_heads, H // num_kv_heads, D)  # [b, Hk, g, D]
    s = torch.einsum("bkgd,lkd->kgbl", qb, k) * scaling  # [Hk, g, b, n]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = torch.logsumexp(s, dim=-1)  # [Hk, g, b]; -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])
    o = torch.einsum("kgbl,lkd->bkgd", p, v)  # [b, Hk, g, Dv]
    return o.reshape(b, H, -1), m.permute(2, 0, 1).reshape(b, H)
