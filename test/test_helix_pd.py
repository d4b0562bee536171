"""Helix decode in prefill/decode disaggregation: the relayout of a plain-TP prefill's KV into a
``--tp N --helix-kvp-size KVP`` decode server's shards (upstream's PD DCP code, ``dcp_gqa``).

Unit tests (no server): the transfer plan with an interleave (against a brute force and, at
interleave 1, upstream's own formula, and 0.5.23's own function from the pinned wheel over page-aligned
and unaligned decode prefixes: an MLA decode's plan), the rank mapping (upstream's ``_resolve_rank_mapping`` in
the mode: every head of a decode rank's slice read from the prefill ranks holding it, per
``compute_head_slice_params``; every prefill rank waits for exactly the decode ranks that read it),
and whole simulated transfers -- P prefill pools, N decode pools in byte arrays, each chunk sent by
upstream's ``MooncakeKVManager.send_kvcache_dcp`` (the real method, ``sglang_helix.testing.pd_send``)
with its blocks moved by ``memmove`` at the pools' real addresses, with upstream's DCP pack buffer
(the real ``try_pack_dcp_src``, its kernel interpreted) and without one (the CPU engine's case),
part-major pages put back by ``unpack_part_major`` -- against Helix's own layout
(``localize_dcp_indices``: what the decode would have written had it run the prefill), each byte
sent once; and the send's block count per owned page at deployment layouts (K = 8 and 4,
replicas included). The end-to-end tests (``test_helix_pd_e2e``) start the real servers.
"""

from __future__ import annotations

import itertools
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

from sglang.srt.disaggregation.common import dcp_gqa  # noqa: E402
from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params  # noqa: E402
from sglang.srt.disaggregation.common.utils import build_dcp_token_transfer_plan  # noqa: E402
from sglang.srt.layers.dcp.layout import localize_dcp_indices  # noqa: E402
from sglang_helix.testing.pd_send import PrefillRank, decode_reads, dry_pack, host_pack_buffer  # noqa: E402


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


