"""Qwen3.5 in DCP's GQA mode against plain TP: the hybrid model upstream's GQA DCP is run with.

The tiny Qwen3.5 checkpoints of ``test_qwen3_5_harness.py`` (2 KV heads; the dense one at head dim
256 with the published M-RoPE sections, the MoE one at head dim 64 with a gated shared expert; 3
Gated DeltaNet layers to 1 gated full-attention layer, partial rotary 0.25), on ``torch_native``,
float32, ``--tp 4``. That file's plain ``--tp 4`` servers are the baselines (and are held to
transformers' own forward there); each layout here serves the same workload (one batched
``/generate``, prompts of 1, 5, 13 and 150 tokens, greedy, logprobs from position 0, twice) and must
give plain TP's greedy tokens within its decisive prefix and every prompt and output logprob within
the same float32 bound (``ATOL + RTOL * |lp|``).

Layouts (default tier): ``--helix-kvp-size 2`` (TPA 2: each rank of a pair projects 8 of the 16
query heads and their gates, attends over its half of the sequence and keeps 4 heads after the
All-to-All) on the dense model, with ``--chunked-prefill-size 96`` as its baseline (resolved to the
mode's page multiple: the 150-token prompt is served in two chunks, the second reading the sharded
KV and the linear-attention states the first left). The default run serves KVP 4 through DCP's
spelling with the MTP draft (``test_qwen3_5_mtp.py``, ``dense-chain-dcp4``) and the mode as a PD
decode server (``test_helix_qwen3_5_pd.py``). Full tier: DCP's spelling at KVP 4 (``--dcp-size 4
--dcp-replicate-q-proj``, TPA 1), upstream's ``--dcp-size 2`` (Q gathered) on the dense model, the
MoE model at KVP 2 and 4, and the dense model at KVP 2 on interpreted Triton.

Every layout runs with upstream's KV debug checks (``kv_checks.DEBUG_ENV``): each rank checks its
KV pool and its linear-attention state pool after every batch and whenever idle (a leak or double
free raises, which ends the server), and the test requires every rank's full-attention KV pool
counts after the workload to equal those at start.

The mode runs with ``--disable-radix-cache`` here: the CPU platform has no mamba extra buffer, and
without it the radix cache of the linear-attention states takes one-token pages only, while the
mode's pages are chunk x KVP tokens (refused at start in one line otherwise: ``test_helix_args.py``,
``qwen3_5_radix``). The plain-TP baselines keep their radix cache (``no_buffer``).

The mode's one model change is the output gate: each rank gates the Q/N heads it holds after the
exchange with those heads' gate rows. Gating with the group's first heads instead (every rank of a
pair taking rank 0's) fails ``test_dense_serves_plain_tp`` by whole nats (docs/testing.md).
"""

from __future__ import annotations

import os
import time

import pytest
import test_qwen3_5_harness as harness
from conftest import FULL, start_server, stop_server
from sglang_helix.testing import kv_checks

pytestmark = pytest.mark.e2e
CHUNKED = [
    "--chunked-prefill-size",
    "96",
]  # the dense baseline's (test_qwen3_5_harness)
NO_RADIX = ["--disable-radix-cache"]

DENSE_LAYOUTS = {
    "kvp2": ["--helix-kvp-size", "2"],
    "dcp4-rq": ["--dcp-size", "4", "--dcp-replicate-q-proj"],
    "dcp2": ["--dcp-size", "2"],  # upstream's DCP: Q gathered
    "kvp2-triton": ["--helix-kvp-size", "2"],
}
FULL_TIER = {"dcp2", "dcp4-rq", "kvp2-triton", "moe-kvp4"}


def serve_checked(
    model_path: str, args: list, log_dir: str, backend: str = "torch_native"
) -> dict:
    """``harness.workload`` on ``--tp 4 args`` with the KV debug checks; then, idle, one more
    request: the results, the checks that fired, and every rank's (total, available, uncached)
    as the first check of the server's life logged it and as the one after the workload does.
    """
    env = {**harness.SERVER_ENV, **kv_checks.DEBUG_ENV}
    srv = start_server(
        model_path, ["--tp", "4", *harness.SERVER_ARGS, *args], backend, log_dir, env
    )
    try:
        out = harness.workload(srv.base_url)
        kv_checks.wait_idle(srv.base_url)
        mark = os.path.getsize(srv.log_path)
        status, _ = kv_checks.get(
            srv.base_url, "/health_generate"
        )  # a request on the idle server
        kv_checks.wait_idle(srv.base_url)
        time.sleep(2.0)  # several idle-loop checks on every rank
        with open(srv.log_path, "rb") as f:
            raw = f.read()
        log = raw.decode(errors="replace")
        out.update(
            healthy=status == 200, fired=kv_checks.fired_checks(log),
            start=kv_checks.busy_counts(log), after=kv_checks.busy_counts(raw[mark:].decode(errors="replace")),
        )  # fmt: skip
    finally:
        stop_server(srv)
    return out


