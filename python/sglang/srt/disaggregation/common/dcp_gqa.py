"""PD decode DCP for GQA models (Helix): which prefill ranks a decode rank reads, and which bytes.

A GQA decode server with ``--dcp-size D`` (``--tp N --helix-kvp-size D``) shards K/V heads over its
``TPA = N / D`` head ranks and the sequence over the ``D`` ranks of each DCP group (consecutive TP
ranks, ``dcp_group_ranks``: ``tp_rank = head_rank * D + dcp_rank``). A plain ``--tp P`` prefill
rank holds ``K / P`` heads of every token (one replicated head where ``P > K``). So a decode rank
takes the tokens its DCP rank owns (``build_dcp_token_transfer_plan``) and, of each token, the
bytes of its head slice: from one prefill rank a sub-slice (``P < TPA``), the whole token
(``P == TPA``), or from ``P / TPA`` prefill ranks a part each (``P > TPA``).

Plain integer and numpy math, no torch: shared by the decode's rank mapping and the prefill's sender.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

# Blocks per Mooncake batch of a GQA relayout when SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES is
# unset: a partial head slice is a block per token, and the TCP transport queues at most
# MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (1024 by default) transfers per peer, refusing the rest
# ("queue-full"; a 6000-token prompt's batch of 4096 blocks failed). Half of it, as Mooncake's
# own proxies keep in flight over TCP.
GQA_TRANSFER_BATCH_BLOCKS = 512


class PrefillRanks(NamedTuple):
    """What a decode rank reads: ``tp_ranks`` (prefill attention-TP ranks, all real senders), how
    many decode ranks each of them serves per request (``required_dst_info_num``) and how many of
    them answer this decode rank (``required_prefill_response_num``)."""

    tp_ranks: List[int]
    required_dst_info_num: int
    required_prefill_response_num: int


class TokenSlice(NamedTuple):
    """Per token: ``copy_bytes`` from ``src_offset`` of the prefill rank's token item to
    ``dst_offset`` of the decode rank's."""

    src_offset: int
    dst_offset: int
    copy_bytes: int


def decode_head_rank(tp_rank: int, attn_tp_size: int, dcp_size: int) -> tuple:
    """``(head_rank, head_tp_size)`` of a DCP decode rank: its K/V head slice among ``TPA`` slices."""
    return (tp_rank % attn_tp_size) // dcp_size, attn_tp_size // dcp_size


def prefill_ranks_for_decode(
    decode_tp_rank: int,
    decode_attn_tp_size: int,
    dcp_size: int,
    prefill_attn_tp_size: int,
) -> PrefillRanks:
    """The prefill ranks that hold the head slice of decode rank ``decode_tp_rank``."""
    head_rank, tpa = decode_head_rank(decode_tp_rank, decode_attn_tp_size, dcp_size)
    p = prefill_attn_tp_size
    if p % tpa and tpa % p:
        raise ValueError(
            f"PD decode DCP: a prefill --tp {p} and decode heads over --tp {decode_attn_tp_size} / "
            f"--dcp-size {dcp_size} = {tpa} ranks must divide one another"
        )
    if (
        p >= tpa
    ):  # P / TPA prefill ranks each give part of the slice; each serves one DCP group
        per = p // tpa
        return PrefillRanks(
            list(range(head_rank * per, (head_rank + 1) * per)), dcp_size, per
        )
    per = (
        tpa // p
    )  # one prefill rank holds the slices of `per` head ranks, each a DCP group
    return PrefillRanks([head_rank // per], per * dcp_size, 1)


def token_slice(
    src_token_bytes: int,
    src_tp_rank: int,
    src_attn_tp_size: int,
    dst_token_bytes: int,
    dst_head_rank: int,
    dst_head_tp_size: int,
) -> Optional[TokenSlice]:
    """The bytes of one K (or V) token a prefill rank gives a decode rank, None if they share no
    head. Heads are contiguous in a token item, so a head slice is a byte range of the model's
    ``K * head_bytes``; a prefill with ``P > K`` holds replicas (rank ``r`` has slice ``r // (P / K)``),
    the decode has none (``TPA <= K``)."""
    src_span, dst_span = (
        src_token_bytes * src_attn_tp_size,
        dst_token_bytes * dst_head_tp_size,
    )
    src_rank = src_tp_rank // max(
        1, src_span // dst_span
    )  # its slice among the distinct ones
    src_start, dst_start = src_rank * src_token_bytes, dst_head_rank * dst_token_bytes
    start = max(src_start, dst_start)
    end = min(src_start + src_token_bytes, dst_start + dst_token_bytes)
    if end <= start:
        return None
    return TokenSlice(start - src_start, start - dst_start, end - start)


def transfer_blocks(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    src_token_bytes: Sequence[int],
    dst_token_bytes: Sequence[int],
    slices: Sequence[Optional[TokenSlice]],
    src_tokens: np.ndarray,
    dst_tokens: np.ndarray,
) -> List[Tuple[int, int, int]]:
    """``(src address, dst address, bytes)`` blocks moving each listed token's slice of every KV
    entry (a layer's K or V buffer): ``src_tokens`` / ``dst_tokens`` ``[T]`` are rows of the prefill
    and the decode pool. A whole-token slice moves runs of consecutive rows as one block (a DCP
    rank's tokens come in runs of its interleave size), a partial one a block per token.
    """
    src_tokens, dst_tokens = np.asarray(src_tokens, np.int64), np.asarray(
        dst_tokens, np.int64
    )
    if src_tokens.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src_tokens) != 1) | (np.diff(dst_tokens) != 1)) + 1
    run_starts = np.concatenate([[0], breaks])
    run_lens = np.diff(np.concatenate([run_starts, [src_tokens.size]]))
    blocks: List[Tuple[int, int, int]] = []
    for src_ptr, dst_ptr, src_bytes, dst_bytes, cut in zip(
        src_ptrs, dst_ptrs, src_token_bytes, dst_token_bytes, slices
    ):
        if cut is None:
            continue
        if cut.copy_bytes == src_bytes == dst_bytes:  # the whole token: runs
            src = src_ptr + src_tokens[run_starts] * src_bytes
            dst = dst_ptr + dst_tokens[run_starts] * dst_bytes
            blocks.extend(
                zip(src.tolist(), dst.tolist(), (run_lens * src_bytes).tolist())
            )
        else:
            src = src_ptr + src_tokens * src_bytes + cut.src_offset
            dst = dst_ptr + dst_tokens * dst_bytes + cut.dst_offset
            blocks.extend(
                (s, d, cut.copy_bytes) for s, d in zip(src.tolist(), dst.tolist())
            )
    return blocks


