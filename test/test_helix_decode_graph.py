"""The Helix decode step through the Triton backend's CUDA-graph code path, on the CPU.

There is no CUDA graph on the CPU, so the test drives what the decode graph runner drives, in its
order, and proves that re-running the Python of a captured step is what a replay would execute:

- **capture** (per captured batch size, largest first): the runner's static inputs sliced to the
  size, ``init_forward_metadata_out_graph(in_capture=True)``, then the captured body twice as warm-up
  and once as "capture": ``init_forward_metadata_in_graph`` + the layers (``forward_decode``: upstream's K/V store, then its DCP branch, ``dcp_gqa_attention``).
- **replay**: the real batch copied into the static inputs, padded as the runner pads (``seq_len``
  1, slot 0, write loc 0), ``init_forward_metadata_out_graph`` on the replay view, then the
  captured body again.

Guards, on every replay: (b) the body calls no ``.item()`` / ``.tolist()`` / ``.cpu()`` /
``.numpy()`` and reads no device value on the host (``aten._local_scalar_dense``); every op and
every kernel launch has the same shapes as at capture (so no allocation takes its shape from a
host value), and every kernel argument not allocated inside the body is at its captured address
(the persistent buffers and static inputs: a graph holds addresses), i.e. the op trace of each
replay equals the capture's; the captured body launches every kernel of the step (the lists are
built inside the graph, not before it); (c) the step runs exactly one
All-to-All per layer, as eager Helix does. And (a): the real rows of every replay equal eager Helix
on the same batch bit for bit (the per-request split counts too), and float64 attention over the
whole context (what a plain-TP rank computes for those heads) within float32 rounding, over steps
whose lengths change, with requests finishing and joining, at padded batch sizes.

The step runs two layers, both reading the lists and workspace the hooks built before them. The rows a
step writes (its tokens' K/V, on the rank that owns each) hold NaN until that step: the attention
reads them back, so a step that does not store its K/V fails, and after every replay each rank's
pool equals its pool after eager on the same batch (the rows reset to NaN in between). The trace
records every kernel's integer and float arguments too: a graph replays them as captured.

Two KVP ranks run as two threads in one process (one Triton kernel at a time: the interpreter is
not thread-safe), with a two-party All-to-All between them; Triton kernels under the interpreter.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are imported

import threading  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from conftest import FULL  # noqa: E402
from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

if STUB_DIR not in sys.path:  # the sglang imports below pull in sgl_kernel
    sys.path.insert(0, STUB_DIR)

from sglang.srt.layers.attention.triton_backend import ForwardMetadata, TritonAttnBackend, TritonMultiStepDraftBackend  # noqa: E402
from sglang.srt.layers.dcp import comm as dcp_comm  # noqa: E402
from sglang.srt.layers.dcp import gqa_attention as attention, gqa_decode as decode_state, gqa_layout as kv_layout  # noqa: E402
from sglang.srt.layers.dcp.gqa_decode import DcpGqaDecodeState  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: log(0) of empty KV

KVP, CHUNK = 2, 2
H, KVH, D = 4, 2, 16  # query heads per rank (Q/TPA), KV heads (GQA 2), head dim
SLOTS, MAX_LEN = 6, 40
NUM_LAYERS = 2
CAPTURE_BS = (1, 2, 4)
FILL_SEQ_LEN = 1  # TritonAttnBackend.get_cuda_graph_seq_len_fill_value()
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
KERNELS = {  # module, attribute: the kernel launches of a Helix decode step
    "decode_attention_fwd": attention,
    "create_triton_kv_indices_for_dcp_triton": decode_state,  # upstream's list kernel
    "get_num_kv_splits_triton": decode_state,  # launched as kernel[grid](...)
    "dcp_pack_a2a_send": dcp_comm,  # must NOT run: stage 2 writes the send buffer itself
    "dcp_lse_combine_triton": dcp_comm,
}


class _TritonBackend(TritonAttnBackend):
    """The fields of the Triton backend that Helix decode reads; its hooks are upstream's, patched."""

    def __init__(self, pool, req_to_token, kvp_rank, draft_step=None, state=None):
        self.token_to_kv_pool, self.req_to_token, self.max_kv_splits = pool, req_to_token, 4
        # An H100's SM count: the per-request split policy runs (kv_split_policy).
        self.static_kv_splits, self.device_core_count, self.split_tile_size = False, 132, None
        self.dcp_gqa_decode = state or DcpGqaDecodeState(req_to_token, kvp_rank, KVP, CHUNK)
        self.dcp_draft_step = draft_step
        self.num_kv_head, self.dcp_gqa_dtype = KVH, torch.float32  # the workspace's heads and dtype
        self.dcp_size, self.dcp_rank, self.dcp_interleave_size = KVP, kvp_rank, CHUNK  # _set_kv_buffer's
        # What forward_decode reads before its DCP branch; the GQA mode's forward_metadata holds none
        self.use_mla = self.enable_deterministic = self.enable_lean_attention = False
        self.forward_metadata = ForwardMetadata(*[None] * 13)
        # What upstream's init_cuda_graph_state reads besides (a plain fp32 target on the CPU).
        self.dllm_attention, self.swa_v_head_dim, self.sliding_window_size = None, None, None
        self.num_head, self.v_head_dim, self.device, self.max_context_len = H, D, "cpu", MAX_LEN
        self.lean_total_programs, self.lean_block_m = 1, 1
        self.is_draft_runner, self.skip_prefill, self.num_draft_tokens = False, False, None
        self.use_sliding_window_kv_pool = False


