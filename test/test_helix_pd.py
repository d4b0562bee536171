"""Helix decode in prefill/decode disaggregation: the relayout of a plain-TP prefill's KV into a
``--tp N --helix-kvp-size KVP`` decode server's shards (DCP's PD code, ``dcp_gqa``).

Unit tests (no server): the transfer plan with an interleave (against a brute force and, at
interleave 1, upstream's own formula), the rank mapping (every decode rank's head slice covered
exactly once by what its prefill ranks send; every prefill rank waits for exactly the decode ranks
that read it), and a whole simulated transfer -- P prefill pools, N decode pools in byte arrays,
moved by ``head_slice_plan`` over ``build_dcp_token_transfer_plan`` in chunks at the pools' real
addresses (sub-slices packed by ``pack_rows`` into a small staging, part-major pages put back by
``unpack_part_major``) -- against Helix's own layout (``kv_layout.write_rows``: what the decode
would have written had it run the prefill) and with each byte sent once; the plan's block count
per owned page, at deployment layouts (K = 8 and 4, replicas included), and its staging bound.
The end-to-end tests (``test_helix_pd_e2e``) start the real servers and the router.
"""

from __future__ import annotations

import ctypes
import itertools
import sys

import numpy as np
import pytest
import torch

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

from sglang.srt.disaggregation.common import dcp_gqa  # noqa: E402
from sglang.srt.disaggregation.common.utils import build_dcp_token_transfer_plan  # noqa: E402
from sglang.srt.layers.dcp.gqa_layout import write_rows  # noqa: E402


