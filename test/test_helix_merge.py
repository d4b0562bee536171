"""Helix All-to-All + LSE merge (sglang.srt.layers.helix.comm).

Both paths of comm: upstream's Triton kernels (interpreted here on a CPU) and the torch path taken
where they cannot run (a CPU tensor without TRITON_INTERPRET).
In-process: ``merge_partials`` against full attention in float64, extreme and empty shards, on each
path; the torch pack writes the kernel's send buffer bit for bit and the torch merge matches the
kernel; a CPU process without the interpreter takes the torch path (subprocess).
Multi-process (gloo, forkserver children, world sizes 2/4/8; Triton, torch, and ranks of both
paths in one group): the exact head redistribution of ``helix_a2a_exchange``, end-to-end
``helix_a2a_merge`` == full attention for each rank's Q/N heads, ONE All-to-All per call whose byte
count does not depend on the sequence length.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import types
from datetime import timedelta

import pytest
import torch

if not torch.cuda.is_available():
    # The upstream kernels are Triton; on a CPU they run under the interpreter, which Triton picks
    # when a kernel is decorated, i.e. when its module is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist
import torch.multiprocessing as mp

from sglang.srt.layers.helix import comm
from sglang.srt.layers.helix.comm import (
    a2a_buffer_shape,
    helix_a2a_bytes,
    helix_a2a_exchange,
    helix_a2a_merge,
    merge_partials,
)
from sglang.srt.layers.helix.ownership import owned_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def test_kernels_run_here():
    from sglang.kernels.ops.attention import dcp_kernels

    if DEVICE == "cpu":
        assert type(dcp_kernels._dcp_lse_combine_kernel).__name__ == "InterpretedFunction", (
            "the DCP kernels were imported before TRITON_INTERPRET=1 was set; run this test file "
            "in its own process or export TRITON_INTERPRET=1"
        )


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Run the test on the Triton kernels, then again with comm forced onto its torch path."""
    if request.param == "torch":
        monkeypatch.setattr(comm, "use_triton", lambda device: False)
    return request.param


# ---------------------------------------------------------------------------------------------
# Reference attention
# ---------------------------------------------------------------------------------------------


def attention(q, k, v, mask, scale):
    """Attention with LSE over the keys ``mask`` allows (GQA: head h reads KV head h // (Hq/Hkv)).

    q ``[T, Hq, D]``, k/v ``[S, Hkv, D]``, mask ``[T, S]`` bool -> (out ``[T, Hq, D]``,
    lse ``[T, Hq]``), computed in q's dtype. A row with no key is the neutral state: 0 and -inf.
    """
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->ths", q, k) * scale  # [T, Hq, S]
    allowed = mask[:, None, :].expand_as(scores)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, Hq], -inf for an empty row
    p = torch.where(allowed, torch.exp(scores - lse[..., None]), 0.0)
    return torch.einsum("ths,shd->thd", p, v), lse


def make_problem(seed, T, Hq, Hkv, D, S):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(S, Hkv, D, generator=g, dtype=torch.float64)
    return q, k, v


def visible(seq_lens, S):
    """``[T, S]``: token t (a decode request of length seq_lens[t]) sees positions < seq_lens[t]."""
    return torch.arange(S)[None, :] < torch.tensor(seq_lens)[:, None]


def shard_partials(q, k, v, mask, kvp, chunk, dtype):
    """Each KVP rank's partial attention over the tokens it owns (fp32 math, output in dtype)."""
    pos = torch.arange(k.shape[0])
    outs, lses = [], []
    for r in range(kvp):
        m = mask & owned_mask(pos, r, kvp, chunk)[None, :]
        o, l = attention(q.float(), k.float(), v.float(), m, q.shape[-1] ** -0.5)
        outs.append(o.to(dtype))
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)  # [KVP, T, H, D], [KVP, T, H]


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# merge_partials (no communication)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kvp", [2, 4, 8])
def test_merge_equals_full_attention(kvp, dtype, path):
    T, Hq, Hkv, D, S, chunk = 4, 4, 2, 32, 45, 4
    seq_lens = [S, 1, chunk + 1, 30]  # token 1 lives on rank 0 only, token 2 on ranks 0-1
    q, k, v = make_problem(kvp, T, Hq, Hkv, D, S)
    mask = visible(seq_lens, S)
    ref_out, ref_lse = attention(q, k, v, mask, D**-0.5)
    outs, lses = shard_partials(q, k, v, mask, kvp, chunk, dtype)
    assert torch.isinf(lses).any()  # some shards are empty for some tokens
    out, lse = merge_partials(outs.to(DEVICE), lses.to(DEVICE))
    assert out.dtype == dtype and out.shape == (T, Hq, D) and lse.dtype == torch.float32
    assert rel_err(out.cpu(), ref_out) <= TOL[dtype]
    assert rel_err(lse.cpu(), ref_lse) <= 1e-5


