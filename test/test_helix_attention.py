"""DCP's GQA mode, one layer on the KVP ranks of a group, every kind of forward, both backends.

Each case builds the real backends of a KVP = 2 group (``sglang_helix.testing.dcp_ranks``: one
``TritonAttnBackend`` or ``TorchNativeAttnBackend`` per rank, built from a model runner's fields, its
own KV pool, the ranks' All-to-All between threads; Triton kernels under the interpreter) and drives
what a model layer drives: the backend's ``init_forward_metadata`` (for the draft steps the
multi-step draft backend's), then ``forward_extend`` / ``forward_decode`` with the layer's Q/K/V.
Every rank must return exact attention for its ``Q/N`` heads.

The reference is the test's own: it records the K/V it fed for every (request, table position), in
the pool's precision where the backend reads them back from the pool (an fp8 pool: ``fp8(k / scale)
* scale``), and computes float64 attention of every query over the keys it should see -- a prefill
or draft extend causally, a decode up to its own position, a verify the committed prefix plus the
drafts its tree mask shows, draft step ``i`` of branch ``t`` the committed prefix plus that branch's
drafts ``0..i`` -- never from a pool the code wrote or from the code's lists. Forwards run in
sequence (a chunked prefill, decodes, a verify, a draft extend, draft steps), each reading what the
earlier ones stored, with ``CHUNK = 2``: every forward crosses ownership chunks, and some requests
have keys one rank does not own at all.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are imported

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from sglang_helix.testing.dcp_ranks import Ranks, Shape, Spec, layer, self_attn  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: log(0) of empty KV

SHAPE = Shape(heads=4, kv_heads=2, head_dim=16, kvp=2, chunk=2, slots=3, max_len=48)
FP8 = torch.float8_e4m3fn


class Record:
    """What attention should see: the K/V fed for each (slot, table position), as fed and as the pool
    holds them (``scales``: an fp8 pool stores ``fp8(k / k_scale)``, reads multiply back)."""

    def __init__(self, kv_dtype, scales, rounding=0.0):
        self.kv_dtype, self.scales, self.rounding = kv_dtype, scales or (1.0, 1.0), rounding
        self.fed, self.stored = {}, {}

    def write(self, layer_id, slot, table_pos, k, v):
        key = layer_id, slot, table_pos
        self.fed[key] = (k, v)
        ks, vs = self.scales
        if self.kv_dtype == torch.float32:
            self.stored[key] = (k, v)
        else:
            self.stored[key] = (
                (k / ks).to(self.kv_dtype).float() * ks,
                (v / vs).to(self.kv_dtype).float() * vs,
            )


def reference(q, seen, scaling):
    """float64 attention of ``q [T, H, D]``; ``seen[t]`` the (k, v) pairs query ``t`` sees."""
    out = []
    for t, pairs in enumerate(seen):
        group = q.shape[1] // pairs[0][0].shape[0]
        k = torch.stack([kv[0] for kv in pairs]).double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = torch.stack([kv[1] for kv in pairs]).double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[t].double(), k) * scaling
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
    return torch.stack(out)


def _batch(ranks, mode, slots, seq_lens, positions, writes, **fields):
    """The ForwardBatch fields the backends read. ``writes [T]``: each new token's (slot, position
    in its request's row of the table), where it is stored."""
    seq = torch.tensor(seq_lens)
    slot_of, table_pos = zip(*writes)
    defaults = dict(
        forward_mode=mode, batch_size=len(slots), req_pool_indices=torch.tensor(slots), seq_lens=seq,
        seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()), positions=torch.tensor(positions),
        out_cache_loc=ranks.req_to_token[torch.tensor(slot_of), torch.tensor(table_pos)].long(), out_cache_loc_is_physical=False,
        spec_info=None, encoder_lens=None, kv_loc_plan=None, kv_loc_cols=None, mha_one_shot=False,
        attn_attend_prefix_cache=False, extend_prefix_lens=None, extend_prefix_lens_cpu=None,
        extend_seq_lens=None, extend_seq_lens_cpu=None,
    )  # fmt: skip
    defaults.update(fields)
    return SimpleNamespace(**defaults)


