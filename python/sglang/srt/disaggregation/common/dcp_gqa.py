"""PD decode DCP for GQA models (Helix): which prefill ranks a decode rank reads, and which bytes.

A GQA decode server with ``--dcp-size D`` (``--tp N --helix-kvp-size D``) shards K/V heads over its
``TPA = N / D`` head ranks and the sequence over the ``D`` ranks of each DCP group (consecutive TP
ranks, ``dcp_group_ranks``: ``tp_rank = head_rank * D + dcp_rank``). A plain ``--tp P`` prefill
rank holds ``K / P`` heads of every token (one replicated head where ``P > K``). So a decode rank
takes the tokens its DCP rank owns (``build_dcp_token_transfer_plan``) and, of each token, the
bytes of its head slice: from one prefill rank a sub-slice (``P < TPA``), the whole token
(``P == TPA``), or from ``P / TPA`` prefill ranks a part each (``P > TPA``).

The send is planned in pages, not tokens (``transfer_plan``): O(pages) blocks per request whatever
P, TPA and the interleave, each byte sent once (replicas split the pages). The plan is integer and
numpy math over pointers; only the prefill's pack (``pack_rows``) and the decode's unpack
(``unpack_part_major``) touch memory, with torch.
"""

from __future__ import annotations

import ctypes
import os
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

# Mooncake's TCP transport queues at most this many transfers per peer and refuses the rest
# ("queue-full"; a batch of 4096 per-token blocks failed): a send keeps half of it in flight, as
# Mooncake's own proxies do over TCP. SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES, when set, wins.
TCP_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
TCP_QUEUE_DEFAULT = 1024

# Prefill staging a transfer worker packs head sub-slices into (bytes; at least one page of every
# K/V entry is used whatever this says).
STAGING_BYTES_ENV = "SGLANG_DCP_PD_STAGING_BYTES"
STAGING_BYTES_DEFAULT = 64 << 20

Block = Tuple[int, int, int]


