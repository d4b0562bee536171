"""Helix KV consistency: every rank's stored K/V, reassembled by the ownership rule, is exact.

A real multi-rank Helix server runs with test/helix_kv_dump on its PYTHONPATH and
``HELIX_KV_DUMP_DIR`` set: after each layer's Helix attention (which writes the K/V) every rank
dumps, per request slot, the global positions in ``[0, seq_len)`` it owns and the K/V rows it reads
back from its pool (``test/helix_kv_dump/sitecustomize.py``).
Several prompts of distinct lengths are decoded concurrently (greedy, a few tokens each); after
they finish, each slot's dump is the request's last forward (its final decode step), so it covers
the prompt and every generated token but the last one (which has no stored KV).

For every request and layer:
- within each TPA slice, every position of ``[0, seq_len)`` is stored on exactly one KVP rank,
  the owner ``(p // chunk) % KVP``, and never twice;
- the stored K (post-RoPE) and V equal Hugging Face transformers' ``past_key_values`` for the same
  token ids, for the KV heads of that TPA slice, within fp32 tolerance.
The reference is teacher-forced over the very tokens the server decoded; the greedy tokens are
then also checked against transformers' argmax.

Layouts: ``--tp 4 --helix-kvp-size 2 --helix-kvp-chunk-size 4`` on a GQA model (Q=8, K=4: TPA=2,
two KV heads per rank), on both attention backends (``triton`` is the write/read path the GPU
uses); the same layout spelled with DCP's flags (``--dcp-size 2 --dcp-comm-backend a2a
--dcp-replicate-q-proj --dcp-interleave-size 4``); upstream's own ``--dcp-size 4`` (interleave 1, the
4 KV heads replicated in the group; torch_native's DCP branch is dumped too); and ``--tp 4 --helix-kvp-size 4 --helix-kvp-chunk-size 2`` on an MQA model (K=1: TPA=1), whose one KV head
the CPU engine keeps under Helix (the CPU-engine patch pads for TPA; ``_real_heads`` reads either).
"""

from __future__ import annotations

import json
import os
import random
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import FULL, GQA, stop_server
from sglang_helix.testing.server import CpuServer
from sglang_helix.testing.tiny_models import TinyModelSpec

ATOL = 1e-4  # fp32

# MQA: K = 1, so TPA = 1 and all --tp 4 ranks are KVP ranks of one slice. (The CPU engine pads
# heads for TPA under Helix, so it keeps one KV head; _real_heads also reads a padded pool.)
MQA = TinyModelSpec(num_heads=8, num_kv_heads=1, head_dim=16, num_layers=2)

# (prompt length, max_tokens): distinct final stored lengths (prompt + max_tokens - 1), crossing
# chunk and page boundaries (page = chunk x KVP = 8 in both layouts).
REQUESTS = [(5, 4), (11, 6), (18, 3), (29, 5)]

