"""The hybrid Qwen3.5 on the CPU harness, served by the real server, against transformers.

Tiny Qwen3.5 checkpoints (``sglang_helix.testing.qwen3_5_models``: 3 Gated DeltaNet layers to 1
gated full-attention layer, partial rotary 0.25, 2 KV heads) are served at plain ``--tp N`` on
``torch_native``, float32. The linear-attention layers run through the stub's torch versions of
the sgl-kernel CPU ops (``sgl_kernel/qwen3_5_cpu_ops.py``); the gated RMSNorm and the MoE
shared-expert gate through the series' "[CPU] Qwen3.5 without AMX" patch (0.5.23 runs Triton
kernels there on a CPU without AMX). One batched ``/generate`` request (token ids, greedy,
``return_logprob`` from position 0, top-2) over prompts of 1, 5, 13 and 150 tokens (the last spans
three GDN chunks of 64), then the same request again (new pool slots: no state of the first round
may leak into them; the ``no_buffer`` mamba radix cache reports no hit for these prompts). The
reference is transformers' own float32 forward on the same directory (its torch fallbacks:
``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``) over each prompt followed by the server's
tokens:

- every prompt logprob, and every output step's logprob, within ``ATOL + RTOL * |lp|``;
- every output token is transformers' argmax, unless transformers' own top-1/top-2 margin is below
  ``MARGIN`` (a near tie, which float32 rounding may flip);
- the second round serves the same tokens and logprobs.

So the prefill GDN path (``chunk_gated_delta_rule_cpu``, ``causal_conv1d_fwd_cpu``) and the
decode path (``fused_sigmoid_gating_delta_rule_update_cpu``, ``causal_conv1d_update_cpu``) are both
held to transformers, across the prefill-to-decode state hand-over. ``--tp 4`` is compared with
``--tp 1`` the same way (tokens within ``--tp 1``'s decisive prefix, logprobs within the bound) and
with transformers, and runs with ``--chunked-prefill-size 96``: the long prompt is served in two
extends (96 + 73 tokens of the batch), the second starting from the conv and recurrent states the
first left in the pool. The MoE model (routed experts + gated shared expert) is compared with
transformers at ``--tp 4`` (``--tp 1`` in the full tier, with dense ``--tp 2`` against ``--tp 1``).

Tolerance, measured 2026-11-29 on this machine: against transformers, prompt logprobs (magnitudes
~30-90 nats on random weights) differ by at most 7.2e-5 (dense ``--tp 1``), 9.9e-5 (dense ``--tp
4``), 6.5e-5 (MoE ``--tp 4``): ~1e-6 relative, float32 sums of a few hundred terms in another
order (the chunked delta rule solves its triangular system differently from transformers'); output
logprobs by at most 1.9e-5 / 1.7e-5 / 2.7e-5; ``--tp 4`` against ``--tp 1`` 1.1e-4 / 1.5e-5. With
``ATOL = 2e-4`` and ``RTOL = 2**-14`` (6e-5 relative) the largest difference used 0.10 of its
bound. A wrong gate, a dropped state update or decay, or a lost initial state moves logprobs by
0.5-5 nats or changes the greedy token (the mutations in docs/cpu-harness.md).

Server settings (docs/cpu-harness.md, "Qwen3.5"): ``SGLANG_MAMBA_CONV_DTYPE=float32`` (SGLang
keeps the conv state in bfloat16 by default, even for a float32 model: 3e-2 nats off transformers
after 6 decode steps) and ``--max-mamba-cache-size 64`` (the state pool is otherwise sized from
system memory in every rank: 8.9 GB at ``--tp 1``, an OOM kill at ``--tp 4``); otherwise the
defaults, overlap scheduling resolving off with the ``no_buffer`` radix cache (the series' "[CPU]
Hybrid models" patch: 0.5.23 asserted at start).
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from conftest import FULL, start_server, stop_server

from sglang_helix.testing.qwen3_5_models import DENSE

SERVER_ARGS = ["--max-mamba-cache-size", "64"]
SERVER_ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}
PROMPT_LENS = (1, 5, 13, 150)
NEW_TOKENS = 8
MARGIN = 1e-3
ATOL = 2e-4
RTOL = 2.0**-14


def prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(35)
    return [
        torch.randint(7, DENSE.vocab_size, (n,), generator=g).tolist()
        for n in PROMPT_LENS
    ]


def _post(base_url: str, payload: dict) -> list:
    req = urllib.request.Request(
        base_url + "/generate",
        json.dumps(payload).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def _round(base_url: str, meta_keys: tuple = ()) -> list[dict]:
    """One batched request over ``prompts()``; ``meta_keys``: meta_info fields kept as ``meta``."""
    payload = {
        "input_ids": prompts(),
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": NEW_TOKENS,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    out = []
    for item in _post(base_url, payload):
        meta = item["meta_info"]
        out.append(
            {
                "prompt_lp": [lp for lp, _, _ in meta["input_token_logprobs"][1:]],
                "ids": [t for _, t, _ in meta["output_token_logprobs"]],
                "lp": [lp for lp, _, _ in meta["output_token_logprobs"]],
                "top2": [
                    [lp for lp, _, _ in step] for step in meta["output_top_logprobs"]
                ],
                "cached": meta.get("cached_tokens", 0),
            }
        )
        if meta_keys:
            out[-1]["meta"] = {k: meta.get(k) for k in meta_keys}
    return out


def workload(base_url: str, meta_keys: tuple = ()) -> dict:
    return {"first": _round(base_url, meta_keys), "again": _round(base_url, meta_keys)}


_RESULTS: dict = {}


def serve(model_path: str, tp: int, log_dir: str, extra_args=()) -> dict:
    """The workload's results at ``--tp tp`` (one server per layout and session)."""
    key = (model_path, tp, tuple(extra_args))
    if key not in _RESULTS:
        args = ["--tp", str(tp), *SERVER_ARGS, *extra_args]
        srv = start_server(model_path, args, "torch_native", log_dir, SERVER_ENV)
        try:
            _RESULTS[key] = workload(srv.base_url)
        finally:
            stop_server(srv)
    return _RESULTS[key]


