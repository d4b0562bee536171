"""`bash scripts/demo.sh` as a user runs it.

Default: the trained model (SmolLM2-135M-Instruct) asked for a passkey by a Helix server and a
plain-TP server; the demo prints both answers and their time per output token, and exits 0 only
when Helix found the key with plain TP's tokens. `--random-model`: the tiny random Llama under
Helix, one chat and one streaming completion.
"""

import os
import re
import subprocess

import pytest

from conftest import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "scripts", "demo.sh")


@pytest.mark.e2e
@FULL  # two servers of the trained model (~3-4 min); test_helix_retrieval.py serves both in the default run
def test_demo_finds_the_passkey_with_helix_and_plain_tp_alike():
    r = subprocess.run(["bash", DEMO, "--prompt-tokens", "1024"], capture_output=True, text=True, timeout=1800,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    out = r.stdout
    assert r.returncode == 0, f"demo.sh exited {r.returncode}\n{out}\n{r.stderr[-4000:]}"
    key = re.search(r"the passkey (\d{5})", out)[1]
    answers = re.search(r"^answer\s+(.+)$", out, re.M)[1]
    assert answers.count(key) == 2, out  # both columns
    assert "same tokens: yes" in out, out
    assert len(re.findall(r"\d+ ms per output token", out)) == 2, out


@pytest.mark.e2e
@FULL  # a server start (~70 s); test_server_harness.py starts one in the default run
def test_random_model_demo_serves_with_helix_and_stops_cleanly(tmp_path):
    cmd = ["bash", DEMO, "--random-model", "--tp", "2", "--helix-kvp-size", "2", "--model-dir", str(tmp_path / "model")]
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
def test_demo_with_flags_the_server_refuses_says_why_without_a_traceback():
    r = subprocess.run(["bash", DEMO, "--tp", "2", "--helix-kvp-size", "3"], capture_output=True, text=True,
                       timeout=600, stdin=subprocess.DEVNULL)  # fmt: skip
    assert r.returncode == 1, f"demo.sh exited {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    assert "demo: the server did not start." in r.stderr, r.stderr[-4000:]
    assert "--helix-kvp-size 3 does not divide --tp 2" in r.stderr, r.stderr[-4000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-4000:]
