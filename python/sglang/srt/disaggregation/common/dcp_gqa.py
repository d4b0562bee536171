"""PD decode DCP for GQA models (Helix): a decode rank's K/V head slice, on upstream's DCP send.

A GQA decode server with ``--dcp-size D`` (``--tp N --helix-kvp-size D``) holds on each rank of a
DCP group (consecutive TP ranks) one of ``TPA = N / D`` K/V head slices, of the positions its DCP
rank owns. A plain ``--tp P`` prefill rank holds ``K / P`` heads of every position (one replicated
head where ``P > K``). Upstream's DCP send (``send_kvcache_dcp``) moves owned tokens in runs (a GQA
prefill allocates no DCP pack buffer: the send goes from the pool); ``head_slice_rows`` gives it, per prefill rank, the
share of the decode rank's slice that upstream's ``compute_head_slice_params`` names, as rows of
items of that share's width, so the same send moves it in pages, each byte once. A speculative
draft's pool is sharded like its target's in the mode, so its entries (``num_draft_entries``) take
the same rows and slices.
"""

from __future__ import annotations

import ctypes
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params

# Mooncake's TCP transport queues at most this many transfers per peer and refuses the rest
# ("queue-full"; a batch of 4096 per-token blocks failed): a send keeps half of it in flight, as
# Mooncake's own proxies do over TCP. SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES, when set, wins.
TCP_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
TCP_QUEUE_DEFAULT = 1024


def in_batches(transfer, configured: int = 0):
    """``transfer(session, blocks)`` in batches of ``configured`` blocks
    (SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES) when positive, else of half of the TCP transport's
    per-peer queue; the first failing batch's code."""
    size = (
        configured
        if configured > 0
        else int(os.environ.get(TCP_QUEUE_ENV, TCP_QUEUE_DEFAULT)) // 2
    )

    def send(session, blocks) -> int:
        for start in range(0, len(blocks), size):
            ret = transfer(session, blocks[start : start + size])
            if ret != 0:
                return ret
        return 0

    return send


