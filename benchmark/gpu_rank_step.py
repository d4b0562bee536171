"""One rank's decoder layer on one GPU, per layout (plain TP, upstream DCP, Helix), beside the model.

    python benchmark/gpu_rank_step.py                       # a GPU: Llama-3.1-70B at N = 16, Qwen3-235B at N = 8
    python benchmark/gpu_rank_step.py --model llama-3.1-70b --gpus 16 --context 32768,131072,1048576 --batch 1,16
    TRITON_INTERPRET=1 python benchmark/gpu_rank_step.py --cpu-smoke   # the same code on the CPU, tiny

For each layout of N GPUs (``sglang_helix.perf_model``: TP N; every ``--dcp-size d`` that 0.5.23
computes correctly; every Helix KVP x TPA) it builds what ONE rank of that layout holds for one
decoder layer of a real model shape, in bf16, and runs that rank's layer:

    TP     x @ W_qkv [H, (Q/N + 2 max(1, K/N)) D]; upstream's decode over the S tokens of its
           max(1, K/N) KV heads; o_proj [Q/N Dv, H]; the MLP [H, 2F/N], [F/N, H]
    DCP    as 0.5.23's Triton backend runs MHA/GQA decode (srt/layers/attention/triton_backend.py,
           decode branch under DCP): the same qkv_proj as TP; Q all-gathered over the group
           ([B, d Q/N, D]); the decode over the rank's S/d tokens (pool heads max(1, K // (N/d)))
           into fp32, the LSE as logsumexp of the per-split LSE; then cp_lse_ag_out_rs_mha's steps
           (srt/layers/dcp/comm.py:56-82): LSE all-gather, global LSE, rescale, all-reduce of the
           fp32 outputs of all d Q/N heads, the rank's own Q/N heads; o_proj and the MLP as TP
    Helix  x @ W_qkv [H, (Q/TPA + 2 K/TPA) D] (replicated over KVP); the decode over the rank's
           S/KVP tokens (round-robin chunks) with the series' merged-LSE output written head-split
           ([KVP, B, Q/N, Dv] + [KVP, B, Q/N]: the All-to-All's send layout), the exchange, the
           N-way merge (upstream's dcp_lse_combine_triton); o_proj and the MLP as TP

(MoE models: the router GEMM and the batch's expected distinct experts, each sharded over N, as
batched GEMMs.) A collective is a device copy here: each rank's "received" slices are copied from
the other group members' buffers (filled once, before timing, by running their part of the
attention over their own shard). The whole layer is captured in a CUDA graph and its replay timed
(``triton.testing.do_bench``, L2 flushed between runs). Left out, the same for every layout: the
norms, rotary embedding, the KV write of the new token, residual adds. Every layout uses the same
KV-split rule (upstream's ``get_num_kv_splits_triton`` fed with the rank's local lengths, cap
``--max-splits``, default 64; 0.5.23's default for TP/DCP is 8: ``--max-splits 8``), except that
Helix layouts split as the server does (``--helix-split-policy on``, the default: ``gqa_decode``'s
per-batch extent, up to 256 splits at batch 1, then each request's share by its local length).

Per (model, N, S, B) it prints each layout's microseconds per layer, the collectives' time from
the model (per collective: the GPU preset's latency + bytes / NVLink bandwidth), their sum (the
rank's step per layer), and the ratio TP / Helix and DCP / Helix of that step (best layout of each
family) beside perf_model's ratio for the same layouts; rows where they differ by more than 20 %
are marked. Also checked: each layout's attention heads for o_proj against float64 attention
(small cases), and graph replay against eager. Rows go to ``--json`` (or ``$OUT/gpu_rank_step.json``).

Needs only torch, triton, the kernel sources (sglang's ``kernels/ops/attention/{decode_attention,
dcp_kernels,metadata,score_mod}.py`` with the series' merged-LSE patch, ``srt/environ.py``,
``srt/utils``; on the lent GPU machine put them under ``.gpu/src`` as for ``gpu_kernels.py``, see
../shared/notes/gpu-machine.md) and ``python/sglang_helix/perf_model.py``. The kernel modules are
imported without running ``sglang/__init__`` (which loads the server). Without a GPU (and without
``--cpu-smoke``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_SRC = os.path.join(ROOT, ".gpu", "src")
if os.path.isdir(GPU_SRC):
    sys.path.insert(0, GPU_SRC)
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

from sglang_helix import perf_model as pm  # noqa: E402

SMOKE_MODELS = {  # tiny shapes for --cpu-smoke: Q 8, K 2, D 16 (a dense and an MoE layer)
    "tiny": pm.Model("tiny", 1, 64, 8, 2, 16, 32, 128, 1000),
    "tiny-moe": pm.Model("tiny-moe", 1, 64, 8, 2, 16, 32, 0, 1000, experts=4, experts_per_token=2, expert_ffn=32),
}
HW_BY_NAME = (("H200", "h200"), ("H100", "h100"), ("B200", "b200"), ("GB200", "gb200-nvl72"))


def split_policy_module():
    """``sglang.srt.layers.dcp.gqa_decode``: the GQA mode's KV-split policy (after ``load_kernels``)."""
    from sglang.srt.layers.dcp import gqa_decode

    return gqa_decode


