"""Upstream DCP and Helix on the same tiny GQA layer, against full attention. One process, CPU.

    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=python/sglang_helix/testing/sgl_kernel_stub \
        .venv/bin/python benchmark/dcp_gqa_check.py

One decode token of a Llama-style layer with Q = 8 query heads and K = 2 KV heads, every rank of
every group run in this process (collectives emulated), compared with float64 attention over all
S positions: the heads each rank hands to ``o_proj`` must be the exact attention of those heads.

**Upstream DCP** (``--tp N --dcp-size G``): upstream's own pieces of the Triton MHA DCP decode, in
the order its backend calls them (0.5.23 line numbers; the pristine file where the series patches
one):

  pool heads  ModelConfig.get_num_kv_heads(tp, dcp)                    configs/model_config.py:1700-1711
  KV write    masked_set_kv_buffer_kernel, row loc // dcp, pos % dcp   mem_cache/memory_pool.py:2938-2958,
                                                                       layers/attention/triton_backend.py:1642-1658
  Q gather    the group's Q heads concatenated (all_gather dim=1)      triton_backend.py:2432
  decode      decode_attention_fwd over the rank's rows                triton_backend.py:2433-2461
  LSE         logsumexp of the per-split LSE                           triton_backend.py:2462-2468
  merge       cp_lse_ag_out_rs_mha, its collectives emulated           layers/dcp/comm.py:56-82

with two layouts of the K/V a rank's ``qkv_proj`` produces: ``qwen3_5`` (replicated within the DCP
group, models/qwen3_5.py:1287-1288, 1330-1341: upstream's GQA KV-head fix, wired only into Qwen3.5)
and ``llama``, the series' Llama (its first patch: ``kv_parallel_group`` from
``linear.dcp_kv_partition``, the same fix made one helper for every family the series touches).
0.5.23's own Llama shards K/V over all tp ranks, which was wrong at --tp 2 --dcp-size 2 and
--tp 4 --dcp-size 4 (K * dcp > tp: query heads 4-7 came out exactly 0; measured 2026-11-24).

**Helix** (``--tp N --helix-kvp-size KVP``): its own pieces: ``qkv_proj`` over TPA (the KV heads of
``tpa_rank``), the K/V of the positions a KVP rank owns (DCP's layout with interleave 4), the
decode kernel's merged-LSE output over them for all Q/TPA heads, and ``dcp_lse_combine_triton`` over the
KVP group of the head slice each rank receives in the All-to-All (``tp_rank * Q/N ...``).

Results (2026-11-25, docs/upstream-pr.md): DCP is exact at every layout with both ``qwen3_5``'s
and the series' Llama K/V partition, and the launch check accepts both; Helix is exact at every
layout.
"""



import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit decoration (CPU tensors)

import types  # noqa: E402

import torch  # noqa: E402

from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.dcp.comm import cp_lse_ag_out_rs_mha  # noqa: E402
from sglang.srt.mem_cache.memory_pool import masked_set_kv_buffer_kernel  # noqa: E402

Q, K, D, S = 8, 2, 16, 37  # query heads, KV heads, head dim, tokens (the last is the decode token)
SCALE = D**-0.5
MAX_SPLITS = 2

torch.manual_seed(0)
Q_FULL = torch.randn(Q, D)  # the decode token's query, every head
K_FULL = torch.randn(S, K, D)  # keys / values at positions 0..S-1 (the decode token's already written)
V_FULL = torch.randn(S, K, D)


