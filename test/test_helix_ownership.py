"""Helix token ownership (sglang.srt.layers.helix.ownership) against a brute-force reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang.srt.layers.helix.ownership import (
    extend_ownership,
    global_position,
    local_kv_len,
    local_kv_len_upper_bound,
    local_position,
    owned_count,
    owned_mask,
    owner_rank,
)

KVP_SIZES = (1, 2, 3, 4, 8)
CHUNKS = (1, 2, 3, 4, 16)


def ref_owned(seq_len: int, rank: int, kvp: int, chunk: int) -> list[int]:
    """Global positions of the first ``seq_len`` tokens that ``rank`` owns, in order."""
    return [p for p in range(seq_len) if (p // chunk) % kvp == rank]


def seq_lens_for(kvp: int, chunk: int) -> list[int]:
    cycle = kvp * chunk
    lens = set(range(0, 2 * cycle + chunk + 2))  # includes S < chunk and S == 0
    lens |= {cycle * m + d for m in (3, 7) for d in (-1, 0, 1)}  # multiples of chunk*KVP
    return sorted(s for s in lens if s >= 0)


@pytest.mark.parametrize("kvp,chunk", list(itertools.product(KVP_SIZES, CHUNKS)))
def test_lengths_and_local_positions_match_reference(kvp, chunk):
    lens = seq_lens_for(kvp, chunk)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    s_max = max(lens)
    for rank in range(kvp):
        owned = ref_owned(s_max, rank, kvp, chunk)
        # Owner and compact local position of every owned token: exactly 0..L-1, in order.
        pos_t = torch.tensor(owned, dtype=torch.int64)
        assert owner_rank(pos_t, kvp, chunk).eq(rank).all()
        assert local_position(pos_t, kvp, chunk).tolist() == list(range(len(owned)))
        assert global_position(torch.arange(len(owned)), rank, kvp, chunk).tolist() == owned
        for s in lens:
            expect = sum(1 for p in owned if p < s)
            assert local_kv_len(s, rank, kvp, chunk) == expect, (s, rank, kvp, chunk)
        # Vectorized over [B] sequence lengths (int64 and int32), same values, dtype kept.
        expect_t = torch.tensor([sum(1 for p in owned if p < s) for s in lens])
        for dtype in (torch.int64, torch.int32):
            got = local_kv_len(lens_t.to(dtype), rank, kvp, chunk)
            assert got.dtype == dtype
            assert torch.equal(got.long(), expect_t)


@pytest.mark.parametrize("kvp,chunk", list(itertools.product(KVP_SIZES, CHUNKS)))
def test_sum_over_ranks_and_upper_bound(kvp, chunk):
    lens = torch.tensor(seq_lens_for(kvp, chunk))
    per_rank = torch.stack([local_kv_len(lens, r, kvp, chunk) for r in range(kvp)])  # [KVP, B]
    assert torch.equal(per_rank.sum(0), lens)
    # A tensor of ranks broadcasts against the lengths: [KVP, 1] x [B] -> [KVP, B].
    ranks = torch.arange(kvp)[:, None]
    assert torch.equal(local_kv_len(lens[None, :], ranks, kvp, chunk), per_rank)
    bound = local_kv_len_upper_bound(lens, kvp, chunk)
    assert torch.equal(bound, per_rank.max(0).values)  # exact worst case, not just a bound
    ceil_per_rank = (lens + kvp - 1) // kvp
    assert (bound <= (ceil_per_rank + chunk - 1) // chunk * chunk).all()
    for s in lens.tolist():
        assert local_kv_len_upper_bound(s, kvp, chunk) == max(
            len(ref_owned(s, r, kvp, chunk)) for r in range(kvp)
        )


def test_ranks_that_own_nothing():
    # S < chunk: only rank 0 owns tokens.
    assert [local_kv_len(3, r, 4, 16) for r in range(4)] == [3, 0, 0, 0]
    # S just past one chunk: ranks 2, 3 still own nothing.
    assert [local_kv_len(17, r, 4, 16) for r in range(4)] == [16, 1, 0, 0]
    assert [local_kv_len(0, r, 4, 16) for r in range(4)] == [0, 0, 0, 0]
    assert local_kv_len_upper_bound(0, 4, 16) == 0


@pytest.mark.parametrize("kvp,chunk", [(1, 4), (2, 1), (3, 2), (4, 3), (8, 16)])
def test_extend_ownership_flat_batch(kvp, chunk):
    """A flat batch of extend segments [prefix_len, seq_len) with their global positions."""
    g = torch.Generator().manual_seed(kvp * 100 + chunk)
    segments = [(0, 0), (0, 1), (5, 5), (0, 3 * kvp * chunk), (7, 50), (kvp * chunk, 2 * kvp * chunk + 1)]
    segments += [tuple(sorted(torch.randint(0, 120, (2,), generator=g).tolist())) for _ in range(6)]
    positions = torch.cat([torch.arange(a, b) for a, b in segments])  # [T]
    for rank in range(kvp):
        mask, local = extend_ownership(positions, rank, kvp, chunk)
        assert mask.dtype == torch.bool and mask.shape == positions.shape
        assert torch.equal(mask, owned_mask(positions, rank, kvp, chunk))
        offset = 0
        for a, b in segments:
            seg_mask, seg_local = mask[offset : offset + b - a], local[offset : offset + b - a]
            offset += b - a
            owned = [p for p in ref_owned(b, rank, kvp, chunk) if p >= a]
            assert torch.arange(a, b)[seg_mask].tolist() == owned
            # New tokens land right after the rank's existing local KV, in order.
            start = local_kv_len(a, rank, kvp, chunk)
            assert seg_local[seg_mask].tolist() == list(range(start, start + len(owned)))
            assert owned_count(a, b, rank, kvp, chunk) == len(owned)
        # owned_count vectorized over [B] segments.
        starts = torch.tensor([a for a, _ in segments])
        ends = torch.tensor([b for _, b in segments])
        counts = owned_count(starts, ends, rank, kvp, chunk)
        assert counts.sum().item() == int(mask.sum())


def test_python_ints_in_python_ints_out():
    assert owner_rank(37, 4, 8) == 0 and owner_rank(40, 4, 8) == 1
    assert local_position(37, 4, 8) == 13 and local_position(41, 4, 8) == 9
    assert global_position(9, 1, 4, 8) == 41
    assert owned_mask(41, 1, 4, 8) is True
    assert isinstance(local_kv_len(100, 2, 4, 8), int)


def test_layout_arguments_fail_fast():
    with pytest.raises(ValueError, match="kvp_size"):
        owner_rank(3, 0, 4)
    with pytest.raises(ValueError, match="chunk"):
        local_kv_len(3, 0, 2, 0)
    with pytest.raises(TypeError, match="chunk"):
        local_position(3, 2, torch.tensor(4))
    with pytest.raises(ValueError, match="kvp_rank"):
        local_kv_len(3, 2, 2, 4)
