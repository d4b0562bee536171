"""DCP's GQA mode through the Triton backend's CUDA-graph hooks, on the CPU.

There is no CUDA graph on the CPU, so the test drives what the graph runners drive, in their order,
and proves that re-running the Python of a captured step is what a replay would execute:

- **capture** (per captured batch size, largest first): the runner's static inputs sliced to the
  size, the backend's ``init_forward_metadata_out_graph(in_capture=True)`` (upstream's hook: it
  builds the forward's metadata over the graph buffers), then the captured body -- the layers:
  ``forward_decode`` (the K/V store, then the DCP branch) -- twice as warm-up and once as "capture";
- **replay**: the real batch copied into the static inputs, padded as the runner pads (``seq_len``
  1, slot 0, write id 0), ``init_forward_metadata_out_graph`` on the replay view (the lists, split
  counts and masks refilled in place, outside the graph), then the captured body again, with the
  metadata object the capture built (a graph replays the kernels it recorded).

Guards, on every replay: the body calls no ``.item()`` / ``.tolist()`` / ``.cpu()`` / ``.numpy()``
and reads no device value on the host; its op trace equals the capture's (every op and kernel
launch with the same shapes, numbers and, for any tensor not allocated inside the body, the same
address: a graph holds addresses); one All-to-All per layer. And the real rows of every replay equal
eager on the same batch and float64 attention over the whole context (what a plain-TP rank computes
for those heads), over steps whose lengths change, with requests finishing and joining, at padded
batch sizes. The rows a step writes hold NaN until it writes them, so a step that does not store
its K/V, or reads stale lists, fails. The decode runs the GQA mode's split policy at an H100's SM
count (constants scaled to these lengths), so every captured size reads its own view of the graph's
split buffers.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are imported

import threading  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from sglang_helix.testing.dcp_ranks import Ranks, Shape, Spec, layer, self_attn  # noqa: E402
from sglang.srt.layers.dcp import comm as dcp_comm  # noqa: E402

try:  # the GQA mode's decode split policy (the decode-performance patch; absent on earlier prefixes)
    from sglang.srt.layers.dcp import gqa_decode  # noqa: E402
except ImportError:
    gqa_decode = None
POLICY = pytest.mark.skipif(gqa_decode is None, reason="the series' decode-performance patch is not applied")
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: log(0) of empty KV

SHAPE = Shape(heads=4, kv_heads=2, head_dim=16, kvp=2, chunk=2, slots=6, max_len=40)
NUM_LAYERS = 2
CAPTURE_BS = (1, 2, 4)
FILL_SEQ_LEN = 1  # TritonAttnBackend.get_cuda_graph_seq_len_fill_value()
SMS = 4  # the SM count the split policy runs at (a GPU scaled to these lengths)
# (slot, seq_len) per request, per decode step: lengths grow, requests finish and join, and
# the batch is padded to 2, 4, 2, 4, 1, 4 (captured sizes).
STEPS = [
    [(1, 5), (2, 9)],
    [(1, 6), (2, 10), (3, 3)],
    [(1, 7), (3, 4)],
    [(1, 8), (3, 5), (4, 17), (5, 1)],
    [(4, 18)],
    [(4, 19), (2, 33), (5, 2)],
]


class _Guard(TorchDispatchMode):
    """Records every op (name, output shapes) and kernel launch (name, argument shapes, numbers and
    where each tensor argument lives); fails on a host read of a device value.

    Where an argument lives, as a CUDA graph sees it: a tensor allocated inside the captured body is
    replayed at its captured address (the graph's pool), so it is recorded by allocation order; any
    other tensor (a graph buffer, a static input, the KV pool) must be at the same address at replay
    as at capture, so it is recorded by address.
    """

    def __init__(self):
        super().__init__()
        self.trace, self.fresh, self.allocations = [], {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host read of a device value (.item() / int() / bool()) in a captured step")
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        outputs = _tensors(out)
        for t in outputs:
            if _storage(t) not in inputs:  # not a view or an in-place / out= result: an allocation
                self.allocated(t)
        self.trace.append((str(func), [tuple(t.shape) for t in outputs]))
        return out

    def allocated(self, t):
        self.fresh[_storage(t)] = self.allocations  # an address freed and reused is a new allocation
        self.allocations += 1

    def where(self, t):
        storage = _storage(t)
        if storage in self.fresh:
            return ("allocated in the body", self.fresh[storage], t.data_ptr() - storage)
        return ("address", t.data_ptr())


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _storage(t):
    return t.untyped_storage().data_ptr()


_tls = threading.local()


def _kernel(name, fn):
    """``fn`` traced as one opaque launch (as on a GPU): its tensors by shape and where they live,
    its numbers by value."""

    def launch(*args, **kwargs):
        guard = getattr(_tls, "guard", None)
        if guard is not None:
            tensors = [(tuple(t.shape), guard.where(t)) for t in _tensors((args, kwargs))]
            numbers = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, (bool, int, float))]
            guard.trace.append((name, tensors, numbers))
        _tls.in_kernel = True
        try:
            with _disable_current_modes():
                out = fn(*args, **kwargs)
        finally:
            _tls.in_kernel = False
        if guard is not None:
            for t in _tensors(out):
                guard.allocated(t)
        return out

    return launch


def _forbid(name):
    original = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        if getattr(_tls, "guard", None) is not None and not getattr(_tls, "in_kernel", False):
            raise AssertionError(f"Tensor.{name}() in a captured step")
        return original(self, *args, **kwargs)

    return method


def _traced(fn):
    """``(fn(), trace)``: ``fn`` run under a fresh ``_Guard``."""
    _tls.guard = guard = _Guard()
    try:
        with guard:
            out = fn()
    finally:
        _tls.guard = None
    return out, guard.trace


def _instrument(monkeypatch, ranks, backends):
    """Trace the decode kernel and the merge, forbid host reads, run the split policy of a GPU
    scaled to these lengths (4 SMs, up to 8 splits, one per 2 local tokens: batch 1 launches 8
    splits, batches 2 and 4 launch 4)."""
    if gqa_decode is not None:
        monkeypatch.setattr(gqa_decode, "DCP_GQA_MAX_KV_SPLITS", 8)
        monkeypatch.setattr(gqa_decode, "DCP_GQA_MIN_TOKENS_PER_SPLIT", 2)
    for name in ("dcp_lse_combine_triton", "dcp_pack_a2a_send"):
        monkeypatch.setattr(dcp_comm, name, _kernel(name, getattr(dcp_comm, name)))
    for name in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _forbid(name))
    for backend in backends:
        backend.decode_attention_fwd = _kernel("decode_attention_fwd", backend.decode_attention_fwd)
        backend.device_core_count = SMS
        if gqa_decode is not None:
            backend.dcp_split_policy = gqa_decode.kv_split_policy(backend.max_kv_splits, SMS, False, None)


LAYERS = [layer(SHAPE, layer_id=i) for i in range(NUM_LAYERS)]


def _owner_row(ranks, slot, table_pos):
    """``(owner rank, row)`` of a table position, by DCP's layout read independently: the owner of
    a logical id is its chunk's turn, its row the id's chunk among that rank's, then the offset."""
    loc = int(ranks.req_to_token[slot, table_pos])
    s = ranks.shape
    return (loc // s.chunk) % s.kvp, (loc // s.page) * s.chunk + loc % s.chunk


def _world(ranks, g, written):
    """Every (slot, table position)'s K/V per layer, written where its owner keeps it (a prefill
    did it), except ``written``: NaN until the steps under test store them."""
    s = ranks.shape
    keys = [{sl: [torch.randn(s.kv_heads, s.head_dim, generator=g) for _ in range(s.max_len)] for sl in range(s.slots)} for _ in LAYERS]
    values = [{sl: [torch.randn(s.kv_heads, s.head_dim, generator=g) for _ in range(s.max_len)] for sl in range(s.slots)} for _ in LAYERS]
    for i in range(NUM_LAYERS):
        for slot in range(s.slots):
            for pos in range(s.max_len):
                owner, row = _owner_row(ranks, slot, pos)
                stored = (slot, pos) not in written
                ranks.pools[owner].get_key_buffer(i)[row] = keys[i][slot][pos] if stored else float("nan")
                ranks.pools[owner].get_value_buffer(i)[row] = values[i][slot][pos] if stored else float("nan")
    return keys, values


def _reset(ranks, written):
    for slot, pos in written:
        owner, row = _owner_row(ranks, slot, pos)
        for i in range(NUM_LAYERS):
            ranks.pools[owner].get_key_buffer(i)[row] = float("nan")
            ranks.pools[owner].get_value_buffer(i)[row] = float("nan")


def _snapshot(pool):
    return [b.clone() for i in range(NUM_LAYERS) for b in (pool.get_key_buffer(i), pool.get_value_buffer(i))]


def _assert_same_pool(pool, snapshot, where):
    for i, (now, then) in enumerate(zip(_snapshot(pool), snapshot)):
        torch.testing.assert_close(now, then, atol=0, rtol=0, equal_nan=True, msg=f"{where}: pool buffer {i}")


def _reference(q, keys, values, seen, rank):
    """float64 attention of ``q [T, H, D]`` over ``seen[t]`` (the (slot, table position)s token
    ``t`` sees), head slice ``rank``: ``[T, H/KVP, D]``."""
    group = SHAPE.heads // SHAPE.kv_heads
    out = []
    for t, keys_t in enumerate(seen):
        kb = torch.stack([keys[s][p] for s, p in keys_t]).double().repeat_interleave(group, dim=1)
        vb = torch.stack([values[s][p] for s, p in keys_t]).double().repeat_interleave(group, dim=1)
        sc = torch.einsum("hd,lhd->hl", q[t].double(), kb) * SHAPE.head_dim**-0.5
        out.append(torch.einsum("hl,lhd->hd", sc.softmax(-1), vb))
    h = SHAPE.heads // SHAPE.kvp
    return torch.stack(out)[:, rank * h : (rank + 1) * h]


def _decode_batch(ranks, reqs):
    """An eager decode ForwardBatch (the fields the backend reads)."""
    slots = torch.tensor([s for s, _ in reqs])
    seq = torch.tensor([n for _, n in reqs])
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=len(reqs), req_pool_indices=slots, seq_lens=seq,
        seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()), positions=seq - 1, spec_info=None,
        out_cache_loc=torch.stack([ranks.req_to_token[s, n - 1] for s, n in reqs]).long(),
        out_cache_loc_is_physical=False, kv_loc_plan=None, kv_loc_cols=None, encoder_lens=None,
    )  # fmt: skip


