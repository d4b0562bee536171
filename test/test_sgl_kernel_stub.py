"""The sgl_kernel import stub imports, but every kernel in it fails loudly and is recorded."""

import subprocess
import sys

from sglang_helix.testing.cpu_env import STUB_DIR, cpu_server_env

SCRIPT = r"""
import sgl_kernel
assert sgl_kernel.IS_SGLANG_HELIX_STUB
from sgl_kernel import rmsnorm, silu_and_mul            # names import fine
from sgl_kernel.flash_attn import flash_attn_with_kvcache  # so do submodules
import sgl_kernel.allreduce as ar
for fn in (rmsnorm, flash_attn_with_kvcache, ar.init_custom_ar, sgl_kernel.common_ops.anything):
    try:
        fn(1, 2)
    except sgl_kernel.SglKernelStubCalled as e:
        assert "stub" in str(e)
    else:
        raise SystemExit("stub call did not raise")
assert not hasattr(sgl_kernel, "__wrapped__")  # dunder lookups are not faked
print("ok")
"""


def test_stub_imports_and_every_call_raises_and_is_logged(tmp_path):
    log = tmp_path / "calls.log"
    env = cpu_server_env(1, stub_log=str(log))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    names = [line.split()[1] for line in log.read_text().splitlines()]
    assert names == ["rmsnorm", "flash_attn.flash_attn_with_kvcache", "allreduce.init_custom_ar", "common_ops.anything"]


def test_stub_shadows_the_real_wheel():
    env = cpu_server_env(1)
    r = subprocess.run(
        [sys.executable, "-c", "import sgl_kernel; print(sgl_kernel.__file__)"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(STUB_DIR)


# ---------------------------------------------------------------------------------------------
# The torch versions of the CPU-engine ops speculative decoding needs (stub's TORCH_OPS). Each is
# checked against a plain reference written from the real op's contract (sgl-kernel's
# csrc/cpu/kvcache.cpp and spec.cpp) and, where sglang 0.5.23 has one, against the Triton kernel
# the GPU runs for the same step (interpreted on CPU tensors).
# ---------------------------------------------------------------------------------------------
import os  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"  # the upstream Triton references run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

import sgl_kernel  # noqa: E402

INDEX_DTYPES = [torch.int32, torch.int64]


def test_torch_ops_are_real_and_the_rest_still_raises():
    assert sgl_kernel.IS_SGLANG_HELIX_STUB
    for name in sgl_kernel.TORCH_OPS:
        op = getattr(sgl_kernel, name)
        assert callable(op) and not isinstance(op, sgl_kernel.StubKernel), name
    # A CPU op speculation does not reach (multi-layer EAGLE's) is still the loud stub.
    with pytest.raises(sgl_kernel.SglKernelStubCalled):
        sgl_kernel.rotate_input_ids_cpu(torch.zeros(1))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# -- copy_all_layer_kv_cache_cpu ---------------------------------------------------------------
def _kv_buffers(g):
    """K/V buffers of three layers with different row widths and dtypes (as the pool has them)."""
    rows = 40
    return [
        torch.randn(rows, 4, 16, generator=g),  # float32, 256 B rows
        torch.randn(rows, 4, 16, generator=g),
        torch.randn(rows, 2, 8, generator=g).to(torch.bfloat16),  # 32 B rows
        torch.randn(rows, 2, 8, generator=g).to(torch.bfloat16),
        torch.randint(0, 255, (rows, 3, 5), generator=g, dtype=torch.uint8),  # fp8 stored as uint8
        torch.randint(0, 255, (rows, 3, 5), generator=g, dtype=torch.uint8),
    ]


def _ptrs_strides(bufs):
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs], dtype=torch.int64)
    return ptrs, strides


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("case", ["disjoint", "overlapping", "swap", "self", "empty"])
def test_copy_all_layer_kv_cache_cpu(case, dtype):
    g = _gen(len(case))
    bufs = _kv_buffers(g)
    if case == "disjoint":
        src, tgt = [3, 7, 11, 0], [20, 21, 30, 39]
    elif case == "overlapping":  # a target is also a later source: every source is read first
        src, tgt = [5, 6, 7, 8], [6, 7, 8, 9]
    elif case == "swap":
        src, tgt = [1, 2, 30], [2, 1, 4]
    elif case == "self":  # the pool's warm-up call: slot 0 onto itself
        src, tgt = [0], [0]
    else:
        src, tgt = [], []
    src_t, tgt_t = torch.tensor(src, dtype=dtype), torch.tensor(tgt, dtype=dtype)
    # Plain reference: stage every source row, then write the targets in order.
    want = [b.clone() for b in bufs]
    for w in want:
        staged = [w[s].clone() for s in src]
        for t, row in zip(tgt, staged):
            w[t] = row
    ptrs, strides = _ptrs_strides(bufs)
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt_t, src_t)
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)


