"""The soak's pure logic: the request mix, the comparison, the verdict (no server)."""

from copy import deepcopy

from sglang_helix.testing import soak
from sglang_helix.testing.openai_probe import Generation

CONTEXT, POOL = 8192, 4096


def test_requests_are_reproducible_and_cover_every_kind():
    a = soak.make_requests(400, seed=5, context_len=CONTEXT, pool_tokens=POOL)
    assert a == soak.make_requests(400, seed=5, context_len=CONTEXT, pool_tokens=POOL)
    assert a != soak.make_requests(400, seed=6, context_len=CONTEXT, pool_tokens=POOL)
    assert {r.kind for r in a} == set(soak.KINDS)
    for r in a:
        n = len(r.prompt)
        if r.kind == "over_context":
            assert n >= CONTEXT
        elif r.kind == "over_pool":
            assert POOL < n < CONTEXT
        elif r.kind.startswith("chat"):
            assert r.text and not r.prompt
        else:
            assert 1 <= n <= POOL * 0.85 and 1 <= r.max_tokens <= 300
    assert any(r.n > 1 for r in a) and any(r.stop for r in a)
    assert max(len(r.prompt) for r in a if r.kind not in ("over_context", "over_pool")) > 2000
    # a third of the prompts start with one of the shared prefixes
    starts = [r.prompt[:32] for r in a if len(r.prompt) >= 32]
    assert max(starts.count(s) for s in starts) > len(a) // 20


def _outcome(lps=(-0.1, -0.2), finish="length", text="ab"):
    gen = Generation(text, ["a", "b"], list(lps), [[lp, lp - 2.0] for lp in lps])
    return soak.Outcome(status=200, finish=[finish], gens=[gen], texts=[text])


def test_compare_flags_every_kind_of_difference():
    req = soak.Request(0, "completion", prompt=(11, 12), max_tokens=2)
    ref = _outcome()
    assert soak.compare([req], [ref], [deepcopy(ref)]) == []
    moved = _outcome(lps=(-0.1, -0.2 + 1e-3))
    assert "logprob" in soak.compare([req], [ref], [moved])[0][2]
    assert "choices" in soak.compare([req], [ref], [soak.Outcome(200)])[0][2]
    other_text = _outcome(text="ac")
    assert "decisive throughout" in soak.compare([req], [ref], [other_text])[0][2]
    err = soak.Outcome(400, error="Input length (5000 tokens) exceeds the maximum allowed length (4090 tokens).")
    assert soak.compare([req], [err], [deepcopy(err)]) == []
    assert soak.compare([req], [err], [soak.Outcome(400, error="something else")])
    assert soak.compare([req], [ref], [err])
    # interrupted requests: only an answer is required
    cut = soak.Request(1, "disconnect", prompt=(11,), max_tokens=9, cut_after=2)
    assert soak.compare([cut], [ref], [soak.Outcome(200, note="closed after 2 chunks")]) == []


def _report(after=(4096, 3968, 128), low=0, retractions=0, fired=()):
    req = soak.Request(0, "completion", prompt=(11, 12), max_tokens=2)
    busy_start = {r: [(4096, 3968, 128)] for r in range(4)}
    busy_during = {r: [(4096, low, 0)] for r in range(4)}
    busy_after = {r: [after] for r in range(4)}
    return {
        "requests": [req], "reference": [_outcome()], "outcomes": [_outcome()], "wall_s": 1.0, "healthy": True,
        "fired": list(fired), "retractions": retractions, "busy": [busy_start, busy_during, busy_after],
    }  # fmt: skip


def test_failures_flags_leaks_and_an_idle_pool():
    assert soak.failures(_report(), 4) == []
    assert any("after the soak" in f for f in soak.failures(_report(after=(4096, 3840, 128)), 4))
    assert any("never ran low" in f for f in soak.failures(_report(low=4000), 4))
    assert soak.failures(_report(low=4000, retractions=2), 4) == []
    assert any("KV check fired" in f for f in soak.failures(_report(fired=["TP1] Scheduler hit an exception"]), 4))
    bad = _report()
    bad["outcomes"] = [soak.Outcome(0, error="TimeoutError")]
    assert any("no answer" in f for f in soak.failures(bad, 4))


def test_a_short_soak_still_has_every_kind():
    a = soak.make_requests(len(soak.KINDS), seed=1, context_len=CONTEXT, pool_tokens=POOL)
    assert sorted(r.kind for r in a) == sorted(soak.KINDS)


def test_openai_streams_are_judged_by_their_text():
    """Upstream's streamed logprobs skip tokens whose text is held back (incomplete UTF-8), and
    which ones depends on chunk timing: two streams of one answer may record different steps."""
    req = soak.Request(0, "chat_stream", text="river stone", max_tokens=3)
    ref = soak.Outcome(200, finish=["length"], gens=[Generation("ab\ufffd", ["a", "b"], [-0.1, -0.2], [[-0.1, -3.0], [-0.2, -2.0]])], texts=["ab\ufffd"])
    got = soak.Outcome(200, finish=["length"], gens=[Generation("ab\ufffd", ["a", "\ufffd"], [-0.1, -0.4], [[-0.1, -3.0], [-0.4, -2.0]])], texts=["ab\ufffd"])
    assert soak.compare([req], [ref], [got]) == []
    got.texts = ["ac"]
    assert "streamed" in soak.compare([req], [ref], [got])[0][2]
    ref.gens[0].top2[1] = [-0.2, -0.2005]  # an indecisive reference step: the texts may differ
    assert soak.compare([req], [ref], [got]) == []


def test_ranks_disagree_finds_the_rank_and_the_batch():
    from sglang_helix.testing.kv_checks import ranks_disagree

    def log(available: dict) -> str:  # {rank: [available at batch 0, 1, ...]}, ranks interleaved
        line = "[2026-12-06 10:19:16 TP{}] [Mem Check (BUSY)] [full] total=256, available={}, evictable=0, uncached=4, x=1"
        rows = [(k, r, a) for r, seq in available.items() for k, a in enumerate(seq)]
        return "\n".join(line.format(r, a) for k, r, a in sorted(rows, key=lambda t: (t[0], -t[1])))

    assert ranks_disagree(log({r: [248, 200, 248] for r in range(4)})) == []
    kept = {0: [248, 200, 248], 1: [248, 200, 248], 2: [248, 192, 240], 3: [248, 200, 248]}
    assert ranks_disagree(log(kept)) == ["TP2: busy check 1 (total, available, uncached) = (256, 192, 4), TP0's (256, 200, 4)"]
    assert ranks_disagree(log({0: [248, 200, 248], 1: [248, 200]})) == ["TP1: 2 busy checks, TP0: 3"]