def head_slice_rows(
    src_rows: np.ndarray,
    dst_rows: np.ndarray,
    dst_item_lens: Sequence[int],
    page_size: int,
    *,
    src_tp_rank: int,
    src_tp_size: int,
    dst_tp_rank: int,
    dst_tp_size: int,
    dcp_size: int,
    num_kv_heads: int,
) -> Tuple[List[int], np.ndarray, np.ndarray]:
    """``(bytes per K/V entry, src rows, dst rows)``: what prefill rank ``src_tp_rank`` gives decode
    rank ``dst_tp_rank`` of the tokens ``src_rows`` -> ``dst_rows`` (pool rows), in items of the
    width of its share of the slice (``compute_head_slice_params`` over the decode's TPA head
    ranks), rows counted in those items. A share that is the ``k``-th of ``r`` in a prefill token
    (``P < TPA``) is item ``s * r + k`` of prefill row ``s``: a strided row, which upstream's DCP
    pack gathers. A share that is the ``j``-th of ``m`` parts of a decode token (``P > TPA``) goes
    *part-major* into the decode page: row ``i`` of page ``p`` at item ``(p * m + j) * page_size + i``,
    a run a page, which the decode puts back token-major (``unpack_part_major``). Where
    ``R = P / K`` prefill ranks hold the same heads, rank ``x`` sends the pages ``p % R == x % R``.
    """
    tpa = dst_tp_size // dcp_size
    head_rank = dst_tp_rank % dst_tp_size // dcp_size
    src_start, heads, dst_start, _ = compute_head_slice_params(
        src_tp_size, tpa, src_tp_rank, head_rank, num_kv_heads
    )
    src_heads, dst_heads = max(1, num_kv_heads // src_tp_size), num_kv_heads // tpa
    replicas = max(1, src_tp_size // num_kv_heads)
    if replicas > 1:
        keep = dst_rows // page_size % replicas == src_tp_rank % replicas
        src_rows, dst_rows = src_rows[keep], dst_rows[keep]
    parts, part = dst_heads // heads, dst_start // heads
    page, row = np.divmod(dst_rows, page_size)
    return (
        [n // page_size // dst_heads * heads for n in dst_item_lens],
        src_rows * (src_heads // heads) + src_start // heads,
        (page * parts + part) * page_size + row,
    )


def _bytes_at(ptr: int, nbytes: int, device):
    """A flat uint8 torch view of ``nbytes`` at ``ptr`` (host memory, or a GPU's)."""
    import torch

    if torch.device(device).type == "cpu":
        return torch.frombuffer(
            (ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8
        )

    class _Device:
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }

    return torch.as_tensor(_Device(), device=device)


def unpack_part_major(
    kv_mgr, pages: np.ndarray, prefill_tp_size: int, device: str
) -> None:
    """Put a decode rank's received ``pages`` back token-major where ``m = min(P, K) / TPA > 1``
    prefill ranks each wrote a part of its tokens: each K/V entry's page (a speculative draft's
    too: its pool is sharded like the target's) holds the ``m`` blocks of ``page_size`` rows
    ``head_slice_rows`` placed part-major, made ``[page_size, m, part bytes]``.
    """
    args = kv_mgr.kv_args
    parts = (
        min(prefill_tp_size, args.total_kv_head_num)
        * kv_mgr.dcp_size
        // kv_mgr.attn_tp_size
    )
    if parts <= 1 or pages.size == 0:
        return
    import torch

    device = "cpu" if device == "cpu" else f"{device}:{args.gpu_id}"
    top = int(pages.max()) + 1
    for ptr, size in zip(args.kv_data_ptrs, args.kv_item_lens):  # a draft's entries too
        flat = _bytes_at(ptr, top * size, device).view(top, size)
        idx = torch.as_tensor(pages, device=flat.device)
        got = flat.index_select(0, idx).view(pages.size, parts, args.page_size, -1)
        flat.index_copy_(0, idx, got.transpose(1, 2).reshape(pages.size, size))


def state_slices_overlap(
    src_rank: int, src_tp: int, dst_rank: int, dst_tp: int
) -> bool:
    """Whether prefill attn-TP rank ``src_rank`` of ``src_tp`` holds any linear-attention (mamba)
    state heads of decode rank ``dst_rank`` of ``dst_tp``: the ranks' equal shares of the heads
    intersect. Upstream's rank mapping pairs only such ranks; in DCP's GQA mode a decode rank reads
    the prefill ranks of its DCP group's KV head slice (TPA = tp / dcp wide), while its states are
    sliced over all tp ranks, so a pair may share none: that prefill rank sends it no state.
    """
    return (
        src_rank * dst_tp < (dst_rank + 1) * src_tp
        and dst_rank * src_tp < (src_rank + 1) * dst_tp
    )


def layout_mismatch(
    src_item_lens: Sequence[int],
    dst_item_lens: Sequence[int],
    page_size: int,
    src_attn_tp_size: int,
    dst_attn_tp_size: int,
    dst_dcp_size: int,
    replicated_heads: bool,
    num_draft_entries: int = 0,
) -> Optional[str]:
    """Why a prefill's K/V token items cannot fill a GQA DCP decode's head slices, or None. All of a
    model's heads span the same bytes on both sides, unless the prefill replicates heads (``P > K``
    on a GPU: ``replicated_heads``; the CPU engine pads a model's KV heads to a multiple of ``P``
    instead, a layout no decode shares). The last ``num_draft_entries`` entries are a speculative
    draft's, sharded like the target's and sent with the target's head slice (the model's K/V
    heads, as upstream's head-sliced send slices every entry): each must hold a target entry's
    bytes a token on both sides."""
    tpa = dst_attn_tp_size // dst_dcp_size
    if len(src_item_lens) != len(dst_item_lens):
        return f"the decode registered {len(dst_item_lens)} KV buffers, the prefill has {len(src_item_lens)}"
    num_target = len(src_item_lens) - num_draft_entries
    for side, lens in (("prefill", src_item_lens), ("decode", dst_item_lens)):
        if num_draft_entries and set(lens[num_target:]) != {lens[0]}:
            return (
                f"PD decode DCP (GQA): the {side}'s speculative draft holds {sorted(set(lens[num_target:]))} "
                f"bytes a KV page, its target {lens[0]}: the draft's KV is sent in the target's head "
                "slices, so its K/V heads and head dim must be the target model's"
            )
    for s, d in zip(src_item_lens, dst_item_lens):
        src_span, dst_span = s // page_size * src_attn_tp_size, d // page_size * tpa
        if src_span == dst_span or (
            replicated_heads and src_span > dst_span and src_span % dst_span == 0
        ):
            continue
        return (
            f"PD decode DCP (GQA): a prefill --tp {src_attn_tp_size} rank holds {s // page_size} bytes of "
            f"each token's K (or V), {src_span} over its TP group, but the decode's {tpa} head slices "
            f"(--tp {dst_attn_tp_size} / --dcp-size {dst_dcp_size}) hold {dst_span}"
            + (
                ""
                if replicated_heads
                else "; the CPU engine pads the KV heads of a prefill whose --tp does "
                "not divide them: use a prefill --tp that divides the model's KV heads"
            )
        )
    return None
