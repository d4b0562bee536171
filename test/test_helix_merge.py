"""Helix All-to-All + LSE merge, on upstream DCP's machinery.

The exchange + merge is ``sglang.srt.layers.dcp.comm.dcp_a2a_lse_reduce`` (pack, ONE All-to-All,
combine) and, for a send buffer a kernel already filled (the GQA mode's decode: ``dcp_a2a_send_buffer``'s views),
``dcp_a2a_lse_reduce_packed``. The merge alone is ``dcp_lse_combine_triton`` (upstream) and
``dcp_lse_combine_torch`` (the series' torch path, taken where Triton does not run: a CPU tensor
without ``TRITON_INTERPRET=1``), the pack ``dcp_pack_a2a_send`` / ``dcp_pack_a2a_send_torch``.

In-process: the combine against full attention in float64, extreme and empty shards, on both
paths; the torch pack writes the kernel's send buffer bit for bit and the torch combine matches the
kernel; a CPU process without the interpreter takes the torch path (subprocess).
Multi-process (gloo, forkserver children, world sizes 2/4/8, KVP groups from ``dcp_group_ranks``
through ``init_model_parallel_group`` as ``initialize_model_parallel`` builds them; Triton, torch,
and ranks of both paths in one group): the exact head redistribution of the All-to-All, both entry
points == full attention for each rank's Q/N heads, ONE All-to-All per call whose byte count does
not depend on the sequence length.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from datetime import timedelta

import pytest
import torch

if not torch.cuda.is_available():
    # The upstream kernels are Triton; on a CPU they run under the interpreter, which Triton picks
    # when a kernel is decorated, i.e. when its module is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

from sglang.kernels.ops.attention import dcp_kernels  # noqa: E402
from sglang.kernels.ops.attention.dcp_kernels import (  # noqa: E402
    _lse_pack_dim,
    dcp_lse_combine_torch,
    dcp_lse_combine_triton,
    dcp_pack_a2a_send,
    dcp_pack_a2a_send_torch,
)
from sglang.srt.layers.dcp import comm as dcp_comm  # noqa: E402
from sglang.srt.layers.dcp.comm import dcp_a2a_lse_reduce, dcp_a2a_lse_reduce_packed  # noqa: E402
from sglang.srt.layers.dcp.layout import localize_dcp_indices  # noqa: E402
from sglang.srt.layers.dcp.comm import dcp_a2a_send_buffer  # noqa: E402
from sglang_helix.testing.workers import run_workers  # noqa: E402


def a2a_buffer_shape(num_tokens, num_heads, head_dim, dtype, kvp):
    """The send buffer's shape, as ``dcp_a2a_send_buffer`` allocates it."""
    return tuple(dcp_a2a_send_buffer(num_tokens, num_heads, head_dim, dtype, kvp, "meta")[0].shape)


