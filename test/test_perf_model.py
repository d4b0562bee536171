"""The decode-step roofline model and layout advisor (sglang_helix.perf_model): each formula against
hand-computed cases, on round-number hardware. No timing."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

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


# --- upstream DCP (0.5.23, MHA/GQA), DCP with the All-to-All and replicated Q, per-collective latency


def test_dcp_0523_terms_by_hand():
    """TINY (Q 8, K 2, D 8, hidden 64) on --tp 4 --dcp-size 2, S = 1000, B = 3. K x d = 4 <= N: valid."""
    lay = pm.Layout(4, 2, "dcp")
    assert lay.name() == "TP4 DCP2" and pm.layout_problem(TINY, lay) == ""
    # pool heads max(1, K // (N/d)) = 1, S/d = 500 tokens: 3 x 500 x 16 elements x 2 B = 48,000 B per layer
    assert pm.kv_heads_per_gpu(TINY, lay) == 1.0 and pm.tokens_per_gpu(1000, lay) == 500
    s = pm.step(TINY, HW, lay, 1000, 3, "bf16", "bf16")
    assert s.kv_s == pytest.approx(2 * 48_000 / 1e12)
    assert s.kv_bytes_per_request == 2 * 500 * 16 * 2
    # qkv_proj as plain TP over 4: 1536 + o_proj 1024 + MLP 6144 = 8704 params (TP4's 17,408 B per layer)
    one = pm.step(TINY, HW, lay, 1000, 1, "bf16", "bf16")
    assert one.weights_s == pytest.approx((2 * 17_408 + 32_000) / 1e12)
    assert pm.weight_splits(lay) == (4, 2, 4)  # qkv over N, gathered heads Q/TPA = 2 x Q/N, o_proj/FFN over N


def test_dcp_0523_collectives_by_hand():
    """B = 5: all-gather Q (d-1) x B x Q/N x D x 2 = 160 B, all-gather fp32 LSE (d-1) x B x d x Q/N x 4
    = 80 B, all-reduce of the fp32 outputs 2(d-1)/d x B x d x Q/N x Dv x 4 = 640 B, and TP's two
    all-reduces of [5, 64] bf16 over 4 (960 B each); 1 us per collective, 100 GB/s."""
    lay = pm.Layout(4, 2, "dcp")
    coll = pm.collectives_per_layer(TINY, lay, 5)
    assert coll == [("all-gather", 160.0), ("all-gather", 80.0), ("all-reduce", 640.0), ("all-reduce", 960.0), ("all-reduce", 960.0)]
    assert pm.collective_counts(TINY, lay) == {"all-reduce": 3, "all-gather": 2, "all-to-all": 0}
    s = pm.step(TINY, HW, lay, 1000, 5, "bf16", "bf16")
    assert s.ag_s == pytest.approx(2 * (2e-6 + 240 / 1e11))
    assert s.ar_s == pytest.approx(2 * (3e-6 + (640 + 2 * 960) / 1e11))
    assert s.a2a_s == 0.0
    assert s.total_s == pytest.approx(s.kv_s + s.weights_s + s.ag_s + s.ar_s)
    assert pm.collective_counts(TINY, pm.Layout(4, 1)) == {"all-reduce": 2, "all-gather": 0, "all-to-all": 0}
    assert pm.collective_counts(TINY, pm.Layout(4, 2)) == {"all-reduce": 2, "all-gather": 0, "all-to-all": 1}


def test_dcp_0523_invalid_where_k_times_d_exceeds_n():
    """0.5.23 computes --dcp-size d right for Llama-style K/V only where d divides N/K
    (benchmark/dcp_gqa_check.py): shown with the reason, never chosen."""
    assert pm.layout_problem(TINY, pm.Layout(4, 4, "dcp")).startswith("K x d = 8 > N = 4")
    assert pm.layout_problem(TINY, pm.Layout(2, 2, "dcp"))  # the measured --tp 2 --dcp-size 2 case
    m = pm.MODELS["llama-3.1-70b"]  # K = 8: nothing at N = 8, only d = 2 at N = 16
    assert [x.kvp for x in pm.layouts(m, 8, dcp=True) if x.kind == "dcp" and not pm.layout_problem(m, x)] == []
    assert [x.kvp for x in pm.layouts(m, 16, dcp=True) if x.kind == "dcp" and not pm.layout_problem(m, x)] == [2]
    # the invalid rows are printed, marked; recommend and best_of_family never pick them
    steps = pm.sweep(m, pm.HARDWARE["h200"], 8, 131072, [1], "bf16", "bf16", list(pm.FAMILIES), show_invalid=True)
    assert any(not s.valid for s in steps) and all(s.layout.kind == "dcp" for s in steps if not s.valid)
    assert pm.best_of_family(m, pm.HARDWARE["h200"], 8, 131072, 1, "dcp")[0] is None
    lay = pm.Layout(4, 2, "dcp")
    fast_wrong = pm.Step(lay, 1, 1e-6, 0, 0, 0, 0, 9, problem="wrong")
    slow_right = pm.Step(pm.Layout(4, 1), 1, 1e-3, 0, 0, 0, 0, 9)
    assert pm.recommend([fast_wrong, slow_right], "latency", 1.0) is slow_right
    assert pm.pareto([fast_wrong, slow_right]) == [slow_right]


def test_dcp_a2a_replicated_q_is_helix_where_tpa_divides_k():
    """DCP a2a + replicated Q at d = KVP: qkv_proj over N/d, one All-to-All of the same bytes, the same
    KV: Helix's layout, the same step."""
    for n, d in ((4, 2), (4, 4), (8, 2)):
        a, h = pm.step(TINY, HW, pm.Layout(n, d, "dcp-a2a"), 1000, 5, "bf16", "bf16"), pm.step(TINY, HW, pm.Layout(n, d), 1000, 5, "bf16", "bf16")
        if TINY.kv_heads % (n // d) == 0:
            assert (a.kv_s, a.weights_s, a.a2a_s, a.ar_s, a.max_batch) == (h.kv_s, h.weights_s, h.a2a_s, h.ar_s, h.max_batch)
    assert pm.collective_counts(TINY, pm.Layout(4, 2, "dcp-a2a")) == {"all-reduce": 2, "all-gather": 0, "all-to-all": 1}


def test_dcp_a2a_with_tpa_above_k_by_hand():
    """N = 8, d = 2: TPA 4 > K = 2, a layout Helix refuses (TPA must divide K). Each KV head on 2 GPUs:
    max(1, K/TPA) = 1 head for S/2 tokens; qkv_proj over 4 (64 x 12 x 8 / 4 = 1536 params); the
    All-to-All sends (d-1) x B x Q/N x (Dv x 2 + 4) = 5 x 1 x 20 = 100 B at B = 5."""
    lay = pm.Layout(8, 2, "dcp-a2a")
    assert lay in pm.layouts(TINY, 8, dcp=True) and pm.Layout(8, 2) not in pm.layouts(TINY, 8)
    assert pm.kv_heads_per_gpu(TINY, lay) == 1.0 and pm.weight_splits(lay) == (4, 4, 8)
    assert pm.collectives_per_layer(TINY, lay, 5)[0] == ("all-to-all", 100.0)
    one = pm.step(TINY, HW, lay, 1000, 1, "bf16", "bf16")
    # qkv 1536 + o_proj 8 x 8 x 64 / 8 = 512 + MLP 3 x 64 x 128 / 8 = 3072 -> 5120 params; lm_head 8000
    assert one.weights_s == pytest.approx((2 * 5120 * 2 + 8000 * 2) / 1e12)
    assert one.kv_s == pytest.approx(2 * 500 * 16 * 2 / 1e12)


def test_dcp_a2a_mla_exchanges_the_latent():
    """0.5.23's MLA DCP exchanges the attention output in the latent space (kv_lora_rank 512)."""
    r1 = pm.MODELS["deepseek-r1"]
    lay = pm.Layout(8, 8, "dcp-a2a")
    assert [x.kind for x in pm.layouts(r1, 8, dcp=True) if x.kind.startswith("dcp")] == ["dcp-a2a"] * 3  # no MHA DCP for MLA
    assert pm.collectives_per_layer(r1, lay, 1)[0] == ("all-to-all", 7 * 16 * (512 * 2 + 4))
    assert pm.collectives_per_layer(r1, pm.Layout(8, 8), 1)[0] == ("all-to-all", 7 * 16 * (128 * 2 + 4))


def test_per_collective_latency():
    """Each collective pays its own latency; with_latency sets all or some; the presets carry the
    cited defaults."""
    hw = pm.with_latency(HW, all_reduce=1e-6, all_gather=2e-6, all_to_all=3e-6)
    h = pm.step(TINY, hw, pm.Layout(4, 2), 1000, 5, "bf16", "bf16")
    assert h.a2a_s == pytest.approx(2 * (3e-6 + 200 / 1e11))
    d = pm.step(TINY, hw, pm.Layout(4, 2, "dcp"), 1000, 5, "bf16", "bf16")
    assert d.ag_s == pytest.approx(2 * (2 * 2e-6 + 240 / 1e11))
    assert pm.with_latency(hw, 30e-6).latency("all-gather") == 30e-6
    assert pm.with_latency(hw, 30e-6, all_to_all=5e-6).latency("all-to-all") == 5e-6
    assert pm.HARDWARE["h100"].latency("all-to-all") == 11e-6 and pm.HARDWARE["b200"].latency("all-gather") == 8e-6
    assert HW.latency("all-gather") == 1e-6  # no per-kind values: link_latency_s for every kind
    with pytest.raises(ValueError):
        pm.with_latency(HW, reduce_scatter=1e-6)


def test_compare_row_by_hand():
    """Per family the fastest valid layout that fits; Helix's ratios are step-time ratios."""
    row = pm.compare_row("llama-3.1-70b", "h200", 16, 131072, 1)
    m, hw = pm.MODELS["llama-3.1-70b"], pm.HARDWARE["h200"]
    tp = pm.step(m, hw, pm.Layout(16, 1), 131072, 1, "bf16", "bf16")
    dcp = pm.step(m, hw, pm.Layout(16, 2, "dcp"), 131072, 1, "bf16", "bf16")  # the only valid d
    best_helix = min((pm.step(m, hw, x, 131072, 1, "bf16", "bf16") for x in pm.layouts(m, 16) if x.kind == "helix"), key=lambda s: s.total_s)
    assert row["tp_layout"] == "TP16" and row["dcp_layout"] == "TP16 DCP2" and row["helix_layout"] == best_helix.layout.name()
    assert row["helix_over_tp"] == round(tp.total_s / best_helix.total_s, 3)
    assert row["helix_over_dcp"] == round(dcp.total_s / best_helix.total_s, 3)
    assert row["tp_max_batch"] == tp.max_batch and row["helix_max_batch"] == best_helix.max_batch
    none = pm.compare_row("llama-3.1-70b", "h200", 8, 131072, 1)  # K = N: no valid --dcp-size
    assert none["dcp_layout"] == "" and none["helix_over_dcp"] == ""


def test_models_from_their_configs():
    m = pm.MODELS
    assert (m["llama-3.1-8b"].layers, m["llama-3.1-8b"].ffn) == (32, 14336)
    assert (m["qwen3-32b"].hidden, m["qwen3-32b"].q_heads * m["qwen3-32b"].head_dim) == (5120, 8192)
    assert (m["mixtral-8x22b"].experts, m["mixtral-8x22b"].experts_per_token, m["mixtral-8x22b"].q_heads) == (8, 2, 48)
    assert all(k in m for k in pm.TABLE_MODELS)


def test_compare_and_latency_cli(tmp_path, capsys):
    csv = tmp_path / "c.csv"
    assert pm.main(["--compare", "--model", "llama-3.1-70b", "--hw", "h200,b200", "--gpus", "16", "--context", "131072",
                    "--batch", "1", "--latency-us", "3,30", "--csv", str(csv)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "KVP2xTPA8" in out and "DCP2" in out and "3/3/3 us" in out and "30/30/30 us" in out
    assert len(csv.read_text().splitlines()) == 1 + 4
    assert pm.main(["--model", "llama-3.1-70b", "--hw", "h200", "--gpus", "8", "--context", "131072", "--batch", "1",
                    "--latency-us", "3,10,30", "--recommend", "latency", "--target", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("recommend:") == 3 and "INVALID: K x d = 16 > N = 8" in out and "10/10/10 us" in out
    assert "DCP" not in out.split("recommend:")[1].splitlines()[0]  # never an invalid layout


def test_compare_markdown_cells(capsys):
    """benchmark/results/perf-model.md's compact tables: "Helix/TP · Helix/DCP", n/a where 0.5.23 has no correct
    --dcp-size, TP OOM where only Helix (and DCP) hold the batch."""
    assert pm.main(["--compare", "--markdown", "--model", "llama-3.1-70b", "--hw", "h200", "--gpus", "8,16",
                    "--context", "131072", "--batch", "16,64", "--detail", "131072,16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| Llama-3.1-70B | 8 | 0.95 · n/a | - |" in out  # K = N: Helix behind TP, no correct DCP; B = 64 fits nowhere
    assert "| Llama-3.1-70B | 16 | 1.58 · 1.10 | - |" in out
    assert "| Llama-3.1-70B | 16 | TP16 · 47 · 46.6 · 21 | DCP2 · 67 · 66.9 · 43 |" in out  # the detail table
    row = pm.compare_row("qwen3-235b-a22b", "h200", 8, 131072, 16)  # K = 4: TP holds 10 requests, Helix 21
    assert pm._ratio_cell(row) == "TP OOM · 1.07" and row["tp_max_batch"] == 10 and row["helix_max_batch"] == 21


def test_dcp_flops_by_hand():
    """On compute-bound hardware (1 GFLOP/s, HBM unbounded) the step is FLOPs: TINY, N = 4, S = 1000, B = 3.
    DCP 2 attends with the gathered 2 x Q/N = 4 heads over S/2 tokens: 2 x 3 x 500 x 4 x (8 + 8) = 192,000
    FLOPs per layer (TP4's per-GPU attention FLOPs: 2 x 3 x 1000 x 2 x 16, the same); its GEMMs are TP4's:
    2 x 3 x 8704 = 52,224 per layer, lm_head 2 x 3 x 16,000 = 96,000. Helix KVP 2 x TPA 2: the same
    attention, qkv_proj over TPA 2: 2 x 3 x 10,240 = 61,440 per layer."""
    slow = pm.Hardware("slow", 1e18, 10e9, 1e11, {"bf16": 1e9}, 8, link_latency_s=0.0)
    dcp = pm.step(TINY, slow, pm.Layout(4, 2, "dcp"), 1000, 3, "bf16", "bf16")
    tp = pm.step(TINY, slow, pm.Layout(4, 1), 1000, 3, "bf16", "bf16")
    helix = pm.step(TINY, slow, pm.Layout(4, 2), 1000, 3, "bf16", "bf16")
    assert dcp.kv_s == pytest.approx(2 * 192_000 / 1e9) and tp.kv_s == dcp.kv_s == helix.kv_s
    assert dcp.weights_s == pytest.approx((2 * 52_224 + 96_000) / 1e9) and tp.weights_s == dcp.weights_s
    assert helix.weights_s == pytest.approx((2 * 61_440 + 96_000) / 1e9)


# --- hybrid models (Qwen3.5: one layer in four softmax attention with a KV cache, the rest Gated DeltaNet)

# TINY's shape in 4 layers, 1 with full attention (an output gate: q_proj 2 x Q rows), 3 linear: 2 key
# heads x 8, 4 value heads x 8, conv kernel 4.
HYB = pm.Model("hyb", 4, 64, 8, 2, 8, 16, 128, 1000, full_attention_layers=1, attn_output_gate=True,
               linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=8)  # fmt: skip


def test_hybrid_parameters_and_state():
    # in_proj_qkvz 64 x (2 x 16 + 2 x 32) + in_proj_ba 64 x 2 x 4 + conv1d (16 + 16 + 32) x 4 + out_proj 32 x 64
    assert HYB.linear_params() == 64 * 96 + 64 * 8 + 64 * 4 + 32 * 64 == 8960
    # recurrent state [4, 8, 8] fp32 + the conv's last 3 inputs of 64 channels, bf16
    assert HYB.linear_state_bytes() == 4 * 8 * 8 * 4 + 64 * 3 * 2 == 1408
    assert HYB.qkv_params() == 64 * (2 * 8 + 2 * 2) * 8  # the gate doubles q_proj's rows
    assert HYB.full_layers == 1 and TINY.full_layers == 2


def test_hybrid_step_by_hand():
    """HYB on Helix KVP 2 x TPA 2 and on TP 4, S = 1000: KV, the A2A and DCP's collectives in the one
    full-attention layer; the three linear layers read + write each request's state over N = 4 and
    their projections over N, in every layout."""
    hx = pm.step(HYB, HW, pm.Layout(4, 2), 1000, 3, "bf16", "bf16")
    tp = pm.step(HYB, HW, pm.Layout(4, 1), 1000, 3, "bf16", "bf16")
    state = 3 * 2 * 1408 / 4  # per linear layer: 3 requests, read + write, over 4 GPUs: 2112 B
    assert hx.kv_s == pytest.approx((3 * 500 * 32 + 3 * state) / 1e12)  # 1 KV head x 500 tokens
    assert tp.kv_s == pytest.approx((3 * 1000 * 32 + 3 * state) / 1e12)  # 1 KV head (replicated) x 1000
    assert hx.kv_bytes_per_request == 500 * 32 + 3 * 1408 / 4 and tp.kv_bytes_per_request == 1000 * 32 + 3 * 352
    # B = 1 weights: full layer qkv 10240 / TPA 2 + o_proj 1024 + MLP 6144 = 12288 params (TP4: 2560 +
    # 7168 = 9728); linear layer 8960 / 4 + 6144 = 8384; lm_head 16,000
    hx1 = pm.step(HYB, HW, pm.Layout(4, 2), 1000, 1, "bf16", "bf16")
    tp1 = pm.step(HYB, HW, pm.Layout(4, 1), 1000, 1, "bf16", "bf16")
    assert hx1.weights_s == pytest.approx(2 * (12288 + 3 * 8384 + 16000) / 1e12)
    assert tp1.weights_s == pytest.approx(2 * (9728 + 3 * 8384 + 16000) / 1e12)
    # MoE in place of the MLP (4 experts of width 32, 1 per token: 6144 / 4 = 1536 params a layer):
    # full layer 2560 + 1024 + 1536 = 5120, linear layer 2240 + 1536 = 3776
    moe = dataclasses.replace(HYB, ffn=0, experts=4, experts_per_token=1, expert_ffn=32)
    assert pm.step(moe, HW, pm.Layout(4, 1), 1000, 1, "bf16", "bf16").weights_s == pytest.approx(2 * (5120 + 3 * 3776 + 16000) / 1e12)
    # B = 5: one All-to-All (the full layer; 200 B as TINY's), two all-reduces in each of the 4 layers
    h5 = pm.step(HYB, HW, pm.Layout(4, 2), 1000, 5, "bf16", "bf16")
    assert h5.a2a_s == pytest.approx(1e-6 + 200 / 1e11)
    assert h5.ar_s == pytest.approx(4 * 2 * (1e-6 + 960 / 1e11))
    assert pm.collectives_per_layer(HYB, pm.Layout(4, 2), 5, linear=True) == [("all-reduce", 960.0)] * 2
    # DCP 2: its all-gathers and fp32 output all-reduce in the full layer only (test_dcp_0523_collectives_by_hand)
    d5 = pm.step(HYB, HW, pm.Layout(4, 2, "dcp"), 1000, 5, "bf16", "bf16")
    assert d5.ag_s == pytest.approx(2e-6 + 240 / 1e11)
    assert d5.ar_s == pytest.approx(3e-6 + (640 + 1920) / 1e11 + 3 * 2 * (1e-6 + 960 / 1e11))


def test_hybrid_with_every_layer_full_is_the_plain_model():
    """Linear-attention dims on a model whose layers all attend change nothing, in every family
    (baselines included); benchmark/results/perf-compare*.csv are unchanged (test below)."""
    moe = pm.Model("moe", 3, 64, 8, 2, 8, 16, 128, 1000, 8, 2, 32, 1, 1)
    for plain in (TINY, moe):
        full = dataclasses.replace(plain, full_attention_layers=plain.layers, linear_k_heads=2, linear_v_heads=4,
                                   linear_k_dim=8, linear_v_dim=8)  # fmt: skip
        for lay in pm.layouts(plain, 4, baselines=True, dcp=True):
            for b in (1, 5, 64):
                assert pm.step(full, HW, lay, 1000, b, "bf16", "bf16") == pm.step(plain, HW, lay, 1000, b, "bf16", "bf16")


def test_hybrid_kv_scales_with_the_full_layers():
    no_state = dataclasses.replace(HYB, linear_k_heads=0, linear_v_heads=0)
    for lay in (pm.Layout(4, 1), pm.Layout(4, 2), pm.Layout(4, 2, "dcp")):
        one, *more = [pm.step(dataclasses.replace(no_state, full_attention_layers=f), HW, lay, 100_000, 2, "bf16", "bf16")
                      for f in (1, 2, 4)]  # fmt: skip
        for f, s in zip((2, 4), more):
            assert s.kv_s == pytest.approx(f * one.kv_s) and s.kv_bytes_per_request == pytest.approx(f * one.kv_bytes_per_request)
    assert pm.step(HYB, HW, pm.Layout(4, 2), 1000, 5, "bf16", "bf16").a2a_s * 4 == pytest.approx(
        pm.step(dataclasses.replace(HYB, full_attention_layers=4), HW, pm.Layout(4, 2), 1000, 5, "bf16", "bf16").a2a_s
    )


def test_qwen35_presets_and_their_kv_per_gpu():
    """The presets add up to their names (397B total / 17B active; 35B / 3B, the names rounding the
    active count down; vision tower and MTP layer left out). Qwen3.5-397B (K = 2) on 8 GPUs: plain
    TP holds each KV head on 4 GPUs (4x the model's KV in all), Helix KVP 4 x TPA 2 each KV byte
    once; only the 15 full-attention layers hold KV."""
    for key, total, active in (("qwen3.5-397b-a17b", 397e9, 17e9), ("qwen3.5-35b-a3b", 35e9, 3e9)):
        m = pm.MODELS[key]
        layer = m.full_layers * (m.qkv_params() + m.o_params()) + (m.layers - m.full_layers) * m.linear_params()
        expert = 3 * m.hidden * m.expert_ffn
        assert layer + m.layers * (m.experts + 1) * expert + 2 * m.vocab * m.hidden == pytest.approx(total, rel=0.02)
        assert active <= layer + m.layers * (m.experts_per_token + 1) * expert + 2 * m.vocab * m.hidden < active + 0.5e9
    m, hw, s = pm.MODELS["qwen3.5-397b-a17b"], pm.HARDWARE["h200"], 1 << 20
    assert (m.full_layers, m.kv_heads, m.head_dim) == (15, 2, 256)
    model_kv = 15 * 2 * 512 * 2 * s  # per request, bf16
    state = 45 * m.linear_state_bytes() / 8  # the linear layers' state per GPU: 45 x 4.07 MiB / 8
    tp = pm.step(m, hw, pm.Layout(8, 1), s, 1, "bf16", "bf16")
    hx = pm.step(m, hw, pm.Layout(8, 4), s, 1, "bf16", "bf16")
    assert (tp.kv_bytes_per_request - state) * 8 == 4 * model_kv
    assert (hx.kv_bytes_per_request - state) * 8 == model_kv
    assert pm.layout_problem(m, pm.Layout(8, 8, "dcp")) == ""  # 0.5.23 replicates its K/V in the DCP group


def test_hybrid_config_json(tmp_path):
    cfg = {"model_type": "qwen3_5_moe", "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 8, "num_hidden_layers": 8, "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "full_attention_interval": 4,
        "attn_output_gate": True, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = pm.model_from_config(str(path))
    assert (m.full_layers, m.attn_output_gate, m.shared_experts, m.dcp_replicates_kv) == (2, True, 1, True)
    assert m.linear_params() == HYB.linear_params() and m.linear_state_bytes() == HYB.linear_state_bytes()
    cfg["text_config"]["layer_types"] = ["full_attention"] + ["linear_attention"] * 7
    path.write_text(json.dumps(cfg))
    assert pm.model_from_config(str(path)).full_layers == 1


COMPARE = "--compare --hw h100,h200,b200 --gpus 8,16 --batch 1,16,64".split()


@pytest.mark.parametrize("name, args", [
    ("perf-compare.csv", ["--model", "table", "--context", "32768,131072,1048576"]),
    ("perf-compare-latency.csv", ["--model", "table", "--context", "32768,131072,1048576", "--latency-us", "3,10,30"]),
    ("perf-compare-qwen3.5.csv", ["--model", "qwen3.5-397b-a17b,qwen3.5-35b-a3b", "--context", "131072,262144,524288,1048576"]),
])  # fmt: skip
def test_committed_compare_csvs_are_the_commands_output(name, args, tmp_path, capsys):
    """benchmark/results' rows are what the commands in perf-model.md / benchmark/README.md print today:
    the hybrid accounting left every earlier row as it was."""
    out = tmp_path / name
    assert pm.main(COMPARE + args + ["--csv", str(out)]) == 0
    capsys.readouterr()
    assert out.read_text() == (pathlib.Path(__file__).resolve().parents[1] / "benchmark" / "results" / name).read_text()


def test_committed_qwen35_markdown_is_the_commands_output(capsys):
    """benchmark/results/perf-compare-qwen3.5.md: after its header, the printout of the command it names."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "benchmark" / "results" / "perf-compare-qwen3.5.md").read_text()
    args = COMPARE + ["--model", "qwen3.5-397b-a17b,qwen3.5-35b-a3b", "--context", "131072,262144,524288,1048576"]
    assert pm.main(args + ["--markdown", "--detail", "131072,1,131072,16,1048576,1"]) == 0
    out = capsys.readouterr().out
    assert text.endswith("```\n" + out) and "| Qwen3.5-397B-A17B | 8 | 0.99 · 1.05 |" in out