def test_decode_capture_replay_equals_eager_and_plain_tp(monkeypatch):
    g = torch.Generator().manual_seed(0)
    ranks = Ranks(SHAPE, "triton", num_layers=NUM_LAYERS)
    backends = ranks.backends
    _instrument(monkeypatch, ranks, backends)
    written = {(slot, n - 1) for reqs in STEPS for slot, n in reqs}  # each step stores its token's K/V
    keys, values = _world(ranks, g, written)
    H, KVH, D = SHAPE.heads, SHAPE.kv_heads, SHAPE.head_dim

    # The runner's static inputs, shared by every captured size (sliced), and the graph state.
    max_bs = max(CAPTURE_BS)
    static = SimpleNamespace(
        req_pool_indices=torch.zeros(max_bs, dtype=torch.int64), seq_lens=torch.full((max_bs,), FILL_SEQ_LEN),
        out_cache_loc=torch.zeros(max_bs, dtype=torch.int64), q=torch.zeros(max_bs, H * D),
        k=torch.zeros(NUM_LAYERS, max_bs, KVH * D), v=torch.zeros(NUM_LAYERS, max_bs, KVH * D),
    )  # fmt: skip
    ranks.run(lambda r: backends[r].init_cuda_graph_state(max_bs, max_bs))
    for backend in backends:  # one split buffer for every captured size, 1/KVP of the context listed
        if gqa_decode is not None:
            rows = gqa_decode.KVSplitPolicy(4, 8, SMS).split_rows(max_bs, H, KVH)
            assert backend.cuda_graph_attn_logits.numel() == rows * H * D
        assert backend.cuda_graph_kv_indices.numel() == max_bs * SHAPE.max_len // SHAPE.kvp

    def static_batch(bs):
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=bs, req_pool_indices=static.req_pool_indices[:bs],
            seq_lens=static.seq_lens[:bs], seq_lens_cpu=None, seq_lens_sum=None, positions=static.seq_lens[:bs] - 1,
            out_cache_loc=static.out_cache_loc[:bs], spec_info=None, out_cache_loc_is_physical=False,
            kv_loc_plan=None, kv_loc_cols=None, encoder_lens=None,
        )  # fmt: skip

    def body(backend, batch):  # what the graph records: the layers
        bs = batch.batch_size
        return torch.stack([
            self_attn(backend, L, static.q[:bs], static.k[i, :bs], static.v[i, :bs], batch)
            for i, L in enumerate(LAYERS)
        ])  # fmt: skip

    # Capture, largest size first: the capture-side hook, two warm-ups, the capture (traced).
    captured, metadata = {}, {}
    for bs in sorted(CAPTURE_BS, reverse=True):

        def capture(rank, bs=bs):
            backend, batch = backends[rank], static_batch(bs)
            backend.init_forward_metadata_out_graph(batch, in_capture=True)
            meta = backend.forward_metadata
            if gqa_decode is not None:
                assert meta.attn_logits.shape[:3] == (bs, H, backend._dcp_split_extent(bs))
            for _ in range(2):
                body(backend, batch)
            return meta, _traced(lambda: body(backend, batch))[1]

        metadata[bs], captured[bs] = zip(*ranks.run(capture))
        launched = {entry[0] for entry in captured[bs][0]}
        assert {"decode_attention_fwd", "dcp_lse_combine_triton"} <= launched, launched
        if gqa_decode is not None:
            assert "dcp_pack_a2a_send" not in launched  # stage 2 writes the send buffer itself
    if gqa_decode is not None:  # the captured sizes read views at their own split extents
        extents = {bs: metadata[bs][0].attn_logits.shape[2] for bs in CAPTURE_BS}
        assert extents == {1: 8, 2: 4, 4: 4}, extents

    for step, reqs in enumerate(STEPS):
        raw_bs = len(reqs)
        bs = min(b for b in CAPTURE_BS if b >= raw_bs)
        q = torch.randn(raw_bs, H * D, generator=g)
        k = torch.stack([torch.stack([keys[i][s][n - 1] for s, n in reqs]).reshape(raw_bs, -1) for i in range(NUM_LAYERS)])
        v = torch.stack([torch.stack([values[i][s][n - 1] for s, n in reqs]).reshape(raw_bs, -1) for i in range(NUM_LAYERS)])
        batch = _decode_batch(ranks, reqs)

        def eager(rank):
            backend = backends[rank]
            backend.init_forward_metadata(batch)
            calls = ranks.exchange.calls[rank]
            out = torch.stack([self_attn(backend, L, q, k[i], v[i], batch).clone() for i, L in enumerate(LAYERS)])
            return out, ranks.exchange.calls[rank] - calls, _snapshot(ranks.pools[rank])

        eager_out = ranks.run(eager)
        _reset(ranks, [(s, n - 1) for s, n in reqs])  # the replay must store them again

        # Replay: copy in and pad as the runner does, the replay-side hook, the captured body.
        static.req_pool_indices.zero_(), static.seq_lens.fill_(FILL_SEQ_LEN), static.out_cache_loc.zero_()
        static.q.zero_(), static.k.zero_(), static.v.zero_()
        static.req_pool_indices[:raw_bs] = batch.req_pool_indices
        static.seq_lens[:raw_bs] = batch.seq_lens
        static.out_cache_loc[:raw_bs] = batch.out_cache_loc
        static.q[:raw_bs], static.k[:, :raw_bs], static.v[:, :raw_bs] = q, k, v

        def replay(rank):
            backend, view = backends[rank], static_batch(bs)
            backend.init_forward_metadata_out_graph(view)
            backend.forward_metadata = metadata[bs][rank]  # what the graph was captured with
            calls = ranks.exchange.calls[rank]
            out, trace = _traced(lambda: body(backend, view))
            return out[:, :raw_bs].clone(), ranks.exchange.calls[rank] - calls, trace

        replayed = ranks.run(replay)
        seen = [[(s, p) for p in range(n)] for s, n in reqs]
        for rank in range(SHAPE.kvp):
            out, a2a, trace = replayed[rank]
            where = f"step {step} {reqs} (padded to {bs}), KVP rank {rank}"
            assert trace == captured[bs][rank], f"{where}: the replayed step differs from the captured one"
            assert a2a == eager_out[rank][1] == NUM_LAYERS, f"{where}: {a2a} All-to-Alls, eager {eager_out[rank][1]}"
            assert torch.equal(out, eager_out[rank][0]), f"{where}: graph path != eager"
            _assert_same_pool(ranks.pools[rank], eager_out[rank][2], f"{where}: the pool after replay != after eager")
            for i in range(NUM_LAYERS):
                ref = _reference(q.view(raw_bs, H, D), keys[i], values[i], seen, rank)
                got = out[i].view(raw_bs, H // SHAPE.kvp, D).double()
                torch.testing.assert_close(got, ref, atol=2e-5, rtol=0, msg=lambda m: f"{where}, layer {i}: {m}")


# (slot, committed seq_len) per request, per draft iteration (every step of it replayed)
DRAFT_ITERATIONS = [[(1, 5), (2, 9)], [(1, 8), (3, 3), (2, 11)], [(4, 14)]]


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_draft_steps_capture_replay_equals_eager_and_plain_tp(monkeypatch, topk):
    """A multi-step draft's decode steps through the multi-step backend's graph hooks: its capture
    builds every step's metadata over the graph buffers; before each replay it refills every step's
    lists from the iteration's committed lengths (step ``i`` of branch ``t``: the committed prefix
    and the branch's drafts ``0..i`` on its own pages), which the steps then read."""
    g = torch.Generator().manual_seed(1)
    steps = 3
    ranks = Ranks(SHAPE, "triton", spec=Spec(num_steps=steps, topk=topk, num_draft_tokens=4), num_layers=NUM_LAYERS)
    drafts = ranks.draft_backends
    step_backends = [b for d in drafts for b in d.attn_backends]
    _instrument(monkeypatch, ranks, step_backends)
    H, KVH, D, page = SHAPE.heads, SHAPE.kv_heads, SHAPE.head_dim, SHAPE.page

    def starts(reqs):  # each branch's first draft in the table (prepare_for_draft's pages)
        return {(s, t): c + t * ((c % page + steps + page - 1) // page) * page for s, c in reqs for t in range(topk)}

    written = {(s, st + i) for reqs in DRAFT_ITERATIONS for (s, t), st in starts(reqs).items() for i in range(steps - 1)}
    keys, values = _world(ranks, g, written)

    max_bs = max(CAPTURE_BS)
    T = max_bs * topk
    static = SimpleNamespace(
        req_pool_indices=torch.zeros(max_bs, dtype=torch.int64), seq_lens=torch.full((max_bs,), FILL_SEQ_LEN),
        positions=torch.zeros(T, dtype=torch.int64), out_cache_loc=torch.zeros(T * steps, dtype=torch.int64),
        q=torch.zeros(steps, T, H * D), k=torch.zeros(steps, T, KVH * D), v=torch.zeros(steps, T, KVH * D),
    )  # fmt: skip
    ranks.run(lambda r: drafts[r].init_cuda_graph_state(max_bs, T))

    def static_batch(bs):
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=bs, req_pool_indices=static.req_pool_indices[:bs],
            seq_lens=static.seq_lens[:bs], seq_lens_cpu=None, seq_lens_sum=None, positions=static.positions[: bs * topk],
            out_cache_loc=static.out_cache_loc[: bs * topk * steps], out_cache_loc_is_physical=False,
            spec_info=SimpleNamespace(kv_indptr=None, kv_indices=None, window_kv_indices=None, custom_mask=None),
            kv_loc_plan=None, kv_loc_cols=None, encoder_lens=None, input_ids=None,
        )  # fmt: skip

    def step_batch(batch, i):  # what draft_forward hands step i (its writes and positions)
        n = batch.batch_size * topk
        per_step = batch.out_cache_loc.view(batch.batch_size, topk, steps).permute(2, 0, 1).reshape(steps, n)
        return SimpleNamespace(**{**vars(batch), "out_cache_loc": per_step[i], "positions": batch.positions + i})

    def body(draft, batch, q=None, k=None, v=None):  # the steps, one layer each
        n = batch.batch_size * topk
        out = []
        for i in range(steps - 1):
            qi, ki, vi = (static.q[i, :n], static.k[i, :n], static.v[i, :n]) if q is None else (q[i], k[i], v[i])
            out.append(self_attn(draft.attn_backends[i], LAYERS[0], qi, ki, vi, step_batch(batch, i)))  # the draft head's one layer
        return torch.stack(out)

    captured, metadata = {}, {}
    for bs in sorted(CAPTURE_BS, reverse=True):

        def capture(rank, bs=bs):
            draft, batch = drafts[rank], static_batch(bs)
            draft.init_forward_metadata_out_graph(batch, in_capture=True)
            meta = [b.forward_metadata for b in draft.attn_backends]
            for _ in range(2):
                body(draft, batch)
            return meta, _traced(lambda: body(draft, batch))[1]

        metadata[bs], captured[bs] = zip(*ranks.run(capture))

    for it, reqs in enumerate(DRAFT_ITERATIONS):
        raw_bs, n = len(reqs), len(reqs) * topk
        bs = min(b for b in CAPTURE_BS if b >= raw_bs)
        st = starts(reqs)
        token = [(s, t) for s, _ in reqs for t in range(topk)]  # draft token order: request-major
        q = torch.randn(steps, n, H * D, generator=g)
        k = torch.stack([torch.stack([keys[0][s][st[s, t] + i] for s, t in token]).reshape(n, -1) for i in range(steps)])
        v = torch.stack([torch.stack([values[0][s][st[s, t] + i] for s, t in token]).reshape(n, -1) for i in range(steps)])
        loc = torch.stack([ranks.req_to_token[s, st[s, t] + i] for s, _ in reqs for t in range(topk) for i in range(steps)]).long()
        committed = torch.tensor([c for _, c in reqs])
        batch = SimpleNamespace(
            **{**vars(static_batch(raw_bs)), "req_pool_indices": torch.tensor([s for s, _ in reqs]),
               "seq_lens": committed, "seq_lens_cpu": committed.clone(), "seq_lens_sum": int(committed.sum()),
               "positions": committed.repeat_interleave(topk), "out_cache_loc": loc}
        )  # fmt: skip
        batch.spec_info = SimpleNamespace(kv_indptr=None, kv_indices=None, window_kv_indices=None, custom_mask=None)

        def eager(rank):
            drafts[rank].init_forward_metadata(batch)
            out = body(drafts[rank], batch, q, k, v).clone()
            return out, _snapshot(ranks.pools[rank])

        eager_out = ranks.run(eager)
        _reset(ranks, [(s, st[s, t] + i) for s, t in token for i in range(steps - 1)])

        static.req_pool_indices.zero_(), static.seq_lens.fill_(FILL_SEQ_LEN), static.out_cache_loc.zero_()
        static.positions.zero_(), static.q.zero_(), static.k.zero_(), static.v.zero_()
        static.req_pool_indices[:raw_bs] = batch.req_pool_indices
        static.seq_lens[:raw_bs] = committed
        static.positions[:n] = batch.positions
        static.out_cache_loc[: n * steps] = loc
        static.q[:, :n], static.k[:, :n], static.v[:, :n] = q, k, v

        def replay(rank):
            draft, view = drafts[rank], static_batch(bs)
            draft.init_forward_metadata_out_graph(view)
            for b, meta in zip(draft.attn_backends, metadata[bs][rank]):
                b.forward_metadata = meta  # what the graph was captured with
            out, trace = _traced(lambda: body(draft, view))
            return out[:, :n].clone(), trace

        replayed = ranks.run(replay)
        for rank in range(SHAPE.kvp):
            out, trace = replayed[rank]
            where = f"iteration {it} {reqs} (padded to {bs}), KVP rank {rank}"
            assert trace == captured[bs][rank], f"{where}: the replayed steps differ from the captured ones"
            assert torch.equal(out, eager_out[rank][0]), f"{where}: graph path != eager"
            _assert_same_pool(ranks.pools[rank], eager_out[rank][1], f"{where}: the pool after replay != after eager")
            for i in range(steps - 1):
                seen = [[(s, p) for p in range(c)] + [(s, st[s, t] + d) for d in range(i + 1)] for (s, t), c in zip(token, committed.repeat_interleave(topk).tolist())]
                ref = _reference(q[i].view(n, H, D), keys[0], values[0], seen, rank)
                got = out[i].view(n, H // SHAPE.kvp, D).double()
                torch.testing.assert_close(got, ref, atol=2e-5, rtol=0, msg=lambda m: f"{where}, step {i}: {m}")


@pytest.mark.parametrize("kvp,chunk", [(2, 2), (4, 2), (3, 5), (8, 64)])
def test_list_kernel_equals_the_layout(kvp, chunk):
    """The list kernel every Triton DCP list is built with (``create_triton_kv_indices_for_dcp_triton``
    at the interleave; with a start, a draft step's runs) writes, for every rank, the rows of the
    positions ``[start, start + len)`` the rank owns, by the test's own reading of DCP's layout
    (owner ``(p // chunk) % kvp``, row ``(loc // page) * chunk + loc % chunk``), empty lists
    included, and nothing past them; its torch twin (torch_native's lists,
    ``create_kv_indices_for_dcp_torch``) writes the same rows, with a start too."""
    from sglang.kernels.ops.attention.dcp_kernels import (
        create_kv_indices_for_dcp_torch,
        create_triton_kv_indices_for_dcp_triton,
    )

    page, max_len = chunk * kvp, 300
    table = torch.zeros(5, max_len, dtype=torch.int32)
    for slot in range(5):
        table[slot] = page * (1 + slot * (max_len // page + 1)) + torch.arange(max_len, dtype=torch.int32)
    slots, lens = torch.tensor([3, 0, 4, 1, 2]), torch.tensor([1, 7, 299, 130, 0])
    for rank in range(kvp):
        for starts in (None, torch.tensor([0, 3, 17, 64, 0])):
            first = torch.zeros_like(lens) if starts is None else torch.minimum(starts, lens)
            want = []
            for s, a, b in zip(slots.tolist(), first.tolist(), lens.tolist()):
                owned = [p for p in range(a, b) if (p // chunk) % kvp == rank]
                locs = [int(table[s, p]) for p in owned]
                want.append([(loc // page) * chunk + loc % chunk for loc in locs])
            local = torch.tensor([len(w) for w in want])
            indptr = torch.zeros(len(want) + 1, dtype=torch.int32)
            indptr[1:] = torch.cumsum(local, 0)
            total = int(local.sum())
            out = torch.full((total + 50,), -1, dtype=torch.int64)
            create_triton_kv_indices_for_dcp_triton[(len(slots),)](
                table, slots, local, indptr, None if starts is None else first, out, table.stride(0), kvp, rank,
                interleave_size=chunk,
            )  # fmt: skip
            assert out[:total].tolist() == [r for w in want for r in w], (rank, starts)
            assert bool((out[total:] == -1).all()), (rank, starts)
            twin = torch.full((total,), -1, dtype=torch.int64)
            create_kv_indices_for_dcp_torch(
                table, slots, local, indptr, None if starts is None else first, twin, kvp, rank, chunk
            )
            assert torch.equal(twin, out[:total]), (rank, starts)


def _splits(lens, cores=132, num_heads=8, num_kv_heads=1, cap=256):
    out = torch.zeros(len(lens), dtype=torch.int32)
    gqa_decode.num_kv_splits_by_local_len(out, torch.tensor(lens), num_heads, num_kv_heads, cap, cores)
    return out.tolist()


@POLICY
def test_split_policy_per_request_from_local_length():
    """Upstream's split heuristic fed with local KV lengths (Llama-70B per-rank heads, an H100's
    SM count), at most one split per DCP_GQA_MIN_TOKENS_PER_SPLIT tokens: monotone in a request's
    length, capped, per request (a short request next to a long one is not split like it), and
    upstream's fixed count where the SM count is unknown (the CPU)."""
    cap, per_split = gqa_decode.DCP_GQA_MAX_KV_SPLITS, gqa_decode.DCP_GQA_MIN_TOKENS_PER_SPLIT
    lengths = [0, 1, 64, 255, 256, 257, 1000, 4096, 8192, 16384, 65536, 131072, 524288, 1 << 20]
    alone = [_splits([n])[0] for n in lengths]
    assert alone == sorted(alone) and 1 <= min(alone) and max(alone) == cap, alone
    assert all(s <= max(1, -(-n // per_split)) for n, s in zip(lengths, alone)), alone
    assert alone[lengths.index(131072)] == cap  # batch 1, a long shard: every split the cap allows
    long, short, mid = _splits([524288, 100, 300000])
    assert long == cap and short == 1 and 1 < mid <= cap
    many = _splits([2000] * 32)
    assert len(set(many)) == 1 and many[0] < _splits([2000])[0] + 1
    assert _splits([524288, 100], cores=0, cap=8) == [8, 8]


@POLICY
def test_split_policy_follows_the_backend_settings():
    """The policy of a Triton backend's settings: the SM count's, with upstream's count as the
    floor and 256 (or a higher --triton-attention-num-kv-splits) as the cap; upstream's fixed count
    without an SM count, with static splits, or with tiled (deterministic) splits. In the GQA mode
    only: a plain or gathered-Q DCP backend has none."""
    Policy, policy = gqa_decode.KVSplitPolicy, gqa_decode.kv_split_policy
    assert policy(8, 132, False, None) == Policy(8, gqa_decode.DCP_GQA_MAX_KV_SPLITS, 132)
    assert policy(512, 132, False, None) == Policy(512, 512, 132)
    for settings in ((8, 0, False, None), (8, 132, True, None), (8, 132, False, 256)):
        assert policy(*settings) == Policy(8, 8, 0), settings
        assert policy(*settings).grid_splits(1, 8, 1) == 8
    ranks = Ranks(SHAPE, "triton")
    assert all(b.dcp_split_policy == Policy(4, 4, 0) for b in ranks.backends)  # the CPU: upstream's
    gathered = Ranks(SHAPE, "triton", replicated_q=False)  # upstream DCP (Q gathered): none
    assert all(b.dcp_split_policy is None for b in gathered.backends)


@POLICY
def test_split_extent_fills_the_sms_per_batch():
    """A batch's split extent (the decode grid's split axis and its split buffers' S) fills
    DCP_GQA_CTAS_PER_SM programs per SM, a power of two between the backend's splits and the cap:
    the H200 measurements (batch 1: 256 splits, batch 4: 128 beat 256) on 132 SMs."""
    policy = gqa_decode.KVSplitPolicy(8, gqa_decode.DCP_GQA_MAX_KV_SPLITS, 132)
    by_batch = {b: policy.grid_splits(b, 8, 1) for b in (1, 2, 3, 4, 8, 16, 64, 256)}
    assert by_batch == {1: 256, 2: 256, 3: 128, 4: 128, 8: 64, 16: 32, 64: 8, 256: 8}, by_batch
    assert policy.grid_splits(1, 16, 2) == 256 and policy.grid_splits(4, 16, 2) == 64  # two KV-head programs
    assert policy.grid_splits(4, 8, 8) == 16  # MHA: a program per head
    # One graph split buffer holds every batch's (token, split) rows: batch 256 x 8 here, not 256 x 256.
    assert policy.split_rows(256, 8, 1) == 256 * 8
    assert policy.split_rows(4, 8, 1) == 512
    # Every extent it can launch is one of a few kernel variants (stage 2's MAX_KV_SPLITS is constexpr).
    assert {policy.grid_splits(b, 8, 1) for b in range(1, 513)} == {8, 16, 32, 64, 128, 256}


def test_the_all_to_all_runs_over_the_dcp_group(monkeypatch):
    """The GQA mode builds no group of its own (``parallel_state`` has no Helix group), and its
    All-to-All runs over the DCP group, which ``graph_capture`` (the decode graph runner's capture
    context) already enters, so the exchange is captured through its pynccl."""
    from contextlib import contextmanager

    from sglang.srt.distributed import parallel_state

    assert not [name for name in vars(parallel_state) if "HELIX" in name.upper()]
    entered = []

    class Group:
        def __init__(self, name):
            self.name = name

        @contextmanager
        def graph_capture(self, context=None, stream=None):
            entered.append(self.name)
            yield context if context is not None else SimpleNamespace(stream=stream)

    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: Group("tp"))
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: Group("pp"))
    for name in ("_DCP", "_ATTN_TP", "_SHARED_EXPERTS_TP", "_MOE_EP", "_MOE_TP"):
        monkeypatch.setattr(parallel_state, name, None)
    monkeypatch.setattr(parallel_state, "_DCP", Group("dcp"))
    with parallel_state.graph_capture():
        pass
    assert entered == ["tp", "pp", "dcp"]


@pytest.mark.parametrize("interleave", [1, 2])
def test_dcp_store_owns_by_slot_at_the_interleave(interleave):
    """``TritonAttnBackend._set_kv_buffer`` under DCP (every DCP write): a rank stores the tokens
    whose slot it owns -- runs of ``--dcp-interleave-size`` slots round robin -- at the slot's
    local row, and nothing else. The RoPE positions here are not the slots' (a tree verify's drafts
    sit at ``seq_len + depth``), so a rule that reads ``positions`` stores the wrong tokens; one
    that ignores the interleave, the wrong rows."""
    shape = Shape(**{**SHAPE.__dict__, "chunk": interleave})
    ranks = Ranks(shape, "triton")
    slots = torch.arange(8, 20, dtype=torch.int64)  # [T] logical slots of the new tokens (page-aligned)
    positions = torch.tensor([8, 9, 9, 10, 10, 10, 11, 12, 12, 13, 14, 14])  # RoPE: depth, not row
    k = torch.randn(slots.shape[0], SHAPE.kv_heads, SHAPE.head_dim)
    v = torch.randn(slots.shape[0], SHAPE.kv_heads, SHAPE.head_dim)
    batch = SimpleNamespace(out_cache_loc=slots, positions=positions, out_cache_loc_is_physical=False)

    def store(rank):
        pool = ranks.pools[rank]
        pool.get_key_buffer(0).fill_(float("nan"))
        ranks.backends[rank]._set_kv_buffer(batch, layer(shape), None, k, v)
        keys = pool.get_key_buffer(0)
        for t, slot in enumerate(slots.tolist()):
            owner = slot // interleave % SHAPE.kvp
            row = slot // (interleave * SHAPE.kvp) * interleave + slot % interleave
            if owner == rank:
                assert torch.equal(keys[row], k[t]), f"rank {rank}: token {t} (slot {slot}) not at row {row}"
        owned = sum(1 for s in slots.tolist() if s // interleave % SHAPE.kvp == rank)
        assert int((~keys.isnan().any(-1).any(-1)).sum()) == owned, f"rank {rank} stored other ranks' tokens"

    ranks.run(store)


# Plain DCP (Q gathered: ``--dcp-size`` alone, interleave 1) keeps 0.5.23's code (issue 79): each test
# calls 0.5.23's own method (the pinned wheel's, unbound, on the same backend) and the series'.
PLAIN_DCP = Shape(**{**SHAPE.__dict__, "chunk": 1})


def _pristine_triton():
    from sglang_helix.testing.pristine import pristine_module

    return pristine_module("sglang/srt/layers/attention/triton_backend.py").TritonAttnBackend


def test_plain_dcp_store_owns_by_position_as_upstream():
    """``_set_kv_buffer`` under plain DCP stores what 0.5.23's does, in every rank's pool: the token
    whose position this rank owns (``positions % dcp``) at row ``out_cache_loc // dcp``. The batch's
    positions are not its slots' residues, so the GQA mode's rule (by slot, above) would store the
    other rank's tokens."""
    pristine = _pristine_triton()
    ranks = Ranks(PLAIN_DCP, "triton", replicated_q=False)
    slots = torch.arange(8, 20, dtype=torch.int64)
    positions = slots + 1  # each token's owner by position is not its owner by slot
    k = torch.randn(slots.shape[0], SHAPE.kv_heads, SHAPE.head_dim)
    v = torch.randn(slots.shape[0], SHAPE.kv_heads, SHAPE.head_dim)
    batch = SimpleNamespace(out_cache_loc=slots, positions=positions, out_cache_loc_is_physical=False, dcp_kv_mask=None)

    def store(rank):
        backend, pool = ranks.backends[rank], ranks.pools[rank]
        assert backend.dcp_size == PLAIN_DCP.kvp and not backend.dcp_gqa_mode
        stored = []
        for set_kv_buffer in (pristine._set_kv_buffer, type(backend)._set_kv_buffer):
            pool.get_key_buffer(0).fill_(float("nan")), pool.get_value_buffer(0).fill_(float("nan"))
            set_kv_buffer(backend, batch, layer(PLAIN_DCP), None, k, v)
            stored.append((pool.get_key_buffer(0).clone(), pool.get_value_buffer(0).clone()))
        for want, got in zip(*stored):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        keys = stored[1][0]
        mine = [t for t, p in enumerate(positions.tolist()) if p % PLAIN_DCP.kvp == rank]
        for t in mine:
            assert torch.equal(keys[slots[t] // PLAIN_DCP.kvp], k[t]), f"rank {rank}: token {t}"
        assert int((~keys.isnan().any(-1).any(-1)).sum()) == len(mine), f"rank {rank} stored other ranks' tokens"

    ranks.run(store)


def test_plain_dcp_graph_kv_index_buffer_is_upstreams():
    """Plain DCP's graph KV index buffer is 0.5.23's, a whole context per token (its target verify
    and draft extend graphs list every key, as upstream's); the GQA mode's holds 1/KVP of it
    (``test_decode_capture_replay_equals_eager_and_plain_tp``)."""
    pristine = _pristine_triton()
    ranks = Ranks(PLAIN_DCP, "triton", replicated_q=False)
    max_bs, max_num_tokens = 4, 8

    def sizes(rank):
        backend, out = ranks.backends[rank], []
        for init_cuda_graph_state in (pristine.init_cuda_graph_state, type(backend).init_cuda_graph_state):
            init_cuda_graph_state(backend, max_bs, max_num_tokens)
            out.append(backend.cuda_graph_kv_indices.numel())
        return out

    for rank, (want, got) in enumerate(ranks.run(sizes)):
        assert got == want == max_num_tokens * ranks.backends[rank].max_context_len, (rank, got, want)
