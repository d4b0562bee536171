"""Helix end to end at the shapes and settings users run, against plain TP.

The main matrix (test_helix_e2e.py) uses head dim 16, a 4-token ownership chunk and float32, which
is what makes ownership errors visible in short prompts. This module runs what a user launches:

- head dim 128 (Llama, Qwen, Mistral), 8 query heads and 2 KV heads at ``--tp 4 --helix-kvp-size 2``
  (TPA 2: one KV head per rank, sharded along the sequence over 2 KVP ranks);
- the default ``--helix-kvp-chunk-size`` (64, so a KV page of 128) and no ``--chunked-prefill-size``
  (the server's default), with a ~1,350-token prompt: ~11 pages, 5-6 ownership chunks per KVP rank;
  and the Triton backend with ``--chunked-prefill-size 256``, so that prompt is prefilled in 6
  chunks, each extending over a prefix already sharded over both ranks;
- ``--dtype bfloat16``, against plain TP in bfloat16.

float32: greedy tokens equal over the decisive prefix and logprobs within LOGPROB_ATOL (1e-4 nats),
as in the main matrix. bfloat16: see ``BF16_LOGPROB_ATOL``.
"""

from __future__ import annotations

import pytest

from conftest import FULL, run_workload
from sglang_helix.testing.openai_probe import (
    LOGPROB_ATOL,
    MARGIN,
    _client,
    assert_same_generation,
    assert_same_probe,
    completions,
    concurrent_waves,
    probe,
)
from sglang_helix.testing.tiny_models import TinyModelSpec

# Q = 8, K = 2, head dim 128: hidden 1024.
HD128 = TinyModelSpec(num_heads=8, num_kv_heads=2, head_dim=128, num_layers=2)

# bfloat16: the logits themselves are bf16, and at their magnitude here (|logit| up to ~30) one bf16
# ulp is 0.125-0.25 nats, so every logprob and top-2 gap comes quantized in steps of ~0.25 (seen:
# gaps of exactly 0.0, 0.25, 0.5). Helix rounds each KVP rank's partial attention output to bf16
# before the merge where plain TP rounds once, a 1-ulp difference that can move a logit by an ulp.
# Measured (2026-11-23, this model): Helix vs plain --tp 4 max 0.25; plain
# --tp 2 vs plain --tp 4 max 0.14, and both part from --tp 4 at the same two steps (top-2 gaps of
# 0.25 and 0.0). So greedy tokens are compared only before the reference's first step whose top-2
# gap is under 2 ulps (BF16_MARGIN), that step excluded: a tie decided by rounding is no evidence.
# Re-measured 2026-12-06 with one request a forward on every server (equal batches): plain --tp 2
# and --tp 1 against --tp 4 max 0.46 and 0.47 nats, Helix 0.74 (a runner-up 4.8 nats down; Helix
# adds a rounding of each rank's partial output). Bound: 3 ulps, 0.75 nats; the margin stays 2 ulps.
BF16_LOGPROB_ATOL = 0.75
BF16_MARGIN = 0.5
# Far in the tail the logits' own size shows: a runner-up 13 nats down moved by 0.75 (-13.25 vs
# -14.0, 2026-11-23, a re-run of the same case that first measured 0.25). A rounding of the hidden
# state moves a logit by a few bf16 ulps *of that logit* (2^-8 relative), so the bound grows with
# the logprob's size: 0.75 + |logprob| / 32 (8 relative ulps). Top-1 logprobs are near 0 here.
BF16_LOGPROB_RTOL = 1 / 32


def assert_close_bf16(ref, got, what: str) -> int:
    """Tokens equal and logprobs (and top-2) within BF16_LOGPROB_ATOL before the reference's first
    step decided by less than BF16_MARGIN; returns how many steps were compared."""
    n = next((i for i, t in enumerate(ref.top2) if len(t) > 1 and t[0] - t[1] < BF16_MARGIN), len(ref.tokens))
    assert got.tokens[:n] == ref.tokens[:n], f"{what}: tokens differ within the first {n} steps\nref={ref.tokens[:n]}\ngot={got.tokens[:n]}"
    for i in range(n):
        pairs = [(got.logprobs[i], ref.logprobs[i])] + list(zip(got.top2[i], ref.top2[i]))
        bound = lambda b: BF16_LOGPROB_ATOL + BF16_LOGPROB_RTOL * abs(b)  # noqa: E731
        assert all(abs(a - b) <= bound(b) for a, b in pairs), f"{what}: step {i}: {pairs}"
    return n


