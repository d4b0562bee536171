"""The patch-series machinery: install/check/revert against the wheel's RECORD, version pinning,
and the maintainer round trip (workspace -> export, upstream branch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import FULL

from sglang_helix import PINNED_SGLANG_VERSION
from sglang_helix.series import (
    Installed,
    Series,
    SeriesError,
    check,
    export,
    install,
    make_pristine,
    make_workspace,
    pinned_wheel,
    revert,
    state,
    upstream_branch,
    NEW_MODULE_PATCHES,
    _patch_subject,
)

REPO = Path(__file__).resolve().parents[1]


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def wheel():
    return pinned_wheel()


@pytest.fixture
def repo_copy(tmp_path):
    """A copy of this repository's series (patches/ + python/sglang) with one extra new module."""
    dst = tmp_path / "repo"
    shutil.copytree(REPO / "patches", dst / "patches")
    if (REPO / "python" / "sglang").exists():
        shutil.copytree(REPO / "python" / "sglang", dst / "python" / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    extra = dst / "python" / "sglang" / "srt" / "helix_series_test_module.py"
    extra.parent.mkdir(parents=True, exist_ok=True)
    extra.write_text("X = 1\n")
    return Series(repo=dst)


@pytest.fixture
def fake_site(tmp_path, wheel, repo_copy):
    """A site-packages holding only the pristine files the series touches, with the real RECORD."""
    real = Installed.find()
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        for rel in repo_copy.touched_files():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(z.read(rel))
    return Installed(site=site, version=PINNED_SGLANG_VERSION, record=real.record)


def test_series_is_nonempty_and_only_edits_upstream_files():
    s = Series()
    assert s.patches, "patches/ is empty"
    touched = s.touched_files()
    rec = Installed.find().record
    assert all(rel in rec for rel in touched), touched


def test_setup_check_reports_applied():
    r = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "series applied" in r.stdout
    for p in Series().patches:
        assert f"applied  {p.name}" in r.stdout


def test_install_check_revert_cycle(fake_site, repo_copy, wheel):
    assert state(repo_copy, fake_site)[0] == "pristine"
    msg = install(repo_copy, fake_site)
    assert f"applied {len(repo_copy.patches)} patches and {len(repo_copy.new_files)} new modules" in msg
    ok, text = check(repo_copy, fake_site)
    assert ok and "series applied" in text
    assert "already applied" in install(repo_copy, fake_site)  # re-running is a no-op
    assert (fake_site.site / "sglang/srt/helix_series_test_module.py").exists()

    assert "reverted" in revert(repo_copy, fake_site)
    ok, text = check(repo_copy, fake_site)
    assert ok and "pristine" in text
    with zipfile.ZipFile(wheel) as z:
        for rel in repo_copy.touched_files():
            assert (fake_site.site / rel).read_bytes() == z.read(rel), rel
    assert not (fake_site.site / "sglang/srt/helix_series_test_module.py").exists()
    assert "already pristine" in revert(repo_copy, fake_site)


def test_hand_edit_is_detected_and_not_overwritten(fake_site, repo_copy):
    install(repo_copy, fake_site)
    target = fake_site.site / repo_copy.touched_files()[0]
    target.write_text(target.read_text() + "\n# local edit\n")
    ok, text = check(repo_copy, fake_site)
    assert not ok and "modified" in text
    # A changed series (here: one more new module) re-installs from the recorded backups.
    (repo_copy.repo / "python/sglang/srt/helix_series_test_module2.py").write_text("Y = 2\n")
    install(repo_copy, fake_site)
    assert check(repo_copy, fake_site)[0]
    # Without a record of an install, a modified upstream file is refused, not guessed at.
    revert(repo_copy, fake_site)
    target.write_text(target.read_text() + "\n# local edit\n")
    with pytest.raises(SeriesError, match="differ from the wheel"):
        install(repo_copy, fake_site)


def test_other_sglang_version_is_refused(fake_site, repo_copy):
    other = Installed(site=fake_site.site, version="0.5.22", record=fake_site.record)
    with pytest.raises(SeriesError) as e:
        install(repo_copy, other)
    assert "0.5.22" in str(e.value) and PINNED_SGLANG_VERSION in str(e.value)


def test_setup_sh_refuses_other_sglang_version(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    info = site / "sglang-0.5.22.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.22\n")
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh")], env=dict(os.environ, HELIX_VENV=str(venv)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1
    assert "sglang 0.5.22" in r.stderr and f"sglang=={PINNED_SGLANG_VERSION}" in r.stderr
    assert "Traceback" not in r.stderr


def test_workspace_export_round_trip_is_lossless(tmp_path, repo_copy, wheel):
    before = {p.name: p.read_bytes() for p in repo_copy.patches}
    ws = make_workspace(repo_copy, tmp_path / "ws", wheel)
    assert int(_git("rev-list", "--count", "HEAD", cwd=ws)) == 1 + len(before)
    export(repo_copy, ws)
    after = {p.name: p.read_bytes() for p in repo_copy.patches}
    assert after == before

    # A developer edit becomes one more numbered patch with its own message...
    f = ws / "python" / "sglang" / "version.py"
    f.write_text(f.read_text() + "\n# helix round-trip test\n")
    _git("commit", "-qam", "[Test] Add a comment\n\nBody of the test commit.", cwd=ws)
    export(repo_copy, ws)
    names = [p.name for p in repo_copy.patches]
    assert len(names) == len(before) + 1 and names[-1].startswith(f"{len(names):04d}-Test-Add-a-comment")
    assert "Body of the test commit." in repo_copy.patches[-1].read_text()
    # ...and a fresh workspace from the exported series has exactly the edited tree.
    ws2 = make_workspace(repo_copy, tmp_path / "ws2", wheel)
    assert _git("rev-parse", "HEAD^{tree}", cwd=ws2) == _git("rev-parse", "HEAD^{tree}", cwd=ws)


def test_upstream_branch(tmp_path, repo_copy, wheel):
    # Every new module of a real series enters with a patch that uses it; the fixture's extra one
    # has none (test_every_new_module_has_an_introducing_patch checks that it would be refused).
    (repo_copy.repo / "python/sglang/srt/helix_series_test_module.py").unlink()
    checkout = make_pristine(tmp_path / "sglang", wheel)
    upstream_branch(repo_copy, checkout, "helix")
    assert _git("rev-parse", "--abbrev-ref", "HEAD", cwd=checkout) == "helix"
    subjects = _git("log", "--format=%s", "v0.5.23-pristine..HEAD", cwd=checkout).splitlines()[::-1]
    assert subjects == [_patch_subject(p) for p in repo_copy.patches]  # one commit per patch
    for rel in repo_copy.new_files:
        assert (checkout / "python" / rel).read_bytes() == (repo_copy.repo / "python" / rel).read_bytes()
        # ... added by the commit of the patch that first uses it (no inert commit of new code)
        added_by = _git("log", "--diff-filter=A", "--format=%s", "--", f"python/{rel}", cwd=checkout)
        assert added_by == NEW_MODULE_PATCHES[rel], (rel, added_by)
    # The branch's upstream files equal pristine + series.
    ws = make_workspace(repo_copy, tmp_path / "ws", wheel)
    for rel in repo_copy.touched_files():
        assert (checkout / "python" / rel).read_bytes() == (ws / "python" / rel).read_bytes()


def test_every_new_module_has_an_introducing_patch(tmp_path, repo_copy, wheel):
    checkout = make_pristine(tmp_path / "sglang", wheel)
    with pytest.raises(SeriesError, match="helix_series_test_module.py"):
        upstream_branch(repo_copy, checkout, "helix")


# --------------------------------------------------------------------------------------------
# Bisectable: every prefix of the series
# --------------------------------------------------------------------------------------------
def test_prefix_tests_name_real_patches():
    """Every PREFIX_TESTS entry belongs to a patch of the series (a renamed patch must not lose
    its tests silently), and every patch but the CPU-engine one has tests of its own."""
    from sglang_helix.series import PREFIX_TESTS, _patch_subject

    subjects = [_patch_subject(p) for p in Series().patches]
    assert set(PREFIX_TESTS) <= set(subjects), set(PREFIX_TESTS) - set(subjects)
    assert [s for s in subjects if s not in PREFIX_TESTS] == [
        "[CPU] Pad unaligned heads for the attention width"
    ]


# The default run checks that every prefix applies, imports and gates the flag (~2 min on 2 cores:
# two probes at a time, each forked from a process that imported torch & co. once; ~6 min before);
# with each patch's own tests at its prefix (PREFIX_TESTS) it takes ~17 min, ~26 min with their full
# items (servers at prefixes 15, 17 and 27), so that runs in the full tier (HELIX_TEST_FULL=1) and
# with `python -m sglang_helix.series prefixes`. Their default items all run on the whole series in
# the default run.
@pytest.mark.parametrize("run_tests", [False, pytest.param(True, marks=FULL)], ids=["imports", "with-tests"])
def test_every_prefix(tmp_path, run_tests):
    """``series prefixes``: each prefix applies with git am, imports, runs its patch's tests, and
    the flag is refused before the Llama patch and accepted from it on (it raises otherwise)."""
    from sglang_helix.series import check_prefixes, opts_llama_in

    lines = check_prefixes(Series(), tmp_path, run_tests=run_tests)
    flags = [line.split("flag ")[1].split(";")[0] for line in lines]
    first = next(i for i, p in enumerate(Series().patches) if opts_llama_in(p))
    # (the [DCP] K/V fix touches llama.py long before: the opt-in is what counts)
    assert first > next(i for i, p in enumerate(Series().patches) if "sglang/srt/models/llama.py" in Series.touched_files_of(p))
    assert flags == ["refused"] * first + ["accepted"] * (len(lines) - first)
    flags_patch = next(i for i, line in enumerate(lines) if "Server args" in line)
    assert 0 < flags_patch < first  # the flag exists, refused, before any model opts in
