"""Helix decode behind sglang-router: a plain ``--tp P`` prefill server hands its KV over Mooncake
(TCP) to a ``--tp 4 --helix-kvp-size KVP`` decode server, and the pair serves a colocated plain
``--tp 4`` server's greedy tokens (logprobs within the e2e tolerance) for batched, streamed and chat
requests, a ~300-token prompt sent twice (the second a prefix-cache hit on the prefill), prompts
of 3, 8, 16 and 21 tokens (shorter than a chunk, ending on a page, past one), and 8 concurrent
clients. Every decode rank runs the allocator's checks (``kv_checks.DEBUG_ENV``: no page free
twice): none fires, the server is up, and rank 0 ends with no token in use. A page kept on a
decode rank other than 0 is not seen here: upstream's idle conservation check (available +
evictable == total) excuses DCP, and the decode's event loop runs no busy check, so there are no
per-rank counts to compare (the colocated tests compare them: ``test_helix_kv_leak.py``, the soak).

The default run: prefill ``--tp 2`` into KVP 2 (each decode rank takes the prefill rank's whole
tokens, its own chunks); ``HELIX_TEST_FULL=1`` adds P in {1, 2, 4} x KVP in {2, 4} (a head
sub-slice of one prefill rank, or parts from several).

The Mooncake transfer engine (``mooncake.engine``) and ``sglang_router`` are test dependencies
(``bash scripts/setup.sh`` installs both): when either fails to import, every test here that runs
fails at setup with the import error, so a broken install cannot turn the default run's only PD
server test into a green skip. ``HELIX_SKIP_PD_E2E=1`` is the explicit opt-out: with it (and only
then) a missing dependency skips the module instead.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import FULL, GQA, KV2, plain_tp_reference, run_workload, stop_server
from helix_runs import pinned_memory_env
from sglang_helix.testing import kv_checks
from sglang_helix.testing.openai_probe import (
    LOGPROB_ATOL,
    assert_same_generation,
    assert_same_probe,
    concurrent_waves,
    long_completion,
    probe,
    sized_completions,
)
from sglang_helix.testing.pd import MOONCAKE_ENV, PDCluster
from sglang_helix.testing.server import CpuServer, free_port

SKIP_ENV = "HELIX_SKIP_PD_E2E"  # =1: skip this module when Mooncake or the router does not import


def _dependency_error() -> str | None:
    """Why Mooncake's engine or the router does not import, or None."""
    try:
        import mooncake.engine  # noqa: F401
        import sglang_router  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


DEPENDENCY_ERROR = _dependency_error()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        DEPENDENCY_ERROR is not None and os.environ.get(SKIP_ENV) == "1",
        reason=f"{SKIP_ENV}=1 and Mooncake / sglang-router do not import: {DEPENDENCY_ERROR}",
    ),
]


@pytest.fixture(autouse=True)
def _pd_dependencies_import():
    if DEPENDENCY_ERROR is not None:
        pytest.fail(
            f"Mooncake / sglang-router do not import ({DEPENDENCY_ERROR}): bash scripts/setup.sh installs "
            f"them; {SKIP_ENV}=1 skips this module instead",
            pytrace=False,
        )
CHUNK = 4  # --helix-kvp-chunk-size, and so the page size of both servers
CACHED_RE = re.compile(r"#cached-token: (\d+)")
CASES = [  # (prefill tp, decode kvp, default run, model): K = 4 KV heads
    (2, 2, True, GQA), (1, 2, False, GQA), (4, 2, False, GQA), (1, 4, False, GQA), (2, 4, False, GQA),
    (4, 4, False, GQA),
]
# Not here: a prefill --tp P > K. On a GPU its ranks replicate heads, which the relayout reads
# (test_helix_pd.py); the CPU engine pads the KV heads instead (adjust_config_with_unaligned_cpu_tp),
# a layout no decode shares, and the decode refuses the pair (docs/disaggregation.md).


