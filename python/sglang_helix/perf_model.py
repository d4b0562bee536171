"""A roofline model of one decode step: plain TP against Helix (KVP x TPA), and a layout advisor.

    python -m sglang_helix.perf_model --model llama-3.1-405b --hw gb200-nvl72 --gpus 64 \\
        --context 1048576 --batch 1,8,64 --dtype fp4
    python -m sglang_helix.perf_model --model path/to/config.json --hw h100 --gpus 8 --context 131072
    python -m sglang_helix.perf_model --model deepseek-r1 --hw gb200-nvl72 --gpus 64 \\
        --context 1048576 --pareto pareto.svg
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
    """N GPUs: attention plain TP (kvp 1) or Helix KVP x TPA; the FFN (dense, or every routed
    expert sharded) TP over all N. Expert parallelism (TPF x EP) is not modeled: its token
    dispatch traffic and expert load imbalance need a routing model this one does not have."""

    n: int
    kvp: int  # 1: plain TP

    @property
    def tpa(self) -> int:
        return self.n // self.kvp

    def name(self) -> str:
        return f"TP{self.n}" if self.kvp == 1 else f"Helix KVP{self.kvp}xTPA{self.tpa}"


def layouts(model: Model, n: int) -> List[Layout]:
    """Plain TP and every Helix KVP x TPA = n whose TPA divides K (so TPA <= K)."""
    out = []
    for kvp in [d for d in range(1, n + 1) if n % d == 0]:
        tpa = n // kvp
        if kvp > 1 and (model.kv_heads % tpa or model.q_heads % n):
            continue
        out.append(Layout(n, kvp))
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
    Helix K/TPA. MLA: the one latent head, replicated on every attention rank."""
    if model.mla:
        return 1.0
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