def test_copy_all_layer_kv_cache_cpu_rejects_what_the_real_op_rejects():
    bufs = _kv_buffers(_gen(0))
    ptrs, strides = _ptrs_strides(bufs)
    loc = torch.tensor([1], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="uint64"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs.to(torch.int64), strides, loc, loc)
    with pytest.raises(RuntimeError, match="one dtype"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, loc, loc.int())


# -- req_to_token <-> out_cache_loc ------------------------------------------------------------
def _pool(g, reqs=6, pool_len=48):
    req_to_token = torch.randint(0, 10_000, (reqs, pool_len), generator=g, dtype=torch.int32)
    return req_to_token, pool_len


def _segments_case(g, dtype, bs=4, pool_len=48):
    rpi = torch.randperm(6, generator=g)[:bs].to(dtype)
    start = torch.randint(0, pool_len // 2, (bs,), generator=g)
    lens = torch.randint(0, 9, (bs,), generator=g)
    lens[1] = 0  # an empty segment
    end = start + lens
    return rpi, start.to(dtype), end.to(dtype), int(lens.sum())


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_assign_req_to_token_pool_cpu(dtype):
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool  # the GPU kernel

    g = _gen(1)
    req_to_token, pool_len = _pool(g)
    rpi, start, end, total = _segments_case(g, dtype)
    out_cache_loc = torch.randint(0, 10_000, (total,), generator=g, dtype=torch.int64)
    want = req_to_token.clone()
    k = 0
    for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist()):
        for j in range(s, e):
            want[r, j] = out_cache_loc[k]
            k += 1
    got = req_to_token.clone()
    sgl_kernel.assign_req_to_token_pool_cpu(rpi, got, start, end, out_cache_loc, pool_len)
    assert torch.equal(got, want)
    tri = req_to_token.clone()
    assign_req_to_token_pool[(rpi.numel(),)](rpi, tri, start, end, out_cache_loc, pool_len, 4)
    assert torch.equal(tri, want)


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_assign_extend_cache_locs_cpu(dtype):
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs

    g = _gen(2)
    req_to_token, pool_len = _pool(g)
    rpi, start, end, total = _segments_case(g, dtype)
    want = [int(req_to_token[r, j]) for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist()) for j in range(s, e)]
    got = torch.full((total + 3,), -7, dtype=torch.int64)  # the tail past `total` is left alone
    sgl_kernel.assign_extend_cache_locs_cpu(rpi, req_to_token, start, end, got, pool_len)
    assert got[:total].tolist() == want and got[total:].tolist() == [-7] * 3
    tri = torch.full((total + 3,), -7, dtype=torch.int64)
    assign_extend_cache_locs[(rpi.numel(),)](rpi, req_to_token, start, end, tri, pool_len, 4)
    assert torch.equal(tri, got)


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("topk,num_steps", [(1, 3), (2, 3), (4, 1)])
def test_assign_draft_cache_locs_contiguous_cpu(dtype, topk, num_steps):
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous

    g = _gen(3)
    req_to_token, pool_len = _pool(g)
    bs, n = 3, topk * num_steps
    rpi = torch.tensor([4, 0, 2], dtype=dtype)
    seq_lens = torch.tensor([5, 17, 0], dtype=dtype)
    want = [int(req_to_token[r, s + j]) for r, s in zip(rpi.tolist(), seq_lens.tolist()) for j in range(n)]
    got = torch.empty(bs * n, dtype=torch.int64)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(rpi, req_to_token, seq_lens, got, pool_len, topk, num_steps)
    assert got.tolist() == want
    tri = torch.empty(bs * n, dtype=torch.int64)
    assign_draft_cache_locs_contiguous[(bs,)](rpi, req_to_token, seq_lens, tri, pool_len, topk, num_steps)
    assert torch.equal(tri, got)


