"""Helix KV layout: rank-invariant logical KV ids, and each rank's physical rows.

The allocator hands out **logical** KV ids (``loc``) in pages of ``P = chunk * KVP`` ids, the same
ids on every rank (the allocator state, and so every scheduling decision, is identical on all
ranks). A paged allocator keeps ``loc % P == position % P``, so a loc's owner and row are pure
functions of the loc:

    owner(loc) = (loc % P) // chunk                      == owner_rank(position)
    row(loc)   = (loc // P) * chunk + loc % chunk        (physical row on the owner)

i.e. exactly ``owner_rank`` / ``local_position`` of ``ownership.py`` applied to the loc. Each page
holds one chunk per rank; rank ``k`` stores rows ``page * chunk + [0, chunk)`` for it. A rank's
physical pool therefore holds ``1/KVP`` of the logical id space, with no KV duplicated.

Functions here are vectorized torch (CPU and GPU alike), with no host syncs: sizes that must be
known on the host come from host-side lengths the scheduler already has.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from sglang.srt.layers.helix.ownership import global_position, local_kv_len, local_position, owner_rank


def write_rows(
    out_cache_loc: torch.Tensor, kvp_rank: int, kvp_size: int, chunk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where this rank stores the K/V of the batch's new tokens.

    Args:
        out_cache_loc: ``[T]`` logical locs of the new tokens.
    Returns:
        ``(rows [T] int64, mask [T] bool)``: physical rows, and which tokens this rank owns.
        Rows of tokens it does not own are meaningless and must not be written.
    """
    loc = out_cache_loc.to(torch.int64)
    return local_position(loc, kvp_size, chunk), owner_rank(loc, kvp_size, chunk) == kvp_rank


def local_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    total_local: int,
    kvp_rank: int,
    kvp_size: int,
    chunk: int,
    kv_starts: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR list of the physical rows of the tokens this rank owns, per request, in position order.

    Args:
        req_to_token: ``[R, max_context]`` logical locs by (request slot, global position).
        req_pool_indices: ``[B]`` request slots.
        kv_lens: ``[B]`` global KV lengths (positions ``[kv_start, kv_len)`` are listed).
        total_local: the number of listed tokens (``sum(local_kv_len(kv_lens)) -
            sum(local_kv_len(kv_starts))``), computed on the host from the host copy of the
            lengths (so that no device value is read here).
        kv_starts: ``[B]`` first global position listed (default 0).
    Returns:
        ``(kv_indptr [B+1] int32, kv_indices [total_local] int64, local_lens [B] int32)``.
    """
    device = req_to_token.device
    local_hi = local_kv_len(kv_lens.to(torch.int64), kvp_rank, kvp_size, chunk)  # [B]
    local_lo = 0 if kv_starts is None else local_kv_len(kv_starts.to(torch.int64), kvp_rank, kvp_size, chunk)
    local_lens = local_hi - local_lo
    kv_indptr = torch.zeros(kv_lens.shape[0] + 1, dtype=torch.int32, device=device)
    torch.cumsum(local_lens, dim=0, out=kv_indptr[1:])
    batch = torch.repeat_interleave(
        torch.arange(kv_lens.shape[0], device=device), local_lens, output_size=total_local
    )  # [L] request of each listed token
    local_pos = torch.arange(total_local, device=device) - kv_indptr[:-1].to(torch.int64)[batch]
    if kv_starts is not None:
        local_pos = local_pos + local_lo[batch]
    pos = global_position(local_pos, kvp_rank, kvp_size, chunk)  # [L]
    loc = req_to_token[req_pool_indices.to(torch.int64)[batch], pos].to(torch.int64)
    return kv_indptr, local_position(loc, kvp_size, chunk), local_lens.to(torch.int32)


def total_local_len(kv_lens_cpu, kvp_rank: int, kvp_size: int, chunk: int) -> int:
    """Host-side ``sum(local_kv_len(kv_lens))`` from a host list / CPU tensor of lengths."""
    if isinstance(kv_lens_cpu, torch.Tensor):
        return int(local_kv_len(kv_lens_cpu.to(torch.int64), kvp_rank, kvp_size, chunk).sum())
    return sum(local_kv_len(int(s), kvp_rank, kvp_size, chunk) for s in kv_lens_cpu)


def extend_segments(
    prefix_lens: Sequence[int], extend_lens: Sequence[int], chunk: int
) -> Tuple[List[int], List[int], List[int]]:
    """Split each request's new tokens ``[prefix_len, prefix_len + extend_len)`` at ownership-chunk
    boundaries (multiples of ``chunk``): every segment lies in one chunk, so one rank owns it.

    Host lists in, host lists out (prefill metadata comes from host lengths): ``(request [S],
    start [S] global position of the segment's first token, length [S])``, in token order, so the
    segments of the batch tile its ``T`` new tokens.
    """
    request, start, length = [], [], []
    for b, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        pos, end = int(p), int(p) + int(e)
        while pos < end:
            stop = min(end, (pos // chunk + 1) * chunk)
            request.append(b)
            start.append(pos)
            length.append(stop - pos)
            pos = stop
    return request, start, length


def owned_positions(kv_indptr: torch.Tensor, total_local: int, kvp_rank: int, kvp_size: int, chunk: int) -> torch.Tensor:
    """``[total_local]`` global positions of the listed tokens (for causal masks by position)."""
    device = kv_indptr.device
    lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    batch = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens, output_size=total_local)
    local_pos = torch.arange(total_local, device=device) - kv_indptr[:-1].to(torch.int64)[batch]
    return global_position(local_pos, kvp_rank, kvp_size, chunk)
