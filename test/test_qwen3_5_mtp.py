"""Qwen3.5's MTP layer as the speculative draft, on plain TP (the CPU harness).

Qwen3.5 checkpoints ship an MTP layer beside the model (``mtp.*``, ``mtp_num_hidden_layers: 1``),
which 0.5.23 serves as the draft of ``--speculative-algorithm NEXTN`` (an alias of EAGLE; with no
``--speculative-draft-model-path`` the draft is the target's own checkpoint, rewritten to
``Qwen3_5ForCausalLMMTP``: ``model_config._config_draft_model``). The tiny checkpoints here are
``test_qwen3_5_harness.py``'s with that layer added (``qwen3_5_models.DENSE_MTP`` / ``MOE_MTP``:
the target's tensors bit for bit the same), an MTP layer that knows the target's greedy
continuation of the workload's prompts for their first ``MTP_KNOWN_STEPS`` tokens and nothing
else: a verify accepts drafts along a known stretch, rejects the first one past it, and so keeps
an accepted prefix's linear-attention states and drops the rest (``_mtp_tensors``).

Each server runs ``test_qwen3_5_harness``'s workload (one batched ``/generate`` over prompts of 1,
5, 13 and 150 tokens, 8 greedy tokens, logprobs from position 0 with top-2, twice) at ``--tp 4``
on torch_native, float32, and must give plain ``--tp 4``'s greedy tokens within its decisive prefix
and every prompt and output logprob within the harness's float32 bound, against that file's plain
``--tp 4`` server on the checkpoint without the layer (the same target; the dense one with
``--chunked-prefill-size 96``, as here: the 150-token prompt is two extends, the second while the
other requests already verify drafts). The drafts must be accepted in part: some verify accepts a
draft, some accepts fewer than all (``meta_info``'s ``spec_correct_drafts_histogram``; the accept
length, ``spec_accept_length``, above 1 for some request and below the maximum for some), the same
in both rounds. With upstream's KV debug checks (``kv_checks.DEBUG_ENV``) every rank checks its KV
pool after every batch and its KV and linear-state (mamba) pools whenever idle (a leak raises);
after the workload the cache is flushed, and every rank's KV pool counts and rank 0's mamba usage
must be back to those at start.

The spec servers keep the radix cache (``no_buffer`` for the linear states, as the baseline): it
serves speculation on the CPU as it is. (These prompts get no prefix hit: ``no_buffer`` keeps
states of whole requests only.)

Cases: the chain (``--speculative-num-steps 3 --speculative-eagle-topk 1
--speculative-num-draft-tokens 4``) on the dense model is the default tier's one server; the full
tier adds the tree (``--speculative-eagle-topk 2 --speculative-num-draft-tokens 4`` with 2 steps:
3 drafts in 2 levels, so the tree always branches), the MoE model's chain and the EAGLE spelling
naming the MTP layer (``--speculative-algorithm EAGLE --speculative-draft-model-path`` the
checkpoint itself).

What 0.5.23 lacks on the CPU, and the harness supplies: the verify's conv and GDN arguments
(``sgl_kernel`` stub, ``qwen3_5_cpu_ops.VERIFY_ARGS``: the real CPU ops take none of them, and
the wrapper raised ``TypeError: causal_conv1d_update_cpu() got an unexpected keyword argument
'intermediate_conv_window'`` in every rank), and the commit of the accepted states after the verify
(series patch 0045: 0.5.23's scatter takes CUDA/XPU tensors only).
"""

from __future__ import annotations

import os
import re
import time

import pytest
import test_helix_qwen3_5 as helix
import test_qwen3_5_harness as harness
from conftest import FULL, start_server, stop_server
from sglang_helix.testing import kv_checks
from sglang_helix.testing.qwen3_5_models import DENSE, MTP_KNOWN_STEPS, mtp_prompts

CHUNKED = helix.CHUNKED
SPEC_META = ("completion_tokens", "spec_verify_ct", "spec_num_correct_drafts", "spec_accept_length",
             "spec_correct_drafts_histogram")  # fmt: skip
MAMBA_USAGE = re.compile(r"TP0\] Prefill batch, .*mamba usage: ([0-9.]+)")


