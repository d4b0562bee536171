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

With the MTP draft (``test_qwen3_5_mtp_draft_on_a_decode_in_the_mode``, below): full tier, every
case (the default run holds the draft's relayout through upstream's own send in
``test_helix_pd.py::test_a_drafts_kv_is_relaid_out_like_the_targets``, its launch in
``test_helix_args.py``). Every case without the draft is in the full tier (``HELIX_TEST_FULL=1``; the default run's PD pair is Llama's,
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


# Qwen3.5's MTP draft on the PD pair (issue 78): both servers --speculative-algorithm NEXTN (the
# checkpoint's MTP layer, test_qwen3_5_mtp.py's checkpoint). The prefill runs the draft over the
# prompt and hands the decode, besides the target's KV and states, the draft's KV (its own pool's
# entries, num_draft_entries) and the first drafts with their hidden state; in the mode the draft's
# pool is sharded like the target's, so its KV takes the target's relayout (head slice, owned
# tokens at the target's rows, part-major pages put back: test_helix_pd.py's unit tests hold it
# byte for byte). The pair serves the colocated plain --tp 4 server's tokens and logprobs within the
# float32 bound, its verifies accepting the drafts colocated plain --tp 4 with the same draft accepts
# (the references are test_qwen3_5_mtp.py's servers, shared in a session), every decode pool back.
MTP_CASES = {  # name: (test_qwen3_5_mtp's plain-TP case, prefill tp, the decode's mode flags)
    "dense-chain-p2-kvp2": ("dense-chain", 2, ["--helix-kvp-size", "2", "--helix-kvp-chunk-size", str(CHUNK)]),
    "dense-chain-p1-kvp2": ("dense-chain", 1, ["--helix-kvp-size", "2", "--helix-kvp-chunk-size", str(CHUNK)]),
    "dense-chain-p2-kvp4": ("dense-chain", 2, ["--helix-kvp-size", "4", "--helix-kvp-chunk-size", str(CHUNK)]),
    "dense-chain-p2-dcp2": ("dense-chain", 2, ["--dcp-size", "2", "--dcp-replicate-q-proj", "--dcp-interleave-size",
                                               str(CHUNK)]),
    "dense-tree-p2-kvp2": ("dense-tree", 2, ["--helix-kvp-size", "2", "--helix-kvp-chunk-size", str(CHUNK)]),
    "moe-chain-p2-kvp2": ("moe-chain", 2, ["--helix-kvp-size", "2", "--helix-kvp-chunk-size", str(CHUNK)]),
}  # fmt: skip
MTP_DEFAULT: set = set()  # all full tier (the default run: the relayout unit test, test_helix_pd.py)
# The MTP layer's drafts hardly depend on its attention (the checkpoint's drafts come from fc's
# embedding half), so tokens and accepted drafts alone do not see a draft KV that went astray (it
# served both the same with upstream's replicated draft path in the mode). So each pair also dumps
# its pools (test/helix_kv_dump: the prefill's plain-TP extends, the decode's DCP forwards) for one
# more request, and every decode rank's rows of the prompt, the draft's (the MTP layer, layer 0 of
# its own pool) and the target's full-attention layers, must be the prefill's bytes for its heads.
KV_DUMP_HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helix_kv_dump")
PROBE = [(31 * i + 11) % 500 + 7 for i in range(37)]  # past a chunk and a KVP page, ending mid-page
DRAFT_LAYER = 0  # the MTP model's one layer


def _dumps(path: str) -> dict:
    import torch

    out = {}
    for name in os.listdir(path):
        if name.endswith(".pt"):
            r = torch.load(os.path.join(path, name))
            out.setdefault((r["layer_id"], r["tp_rank"]), []).append(r)
    return out


def assert_decode_holds_the_prefills_kv(pd: PDCluster, dumps: dict, prefill_tp: int, what: str) -> None:
    """One request of ``PROBE`` through the pair, both servers dumping: every decode rank holds, for
    each prompt position its KVP rank owns, the prefill's K/V bytes of its TPA slice's heads, the
    MTP draft's and each full-attention layer's, and each TPA slice's KVP ranks hold every position
    of the prompt once."""
    import torch
    from test_helix_pd_e2e import _output_ids

    for d in dumps.values():
        for name in os.listdir(d):
            os.remove(os.path.join(d, name))
    _output_ids(pd.url, PROBE, 4)
    kv_checks.wait_idle(pd.decode.base_url, timeout=300)
    time.sleep(1.0)
    n = len(PROBE)
    src, dst = _dumps(dumps["prefill"]), _dumps(dumps["decode"])
    layers = sorted({layer for layer, _ in src})
    assert DRAFT_LAYER in layers and len(layers) > 1, f"{what}: prefill dumps of layers {layers}"
    for layer in layers:
        full = {}
        for kv in ("k", "v"):  # the prompt's K/V over all heads: the prefill ranks' heads side by side
            parts = []
            for rank in range(prefill_tp):
                (rec,) = [r for r in src[(layer, rank)] if r["seq_len"] == n]
                parts.append(rec[kv])
            full[kv] = torch.cat(parts, dim=1)
        heads = full["k"].shape[1]
        seen = {}
        for (dl, rank), recs in dst.items():
            if dl != layer:
                continue
            (rec,) = recs  # the probe's one slot
            tpa, kvp = rank // rec["kvp_size"], rec["kvp_size"]
            width = rec["k"].shape[1]
            mine = slice(tpa * width, (tpa + 1) * width)
            prompt = rec["positions"] < n
            pos = rec["positions"][prompt]
            for kv in ("k", "v"):
                want = full[kv][pos][:, mine]
                assert torch.equal(rec[kv][prompt], want), (
                    f"{what}: decode rank {rank} layer {layer} ({'draft' if layer == DRAFT_LAYER else 'target'}) "
                    f"{kv.upper()} rows are not the prefill's: {(rec[kv][prompt] - want).abs().amax().item()}"
                )
            for p in pos.tolist():
                seen[(tpa, p)] = seen.get((tpa, p), 0) + 1
            assert kvp > 1
        tpas = {t for t, _ in seen}
        assert tpas and all(seen.get((t, p)) == 1 for t in tpas for p in range(n)), (
            f"{what}: layer {layer}: prompt positions not held once per TPA slice"
        )


@pytest.mark.parametrize("case", [pytest.param(k, marks=() if k in MTP_DEFAULT else FULL) for k in MTP_CASES])
def test_qwen3_5_mtp_draft_on_a_decode_in_the_mode(qwen3_5_dirs, mtp_dirs, server_log_dir, tmp_path, monkeypatch, case):
    import test_qwen3_5_mtp as mtp

    plain_case, prefill_tp, mode_flags = MTP_CASES[case]
    model, flags, drafts = mtp.CASES[plain_case]
    chunked = BASELINE[model]
    base = harness.serve(qwen3_5_dirs[model], 4, server_log_dir, chunked)
    path = mtp_dirs(model)
    plain = mtp.serve_spec_once(path, [*flags, *chunked], server_log_dir)
    prefill = ["--tp", str(prefill_tp), *COMMON, *flags, *chunked]
    decode = ["--tp", "4", *mode_flags, *COMMON, *flags]
    dumps = {side: str(tmp_path / f"{side}-kv") for side in ("prefill", "decode")}
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (KV_DUMP_HOOK, os.environ.get("PYTHONPATH")) if p))
    for d in dumps.values():
        os.makedirs(d)
    env = {**harness.SERVER_ENV, **kv_checks.DEBUG_ENV, "HELIX_KV_DUMP_DIR": dumps["decode"], "HELIX_KV_DUMP_OWNED": "1"}
    prefill_env = {**harness.SERVER_ENV, "HELIX_KV_DUMP_DIR": dumps["prefill"], "HELIX_KV_DUMP_PLAIN": "1"}
    t0 = time.monotonic()
    with PDCluster(path, prefill, decode, server_log_dir, page_size=CHUNK, decode_env=env,
                   prefill_env=prefill_env) as pd:  # fmt: skip
        started = time.monotonic() - t0
        got = harness.workload(pd.url, mtp.SPEC_META)
        assert_decode_pools_back(pd, f"{case}: after the workload")
        assert_decode_holds_the_prefills_kv(pd, dumps, prefill_tp, case)
        assert_decode_pools_back(pd, f"{case}: after the dumped request")
    what = f"{case}: PD --tp {prefill_tp} -> --tp 4 {' '.join(mode_flags)} with the MTP draft"
    for round_ in ("first", "again"):
        worst = harness.assert_same_results(base[round_], got[round_], f"{what} ({round_} round)")
    stats, plain_stats = mtp.accept_stats(got, drafts, case), mtp.accept_stats(plain, drafts, plain_case)
    assert stats == plain_stats, f"{what}: accepted drafts {stats}, colocated plain --tp 4 {plain_stats}"
    mtp.assert_accepts_partially(stats, drafts, case)
    print(f"{what}: {worst}; verifies by accepted drafts {stats['hist']} (plain TP's); cluster start {started:.0f} s, "
          f"all {time.monotonic() - t0:.0f} s")  # fmt: skip