def ref_merge(outs, lses):
    """The merge formula in float64."""
    lses = lses.double()
    m = lses.max(0).values
    m = torch.where(torch.isinf(m), 0.0, m)
    w = torch.exp(lses - m)  # [N, T, H]
    total = w.sum(0)
    out = (w[..., None] * outs.double()).sum(0) / total.clamp_min(1.0)[..., None]
    return out, m + torch.log(total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_extreme_lse(dtype, path):
    g = torch.Generator().manual_seed(7)
    N, T, H, D = 4, 3, 4, 16
    outs = torch.randn(N, T, H, D, generator=g).to(dtype)
    lses = torch.tensor(
        [  # [N, T] per row, broadcast over heads with small offsets
            [1e4, -1e4, 0.0],
            [-1e4, -1e4 + 3.0, 80.0],
            [1e4 - 30.0, -1e4 + 1.0, -80.0],
            [1e4 - 0.5, float("-inf"), 1e-3],
        ]
    )[:, :, None] + torch.linspace(0, 2, H)
    out, lse = merge_partials(outs.to(DEVICE), lses.to(DEVICE))
    ref_out, ref_lse = ref_merge(outs, lses)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_err(out.cpu(), ref_out) <= TOL[dtype]
    assert ((lse.cpu().double() - ref_lse).abs() <= 1e-6 * ref_lse.abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_all_but_one_empty(dtype, path):
    g = torch.Generator().manual_seed(3)
    N, T, H, D = 4, 2, 2, 16
    for keep in range(N):
        outs = torch.zeros(N, T, H, D, dtype=dtype)
        outs[keep] = torch.randn(T, H, D, generator=g).to(dtype)
        lses = torch.full((N, T, H), float("-inf"))
        lses[keep] = torch.randn(T, H, generator=g) * 50
        out, lse = merge_partials(outs.to(DEVICE), lses.to(DEVICE))
        assert torch.equal(out.cpu(), outs[keep])
        assert torch.equal(lse.cpu(), lses[keep])


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
def test_merge_all_empty_is_zero_not_nan(path):  # (the interpreter warns on the expected log(0))
    outs = torch.zeros(4, 2, 2, 16)
    lses = torch.full((4, 2, 2), float("-inf"))
    out, lse = merge_partials(outs.to(DEVICE), lses.to(DEVICE))
    assert torch.equal(out.cpu(), torch.zeros(2, 2, 16))
    assert torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------
# The torch path against the Triton kernels
# ---------------------------------------------------------------------------------------------

SPECIAL_LSE = (float("-inf"), float("inf"), float("nan"), 1e30, -1e30, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kvp", [2, 4, 8])
def test_torch_pack_writes_the_kernels_send_buffer(kvp, dtype):
    g = torch.Generator().manual_seed(kvp)
    T, H, D = 5, 2 * kvp, 16
    out = torch.randn(T, 2 * H, D, generator=g).to(dtype)[:, ::2]  # strided heads: a slice
    lse = torch.randn(T, H, generator=g) * 100
    lse.view(-1)[: len(SPECIAL_LSE)] = torch.tensor(SPECIAL_LSE)  # carried as bits, never read
    shape = a2a_buffer_shape(T, H, D, dtype, kvp)
    by_kernel = torch.full(shape, 1.0, dtype=dtype, device=DEVICE)
    by_torch = torch.full(shape, 2.0, dtype=dtype, device=DEVICE)  # so every byte must be written
    comm._pack_send(out.to(DEVICE), lse.to(DEVICE), by_kernel, triton=True)
    comm._pack_send(out.to(DEVICE), lse.to(DEVICE), by_torch, triton=False)
    assert torch.equal(by_torch.view(torch.uint8), by_kernel.view(torch.uint8))


def _received(g, kvp, T, H, D, dtype):
    """Partials as the exchange leaves them: strided views into one [KVP, T, H, D + lpd] buffer.

    Row 0: every shard empty; row 1: NaN and +inf LSE shards (read as empty) beside real ones;
    row 2: LSEs 1e4 apart; the rest random. An empty (-inf) shard has output 0.
    """
    out = torch.randn(T, kvp * H, D, generator=g)
    lse = torch.randn(T, kvp * H, generator=g) * 30
    lse[0] = float("-inf")
    lse[1, 0::kvp], lse[1, 1::kvp] = float("nan"), float("inf")
    lse[2] = lse[2] + 1e4 * (torch.arange(kvp * H) % 3 - 1)
    out[torch.isneginf(lse)] = 0.0
    buf = torch.empty(a2a_buffer_shape(T, kvp * H, D, dtype, kvp), dtype=dtype, device=DEVICE)
    comm._pack_send(out.to(dtype).to(DEVICE), lse.to(DEVICE), buf, triton=False)
    # Reading the head-major layout as if it came from KVP peers: recv[j] = slice j of the heads.
    lse_word = D // (buf.shape[3] - D)  # the fp32 word after the D output columns
    return buf[..., :D], buf.view(torch.float32)[..., lse_word]


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kvp", [2, 4, 8])
def test_torch_merge_matches_the_kernel(kvp, dtype):
    g = torch.Generator().manual_seed(10 + kvp)
    outs, lses = _received(g, kvp, 6, 2, 32, dtype)
    assert outs.stride(2) != outs.shape[3]  # really the strided receive views
    out_k, lse_k = comm._combine(outs, lses, True, triton=True)
    out_t, lse_t = comm._combine(outs, lses, True, triton=False)
    assert out_t.dtype == dtype and lse_t.dtype == torch.float32
    assert not out_t.isnan().any() and not lse_t.isnan().any()
    assert not out_t[0].any() and torch.isneginf(lse_t[0]).all()  # every shard empty: 0, -inf
    # exp differs by an ulp between the two (numpy / torch); bf16: at most one bf16 ulp apart.
    rtol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out_t.float(), out_k.float(), rtol=rtol, atol=1e-6)
    torch.testing.assert_close(lse_t, lse_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(comm._combine(outs, lses, False, triton=False)[0], out_t)
    empty = lses.isnan() | lses.isposinf()  # what the merge reads as an empty shard
    ref_out, ref_lse = ref_merge(outs.cpu(), lses.masked_fill(empty, float("-inf")).cpu())
    assert rel_err(out_t.cpu(), ref_out) <= TOL[dtype]
    torch.testing.assert_close(lse_t.cpu().double(), ref_lse, rtol=1e-6, atol=1e-6)


# Runs in a process without TRITON_INTERPRET (the pytest process has it: the kernels here are
# interpreted since this module's import). A stand-in 2-rank group whose peer sends back exactly
# what this rank sends: head slice j of the local partials arrives as source j's partial.
_NO_INTERPRETER = r"""
import torch
from sglang.kernels.ops.attention import dcp_kernels
from sglang.srt.layers.helix import comm

class Loopback:
    world_size = 2
    def all_to_all_single(self, output, input):
        output.copy_(input)

kernel = type(dcp_kernels._dcp_lse_combine_kernel).__name__
assert kernel != "InterpretedFunction", "interpreted kernels: nothing tested"
g = torch.Generator().manual_seed(0)
T, H, D = 3, 4, 16
out, lse = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g) * 10
out[0], lse[0] = 0.0, float("-inf")  # a token none of the shards holds
merged = comm.helix_a2a_merge(out, lse, Loopback())  # [T, H/2, D]
outs = out.double().unflatten(1, (2, 2)).transpose(0, 1)  # [2, T, H/2, D]: source j = slice j
lses = lse.double().unflatten(1, (2, 2)).transpose(0, 1)
m = lses.amax(0)
m = torch.where(torch.isneginf(m), 0.0, m)
w = torch.exp(lses - m)
ref = (w[..., None] * outs).sum(0) / w.sum(0).clamp_min(1.0)[..., None]
assert not merged.isnan().any() and torch.equal(merged[0], torch.zeros(H // 2, D))
err = (merged.double() - ref).abs().max().item()
assert err < 1e-6, err
print("torch path ok", err)
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU without the interpreter")
def test_cpu_without_interpreter_takes_the_torch_path():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", _NO_INTERPRETER]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "torch path ok" in proc.stdout


def test_merge_rejects_what_the_kernels_cannot_do():
    with pytest.raises(ValueError, match="head_dim=24"):
        merge_partials(torch.zeros(2, 1, 1, 24), torch.zeros(2, 1, 1))
    with pytest.raises(ValueError, match="float32"):
        merge_partials(torch.zeros(2, 1, 1, 16), torch.zeros(2, 1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="divisible by kvp_size"):
        helix_a2a_bytes(1, 6, 16, torch.float32, 4)


def test_kvp1_is_a_noop():
    single = types.SimpleNamespace(world_size=1)  # a GroupCoordinator of one rank
    x, lse = torch.randn(3, 4, 16), torch.randn(3, 4)
    assert helix_a2a_merge(x, lse, single) is x
    assert helix_a2a_bytes(3, 4, 16, torch.bfloat16, 1) == 0


def test_a2a_bytes_formula():
    # Output plus one fp32 LSE per (token, local head): T * (Q/TPA) * (D * itemsize + 4).
    for dtype, itemsize in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)):
        for kvp in (2, 4, 8):
            assert helix_a2a_bytes(5, 8, 128, dtype, kvp) == 5 * 8 * (128 * itemsize + 4)


# ---------------------------------------------------------------------------------------------
# Multi-process (gloo)
# ---------------------------------------------------------------------------------------------

HN = 2  # Q/N: query heads per rank after the merge
T_MP, D_MP, CHUNK_MP = 3, 16, 4


def _groups(rank, world, kvp):
    """The KVP group of ``rank`` (contiguous blocks of ``kvp`` ranks) as both kinds of group."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    blocks = [list(range(s, s + kvp)) for s in range(0, world, kvp)]
    coordinator = GroupCoordinator(
        group_ranks=blocks,
        local_rank=rank,
        torch_distributed_backend="gloo",
        use_pynccl=False,
        use_mscclpp=False,
        use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name=f"helix_test_kvp{kvp}",
    )
    mine = None
    for ranks in blocks:
        pg = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = pg
    return coordinator, mine


def _check_exchange_pattern(group, kvp_rank, tpa_rank, kvp, dtype):
    H = HN * kvp  # Q/TPA
    t, h, d = torch.meshgrid(torch.arange(T_MP), torch.arange(H), torch.arange(D_MP), indexing="ij")
    # Small integers are exact in bf16: channel 0 = source kvp rank, 1 = local head, 2 = token,
    # 3 = tpa rank (must never cross KVP groups), 4.. = the column index.
    out = d.clone()
    out[..., 0], out[..., 1], out[..., 2], out[..., 3] = kvp_rank, h[..., 0], t[..., 0], tpa_rank
    lse = kvp_rank * 1000.0 + torch.arange(H)[None, :] * 10.0 + torch.arange(T_MP)[:, None] + 0.5
    outs, lses = helix_a2a_exchange(out.to(dtype), lse.float(), group)
    assert outs.shape == (kvp, T_MP, HN, D_MP) and lses.shape == (kvp, T_MP, HN)
    for src in range(kvp):  # rank k holds head slice k from every source, in source order
        heads = slice(kvp_rank * HN, (kvp_rank + 1) * HN)
        expect = out[:, heads].clone()
        expect[..., 0] = src
        assert torch.equal(outs[src], expect.to(dtype)), (src, outs[src])
        expect_lse = src * 1000.0 + torch.arange(H)[heads][None, :] * 10.0
        expect_lse = expect_lse + torch.arange(T_MP)[:, None] + 0.5
        assert torch.equal(lses[src], expect_lse.float())


def _local_partial(rank, world, kvp, S, seq_lens, dtype):
    """This rank's partial over its owned tokens for its TPA heads + the reference for its Q/N."""
    tpa_rank, kvp_rank = divmod(rank, kvp)
    tpa = world // kvp
    H, Hkv_local = HN * kvp, 2  # per TPA slice: Q/TPA query heads, 2 KV heads
    q, k, v = make_problem(1234 + S, T_MP, H * tpa, Hkv_local * tpa, D_MP, S)  # same on all ranks
    mask = visible(seq_lens, S)
    ref_out, _ = attention(q, k, v, mask, D_MP**-0.5)
    qs = slice(tpa_rank * H, (tpa_rank + 1) * H)
    kvs = slice(tpa_rank * Hkv_local, (tpa_rank + 1) * Hkv_local)
    own = mask & owned_mask(torch.arange(S), kvp_rank, kvp, CHUNK_MP)[None, :]
    o, l = attention(q[:, qs].float(), k[:, kvs].float(), v[:, kvs].float(), own, D_MP**-0.5)
    # tp_rank = tpa_rank * KVP + kvp_rank == rank holds o_proj heads [rank * Q/N, (rank+1) * Q/N).
    return o.to(dtype), l, ref_out[:, rank * HN : (rank + 1) * HN]


def _worker(rank, world, init_file, path):
    torch.set_num_threads(1)
    triton = path == "triton" or (path == "mixed" and rank % 2 == 0)  # mixed: both in each group
    if not triton:
        comm.use_triton = lambda device: False  # this child only
    assert comm.use_triton(torch.device("cpu")) == (triton and DEVICE == "cpu")  # interpreted
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        # Count what goes over the wire: both transports end in dist.all_to_all_single on CPU.
        sent = []
        real_a2a = dist.all_to_all_single

        def counting_a2a(output, input, *args, **kwargs):
            sent.append(input.numel() * input.element_size())
            return real_a2a(output, input, *args, **kwargs)

        dist.all_to_all_single = counting_a2a
        for kvp in [k for k in (2, 4, 8) if world % k == 0 and k <= world]:
            tpa_rank, kvp_rank = divmod(rank, kvp)
            coordinator, pg = _groups(rank, world, kvp)
            for group in (coordinator, pg):
                for dtype in (torch.float32, torch.bfloat16):
                    _check_exchange_pattern(group, kvp_rank, tpa_rank, kvp, dtype)
                    per_call = helix_a2a_bytes(T_MP, HN * kvp, D_MP, dtype, kvp)
                    # The wire bytes must not grow with S (checked on one transport, both dtypes).
                    for S in (5, 300) if group is coordinator else (37,):
                        seq_lens = [S, 1, CHUNK_MP + 1]  # some ranks own nothing of tokens 1, 2
                        o, l, ref = _local_partial(rank, world, kvp, S, seq_lens, dtype)
                        before = len(sent)
                        merged = helix_a2a_merge(o, l, group)
                        assert sent[before:] == [per_call], (kvp, dtype, S, sent[before:])
                        assert merged.shape == (T_MP, HN, D_MP) and merged.dtype == dtype
                        err = rel_err(merged, ref)
                        assert err <= TOL[dtype], (kvp, dtype, S, err)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world, path, timeout_s=90.0):
    """Start ``world`` forkserver children, wait at most ``timeout_s``; never leave one behind."""
    # Children fork from a server that has imported torch and the kernels once (a spawned child
    # would pay ~5 s of imports each).
    mp.set_forkserver_preload(["sglang.srt.layers.helix.comm", "sglang.srt.distributed.parallel_state"])
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _worker, args=(world, os.path.join(tmp, "init"), path), nprocs=world, join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):  # raises if a child failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"helix merge workers (world {world}) ran over {timeout_s}s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()


@pytest.mark.parametrize("path", ["triton", "torch", "mixed"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_a2a_merge_multiprocess(world, path):
    _run(world, path)
