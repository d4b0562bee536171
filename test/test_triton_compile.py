"""Every Triton kernel specialization Helix launches, compiled for the GPU without one (issue 35).

The fixture ``test/data/helix_triton_specializations.json`` holds what the in-process Helix tests
(decode eager and capture, extend with chunked prefill and prefix, speculative verify and draft,
bf16 / fp32 / fp8 KV) and the unit-level model shapes (``sglang_helix.triton_shapes``: Llama-3.1-70B
and Qwen3-235B per-rank heads at TPA 2/4, head dims 64/128, bf16 and fp8 KV, KVP 2/4, the GPU's
split policy at every split extent, the extend's tiles as sm_90 and sm_100 choose them) launch, as
Triton's binder specializes them: argument dtypes,
pointer/integer divisibility by 16, ``== 1``, constexprs, launch options. Regenerate it with
``.venv/bin/python -m sglang_helix.triton_specs record``; every default run checks that no in-process
launch is missing from it (``sglang_helix/testing/triton_record.py``, loaded by ``conftest.py``) and
the cheap test below does so explicitly for one shape.

Here each specialization is compiled (``triton.compile`` of the kernel's AST, ``ptxas``) for
``GPUTarget("cuda", 90, 32)`` (H100) and ``("cuda", 100, 32)`` (B200), in worker processes without
``TRITON_INTERPRET``. A compile error fails with the kernel, the specialization and the patch that
owns it, as does any spill in decode stage 1/2, static shared memory over the target's limit, or a
compile without its ``ptxas -v`` registers and spill figures; on the full series no specialization
may be skipped.
Upstream's own failure at the CPU harness's tiny shapes (an fp8 ``tl.dot`` at head dim 16, which no
GPU model has) is expected (``known_upstream_failure``). Results are cached by kernel source hash
+ specialization + target + Triton version under ``~/.cache/sglang-helix/triton-compile``: a
clean machine compiles everything once (~1-2 min on 2 cores), a rerun reads the cache.

On an earlier prefix of the series (``python -m sglang_helix.series prefixes``, with each patch's
tests) only the kernels a patch changes are compiled, each specialization adapted to that tree's
kernel signature (one that needs a later patch's argument is skipped).
"""

from __future__ import annotations

import os
import time

import pytest

from sglang_helix import triton_specs as ts
from sglang_helix.testing.triton_record import _installed_tree

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

FULL_SERIES = _installed_tree()


@pytest.fixture(scope="module")
def compiled():
    specs = ts.load_fixture()
    t0 = time.time()
    results = ts.compile_all(specs, procs=os.cpu_count(), upstream=FULL_SERIES, owned_only=not FULL_SERIES)
    n_cached = sum(1 for *_, r in results if r.get("cached"))
    print(f"\n{len(results)} compiles ({n_cached} cached) in {time.time() - t0:.1f} s")
    return results


def test_helix_kernels_compile_for_sm90_and_sm100(compiled):
    bad = ts.problems(compiled)
    assert not bad, f"{len(bad)} problem(s):\n\n" + "\n\n".join(bad)
    done = [r for *_, r in compiled if not r.get("skipped")]
    assert done, "nothing compiled"
    if FULL_SERIES:  # every specialization is the full series' own launch: none may be skipped
        skipped = [f"{ts.describe(spec)} for {t}: {r['skipped']}" for spec, t, _, r in compiled if r.get("skipped")]
        assert not skipped, f"{len(skipped)} compile(s) skipped on the full series:\n" + "\n".join(skipped)


def test_a_compile_without_resource_figures_is_a_problem():
    """A compile whose ``ptxas -v`` log is absent (no registers / spill lines) cannot be checked
    for spills: it is reported, not passed with ``None`` figures."""
    spec = ts.load_fixture()[0]
    figures = {"ok": True, "shared": 0, "regs": 40, "spill_stores": 0, "spill_loads": 0}
    assert ts.problems([(spec, "sm90", None, figures)]) == []
    for absent in ("regs", "spill_stores", "spill_loads"):
        bad = ts.problems([(spec, "sm90", None, {**figures, absent: None})])
        assert len(bad) == 1 and bad[0].startswith("no resource figures") and absent in bad[0], bad


@pytest.mark.parametrize("clean_on_try", [2, 3, None])
def test_a_decode_spill_must_come_back_in_fresh_processes(monkeypatch, clean_on_try):
    """A decode-stage spill is compiled again, each time in a fresh worker process, up to three
    compiles: one that a retry compiles clean is recorded beside the clean result and is not a
    problem (ptxas reported such 4-12 B spills of upstream's stage 1 at sm_100 in three full runs);
    one that every try reports is."""
    spec = next(s for s in ts.load_fixture() if s["kernel"].endswith(":_fwd_grouped_kernel_stage1"))
    other = next(s for s in ts.load_fixture() if s["kernel"].endswith(":_fwd_kernel"))
    tries = []

    def result(spill):
        return {"ok": True, "shared": 0, "regs": 168, "spill_stores": spill, "spill_loads": spill, "cached": False}

    def run_workers(items, procs):
        tries.append(items)
        return [result(0 if len(tries) + 1 == clean_on_try else 4) for _ in items]

    monkeypatch.setattr(ts, "_run_workers", run_workers)
    first = [result(4), result(0), result(200)]  # a decode spill, a clean one, an extend kernel's spill
    items = [[spec, "sm100", None, True], [spec, "sm90", None, True], [other, "sm90", "upstream", True]]
    results = ts._retry_decode_spills(items, first)
    assert all(t == [items[0]] for t in tries)  # only the decode spill, one item a fresh process
    assert results[1:] == first[1:]
    bad = ts.problems([(spec, "sm100", None, results[0])])
    if clean_on_try is None:
        assert len(tries) == 2 and len(bad) == 1 and bad[0].startswith("spill (4 B stores"), bad
    else:
        assert len(tries) == clean_on_try - 1 and bad == [], bad
        assert results[0]["unreproduced_spill"] == [[4, 4]] * (clean_on_try - 1) and results[0]["spill_stores"] == 0


