"""Prefill attention work over the KVP ranks, counted from the metadata the real code builds.

A deterministic counter of the (query, key) pairs each rank's attention computes per layer:

- torch_native: every query over the owned keys at positions <= its own (``create_kv_indices_for_dcp_torch``
  over ``[0, seq_len)`` with the positional mask): balanced by construction, each pair once;
- triton: upstream DCP's extend (``_forward_extend_dcp``, which serves the GQA mode): every query
  over this rank's share of the prefix (the backend's own lists, ``init_forward_metadata``), and the
  chunk's causal attention over itself on every rank (from the K/V in hand). The prefix share is
  balanced; the chunk's own part is computed KVP times: (KVP - 1) x chunk^2 / 2 pairs more than
  plain TP in all, bounded by ``--chunked-prefill-size`` (docs/helix-design.md, section 3).

For a 6,000-token prompt prefilled in chunks of 2,048 tokens (and a batch mixing it with a short
request and a request extending a prefix that is not chunk-aligned), at KVP 2/4/8 and chunk 64:
the busiest rank does at most 1.2x the mean of the prefix share.
"""

from __future__ import annotations

import os
import sys

# No kernel runs here, but the modules imported below import Triton kernels: interpreted, as every
# in-process kernel test of this suite needs them (test_helix_attention.py), whichever runs first.
os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

if STUB_DIR not in sys.path:  # the sglang imports below pull in sgl_kernel
    sys.path.insert(0, STUB_DIR)

from sglang.srt.layers.dcp.layout import get_dcp_lens, get_dcp_positions  # noqa: E402
from sglang_helix.testing.dcp_ranks import Ranks, Shape  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

CHUNK = 64
PROMPT, PREFILL_CHUNK = 6000, 2048


def _forward_batch(reqs, req_to_token):
    """(slot, prefix_len, seq_len) per request: the ForwardBatch fields the metadata reads."""
    slots = torch.tensor([s for s, _, _ in reqs])
    prefix = torch.tensor([p for _, p, _ in reqs])
    seq = torch.tensor([n for _, _, n in reqs])
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, spec_info=None, batch_size=len(reqs), seq_lens_sum=int(seq.sum()),
        kv_loc_plan=None, out_cache_loc=None, encoder_lens=None,
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


def triton_prefix_pairs(reqs, kvp: int) -> list:
    """Per rank, the (query, prefix key) pairs of the Triton DCP extend's prefix call: each query
    over the keys of its request's prefix that the rank's lists (the backend's own) hold."""
    ranks = Ranks(Shape(kvp=kvp, chunk=CHUNK, slots=3, max_len=PROMPT + 64, heads=kvp, kv_heads=1), "triton")
    batch = _forward_batch(reqs, ranks.req_to_token)

    def count(rank):
        ranks.backends[rank].init_forward_metadata(batch)
        owned = _lens(ranks.backends[rank].forward_metadata.kv_indptr)
        return sum((n - p) * o for (_, p, n), o in zip(reqs, owned))

    return ranks.run(count)


def torch_pairs(reqs, kvp_rank: int, kvp: int, pool: torch.Tensor) -> int:
    """Pairs (query, owned key at a position <= the query's) of the torch path's masked softmax."""
    total = 0
    for slot, prefix, seq in reqs:
        local = torch.arange(int(get_dcp_lens(torch.tensor([seq]), kvp, kvp_rank, interleave_size=CHUNK)))
        positions = get_dcp_positions(local, kvp, kvp_rank, interleave_size=CHUNK)
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
def test_torch_native_busiest_rank_does_at_most_1_2x_the_mean(kvp):
    pool = _pool(kvp)
    for what, reqs in _batches():
        if what != "mixed" and not what.endswith("@4096"):
            continue  # the counter is a Python loop over queries: one chunk is enough
        work = [torch_pairs(reqs, r, kvp, pool) for r in range(kvp)]
        assert max(work) <= 1.2 * sum(work) / kvp, f"KVP {kvp} {what}: pairs per rank {work}"
        assert sum(work) == plain_pairs(reqs), (what, work)


@pytest.mark.parametrize("kvp", [2, 4, 8])
def test_triton_prefix_share_is_balanced_and_the_chunk_is_computed_on_every_rank(kvp):
    for what, reqs in _batches():
        prefix = triton_prefix_pairs(reqs, kvp)
        chunk = sum((n - p) * (n - p + 1) // 2 for _, p, n in reqs)  # every rank's own part
        if any(prefix):
            assert max(prefix) <= 1.2 * sum(prefix) / kvp, f"KVP {kvp} {what}: prefix pairs per rank {prefix}"
        assert sum(prefix) + chunk == plain_pairs(reqs), (what, prefix, chunk)