def step(model: Model, hw: Hardware, layout: Layout, context: int, batch: int, w_dtype: str, kv_dtype: str, act_bytes: float = 2.0) -> Step:
    """One decode step of ``batch`` requests at ``context`` tokens on ``layout``: seconds per part."""
    n, kvp, tpa = layout.n, layout.kvp, layout.tpa
    wb, kvb = DTYPE_BYTES[w_dtype], DTYPE_BYTES[kv_dtype]
    peak = hw.flops.get(w_dtype) or hw.flops["bf16"]
    h, dv = model.hidden, model.dv
    tokens = tokens_per_gpu(context, layout)

    # Attention over the KV: each GPU reads its tokens' KV, for its KV heads, once per request.
    kv_per_token_layer = kv_heads_per_gpu(model, layout) * model.kv_dim * kvb
    kv_bytes = batch * tokens * kv_per_token_layer  # per layer
    # Query heads one GPU attends with: plain TP Q/N, Helix Q/TPA (all of its TPA slice). MLA
    # decode attends in the latent space: scores over latent + rope, values over the latent.
    q_local = model.q_heads / (n if kvp == 1 else tpa)
    if model.mla:
        qk_dim, v_dim = model.kv_dim, model.kv_dim - model.mla_rope_dim
    else:
        qk_dim, v_dim = model.head_dim, dv
    attn_flops = 2.0 * batch * tokens * q_local * (qk_dim + v_dim)
    kv_s = max(kv_bytes / hw.hbm_bytes_s, attn_flops / peak)

    # Weights one GPU reads per layer: the pre-attention projections over TPA (replicated over
    # KVP; plain TP: over N), o_proj over N; the FFN over N (MoE: the experts the batch touches,
    # and the shared ones).
    attn_w = model.qkv_params() / (n if kvp == 1 else tpa) + model.o_params() / n
    moe_layers = model.layers - model.dense_layers if model.moe else 0
    dense_layers = model.layers - moe_layers
    dense_w = 3.0 * h * model.ffn / n
    expert_w = 3.0 * h * model.expert_ffn / n  # one expert's share on a GPU
    moe_w = (expected_distinct_experts(model, batch) + model.shared_experts) * expert_w
    # GEMM FLOPs per GPU: 2 x tokens x the parameters each token goes through on it.
    moe_active = (model.experts_per_token + model.shared_experts) * expert_w
    w_dense_s = max((attn_w + dense_w) * wb / hw.hbm_bytes_s, 2.0 * batch * (attn_w + dense_w) / peak)
    w_moe_s = max((attn_w + moe_w) * wb / hw.hbm_bytes_s, 2.0 * batch * (attn_w + moe_active) / peak)
    lm_head = model.vocab * h / n
    lm_head_s = max(lm_head * wb / hw.hbm_bytes_s, 2.0 * batch * lm_head / peak)
    weights_s = dense_layers * w_dense_s + moe_layers * w_moe_s + lm_head_s

    # Communication per layer. Helix: one All-to-All over the KVP group; a GPU sends (KVP-1)/KVP
    # of its partials [B, Q/TPA, Dv] + fp32 LSE. Both layouts: a ring all-reduce of [B, H] over N
    # after o_proj and after the FFN.
    a2a_bytes = batch * (model.q_heads / tpa) * (dv * act_bytes + 4) * (kvp - 1) / kvp
    a2a_s = model.layers * (hw.link_latency_s + a2a_bytes / hw.link_bytes_s) if kvp > 1 else 0.0
    ar_bytes = 2.0 * (n - 1) / n * batch * h * act_bytes
    ar_s = model.layers * 2 * (hw.link_latency_s + ar_bytes / hw.link_bytes_s) if n > 1 else 0.0

    # Capacity: every weight resident (all experts), embeddings and lm_head; KV in what is left.
    resident = dense_layers * (attn_w + dense_w) + moe_layers * (attn_w + (model.experts + model.shared_experts) * expert_w)
    resident = (resident + 2 * lm_head) * wb
    kv_request = model.layers * kv_per_token_layer * tokens
    max_batch = max(0, int((0.9 * hw.hbm_bytes - resident) // kv_request))
    return Step(layout, batch, model.layers * kv_s, weights_s, a2a_s, ar_s, kv_request, max_batch)


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


def write_svg(steps: List[Step], path: str, title: str) -> None:
    """tokens/s/user (x) against tokens/s/GPU (y), log axes, one colour per attention layout."""
    w, h, pad = 720, 480, 60
    xs = [math.log10(s.tok_s_user) for s in steps]
    ys = [math.log10(max(s.tok_s_gpu, 1e-9)) for s in steps]
    x0, x1, y0, y1 = min(xs), max(xs) + 1e-9, min(ys), max(ys) + 1e-9
    px = lambda x: pad + (x - x0) / (x1 - x0) * (w - 2 * pad)  # noqa: E731
    py = lambda y: h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    names = sorted({s.layout.name() for s in steps})
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
             f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
             f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">tokens/s/user (log)</text>',
             f'<text x="15" y="{h / 2}" transform="rotate(-90 15 {h / 2})" text-anchor="middle">tokens/s/GPU (log)</text>',
             f'<rect x="{pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" stroke="#888"/>']  # fmt: skip
    for i, name in enumerate(names):
        c = colors[i % len(colors)]
        pts = sorted((s for s in steps if s.layout.name() == name), key=lambda s: s.batch)
        path_d = " ".join(f"{'M' if j == 0 else 'L'}{px(math.log10(s.tok_s_user)):.1f},{py(math.log10(max(s.tok_s_gpu, 1e-9))):.1f}" for j, s in enumerate(pts))
        parts.append(f'<path d="{path_d}" fill="none" stroke="{c}"/>')
        parts += [f'<circle cx="{px(math.log10(s.tok_s_user)):.1f}" cy="{py(math.log10(max(s.tok_s_gpu, 1e-9))):.1f}" r="2.5" fill="{c}"/>' for s in pts]
        parts.append(f'<text x="{w - pad + 5 - 200}" y="{pad + 15 + 14 * i}" fill="{c}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(MODELS)}) or a config.json path")
    p.add_argument("--hw", default="h100", choices=list(HARDWARE))
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--dtype", default="bf16", choices=list(DTYPE_BYTES), help="weights (and compute)")
    p.add_argument("--kv-dtype", default=None, choices=list(DTYPE_BYTES), help="KV cache (default: --dtype)")
    p.add_argument("--pareto", help="write the tokens/s/user vs tokens/s/GPU plot here (.svg)")
    p.add_argument("--recommend", choices=["latency", "throughput"])
    p.add_argument("--target", type=float, help="tokens/s/user (latency) or tokens/s/GPU (throughput)")
    args = p.parse_args(argv)
    model = MODELS[args.model] if args.model in MODELS else model_from_config(args.model)
    hw = HARDWARE[args.hw]
    if args.gpus > hw.domain:
        print(f"note: {args.gpus} GPUs exceed one {hw.name} NVLink domain ({hw.domain}); the model assumes one", file=sys.stderr)
    steps = sweep(model, hw, args.gpus, args.context, args.batch, args.dtype, args.kv_dtype or args.dtype)
    print(f"{model.name} on {args.gpus} x {hw.name}, context {args.context}, weights {args.dtype}, KV {args.kv_dtype or args.dtype}, "
          f"collective latency {hw.link_latency_s * 1e6:.0f} us (assumed)")  # fmt: skip
    print_table(steps)
    if args.pareto:
        write_svg(pareto(steps) if len(steps) > 50 else steps, args.pareto, f"{model.name}, {args.gpus} x {hw.name}, S={args.context}")
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