def _self_attn(backend, layer, q, k, v, batch):
    """A model layer's ``self.attn`` on a decode: RadixAttention views K/V as ``[T, K, D]`` and calls
    the backend's ``forward_decode`` (upstream's K/V store, then its DCP branch)."""
    k, v = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim), v.view(-1, layer.tp_k_head_num, layer.v_head_dim)
    return backend.forward_decode(q, k, v, layer, batch)


class _Exchange:
    """A KVP-wide ``all_to_all_single`` between threads; one thread runs at a time (``turn``)."""

    def __init__(self):
        self.turn = threading.Lock()
        self.barrier = threading.Barrier(KVP)
        self.inputs = [None] * KVP
        self.calls = [0] * KVP

    def group(self, rank):
        exchange = self

        class Group:  # what dcp_a2a_lse_reduce_packed uses of a GroupCoordinator
            world_size = KVP

            def all_to_all_single(self, output, input):
                exchange.calls[rank] += 1
                exchange.inputs[rank] = input
                exchange.turn.release()
                exchange.barrier.wait()
                exchange.turn.acquire()
                with _disable_current_modes():
                    output.view(KVP, -1).copy_(torch.stack([x.view(KVP, -1)[rank] for x in exchange.inputs]))
                exchange.turn.release()
                exchange.barrier.wait()
                exchange.turn.acquire()

        return Group()


class _Guard(TorchDispatchMode):
    """Records every op (name, output shapes) and kernel launch (name, argument shapes, and where
    each argument lives); fails on a host read of a device value.

    Where an argument lives, as a CUDA graph sees it: a tensor allocated inside the captured body
    is replayed at its captured address (the graph's pool), so it is recorded by allocation order;
    any other tensor (a persistent buffer, a static input, the KV pool) must be at the same
    address at replay as at capture, so it is recorded by address.
    """

    def __init__(self):
        super().__init__()
        self.trace = []
        self.fresh = {}  # storage address -> allocation order (the latest there), allocated in the body
        self.allocations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host read of a device value (.item() / int() / bool()) in the Helix decode step")
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
    if hasattr(fn, "__getitem__"):  # a @triton.jit kernel: kernel[grid](...)
        return _JitKernel(name, fn)

    def launch(*args, **kwargs):
        guard = getattr(_tls, "guard", None)
        if guard is not None:  # tensors by shape and address, numbers by value (a graph replays them)
            tensors = [(tuple(t.shape), guard.where(t)) for t in _tensors((args, kwargs))]
            numbers = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, (bool, int, float))]
            guard.trace.append((name, tensors, numbers))
        _tls.in_kernel = True
        try:
            with _disable_current_modes():  # a kernel is one opaque launch, as on a GPU
                out = fn(*args, **kwargs)
        finally:
            _tls.in_kernel = False
        if guard is not None:  # what the launcher allocated (e.g. the merge's output)
            for t in _tensors(out):
                guard.allocated(t)
        return out

    return launch


class _JitKernel:
    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        return _kernel(self.name, self.kernel[grid])


def _forbid(name):
    original = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        if getattr(_tls, "guard", None) is not None and not getattr(_tls, "in_kernel", False):
            raise AssertionError(f"Tensor.{name}() in the Helix decode step")
        return original(self, *args, **kwargs)

    return method


def _batch(reqs, req_to_token):
    """An eager decode ForwardBatch (the fields Helix decode reads)."""
    slots = torch.tensor([s for s, _ in reqs])
    seq = torch.tensor([n for _, n in reqs])
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=len(reqs), req_pool_indices=slots, seq_lens=seq,
        seq_lens_cpu=seq, positions=seq - 1, spec_info=None, out_cache_loc_is_physical=False,
        out_cache_loc=torch.stack([req_to_token[s, n - 1] for s, n in reqs]).long(),
    )  # fmt: skip


def _reference(q, keys, values, reqs, rank):
    """float64 attention over the whole context, head slice ``rank`` of ``H``: ``[T, H/KVP, D]``."""
    out = []
    for t, (slot, seq) in enumerate(reqs):
        kb = torch.stack(keys[slot][:seq]).double().repeat_interleave(H // KVH, dim=1)  # [L, H, D]
        vb = torch.stack(values[slot][:seq]).double().repeat_interleave(H // KVH, dim=1)
        s = torch.einsum("hd,lhd->hl", q[t].double(), kb) * D**-0.5
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vb))
    h = H // KVP
    return torch.stack(out)[:, rank * h : (rank + 1) * h]


def _instrument(monkeypatch):
    """Trace the step's kernels, forbid host reads, and route the All-to-All to this thread's group."""
    # The split policy at these tiny lengths: up to 8 splits, one per 2 local tokens.
    monkeypatch.setattr(decode_state, "DCP_GQA_MAX_KV_SPLITS", 8)
    monkeypatch.setattr(decode_state, "DCP_GQA_MIN_TOKENS_PER_SPLIT", 2)
    for name, module in KERNELS.items():
        monkeypatch.setattr(module, name, _kernel(name, getattr(module, name)))
    for name in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _forbid(name))
    monkeypatch.setattr(attention, "get_parallel", lambda: SimpleNamespace(dcp_group=_tls.group))


