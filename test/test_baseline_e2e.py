"""Baseline: plain TP through the OpenAI API, the reference every Helix test compares to.

--tp 2/4 torch_native and --tp 1/2/4 triton (TRITON_INTERPRET=1) must give the same greedy tokens as
--tp 1 torch_native (the reference) and per-token logprobs (and top-2 logprobs) within
LOGPROB_ATOL (1e-4 nats, float32; plus 2^-15 |logprob|), for batched completions, a streamed completion, a chat
completion and a streamed chat completion.

The reference layout itself is not a case: ``run_workload`` caches per (model, args, backend,
workload), so "--tp 1 torch_native against --tp 1 torch_native" read the same cached result twice and
could fail only on length (removed 2026-11-27, issue 48). The reference is checked against an
independent server, the pristine 0.5.23 wheel at ``--tp 1``, by ``test_kvp1_pristine.py``
(``tp1-wheel``, default tier), and its lengths here.
"""

import pytest

from conftest import FULL, GQA, plain_tp_reference, run_workload
from sglang_helix.testing.openai_probe import LOGPROB_ATOL, assert_same_generation, assert_same_probe

REFERENCE = (1, "torch_native")
LAYOUTS = [(2, "torch_native"), (4, "torch_native"), (1, "triton"), (2, "triton"), (4, "triton")]  # not REFERENCE
# The default run: --tp 4 (the reference of the Helix tests); the rest with HELIX_TEST_FULL=1.
PARAMS = [pytest.param(t, b, id=f"tp{t}-{b}", marks=() if (t, b) == (4, "torch_native") else FULL) for t, b in LAYOUTS]


def run_layout(model_path, tp, backend, log_dir):
    # The same workload (and so the same cached servers) the Helix tests compare with.
    return run_workload(model_path, ["--tp", str(tp)], backend, log_dir, plain_tp_reference)


@pytest.mark.e2e
@pytest.mark.parametrize("tp,backend", PARAMS)
def test_layout_matches_tp1(model_dir, server_log_dir, tp, backend):
    ref = run_layout(model_dir(GQA), *REFERENCE, server_log_dir)
    got = run_layout(model_dir(GQA), tp, backend, server_log_dir)
    what = f"tp{tp}/{backend}"
    assert got is not ref, "a layout compared with the cached reference itself"
    for result in (ref, got):
        assert len(result["probe"].completions) == 4 and all(len(g.tokens) == 16 for g in result["probe"].completions)
    assert_same_probe(ref["probe"], got["probe"], LOGPROB_ATOL, what)
    assert_same_generation(ref["long"], got["long"], LOGPROB_ATOL, f"{what} long prompt")
    for i, (r, g) in enumerate(zip(ref["singles"], got["singles"])):
        assert_same_generation(r, g, LOGPROB_ATOL, f"{what} prompt {i}")


def test_comparison_detects_a_perturbed_logprob():
    """The comparison itself can fail: a logprob moved by 10x the tolerance is caught."""
    from copy import deepcopy

    from sglang_helix.testing.openai_probe import Generation, assert_same_generation

    ref = Generation("ab", ["a", "b"], [-0.1, -0.2], [[-0.1, -3.0], [-0.2, -2.0]])
    bad = deepcopy(ref)
    bad.logprobs[1] += 10 * LOGPROB_ATOL
    with pytest.raises(AssertionError, match="step 1 logprob"):
        assert_same_generation(ref, bad)
    far = deepcopy(ref)  # a runner-up 3 nats down may move by 1e-4 + 3 * 2^-15, no more
    far.top2[0][1] += 1e-4 + 3.0 * 2**-15 + 1e-6
    with pytest.raises(AssertionError, match="step 0 top-2"):
        assert_same_generation(ref, far)
    far.top2[0][1] -= 2e-6
    assert_same_generation(ref, far)
    other = deepcopy(ref)
    other.tokens[0] = "c"
    with pytest.raises(AssertionError, match="tokens differ"):
        assert_same_generation(ref, other)
