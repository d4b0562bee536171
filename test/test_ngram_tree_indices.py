"""The `[CPU]` NGRAM patch: ``reconstruct_indices_from_tree_mask_torch`` (the CPU engine's path)
equals upstream's Triton kernel (``reconstruct_indices_from_tree_mask_triton``, under the
interpreter) on random trees, and hand-checked values on a small one."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernel is imported

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

from sglang.kernels.ops.speculative import reconstruct_tree  # noqa: E402


def _random_tree_mask(g, bs: int, n: int) -> torch.Tensor:
    """``[bs * n * n]`` bool: node 0 the root, each later node a child of an earlier one
    (BFS-numbered as NGRAM's corpus emits them); row i marks i's ancestors and itself."""
    masks = []
    for _ in range(bs):
        m = torch.zeros(n, n, dtype=torch.bool)
        m[0, 0] = True
        for i in range(1, n):
            parent = int(torch.randint(0, i, (1,), generator=g))
            m[i] = m[parent]
            m[i, i] = True
        masks.append(m.reshape(-1))
    return torch.cat(masks)


def _run(fn, mask, seq, bs, n):
    out = [torch.full((bs * n,), -7, dtype=torch.int64) for _ in range(4)]
    fn(mask, seq, *out, bs, n)
    return out


@pytest.mark.parametrize("bs, n", [(1, 1), (3, 6), (2, 12), (4, 8)])
def test_torch_equals_the_triton_kernel(bs, n):
    g = torch.Generator().manual_seed(bs * 100 + n)
    mask = _random_tree_mask(g, bs, n)
    seq = torch.randint(1, 50, (bs,), generator=g)
    want = _run(reconstruct_tree.reconstruct_indices_from_tree_mask_triton, mask, seq, bs, n)
    got = _run(reconstruct_tree.reconstruct_indices_from_tree_mask_torch, mask, seq, bs, n)
    for name, w, x in zip(("positions", "retrieve_index", "next_token", "next_sibling"), want, got):
        assert torch.equal(w, x), (name, w, x)


def test_a_small_tree_by_hand():
    """0 -> {1, 2}, 1 -> {3}: depths 0 1 1 2; first children 1 3 - -; next siblings - 2 - -."""
    parents = [-1, 0, 0, 1]
    m = torch.zeros(4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        m[i] = m[p] if p >= 0 else m[i]
        m[i, i] = True
    positions, index, child, sibling = _run(reconstruct_tree.reconstruct_indices_from_tree_mask_torch,
                                            m.reshape(-1), torch.tensor([10]), 1, 4)  # fmt: skip
    assert positions.tolist() == [10, 11, 11, 12] and index.tolist() == [0, 1, 2, 3]
    assert child.tolist() == [1, 3, -1, -1] and sibling.tolist() == [-1, 2, -1, -1]


def test_the_cpu_engine_takes_the_torch_path(monkeypatch):
    calls = []
    monkeypatch.setattr(reconstruct_tree, "_is_cpu", True)
    monkeypatch.setattr(reconstruct_tree, "reconstruct_indices_from_tree_mask_torch", lambda *a: calls.append(a))
    reconstruct_tree.reconstruct_indices_from_tree_mask_func(*([None] * 6), 1, 1)
    assert len(calls) == 1