def load_kernels():
    """``(decode_attention_fwd, dcp_lse_combine_triton, get_num_kv_splits_triton)`` from the kernel
    files alone: the parent packages are registered empty (their ``__init__`` would import the
    whole server, ~25 s on two cores), then only the three kernel modules run."""
    if "sglang" not in sys.modules:
        spec = importlib.util.find_spec("sglang")
        base = os.path.dirname(list(spec.submodule_search_locations)[0])
        for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention", "sglang.srt",
                     "sglang.srt.layers", "sglang.srt.layers.dcp"):  # fmt: skip
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(base, *name.split("."))]
            sys.modules[name] = pkg
    from sglang.kernels.ops.attention.dcp_kernels import dcp_lse_combine_triton
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    return decode_attention_fwd, dcp_lse_combine_triton, get_num_kv_splits_triton


# --------------------------------------------------------------------------------------------
# What one rank of a layout holds (rank 0: TP rank 0, DCP rank 0 of group 0, Helix tpa 0 / kvp 0).
# --------------------------------------------------------------------------------------------


def rank_heads(model: pm.Model, lay: pm.Layout) -> dict:
    """Head counts of rank 0: ``q_proj`` / ``kv_proj`` (what its qkv_proj computes), ``attn_q``
    (heads it attends with), ``attn_kv`` (KV heads it stores), ``own`` (heads it hands to o_proj)."""
    n, k, q = lay.n, model.kv_heads, model.q_heads
    if lay.kind == "tp":
        return dict(q_proj=q // n, kv_proj=max(1, k // n), attn_q=q // n, attn_kv=max(1, k // n), own=q // n)
    if lay.kind == "dcp":  # Llama-style qkv_proj over N; 0.5.23's pool: max(1, K // (N/d)) heads
        return dict(q_proj=q // n, kv_proj=max(1, k // n), attn_q=q // lay.tpa, attn_kv=max(1, k // lay.tpa), own=q // n)
    if lay.kind == "helix":
        return dict(q_proj=q // lay.tpa, kv_proj=k // lay.tpa, attn_q=q // lay.tpa, attn_kv=k // lay.tpa, own=q // n)
    raise ValueError(f"gpu_rank_step: no rank layer for {lay.kind!r}")


def owned_positions(context: int, lay: pm.Layout, member: int, chunk: int) -> torch.Tensor:
    """Positions group member ``member`` stores: DCP interleaves tokens (``pos % d``, 0.5.23's
    triton backend), Helix round-robin chunks (``(pos // C) % KVP``); TP all of them."""
    pos = torch.arange(context)
    if lay.kind == "dcp":
        return pos[pos % lay.kvp == member]
    if lay.kind == "helix":
        return pos[(pos // chunk) % lay.kvp == member]
    return pos


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """float64 attention of q [B, h, D] over k/v [B, S, kh, D]; query head i reads KV head i // group."""
    idx = torch.arange(q.shape[1]) // group
    kk, vv = k.double()[:, :, idx], v.double()[:, :, idx]  # [B, S, h, D]
    s = torch.einsum("bhd,bshd->bhs", q.double(), kk) * q.shape[-1] ** -0.5
    return torch.einsum("bhs,bshd->bhd", s.softmax(-1), vv)


class KVShard:
    """One member's KV rows for B requests of ``tokens`` each, and the decode's per-request lists."""

    def __init__(self, k, v, splits_fn, heads: int, max_splits: int, cores: int, policy=None):
        B, tokens, kh, D = k.shape  # [B, tokens, kh, D]
        self.k = k.reshape(B * tokens, kh, D).contiguous()  # [rows, kh, D]
        self.v = v.reshape(B * tokens, kh, v.shape[-1]).contiguous()
        dev = k.device
        self.indptr = torch.arange(B + 1, device=dev, dtype=torch.int32) * tokens  # [B+1]
        self.indices = torch.arange(B * tokens, device=dev, dtype=torch.int64)  # [B * tokens]
        self.splits = torch.full((B,), max_splits, dtype=torch.int32, device=dev)  # [B]
        lens = torch.full((B,), max(tokens, 1), dtype=torch.int32, device=dev)
        if policy is not None:  # the GQA mode's per-request policy (gqa_decode), as the server runs it
            policy.num_kv_splits_by_local_len(self.splits, lens, heads, kh, max_splits, cores)
        else:
            splits_fn[(1,)](self.splits, lens, B, 1, heads, kh, max_splits, cores,
                            MAX_NUM_SEQ=256 if B < 256 else 1 << (B - 1).bit_length())  # fmt: skip
        self.bytes = 2 * self.k.numel() * self.k.element_size()  # K and V it reads


class RankLayer:
    """Rank 0's decoder layer of ``lay``: static buffers, ``__call__`` runs it (capturable)."""

    def __init__(self, model, lay, context, batch, kernels, dtype, device, chunk=64, max_splits=64, cores=132,
                 check=False, helix_policy=False):  # fmt: skip
        self.decode, self.combine, splits_fn = kernels
        self.model, self.lay, self.B = model, lay, batch
        self.heads = rank_heads(model, lay)
        B, H, D, Dv, hd = batch, model.hidden, model.head_dim, model.dv, self.heads
        policy, self.split_tile = None, 0
        if helix_policy and lay.kind == "helix":  # the batch's split extent, then each request's share of it
            policy = split_policy_module()
            grid = policy.KVSplitPolicy(8, policy.DCP_GQA_MAX_KV_SPLITS, cores)  # 8: the backend's default
            max_splits = grid.grid_splits(B, hd["attn_q"], hd["attn_kv"])
            self.split_tile = policy.stage2_split_tile(max_splits)
        self.scale = D**-0.5
        self.max_splits = max_splits
        g = torch.Generator(device=device).manual_seed(context + batch + lay.n + lay.kvp)

        def rand(*shape, std=1.0):  # drawn on the device: a 1M-token shard is GBs
            return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

        # GEMM weights of rank 0, [in, out]. qkv_proj's output: [q heads | k heads | v heads] x D.
        self.x = rand(B, H)  # [B, H]
        self.w_qkv = rand(H, (hd["q_proj"] + 2 * hd["kv_proj"]) * D, std=H**-0.5)
        self.w_o = rand(hd["own"] * Dv, H, std=(hd["own"] * Dv) ** -0.5)  # o_proj's row shard [Q/N Dv, H]
        self._init_mlp(rand, model, lay.n, B, H)
        # The KV of the heads rank 0's group reads, [B, S, kv, D]; each member's shard of it.
        kv = hd["attn_kv"]
        members = 1 if lay.kind == "tp" else lay.kvp
        pos = [owned_positions(context, lay, m, chunk) for m in range(members)]
        if check:
            k_all, v_all = rand(B, context, kv, D), rand(B, context, kv, Dv)
            shards = [(k_all[:, p], v_all[:, p]) for p in pos]
            self.k_all, self.v_all = k_all.cpu(), v_all.cpu()
        else:  # no reference: the other members read rank 0's rows (their values do not matter; one shard's memory)
            shards = [(rand(B, len(pos[0]), kv, D), rand(B, len(pos[0]), kv, Dv))] * members
        self.shards = [KVShard(k, v, splits_fn, hd["attn_q"], max_splits, cores, policy) for k, v in shards]
        self.split_count = int(self.shards[0].splits[0])
        self.kv_bytes = self.shards[0].bytes
        self.q = torch.empty(B, hd["attn_q"], D, dtype=dtype, device=device)  # [B, attn heads, D]
        self.out = torch.empty(B, hd["own"], Dv, dtype=dtype, device=device)  # [B, Q/N, Dv]: o_proj's input
        self.y = torch.empty(B, H, dtype=dtype, device=device)
        getattr(self, f"_init_{lay.kind}")(dtype, device)

    # ---- the MLP (dense: F/N; MoE: the batch's expected distinct experts, each F_e/N)
    def _init_mlp(self, rand, model, n, B, H):
        if not model.moe:
            f = model.ffn // n
            self.w_gu, self.w_down = rand(H, 2 * f, std=H**-0.5), rand(f, H, std=f**-0.5)  # [H, 2F/N], [F/N, H]
            return
        f = model.expert_ffn // n
        active = max(1, round(pm.expected_distinct_experts(model, B)))
        per_expert = math.ceil(B * model.experts_per_token / active)  # tokens each active expert sees
        self.w_router = rand(H, model.experts, std=H**-0.5)  # [H, E], replicated
        self.w_gu = rand(active, H, 2 * f, std=H**-0.5)  # [E_active, H, 2F_e/N]
        self.w_down = rand(active, f, H, std=f**-0.5)  # [E_active, F_e/N, H]
        self.rows = (torch.arange(active * per_expert) % B).to(self.x.device)  # token of each expert slot

    def _mlp(self, y):
        if not self.model.moe:
            gate, up = (y @ self.w_gu).chunk(2, dim=-1)  # [B, F/N] each
            return (torch.nn.functional.silu(gate) * up) @ self.w_down  # [B, H]
        _ = y @ self.w_router  # [B, E] (the top-k choice itself is left out)
        xs = y[self.rows].view(self.w_gu.shape[0], -1, y.shape[-1])  # [E_active, t, H]
        gate, up = torch.bmm(xs, self.w_gu).chunk(2, dim=-1)  # [E_active, t, F_e/N]
        o = torch.bmm(torch.nn.functional.silu(gate) * up, self.w_down)  # [E_active, t, H]
        # Slot i is token i % B: sum the slots per token in a fixed order (index_add_'s atomics
        # reorder the bf16 sums between runs, so a graph replay would not equal eager bit for bit).
        o = o.view(-1, y.shape[-1])  # [slots, H]
        o = torch.nn.functional.pad(o, (0, 0, 0, -o.shape[0] % y.shape[0]))  # [ceil(slots / B) B, H]
        return o.view(-1, *y.shape).sum(0)  # [B, H]

    def _qkv(self):
        qkv = self.x @ self.w_qkv  # [B, (q_proj + 2 kv_proj) D]
        return qkv[:, : self.heads["q_proj"] * self.model.head_dim].view(self.B, self.heads["q_proj"], -1)

    def _run_decode(self, shard, q, o, logits, split_lse, output_lse=None):
        tile = {"split_tile": self.split_tile} if self.split_tile else {}  # Helix under the server's policy
        self.decode(q, shard.k, shard.v, o, shard.indptr, shard.indices, logits, split_lse, shard.splits,
                    self.max_splits, self.scale, 1.0, 1.0, output_lse=output_lse, **tile)  # fmt: skip

    def _workspace(self, heads, dtype, device):
        B, Dv = self.B, self.model.dv
        logits = torch.empty(B, heads, self.max_splits, Dv, dtype=torch.float32, device=device)
        return logits, torch.empty(B, heads, self.max_splits, dtype=torch.float32, device=device)

    # ---- TP: upstream decode over all S tokens of max(1, K/N) KV heads
    def _init_tp(self, dtype, device):
        self.logits, self.split_lse = self._workspace(self.heads["attn_q"], dtype, device)

    def _attend_tp(self):
        self.q.copy_(self._qkv())
        self._run_decode(self.shards[0], self.q, self.out, self.logits, self.split_lse)

    # ---- DCP (0.5.23): Q all-gather, fp32 decode, LSE all-gather, rescale, output all-reduce
    def _init_dcp(self, dtype, device):
        d, hq, B, Dv = self.lay.kvp, self.heads["own"], self.B, self.model.dv
        hg = d * hq  # gathered heads [B, d Q/N, D]
        self.logits, self.split_lse = self._workspace(hg, dtype, device)
        self.o32 = torch.empty(B, hg, Dv, dtype=torch.float32, device=device)  # o_for_decode
        self.lses = torch.empty(d, B, hg, dtype=torch.float32, device=device)  # all-gathered LSE
        self.outs = torch.empty(d, B, hg, Dv, dtype=torch.float32, device=device)  # all-reduce inputs
        # The other members: their Q slices, and (after the first call) their LSE and rescaled outputs.
        g = torch.Generator(device=device).manual_seed(7)
        self.q_members = [torch.randn(B, hq, self.model.head_dim, generator=g, device=device).to(dtype) for _ in range(d)]
        self.q_members[0] = self._qkv().contiguous()
        self.q.copy_(torch.cat(self.q_members, dim=1))
        member_lse, member_o = [], []
        for m in range(d):  # each member's decode over its own shard, with the same gathered Q
            self._run_decode(self.shards[m], self.q, self.o32, self.logits, self.split_lse.fill_(-math.inf))
            member_lse.append(torch.logsumexp(self.split_lse, dim=-1).clone())
            member_o.append(self.o32.clone())
        glob = torch.logsumexp(torch.stack(member_lse), dim=0)
        self.lse_members = member_lse
        self.scaled_members = [o * torch.exp(lse - glob).unsqueeze(-1) for o, lse in zip(member_o, member_lse)]

    def _attend_dcp(self):
        d, hq = self.lay.kvp, self.heads["own"]
        self.q[:, :hq].copy_(self._qkv())  # this rank's slice; the all-gather brings the others'
        for m in range(1, d):
            self.q[:, m * hq : (m + 1) * hq].copy_(self.q_members[m])
        self.split_lse.fill_(-math.inf)
        self._run_decode(self.shards[0], self.q, self.o32, self.logits, self.split_lse)
        lse = torch.logsumexp(self.split_lse, dim=-1)  # [B, d Q/N]
        self.lses[0].copy_(lse)  # LSE all-gather
        for m in range(1, d):
            self.lses[m].copy_(self.lse_members[m])
        scale = torch.exp(lse - torch.logsumexp(self.lses, dim=0)).unsqueeze(-1).nan_to_num_(0.0, 0.0, 0.0)
        self.outs[0].copy_(self.o32.nan_to_num(0.0, 0.0, 0.0) * scale)  # output all-reduce
        for m in range(1, d):
            self.outs[m].copy_(self.scaled_members[m])
        self.out.copy_(self.outs.sum(dim=0)[:, :hq])  # this rank's heads, in the activation dtype

    # ---- Helix: merged-LSE decode into the head-split send layout, exchange, N-way merge
    def _init_helix(self, dtype, device):
        kvp, hq, B, Dv = self.lay.kvp, self.heads["own"], self.B, self.model.dv
        self.logits, self.split_lse = self._workspace(self.heads["attn_q"], dtype, device)
        self.send_o = torch.empty(kvp, B, hq, Dv, dtype=dtype, device=device)  # [KVP, B, Q/N, Dv]
        self.send_lse = torch.empty(kvp, B, hq, dtype=torch.float32, device=device)  # [KVP, B, Q/N]
        self.recv_o, self.recv_lse = torch.empty_like(self.send_o), torch.empty_like(self.send_lse)
        self.q.copy_(self._qkv())  # every KVP member computes the same Q (qkv_proj replicated over KVP)
        self.member_send = []
        for m in range(kvp):  # slice 0 of each member's send buffer is what rank 0 receives
            self._run_decode(self.shards[m], self.q, self.send_o, self.logits, self.split_lse, self.send_lse)
            self.member_send.append((self.send_o[0].clone(), self.send_lse[0].clone()))

    def _attend_helix(self):
        self.q.copy_(self._qkv())
        self._run_decode(self.shards[0], self.q, self.send_o, self.logits, self.split_lse, self.send_lse)
        self.recv_o[0].copy_(self.send_o[0])  # the All-to-All: chunk m of rank 0's receive = member m's slice 0
        self.recv_lse[0].copy_(self.send_lse[0])
        for m in range(1, self.lay.kvp):
            self.recv_o[m].copy_(self.member_send[m][0])
            self.recv_lse[m].copy_(self.member_send[m][1])
        merged, _ = self.combine(self.recv_o, self.recv_lse, is_lse_base_on_e=True)  # [B, Q/N, Dv]
        self.out.copy_(merged)

    def __call__(self) -> torch.Tensor:
        getattr(self, f"_attend_{self.lay.kind}")()
        h = self.out.view(self.B, -1) @ self.w_o  # o_proj [B, H]
        self.y.copy_(self._mlp(h))
        return self.y

    def attention_error(self) -> float:
        """max |rank 0's o_proj heads - float64 attention of its query heads over the whole context|."""
        B, hq, Dv = self.B, self.heads["own"], self.model.dv
        q_own = self._qkv()[:, :hq].float().cpu()  # rank 0's first Q/N heads (all layouts start at head 0)
        group = self.model.q_heads // self.model.kv_heads  # query heads per KV head
        want = reference(q_own, self.k_all.float(), self.v_all.float(), group)
        return (self.out.float().cpu().double().view(B, hq, Dv) - want).abs().max().item()


# --------------------------------------------------------------------------------------------
# Cases, the model beside them, output.
# --------------------------------------------------------------------------------------------


def rank_layouts(model: pm.Model, n: int) -> list:
    """TP N, every ``--dcp-size`` 0.5.23 computes correctly, every Helix KVP x TPA."""
    out = []
    for lay in pm.layouts(model, n, dcp=True):
        if lay.kind in ("tp", "helix") or (lay.kind == "dcp" and not pm.layout_problem(model, lay)):
            out.append(lay)
    return out


def model_comm_us(model, hw, lay, batch) -> float:
    """The layer's collectives from perf_model: per collective, latency + bytes / NVLink bandwidth."""
    return sum(hw.latency(k) + b / hw.link_bytes_s for k, b in pm.collectives_per_layer(model, lay, batch)) * 1e6


def run_case(model, n, context, batch, kernels, hw, dtype, device, timing, max_splits, cores, chunk=64,
             helix_policy=False) -> list:  # fmt: skip
    rows = []
    check = batch * context < (1 << 20)  # the float64 reference runs on the host: up to 512K tokens
    for lay in rank_layouts(model, n):
        layer = RankLayer(model, lay, context, batch, kernels, dtype, device, chunk, max_splits, cores, check,
                          helix_policy)  # fmt: skip
        eager = layer().clone()
        row = {"model": model.name, "gpus": n, "context": context, "batch": batch, "layout": lay.name(),
               "family": lay.kind, "kv_bytes_per_layer": layer.kv_bytes, "kv_splits": layer.split_count,
               "kv_split_extent": layer.max_splits}  # fmt: skip
        if check:
            row["attn_max_abs_err_vs_fp64"] = layer.attention_error()
        modelled = pm.step(model, hw, lay, context, batch, "bf16", "bf16")
        row["model_layer_us"] = pm.layer_seconds(model, modelled) * 1e6
        row["model_comm_us"] = model_comm_us(model, hw, lay, batch)
        if device == "cuda":
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                layer()
            graph.replay()
            torch.cuda.synchronize()
            row["graph_equals_eager"] = bool(torch.equal(layer.y, eager))
            if timing:
                from triton.testing import do_bench

                row["measured_layer_us"] = do_bench(graph.replay) * 1e3
                row["step_us"] = row["measured_layer_us"] + row["model_comm_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)  # a run cut short keeps the rows it finished
        del layer
    return rows


def ratios(rows: list) -> list:
    """Per case: TP / Helix and DCP / Helix of the per-rank step (best layout of each family), measured
    and modelled (perf_model's per-layer time of the same two layouts)."""
    out = []
    for key in sorted({(r["model"], r["gpus"], r["context"], r["batch"]) for r in rows}, key=str):
        case = [r for r in rows if (r["model"], r["gpus"], r["context"], r["batch"]) == key]
        if not all("step_us" in r for r in case):
            continue
        best = {f: min((r for r in case if r["family"] == f), key=lambda r: r["step_us"], default=None) for f in ("tp", "dcp", "helix")}
        for other in ("tp", "dcp"):
            a, h = best[other], best["helix"]
            if a is None or h is None:
                continue
            measured, modelled = a["step_us"] / h["step_us"], a["model_layer_us"] / h["model_layer_us"]
            out.append({"model": key[0], "gpus": key[1], "context": key[2], "batch": key[3], "pair": f"{other}/helix",
                        "layouts": f"{a['layout']} / {h['layout']}", "measured": measured, "modelled": modelled,
                        "off_by_more_than_20pct": abs(measured / modelled - 1) > 0.2})  # fmt: skip
    return out


def print_rows(rows: list, pairs: list) -> None:
    print(f"{'model':<16} {'N':>3} {'S':>8} {'B':>3} {'layout':<28} {'layer us':>9} {'+comm us':>9} {'step us':>9} "
          f"{'model us':>9} {'splits':>6} {'err':>8}")  # fmt: skip
    for r in rows:
        meas = f"{r['measured_layer_us']:>9.1f}" if "measured_layer_us" in r else f"{'-':>9}"
        stp = f"{r['step_us']:>9.1f}" if "step_us" in r else f"{'-':>9}"
        err = f"{r['attn_max_abs_err_vs_fp64']:>8.1e}" if "attn_max_abs_err_vs_fp64" in r else f"{'-':>8}"
        print(f"{r['model']:<16} {r['gpus']:>3} {r['context']:>8} {r['batch']:>3} {r['layout']:<28} {meas} "
              f"{r['model_comm_us']:>9.1f} {stp} {r['model_layer_us']:>9.1f} {r['kv_splits']:>6} {err}")  # fmt: skip
    for p in pairs:
        flag = "  DIFFERS > 20 %" if p["off_by_more_than_20pct"] else ""
        print(f"{p['model']} N={p['gpus']} S={p['context']} B={p['batch']} {p['pair']} ({p['layouts']}): "
              f"measured {p['measured']:.2f}x, perf_model {p['modelled']:.2f}x{flag}")  # fmt: skip


def _ints(s: str) -> list:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-70b,qwen3-235b-a22b", help=f"presets: {', '.join(pm.MODELS)}")
    p.add_argument("--gpus", default="16,8", help="N per model (one value: every model)")
    p.add_argument("--context", default="32768,131072,1048576")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--hw", default=None, help="perf_model GPU preset for the collectives and the modelled ratio "
                                              "(default: from the device name)")  # fmt: skip
    p.add_argument("--max-splits", type=int, default=64, help="KV-split cap of TP and DCP layouts (0.5.23's default: 8)")
    p.add_argument("--chunk", type=int, default=64, help="--helix-kvp-chunk-size")
    p.add_argument("--helix-split-policy", default="on", choices=("on", "off"),
                   help="on: Helix layouts split as the server does (gqa_decode's per-batch policy, up to 256 "
                        "splits); off: --max-splits as every other layout")  # fmt: skip
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--cpu-smoke needs TRITON_INTERPRET=1 in the environment (Triton reads it at import)")
        device, dtype, timing, cores = "cpu", torch.float32, False, 132  # an H100's SM count for the split rule
        cases = [(SMOKE_MODELS["tiny"], 4), (SMOKE_MODELS["tiny-moe"], 4)]
        contexts, batches, chunk, hw_key = [96], [2], 8, args.hw or "h100"
        args.max_splits = 4  # the interpreter runs every (request, head, split) program in Python
    elif not torch.cuda.is_available():
        print("gpu_rank_step: no GPU here (torch.cuda.is_available() is False); nothing to run.")
        return 0
    else:
        device, dtype, timing = "cuda", torch.bfloat16, True
        cores = torch.cuda.get_device_properties(0).multi_processor_count
        name = torch.cuda.get_device_name(0)
        hw_key = args.hw or next((k for tag, k in HW_BY_NAME if tag in name), "h100")
        models = [pm.MODELS[m] for m in args.model.split(",")]
        ns = _ints(args.gpus)
        cases = list(zip(models, ns if len(ns) == len(models) else ns[:1] * len(models)))
        contexts, batches, chunk = _ints(args.context), _ints(args.batch), args.chunk
        print(json.dumps({"device": name, "hw_preset": hw_key, "sms": cores}), flush=True)
    hw = pm.HARDWARE[hw_key]
    kernels = load_kernels()
    rows = []
    for model, n in cases:
        for context in contexts:
            for batch in batches:
                rows += run_case(model, n, context, batch, kernels, hw, dtype, device, timing, args.max_splits, cores,
                                 chunk, args.helix_split_policy == "on")  # fmt: skip
    pairs = ratios(rows)
    print_rows(rows, pairs)
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_rank_step.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "hw_preset": hw_key,
                       "latency_us": pm.latency_label(hw), "rows": rows, "ratios": pairs}, f, indent=1)  # fmt: skip
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    bad = [r for r in rows if r.get("attn_max_abs_err_vs_fp64", 0.0) > tol or r.get("graph_equals_eager") is False]
    if bad:
        print(f"gpu_rank_step: {len(bad)} layout(s) failed the checks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