LAYOUTS = {
    # Chunked prefill of 16 tokens: the 18- and 29-token prompts extend over a stored prefix.
    "tp4-kvp2-c4-gqa": (GQA, ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", "4", "--chunked-prefill-size", "16"]),
    "tp4-kvp4-c2-mqa": (MQA, ["--tp", "4", "--helix-kvp-size", "4", "--helix-kvp-chunk-size", "2"]),
    # The same Helix layout spelled with DCP's flags (DCP's GQA mode) ...
    "tp4-dcp2-rq-i4-gqa": (GQA, ["--tp", "4", "--dcp-size", "2", "--dcp-comm-backend", "a2a", "--dcp-replicate-q-proj",
                                 "--dcp-interleave-size", "4", "--chunked-prefill-size", "16"]),
    # ... and upstream's own DCP (Q gathered, interleave 1; K/V replicated inside the group).
    "tp4-dcp4-gqa": (GQA, ["--tp", "4", "--dcp-size", "4", "--chunked-prefill-size", "16"]),
}


def _layout(args: list) -> tuple:
    """``(KVP, chunk)`` of a launch, whichever spelling: Helix's flags or DCP's."""
    def flag(name, default):
        return int(args[args.index(name) + 1]) if name in args else default

    if "--helix-kvp-size" in args:
        return flag("--helix-kvp-size", 1), flag("--helix-kvp-chunk-size", 64)
    return flag("--dcp-size", 1), flag("--dcp-interleave-size", 1)
# Both backends write and read the pool their own way (torch_native: gather by row; triton: the
# decode/extend kernels over the local KV list, the path the GPU uses).
# The default run: triton (the GPU's path); the rest with HELIX_TEST_FULL=1. (Upstream's DCP,
# tp4-dcp4-gqa, was the default run's too until 2026-11-28, moved for CI time: its torch shards and
# merge are test_dcp_gqa.py's unit tests at --dcp-size 2 and 4, and DCP serves in the default run
# through test_dcp_gqa.py's dcp2-rq.)
PARAMS = [
    pytest.param("tp4-kvp2-c4-gqa", "torch_native", id="tp4-kvp2-c4-gqa-torch_native", marks=FULL),
    pytest.param("tp4-kvp2-c4-gqa", "triton", id="tp4-kvp2-c4-gqa-triton"),
    pytest.param("tp4-kvp4-c2-mqa", "torch_native", id="tp4-kvp4-c2-mqa-torch_native", marks=FULL),
    # The three spellings: Helix's flags (above), DCP's GQA mode and upstream's DCP. (DCP's
    # spelling of the GQA mode: FULL since 2026-11-27, for CI time. It resolves to the very server
    # args of Helix's spelling (test_helix_args.py); the default run serves it against plain TP in
    # test_dcp_gqa.py's dcp2-rq, and the full tier checks the two spellings bit for bit.)
    pytest.param("tp4-dcp2-rq-i4-gqa", "torch_native", id="tp4-dcp2-rq-i4-gqa-torch_native", marks=FULL),
    pytest.param("tp4-dcp4-gqa", "torch_native", id="tp4-dcp4-gqa-torch_native", marks=FULL),
]


def _complete(base_url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    body = {
        "model": "default", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    req = urllib.request.Request(
        base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n, _ in REQUESTS]


def _hf_reference(model_path: str, ids: list[int]):
    """transformers' logits and per-layer post-RoPE (K, V) ``[K, S, D]`` over ``ids``."""
    import torch
    from transformers import LlamaForCausalLM

    model = _hf_reference.cache.get(model_path)
    if model is None:
        model = LlamaForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
        _hf_reference.cache[model_path] = model
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    kv = []
    for layer in range(model.config.num_hidden_layers):
        if hasattr(cache, "layers"):  # transformers >= 4.56
            k, v = cache.layers[layer].keys, cache.layers[layer].values
        elif hasattr(cache, "key_cache"):
            k, v = cache.key_cache[layer], cache.value_cache[layer]
        else:
            k, v = cache[layer]
        kv.append((k[0].float(), v[0].float()))
    return out.logits[0], kv


_hf_reference.cache = {}


def _real_heads(rec, heads: int, tpa: int):
    """The dumped K/V of the model's real KV heads ``[n, heads, D]``.

    The CPU engine pads KV heads up to a multiple of --tp when --tp does not divide them
    (upstream ``adjust_config_with_unaligned_cpu_tp``): K=1 at --tp 4 runs as 4 KV heads, the
    real one first and three zero-weight ones. With TPA = 1 a rank then stores all 4; the padding
    heads must hold exactly zero.
    """
    k, v = rec["k"], rec["v"]
    if k.shape[1] != heads:
        assert tpa == 1 and k.shape[1] > heads, f"unexpected KV head count {k.shape[1]} (model: {heads} per TPA slice)"
        assert not k[:, heads:].any() and not v[:, heads:].any(), "CPU padding KV heads hold non-zero K/V"
        k, v = k[:, :heads], v[:, :heads]
    return k, v


def _load_dumps(dump_dir: str):
    """{(slot, layer): [record, ...]} of the dump files (one record per rank)."""
    import torch

    by_slot = defaultdict(list)
    for name in os.listdir(dump_dir):
        if name.endswith(".pt"):
            rec = torch.load(os.path.join(dump_dir, name))
            by_slot[(rec["slot"], rec["layer_id"])].append(rec)
    return by_slot


@pytest.mark.e2e
@pytest.mark.parametrize("layout,backend", PARAMS)
def test_kv_shards_reassemble_to_reference(model_dir, server_log_dir, tmp_path, monkeypatch, layout, backend):
    import torch

    # test/helix_kv_dump/sitecustomize.py writes the dumps in the server processes.
    hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helix_kv_dump")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH")) if p))

    spec, args = LAYOUTS[layout]
    model_path = model_dir(spec)
    kvp, chunk = _layout(args)
    tpa = 4 // kvp
    heads_per_slice = spec.num_kv_heads // tpa
    dump_dir = tmp_path / "kv"
    dump_dir.mkdir()

    timeout = float(os.environ.get("HELIX_TEST_STARTUP_TIMEOUT", "900"))
    srv = CpuServer(
        model_path, args, attention_backend=backend, startup_timeout=timeout, log_dir=server_log_dir,
        extra_env={"HELIX_KV_DUMP_DIR": str(dump_dir)},
    ).start()  # fmt: skip
    try:
        for f in os.listdir(dump_dir):  # the startup health check's request
            os.remove(dump_dir / f)
        prompts = _prompts(vocab=400)
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            futures = [pool.submit(_complete, srv.base_url, p, m) for p, (_, m) in zip(prompts, REQUESTS)]
            choices = [f.result() for f in futures]
    finally:
        stop_server(srv)

    dumps = _load_dumps(str(dump_dir))
    slot_of_len = {}
    for (slot, layer), recs in dumps.items():
        lens = {r["seq_len"] for r in recs}
        assert len(lens) == 1, f"slot {slot} layer {layer}: ranks dumped different seq_lens {lens}"
        assert sorted(r["tp_rank"] for r in recs) == [0, 1, 2, 3], f"slot {slot} layer {layer}: ranks {[r['tp_rank'] for r in recs]}"
        slot_of_len.setdefault(lens.pop(), set()).add(slot)

    worst = 0.0
    for prompt, (n, max_tokens), choice in zip(prompts, REQUESTS, choices):
        gen = choice["token_ids"]
        assert len(gen) == max_tokens, choice
        if choice.get("prompt_token_ids") is not None:
            assert choice["prompt_token_ids"] == prompt
        ids = prompt + gen
        seq_len = len(ids) - 1  # the last generated token has no stored KV
        slots = slot_of_len.get(seq_len, set())
        assert len(slots) == 1, f"request of {n} prompt tokens: expected one slot dumped with seq_len {seq_len}, got {slot_of_len}"
        slot = slots.pop()

        logits, ref_kv = _hf_reference(model_path, ids)  # teacher-forced over the server's tokens

        for layer in range(spec.num_layers):
            recs = dumps[(slot, layer)]
            k_ref, v_ref = ref_kv[layer]  # [K, S, D]
            for t in range(tpa):
                owners = {}
                for rec in (r for r in recs if r["tpa_rank"] == t):
                    assert rec["kvp_size"] == kvp and rec["chunk"] == chunk
                    pos = rec["positions"].tolist()
                    assert len(set(pos)) == len(pos), f"rank {rec['tp_rank']} lists a position twice"
                    for p in pos:
                        assert p not in owners, f"layer {layer} slot {slot}: position {p} stored on ranks {owners[p]} and {rec['tp_rank']}"
                        owners[p] = rec["tp_rank"]
                        assert (p // chunk) % kvp == rec["kvp_rank"], f"position {p} stored on KVP rank {rec['kvp_rank']}"
                    heads = slice(t * heads_per_slice, (t + 1) * heads_per_slice)
                    idx = torch.tensor(pos, dtype=torch.long)
                    want_k = k_ref[heads][:, idx].transpose(0, 1)  # [n, K/TPA, D]
                    want_v = v_ref[heads][:, idx].transpose(0, 1)
                    got_k, got_v = _real_heads(rec, want_k.shape[1], tpa)
                    assert got_k.shape == want_k.shape, (got_k.shape, want_k.shape)
                    dk = (got_k - want_k).abs().max().item() if pos else 0.0
                    dv = (got_v - want_v).abs().max().item() if pos else 0.0
                    worst = max(worst, dk, dv)
                    assert dk <= ATOL and dv <= ATOL, (
                        f"layer {layer} slot {slot} rank {rec['tp_rank']}: |dK|={dk:.2e} |dV|={dv:.2e} > {ATOL}"
                    )
                assert sorted(owners) == list(range(seq_len)), (
                    f"layer {layer} slot {slot} TPA slice {t}: positions {sorted(set(range(seq_len)) - set(owners))} missing"
                )
        assert logits[n - 1 : -1].argmax(-1).tolist() == gen, "server's greedy tokens differ from transformers'"
    print(f"{layout} {backend}: {len(REQUESTS)} requests x {spec.num_layers} layers x 4 ranks; max |dK|,|dV| = {worst:.2e}")