def assert_pools_back(out: dict, what: str) -> None:
    assert (
        out["healthy"] and not out["fired"]
    ), f"{what}: KV checks fired: {out['fired'][:5]}"
    ranks = list(range(4))
    assert (
        sorted(out["start"]) == sorted(out["after"]) == ranks
    ), f"{what}: busy checks {out['after']}"
    for (
        rank
    ) in ranks:  # a request on the idle server sees the pool its first request saw
        first, after = out["start"][rank][0], out["after"][rank][0]
        assert (
            after == first
        ), f"{what}: TP{rank} (total, available, uncached) {after}, at start {first}"


def assert_serves_plain_tp(base: dict, got: dict, what: str) -> None:
    for round_ in ("first", "again"):
        worst = harness.assert_same_results(
            base[round_], got[round_], f"{what} ({round_} round)"
        )
    print(f"{what} vs plain --tp 4: {worst}")
    assert_pools_back(got, what)


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=FULL if k in FULL_TIER else ()) for k in DENSE_LAYOUTS],
)
def test_dense_serves_plain_tp(qwen3_5_dirs, server_log_dir, layout):
    path = qwen3_5_dirs["dense"]
    base = harness.serve(path, 4, server_log_dir, CHUNKED)
    backend = "triton" if layout.endswith("triton") else "torch_native"
    got = serve_checked(
        path, [*DENSE_LAYOUTS[layout], *NO_RADIX, *CHUNKED], server_log_dir, backend
    )
    assert_serves_plain_tp(base, got, f"dense {layout}")


@pytest.mark.parametrize(
    "kvp", [pytest.param(2, id="moe-kvp2", marks=FULL), pytest.param(4, id="moe-kvp4", marks=FULL)]
)
def test_moe_serves_plain_tp(qwen3_5_dirs, server_log_dir, kvp):
    path = qwen3_5_dirs["moe"]
    base = harness.serve(path, 4, server_log_dir)
    got = serve_checked(path, ["--helix-kvp-size", str(kvp), *NO_RADIX], server_log_dir)
    assert_serves_plain_tp(base, got, f"moe kvp{kvp}")


@FULL
def test_block_fp8_serves_plain_tp(qwen3_5_dirs, server_log_dir, tmp_path_factory):
    """The dense model as Qwen publishes Qwen3.5 in FP8 (block-wise 128 x 128, the Gated DeltaNet
    projections unquantized: ``write_qwen3_5_fp8_block``), bfloat16, ``--helix-kvp-size 2`` against
    plain ``--tp 4`` on the same checkpoint: the greedy tokens while plain TP decides by more than
    ``BF16_MARGIN``, and their logprobs within ``test_helix_real_shapes``' bfloat16 bound. (Where the
    TPA shards are not whole blocks the checkpoint is refused: ``test_helix_args.py``.)
    """
    from sglang_helix.testing.qwen3_5_models import write_qwen3_5_fp8_block
    from test_helix_real_shapes import BF16_LOGPROB_ATOL, BF16_LOGPROB_RTOL, BF16_MARGIN

    fp8 = write_qwen3_5_fp8_block(
        qwen3_5_dirs["dense"], str(tmp_path_factory.mktemp("qwen3_5") / "fp8")
    )
    args = ["--dtype", "bfloat16", *NO_RADIX]
    base = serve_checked(fp8, args, server_log_dir)
    got = serve_checked(fp8, [*args, "--helix-kvp-size", "2"], server_log_dir)
    compared = 0
    for i, (r, g) in enumerate(zip(base["first"], got["first"])):
        n = next(
            (k for k, t in enumerate(r["top2"]) if t[0] - t[1] < BF16_MARGIN),
            len(r["ids"]),
        )
        assert (
            g["ids"][:n] == r["ids"][:n]
        ), f"fp8 prompt {i}: {g['ids']} vs plain TP {r['ids']} ({n} decided)"
        for a, b in zip(g["lp"][:n], r["lp"][:n]):
            assert abs(a - b) <= BF16_LOGPROB_ATOL + BF16_LOGPROB_RTOL * abs(
                b
            ), f"fp8 prompt {i}: {a} vs {b}"
        compared += n
    assert compared >= 8, compared
    assert_pools_back(got, "fp8 kvp2")


@FULL
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_multimodal_checkpoint_serves_plain_tp(server_log_dir, tmp_path_factory, model):
    """The form Qwen publishes, ``Qwen3_5ForConditionalGeneration`` /
    ``Qwen3_5MoeForConditionalGeneration`` (the text model under ``model.language_model`` beside a
    one-block vision encoder, ``write_qwen3_5_vl_model``): its language model in the mode serves
    plain ``--tp 4``'s tokens for text requests (the vision encoder runs plain TP over attn_tp,
    untouched by the mode; image requests are not served here).
    """
    from sglang_helix.testing.qwen3_5_models import DENSE, MOE, write_qwen3_5_vl_model

    spec = {"dense": DENSE, "moe": MOE}[model]
    path = write_qwen3_5_vl_model(str(tmp_path_factory.mktemp("qwen3_5") / f"vl-{model}"), spec)
    base = serve_checked(path, NO_RADIX, server_log_dir)
    got = serve_checked(path, ["--helix-kvp-size", "2", *NO_RADIX], server_log_dir)
    assert_serves_plain_tp(base, got, f"multimodal {model} kvp2")
