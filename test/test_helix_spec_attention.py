"""Helix attention in the forwards of speculative decoding, both backends (issue 27).

A chain draft's iteration runs three kinds of forward over the sequence-sharded KV:

- the target verify (``TARGET_VERIFY``): the ``k + 1`` draft tokens of each request attend the
  committed prefix (``seq_lens``) and causally each other -- an extend of ``draft_token_num``
  tokens (``extend_lens_of``): the torch path, and on Triton the three extend calls;
- the draft decode steps (``DECODE`` with ``spec_info``): step ``i`` attends positions
  ``[0, seq_len + i]`` (``kv_ends_of``: position + 1). The multi-step draft backend prepares every
  step's backend before the steps run (``init_forward_metadata``), as the draft worker calls it:
  on Triton each step backend (``dcp_draft_step``) fills its own list set once, from the step-0
  positions (``DcpGqaDecodeState.prepare``), and the layers only read it;
- the draft extend (``DRAFT_EXTEND_V2``): an extend with its own prefix and extend lengths.

Each case drives ``dcp_gqa_attention`` on both ranks of a KVP = 2 layout (one fp32 pool per rank,
Triton kernels under the interpreter), merges the ranks' partials with upstream's
``dcp_lse_combine_triton`` (the All-to-All emulated as in ``test_helix_fp8_kv.py``), and compares
with float64 attention over the stored K/V. ``CHUNK = 2`` and 4 draft tokens: every verify and
every draft chain crosses ownership chunks.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are imported

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from test_helix_fp8_kv import (  # noqa: E402
    BACKENDS, CHUNK, D, H, KVH, KVP, MAX_LEN, _layer, _reference, attend, capture_partials, init_forward_metadata, paged_table_and_pools,
)  # fmt: skip
from sglang.kernels.ops.attention.dcp_kernels import dcp_lse_combine_triton  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.layers.dcp import gqa_layout as kv_layout  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend  # noqa: E402
from sglang.srt.layers.dcp import gqa_decode as decode_state  # noqa: E402
from sglang.srt.layers.dcp.gqa_decode import DcpGqaDecodeState  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: log(0) of empty KV

DRAFTS = 4  # draft_token_num: a chain of 3 steps + the verified token
SPEC = SimpleNamespace(draft_token_num=DRAFTS)


def _batch(mode, reqs, req_to_token, step=0):
    """``reqs``: ``(slot, committed seq_len, prefill prefix)`` per request. The fields Helix
    attention reads of a prefill of ``[prefix, seq_len)``, a target verify, draft decode step
    ``step``, or a draft extend (EAGLE v2: the ``DRAFTS`` tokens of the verify window over the
    committed prefix, ``seq_lens`` past them). Returns it and its ``(slot, start, end)`` spans."""
    slots = torch.tensor([s for s, _, _ in reqs])
    seq = torch.tensor([n for _, n, _ in reqs])
    if mode == "extend":  # a prefill of [prefix, seq_len)
        spans = [(p, n) for _, n, p in reqs]
        fields = dict(forward_mode=ForwardMode.EXTEND, spec_info=None)
    elif mode == "draft_extend":  # EAGLE v2: the DRAFTS verify-window tokens over the prefix, seq_lens past them
        spans = [(n, n + DRAFTS) for _, n, _ in reqs]
        seq = seq + DRAFTS
        fields = dict(forward_mode=ForwardMode.DRAFT_EXTEND_V2, spec_info=SPEC)
    elif mode == "verify":
        spans = [(n, n + DRAFTS) for _, n, _ in reqs]
        fields = dict(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=SPEC)
    else:  # draft decode step `step`: the token at seq_len + step
        spans = [(n + step, n + step + 1) for _, n, _ in reqs]
        fields = dict(forward_mode=ForwardMode.DECODE, spec_info=SPEC)
    prefix = torch.tensor([a for a, _ in spans])
    new = torch.tensor([b - a for a, b in spans])
    if mode in ("extend", "draft_extend"):
        fields.update(
            extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix.tolist(),
            extend_seq_lens=new, extend_seq_lens_cpu=new.tolist(),
        )  # fmt: skip
    else:  # a verify or a decode has no extend lengths (ForwardBatch leaves them None)
        fields.update(extend_prefix_lens=None, extend_prefix_lens_cpu=None, extend_seq_lens=None, extend_seq_lens_cpu=None)
    batch = SimpleNamespace(
        req_pool_indices=slots, seq_lens=seq, seq_lens_cpu=seq.clone(), out_cache_loc_is_physical=False,
        mha_one_shot=False, positions=torch.cat([torch.arange(a, b) for a, b in spans]),
        out_cache_loc=torch.cat([req_to_token[s, a:b] for (s, _, _), (a, b) in zip(reqs, spans)]).long(),
        **fields,
    )  # fmt: skip
    return batch, [(s, a, b) for (s, _, _), (a, b) in zip(reqs, spans)]


# (slot, committed seq_len, prefill prefix): a prefill, a verify, the draft's chain of 3 decode
# steps, a draft extend; then the next iteration's verify and draft steps on the longer prefix.
FORWARDS = [
    ("extend", [(0, 7, 0), (1, 5, 0)], 0),
    ("verify", [(0, 7, 0), (1, 5, 0)], 0),
    ("draft", [(0, 7, 0), (1, 5, 0)], 0),
    ("draft", [(0, 7, 0), (1, 5, 0)], 1),
    ("draft", [(0, 7, 0), (1, 5, 0)], 2),
    ("draft_extend", [(0, 7, 0), (1, 5, 0)], 0),
    ("verify", [(0, 10, 0), (1, 6, 0)], 0),
    ("draft", [(0, 10, 0), (1, 6, 0)], 0),
    ("draft", [(0, 10, 0), (1, 6, 0)], 1),
]


def triton_draft(pool, req_to_token, state, steps: int):
    """A rank's ``TritonMultiStepDraftBackend`` (as patched) over ``steps`` step backends on ``state``,
    step backend ``i`` with ``dcp_draft_step = i`` (what its ``__init__`` builds from a model runner)."""
    m = TritonMultiStepDraftBackend.__new__(TritonMultiStepDraftBackend)
    m.attn_backends = []
    for i in range(steps):
        backend = BACKENDS["triton"](pool, req_to_token)
        backend.dcp_gqa_decode, backend.dcp_draft_step = state, i
        m.attn_backends.append(backend)
    return m


def _forbid(name):
    def forbidden(self, *args, **kwargs):
        raise AssertionError(f"Tensor.{name}() in a Helix speculative forward: a device-to-host read")

    return forbidden


@pytest.mark.parametrize("backend_name", ["torch_native", "triton"])
def test_speculative_forwards_are_exact(monkeypatch, backend_name):
    g = torch.Generator().manual_seed(1)
    monkeypatch.setattr(decode_state, "max_speculative_num_draft_tokens", lambda: DRAFTS)
    req_to_token, pools = paged_table_and_pools(torch.float32)
    backends = [BACKENDS[backend_name](pools[r], req_to_token) for r in range(KVP)]
    triton = backend_name == "triton"
    draft_steps = DRAFTS - 1
    # the Triton backend's decode state (torch_native has none): a list set per draft step
    states = [DcpGqaDecodeState(req_to_token, r, KVP, CHUNK, list_sets=draft_steps) for r in range(KVP)]
    for r, backend in enumerate(backends):  # one per rank, kept across forwards as a server's is
        if triton:
            backend.dcp_gqa_decode = states[r]
    layer = _layer(None)
    partials = capture_partials(monkeypatch)
    filled = {r: 0 for r in range(KVP)}
    for r, state in enumerate(states if triton else ()):  # count the list fills (once per step, never by a layer)
        real = state.prepare

        def counted(fb, backend, in_graph=False, real=real, r=r):
            filled[r] += 1
            return real(fb, backend, in_graph)

        state.prepare = counted
    drafts = {}  # per rank, this round's Triton multi-step draft backend

    persistent = {}  # a draft step's writes and positions, per rank: one tensor for every step
    for mode, reqs, step in FORWARDS:
        batches = [_batch(mode, reqs, req_to_token, step) for _ in range(KVP)]
        for r, (b, _) in enumerate(batches):
            if mode == "draft":  # as the draft CUDA-graph runner: new values in the same tensors
                loc, pos = persistent.setdefault((r, b.out_cache_loc.shape[0]), (b.out_cache_loc.clone(), b.positions.clone()))
                b.out_cache_loc, b.positions = loc.copy_(b.out_cache_loc), pos.copy_(b.positions)
        spans = batches[0][1]
        T = sum(b - a for _, a, b in spans)
        q = torch.randn(T, H, D, generator=g)
        k = torch.randn(T, KVH, D, generator=g)
        v = torch.randn(T, KVH, D, generator=g)
        partials.clear()
        for r in range(KVP):
            parallel = SimpleNamespace(attn_dcp_rank=r, attn_dcp_size=KVP, dcp_interleave_size=CHUNK, dcp_group=None, dcp_comm_backend="a2a")
            monkeypatch.setattr(runtime_context, "_PARALLEL", parallel)
            batch = batches[r][0]
            backend = backends[r]
            if triton and mode == "draft":  # the draft worker's multi-step init, before the round's steps
                if step == 0:
                    drafts[r], before = triton_draft(pools[r], req_to_token, states[r], draft_steps), filled[r]
                    drafts[r].init_forward_metadata(batch)  # every step's lists, from the step-0 positions
                    assert filled[r] == before + draft_steps, "each draft step's lists are built once, before the steps"
                backend = drafts[r].attn_backends[step]
            else:
                if not triton:  # a chain draft step's rows (TorchNativeMultiStepDraftBackend, top-k 1): the request's
                    ends = batch.seq_lens + step + 1
                    backend.draft_decode_metadata = (req_to_token, batch.req_pool_indices, ends, ends.clone()) if mode == "draft" else None
                init_forward_metadata(backend, batch)  # (a torch draft step's: with its writes bound)
            before = dict(filled)
            with monkeypatch.context() as m:
                if triton and mode in ("draft", "verify"):  # no device-to-host read (on a GPU: a sync)
                    for name in ("item", "tolist", "cpu", "numpy"):
                        m.setattr(torch.Tensor, name, _forbid(name))
                for _ in range(2):  # two layers of one forward, both reading the lists built before them
                    attend(backend, layer, q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), batch)
            assert filled[r] == before[r], "a layer built lists: the backend's hooks build them, once per forward"

        keys = {0: [None] * MAX_LEN, 1: [None] * MAX_LEN}
        values = {0: [None] * MAX_LEN, 1: [None] * MAX_LEN}
        for slot, _, end in spans:  # the stored K/V, each position read from its owner's pool
            locs = req_to_token[slot, :end].long()
            for pos in range(end):
                owner = (pos // CHUNK) % KVP
                rows = kv_layout.write_rows(locs, owner, KVP, CHUNK)
                keys[slot][pos] = pools[owner].get_key_buffer(0)[rows[pos]].float()
                values[slot][pos] = pools[owner].get_value_buffer(0)[rows[pos]].float()
        second = partials[1::2]  # per rank, its second layer's partials (rank by rank, two layers each)
        assert len(second) == KVP
        out, _ = dcp_lse_combine_triton(torch.stack([o for o, _ in second]), torch.stack([lse for _, lse in second]))
        ref = _reference(q, keys, values, spans)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0, msg=lambda m: f"{mode} step {step} {reqs}: {m}")


def test_draft_step_backends_share_the_ranks_decode_buffers(monkeypatch):
    """Every Triton backend of a rank over one request table (the target's, and a speculative
    draft's per-step backends) gets the same ``DcpGqaDecodeState``: one buffer set, the one the KV
    pool sizing charged, with a list set per draft step (their lists are built before the steps
    run) and the workspace shared."""
    parallel = SimpleNamespace(dcp_gqa_mode=True, attn_dcp_rank=1, attn_dcp_size=KVP, dcp_interleave_size=CHUNK)
    monkeypatch.setattr(runtime_context, "_PARALLEL", parallel)
    monkeypatch.setattr(decode_state, "reserved_batch", lambda: 4)
    monkeypatch.setattr(decode_state, "draft_list_sets", lambda: 2)
    pool = SimpleNamespace(req_to_token=torch.zeros(2, MAX_LEN, dtype=torch.int32))  # the ReqToTokenPool
    states = [DcpGqaDecodeState.for_this_rank(pool) for _ in range(3)]  # target + two draft steps
    assert states[0] is states[1] is states[2] is pool.dcp_gqa_decode  # held by the table's pool, no global
    assert (states[0].kvp_rank, states[0].reserved_bs, states[0].req_to_token) == (1, 4, pool.req_to_token)
    assert states[0].list_sets == 2
    other = DcpGqaDecodeState.for_this_rank(SimpleNamespace(req_to_token=torch.zeros(2, MAX_LEN, dtype=torch.int32)))
    assert other is not states[0]
    parallel.dcp_gqa_mode = False
    assert DcpGqaDecodeState.for_this_rank(pool) is None


TOPK, STEPS_T = 2, 3  # a tree draft: 2 branches of 3 steps; its verify: DRAFTS tokens by a tree mask
PARENTS = [-1, 0, 0, 1]  # the verified tree: token 0 the root, 1 and 2 its children, 3 a child of 1


def _owned_kv(pools, locs):
    """float64 K/V ``[l, H, D]`` of logical ids ``locs``, each read from its owner's pool."""
    out = []
    for buf in ("get_key_buffer", "get_value_buffer"):
        rows = []
        for loc in locs.tolist():
            owner = (loc // CHUNK) % KVP
            row = int(kv_layout.write_rows(torch.tensor([loc]), owner, KVP, CHUNK)[0])
            rows.append(getattr(pools[owner], buf)(0)[row])
        out.append(torch.stack(rows).double().repeat_interleave(H // KVH, dim=1))
    return out


def _run_ranks(monkeypatch, backends, layer, batch_of, q, k, v, partials, init=True):
    """Every rank's Helix attention of one forward (after its ``init_forward_metadata``, unless the
    lists were built before: a draft step's, by the multi-step draft backend); the ranks' partials merged ``[T, H, D]``."""
    partials.clear()
    T = q.shape[0]
    for r, backend in enumerate(backends):
        parallel = SimpleNamespace(attn_dcp_rank=r, attn_dcp_size=KVP, dcp_interleave_size=CHUNK, dcp_group=None, dcp_comm_backend="a2a")
        monkeypatch.setattr(runtime_context, "_PARALLEL", parallel)
        if init:
            init_forward_metadata(backend, batch_of(r))
        attend(backend, layer, q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), batch_of(r))
    out, _ = dcp_lse_combine_triton(torch.stack([o for o, _ in partials]), torch.stack([lse for _, lse in partials]))
    return out


@pytest.mark.parametrize("backend_name", ["torch_native", "triton"])
def test_tree_draft_steps_and_tree_verify_are_exact(monkeypatch, backend_name):
    """Top-k 2: each branch's draft step sees the prefix and that branch's own drafts, which
    ``prepare_for_draft`` puts on the branch's own KV pages (torch_native: the draft backend's rows,
    ``TorchNativeMultiStepDraftBackend``; Triton: the list kernel over two runs per token, no host
    read); the verify applies the tree mask to the keys each rank owns (Triton: the owned prefix,
    then the owned tree keys by the mask's columns). Both equal float64 attention over the keys each
    token should see."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeMultiStepDraftBackend

    triton = backend_name == "triton"
    monkeypatch.setattr(decode_state, "max_speculative_num_draft_tokens", lambda: STEPS_T)
    monkeypatch.setattr(decode_state, "get_spec", lambda: SimpleNamespace(speculative_num_steps=STEPS_T))
    g = torch.Generator().manual_seed(3)
    req_to_token, pools = paged_table_and_pools(torch.float32)
    page = CHUNK * KVP
    layer = _layer(None)
    partials = capture_partials(monkeypatch)
    backends = []
    for r in range(KVP):
        backend = BACKENDS[backend_name](pools[r], req_to_token)
        if triton:  # a list set per draft step
            backend.dcp_gqa_decode = DcpGqaDecodeState(req_to_token, r, KVP, CHUNK, list_sets=STEPS_T - 1)
        else:
            backend.use_sliding_window_kv_pool, backend.draft_decode_metadata = False, None
        backends.append(backend)
    reqs = [(0, 7), (1, 5)]  # (slot, committed seq_len): the prefix ends mid-page
    slots = torch.tensor([s for s, _ in reqs])
    seq = torch.tensor([n for _, n in reqs])
    for s, n in reqs:  # one set of values, written by each owner
        kv = torch.randn(2, n, KVH, D, generator=g)
        for r in range(KVP):
            rows = kv_layout.write_rows(req_to_token[s, :n].long(), r, KVP, CHUNK)
            own = rows >= 0
            pools[r].get_key_buffer(0)[rows[own]] = kv[0][own]
            pools[r].get_value_buffer(0)[rows[own]] = kv[1][own]

    # The draft steps: branch t's step i writes row position seq + t * num_new_pages * page + i.
    multi = []  # per rank, the draft backend: one backend per step
    for r in range(KVP):
        if triton:
            multi.append(triton_draft(pools[r], req_to_token, backends[r].dcp_gqa_decode, STEPS_T - 1))
            continue
        m = TorchNativeMultiStepDraftBackend.__new__(TorchNativeMultiStepDraftBackend)
        m.topk, m.speculative_num_steps, m.page_size, m.req_to_token = TOPK, STEPS_T, page, req_to_token
        m.attn_backends = [BACKENDS["torch_native"](pools[r], req_to_token) for _ in range(STEPS_T - 1)]
        for backend in m.attn_backends:
            backend.use_sliding_window_kv_pool = False
        multi.append(m)
    new_pages = (seq % page + STEPS_T + page - 1) // page
    start = (seq[:, None] + torch.arange(TOPK)[None, :] * new_pages[:, None] * page).reshape(-1)  # [B * topk]
    req_of = torch.arange(len(reqs)).repeat_interleave(TOPK)
    # the round's writes as the draft worker allocates them, [B * topk * num_steps] laid out (b, t, step)
    writes = req_to_token[slots[req_of][:, None], start[:, None] + torch.arange(STEPS_T)].long().reshape(-1)
    round_batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, spec_info=SPEC, seq_lens=seq, seq_lens_cpu=seq.clone(), req_pool_indices=slots,
        out_cache_loc=writes, positions=seq[req_of],  # the step-0 tokens'
    )  # fmt: skip
    for r, m in enumerate(multi):  # once per draft round, before its steps (as the draft worker does)
        parallel = SimpleNamespace(attn_dcp_rank=r, attn_dcp_size=KVP, dcp_interleave_size=CHUNK, dcp_group=None, dcp_comm_backend="a2a")
        monkeypatch.setattr(runtime_context, "_PARALLEL", parallel)
        m.init_forward_metadata(round_batch)
    for step in range(STEPS_T - 1):
        loc = req_to_token[slots[req_of], start + step].long()
        fb = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, spec_info=SPEC, seq_lens=seq, seq_lens_cpu=seq.clone(),
            req_pool_indices=slots, out_cache_loc=loc, positions=seq[req_of] + step, out_cache_loc_is_physical=False,
        )  # fmt: skip
        T = loc.shape[0]
        q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
        step_backends = [m.attn_backends[step] for m in multi]
        with monkeypatch.context() as mp:
            if triton:  # no device-to-host read in a draft step (on a GPU: a sync)
                for name in ("item", "tolist", "cpu", "numpy"):
                    mp.setattr(torch.Tensor, name, _forbid(name))
            out = _run_ranks(monkeypatch, step_backends, layer, lambda r: fb, q, k, v, partials, init=False)
        for t in range(T):
            b = int(req_of[t])
            locs = torch.cat([req_to_token[slots[b], : seq[b]], req_to_token[slots[b], start[t] : start[t] + step + 1]])
            kb, vb = _owned_kv(pools, locs.long())
            ref = torch.einsum("hl,lhd->hd", (torch.einsum("hd,lhd->hl", q[t].double(), kb) * D**-0.5).softmax(-1), vb)
            torch.testing.assert_close(out[t].double(), ref, atol=1e-5, rtol=0, msg=lambda m: f"draft step {step} token {t}: {m}")

    # The tree verify: token j at row position seq + j, RoPE position seq + depth(j), the FULL_MASK layout.
    depth = [0] * DRAFTS
    ancestors = [{j} for j in range(DRAFTS)]
    for j, p in enumerate(PARENTS):
        if p >= 0:
            depth[j], ancestors[j] = depth[p] + 1, ancestors[j] | ancestors[p]
    masks = []
    for _, n in reqs:
        m = torch.ones(DRAFTS, n + DRAFTS, dtype=torch.bool)
        m[:, n:] = torch.tensor([[c in ancestors[j] for c in range(DRAFTS)] for j in range(DRAFTS)])
        masks.append(m.reshape(-1))
    spec = SimpleNamespace(draft_token_num=DRAFTS, tree_topk=TOPK, custom_mask=torch.cat(masks))
    loc = torch.cat([req_to_token[s, n : n + DRAFTS] for s, n in reqs]).long()
    fb = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec, seq_lens=seq, seq_lens_cpu=seq.clone(),
        req_pool_indices=slots, out_cache_loc=loc, extend_prefix_lens=None, extend_seq_lens=None,
        out_cache_loc_is_physical=False, mha_one_shot=False, positions=torch.cat([n + torch.tensor(depth) for _, n in reqs]),
    )  # fmt: skip
    T = loc.shape[0]
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
    with monkeypatch.context() as mp:
        if triton:  # the verify's lists and mask from host lengths: no device-to-host read
            for name in ("item", "tolist", "cpu", "numpy"):
                mp.setattr(torch.Tensor, name, _forbid(name))
        out = _run_ranks(monkeypatch, backends, layer, lambda r: fb, q, k, v, partials)
    for t in range(T):
        b, j = divmod(t, DRAFTS)
        s, n = reqs[b]
        locs = torch.cat([req_to_token[s, :n], req_to_token[s, n + torch.tensor(sorted(ancestors[j]))]])
        kb, vb = _owned_kv(pools, locs.long())
        ref = torch.einsum("hl,lhd->hd", (torch.einsum("hd,lhd->hl", q[t].double(), kb) * D**-0.5).softmax(-1), vb)
        torch.testing.assert_close(out[t].double(), ref, atol=1e-5, rtol=0, msg=lambda m: f"tree verify token {t}: {m}")


def test_torch_native_dcp_refuses_speculation_with_q_gathered(monkeypatch):
    """torch_native's DCP path serves speculation with replicated Q (the GQA mode, above); with Q
    gathered (``--dcp-size`` alone: the layer holds Q/tp of the group's heads) a verify, a draft
    extend and a draft step are refused by name, as before the mode shared the path."""
    req_to_token, pools = paged_table_and_pools(torch.float32)
    layer = _layer(None)
    parallel = SimpleNamespace(attn_dcp_rank=0, attn_dcp_size=KVP, dcp_interleave_size=CHUNK, dcp_group=None, dcp_comm_backend="ag_rs")
    monkeypatch.setattr(runtime_context, "_PARALLEL", parallel)
    for mode in ("verify", "draft_extend", "draft"):
        backend = BACKENDS["torch_native"](pools[0], req_to_token)
        backend.dcp_num_heads = H * KVP  # the group's heads: this layer's Q is gathered
        batch, spans = _batch(mode, [(0, 7, 0)], req_to_token)
        if mode == "draft":
            ends = batch.seq_lens + 1
            backend.draft_decode_metadata = (req_to_token, batch.req_pool_indices, ends, ends.clone())
        backend.init_forward_metadata(batch)
        T = sum(b - a for _, a, b in spans)
        with pytest.raises(NotImplementedError, match="replicated Q only"):
            backend._forward_dcp(torch.zeros(T, H * D), torch.zeros(T, KVH * D), torch.zeros(T, KVH * D), layer, batch, True)


class _TorchCalls(TorchFunctionMode):
    """Counts the torch calls (functions and Tensor methods) made under it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend_name", ["torch_native", "triton"])
def test_tree_verify_metadata_is_built_for_the_batch_at_once(monkeypatch, backend_name):
    """A tree verify's owned-key lists and its local mask (torch_native: the padded visibility;
    Triton: the mask columns of the owned tree keys) are built for the whole batch at once: as
    many torch calls for 6 requests as for 2, no per-request loop (issue 45: the torch DCP path and
    the tree verify without a per-request host loop)."""
    req_to_token, pools = paged_table_and_pools(torch.float32)
    parallel = SimpleNamespace(attn_dcp_rank=1, attn_dcp_size=KVP, dcp_interleave_size=CHUNK, dcp_group=None, dcp_comm_backend="a2a")
    monkeypatch.setattr(runtime_context, "_PARALLEL", parallel)
    calls = {}
    for seq_lens in ([7, 5], [7, 5, 9, 3, 6, 11]):
        slots, seq = torch.arange(len(seq_lens)) % 2, torch.tensor(seq_lens)
        masks = [torch.rand(DRAFTS, n + DRAFTS, generator=torch.Generator().manual_seed(n)) < 0.5 for n in seq_lens]
        spec = SimpleNamespace(draft_token_num=DRAFTS, tree_topk=TOPK, custom_mask=torch.cat([m.reshape(-1) for m in masks]))
        fb = SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec, seq_lens=seq, seq_lens_cpu=seq.clone(),
            req_pool_indices=slots, extend_prefix_lens=None, extend_seq_lens=None, out_cache_loc_is_physical=False,
            mha_one_shot=False, positions=(seq[:, None] + torch.arange(DRAFTS)).reshape(-1),
            out_cache_loc=torch.cat([req_to_token[s, n : n + DRAFTS] for s, n in zip(slots.tolist(), seq_lens)]).long(),
        )  # fmt: skip
        backend = BACKENDS[backend_name](pools[1], req_to_token)
        if backend_name == "triton":
            backend.dcp_gqa_decode = DcpGqaDecodeState(req_to_token, 1, KVP, CHUNK)
        with _TorchCalls() as counter:
            init_forward_metadata(backend, fb)
        calls[len(seq_lens)] = counter.calls
        # what the layers read: each request's mask at the keys this rank owns
        if backend_name == "triton":
            *_, tree_indptr, _, local_mask, mask_indptr = backend.forward_metadata.dcp_gqa.extend_lists
            tree_pos = kv_layout.local_kv_indices(req_to_token, slots, seq + DRAFTS, int(tree_indptr[-1]), 1, KVP, CHUNK, kv_starts=seq)[2]
            for b, n in enumerate(seq_lens):
                cols = tree_pos[tree_indptr[b] : tree_indptr[b + 1]]
                want = torch.cat([masks[b][:, cols], torch.zeros(DRAFTS, DRAFTS, dtype=torch.bool)], dim=1)
                assert torch.equal(local_mask[mask_indptr[b] : mask_indptr[b + 1]].view(DRAFTS, -1), want)
        else:
            meta = backend.dcp_metadata
            for b, n in enumerate(seq_lens):
                lo, hi = meta.kv_indptr_host[b], meta.kv_indptr_host[b + 1]
                want = masks[b][:, meta.kv_positions[lo:hi]]
                assert torch.equal(meta.padded_visible[b, :, : hi - lo], want)
                assert not meta.padded_visible[b, :, hi - lo :].any()
    assert calls[6] == calls[2], calls
