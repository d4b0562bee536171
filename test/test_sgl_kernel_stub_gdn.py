"""The stub's torch versions of the Qwen3.5 CPU ops (``sgl_kernel/qwen3_5_cpu_ops.py``) against
independent references: float64 loops written here from the ops' contracts, and transformers' own
torch implementations of the same steps (``transformers/models/qwen3_5/modeling_qwen3_5.py``:
``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``,
``causal_conv1d_update``, ``Qwen3_5RMSNorm``), on varlen batches with states gathered from a pool
by index, written back in place, and the pad slot (-1) left alone.

Layouts: SGLang's recurrent state pool is ``[slots, Hv, V, K]``; transformers' state is ``[...,
K, V]`` (compared transposed). Tolerances: float32 ops against float64 references, 2e-5
relative to the output scale unless stated.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sglang_helix.testing.cpu_env import STUB_DIR, cpu_server_env

os.environ.setdefault(
    "HF_HUB_OFFLINE", "1"
)  # transformers' kernel-hub fallbacks: torch only
if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

import sgl_kernel  # noqa: E402
from sgl_kernel import mamba, qwen3_5_cpu_ops  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf  # noqa: E402

OPS = torch.ops.sgl_kernel
I32 = torch.int32


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _close(got, want, rel=2e-5, what=""):
    got, want = got.double(), want.double()
    scale = want.abs().max().clamp_min(1.0)
    err = (got - want).abs().max() / scale
    assert err <= rel, f"{what}: max error {err:.3g} (relative to {scale:.3g}) > {rel}"


# -- registration -----------------------------------------------------------------------------------
def test_ops_are_defined_under_torch_ops_sgl_kernel():
    for name in qwen3_5_cpu_ops.OPS:
        op = getattr(OPS, name)
        assert str(op.default._schema).startswith(f"sgl_kernel::{name}("), name
    # Feature probes stay unanswered: the engine must not take its AMX paths.
    for probe in (
        "convert_weight_packed",
        "fused_qk_norm_rope_cpu",
        "fused_qk_norm_cpu",
        "fused_rmsnorm_gated_cpu",
    ):
        assert not hasattr(OPS, probe), probe
    for name in mamba.WRAPPERS:
        assert callable(getattr(mamba, name)) and not isinstance(
            getattr(mamba, name), sgl_kernel.StubKernel
        )
    with pytest.raises(sgl_kernel.SglKernelStubCalled):
        mamba.causal_conv1d_fwd(torch.zeros(1))  # the CUDA op stays a loud stub


SGLANG_BINDS = r"""
import torch
from sglang.srt.utils import cpu_has_amx_support
import sglang.srt.models.qwen3_5 as m
import sglang.srt.layers.attention.linear.gdn_backend as b
import sglang.srt.layers.attention.linear.kernels.gdn_triton as t
assert not cpu_has_amx_support()
assert m.fused_qk_gemma_rmsnorm is torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu
assert b.fused_gdn_gating is torch.ops.sgl_kernel.fused_gdn_gating_cpu
assert b.causal_conv1d_fn.__module__ == "sgl_kernel.mamba" and t.chunk_gated_delta_rule.__module__ == "sgl_kernel.mamba"
print("ok")
"""


def test_sglang_binds_the_stub_ops_in_a_server_environment():
    """What a server rank imports: the Qwen3.5 model and GDN backend modules bind these ops."""
    env = cpu_server_env(1)
    r = subprocess.run(
        [sys.executable, "-c", SGLANG_BINDS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# -- the attention output gate and the q/k norms ----------------------------------------------------
def test_fused_sigmoid_mul_cpu_is_in_place():
    g = _gen(0)
    x, gate = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g)
    want = x.double() * torch.sigmoid(gate.double())
    got = x.clone()
    assert OPS.fused_sigmoid_mul_cpu(got, gate) is None
    _close(got, want, what="2-D gate")
    got3 = x.clone()
    OPS.fused_sigmoid_mul_cpu(got3, gate.view(5, 3, 8))  # [T, H, D] against [T, H * D]
    assert torch.equal(got3, got)


def _hf_rmsnorm(x, weight, eps):
    norm = hf.Qwen3_5RMSNorm(x.shape[-1], eps=eps)
    norm.weight.data.copy_(weight)
    return norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qk_gemma_rmsnorm_cpu(dtype):
    g = _gen(1)
    T, Hq, Hk, D, eps = 6, 4, 2, 32, 1e-6
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(
        dtype
    )  # q and k are strided views
    q, k = qkv[:, : Hq * D], qkv[:, Hq * D : (Hq + Hk) * D]
    qw, kw = (0.1 * torch.randn(D, generator=g)).to(dtype), (
        0.1 * torch.randn(D, generator=g)
    ).to(dtype)
    qn, kn = OPS.fused_qk_gemma_rmsnorm_cpu(q, k, qw, kw, eps, D)
    assert qn.shape == q.shape and kn.shape == k.shape and qn.dtype == dtype
    rel = 2e-5 if dtype == torch.float32 else 1e-2
    _close(
        qn, _hf_rmsnorm(q.float().view(T, Hq, D), qw.float(), eps).view(T, -1), rel, "q"
    )
    _close(
        kn, _hf_rmsnorm(k.float().view(T, Hk, D), kw.float(), eps).view(T, -1), rel, "k"
    )


def test_fused_qk_gemma_rmsnorm_with_gate_cpu_splits_like_the_checkpoint():
    """q_proj's rows are [q_h, gate_h] per head: transformers' chunk of view(T, H, 2D)."""
    g = _gen(2)
    T, H, Hk, D, eps = 5, 4, 2, 32, 1e-6
    q_gate, k = torch.randn(T, H * 2 * D, generator=g), torch.randn(
        T, Hk * D, generator=g
    )
    qw, kw = 0.1 * torch.randn(D, generator=g), 0.1 * torch.randn(D, generator=g)
    q_out, k_out, gate_out = OPS.fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate, k, qw, kw, eps, D, H
    )
    q_ref, gate_ref = torch.chunk(q_gate.view(T, H, 2 * D), 2, dim=-1)
    assert q_out.shape == gate_out.shape == (T * H, D) and k_out.shape == (T * Hk, D)
    _close(q_out, _hf_rmsnorm(q_ref, qw, eps).reshape(-1, D), what="q")
    _close(k_out, _hf_rmsnorm(k.view(T, Hk, D), kw, eps).reshape(-1, D), what="k")
    assert torch.equal(gate_out, gate_ref.reshape(-1, D))  # the gate is not normalized


# -- the GDN input split and gates ------------------------------------------------------------------
def test_fused_qkvzba_split_reshape_cat_contiguous_cpu():
    g = _gen(3)
    T, Hk, Hv, Dk, Dv = 3, 2, 4, 32, 32
    qkvz = torch.randn(T, 2 * Hk * Dk + 2 * Hv * Dv, generator=g)
    ba = torch.randn(T, 2 * Hv, generator=g)
    mixed_qkv, z, b, a = OPS.fused_qkvzba_split_reshape_cat_contiguous_cpu(
        qkvz, ba, Hk, Hv, Dk, Dv
    )
    q_, k_, v_, z_ = qkvz.split([Hk * Dk, Hk * Dk, Hv * Dv, Hv * Dv], dim=-1)
    assert torch.equal(mixed_qkv, torch.cat([q_, k_, v_], -1))
    assert (
        torch.equal(z, z_.view(T, Hv, Dv))
        and torch.equal(b, ba[:, :Hv])
        and torch.equal(a, ba[:, Hv:])
    )
    with pytest.raises(RuntimeError, match="power-of-two"):
        OPS.fused_qkvzba_split_reshape_cat_contiguous_cpu(
            torch.randn(T, 2 * 32 + 6 * 32), torch.randn(T, 6), 1, 3, 32, 32
        )


def test_fused_gdn_gating_cpu():
    g = _gen(4)
    B, H = 7, 8
    A_log = torch.randn(H, generator=g)
    a, b, dt_bias = (
        torch.randn(B, H, generator=g) * 3,
        torch.randn(B, H, generator=g),
        torch.randn(H, generator=g),
    )
    a[0, 0] = 40.0  # the softplus threshold branch
    gate, beta = OPS.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    assert (
        gate.shape == beta.shape == (1, B, H)
        and gate.dtype == torch.float32
        and beta.dtype == b.dtype
    )
    want_g = -A_log.double().exp() * F.softplus(
        a.double() + dt_bias.double()
    )  # transformers' formula
    _close(gate[0], want_g, what="g")
    _close(beta[0], torch.sigmoid(b.double()), what="beta")
    assert (
        OPS.fused_gdn_gating_cpu(A_log, a.bfloat16(), b.bfloat16(), dt_bias.bfloat16())[
            1
        ].dtype
        == torch.bfloat16
    )


# -- causal conv1d ----------------------------------------------------------------------------------
def _ref_conv(window, xs, w, bias):
    """float64: out[:, t] = silu(sum_j w[:, j] * cat(window, xs)[:, t + j] + bias)."""
    full = torch.cat([window.double(), xs.double()], 1)
    W = w.shape[1]
    out = torch.stack(
        [(full[:, t : t + W] * w.double()).sum(1) for t in range(xs.shape[1])], 1
    )
    return F.silu(out + bias.double()[:, None])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_fwd_cpu_varlen_with_states(state_dtype):
    g = _gen(5)
    dim, W = 32, 4
    lens = [5, 2, 9, 3]  # the 2-token one shifts its initial state
    slots = [3, 0, -1, 5]  # -1: the pad slot, skipped
    initial = [True, True, False, False]
    w, bias = torch.randn(dim, W, generator=g), torch.randn(dim, generator=g)
    x = torch.randn(
        sum(lens), dim, generator=g
    ).t()  # [dim, T], a transposed view as the backend passes it
    pool = torch.randn(7, dim, W - 1, generator=g).to(state_dtype)
    before = pool.clone()
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=I32)
    out = mamba.causal_conv1d_fn_cpu(
        x,
        w,
        bias,
        "silu",
        pool,
        torch.tensor(initial),
        torch.tensor(slots, dtype=I32),
        qsl,
        lens,
    )
    assert out.shape == x.shape and out.dtype == x.dtype
    for i, (s, e) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        xs = x[:, s:e]
        if slots[i] < 0:
            assert (out[:, s:e] == 0).all()
            continue
        window = (
            before[slots[i]].double()
            if initial[i]
            else torch.zeros(dim, W - 1, dtype=torch.float64)
        )
        _close(out[:, s:e], _ref_conv(window, xs, w, bias), what=f"seq {i} output")
        want_state = torch.cat([window, xs.double()], 1)[:, -(W - 1) :].to(state_dtype)
        assert torch.equal(pool[slots[i]], want_state), f"seq {i} state"
        if not initial[i]:  # transformers' own conv (no cache) for a fresh sequence
            hf_out = hf.causal_conv1d_fn(xs[None], w, bias, activation="silu")[0]
            _close(out[:, s:e], hf_out, what=f"seq {i} vs transformers")
    untouched = [j for j in range(7) if j not in slots]
    assert torch.equal(pool[untouched], before[untouched])


def test_causal_conv1d_update_cpu_decode_rows():
    g = _gen(6)
    dim, W, B = 32, 4, 4
    w, bias = torch.randn(dim, W, generator=g), torch.randn(dim, generator=g)
    x = torch.randn(B, dim, generator=g)
    pool = torch.randn(6, dim, W - 1, generator=g)
    before = pool.clone()
    slots = torch.tensor([4, 1, -1, 2], dtype=I32)
    out = mamba.causal_conv1d_update_cpu(x, pool, w, bias, "silu", slots)
    assert out.shape == x.shape
    for b, s in enumerate(slots.tolist()):
        if s < 0:
            assert (out[b] == 0).all()
            continue
        _close(
            out[b],
            _ref_conv(before[s], x[b : b + 1].t(), w, bias)[:, 0],
            what=f"row {b}",
        )
        state = before[
            s : s + 1
        ].clone()  # transformers updates its conv state in place too
        hf_out = hf.causal_conv1d_update(
            x[b : b + 1, :, None], state, w, bias, activation="silu"
        )
        _close(out[b], hf_out[0, :, 0], what=f"row {b} vs transformers")
        assert torch.equal(pool[s], state[0])
    assert torch.equal(pool[[0, 3, 5]], before[[0, 3, 5]])
    with pytest.raises(RuntimeError, match="int32"):
        mamba.causal_conv1d_update_cpu(x, pool, w, bias, "silu", slots.long())


# -- the gated delta rule ---------------------------------------------------------------------------
def _ref_delta_rule(q, k, v, g, beta, h, scale):
    """float64, token by token, SGLang's state layout h [Hv, V, K]; q/k [T, H, K] already
    L2-normalized, v [T, Hv, V], g/beta [T, Hv]."""
    rep = v.shape[1] // q.shape[1]
    q, k, v, g, beta, h = (t.double() for t in (q, k, v, g, beta, h))
    outs = []
    for t in range(q.shape[0]):
        qt, kt = q[t].repeat_interleave(rep, 0) * scale, k[t].repeat_interleave(
            rep, 0
        )  # [Hv, K]
        h = h * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - (h * kt[:, None, :]).sum(-1))  # [Hv, V]
        h = h + u[:, :, None] * kt[:, None, :]
        outs.append((h * qt[:, None, :]).sum(-1))
    return torch.stack(outs), h


def _l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _gdn_inputs(seed, T, H=2, Hv=4, D=32):
    g = _gen(seed)
    q, k = torch.randn(1, T, H, D, generator=g), torch.randn(1, T, H, D, generator=g)
    v = torch.randn(1, T, Hv, D, generator=g)
    gate = -0.3 * torch.rand(
        1, T, Hv, generator=g
    )  # decays exp(g) in [0.74, 1]: state carries far
    beta = torch.rand(1, T, Hv, generator=g)
    return q, k, v, gate, beta


def test_chunk_gated_delta_rule_cpu_varlen_pool():
    lens = [1, 70, 130, 5]  # across chunk boundaries at 64 and 128
    slots = [
        4,
        0,
        2,
        -1,
    ]  # gathered out of order; -1 starts from zeros and is not written
    T, Hv, D = sum(lens), 4, 32
    q, k, v, gate, beta = _gdn_inputs(7, T)
    pool = torch.randn(6, Hv, D, D, generator=_gen(8)) * 0.1
    before = pool.clone()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=I32)
    o, final, h = mamba.chunk_gated_delta_rule_cpu(
        q, k, v, gate, beta, pool, cu, False, True, torch.tensor(slots, dtype=I32)
    )
    assert o.shape == v.shape and o.dtype == q.dtype and final is pool and h is None
    for i, slot in enumerate(slots):
        s, e = cu[i].item(), cu[i + 1].item()
        h0 = before[slot] if slot >= 0 else torch.zeros(Hv, D, D)
        want_o, want_h = _ref_delta_rule(
            _l2n(q[0, s:e]),
            _l2n(k[0, s:e]),
            v[0, s:e],
            gate[0, s:e],
            beta[0, s:e],
            h0,
            D**-0.5,
        )
        _close(o[0, s:e], want_o, what=f"seq {i} output")
        if slot >= 0:
            _close(pool[slot], want_h, what=f"seq {i} state")
        # transformers' chunked and token-by-token versions, state [K, V]
        for fn in (
            hf.torch_chunk_gated_delta_rule,
            hf.torch_recurrent_gated_delta_rule,
        ):
            rep = Hv // q.shape[2]
            hf_o, hf_h = fn(
                q[:, s:e].repeat_interleave(rep, 2),
                k[:, s:e].repeat_interleave(rep, 2),
                v[:, s:e],
                g=gate[:, s:e],
                beta=beta[:, s:e],
                initial_state=h0.transpose(-1, -2)[None],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            _close(o[0, s:e], hf_o[0], what=f"seq {i} vs transformers {fn.__name__}")
            if slot >= 0:
                _close(
                    pool[slot],
                    hf_h[0].transpose(-1, -2),
                    what=f"seq {i} state vs {fn.__name__}",
                )
    assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])


def test_chunk_gated_delta_rule_cpu_returns_per_chunk_states_for_the_extra_buffer(monkeypatch):
    """Test-only (``HELIX_TEST_MAMBA_CHUNK_STATES=1``, ``test_helix_qwen3_5_radix.py``): the
    wrapper also returns ``h`` as the Triton/FLA chunk kernel does (``chunk_gated_delta_rule_fwd_h``:
    ``[1, NT, Hv, V, K]``, NT the 64-token chunks of every sequence in batch order, entry i the state
    chunk i starts from, the first a sequence's initial state), which the mamba radix cache's extra
    buffer snapshots. Each entry against the float64 reference run over the prefix before it;
    the outputs and the pool's final states are those of the plain call."""
    lens = [130, 64, 5, 129]  # 3 + 1 + 1 + 3 chunks
    slots = [4, 0, -1, 2]
    T, Hv, D = sum(lens), 4, 32
    q, k, v, gate, beta = _gdn_inputs(12, T)
    pool = torch.randn(6, Hv, D, D, generator=_gen(13)) * 0.1
    before, plain_pool = pool.clone(), pool.clone()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=I32)
    idx = torch.tensor(slots, dtype=I32)
    plain_o, _, _ = mamba.chunk_gated_delta_rule_cpu(q, k, v, gate, beta, plain_pool, cu, False, True, idx)
    monkeypatch.setenv(mamba.CHUNK_STATES_ENV, "1")
    o, final, h = mamba.chunk_gated_delta_rule_cpu(q, k, v, gate, beta, pool, cu, False, True, idx)
    assert final is pool and torch.equal(o, plain_o) and torch.equal(pool, plain_pool)
    assert h.shape == (1, sum((n + 63) // 64 for n in lens), Hv, D, D) and h.dtype == q.dtype
    n = 0
    for i, slot in enumerate(slots):
        s = cu[i].item()
        h0 = before[slot] if slot >= 0 else torch.zeros(Hv, D, D)
        for c in range((lens[i] + 63) // 64):
            e = s + 64 * c
            want = h0
            if c:
                _, want = _ref_delta_rule(
                    _l2n(q[0, s:e]), _l2n(k[0, s:e]), v[0, s:e], gate[0, s:e], beta[0, s:e], h0, D**-0.5
                )
            _close(h[0, n], want, what=f"seq {i} chunk {c} start state")
            n += 1


def test_chunk_gated_delta_rule_cpu_rejects_what_the_real_op_rejects():
    q, k, v, gate, beta = _gdn_inputs(9, 4)
    pool, cu, idx = (
        torch.zeros(2, 4, 32, 32),
        torch.tensor([0, 4], dtype=I32),
        torch.tensor([0], dtype=I32),
    )
    args = (q, k, v, gate, beta, pool, True, cu, False, True, idx)
    OPS.chunk_gated_delta_rule_cpu(*args)
    for i, bad, match in [
        (5, pool.bfloat16(), "float32"),
        (10, idx.long(), "int32"),
        (8, True, "head_first"),
        (3, gate.bfloat16(), "float32"),
        (7, cu.long(), "int32"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            OPS.chunk_gated_delta_rule_cpu(*args[:i], bad, *args[i + 1 :])


def _decode_gates(seed, B, Hv):
    g = _gen(seed)
    A_log = torch.rand(Hv, generator=g).mul(0.3).add(0.02).log()
    return (
        A_log,
        torch.randn(B, Hv, generator=g),
        torch.randn(B, Hv, generator=g),
        torch.randn(Hv, generator=g) - 1,
    )


def test_fused_sigmoid_gating_delta_rule_update_cpu_decode_batch():
    B, H, Hv, D = 4, 2, 4, 32
    q, k, v, _, _ = _gdn_inputs(10, B)
    A_log, a, b, dt_bias = _decode_gates(11, B, Hv)
    pool = torch.randn(6, Hv, D, D, generator=_gen(12)) * 0.1
    before = pool.clone()
    slots = torch.tensor([5, -1, 1, 3], dtype=I32)
    cu = torch.arange(B + 1, dtype=I32)
    o = OPS.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q, k, v, a, b, pool, slots, cu, True
    )
    assert o.shape == (B, 1, Hv, D)
    gate = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    beta = torch.sigmoid(b.double())
    for i, slot in enumerate(slots.tolist()):
        h0 = before[slot] if slot >= 0 else torch.zeros(Hv, D, D)
        want_o, want_h = _ref_delta_rule(
            _l2n(q[0, i : i + 1]),
            _l2n(k[0, i : i + 1]),
            v[0, i : i + 1],
            gate[i : i + 1],
            beta[i : i + 1],
            h0,
            D**-0.5,
        )
        _close(o[i], want_o, what=f"row {i}")
        if slot >= 0:
            _close(pool[slot], want_h, what=f"row {i} state")
        rep = Hv // H
        hf_o, hf_h = hf.torch_recurrent_gated_delta_rule(
            q[:, i : i + 1].repeat_interleave(rep, 2),
            k[:, i : i + 1].repeat_interleave(rep, 2),
            v[:, i : i + 1],
            g=gate[None, i : i + 1].float(),
            beta=beta[None, i : i + 1].float(),
            initial_state=h0.transpose(-1, -2)[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        _close(o[i], hf_o[0], what=f"row {i} vs transformers")
    assert torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])


def test_prefill_then_decode_steps_equal_one_prefill():
    """A prefill of n tokens, then decode steps token by token from the pool, give what one prefill
    of all the tokens gives: the state crosses from the chunk op to the decode op intact.
    """
    n, extra, H, Hv, D = 67, 3, 2, 4, 32
    q, k, v, _, _ = _gdn_inputs(13, n + extra)
    A_log, a, b, dt_bias = _decode_gates(14, n + extra, Hv)
    gate, beta = OPS.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    whole = torch.zeros(2, Hv, D, D)
    o_all, _ = OPS.chunk_gated_delta_rule_cpu(
        q,
        k,
        v,
        gate,
        beta,
        whole,
        True,
        torch.tensor([0, n + extra], dtype=I32),
        False,
        True,
        torch.tensor([1], dtype=I32),
    )
    pool = torch.zeros(2, Hv, D, D)
    o_pre, _ = OPS.chunk_gated_delta_rule_cpu(
        q[:, :n],
        k[:, :n],
        v[:, :n],
        gate[:, :n],
        beta[:, :n],
        pool,
        True,
        torch.tensor([0, n], dtype=I32),
        False,
        True,
        torch.tensor([1], dtype=I32),
    )
    _close(o_pre, o_all[:, :n], what="prefill")
    for t in range(n, n + extra):
        sl = slice(t, t + 1)
        o_t = OPS.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log,
            dt_bias,
            q[:, sl],
            k[:, sl],
            v[:, sl],
            a[sl],
            b[sl],
            pool,
            torch.tensor([1], dtype=I32),
            torch.tensor([0, 1], dtype=I32),
            True,
        )
        _close(o_t[0, 0], o_all[0, t], what=f"decode step {t}")
    _close(pool[1], whole[1], what="final state")


# -- the target verify (speculation on a hybrid model; qwen3_5_cpu_ops.VERIFY_ARGS) ----------------
# A request's drafts as EAGLE's tree lists hold them: token 0 is the root (the last verified token);
# retrieve_next_token[t] is t's first child, retrieve_next_sibling[t] the next child of t's parent.
TREES = {
    "chain": [[0, 0, 1, 2], [0, 0, 1, 2], [0, 0, 1, 2]],
    # topk 2 shapes: a root with two children, one of them with a child; two chains from the root;
    # a path of three under the root's second child.
    "tree": [[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 0, 2]],
}


def _tree_lists(parents):
    n = len(parents)
    nxt, sib = [-1] * n, [-1] * n
    for t in range(1, n):
        siblings = [c for c in range(1, n) if parents[c] == parents[t]]
        if siblings[0] == t:
            nxt[parents[t]] = t
        later = [c for c in siblings if c > t]
        sib[t] = later[0] if later else -1
    return nxt, sib


def _path(parents, t):
    """t and its ancestors up to the root, root first."""
    out = [t]
    while out[-1] != 0:
        out.append(parents[out[-1]])
    return out[::-1]


def test_tree_lists_give_back_the_parents():
    for trees in TREES.values():
        for parents in trees:
            nxt, sib = _tree_lists(parents)
            assert qwen3_5_cpu_ops.tree_parents(nxt, sib, len(parents)) == parents


@pytest.mark.parametrize("shape", list(TREES))
def test_causal_conv1d_update_cpu_verify_keeps_each_drafts_window(shape):
    """The verify's conv (``_causal_conv1d_update_kernel`` with ``SAVE_INTERMEDIATE``; on a tree
    with its tree lists): each draft convolves its own path (chain: the drafts before it; tree:
    its ancestors), past the root the state's newest inputs; the window after each draft lands at
    ``intermediate_conv_window[intermediate_state_indices[b], t]``; a tree's parents are written
    for the GDN op; the slot keeps the last ``width - 1`` drafts; the pad slot is left alone.
    Against float64 sums along each path, and for the chain against the decode op run draft by
    draft (whose state after draft t is the window t)."""
    g = _gen(20)
    dim, W, n = 32, 4, 4
    trees = TREES[shape]
    B = len(trees)
    w, bias = torch.randn(dim, W, generator=g), torch.randn(dim, generator=g)
    # the backend's mixed_qkv.view(batch, drafts, -1).transpose(1, 2): [B, dim, n], strided
    x = torch.randn(B, n, dim, generator=g).transpose(1, 2)
    pool = torch.randn(6, dim, W - 1, generator=g)
    before = pool.clone()
    slots = torch.tensor([4, -1, 1], dtype=I32)  # the second request is padding
    rows = torch.tensor([2, 0, 1], dtype=I32)
    windows = torch.full((4, n, dim, W - 1), 7.0)
    lists = {}
    if shape == "tree":
        nxt, sib = zip(*(_tree_lists(p) for p in trees))
        lists = dict(
            retrieve_next_token=torch.tensor(nxt),
            retrieve_next_sibling=torch.tensor(sib),
            retrieve_parent_token=torch.full((B, n), -7, dtype=torch.long),
        )
    out = mamba.causal_conv1d_update_cpu(
        x, pool, w, bias, "silu", slots,
        intermediate_conv_window=windows, intermediate_state_indices=rows, **lists,
    )  # fmt: skip
    assert out.shape == x.shape
    for b in range(B):
        if slots[b] < 0:
            assert (out[b] == 0).all() and (windows[rows[b]] == 7).all()
            if lists:
                assert (lists["retrieve_parent_token"][b] == -7).all()
            continue
        prev, xs = before[slots[b]].double(), x[b].double()
        for t in range(n):
            inputs = [xs[:, s] for s in _path(trees[b], t)]
            full = torch.stack([prev[:, j] for j in range(W - 1)] + inputs, 1)[:, -W:]
            want = F.silu((full * w.double()).sum(1) + bias.double())
            _close(out[b, :, t], want, what=f"request {b} draft {t}")
            assert torch.equal(windows[rows[b], t], full[:, 1:].float()), f"request {b} window {t}"
        assert torch.equal(pool[slots[b]], torch.cat([before[slots[b]], x[b]], 1)[:, -(W - 1) :])
        if lists:
            assert lists["retrieve_parent_token"][b].tolist() == trees[b]
    assert torch.equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
    if shape == "chain":  # the decode op, draft by draft, from the same state
        state = before.clone()
        for t in range(n):
            step = mamba.causal_conv1d_update_cpu(x[:, :, t], state, w, bias, "silu", slots)
            assert torch.equal(step[[0, 2]], out[[0, 2], :, t])
            assert torch.equal(state[4], windows[2, t]) and torch.equal(state[1], windows[1, t])


# (a tree verify always runs with disable_state_update: gdn_triton.TritonGDNKernel.target_verify)
@pytest.mark.parametrize(
    "shape,update",
    [("chain", False), ("tree", False), ("chain", True)],
    ids=["chain-state-kept", "tree-state-kept", "chain-state-updated"],
)
def test_fused_sigmoid_gating_delta_rule_update_cpu_verify_caches_each_drafts_state(shape, update):
    """The verify's GDN step (the Triton ``fused_sigmoid_gating_delta_rule_update`` with
    ``intermediate_states_buffer``, ``disable_state_update``, ``retrieve_parent_token``): the
    drafts of request i are ``cu_seqlens[i]:cu_seqlens[i + 1]``; each continues from its parent's
    state (chain: the draft before it; the root from the pool's), and the state after each is
    cached at ``intermediate_states_buffer[intermediate_state_indices[i], t]``; the pool is written
    only without ``disable_state_update`` (then with the last draft's state, as a decode would).
    Against the float64 delta rule along each path."""
    n, H, Hv, D = 4, 2, 4, 32
    trees = TREES[shape]
    N = len(trees)
    q, k, v, _, _ = _gdn_inputs(21, N * n)
    A_log, a, b, dt_bias = _decode_gates(22, N * n, Hv)
    pool = torch.randn(6, Hv, D, D, generator=_gen(23)) * 0.1
    before = pool.clone()
    slots = torch.tensor([5, -1, 2], dtype=I32)  # -1: starts from zeros, never written
    rows = torch.tensor([1, 3, 0], dtype=I32)
    buffer = torch.full((4, n, Hv, D, D), 7.0)
    cu = torch.arange(0, N * n + 1, n, dtype=I32)
    parents = torch.tensor(trees) if shape == "tree" else None
    o = OPS.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool,
        initial_state_indices=slots, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0, softplus_threshold=20.0, is_kda=False, disable_state_update=not update,
        intermediate_states_buffer=buffer, intermediate_state_indices=rows, cache_steps=n,
        retrieve_parent_token=parents,
    )  # fmt: skip
    assert o.shape == (N * n, 1, Hv, D) and o.dtype == q.dtype
    gate = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    beta = torch.sigmoid(b.double())
    for i in range(N):
        h0 = before[slots[i]] if slots[i] >= 0 else torch.zeros(Hv, D, D)
        states = {}
        for t in range(n):
            parent = trees[i][t]
            h = h0 if t == 0 else states[parent]
            s = i * n + t
            want_o, states[t] = _ref_delta_rule(
                _l2n(q[0, s : s + 1]), _l2n(k[0, s : s + 1]), v[0, s : s + 1],
                gate[s : s + 1], beta[s : s + 1], h, D**-0.5,
            )  # fmt: skip
            _close(o[s], want_o, what=f"request {i} draft {t}")
            _close(buffer[rows[i], t], states[t], what=f"request {i} state after draft {t}")
        if slots[i] >= 0:
            want_pool = states[n - 1] if update else before[slots[i]]
            _close(pool[slots[i]], want_pool, what=f"request {i} pool")
    assert torch.equal(pool[[0, 1, 3, 4]], before[[0, 1, 3, 4]])
    assert (buffer[2] == 7).all()  # no request's row


def test_the_verify_then_the_accepted_states_continue_as_a_decode_would():
    """Verify a chain of drafts, take the states after an accepted draft ``s`` (what the commit
    after verify copies into the slot: window s, SSM state s), decode the next token from them;
    the same as decoding drafts 0..s and that token one at a time from the start."""
    dim, W, n, H, Hv, D, s = 32, 4, 4, 2, 4, 32, 1
    g = _gen(24)
    w, bias = torch.randn(dim, W, generator=g), torch.randn(dim, generator=g)
    x = torch.randn(n + 1, dim, generator=g)  # the drafts, then the next token
    conv0 = torch.randn(2, dim, W - 1, generator=g)
    q, k, v, _, _ = _gdn_inputs(25, n + 1)
    A_log, a, b, dt_bias = _decode_gates(26, n + 1, Hv)
    ssm0 = torch.randn(2, Hv, D, D, generator=_gen(27)) * 0.1
    one = torch.tensor([1], dtype=I32)

    conv, ssm = conv0.clone(), ssm0.clone()
    windows, states = torch.zeros(1, n, dim, W - 1), torch.zeros(1, n, Hv, D, D)
    mamba.causal_conv1d_update_cpu(
        x[:n].T[None], conv, w, bias, "silu", one,
        intermediate_conv_window=windows, intermediate_state_indices=torch.tensor([0], dtype=I32),
    )  # fmt: skip
    OPS.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q[:, :n], k[:, :n], v[:, :n], a[:n], b[:n], ssm, one,
        torch.tensor([0, n], dtype=I32), True, 1.0, 20.0, False, True, states,
        torch.tensor([0], dtype=I32), n, None,
    )  # fmt: skip
    assert torch.equal(ssm, ssm0)  # disable_state_update
    conv[1], ssm[1] = windows[0, s], states[0, s]  # the commit of draft s
    nxt = slice(n, n + 1)
    conv_out = mamba.causal_conv1d_update_cpu(x[nxt], conv, w, bias, "silu", one)
    o = OPS.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q[:, nxt], k[:, nxt], v[:, nxt], a[nxt], b[nxt], ssm, one,
        torch.tensor([0, 1], dtype=I32), True,
    )  # fmt: skip

    conv_ref, ssm_ref = conv0.clone(), ssm0.clone()
    for t in list(range(s + 1)) + [n]:
        ref_out = mamba.causal_conv1d_update_cpu(x[t : t + 1], conv_ref, w, bias, "silu", one)
        ref_o = OPS.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log, dt_bias, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], a[t : t + 1],
            b[t : t + 1], ssm_ref, one, torch.tensor([0, 1], dtype=I32), True,
        )  # fmt: skip
    assert torch.equal(conv_out, ref_out) and torch.equal(conv[1], conv_ref[1])
    _close(o, ref_o, what="the next token's output")
    _close(ssm[1], ssm_ref[1], what="the state after it")


