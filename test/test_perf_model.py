"""The decode-step roofline model and layout advisor (sglang_helix.perf_model): each formula against
hand-computed cases, on round-number hardware. No timing."""

from __future__ import annotations

import json
import math

import pytest

from sglang_helix import perf_model as pm

# 1 TB/s HBM, 100 GB/s link, 1 PFLOP/s, 1 us per collective, 10 GB.
HW = pm.Hardware("test", 1e12, 10e9, 1e11, {"bf16": 1e15}, 8, link_latency_s=1e-6)
# 2 layers, hidden 64, Q 8, K 2, head dim 8 (K+V: 16 elements per head), FFN 128, vocab 1000.
TINY = pm.Model("tiny", 2, 64, 8, 2, 8, 16, 128, 1000)


def test_kv_heads_and_tokens_per_gpu():
    # plain TP replicates KV heads once N > K: max(1, K/N); Helix holds K/TPA heads of S/KVP tokens
    assert pm.kv_heads_per_gpu(TINY, pm.Layout(4, 1)) == 1.0
    assert pm.kv_heads_per_gpu(TINY, pm.Layout(2, 1)) == 1.0
    assert pm.kv_heads_per_gpu(TINY, pm.Layout(4, 2)) == 1.0  # TPA 2
    assert pm.kv_heads_per_gpu(TINY, pm.Layout(4, 4)) == 2.0  # TPA 1
    assert pm.tokens_per_gpu(1000, pm.Layout(4, 4)) == 250
    r1 = pm.MODELS["deepseek-r1"]
    assert pm.kv_heads_per_gpu(r1, pm.Layout(64, 1)) == pm.kv_heads_per_gpu(r1, pm.Layout(64, 64)) == 1.0


def test_layouts_keep_tpa_dividing_k():
    names = [x.name() for x in pm.layouts(pm.MODELS["llama-3.1-405b"], 64)]  # K = 8
    assert names == ["TP64", "Helix KVP8xTPA8", "Helix KVP16xTPA4", "Helix KVP32xTPA2", "Helix KVP64xTPA1"]
    assert [x.name() for x in pm.layouts(pm.MODELS["deepseek-r1"], 8)] == ["TP8", "Helix KVP8xTPA1"]  # MLA: K = 1


def test_kv_read_and_attention_flops():
    # Helix KVP 4 x TPA 1 at N = 4, S = 1000, B = 3, bf16: per layer each GPU reads
    # B x S/KVP x (K/TPA = 2 heads x 16 elements) x 2 bytes = 3 x 250 x 64 = 48,000 bytes -> 48 ns;
    # attention FLOPs 2 x B x S/KVP x Q/TPA x (8 + 8) = 2 x 3 x 250 x 8 x 16 = 192,000 -> 0.192 ns.
    s = pm.step(TINY, HW, pm.Layout(4, 4), 1000, 3, "bf16", "bf16")
    assert s.kv_s == pytest.approx(2 * 48_000 / 1e12)
    # plain TP 4: 1 head (replicated) x all 1000 tokens: 3 x 1000 x 16 x 2 = 96,000 bytes per layer
    t = pm.step(TINY, HW, pm.Layout(4, 1), 1000, 3, "bf16", "bf16")
    assert t.kv_s == pytest.approx(2 * 96_000 / 1e12)
    # capacity: KV per request per GPU, all layers
    assert s.kv_bytes_per_request == 2 * 250 * 64 and t.kv_bytes_per_request == 2 * 1000 * 32


def test_weight_read():
    # Helix KVP 2 x TPA 2 at N = 4, B = 1: qkv 64 x (8 + 4) x 8 = 6144 params over TPA 2 -> 3072;
    # o_proj 8 x 8 x 64 = 4096 over 4 -> 1024; MLP 3 x 64 x 128 / 4 = 6144: 10,240 params x 2 B
    # = 20,480 bytes per layer; lm_head 1000 x 64 / 4 x 2 B = 32,000 bytes.
    s = pm.step(TINY, HW, pm.Layout(4, 2), 1000, 1, "bf16", "bf16")
    assert s.weights_s == pytest.approx((2 * 20_480 + 32_000) / 1e12)
    # plain TP 4: qkv over 4 -> 1536 + 1024 + 6144 = 8704 params -> 17,408 bytes per layer
    t = pm.step(TINY, HW, pm.Layout(4, 1), 1000, 1, "bf16", "bf16")
    assert t.weights_s == pytest.approx((2 * 17_408 + 32_000) / 1e12)


