"""Helix servers whose sizes the Helix step resolves, against plain TP (real servers on the CPU).

Helix allocates KV in pages of ``--helix-kvp-chunk-size x --helix-kvp-size`` tokens, a page the
user never sets; sizes that must be counted in it are resolved (srt/arg_groups/helix_hook.py):

- ``--tp 4 --helix-kvp-size 4 --chunked-prefill-size 128``: page 256; the chunk is raised to one
  page, so the ~330-token long prompt is prefilled in two chunks (256 + the rest).
- ``--tp 2 --helix-kvp-size 2 --helix-kvp-chunk-size 96``: page 192; the default chunked prefill
  4096 becomes 4032, max prefill tokens 16384 becomes 16512.

Both used to end at launch in ``AssertionError: chunked_prefill_size must be divisible by
page_size``. And the CPU engine's MLP padding under Helix (the CPU-engine patch pads for TPA, the MLP
stays sharded over N): intermediate_size 130 at ``--tp 4 --helix-kvp-size 2`` is padded for
TPA 2 to 192, which --tp 4 divides, so it is served (what does not divide is refused at
argument time: test_helix_args.py).

Each server must start, log the resolved sizes, and give plain TP's greedy tokens and logprobs.
"""

import pytest

from conftest import FULL, GQA, plain_tp_reference, run_workload, start_server, stop_server
from sglang_helix.testing.openai_probe import (
    LOGPROB_ATOL,
    assert_same_generation,
    assert_same_probe,
    long_completion,
    probe,
)
from sglang_helix.testing.tiny_models import TinyModelSpec

MLP130 = TinyModelSpec(num_heads=8, num_kv_heads=4, head_dim=16, num_layers=2, intermediate_size=130)

CASES = {
    # id: (model, --tp, Helix flags, lines the server log must hold)
    "kvp4-chunked-prefill-128": (
        GQA, 4, ["--helix-kvp-size", "4", "--chunked-prefill-size", "128"],
        ["--chunked-prefill-size 128 -> 256", "chunked_prefill_size=256, max_prefill_tokens=16384"],
    ),
    "kvp2-chunk-96": (
        GQA, 2, ["--helix-kvp-size", "2", "--helix-kvp-chunk-size", "96"],
        ["--chunked-prefill-size 4096 -> 4032", "chunked_prefill_size=4032, max_prefill_tokens=16384"],
    ),
    "cpu-mlp-padding": (MLP130, 4, ["--helix-kvp-size", "2"], []),  # MLP padded for --tp 4, heads for TPA 2
}  # fmt: skip


@pytest.mark.e2e
# All three with HELIX_TEST_FULL=1 (~75 s each); the default run resolves the whole table through
# the real pipeline without servers (test_helix_args.py::test_page_multiples_resolve).
@pytest.mark.parametrize("case", [pytest.param(c, marks=FULL) for c in CASES])
def test_helix_resolved_sizes_serve_like_plain_tp(model_dir, server_log_dir, case):
    spec, tp, helix_args, log_lines = CASES[case]
    model = model_dir(spec)
    ref = run_workload(model, ["--tp", str(tp)], "torch_native", server_log_dir, plain_tp_reference)
    srv = start_server(model, ["--tp", str(tp), *helix_args], "torch_native", server_log_dir)
    try:
        got_probe, got_long = probe(srv.base_url), long_completion(srv.base_url)
        log = srv.log_text()
    finally:
        stop_server(srv)
    for line in log_lines:
        assert line in log, f"{case}: {line!r} not in the server log {srv.log_path}"
    assert_same_probe(ref["probe"], got_probe, LOGPROB_ATOL, case)
    assert_same_generation(ref["long"], got_long, LOGPROB_ATOL, f"{case} long prompt")
