"""A roofline model of one decode step: plain TP, upstream DCP and Helix (KVP x TPA), and a layout advisor.

    python -m sglang_helix.perf_model --model llama-3.1-405b --hw gb200-nvl72 --gpus 64 \\
        --context 1048576 --batch 1,8,64 --dtype fp4
    python -m sglang_helix.perf_model --model path/to/config.json --hw h100 --gpus 8 --context 131072
    python -m sglang_helix.perf_model --model deepseek-r1 --hw gb200-nvl72 --gpus 64 \\
        --context 1048576 --pareto pareto.png
    python -m sglang_helix.perf_model --model llama-3.3-70b --hw h200 --gpus 8 --context 262144 \\
        --recommend latency --target 50
    python -m sglang_helix.perf_model --model llama-3.1-70b --hw h200 --gpus 16 --context 131072 \\
        --batch 1,16 --latency-us 3,10,30          # every table at three per-collective latencies
    python -m sglang_helix.perf_model --compare --model table --hw h100,h200,b200 --gpus 8,16 \\
        --context 32768,131072,1048576 --batch 1,16,64 --csv compare.csv

For each layout of N GPUs and batch B it prints one decode step per GPU. The layouts (``--families``):

    tp       plain ``--tp N``
    dcp      ``--tp N --dcp-size d`` as SGLang 0.5.23 runs it for MHA/GQA (Triton backend): qkv_proj
             TP over N, Q all-gathered over the DCP group, KV sharded along the sequence d ways
             (pool heads max(1, K / (N/d))), LSE all-gather + fp32 output all-reduce. Layouts with
             K x d > N are computed wrongly by 0.5.23 (docs/upstream-pr.md): shown, never chosen
    dcp-a2a  DCP with the All-to-All exchange and Q replicated over the DCP group (0.5.23's MLA path,
             ``--dcp-comm-backend a2a --dcp-replicate-q-proj``; for GQA it needs the KV-head fix):
             qkv_proj over N/d, one All-to-All; at d = KVP it is Helix's layout, and it adds N/d > K
    helix    ``--tp N --helix-kvp-size KVP``: attention KVP x TPA (TPA | K), one All-to-All

and breaks the step into

    kv      KV bytes the GPU reads / HBM bandwidth, and attention FLOPs / peak (roofline max); a
            hybrid model (Qwen3.5): KV in its full-attention layers only, and the state its linear
            (Gated DeltaNet) layers read and write, which run as plain TP over N in every layout
    weights weight bytes the GPU reads / HBM bandwidth, and GEMM FLOPs / peak (roofline max)
    a2a     the All-to-All per layer (Helix, DCP a2a): latency + bytes / NVLink bandwidth
    ag      DCP's all-gathers of Q and of the LSE: latency + bytes / NVLink bandwidth
    ar      the all-reduces after o_proj and the FFN (and DCP's output all-reduce)

summed over the layers (+ lm_head), the per-user rate (tokens/s/user = 1 / step) and the
per-GPU throughput (B / step / N), and the largest batch whose KV fits next to the weights.
``--compare`` prints, per model and case, the best layout of each family and Helix's ratios.

What it leaves out, on purpose: kernel efficiency (every term runs at the roofline), overlap of
communication with compute (terms add), the prefill, and the CPU/launch overhead a CUDA graph
removes. It compares layouts under the same assumptions; absolute numbers are lower bounds.
The per-collective latency is the one free parameter: defaults per GPU below, with sources.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

# --------------------------------------------------------------------------------------------
# Hardware. Per GPU. Sources: NVIDIA's datasheets (dense, i.e. without 2:4 sparsity):
#   H100 SXM5  https://www.nvidia.com/en-us/data-center/h100/ : 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s
#              (bidirectional; 450 GB/s each way), BF16 989 TFLOP/s, FP8 1,979 TFLOP/s.
#   H200 SXM   https://www.nvidia.com/en-us/data-center/h200/ : 4.8 TB/s HBM3e, 141 GB; NVLink and
#              compute as H100.
#   B200       https://www.nvidia.com/en-us/data-center/dgx-b200/ (8 GPUs: 1,440 GB, 64 TB/s HBM3e,
#              14.4 TB/s NVLink, 72 PF FP8 / 144 PF FP4 dense... per GPU /8): 180 GB, 8 TB/s,
#              NVLink 1.8 TB/s (900 GB/s each way), BF16 2.25, FP8 4.5, FP4 9 PFLOP/s.
#   GB200 NVL72 https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (72 GPUs: 13.4 TB HBM3e,
#              576 TB/s, 130 TB/s NVLink, 360 PF FP8 / 720 PF FP4 dense... per GPU /72): 186 GB,
#              8 TB/s, NVLink 1.8 TB/s, BF16 2.5, FP8 5, FP4 10 PFLOP/s.
# NVLink latency is not in the datasheets. ALPHA_S (3 us) is the model's original assumption, kept
# for a Hardware built without per-collective values and for --paper (which sweeps 3 / 10 / 30 us).
#
# Per-collective defaults (small messages, 1-64 KB: what decode sends; one NVLink domain). Published
# measurements found (2026-11-25), none of them of SGLang itself:
#   all-reduce, Hopper: 8 x H100, NCCL through torch.distributed, 128 B-64 KB: 19.2-23.1 us
#     (https://github.com/ByteDance-Seed/Triton-distributed/issues/57); NCCL 21.8-24.4 us and a
#     one-shot symmetric-memory all-reduce (the kind SGLang's custom all-reduce runs for decode-sized
#     buffers) 10.8-11.7 us at 8-64 KB bf16 (https://github.com/yifuwang/symm-mem-recipes/pull/3);
#     NVLink SHARP with CUDA graphs, 2 x H100: ~6 us (https://github.com/NVIDIA/nccl/issues/1259);
#     tuned NCCL 2.27 symmetric kernels, 8 bytes, 8 x H200: ~2.3 us (https://github.com/NVIDIA/nccl/issues/1940).
#   all-to-all, Hopper: nccl-tests output of a collective without reduction (redop "none", as
#     alltoall_perf prints it) on 8 x H20 (Hopper, NVLink 4), 128 B-4 KB: 10.3-11.1 us, posted in
#     an issue about all-to-all latency (https://github.com/deepseek-ai/DeepEP/issues/303).
#   all-gather, Hopper: no small-message measurement found. ASSUMED equal to the all-reduce (10 us).
#   all-reduce, Blackwell: NCCL 2.27 symmetric kernels on GB200 NVL72 (32 GPUs) ~6.3 us, as quoted
#     from NVIDIA's NCCL 2.27 blog, and an NVIDIA engineer's "under 8us with all_reduce_perf for
#     messages sizes up to 1KB, on a single-node GB200 (4 GPUs)" (https://github.com/NVIDIA/nccl-tests/issues/333);
#     tuned, 8 bytes, 8 x B200: ~3 us (https://github.com/NVIDIA/nccl/issues/1940).
#   all-gather, all-to-all, Blackwell: no measurement found. ASSUMED equal to the all-reduce (8 us).
# So: Hopper 10 / 10 / 11 us (all-reduce / all-gather / all-to-all), Blackwell 8 / 8 / 8 us. The
# sources spread over 2-25 us: every table can be printed at 3 / 10 / 30 us (--latency-us).
# --------------------------------------------------------------------------------------------

ALPHA_S = 3e-6  # per collective, assumed (the model's original value; --paper's first column)
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all")
HOPPER_LATENCY_S = {"all-reduce": 10e-6, "all-gather": 10e-6, "all-to-all": 11e-6}
BLACKWELL_LATENCY_S = {"all-reduce": 8e-6, "all-gather": 8e-6, "all-to-all": 8e-6}


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_s: float
    hbm_bytes: float
    link_bytes_s: float  # NVLink, one direction
    flops: Dict[str, float]  # dense, per dtype
    domain: int  # GPUs in one NVLink domain
    link_latency_s: float = ALPHA_S  # every collective without its own entry in latency_s
    latency_s: Optional[Dict[str, float]] = None  # seconds per collective kind (COLLECTIVES)

    def latency(self, kind: str) -> float:
        """Seconds one small collective of ``kind`` costs before its bytes move."""
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}")
        return (self.latency_s or {}).get(kind, self.link_latency_s)


def with_latency(hw: Hardware, every_s: Optional[float] = None, **per_kind_s: Optional[float]) -> Hardware:
    """``hw`` with every collective at ``every_s`` (None: keep) and then some at their own value
    (``all_reduce=``, ``all_gather=``, ``all_to_all=``, seconds; None: keep)."""
    lat = dict.fromkeys(COLLECTIVES, every_s) if every_s is not None else {k: hw.latency(k) for k in COLLECTIVES}
    for key, value in per_kind_s.items():
        kind = key.replace("_", "-")
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {key!r}")
        if value is not None:
            lat[kind] = value
    return dataclasses.replace(hw, link_latency_s=hw.link_latency_s if every_s is None else every_s, latency_s=lat)


def latency_label(hw: Hardware) -> str:
    return "/".join(f"{hw.latency(k) * 1e6:g}" for k in COLLECTIVES) + " us (all-reduce/all-gather/all-to-all)"


HARDWARE = {
    "h100": Hardware("H100 SXM", 3.35e12, 80e9, 450e9, {"bf16": 989e12, "fp8": 1979e12}, 8, latency_s=HOPPER_LATENCY_S),
    "h200": Hardware("H200 SXM", 4.8e12, 141e9, 450e9, {"bf16": 989e12, "fp8": 1979e12}, 8, latency_s=HOPPER_LATENCY_S),
    "b200": Hardware("B200", 8e12, 180e9, 900e9, {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15}, 8, latency_s=BLACKWELL_LATENCY_S),
    "gb200-nvl72": Hardware("GB200 NVL72", 8e12, 186e9, 900e9, {"bf16": 2.5e15, "fp8": 5e15, "fp4": 10e15}, 72,
                            latency_s=BLACKWELL_LATENCY_S),  # fmt: skip
}

DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5}


# --------------------------------------------------------------------------------------------
# Models.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int  # K; 1 for MLA (one latent head)
    head_dim: int  # query/key head dim (QK), per head
    kv_dim: int  # elements stored per token per KV head for K and V together (2 * D; MLA: latent + rope)
    ffn: int  # dense FFN width (dense layers)
    vocab: int
    experts: int = 0  # routed experts (0: dense)
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # MoE models: leading dense layers
    mla_q_rank: int = 0  # MLA: q_lora_rank (0: plain q projection)
    v_head_dim: int = 0  # value head dim (0: head_dim)
    mla_rope_dim: int = 0  # MLA: the rope part of the latent (0: not MLA)
    # Hybrid models (Qwen3.5, Qwen3-Next): only full_attention_layers of the layers attend with softmax
    # over a KV cache (None: all); the others are Gated DeltaNet linear attention with a constant-size
    # state, run as plain TP over N in every layout (no KV, no exchange): their projections and state
    # come from linear_k_heads x linear_k_dim keys (and queries), linear_v_heads x linear_v_dim values.
    full_attention_layers: Optional[int] = None
    attn_output_gate: bool = False  # q_proj also emits a sigmoid gate per query head: 2 x Q rows
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 4  # the depthwise causal conv's kernel
    dcp_replicates_kv: bool = False  # 0.5.23 replicates K/V inside the DCP group (qwen3_5.py): every d correct

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        return self.mla_rope_dim > 0

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def full_layers(self) -> int:
        """Layers with softmax attention and a KV cache (all but a hybrid model's linear layers)."""
        return self.layers if self.full_attention_layers is None else self.full_attention_layers

    def qkv_params(self) -> float:
        """Parameters of one layer's projections before attention (q with its output gate, k, v;
        MLA: q_a/q_b, kv_a, kv_b)."""
        h, d, q = self.hidden, self.head_dim, self.q_heads
        if not self.mla:
            return h * (q * (2 if self.attn_output_gate else 1) + 2 * self.kv_heads) * d
        q_proj = h * self.mla_q_rank + self.mla_q_rank * q * d if self.mla_q_rank else h * q * d
        latent = self.kv_dim - self.mla_rope_dim
        return q_proj + h * self.kv_dim + latent * q * ((d - self.mla_rope_dim) + self.dv)

    def o_params(self) -> float:
        return self.q_heads * self.dv * self.hidden

    def _linear_dims(self) -> Tuple[int, int, int]:
        kd, vd = self.linear_k_heads * self.linear_k_dim, self.linear_v_heads * self.linear_v_dim
        return kd, vd, 2 * kd + vd  # keys (= queries), values, the conv's channels (q, k, v)

    def linear_params(self) -> float:
        """Parameters of one Gated DeltaNet layer (SGLang 0.5.23 ``qwen3_5.py``): in_proj_qkvz
        [hidden -> 2 kd + 2 vd], in_proj_ba [hidden -> 2 v_heads], conv1d [2 kd + vd, kernel],
        out_proj [vd -> hidden] (A_log, dt_bias and the norm: v_heads + v_dim each, left out)."""
        kd, vd, conv = self._linear_dims()
        return self.hidden * (2 * kd + 2 * vd + 2 * self.linear_v_heads) + conv * self.linear_conv + vd * self.hidden

    def linear_state_bytes(self) -> float:
        """One request's state in one Gated DeltaNet layer, whole: the recurrent state [v_heads,
        k_dim, v_dim] fp32 and the conv's last kernel - 1 inputs [2 kd + vd, kernel - 1] bf16
        (SGLang's default state dtypes, ``configs/mamba_utils.py``)."""
        conv = self._linear_dims()[2]
        return self.linear_v_heads * self.linear_k_dim * self.linear_v_dim * 4 + conv * (self.linear_conv - 1) * 2


def _mla_preset() -> Model:
    # DeepSeek-R1 (config.json of deepseek-ai/DeepSeek-R1): 61 layers, hidden 7168, 128 heads,
    # q_lora_rank 1536, kv_lora_rank 512 + qk_rope_head_dim 64 = a 576-element latent per token
    # (one "KV head"), qk head dim 128 + 64, v head dim 128, 256 routed experts (8 per token,
    # width 2048) + 1 shared, the first 3 layers dense (18432), vocab 129280.
    return Model("DeepSeek-R1", 61, 7168, 128, 1, 192, 576, 18432, 129280, 256, 8, 2048, 1, 3, 1536, 128, 64)


# What the Qwen3.5 presets share (below): 2 KV heads of dim 256 with an output gate in the full-attention
# layers, 16 key heads and value heads of dim 128 in the linear ones, one shared expert as wide as a routed
# one, no dense FFN layer, vocab 248320; 0.5.23's qwen3_5.py replicates their K/V inside the DCP group.
_QWEN35 = dict(kv_heads=2, head_dim=256, kv_dim=512, ffn=0, vocab=248320, shared_experts=1, attn_output_gate=True, linear_k_heads=16,
               linear_k_dim=128, linear_v_dim=128, dcp_replicates_kv=True)  # fmt: skip

MODELS = {
    # Each from the model's config.json (num_hidden_layers, hidden_size, num_attention_heads,
    # num_key_value_heads, head_dim, intermediate_size / moe_intermediate_size, num_experts /
    # num_local_experts, num_experts_per_tok, vocab_size).
    # meta-llama/Llama-3.1-8B: 32 layers, hidden 4096, 32 q heads, 8 KV heads, head dim 128,
    # FFN 14336, vocab 128256.
    "llama-3.1-8b": Model("Llama-3.1-8B", 32, 4096, 32, 8, 128, 256, 14336, 128256),
    # meta-llama/Llama-3.1-70B (and Llama-3.3-70B-Instruct): 80 layers, hidden 8192, 64 q heads,
    # 8 KV heads, head dim 128, FFN 28672, vocab 128256.
    "llama-3.1-70b": Model("Llama-3.1-70B", 80, 8192, 64, 8, 128, 256, 28672, 128256),
    "llama-3.3-70b": Model("Llama-3.3-70B", 80, 8192, 64, 8, 128, 256, 28672, 128256),
    # meta-llama/Llama-3.1-405B: 126 layers, hidden 16384, 128 q heads, 8 KV heads, head dim 128,
    # FFN 53248, vocab 128256.
    "llama-3.1-405b": Model("Llama-3.1-405B", 126, 16384, 128, 8, 128, 256, 53248, 128256),
    # Qwen/Qwen2.5-72B: 80 layers, hidden 8192, 64 q heads, 8 KV heads, head dim 128, FFN 29568,
    # vocab 152064 (the q/k/v biases are left out: 0.01 % of the qkv weights).
    "qwen2.5-72b": Model("Qwen2.5-72B", 80, 8192, 64, 8, 128, 256, 29568, 152064),
    # Qwen/Qwen3-32B: 64 layers, hidden 5120, 64 q heads, 8 KV heads, head dim 128 (Q x D = 8192 >
    # hidden), FFN 25600, vocab 151936.
    "qwen3-32b": Model("Qwen3-32B", 64, 5120, 64, 8, 128, 256, 25600, 151936),
    # Qwen/Qwen3-235B-A22B: 94 layers, hidden 4096, 64 q heads, 4 KV heads, head dim 128, 128
    # experts (8 per token, width 1536), no dense layer, vocab 151936.
    "qwen3-235b-a22b": Model("Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 256, 12288, 151936, 128, 8, 1536),
    # mistralai/Mixtral-8x22B-v0.1: 56 layers, hidden 6144, 48 q heads, 8 KV heads, head dim 128,
    # 8 experts (2 per token, width 16384), vocab 32000.
    "mixtral-8x22b": Model("Mixtral-8x22B", 56, 6144, 48, 8, 128, 256, 16384, 32000, 8, 2, 16384),
    "deepseek-r1": _mla_preset(),
    # Hybrid: Qwen3.5 (config.json's text_config: layer_types three linear_attention then one
    # full_attention, full_attention_interval 4; attn_output_gate true; a shared expert with its own
    # sigmoid gate, left out like the router; tie_word_embeddings false). Qwen's own config.json files
    # are not among the stored public sources: these numbers are from copies of them that agree
    # (THUDM/slime scripts/models/qwen3.5-397B-A17B.sh and qwen3.5-35B-A3B.sh, and parsers' test
    # fixtures), except the 397B's shared_expert_intermediate_size: 1024 in slime's script and three
    # fixtures, 4096 in one (Megatron-Bridge's Qwen3.5 bridge test). 1024 is used: with it the
    # parameters add up to 396.2B total, 17.2B active (4096: 19.5B active). No dense FFN layer (ffn 0).
    # Qwen/Qwen3.5-397B-A17B: 60 layers (15 full attention), hidden 4096, 32 q heads, 2 KV heads, head
    # dim 256, 512 experts (10 per token, width 1024) + 1 shared (1024), vocab 248320; linear attention
    # 16 key heads x 128, 64 value heads x 128, conv kernel 4.
    "qwen3.5-397b-a17b": Model(
        "Qwen3.5-397B-A17B", 60, 4096, 32, experts=512, experts_per_token=10, expert_ffn=1024, full_attention_layers=15, linear_v_heads=64, **_QWEN35
    ),
    # Qwen/Qwen3.5-35B-A3B: 40 layers (10 full attention), hidden 2048, 16 q heads, 2 KV heads, head dim
    # 256, 256 experts (8 per token, width 512) + 1 shared (512), vocab 248320; linear attention 16 key
    # heads x 128, 32 value heads x 128, conv kernel 4 (34.6B total, 3.4B active).
    "qwen3.5-35b-a3b": Model(
        "Qwen3.5-35B-A3B", 40, 2048, 16, experts=256, experts_per_token=8, expert_ffn=512, full_attention_layers=10, linear_v_heads=32, **_QWEN35
    ),
}

# The models of the comparison table (benchmark/results/perf-model.md): ``--model table``.
TABLE_MODELS = ["llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen2.5-72b", "qwen3-32b", "qwen3-235b-a22b", "mixtral-8x22b"]


def model_from_config(path: str) -> Model:
    """A Model from a Hugging Face config.json (Llama/Qwen/Mistral/Mixtral/Qwen-MoE/DeepSeek MLA)."""
    with open(path) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    q = c["num_attention_heads"]
    hidden = c["hidden_size"]
    vocab = c["vocab_size"]
    experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
    if "kv_lora_rank" in c:  # MLA
        rope = c.get("qk_rope_head_dim", 64)
        return Model(
            os.path.basename(os.path.dirname(os.path.abspath(path))) or "mla", c["num_hidden_layers"], hidden, q, 1,
            c.get("qk_nope_head_dim", 128) + rope, c["kv_lora_rank"] + rope, c.get("intermediate_size", 0), vocab,
            experts, c.get("num_experts_per_tok", 0), c.get("moe_intermediate_size", 0), c.get("n_shared_experts", 0),
            c.get("first_k_dense_replace", 0), c.get("q_lora_rank") or 0, c.get("v_head_dim", 128), rope,
        )  # fmt: skip
    d = c.get("head_dim") or hidden // q
    layers = c["num_hidden_layers"]
    expert_ffn = c.get("moe_intermediate_size") or c.get("intermediate_size", 0)
    hybrid = {}
    if "linear_num_value_heads" in c:  # Qwen3.5 / Qwen3-Next: Gated DeltaNet layers between full attention
        types = c.get("layer_types") or [("full" if (i + 1) % c.get("full_attention_interval", 4) == 0 else "linear")
                                         for i in range(layers)]  # fmt: skip
        hybrid = dict(
            full_attention_layers=sum(1 for t in types if t.startswith("full")), attn_output_gate=c.get("attn_output_gate", True),
            linear_k_heads=c["linear_num_key_heads"], linear_v_heads=c["linear_num_value_heads"],
            linear_k_dim=c["linear_key_head_dim"], linear_v_dim=c["linear_value_head_dim"],
            linear_conv=c.get("linear_conv_kernel_dim", 4), dcp_replicates_kv=c.get("model_type", "").startswith("qwen3_5"),
        )  # fmt: skip
    return Model(
        os.path.basename(os.path.dirname(os.path.abspath(path))) or "model", layers, hidden, q,
        c.get("num_key_value_heads", q), d, 2 * d, c.get("intermediate_size", 0), vocab, experts,
        c.get("num_experts_per_tok", 0), expert_ffn,
        shared_experts=round(c.get("shared_expert_intermediate_size", 0) / expert_ffn) if experts and expert_ffn else 0,
        **hybrid,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Layouts and the step model.
# --------------------------------------------------------------------------------------------

FAMILIES = ("tp", "dcp", "dcp-a2a", "helix")  # what --families / --compare consider (baselines: medha, dp-ep)
FAMILY_TITLES = {"tp": "TP", "dcp": "DCP (0.5.23)", "dcp-a2a": "DCP a2a+repQ", "helix": "Helix"}


@dataclass(frozen=True)
class Layout:
    """N GPUs and how attention and the FFN are split over them. ``kvp``: the KV's sequence-sharding
    width (Helix's KVP, DCP's ``--dcp-size``). ``family``:

    - ``"tp"`` (``kvp`` 1): plain TP N for everything; KV heads replicated once N > K.
    - ``"helix"``: attention KVP x TPA (KV sharded along the sequence over KVP), then o_proj and
      the FFN TP over all N (the FFN of an MoE: every routed expert sharded over N; under uniform
      routing that reads the same expert bytes per GPU as any TPF x EP grid, the split only
      changes the FFN's collective, which this model takes as TP's all-reduce).
    - ``"dcp"``: upstream ``--tp N --dcp-size kvp`` as 0.5.23 runs MHA/GQA decode (Triton backend):
      qkv_proj TP over N; Q all-gathered over the DCP group (kvp x Q/N heads attend); the pool keeps
      ``max(1, K // (N/kvp))`` KV heads for S/kvp tokens; LSE all-gather, fp32 output all-reduce;
      o_proj and the FFN TP over N. Wrong in 0.5.23 where K x kvp > N (``layout_problem``).
    - ``"dcp-a2a"``: DCP with the All-to-All exchange and Q replicated over the DCP group (0.5.23's
      MLA path with ``--dcp-comm-backend a2a --dcp-replicate-q-proj``; for GQA, with the KV-head fix
      that replicates K/V within the group): qkv_proj over N/kvp, one All-to-All, o_proj and the FFN
      over N. Where N/kvp divides K this is Helix's layout; it also allows N/kvp > K.
    - ``"medha"``: the paper's "vanilla KVP" baseline: attention as Helix, but o_proj and the FFN
      TP over the TPA GPUs only (replicated over KVP), its exchange not overlapped.
    - ``"dp-ep"``: the paper's MoE baseline: data-parallel attention (each GPU serves B/N requests
      with all heads and its own KV) and expert-parallel routed experts over N (token dispatch and
      combine all-to-alls; shared experts and dense layers replicated).
    """

    n: int
    kvp: int  # 1: plain TP (or dp-ep)
    family: str = ""  # "" = "tp" when kvp == 1 else "helix"

    @property
    def kind(self) -> str:
        return self.family or ("tp" if self.kvp == 1 else "helix")

    @property
    def tpa(self) -> int:
        """GPUs the attention heads are split over (DCP: N/d, the heads of a gathered group)."""
        return self.n // self.kvp

    def name(self) -> str:
        return {
            "tp": f"TP{self.n}",
            "helix": f"Helix KVP{self.kvp}xTPA{self.tpa}",
            "dcp": f"TP{self.n} DCP{self.kvp}",
            "dcp-a2a": f"TP{self.n} DCP{self.kvp} a2a+repQ",
            "medha": f"KVP{self.kvp}xTP{self.tpa} (Medha)",
            "dp-ep": f"DP{self.n} attn + EP{self.n}",
        }[self.kind]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dcp_layouts(model: Model, n: int) -> List[Layout]:
    """``--dcp-size d`` for every d > 1 dividing N: 0.5.23's MHA path (GQA models; shown even where
    it computes wrongly, see ``layout_problem``) and the All-to-All + replicated-Q variant (where
    N/d and K divide one another, so every GPU holds whole KV heads)."""
    out = []
    for d in _divisors(n)[1:]:
        if model.q_heads % n:
            continue
        if not model.mla:
            out.append(Layout(n, d, "dcp"))
        tpa = n // d
        if model.mla or tpa % model.kv_heads == 0 or model.kv_heads % tpa == 0:
            out.append(Layout(n, d, "dcp-a2a"))
    return out


def layouts(model: Model, n: int, baselines: bool = False, dcp: bool = False) -> List[Layout]:
    """Plain TP and every Helix KVP x TPA = n whose TPA divides K (so TPA <= K); with
    ``baselines``, the paper's other families too (Medha-style KVP x TP; DP attention + EP for MoE);
    with ``dcp``, upstream's ``--dcp-size`` layouts (``dcp_layouts``)."""
    out = []
    for kvp in _divisors(n):
        tpa = n // kvp
        if kvp > 1 and (model.kv_heads % tpa or model.q_heads % n):
            continue
        out.append(Layout(n, kvp))
        if baselines and kvp > 1:
            out.append(Layout(n, kvp, "medha"))
    if baselines and model.moe:
        out.append(Layout(n, 1, "dp-ep"))
    if dcp:
        out += dcp_layouts(model, n)
    return out


def layout_problem(model: Model, layout: Layout) -> str:
    """Why SGLang 0.5.23 does not run ``layout`` correctly ("" when it does, or for other families).

    0.5.23's ``--dcp-size d`` keeps Llama-style K/V (sharded over the TP ranks) while its pool and
    decode assume every rank of a DCP group holds the same KV heads: true only where d divides N/K
    (K x d <= N). Otherwise query heads read zeros or the wrong KV head, silently
    (benchmark/dcp_gqa_check.py, docs/upstream-pr.md). Not for Qwen3.5, whose 0.5.23 attention
    replicates K/V inside the DCP group (``dcp_replicates_kv``)."""
    if layout.kind != "dcp" or model.dcp_replicates_kv:
        return ""
    n, d, k = layout.n, layout.kvp, model.kv_heads
    if n % k or (n // k) % d:
        return f"K x d = {k * d} > N = {n}: wrong in 0.5.23 without the KV-head fix"
    return ""


@dataclass
class Step:
    layout: Layout
    batch: int
    kv_s: float
    weights_s: float
    a2a_s: float
    ar_s: float
    kv_bytes_per_request: float  # KV (and a hybrid's linear-attention state) one GPU holds for one request, all layers
    max_batch: int  # requests whose KV fits next to the weights in 90% of HBM
    ag_s: float = 0.0  # DCP's all-gathers (Q and LSE)
    lm_head_s: float = 0.0  # the part of weights_s that is lm_head (not a decoder layer)
    problem: str = ""  # why 0.5.23 computes this layout wrongly ("" = it does not)

    @property
    def valid(self) -> bool:
        return not self.problem

    @property
    def total_s(self) -> float:
        return self.kv_s + self.weights_s + self.a2a_s + self.ag_s + self.ar_s

    @property
    def tok_s_user(self) -> float:
        return 1.0 / self.total_s

    @property
    def tok_s_gpu(self) -> float:
        return self.batch / self.total_s / self.layout.n


def kv_heads_per_gpu(model: Model, layout: Layout) -> float:
    """KV heads one GPU stores for its tokens: plain TP max(1, K/N) (replicated once N > K),
    Helix / Medha K/TPA, DCP max(1, K/(N/d)) (0.5.23's ``get_num_kv_heads(tp, dcp)``; the same
    with the KV-head fix), DP attention K. MLA: the one latent head, replicated on every attention rank."""
    if model.mla:
        return 1.0
    if layout.kind == "dp-ep":
        return float(model.kv_heads)
    return max(1.0, model.kv_heads / layout.tpa)  # TP: tpa = N


def tokens_per_gpu(context: int, layout: Layout) -> float:
    return context / layout.kvp


def weight_splits(layout: Layout) -> Tuple[int, int, int]:
    """``(qkv, heads, dense)``: GPUs that qkv_proj's weights, the attending query heads, and
    o_proj / the FFN / lm_head are split over. DCP (0.5.23) shards qkv_proj over N but attends
    with the DCP group's gathered heads (Q/TPA); Helix and DCP a2a+repQ replicate qkv_proj over
    KVP; Medha also keeps o_proj and the FFN on TPA; DP attention keeps everything whole."""
    n, tpa = layout.n, layout.tpa
    return {
        "tp": (n, n, n),
        "helix": (tpa, tpa, n),
        "dcp": (n, tpa, n),
        "dcp-a2a": (tpa, tpa, n),
        "medha": (tpa, tpa, tpa),
        "dp-ep": (1, 1, 1),
    }[layout.kind]


def expected_distinct_experts(model: Model, batch: int) -> float:
    """Routed experts a batch of B tokens touches per layer (uniform routing): E(1 - (1 - k/E)^B)."""
    if not model.moe:
        return 0.0
    return model.experts * (1.0 - (1.0 - model.experts_per_token / model.experts) ** batch)


def helix_a2a_bytes(model: Model, n: int, kvp: int, batch: int, act_bytes: float, dim: Optional[int] = None) -> float:
    """Bytes one GPU sends in a layer's All-to-All: (KVP-1)/KVP of its partials [B, Q/TPA, Dv]
    and their fp32 LSE, i.e. (KVP-1) x B x (Q/N) x (Dv x e + 4). ``dim``: the exchanged width when
    it is not Dv (0.5.23's MLA DCP exchanges the latent, kv_lora_rank)."""
    return (kvp - 1) * batch * (model.q_heads / n) * ((dim or model.dv) * act_bytes + 4)


def collectives_per_layer(model: Model, layout: Layout, batch: int, act_bytes: float = 2.0,
                          linear: bool = False) -> List[Tuple[str, float]]:  # fmt: skip
    """``[(collective, bytes one GPU sends)]`` of one decoder layer (dp-ep: of one MoE layer).

    TP, Helix, DCP: a ring all-reduce of [B, hidden] after o_proj and one after the FFN, over N
    (Medha: over TPA). Helix / Medha / DCP a2a+repQ: one All-to-All over the KVP group. DCP
    (0.5.23): all-gather Q, all-gather the fp32 LSE, all-reduce the fp32 outputs
    (``comm_per_layer``). dp-ep: the token dispatch and combine all-to-alls, B/N tokens x k experts x [H].
    ``linear``: a hybrid model's linear-attention layer, plain TP in every layout: no exchange.
    """
    n, kvp, kind = layout.n, layout.kvp, layout.kind
    out: List[Tuple[str, float]] = []
    if kind == "dp-ep":
        if n > 1:
            ep = math.ceil(batch / n) * model.experts_per_token * model.hidden * act_bytes * (n - 1) / n
            out += [("all-to-all", ep), ("all-to-all", ep)]
        return out
    if kind in ("helix", "medha", "dcp-a2a") and kvp > 1 and not linear:
        dim = model.kv_dim - model.mla_rope_dim if (model.mla and kind == "dcp-a2a") else None
        out.append(("all-to-all", helix_a2a_bytes(model, n, kvp, batch, act_bytes, dim)))
    if kind == "dcp" and kvp > 1 and not linear:
        c = comm_per_layer(model, n, "dcp", kvp, batch, act_bytes)
        out += [("all-gather", c["all-gather Q"]), ("all-gather", c["all-gather LSE (fp32)"])]
        out.append(("all-reduce", c["all-reduce outputs (fp32)"]))
    ar_n = weight_splits(layout)[2]
    if ar_n > 1:
        ar_bytes = 2.0 * (ar_n - 1) / ar_n * batch * model.hidden * act_bytes
        out += [("all-reduce", ar_bytes), ("all-reduce", ar_bytes)]
    return out


def collective_counts(model: Model, layout: Layout) -> Dict[str, int]:
    """How many of each collective one decoder layer runs."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for kind, _ in collectives_per_layer(model, layout, 1):
        counts[kind] += 1
    return counts


def _roofline(bytes_: float, flops: float, hw: Hardware, peak: float) -> float:
    return max(bytes_ / hw.hbm_bytes_s, flops / peak)


def step(model: Model, hw: Hardware, layout: Layout, context: int, batch: int, w_dtype: str, kv_dtype: str, act_bytes: float = 2.0) -> Step:
    """One decode step of ``batch`` requests at ``context`` tokens on ``layout``: seconds per part."""
    n, kind = layout.n, layout.kind
    wb, kvb = DTYPE_BYTES[w_dtype], DTYPE_BYTES[kv_dtype]
    peak = hw.flops.get(w_dtype) or hw.flops["bf16"]
    h = model.hidden
    tokens = tokens_per_gpu(context, layout)
    dp = kind == "dp-ep"
    attn_batch = math.ceil(batch / n) if dp else batch  # requests whose attention one GPU runs
    qkv_split, attn_split, ffn_split = weight_splits(layout)

    # Attention over the KV: each GPU reads its tokens' KV, for its KV heads, once per request.
    kv_per_token_layer = kv_heads_per_gpu(model, layout) * model.kv_dim * kvb
    kv_bytes = attn_batch * tokens * kv_per_token_layer  # per layer
    # Query heads one GPU attends with: Q / attn_split (plain TP Q/N; Helix, Medha and both DCPs
    # Q/TPA: DCP gathers d x Q/N; DP all Q). MLA decode attends in the latent space: scores over
    # latent + rope, values over the latent.
    q_local = model.q_heads / attn_split
    if model.mla:
        qk_dim, v_dim = model.kv_dim, model.kv_dim - model.mla_rope_dim
    else:
        qk_dim, v_dim = model.head_dim, model.dv
    attn_flops = 2.0 * attn_batch * tokens * q_local * (qk_dim + v_dim)
    kv_s = _roofline(kv_bytes, attn_flops, hw, peak)
    # A hybrid model: only its full-attention layers hold KV; each linear-attention layer reads and
    # writes every request's state instead, split like the FFN (TP over N; dp-ep: whole), about one
    # FLOP per byte (memory-bound: bytes only).
    full, linear = model.full_layers, model.layers - model.full_layers
    f = full / model.layers  # 1.0 unless hybrid
    state_request = model.linear_state_bytes() / ffn_split  # per linear layer, one request, one GPU
    state_s = 2.0 * attn_batch * state_request / hw.hbm_bytes_s

    # Weights one GPU reads per layer (and the GEMM FLOPs, 2 x tokens x parameters): qkv_proj over
    # its split, o_proj over N (Medha: TPA; DP: whole); the FFN over N (Medha: TPA; MoE: the
    # experts the batch touches, and the shared ones; dp-ep: routed experts over N, the rest whole).
    # qkv_proj / split counts TP's and DCP's K/V weights once: with N > K they are replicated, which
    # this leaves out (at most 2 x D x hidden per layer, ~1-3 % of a layer's weights per GPU).
    # A hybrid model's linear-attention layers: their projections split like o_proj, in every layout.
    attn_w = model.qkv_params() / qkv_split + model.o_params() / ffn_split
    linear_w = model.linear_params() / ffn_split
    moe_layers = model.layers - model.dense_layers if model.moe else 0
    dense_layers = model.layers - moe_layers
    dense_w = 3.0 * h * model.ffn / ffn_split
    one_expert = 3.0 * h * model.expert_ffn
    routed_split = n if dp else ffn_split
    routed_w = expected_distinct_experts(model, batch) * one_expert / routed_split
    shared_w = model.shared_experts * one_expert / ffn_split

    def dense_and_moe_s(a: float) -> Tuple[float, float]:  # one dense and one MoE layer whose attention has a params
        moe_flops = 2.0 * (attn_batch * (a + shared_w) + batch * model.experts_per_token * one_expert / routed_split)
        return (_roofline((a + dense_w) * wb, 2.0 * attn_batch * (a + dense_w), hw, peak),
                _roofline((a + routed_w + shared_w) * wb, moe_flops, hw, peak))  # fmt: skip

    # dense and MoE layers hold full and linear attention in the same proportion (exact for f = 1)
    (full_dense_s, full_moe_s), (linear_dense_s, linear_moe_s) = dense_and_moe_s(attn_w), dense_and_moe_s(linear_w)
    w_dense_s = f * full_dense_s + (1 - f) * linear_dense_s
    w_moe_s = f * full_moe_s + (1 - f) * linear_moe_s
    lm_head = model.vocab * h / ffn_split
    lm_head_s = _roofline(lm_head * wb, 2.0 * attn_batch * lm_head, hw, peak)
    weights_s = dense_layers * w_dense_s + moe_layers * w_moe_s + lm_head_s

    # Communication: per collective, latency + bytes / NVLink bandwidth (collectives_per_layer),
    # in full-attention layers and (no exchange) linear-attention ones.
    comm: Tuple[Dict[str, float], Dict[str, float]] = (dict.fromkeys(COLLECTIVES, 0.0), dict.fromkeys(COLLECTIVES, 0.0))
    for c, is_linear in zip(comm, (False, True)):
        for coll, nbytes in collectives_per_layer(model, layout, batch, act_bytes, is_linear):
            c[coll] += hw.latency(coll) + nbytes / hw.link_bytes_s
    counts = (moe_layers, 0) if dp else (full, linear)  # dp-ep's all-to-alls run in the MoE layers only
    a2a_s, ag_s, ar_s = (counts[0] * comm[0][k] + counts[1] * comm[1][k] for k in ("all-to-all", "all-gather", "all-reduce"))

    # Capacity: every weight resident (all experts), embeddings and lm_head; KV in what is left.
    all_experts = (model.experts / routed_split + model.shared_experts / ffn_split) * one_expert
    mean_attn_w = f * attn_w + (1 - f) * linear_w
    resident = dense_layers * (mean_attn_w + dense_w) + moe_layers * (mean_attn_w + all_experts)
    resident = (resident + 2 * lm_head) * wb
    kv_request = full * kv_per_token_layer * tokens + linear * state_request
    per_gpu = max(0, int((0.9 * hw.hbm_bytes - resident) // kv_request))
    max_batch = per_gpu * n if dp else per_gpu  # DP: each GPU holds the KV of its own requests
    return Step(layout, batch, full * kv_s + linear * state_s, weights_s, a2a_s, ar_s, kv_request, max_batch,
                ag_s, lm_head_s, layout_problem(model, layout))  # fmt: skip


def layer_seconds(model: Model, s: Step) -> float:
    """One decoder layer of ``s`` on one GPU (the step without lm_head, per layer; MoE models with
    dense layers: their mean)."""
    return (s.total_s - s.lm_head_s) / model.layers


# --------------------------------------------------------------------------------------------
# Communication per layer and decode step, per GPU: plain TP, Helix, upstream --dcp-size (MHA).
# --------------------------------------------------------------------------------------------


def comm_per_layer(model: Model, n: int, scheme: str, size: int, batch: int = 1, act_bytes: float = 2.0) -> Dict[str, float]:
    """Bytes one GPU sends per attention layer and decode step, by collective (ring algorithms:
    an all-gather sends (G-1) x its input, an all-reduce 2(G-1)/G x its buffer).

    ``scheme``: ``"tp"`` (plain ``--tp n``; ``size`` ignored), ``"helix"`` (``--helix-kvp-size
    size``) or ``"dcp"`` (upstream ``--dcp-size size``, its MHA decode path, Triton backend:
    sglang 0.5.23 ``triton_backend.py`` gathers Q over the DCP group, gathers the fp32 LSE, and
    all-reduces the fp32 outputs of all gathered heads, ``srt/layers/dcp/comm.py``). All three
    keep the TP all-reduces after o_proj and after the FFN, of ``[B, hidden]``.
    """
    h, d, dv, q = model.hidden, model.head_dim, model.dv, model.q_heads
    out = {"all-reduce o_proj + FFN": 2 * 2.0 * (n - 1) / n * batch * h * act_bytes if n > 1 else 0.0}
    if scheme == "helix" and size > 1:  # one All-to-All of [KVP, B, Q/N, Dv + LSE]; (KVP-1)/KVP leaves
        out["all-to-all partials + LSE"] = helix_a2a_bytes(model, n, size, batch, act_bytes)
    elif scheme == "dcp" and size > 1:
        hq = q / n  # query heads per rank (DCP keeps attention TP at n; heads are gathered)
        out["all-gather Q"] = (size - 1) * batch * hq * d * act_bytes
        out["all-gather LSE (fp32)"] = (size - 1) * batch * size * hq * 4
        out["all-reduce outputs (fp32)"] = 2.0 * (size - 1) / size * batch * size * hq * dv * 4
    elif scheme not in ("tp", "helix", "dcp"):
        raise ValueError(f"comm_per_layer: unknown scheme {scheme!r}")
    return out


def print_comm_table(model: Model, ns: List[int], batch: int = 1, act_bytes: float = 2.0, out=None) -> None:
    out = out or sys.stdout
    print(f"{model.name}: bytes one GPU sends per attention layer and decode step, batch {batch}, activations {act_bytes:g} B", file=out)
    print(f"{'layout':<24} {'collectives':>11} {'attention extra':>16} {'total':>10}  by collective", file=out)
    for n in ns:
        rows = [("TP%d" % n, "tp", 1)]
        rows += [(f"TP{n} {lay.name()}", "helix", lay.kvp) for lay in layouts(model, n) if lay.kind == "helix"]
        rows += [(f"TP{n} DCP{k} (upstream)", "dcp", k) for k in range(2, n + 1) if n % k == 0]
        for name, scheme, size in rows:
            c = comm_per_layer(model, n, scheme, size, batch, act_bytes)
            extra = sum(v for k, v in c.items() if not k.startswith("all-reduce o_proj"))
            parts = ", ".join(f"{k} {v / 1024:.2f} KiB" for k, v in c.items())
            collectives = len(c) + 1  # the o_proj and FFN all-reduces are two
            print(f"{name:<24} {collectives:>11} {extra / 1024:>12.2f} KiB {sum(c.values()) / 1024:>6.2f} KiB  {parts}", file=out)


def sweep(model: Model, hw: Hardware, n: int, context: int, batches: List[int], w_dtype: str, kv_dtype: str,
          families: Optional[List[str]] = None, show_invalid: bool = False) -> List[Step]:  # fmt: skip
    """Every layout of ``families`` (default plain TP and Helix) at every batch whose KV fits.
    Layouts 0.5.23 computes wrongly only with ``show_invalid`` (for the table: never candidates)."""
    families = families or ["tp", "helix"]
    out = []
    for lay in layouts(model, n, dcp=any(f.startswith("dcp") for f in families)):
        if lay.kind not in families:
            continue
        for b in batches:
            s = step(model, hw, lay, context, b, w_dtype, kv_dtype)
            if b <= s.max_batch and (s.valid or show_invalid):
                out.append(s)
    return out


def pareto(steps: List[Step]) -> List[Step]:
    """Steps not beaten on both tokens/s/user and tokens/s/GPU by another (valid layouts only)."""
    steps = [s for s in steps if s.valid]
    front = []
    for s in steps:
        if not any(o.tok_s_user >= s.tok_s_user and o.tok_s_gpu >= s.tok_s_gpu and (o.tok_s_user > s.tok_s_user or o.tok_s_gpu > s.tok_s_gpu) for o in steps):
            front.append(s)
    return sorted(front, key=lambda s: s.tok_s_user)


def recommend(steps: List[Step], goal: str, target: float) -> Optional[Step]:
    """``latency``: the most tokens/s/GPU among steps with tokens/s/user >= target.
    ``throughput``: the most tokens/s/user among steps with tokens/s/GPU >= target.
    Layouts 0.5.23 computes wrongly are never chosen."""
    steps = [s for s in steps if s.valid]
    if goal == "latency":
        ok = [s for s in steps if s.tok_s_user >= target]
        return max(ok, key=lambda s: s.tok_s_gpu, default=None)
    ok = [s for s in steps if s.tok_s_gpu >= target]
    return max(ok, key=lambda s: s.tok_s_user, default=None)


# --------------------------------------------------------------------------------------------
# --compare: per model and case, the best layout of each family, and Helix's ratios.
# --------------------------------------------------------------------------------------------


def best_of_family(model: Model, hw: Hardware, n: int, context: int, batch: int, family: str,
                   w_dtype: str = "bf16", kv_dtype: str = "bf16") -> Tuple[Optional[Step], int]:  # fmt: skip
    """``(the fastest valid layout of family whose KV fits batch, or None; the family's largest
    batch that fits, over its valid layouts)``. At a fixed N and batch the fastest step is also the
    most tokens/s/GPU."""
    steps = [step(model, hw, lay, context, batch, w_dtype, kv_dtype) for lay in layouts(model, n, dcp=True) if lay.kind == family]
    steps = [s for s in steps if s.valid]
    fits = [s for s in steps if batch <= s.max_batch]
    best = min(fits, key=lambda s: s.total_s, default=None)
    return best, max((s.max_batch for s in steps), default=0)


def compare_row(model_key: str, hw_key: str, n: int, context: int, batch: int, hw: Optional[Hardware] = None) -> Dict[str, object]:
    """One case: per family its best layout, tokens/s/user, tokens/s/GPU and largest fitting batch;
    the ratios Helix/TP, Helix/DCP (0.5.23) and Helix/DCP a2a+repQ in tokens/s/user (= step time
    ratios; at equal N and batch also the tokens/s/GPU ratios). "" where a family has no layout."""
    model = MODELS[model_key]
    hw = hw or HARDWARE[hw_key]
    row: Dict[str, object] = {"model": model.name, "hw": hw_key, "gpus": n, "context": context, "batch": batch,
                              "latency_us": latency_label(hw).split(" ")[0]}  # fmt: skip
    best = {}
    for fam in FAMILIES:
        s, max_b = best_of_family(model, hw, n, context, batch, fam)
        best[fam] = s
        row[f"{fam}_layout"] = s.layout.name() if s else ""
        row[f"{fam}_tok_s_user"] = round(s.tok_s_user, 2) if s else ""
        row[f"{fam}_tok_s_gpu"] = round(s.tok_s_gpu, 3) if s else ""
        row[f"{fam}_max_batch"] = s.max_batch if s else max_b
        row[f"{fam}_layouts"] = sum(1 for x in layouts(model, n, dcp=True) if x.kind == fam and not layout_problem(model, x))
    for other in ("tp", "dcp", "dcp-a2a"):
        h, o = best["helix"], best[other]
        row[f"helix_over_{other}"] = round(o.total_s / h.total_s, 3) if (h and o) else ""
    return row


def compare_rows(model_keys: List[str], hw_keys: List[str], ns: List[int], contexts: List[int], batches: List[int],
                 latencies_s: Optional[List[Optional[float]]] = None, **per_kind_s: Optional[float]) -> List[Dict[str, object]]:  # fmt: skip
    rows = []
    for lat in latencies_s or [None]:
        for key in model_keys:
            for hw_key in hw_keys:
                hw = with_latency(HARDWARE[hw_key], lat, **per_kind_s)
                for n in ns:
                    for context in contexts:
                        for batch in batches:
                            rows.append(compare_row(key, hw_key, n, context, batch, hw))
    return rows


def _ratio(x) -> str:
    return f"{x:.2f}x" if x != "" else "-"


def _no_layout(row: Dict[str, object], fam: str) -> str:
    """Why a family has no step in ``row``: no layout 0.5.23 runs correctly, or the batch's KV (or
    the weights alone: B <= 0) does not fit."""
    if not row[f"{fam}_layouts"]:
        return "no layout"
    return f"does not fit (B <= {row[f'{fam}_max_batch']})"


def _family_cell(row: Dict[str, object], fam: str) -> str:
    if not row[f"{fam}_layout"]:
        return _no_layout(row, fam)
    layout = str(row[f"{fam}_layout"]).replace(f"TP{row['gpus']} ", "").replace("Helix ", "")
    return f"{layout} {row[f'{fam}_tok_s_user']:.1f}/{row[f'{fam}_tok_s_gpu']:.2f} B<={row[f'{fam}_max_batch']}"


def print_compare(rows: List[Dict[str, object]], out=None) -> None:
    """Per model: one line per case, each family's best layout as "layout tok/s/user/tok/s/GPU
    B<=largest batch that fits", then Helix/TP, Helix/DCP (0.5.23) and Helix/DCP a2a+repQ."""
    out = out or sys.stdout
    last = None
    for r in rows:
        head = (r["model"], r["latency_us"])
        if head != last:
            print(f"\n{r['model']}, bf16, collective latency {r['latency_us']} us (all-reduce/all-gather/all-to-all)", file=out)
            print(f"{'hw':<5} {'N':>3} {'S':>8} {'B':>3}  " + "  ".join(f"{FAMILY_TITLES[f]:<34}" for f in FAMILIES)
                  + f" {'H/TP':>6} {'H/DCP':>6} {'H/a2a':>6}", file=out)  # fmt: skip
            last = head
        cells = "  ".join(f"{_family_cell(r, f):<34}" for f in FAMILIES)
        ratios = " ".join(f"{_ratio(r[f'helix_over_{o}']):>6}" for o in ("tp", "dcp", "dcp-a2a"))
        print(f"{r['hw']:<5} {r['gpus']:>3} {r['context']:>8} {r['batch']:>3}  {cells} {ratios}", file=out)


def _k(x: object) -> str:
    x = int(x)
    return f"{x >> 20}M" if x >= 1 << 20 else f"{x >> 10}K"


def _ratio_cell(r: Dict[str, object]) -> str:
    """ "Helix/TP · Helix/DCP": "OOM" where that family's KV (or weights) does not fit the batch but
    Helix's does, "n/a" where 0.5.23 has no correct --dcp-size; "Helix OOM" / "-" where Helix (and
    nothing else) fits."""
    if not r["helix_layout"]:
        return "Helix OOM" if (r["tp_layout"] or r["dcp_layout"]) else "-"
    tp = _ratio(r["helix_over_tp"]).replace("x", "") if r["tp_layout"] else "TP OOM"
    if not r["dcp_layouts"]:
        return f"{tp} · n/a"
    return f"{tp} · " + (_ratio(r["helix_over_dcp"]).replace("x", "") if r["dcp_layout"] else "DCP OOM")


def print_compare_markdown(rows: List[Dict[str, object]], detail: Optional[List[Tuple[int, int]]] = None, out=None) -> None:
    """The compact tables of benchmark/results/perf-model.md (and the H200 one in benchmark/README.md): per GPU and latency, one line per model and N,
    one cell per (context, batch): "Helix/TP · Helix/DCP" (``_ratio_cell``); then, per GPU and
    ``detail`` case (context, batch; default the first of each), every family's best layout,
    tokens/s/user, tokens/s/GPU and largest fitting batch."""
    out = out or sys.stdout
    cases = list(dict.fromkeys((r["context"], r["batch"]) for r in rows))
    for hw_key, lat in dict.fromkeys((r["hw"], r["latency_us"]) for r in rows):
        sel = [r for r in rows if (r["hw"], r["latency_us"]) == (hw_key, lat)]
        print(f"\n{HARDWARE[hw_key].name}, collective latency {lat} us; cell: Helix/TP · Helix/DCP (0.5.23)\n", file=out)
        print("| model | N | " + " | ".join(f"{_k(c)} B={b}" for c, b in cases) + " |", file=out)
        print("|---|---|" + "---|" * len(cases), file=out)
        for model, n in dict.fromkeys((r["model"], r["gpus"]) for r in sel):
            cells = [_ratio_cell(next(x for x in sel if (x["model"], x["gpus"], x["context"], x["batch"]) == (model, n, c, b)))
                     for c, b in cases]  # fmt: skip
            print(f"| {model} | {n} | " + " | ".join(cells) + " |", file=out)
    for (hw_key, lat), (c0, b0) in ((k, c) for k in dict.fromkeys((r["hw"], r["latency_us"]) for r in rows) for c in detail or cases[:1]):
        sel = [r for r in rows if (r["hw"], r["latency_us"], r["context"], r["batch"]) == (hw_key, lat, c0, b0)]
        print(f"\n{HARDWARE[hw_key].name}, {_k(c0)} context, batch {b0}, collective latency {lat} us; "
              f"cell: best layout · tokens/s/user · tokens/s/GPU · largest batch that fits\n", file=out)  # fmt: skip
        print("| model | N | " + " | ".join(FAMILY_TITLES[f] for f in FAMILIES) + " | Helix/TP | Helix/DCP |", file=out)
        print("|---|---|" + "---|" * (len(FAMILIES) + 2), file=out)
        for r in sel:
            cells = []
            for fam in FAMILIES:
                if not r[f"{fam}_layout"]:
                    cells.append(_no_layout(r, fam))
                    continue
                name = str(r[f"{fam}_layout"]).replace(f"TP{r['gpus']} ", "").replace("Helix ", "")
                cells.append(f"{name} · {r[f'{fam}_tok_s_user']:.0f} · {r[f'{fam}_tok_s_gpu']:.1f} · {r[f'{fam}_max_batch']}")
            print(f"| {r['model']} | {r['gpus']} | " + " | ".join(cells) + f" | {_ratio(r['helix_over_tp'])} | {_ratio(r['helix_over_dcp'])} |", file=out)


def write_compare_csv(rows: List[Dict[str, object]], path: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# --------------------------------------------------------------------------------------------
# The paper's headline ratios (arXiv 2507.07120 v1, section 3), under its stated assumptions:
# GB200 NVL72, FP4 weights, KV and arithmetic, 1M-token context, 1 to 64 GPUs, the best of a
# sweep over layouts and batch sizes. Its numbers are ratios of Pareto frontiers (tokens/s/user
# against tokens/s/GPU): "max interactivity" compares the frontiers' highest tokens/s/user;
# "throughput" the tokens/s/GPU at equal tokens/s/user ("up to": the best such gap).
# Llama-405B is compared against TP sharding, DeepSeek-R1 against the best baseline (TP, DP
# attention + EP, Medha-style KVP); pipeline parallelism never helps a per-token latency and is
# left out here.
# --------------------------------------------------------------------------------------------

PAPER = {
    "llama-3.1-405b": {"baseline": "tp", "interactivity": 1.13, "throughput": 4.0, "batch": 4.0},
    "deepseek-r1": {"baseline": "best", "interactivity": 1.5, "throughput": 32.0, "batch": 32.0},
}
PAPER_GPUS = [1, 2, 4, 8, 16, 32, 64]
PAPER_BATCHES = [2**i for i in range(13)]


def frontier_ratios(helix: List[Step], base: List[Step]) -> Dict[str, float]:
    """Max tokens/s/user ratio; the largest tokens/s/GPU ratio at equal tokens/s/user (for each
    Helix frontier point, the best baseline point at least as interactive); and the same for the
    batch (concurrent users, whatever the GPU count: the paper equates the two)."""
    inter = max(s.tok_s_user for s in helix) / max(s.tok_s_user for s in base)
    best, batch = 0.0, 0.0
    for h in helix:
        rivals = [b for b in base if b.tok_s_user >= h.tok_s_user]
        if rivals:
            best = max(best, h.tok_s_gpu / max(b.tok_s_gpu for b in rivals))
            batch = max(batch, h.batch / max(b.batch for b in rivals))
    return {"interactivity": inter, "throughput": best, "batch": batch}


def paper_ratios(key: str, latency_s: float = ALPHA_S, context: int = 1 << 20, baseline: Optional[str] = None) -> Dict[str, float]:
    """Helix's frontier against TP's (``baseline`` "tp") or the best baseline's ("best"; default:
    what the paper compares that model with)."""
    model, hw = MODELS[key], HARDWARE["gb200-nvl72"]
    hw = with_latency(hw, latency_s)
    steps = []
    for n in PAPER_GPUS:
        for lay in layouts(model, n, baselines=True):
            for b in PAPER_BATCHES:
                s = step(model, hw, lay, context, b, "fp4", "fp4", act_bytes=0.5)
                if b <= s.max_batch:
                    steps.append(s)
    helix = [s for s in steps if s.layout.kind == "helix"]
    baseline = baseline or PAPER[key]["baseline"]
    base = [s for s in steps if s.layout.kind != "helix" and (baseline == "best" or s.layout.kind == "tp")]
    return frontier_ratios(helix, base)


def print_paper(out=None) -> None:
    out = out or sys.stdout
    alphas = (3e-6, 10e-6, 30e-6)
    print("Helix against a baseline, GB200 NVL72, FP4, 1M context, 1-64 GPUs (paper: arXiv 2507.07120 v1, section 3);", file=out)
    print("the model's ratio at three per-collective latencies a (its one free parameter); * = what the paper compares", file=out)
    print(f"{'model':<16} {'metric':<14} {'baseline':<9} {'paper':>6} " + " ".join(f"{f'a={a * 1e6:g}us':>9}" for a in alphas), file=out)
    for key, claim in PAPER.items():
        for baseline in ("tp", "best"):
            got = [paper_ratios(key, a, baseline=baseline) for a in alphas]
            for metric in ("interactivity", "throughput", "batch"):
                paper = f"{claim[metric]:>5.2f}x" if baseline == claim["baseline"] else f"{'-':>6}"
                mark = "*" if baseline == claim["baseline"] else " "
                print(f"{MODELS[key].name:<16} {metric:<14} {baseline + mark:<9} {paper} " + " ".join(f"{g[metric]:>8.2f}x" for g in got), file=out)


# --------------------------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------------------------


def print_table(steps: List[Step], out=None) -> None:
    out = out or sys.stdout
    head = (f"{'layout':<30} {'B':>5} {'kv ms':>8} {'w ms':>8} {'a2a ms':>7} {'ag ms':>7} {'ar ms':>7} {'step ms':>8} "
            f"{'tok/s/user':>10} {'tok/s/GPU':>10} {'maxB':>6}")  # fmt: skip
    print(head, file=out)
    for s in steps:
        note = f"  INVALID: {s.problem}" if s.problem else ""
        print(
            f"{s.layout.name():<30} {s.batch:>5} {s.kv_s * 1e3:>8.3f} {s.weights_s * 1e3:>8.3f} {s.a2a_s * 1e3:>7.3f} "
            f"{s.ag_s * 1e3:>7.3f} {s.ar_s * 1e3:>7.3f} {s.total_s * 1e3:>8.3f} {s.tok_s_user:>10.1f} {s.tok_s_gpu:>10.2f} "
            f"{s.max_batch:>6}{note}",
            file=out,
        )


def write_pareto_png(steps: List[Step], path: str, title: str) -> None:
    """tokens/s/user (x) against tokens/s/GPU (y), log axes, one line per layout over the batch."""
    from sglang_helix.plot import line_plot_png

    series = {}
    for s in sorted(steps, key=lambda s: s.batch):
        series.setdefault(s.layout.name(), []).append((s.tok_s_user, max(s.tok_s_gpu, 1e-9)))
    line_plot_png(series, path, title, "tokens/s/user", "tokens/s/GPU", logx=True, logy=True)


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def _names(s: str) -> List[str]:
    return [x for x in s.split(",") if x]


def _model_keys(arg: str) -> List[str]:
    return TABLE_MODELS if arg == "table" else _names(arg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"a preset ({', '.join(MODELS)}) or a config.json path; with --compare a comma "
                                   f"list of presets, or 'table' ({', '.join(TABLE_MODELS)})")  # fmt: skip
    p.add_argument("--hw", type=_names, default=["h100"], help=f"{', '.join(HARDWARE)} (a comma list with --compare)")
    p.add_argument("--gpus", type=_ints, default=[8], help="N (a comma list with --compare)")
    p.add_argument("--context", type=_ints, default=[131072], help="tokens per request (a comma list with --compare)")
    p.add_argument("--batch", type=_ints, default=None, help="batch sizes (default 1..1024; --compare: 1,16,64)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPE_BYTES), help="weights (and compute)")
    p.add_argument("--kv-dtype", default=None, choices=list(DTYPE_BYTES), help="KV cache (default: --dtype)")
    p.add_argument("--families", type=_names, default=list(FAMILIES), help=f"layouts to consider: {', '.join(FAMILIES)}")
    p.add_argument("--latency-us", type=_floats, default=None,
                   help="per-collective latency in us, every collective; a comma list prints one table per value "
                        "(default: the GPU's cited per-collective values)")  # fmt: skip
    p.add_argument("--ar-us", type=float, help="all-reduce latency in us (after --latency-us)")
    p.add_argument("--ag-us", type=float, help="all-gather latency in us (after --latency-us)")
    p.add_argument("--a2a-us", type=float, help="all-to-all latency in us (after --latency-us)")
    p.add_argument("--pareto", help="write the tokens/s/user vs tokens/s/GPU plot here (PNG; first latency)")
    p.add_argument("--paper", action="store_true", help="the paper's headline ratios under its assumptions, and the model's")
    p.add_argument("--comm", type=_ints, help="print the per-layer communication table at these N (e.g. 4,8) and exit")
    p.add_argument("--recommend", choices=["latency", "throughput"], help="choose among every family's valid layouts")
    p.add_argument("--target", type=float, help="tokens/s/user (latency) or tokens/s/GPU (throughput)")
    p.add_argument("--compare", action="store_true", help="per model and case: each family's best layout and Helix's ratios")
    p.add_argument("--csv", help="--compare: also write the rows here")
    p.add_argument("--markdown", action="store_true", help="--compare: print the compact tables of benchmark/results/perf-model.md instead")
    p.add_argument("--detail", type=_ints, help="--markdown: context,batch[,context,batch...] of the per-family detail tables")
    args = p.parse_args(argv)
    if args.paper:
        print_paper()
        return 0
    if not args.model:
        p.error("--model is required (a preset or a config.json)")
    unknown = [h for h in args.hw if h not in HARDWARE] + [f for f in args.families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown --hw / --families value(s): {', '.join(unknown)}")
    us = {k: (v * 1e-6 if v is not None else None) for k, v in
          (("all_reduce", args.ar_us), ("all_gather", args.ag_us), ("all_to_all", args.a2a_us))}  # fmt: skip
    latencies = [x * 1e-6 for x in args.latency_us] if args.latency_us else [None]
    if args.compare:
        keys = _model_keys(args.model)
        missing = [k for k in keys if k not in MODELS]
        if missing:
            p.error(f"--compare takes presets: {', '.join(missing)}")
        rows = compare_rows(keys, args.hw, args.gpus, args.context, args.batch or [1, 16, 64], latencies, **us)
        if args.markdown:
            print_compare_markdown(rows, list(zip(args.detail[::2], args.detail[1::2])) if args.detail else None)
        else:
            print_compare(rows)
        if args.csv:
            write_compare_csv(rows, args.csv)
            print(f"\nwrote {len(rows)} rows to {args.csv}")
        return 0
    if len(args.hw) > 1 or len(args.gpus) > 1 or len(args.context) > 1:
        p.error("one --hw, --gpus and --context value (lists are for --compare)")
    model = MODELS[args.model] if args.model in MODELS else model_from_config(args.model)
    if args.comm:
        for b in args.batch or [1]:
            print_comm_table(model, args.comm, b)
        return 0
    n, context, batches = args.gpus[0], args.context[0], args.batch or [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    kv_dtype = args.kv_dtype or args.dtype
    if args.recommend and args.target is None:
        p.error("--recommend needs --target")
    for i, lat in enumerate(latencies):
        hw = with_latency(HARDWARE[args.hw[0]], lat, **us)
        if n > hw.domain and i == 0:
            print(f"note: {n} GPUs exceed one {hw.name} NVLink domain ({hw.domain}); the model assumes one", file=sys.stderr)
        steps = sweep(model, hw, n, context, batches, args.dtype, kv_dtype, args.families, show_invalid=True)
        print(f"{'' if i == 0 else chr(10)}{model.name} on {n} x {hw.name}, context {context}, weights {args.dtype}, "
              f"KV {kv_dtype}, collective latency {latency_label(hw)}")  # fmt: skip
        print_table(steps)
        if args.pareto and i == 0:
            valid = [s for s in steps if s.valid]
            write_pareto_png(pareto(valid) if len(valid) > 50 else valid, args.pareto, f"{model.name}, {n} x {hw.name}, S={context}")
            print(f"wrote {args.pareto}")
        if args.recommend:
            best = recommend(steps, args.recommend, args.target)
            print("recommend:", "nothing meets the target" if best is None else f"{best.layout.name()} at batch {best.batch} "
                  f"({best.tok_s_user:.1f} tok/s/user, {best.tok_s_gpu:.2f} tok/s/GPU)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
