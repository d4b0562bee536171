"""Qwen3.5's CPU paths on a CPU without AMX (patch ``[CPU] Qwen3.5 without AMX``), at the unit level.

Also the commit after a speculative verify on the CPU engine (patch ``[CPU] Hybrid models: a
verify's accepted linear-attention states are committed in torch``), against a loop written here.

The Gated DeltaNet layers' gated RMSNorm (``fla/layernorm_gated.RMSNorm``, ``norm(x) * silu(z)``
per head row) runs its torch reference where neither sgl-kernel's AMX op nor a Triton device
exists; before the patch it asked CUDA for an SM count. Checked against float64 math written here.
(The MoE block's shared-expert gate, the patch's other half, is served end to end by
``test_qwen3_5_harness.py``'s MoE server.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from sglang_helix.testing.cpu_env import STUB_DIR, cpu_server_env


@pytest.fixture(autouse=True)
def cpu_engine(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.syspath_prepend(STUB_DIR)


# In a process of its own with the CPU engine's environment: the module picks its path at import,
# and this test process may have imported it before without the CPU engine.
NORM_SCRIPT = r"""
import sys, torch
from sglang.kernels.ops.attention.fla import layernorm_gated
from sglang.srt.utils import cpu_has_amx_support

if cpu_has_amx_support():
    print("amx"); sys.exit(0)
dt = getattr(torch, sys.argv[1])
g = torch.Generator().manual_seed(0)
norm = layernorm_gated.RMSNorm(64, eps=1e-6, group_size=None, norm_before_gate=True, dtype=dt)
with torch.no_grad():
    norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
x, z = (torch.randn(7, 64, generator=g).to(dt) for _ in range(2))
out = norm(x, z)
x64, z64, w64 = x.double(), z.double(), norm.weight.double()
ref = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64 * torch.nn.functional.silu(z64)
assert out.dtype == dt and out.shape == x.shape
print((out.double() - ref).abs().max().item())
"""


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_gated_rmsnorm_runs_in_torch_on_a_cpu_without_amx(dtype, tol):
    """``norm(x) * silu(z)`` against float64 (0.5.23 asked CUDA for an SM count here)."""
    r = subprocess.run(
        [sys.executable, "-c", NORM_SCRIPT, dtype],
        env=cpu_server_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    if r.stdout.strip() == "amx":
        pytest.skip("this CPU has AMX: sgl-kernel's op serves the norm")
    assert float(r.stdout.split()[-1]) <= tol, r.stdout


def test_default_flags_resolve_the_radix_cache_without_an_extra_buffer(tmp_path):
    """``launch_server`` with the default flags on the CPU engine (patch ``[CPU] Hybrid models``):
    the hybrid model's radix cache resolves to ``no_buffer`` with overlap scheduling off, where
    0.5.23 chose ``extra_buffer`` for the overlap schedule and then asserted the platform has one.
    """
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args
    from sglang_helix.testing.qwen3_5_models import DENSE, write_qwen3_5_model

    path = write_qwen3_5_model(str(tmp_path / "dense"), DENSE)
    server_args = prepare_server_args(["--model-path", path, "--device", "cpu"])
    server_args.resolve_once()
    cfg = resolving_view(server_args)
    assert (
        cfg.mamba_radix_cache_strategy == "no_buffer" and cfg.disable_overlap_schedule
    )
    assert not cfg.disable_radix_cache


@pytest.mark.parametrize("src_rows", [False, True], ids=["batch-rows", "stable-rows"])
def test_a_verify_commits_the_accepted_states_on_the_cpu(src_rows):
    """``scatter_mamba_states_after_mtp_verify`` on CPU tensors (0.5.23 raised "only supports
    CUDA/XPU tensors"): for each state (SSM, every conv type; a bfloat16 conv pool, which CUDA
    sends through its multi-type kernel) the accepted step's state of request i lands in its slot,
    and then the track step's in its track slot; a request without a valid step or slot (-1) is
    skipped and every other slot keeps its bytes. Against a loop over the requests."""
    import torch
    from types import SimpleNamespace

    from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
        scatter_mamba_states_after_mtp_verify,
    )

    g = torch.Generator().manual_seed(0)
    L, slots, rows, steps = 3, 8, 6, 4
    temporal = torch.randn(L, slots, 2, 3, 5, generator=g)
    caches = SimpleNamespace(
        temporal=temporal,
        intermediate_ssm=torch.randn(L, rows, steps, 2, 3, 5, generator=g),
        conv=[torch.randn(L, slots, 6, 3, generator=g).bfloat16(), torch.randn(L, slots, 4, 3, generator=g)],
        intermediate_conv_window=[
            torch.randn(L, rows, steps, 6, 3, generator=g).bfloat16(),
            torch.randn(L, rows, steps, 4, 3, generator=g),
        ],
    )  # fmt: skip
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    dst, accepted = i32([3, 0, -1, 6, 5]), i32([2, -1, 1, 0, 3])
    track, track_steps = i32([7, -1, 2, 1, -1]), i32([1, -1, 0, 2, -1])
    src = i32([5, 4, 3, 2, 1]) if src_rows else None
    pairs = [(caches.temporal, caches.intermediate_ssm), *zip(caches.conv, caches.intermediate_conv_window)]
    want = [d.clone() for d, _ in pairs]
    for (d, s), w in zip(pairs, want):
        for idx, st in ((dst, accepted), (track, track_steps)):
            for i in range(len(idx)):
                r = i if src is None else int(src[i])
                if 0 <= st[i] < steps and 0 <= idx[i] < slots and r < rows:
                    w[:, idx[i]] = s[:, r, st[i]]
    scatter_mamba_states_after_mtp_verify(caches, dst, accepted, track, track_steps, src_indices_raw=src)
    for (d, _), w in zip(pairs, want):
        assert torch.equal(d, w)
    assert caches.temporal is temporal
