"""A roofline model of one decode step: plain TP against Helix (KVP x TPA), and a layout advisor.

    python -m sglang_helix.perf_model --model llama-3.1-405b --hw gb200-nvl72 --gpus 64 \\
        --context 1048576 --batch 1,8,64 --dtype fp4
    python -m sglang_helix.perf_model --model path/to/config.json --hw h100 --gpus 8 --context 131072
    python -m sglang_helix.perf_model --model deepseek-r1 --hw gb200-nvl72 --gpus 64 \\
        --context 1048576 --pareto pareto.png
    python -m sglang_helix.perf_model --model llama-3.3-70b --hw h200 --gpus 8 --context 262144 \\
        --recommend latency --target 50

For each layout of N GPUs (plain TP = N; Helix KVP x TPA with TPA | K; MoE FFN as TPF x EP) and
batch B it prints one decode step per GPU, broken into

    kv      KV bytes the GPU reads / HBM bandwidth, and attention FLOPs / peak (roofline max)
    weights weight bytes the GPU reads / HBM bandwidth, and GEMM FLOPs / peak (roofline max)
    a2a     Helix's one All-to-All per layer: latency + bytes / NVLink bandwidth
    ar      the all-reduces after o_proj and the FFN: latency + ring bytes / NVLink bandwidth

summed over the layers (+ lm_head), the per-user rate (tokens/s/user = 1 / step) and the
per-GPU throughput (B / step / N), and the largest batch whose KV fits next to the weights.

What it leaves out, on purpose: kernel efficiency (every term runs at the roofline), overlap of
communication with compute (terms add), the prefill, and the CPU/launch overhead a CUDA graph
removes. It compares layouts under the same assumptions; absolute numbers are lower bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

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
# NVLink latency is not in the datasheets: ALPHA_S is an assumption (a few microseconds for a
# small NCCL collective inside one NVLink domain), stated here and printed with the results.
# --------------------------------------------------------------------------------------------

ALPHA_S = 3e-6  # per collective, assumed


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_s: float
    hbm_bytes: float
    link_bytes_s: float  # NVLink, one direction
    flops: Dict[str, float]  # dense, per dtype
    domain: int  # GPUs in one NVLink domain
    link_latency_s: float = ALPHA_S


HARDWARE = {
    "h100": Hardware("H100 SXM", 3.35e12, 80e9, 450e9, {"bf16": 989e12, "fp8": 1979e12}, 8),
    "h200": Hardware("H200 SXM", 4.8e12, 141e9, 450e9, {"bf16": 989e12, "fp8": 1979e12}, 8),
    "b200": Hardware("B200", 8e12, 180e9, 900e9, {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15}, 8),
    "gb200-nvl72": Hardware("GB200 NVL72", 8e12, 186e9, 900e9, {"bf16": 2.5e15, "fp8": 5e15, "fp4": 10e15}, 72),
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

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        return self.mla_rope_dim > 0

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    def qkv_params(self) -> float:
        """Parameters of one layer's projections before attention (q, k, v; MLA: q_a/q_b, kv_a, kv_b)."""
        h, d, q = self.hidden, self.head_dim, self.q_heads
        if not self.mla:
            return h * (q + 2 * self.kv_heads) * d
        q_proj = h * self.mla_q_rank + self.mla_q_rank * q * d if self.mla_q_rank else h * q * d
        latent = self.kv_dim - self.mla_rope_dim
        return q_proj + h * self.kv_dim + latent * q * ((d - self.mla_rope_dim) + self.dv)

    def o_params(self) -> float:
        return self.q_heads * self.dv * self.hidden


def _mla_preset() -> Model:
    # DeepSeek-R1 (config.json of deepseek-ai/DeepSeek-R1): 61 layers, hidden 7168, 128 heads,
    # q_lora_rank 1536, kv_lora_rank 512 + qk_rope_head_dim 64 = a 576-element latent per token
    # (one "KV head"), qk head dim 128 + 64, v head dim 128, 256 routed experts (8 per token,
    # width 2048) + 1 shared, the first 3 layers dense (18432), vocab 129280.
    return Model("DeepSeek-R1", 61, 7168, 128, 1, 192, 576, 18432, 129280, 256, 8, 2048, 1, 3, 1536, 128, 64)