def extend_batch(ranks, reqs, mode=ForwardMode.EXTEND, spec_info=None):
    """A prefill chunk (or a draft extend) of ``reqs``: ``(slot, prefix, seq_len)``, new tokens at
    table positions ``[prefix, seq_len)``."""
    prefix = torch.tensor([p for _, p, _ in reqs])
    seq = torch.tensor([n for _, _, n in reqs])
    writes = [(s, i) for s, p, n in reqs for i in range(p, n)]
    b = _batch(
        ranks, mode, [s for s, _, _ in reqs], seq.tolist(), [i for _, i in writes], writes, spec_info=spec_info,
        extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix.tolist(),
        extend_seq_lens=seq - prefix, extend_seq_lens_cpu=(seq - prefix).tolist(),
    )  # fmt: skip
    return b


def run(ranks, record, batch, q, k, v, scaling, writes, seen, build=None, backends=None, layer_id=0):
    """Store ``k/v [T, KVH, D]`` in the record at ``writes`` (each token's (slot, table position)),
    run the layer on every rank, and compare each rank's heads with float64 attention over
    ``seen``. ``build(rank)``: the metadata hook to call (default: the rank's backend's
    ``init_forward_metadata``). ``layer_id``: the layer's KV in the pools (the target's 0, the
    draft model's 1)."""
    for t, (slot, tp) in enumerate(writes):
        record.write(layer_id, slot, tp, k[t], v[t])
    scales = record.scales if record.kv_dtype != torch.float32 else None
    shape = ranks.shape
    L = layer(shape, scaling=scaling, scales=scales, layer_id=layer_id)

    def fn(rank):
        backend = (backends or ranks.backends)[rank]
        if build is None:
            backend.init_forward_metadata(batch)
        else:
            build(rank)
        return self_attn(backend, L, q.clone(), k.clone(), v.clone(), batch)

    outs = ranks.run(fn)
    ref = reference(q, [[kv(layer_id) for kv in keys] for keys in seen], scaling)
    h = shape.heads // shape.kvp
    for rank, out in enumerate(outs):
        out = out.view(q.shape[0], h, shape.head_dim).double()
        # an fp8 pool: Triton's GQA kernels also multiply fp8 V by the probabilities cast to fp8
        atol = 5e-6 if record.kv_dtype == torch.float32 else 2.5 * record.rounding
        torch.testing.assert_close(out, ref[:, rank * h : (rank + 1) * h], atol=atol, rtol=0)


def _tensors(g, T, kv_dtype=torch.float32, shape=SHAPE):
    # q exactly representable in the KV dtype: Triton's extend casts q to it for the prefix
    q = torch.randn(T, shape.heads, shape.head_dim, generator=g).to(kv_dtype).float()
    k = torch.randn(T, shape.kv_heads, shape.head_dim, generator=g)
    v = torch.randn(T, shape.kv_heads, shape.head_dim, generator=g)
    return q, k, v


def _pool(record, slot, tp):
    return lambda layer_id: record.stored[layer_id, slot, tp]


def _fed(record, slot, tp):
    return lambda layer_id: record.fed[layer_id, slot, tp]


# KV dtype, its largest relative rounding error (3 or 2 mantissa bits), the layer's (k, v) scales
KV_CACHES = {
    "plain": (torch.float32, 0.0, None),
    "e4m3": (torch.float8_e4m3fn, 2**-4, (2.5, 0.25)),
    "e5m2": (torch.float8_e5m2, 2**-3, (2.5, 0.25)),
}


