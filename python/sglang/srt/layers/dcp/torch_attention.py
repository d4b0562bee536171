"""Decode context parallel (DCP) attention in plain torch: the torch_native backend's DCP path.

Under ``--dcp-size D`` a rank stores the K/V of the tokens it owns (``localize_dcp_indices``:
runs of ``interleave_size`` logical KV ids dealt round-robin over the DCP ranks, kept compactly
at ``local row``), so it attends over its own shard and returns a partial output with its
log-sum-exp; the DCP exchange (``cp_lse_ag_out_rs_mha`` or ``dcp_a2a_lse_reduce``) merges the
partials into exact attention. These are the torch pieces of that partial, and the reference the
Triton kernels' DCP paths are tested against:

    dcp_torch_metadata(forward_batch, req_to_token [R, C], ...)   once per batch, by the backend's
        -> DcpTorchMetadata: the store's (owned tokens, rows), the local KV list    init_forward_metadata
    dcp_partial_attention(layer, q [T, H, D], forward_batch, meta, kv_pool)
        -> out [T, H, Dv], lse [T, H] fp32          per layer: a decode or verify batch at once
                                                    (padded lists), an extend per request
    partial_attention(q [t, H, D], k [l, Hk, D], v [l, Hk, Dv], ...)
        -> out [t, H, Dv], lse [t, H] fp32

A query sees the keys at positions <= its own (a decode: every key; a speculative tree verify:
the keys its mask shows); a rank that owns none of them returns output 0 and LSE ``-inf``, which
both exchanges treat as an empty partial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sglang.kernels.ops.attention.dcp_kernels import create_kv_indices_for_dcp_torch
from sglang.srt.layers.dcp.layout import (
    get_dcp_lens,
    get_dcp_positions,
    localize_dcp_indices,
)

# The most fp32 scores [Hk, g, t, l] held at once (128 MiB): queries go in blocks under it.
_SCORE_ELEMS = 1 << 25


@dataclass
class DcpTorchMetadata:
    """One forward's DCP lists on torch_native, built once per batch (``dcp_torch_metadata``) and
    only read by the layers."""

    # (owned token indices [t], their rows [t])
    store: Tuple[torch.Tensor, torch.Tensor]
    # the local KV list of positions [0, kv_end) (new tokens included): indptr [B+1], rows [L],
    # the global position of local index j (every list's j-th row) [max list length]; the indptr
    # on the host, and per request the first row of its list when the list is one ascending run
    # of rows (r0, r0 + 1, ...), else None: then the layers read a view of the pool, no gather
    # (an extend's requests, a lone decode or verify)
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_positions: torch.Tensor
    kv_indptr_host: list
    kv_run_starts: list
    # A decode or verify (every request the same number of new tokens, Q): the lists padded to
    # the longest, so that a layer attends the whole batch in one call. rows [B, L] (0 where
    # padded), the keys each query sees [B, Q, L] (decode: [B, 1, L], the same for its heads)
    padded_rows: Optional[torch.Tensor] = None
    padded_visible: Optional[torch.Tensor] = None


def dcp_torch_metadata(
    forward_batch,
    req_to_token: torch.Tensor,
    dcp_size: int,
    dcp_rank: int,
    interleave_size: int = 1,
    draft_rows=None,
) -> Optional[DcpTorchMetadata]:
    """This forward's lists, for the backend's ``init_forward_metadata``; ``req_to_token [R,
    max_context]`` the backend's table. A speculative draft decode step's come from ``draft_rows``,
    the draft backend's ``(table, slots, kv_ends, kv_ends_cpu)``, a row per draft token with tree
    branches moved up to seq_len, and the step's writes (the multi-step draft backend binds them
    before the steps run). None for an idle batch, and for a draft step without its rows.
    """
    mode = forward_batch.forward_mode
    if forward_batch.out_cache_loc is None or mode.is_idle():
        return None
    if mode.is_decode() and forward_batch.spec_info is not None and draft_rows is None:
        return None
    n, k, c = dcp_size, dcp_rank, interleave_size
    # [T], -1: not owned
    rows = localize_dcp_indices(forward_batch.out_cache_loc.to(torch.int64), n, k, c)
    owned = (rows >= 0).nonzero().squeeze(1)
    if draft_rows is not None:
        table, slots, kv_ends, kv_ends_cpu = draft_rows
    else:
        table, slots = req_to_token, forward_batch.req_pool_indices
        kv_ends, kv_ends_cpu = kv_ends_of(forward_batch)
    # this rank's share of [0, kv_end): lengths [B] and their host sum
    local_lens = get_dcp_lens(kv_ends.to(torch.int64), n, k, interleave_size=c)
    total = int(
        get_dcp_lens(torch.as_tensor(kv_ends_cpu), n, k, interleave_size=c).sum()
    )
    indptr = torch.zeros(len(local_lens) + 1, dtype=torch.int32, device=table.device)
    torch.cumsum(local_lens, dim=0, out=indptr[1:])
    indices = torch.empty(total, dtype=torch.int64, device=table.device)
    create_kv_indices_for_dcp_torch(
        table, slots, local_lens, indptr, None, indices, n, k, interleave_size=c
    )
    indptr_host = indptr.tolist()  # (the CPU path: host values are free)
    longest = max((b - a for a, b in zip(indptr_host, indptr_host[1:])), default=0)
    positions = get_dcp_positions(
        torch.arange(longest, device=table.device), n, k, interleave_size=c
    )
    padded = mode.is_decode() or mode.is_target_verify()
    batch_size = len(indptr_host) - 1
    meta = DcpTorchMetadata(
        (owned, rows[owned]),
        indptr,
        indices,
        positions,
        indptr_host,
        # (a padded batch of several requests gathers: no run to look for)
        (
            [None] * batch_size
            if padded and batch_size > 1
            else _run_starts(indices, indptr_host)
        ),
    )
    if padded:
        _pad_lists(meta, forward_batch)
    return meta


def _pad_lists(meta: DcpTorchMetadata, forward_batch) -> None:
    """A decode's or verify's ``padded_rows [B, L]`` and ``padded_visible [B, Q or 1, L]`` (see
    ``DcpTorchMetadata``), from its lists; once per batch, on the device."""
    indptr, host, device = meta.kv_indptr, meta.kv_indptr_host, meta.kv_indices.device
    B = len(host) - 1
    L = max((host[b + 1] - host[b] for b in range(B)), default=0)
    col = torch.arange(L, device=device)
    valid = col[None, :] < (indptr[1:] - indptr[:-1])[:, None]  # [B, L]
    at = (indptr[:-1, None] + col[None, :]).clamp_(max=max(len(meta.kv_indices) - 1, 0))
    if len(meta.kv_indices) == 0:  # this rank owns no key of the batch
        meta.padded_rows = torch.zeros(B, L, dtype=torch.int64, device=device)
        meta.padded_visible = valid[:, None, :]
        return
    meta.padded_rows = torch.where(valid, meta.kv_indices[at], 0)
    if forward_batch.forward_mode.is_decode():  # a decode token sees every key
        meta.padded_visible = valid[:, None, :]
        return
    key_pos = torch.where(valid, meta.kv_positions[None, :L], 0)  # [B, L]
    Q = forward_batch.spec_info.draft_token_num
    tree = tree_mask_of(forward_batch)
    if tree is not None:
        # request b's rows of the tree's mask [Q, seq_len + Q], at the keys it owns here
        mask, offsets = tree
        width = forward_batch.seq_lens.to(device) + Q  # [B]
        start = offsets.to(device)  # [B]
        row = torch.arange(Q, device=device)
        flat = start[:, None, None] + row[None, :, None] * width[:, None, None]
        visible = mask[flat + key_pos[:, None, :]].bool()  # [B, Q, L]
    else:  # a chain: causal
        query_pos = forward_batch.positions.view(B, Q).long()
        visible = key_pos[:, None, :] <= query_pos[:, :, None]
    meta.padded_visible = visible & valid[:, None, :]


def kv_ends_of(forward_batch) -> Tuple[torch.Tensor, torch.Tensor]:
    """``([B] tensor, its host copy)``: the end of each request's attended positions ``[0, end)``, new
    tokens included: ``seq_lens``; a target verify adds its ``draft_token_num`` drafts. (A draft
    decode step's ends come with its rows: the torch_native draft backend's ``draft_decode_metadata``,
    on Triton ``draft_kv_ends``.)"""
    if forward_batch.forward_mode.is_target_verify():
        drafts = forward_batch.spec_info.draft_token_num
        return forward_batch.seq_lens + drafts, forward_batch.seq_lens_cpu + drafts
    return forward_batch.seq_lens, forward_batch.seq_lens_cpu


def tree_mask_of(forward_batch) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """A tree verify's (top-k > 1) ``custom_mask`` in the FULL_MASK layout -- per request ``[n,
    seq_len + n]`` flattened, back to back -- and each request's offset in it (``[B]``, on the
    mask's device), else None."""
    spec = forward_batch.spec_info
    if (
        not forward_batch.forward_mode.is_target_verify()
        or getattr(spec, "tree_topk", 1) == 1
    ):
        return None
    n, mask = spec.draft_token_num, spec.custom_mask
    sizes = n * (forward_batch.seq_lens.to(mask.device, torch.int64) + n)
    return mask, torch.cumsum(sizes, 0) - sizes


