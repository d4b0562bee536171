"""Helix token ownership against a brute-force reference.

The rule: position ``p`` belongs to KVP rank ``(p // chunk) % KVP`` and sits at local index
``(p // (chunk * KVP)) * chunk + p % chunk`` of that rank's compact KV. Helix implements it with
upstream DCP's layout at ``interleave_size = chunk`` (``sglang.srt.layers.dcp.layout``:
``get_dcp_lens``, ``localize_dcp_indices`` and the series' inverse ``get_dcp_positions``) and
torch_native's list builder (``dcp_kernels.create_kv_indices_for_dcp_torch``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang.kernels.ops.attention.dcp_kernels import create_kv_indices_for_dcp_torch
from sglang.srt.layers.dcp.layout import get_dcp_lens, get_dcp_positions, localize_dcp_indices

KVP_SIZES = (1, 2, 3, 4, 8)
CHUNKS = (1, 2, 3, 4, 16)
LAYOUTS = list(itertools.product(KVP_SIZES, CHUNKS))


def local_kv_lens(lens, rank: int, kvp: int, chunk: int, start=None) -> torch.Tensor:
    """``get_dcp_lens`` of ints or lists (the tests' shorthand)."""
    start = None if start is None else torch.as_tensor(start)
    return get_dcp_lens(torch.as_tensor(lens), kvp, rank, start=start, interleave_size=chunk)


def ref_owner(p: int, kvp: int, chunk: int) -> int:
    return (p // chunk) % kvp


def ref_local(p: int, kvp: int, chunk: int) -> int:
    return (p // (chunk * kvp)) * chunk + p % chunk


def ref_owned(seq_len: int, rank: int, kvp: int, chunk: int, start: int = 0) -> list[int]:
    """Global positions of ``[start, seq_len)`` that ``rank`` owns, in order."""
    return [p for p in range(start, seq_len) if ref_owner(p, kvp, chunk) == rank]


def seq_lens_for(kvp: int, chunk: int) -> list[int]:
    cycle = kvp * chunk
    lens = set(range(0, 2 * cycle + chunk + 2))  # includes S < chunk and S == 0
    lens |= {cycle * m + d for m in (3, 7) for d in (-1, 0, 1)}  # multiples of chunk*KVP
    return sorted(s for s in lens if s >= 0)


@pytest.mark.parametrize("kvp,chunk", LAYOUTS)
def test_local_index_and_its_inverse_match_reference(kvp, chunk):
    """``localize_dcp_indices`` on positions: the compact local index where owned, -1 elsewhere;
    ``get_dcp_positions`` maps local indices 0..L-1 back to the owned positions, in order."""
    s_max = max(seq_lens_for(kvp, chunk))
    pos = torch.arange(s_max)
    for rank in range(kvp):
        owned = ref_owned(s_max, rank, kvp, chunk)
        got = localize_dcp_indices(pos, kvp, rank, interleave_size=chunk)
        want = [ref_local(p, kvp, chunk) if ref_owner(p, kvp, chunk) == rank else -1 for p in range(s_max)]
        assert got.tolist() == want, (rank, kvp, chunk)
        # A rank's owned positions fill its local KV densely, in order: exactly 0..L-1.
        assert got[got >= 0].tolist() == list(range(len(owned)))
        back = get_dcp_positions(torch.arange(len(owned)), kvp, rank, interleave_size=chunk)
        assert back.dtype == torch.int64 and back.tolist() == owned


@pytest.mark.parametrize("kvp,chunk", LAYOUTS)
def test_lengths_match_reference(kvp, chunk):
    """Upstream's ``get_dcp_lens`` (its ``(dcp_size, dcp_rank)`` order; dtype kept) counts the
    positions of ``[0, S)`` a rank owns."""
    lens = seq_lens_for(kvp, chunk)
    for rank in range(kvp):
        expect = [len(ref_owned(s, rank, kvp, chunk)) for s in lens]
        for dtype in (torch.int64, torch.int32):
            up = get_dcp_lens(torch.tensor(lens, dtype=dtype), kvp, rank, interleave_size=chunk)
            assert up.dtype == dtype and up.tolist() == expect


@pytest.mark.parametrize("kvp,chunk", LAYOUTS)
def test_sum_over_ranks_and_upper_bound(kvp, chunk):
    lens = torch.tensor(seq_lens_for(kvp, chunk))
    per_rank = torch.stack([local_kv_lens(lens, r, kvp, chunk) for r in range(kvp)])  # [KVP, B]
    assert torch.equal(per_rank.sum(0), lens)  # every position has exactly one owner
    # Rank 0 owns the most: its length is the exact worst case over the ranks, the bound the
    # buffers are sized with.
    bound = local_kv_lens(lens, 0, kvp, chunk)
    assert torch.equal(bound, per_rank.max(0).values)
    ceil_per_rank = (lens + kvp - 1) // kvp
    assert (bound <= (ceil_per_rank + chunk - 1) // chunk * chunk).all()
    for s in lens.tolist():
        assert int(local_kv_lens(s, 0, kvp, chunk)) == max(len(ref_owned(s, r, kvp, chunk)) for r in range(kvp))


def test_ranks_that_own_nothing():
    # S < chunk: only rank 0 owns tokens.
    assert [int(local_kv_lens(3, r, 4, 16)) for r in range(4)] == [3, 0, 0, 0]
    # S just past one chunk: ranks 2, 3 still own nothing.
    assert [int(local_kv_lens(17, r, 4, 16)) for r in range(4)] == [16, 1, 0, 0]
    assert [int(local_kv_lens(0, r, 4, 16)) for r in range(4)] == [0, 0, 0, 0]
    # A worked example of the rule: position 37 at KVP 4, chunk 8 is rank 0's local index 13;
    # position 41 is rank 1's local index 9.
    pos = torch.tensor([37, 41])
    assert localize_dcp_indices(pos, 4, 0, interleave_size=8).tolist() == [13, -1]
    assert localize_dcp_indices(pos, 4, 1, interleave_size=8).tolist() == [-1, 9]
    assert get_dcp_positions(torch.tensor([13]), 4, 0, interleave_size=8).tolist() == [37]
    assert get_dcp_positions(torch.tensor(9), 4, 1, interleave_size=8).item() == 41


@pytest.mark.parametrize("kvp,chunk", [(1, 4), (2, 1), (3, 2), (4, 3), (8, 16)])
def test_extend_segments_and_start(kvp, chunk):
    """Extend segments ``[prefix_len, seq_len)``: ``get_dcp_lens(start=)`` counts the owned new tokens, and they land in the rank's local KV
    right after its prefix (``localize_dcp_indices`` of the segment's positions)."""
    g = torch.Generator().manual_seed(kvp * 100 + chunk)
    segments = [(0, 0), (0, 1), (5, 5), (0, 3 * kvp * chunk), (7, 50), (kvp * chunk, 2 * kvp * chunk + 1)]
    segments += [tuple(sorted(torch.randint(0, 120, (2,), generator=g).tolist())) for _ in range(6)]
    starts = torch.tensor([a for a, _ in segments])
    spans = torch.tensor([b - a for a, b in segments])
    for rank in range(kvp):
        counts = get_dcp_lens(spans, kvp, rank, start=starts, interleave_size=chunk)
        for (a, b), n in zip(segments, counts.tolist()):
            owned = ref_owned(b, rank, kvp, chunk, start=a)
            assert n == len(owned), (a, b, rank)
            local = localize_dcp_indices(torch.arange(a, b), kvp, rank, interleave_size=chunk)
            assert torch.arange(a, b)[local >= 0].tolist() == owned
            first = int(local_kv_lens(a, rank, kvp, chunk))
            assert local[local >= 0].tolist() == list(range(first, first + n))


def _allocator_locs(positions: torch.Tensor, kvp: int, chunk: int, seed: int) -> torch.Tensor:
    """Logical KV ids as Helix's allocator hands them out: pages of ``P = chunk * KVP`` ids,
    ``loc % P == p % P``, page 0 reserved (the trash page)."""
    P = chunk * kvp
    g = torch.Generator().manual_seed(seed)
    pages = 1 + torch.randperm(64, generator=g)[: int(positions.max()) // P + 1]
    return pages[positions // P] * P + positions % P


@pytest.mark.parametrize("kvp,chunk", LAYOUTS)
def test_write_rows_match_reference(kvp, chunk):
    """``localize_dcp_indices`` of the new tokens' ids: the physical row of each new token on the rank that owns its position, -1
    on every other rank (DCP's masked store skips it: no row is written for it)."""
    positions = torch.cat([torch.arange(0, 3 * kvp * chunk + 2), torch.arange(5, 9)])  # [T]
    locs = _allocator_locs(positions, kvp, chunk, seed=kvp * 31 + chunk)
    before = locs.clone()
    owners = torch.zeros_like(positions)
    for rank in range(kvp):
        for dtype in (torch.int64, torch.int32):
            rows = localize_dcp_indices(locs.to(dtype), kvp, rank, interleave_size=chunk)
            assert rows.dtype == dtype and rows.shape == locs.shape
            want = [
                ref_local(loc, kvp, chunk) if ref_owner(p, kvp, chunk) == rank else -1
                for p, loc in zip(positions.tolist(), locs.tolist())
            ]
            assert rows.tolist() == want, (rank, kvp, chunk)
        owned = torch.tensor([ref_owner(p, kvp, chunk) == rank for p in positions.tolist()])
        assert (rows[owned] >= 0).all()
        assert torch.equal(rows[owned], localize_dcp_indices(locs[owned], kvp, rank, interleave_size=chunk))
        assert (localize_dcp_indices(locs[~owned], kvp, rank, interleave_size=chunk) == -1).all()
        owners[owned] += 1
    assert (owners == 1).all()  # each new token is written on exactly one rank
    assert torch.equal(locs, before)  # the batch's out_cache_loc is left as it was


@pytest.mark.parametrize("kvp,chunk", [(1, 4), (2, 1), (3, 2), (4, 3), (8, 16)])
def test_local_kv_indices_positions(kvp, chunk):
    """torch_native's lists (``create_kv_indices_for_dcp_torch``, from ``[0, len)`` and from a
    ``kv_start``) and the global position of each row (``get_dcp_positions`` of its local index),
    against the brute-force owned positions and their rows."""
    lens = torch.tensor([0, 1, chunk + 1, 2 * kvp * chunk + 3, 57])
    starts = torch.tensor([0, 0, 1, kvp * chunk - 1, 13])
    max_len = int((lens + starts).max())
    req_to_token = torch.stack(
        [_allocator_locs(torch.arange(max_len), kvp, chunk, seed=s) for s in range(len(lens))]
    ).to(torch.int32)
    slots = torch.tensor([3, 1, 4, 0, 2])
    req_to_token = req_to_token[torch.argsort(slots)]  # slot s holds request slots.tolist().index(s)
    for rank, start in itertools.product(range(kvp), (None, starts)):
        local_lens = get_dcp_lens(lens, kvp, rank, start=start, interleave_size=chunk)
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(local_lens, 0)
        rows = torch.full((int(local_lens.sum()),), -7, dtype=torch.int64)
        create_kv_indices_for_dcp_torch(req_to_token, slots, local_lens, indptr, start, rows, kvp, rank, chunk)
        want_rows = []
        for b in range(len(lens)):
            a = 0 if start is None else int(start[b])
            owned = ref_owned(a + int(lens[b]), rank, kvp, chunk, start=a)
            assert int(indptr[b + 1] - indptr[b]) == len(owned)
            want_rows += [ref_local(int(req_to_token[slots[b], p]), kvp, chunk) for p in owned]
            if start is None:  # list index j is local index j: its position
                pos = get_dcp_positions(torch.arange(len(owned)), kvp, rank, interleave_size=chunk)
                assert pos.tolist() == owned
        assert rows.tolist() == want_rows, (rank, start)


def test_interleave_below_one_is_refused():
    for fn in (
        lambda: get_dcp_lens(torch.tensor([3]), 2, 0, interleave_size=0),
        lambda: localize_dcp_indices(torch.tensor([3]), 2, 0, interleave_size=0),
    ):
        with pytest.raises(ValueError, match="interleave_size"):
            fn()