@pytest.mark.parametrize("kv_cache", list(KV_CACHES))
@pytest.mark.parametrize("backend", ["triton", "torch_native", "torch_native-blocked"])
def test_prefill_and_decode_are_exact(monkeypatch, backend, kv_cache):
    """A prefill in two chunks (one request's second chunk over a prefix one rank owns none of),
    then decodes; a non-default softmax scale; a plain pool and fp8 pools with scales != 1 (the
    write divides by them, the reads multiply back). ``torch_native-blocked``: its queries one row
    at a time, as a long prefill's are."""
    if backend == "torch_native-blocked":
        from sglang.srt.layers.dcp import torch_attention

        monkeypatch.setattr(torch_attention, "_SCORE_ELEMS", 1)
        backend = "torch_native"
    kv_dtype, rounding, scales = KV_CACHES[kv_cache]
    ranks = Ranks(Shape(**{**SHAPE.__dict__, "kv_dtype": kv_dtype}), backend)
    record, g, scaling = Record(kv_dtype, scales, rounding), torch.Generator().manual_seed(0), 0.37
    in_hand = backend == "triton"  # Triton's extend attends the new tokens from the K/V in hand
    for reqs in ([(0, 0, 1), (1, 0, 6)], [(0, 1, 7), (1, 6, 9)]):
        batch = extend_batch(ranks, reqs)
        writes = [(s, i) for s, p, n in reqs for i in range(p, n)]
        seen = [
            [(_fed if in_hand and j >= p else _pool)(record, s, j) for j in range(i + 1)]
            for s, p, n in reqs
            for i in range(p, n)
        ]
        run(ranks, record, batch, *_tensors(g, len(writes), kv_dtype), scaling, writes, seen)
    for step in range(3):
        lens = [7 + step, 9 + step]
        batch = _batch(ranks, ForwardMode.DECODE, [0, 1], [n + 1 for n in lens], lens, list(zip([0, 1], lens)))
        seen = [[_pool(record, s, j) for j in range(n + 1)] for s, n in zip([0, 1], lens)]
        run(ranks, record, batch, *_tensors(g, 2, kv_dtype), scaling, list(zip([0, 1], lens)), seen)


def tree_mask(seq_lens, parents):
    """FULL_MASK verify mask (per request ``[n, seq_len + n]``, back to back) of a draft tree given
    by ``parents`` (``-1``: the root); draft ``j`` sees the prefix, its ancestors and itself."""
    n, rows = len(parents), []
    for s in seq_lens:
        for j in range(n):
            row = [1] * s + [0] * n
            a = j
            while a != -1:
                row[s + a] = 1
                a = parents[a]
            rows.extend(row)
    return torch.tensor(rows, dtype=torch.bool)


def ancestors(parents, j):
    out, a = [], j
    while a != -1:
        out.append(a)
        a = parents[a]
    return sorted(out)


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_forwards_are_exact(backend, tree):
    """A prefill, then the forwards of two speculative iterations: a target verify (a chain:
    causal; a tree: by its mask), a draft extend, and the draft's decode steps (top-k 2 branches
    for the tree, each on its own pages), each rank over its own KV."""
    _speculative_forwards(SHAPE, backend, tree)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_plain_torch_native_speculative_forwards_are_exact(tree):
    """The same forwards on one rank without DCP: torch_native's own draft decode, target verify
    and draft extend (upstream 0.5.23 has none; the series' torch_native speculation patch)."""
    _speculative_forwards(Shape(**{**SHAPE.__dict__, "kvp": 1}), "torch_native", tree)