def dcp_partial_attention(
    layer, q: torch.Tensor, forward_batch, meta: DcpTorchMetadata, kv_pool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` of ``q [T, H, D]`` over the keys this rank owns (``meta``'s lists;
    an fp8 pool's scales multiplied back): ``out [T, H, Dv]``, ``lse [T, H]`` fp32. A decode or
    verify attends the batch in one call over the padded lists (one request's one run of rows:
    a view of the pool); an extend, whose per-request work dwarfs a loop, request by request.
    """
    k_buf = kv_pool.get_key_buffer(layer.layer_id)
    v_buf = kv_pool.get_value_buffer(layer.layer_id)
    k_descale, v_descale = kv_scales(layer, kv_pool, q.dtype) or (1.0, 1.0)
    T, H, _ = q.shape
    if meta.padded_rows is not None:
        rows = meta.padded_rows  # [B, L]
        B, L = rows.shape
        if B == 1 and meta.kv_run_starts[0] is not None:
            # one run of rows: a view of the pool, no copy
            rows = slice(meta.kv_run_starts[0], meta.kv_run_starts[0] + L)
        k = _read_rows(k_buf, rows, k_descale).view(B, L, *k_buf.shape[1:])
        v = _read_rows(v_buf, rows, v_descale).view(B, L, *v_buf.shape[1:])
        out, lse = _attend_batch(q, k, v, layer.scaling, meta.padded_visible)
        return out.to(q.dtype), lse
    out = torch.zeros(T, H, layer.v_head_dim, dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    indptr, start = meta.kv_indptr_host, 0
    for b, q_len in enumerate(forward_batch.extend_seq_lens_cpu):
        lo, hi = indptr[b], indptr[b + 1]
        tok = slice(start, start + q_len)
        start += q_len
        if hi == lo:
            continue  # this rank owns none of the request's tokens: neutral partial
        rows = meta.kv_indices[lo:hi]
        run = meta.kv_run_starts[b]
        if run is not None:  # the same rows in the same order: a view, no copy
            rows = slice(run, run + hi - lo)
        out[tok], lse[tok] = partial_attention(
            q[tok],
            _read_rows(k_buf, rows, k_descale),
            _read_rows(v_buf, rows, v_descale),
            layer.scaling,
            forward_batch.positions[tok].long(),
            meta.kv_positions[: hi - lo],
        )
    return out, lse


def kv_scales(layer, kv_pool, dtype: torch.dtype) -> Optional[Tuple[float, float]]:
    """``(k_scale, v_scale)`` when the pool's write divides K/V of ``dtype`` by them (it converts:
    an fp8 pool, as ``MHATokenToKVPool.set_kv_buffer``), else None; reads multiply them back.
    """
    if layer.k_scale is None or layer.v_scale is None or dtype == kv_pool.dtype:
        return None
    if layer.k_scale_float is not None:
        return layer.k_scale_float, layer.v_scale_float
    return float(layer.k_scale), float(layer.v_scale)


def _read_rows(buf: torch.Tensor, rows, descale: float) -> torch.Tensor:
    """``buf[rows]`` in fp32, dequantized: one gather (plus one conversion for a non-fp32 pool),
    no multiply when the scale is 1. ``rows`` a slice: a view of an fp32 pool, nothing copied.
    """
    out = buf[rows].float()
    if descale == 1.0:
        return out
    # never scale the pool in place
    return out * descale if isinstance(rows, slice) else out.mul_(descale)


def _run_starts(kv_indices: torch.Tensor, indptr: list) -> list:
    """Per request ``b``: ``r0`` when ``kv_indices[indptr[b]:indptr[b+1]]`` is exactly
    ``r0, r0 + 1, ...`` (a fresh request's pages are usually consecutive), else None. One
    comparison over the batch's lists, once per forward batch, instead of two gathers per layer.
    """
    out = []
    for b in range(len(indptr) - 1):
        lo, hi = indptr[b], indptr[b + 1]
        rows = kv_indices[lo:hi]
        r0 = int(rows[0]) if hi > lo else 0
        ok = (
            hi > lo
            and int(rows[-1]) - r0 == hi - lo - 1
            and bool((rows[1:] - rows[:-1] == 1).all())
        )
        out.append(r0 if ok else None)
    return out


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
    ``(out [b, H, Dv], lse [b, H])``; a query that sees no key: 0, -inf. ``_attend_batch`` of one
    request."""
    if mask is None:
        visible = torch.ones(1, 1, k.shape[0], dtype=torch.bool, device=q.device)
    else:
        visible = mask[None]
    return _attend_batch(q, k[None], v[None], scaling, visible)


def _attend_batch(q, k, v, scaling, visible, cpu_flash=None):
    """``q [B * Q, H, D]`` (request-major) over ``k [B, L, Hk, D]`` / ``v [B, L, Hk, Dv]``,
    ``visible [B, Q or 1, L]``: ``(out [B * Q, H, Dv] fp32, lse [B * Q, H])``; a query that sees
    no key: 0, -inf. Each KV head's query rows are its group's heads x the request's queries
    ``[B, Hk, g * Q, D]`` under the additive mask ``[B, 1, g * Q or 1, L]``: on the CPU one call
    of torch's flash kernel (which returns the LSE), elsewhere through the fp32 scores
    (``cpu_flash``: which; by default, by ``q``'s device)."""
    T, H, D = q.shape
    B, L, num_kv_heads, _ = k.shape
    if L == 0 or T == 0:  # this rank owns no key of the batch
        out = torch.zeros(T, H, v.shape[3], dtype=torch.float32, device=q.device)
        return out, torch.full((T, H), float("-inf"), device=q.device)
    Q, group = T // B, H // num_kv_heads
    qg = q.float().reshape(B, Q, num_kv_heads, group, D).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(B, num_kv_heads, group * Q, D)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hk, L, D]
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device)
    bias = bias.masked_fill_(~visible, -math.inf)
    if visible.shape[1] > 1:
        bias = bias.repeat(1, group, 1)
    bias = bias[:, None]
    if q.device.type == "cpu" if cpu_flash is None else cpu_flash:
        # [B, Hk, g * Q, Dv], [B, Hk, g * Q]
        o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k, v, 0.0, False, attn_mask=bias, scale=scaling
        )
    else:
        s = torch.matmul(qg, k.transpose(-1, -2)) * scaling + bias  # [B, Hk, g * Q, L]
        m = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible
        o = torch.matmul(
            torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None]), v
        )
    o = o.view(B, num_kv_heads, group, Q, -1).permute(0, 3, 1, 2, 4).reshape(T, H, -1)
    m = m.view(B, num_kv_heads, group, Q).permute(0, 3, 1, 2).reshape(T, H)
    blind = ~visible.any(dim=2).expand(B, Q).reshape(T)  # queries that see no key here
    o[blind], m[blind] = 0.0, -math.inf
    return o, m