def test_all_to_all_and_all_reduce():
    # Helix KVP 2 x TPA 2, B = 5: a GPU sends half of [5, Q/TPA = 4, Dv = 8] bf16 + fp32 LSE:
    # 5 x 4 x (8 x 2 + 4) / 2 = 200 bytes per layer -> 1 us + 2 ns
    s = pm.step(TINY, HW, pm.Layout(4, 2), 1000, 5, "bf16", "bf16")
    assert s.a2a_s == pytest.approx(2 * (1e-6 + 200 / 1e11))
    # ring all-reduce of [5, 64] bf16 over 4: 2 x 3/4 x 640 = 960 bytes, twice per layer
    assert s.ar_s == pytest.approx(2 * 2 * (1e-6 + 960 / 1e11))
    t = pm.step(TINY, HW, pm.Layout(4, 1), 1000, 5, "bf16", "bf16")
    assert t.a2a_s == 0.0 and t.ar_s == s.ar_s


def test_moe_experts_touched():
    moe = pm.Model("moe", 1, 64, 8, 2, 8, 16, 0, 1000, experts=4, experts_per_token=2, expert_ffn=32)
    assert pm.expected_distinct_experts(moe, 1) == pytest.approx(2.0)
    assert pm.expected_distinct_experts(moe, 2) == pytest.approx(4 * (1 - 0.25))
    assert pm.expected_distinct_experts(moe, 1000) == pytest.approx(4.0)
    assert pm.expected_distinct_experts(TINY, 8) == 0.0


def test_mla_parameters():
    r1 = pm.MODELS["deepseek-r1"]
    # q_a 7168 x 1536 + q_b 1536 x 128 x 192 + kv_a 7168 x 576 + kv_b 512 x 128 x (128 + 128)
    assert r1.qkv_params() == 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
    assert r1.o_params() == 128 * 128 * 7168


def test_helix_wins_where_kv_dominates_and_tp_duplicates_kv():
    """The qualitative claim: at 1M tokens with N > K, Helix's step is shorter and it fits far more
    requests; at N = K with short context it only pays for the replicated qkv_proj."""
    m, hw = pm.MODELS["llama-3.1-405b"], pm.HARDWARE["gb200-nvl72"]
    tp = pm.step(m, hw, pm.Layout(64, 1), 1 << 20, 1, "fp4", "fp4")
    hx = pm.step(m, hw, pm.Layout(64, 8), 1 << 20, 1, "fp4", "fp4")
    assert hx.total_s < tp.total_s and hx.max_batch > 4 * tp.max_batch
    m70 = pm.MODELS["llama-3.3-70b"]
    tp8 = pm.step(m70, pm.HARDWARE["h100"], pm.Layout(8, 1), 4096, 8, "bf16", "bf16")
    hx8 = pm.step(m70, pm.HARDWARE["h100"], pm.Layout(8, 8), 4096, 8, "bf16", "bf16")
    assert hx8.total_s > tp8.total_s


def test_pareto_and_recommend():
    steps = pm.sweep(TINY, HW, 4, 100_000, [1, 4, 16, 64], "bf16", "bf16")
    front = pm.pareto(steps)
    for s in steps:  # nothing on the front is beaten on both axes
        assert not any(o.tok_s_user > s.tok_s_user and o.tok_s_gpu > s.tok_s_gpu for o in steps) or s not in front
    fastest = max(steps, key=lambda s: s.tok_s_user)
    best = pm.recommend(steps, "latency", fastest.tok_s_user)
    assert best.tok_s_user >= fastest.tok_s_user
    assert pm.recommend(steps, "latency", math.inf) is None
    most = max(steps, key=lambda s: s.tok_s_gpu)
    assert pm.recommend(steps, "throughput", most.tok_s_gpu).tok_s_gpu >= most.tok_s_gpu