def _speculative_forwards(shape, backend, tree):
    topk, steps, n = (2, 3, 4) if tree else (1, 3, 4)
    spec = Spec(num_steps=steps, topk=topk, num_draft_tokens=n)
    ranks = Ranks(shape, backend, spec=spec, num_layers=2)  # the target's layer 0, the draft's 1
    record, g, scaling = Record(torch.float32, None), torch.Generator().manual_seed(1), 0.29
    in_hand = backend == "triton"
    slots, committed = [0, 1], [7, 5]
    parents = [-1, 0, 0, 1] if tree else [-1, 0, 1, 2]

    # a prefill of the committed prefixes, in the target and in the draft model
    reqs = [(s, 0, c) for s, c in zip(slots, committed)]
    writes = [(s, i) for s, _, c in reqs for i in range(c)]
    seen = [[(_fed if in_hand else _pool)(record, s, j) for j in range(i + 1)] for s, _, c in reqs for i in range(c)]
    for layer_id in (0, 1):
        batch = extend_batch(ranks, reqs)
        run(ranks, record, batch, *_tensors(g, len(writes)), scaling, writes, seen, layer_id=layer_id)

    for it in range(2):
        # target verify: draft j at table position seq + j, RoPE position seq + depth(j)
        mask = tree_mask(committed, parents) if tree else None
        spec_info = SimpleNamespace(
            draft_token_num=n, num_tokens_per_req=n, custom_mask=mask, tree_topk=topk,
            kv_indptr=None, kv_indices=None, window_kv_indices=None,
        )  # fmt: skip
        writes = [(s, c + j) for s, c in zip(slots, committed) for j in range(n)]
        positions = [c + len(ancestors(parents, j)) - 1 for c in committed for j in range(n)]
        batch = _batch(ranks, ForwardMode.TARGET_VERIFY, slots, committed, positions, writes, spec_info=spec_info)
        seen = [
            [_pool(record, s, i) for i in range(c)]
            + [(_fed if in_hand else _pool)(record, s, c + a) for a in ancestors(parents, j)]
            for s, c in zip(slots, committed)
            for j in range(n)
        ]
        run(ranks, record, batch, *_tensors(g, len(writes)), scaling, writes, seen)

        # accept two drafts; the draft model extends the n tokens of the verify window [c, c + n)
        window = committed
        committed = [c + 2 for c in committed]
        reqs = [(s, c, c + n) for s, c in zip(slots, window)]
        batch = extend_batch(ranks, reqs, ForwardMode.DRAFT_EXTEND_V2, SimpleNamespace(draft_token_num=n))
        writes = [(s, i) for s, p, e in reqs for i in range(p, e)]
        seen = [
            [(_fed if in_hand and j >= p else _pool)(record, s, j) for j in range(i + 1)]
            for s, p, e in reqs
            for i in range(p, e)
        ]
        run(ranks, record, batch, *_tensors(g, len(writes)), scaling, writes, seen, layer_id=1)

        # the draft's decode steps over the committed prefix: step i of branch t writes at its
        # branch's table position start_t + i and sees the prefix and its branch's drafts 0..i
        page = shape.page
        starts = {
            (s, t): c + t * ((c % page + steps + page - 1) // page) * page
            for s, c in zip(slots, committed)
            for t in range(topk)
        }
        writes = torch.stack(
            [ranks.req_to_token[s, starts[s, t] + i] for s in slots for t in range(topk) for i in range(steps)]
        ).long()  # [B, topk, steps]: the layout per_step_draft_out_cache_loc reads
        draft_batch = _batch(
            ranks, ForwardMode.DECODE, slots, committed, [c for c in committed for _ in range(topk)],
            [(s, starts[s, t]) for s in slots for t in range(topk)],
            spec_info=SimpleNamespace(kv_indptr=None, kv_indices=None, window_kv_indices=None, custom_mask=None),
        )  # fmt: skip
        draft_batch.out_cache_loc = writes
        built = set()

        def build(rank):
            if rank not in built:  # the multi-step backend prepares every step before they run
                ranks.draft_backends[rank].init_forward_metadata(draft_batch)
                built.add(rank)

        for i in range(steps - 1):
            step_batch = SimpleNamespace(**vars(draft_batch))
            step_batch.out_cache_loc = writes.view(len(slots), topk, steps)[:, :, i].reshape(-1)
            step_batch.positions = torch.tensor([c + i for c in committed for _ in range(topk)])
            writes_i = [(s, starts[s, t] + i) for s in slots for t in range(topk)]
            seen = [
                [_pool(record, s, j) for j in range(c)] + [_pool(record, s, starts[s, t] + d) for d in range(i + 1)]
                for s, c in zip(slots, committed)
                for t in range(topk)
            ]
            backends = [d.attn_backends[i] for d in ranks.draft_backends]
            run(ranks, record, step_batch, *_tensors(g, len(writes_i)), scaling, writes_i, seen, build, backends, 1)


def test_torch_native_dcp_refuses_speculation_with_q_gathered():
    """torch_native's DCP path serves speculation with replicated Q (the GQA mode, above); with Q
    gathered (``--dcp-size`` alone: the layer holds Q/tp of the group's heads) a verify and a draft
    extend are refused by name."""
    ranks = Ranks(SHAPE, "torch_native")
    L = layer(SHAPE)
    n = 4
    spec_info = SimpleNamespace(draft_token_num=n, num_tokens_per_req=n, custom_mask=None, tree_topk=1)
    batches = [
        _batch(ranks, ForwardMode.TARGET_VERIFY, [0], [7], list(range(7, 11)), [(0, i) for i in range(7, 11)], spec_info=spec_info),
        extend_batch(ranks, [(0, 7, 11)], ForwardMode.DRAFT_EXTEND_V2, spec_info),
    ]  # fmt: skip

    def fn(rank):
        if rank:
            return
        backend = ranks.backends[0]
        ranks.parallels[0].dcp_gqa_mode = False  # --dcp-size alone: Q gathered
        for batch in batches:
            backend.init_forward_metadata(batch)
            q = torch.zeros(n, SHAPE.heads * SHAPE.head_dim)
            kv = torch.zeros(n, SHAPE.kv_heads * SHAPE.head_dim)
            with pytest.raises(NotImplementedError, match="replicated Q only"):
                backend._forward_dcp(q, kv, kv.clone(), L, batch, True)

    ranks.run(fn)


def test_plain_dcp_speculative_lists_are_upstreams():
    """Plain DCP (Q gathered: ``--dcp-size`` alone, interleave 1) on Triton keeps 0.5.23's speculative
    paths (issue 79), each compared with 0.5.23's own method (the pinned wheel's, called unbound on the
    same backend): a tree verify lists every key of each sequence and keeps the whole FULL_MASK, eager
    and in the verify graph's buffers, and its extend still refuses the mask by name (the server args
    refuse this layout at launch); a graph-captured draft extend lists the whole prefix; each draft
    step lists the whole prefix and its branch (upstream's kernel), and a replay sizes the steps'
    splits from the full lengths. The GQA mode's lists are DCP's (the tests above)."""
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang_helix.testing.pristine import pristine_module

    upstream = pristine_module("sglang/srt/layers/attention/triton_backend.py")
    shape = Shape(**{**SHAPE.__dict__, "chunk": 1})
    n, topk, steps = 4, 2, 3
    ranks = Ranks(shape, "triton", spec=Spec(num_steps=steps, topk=topk, num_draft_tokens=n), replicated_q=False)
    for r in range(shape.kvp):  # upstream's lists read the table through the runner's translator
        translator = KVIndexTranslator(
            req_to_token=ranks.req_to_token, token_to_kv_pool_allocator=SimpleNamespace(page_size=shape.page),
            token_to_kv_pool=ranks.pools[r], page_size=shape.chunk, device="cpu",
        )  # fmt: skip
        for backend in (ranks.backends[r], ranks.draft_backends[r], *ranks.draft_backends[r].attn_backends):
            backend.kv_index_translator = translator
    slots, seq_lens = [0, 1], [7, 5]
    masks = [torch.rand(n, c + n, generator=torch.Generator().manual_seed(c)) < 0.5 for c in seq_lens]
    spec_info = SimpleNamespace(
        draft_token_num=n, num_tokens_per_req=n, tree_topk=topk, kv_indptr=None, kv_indices=None,
        custom_mask=torch.cat([m.reshape(-1) for m in masks]), window_kv_indices=None,
    )  # fmt: skip
    writes = [(s, c + j) for s, c in zip(slots, seq_lens) for j in range(n)]
    verify = _batch(ranks, ForwardMode.TARGET_VERIFY, slots, seq_lens, [p for _, p in writes], writes, spec_info=spec_info)
    every_key = torch.cat([ranks.req_to_token[s, :c] for s, c in zip(slots, seq_lens)]).long()
    req_pool_indices, lens = torch.tensor(slots), torch.tensor(seq_lens)

    def lists(indptr, indices, bs):
        return [indices[indptr[b] : indptr[b + 1]].tolist() for b in range(bs)]

    def target(rank):
        backend = ranks.backends[rank]
        assert backend.dcp_size == shape.kvp and not backend.dcp_gqa_mode
        # the eager verify: every key, the whole mask
        seen = []
        for init in (upstream.TritonAttnBackend.init_forward_metadata, type(backend).init_forward_metadata):
            init(backend, verify)
            m = backend.forward_metadata
            seen.append((lists(m.kv_indptr, m.kv_indices, 2), m.custom_mask, m.mask_indptr.tolist()))
        assert seen[1][0] == seen[0][0] == lists([0, 7, 12], every_key, 2)
        assert seen[1][1] is seen[0][1] is spec_info.custom_mask and seen[1][2] == seen[0][2]
        L = layer(shape)
        L.tp_q_head_num = shape.heads // shape.kvp  # Q/tp, gathered by the extend
        q = torch.zeros(len(writes), L.tp_q_head_num * shape.head_dim)
        kv = torch.zeros(len(writes), shape.kv_heads * shape.head_dim)
        with pytest.raises(NotImplementedError, match="^DCP Triton extend does not support custom masks$"):
            self_attn(backend, L, q, kv, kv.clone(), verify)
        # the verify graph and the draft extend graph: upstream's buffers
        backend.init_cuda_graph_state(4, 4 * n)
        graph = []
        for update in (upstream.TritonAttnBackend._update_target_verify_buffers, type(backend)._update_target_verify_buffers):
            qo_indptr, kv_indptr, custom_mask, mask_indptr = update(backend, None, 2, lens, spec_info, req_pool_indices)[:4]
            total = int(mask_indptr[-1])
            graph.append((lists(kv_indptr, backend.cuda_graph_kv_indices, 2), custom_mask[:total].clone(), mask_indptr.tolist()))
        assert graph[1][0] == graph[0][0] == lists([0, 7, 12], every_key, 2)
        assert torch.equal(graph[1][1], graph[0][1]) and torch.equal(graph[1][1], spec_info.custom_mask)
        assert graph[1][2] == graph[0][2]
        extend_info = SimpleNamespace(extend_seq_lens_tensor=torch.tensor([n, n]))
        extend = []
        for update in (upstream.TritonAttnBackend._update_draft_extend_buffers, type(backend)._update_draft_extend_buffers):
            update(backend, None, 2, lens + n, ForwardMode.DRAFT_EXTEND_V2, extend_info, req_pool_indices)
            extend.append(lists(backend.kv_indptr, backend.cuda_graph_kv_indices, 2))
        assert extend[1] == extend[0] == lists([0, 7, 12], every_key, 2)

    ranks.run(target)

    # the draft's decode steps: step i of branch t of request b, its prefix and its branch's drafts
    # (one-token pages: at seq_len + t * steps)
    tokens = [(s, c, t) for s, c in zip(slots, seq_lens) for t in range(topk)]
    draft = _batch(
        ranks, ForwardMode.DECODE, slots, seq_lens, [c for _, c, _ in tokens], [(s, c + t * steps) for s, c, t in tokens],
        spec_info=SimpleNamespace(kv_indptr=None, kv_indices=None, window_kv_indices=None, custom_mask=None),
    )  # fmt: skip
    draft.out_cache_loc = torch.stack([ranks.req_to_token[s, c + t * steps + i] for s, c, t in tokens for i in range(steps)]).long()
    want = [
        [torch.cat([ranks.req_to_token[s, :c], ranks.req_to_token[s, c + t * steps : c + t * steps + i + 1]]).tolist() for s, c, t in tokens]
        for i in range(steps - 1)
    ]

    def draft_steps(rank):
        backend = ranks.draft_backends[rank]
        backend.init_forward_metadata(draft)
        got = [lists(b.forward_metadata.kv_indptr, b.forward_metadata.kv_indices, len(tokens)) for b in backend.attn_backends[: steps - 1]]
        recorded = []
        buffer = torch.zeros(steps, 4 * shape.max_len, dtype=torch.int64)

        def record(i, batch):
            recorded.append(lists(batch.spec_info.kv_indptr, batch.spec_info.kv_indices, len(tokens)))

        upstream.TritonMultiStepDraftBackend.common_template(backend, draft, buffer, record)
        assert got == recorded == want
        # a replay's split counts: from the full lengths, as 0.5.23's
        backend.init_cuda_graph_state(4, 4 * topk)
        last, split_lens = backend.attn_backends[-1], []
        real = last.get_num_kv_splits
        last.get_num_kv_splits = lambda out, lens, *a: (split_lens.append(lens.tolist()), real(out, lens, *a))
        try:
            for out_graph in (upstream.TritonMultiStepDraftBackend.init_forward_metadata_out_graph, type(backend).init_forward_metadata_out_graph):
                out_graph(backend, draft)
        finally:
            del last.get_num_kv_splits
        assert split_lens == [seq_lens, seq_lens], split_lens

    ranks.run(draft_steps)


class _TorchCalls(TorchFunctionMode):
    """Counts the torch calls (functions and Tensor methods) made under it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_tree_verify_metadata_is_built_for_the_batch_at_once(backend):
    """A tree verify's lists and mask are built for the whole batch at once: as many torch calls
    for 6 requests as for 2 (no per-request loop), and what the layers read is each request's mask
    at the keys this rank owns, by the test's own reading of the layout (Triton: the drafts'
    block [n, n], the prefix being all visible; torch_native: the padded visibility of every key
    it lists)."""
    n, rank = 4, 1
    ranks = Ranks(Shape(**{**SHAPE.__dict__, "slots": 6}), backend, spec=Spec(num_steps=3, topk=2, num_draft_tokens=n))
    calls = {}
    for seq_lens in ([7, 5], [7, 5, 9, 3, 6, 11]):
        slots = list(range(len(seq_lens)))
        masks = [torch.rand(n, c + n, generator=torch.Generator().manual_seed(c)) < 0.5 for c in seq_lens]
        spec_info = SimpleNamespace(
            draft_token_num=n, num_tokens_per_req=n, tree_topk=2, kv_indptr=None, kv_indices=None,
            custom_mask=torch.cat([m.reshape(-1) for m in masks]), window_kv_indices=None,
        )  # fmt: skip
        writes = [(s, c + j) for s, c in zip(slots, seq_lens) for j in range(n)]
        batch = _batch(ranks, ForwardMode.TARGET_VERIFY, slots, seq_lens, [p for _, p in writes], writes, spec_info=spec_info)

        def fn(r):
            if r != rank:
                return
            backend_r = ranks.backends[r]
            with _TorchCalls() as counter:
                backend_r.init_forward_metadata(batch)
            calls[len(seq_lens)] = counter.calls
            if backend == "triton":
                meta = backend_r.forward_metadata
                for b, c in enumerate(seq_lens):
                    block = meta.custom_mask[meta.mask_indptr[b] : meta.mask_indptr[b + 1]].view(n, n)
                    assert torch.equal(block.bool(), masks[b][:, c:])
            else:
                meta = backend_r.dcp_metadata
                for b, c in enumerate(seq_lens):
                    owned = [p for p in range(c + n) if (p // SHAPE.chunk) % SHAPE.kvp == rank]
                    got = meta.padded_visible[b]
                    assert torch.equal(got[:, : len(owned)], masks[b][:, owned])
                    assert not got[:, len(owned) :].any()

        ranks.run(fn)
    assert calls[6] == calls[2], calls


@pytest.mark.parametrize("kvp", [2, 4])
def test_gathered_q_dcp_extend_over_a_short_prefix_is_exact(kvp):
    """Upstream DCP's own layout (Q sharded over tp, gathered over the group; K/V replicated in it),
    on Triton: a prefill whose second chunk extends a 1-token prefix that all ranks but one own none
    of. Every rank joins the group's collectives (a rank skipping them hung the others), and the
    prefix call reads the pool's K/V heads, not this rank's slice (query heads past the first KV
    head read KV head 0). Each rank returns exact attention for its query heads."""
    shape = Shape(heads=2 * kvp, kv_heads=2, head_dim=16, kvp=kvp, chunk=1, slots=2, max_len=24)
    ranks = Ranks(shape, "triton", replicated_q=False)
    h = shape.heads // kvp  # this rank's query heads (Q/tp)
    L = layer(shape)
    L.tp_q_head_num = h
    record, g = Record(torch.float32, None), torch.Generator().manual_seed(3)
    for reqs in ([(0, 0, 1), (1, 0, 2)], [(0, 1, 6), (1, 2, 9)]):
        batch = extend_batch(ranks, reqs)
        writes = [(s, i) for s, p, n in reqs for i in range(p, n)]
        q, k, v = _tensors(g, len(writes), shape=shape)
        for t, (slot, tp) in enumerate(writes):
            record.write(0, slot, tp, k[t], v[t])

        def fn(rank):
            backend = ranks.backends[rank]
            backend.init_forward_metadata(batch)
            q_rank = q[:, rank * h : (rank + 1) * h]  # this rank's Q shard
            return self_attn(backend, L, q_rank.clone(), k.clone(), v.clone(), batch)

        outs = ranks.run(fn)
        seen = [[record.fed[0, s, j] for j in range(i + 1)] for s, p, n in reqs for i in range(p, n)]
        ref = reference(q, seen, L.scaling)
        for rank, out in enumerate(outs):
            got = out.view(len(writes), h, shape.head_dim).double()
            torch.testing.assert_close(got, ref[:, rank * h : (rank + 1) * h], atol=5e-6, rtol=0)
