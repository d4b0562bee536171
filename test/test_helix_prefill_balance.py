"""Prefill attention work is split over the KVP ranks: no rank does most of it.

A deterministic counter of the (query, key) pairs each rank's attention computes per layer, from
the metadata the real code builds:

- triton: ``TritonExtendLists`` (attention.py), the lists of the three extend calls: every query
  over the owned prefix, each ownership-chunk segment over the owned new tokens before it, each
  segment causally over itself (on every rank; kept where owned);
- torch_native: every query over the owned keys at positions <= its own (``local_kv_indices``
  over ``[0, seq_len)`` with the positional mask).

For a 6,000-token prompt prefilled in chunks of 2,048 tokens (and a batch mixing it with a short
request and a request extending a prefix that is not chunk-aligned), at KVP 2/4/8 and chunk 64:
the busiest rank does at most 1.2x the mean, and the ranks together do what one plain-TP rank
does (each pair once; plus, on triton, the segments' own causal sliver on the ranks that do not
keep it: a segment x segment sliver, ~3% of a 2,048-token chunk's pairs per rank). Before the
split, KVP rank 0 computed every chunk's causal attention over itself alone: on the prompt's second
chunk the same counter gives it 1.3x (KVP 2) to 3.3x (KVP 8) the mean, and KVP x on the first.
"""

from __future__ import annotations

import os
import sys

# No kernel runs here, but the modules imported below import Triton kernels: interpreted, as every
# in-process kernel test of this suite needs them (test_helix_fp8_kv.py), whichever runs first.
os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

if STUB_DIR not in sys.path:  # the sglang imports below pull in sgl_kernel
    sys.path.insert(0, STUB_DIR)

from sglang.srt.layers.dcp import gqa_layout as kv_layout  # noqa: E402
from sglang.srt.layers.dcp.gqa_attention import DcpGqaForwardMetadata, TritonExtendLists  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

CHUNK = 64
PROMPT, PREFILL_CHUNK = 6000, 2048


def _forward_batch(reqs, req_to_token):
    """(slot, prefix_len, seq_len) per request: the ForwardBatch fields the metadata reads."""
    slots = torch.tensor([s for s, _, _ in reqs])
    prefix = torch.tensor([p for _, p, _ in reqs])
    seq = torch.tensor([n for _, _, n in reqs])
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, spec_info=None,
        req_pool_indices=slots, seq_lens=seq, seq_lens_cpu=seq,
        extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix.tolist(),
        extend_seq_lens=seq - prefix, extend_seq_lens_cpu=(seq - prefix).tolist(),
    )  # fmt: skip