def test_config_json_and_the_command(tmp_path, capsys):
    cfg = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = pm.model_from_config(str(path))
    assert (m.layers, m.hidden, m.q_heads, m.kv_heads, m.head_dim, m.kv_dim, m.ffn) == (2, 64, 8, 2, 8, 16, 128)
    png = tmp_path / "p.png"
    assert pm.main(["--model", str(path), "--hw", "h100", "--gpus", "4", "--context", "65536",
                    "--pareto", str(png), "--recommend", "latency", "--target", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "Helix KVP4xTPA1" in out and "recommend:" in out and png.read_bytes().startswith(b"\x89PNG")


def test_comm_per_layer_by_hand():
    """Llama-3.3-70B (Q 64, K 8, D 128, hidden 8192), bf16, batch 1, N = 4."""
    m = pm.MODELS["llama-3.3-70b"]
    ar = 2 * 2 * 3 / 4 * 8192 * 2  # two ring all-reduces of [1, 8192] bf16: 48 KiB
    assert pm.comm_per_layer(m, 4, "tp", 1) == {"all-reduce o_proj + FFN": ar}
    # Helix KVP 4 x TPA 1: 3 of 4 slices of [16 heads, 128 bf16 + 4 B LSE] leave the GPU
    helix = pm.comm_per_layer(m, 4, "helix", 4)
    assert helix["all-to-all partials + LSE"] == 3 * 16 * (128 * 2 + 4) == 12480
    assert helix["all-reduce o_proj + FFN"] == ar and len(helix) == 2
    # upstream DCP 4: gather Q [16, 128] bf16, gather fp32 LSE [64], all-reduce fp32 out [64, 128]
    dcp = pm.comm_per_layer(m, 4, "dcp", 4)
    assert dcp["all-gather Q"] == 3 * 16 * 128 * 2
    assert dcp["all-gather LSE (fp32)"] == 3 * 64 * 4
    assert dcp["all-reduce outputs (fp32)"] == 2 * 3 / 4 * 64 * 128 * 4
    assert sum(dcp.values()) - ar == 62208  # 5x Helix's 12480 at the same N
    # batch scales every term; S never appears
    assert pm.comm_per_layer(m, 8, "helix", 8, batch=8)["all-to-all partials + LSE"] == 8 * 7 * 8 * 260
    with pytest.raises(ValueError, match="unknown scheme"):
        pm.comm_per_layer(m, 4, "ring", 2)


def test_comm_table_cli(capsys):
    assert pm.main(["--model", "llama-3.3-70b", "--comm", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "TP4 Helix KVP4xTPA1" in out and "TP8 DCP8 (upstream)" in out and "12.19 KiB" in out


def test_medha_baseline_keeps_o_proj_and_ffn_on_tpa():
    """Medha-style KVP 2 x TP 2: attention as Helix, o_proj / FFN / lm_head / all-reduces over TPA = 2."""
    medha = pm.step(TINY, HW, pm.Layout(4, 2, "medha"), 1000, 1, "bf16", "bf16")
    helix = pm.step(TINY, HW, pm.Layout(4, 2), 1000, 1, "bf16", "bf16")
    # per layer: qkv 64*12*8/2 + o 8*8*64/2 + FFN 3*64*128/2 = 17408 params; lm_head 1000*64/2
    assert medha.weights_s == pytest.approx((2 * 17408 + 32000) * 2 / 1e12)
    assert medha.ar_s == pytest.approx(2 * 2 * (1e-6 + 2 * 1 / 2 * 64 * 2 / 1e11))  # ring over 2
    assert medha.a2a_s == helix.a2a_s and medha.kv_s == helix.kv_s
    assert pm.Layout(4, 2, "medha").name() == "KVP2xTP2 (Medha)"


def test_dp_attention_ep_baseline():
    """DP attention + EP over 4 GPUs, batch 8: each GPU attends 2 requests with all K heads."""
    moe = pm.Model("moe", 2, 64, 8, 2, 8, 16, 128, 1000, experts=8, experts_per_token=2, expert_ffn=32, shared_experts=1, dense_layers=1)
    s = pm.step(moe, HW, pm.Layout(4, 1, "dp-ep"), 1000, 8, "bf16", "bf16")
    assert s.kv_s == pytest.approx(2 * (2 * 1000 * 2 * 16 * 2) / 1e12)  # 2 layers x 2 requests x K heads
    # one MoE layer: dispatch + combine of 2 tokens x 2 experts x [64] bf16, 3/4 of it off the GPU
    assert s.a2a_s == pytest.approx(2 * (1e-6 + 2 * 2 * 64 * 2 * 3 / 4 / 1e11))
    assert s.ar_s == 0.0 and s.max_batch % 4 == 0 and s.max_batch > 0
    assert [lay.kind for lay in pm.layouts(moe, 4, baselines=True)] == ["tp", "helix", "medha", "helix", "medha", "dp-ep"]


def test_frontier_ratios_by_hand():
    lay = pm.Layout(1, 1)
    helix = [pm.Step(lay, 1, 1e-3, 0, 0, 0, 0, 9), pm.Step(lay, 4, 2e-3, 0, 0, 0, 0, 9)]  # 1000 / 500 tok/s/user
    base = [pm.Step(lay, 1, 2e-3, 0, 0, 0, 0, 9)]  # 500 tok/s/user, 500 tok/s/GPU
    r = pm.frontier_ratios(helix, base)
    assert r["interactivity"] == pytest.approx(2.0)
    assert r["throughput"] == pytest.approx(4.0)  # 2000 against 500 at 500 tok/s/user
    assert r["batch"] == pytest.approx(4.0)


def test_paper_cli(capsys):
    assert pm.main(["--paper"]) == 0
    out = capsys.readouterr().out
    assert "Llama-3.1-405B" in out and "DeepSeek-R1" in out and "32.00x" in out and "tp*" in out