def transfer_batch_blocks(configured: int = 0) -> int:
    """Blocks per ``batch_transfer_sync``: ``configured`` (SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES)
    when positive, else half of the TCP transport's per-peer queue."""
    if configured > 0:
        return configured
    return max(1, int(os.environ.get(TCP_QUEUE_ENV, TCP_QUEUE_DEFAULT)) // 2)


def staging_bytes() -> int:
    return int(os.environ.get(STAGING_BYTES_ENV, STAGING_BYTES_DEFAULT))


def staging_charge_bytes(page_bytes: int, transfer_queues: int) -> int:
    """The most a prefill server's transfer workers hold in staging: one buffer per transfer queue
    (its worker thread sends), each the larger of ``staging_bytes()`` and one page of every K/V
    entry (``page_bytes``). The KV pool sizing charges it on a GQA prefill server."""
    return transfer_queues * max(staging_bytes(), page_bytes)


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
    # P / TPA prefill ranks each give part of the slice; each serves one DCP group
    if p >= tpa:
        per = p // tpa
        return PrefillRanks(
            list(range(head_rank * per, (head_rank + 1) * per)), dcp_size, per
        )
    # one prefill rank holds the slices of `per` head ranks, each a DCP group
    per = tpa // p
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
    # its slice among the distinct ones
    src_rank = src_tp_rank // max(1, src_span // dst_span)
    src_start, dst_start = src_rank * src_token_bytes, dst_head_rank * dst_token_bytes
    start = max(src_start, dst_start)
    end = min(src_start + src_token_bytes, dst_start + dst_token_bytes)
    if end <= start:
        return None
    return TokenSlice(start - src_start, start - dst_start, end - start)


class Gather(NamedTuple):
    """A K/V entry's head sub-slice packed into staging: ``copy_bytes`` at ``src_ptr`` (the
    prefill entry's base plus the slice's byte offset) of each packed row, rows
    ``src_token_bytes`` apart."""

    src_ptr: int
    src_token_bytes: int
    copy_bytes: int


class TransferStep(NamedTuple):
    """Pack ``rows`` (prefill pool rows) of each of ``gathers`` into staging, entry after entry and
    row after row, then move ``blocks`` (``[B, 3]`` int64 rows ``(src, dst, bytes)``, a source in
    the prefill pool or in staging; an array, not B Python tuples)."""

    rows: np.ndarray
    gathers: List[Gather]
    blocks: np.ndarray


class TransferPlan(NamedTuple):
    """One prefill rank's send to one decode rank, in steps whose packed bytes fit the staging."""

    steps: List[TransferStep]

    @property
    def blocks(self) -> np.ndarray:
        return np.concatenate([s.blocks for s in self.steps] or [_NO_BLOCKS])

    @property
    def staged_bytes(self) -> int:
        """The most bytes one step packs (what the staging must hold)."""
        return max(
            (len(s.rows) * sum(g.copy_bytes for g in s.gathers) for s in self.steps),
            default=0,
        )


def _runs(breaks: np.ndarray, n: int) -> Tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the runs of ``n`` items that ``breaks`` ``[n - 1]`` (True: item
    ``i + 1`` starts a run) cut."""
    starts = np.concatenate([[0], np.flatnonzero(breaks) + 1]).astype(np.int64)
    return starts, np.diff(np.concatenate([starts, [n]]))


_NO_BLOCKS = np.empty((0, 3), np.int64)


def _blocks(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> np.ndarray:
    return np.stack([src, dst, lens], axis=1).astype(np.int64, copy=False)


def batch_lists(blocks: np.ndarray, batch: int):
    """``(src addresses, dst addresses, lengths)`` lists of at most ``batch`` blocks each, what
    ``batch_transfer_sync`` takes."""
    for start in range(0, len(blocks), batch):
        part = blocks[start : start + batch]
        yield part[:, 0].tolist(), part[:, 1].tolist(), part[:, 2].tolist()


def transfer_plan(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    src_token_bytes: Sequence[int],
    dst_token_bytes: Sequence[int],
    slices: Sequence[Optional[TokenSlice]],
    src_tokens: np.ndarray,
    dst_tokens: np.ndarray,
    *,
    page_size: int,
    replicas: int = 1,
    replica: int = 0,
    staging_ptr: int = 0,
    staging_capacity: int = STAGING_BYTES_DEFAULT,
) -> TransferPlan:
    """The blocks moving each listed token's slice of every KV entry (a layer's K or V buffer):
    ``src_tokens`` / ``dst_tokens`` ``[T]`` are rows of the prefill and the decode pool (a decode
    rank's tokens come in runs of a page, its interleave). O(pages) blocks whatever the slice:

    - the whole token (``P == TPA``): a block per run of rows consecutive on both sides;
    - a sub-slice of the prefill's token (``P < TPA``): the rows' slices packed into staging
      (``TransferStep.rows`` / ``gathers``, at most ``staging_capacity`` bytes a step, at least a
      page), then a block per run of consecutive decode rows;
    - a part of the decode's token (``P > TPA``: ``m = dst / copy`` prefill ranks each hold a
      part): each part's rows written *part-major* in the decode page (part ``j`` of a page's row
      ``i`` at byte ``(j * page_size + i) * copy``), a block per run within a page; the decode
      puts its pages back token-major when the transfer is done (``unpack_part_major``).

    Each byte once: where ``replicas`` prefill ranks hold the same slice (``P > K`` on a GPU),
    replica ``replica`` sends the decode pages ``p`` with ``p % replicas == replica``.
    """
    src_tokens = np.asarray(src_tokens, np.int64)
    dst_tokens = np.asarray(dst_tokens, np.int64)
    if replicas > 1:
        keep = (dst_tokens // page_size) % replicas == replica
        src_tokens, dst_tokens = src_tokens[keep], dst_tokens[keep]
    n = src_tokens.size
    if n == 0:
        return TransferPlan([])
    breaks = (np.diff(src_tokens) != 1) | (np.diff(dst_tokens) != 1)
    whole = _runs(breaks, n)
    in_page = None
    direct: List[np.ndarray] = []
    # and the decode entry's pointer, token bytes
    gathers: List[Tuple[Gather, int, int]] = []
    for src_ptr, dst_ptr, src_bytes, dst_bytes, cut in zip(
        src_ptrs, dst_ptrs, src_token_bytes, dst_token_bytes, slices
    ):
        if cut is None:
            continue
        if cut.copy_bytes == src_bytes == dst_bytes:  # the whole token: runs
            starts, lens = whole
            direct.append(
                _blocks(
                    src_ptr + src_tokens[starts] * src_bytes,
                    dst_ptr + dst_tokens[starts] * dst_bytes,
                    lens * src_bytes,
                )
            )
        # a part of the decode token: part-major pages
        elif cut.copy_bytes == src_bytes:
            if in_page is None:
                page_breaks = (
                    dst_tokens[1:] // page_size != dst_tokens[:-1] // page_size
                )
                in_page = _runs(breaks | page_breaks, n)
            starts, lens = in_page
            rows = dst_tokens[starts]
            part = cut.dst_offset // cut.copy_bytes
            dst = dst_ptr + (rows // page_size) * page_size * dst_bytes
            dst += (part * page_size + rows % page_size) * cut.copy_bytes
            direct.append(
                _blocks(
                    src_ptr + src_tokens[starts] * src_bytes, dst, lens * cut.copy_bytes
                )
            )
        else:  # a sub-slice of the prefill token: packed
            gathers.append(
                (
                    Gather(src_ptr + cut.src_offset, src_bytes, cut.copy_bytes),
                    dst_ptr,
                    dst_bytes,
                )
            )
    steps = [TransferStep(src_tokens[:0], [], np.concatenate(direct))] if direct else []
    if not gathers:
        return TransferPlan(steps)
    row_bytes = sum(g.copy_bytes for g, _, _ in gathers)
    per_step = max(page_size, staging_capacity // row_bytes // page_size * page_size)
    for w0 in range(0, n, per_step):
        rows, dst_rows = src_tokens[w0 : w0 + per_step], dst_tokens[w0 : w0 + per_step]
        starts, lens = _runs(np.diff(dst_rows) != 1, rows.size)
        blocks: List[np.ndarray] = []
        offset = staging_ptr
        for g, dst_ptr, dst_bytes in gathers:
            blocks.append(
                _blocks(
                    offset + starts * g.copy_bytes,
                    dst_ptr + dst_rows[starts] * dst_bytes,
                    lens * g.copy_bytes,
                )
            )
            offset += rows.size * g.copy_bytes
        steps.append(
            TransferStep(rows, [g for g, _, _ in gathers], np.concatenate(blocks))
        )
    return TransferPlan(steps)


def replica_of(
    src_token_bytes: int,
    src_tp_rank: int,
    src_attn_tp_size: int,
    dst_token_bytes: int,
    dst_head_tp_size: int,
) -> Tuple[int, int]:
    """``(replicas, replica)``: how many prefill ranks hold this rank's slice (``P > K`` on a GPU)
    and which of them this one is."""
    replicas = max(
        1, (src_token_bytes * src_attn_tp_size) // (dst_token_bytes * dst_head_tp_size)
    )
    return replicas, src_tp_rank % replicas


def head_slice_plan(
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
    staging_ptr: int = 0,
    staging_capacity: int = STAGING_BYTES_DEFAULT,
) -> TransferPlan:
    """The plan of one prefill -> decode DCP transfer of a GQA pool: for each KV entry (item
    lengths are page bytes, one page size on both sides) the decode rank's head slice of each
    token of the plan (``src_tokens`` -> ``dst_tokens``, rows of the two pools), in pages
    (``transfer_plan``). The layouts were checked once, when the decode registered
    (``layout_mismatch``); this runs on the transfer thread, where an exception would stop every
    later transfer."""
    head_rank, head_tp = decode_head_rank(dst_tp_rank, dst_attn_tp_size, dst_dcp_size)
    src_bytes = [n // page_size for n in src_item_lens]
    dst_bytes = [n // page_size for n in dst_item_lens]
    cuts = [
        token_slice(s, src_tp_rank, src_attn_tp_size, d, head_rank, head_tp)
        for s, d in zip(src_bytes, dst_bytes)
    ]
    replicas, replica = replica_of(
        src_bytes[0], src_tp_rank, src_attn_tp_size, dst_bytes[0], head_tp
    )
    return transfer_plan(
        src_ptrs,
        dst_ptrs,
        src_bytes,
        dst_bytes,
        cuts,
        src_tokens,
        dst_tokens,
        page_size=page_size,
        replicas=replicas,
        replica=replica,
        staging_ptr=staging_ptr,
        staging_capacity=staging_capacity,
    )


def decode_parts(
    prefill_attn_tp_size: int,
    decode_attn_tp_size: int,
    dcp_size: int,
    num_kv_heads: int,
) -> int:
    """How many prefill ranks each write a part of a decode rank's token (``min(P, K) / TPA``,
    at least 1): above 1 its received pages are part-major until ``unpack_part_major``.
    """
    tpa = decode_attn_tp_size // dcp_size
    return max(1, min(prefill_attn_tp_size, num_kv_heads) // tpa)


def pack_rows(step: TransferStep, staging) -> None:
    """Pack a step's rows into ``staging`` (a flat uint8 torch tensor the plan's staging pointer
    points at): on the CPU with numpy views of the prefill pool, on a GPU with upstream's DCP pack
    kernel (``copy_mla_rows_into_pack``, the same strided row gather)."""
    if not step.gathers or step.rows.size == 0:
        return
    if staging.device.type == "cpu":
        out = staging.numpy()
        offset, top = 0, int(step.rows.max())
        for g in step.gathers:
            flat = np.ctypeslib.as_array(
                ctypes.cast(g.src_ptr, ctypes.POINTER(ctypes.c_uint8)),
                shape=(top * g.src_token_bytes + g.copy_bytes,),
            )
            rows = np.lib.stride_tricks.as_strided(
                flat, shape=(top + 1, g.copy_bytes), strides=(g.src_token_bytes, 1)
            )
            size = step.rows.size * g.copy_bytes
            out[offset : offset + size].reshape(step.rows.size, g.copy_bytes)[:] = rows[
                step.rows
            ]
            offset += size
        return
    import torch

    from sglang.kernels.ops.kvcache.pd_dcp_gather import copy_mla_rows_into_pack

    copy_mla_rows_into_pack(
        [g.src_ptr for g in step.gathers],
        torch.as_tensor(step.rows, device=staging.device),
        staging,
        [g.copy_bytes for g in step.gathers],
        [g.src_token_bytes for g in step.gathers],
    )
    torch.get_device_module(staging.device).synchronize(staging.device)


def _bytes_at(ptr: int, nbytes: int, device):
    """A flat uint8 torch view of ``nbytes`` at ``ptr`` (host memory, or a GPU's)."""
    import torch

    if torch.device(device).type == "cpu":
        arr = np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), shape=(nbytes,)
        )
        return torch.from_numpy(arr)

    class _Device:
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }

    return torch.as_tensor(_Device(), device=device)


def unpack_part_major(
    ptrs: Sequence[int],
    page_bytes: Sequence[int],
    pages: np.ndarray,
    page_size: int,
    parts: int,
    device="cpu",
) -> None:
    """Put a decode rank's received pages back token-major: each K/V entry (at ``ptrs``, pages of
    ``page_bytes``) holds in page ``p`` of ``pages`` the ``parts`` blocks of ``page_size`` rows
    ``transfer_plan`` wrote part-major, made ``[page_size, parts, part bytes]``."""
    pages = np.asarray(pages, np.int64)
    if parts <= 1 or pages.size == 0:
        return
    import torch

    top = int(pages.max()) + 1
    for ptr, size in zip(ptrs, page_bytes):
        flat = _bytes_at(ptr, top * size, device).view(top, size)
        idx = torch.as_tensor(pages, device=flat.device)
        got = flat.index_select(0, idx).view(pages.size, parts, page_size, -1)
        flat.index_copy_(0, idx, got.transpose(1, 2).reshape(pages.size, size))


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
