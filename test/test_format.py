"""The new modules under ``python/sglang`` pass the pinned release's own formatters as upstream's
pre-commit runs them (isort 5.13.2 with ``profile=black`` and sglang first-party, black 24.10.0 at
its default settings), with no ``# fmt: skip`` / ``# fmt: off`` opt-outs: a maintainer's CI would
otherwise reformat or reject them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ROOT / "python" / "sglang"


def _python_files():
    files = sorted(str(p) for p in MODULES.rglob("*.py"))
    assert files, MODULES
    return files


def test_no_formatter_opt_outs():
    marked = [f"{f}:{i}" for f in _python_files() for i, line in enumerate(open(f), 1)
              if "fmt: skip" in line or "fmt: off" in line]  # fmt: skip
    assert marked == []


def test_black_and_isort_leave_the_new_modules_unchanged():
    files = _python_files()
    isort = subprocess.run(
        [sys.executable, "-m", "isort", "--settings-path", str(ROOT / "python" / ".isort.cfg"), "--check-only",
         "--diff", *files],
        capture_output=True, text=True,
    )  # fmt: skip
    assert isort.returncode == 0, isort.stdout + isort.stderr
    black = subprocess.run([sys.executable, "-m", "black", "--check", "--diff", *files], capture_output=True, text=True)
    assert black.returncode == 0, black.stdout[-4000:] + black.stderr[-2000:]