def reference() -> torch.Tensor:
    """[Q, D]: query head h attends with KV head h // (Q/K) over all S positions (float64)."""
    kk = K_FULL.double().repeat_interleave(Q // K, dim=1)
    vv = V_FULL.double().repeat_interleave(Q // K, dim=1)
    p = torch.softmax(torch.einsum("hd,shd->hs", Q_FULL.double(), kk) * SCALE, dim=-1)
    return torch.einsum("hs,shd->hd", p, vv)


def kv_heads_of(kv_rank: int, kv_tp: int) -> list[int]:
    """The KV heads QKVParallelLinear gives kv_rank of kv_tp ranks (layers/linear.py:1140-1145, 1502)."""
    if kv_tp >= K:
        return [kv_rank // (kv_tp // K)]  # replicated: kv_tp / K ranks per head
    n = K // kv_tp
    return list(range(kv_rank * n, (kv_rank + 1) * n))


def pool_heads(tp: int, dcp: int) -> int:
    cfg = types.SimpleNamespace(get_total_num_kv_heads=lambda: K, is_draft_model=False)
    return ModelConfig.get_num_kv_heads(cfg, tp, dcp)


def rank_partial(q_all, heads, dcp, dcp_rank, n_pool_heads):
    """One DCP rank: masked write of its owned tokens, then decode over its rows. (o fp32, lse)."""
    k_loc = K_FULL[:, heads].contiguous()  # [S, H_local, D]: what this rank's qkv_proj produced
    v_loc = V_FULL[:, heads].contiguous()
    pos = torch.arange(S)
    loc = pos + dcp  # logical ids from a page = dcp allocator (loc % dcp == pos % dcp); page 0 reserved
    rows = S // dcp + 2
    k_buf = torch.zeros(rows, n_pool_heads, D)  # the pool is zero-initialised (memory_pool.py:2625-2627)
    v_buf = torch.zeros_like(k_buf)
    mask = pos % dcp == dcp_rank
    write_loc = loc // dcp
    n, h, d = k_loc.shape  # H comes from the K/V in hand, not from the pool (memory_pool.py:2939)
    masked_set_kv_buffer_kernel[(n,)](
        k_loc, v_loc, k_buf, v_buf, write_loc, mask, n, h, d, 128,
        k_loc.stride(0), k_loc.stride(1), v_loc.stride(0), v_loc.stride(1),
        k_buf.stride(0), v_buf.stride(0),
    )
    kv_indices = (loc[mask] // dcp).to(torch.int64)  # this rank's rows in position order
    kv_indptr = torch.tensor([0, kv_indices.numel()], dtype=torch.int32)
    hg = q_all.shape[1]
    o = torch.empty(1, hg, D)
    attn_logits = torch.empty(1, hg, MAX_SPLITS, D)
    attn_lse = torch.full((1, hg, MAX_SPLITS), float("-inf"))
    num_kv_splits = torch.full((1,), MAX_SPLITS, dtype=torch.int32)
    decode_attention_fwd(
        q_all, k_buf, v_buf, o, kv_indptr, kv_indices, attn_logits, attn_lse,
        num_kv_splits, MAX_SPLITS, SCALE, 1.0, 1.0,
    )
    return o, torch.logsumexp(attn_lse, dim=-1)  # [1, hg, D], [1, hg]


def merge(outs, lses):
    """cp_lse_ag_out_rs_mha on every member, its all_gather / all_reduce emulated in one process."""
    n = len(outs)

    class Group:
        world_size = n

        def __init__(self, rank, total=None):
            self.rank_in_group, self.total, self.seen = rank, total, None

        def all_gather(self, t, dim=0):
            return torch.cat([x.contiguous() for x in lses], dim=dim)

        def all_reduce(self, t):
            self.seen = t.clone()
            return self.total.clone() if self.total is not None else t

    contributions = []
    for r in range(n):  # pass 1: what each member hands to the all-reduce
        g = Group(r)
        cp_lse_ag_out_rs_mha(outs[r].clone(), lses[r], g)
        contributions.append(g.seen)
    total = sum(contributions)
    return [cp_lse_ag_out_rs_mha(outs[r].clone(), lses[r], Group(r, total)) for r in range(n)]


ARCH = {"llama": "LlamaForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}


def launch_check(tp: int, dcp: int, layout: str) -> str:
    """What the series' [DCP] launch guard (arg_groups/attention_hook.py, every platform) says."""
    from sglang.srt.arg_groups.attention_hook import _check_dcp_kv_head_layout
    from sglang.srt.configs.model_config import AttentionArch

    cfg = types.SimpleNamespace(
        attention_arch=AttentionArch.MHA, hf_config=types.SimpleNamespace(architectures=[ARCH[layout]]),
        get_num_kv_heads=lambda tp_, dcp_=1: pool_heads(tp_, dcp_),
    )  # fmt: skip
    try:
        _check_dcp_kv_head_layout(tp, dcp, cfg)
    except ValueError:
        return "refused"
    return "accepted"


def llama_kv_partition(tp: int, dcp: int):
    """``dcp_kv_partition(tp)`` (layers/linear.py, the series' first patch) at ``--dcp-size dcp``:
    what LlamaAttention passes its qkv_proj as ``kv_parallel_group``, and the K/V TP width."""
    from sglang.srt.layers import linear

    published = linear.get_parallel
    linear.get_parallel = lambda: types.SimpleNamespace(attn_dcp_size=dcp)
    try:
        return linear.dcp_kv_partition(tp)
    finally:
        linear.get_parallel = published


def run(tp: int, dcp: int, layout: str) -> None:
    ref = reference()
    n_pool = pool_heads(tp, dcp)
    worst, zero_heads = 0.0, []
    for g0 in range(0, tp, dcp):  # DCP groups: consecutive TP ranks (distributed/parallel_state.py:2719-2725)
        members = list(range(g0, g0 + dcp))
        q_all = torch.cat([Q_FULL[r * Q // tp:(r + 1) * Q // tp] for r in members])[None].contiguous()
        outs, lses = [], []
        for r in members:
            if layout == "llama":  # the series' Llama: qkv_proj's K/V partition from dcp_kv_partition
                group, kv_tp = llama_kv_partition(tp, dcp)
                heads = kv_heads_of(r // (group.replica_size if group else 1), kv_tp)
            else:
                heads = kv_heads_of(r // dcp, tp // dcp)
            o, lse = rank_partial(q_all, heads, dcp, r % dcp, n_pool)  # dcp_rank = tp_rank % dcp
            outs.append(o)
            lses.append(lse)
        for r, out in zip(members, merge(outs, lses)):
            want = ref[r * Q // tp:(r + 1) * Q // tp]
            got = out[0].double()
            worst = max(worst, (got - want).abs().max().item())
            zero_heads += [r * Q // tp + i for i in range(got.shape[0]) if not got[i].any()]
    print(
        f"{layout:8s} --tp {tp} --dcp-size {dcp}: pool KV heads {n_pool}, "
        f"max |err| vs full attention {worst:.2e}, all-zero output heads {zero_heads}, "
        f"launch {launch_check(tp, dcp, layout)}"
    )


CHUNK = 4  # --helix-kvp-chunk-size (small, so that every rank owns several chunks of S)


def helix_run(tp: int, kvp: int) -> float:
    """Helix's decode for every rank of a --tp tp --helix-kvp-size kvp grid: max |err| of the heads
    each rank hands to o_proj."""
    from sglang.kernels.ops.attention.dcp_kernels import dcp_lse_combine_triton

    ref = reference()
    tpa = tp // kvp
    worst = 0.0
    owner = (torch.arange(S) // CHUNK) % kvp  # DCP's layout with interleave_size = CHUNK
    for t in range(tpa):  # one TPA slice: KVP ranks with the same heads, different positions
        q_heads = list(range(t * Q // tpa, (t + 1) * Q // tpa))  # qkv_proj over TPA
        kv_heads = list(range(t * K // tpa, (t + 1) * K // tpa))
        q = Q_FULL[q_heads][None].contiguous()  # [1, Q/TPA, D]
        outs, lses = [], []
        for k in range(kvp):
            pos = torch.nonzero(owner == k).flatten()  # the positions KVP rank k stores
            k_buf = K_FULL[pos][:, kv_heads].contiguous()  # compact local rows
            v_buf = V_FULL[pos][:, kv_heads].contiguous()
            o = torch.empty(1, len(q_heads), D)
            lse = torch.empty(1, len(q_heads))
            decode_attention_fwd(
                q, k_buf, v_buf, o,
                torch.tensor([0, pos.numel()], dtype=torch.int32), torch.arange(pos.numel()),
                torch.empty(1, len(q_heads), MAX_SPLITS, D), torch.empty(1, len(q_heads), MAX_SPLITS),
                torch.full((1,), MAX_SPLITS, dtype=torch.int32), MAX_SPLITS, SCALE, 1.0, 1.0,
                output_lse=lse,
            )  # fmt: skip
            outs.append(o)
            lses.append(lse)
        outs, lses = torch.stack(outs), torch.stack(lses)  # [KVP, 1, Q/TPA, D], [KVP, 1, Q/TPA]
        g = Q // tp  # heads per destination after the All-to-All
        for k in range(kvp):  # what rank (t, k) merges: slice k of every member's heads
            merged, _ = dcp_lse_combine_triton(outs[:, :, k * g : (k + 1) * g], lses[:, :, k * g : (k + 1) * g])
            tp_rank = t * kvp + k
            want = ref[tp_rank * g : (tp_rank + 1) * g]  # o_proj's row shard of plain TP = N
            worst = max(worst, (merged[0].double() - want).abs().max().item())
    print(f"helix    --tp {tp} --helix-kvp-size {kvp}: TPA {tpa}, max |err| vs full attention {worst:.2e}")
    return worst


if __name__ == "__main__":
    for tp, g in ((4, 2), (2, 2), (4, 4)):
        for layout in ("qwen3_5", "llama"):
            run(tp, g, layout)
        helix_run(tp, g)

