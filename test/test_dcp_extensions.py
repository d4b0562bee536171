"""The series' extensions of upstream DCP, tested on upstream modules alone (no Helix module), so
that the per-prefix check can run them at the patch that brings each one:

- ``create_triton_kv_indices_for_dcp_triton(..., interleave_size=I)``: the local KV lists of
  ``get_dcp_lens(interleave_size=I)`` / ``localize_dcp_indices(interleave_size=I)``, and exactly
  upstream's lists at I = 1;
- ``dcp_a2a_lse_reduce_packed``: what ``dcp_a2a_lse_reduce`` does after its pack;
- ``dcp_group_ranks``: the DCP group layout;
- ``GroupCoordinator.all_to_all_single`` on CPU tensors over gloo (and the reduce through it).
"""

from __future__ import annotations

import os
import socket
import sys

# The DCP kernels on CPU tensors need the interpreter (read when they are decorated).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

from sglang.kernels.ops.attention import dcp_kernels  # noqa: E402
from sglang.srt.layers.dcp import comm as dcp_comm  # noqa: E402
from sglang.srt.layers.dcp.layout import get_dcp_lens, localize_dcp_indices  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _req_to_token(slots: int, max_len: int, cycle: int) -> torch.Tensor:
    """Widened logical slots as a paged allocator hands them out: ``slot % cycle == pos % cycle``."""
    g = torch.Generator().manual_seed(cycle)
    pages = -(-max_len // cycle)
    out = torch.zeros(slots, max_len, dtype=torch.int32)
    for s in range(slots):
        page_ids = 1 + torch.randperm(slots * pages + 4, generator=g)[:pages]
        pos = torch.arange(max_len)
        out[s] = (page_ids[pos // cycle] * cycle + pos % cycle).int()
    return out


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (4, 1), (3, 1), (2, 2), (4, 2), (3, 5), (8, 64)])
def test_kernel_lists_follow_get_dcp_lens_and_localize(dcp, interleave):
    """Rank r's list of request b, from ``kv_start`` to ``kv_start + len``: the rows
    (``localize_dcp_indices``) of the positions r owns, in order; ``get_dcp_lens`` of them."""
    cycle, max_len = dcp * interleave, 300
    req_to_token = _req_to_token(4, max_len, cycle)
    slots = torch.tensor([2, 0, 3, 1])
    for starts in (None, torch.tensor([0, 3, 41, 128])):
        ends = torch.tensor([0, 9, 137, 299])
        spans = ends if starts is None else ends - starts
        for rank in range(dcp):
            lens = get_dcp_lens(spans, dcp, rank, start=starts, interleave_size=interleave)
            indptr = torch.zeros(5, dtype=torch.int32)
            indptr[1:] = torch.cumsum(lens, 0)
            total = int(indptr[-1])
            out = torch.full((total + 7,), -9, dtype=torch.int64)
            dcp_kernels.create_triton_kv_indices_for_dcp_triton[(4,)](
                req_to_token, slots, lens, indptr, starts, out, req_to_token.stride(0), dcp, rank,
                interleave_size=interleave,
            )  # fmt: skip
            want = []
            for b in range(4):
                lo = 0 if starts is None else int(starts[b])
                pos = [p for p in range(lo, int(ends[b])) if (p // interleave) % dcp == rank]
                assert len(pos) == int(lens[b])
                locs = req_to_token[slots[b], pos].long()
                rows = localize_dcp_indices(locs, dcp, rank, interleave_size=interleave)
                assert bool((rows >= 0).all())  # the owner of a slot is the owner of its position
                want += rows.tolist()
            assert out[:total].tolist() == want, (dcp, interleave, rank, starts)
            assert bool((out[total:] == -9).all())  # nothing past the lists
            if interleave == 1:  # upstream's own expression for I = 1: row = slot // dcp
                upstream = []
                for b in range(4):
                    lo = 0 if starts is None else int(starts[b])
                    owned = [p for p in range(lo, int(ends[b])) if p % dcp == rank]
                    upstream += (req_to_token[slots[b], owned].long() // dcp).tolist()
                assert out[:total].tolist() == upstream


class _Loopback:
    """A group of ``world_size`` ranks in which every rank sent what this one sends."""

    def __init__(self, world_size):
        self.world_size = world_size

    def all_to_all_single(self, output, input):
        output.copy_(input)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_entry_point_is_the_reduce_after_its_pack(dtype):
    N, B, H, D = 4, 3, 8, 16
    g = torch.Generator().manual_seed(0)
    out = torch.randn(B, H, D, generator=g).to(dtype)
    lse = torch.randn(B, H, generator=g)
    lse[1, 3] = float("-inf")  # an empty shard
    group = _Loopback(N)
    whole = dcp_comm.dcp_a2a_lse_reduce(out, lse, group)
    lpd = dcp_kernels._lse_pack_dim(dtype)
    send = torch.empty(N, B, H // N, D + lpd, dtype=dtype)
    dcp_kernels.dcp_pack_a2a_send(out, lse, send[..., :D], send.view(torch.float32)[..., D // lpd])
    packed = dcp_comm.dcp_a2a_lse_reduce_packed(send, torch.empty_like(send), B, group)
    assert torch.equal(whole, packed)
    # Padded graph buffers: rows past num_tokens are ignored.
    big = torch.zeros(N, B + 2, H // N, D + lpd, dtype=dtype)
    big[:, :B] = send
    assert torch.equal(dcp_comm.dcp_a2a_lse_reduce_packed(big, torch.empty_like(big), B, group), packed)


def test_dcp_group_ranks():
    from sglang.srt.distributed.parallel_state import dcp_group_ranks

    assert dcp_group_ranks([list(range(8))], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dcp_group_ranks([list(range(8))], 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Stage-local TP groups (PP = 2): groups never cross a TP group.
    assert dcp_group_ranks([[0, 1, 2, 3], [4, 5, 6, 7]], 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dcp_group_ranks([[0, 1, 2, 3]], 1) == [[0], [1], [2], [3]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, results):
    import torch.distributed as dist

    from sglang.srt.distributed.parallel_state import GroupCoordinator

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = GroupCoordinator(
        group_ranks=[list(range(world))], local_rank=rank, torch_distributed_backend="gloo",
        use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False, use_xpu_communicator=False,
        group_name="dcp_ext_test",
    )  # fmt: skip
    # all_to_all_single: chunk j of the output comes from rank j.
    send = torch.arange(world * 3, dtype=torch.float32) + 100 * rank
    recv = torch.empty_like(send)
    group.all_to_all_single(recv, send)
    want = torch.cat([torch.arange(rank * 3, rank * 3 + 3, dtype=torch.float32) + 100 * j for j in range(world)])
    results[rank] = bool(torch.equal(recv, want))
    dist.destroy_process_group()


def test_all_to_all_single_on_cpu_over_gloo():
    world = 2
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, _free_port(), results), nprocs=world, join=True)
    assert dict(results) == {0: True, 1: True}


def test_dcp_kv_head_guard_refuses_what_corrupts_on_every_platform():
    """``--dcp-size d`` at ``--tp t``: a GQA model whose qkv_proj shards K over t is refused when
    K * d > t (the pool would mix different KV heads), accepted otherwise; the families whose
    qkv_proj replicates K/V inside the DCP group (``dcp_kv_partition``: Llama, Mistral, Qwen2,
    Qwen3, Qwen3-MoE, Mixtral, declared in their own class body), Qwen3.5 and MLA models are
    accepted at every layout. No platform is involved."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups.attention_hook import _check_dcp_kv_head_layout
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    def config(arch, k=2, mla=False):
        return SimpleNamespace(
            attention_arch=AttentionArch.MLA if mla else AttentionArch.MHA,
            hf_config=SimpleNamespace(architectures=[arch]),
            get_num_kv_heads=lambda tp, dcp=1: ModelConfig.get_num_kv_heads(
                SimpleNamespace(get_total_num_kv_heads=lambda: k, is_draft_model=False), tp, dcp
            ),
        )  # fmt: skip

    for tp, dcp in ((4, 2), (8, 4), (2, 1)):  # K = 2: K * dcp <= tp
        _check_dcp_kv_head_layout(tp, dcp, config("GemmaForCausalLM"))
    for tp, dcp in ((2, 2), (4, 4), (8, 8)):  # K * dcp > tp: silently wrong in 0.5.23
        with pytest.raises(ValueError, match=f"--dcp-size {dcp} at --tp-size {tp}"):
            _check_dcp_kv_head_layout(tp, dcp, config("GemmaForCausalLM"))
        for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM"):
            _check_dcp_kv_head_layout(tp, dcp, config(arch))
        _check_dcp_kv_head_layout(tp, dcp, config("Qwen3_5ForCausalLM"))
        _check_dcp_kv_head_layout(tp, dcp, config("DeepseekV3ForCausalLM", k=128, mla=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_pack_and_combine_equal_the_kernels(dtype, monkeypatch):
    """Where Triton does not run (a CPU tensor without the interpreter) the reduce takes the torch
    pack and combine: the same send-buffer bytes, and the kernel's combine within fp32 rounding,
    with the kernel's rules for empty (-inf), NaN and +inf shards."""
    N, B, H, D = 4, 5, 8, 16
    g = torch.Generator().manual_seed(1)
    out = torch.randn(B, H, D, generator=g).to(dtype)
    lse = torch.randn(B, H, generator=g) * 3
    lpd = dcp_kernels._lse_pack_dim(dtype)
    sends = []
    for pack in (dcp_kernels.dcp_pack_a2a_send, dcp_kernels.dcp_pack_a2a_send_torch):
        send = torch.zeros(N, B + 1, H // N, D + lpd, dtype=dtype)
        pack(out, lse, send[..., :D], send.view(torch.float32)[..., D // lpd])
        sends.append(send)
    assert torch.equal(sends[0].view(torch.uint8), sends[1].view(torch.uint8))

    recv_out = torch.randn(N, B, H // N, D, generator=g).to(dtype)
    recv_lse = torch.randn(N, B, H // N, generator=g)
    recv_lse[:, 0, 0] = float("-inf")  # every shard empty: 0, LSE -inf
    recv_lse[1, 1, 1], recv_lse[2, 2, 0] = float("nan"), float("inf")  # counted as empty
    for base_e in (True, False):
        want, want_lse = dcp_kernels.dcp_lse_combine_triton(recv_out, recv_lse.contiguous(), base_e, True)
        got, got_lse = dcp_kernels.dcp_lse_combine_torch(recv_out, recv_lse, base_e, True)
        tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
        assert bool((got[0, 0] == 0).all()) and got_lse[0, 0] == float("-inf")

    group = _Loopback(N)
    with_kernels = dcp_comm.dcp_a2a_lse_reduce(out, lse, group)
    assert dcp_kernels.dcp_a2a_kernels_run_on(torch.device("cpu"))  # interpreted here
    # a CPU user (no TRITON_INTERPRET): the kernel as triton.jit compiles it, not interpreted
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(dcp_kernels, "_dcp_lse_combine_kernel", JITFunction(dcp_kernels._dcp_lse_combine_kernel.fn))
    assert not dcp_kernels.dcp_a2a_kernels_run_on(torch.device("cpu"))
    assert dcp_kernels.dcp_a2a_kernels_run_on(torch.device("meta"))  # any other device: the kernels
    called = []
    monkeypatch.setattr(dcp_comm, "dcp_lse_combine_triton", lambda *a, **k: called.append(1))
    monkeypatch.setattr(dcp_comm, "dcp_pack_a2a_send", lambda *a, **k: called.append(1))
    torch_path = dcp_comm.dcp_a2a_lse_reduce(out, lse, group)
    assert not called
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(torch_path, with_kernels, **tol)
