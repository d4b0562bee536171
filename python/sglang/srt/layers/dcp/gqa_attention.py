"""DCP's GQA mode (Helix, arXiv 2507.07120) on Triton: one layer's attention, from the backend's DCP
branches (torch_native's DCP path, ``torch_attention.py``, serves every DCP layout itself):

    q [T, Q/TPA, D], k/v [T, K/TPA, D]                    (qkv_proj over TPA, replicated over KVP)
      -> K/V of the tokens this rank owns stored          (the backend's _set_kv_buffer, before)
      -> partial attention over this rank's KV shard      (out [T, Q/TPA, D], lse [T, Q/TPA])
      -> ONE All-to-All over the DCP group + LSE merge    (exact attention [T, Q/N, D])
      -> [T, Q/N * D] for o_proj (TP over all N ranks)

A query at position p attends to the keys this rank owns at positions <= p (none: output 0, LSE
-inf). Decode is upstream's two-stage kernel with the merged-LSE output over the local KV list;
extend is upstream's extend kernel with ``lse_extend`` in three calls over the owned keys (the
owned prefix; each chunk segment over the owned new tokens before it; each segment causally over
itself), so every rank does ~1/KVP of the prefill. A speculative target verify is a causal extend
of the drafts over the committed prefix; a draft decode step attends up to its own position. Every
forward's lists are built once per batch by the backend's hooks into ``forward_metadata.dcp_gqa``
(``init_forward_metadata``: ``dcp_gqa_forward_metadata``; in a CUDA graph, a decode's and each draft
step's by ``init_forward_metadata_in_graph``, ``gqa_decode.py``), and the layers only read them
(docs/helix-design.md, 3-4).

The ranks: N = KVP x TPA form the TP group, ``tp_rank = tpa_rank * KVP + kvp_rank``; the KVP group
is DCP's group (``dcp_group_ranks``), its layout DCP's with ``interleave_size = chunk``
(``gqa_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sglang.kernels.ops.attention.dcp_kernels import dcp_lse_combine_triton
from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
from sglang.srt.layers.dcp import gqa_layout
from sglang.srt.layers.dcp.comm import dcp_a2a_lse_reduce, dcp_a2a_lse_reduce_packed
from sglang.srt.layers.dcp.gqa_decode import (
    DcpGqaDecodeMetadata,
    send_views,
    stage2_split_tile,
)
from sglang.srt.layers.dcp.layout import localize_dcp_indices
from sglang.srt.layers.dcp.torch_attention import kv_scales, tree_mask_of
from sglang.srt.runtime_context import get_parallel


@dataclass
class DcpGqaForwardMetadata:
    """An extend's or a verify's lists (a decode's: ``DcpGqaDecodeMetadata``): built once per batch
    by the backend's ``init_forward_metadata`` (``dcp_gqa_forward_metadata``), only read by the
    layers."""

    kvp_rank: int
    kvp_size: int
    chunk: int
    # the owned-key lists of the extend's three calls (TritonExtendLists), or of a tree
    # verify's two (_tree_verify_lists)
    extend_lists: Optional[object] = None


def dcp_gqa_forward_metadata(forward_batch, backend):
    """This forward's metadata, for the Triton backend's ``init_forward_metadata``: a decode's (or a
    draft step's) lists and workspace from the decode state (``gqa_decode.py``), any other
    forward's owned-key lists from the backend's table; None for an idle batch."""
    mode = forward_batch.forward_mode
    if forward_batch.out_cache_loc is None or mode.is_idle():
        return None
    if mode.is_decode():
        return backend.dcp_gqa_decode.prepare(forward_batch, backend)
    req_to_token = backend.req_to_token
    parallel = get_parallel()
    meta = DcpGqaForwardMetadata(
        parallel.attn_dcp_rank, parallel.attn_dcp_size, parallel.dcp_interleave_size
    )
    tree = tree_mask_of(forward_batch)
    if tree is not None:
        meta.extend_lists = _tree_verify_lists(forward_batch, meta, req_to_token, tree)
    else:
        meta.extend_lists = TritonExtendLists.build(forward_batch, meta, req_to_token)
    return meta


def extend_lens_of(forward_batch) -> Tuple[torch.Tensor, list, torch.Tensor, list]:
    """``(prefix [B], prefix host list, new [B], new host list)`` of an extend-like forward: an
    extend (a draft extend too) has them; a speculative target verify is an extend of the
    ``draft_token_num`` draft tokens of each request over its committed ``seq_lens``."""
    if forward_batch.forward_mode.is_target_verify():
        drafts = forward_batch.spec_info.draft_token_num
        prefix = forward_batch.seq_lens
        return (
            prefix,
            [int(x) for x in forward_batch.seq_lens_cpu],
            torch.full_like(prefix, drafts),
            [drafts] * prefix.shape[0],
        )
    return (
        forward_batch.extend_prefix_lens,
        [int(x) for x in forward_batch.extend_prefix_lens_cpu],
        forward_batch.extend_seq_lens,
        [int(x) for x in forward_batch.extend_seq_lens_cpu],
    )


@dataclass
class TritonExtendLists:
    """The owned-key lists of the Triton extend's three calls: ``qo_indptr [B+1]`` over the T new
    tokens, ``prefix_kv_*`` the owned keys in ``[0, prefix_len)``; per segment (``extend_segments``):
    ``seg_qo_indptr [S+1]``, ``seg_kv_*`` the owned keys in ``[prefix_len, segment start)`` (already
    written), ``seg_owned [T]`` whether this rank owns each new token's segment."""

    qo_indptr: torch.Tensor
    prefix_kv_indptr: torch.Tensor
    prefix_kv_indices: torch.Tensor
    max_extend_len: int
    extend_lens_cpu: list
    seg_qo_indptr: torch.Tensor
    seg_kv_indptr: torch.Tensor
    seg_kv_indices: torch.Tensor
    seg_owned: torch.Tensor
    max_seg_len: int
    seg_lens_cpu: list

    @classmethod
    def build(
        cls, forward_batch, meta: DcpGqaForwardMetadata, pool: torch.Tensor
    ) -> "TritonExtendLists":
        k, n, c = meta.kvp_rank, meta.kvp_size, meta.chunk
        device = forward_batch.seq_lens.device
        prefix_lens, prefix_cpu, extend_lens, extend_cpu = extend_lens_of(forward_batch)
        slots = forward_batch.req_pool_indices
        qo = torch.zeros(len(extend_cpu) + 1, dtype=torch.int32, device=device)
        torch.cumsum(extend_lens, dim=0, dtype=torch.int32, out=qo[1:])
        prefix_total = gqa_layout.total_local_len(prefix_cpu, k, n, c)
        prefix_indptr, prefix_indices, _ = gqa_layout.local_kv_indices(
            pool, slots, prefix_lens, prefix_total, k, n, c
        )
        request, start, length = gqa_layout.extend_segments(prefix_cpu, extend_cpu, c)
        seg_total = gqa_layout.total_local_len(
            start, k, n, c
        ) - gqa_layout.total_local_len([prefix_cpu[b] for b in request], k, n, c)
        request_t = torch.tensor(request, dtype=torch.int64, device=device)
        seg_start = torch.tensor(start, dtype=torch.int64, device=device)
        seg_indptr, seg_indices, _ = gqa_layout.local_kv_indices(
            pool,
            slots[request_t],
            seg_start,
            seg_total,
            k,
            n,
            c,
            kv_starts=prefix_lens.to(torch.int64)[request_t],
        )
        seg_lens = torch.tensor(length, dtype=torch.int64, device=device)
        seg_qo = torch.zeros(len(length) + 1, dtype=torch.int32, device=device)
        torch.cumsum(seg_lens, dim=0, out=seg_qo[1:])
        owned = localize_dcp_indices(seg_start, n, k, interleave_size=c) >= 0  # [S]
        # [T]
        seg_owned = torch.repeat_interleave(owned, seg_lens, output_size=sum(length))
        return cls(
            qo,
            prefix_indptr,
            prefix_indices,
            max(extend_cpu),
            extend_cpu,
            seg_qo,
            seg_indptr,
            seg_indices,
            seg_owned,
            max(length),
            length,
        )


def dcp_gqa_attention(layer, q, k, v, forward_batch, backend) -> torch.Tensor:
    """Exact attention of this rank's ``Q/N`` heads, ``[T, Q/N * Dv]`` for ``o_proj``, from the
    Triton backend's DCP branches in DCP's GQA mode (the forward stored the K/V before);
    ``layer`` has the TPA-local head counts.
    """
    num_heads, num_kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    q = q.reshape(-1, num_heads, layer.qk_head_dim)  # [T, Q/TPA, D]
    mode = forward_batch.forward_mode
    # built by the backend's hooks, before the layers
    meta = backend.forward_metadata.dcp_gqa
    if meta is None:
        raise RuntimeError(
            "dcp gqa attention: the Triton backend's init_forward_metadata (or, in a CUDA graph, "
            f"init_forward_metadata_in_graph) did not build this forward's lists ({mode.name})"
        )
    if k is not None:
        k = k.reshape(-1, num_kv_heads, layer.qk_head_dim)  # [T, K/TPA, D]
        v = v.reshape(-1, num_kv_heads, layer.v_head_dim)

    # One All-to-All of the partials over the DCP group + the LSE combine: [T, Q/N, Dv]
    group = get_parallel().dcp_group
    if isinstance(meta, DcpGqaDecodeMetadata):
        send, recv = _triton_decode(layer, q, meta, backend)  # send holds the partials
        merged = dcp_a2a_lse_reduce_packed(send, recv, q.shape[0], group)
    else:
        out, lse = _triton_extend(layer, q, k, v, forward_batch, meta, backend)
        merged = dcp_a2a_lse_reduce(out, lse, group)
    return merged.reshape(merged.shape[0], -1)


def _check_layer(layer) -> None:
    if getattr(layer, "sliding_window_size", -1) not in (-1, None) or layer.logit_cap:
        raise NotImplementedError(
            "dcp gqa attention: sliding window / logit cap are not supported"
        )


def _kv_buffers(layer, backend, dtype: torch.dtype):
    pool = backend.token_to_kv_pool
    k_descale, v_descale = kv_scales(layer, pool, dtype) or (1.0, 1.0)
    return (
        pool.get_key_buffer(layer.layer_id),
        pool.get_value_buffer(layer.layer_id),
        k_descale,
        v_descale,
    )


def _triton_decode(layer, q, meta: DcpGqaDecodeMetadata, backend):
    """Upstream's two-stage decode over the local KV lists, stage 2 writing output and merged LSE
    into the send buffer: ``(send, recv)`` ``[KVP, T, Q/N, Dv + lpd]``, every buffer the metadata's.
    No host value, no allocation: capturable."""
    _check_layer(layer)
    k_buf, v_buf, k_descale, v_descale = _kv_buffers(layer, backend, q.dtype)
    # [KVP, T, Q/N, Dv], [KVP, T, Q/N]
    out, lse = send_views(meta.send, layer.v_head_dim)
    splits = meta.attn_logits.shape[2]
    decode_attention_fwd(
        q,
        k_buf,
        v_buf,
        out,
        meta.kv_indptr,
        meta.kv_indices,
        meta.attn_logits,  # [T, Q/TPA, S, Dv]: S, the batch's split extent
        meta.attn_lse,
        meta.num_kv_splits,
        splits,
        layer.scaling,
        k_descale,
        v_descale,
        output_lse=lse,
        split_tile=stage2_split_tile(splits),
    )
    return meta.send, meta.recv


def _triton_extend(layer, q, k, v, forward_batch, meta: DcpGqaForwardMetadata, backend):
    _check_layer(layer)
    k_buf, v_buf, k_descale, v_descale = _kv_buffers(layer, backend, q.dtype)
    T, H, _ = q.shape
    # Extend: three partials over the keys this rank owns (docs/helix-design.md, section 3),
    # merged here: [0] every query over the owned prefix, [1] each segment over the owned new
    # tokens before it, [2] each segment causally over itself (kept only where this rank owns it;
    # the others compute it too, a chunk x segment sliver, rather than gather the owned ones).
    if not isinstance(meta.extend_lists, TritonExtendLists):  # a tree verify
        return _triton_tree_verify(
            layer, q, k.contiguous(), v.contiguous(), forward_batch, meta, backend
        )
    x = meta.extend_lists
    # [3, T, Q/TPA, Dv]
    outs = torch.empty((3, T, H, layer.v_head_dim), dtype=q.dtype, device=q.device)
    lses = torch.empty((3, T, H), dtype=torch.float32, device=q.device)
    k, v = k.contiguous(), v.contiguous()
    # (qo_indptr, kv_indptr, kv_indices, max_len, lens_cpu) of the prefix call and the segments'
    prefix = (x.qo_indptr, x.prefix_kv_indptr, x.prefix_kv_indices, x.max_extend_len)
    seg = (x.seg_qo_indptr, x.seg_kv_indptr, x.seg_kv_indices, x.max_seg_len)
    calls = (
        (*prefix, x.extend_lens_cpu, True, False),
        (*seg, x.seg_lens_cpu, True, False),
        (*seg, x.seg_lens_cpu, False, True),
    )
    for i, call in enumerate(calls):
        qo, kv_indptr, kv_indices, max_len, lens_cpu, skip_extend, skip_prefix = call
        extend_attention_fwd(
            q,
            k,
            v,
            outs[i],
            k_buf,
            v_buf,
            qo,
            kv_indptr,
            kv_indices,
            None,
            True,
            None,
            max_len,
            k_descale,
            v_descale,
            sm_scale=layer.scaling,
            lse_extend=lses[i],
            skip_extend=skip_extend,
            skip_prefix=skip_prefix,
            extend_seq_lens_cpu=lens_cpu,
        )
    lses[2].masked_fill_(~x.seg_owned[:, None], float("-inf"))
    # [T, Q/TPA, Dv], [T, Q/TPA]
    return dcp_lse_combine_triton(outs, lses, return_lse=True)


def _tree_verify_lists(forward_batch, meta: DcpGqaForwardMetadata, req_to_token, tree):
    """A Triton tree verify's lists (``_triton_tree_verify``): ``(qo_indptr [B+1], the owned
    committed prefix's indptr and rows, the owned tree keys' indptr and rows, their mask columns
    [n, L + n] per request back to back, its indptr)``. Vectorized over the batch; host sizes from
    the host lengths."""
    kr, n, c = meta.kvp_rank, meta.kvp_size, meta.chunk
    pool, slots, seq = (
        req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
    )
    seq_cpu = torch.as_tensor(forward_batch.seq_lens_cpu, dtype=torch.int64)
    device = seq.device
    drafts, B = forward_batch.spec_info.draft_token_num, seq.shape[0]
    # [B+1]
    qo = torch.arange(0, B * drafts + 1, drafts, dtype=torch.int32, device=device)
    owned_prefix = gqa_layout.total_local_len(seq_cpu, kr, n, c)
    prefix = gqa_layout.local_kv_indices(pool, slots, seq, owned_prefix, kr, n, c)
    owned_tree = gqa_layout.total_local_len(seq_cpu + drafts, kr, n, c) - owned_prefix
    tree_indptr, tree_rows, tree_pos = gqa_layout.local_kv_indices(
        pool, slots, seq + drafts, owned_tree, kr, n, c, kv_starts=seq
    )
    # request b's local mask [n, L_b + n]: its rows of the tree's mask [n, seq_len + n] at the
    # columns of its L_b owned tree keys (a key's column is its position), then n zero columns
    # (the kernel's skipped extend part)
    mask, offsets = tree
    tree_lens = (tree_indptr[1:] - tree_indptr[:-1]).long()  # [B]
    mask_indptr = torch.zeros(B + 1, dtype=torch.int64, device=device)
    torch.cumsum(drafts * (tree_lens + drafts), 0, out=mask_indptr[1:])
    total = drafts * (owned_tree + B * drafts)
    b = torch.repeat_interleave(
        torch.arange(B, device=device),
        mask_indptr[1:] - mask_indptr[:-1],
        output_size=total,
    )
    at = torch.arange(total, device=device) - mask_indptr[b]
    row, col = at // (tree_lens[b] + drafts), at % (tree_lens[b] + drafts)
    key = col < tree_lens[b]
    # [owned_tree + 1]: one pad entry for the zero columns
    key_pos = torch.cat([tree_pos, tree_pos.new_zeros(1)])
    pos = key_pos[torch.where(key, tree_indptr[:-1].long()[b] + col, owned_tree)]
    full_at = offsets[b] + row * (seq.long()[b] + drafts) + pos
    local_mask = torch.where(key, mask[full_at], torch.zeros_like(mask[:1]))
    return qo, prefix[0], prefix[1], tree_indptr, tree_rows, local_mask, mask_indptr


def _triton_tree_verify(
    layer, q, k, v, forward_batch, meta: DcpGqaForwardMetadata, backend
):
    """A tree verify (top-k > 1) on Triton: two partials over the keys this rank owns, merged here:
    [0] every draft token over the owned committed prefix (all visible, no mask), [1] every draft
    token over the owned tree keys (already written) by the verify's mask, its columns of those keys
    (``[n, L + n]`` per request, L the owned tree keys; the kernel's extend part is skipped).
    """
    k_buf, v_buf, k_descale, v_descale = _kv_buffers(layer, backend, q.dtype)
    T, H, _ = q.shape
    qo, prefix_indptr, prefix_rows, tree_indptr, tree_rows, local_mask, mask_indptr = (
        meta.extend_lists
    )
    drafts = forward_batch.spec_info.draft_token_num
    lens_cpu = [drafts] * (qo.shape[0] - 1)
    # [2, T, Q/TPA, Dv]
    outs = torch.empty((2, T, H, layer.v_head_dim), dtype=q.dtype, device=q.device)
    lses = torch.empty((2, T, H), dtype=torch.float32, device=q.device)
    for i, (kv_indptr, kv_indices, mask) in enumerate(
        ((prefix_indptr, prefix_rows, None), (tree_indptr, tree_rows, local_mask))
    ):
        extend_attention_fwd(
            q,
            k,
            v,
            outs[i],
            k_buf,
            v_buf,
            qo,
            kv_indptr,
            kv_indices,
            mask,
            True,
            None if mask is None else mask_indptr,
            drafts,
            k_descale,
            v_descale,
            sm_scale=layer.scaling,
            skip_prefix_custom_mask=mask is None,
            lse_extend=lses[i],
            skip_extend=True,
            extend_seq_lens_cpu=lens_cpu,
        )
    return dcp_lse_combine_triton(outs, lses, return_lse=True)
