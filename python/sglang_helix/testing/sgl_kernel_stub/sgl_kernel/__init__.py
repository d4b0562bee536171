"""Import stub for the CUDA-only ``sgl_kernel`` package (CPU test harness only).

The real ``sgl_kernel`` wheel cannot be imported on a machine without libcuda, yet several SGLang
modules import names from it at import time. Putting this directory first on ``PYTHONPATH`` lets
those imports succeed. Every attribute is a ``StubKernel``: calling it, or any attribute of it,
raises ``SglKernelStubCalled`` and, when ``SGL_KERNEL_STUB_LOG`` names a file, appends the kernel's
name to it first. Tests assert that the log stays empty, so a test can never silently run through a
fake kernel (even if some caller swallows the exception).

The one exception is ``TORCH_OPS``: the few CPU-engine ops that speculative decoding calls (KV slot
moves, draft/verify cache locations, tree build and greedy verify). Each is a plain torch function
with the signature and semantics of the real CPU op (``sgl-kernel/csrc/cpu/kvcache.cpp`` and
``spec.cpp``; Python signatures as in ``sgl_kernel/{kvcacheio,speculative}.py`` of the wheel paired
with sglang 0.5.23), checked against plain references in ``test/test_sgl_kernel_stub.py``. They are
real implementations, so they are not logged. Anything else still raises.

Likewise the CPU ops SGLang's Qwen3.5 hybrid path calls as ``torch.ops.sgl_kernel.*`` (gated
delta rule, causal conv1d, gates, q/k norms, the output gate): ``qwen3_5_cpu_ops`` defines them in
torch under the ``sgl_kernel`` op namespace when this package is imported, and ``sgl_kernel.mamba``
holds the wheel's three CPU wrappers over them (``test/test_sgl_kernel_stub_gdn.py``). Those two
submodules are real files; every other ``sgl_kernel.*`` submodule is a stub.

Never install this into a real environment: it exists for the CPU harness only.
"""

import importlib.abc
import importlib.machinery
import os
import sys

__version__ = "0.0.0+cpu-stub"
IS_SGLANG_HELIX_STUB = True


class SglKernelStubCalled(RuntimeError):
    pass


def _record(name: str) -> None:
    log = os.environ.get("SGL_KERNEL_STUB_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {name}\n")


class StubKernel:
    """Stands in for any object of sgl_kernel; fails loudly when used."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        _record(self._name)
        raise SglKernelStubCalled(
            f"sgl_kernel.{self._name} was called, but sgl_kernel is the CPU-harness stub "
            f"(sglang_helix/testing/sgl_kernel_stub). This code path needs a real CUDA kernel."
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return StubKernel(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stub {self._name}>"


# ---------------------------------------------------------------------------------------------
# Torch versions of the CPU-engine ops speculative decoding needs (see the module docstring).
# Shapes and dtypes follow the real ops; an input the real op rejects is rejected here too.
# ---------------------------------------------------------------------------------------------


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"sgl_kernel stub (torch op): {what}")


def _index_dtype(*ts) -> None:
    import torch

    for t in ts:
        _require(t.dtype in (torch.int32, torch.int64), f"index tensor must be int32/int64, got {t.dtype}")


def _segments(starts, ends):
    """For segments ``[starts[i], ends[i])``: (segment id, column) of every element, in order."""
    import torch

    starts, ends = starts.to(torch.int64), ends.to(torch.int64)
    lens = ends - starts
    _require(bool((lens >= 0).all()), "a segment ends before it starts")
    seg = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int64), lens)
    first = torch.cumsum(lens, 0) - lens  # exclusive prefix sum: where each segment starts
    col = torch.arange(seg.numel(), dtype=torch.int64) - first[seg] + starts[seg]
    return seg, col


def _bytes_at(address: int, nbytes: int):
    """A uint8 tensor over ``nbytes`` of existing memory at ``address`` (no copy, not owned)."""
    import ctypes

    import torch

    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer b (base address ``data_ptrs[b]``, ``strides[b]`` bytes per slot row):
    ``row[tgt_loc[i]] = row[src_loc[i]]``. All source rows are read before any target row is
    written, so overlapping ``tgt_loc``/``src_loc`` are safe (the real op stages them the same way)."""
    import torch

    _require(data_ptrs.dtype == torch.uint64, "data_ptrs must be uint64")
    _require(strides.dtype == torch.int64, "strides must be int64")
    _require(tgt_loc.dtype == src_loc.dtype, "tgt_loc and src_loc must have one dtype")
    _index_dtype(tgt_loc)
    _require(strides.numel() == data_ptrs.numel(), "one stride per buffer")
    _require(src_loc.numel() == tgt_loc.numel(), "as many sources as targets")
    if data_ptrs.numel() == 0 or tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = _bytes_at(address, rows * stride).view(rows, stride)
        buf[tgt] = buf[src]  # buf[src] is a gathered copy: every source read before any write


