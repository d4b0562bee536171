"""Helix KV layout on upstream's allocator: logical ids -> owner and physical row; local KV lists.

A small scheduler drives the real ``PagedTokenToKVPoolAllocator``, sized as the KV-cache patch sizes it
(``rows_per_rank * KVP`` logical ids in pages of ``chunk * KVP``), on CPU tensors: requests are
prefilled in chunks (``alloc_extend`` over a prefix), decoded (``alloc_decode``), finished and
retracted (their locs freed, in free groups as the scheduler frees) and re-admitted from scratch,
with ``req_to_token`` kept as upstream keeps it. After every step, on every KVP rank:

- the write rows of the new tokens (``localize_dcp_indices`` of their ids) are owned by position, inside the
  rank's pool ``[chunk, rows_per_rank + chunk)`` (rows ``[0, chunk)`` are the reserved logical
  page 0), -1 (masked out of the write) on the other ranks, and used by no other live token;
- the local KV lists (torch_native's ``create_kv_indices_for_dcp_torch``) of every live request are
  exactly the rows written for it on that rank, in position order (``get_dcp_lens`` of them), and upstream's list
  kernel with ``interleave_size = chunk`` (what the decode runs) builds the same lists;
- the allocator's free size is the initial one minus the pages the live requests hold, and after
  everything is freed it is the initial one.

The allocator runs its torch path (what the CPU platform uses) and its Triton kernels (what CUDA
uses; here under the interpreter) for pages of a power-of-two size, which those kernels need.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from dataclasses import dataclass


def owner_rank(pos, kvp: int, chunk: int):
    """The ownership rule, written out: runs of ``chunk`` positions rotate over the KVP ranks."""
    return (pos // chunk) % kvp

# The allocator's Triton kernels on CPU tensors need the interpreter (read when they are decorated).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import FULL  # noqa: E402

from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

if STUB_DIR not in sys.path:  # the allocator's imports pull in sgl_kernel
    sys.path.insert(0, STUB_DIR)

from sglang.kernels.ops.attention.dcp_kernels import (  # noqa: E402
    create_kv_indices_for_dcp_torch,
    create_triton_kv_indices_for_dcp_triton,
)
from sglang.srt.layers.dcp.layout import get_dcp_lens, get_dcp_positions, localize_dcp_indices  # noqa: E402
from sglang.srt.mem_cache.allocator import paged  # noqa: E402

NUM_SLOTS, MAX_CONTEXT = 6, 160
NUM_PAGES = 12  # per rank: rows_per_rank = NUM_PAGES * chunk; small, so requests run out of it


@dataclass
class Req:
    rid: int
    prompt_len: int  # tokens to prefill (a retracted request re-prefills everything it had)
    target_len: int  # prompt + output: finished at this length
    slot: int = -1
    kv_len: int = 0  # positions [0, kv_len) hold KV


class Harness:
    """The real allocator, ``req_to_token``, and per rank the live token stored in each row."""

    def __init__(self, kvp: int, chunk: int, triton_kernels: bool, need_sort: bool):
        self.kvp, self.chunk, self.page = kvp, chunk, chunk * kvp
        self.rows_per_rank = NUM_PAGES * chunk
        # As the KV-cache patch builds it: the rows of one rank widened by KVP, paged by chunk * KVP.
        self.alloc = paged.PagedTokenToKVPoolAllocator(
            self.rows_per_rank * kvp, self.page, torch.float32, "cpu", None, need_sort
        )
        self.alloc.use_triton_kernels = triton_kernels
        self.alloc.debug_mode = True  # upstream's own checks: page alignment, no duplicate ids or pages
        self.initial = self.alloc.available_size()
        self.req_to_token = torch.zeros(NUM_SLOTS, MAX_CONTEXT, dtype=torch.int32)
        self.free_slots = list(range(NUM_SLOTS))
        self.row_owner = [{} for _ in range(kvp)]  # rank -> {row: (rid, pos)} of live tokens
        self.rows = {}  # (rid, pos) -> (rank, row) where its K/V is written

    # -- allocation, as the scheduler does it (alloc_for_extend / alloc_for_decode) --
    def extend(self, reqs: list, ext_lens: list) -> bool:
        prefix = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        seq = prefix + torch.tensor(ext_lens, dtype=torch.int64)
        slots = torch.tensor([r.slot for r in reqs])
        last_loc = torch.where(prefix > 0, self.req_to_token[slots, (prefix - 1).clamp(min=0)], -1)
        locs = self.alloc.alloc_extend(prefix, prefix, seq, seq, last_loc, sum(ext_lens))
        if locs is None:
            return False
        positions = [(r, p) for r, n in zip(reqs, ext_lens) for p in range(r.kv_len, r.kv_len + n)]
        self._written(locs, positions)
        for r, n in zip(reqs, ext_lens):
            r.kv_len += n
        return True

    def decode(self, reqs: list) -> bool:
        slots = torch.tensor([r.slot for r in reqs])
        seq = torch.tensor([r.kv_len + 1 for r in reqs], dtype=torch.int64)
        last_loc = self.req_to_token[slots, seq - 2].to(torch.int64)
        locs = self.alloc.alloc_decode(seq, seq, last_loc)
        if locs is None:
            return False
        self._written(locs, [(r, r.kv_len) for r in reqs])
        for r in reqs:
            r.kv_len += 1
        return True

    def free(self, reqs: list) -> None:
        """Finish or retract: free every loc the requests hold, in one free group."""
        self.alloc.free_group_begin()
        for r in reqs:
            self.alloc.free(self.req_to_token[r.slot, : r.kv_len].to(torch.int64))
            for pos in range(r.kv_len):
                rank, row = self.rows.pop((r.rid, pos))
                del self.row_owner[rank][row]
            self.free_slots.append(r.slot)
            r.slot, r.kv_len = -1, 0
        self.alloc.free_group_end()

    # -- the checks --
    def _written(self, locs: torch.Tensor, positions: list) -> None:
        """New tokens: write rows on every rank; record them; req_to_token as upstream writes it."""
        slots = torch.tensor([r.slot for r, _ in positions])
        pos = torch.tensor([p for _, p in positions])
        self.req_to_token[slots, pos] = locs.to(torch.int32)
        owners = torch.zeros(len(positions), dtype=torch.int64)
        for k in range(self.kvp):
            rows = localize_dcp_indices(locs, self.kvp, k, interleave_size=self.chunk)
            mine = owner_rank(pos, self.kvp, self.chunk) == k  # owner by position ...
            assert torch.equal(rows >= 0, mine)  # ... == owner by loc (-1: masked, not written)
            owners += mine
            for i in mine.nonzero().flatten().tolist():
                row, (r, p) = int(rows[i]), positions[i]
                assert self.chunk <= row < self.rows_per_rank + self.chunk, (k, row)
                assert row not in self.row_owner[k], f"rank {k} row {row}: {(r.rid, p)} and {self.row_owner[k][row]}"
                self.row_owner[k][row] = (r.rid, p)
                self.rows[(r.rid, p)] = (k, row)
        assert owners.eq(1).all()  # every token is stored exactly once over the KVP ranks

    def check(self, live: list) -> None:
        """Every live request's local KV list on every rank is the rows written for it, in order."""
        pages = {int(loc) // self.page for r in live for loc in self.req_to_token[r.slot, : r.kv_len]}
        assert self.alloc.available_size() == self.initial - len(pages) * self.page
        if not live:
            return
        slots = torch.tensor([r.slot for r in live])
        lens = torch.tensor([r.kv_len for r in live])
        for k in range(self.kvp):
            local_lens = get_dcp_lens(lens, self.kvp, k, interleave_size=self.chunk)
            total = int(local_lens.sum())
            indptr = torch.zeros(len(live) + 1, dtype=torch.int32)
            indptr[1:] = torch.cumsum(local_lens, 0)
            indices = torch.empty(total, dtype=torch.int64)
            create_kv_indices_for_dcp_torch(
                self.req_to_token, slots, local_lens, indptr, None, indices, self.kvp, k, self.chunk
            )
            if self.alloc.use_triton_kernels:  # upstream's list kernel, interpreted here too
                kernel_indices = torch.full((total + 3,), -1, dtype=torch.int64)
                create_triton_kv_indices_for_dcp_triton[(len(live),)](
                    self.req_to_token, slots, local_lens, indptr, None, kernel_indices,
                    self.req_to_token.stride(0), self.kvp, k, interleave_size=self.chunk,
                )  # fmt: skip
                assert torch.equal(kernel_indices[:total], indices) and kernel_indices[total:].eq(-1).all()
            for b, r in enumerate(live):
                owned = [p for p in range(r.kv_len) if owner_rank(p, self.kvp, self.chunk) == k]
                assert int(local_lens[b]) == len(owned)
                lo, hi = int(indptr[b]), int(indptr[b + 1])
                assert indices[lo:hi].tolist() == [self.rows[(r.rid, p)][1] for p in owned]
                local = torch.arange(hi - lo)
                assert get_dcp_positions(local, self.kvp, k, interleave_size=self.chunk).tolist() == owned


def _interpreted_alloc_kernels(monkeypatch):
    """The allocator's Triton kernels as interpreted functions, whoever imported them first."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(paged.alloc_extend_kernel, InterpretedFunction):
        return
    origin = importlib.util.find_spec("sglang.kernels.ops.memory.allocator").origin
    spec = importlib.util.spec_from_file_location("_helix_test_alloc_kernels", origin)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(paged, "alloc_extend_kernel", mod.alloc_extend_kernel)
    monkeypatch.setattr(paged, "alloc_decode_kernel", mod.alloc_decode_kernel)


LAYOUTS = [(2, 4), (4, 1), (8, 2), (3, 5), (2, 3)]  # (KVP, chunk)
CASES = [
    (kvp, chunk, kernels, need_sort)
    for kvp, chunk in LAYOUTS
    for kernels in ("torch", "triton")
    for need_sort in (False, True)
    if kernels == "torch" or (chunk * kvp) & (chunk * kvp - 1) == 0  # Triton: power-of-two pages
]


# The interpreted Triton list kernel: need_sort=False cases in the full tier (the True ones run the same kernel).
@pytest.mark.parametrize(
    "kvp,chunk,kernels,need_sort",
    [pytest.param(*c, marks=FULL) if c[2] == "triton" and not c[3] else c for c in CASES],
)
def test_scheduler_on_the_real_allocator(monkeypatch, kvp, chunk, kernels, need_sort):
    if kernels == "triton":
        _interpreted_alloc_kernels(monkeypatch)
    h = Harness(kvp, chunk, kernels == "triton", need_sort)
    rng, P = random.Random(kvp * 100 + chunk), h.page
    waiting = []
    for rid in range(16):
        prompt_len = rng.randint(1, 3 * P + 2)
        waiting.append(Req(rid, prompt_len, prompt_len + rng.randint(1, 3 * P)))
    running, done, retracted = [], 0, 0

    def retract(r):  # free everything it holds; re-admitted later, it re-prefills all of it
        nonlocal retracted
        running.remove(r)
        r.prompt_len = max(r.prompt_len, r.kv_len)
        h.free([r])
        waiting.append(r)
        retracted += 1

    for step in range(120):
        # Admit: waiting requests take a free slot (and are prefilled from position 0).
        while waiting and h.free_slots and len(running) < NUM_SLOTS:
            r = waiting.pop(0)
            r.slot = h.free_slots.pop(0)
            running.append(r)
        prefilling = [r for r in running if r.kv_len < r.prompt_len]
        decoding = [r for r in running if r.kv_len >= r.prompt_len]
        if prefilling and (not decoding or rng.random() < 0.5):
            # A chunked-prefill batch: up to 3 requests, each a chunk of 1 .. 2P + 1 tokens.
            batch = prefilling[:3]
            ext = [min(r.prompt_len - r.kv_len, rng.randint(1, 2 * P + 1)) for r in batch]
            if not h.extend(batch, ext):
                retract(running[-1])  # out of memory: retract the newest request
        elif decoding:
            while decoding and not h.decode(decoding):
                retract(decoding.pop())  # out of memory: retract, as retract_decode does
        # Finish what reached its length, and now and then retract a running request.
        finished = [r for r in running if r.kv_len >= r.target_len]
        unfinished = [r for r in running if r.kv_len < r.target_len]
        if unfinished and rng.random() < 0.08:
            retract(rng.choice(unfinished))
        if finished:
            h.free(finished)
            for r in finished:
                running.remove(r)
            done += len(finished)
        h.check(running)

    h.free(running)
    h.check([])
    assert h.alloc.available_size() == h.initial
    assert done > 0 and retracted > 0  # the run exercised finishing and retraction


def test_triton_allocator_needs_power_of_two_pages(monkeypatch):
    """Why the Triton cases above skip other pages: ``alloc_extend_kernel`` builds
    ``tl.arange(0, page_size)``. Where the allocator runs it (CUDA), a Helix page of
    chunk x KVP that is not a power of two (KVP 3, chunk 96, ...) fails the first prefill."""
    _interpreted_alloc_kernels(monkeypatch)
    h = Harness(3, 5, triton_kernels=True, need_sort=False)
    with pytest.raises(Exception, match="power of 2"):
        h.extend([Req(0, 7, 8, slot=0)], [7])


def test_write_rows_of_tokens_a_rank_does_not_own():
    locs = torch.arange(16, 48)  # pages 1..2 of P=16 (chunk 4, KVP 4)
    for k in range(4):
        rows = localize_dcp_indices(locs, 4, k, interleave_size=4)
        mine = rows >= 0  # -1: another rank's token, masked out of the write
        assert mine.sum() == 8 and owner_rank(locs[mine], 4, 4).eq(k).all()


@pytest.mark.parametrize("kvp,chunk", [(2, 1), (2, 4), (4, 3)])
def test_owner_rank_is_the_rank_that_writes_the_id(kvp, chunk):
    loc = torch.arange(0, 5 * kvp * chunk + 3)
    owner = owner_rank(loc, kvp, chunk)
    for rank in range(kvp):
        assert torch.equal(localize_dcp_indices(loc, kvp, rank, interleave_size=chunk) >= 0, owner == rank)