def _upstream_target_rows(src_pages, dst_pages, S, D, rank, src_page_offset, decode_prefix_len, n):
    """0.5.23's formula (interleave 1), verbatim in numpy: the reference the interleave keeps."""
    chunk_start = decode_prefix_len + src_page_offset * S
    offsets = np.arange((rank - chunk_start) % D, n, D, dtype=np.int64)
    local = (src_page_offset * S + offsets) // D
    return src_pages[offsets // S] * S + offsets % S, dst_pages[local // S] * S + local % S


@pytest.mark.parametrize("S,D,interleave", [(4, 2, 1), (4, 4, 1), (8, 2, 1), (4, 2, 4), (4, 4, 4), (8, 2, 8), (8, 4, 2)])
def test_plan_places_each_token_on_its_owner_row(S, D, interleave):
    rng = np.random.default_rng(S * 100 + D * 10 + interleave)
    for _ in range(20):
        n_pages = int(rng.integers(1, 12))
        src_pages = rng.permutation(64)[:n_pages].astype(np.int64)
        virtual = S * D
        decode_prefix_len = int(rng.integers(0, 3)) * virtual
        src_page_offset = int(rng.integers(0, 4))
        n = int(rng.integers(1, n_pages * S + 1))  # the last page partial
        dst_pages = rng.permutation(64)[: (src_page_offset * S + n) // virtual + 2].astype(np.int64)
        for rank in range(D):
            plan = build_dcp_token_transfer_plan(
                src_pages, dst_pages, physical_page_size=S, dcp_size=D, dcp_rank=rank,
                src_page_offset=src_page_offset, decode_prefix_len=decode_prefix_len, num_kv_tokens=n,
                interleave_size=interleave,
            )  # fmt: skip
            want_src, want_dst = [], []
            for o in range(n):  # brute force: token o of this chunk
                q = src_page_offset * S + o  # its position past decode_prefix_len
                if (q // interleave) % D != rank:
                    continue
                local = q // (interleave * D) * interleave + q % interleave
                want_src.append(src_pages[o // S] * S + o % S)
                want_dst.append(dst_pages[local // S] * S + local % S)
            assert plan.target_src_token_indices.tolist() == want_src
            assert plan.target_dst_token_indices.tolist() == want_dst
            if interleave == 1:
                up_src, up_dst = _upstream_target_rows(src_pages, dst_pages, S, D, rank, src_page_offset, decode_prefix_len, n)
                assert plan.target_src_token_indices.tolist() == up_src.tolist()
                assert plan.target_dst_token_indices.tolist() == up_dst.tolist()


LAYOUTS = [  # (prefill P, decode N, KVP, K)
    (p, n, kvp, k)
    for n, kvp, k in [(4, 2, 4), (4, 4, 4), (4, 2, 2), (8, 2, 4), (8, 4, 8), (4, 4, 1), (8, 8, 2)]
    for p in (1, 2, 4, 8)
    if (n // kvp) <= k
]


def _prefill_heads(p_rank, P, K):
    """The heads a plain --tp P prefill rank holds (one replicated head where P > K)."""
    if P <= K:
        return list(range(p_rank * K // P, (p_rank + 1) * K // P))
    return [p_rank // (P // K)]


@pytest.mark.parametrize("P,N,KVP,K", LAYOUTS)
def test_rank_mapping_covers_each_head_slice_once(P, N, KVP, K):
    head_bytes = 3
    readers = {r: 0 for r in range(P)}
    for d in range(N):
        ranks, dst_info, responses = dcp_gqa.prefill_ranks_for_decode(d, N, KVP, P)
        assert responses == len(ranks)
        head_rank, tpa = dcp_gqa.decode_head_rank(d, N, KVP)
        want = list(range(head_rank * K // tpa, (head_rank + 1) * K // tpa))
        got = [None] * (len(want) * head_bytes)
        for r in ranks:
            readers[r] += 1
            src = _prefill_heads(r, P, K)
            cut = dcp_gqa.token_slice(len(src) * head_bytes, r, P, len(want) * head_bytes, head_rank, tpa)
            assert cut is not None
            src_bytes = [(h, b) for h in src for b in range(head_bytes)]
            for i in range(cut.copy_bytes):
                got[cut.dst_offset + i] = src_bytes[cut.src_offset + i]
        assert got == [(h, b) for h in want for b in range(head_bytes)], (d, ranks)
    for r in range(P):  # each prefill rank waits for exactly the decode ranks that read it
        expect = dcp_gqa.prefill_ranks_for_decode(next(d for d in range(N) if r in dcp_gqa.prefill_ranks_for_decode(d, N, KVP, P)[0]), N, KVP, P)[1]
        assert readers[r] == expect


def test_rank_mapping_refuses_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="--tp 3"):
        dcp_gqa.prefill_ranks_for_decode(0, 4, 2, 3)


def _simulate(P, N, KVP, K, S, prompt_len, chunks, decode_prefix_len=0, D_head=2, n_layers=2, seed=0, staging_capacity=96):
    """A prefill of ``prompt_len`` tokens sent in ``chunks`` (token counts, page multiples but the
    last) to every decode rank; returns (decode pools, expected decode pools)."""
    rng = np.random.default_rng(seed)
    kv = rng.integers(0, 256, size=(n_layers, 2, prompt_len + decode_prefix_len, K, D_head), dtype=np.uint8)
    # prefill pools: per rank, per entry (layer K, layer V) [rows, heads_p, D_head]; random pages
    n_src_pages = 64
    src_pages = rng.permutation(n_src_pages)[: -(-prompt_len // S)].astype(np.int64)
    src_pools = []
    for r in range(P):
        heads = _prefill_heads(r, P, K)
        pool = np.zeros((n_layers * 2, n_src_pages * S, len(heads), D_head), np.uint8)
        for t in range(prompt_len):
            row = src_pages[t // S] * S + t % S
            for layer, kv_i in itertools.product(range(n_layers), range(2)):
                pool[layer * 2 + kv_i, row] = kv[layer, kv_i, decode_prefix_len + t, heads]
        src_pools.append(pool)
    # decode: logical ids in virtual pages of S * KVP, the same on every rank
    virtual = S * KVP
    total = decode_prefix_len + prompt_len
    dst_pages = rng.permutation(32)[: -(-total // virtual)].astype(np.int64)
    locs = torch.tensor([dst_pages[t // virtual] * virtual + t % virtual for t in range(total)])
    tpa = N // KVP
    dst_pools, want_pools = [], []
    for d in range(N):
        head_rank, kvp_rank = d // KVP, d % KVP
        heads = list(range(head_rank * K // tpa, (head_rank + 1) * K // tpa))
        rows = 32 * S
        dst, want = (np.zeros((n_layers * 2, rows, len(heads), D_head), np.uint8) for _ in range(2))
        owned_rows = write_rows(locs, kvp_rank, KVP, S)  # Helix's own layout: the oracle
        for t in range(decode_prefix_len, total):
            if owned_rows[t] >= 0:
                for layer, kv_i in itertools.product(range(n_layers), range(2)):
                    want[layer * 2 + kv_i, owned_rows[t]] = kv[layer, kv_i, t, heads]
        dst_pools.append(dst)
        want_pools.append(want)
    # the transfer: each decode rank from its prefill ranks, chunk by chunk, at the pools' real
    # addresses (blocks moved with memmove, sub-slices packed by pack_rows into a small staging)
    dst_prefix_pages = decode_prefix_len // virtual
    staging = torch.zeros(staging_capacity, dtype=torch.uint8)
    sent = [0] * N
    for d in range(N):
        ranks, _, _ = dcp_gqa.prefill_ranks_for_decode(d, N, KVP, P)
        for r in ranks:
            src, dst = src_pools[r], dst_pools[d]
            src_item = [src[0, :S].nbytes] * (n_layers * 2)
            dst_item = [dst[0, :S].nbytes] * (n_layers * 2)
            src_ptrs = [src[e].ctypes.data for e in range(n_layers * 2)]
            dst_ptrs = [dst[e].ctypes.data for e in range(n_layers * 2)]
            start = 0
            for size in chunks:
                page_offset = start // S
                plan = build_dcp_token_transfer_plan(
                    src_pages[page_offset : page_offset + -(-size // S)], dst_pages[dst_prefix_pages:],
                    physical_page_size=S, dcp_size=KVP, dcp_rank=d % KVP, src_page_offset=page_offset,
                    decode_prefix_len=decode_prefix_len, num_kv_tokens=size, interleave_size=S,
                )  # fmt: skip
                send = dcp_gqa.head_slice_plan(
                    src_ptrs, src_item, dst_ptrs, dst_item, S, plan.target_src_token_indices,
                    plan.target_dst_token_indices, src_tp_rank=r, src_attn_tp_size=P, dst_tp_rank=d,
                    dst_attn_tp_size=N, dst_dcp_size=KVP, staging_ptr=staging.data_ptr(),
                    staging_capacity=staging_capacity,
                )  # fmt: skip
                row_bytes = sum(g.copy_bytes for g in send.steps[-1].gathers) if send.steps else 0
                assert send.staged_bytes <= max(staging_capacity, S * row_bytes)  # bounded: a page at least
                for step in send.steps:
                    dcp_gqa.pack_rows(step, staging)
                    for s_addr, d_addr, length in step.blocks:
                        ctypes.memmove(int(d_addr), int(s_addr), int(length))
                        sent[d] += length
                start += size
            assert start == prompt_len
        # the decode rank, its transfer done: its pages back token-major (part-major when P > TPA)
        rows = write_rows(locs[decode_prefix_len:], d % KVP, KVP, S).numpy()
        pages = np.unique(rows[rows >= 0] // S)
        parts = dcp_gqa.decode_parts(P, N, KVP, K)
        dst = dst_pools[d]
        dcp_gqa.unpack_part_major([dst[e].ctypes.data for e in range(n_layers * 2)], [dst[0, :S].nbytes] * (n_layers * 2), pages, S, parts)
        # each byte once: what every prefill rank sent is the decode rank's KV
        assert sent[d] == (rows >= 0).sum() * dst_pools[d][0, 0].nbytes * n_layers * 2, (d, sent[d])
    return dst_pools, want_pools


CASES = [  # (name, prompt_len, chunks, decode_prefix_len) at page S = 4
    ("last_chunk_partial", 37, [16, 16, 5], 0),
    ("shorter_than_a_chunk", 3, [3], 0),
    ("ends_on_a_page", 32, [32], 0),
    ("one_chunk", 21, [21], 0),
    ("past_a_decode_prefix", 19, [8, 11], 16),
]


# and the deployment layouts at K = 8 (Llama-3.1-70B, Qwen2.5-72B) and K = 4 (Qwen3-235B-A22B):
# parts of the decode token (8 -> 8x2), replicas (16 -> 16x2), both (16 -> 8x2)
DEPLOYED = [(8, 8, 2, 8), (8, 16, 4, 8), (4, 8, 2, 8), (16, 16, 2, 8), (16, 8, 2, 8), (8, 8, 2, 4), (8, 16, 4, 4), (4, 8, 2, 4)]


@pytest.mark.parametrize("P,N,KVP,K", [c for c in LAYOUTS if c[1] == 4 and c[0] <= 4] + [(8, 8, 2, 4), (8, 4, 2, 2)] + DEPLOYED)
@pytest.mark.parametrize("name,prompt_len,chunks,decode_prefix_len", CASES, ids=[c[0] for c in CASES])
def test_relayout_fills_each_decode_rank_as_helix_would(P, N, KVP, K, name, prompt_len, chunks, decode_prefix_len):
    got, want = _simulate(P, N, KVP, K, 4, prompt_len, chunks, decode_prefix_len, seed=prompt_len + P)
    for d in range(N):
        np.testing.assert_array_equal(got[d], want[d], err_msg=f"decode rank {d}")


def test_whole_token_slices_move_in_runs():
    """P == TPA: a rank's owned tokens go as one block per run of the interleave, not per token."""
    plan = build_dcp_token_transfer_plan(
        np.arange(8), np.arange(4), physical_page_size=4, dcp_size=2, dcp_rank=1, num_kv_tokens=32, interleave_size=4
    )
    blocks = dcp_gqa.head_slice_plan(
        [0], [64], [0], [64], 4, plan.target_src_token_indices, plan.target_dst_token_indices,
        src_tp_rank=1, src_attn_tp_size=2, dst_tp_rank=2, dst_attn_tp_size=4, dst_dcp_size=2,
    ).blocks  # fmt: skip
    assert blocks[:, 2].tolist() == [64] * 4  # four runs of four 16-byte tokens


def _send_plans(P, N, KVP, K, S, n_tokens, d, head_bytes=256, entries=4, staging_capacity=dcp_gqa.STAGING_BYTES_DEFAULT):
    """Every prefill rank's plan to decode rank ``d`` for one ``n_tokens`` chunk (contiguous pools)."""
    src_item = [len(_prefill_heads(0, P, K)) * head_bytes * S] * entries
    dst_item = [K // (N // KVP) * head_bytes * S] * entries
    plan = build_dcp_token_transfer_plan(
        np.arange(-(-n_tokens // S)), np.arange(-(-n_tokens // (S * KVP))), physical_page_size=S, dcp_size=KVP,
        dcp_rank=d % KVP, num_kv_tokens=n_tokens, interleave_size=S,
    )  # fmt: skip
    ranks = dcp_gqa.prefill_ranks_for_decode(d, N, KVP, P).tp_ranks
    return plan, [
        dcp_gqa.head_slice_plan(
            [1 << 40] * entries, src_item, [2 << 40] * entries, dst_item, S, plan.target_src_token_indices,
            plan.target_dst_token_indices, src_tp_rank=r, src_attn_tp_size=P, dst_tp_rank=d, dst_attn_tp_size=N,
            dst_dcp_size=KVP, staging_ptr=3 << 40, staging_capacity=staging_capacity,
        )  # fmt: skip
        for r in ranks
    ]


@pytest.mark.parametrize("P,N,KVP,K", DEPLOYED + [(2, 8, 2, 8), (1, 8, 2, 4), (2, 16, 4, 4)])  # + packed sub-slices
def test_blocks_scale_with_pages_and_each_byte_is_sent_once(P, N, KVP, K):
    """Per decode rank, all its prefill ranks together: at most a block per owned page per K/V
    entry per part of the token (a block per token would be S times that), no more per page
    at twice the tokens, and as many bytes as the decode rank's KV."""
    S, entries, head_bytes = 16, 4, 256
    for d in range(N):
        per_page = []
        for n_tokens in (4096, 8192):
            plan, sends = _send_plans(P, N, KVP, K, S, n_tokens, d, head_bytes, entries)
            owned_pages = len(np.unique(plan.target_dst_token_indices // S))
            parts = dcp_gqa.decode_parts(P, N, KVP, K)
            blocks = sum(len(s.blocks) for s in sends)
            assert blocks <= entries * owned_pages * parts, (d, n_tokens, blocks, owned_pages)
            per_page.append(blocks / owned_pages)
            sent = sum(b[2] for s in sends for b in s.blocks)
            dst_token_bytes = K // (N // KVP) * head_bytes
            assert sent == plan.target_dst_token_indices.size * dst_token_bytes * entries
        assert per_page[1] <= per_page[0]  # no more blocks a page at twice the tokens


def test_staging_is_bounded_and_used_in_steps():
    """A --tp 1 prefill into --tp 8 --helix-kvp-size 2 (a quarter of each token): the packed bytes
    of a step stay within the staging, at least a page, and the steps cover every owned token."""
    S, entries, head_bytes = 16, 4, 256
    row_bytes = 8 // 4 * head_bytes * entries
    for capacity in (1, 5 * S * row_bytes + 7, 1 << 30):
        plan, sends = _send_plans(1, 8, 2, 8, S, 4096, 3, head_bytes, entries, staging_capacity=capacity)
        (send,) = sends
        assert send.staged_bytes == min(max(capacity // (S * row_bytes), 1) * S * row_bytes, plan.target_src_token_indices.size * row_bytes)
        assert np.concatenate([s.rows for s in send.steps]).tolist() == plan.target_src_token_indices.tolist()


@pytest.mark.parametrize("P,N,KVP,K", LAYOUTS)
def test_layout_check_accepts_every_served_layout(P, N, KVP, K):
    head = 32  # bytes of one head of one token
    src = len(_prefill_heads(0, P, K)) * head
    dst = K // (N // KVP) * head
    S = 4
    assert dcp_gqa.layout_mismatch([src * S] * 4, [dst * S] * 4, S, P, N, KVP, replicated_heads=True) is None
    if P <= K:  # no replica: the CPU engine serves it too
        assert dcp_gqa.layout_mismatch([src * S] * 4, [dst * S] * 4, S, P, N, KVP, replicated_heads=False) is None


def test_layout_check_refuses_a_cpu_prefill_that_padded_its_heads():
    """--tp 4 prefill of a K = 2 model on the CPU engine: 4 padded heads, one a rank; the decode's
    two head slices hold the model's 2 heads."""
    head, S = 32, 4
    why = dcp_gqa.layout_mismatch([head * S] * 4, [head * S] * 4, S, 4, 4, 2, replicated_heads=False)
    assert why is not None and "--tp 4" in why and "divides the model's KV heads" in why
    assert dcp_gqa.layout_mismatch([head * S] * 4, [head * S] * 4, S, 4, 4, 2, replicated_heads=True) is None
    assert "KV buffers" in dcp_gqa.layout_mismatch([head * S] * 4, [head * S] * 2, S, 2, 4, 2, replicated_heads=True)
