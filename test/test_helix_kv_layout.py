"""Helix KV layout: logical ids from a paged allocator -> owner and physical row; local KV lists.

These are the indices the attention reads: per decode step a rank reads exactly
local_kv_len(S) tokens of a request (at most ceil(S / (chunk*KVP)) * chunk, i.e. ~S/KVP), each
stored once, on its owner, in rows no other token uses.
"""

import random

import pytest
import torch

from sglang.srt.layers.helix import kv_layout
from sglang.srt.layers.helix.ownership import local_kv_len, owner_rank


def _paged_req_to_token(seq_lens, kvp, chunk, num_pages, seed=0):
    """What the paged allocator (page P = chunk*KVP, page 0 reserved) gives: loc % P == pos % P."""
    P = chunk * kvp
    rng = random.Random(seed)
    free = list(range(1, num_pages + 1))
    rng.shuffle(free)
    table = torch.zeros(len(seq_lens), max(seq_lens) + P, dtype=torch.int32)
    for r, S in enumerate(seq_lens):
        for page_start in range(0, S, P):
            page = free.pop()
            n = min(P, S - page_start)
            table[r, page_start : page_start + n] = torch.arange(page * P, page * P + n, dtype=torch.int32)
    return table


@pytest.mark.parametrize("kvp,chunk", [(2, 4), (4, 4), (4, 1), (3, 5), (8, 2)])
def test_rows_and_local_lists(kvp, chunk):
    seq_lens = [1, chunk - 1 if chunk > 1 else 1, chunk * kvp, chunk * kvp * 3 + 2, 97, 5]
    num_pages = sum(-(-s // (chunk * kvp)) for s in seq_lens) + 3
    table = _paged_req_to_token(seq_lens, kvp, chunk, num_pages)
    rows_per_rank = num_pages * chunk  # R: the pool's rows
    lens = torch.tensor(seq_lens)
    owned_rows_seen = {k: set() for k in range(kvp)}
    for k in range(kvp):
        total = kv_layout.total_local_len(lens, k, kvp, chunk)
        indptr, indices, local_lens = kv_layout.local_kv_indices(table, torch.arange(len(seq_lens)), lens, total, k, kvp, chunk)
        assert local_lens.tolist() == [local_kv_len(s, k, kvp, chunk) for s in seq_lens]
        for b, S in enumerate(seq_lens):
            pos = [p for p in range(S) if owner_rank(p, kvp, chunk) == k]
            locs = table[b, pos].long()
            rows, mine = kv_layout.write_rows(locs, k, kvp, chunk)
            assert bool(mine.all())  # the owner by position is the owner by loc
            got = indices[indptr[b] : indptr[b + 1]]
            assert got.tolist() == rows.tolist()  # the rows written are the rows read, in order
            assert len(got) <= -(-S // (chunk * kvp)) * chunk  # ~S/KVP: one chunk of slack
            for r in got.tolist():
                assert chunk <= r < rows_per_rank + chunk  # never the trash rows, inside the pool
                assert r not in owned_rows_seen[k]  # one row per token
                owned_rows_seen[k].add(r)
            positions = kv_layout.owned_positions(indptr, total, k, kvp, chunk)[indptr[b] : indptr[b + 1]]
            assert positions.tolist() == pos
    # Every token of every request is stored exactly once over the KVP ranks.
    assert sum(len(v) for v in owned_rows_seen.values()) == sum(seq_lens)


def test_write_rows_of_tokens_a_rank_does_not_own():
    locs = torch.arange(16, 48)  # pages 1..2 of P=16 (chunk 4, KVP 4)
    for k in range(4):
        rows, mine = kv_layout.write_rows(locs, k, 4, 4)
        assert mine.sum() == 8 and owner_rank(locs[mine], 4, 4).eq(k).all()