def speculative(algorithm: str, steps: int, topk: int, drafts: int) -> list[str]:
    return ["--speculative-algorithm", algorithm, "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(drafts)]  # fmt: skip


CASES = {  # name: (model, speculation flags (the draft path filled in at run time), drafts a verify checks)
    "dense-chain": ("dense", speculative("NEXTN", 3, 1, 4), 3),
    "dense-tree": ("dense", speculative("NEXTN", 2, 2, 4), 3),
    "dense-eagle": ("dense", [*speculative("EAGLE", 3, 1, 4), "--speculative-draft-model-path"], 3),
    "moe-chain": ("moe", speculative("NEXTN", 3, 1, 4), 3),
}
FULL_TIER = {"dense-tree", "dense-eagle", "moe-chain"}


def test_the_mtp_checkpoint_adds_the_layer_to_the_same_target(qwen3_5_dirs, mtp_dirs):
    """The checkpoint is the plain one (every tensor bit for bit; the stamp of an MTP-less spec
    unchanged) plus the MTP layer in the layout Qwen publishes (what ``qwen3_5_mtp.py`` loads),
    ``mtp_num_hidden_layers`` in the config; its prompts are the harness's."""
    import json

    from safetensors.torch import load_file

    assert mtp_prompts() == harness.prompts()
    plain = load_file(os.path.join(qwen3_5_dirs["dense"], "model.safetensors"))
    path = mtp_dirs("dense")
    both = load_file(os.path.join(path, "model.safetensors"))
    assert all(both[k].equal(t) for k, t in plain.items())
    mtp = sorted(k for k in both if k not in plain)
    assert all(k.startswith("mtp.") for k in mtp)
    layer = "mtp.layers.0."
    assert {k for k in mtp if not k.startswith(layer)} == {
        "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
    }  # fmt: skip
    assert {k[len(layer) :] for k in mtp if k.startswith(layer)} == {
        "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", *(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
    }  # fmt: skip
    h = DENSE.hidden_size
    assert both["mtp.fc.weight"].shape == (h, 2 * h)
    assert both[layer + "self_attn.q_proj.weight"].shape == (2 * DENSE.num_heads * DENSE.head_dim, h)  # + the gate
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["mtp_num_hidden_layers"] == 1
    with open(os.path.join(qwen3_5_dirs["dense"], "tiny_model_spec.json")) as f:
        assert "mtp" not in json.load(f)


_SPEC: dict = {}


def serve_spec_once(model_path: str, args: list, log_dir: str) -> dict:
    """``serve_spec``, one server per layout and session (the plain-TP spec servers are the
    references of the mode's)."""
    key = (model_path, tuple(args))
    if key not in _SPEC:
        _SPEC[key] = serve_spec(model_path, args, log_dir)
    return _SPEC[key]


def serve_spec(model_path: str, args: list, log_dir: str) -> dict:
    """The workload (with the speculation fields of ``meta_info``) on ``--tp 4 args`` with the
    KV debug checks; then the cache flushed, idle, one more request: the results, the checks that
    fired, every rank's (total, available, uncached) and rank 0's mamba usage at start and after."""
    env = {**harness.SERVER_ENV, **kv_checks.DEBUG_ENV}
    t0 = time.monotonic()
    srv = start_server(model_path, ["--tp", "4", *harness.SERVER_ARGS, *args], "torch_native", log_dir, env)
    try:
        started = time.monotonic() - t0
        out = harness.workload(srv.base_url, SPEC_META)
        kv_checks.wait_idle(srv.base_url)
        kv_checks.post(srv.base_url, "/flush_cache", {})
        kv_checks.wait_idle(srv.base_url)
        mark = os.path.getsize(srv.log_path)
        status, _ = kv_checks.get(srv.base_url, "/health_generate")  # a request on the idle server
        kv_checks.wait_idle(srv.base_url)
        time.sleep(2.0)  # several idle-loop checks on every rank
        with open(srv.log_path, "rb") as f:
            raw = f.read()
        log, after = raw.decode(errors="replace"), raw[mark:].decode(errors="replace")
        out.update(
            healthy=status == 200, fired=kv_checks.fired_checks(log), start=kv_checks.busy_counts(log),
            after=kv_checks.busy_counts(after), mamba=[MAMBA_USAGE.findall(t)[:1] for t in (log, after)],
            started=started, seconds=time.monotonic() - t0,
        )  # fmt: skip
    finally:
        stop_server(srv)
    return out


def accept_stats(out: dict, drafts: int, what: str) -> dict:
    """Every request speculated (verify count > 0) to its 8 tokens, the same in both rounds; the
    verifies' accepted-draft counts summed over requests (``hist[k]``: verifies that accepted k
    drafts) and each request's accept length (tokens per verify, the bonus token included)."""
    rounds = [[r["meta"] for r in out[k]] for k in ("first", "again")]
    for metas in rounds:
        for i, m in enumerate(metas):
            assert m["completion_tokens"] == harness.NEW_TOKENS, f"{what} request {i}: {m}"
            assert (m["spec_verify_ct"] or 0) > 0, f"{what} request {i}: no verify ({m})"
    assert rounds[0] == rounds[1], f"{what}: the rounds speculated differently\n{rounds}"
    hist = [0] * (drafts + 1)
    for m in rounds[0]:
        for k, c in enumerate(m["spec_correct_drafts_histogram"]):
            hist[k] += c
    return {"hist": hist, "lengths": [m["spec_accept_length"] for m in rounds[0]]}


def assert_accepts_partially(stats: dict, drafts: int, what: str) -> None:
    """Some verify accepts a draft and some rejects one, and some does both: the committed
    linear-attention states are an accepted prefix's, not every draft's (a chain's verify that
    accepts ``0 < k < drafts`` takes them from the middle of its drafts; a tree's, whose 3 drafts
    span 2 levels, from the accepted path's end, past a rejected sibling's)."""
    hist, lengths = stats["hist"], stats["lengths"]
    assert sum(hist[1:]) > 0 and max(lengths) > 1, f"{what}: no draft accepted: {stats}"
    assert sum(hist[:drafts]) > 0 and min(lengths) < drafts + 1, f"{what}: no draft rejected: {stats}"
    assert sum(hist[1:drafts]) > 0, f"{what}: no verify accepted part of its drafts: {stats}"


@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(k, marks=FULL if k in FULL_TIER else ()) for k in CASES])
def test_mtp_speculation_serves_plain_tps_tokens(qwen3_5_dirs, mtp_dirs, server_log_dir, case):
    model, flags, drafts = CASES[case]
    chunked = CHUNKED if model == "dense" else []
    base = harness.serve(qwen3_5_dirs[model], 4, server_log_dir, chunked)
    path = mtp_dirs(model)
    args = [*flags, path] if flags[-1] == "--speculative-draft-model-path" else flags
    got = serve_spec_once(path, [*args, *chunked], server_log_dir)
    stats = accept_stats(got, drafts, case)
    helix.assert_serves_plain_tp(base, got, f"mtp {case}")
    first, after = got["mamba"]
    assert first and after == first, f"{case}: rank 0's mamba usage {after}, at start {first}"
    assert_accepts_partially(stats, drafts, case)
    print(f"mtp {case}: verifies by accepted drafts {stats['hist']}, accept lengths "
          f"{[round(x, 2) for x in stats['lengths']]}; server start {got['started']:.0f} s, "
          f"all {got['seconds']:.0f} s (the draft knows {MTP_KNOWN_STEPS} tokens a prompt)")  # fmt: skip