# -- accept bookkeeping ------------------------------------------------------------------------
def test_fill_bonus_tokens_cpu():
    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens

    g = _gen(4)
    bs, stride = 5, 4
    accept_tokens = torch.randint(0, 500, (bs, stride), generator=g, dtype=torch.int32)
    accept_lens = torch.tensor([1, 4, 2, 3, 1], dtype=torch.int32)
    want = [int(accept_tokens[i, accept_lens[i] - 1]) for i in range(bs)]
    got = torch.empty(bs, dtype=torch.int32)
    sgl_kernel.fill_bonus_tokens_cpu(accept_tokens, accept_lens, got, stride)
    assert got.tolist() == want
    tri = torch.empty(bs, dtype=torch.int32)
    fill_bonus_tokens[(bs,)](accept_tokens, accept_lens, tri, stride)
    assert torch.equal(tri, got)


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_fill_accept_out_cache_loc_cpu(dtype):
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc

    g = _gen(5)
    bs, steps, draft = 3, 4, 4
    out_cache_loc = torch.randint(0, 10_000, (bs * draft,), generator=g, dtype=torch.int64)
    accept_index = torch.tensor([[0, 1, -1, -1], [4, 5, 6, 7], [8, -1, -1, -1]], dtype=dtype)
    want = [int(out_cache_loc[j]) for j in accept_index.flatten().tolist() if j > -1]
    got = torch.full((bs * steps,), -7, dtype=torch.int64)
    sgl_kernel.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got)
    assert got[: len(want)].tolist() == want and (got[len(want) :] == -7).all()
    tri = torch.full((bs * steps,), -7, dtype=torch.int64)
    size = accept_index.numel()
    fill_accept_out_cache_loc[(size,)](accept_index, out_cache_loc, tri, 16)
    assert torch.equal(tri, got)


# -- the draft tree: build and greedy verify ---------------------------------------------------
def _draft_tree(g, bs, topk, steps, num_draft):
    """(parent_list, selected_index) as EAGLE's draft leaves them (``select_top_k_tokens`` and
    ``organize_draft_results``), from random draft probabilities."""
    scores, parents = [], []
    p = torch.rand(bs, topk, generator=g).sort(dim=1, descending=True).values
    scores.append(p.unsqueeze(1))  # step 0: topk children of the root
    parents.append(torch.arange(-1, topk).expand(bs, -1))
    cur = p
    for i in range(1, steps):
        expand = cur.unsqueeze(2) * torch.rand(bs, topk, topk, generator=g)
        top = expand.flatten(1).topk(topk, dim=1)
        scores.append(expand)
        parents.append(top.indices + (topk * topk * (i - 1) + topk))
        cur = top.values
    flat = torch.cat([s.flatten(1) for s in scores], dim=1)
    selected = flat.topk(num_draft - 1, dim=1).indices.sort(dim=1).values
    parent_list = torch.cat(parents[:-1], dim=1) if steps > 1 else torch.empty(bs, 0, dtype=torch.long)
    return parent_list, selected


def _tree_reference(parent_list, selected, seq_lens, topk, n):
    """Per request: each node's parent node (root = 0), depth, and the tree built from them."""
    out = []
    for b in range(selected.shape[0]):
        sel = selected[b].tolist()
        parent = [-1] * n
        for i in range(1, n):
            tb = sel[i - 1] // topk
            parent[i] = 0 if tb == 0 else 1 + sel.index(int(parent_list[b, tb]))
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parent[i]] + 1
        children = [[c for c in range(1, n) if parent[c] == i] for i in range(n)]
        ancestors = []
        for i in range(n):
            a, j = {0, i}, i
            while j > 0:
                j = parent[j]
                a.add(j)
            ancestors.append(a)
        out.append(dict(parent=parent, depth=depth, children=children, ancestors=ancestors, seq_len=int(seq_lens[b])))
    return out


def _build(op, parent_list, selected, seq_lens, topk, steps, n, mode):
    bs = seq_lens.numel()
    if mode == 0:
        mask = torch.ones(int(seq_lens.sum()) * n + n * n * bs, dtype=torch.bool)
    else:
        mask = torch.ones(n * n * bs, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.long)
    links = torch.full((3, bs, n), -1, dtype=torch.long)
    op(parent_list, selected, seq_lens, mask, positions, links[0], links[1], links[2], topk, steps, n, mode)
    return mask, positions, links