def head_slice_blocks(
    src_ptrs: Sequence[int],
    src_item_lens: Sequence[int],
    dst_ptrs: Sequence[int],
    dst_item_lens: Sequence[int],
    page_size: int,
    src_tokens: np.ndarray,
    dst_tokens: np.ndarray,
    *,
    src_tp_rank: int,
    src_attn_tp_size: int,
    dst_tp_rank: int,
    dst_attn_tp_size: int,
    dst_dcp_size: int,
) -> List[Tuple[int, int, int]]:
    """The blocks of one prefill -> decode DCP transfer of a GQA pool: for each KV entry (item
    lengths are page bytes, one page size on both sides) the decode rank's head slice of each
    token of the plan (``src_tokens`` -> ``dst_tokens``, rows of the two pools). The layouts were
    checked once, when the decode registered (``layout_mismatch``); this runs on the transfer
    thread, where an exception would stop every later transfer."""
    head_rank, head_tp = decode_head_rank(dst_tp_rank, dst_attn_tp_size, dst_dcp_size)
    src_bytes = [n // page_size for n in src_item_lens]
    dst_bytes = [n // page_size for n in dst_item_lens]
    cuts = [
        token_slice(s, src_tp_rank, src_attn_tp_size, d, head_rank, head_tp)
        for s, d in zip(src_bytes, dst_bytes)
    ]
    return transfer_blocks(
        src_ptrs, dst_ptrs, src_bytes, dst_bytes, cuts, src_tokens, dst_tokens
    )


def layout_mismatch(
    src_item_lens: Sequence[int],
    dst_item_lens: Sequence[int],
    page_size: int,
    src_attn_tp_size: int,
    dst_attn_tp_size: int,
    dst_dcp_size: int,
    replicated_heads: bool,
) -> Optional[str]:
    """Why a prefill's K/V token items cannot fill a GQA DCP decode's head slices, or None. All of a
    model's heads span the same bytes on both sides, unless the prefill replicates heads (``P > K``
    on a GPU: ``replicated_heads``; the CPU engine pads a model's KV heads to a multiple of ``P``
    instead, a layout no decode shares)."""
    tpa = dst_attn_tp_size // dst_dcp_size
    if len(src_item_lens) != len(dst_item_lens):
        return f"the decode registered {len(dst_item_lens)} KV buffers, the prefill has {len(src_item_lens)}"
    for s, d in zip(src_item_lens, dst_item_lens):
        s, d = s // page_size, d // page_size
        src_span, dst_span = s * src_attn_tp_size, d * tpa
        if src_span == dst_span or (
            replicated_heads and src_span > dst_span and src_span % dst_span == 0
        ):
            continue
        return (
            f"PD decode DCP (GQA): a prefill --tp {src_attn_tp_size} rank holds {s} bytes of each token's K "
            f"(or V), {src_span} over its TP group, but the decode's {tpa} head slices (--tp {dst_attn_tp_size} "
            f"/ --dcp-size {dst_dcp_size}) hold {dst_span}"
            + (
                ""
                if replicated_heads
                else "; the CPU engine pads the KV heads of a prefill whose --tp does "
                "not divide them: use a prefill --tp that divides the model's KV heads"
            )
        )
    return None
