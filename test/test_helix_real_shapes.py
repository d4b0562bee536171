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

from conftest import run_workload
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
from sglang_helix.testing.tiny_llama import TinyLlamaSpec

# Q = 8, K = 2, head dim 128: hidden 1024.
HD128 = TinyLlamaSpec(num_heads=8, num_kv_heads=2, head_dim=128, num_layers=2)

# bfloat16 keeps 8 significant bits: every rounding of an activation moves it by up to 2^-9
# relative. Helix and plain TP round at different places (Helix rounds each KVP rank's partial
# attention output to bf16 before the exchange, then the merged output; plain TP rounds once), so
# the attention outputs differ by ~1 bf16 ulp, which the two layers, o_proj and the FFN carry to
# the logits. The logits here span ~+-10 nats (logit_scale 4), so one ulp of relative error on them
# is ~10 * 2^-8 = 0.04 nats; a logprob is a difference of such logits. Measured: see the test's
# printout (max |d logprob| over all compared steps). A wrong attention result (a missing or
# doubled shard) moves logprobs by whole nats.
BF16_LOGPROB_ATOL = 0.1
# Greedy tokens are compared while the reference's top-1 beats its top-2 by more than both layouts'
# error together (2 x the tolerance): below that, bf16 rounding alone may pick the other token
# (seen: a step decided by < 0.2 nats flipped), after which the generations legitimately part.
BF16_MARGIN = 2 * BF16_LOGPROB_ATOL

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
@pytest.mark.parametrize("case", list(CASES))
def test_real_shapes_match_plain_tp(model_dir, server_log_dir, case):
    dtype, backend, extra, atol, margin = CASES[case]
    model = model_dir(HD128)
    dtype_args = ["--dtype", dtype]
    ref = run_workload(model, ["--tp", "4", *dtype_args], "torch_native", server_log_dir, reference_workload)
    got = run_workload(model, [*HELIX, *dtype_args, *extra], backend, server_log_dir, real_shapes_workload)

    assert len(ref["long"].tokens) == 24
    assert_same_probe(ref["probe"], got["probe"], atol, case, margin)
    assert_same_generation(ref["long"], got["long"], atol, f"{case} ~1.3K-token prompt", margin)
    # The long prompt must really be decided by the model, not end at its first step.
    assert ref["long"].decisive_prefix(margin) >= 4, f"reference long generation indecisive: {ref['long'].top2[:8]}"
    deltas = [_max_logprob_delta(ref["long"], got["long"], margin)]
    for i, (prompt_index, gen) in enumerate(got["waves"][8]):
        ref_gen = ref["singles"][prompt_index]
        assert_same_generation(ref_gen, gen, atol, f"{case} wave request {i}", margin)
        deltas.append(_max_logprob_delta(ref_gen, gen, margin))
    for r, g in zip(ref["probe"].completions, got["probe"].completions):
        deltas.append(_max_logprob_delta(r, g, margin))
    print(f"{case}: max |d logprob| vs plain TP ({dtype}) = {max(deltas):.2e} (tolerance {atol})")