MODELS = {
    # meta-llama/Llama-3.1-405B: 126 layers, hidden 16384, 128 q heads, 8 KV heads, head dim 128,
    # FFN 53248, vocab 128256.
    "llama-3.1-405b": Model("Llama-3.1-405B", 126, 16384, 128, 8, 128, 256, 53248, 128256),
    # meta-llama/Llama-3.3-70B-Instruct: 80 layers, hidden 8192, 64 q heads, 8 KV heads, FFN 28672.
    "llama-3.3-70b": Model("Llama-3.3-70B", 80, 8192, 64, 8, 128, 256, 28672, 128256),
    # Qwen/Qwen3-235B-A22B: 94 layers, hidden 4096, 64 q heads, 4 KV heads, head dim 128, 128
    # experts (8 per token, width 1536), vocab 151936.
    "qwen3-235b-a22b": Model("Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 256, 12288, 151936, 128, 8, 1536),
    "deepseek-r1": _mla_preset(),
}


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
    return Model(
        os.path.basename(os.path.dirname(os.path.abspath(path))) or "model", c["num_hidden_layers"], hidden, q,
        c.get("num_key_value_heads", q), d, 2 * d, c.get("intermediate_size", 0), vocab, experts,
        c.get("num_experts_per_tok", 0), c.get("moe_intermediate_size") or c.get("intermediate_size", 0),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Layouts and the step model.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """N GPUs and how attention and the FFN are split over them. ``family``:

    - ``"tp"`` (``kvp`` 1): plain TP N for everything; KV heads replicated once N > K.
    - ``"helix"``: attention KVP x TPA (KV sharded along the sequence over KVP), then o_proj and
      the FFN TP over all N (the FFN of an MoE: every routed expert sharded over N; under uniform
      routing that reads the same expert bytes per GPU as any TPF x EP grid, the split only
      changes the FFN's collective, which this model takes as TP's all-reduce).
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
        return self.n // self.kvp

    def name(self) -> str:
        return {
            "tp": f"TP{self.n}",
            "helix": f"Helix KVP{self.kvp}xTPA{self.tpa}",
            "medha": f"KVP{self.kvp}xTP{self.tpa} (Medha)",
            "dp-ep": f"DP{self.n} attn + EP{self.n}",
        }[self.kind]


def layouts(model: Model, n: int, baselines: bool = False) -> List[Layout]:
    """Plain TP and every Helix KVP x TPA = n whose TPA divides K (so TPA <= K); with
    ``baselines``, the paper's other families too (Medha-style KVP x TP; DP attention + EP for MoE)."""
    out = []
    for kvp in [d for d in range(1, n + 1) if n % d == 0]:
        tpa = n // kvp
        if kvp > 1 and (model.kv_heads % tpa or model.q_heads % n):
            continue
        out.append(Layout(n, kvp))
        if baselines and kvp > 1:
            out.append(Layout(n, kvp, "medha"))
    if baselines and model.moe:
        out.append(Layout(n, 1, "dp-ep"))
    return out


@dataclass
class Step:
    layout: Layout
    batch: int
    kv_s: float
    weights_s: float
    a2a_s: float
    ar_s: float
    kv_bytes_per_request: float  # KV one GPU holds for one request, all layers
    max_batch: int  # requests whose KV fits next to the weights in 90% of HBM

    @property
    def total_s(self) -> float:
        return self.kv_s + self.weights_s + self.a2a_s + self.ar_s

    @property
    def tok_s_user(self) -> float:
        return 1.0 / self.total_s

    @property
    def tok_s_gpu(self) -> float:
        return self.batch / self.total_s / self.layout.n


def kv_heads_per_gpu(model: Model, layout: Layout) -> float:
    """KV heads one GPU stores for its tokens: plain TP max(1, K/N) (replicated once N > K),
    Helix / Medha K/TPA, DP attention K. MLA: the one latent head, replicated on every attention rank."""
    if model.mla:
        return 1.0
    if layout.kind == "dp-ep":
        return float(model.kv_heads)
    if layout.kvp == 1:
        return max(1.0, model.kv_heads / layout.n)
    return model.kv_heads / layout.tpa


def tokens_per_gpu(context: int, layout: Layout) -> float:
    return context / layout.kvp


def expected_distinct_experts(model: Model, batch: int) -> float:
    """Routed experts a batch of B tokens touches per layer (uniform routing): E(1 - (1 - k/E)^B)."""
    if not model.moe:
        return 0.0
    return model.experts * (1.0 - (1.0 - model.experts_per_token / model.experts) ** batch)


def helix_a2a_bytes(model: Model, n: int, kvp: int, batch: int, act_bytes: float) -> float:
    """Bytes one GPU sends in a layer's All-to-All: (KVP-1)/KVP of its partials [B, Q/TPA, Dv]
    and their fp32 LSE, i.e. (KVP-1) x B x (Q/N) x (Dv x e + 4)."""
    return (kvp - 1) * batch * (model.q_heads / n) * (model.dv * act_bytes + 4)


def _roofline(bytes_: float, flops: float, hw: Hardware, peak: float) -> float:
    return max(bytes_ / hw.hbm_bytes_s, flops / peak)


def step(model: Model, hw: Hardware, layout: Layout, context: int, batch: int, w_dtype: str, kv_dtype: str, act_bytes: float = 2.0) -> Step:
    """One decode step of ``batch`` requests at ``context`` tokens on ``layout``: seconds per part."""
    n, kvp, tpa, kind = layout.n, layout.kvp, layout.tpa, layout.kind
    wb, kvb = DTYPE_BYTES[w_dtype], DTYPE_BYTES[kv_dtype]
    peak = hw.flops.get(w_dtype) or hw.flops["bf16"]
    h, dv = model.hidden, model.dv
    tokens = tokens_per_gpu(context, layout)
    dp = kind == "dp-ep"
    attn_batch = math.ceil(batch / n) if dp else batch  # requests whose attention one GPU runs

    # Attention over the KV: each GPU reads its tokens' KV, for its KV heads, once per request.
    kv_per_token_layer = kv_heads_per_gpu(model, layout) * model.kv_dim * kvb
    kv_bytes = attn_batch * tokens * kv_per_token_layer  # per layer
    # Query heads one GPU attends with: plain TP Q/N, Helix / Medha Q/TPA (all of its TPA slice),
    # DP all Q. MLA decode attends in the latent space: scores over latent + rope, values over the latent.
    attn_split = {"tp": n, "helix": tpa, "medha": tpa, "dp-ep": 1}[kind]  # GPUs the heads are split over
    q_local = model.q_heads / attn_split
    if model.mla:
        qk_dim, v_dim = model.kv_dim, model.kv_dim - model.mla_rope_dim
    else:
        qk_dim, v_dim = model.head_dim, dv
    attn_flops = 2.0 * attn_batch * tokens * q_local * (qk_dim + v_dim)
    kv_s = _roofline(kv_bytes, attn_flops, hw, peak)

    # Weights one GPU reads per layer (and the GEMM FLOPs, 2 x tokens x parameters): the
    # pre-attention projections over TPA (replicated over KVP; plain TP: over N; DP: whole),
    # o_proj over N (Medha: TPA; DP: whole); the FFN over N (Medha: TPA; MoE: the experts the
    # batch touches, and the shared ones; dp-ep: routed experts over N, the rest whole).
    ffn_split = {"tp": n, "helix": n, "medha": tpa, "dp-ep": 1}[kind]
    attn_w = model.qkv_params() / attn_split + model.o_params() / ffn_split
    moe_layers = model.layers - model.dense_layers if model.moe else 0
    dense_layers = model.layers - moe_layers
    dense_w = 3.0 * h * model.ffn / ffn_split
    one_expert = 3.0 * h * model.expert_ffn
    routed_split = n if dp else ffn_split
    routed_w = expected_distinct_experts(model, batch) * one_expert / routed_split
    shared_w = model.shared_experts * one_expert / ffn_split
    w_dense_s = _roofline((attn_w + dense_w) * wb, 2.0 * attn_batch * (attn_w + dense_w), hw, peak)
    moe_flops = 2.0 * (attn_batch * (attn_w + shared_w) + batch * model.experts_per_token * one_expert / routed_split)
    w_moe_s = _roofline((attn_w + routed_w + shared_w) * wb, moe_flops, hw, peak)
    lm_head = model.vocab * h / ffn_split
    lm_head_s = _roofline(lm_head * wb, 2.0 * attn_batch * lm_head, hw, peak)
    weights_s = dense_layers * w_dense_s + moe_layers * w_moe_s + lm_head_s

    # Communication per layer. Helix / Medha: one All-to-All over the KVP group; a GPU sends
    # (KVP-1)/KVP of its partials [B, Q/TPA, Dv] + fp32 LSE. TP / Helix: a ring all-reduce of
    # [B, H] over N after o_proj and after the FFN (Medha: over TPA). dp-ep: per MoE layer, the
    # token dispatch and combine all-to-alls, B/N tokens x k experts x [H] each.
    a2a_bytes = helix_a2a_bytes(model, n, kvp, batch, act_bytes)
    a2a_s = model.layers * (hw.link_latency_s + a2a_bytes / hw.link_bytes_s) if kvp > 1 else 0.0
    ar_n = ffn_split
    ar_bytes = 2.0 * (ar_n - 1) / ar_n * batch * h * act_bytes if ar_n > 1 else 0.0
    ar_s = model.layers * 2 * (hw.link_latency_s + ar_bytes / hw.link_bytes_s) if ar_n > 1 else 0.0
    if dp and n > 1:
        ep_bytes = attn_batch * model.experts_per_token * h * act_bytes * (n - 1) / n
        a2a_s = moe_layers * 2 * (hw.link_latency_s + ep_bytes / hw.link_bytes_s)

    # Capacity: every weight resident (all experts), embeddings and lm_head; KV in what is left.
    all_experts = (model.experts / routed_split + model.shared_experts / ffn_split) * one_expert
    resident = dense_layers * (attn_w + dense_w) + moe_layers * (attn_w + all_experts)
    resident = (resident + 2 * lm_head) * wb
    kv_request = model.layers * kv_per_token_layer * tokens
    per_gpu = max(0, int((0.9 * hw.hbm_bytes - resident) // kv_request))
    max_batch = per_gpu * n if dp else per_gpu  # DP: each GPU holds the KV of its own requests
    return Step(layout, batch, model.layers * kv_s, weights_s, a2a_s, ar_s, kv_request, max_batch)


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


def sweep(model: Model, hw: Hardware, n: int, context: int, batches: List[int], w_dtype: str, kv_dtype: str) -> List[Step]:
    out = []
    for lay in layouts(model, n):
        for b in batches:
            s = step(model, hw, lay, context, b, w_dtype, kv_dtype)
            if b <= s.max_batch:
                out.append(s)
    return out


def pareto(steps: List[Step]) -> List[Step]:
    """Steps not beaten on both tokens/s/user and tokens/s/GPU by another."""
    front = []
    for s in steps:
        if not any(o.tok_s_user >= s.tok_s_user and o.tok_s_gpu >= s.tok_s_gpu and (o.tok_s_user > s.tok_s_user or o.tok_s_gpu > s.tok_s_gpu) for o in steps):
            front.append(s)
    return sorted(front, key=lambda s: s.tok_s_user)


def recommend(steps: List[Step], goal: str, target: float) -> Optional[Step]:
    """``latency``: the most tokens/s/GPU among steps with tokens/s/user >= target.
    ``throughput``: the most tokens/s/user among steps with tokens/s/GPU >= target."""
    if goal == "latency":
        ok = [s for s in steps if s.tok_s_user >= target]
        return max(ok, key=lambda s: s.tok_s_gpu, default=None)
    ok = [s for s in steps if s.tok_s_gpu >= target]
    return max(ok, key=lambda s: s.tok_s_user, default=None)


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
    hw = dataclasses.replace(hw, link_latency_s=latency_s)
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
    head = f"{'layout':<28} {'B':>5} {'kv ms':>8} {'w ms':>8} {'a2a ms':>7} {'ar ms':>7} {'step ms':>8} {'tok/s/user':>10} {'tok/s/GPU':>10} {'maxB':>6}"
    print(head, file=out)
    for s in steps:
        print(
            f"{s.layout.name():<28} {s.batch:>5} {s.kv_s * 1e3:>8.3f} {s.weights_s * 1e3:>8.3f} {s.a2a_s * 1e3:>7.3f} "
            f"{s.ar_s * 1e3:>7.3f} {s.total_s * 1e3:>8.3f} {s.tok_s_user:>10.1f} {s.tok_s_gpu:>10.2f} {s.max_batch:>6}",
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"a preset ({', '.join(MODELS)}) or a config.json path")
    p.add_argument("--hw", default="h100", choices=list(HARDWARE))
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--dtype", default="bf16", choices=list(DTYPE_BYTES), help="weights (and compute)")
    p.add_argument("--kv-dtype", default=None, choices=list(DTYPE_BYTES), help="KV cache (default: --dtype)")
    p.add_argument("--pareto", help="write the tokens/s/user vs tokens/s/GPU plot here (PNG)")
    p.add_argument("--paper", action="store_true", help="the paper's headline ratios under its assumptions, and the model's")
    p.add_argument("--comm", type=_ints, help="print the per-layer communication table at these N (e.g. 4,8) and exit")
    p.add_argument("--recommend", choices=["latency", "throughput"])
    p.add_argument("--target", type=float, help="tokens/s/user (latency) or tokens/s/GPU (throughput)")
    args = p.parse_args(argv)
    if args.paper:
        print_paper()
        return 0
    if not args.model:
        p.error("--model is required (a preset or a config.json)")
    model = MODELS[args.model] if args.model in MODELS else model_from_config(args.model)
    hw = HARDWARE[args.hw]
    if args.comm:
        for b in args.batch if args.batch != p.get_default("batch") else [1]:
            print_comm_table(model, args.comm, b)
        return 0
    if args.gpus > hw.domain:
        print(f"note: {args.gpus} GPUs exceed one {hw.name} NVLink domain ({hw.domain}); the model assumes one", file=sys.stderr)
    steps = sweep(model, hw, args.gpus, args.context, args.batch, args.dtype, args.kv_dtype or args.dtype)
    print(f"{model.name} on {args.gpus} x {hw.name}, context {args.context}, weights {args.dtype}, KV {args.kv_dtype or args.dtype}, "
          f"collective latency {hw.link_latency_s * 1e6:.0f} us (assumed)")  # fmt: skip
    print_table(steps)
    if args.pareto:
        write_pareto_png(pareto(steps) if len(steps) > 50 else steps, args.pareto, f"{model.name}, {args.gpus} x {hw.name}, S={args.context}")
        print(f"wrote {args.pareto}")
    if args.recommend:
        if args.target is None:
            p.error("--recommend needs --target")
        best = recommend(steps, args.recommend, args.target)
        print("recommend:", "nothing meets the target" if best is None else f"{best.layout.name()} at batch {best.batch} "
              f"({best.tok_s_user:.1f} tok/s/user, {best.tok_s_gpu:.2f} tok/s/GPU)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