@pytest.mark.parametrize(
    "prefill_tp,kvp,spec",
    [pytest.param(p, k, m, id=f"p{p}-kvp{k}" + ("-k2" if m is KV2 else ""), marks=() if d else FULL)
     for p, k, d, m in CASES],
)  # fmt: skip
def test_helix_decode_behind_router_serves_plain_tp_tokens(prefill_tp, kvp, spec, model_dir, server_log_dir):
    path = model_dir(spec)
    ref = run_workload(path, ["--tp", "4"], "torch_native", server_log_dir, plain_tp_reference)
    decode_args = ["--tp", "4", "--helix-kvp-size", str(kvp), "--helix-kvp-chunk-size", str(CHUNK)]
    with PDCluster(
        path, ["--tp", str(prefill_tp)], decode_args, server_log_dir, page_size=CHUNK, decode_env=kv_checks.DEBUG_ENV
    ) as pd:
        got = probe(pd.url)
        long_first, long_again = long_completion(pd.url), long_completion(pd.url)
        waves = concurrent_waves(pd.url, sizes=(8,))
        sized = sized_completions(pd.url)
        idle = kv_checks.wait_idle(pd.decode.base_url)
        time.sleep(2)  # every rank idles and checks its pool (a failed check takes the server down)
        alive = pd.decode.proc.poll() is None
        decode_log, prefill_log = pd.decode.log_text(), pd.prefill.log_text()
    what = f"PD --tp {prefill_tp} -> --tp 4 --helix-kvp-size {kvp}"
    assert_same_probe(ref["probe"], got, LOGPROB_ATOL, what)
    assert_same_generation(ref["long"], long_first, LOGPROB_ATOL, f"{what} long prompt")
    assert_same_generation(ref["long"], long_again, LOGPROB_ATOL, f"{what} long prompt, prefix hit")
    for n, r, g in zip((3, 8, 16, 21), ref["sized"], sized):  # chunk and page edges
        assert_same_generation(r, g, LOGPROB_ATOL, f"{what} a {n}-token prompt")
    for i, gen in waves[8]:
        assert_same_generation(ref["singles"][i], gen, LOGPROB_ATOL, f"{what} concurrent prompt {i}")
    assert max(int(n) for n in CACHED_RE.findall(prefill_log)) >= 256, "the repeated long prompt missed the prefill's prefix cache"
    assert not kv_checks.fired_checks(decode_log), kv_checks.fired_checks(decode_log)[:5]
    assert alive and idle["num_used_tokens"] == 0


def test_a_plain_prefill_server_sizes_its_kv_pool_as_0_5_23(model_dir, server_log_dir):
    """A GQA prefill server over Mooncake that is not in DCP's GQA mode sizes its KV pool exactly
    as 0.5.23 does. Its free-memory reading is pinned (``helix_runs.pinned_memory_env``: 2 GiB), so
    its budget is 2 GiB x ``--mem-fraction-static`` (0.1875: 384 MiB), and 0.5.23's
    ``DefaultPoolConfigurator.calculate_pool_sizes`` makes that ``(budget - fixed overhead) // cell
    // page * page`` tokens, with no fixed overhead here (no KV-shard scratch) and the cell the
    model's K and V bytes a token (2 layers x 4 heads x 16 x fp32 x 2 = 1 KiB). Anything charged
    before sizing (the series' 4 x 64 MiB of PD staging before issue 69) takes tokens off."""
    page, fraction = CHUNK, 0.1875
    args = ["--tp", "1", "--mem-fraction-static", str(fraction), "--page-size", str(page), "--disaggregation-mode",
            "prefill", "--disaggregation-transfer-backend", "mooncake", "--disaggregation-bootstrap-port",
            str(free_port())]  # fmt: skip
    env = {**MOONCAKE_ENV, **pinned_memory_env()}
    srv = CpuServer(model_dir(GQA), args, log_dir=server_log_dir, extra_env=env, health_path="/health").start()
    try:
        log = srv.log_text()
    finally:
        stop_server(srv)
    avail = re.findall(r"Load weight begin\. avail mem=([\d.]+) GB", log)
    assert avail == ["2.00"], f"the memory pin did not apply: {avail} ({srv.log_path})"
    got = re.findall(r"KV Cache is allocated\. dtype: \S+, #tokens: (\d+)", log) + re.findall(r"max_total_num_tokens=(\d+),", log)
    cell = GQA.num_layers * 2 * GQA.num_kv_heads * GQA.head_dim * 4
    want = int(int(env["HELIX_TEST_AVAILABLE_MEMORY_BYTES"]) * fraction) // cell // page * page
    assert got == [str(want)] * 2, f"a plain prefill server's KV pool rows and max_total_num_tokens: {got}; 0.5.23 sizes {want} ({srv.log_path})"


