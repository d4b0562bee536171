"""Prefix reuse (the radix cache) under Helix, against plain TP with its radix cache on.

The allocator hands every rank the same logical KV ids, in pages of ``P = chunk x KVP`` ids with
``loc % P == position % P`` (docs/helix-design.md, section 2). A radix-cache match is a run of whole
pages from position 0, so a reused page sits at the same positions in the new request as in the
one that stored it: every rank's ownership of it, and its physical rows, are unchanged. Matching,
insertion, eviction, locking and release run on each rank's identical tree over identical ids, so
they stay identical on all ranks. Reuse granularity: one page (``P`` tokens; 128 at the default
chunk and KVP 2): a prompt reuses the longest cached prefix that is a whole number of pages.

One Helix server (``--tp 2 --helix-kvp-size 2 --helix-kvp-chunk-size 4``: P = 8,
``--chunked-prefill-size 64``) with a KV pool of 192 rows per rank (384 ids), too small to keep
everything, and upstream's KV debug checks on (the leak test's: double free, use after free, and
``available + evictable + uncached == total`` after every batch and when idle), runs, in order:

1. one ~250-token document, then four questions on it, one after the other: every question after
   the first reports the document's whole pages as cached prompt tokens (``cached_tokens``);
2. a six-turn chat, each turn sending the whole history: turns 2-6 report cached tokens;
3. eight concurrent requests sharing a ~130-token prefix;
4. three more documents, which evict the first one's pages; then the first question again
   (recomputed, or what is left of it reused);
5. ``/flush_cache``, and a last question: nothing cached.

Every answer (greedy tokens and logprobs) must equal plain ``--tp 2``'s, whose pool is large;
reuse is exactly plain TP's rounded down to whole pages (measured: 256 of a 257-token common
prefix, chat turns 32/48/64/88/120 where plain TP reuses 34/52/70/92/121); no KV check may fire
on any rank; after a last flush every rank's free count is back to its initial value (the first
request after startup and the first after the flush see the same counts).
HELIX_TEST_FULL=1 (both backends); the default run's prefix-reuse check is test_helix_soak.py.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import FULL, KV2, run_workload, start_server, stop_server
from sglang_helix.testing.openai_probe import (
    LOGPROB_ATOL,
    Generation,
    _client,
    _top2,
    assert_same_generation,
    chat_response,
)
from test_helix_kv_leak import DEBUG_ENV, LEAK_PATTERNS, _busy_counts, _get, _wait_idle

TP, KVP, CHUNK = 2, 2, 4
PAGE = CHUNK * KVP
ROWS_PER_RANK = 192
HELIX_ARGS = [
    "--tp", str(TP), "--helix-kvp-size", str(KVP), "--helix-kvp-chunk-size", str(CHUNK),
    "--chunked-prefill-size", "64", "--max-total-tokens", str(ROWS_PER_RANK), "--enable-cache-report",
]  # fmt: skip
PLAIN_ARGS = ["--tp", str(TP), "--enable-cache-report"]

_WORDS = (
    "the river ran past the old mill where the miller kept his stones and the village children "
    "came each morning to watch the great wheel turn in the cold clear water of the north"
).split()


def _text(n_words: int, seed: int) -> str:
    return " ".join(_WORDS[(i * 7 + seed * 13 + i // 5) % len(_WORDS)] for i in range(n_words))


DOCS = [_text(100, seed) for seed in range(4)]
QUESTIONS = ["\nquestion: who kept the stones", "\nquestion: when did the children come",
             "\nquestion: what turned in the water", "\nquestion: where was the mill"]  # fmt: skip
SHARED = _text(50, 9)
TURNS = ["tell me about the mill", "and the wheel", "who came to watch", "in the morning",
         "was the water cold", "thank you"]  # fmt: skip


def _complete(client, prompt: str, max_tokens: int = 8):
    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    c, lp = r.choices[0], r.choices[0].logprobs
    gen = Generation(c.text, list(lp.tokens), list(lp.token_logprobs), [_top2(t) for t in lp.top_logprobs])
    return gen, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def _chat(client, messages, max_tokens: int = 8):
    gen, r = chat_response(client, messages, max_tokens)
    return gen, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def prefix_workload(base_url: str) -> dict:
    client = _client(base_url)
    out = {"doc": [_complete(client, DOCS[0] + q) for q in QUESTIONS]}
    messages, out["chat"] = [{"role": "system", "content": "you are a tiny model"}], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        gen, prompt_tokens, cached = _chat(client, messages)
        out["chat"].append((gen, prompt_tokens, cached))
        messages.append({"role": "assistant", "content": gen.text})
    with ThreadPoolExecutor(8) as pool:
        out["shared"] = list(pool.map(lambda i: _complete(client, SHARED + f" {_WORDS[i]} {i}"), range(8)))
    out["evict"] = [_complete(client, doc + QUESTIONS[0]) for doc in DOCS[1:]]
    out["again"] = _complete(client, DOCS[0] + QUESTIONS[1])
    _flush(base_url)
    out["flushed"] = _complete(client, DOCS[0] + QUESTIONS[2])
    return out


def _flush(base_url: str) -> None:
    req = urllib.request.Request(base_url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200, r.status


def _pairs(out: dict):
    yield from ((f"document question {i}", x) for i, x in enumerate(out["doc"]))
    yield from ((f"chat turn {i}", x) for i, x in enumerate(out["chat"]))
    yield from ((f"shared-prefix request {i}", x) for i, x in enumerate(out["shared"]))
    yield from ((f"eviction document {i}", x) for i, x in enumerate(out["evict"]))
    yield "first document after eviction", out["again"]
    yield "after /flush_cache", out["flushed"]


@pytest.mark.e2e
# HELIX_TEST_FULL=1 (both backends): the default run's prefix-reuse check is the soak
# (test_helix_soak.py: shared prefixes hit the cache, every answer compared with plain TP).
@pytest.mark.parametrize("backend", [pytest.param("torch_native", marks=FULL), pytest.param("triton", marks=FULL)])
def test_prefix_reuse_matches_plain_tp(model_dir, server_log_dir, backend):
    model = model_dir(KV2)
    ref = run_workload(model, PLAIN_ARGS, "torch_native", server_log_dir, prefix_workload)

    srv = start_server(model, HELIX_ARGS, backend, server_log_dir, extra_env=DEBUG_ENV)
    try:
        _wait_idle(srv.base_url)
        got = prefix_workload(srv.base_url)
        _wait_idle(srv.base_url)
        _flush(srv.base_url)  # the last request's pages went back into the tree
        time.sleep(2.0)  # idle-loop checks on every rank
        mark = os.path.getsize(srv.log_path)
        assert _get(srv.base_url, "/health_generate")[0] == 200  # as at startup: one page
        _wait_idle(srv.base_url)
        assert srv.proc.poll() is None, "server died\n" + srv.log_tail()
    finally:
        with open(srv.log_path, "rb") as f:
            raw = f.read()
        stop_server(srv)
    log = raw.decode(errors="replace")
    fired = [line for line in log.splitlines() if any(p in line for p in LEAK_PATTERNS)]
    assert not fired, "a KV pool check fired in the server:\n" + "\n".join(fired)[:4000]

    # Every answer equals plain TP's.
    for (what, (r, r_prompt, _)), (_, (g, g_prompt, _)) in zip(_pairs(ref), _pairs(got)):
        assert g_prompt == r_prompt, f"{what}: prompt tokens {g_prompt} vs {r_prompt}"
        assert_same_generation(r, g, LOGPROB_ATOL, f"{backend} {what}")

    # Reuse: whole pages of what plain TP (page 1) reuses, short of the request's last token.
    cached = {what: (g_cached, r_cached, g_prompt) for (what, (_, _, r_cached)), (_, (_, g_prompt, g_cached)) in zip(_pairs(ref), _pairs(got))}
    print("cached tokens (helix, plain, prompt):", json.dumps(cached))
    for i in (1, 2, 3):
        g_cached, r_cached, prompt_tokens = cached[f"document question {i}"]
        assert r_cached >= 0.85 * prompt_tokens, f"plain TP did not reuse the document: {cached}"
        assert g_cached == r_cached // PAGE * PAGE, f"question {i}: Helix reused {g_cached}, plain {r_cached}"
    for i in range(1, len(TURNS)):
        g_cached, r_cached, _ = cached[f"chat turn {i}"]
        assert g_cached == r_cached // PAGE * PAGE and g_cached > 0, f"chat turn {i}: {g_cached} vs plain {r_cached}"
    assert cached["after /flush_cache"][:2] == (0, 0), cached["after /flush_cache"]
    # The three other documents did not fit next to the first: its pages were evicted (plain TP,
    # with its large pool, still had them all), and the answer was recomputed, equal.
    assert cached["first document after eviction"][0] < cached["document question 1"][0], cached

    # After the flush every rank's pool is as at startup: the first busy check after startup (the
    # health check's one page) and the first after the flush (one page) see the same counts.
    before, after = _busy_counts(raw[:mark].decode(errors="replace")), _busy_counts(raw[mark:].decode(errors="replace"))
    assert sorted(before) == sorted(after) == list(range(TP)), (sorted(before), sorted(after))
    for rank in range(TP):
        first, again = before[rank][0], after[rank][0]
        assert again == first, f"TP{rank}: after the flush (total, available, uncached) = {again}, at startup {first}"
        assert min(a for _, a, _ in before[rank]) < ROWS_PER_RANK * KVP // 4, f"TP{rank}: the pool never ran low"
