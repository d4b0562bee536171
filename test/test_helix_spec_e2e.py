"""Speculative decoding under Helix on the CPU harness (issue 27): real ``--tp 4`` servers.

Helix serves EAGLE and STANDALONE chain drafts (``--speculative-eagle-topk 1``) and tree drafts (top-k > 1,
issue 33) on torch_native and triton (``docs/helix-flags.md``, "Speculative decoding"; the refusals are
``test_helix_args.py``'s). What runs where:

- the target verify is an extend of the ``k + 1`` draft tokens over the sequence-sharded prefix
  (Triton: the backend's DCP verify lists; torch_native: ``kv_ends_of`` in ``layers/dcp/torch_attention.py``): each rank attends every
  draft token to the keys it owns, the draft tokens' own K/V written by their owners, and the
  All-to-All + LSE merge makes it exact;
- the draft model's attention is Helix attention too (a Llama-family draft, or the
  ``LlamaForCausalLMEagle`` head), over its own pool laid out like the target's (same allocator
  ids, same owners); its decode steps run past ``seq_lens`` on the slots the scheduler reserved,
  so each step's local KV list ends at the step's position;
- rejected drafts' slots are the scheduler's over-allocation, freed by the allocator every rank
  shares (logical ids), so they are freed on every rank at once;
- a tree: each rank applies the verify's tree mask to the keys it owns, each draft branch sits on
  its own KV pages (a shift by whole pages keeps its owners), and the accepted path moves to the
  front of the verify window across ranks (``kv_move``).

``--helix-kvp-chunk-size 4`` with a chain of 3 (4 draft tokens): every verify and every draft
chain crosses an ownership boundary.

Checked (default tier, one Helix server: STANDALONE with a tree draft, beside plain TP with the
same tree; the chains, STANDALONE's and EAGLE's, in the full tier): greedy tokens and logprobs equal plain TP's (no
speculation) over the batched ``/generate``, the OpenAI probe (completions, stream, chat, streamed
chat) and the ~300-token prompt; the accept length is reported and above 1.5 for the tree (the
chain: at least the documented floor of the target as its own draft, ``STANDALONE_CHAIN_FLOOR``,
1.3; plain TP's chain is held to it in the default run by test_spec_baseline_e2e), and per prompt the verifies and accepted drafts equal plain TP + the same speculation's
(the draft under Helix proposes the same tokens); a sampled request runs; an aborted and a disconnected stream; then upstream's KV checks on every
rank (``kv_checks.DEBUG_ENV``): none fired, and every rank's free count after the run equals its
count at startup. Full tier: KVP 4, triton (STANDALONE and EAGLE, interpreted kernels;
``test_helix_attention.py`` checks the same forwards on both backends in the default tier,
without a server), and the scripted retraction/abort scenario of ``test_helix_kv_leak.py`` with
speculation on.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from conftest import FULL, GQA, run_workload, start_server, stop_server
from sglang_helix.testing.kv_checks import DEBUG_ENV, busy_counts, fired_checks, get, wait_idle
from sglang_helix.testing.openai_probe import LOGPROB_ATOL, assert_same_generation, assert_same_probe, long_completion, probe
from test_helix_kv_leak import _stream_generate_then_abort, _stream_then_close
from test_spec_baseline_e2e import (
    STANDALONE_CHAIN_FLOOR,
    assert_generate_matches,
    assert_speculated,
    assert_ngram_run,
    generate,
    ngram_args,
    ngram_run,
    reference,
    spec_args,
)

BACKEND = "torch_native"


def helix_spec_args(algorithm: str, draft: str, kvp: int) -> list:
    return spec_args(algorithm, draft) + ["--helix-kvp-size", str(kvp), "--helix-kvp-chunk-size", "4"]


def sampled(base_url: str) -> list:
    import json
    import urllib.request

    body = {
        "text": ["The capital of France is", "Once upon a time"],
        "sampling_params": {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7},
    }
    req = urllib.request.Request(base_url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.load(r)


def mixed_run(base_url: str) -> dict:
    """Everything the default test reads from one server, then the aborted/disconnected streams."""
    rng = random.Random(3)
    prompt = lambda n: [rng.randrange(10, 400) for _ in range(n)]  # noqa: E731
    out = {"generate": generate(base_url), "probe": probe(base_url), "long": long_completion(base_url)}
    out["sampled"] = sampled(base_url)
    out["closed_after"] = _stream_then_close(base_url, prompt(21), 40, 3)
    out["aborted"] = _stream_generate_then_abort(base_url, "helix-spec-abort", prompt(18), 40, 2)
    return out


def run_checked(model: str, args: list, log_dir: str, workload, backend: str = BACKEND) -> tuple:
    """Run ``workload`` on a server with upstream's KV checks on every rank; return its result and
    every rank's ``(total, available, uncached)`` at the first busy check after startup and after
    the workload (a health-check request each)."""
    srv = start_server(model, args, backend, log_dir, extra_env=DEBUG_ENV)
    try:
        wait_idle(srv.base_url)
        result = workload(srv.base_url)
        wait_idle(srv.base_url)
        # The radix cache (on) keeps the run's prefixes: release them, so the pool can come back.
        assert get(srv.base_url, "/flush_cache")[0] == 200
        time.sleep(2.0)  # idle checks on every rank
        mark = os.path.getsize(srv.log_path)
        assert get(srv.base_url, "/health_generate")[0] == 200
        wait_idle(srv.base_url)
        time.sleep(1.0)
        assert srv.proc.poll() is None, "server died\n" + srv.log_tail()
    finally:
        with open(srv.log_path, "rb") as f:
            raw = f.read()
        stop_server(srv)
    log = raw.decode(errors="replace")
    fired = fired_checks(log)
    assert not fired, "a KV pool check fired:\n" + "\n".join(fired)[:4000]
    before, after = busy_counts(raw[:mark].decode(errors="replace")), busy_counts(raw[mark:].decode(errors="replace"))
    return result, before, after


def counts(results: list) -> list:
    """Per prompt ``(verifies, accepted drafts)``."""
    return [(r["meta"]["spec_verify_ct"], r["meta"]["spec_num_correct_drafts"]) for r in results]


def assert_every_rank_back(before: dict, after: dict, tp: int) -> None:
    assert sorted(before) == sorted(after) == list(range(tp)), (sorted(before), sorted(after))
    for rank in range(tp):
        assert after[rank][0] == before[rank][0], f"TP{rank}: after the run {after[rank][0]}, at startup {before[rank][0]}"
        assert len({t for t, _, _ in before[rank] + after[rank]}) == 1, f"TP{rank}: the pool's total changed"


@pytest.mark.e2e
@pytest.mark.parametrize("shape", ["tree", pytest.param("chain", marks=FULL)])
def test_helix_standalone_serves_plain_tp_tokens(model_dir, server_log_dir, shape):
    """Helix KVP 2 x TPA 2, STANDALONE (the target as its own draft): a tree (top-k 2, 6 tokens
    verified per step; the default run's speculation server) or a chain of 3 (full tier, with
    EAGLE's chain): plain TP's greedy tokens and logprobs everywhere, drafts accepted, and every
    rank's KV back to its startup count after aborts and a disconnect."""
    ref = reference(model_dir, server_log_dir)
    model = model_dir(GQA)
    draft = tree_args if shape == "tree" else list
    what = f"Helix STANDALONE {shape}"
    got, before, after = run_checked(model, draft(helix_spec_args("STANDALONE", model, 2)), server_log_dir, mixed_run)
    assert_generate_matches(ref["probe"].completions, got["generate"], model, what)
    assert_same_probe(ref["probe"], got["probe"], LOGPROB_ATOL, what)
    assert_same_generation(ref["long"], got["long"], LOGPROB_ATOL, f"{what} long prompt")
    floor = STANDALONE_CHAIN_FLOOR if shape == "chain" else 1.5
    assert assert_speculated(got["generate"], f"Helix KVP 2 STANDALONE {shape}") >= floor
    # The draft under Helix proposes what plain TP's draft proposes: the same accepted drafts and
    # verifies per prompt as plain TP + the same speculation (the chain: test_spec_baseline_e2e's run).
    plain_spec = run_workload(model, draft(spec_args("STANDALONE", model)), BACKEND, server_log_dir, generate)
    assert_generate_matches(ref["probe"].completions, plain_spec, model, f"plain TP STANDALONE {shape}")
    assert counts(got["generate"]) == counts(plain_spec)
    for r in got["sampled"]:
        assert r["meta_info"]["completion_tokens"] == 12 and r["meta_info"].get("spec_verify_ct", 0) > 0, r["meta_info"]
    assert got["closed_after"] == 3
    assert got["aborted"]["finish_reason"]["type"] == "abort"
    assert_every_rank_back(before, after, 4)


@pytest.mark.e2e
# (KVP 2: FULL since 2026-11-28, for CI time; the default run's Helix speculation server is the
# STANDALONE tree above, and test_helix_attention.py runs EAGLE's draft steps without a server)
@pytest.mark.parametrize("kvp", [pytest.param(2, marks=FULL), pytest.param(4, marks=FULL)])
def test_helix_eagle_with_an_accepting_head_matches_plain_tp_eagle(model_dir, server_log_dir, eagle_draft, kvp):
    """EAGLE proven: a head fitted to the target (conftest ``eagle_draft``) proposes what the target
    then produces. Plain TP + EAGLE and Helix + EAGLE (its draft runs the Helix attention too) serve
    plain TP's greedy tokens, with the same verifies and accepted drafts per prompt and an accept
    length above 1.5; every rank's KV is back after the run."""
    ref = reference(model_dir, server_log_dir)
    model = model_dir(GQA)
    plain = run_workload(model, spec_args("EAGLE", eagle_draft), BACKEND, server_log_dir, generate)
    assert_generate_matches(ref["probe"].completions, plain, model, "plain TP EAGLE")
    assert assert_speculated(plain, "plain TP EAGLE") > 1.5
    got, before, after = run_checked(model, helix_spec_args("EAGLE", eagle_draft, kvp), server_log_dir, generate)
    assert_generate_matches(ref["probe"].completions, got, model, f"Helix KVP {kvp} EAGLE")
    assert assert_speculated(got, f"Helix KVP {kvp} EAGLE") > 1.5
    assert counts(got) == counts(plain)
    assert_every_rank_back(before, after, 4)


def tree_args(args: list, topk: int = 2, draft_tokens: int = 6) -> list:
    """``args`` with a tree draft: ``topk`` branches, ``draft_tokens`` verified per step."""
    args = list(args)
    args[args.index("--speculative-eagle-topk") + 1] = str(topk)
    args[args.index("--speculative-num-draft-tokens") + 1] = str(draft_tokens)
    return args


@pytest.mark.e2e
@pytest.mark.parametrize(
    "kvp, backend",
    # (KVP 2 on torch_native: FULL since 2026-11-27, for CI time; the default run's tree server is
    # test_helix_standalone_serves_plain_tp_tokens[tree], the same tree with the mixed workload)
    [pytest.param(2, BACKEND, marks=FULL), pytest.param(4, BACKEND, marks=FULL), pytest.param(2, "triton", marks=FULL)],
)
def test_helix_tree_draft_serves_plain_tp_tokens(model_dir, server_log_dir, kvp, backend):
    """A tree draft (STANDALONE, top-k 2, 6 tokens verified per step) under Helix: each rank applies
    the verify's tree mask to the keys it owns, draft branches start on their own KV page (so a
    branch's keys keep their owners), and the accepted path moves to the front of the verify window
    across ranks (``kv_move``). Plain TP's tokens and logprobs; per prompt the verifies and accepted
    drafts of plain TP + the same tree; every rank's KV back after the run. Triton (interpreted,
    full tier): the draft steps' lists from two runs per token, the verify's owned tree keys by the
    mask's columns."""
    ref = reference(model_dir, server_log_dir)
    model = model_dir(GQA)
    args = tree_args(helix_spec_args("STANDALONE", model, kvp))
    got, before, after = run_checked(model, args, server_log_dir, generate, backend)
    assert_generate_matches(ref["probe"].completions, got, model, f"Helix KVP {kvp} tree")
    assert assert_speculated(got, f"Helix KVP {kvp} tree") > 1.5
    plain_tree = run_workload(model, tree_args(spec_args("STANDALONE", model)), BACKEND, server_log_dir, generate)
    assert_generate_matches(ref["probe"].completions, plain_tree, model, "plain TP tree")
    assert counts(got) == counts(plain_tree)
    assert_every_rank_back(before, after, 4)


@pytest.mark.e2e
@FULL  # (the default run's 37.4 min left no room for its two servers; the tree server is the default run's tree verify)
@pytest.mark.parametrize("kvp, backend", [(2, BACKEND), (4, BACKEND)])
def test_helix_ngram_serves_plain_tp_tokens(model_dir, server_log_dir, kvp, backend):
    """NGRAM (no draft model; upstream's n-gram corpus proposes trees of up to 6 tokens from the
    tokens it has seen; the batch runs twice, so the second round's drafts are accepted: they are
    round 1's answers to the same prompts, read back from the corpus, so the accept length above
    1.5 proves the verify accepts and moves a correct tree path, not that NGRAM predicts) under
    Helix at the default chunk (64: NGRAM's tree on a paged
    pool): the verify takes the tree path (tree mask by owner, accepted path moved across ranks).
    Plain TP's tokens and logprobs; per prompt the verifies and accepted drafts of plain TP + NGRAM
    (the corpus sees the same tokens); every rank's KV back after the run."""
    ref = reference(model_dir, server_log_dir)
    model = model_dir(GQA)
    got, before, after = run_checked(model, ngram_args() + ["--helix-kvp-size", str(kvp)], server_log_dir, ngram_run, backend)
    assert assert_ngram_run(ref["probe"].completions, got, model, f"Helix KVP {kvp} NGRAM") > 1.5
    plain = run_workload(model, ngram_args(), BACKEND, server_log_dir, ngram_run)
    assert [counts(got[r]) for r in ("first", "second")] == [counts(plain[r]) for r in ("first", "second")]
    assert_every_rank_back(before, after, 4)


@pytest.mark.e2e
@FULL
def test_helix_kvp4_standalone_serves_plain_tp_tokens(model_dir, server_log_dir):
    """KVP 4 x TPA 1: four owners per verify window of 4 tokens with chunk 4."""
    ref = reference(model_dir, server_log_dir)
    model = model_dir(GQA)
    got, before, after = run_checked(model, helix_spec_args("STANDALONE", model, 4), server_log_dir, generate)
    assert_generate_matches(ref["probe"].completions, got, model, "Helix KVP 4 STANDALONE")
    assert assert_speculated(got, "Helix KVP 4 STANDALONE") >= STANDALONE_CHAIN_FLOOR
    assert_every_rank_back(before, after, 4)



def triton_run(base_url: str) -> dict:
    """Interpreted Triton: the batched ``/generate``, the ~300-token prompt and a sampled request."""
    return {"generate": generate(base_url), "long": long_completion(base_url), "sampled": sampled(base_url)}


@pytest.mark.e2e
@FULL
@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE"])
def test_helix_triton_serves_plain_tp_tokens(model_dir, server_log_dir, eagle_draft, algorithm):
    """Triton (kernels interpreted, ~10 min a server): the verify is the three-call extend over
    the owned keys, each draft step's decode lists end at its position (built by its step
    backend's ``init_forward_metadata`` before the steps run). Plain TP's tokens and logprobs, the target-as-draft's verifies and accepted drafts per
    prompt equal to plain TP + the same speculation's, every rank's KV back."""
    ref = reference(model_dir, server_log_dir)
    model = model_dir(GQA)
    draft = model if algorithm == "STANDALONE" else eagle_draft
    got, before, after = run_checked(model, helix_spec_args(algorithm, draft, 2), server_log_dir, triton_run, "triton")
    what = f"Helix triton {algorithm}"
    assert_generate_matches(ref["probe"].completions, got["generate"], model, what)
    assert_same_generation(ref["long"], got["long"], LOGPROB_ATOL, what + " long prompt")
    length = assert_speculated(got["generate"], what)
    floor_ok = length >= STANDALONE_CHAIN_FLOOR if algorithm == "STANDALONE" else length > 1.5  # EAGLE: the fitted head
    assert floor_ok, f"{what}: accept length {length:.2f}"
    for r in got["sampled"]:
        assert r["meta_info"]["completion_tokens"] == 12 and r["meta_info"].get("spec_verify_ct", 0) > 0, r["meta_info"]
    plain_spec = run_workload(model, spec_args(algorithm, draft), BACKEND, server_log_dir, generate)
    assert counts(got["generate"]) == counts(plain_spec)
    assert_every_rank_back(before, after, 4)