def send_views(buf, head_dim):
    """``(out, lse)`` of a send buffer: the views ``dcp_a2a_send_buffer`` hands a kernel."""
    lpd = buf.shape[-1] - head_dim
    return buf[..., :head_dim], buf.view(torch.float32)[..., head_dim // lpd]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
COMBINE = {"triton": dcp_lse_combine_triton, "torch": dcp_lse_combine_torch}
PACK = {"triton": dcp_pack_a2a_send, "torch": dcp_pack_a2a_send_torch}


def test_kernels_run_here():
    if DEVICE == "cpu":
        assert type(dcp_kernels._dcp_lse_combine_kernel).__name__ == "InterpretedFunction", (
            "the DCP kernels were imported before TRITON_INTERPRET=1 was set; run this test file "
            "in its own process or export TRITON_INTERPRET=1"
        )
    assert dcp_kernels.dcp_a2a_kernels_run_on(torch.device(DEVICE))


@pytest.fixture(params=["triton", "torch"])
def path(request):
    """The merge on upstream's Triton kernel, then on the series' torch combine."""
    return request.param


def merge(outs, lses, path):
    """``(out [T, H, D], lse [T, H])`` of the ``KVP`` partials ``[KVP, T, H, D]`` / ``[KVP, T, H]``."""
    # The kernel stores the merged LSE with the *input* LSE's strides: give it a contiguous one.
    return COMBINE[path](outs.to(DEVICE), lses.to(DEVICE).contiguous(), is_lse_base_on_e=True, return_lse=True)


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


def owned(S, kvp_rank, kvp, chunk):
    """``[S]`` bool: the positions KVP rank ``kvp_rank`` holds (Helix's layout, DCP's formula)."""
    return localize_dcp_indices(torch.arange(S), kvp, kvp_rank, interleave_size=chunk) >= 0


def shard_partials(q, k, v, mask, kvp, chunk, dtype):
    """Each KVP rank's partial attention over the tokens it owns (fp32 math, output in dtype)."""
    outs, lses = [], []
    for r in range(kvp):
        m = mask & owned(k.shape[0], r, kvp, chunk)[None, :]
        o, l = attention(q.float(), k.float(), v.float(), m, q.shape[-1] ** -0.5)
        outs.append(o.to(dtype))
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)  # [KVP, T, H, D], [KVP, T, H]


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# The combine (no communication)
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
    out, lse = merge(outs, lses, path)
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
    out, lse = merge(outs, lses, path)
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
        out, lse = merge(outs, lses, path)
        assert torch.equal(out.cpu(), outs[keep])
        assert torch.equal(lse.cpu(), lses[keep])


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
def test_merge_all_empty_is_zero_not_nan(path):  # (the interpreter warns on the expected log(0))
    outs = torch.zeros(4, 2, 2, 16)
    lses = torch.full((4, 2, 2), float("-inf"))
    out, lse = merge(outs, lses, path)
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
    T, H, D, pad = 5, 2 * kvp, 16, 2  # pad: a graph's buffer, sized for more tokens than this batch
    out = torch.randn(T, 2 * H, D, generator=g).to(dtype)[:, ::2]  # strided heads: a slice
    lse = torch.randn(T, H, generator=g) * 100
    lse.view(-1)[: len(SPECIAL_LSE)] = torch.tensor(SPECIAL_LSE)  # carried as bits, never read
    shape = a2a_buffer_shape(T + pad, H, D, dtype, kvp)
    assert shape == (kvp, T + pad, H // kvp, D + _lse_pack_dim(dtype))
    by_kernel = torch.full(shape, 1.0, dtype=dtype, device=DEVICE)
    by_torch = torch.full(shape, 2.0, dtype=dtype, device=DEVICE)  # so every byte must be written
    dcp_pack_a2a_send(out.to(DEVICE), lse.to(DEVICE), *send_views(by_kernel, D))
    dcp_pack_a2a_send_torch(out.to(DEVICE), lse.to(DEVICE), *send_views(by_torch, D))
    assert torch.equal(by_torch[:, :T].view(torch.uint8), by_kernel[:, :T].view(torch.uint8))
    assert (by_kernel[:, T:] == 1.0).all() and (by_torch[:, T:] == 2.0).all()  # padding untouched
    # The layout: slot [k, t, h] holds head k * H/KVP + h of token t, the fp32 LSE right after it.
    o_view, l_view = send_views(by_torch, D)
    heads = H // kvp
    for k in range(kvp):
        assert torch.equal(o_view[k, :T].cpu(), out[:, k * heads : (k + 1) * heads])
        assert torch.equal(l_view[k, :T].cpu().view(torch.int32), lse[:, k * heads : (k + 1) * heads].view(torch.int32))


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
    dcp_pack_a2a_send_torch(out.to(dtype).to(DEVICE), lse.to(DEVICE), *send_views(buf, D))
    # Reading the head-major layout as if it came from KVP peers: recv[j] = slice j of the heads.
    return send_views(buf, D)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kvp", [2, 4, 8])
def test_torch_merge_matches_the_kernel(kvp, dtype):
    g = torch.Generator().manual_seed(10 + kvp)
    outs, lses = _received(g, kvp, 6, 2, 32, dtype)
    assert outs.stride(2) != outs.shape[3]  # really the strided receive views
    out_k, lse_k = dcp_lse_combine_triton(outs, lses.contiguous(), True, return_lse=True)
    out_t, lse_t = dcp_lse_combine_torch(outs, lses, True, return_lse=True)
    assert out_t.dtype == dtype and lse_t.dtype == torch.float32
    assert not out_t.isnan().any() and not lse_t.isnan().any()
    assert not out_t[0].any() and torch.isneginf(lse_t[0]).all()  # every shard empty: 0, -inf
    # exp differs by an ulp between the two (numpy / torch); bf16: at most one bf16 ulp apart.
    rtol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out_t.float(), out_k.float(), rtol=rtol, atol=1e-6)
    torch.testing.assert_close(lse_t, lse_k, rtol=1e-6, atol=1e-6)
    # What the reduce runs (no LSE out, the strided views as they are): the same outputs.
    assert torch.equal(dcp_lse_combine_torch(outs, lses, True)[0], out_t)
    assert torch.equal(dcp_lse_combine_triton(outs, lses, True)[0], out_k)
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
from sglang.srt.layers.dcp.comm import dcp_a2a_lse_reduce