_WORDS = (
    "attention head query key value cache token sequence shard rank merge parallel helix decode "
    "prefill chunk layer model tensor kernel memory context window long short fast slow exact"
).split()
# 1,346 tokens with the tiny tokenizer.
PROMPT_1K = " ".join(_WORDS[(i * 11 + i // 7) % len(_WORDS)] for i in range(1000))


def real_shapes_workload(base_url):
    client = _client(base_url)
    return {
        "probe": probe(base_url),
        "long": completions(client, [PROMPT_1K], max_tokens=24)[0],
        "waves": concurrent_waves(base_url, sizes=(8,)),
    }


def reference_workload(base_url):
    from sglang_helix.testing.openai_probe import single_completions

    return {**real_shapes_workload(base_url), "singles": single_completions(base_url)}


HELIX = ["--tp", "4", "--helix-kvp-size", "2"]
CASES = {
    # id: (dtype, backend, extra Helix args, logprob tolerance, decisive margin)
    "hd128-tp4-kvp2-default-chunks-torch_native": ("float32", "torch_native", [], LOGPROB_ATOL, MARGIN),
    "hd128-tp4-kvp2-cpp256-triton": ("float32", "triton", ["--chunked-prefill-size", "256"], LOGPROB_ATOL, MARGIN),
    "hd128-tp4-kvp2-bf16-torch_native": ("bfloat16", "torch_native", [], BF16_LOGPROB_ATOL, BF16_MARGIN),
}


def _max_logprob_delta(ref, got, margin) -> float:
    n = ref.decisive_prefix(margin)
    return max((abs(a - b) for a, b in zip(ref.logprobs[:n], got.logprobs[:n])), default=0.0)


@pytest.mark.e2e
# Every case runs with HELIX_TEST_FULL=1. The float32 torch_native default-chunks case was the
# default run's until 2026-11-27 (two servers, 153 s in that day's CI run; moved for CI time). The
# default run serves the same path against plain TP elsewhere: the default --helix-kvp-chunk-size
# (64, a KV page of 128) and no --chunked-prefill-size at --tp 4 --helix-kvp-size 2 (TPA 2) in
# test_helix_soak.py (prompts up to ~3.5K tokens, 16 concurrent clients, the same greedy answers),
# and long prompts at a real head dim (64) on a trained model in test_helix_retrieval.py (chunk 64,
# ~2K and ~4K tokens). Head dim 128 is a size on torch_native; the Triton kernels' head-dim-128
# specializations are compiled by test_triton_compile.py.
@pytest.mark.parametrize("case", [pytest.param(c, marks=FULL) for c in CASES])
def test_real_shapes_match_plain_tp(model_dir, server_log_dir, case):
    dtype, backend, extra, atol, margin = CASES[case]
    model = model_dir(HD128)
    dtype_args = ["--dtype", dtype]
    if dtype == "bfloat16":
        # One request a forward on both servers: a bf16 GEMM rounds by its row count, so two servers
        # that batch the probe's prompts differently (seen: 1 + 3 against 4 at once, 2026-12-06)
        # part by more than Helix's own rounding. The float32 cases keep the concurrent batches.
        dtype_args += ["--max-running-requests", "1"]
    ref = run_workload(model, ["--tp", "4", *dtype_args], "torch_native", server_log_dir, reference_workload)
    got = run_workload(model, [*HELIX, *dtype_args, *extra], backend, server_log_dir, real_shapes_workload)

    assert len(ref["long"].tokens) == 24
    pairs = [(f"completion[{i}]", r, g) for i, (r, g) in enumerate(zip(ref["probe"].completions, got["probe"].completions))]
    pairs += [("chat", ref["probe"].chat, got["probe"].chat), ("~1.3K-token prompt", ref["long"], got["long"])]
    pairs += [(f"wave request {i}", ref["singles"][p], gen) for i, (p, gen) in enumerate(got["waves"][8])]
    if dtype == "bfloat16":
        compared = {what: assert_close_bf16(r, g, f"{case} {what}") for what, r, g in pairs}
        # The long prompt must really be decided by the model, not end at its first step.
        assert compared["~1.3K-token prompt"] >= 3, compared
    else:
        assert_same_probe(ref["probe"], got["probe"], atol, case, margin)
        for what, r, g in pairs:
            assert_same_generation(r, g, atol, f"{case} {what}", margin)
        assert ref["long"].decisive_prefix(margin) >= 8, f"reference long generation indecisive: {ref['long'].top2[:8]}"
    deltas = [_max_logprob_delta(r, g, margin) for _, r, g in pairs]
    print(f"{case}: max |d logprob| vs plain TP ({dtype}) = {max(deltas):.2e} (tolerance {atol})")