@FULL  # the default run's Helix pair has a plain CPU-engine prefill too; this adds a plain decode
def test_plain_pd_pair_on_the_cpu_engine(model_dir, server_log_dir):
    """Upstream PD on the CPU engine (the [CPU] disaggregation patch): a plain --tp 1 -> --tp 1 pair
    with the default decode retraction backup serves the colocated tokens; the repeated prompt takes
    the cached-prefix early send."""
    path = model_dir(GQA)
    ref = run_workload(path, ["--tp", "4"], "torch_native", server_log_dir, plain_tp_reference)
    with PDCluster(path, ["--tp", "1"], ["--tp", "1"], server_log_dir, page_size=CHUNK) as pd:
        got = probe(pd.url)
        long_first, long_again = long_completion(pd.url), long_completion(pd.url)
        prefill_log = pd.prefill.log_text()
    assert_same_probe(ref["probe"], got, LOGPROB_ATOL, "plain PD --tp 1 -> --tp 1")
    assert_same_generation(ref["long"], long_first, LOGPROB_ATOL, "plain PD long prompt")
    assert_same_generation(ref["long"], long_again, LOGPROB_ATOL, "plain PD long prompt, prefix hit")
    assert max(int(n) for n in CACHED_RE.findall(prefill_log)) >= 256


def _generate(url: str, input_ids: list, max_new_tokens: int, timeout: float = 900, stream: bool = False):
    body = {"input_ids": input_ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _output_ids(url: str, input_ids: list, max_new_tokens: int) -> list:
    with _generate(url, input_ids, max_new_tokens) as r:
        return json.loads(r.read())["output_ids"]


def _assert_decode_pool_back(pd: PDCluster, what: str) -> None:
    """The decode's pool back to its start: rank 0 idle with no token in use, and no allocator
    check fired on any rank (the module docstring says what the other ranks' checks see)."""
    idle = kv_checks.wait_idle(pd.decode.base_url, timeout=300)
    time.sleep(2)
    assert pd.decode.proc.poll() is None, f"{what}: the decode server died\n{pd.decode.log_tail()}"
    assert idle["num_used_tokens"] == 0, (what, idle)
    fired = kv_checks.fired_checks(pd.decode.log_text())
    assert not fired, (what, fired[:5])


@FULL
def test_helix_decode_survives_aborts_a_full_pool_and_a_dead_prefill(model_dir, server_log_dir):
    """A client gone mid-transfer and mid-decode, more requests than the decode pool holds at once
    (queued, all answered, the answers of each alone), then the prefill server killed mid-transfer
    (the request fails, the decode frees what it reserved): after each every decode rank's pool is
    back to its start."""
    path = model_dir(GQA)
    rng = random.Random(7)
    long_ids = [rng.randrange(10, 400) for _ in range(6000)]
    prompts = [[rng.randrange(10, 400) for _ in range(1500)] for _ in range(3)]
    decode_args = ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", str(CHUNK),
                   "--max-total-tokens", "4096", "--chunked-prefill-size", "512"]  # fmt: skip
    prefill_args = ["--tp", "2", "--chunked-prefill-size", "512", "--max-total-tokens", "16384"]
    env = {**kv_checks.DEBUG_ENV, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2"}
    with PDCluster(path, prefill_args, decode_args, server_log_dir, page_size=CHUNK, decode_env=env) as pd:
        # 1. mid-decode: read a few streamed tokens, then hang up
        with _generate(pd.url, prompts[0], 400, stream=True) as r:
            for _ in range(4):
                r.readline()
        _assert_decode_pool_back(pd, "client gone mid-decode")
        # 2. mid-transfer: hang up long before a 6000-token prefill has been sent
        with pytest.raises((TimeoutError, urllib.error.URLError, OSError)):
            _generate(pd.url, long_ids, 8, timeout=1.0).read()
        time.sleep(20)  # the prefill finishes or drops it; the decode side follows
        _assert_decode_pool_back(pd, "client gone mid-transfer")
        # 3. three requests of ~1.6K tokens against a 4096-token decode pool: at most two at once
        alone = [_output_ids(pd.url, ids, 64) for ids in prompts]
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda ids: _output_ids(pd.url, ids, 64), prompts))
        assert together == alone
        _assert_decode_pool_back(pd, "a full decode pool")
        # 4. the prefill server killed while it sends a long prompt's KV
        failed = {}

        def send():
            try:
                _output_ids(pd.url, long_ids, 8)
            except Exception as e:  # noqa: BLE001 - any error answer is the point
                failed["error"] = e

        client = threading.Thread(target=send)
        client.start()
        time.sleep(1.5)
        os.killpg(pd.prefill.proc.pid, signal.SIGKILL)
        client.join(timeout=600)
        assert not client.is_alive(), "the request never finished after the prefill server died"
        assert "error" in failed, "a request whose prefill server died was answered"
        _assert_decode_pool_back(pd, "prefill killed mid-transfer")


