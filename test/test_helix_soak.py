"""Reliability: a soak against plain TP with a KV pool that runs out, and a rank killed mid-decode.

**Soak** (``sglang_helix.testing.soak``; the long form is ``benchmark/soak_helix.py``). The same
reproducible request list goes to a plain ``--tp 4`` server and a ``--tp 4 --helix-kvp-size 2``
server with the same logical KV pool (4096 tokens: 2048 rows per rank x KVP 2 against 4096 rows),
from 16 concurrent clients: OpenAI completions and chat (streamed and not, ``n`` > 1, stop
strings), ``/generate`` (streamed and not), clients that close the stream, ``/abort_request``
aborts, prompts from 1 token to ~3.5K (a third of them on shared prefixes: prefix-cache hits),
``max_tokens`` 1-300, prompts over the context and over the pool. Helix runs with upstream's KV
checks on every rank (``kv_checks.DEBUG_ENV``: double free, use after free, leak after every
batch and when idle). Asserted:

- every request answered within the request timeout (no hang), and every answer the reference's:
  the same HTTP error and message, or the same greedy generation (``soak.compare``);
- a prompt larger than the pool is refused at once with a message naming the sizes (no
  retraction loop); the pool did run low (retraction or < 1/8 free) on every rank;
- prompts on shared prefixes hit the prefix cache (``#cached-token`` > 0), so the default run's
  prefix-reuse check against plain TP is this soak (test_helix_prefix_cache.py runs in full);
- afterwards (prefix cache flushed): no check fired on any rank, the server is healthy, and every
  rank's (total, available, uncached) on the first request equals what it was at startup.

``HELIX_SOAK_REQUESTS`` (default 60 here: every kind at least once) and ``HELIX_SOAK_CLIENTS`` (16) size it.

**Rank killed mid-decode**: SIGKILL on scheduler TP3 while a request streams. The launcher must
exit within ``EXIT_BOUND_S`` (120 s; upstream's crash diagnostics take up to ~65 s) with
upstream's "child failed" line, the client's stream must end
(no hang), no process of the tree may survive, and a restarted server must serve the same
answer as before.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import psutil
import pytest

from conftest import FULL, GQA, start_server, stop_server
from sglang_helix.testing import kv_checks, soak

CONTEXT = 8192  # the tiny models' max_position_embeddings
POOL_TOKENS = 4096
HELIX_ARGS = ["--tp", "4", "--helix-kvp-size", "2", "--max-total-tokens", str(POOL_TOKENS // 2)]
PLAIN_ARGS = ["--tp", "4", "--max-total-tokens", str(POOL_TOKENS)]
REQUESTS = int(os.environ.get("HELIX_SOAK_REQUESTS", "60"))
CLIENTS = int(os.environ.get("HELIX_SOAK_CLIENTS", "16"))
# Upstream's crash path: the peers' next collective fails and they raise, the launcher gets SIGQUIT,
# and when a scheduler is still alive it sleeps 5 s, tries py-spy and waits
# SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS (60 s) for GPU core dumps before killing the tree: ~5 s
# when every peer is already gone, ~65 s otherwise (upstream's defaults; the test harness turns
# the py-spy and coredump steps off, cpu_env.py, and the bound holds either way).
EXIT_BOUND_S = 120


_HELIX: dict = {}  # the Helix soak server, kept for the fault test that kills one of its ranks


def _helix_server(model_dir, server_log_dir):
    srv = _HELIX.get("srv")
    if srv is None or srv.proc is None:
        srv = _HELIX["srv"] = start_server(model_dir(GQA), HELIX_ARGS, "torch_native", server_log_dir, kv_checks.DEBUG_ENV)
    return srv


@pytest.fixture(scope="module", autouse=True)
def _stop_helix_server():
    yield
    srv = _HELIX.pop("srv", None)
    if srv is not None and srv.proc is not None:
        stop_server(srv)


@pytest.mark.e2e
def test_soak_matches_plain_tp_and_leaks_nothing(model_dir, server_log_dir):
    # Plain TP first, then Helix: an idle server's scheduler ranks poll and would slow the other.
    requests = soak.make_requests(REQUESTS, seed=13, context_len=CONTEXT, pool_tokens=POOL_TOKENS)
    plain = start_server(model_dir(GQA), PLAIN_ARGS, "torch_native", server_log_dir)
    try:
        ref = soak.run(plain.base_url, requests, CLIENTS)
    finally:
        stop_server(plain)

    helix_server = _helix_server(model_dir, server_log_dir)
    report = soak.soak_server(helix_server, requests, ref, CLIENTS)
    found = soak.failures(report, num_ranks=4)
    assert not found, f"{len(found)} problems:\n" + "\n".join(found[:20]) + "\n" + helix_server.log_tail(30)
    # Shared prefixes were reused (the prefix cache under Helix, against plain TP's answers).
    assert report["cached_tokens"] > 0, "no prefill found a cached prefix"
    print(json.dumps(soak.report_summary(report)))


def _stream(base_url: str, state: dict, max_tokens: int = 300) -> None:
    body = {"model": "default", "prompt": "the quick brown fox", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    state["chunks"] = state.get("chunks", 0) + 1
                elif line.startswith(b"data: [DONE]"):
                    state["done"] = True
    except Exception as e:  # the server went away: what a client sees
        state["error"] = f"{type(e).__name__}: {e}"
    state["ended"] = time.monotonic()


def _answer(base_url: str) -> list:
    body = {"model": "default", "prompt": "attention head query key value", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    out = kv_checks.post(base_url, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"]))


def _scheduler(srv, tp_rank: int) -> psutil.Process:
    for p in psutil.Process(srv.proc.pid).children(recursive=True):
        if p.name().endswith(f"scheduler_TP{tp_rank}") or f"scheduler_TP{tp_rank}" in " ".join(p.cmdline()):
            return p
    raise AssertionError(f"no scheduler_TP{tp_rank} process")


@pytest.mark.e2e
# Full tier (a server each, ~160 s): the default run's fault coverage is the KV checks of the soak.
@pytest.mark.parametrize("victim", [pytest.param(3, marks=FULL), pytest.param(0, marks=FULL)])
def test_rank_killed_mid_decode_exits_cleanly_and_restarts(model_dir, server_log_dir, victim):
    srv = _helix_server(model_dir, server_log_dir)  # the soak's, when it ran first
    before = _answer(srv.base_url)
    state: dict = {}
    client = threading.Thread(target=_stream, args=(srv.base_url, state), daemon=True)
    client.start()
    deadline = time.monotonic() + 300
    while state.get("chunks", 0) < 5:
        assert time.monotonic() < deadline and "ended" not in state, f"stream did not start: {state}"
        time.sleep(0.05)
    tree = set(srv.tree_pids) | {p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)}
    killed_at = time.monotonic()
    _scheduler(srv, victim).send_signal(signal.SIGKILL)

    try:
        code = srv.proc.wait(timeout=EXIT_BOUND_S)
    except Exception:
        pytest.fail(f"the launcher did not exit within {EXIT_BOUND_S}s of TP{victim}'s death\n" + srv.log_tail())
    exit_s = time.monotonic() - killed_at
    client.join(EXIT_BOUND_S)
    assert "ended" in state, "the client's stream did not end"
    assert state.get("chunks", 0) < 300 and not state.get("done"), f"the stream completed although a rank died: {state}"
    time.sleep(2.0)
    survivors = [p for p in tree if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    log = srv.log_text()
    stop_server(srv)  # reaps; raises if anything survived or a stub function was called
    assert not survivors, f"processes left behind: {survivors}"
    assert "It usually means one child failed" in log or "crashed with exit code" in log, log[-3000:]
    stream_s = state["ended"] - killed_at
    print(f"TP{victim} killed: launcher exited with {code} after {exit_s:.1f}s; the client's stream ended after {stream_s:.1f}s: {state}")

    again = start_server(model_dir(GQA), HELIX_ARGS, "torch_native", server_log_dir, kv_checks.DEBUG_ENV)
    try:
        assert _answer(again.base_url) == before
    finally:
        stop_server(again)