def test_the_verify_arguments_are_checked():
    x = torch.randn(1, 32, 4)
    pool, w = torch.zeros(2, 32, 3), torch.randn(32, 4)
    idx = torch.tensor([0], dtype=I32)
    with pytest.raises(RuntimeError, match="intermediate_state_indices"):
        mamba.causal_conv1d_update_cpu(x, pool, w, None, "silu", idx, intermediate_conv_window=torch.zeros(1, 4, 32, 3))
    with pytest.raises(RuntimeError, match="retrieve_next_sibling"):
        mamba.causal_conv1d_update_cpu(x, pool, w, None, "silu", idx, retrieve_next_token=torch.zeros(1, 4, dtype=torch.long))
    q, k, v, _, _ = _gdn_inputs(28, 4)
    A_log, a, b, dt_bias = _decode_gates(29, 4, 4)
    args = (A_log, dt_bias, q, k, v, a, b, torch.zeros(2, 4, 32, 32), idx, torch.tensor([0, 4], dtype=I32), True)
    with pytest.raises(RuntimeError, match="is_kda"):
        OPS.fused_sigmoid_gating_delta_rule_update_cpu(*args, is_kda=True)
    with pytest.raises(RuntimeError, match="intermediate_states_buffer must be"):
        OPS.fused_sigmoid_gating_delta_rule_update_cpu(
            *args, intermediate_states_buffer=torch.zeros(1, 3, 4, 32, 32), intermediate_state_indices=idx
        )