def test_plan_at_interleave_1_is_0_5_23s_for_every_prefix():
    """An MLA decode (and any decode outside the GQA mode) registers interleave 1, where the plan is
    0.5.23's: the pinned wheel's own ``build_dcp_token_transfer_plan`` gives the same four arrays
    (values and dtype) over sampled decode prefixes, whole virtual pages and not (0.5.23 refuses a
    prefix that is not whole virtual pages with a ValueError; so does the series, in the same
    words), chunk offsets, partial last pages, empty chunks and DCP sizes that are not powers of two."""
    from sglang_helix.testing.pristine import pristine_module

    upstream = pristine_module("sglang/srt/disaggregation/common/utils.py").build_dcp_token_transfer_plan
    fields = ("target_src_token_indices", "target_dst_token_indices", "draft_src_token_indices", "draft_dst_token_indices")
    rng = np.random.default_rng(79)
    sampled = {"aligned": 0, "unaligned": 0}
    for _ in range(600):
        S, D = int(rng.choice([1, 2, 4, 16])), int(rng.choice([2, 3, 4, 8]))
        virtual, n_pages = S * D, int(rng.integers(0, 6))
        src_pages = rng.permutation(64)[:n_pages].astype(np.int32)
        src_page_offset = int(rng.integers(0, 4))
        decode_prefix_len = int(rng.integers(0, 4)) * virtual + int(rng.integers(0, virtual) if rng.random() < 0.5 else 0)
        n = None if rng.random() < 0.25 else int(rng.integers(0, n_pages * S + 1))
        dst_pages = rng.permutation(64)[: (src_page_offset + n_pages) * S // virtual + 2].astype(np.int32)
        kwargs = dict(physical_page_size=S, dcp_size=D, dcp_rank=int(rng.integers(0, D)), src_page_offset=src_page_offset,
                      decode_prefix_len=decode_prefix_len, num_kv_tokens=n)  # fmt: skip
        sampled["aligned" if decode_prefix_len % virtual == 0 else "unaligned"] += 1
        try:
            want = upstream(src_pages, dst_pages, **kwargs)
        except ValueError as e:
            with pytest.raises(ValueError) as info:
                build_dcp_token_transfer_plan(src_pages, dst_pages, **kwargs, interleave_size=1)
            assert str(info.value) == str(e), kwargs
            continue
        got = build_dcp_token_transfer_plan(src_pages, dst_pages, **kwargs, interleave_size=1)
        for field in fields:
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and np.array_equal(a, b), (field, kwargs, a, b)
    assert min(sampled.values()) > 200, sampled


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


def _parts(P, N, KVP, K):
    """How many prefill ranks hold distinct parts of a decode rank's heads (part-major pages)."""
    return max(1, min(P, K) // (N // KVP))


@pytest.mark.parametrize("P,N,KVP,K", LAYOUTS)
def test_rank_mapping_reads_each_head_from_the_ranks_holding_it(P, N, KVP, K):
    tpa = N // KVP
    waits = {r: [] for r in range(P)}
    for d in range(N):
        ranks, dst_info, responses = decode_reads(d, N, KVP, P)
        assert responses == len(ranks)
        head_rank = d // KVP
        want = list(range(head_rank * K // tpa, (head_rank + 1) * K // tpa))
        got = []
        for r in ranks:
            waits[r].append(dst_info)
            src_start, heads, dst_start, _ = compute_head_slice_params(P, tpa, r, head_rank, K)
            share = _prefill_heads(r, P, K)[src_start : src_start + heads]
            assert share == want[dst_start : dst_start + heads], (d, r)
            got += share
        assert sorted(got) == sorted(want * max(1, P // K)), (d, ranks)  # every replica of each head
    for r in range(P):  # each prefill rank waits for exactly the decode ranks that read it
        assert waits[r] == [len(waits[r])] * len(waits[r]) and waits[r], (r, waits[r])


@pytest.mark.parametrize("P,N,KVP,K", LAYOUTS + [(p, n, 1, 8) for p in (1, 2, 4, 8) for n in (1, 2, 4, 8)])
def test_linear_attention_states_come_once_from_the_ranks_holding_them(P, N, KVP, K):
    """A hybrid model's (Qwen3.5's) Gated DeltaNet states are plain TP over all N decode ranks, each
    rank 1/N of the state heads, while in the mode a decode rank reads the prefill ranks of its DCP
    group's KV head slice. Of those, the ranks ``dcp_gqa.state_slices_overlap`` lets send states
    cover the decode rank's heads exactly once (the others hold none of them: their slice written at
    its offset was the KVP 4 bug, a p2 -> kvp4 pair serving wrong tokens); at KVP 1 (upstream's
    mapping, no DCP) every rank read overlaps, so plain PD sends what 0.5.23 sends."""
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_blocks

    heads = P * N  # state heads: whole shares on both sides
    src_dim, dst_dim = heads // P, heads // N
    for d in range(N):
        ranks = decode_reads(d, N, KVP, P)[0] if KVP > 1 else _plain_reads(d, N, P)
        senders = [r for r in ranks if dcp_gqa.state_slices_overlap(r, P, d, N)]
        if KVP == 1:
            assert senders == ranks, (d, ranks)
        slot = [[] for _ in range(dst_dim)]  # what lands at each head of d's state slot
        for r in senders:  # what the prefill sends (mooncake's state send: whole, or sliced)
            blocks = [(0, 0, src_dim)] if P == N else compute_mamba_state_slice_blocks(
                src_dim, dst_dim, P, N, d, r
            )  # fmt: skip
            for src_start, dst_start, num in blocks:
                for k in range(num):
                    slot[dst_start + k].append(r * src_dim + src_start + k)
        want = [[h] for h in range(d * dst_dim, (d + 1) * dst_dim)]
        assert slot == want, (d, ranks, senders, slot)


def _plain_reads(d, N, P):
    """Upstream's plain-TP mapping: the prefill ranks a --tp N decode rank reads."""
    return [d // (N // P)] if N >= P else list(range(d * (P // N), (d + 1) * (P // N)))


def test_rank_mapping_refuses_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="--tp 3"):
        decode_reads(0, 4, 2, 3)


def _simulate(
    P, N, KVP, K, S, prompt_len, chunks, decode_prefix_len=0, D_head=2, n_layers=2, seed=0, pack=False, n_draft=0
):  # fmt: skip
    """A prefill of ``prompt_len`` tokens sent in ``chunks`` (token counts, page multiples but the
    last) to every decode rank by upstream's send; returns (decode pools, expected decode pools).
    ``n_draft`` more layers are a speculative draft's (the last K/V entries, ``num_draft_entries``):
    on the prefill at the target's rows (upstream: a draft shares the target's token ids), on the
    decode sharded like the target's (the mode's draft pool), so expected in Helix's layout too."""
    rng = np.random.default_rng(seed)
    num_draft, n_layers = 2 * n_draft, n_layers + n_draft
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
        owned_rows = localize_dcp_indices(locs.to(torch.int64), KVP, kvp_rank, S)  # Helix's own layout: the oracle
        for t in range(decode_prefix_len, total):
            if owned_rows[t] >= 0:
                for layer, kv_i in itertools.product(range(n_layers), range(2)):
                    want[layer * 2 + kv_i, owned_rows[t]] = kv[layer, kv_i, t, heads]
        dst_pools.append(dst)
        want_pools.append(want)
    # the transfer: each decode rank from its prefill ranks, chunk by chunk, by upstream's send at
    # the pools' real addresses (its blocks moved with memmove, in batches of 7 blocks)
    dst_prefix_pages = decode_prefix_len // virtual
    entries = n_layers * 2
    for d in range(N):
        ranks, _, _ = decode_reads(d, N, KVP, P)
        sent = 0
        dst = dst_pools[d]
        dst_item, dst_ptrs = [dst[0, :S].nbytes] * entries, [dst[e].ctypes.data for e in range(entries)]
        for r in ranks:
            src = src_pools[r]
            rank = PrefillRank(r, P, K, [src[e].ctypes.data for e in range(entries)], [src[0, :S].nbytes] * entries,
                               S, move=True, batch_indices=7, num_draft=num_draft)  # fmt: skip
            start = 0
            for size in chunks:
                page_offset = start // S
                buffer = host_pack_buffer(size * src[0, 0].nbytes * entries) if pack else None
                assert rank.send(
                    src_pages[page_offset : page_offset + -(-size // S)], dst_ptrs, dst_pages[dst_prefix_pages:],
                    dst_item, dcp_size=KVP, dst_rank=d, dst_tp_size=N, src_page_offset=page_offset, num_tokens=size,
                    decode_prefix_len=decode_prefix_len, pack=buffer,
                ) == 0  # fmt: skip
                start += size
            assert start == prompt_len
            assert all(len(b) <= 7 for b in rank.batches)
            sent += sum(int(b[:, 2].sum()) for b in rank.batches)
        # the decode rank, its transfer done: its pages back token-major (part-major when P > TPA)
        rows = localize_dcp_indices(locs[decode_prefix_len:].to(torch.int64), KVP, d % KVP, S).numpy()
        pages = np.unique(rows[rows >= 0] // S)
        args = SimpleNamespace(kv_data_ptrs=dst_ptrs, kv_item_lens=dst_item, num_draft_entries=num_draft, page_size=S,
                               total_kv_head_num=K, gpu_id=0)  # fmt: skip
        dcp_gqa.unpack_part_major(SimpleNamespace(kv_args=args, dcp_size=KVP, attn_tp_size=N), pages, P, "cpu")
        # each byte once: what every prefill rank sent is the decode rank's KV
        assert sent == (rows >= 0).sum() * dst[0, 0].nbytes * entries, (d, sent)
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


@pytest.mark.parametrize("P,N,KVP,K", [(1, 4, 2, 4), (2, 4, 4, 4), (4, 4, 2, 4), (2, 8, 2, 8), (16, 8, 2, 8)])
def test_relayout_through_upstreams_pack_buffer(P, N, KVP, K):
    """With upstream's DCP pack buffer (a GPU prefill's): every row packed by ``try_pack_dcp_src``
    (a sub-slice as a strided row), then sent from it."""
    got, want = _simulate(P, N, KVP, K, 4, 37, [16, 16, 5], seed=P, pack=True)
    for d in range(N):
        np.testing.assert_array_equal(got[d], want[d], err_msg=f"decode rank {d}")


# A speculative draft's KV (Qwen3.5's MTP layer, an EAGLE head) on a decode in the mode: sharded like
# its target (the KV cache patch), so its entries take the target's relayout -- the owned tokens at
# the target's rows, the same head slice, part-major pages put back -- not upstream's replicated
# draft path (every token at its widened id). Layouts: whole tokens, sub-slices (P < TPA), parts
# (P > TPA), replicas (P > K), with and without upstream's pack buffer.
@pytest.mark.parametrize(
    "P,N,KVP,K,pack",
    [(2, 4, 2, 2, False), (1, 4, 2, 2, False), (2, 4, 4, 2, False), (1, 4, 4, 2, False), (4, 4, 2, 4, False),
     (8, 8, 2, 4, False), (16, 8, 2, 8, False), (1, 4, 2, 4, True), (16, 8, 2, 8, True)],
)  # fmt: skip
@pytest.mark.parametrize("name,prompt_len,chunks,decode_prefix_len", CASES[:1] + CASES[-1:], ids=["partial", "prefix"])
def test_a_drafts_kv_is_relaid_out_like_the_targets(P, N, KVP, K, pack, name, prompt_len, chunks, decode_prefix_len):
    got, want = _simulate(P, N, KVP, K, 4, prompt_len, chunks, decode_prefix_len, seed=P + K, pack=pack, n_draft=1)
    for d in range(N):
        np.testing.assert_array_equal(got[d][-2:], want[d][-2:], err_msg=f"decode rank {d}: the draft's K/V")
        np.testing.assert_array_equal(got[d], want[d], err_msg=f"decode rank {d}")


def _sends(P, N, KVP, K, S, n_tokens, d, head_bytes=256, entries=4, pack=True):
    """Every prefill rank's send to decode rank ``d`` of one ``n_tokens`` chunk, over pointers
    (the decode's pages in descending order: no two adjacent by luck); returns (the token plan, each
    rank's batches of blocks)."""
    src_item = [len(_prefill_heads(0, P, K)) * head_bytes * S] * entries
    dst_item = [K // (N // KVP) * head_bytes * S] * entries
    dst_pages = np.arange(-(-n_tokens // (S * KVP)))[::-1].copy()
    plan = build_dcp_token_transfer_plan(
        np.arange(-(-n_tokens // S)), dst_pages, physical_page_size=S, dcp_size=KVP, dcp_rank=d % KVP,
        num_kv_tokens=n_tokens, interleave_size=S,
    )  # fmt: skip
    blocks = []
    with dry_pack():
        for r in decode_reads(d, N, KVP, P)[0]:
            rank = PrefillRank(r, P, K, [(1 << 40) + e * (1 << 32) for e in range(entries)], src_item, S)
            rank.send(np.arange(-(-n_tokens // S)), [(2 << 40) + e * (1 << 32) for e in range(entries)], dst_pages,
                      dst_item, dcp_size=KVP, dst_rank=d, dst_tp_size=N, src_page_offset=0, num_tokens=n_tokens,
                      pack=object() if pack else None)  # fmt: skip
            blocks.append(rank.batches)
    return plan, blocks


def test_whole_token_slices_move_in_runs():
    """P == TPA: a rank's owned tokens go as one block per run of the interleave, not per token."""
    _, [(blocks,)] = _sends(2, 4, 2, 4, 4, 32, 2, head_bytes=8, entries=1, pack=False)
    assert blocks[:, 2].tolist() == [64] * 4  # four runs of four 16-byte tokens


@pytest.mark.parametrize("P,N,KVP,K", DEPLOYED + [(2, 8, 2, 8), (1, 8, 2, 4), (2, 16, 4, 4)])  # + packed sub-slices
def test_blocks_scale_with_pages_and_each_byte_is_sent_once(P, N, KVP, K):
    """Per decode rank, all its prefill ranks together: a block per owned page per K/V entry per
    part of the token (a block per token would be S times that), at any length, and as many bytes
    as the decode rank's KV."""
    S, entries, head_bytes = 16, 4, 256
    for d in range(N):
        for n_tokens in (4096, 8192):
            plan, sends = _sends(P, N, KVP, K, S, n_tokens, d, head_bytes, entries)
            owned_pages = len(np.unique(plan.target_dst_token_indices // S))
            sends = [np.concatenate(batches) for batches in sends]
            blocks = sum(len(s) for s in sends)
            assert blocks == entries * owned_pages * _parts(P, N, KVP, K), (d, n_tokens, blocks, owned_pages)
            sent = sum(int(s[:, 2].sum()) for s in sends)
            dst_token_bytes = K // (N // KVP) * head_bytes
            assert sent == plan.target_dst_token_indices.size * dst_token_bytes * entries


def test_without_a_pack_buffer_a_sub_slice_moves_per_token():
    """The CPU engine (no DCP pack buffer, as in 0.5.23): a --tp 1 prefill's quarter of each token
    goes a block per token, in batches the TCP transport queues; the bytes are the same."""
    plan, [packed] = _sends(1, 8, 2, 8, 16, 4096, 3)
    _, [unpacked] = _sends(1, 8, 2, 8, 16, 4096, 3, pack=False)
    assert [len(b) for b in unpacked[:-1]] == [512] * (len(unpacked) - 1)  # half of the per-peer queue
    packed, unpacked = np.concatenate(packed), np.concatenate(unpacked)
    assert len(unpacked) == plan.target_src_token_indices.size * 4 and len(packed) <= len(unpacked) // 16
    assert unpacked[:, 2].sum() == packed[:, 2].sum()


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


# ----------------------------------------------------------------------------------------------
# Plain PD outside the mode keeps 0.5.23's code (issue 79): the registration, the pack buffers
# (the prefill's index path: test_cpu_pd_paths.py). References: the pinned wheel's own functions.
# ----------------------------------------------------------------------------------------------
def _registering_decode(interleave: int):
    """A Mooncake decode manager as ``build_receiver_registration_message`` reads it."""
    kv_args = SimpleNamespace(
        kv_data_ptrs=[4096, 8192], aux_data_ptrs=[512], state_data_ptrs=[[1024]], state_item_lens=[[64]],
        state_dim_per_tensor=[], state_layer_ids=[[0]], kv_layer_ids=[0, 1], engine_rank=3,
        kv_item_lens=[2048, 2048], gpu_id=0,
    )
    return SimpleNamespace(
        get_session_id=lambda: "127.0.0.1:7000", kv_args=kv_args, attn_tp_size=2, dcp_size=2,
        dcp_rank=1, enable_staging=False, local_ip="127.0.0.1", rank_port=7001, kv_buffer_tensors=None,
        _staging_ctx=SimpleNamespace(allocator=None),
    )


@pytest.mark.parametrize("interleave", [1, 4])
def test_only_a_decode_in_the_mode_registers_its_interleave(monkeypatch, interleave):
    """A decode outside the mode (interleave 1) sends 0.5.23's registration fields, exactly; one in
    the mode adds its interleave at the end, which the prefill reads back (absent: 1)."""
    from sglang.srt.disaggregation.mooncake import conn
    from sglang_helix.testing.pristine import pristine_module

    upstream = pristine_module("sglang/srt/disaggregation/mooncake/conn.py")
    parallel = SimpleNamespace(dcp_interleave_size=interleave, enable_kv_cache_sharding=False)
    monkeypatch.setattr(conn, "get_parallel", lambda: parallel)
    monkeypatch.setattr(upstream, "get_parallel", lambda: parallel)
    decode = _registering_decode(interleave)
    ours = conn.MooncakeKVManager.build_receiver_registration_message(decode)
    theirs = upstream.MooncakeKVManager.build_receiver_registration_message(decode)
    if interleave == 1:
        assert ours == theirs
    else:
        assert ours[:-1] == theirs and ours[-1] == b"4"
    for msg, want in ((ours, interleave), (theirs, 1)):
        assert conn.KVArgsRegisterInfo.from_zmq(msg).dst_dcp_interleave_size == want


@pytest.mark.parametrize("mla", [True, False])
def test_a_gqa_prefill_allocates_no_pack_buffers(monkeypatch, mla):
    """When a DCP decode registers, an MLA prefill allocates 0.5.23's pack buffers (outside its
    pool, as 0.5.23 does); a GQA prefill (a decode in the mode) allocates none, so a plain GQA
    prefill server at its memory limit takes nothing its pool sizing did not count: its send goes
    from the pool, a block per run of rows (``pack_buffer`` None, as on the CPU engine)."""
    from sglang.srt.disaggregation.common import conn, dcp_pack
    from sglang_helix.testing.pristine import pristine_module

    allocated = []

    def init_dcp_pack_buffers(register_fn, kv_args, count, dcp_size, max_tokens, **kw):
        allocated.append((count, dcp_size))
        return ["buffer"] * count

    monkeypatch.setattr(dcp_pack, "init_dcp_pack_buffers", init_dcp_pack_buffers)
    monkeypatch.setattr(conn, "max_prefill_buffer_tokens", lambda: 8192)
    upstream = pristine_module("sglang/srt/disaggregation/common/conn.py")
    monkeypatch.setattr(upstream, "max_prefill_buffer_tokens", lambda: 8192)
    for module in (conn, upstream):
        monkeypatch.setattr(module, "get_device", lambda: SimpleNamespace(device="cuda"))

    def prefill():
        return SimpleNamespace(
            _dcp_pack_buffers=None, kv_args=SimpleNamespace(kv_item_lens=[4096], page_size=1, gpu_id=0),
            is_mla_backend=mla, is_hybrid_mla_backend=False, transfer_queues=[0] * 4,
            _register_staging_memory=lambda ptr, size: None,
        )

    ours, theirs = prefill(), prefill()
    conn.CommonKVManager._init_dcp_pack_buffers_once(ours, 2, include_draft=True)
    if mla:  # 0.5.23's allocation, unchanged
        upstream.CommonKVManager._init_dcp_pack_buffers_once(theirs, 2, include_draft=True)
        assert allocated == [(4, 2), (4, 2)] and ours._dcp_pack_buffers == theirs._dcp_pack_buffers == ["buffer"] * 4
    else:
        assert allocated == [] and ours._dcp_pack_buffers == []
        conn.CommonKVManager._init_dcp_pack_buffers_once(ours, 2, include_draft=True)  # every registration
        assert allocated == []