def _pool(kvp: int, slots: int = 3, max_len: int = PROMPT + 64) -> torch.Tensor:
    """req_to_token with paged logical locs (loc % page == pos % page), page 0 reserved."""
    page = CHUNK * kvp
    pages = -(-max_len // page)
    base = (1 + torch.arange(slots)[:, None] * pages) * page
    return (base + torch.arange(pages * page)[None, :]).to(torch.int32)


def _lens(indptr: torch.Tensor) -> list:
    return (indptr[1:] - indptr[:-1]).tolist()


def triton_pairs(reqs, kvp_rank: int, kvp: int, pool: torch.Tensor) -> int:
    fb = _forward_batch(reqs, pool)
    meta = DcpGqaForwardMetadata(kvp_rank, kvp, CHUNK)
    x = TritonExtendLists.build(fb, meta, pool)
    prefix = sum(e * n for e, n in zip(x.extend_lens_cpu, _lens(x.prefix_kv_indptr)))
    earlier = sum(e * n for e, n in zip(x.seg_lens_cpu, _lens(x.seg_kv_indptr)))
    own_segment = sum(e * (e + 1) // 2 for e in x.seg_lens_cpu)
    return prefix + earlier + own_segment


def torch_pairs(reqs, kvp_rank: int, kvp: int, pool: torch.Tensor) -> int:
    """Pairs (query, owned key at a position <= the query's) of the torch path's masked softmax."""
    total = 0
    for slot, prefix, seq in reqs:
        local = torch.arange(kv_layout.total_local_len([seq], kvp_rank, kvp, CHUNK))
        positions = kv_layout.global_position(local, kvp_rank, kvp, CHUNK)
        for q in range(prefix, seq):
            total += int((positions <= q).sum())
    return total


def plain_pairs(reqs) -> int:
    return sum((seq * (seq + 1) - prefix * (prefix + 1)) // 2 for _, prefix, seq in reqs)


def _batches():
    """The chunked prefill of one long prompt, and a mixed batch."""
    for start in range(0, PROMPT, PREFILL_CHUNK):
        yield f"chunk@{start}", [(0, start, min(PROMPT, start + PREFILL_CHUNK))]
    # a short request, and one extending a prefix that is not a whole number of chunks
    yield "mixed", [(0, 4096, 6000), (1, 0, 37), (2, 1000, 2100)]


@pytest.mark.parametrize("kvp", [2, 4, 8])
@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_busiest_rank_does_at_most_1_2x_the_mean(backend, kvp):
    pool = _pool(kvp)
    count = triton_pairs if backend == "triton" else torch_pairs
    for what, reqs in _batches():
        if backend == "torch_native" and what != "mixed" and not what.endswith("@4096"):
            continue  # the torch counter is a Python loop over queries: one chunk is enough
        work = [count(reqs, r, kvp, pool) for r in range(kvp)]
        mean = sum(work) / kvp
        assert max(work) <= 1.2 * mean, f"{backend} KVP {kvp} {what}: pairs per rank {work}"
        exact = plain_pairs(reqs)
        if backend == "torch_native":
            assert sum(work) == exact, (what, work, exact)
        else:  # each pair once, plus every segment's own causal part on the ranks that drop it
            sliver = sum(e * (e + 1) // 2 for e in kv_layout.extend_segments(
                [p for _, p, _ in reqs], [n - p for _, p, n in reqs], CHUNK)[2])  # fmt: skip
            assert sum(work) == exact + (kvp - 1) * sliver, (what, work, exact, sliver)


def test_before_the_split_rank_0_did_most_of_a_chunk():
    """The old scheme (owned prefix everywhere, the chunk over itself on KVP rank 0 only) on the
    same counter: what the test above would have caught."""
    for kvp in (2, 4, 8):
        prefix, seq = PREFILL_CHUNK, 2 * PREFILL_CHUNK  # the prompt's second chunk
        owned_prefix = [int(kv_layout.local_kv_lens(prefix, r, kvp, CHUNK)) for r in range(kvp)]
        e = seq - prefix
        work = [e * owned_prefix[r] + (e * (e + 1) // 2 if r == 0 else 0) for r in range(kvp)]
        assert max(work) > 1.2 * sum(work) / kvp, work


@pytest.mark.parametrize("kvp", [2, 3, 4])
def test_segments_tile_the_new_tokens_and_the_lists_hold_only_owned_keys(kvp):
    pool = _pool(kvp)
    reqs = [(0, 100, 333), (1, 0, 5), (2, 128, 256)]
    segments = kv_layout.extend_segments([p for _, p, _ in reqs], [n - p for _, p, n in reqs], CHUNK)
    request, start, length = segments
    assert sum(length) == sum(n - p for _, p, n in reqs)
    for b, st, ln in zip(request, start, length):
        assert st // CHUNK == (st + ln - 1) // CHUNK  # one ownership chunk each
    for r in range(kvp):
        fb = _forward_batch(reqs, pool)
        x = TritonExtendLists.build(fb, DcpGqaForwardMetadata(r, kvp, CHUNK), pool)
        indptr = x.seg_kv_indptr.tolist()
        for s, (b, st) in enumerate(zip(request, start)):
            slot, prefix, _ = reqs[b]
            want = [p for p in range(prefix, st) if (p // CHUNK) % kvp == r]
            loc = pool[slot, want].long()
            rows = ((loc // (CHUNK * kvp)) * CHUNK + loc % CHUNK).tolist()  # the owner's compact row
            assert x.seg_kv_indices[indptr[s] : indptr[s + 1]].tolist() == rows, (r, s)
        owned = torch.cat([torch.full((ln,), (st // CHUNK) % kvp == r) for st, ln in zip(start, length)])
        assert torch.equal(x.seg_owned, owned)
