"""``benchmark/dcp_gqa_check.py``: upstream DCP and Helix on the same tiny GQA layer (Q = 8, K = 2).

The measurement quoted in docs/upstream-pr.md ("Relation to upstream DCP"): upstream's Triton MHA
DCP decode, run with its own pieces, is exact with Qwen3.5's KV layout and with the series' Llama
(its K/V partition from ``dcp_kv_partition``, the first patch) at every layout, K * dcp > tp
included (where 0.5.23's Llama gave all-zero query heads), and the launch check accepts them;
Helix is exact at every layout. If a change altered any of it, this fails and the document must
change with it.
"""

import os
import re
import subprocess
import sys

from sglang_helix.testing.cpu_env import STUB_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dcp_exact_for_gqa_llama_and_helix():
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STUB_DIR, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmark", "dcp_gqa_check.py")],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"(\w+)\s+--tp (\d) --(dcp|helix-kvp)-size (\d).*max \|err\| vs full attention ([0-9.e+-]+)(?:, all-zero output heads (.*), launch (\w+))?", line)
        if m:
            rows[(m[1], int(m[2]), int(m[4]))] = (float(m[5]), m[6], m[7])
    assert len(rows) == 9, proc.stdout
    for (layout, tp, size), (err, zero, launch) in rows.items():
        assert err < 1e-5, (layout, tp, size, err)
        if layout != "helix":
            assert zero == "[]", (layout, tp, size, zero)
            assert launch == "accepted", (layout, tp, size, launch)