LAYERS = [
    SimpleNamespace(
        layer_id=i, tp_q_head_num=H, tp_k_head_num=KVH, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5,
        k_scale=None, v_scale=None, k_scale_float=None, v_scale_float=None, logit_cap=0.0, sliding_window_size=-1,
        logit_capping_method="tanh",
    )  # fmt: skip
    for i in range(NUM_LAYERS)
]


def _row(req_to_token, slot, pos):
    """``(owner rank, row)`` of position ``pos`` of request slot ``slot``."""
    owner = (pos // CHUNK) % KVP
    return owner, int(kv_layout.write_rows(req_to_token[slot, pos : pos + 1].long(), owner, KVP, CHUNK)[0])


def _world(g, written):
    """``(req_to_token [SLOTS, MAX_LEN], pools [KVP], keys, values)``: paged logical locs (page 0
    reserved) and every position's K/V per layer (``keys[layer][slot][pos]``), written where its
    owner keeps it (a prefill did it), except the ``written`` ``(slot, pos)`` that the steps under
    test store themselves: NaN until then."""
    page = CHUNK * KVP
    req_to_token = torch.zeros(SLOTS, MAX_LEN, dtype=torch.int32)
    for slot in range(SLOTS):
        req_to_token[slot] = page * (1 + slot * MAX_LEN) + torch.arange(MAX_LEN, dtype=torch.int32)
    rows = (SLOTS * MAX_LEN + 1) * CHUNK
    pools = [
        MHATokenToKVPool(rows, 1, torch.float32, KVH, D, NUM_LAYERS, "cpu", enable_memory_saver=False)
        for _ in range(KVP)
    ]
    keys = [{s: [torch.randn(KVH, D, generator=g) for _ in range(MAX_LEN)] for s in range(SLOTS)} for _ in LAYERS]
    values = [{s: [torch.randn(KVH, D, generator=g) for _ in range(MAX_LEN)] for s in range(SLOTS)} for _ in LAYERS]
    for layer in range(NUM_LAYERS):
        for slot in range(SLOTS):
            for pos in range(MAX_LEN):
                owner, row = _row(req_to_token, slot, pos)
                stored = (slot, pos) not in written
                pools[owner].get_key_buffer(layer)[row] = keys[layer][slot][pos] if stored else float("nan")
                pools[owner].get_value_buffer(layer)[row] = values[layer][slot][pos] if stored else float("nan")
    return req_to_token, pools, keys, values


def _reset(pools, req_to_token, written):
    """The rows of ``written`` ``(slot, pos)`` back to NaN on their owners, every layer."""
    for slot, pos in written:
        owner, row = _row(req_to_token, slot, pos)
        for layer in range(NUM_LAYERS):
            pools[owner].get_key_buffer(layer)[row] = float("nan")
            pools[owner].get_value_buffer(layer)[row] = float("nan")


def _snapshot(pool):
    return [b.clone() for layer in range(NUM_LAYERS) for b in (pool.get_key_buffer(layer), pool.get_value_buffer(layer))]


def _assert_same_pool(pool, snapshot, where):
    for i, (now, then) in enumerate(zip(_snapshot(pool), snapshot)):
        torch.testing.assert_close(now, then, atol=0, rtol=0, equal_nan=True, msg=f"{where}: pool buffer {i}")


def _run_ranks(exchange, fn):
    """``fn(rank)`` for every KVP rank, one thread each, taking turns (``exchange.turn``)."""
    results, errors = {}, []

    def worker(rank):
        _tls.group = exchange.group(rank)
        with exchange.turn:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 -- reported below
                errors.append(e)
                exchange.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(KVP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[r] for r in range(KVP)]


def _traced(fn):
    """``(fn(), trace)``: ``fn`` run under a fresh ``_Guard``."""
    _tls.guard = guard = _Guard()
    try:
        with guard:
            out = fn()
    finally:
        _tls.guard = None
    return out, guard.trace


def test_decode_capture_replay_equals_eager_and_plain_tp(monkeypatch):
    _instrument(monkeypatch)
    g = torch.Generator().manual_seed(0)
    written = {(slot, n - 1) for reqs in STEPS for slot, n in reqs}  # each step stores its token's K/V
    req_to_token, pools, keys, values = _world(g, written)
    backends = [_TritonBackend(pools[r], req_to_token, r) for r in range(KVP)]

    # The runner's static inputs, shared by every captured size (sliced), and the graph state.
    max_bs = max(CAPTURE_BS)
    static = SimpleNamespace(
        req_pool_indices=torch.zeros(max_bs, dtype=torch.int64), seq_lens=torch.full((max_bs,), FILL_SEQ_LEN),
        out_cache_loc=torch.zeros(max_bs, dtype=torch.int64), q=torch.zeros(max_bs, H * D),
        k=torch.zeros(NUM_LAYERS, max_bs, KVH * D), v=torch.zeros(NUM_LAYERS, max_bs, KVH * D),
    )  # fmt: skip
    for backend in backends:  # the runner's call: the hook allocates the mode's graph buffers
        TritonAttnBackend.init_cuda_graph_state(backend, max_bs, max_bs)
        graph = backend.dcp_gqa_decode.graph
        assert graph is not None and backend.cuda_graph_kv_indices.data_ptr() == graph.kv_indices.data_ptr()  # 1/KVP of upstream's rows
        assert backend.cuda_graph_attn_logits.shape[0] == 0  # upstream's split buffers: never read here

    def static_batch(bs):
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=bs, req_pool_indices=static.req_pool_indices[:bs],
            seq_lens=static.seq_lens[:bs], seq_lens_cpu=static.seq_lens[:bs], positions=static.seq_lens[:bs] - 1,
            out_cache_loc=static.out_cache_loc[:bs], spec_info=None, out_cache_loc_is_physical=False,
        )  # fmt: skip

    def body(backend, batch):  # what the graph records: in-graph metadata prep + the layers
        TritonAttnBackend.init_forward_metadata_in_graph(backend, batch)
        bs = batch.batch_size
        return torch.stack([
            _self_attn(backend, layer, static.q[:bs], static.k[i, :bs], static.v[i, :bs], batch)
            for i, layer in enumerate(LAYERS)
        ])  # fmt: skip

    exchange = _Exchange()
    run_ranks = lambda fn: _run_ranks(exchange, fn)  # noqa: E731

    # Capture, largest size first: out-of-graph prep, two warm-ups, the capture (traced).
    captured = {}
    for bs in sorted(CAPTURE_BS, reverse=True):

        def capture(rank, bs=bs):
            backend, batch = backends[rank], static_batch(bs)
            TritonAttnBackend.init_forward_metadata_out_graph(backend, batch, in_capture=True)
            for _ in range(2):
                body(backend, batch)
            return _traced(lambda: body(backend, batch))[1]

        captured[bs] = run_ranks(capture)
        launched = {entry[0] for entry in captured[bs][0]}
        assert set(KERNELS) - {"dcp_pack_a2a_send"} <= launched and "dcp_pack_a2a_send" not in launched, launched

    split_counts = set()
    for step, reqs in enumerate(STEPS):
        raw_bs = len(reqs)
        bs = min(b for b in CAPTURE_BS if b >= raw_bs)
        q = torch.randn(raw_bs, H * D, generator=g)
        k = torch.stack([torch.stack([keys[i][s][n - 1] for s, n in reqs]).reshape(raw_bs, -1) for i in range(NUM_LAYERS)])
        v = torch.stack([torch.stack([values[i][s][n - 1] for s, n in reqs]).reshape(raw_bs, -1) for i in range(NUM_LAYERS)])
        batch = _batch(reqs, req_to_token)

        # Eager Helix: the backend's eager hook, then the layers on the real batch.
        def eager(rank):
            TritonAttnBackend.init_forward_metadata(backends[rank], batch)
            calls = exchange.calls[rank]
            out = torch.stack([
                _self_attn(backends[rank], layer, q, k[i], v[i], batch).clone()
                for i, layer in enumerate(LAYERS)
            ])  # fmt: skip
            splits = backends[rank].forward_metadata.dcp_gqa.num_kv_splits[:raw_bs].clone()
            return out, exchange.calls[rank] - calls, splits, _snapshot(pools[rank])

        eager_out = run_ranks(eager)
        _reset(pools, req_to_token, [(s, n - 1) for s, n in reqs])  # the replay must store them again

        # Replay: copy in and pad as the runner does, the replay-side prep, the captured body.
        static.req_pool_indices.zero_()
        static.seq_lens.fill_(FILL_SEQ_LEN)
        static.out_cache_loc.zero_()
        static.q.zero_(), static.k.zero_(), static.v.zero_()
        static.req_pool_indices[:raw_bs] = batch.req_pool_indices
        static.seq_lens[:raw_bs] = batch.seq_lens
        static.out_cache_loc[:raw_bs] = batch.out_cache_loc
        static.q[:raw_bs], static.k[:, :raw_bs], static.v[:, :raw_bs] = q, k, v

        def replay(rank):
            view = static_batch(bs)
            TritonAttnBackend.init_forward_metadata_out_graph(backends[rank], view)
            calls = exchange.calls[rank]
            out, trace = _traced(lambda: body(backends[rank], view))
            splits = backends[rank].forward_metadata.dcp_gqa.num_kv_splits[:raw_bs]
            assert splits.data_ptr() == backends[rank].dcp_gqa_decode.graph.num_kv_splits.data_ptr()
            splits = splits.clone()
            return out[:, :raw_bs].clone(), exchange.calls[rank] - calls, trace, splits

        replayed = run_ranks(replay)

        for rank in range(KVP):
            out, a2a, trace, splits = replayed[rank]
            where = f"step {step} {reqs} (padded to {bs}), KVP rank {rank}"
            assert trace == captured[bs][rank], f"{where}: the replayed step differs from the captured one"
            assert a2a == eager_out[rank][1] == NUM_LAYERS, f"{where}: {a2a} All-to-Alls, eager {eager_out[rank][1]}"
            assert torch.equal(out, eager_out[rank][0]), f"{where}: graph path != eager"
            assert torch.equal(splits, eager_out[rank][2]), f"{where}: splits {splits} != eager {eager_out[rank][2]}"
            _assert_same_pool(pools[rank], eager_out[rank][3], f"{where}: the pool after replay != after eager")
            split_counts.update(splits.tolist())
            for i in range(NUM_LAYERS):
                ref = _reference(q.view(raw_bs, H, D), keys[i], values[i], reqs, rank)
                got = out[i].view(raw_bs, H // KVP, D).double()
                torch.testing.assert_close(got, ref, atol=2e-5, rtol=0, msg=f"{where}, layer {i}")
    assert len(split_counts) >= 3, split_counts  # the per-request split policy was exercised


DRAFT_STEPS = 3  # --speculative-num-steps: a round runs 2 draft decode forwards, each its own backend
# Per draft round, (slot, committed seq_len): rounds of 2, 3, 1 and 4 requests (padded to 2, 4, 1, 4).
DRAFT_ROUNDS = [
    [(1, 5), (2, 9)],
    [(1, 7), (3, 3), (4, 12)],
    [(4, 14)],
    [(2, 20), (5, 2), (1, 9), (3, 6)],
]


def _draft_rows(reqs, topk):
    """Per draft token ``[T = B * topk]``: its request and the position of its step-0 row. Branch ``t``
    of a tree writes its drafts on its own pages, ``t * num_new_pages * page`` past ``seq_len``
    (``prepare_for_draft``); a chain's (topk 1) start at ``seq_len``."""
    page, out = CHUNK * KVP, []
    for b, (_, n) in enumerate(reqs):
        new_pages = (n % page + DRAFT_STEPS + page - 1) // page
        out += [(b, n + t * new_pages * page) for t in range(topk)]
    return out


# Full tier (2026-11-27, ~3.3 min of the default run on 2 cores): the default run keeps the decode
# step's capture test (the same hooks, buffers, NaN rows and pool comparison) and each draft step's
# list fill at its series prefix; HELIX_TEST_FULL=1 runs the chain and tree draft rounds.
@FULL
@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_draft_steps_capture_replay_equals_eager_and_plain_tp(monkeypatch, topk):
    """A speculative draft round through the draft graph runner's hooks on the real
    ``TritonMultiStepDraftBackend`` (as patched), in its order: its ``init_cuda_graph_state``
    (each step backend's, sizing the graph buffers for ``max_bs * topk`` tokens), its
    ``init_forward_metadata_out_graph`` before capture and before each replay, and its
    ``init_forward_metadata_in_graph`` (every step backend's: step ``i``'s lists from the step-0
    positions + ``i`` + 1, into its own list set of the graph buffers sized for ``max_bs * topk``
    tokens) at the start of the captured body, then per step the step's writes bound and the
    layers, positions advanced on the device. Every replay runs the captured op trace with no host
    read, one All-to-All per step, and its rows equal eager Helix's draft steps (the multi-step
    backend's ``init_forward_metadata`` before the steps, lists sized on the host) bit for bit and
    float64 attention over the prefix and the token's own drafts."""
    _instrument(monkeypatch)
    monkeypatch.setattr(decode_state, "max_speculative_num_draft_tokens", lambda: DRAFT_STEPS * topk)
    monkeypatch.setattr(decode_state, "get_spec", lambda: SimpleNamespace(speculative_num_steps=DRAFT_STEPS))
    g = torch.Generator().manual_seed(1)
    steps = DRAFT_STEPS - 1
    round_rows = [_draft_rows(reqs, topk) for reqs in DRAFT_ROUNDS]
    round_written = [
        sorted({(reqs[b][0], r + i) for b, r in rows for i in range(steps)}) for reqs, rows in zip(DRAFT_ROUNDS, round_rows)
    ]  # each round's draft steps store their tokens' K/V
    req_to_token, pools, keys, values = _world(g, {w for written in round_written for w in written})
    spec = SimpleNamespace()  # a draft step: a decode with spec_info
    # a list set per draft step (draft_list_sets)
    states = [DcpGqaDecodeState(req_to_token, r, KVP, CHUNK, list_sets=steps) for r in range(KVP)]
    step_backends, drafts = [], []  # per rank, one backend per step over the rank's one state (as the pool shares it)
    max_bs = max(CAPTURE_BS)
    for r in range(KVP):
        step_backends.append([_TritonBackend(pools[r], req_to_token, r, i, states[r]) for i in range(steps)])
        # The draft worker's TritonMultiStepDraftBackend over these step backends (its __init__ builds
        # them from a model runner), with the fields its graph hooks read.
        draft = TritonMultiStepDraftBackend.__new__(TritonMultiStepDraftBackend)
        draft.topk, draft.speculative_num_steps, draft.attn_backends = topk, DRAFT_STEPS, step_backends[r]
        draft.max_context_len, draft.device, draft.window_rail = MAX_LEN, "cpu", False
        draft.init_cuda_graph_state(max_bs, max_bs * topk)  # the draft graph runner's call
        drafts.append(draft)
    for state in states:  # sized by the hook for max_bs * topk tokens at the model's context
        assert state.graph is not None and state.graph.max_bs == max_bs * topk, "init_cuda_graph_state sized no graph buffers"

    T_max = max_bs * topk
    statics = [  # each rank's runner has its own static inputs (the body advances positions in place)
        SimpleNamespace(
            req_pool_indices=torch.zeros(max_bs, dtype=torch.int64), seq_lens=torch.full((max_bs,), FILL_SEQ_LEN),
            positions=torch.zeros(T_max, dtype=torch.int64), out_cache_loc=torch.zeros(steps, T_max, dtype=torch.int64),
            q=torch.zeros(steps, T_max, H * D), k=torch.zeros(NUM_LAYERS, steps, T_max, KVH * D),
            v=torch.zeros(NUM_LAYERS, steps, T_max, KVH * D),
        )  # fmt: skip
        for _ in range(KVP)
    ]

    def static_batch(rank, bs):
        static = statics[rank]
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=bs, req_pool_indices=static.req_pool_indices[:bs],
            seq_lens=static.seq_lens[:bs], seq_lens_cpu=static.seq_lens[:bs], positions=static.positions[: bs * topk],
            out_cache_loc=static.out_cache_loc[0, : bs * topk], spec_info=spec, out_cache_loc_is_physical=False,
        )  # fmt: skip

    def body(rank, batch):  # the draft runner's run_once: in-graph prep, then draft_forward's steps
        T, static = batch.positions.shape[0], statics[rank]
        drafts[rank].init_forward_metadata_in_graph(batch)  # every step backend's
        outs = []
        for i, backend in enumerate(step_backends[rank]):
            batch.out_cache_loc = static.out_cache_loc[i, :T]
            outs.append(torch.stack([
                _self_attn(backend, layer, static.q[i, :T], static.k[j, i, :T], static.v[j, i, :T], batch)
                for j, layer in enumerate(LAYERS)
            ]))  # fmt: skip
            batch.positions.add_(1)
        batch.positions.sub_(steps)  # as run_once restores them
        return outs

    exchange = _Exchange()
    run_ranks = lambda fn: _run_ranks(exchange, fn)  # noqa: E731
    captured = {}
    for bs in sorted(CAPTURE_BS, reverse=True):

        def capture(rank, bs=bs):
            batch = static_batch(rank, bs)
            drafts[rank].init_forward_metadata_out_graph(batch, in_capture=True)
            for _ in range(2):
                body(rank, batch)
            return _traced(lambda: body(rank, batch))[1]

        captured[bs] = run_ranks(capture)
        launched = [entry[0] for entry in captured[bs][0]]
        assert launched.count("create_triton_kv_indices_for_dcp_triton") == steps, launched  # each step's lists, in the body
        assert launched.count("decode_attention_fwd") == steps * NUM_LAYERS and "dcp_pack_a2a_send" not in launched

    for round_no, reqs in enumerate(DRAFT_ROUNDS):
        raw_bs = len(reqs)
        bs = min(b for b in CAPTURE_BS if b >= raw_bs)
        rows = round_rows[round_no]
        T, T_pad = raw_bs * topk, bs * topk
        slots = torch.tensor([s for s, _ in reqs])
        seq = torch.tensor([n for _, n in reqs])
        positions = torch.tensor([reqs[b][1] for b, _ in rows])  # RoPE position of step 0: seq_len
        loc = torch.stack([torch.stack([req_to_token[reqs[b][0], r + i] for b, r in rows]) for i in range(steps)]).long()
        q = torch.randn(steps, T, H * D, generator=g)
        k = torch.stack([
            torch.stack([torch.stack([keys[j][reqs[b][0]][r + i] for b, r in rows]) for i in range(steps)]).reshape(steps, T, -1)
            for j in range(NUM_LAYERS)
        ])  # fmt: skip
        v = torch.stack([
            torch.stack([torch.stack([values[j][reqs[b][0]][r + i] for b, r in rows]) for i in range(steps)]).reshape(steps, T, -1)
            for j in range(NUM_LAYERS)
        ])  # fmt: skip

        def eager(rank):  # the eager draft: the multi-step init (every step's lists), then each step's layers
            batch = SimpleNamespace(
                forward_mode=ForwardMode.DECODE, batch_size=raw_bs, req_pool_indices=slots, seq_lens=seq,
                seq_lens_cpu=seq, positions=positions.clone(), out_cache_loc=loc[0], spec_info=spec, out_cache_loc_is_physical=False,
            )  # fmt: skip
            drafts[rank].init_forward_metadata(batch)  # each step backend's, from the step-0 positions
            outs = []
            for i, backend in enumerate(step_backends[rank]):
                batch.out_cache_loc = loc[i]  # draft_forward binds the step's writes and advances positions
                calls = exchange.calls[rank]
                outs.append(torch.stack([
                    _self_attn(backend, layer, q[i], k[j, i], v[j, i], batch) for j, layer in enumerate(LAYERS)
                ]))  # fmt: skip
                assert exchange.calls[rank] - calls == NUM_LAYERS
                batch.positions.add_(1)
            return outs, _snapshot(pools[rank])

        eager_out = run_ranks(eager)
        _reset(pools, req_to_token, round_written[round_no])  # the replay must store them again

        # Replay: the round copied into the static inputs and padded (slot 0, seq_len 1, position 0, loc 0).
        for static in statics:
            static.req_pool_indices.zero_(), static.seq_lens.fill_(FILL_SEQ_LEN), static.positions.zero_()
            static.out_cache_loc.zero_(), static.q.zero_(), static.k.zero_(), static.v.zero_()
            static.req_pool_indices[:raw_bs], static.seq_lens[:raw_bs], static.positions[:T] = slots, seq, positions
            static.out_cache_loc[:, :T], static.q[:, :T], static.k[:, :, :T], static.v[:, :, :T] = loc, q, k, v

        def replay(rank):
            view = static_batch(rank, bs)
            drafts[rank].init_forward_metadata_out_graph(view)  # the replay's out-of-graph hook
            calls = exchange.calls[rank]
            outs, trace = _traced(lambda: body(rank, view))
            return [o[:, :T].clone() for o in outs], exchange.calls[rank] - calls, trace

        replayed = run_ranks(replay)
        for rank in range(KVP):
            outs, a2a, trace = replayed[rank]
            where = f"round {round_no} {reqs} (padded to {bs}, {T_pad} tokens), KVP rank {rank}"
            assert trace == captured[bs][rank], f"{where}: the replayed draft round differs from the captured one"
            assert a2a == steps * NUM_LAYERS, f"{where}: {a2a} All-to-Alls for {steps} steps x {NUM_LAYERS} layers"
            _assert_same_pool(pools[rank], eager_out[rank][1], f"{where}: the pool after replay != after eager")
            h = H // KVP
            for i in range(steps):
                assert torch.equal(outs[i], eager_out[rank][0][i]), f"{where}, step {i}: graph path != eager"
                for j, t, (b, r) in ((j, t, br) for j in range(NUM_LAYERS) for t, br in enumerate(rows)):
                    slot, n = reqs[b]  # the prefix, then the token's own drafts up to this step
                    pos = list(range(n)) + list(range(r, r + i + 1))
                    kb = torch.stack([keys[j][slot][p] for p in pos]).double().repeat_interleave(H // KVH, dim=1)
                    vb = torch.stack([values[j][slot][p] for p in pos]).double().repeat_interleave(H // KVH, dim=1)
                    sc = torch.einsum("hd,lhd->hl", q[i, t].view(H, D).double(), kb) * D**-0.5
                    ref = torch.einsum("hl,lhd->hd", sc.softmax(-1), vb)[rank * h : (rank + 1) * h]
                    got = outs[i][j, t].view(h, D).double()
                    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0, msg=f"{where}, layer {j}")


@pytest.mark.parametrize("kvp,chunk", [(2, 2), (4, 2), (3, 5), (8, 64)])
def test_local_kv_indices_kernel_equals_kv_layout(kvp, chunk):
    """The list builder's kernel writes exactly ``kv_layout.local_kv_indices``' lists, in place,
    for every rank (empty lists included), and nothing past them."""
    page, max_len = chunk * kvp, 300
    req_to_token = torch.zeros(5, max_len, dtype=torch.int32)
    for slot in range(5):
        req_to_token[slot] = page * (1 + slot * (max_len // page + 1)) + torch.arange(max_len, dtype=torch.int32)
    slots, lens = torch.tensor([3, 0, 4, 1, 2]), torch.tensor([1, 7, 299, 130, 0])
    for rank in range(kvp):
        total = kv_layout.total_local_len(lens, rank, kvp, chunk)
        indptr, indices, _ = kv_layout.local_kv_indices(req_to_token, slots, lens, total, rank, kvp, chunk)
        local_lens = kv_layout.local_kv_lens(lens, rank, kvp, chunk)
        out = torch.full((total + 50,), -1, dtype=torch.int64)
        decode_state.create_triton_kv_indices_for_dcp_triton[(len(slots),)](
            req_to_token, slots, local_lens, indptr, None, out, req_to_token.stride(0), kvp, rank,
            interleave_size=chunk,
        )  # fmt: skip
        assert torch.equal(out[:total], indices) and bool((out[total:] == -1).all()), rank


def test_eager_lists_without_a_charged_set():
    """Eager decode without a charged set (no decode graph batch configured) fills buffers of the
    step only, kept by nothing past it; the lists always equal kv_layout's."""
    page = CHUNK * KVP
    req_to_token = torch.zeros(SLOTS, MAX_LEN, dtype=torch.int32)
    for slot in range(SLOTS):
        req_to_token[slot] = page * (1 + slot * MAX_LEN) + torch.arange(MAX_LEN, dtype=torch.int32)
    backend = _TritonBackend(None, req_to_token, 1)
    state = backend.dcp_gqa_decode
    for reqs in STEPS:
        batch = _batch(reqs, req_to_token)
        TritonAttnBackend.init_forward_metadata(backend, batch)
        meta = backend.forward_metadata.dcp_gqa
        total = kv_layout.total_local_len(batch.seq_lens_cpu, 1, KVP, CHUNK)
        indptr, indices, _ = kv_layout.local_kv_indices(
            req_to_token, batch.req_pool_indices, batch.seq_lens, total, 1, KVP, CHUNK
        )
        assert torch.equal(meta.kv_indptr, indptr) and torch.equal(meta.kv_indices[:total], indices)
        assert meta.kv_indices.shape[0] == max(total, 1) and meta.num_kv_splits.shape[0] == len(reqs)
        assert state.graph is None  # nothing kept but the step's metadata


def _splits(lens, cores=132, num_heads=8, num_kv_heads=1, cap=decode_state.DCP_GQA_MAX_KV_SPLITS):
    out = torch.zeros(len(lens), dtype=torch.int32)
    decode_state.num_kv_splits_by_local_len(out, torch.tensor(lens), num_heads, num_kv_heads, cap, cores)
    return out.tolist()


def test_split_policy_per_request_from_local_length():
    """Upstream's split heuristic fed with local KV lengths (Llama-70B per-rank heads, an H100's
    SM count), at most one split per DCP_GQA_MIN_TOKENS_PER_SPLIT tokens: monotone in a request's
    length, capped, per request (a short request next to a long one is not split like it), and
    upstream's fixed count where the SM count is unknown (the CPU)."""
    cap, per_split = decode_state.DCP_GQA_MAX_KV_SPLITS, decode_state.DCP_GQA_MIN_TOKENS_PER_SPLIT
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


def test_split_policy_follows_the_backend_settings():
    Policy = decode_state.KVSplitPolicy
    backend = SimpleNamespace(max_kv_splits=8, static_kv_splits=False, device_core_count=132, split_tile_size=None)
    assert decode_state.kv_split_policy(backend) == Policy(8, decode_state.DCP_GQA_MAX_KV_SPLITS, 132)
    backend.max_kv_splits = 512  # --triton-attention-num-kv-splits 512: a higher cap is kept
    assert decode_state.kv_split_policy(backend) == Policy(512, 512, 132)
    for static in (
        dict(device_core_count=0),  # the CPU
        dict(static_kv_splits=True),  # SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS
        dict(split_tile_size=256),  # deterministic inference: fixed tiles
    ):
        b = SimpleNamespace(**{**vars(backend), "max_kv_splits": 8, **static})
        assert decode_state.kv_split_policy(b) == Policy(8, 8, 0), static
        assert decode_state.kv_split_policy(b).grid_splits(1, 8, 1) == 8


def test_split_extent_fills_the_sms_per_batch():
    """A batch's split extent (the decode grid's split axis and the workspace's S) fills
    DCP_GQA_CTAS_PER_SM programs per SM, a power of two between the backend's splits and the cap:
    the H200 measurements (batch 1: 256 splits, batch 4: 128 beat 256) on 132 SMs."""
    policy = decode_state.KVSplitPolicy(8, decode_state.DCP_GQA_MAX_KV_SPLITS, 132)
    by_batch = {b: policy.grid_splits(b, 8, 1) for b in (1, 2, 3, 4, 8, 16, 64, 256)}
    assert by_batch == {1: 256, 2: 256, 3: 128, 4: 128, 8: 64, 16: 32, 64: 8, 256: 8}, by_batch
    assert policy.grid_splits(1, 16, 2) == 256 and policy.grid_splits(4, 16, 2) == 64  # two KV-head programs
    assert policy.grid_splits(4, 8, 8) == 16  # MHA: a program per head
    # The workspace holds every batch's (token, split) rows: batch 256 x 8 here, not 256 x 256.
    assert policy.workspace_rows(256, 8, 1) == 256 * 8
    assert policy.workspace_rows(4, 8, 1) == 512
    # Every extent it can launch is one of a few kernel variants (stage 2's MAX_KV_SPLITS is constexpr).
    assert {policy.grid_splits(b, 8, 1) for b in range(1, 513)} == {8, 16, 32, 64, 128, 256}


def test_the_all_to_all_runs_over_the_dcp_group(monkeypatch):
    """Helix is DCP's GQA mode: it builds no group of its own (``parallel_state`` has no Helix
    group), and its All-to-All runs over the DCP group, which ``graph_capture`` (the decode graph
    runner's capture context) already enters, so the exchange is captured through its pynccl."""
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
    """``TritonAttnBackend._set_kv_buffer`` under DCP (every DCP write, the GQA mode's too): a rank
    stores the tokens whose slot it owns -- runs of ``--dcp-interleave-size`` slots round robin
    (``localize_dcp_indices``) -- at the slot's local row, and nothing else. The RoPE positions here
    are not the slots' (a tree verify's drafts sit at ``seq_len + depth``), so a rule that reads
    ``positions`` stores the wrong tokens; one that ignores the interleave, the wrong rows."""
    slots = torch.arange(8, 20, dtype=torch.int64)  # [T] logical slots of the new tokens (page-aligned)
    positions = torch.tensor([8, 9, 9, 10, 10, 10, 11, 12, 12, 13, 14, 14])  # RoPE: depth, not row
    k, v = torch.randn(slots.shape[0], KVH, D), torch.randn(slots.shape[0], KVH, D)
    batch = SimpleNamespace(out_cache_loc=slots, positions=positions, out_cache_loc_is_physical=False)
    for rank in range(KVP):
        pool = MHATokenToKVPool(32, 1, torch.float32, KVH, D, 1, "cpu", enable_memory_saver=False)
        pool.get_key_buffer(0).fill_(float("nan"))
        backend = _TritonBackend(pool, torch.zeros(1, MAX_LEN, dtype=torch.int32), rank)
        backend.dcp_interleave_size = interleave
        TritonAttnBackend._set_kv_buffer(backend, batch, LAYERS[0], None, k, v)
        keys = pool.get_key_buffer(0)
        for t, slot in enumerate(slots.tolist()):
            owner = slot // interleave % KVP
            row = slot // (interleave * KVP) * interleave + slot % interleave
            if owner == rank:
                assert torch.equal(keys[row], k[t]), f"rank {rank}: token {t} (slot {slot}) not at row {row}"
        owned = sum(1 for s in slots.tolist() if s // interleave % KVP == rank)
        assert int((~keys.isnan().any(-1).any(-1)).sum()) == owned, f"rank {rank} stored other ranks' tokens"