def test_a_cached_decode_spill_is_compiled_again(tmp_path, monkeypatch):
    """The compile cache never answers with a decode spill (an entry left by an older run): the
    specialization is compiled again."""
    import json

    spec = next(s for s in ts.load_fixture() if s["kernel"].endswith(":_fwd_grouped_kernel_stage1"))
    entry = tmp_path / "entry.json"
    monkeypatch.setattr(ts, "cache_entry", lambda *a: entry)
    monkeypatch.setattr(ts, "_compile_inputs", lambda *a: (_ for _ in ()).throw(ts.NotApplicable("compiled")))
    entry.write_text(json.dumps({"ok": True, "shared": 0, "regs": 175, "spill_stores": 0, "spill_loads": 0}))
    assert ts.compile_one(spec, "sm100")["cached"] is True
    entry.write_text(json.dumps({"ok": True, "shared": 0, "regs": 168, "spill_stores": 4, "spill_loads": 4}))
    assert ts.compile_one(spec, "sm100") == {"ok": True, "skipped": "compiled", "cached": False}


@pytest.mark.skipif(not FULL_SERIES, reason="the check runs against the installed, fully patched tree only")
def test_a_missing_fixture_fails_the_run(tmp_path):
    """The end-of-session coverage check (``triton_record``) fails a run without its fixture
    instead of switching itself off."""
    import subprocess
    import sys

    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "HELIX_TRITON_FIXTURE": str(tmp_path / "missing.json")}
    env.pop("HELIX_TRITON_RECORD", None)
    env.pop("HELIX_TRITON_CHECK_FIXTURE", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "sglang_helix.testing.triton_record", "-p", "no:cacheprovider",
           "--rootdir", str(tmp_path), str(tmp_path / "test_nothing.py")]  # fmt: skip
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "missing.json does not exist" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    env["HELIX_TRITON_CHECK_FIXTURE"] = "0"  # the explicit opt-out
    assert subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=300).returncode == 0


def test_fixture_covers_the_model_shapes():
    """The fixture holds the launches a GPU server makes at real shapes (not only the harness's)."""
    specs = ts.load_fixture()

    def cx(s):
        return {n: v for n, t, v in s["args"] if t == "constexpr"}

    def ty(s):
        return {n: t for n, t, _ in s["args"]}

    stage2 = [cx(s) for s in specs if s["kernel"].endswith(":_fwd_kernel_stage2")]
    # the split extent follows the batch up to 256; head groups = Q/TPA / KVP at KVP 2 and 4
    assert {256, 128, 8} <= {c["MAX_KV_SPLITS"] for c in stage2 if c["Lv"] == 128}
    assert {16, 8, 4} <= {c["O_HEAD_GROUP"] for c in stage2 if c["Lv"] == 128}
    stage1 = [s for s in specs if s["kernel"].endswith(":_fwd_grouped_kernel_stage1")]
    kv_at = {(cx(s)["Lk"], ty(s)["K_Buffer"]) for s in stage1}
    assert {(128, "*bf16"), (128, "*fp8e4nv"), (64, "*bf16"), (64, "*fp8e4nv")} <= kv_at
    extend = [cx(s) for s in specs if s["kernel"].endswith("extend_attention:_fwd_kernel")]
    assert {(True, False), (False, True)} <= {(c["SKIP_EXTEND"], c["SKIP_PREFIX"]) for c in extend if c["Lq"] == 128}
    # (Helix's speculative verify runs the same three causal extend calls: no custom mask)
    # the extend's tiles as an H100 configures them (BLOCK_M 128 at head dim <= 128), as a B200 (64)
    assert {128, 64} <= {c["BLOCK_M"] for c in extend if c["Lq"] == 128}
    lists = [cx(s) for s in specs if s["kernel"].endswith(":create_triton_kv_indices_for_dcp_triton")]
    assert {2, 4} <= {c["dcp_size"] for c in lists if c["interleave_size"] == 64}


@pytest.mark.skipif(not FULL_SERIES, reason="the fixture is the full series' launches")
def test_fixture_is_current_for_a_decode_and_extend():
    """A Helix extend and decode at a tiny shape, recorded in-process: every specialization is in
    the fixture (the conftest hook checks every other in-process launch of the run the same way)."""
    from sglang_helix import triton_shapes

    triton_shapes._setup()
    rec = ts.Recorder().install()
    try:
        triton_shapes.run_shape("tiny-q8k4/tpa2", 4, 2, 16, "bf16", 2, rec, batches=[1, 3])
    finally:
        rec.uninstall()
    assert rec.specs and not rec.errors, rec.errors
    missing = ts.missing_from_fixture(list(rec.specs.values()))
    assert not missing, "regenerate the fixture (python -m sglang_helix.triton_specs record):\n" + "\n".join(
        ts.describe(s) for s in missing
    )
