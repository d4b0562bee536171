"""Qwen3.5 behind sglang-router with a decode server in DCP's GQA mode: a plain ``--tp P`` prefill
server hands a ``--tp 4 --helix-kvp-size KVP`` decode server, over Mooncake (TCP), its
full-attention KV in pages (relaid out into the mode's head slice and sequence shard, as for
Llama: ``disaggregation/common/dcp_gqa.py``) and its Gated DeltaNet states (upstream's state
transfer, which slices them for the decode's --tp 4). The pair serves the colocated plain
``--tp 4`` server's greedy tokens and logprobs within the float32 bound on
``test_qwen3_5_harness``'s workload (prompts of 1, 5, 13 and 150 tokens, two rounds): a state
lost, sent for the wrong rank's heads or from the wrong request moves every output after the
prompt; a KV page in the wrong shard moves the full-attention layers.

Every decode rank runs the allocator checks (``kv_checks.DEBUG_ENV``: its KV pool and its
linear-attention state pool after every batch and whenever idle): none fires, the server is up,
and rank 0 ends with no token in use (``test_helix_pd_e2e.py`` says what the other ranks' checks
see on a PD decode).

Both servers run ``--disable-radix-cache``: on the CPU a Qwen3.5 prefill server with the decode's
``--page-size`` (more than one token) needs it or the mamba extra buffer, which the CPU platform
lacks (0.5.23 asserts ``no_buffer only supports page_size=1`` with a traceback otherwise:
``docs/disaggregation.md``), and the mode refuses a linear-attention radix cache without it.

Every case is in the full tier (``HELIX_TEST_FULL=1``; the default run's PD pair is Llama's,
``test_helix_pd_e2e.py``, and the state guard is a default-tier unit test,
``test_helix_pd.py::test_linear_attention_states_come_once_from_the_ranks_holding_them``): the
dense model, prefill ``--tp 2`` into KVP 2 (131 s in the 2026-12-07 CI run, when it was the default
run's), prefill ``--tp 1`` (each decode rank a head slice of the one prefill rank's KV, and its states sliced for
--tp 4), KVP 4, the MoE model, and the prefill server killed mid-transfer (the request fails with
an error, the decode's pools back at start).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import test_qwen3_5_harness as harness
from conftest import FULL
from sglang_helix.testing import kv_checks
from sglang_helix.testing.pd import PDCluster

pytestmark = pytest.mark.e2e
CHUNK = 4  # --helix-kvp-chunk-size, and so the page size of both servers
COMMON = [*harness.SERVER_ARGS, "--disable-radix-cache"]
# Each model's plain --tp 4 baseline as test_qwen3_5_harness serves it (one server per session).
BASELINE = {"dense": ["--chunked-prefill-size", "96"], "moe": []}
CASES = [  # (model, prefill tp, decode kvp, default run)
    ("dense", 2, 2, False), ("dense", 1, 2, False), ("dense", 2, 4, False), ("moe", 2, 2, False),
    ("moe", 1, 2, False),
]  # fmt: skip


def pd_cluster(path: str, prefill_tp: int, kvp: int, log_dir: str, decode_env_extra=None) -> PDCluster:
    decode = ["--tp", "4", "--helix-kvp-size", str(kvp), "--helix-kvp-chunk-size", str(CHUNK), *COMMON]
    env = {**harness.SERVER_ENV, **kv_checks.DEBUG_ENV, **(decode_env_extra or {})}
    return PDCluster(
        path, ["--tp", str(prefill_tp), *COMMON], decode, log_dir, page_size=CHUNK, decode_env=env,
        prefill_env=harness.SERVER_ENV,
    )  # fmt: skip


def assert_decode_pools_back(pd: PDCluster, what: str) -> None:
    """Rank 0 idle with no KV token in use, no check fired on any rank, the decode server up."""
    idle = kv_checks.wait_idle(pd.decode.base_url, timeout=300)
    time.sleep(2)  # every rank idles and checks its pools (a failed check ends the server)
    assert pd.decode.proc.poll() is None, f"{what}: the decode server died\n{pd.decode.log_tail()}"
    assert idle["num_used_tokens"] == 0, (what, idle)
    fired = kv_checks.fired_checks(pd.decode.log_text())
    assert not fired, (what, fired[:5])


@pytest.mark.parametrize(
    "model,prefill_tp,kvp",
    [pytest.param(m, p, k, id=f"{m}-p{p}-kvp{k}", marks=() if d else FULL) for m, p, k, d in CASES],
)
def test_qwen3_5_decode_behind_router_serves_colocated_tokens(qwen3_5_dirs, server_log_dir, model, prefill_tp, kvp):
    path = qwen3_5_dirs[model]
    base = harness.serve(path, 4, server_log_dir, BASELINE[model])
    with pd_cluster(path, prefill_tp, kvp, server_log_dir) as pd:
        got = harness.workload(pd.url)
        assert_decode_pools_back(pd, "after the workload")
    what = f"{model} PD --tp {prefill_tp} -> --tp 4 --helix-kvp-size {kvp}"
    for round_ in ("first", "again"):
        worst = harness.assert_same_results(base[round_], got[round_], f"{what} ({round_} round)")
    print(f"{what} vs colocated plain --tp 4: {worst}")


@FULL
def test_qwen3_5_dead_prefill_fails_its_request_and_frees_the_decode(qwen3_5_dirs, server_log_dir):
    """The prefill server killed while it sends a 3000-token prompt's KV and states: the request
    fails with an error answer (no hang, no wrong tokens), the decode frees what it reserved."""
    from test_helix_pd_e2e import _output_ids

    path = qwen3_5_dirs["dense"]
    long_ids = [(13 * i + 5) % 400 + 10 for i in range(3000)]
    env_extra = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2"}
    with pd_cluster(path, 2, 2, server_log_dir, decode_env_extra=env_extra) as pd:
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
        assert_decode_pools_back(pd, "prefill killed mid-transfer")