@FULL
def test_a_prefill_layout_the_decode_cannot_hold_fails_its_requests(model_dir, server_log_dir):
    """A K = 2 model prefilled at --tp 4 on the CPU engine (which pads the KV heads to 4 rather than
    replicating them) into --tp 4 --helix-kvp-size 2: the prefill rejects the decode's layout at
    registration, so the request fails with an error (no wrong tokens) and the decode stays up."""
    path = model_dir(KV2)
    decode_args = ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", str(CHUNK)]
    pd = PDCluster(path, ["--tp", "4"], decode_args, server_log_dir, page_size=CHUNK)
    try:
        pd.start(wait_generate=False)
        deadline, answer = time.monotonic() + 600, None
        while answer is None:
            assert time.monotonic() < deadline, "no answer from the router"
            try:
                answer = _output_ids(pd.url, [11, 12, 13, 14, 15, 16], 4)
            except urllib.error.HTTPError as e:
                if e.code != 503:  # 503: the router has not admitted the workers yet
                    answer = e
            except (urllib.error.URLError, ConnectionError):
                pass  # the router is not listening yet
            time.sleep(1)
        assert isinstance(answer, urllib.error.HTTPError), f"answered {answer}"
        assert "divides the model's KV heads" in pd.prefill.log_text()
        assert pd.decode.proc.poll() is None and pd.prefill.proc.poll() is None
    finally:
        pd.stop()


LONG_IDS = [(13 * i + 5) % 400 + 10 for i in range(6000)]


def long_ids_completion(base_url: str):
    from sglang_helix.testing.openai_probe import generate_ids

    return generate_ids(base_url, LONG_IDS, 8)


@FULL
def test_a_long_prompt_in_head_sub_slices(model_dir, server_log_dir):
    """A 6000-token prompt from a --tp 1 prefill into --tp 4 --helix-kvp-size 2: each decode rank
    takes half of every token's heads (a strided row of the prefill's pool; the CPU engine has no
    DCP pack buffer, so a block per token, in batches the TCP transport queues): the colocated
    server's tokens."""
    path = model_dir(GQA)
    ref = run_workload(path, ["--tp", "4"], "torch_native", server_log_dir, long_ids_completion)
    decode_args = ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", str(CHUNK)]
    with PDCluster(path, ["--tp", "1"], decode_args, server_log_dir, page_size=CHUNK) as pd:
        got = long_ids_completion(pd.url)
    assert_same_generation(ref, got, LOGPROB_ATOL, "PD --tp 1 -> --tp 4 --helix-kvp-size 2, 6000 tokens")
