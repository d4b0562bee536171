"""pytest plugin: record the Triton launches of the tracked kernels (``sglang_helix.triton_specs``).

- ``HELIX_TRITON_RECORD=PATH python -m pytest -p sglang_helix.testing.triton_record ...`` writes
  ``{"specs": [...], "sources": [...], "errors": [...]}`` to PATH at the end of the session
  (``python -m sglang_helix.triton_specs record`` does this for the Helix test files).
- Loaded by ``test/conftest.py`` in every run: every in-process launch of a tracked kernel is
  recorded (the binder only, ~tens of microseconds a launch), and at the end of the session a
  specialization missing from the committed fixture (``test/data/helix_triton_specializations.json``)
  fails the run, with the kernel, the specialization and the test that launched it, so the
  fixture the compile test compiles cannot go stale. Only against the installed, fully patched
  tree (a per-prefix run of the series imports an earlier tree: its kernels take other arguments).
  A missing fixture fails the run too (the check cannot run without it);
  ``HELIX_TRITON_CHECK_FIXTURE=0`` turns the check off explicitly.
- ``HELIX_CI=1`` (``.ci/run`` sets it): a run whose ``sglang`` is not this interpreter's installed
  series (another Python, another environment) is refused at once instead of running with the
  check, and ``test_triton_compile.py``'s full-series checks, switched off.
"""

from __future__ import annotations

import json
import os
import sys

from sglang_helix.triton_specs import FIXTURE, Recorder, describe, missing_from_fixture

_RECORDER: Recorder | None = None
_MISSING: list = []


def _installed_tree() -> bool:
    """Whether ``sglang`` resolves to the virtualenv's site-packages (the installed series)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    origin = os.path.realpath(spec.origin) if spec and spec.origin else ""
    return origin.startswith(os.path.realpath(sys.prefix) + os.sep)


def _enabled() -> bool:
    if os.environ.get("HELIX_TRITON_RECORD"):
        return True
    # Not conditional on the fixture existing: without it the check fails the run (below).
    return os.environ.get("HELIX_TRITON_CHECK_FIXTURE", "1") == "1" and _installed_tree()


def pytest_configure(config):
    global _RECORDER
    if os.environ.get("HELIX_CI") == "1" and not _installed_tree():
        import pytest

        raise pytest.UsageError(
            f"HELIX_CI=1: sglang is not the series installed in this interpreter's environment "
            f"({sys.prefix}), so the Triton launch check and the compile check cannot run. Run the "
            "README's test command (.venv/bin/python -m pytest ...) after bash scripts/setup.sh."
        )
    if _RECORDER is None and os.environ.get("TRITON_INTERPRET") == "1" and _enabled():
        _RECORDER = Recorder().install()


def pytest_runtest_setup(item):
    if _RECORDER is not None:
        _RECORDER.context = item.nodeid


def pytest_sessionfinish(session, exitstatus):
    if _RECORDER is None:
        return
    keys = list(_RECORDER.specs)
    path = os.environ.get("HELIX_TRITON_RECORD")
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "specs": [_RECORDER.specs[k] for k in keys],
                    "sources": [_RECORDER.sources[k] for k in keys],
                    "errors": sorted(set(_RECORDER.errors)),
                },
                f,
            )
        return
    if not FIXTURE.exists():
        _MISSING[:] = [f"the fixture {FIXTURE} does not exist: no launch can be checked against it"]
        if session.exitstatus == 0:
            session.exitstatus = 1
        return
    missing = missing_from_fixture(list(_RECORDER.specs.values()))
    sources = {id(s): _RECORDER.sources.get(k) for k, s in _RECORDER.specs.items()}
    _MISSING[:] = [f"{describe(s)}  (launched by {sources.get(id(s))})" for s in missing]
    _MISSING.extend(f"record error: {e}" for e in sorted(set(_RECORDER.errors)))
    if _MISSING and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _MISSING:
        terminalreporter.section("Triton specializations missing from the compile fixture", red=True)
        if not FIXTURE.exists():
            terminalreporter.write_line(
                f"{_MISSING[0]}; regenerate it: .venv/bin/python -m sglang_helix.triton_specs record "
                "(HELIX_TRITON_CHECK_FIXTURE=0 turns the check off)"
            )
            return
        terminalreporter.write_line(
            f"{len(_MISSING)} launch(es) of a Helix Triton kernel at a specialization not in {FIXTURE.name}; "
            "regenerate it: .venv/bin/python -m sglang_helix.triton_specs record (then the compile test "
            "compiles it for sm_90/sm_100)"
        )
        for line in _MISSING:
            terminalreporter.write_line("  " + line)
