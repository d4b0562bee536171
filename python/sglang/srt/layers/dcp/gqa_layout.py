"""DCP's GQA-mode KV layout: upstream DCP's sequence sharding with ``interleave_size = chunk``.

Tokens are dealt to the KVP ranks of a KVP group round-robin in runs of ``chunk`` positions (the
``interleave_size`` of ``sglang.srt.layers.dcp.layout``): position ``p`` belongs to KVP rank
``(p // chunk) % KVP``, and a rank stores its tokens compactly in position order. The allocator
hands out logical KV ids (``loc``) in pages of ``P = chunk * KVP``, the same ids on every rank, and
keeps ``loc % P == p % P``; so a loc's owner and physical row are DCP's formulas applied to the
loc: ``localize_dcp_indices(loc, KVP, kvp_rank, chunk)`` (-1 where another rank owns it), and a
rank's local KV length is ``get_dcp_lens(seq_len, KVP, kvp_rank, interleave_size=chunk)``.

What DCP's layout module does not have, and torch_native's DCP path needs: the inverse map (local
index -> global position) and this rank's local KV lists in torch (``local_kv_indices``: the rows of
upstream's Triton list kernel, ``create_triton_kv_indices_for_dcp_triton``, which the Triton backend
runs, with each row's position). Vectorized torch, no host syncs: sizes the host needs come from
host-side lengths the scheduler already has.
"""

from __future__ import annotations

from typing import Tuple

import torch

from sglang.srt.layers.dcp.layout import get_dcp_lens, localize_dcp_indices


def write_rows(
    out_cache_loc: torch.Tensor, kvp_rank: int, kvp_size: int, chunk: int
) -> torch.Tensor:
    """``[T]`` physical row of each new token on this rank, -1 for tokens it does not own (the
    write masks them: ``rows >= 0`` is DCP's ``dcp_kv_mask``)."""
    return localize_dcp_indices(
        out_cache_loc.to(torch.int64), kvp_size, kvp_rank, interleave_size=chunk
    )


def owner_rank(loc: torch.Tensor, kvp_size: int, chunk: int) -> torch.Tensor:
    """``[*]`` the KVP rank that stores each logical id (DCP's ownership at ``interleave_size = chunk``)."""
    return (loc.to(torch.int64) // chunk) % kvp_size


def local_kv_lens(
    seq_lens, kvp_rank: int, kvp_size: int, chunk: int, start=None
) -> torch.Tensor:
    """``[B]`` how many positions of ``[start, start + seq_lens)`` (default ``[0, seq_lens)``) this rank owns."""
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    start = None if start is None else torch.as_tensor(start, dtype=torch.int64)
    return get_dcp_lens(
        seq_lens, kvp_size, kvp_rank, start=start, interleave_size=chunk
    )


def global_position(
    local_pos: torch.Tensor, kvp_rank: int, kvp_size: int, chunk: int
) -> torch.Tensor:
    """Global position of local index ``local_pos [*]`` on rank ``kvp_rank`` (inverse of
    ``localize_dcp_indices`` on positions)."""
    return (
        (local_pos // chunk) * (chunk * kvp_size) + kvp_rank * chunk + local_pos % chunk
    )


def total_local_len(
    kv_lens_cpu, kvp_rank: int, kvp_size: int, chunk: int, start_cpu=None
) -> int:
    """Host-side ``sum(local_kv_lens(...))`` from host lists / CPU tensors of lengths."""
    if len(kv_lens_cpu) == 0:
        return 0
    return int(local_kv_lens(kv_lens_cpu, kvp_rank, kvp_size, chunk, start_cpu).sum())


def local_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    total_local: int,
    kvp_rank: int,
    kvp_size: int,
    chunk: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR list of the physical rows of the positions ``[0, kv_len)`` this rank owns, from
    ``req_to_token [R, max_context]``, ``req_pool_indices / kv_lens [B]`` and the host count
    ``total_local``: ``(kv_indptr [B+1] int32, kv_indices [total_local] int64, positions int64)``, the
    rows of ``create_triton_kv_indices_for_dcp_triton(..., interleave_size=chunk)``."""
    device = req_to_token.device
    # [B]
    local_lens = local_kv_lens(kv_lens.to(torch.int64), kvp_rank, kvp_size, chunk)
    kv_indptr = torch.zeros(kv_lens.shape[0] + 1, dtype=torch.int32, device=device)
    torch.cumsum(local_lens, dim=0, out=kv_indptr[1:])
    # [L] request of each listed token
    batch = torch.repeat_interleave(
        torch.arange(kv_lens.shape[0], device=device),
        local_lens,
        output_size=total_local,
    )
    local_pos = (
        torch.arange(total_local, device=device) - kv_indptr[:-1].to(torch.int64)[batch]
    )
    pos = global_position(local_pos, kvp_rank, kvp_size, chunk)  # [L]
    loc = req_to_token[req_pool_indices.to(torch.int64)[batch], pos].to(torch.int64)
    rows = localize_dcp_indices(loc, kvp_size, kvp_rank, interleave_size=chunk)
    return kv_indptr, rows, pos