@pytest.mark.parametrize("mode", [1, 0], ids=["qlen_only", "full_mask"])
@pytest.mark.parametrize("topk,steps,n", [(1, 3, 4), (1, 5, 6), (2, 3, 5), (4, 3, 8), (3, 4, 10)])
def test_build_tree_kernel_efficient_cpu(topk, steps, n, mode):
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    g = _gen(topk * 100 + steps * 10 + n)
    bs = 3
    parent_list, selected = _draft_tree(g, bs, topk, steps, n)
    seq_lens = torch.tensor([7, 1, 12])
    mask, positions, links = _build(sgl_kernel.build_tree_kernel_efficient_cpu, parent_list, selected, seq_lens, topk, steps, n, mode)
    base = 0
    for b, ref in enumerate(_tree_reference(parent_list, selected, seq_lens, topk, n)):
        off = b * n
        assert positions[off : off + n].tolist() == [ref["seq_len"] + d for d in ref["depth"]]
        assert links[0, b].tolist() == list(range(off, off + n))
        for i in range(n):  # first child, then siblings in increasing order
            kids = ref["children"][i]
            assert int(links[1, b, i]) == (kids[0] if kids else -1)
            for a, c in zip(kids, kids[1:] + [-1]):
                assert int(links[2, b, a]) == c
        if mode == 1:
            block = mask[b * n * n : (b + 1) * n * n].view(n, n)
        else:
            s = ref["seq_len"]
            rows = mask[base : base + n * (s + n)].view(n, s + n)
            assert rows[:, :s].all()  # the prefix columns are left as they were (filled)
            block, base = rows[:, s:], base + n * (s + n)
        want = torch.tensor([[j in ref["ancestors"][i] for j in range(n)] for i in range(n)])
        assert torch.equal(block, want)
        if topk == 1:  # a chain: causal
            assert torch.equal(block, torch.ones(n, n, dtype=torch.bool).tril())
    tri = _build(sgl_build_tree_kernel_triton, parent_list, selected, seq_lens, topk, steps, n, mode)
    for a, b in zip((mask, positions, links), tri):
        assert torch.equal(a, b)


def _verify_case(g, topk, steps, n, bs=4):
    parent_list, selected = _draft_tree(g, bs, topk, steps, n)
    seq_lens = torch.tensor([3, 9, 1, 20])[:bs]
    _, _, links = _build(sgl_kernel.build_tree_kernel_efficient_cpu, parent_list, selected, seq_lens, topk, steps, n, 1)
    refs = _tree_reference(parent_list, selected, seq_lens, topk, n)
    # Draft tokens unique among siblings; the target picks a child's token 3 times in 4.
    candidates = torch.randint(0, 50, (bs, n), generator=g)
    for b, ref in enumerate(refs):
        for kids in ref["children"]:
            for k, c in enumerate(kids):
                candidates[b, c] = 100 + 10 * k + c
    target = torch.randint(0, 50, (bs, n), generator=g)
    for b, ref in enumerate(refs):
        for i, kids in enumerate(ref["children"]):
            if kids and torch.rand(1, generator=g).item() < 0.75:
                target[b, i] = candidates[b, kids[int(torch.randint(0, len(kids), (1,), generator=g))]]
    return links, refs, candidates, target


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("topk,steps,n", [(1, 3, 4), (2, 3, 5), (4, 3, 8), (3, 4, 10)])
def test_verify_tree_greedy_cpu(topk, steps, n, dtype):
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_kernel_triton

    g = _gen(topk * 7 + n)
    links, refs, candidates, target = _verify_case(g, topk, steps, n)
    bs, num_spec = candidates.shape[0], steps + 1
    args = [t.to(dtype).contiguous() for t in (candidates, links[0], links[1], links[2], target)]

    def run(fn, **kw):
        predicts = torch.full((bs * n,), -5, dtype=torch.int32)
        accept_index = torch.full((bs, num_spec), -1, dtype=torch.int32)
        accept_num = torch.full((bs,), -5, dtype=torch.int32)
        fn(predicts, accept_index, accept_num, *args, **kw)
        return predicts, accept_index, accept_num

    predicts, accept_index, accept_num = run(sgl_kernel.verify_tree_greedy_cpu)
    for b, ref in enumerate(refs):
        # Plain reference: from the root, follow the child whose token the target predicted there.
        path, node = [0], 0
        while len(path) < num_spec:
            match = [c for c in ref["children"][node] if candidates[b, c] == target[b, node]]
            if not match:
                break
            node = match[0]
            path.append(node)
        assert accept_num[b] == len(path) - 1
        assert accept_index[b].tolist() == [b * n + i for i in path] + [-1] * (num_spec - len(path))
        want_pred = [-5] * n
        for i in path:
            want_pred[i] = int(target[b, i])
        assert predicts[b * n : (b + 1) * n].tolist() == want_pred
    tri = run(verify_tree_greedy_kernel_triton[(bs,)], batch_size=bs, num_speculative_tokens=num_spec, num_draft_tokens=n)
    for a, b in zip((predicts, accept_index, accept_num), tri):
        assert torch.equal(a, b)