def hf_reference(model_path: str, results: list[dict]) -> list[dict]:
    """transformers' float32 logprobs over each prompt followed by the served tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    refs = []
    for prompt, res in zip(prompts(), results):
        ids = torch.tensor([prompt + res["ids"]])
        with torch.no_grad():
            lp = model(ids).logits[0].float().log_softmax(-1)
        n = len(prompt)
        steps = lp[n - 1 : n - 1 + len(res["ids"])]
        top2 = steps.topk(2, dim=-1)
        refs.append(
            {
                "prompt_lp": [lp[i - 1, prompt[i]].item() for i in range(1, n)],
                "lp": [steps[j, t].item() for j, t in enumerate(res["ids"])],
                "argmax": top2.indices[:, 0].tolist(),
                "margin": (top2.values[:, 0] - top2.values[:, 1]).tolist(),
            }
        )
    return refs


def _bound(ref: float) -> float:
    return ATOL + RTOL * abs(ref)


class Worst:
    """The largest differences seen, for the record: prompt / output logprobs, and the largest
    fraction of the bound used."""

    def __init__(self):
        self.prompt = self.output = self.of_bound = 0.0

    def add(self, kind: str, got: float, want: float) -> bool:
        d = abs(got - want)
        setattr(self, kind, max(getattr(self, kind), d))
        self.of_bound = max(self.of_bound, d / _bound(want))
        return d <= _bound(want)

    def __str__(self):
        return f"prompt {self.prompt:.2g}, output {self.output:.2g} nats; {self.of_bound:.2f} of the bound"


def assert_matches_transformers(
    results: list[dict], refs: list[dict], what: str
) -> Worst:
    worst = Worst()
    for i, (res, ref) in enumerate(zip(results, refs)):
        for j, (got, want) in enumerate(zip(res["prompt_lp"], ref["prompt_lp"])):
            assert worst.add(
                "prompt", got, want
            ), f"{what} prompt {i} position {j + 1}: {got} vs transformers {want}"
        for j, (tok, got, want) in enumerate(zip(res["ids"], res["lp"], ref["lp"])):
            assert tok == ref["argmax"][j] or ref["margin"][j] < MARGIN, (
                f"{what} prompt {i} step {j}: served {tok}, transformers' argmax {ref['argmax'][j]} "
                f"(margin {ref['margin'][j]:.3g})\nserved {res['ids']}"
            )
            assert worst.add(
                "output", got, want
            ), f"{what} prompt {i} step {j}: logprob {got} vs transformers {want}"
    return worst


def assert_same_results(ref: list[dict], got: list[dict], what: str) -> Worst:
    worst = Worst()
    for i, (r, g) in enumerate(zip(ref, got)):
        for j, (a, b) in enumerate(zip(r["prompt_lp"], g["prompt_lp"])):
            assert worst.add(
                "prompt", b, a
            ), f"{what} prompt {i} position {j + 1}: {b} vs {a}"
        n = next(
            (k + 1 for k, t in enumerate(r["top2"]) if t[0] - t[1] < MARGIN),
            len(r["ids"]),
        )
        assert (
            g["ids"][:n] == r["ids"][:n]
        ), f"{what} prompt {i}: tokens differ within the decisive prefix ({n})"
        for j in range(n):
            assert worst.add(
                "output", g["lp"][j], r["lp"][j]
            ), f"{what} prompt {i} step {j}: {g['lp'][j]} vs {r['lp'][j]}"
    return worst


def _check_rounds(out: dict, what: str) -> None:
    assert [len(r["ids"]) for r in out["first"]] == [NEW_TOKENS] * len(PROMPT_LENS)
    assert_same_results(out["first"], out["again"], f"{what} second round")


@pytest.mark.e2e
def test_dense_tp1_matches_transformers(qwen3_5_dirs, server_log_dir):
    out = serve(qwen3_5_dirs["dense"], 1, server_log_dir)
    _check_rounds(out, "tp1")
    worst = assert_matches_transformers(
        out["first"], hf_reference(qwen3_5_dirs["dense"], out["first"]), "tp1"
    )
    print(
        f"dense --tp 1 vs transformers: {worst}; cached tokens, second round: {[r['cached'] for r in out['again']]}"
    )


@pytest.mark.e2e
def test_dense_tp4_matches_tp1_and_transformers(qwen3_5_dirs, server_log_dir):
    ref = serve(qwen3_5_dirs["dense"], 1, server_log_dir)
    got = serve(
        qwen3_5_dirs["dense"], 4, server_log_dir, ["--chunked-prefill-size", "96"]
    )
    _check_rounds(got, "tp4")
    worst = assert_same_results(ref["first"], got["first"], "tp4 vs tp1")
    worst_hf = assert_matches_transformers(
        got["first"], hf_reference(qwen3_5_dirs["dense"], got["first"]), "tp4"
    )
    print(f"dense --tp 4 vs --tp 1: {worst}; vs transformers: {worst_hf}")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "tp", [pytest.param(4, id="tp4"), pytest.param(1, id="tp1", marks=FULL)]
)
def test_moe_matches_transformers(qwen3_5_dirs, server_log_dir, tp):
    out = serve(qwen3_5_dirs["moe"], tp, server_log_dir)
    _check_rounds(out, f"moe tp{tp}")
    worst = assert_matches_transformers(
        out["first"], hf_reference(qwen3_5_dirs["moe"], out["first"]), f"moe tp{tp}"
    )
    print(f"moe --tp {tp} vs transformers: {worst}")


@pytest.mark.e2e
@FULL
def test_dense_tp2_matches_tp1(qwen3_5_dirs, server_log_dir):
    ref = serve(qwen3_5_dirs["dense"], 1, server_log_dir)
    got = serve(qwen3_5_dirs["dense"], 2, server_log_dir)
    _check_rounds(got, "tp2")
    assert_same_results(ref["first"], got["first"], "tp2 vs tp1")
