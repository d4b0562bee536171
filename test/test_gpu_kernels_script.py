"""benchmark/gpu_kernels.py, the one-GPU kernel check, on the CPU: the emulated KVP group step
(decode with merged LSE per shard, pack, exchange as a copy, merge) against float64 under the
Triton interpreter at tiny shapes, with the per-request split policy on and off, and a clean exit where there is no GPU."""

import json
import os
import subprocess
import sys

from conftest import FULL
from sglang_helix.testing.cpu_env import STUB_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmark", "gpu_kernels.py")


def _run(args, interpret: bool):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([STUB_DIR, env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600)


# Full tier (~100 s of interpreted Triton in the 2026-11-27 CI run, moved for CI time): the script's
# own glue at tiny shapes. What it runs is the default run's elsewhere: stage 2 with the merged LSE
# and the head-split output into the All-to-All send buffer, bit for bit
# (test_decode_lse_kernel.py: test_head_split_output_is_the_packed_send_buffer,
# test_shard_partials_merge_to_full_attention), the merge (test_helix_merge.py) and the per-request
# split policy (test_helix_decode_graph.py: test_split_policy_per_request_from_local_length). The
# default run keeps the no-GPU exit and the fixture shapes below.
@FULL
def test_cpu_smoke_is_exact(tmp_path):
    out = tmp_path / "rows.json"
    r = _run(["--cpu-smoke", "--json", str(out)], interpret=True)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["kvp"], row["split_policy"]) for row in rows] == [(2, "on"), (2, "off"), (4, "on"), (4, "off")]
    assert all(row["max_abs_err_vs_fp64"] < 1e-5 for row in rows), rows
    assert all(row["plain_tp_max_abs_err_vs_fp64"] < 1e-5 for row in rows), rows  # the plain-TP path runs in the smoke too
    assert all(row["fused_equals_unfused"] for row in rows), rows  # stage 2 into the send buffer == pack
    # 100 and 50 local tokens: one split with the policy (< DCP_GQA_MIN_TOKENS_PER_SPLIT), --splits 2 without
    assert [row["helix_splits"] for row in rows] == [1, 2, 1, 2], rows


def test_without_a_gpu_it_says_so_and_exits_0():
    r = _run([], interpret=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no GPU here" in r.stdout


def test_fixture_shapes_are_the_recorded_model_shapes():
    """``--shapes-from-fixture`` runs the (heads, KV heads, head dim) the server launches at the
    model shapes: those of ``sglang_helix.triton_shapes`` at a GPU head dim, read from the fixture."""
    import importlib.util

    from sglang_helix.triton_shapes import SHAPES

    spec = importlib.util.spec_from_file_location("_gpu_kernels_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    want = {(h, kh, d) for _, h, kh, d in SHAPES}
    got = set(mod.fixture_shapes())
    assert {s for s in want if s[2] >= 64} <= got <= want, (got, want)