# DCP's GQA mode with the MTP draft (patch 0046): the MTP layer's attention in the target's layout
# (Q and its gate over tp / KVP, K/V replicated in the KVP group, its KV sharded along the
# sequence), the Gated DeltaNet states through the verify upstream's. Each layout against plain
# --tp 4 with the same draft (the case above): plain TP's tokens and logprobs within the float32
# bound, the same verifies accepting the same drafts, every pool back at start. The mode runs with
# --disable-radix-cache (the CPU has no mamba extra buffer: test_helix_qwen3_5.py).
MODE_CASES = {  # name: (the plain-TP case with the same draft, the mode's flags)
    "dense-chain-dcp4": ("dense-chain", ["--dcp-size", "4", "--dcp-replicate-q-proj"]),
    "dense-chain-kvp2": ("dense-chain", ["--helix-kvp-size", "2"]),
    "dense-tree-kvp2": ("dense-tree", ["--helix-kvp-size", "2"]),
    "dense-tree-kvp4": ("dense-tree", ["--helix-kvp-size", "4"]),
    "dense-eagle-kvp2": ("dense-eagle", ["--helix-kvp-size", "2"]),
    "moe-chain-kvp2": ("moe-chain", ["--helix-kvp-size", "2"]),
    "moe-chain-kvp4": ("moe-chain", ["--helix-kvp-size", "4"]),
}
# The default run's: KVP 4 in DCP's spelling (TPA 1: each rank projects all 16 query heads and their
# gates, keeps 4 after the exchange), the chain; the rest is the full tier.
MODE_DEFAULT = {"dense-chain-dcp4"}


@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(k, marks=() if k in MODE_DEFAULT else FULL) for k in MODE_CASES])
def test_mtp_speculation_in_the_mode_serves_plain_tps_tokens(qwen3_5_dirs, mtp_dirs, server_log_dir, case):
    plain_case, mode_flags = MODE_CASES[case]
    model, flags, drafts = CASES[plain_case]
    chunked = CHUNKED if model == "dense" else []
    base = harness.serve(qwen3_5_dirs[model], 4, server_log_dir, chunked)
    path = mtp_dirs(model)
    args = [*flags, path] if flags[-1] == "--speculative-draft-model-path" else flags
    plain = serve_spec_once(path, [*args, *chunked], server_log_dir)
    got = serve_spec(path, [*args, *chunked, *mode_flags, "--disable-radix-cache"], server_log_dir)
    helix.assert_serves_plain_tp(base, got, f"mtp {case}")
    stats, plain_stats = accept_stats(got, drafts, case), accept_stats(plain, drafts, plain_case)
    assert stats == plain_stats, f"{case}: accepted drafts {stats}, plain TP with the same draft {plain_stats}"
    first, after = got["mamba"]
    assert first and after == first, f"{case}: rank 0's mamba usage {after}, at start {first}"
    print(f"mtp {case}: verifies by accepted drafts {stats['hist']} (plain TP's), server start "
          f"{got['started']:.0f} s, all {got['seconds']:.0f} s")  # fmt: skip