def _request_runs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """The two cache-loc ops' shared checks, and per element of the runs laid end to end: its
    request (``seg``), that request's ``req_to_token`` row and the column."""
    import torch

    _index_dtype(req_pool_indices, start_offset)
    _require(req_to_token.dtype == torch.int32, "req_to_token must be int32")
    _require(out_cache_loc.dtype == torch.int64, "out_cache_loc must be int64")
    _require(end_offset.dtype == start_offset.dtype, "start/end offsets must have one dtype")
    _require(req_to_token.shape[1] == pool_len, "pool_len is req_to_token's row length")
    seg, col = _segments(start_offset, end_offset)
    rows = req_pool_indices.to(torch.int64)[seg]
    return seg, rows, col


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` = request i's run of
    ``out_cache_loc`` (the runs laid end to end)."""
    import torch

    seg, rows, col = _request_runs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len)
    req_to_token[rows, col] = out_cache_loc[: seg.numel()].to(torch.int32)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """The inverse gather: request i's ``req_to_token[req_pool_indices[i], start:end]``, laid end to
    end into ``out_cache_loc`` (int64)."""
    import torch

    seg, rows, col = _request_runs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len)
    out_cache_loc[: seg.numel()] = req_to_token[rows, col].to(torch.int64)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps):
    """Request i's ``topk * num_steps`` draft slots, ``req_to_token[req_pool_indices[i],
    seq_lens[i]:seq_lens[i] + topk * num_steps]``, into ``out_cache_loc[i * topk * num_steps:]``."""
    import torch

    n = topk * num_steps
    _require(out_cache_loc.numel() == req_pool_indices.numel() * n, "out_cache_loc must hold bs * topk * num_steps")
    _index_dtype(seq_lens)
    assign_extend_cache_locs_cpu(
        req_pool_indices, req_to_token, seq_lens, seq_lens + n, out_cache_loc.view(-1), pool_len
    )  # fmt: skip


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """``bonus_tokens[i]`` = the last accepted token of request i (``accept_lens`` counts the
    bonus): ``accept_tokens.flat[i * accept_stride + accept_lens[i] - 1]``."""
    import torch

    for t in (accept_tokens, accept_lens, bonus_tokens):
        _require(t.dtype == torch.int32, "fill_bonus_tokens_cpu takes int32 tensors")
    bs = accept_lens.numel()
    flat = torch.arange(bs, dtype=torch.int64) * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[flat])


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact the accepted tokens' KV slots: ``out_cache_loc[j]`` for every ``j = accept_index[k]
    > -1``, in order, into the front of ``accept_out_cache_loc``."""
    import torch

    _index_dtype(accept_index)
    _require(out_cache_loc.dtype == torch.int64, "out_cache_loc must be int64")
    _require(accept_out_cache_loc.dtype == torch.int64, "accept_out_cache_loc must be int64")
    idx = accept_index.reshape(-1).to(torch.int64)
    kept = idx[idx > -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept]


def verify_tree_greedy_cpu(
    predicts, accept_index, accept_token_num, candidates,
    retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
):  # fmt: skip
    """Greedy tree verify: per request, walk from the root through the first child whose draft
    token equals the target's argmax at the last accepted node (siblings in list order), for at
    most ``accept_index.shape[1] - 1`` levels. Writes the accepted nodes' flat indices into
    ``accept_index`` (root first), their count (bonus excluded) into ``accept_token_num``, and the
    target token at every accepted node into ``predicts`` (flat by draft slot)."""
    import torch

    for t in (predicts, accept_index, accept_token_num):
        _require(t.dtype == torch.int32, "predicts/accept_index/accept_token_num must be int32")
    _index_dtype(candidates)
    for t in (retrive_index, retrive_next_token, retrive_next_sibling, target_predict):
        _require(t.dtype == candidates.dtype, "candidates and the retrive/target tensors must have one dtype")
    _require(candidates.dim() == 2 and accept_index.dim() == 2, "candidates and accept_index are 2-D")
    bs, num_draft = candidates.shape
    num_steps = accept_index.shape[1]
    cand, ri = candidates.tolist(), retrive_index.reshape(-1).tolist()
    nxt, sib = retrive_next_token.reshape(-1).tolist(), retrive_next_sibling.reshape(-1).tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(bs):
        off = b * num_draft
        last = ri[off]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, num_steps):
            cur = nxt[off + cur]
            while cur != -1 and cand[b][cur] != target[last]:
                cur = sib[off + cur]
            if cur == -1:
                break
            predicts.view(-1)[last] = target[last]
            accepted += 1
            accept_index[b, accepted] = ri[off + cur]
            last = ri[off + cur]
        accept_token_num[b] = accepted
        predicts.view(-1)[last] = target[last]


def build_tree_kernel_efficient_cpu(
    parent_list, selected_index, verified_seq_len, tree_mask, positions,
    retrive_index, retrive_next_token, retrive_next_sibling,
    topk, depth, draft_token_num, tree_mask_mode,
):  # fmt: skip
    """Build the draft tree for verify from the draft's top-k bookkeeping: the retrieval links
    (index, first child, next sibling; the link tensors come pre-filled with -1), each node's
    position (``verified_seq_len`` + depth) and the tree attention mask (a node attends to the root
    and its ancestors), in ``QLEN_ONLY`` (1: ``[bs, n, n]``) or ``FULL_MASK`` (0: per request a
    ``[n, seq_len + n]`` block whose prefix columns are left as they are) layout."""
    import torch

    _require(tree_mask.dtype == torch.bool, "tree_mask must be bool")
    _index_dtype(parent_list)
    for t in (selected_index, verified_seq_len, positions, retrive_index, retrive_next_token, retrive_next_sibling):
        _require(t.dtype == parent_list.dtype, "parent_list and the index tensors must have one dtype")
    _require(tree_mask_mode in (0, 1), f"tree_mask_mode {int(tree_mask_mode)} is not supported on CPU")
    n = draft_token_num
    bs = verified_seq_len.numel()
    parents = parent_list.reshape(bs, -1).tolist()
    sel = selected_index.reshape(bs, -1).tolist()
    seq_lens = verified_seq_len.tolist()
    ri, nxt, sib = (t.view(-1) for t in (retrive_index, retrive_next_token, retrive_next_sibling))
    mask, pos = tree_mask.view(-1), positions.view(-1)

    def node_of(b, token_idx):  # the draft slot (0 .. n-2) that selected this top-k token, or None
        for p in range(n - 1):
            if sel[b][p] == token_idx:
                return p
        return None

    mask_base = 0
    for b in range(bs):
        off, seq_len = b * n, seq_lens[b]
        pos[off] = seq_len
        ri[off] = off
        for i in range(n - 1, 0, -1):
            ri[off + i] = off + i
            parent_tb = sel[b][i - 1] // topk
            if parent_tb == 0:
                parent = 0  # the root
            else:
                slot = node_of(b, parents[b][parent_tb])
                if slot is None:
                    continue
                parent = slot + 1
            first = int(nxt[off + parent])
            nxt[off + parent] = i
            if first != -1:
                sib[off + i] = first
        if tree_mask_mode == 0:
            row_len, base = seq_len + n, mask_base + seq_len
            mask_base += n * (seq_len + n)
        else:
            row_len, base = n, b * n * n
        for t in range(n):
            row = base + t * row_len
            mask[row] = True
            mask[row + 1 : row + n] = False
            if t == 0:
                continue
            cur, level = t - 1, 0
            for _ in range(depth):
                level += 1
                mask[row + cur + 1] = True
                parent_tb = sel[b][cur] // topk
                if parent_tb == 0:
                    break
                cur = node_of(b, parents[b][parent_tb])
                if cur is None:
                    break
            pos[off + t] = seq_len + level


TORCH_OPS = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "verify_tree_greedy_cpu",
    "build_tree_kernel_efficient_cpu",
)


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    if name in REAL_SUBMODULES:  # ``from sgl_kernel import mamba`` asks here before importing it
        return importlib.import_module(f"{__name__}.{name}")
    return StubKernel(name)


# Submodules that are files of this package (real torch code); the finder leaves them to the normal
# import system.
REAL_SUBMODULES = ("mamba", "qwen3_5_cpu_ops")


class _StubSubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import sgl_kernel.anything`` yield a stub module as well (but ``REAL_SUBMODULES``)."""

    def find_spec(self, fullname, path, target=None):
        if fullname in tuple(f"{__name__}.{m}" for m in REAL_SUBMODULES):
            return None
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        import types

        module = types.ModuleType(spec.name)
        module.__path__ = []
        prefix = spec.name[len(__name__) + 1 :]
        module.__getattr__ = lambda attr: (
            (_ for _ in ()).throw(AttributeError(attr))
            if attr.startswith("__") and attr.endswith("__")
            else StubKernel(f"{prefix}.{attr}")
        )
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StubSubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubSubmoduleFinder())

# The Qwen3.5 CPU ops under torch.ops.sgl_kernel (SGLang binds them when its modules import). An
# import statement, not ``from sgl_kernel import``: this module's ``__getattr__`` would answer that.
importlib.import_module(__name__ + ".qwen3_5_cpu_ops").register()