class Loopback:
    world_size = 2
    def all_to_all_single(self, output, input):
        output.copy_(input)

kernel = type(dcp_kernels._dcp_lse_combine_kernel).__name__
assert kernel != "InterpretedFunction", "interpreted kernels: nothing tested"
assert not dcp_kernels.dcp_a2a_kernels_run_on(torch.device("cpu"))
g = torch.Generator().manual_seed(0)
T, H, D = 3, 4, 16
out, lse = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g) * 10
out[0], lse[0] = 0.0, float("-inf")  # a token none of the shards holds
merged = dcp_a2a_lse_reduce(out, lse, Loopback())  # [T, H/2, D]; Triton on a CPU tensor would raise
outs = out.double().unflatten(1, (2, 2)).transpose(0, 1)  # [2, T, H/2, D]: source j = slice j
lses = lse.double().unflatten(1, (2, 2)).transpose(0, 1)
m = lses.amax(0)
m = torch.where(torch.isneginf(m), 0.0, m)
w = torch.exp(lses - m)
ref = (w[..., None] * outs).sum(0) / w.sum(0).clamp_min(1.0)[..., None]
assert merged.shape == (T, H // 2, D)
assert not merged.isnan().any() and torch.equal(merged[0], torch.zeros(H // 2, D))
err = (merged.double() - ref).abs().max().item()
assert err < 1e-6, err
print("torch path ok", err)
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU without the interpreter")
def test_cpu_without_interpreter_takes_the_torch_path():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", _NO_INTERPRETER]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "torch path ok" in proc.stdout


def test_kvp1_is_a_noop():
    single = types.SimpleNamespace(world_size=1)  # a GroupCoordinator of one rank
    x, lse = torch.randn(3, 4, 16), torch.randn(3, 4)
    assert dcp_a2a_lse_reduce(x, lse, single) is x


def test_a2a_bytes_formula():
    # Output plus one fp32 LSE per (token, local head): T * (Q/TPA) * (D * itemsize + 4).
    for dtype, itemsize in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)):
        for kvp in (2, 4, 8):
            shape = a2a_buffer_shape(5, 8, 128, dtype, kvp)
            assert torch.Size(shape).numel() * itemsize == 5 * 8 * (128 * itemsize + 4)


# ---------------------------------------------------------------------------------------------
# Multi-process (gloo)
# ---------------------------------------------------------------------------------------------

HN = 2  # Q/N: query heads per rank after the merge
T_MP, D_MP, CHUNK_MP = 3, 16, 4


def _kvp_group(rank, world, kvp):
    """This rank's KVP group as ``initialize_model_parallel`` lays it out and builds it (one TP
    group of ``world`` ranks): ``dcp_group_ranks`` + ``init_model_parallel_group`` over gloo."""
    from sglang.srt.distributed.parallel_state import dcp_group_ranks, init_model_parallel_group

    group = init_model_parallel_group(dcp_group_ranks([list(range(world))], kvp), rank, "gloo", group_name="helix_kvp")
    assert group.world_size == kvp and group.rank_in_group == rank % kvp
    return group


def _packed_reduce(out, lse, group, path, pad):
    """``dcp_a2a_lse_reduce_packed`` as Helix decode runs it: the partials written into the send
    buffer's views (here by a pack; by the decode kernel's stage 2 in the runtime), in a buffer
    sized for ``pad`` more tokens (padding rows NaN). Returns the merged output and the views of
    what arrived: ``(merged, recv_out [KVP, T, H/KVP, D], recv_lse [KVP, T, H/KVP])``."""
    T, H, D = out.shape
    shape = a2a_buffer_shape(T + pad, H, D, out.dtype, group.world_size)
    send = torch.full(shape, float("nan"), dtype=out.dtype)
    recv = torch.full(shape, float("nan"), dtype=out.dtype)
    PACK[path](out, lse, *send_views(send, D))
    merged = dcp_a2a_lse_reduce_packed(send, recv, T, group)
    recv_out, recv_lse = send_views(recv, D)
    return merged, recv_out[:, :T], recv_lse[:, :T]


def _check_exchange_pattern(group, kvp_rank, tpa_rank, kvp, dtype, path):
    H = HN * kvp  # Q/TPA
    t, h, d = torch.meshgrid(torch.arange(T_MP), torch.arange(H), torch.arange(D_MP), indexing="ij")
    # Small integers are exact in bf16: channel 0 = source kvp rank, 1 = local head, 2 = token,
    # 3 = tpa rank (must never cross KVP groups), 4.. = the column index.
    out = d.clone()
    out[..., 0], out[..., 1], out[..., 2], out[..., 3] = kvp_rank, h[..., 0], t[..., 0], tpa_rank
    lse = kvp_rank * 1000.0 + torch.arange(H)[None, :] * 10.0 + torch.arange(T_MP)[:, None] + 0.5
    _, outs, lses = _packed_reduce(out.to(dtype), lse.float(), group, path, pad=1)
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
    own = mask & owned(S, kvp_rank, kvp, CHUNK_MP)[None, :]
    o, l = attention(q[:, qs].float(), k[:, kvs].float(), v[:, kvs].float(), own, D_MP**-0.5)
    # tp_rank = tpa_rank * KVP + kvp_rank == rank holds o_proj heads [rank * Q/N, (rank+1) * Q/N).
    return o.to(dtype), l, ref_out[:, rank * HN : (rank + 1) * HN]


def _worker(rank, world, init_file, path):
    from sglang.srt.distributed import parallel_state

    torch.set_num_threads(1)
    path = path if path != "mixed" else ("triton" if rank % 2 == 0 else "torch")  # both in each group
    if path == "torch":
        # this child only: a CPU without TRITON_INTERPRET (the kernel as triton.jit compiles it)
        from triton.runtime.jit import JITFunction

        dcp_kernels._dcp_lse_combine_kernel = JITFunction(dcp_kernels._dcp_lse_combine_kernel.fn)
    assert dcp_kernels.dcp_a2a_kernels_run_on(torch.device("cpu")) == (path == "triton")
    # Which combine the reduce runs on this rank.
    combines = []
    for name in ("dcp_lse_combine_triton", "dcp_lse_combine_torch"):
        real = getattr(dcp_comm, name)
        setattr(dcp_comm, name, lambda *a, _real=real, _name=name, **k: combines.append(_name) or _real(*a, **k))
    parallel_state.set_custom_all_reduce(False)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        # Count what goes over the wire: GroupCoordinator.all_to_all_single ends in
        # dist.all_to_all_single on CPU tensors.
        sent = []
        real_a2a = dist.all_to_all_single

        def counting_a2a(output, input, *args, **kwargs):
            sent.append(input.numel() * input.element_size())
            return real_a2a(output, input, *args, **kwargs)

        dist.all_to_all_single = counting_a2a
        for kvp in [k for k in (2, 4, 8) if world % k == 0 and k <= world]:
            tpa_rank, kvp_rank = divmod(rank, kvp)
            group = _kvp_group(rank, world, kvp)
            for dtype in (torch.float32, torch.bfloat16):
                _check_exchange_pattern(group, kvp_rank, tpa_rank, kvp, dtype, path)
                per_call = T_MP * HN * kvp * (D_MP * torch.empty((), dtype=dtype).element_size() + 4)
                # The wire bytes must not grow with S.
                for S in (5, 300):
                    seq_lens = [S, 1, CHUNK_MP + 1]  # some ranks own nothing of tokens 1, 2
                    o, l, ref = _local_partial(rank, world, kvp, S, seq_lens, dtype)
                    before, combines[:] = len(sent), []
                    merged = dcp_a2a_lse_reduce(o, l, group)
                    assert sent[before:] == [per_call], (kvp, dtype, S, sent[before:])
                    assert combines == [f"dcp_lse_combine_{path}"], combines
                    assert merged.shape == (T_MP, HN, D_MP) and merged.dtype == dtype
                    err = rel_err(merged, ref)
                    assert err <= TOL[dtype], (kvp, dtype, S, err)
                    if S == 5:  # (at KVP >= 4 some ranks own nothing of any token)
                        # The packed entry point (a buffer padded for more tokens): the same result.
                        packed, _, _ = _packed_reduce(o, l, group, path, pad=2)
                        assert torch.equal(packed, merged), (kvp, dtype, S)
            dist.barrier()
            group.destroy()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world, path, timeout_s=180.0):
    # Children fork from a server that has imported torch and the kernels once (a spawned child
    # would pay the imports each).
    preload = ["sglang.srt.layers.dcp.comm"]
    run_workers(_worker, world, timeout_s, f"helix merge (world {world})", preload, args=(path,))


@pytest.mark.parametrize("path", ["triton", "torch", "mixed"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_a2a_merge_multiprocess(world, path):
    _run(world, path)
