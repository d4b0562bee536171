"""Upstream's PD DCP send and rank mapping, run for one rank without a server or Mooncake.

``PrefillRank`` is the state ``MooncakeKVManager.send_kvcache_dcp`` reads (the real method, not a
copy), with an engine that records each ``batch_transfer_sync`` and, when asked, moves its blocks
with ``memmove`` (pools at real host addresses). ``host_pack_buffer`` is upstream's DCP pack
buffer (``StagingBuffer``, which 0.5.23 allocates on CUDA only) over host memory, for the real
``try_pack_dcp_src`` (its Triton kernel interpreted, ``TRITON_INTERPRET=1``); ``dry_pack`` stands
in for it over pointers, for plans at deployment sizes. ``decode_reads`` is the decode side's
``_resolve_rank_mapping`` in DCP's GQA mode. Used by test_helix_pd.py and bench_helix_pd_plan.py
(import it after ``sglang_helix.testing.cpu_env.STUB_DIR`` is on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import ctypes
from types import SimpleNamespace

import numpy as np
import torch

from sglang.srt.disaggregation.common import conn, dcp_pack
from sglang.srt.disaggregation.common.staging_buffer import StagingBuffer
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager


def decode_reads(d: int, n: int, kvp: int, p: int):
    """``(target prefill ranks, decode ranks each of them waits for, prefill ranks answering)`` of
    decode rank ``d`` of ``--tp n --helix-kvp-size kvp`` for a ``--tp p`` prefill."""
    rank = SimpleNamespace(
        attn_tp_size=n, dcp_size=kvp, kv_args=SimpleNamespace(engine_rank=d), is_mla_backend=False,
        is_hybrid_mla_backend=False, attn_cp_size=1, attn_cp_rank=0, pp_size=1, pp_rank=0,
    )  # fmt: skip
    info = conn.PrefillServerInfo(
        attn_tp_size=p, attn_cp_size=1, dp_size=1, pp_size=1, page_size=None, kv_cache_dtype=None,
        follow_bootstrap_room=True,
    )  # fmt: skip
    real = conn.get_parallel
    conn.get_parallel = lambda: SimpleNamespace(dcp_gqa_mode=True)
    try:
        conn.CommonKVManager._resolve_rank_mapping(rank, info)
    finally:
        conn.get_parallel = real
    return (
        info.target_tp_ranks,
        info.required_dst_info_num,
        info.required_prefill_response_num,
    )


class PrefillRank:
    """Prefill rank ``rank`` of a plain ``--tp p`` server of a model with ``k`` KV heads, its K/V
    entries at ``ptrs`` (pages of ``item_lens`` bytes), the last ``num_draft`` of them a speculative
    draft's. ``batches``: the block lists each ``batch_transfer_sync`` took, as ``[B, 3]`` arrays
    ``(src, dst, bytes)``."""

    send_kvcache_dcp = MooncakeKVManager.send_kvcache_dcp
    _transfer_data = MooncakeKVManager._transfer_data
    get_mla_kv_ptrs_with_pp = conn.CommonKVManager.get_mla_kv_ptrs_with_pp

    def __init__(
        self,
        rank,
        p,
        k,
        ptrs,
        item_lens,
        page_size,
        move=False,
        batch_indices=0,
        num_draft=0,
    ):
        self.is_mla_backend = self.is_hybrid_mla_backend = (
            self.enable_custom_mem_pool
        ) = False
        self.attn_tp_size, self.engine, self.move = p, self, move
        self.max_transfer_batch_indices = batch_indices
        self.kv_args = SimpleNamespace(
            page_size=page_size, kv_layer_ids=[], kv_data_ptrs=list(ptrs), kv_item_lens=list(item_lens),
            num_draft_entries=num_draft, engine_rank=rank, total_kv_head_num=k,
        )  # fmt: skip
        self.batches = []

    def batch_transfer_sync(self, session, src, dst, lengths) -> int:
        blocks = np.array([src, dst, lengths], dtype=np.int64).reshape(3, -1).T
        self.batches.append(blocks)
        if self.move:
            for s, d, n in blocks.tolist():
                ctypes.memmove(d, s, n)
        return 0

    def send(self, src_pages, dst_ptrs, dst_pages, dst_item_lens, *, dcp_size, dst_rank, dst_tp_size,
             src_page_offset, num_tokens, decode_prefix_len=0, pack=None) -> int:  # fmt: skip
        """One chunk to decode rank ``dst_rank`` (interleave = page, as Helix runs it)."""
        page = self.kv_args.page_size
        return self.send_kvcache_dcp(
            "session", np.asarray(src_pages), dst_ptrs, np.asarray(dst_pages),
            dcp_token_item_lens=[n // page for n in self.kv_args.kv_item_lens], dst_dcp_size=dcp_size,
            dst_dcp_rank=dst_rank % dcp_size, src_page_offset=src_page_offset, decode_prefix_len=decode_prefix_len,
            num_kv_tokens=num_tokens, executor=None, dst_layer_ids=[], pack_buffer=pack,
            dst_kv_item_lens=list(dst_item_lens), dst_tp_rank=dst_rank, dst_attn_tp_size=dst_tp_size,
            dst_dcp_interleave_size=page,
        )  # fmt: skip


def host_pack_buffer(nbytes: int):
    """Upstream's ``StagingBuffer`` over ``nbytes`` of host memory (its constructor accepts CUDA
    and XPU only): a host tensor and a stream object that has what ``try_pack_dcp_src`` calls.
    """

    class HostStream(torch.cpu.Stream):
        device = torch.device("cpu")

        def synchronize(self):
            pass

    buf = object.__new__(StagingBuffer)
    buf.size_bytes, buf.device, buf.gpu_id, buf.device_module = (
        nbytes,
        torch.device("cpu"),
        0,
        torch.cpu,
    )
    buf.buffer = torch.zeros(nbytes, dtype=torch.uint8)
    buf.data_ptr, buf._gather_stream = buf.buffer.data_ptr(), HostStream()
    return buf


@contextlib.contextmanager
def dry_pack(base: int = 3 << 44):
    """``try_pack_dcp_src`` over pointers: what it returns (each entry's rows packed one after the
    other from ``base``) without reading them; yields the list of bytes each call packed.
    """
    packed = []

    def pack(
        *,
        pack_buffer,
        kv_data_ptrs,
        src_token_indices,
        token_item_lens,
        pack_offset_bytes=0,
        **_,
    ):
        n = int(src_token_indices.size)
        offsets = np.concatenate(
            [[0], np.cumsum([n * int(w) for w in token_item_lens])]
        )
        packed.append(int(offsets[-1]))
        return [base + pack_offset_bytes + int(o) for o in offsets[:-1]], np.arange(
            n, dtype=np.int64
        )

    real = dcp_pack.try_pack_dcp_src
    dcp_pack.try_pack_dcp_src = pack
    try:
        yield packed
    finally:
        dcp_pack.try_pack_dcp_src = real
