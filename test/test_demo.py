"""`bash scripts/demo.sh` as a user runs it: Helix on, one chat and one streaming completion, clean stop.

Run at `--tp 2 --helix-kvp-size 2` (the default is `--tp 4`) to keep the CI cost to one small server.
"""

import os
import re
import subprocess

import pytest

from conftest import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.e2e
@FULL  # a server start (~70 s); test_server_harness.py starts one in the default run
def test_demo_serves_with_helix_and_stops_cleanly(tmp_path):
    cmd = ["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--tp", "2", "--helix-kvp-size", "2"]
    cmd += ["--model-dir", str(tmp_path / "model")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    out = r.stdout
    assert r.returncode == 0, f"demo.sh exited {r.returncode}\n{out}\n{r.stderr[-4000:]}"
    assert "--tp 2 --helix-kvp-size 2" in out, out
    chat = re.search(r"chat completion:\n  (.+)\n  \((\d+) prompt tokens, (\d+) completion tokens\)", out)
    assert chat and chat[1] not in ("''", "None") and int(chat[3]) > 0, out
    stream = re.search(r"streaming completion:\n  (.*)\n  \((\d+) chunks\)", out)
    assert stream and int(stream[2]) > 0, out
    assert out.rstrip().endswith("server stopped; no process left"), out


@pytest.mark.e2e
def test_demo_with_flags_the_server_refuses_says_why_without_a_traceback(tmp_path):
    cmd = ["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--tp", "2", "--helix-kvp-size", "3"]
    cmd += ["--model-dir", str(tmp_path / "model")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, f"demo.sh exited {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    assert "demo: the server did not start." in r.stderr, r.stderr[-4000:]
    assert "--helix-kvp-size 3 does not divide --tp 2" in r.stderr, r.stderr[-4000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-4000:]
