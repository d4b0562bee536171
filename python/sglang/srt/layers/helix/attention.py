"""Helix attention for one layer: write the owned K/V, attend over the local shard, merge.

    q [T, Q/TPA, D], k/v [T, K/TPA, D]                    (qkv_proj over TPA, replicated over KVP)
      -> write K/V of the tokens this rank owns           (physical rows; others go to a trash row)
      -> partial attention over this rank's KV shard      (out [T, Q/TPA, D], lse [T, Q/TPA])
      -> ONE All-to-All over the KVP group + LSE merge    (exact attention [T, Q/N, D])
      -> [T, Q/N * D] for o_proj (TP over all N ranks)

Partial attention contract (both backends): for query token t at global position p, attend to the
keys this rank owns at positions <= p; a rank that owns none returns output 0, LSE -inf.

- ``torch_native``: explicit masked softmax per request in fp32 (the fast CPU path for tests).
- ``triton``: decode is the upstream two-stage decode kernel with the merged-LSE output
  (``decode_attention_fwd(..., output_lse=)``) over the local KV list. Extend uses the upstream
  extend kernel with ``lse_extend``: every rank attends its *owned prefix* (1/KVP of the prefix
  work each); the causal attention of the chunk being prefilled over itself is computed once, by
  KVP rank 0, from the K/V in hand (``skip_extend`` elsewhere). Exact, but that chunk-local part is
  not split across ranks (see docs/helix-design.md, section 3).

Per-batch index metadata (write rows, local KV lists) is built once per forward batch, on the
first layer, and cached on the ``ForwardBatch``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sglang.srt.layers.helix import kv_layout
from sglang.srt.layers.helix.comm import helix_a2a_merge
from sglang.srt.model_executor.forward_context import get_attn_backend

TRASH_ROW = 0  # physical rows of the reserved logical page 0: never hold a real token

# DEBUG: directory for per-rank K/V dumps (see _debug_dump_kv); read once, unset = no dumps.
_DEBUG_KV_DIR = os.environ.get("SGLANG_HELIX_DEBUG_KV_DIR") or None


@dataclass
class HelixForwardMetadata:
    kvp_rank: int
    kvp_size: int
    chunk: int
    write_rows: torch.Tensor  # [T] physical row of each new token on this rank (trash if not owned)
    kv_indptr: torch.Tensor  # [B+1] local KV list of positions [0, seq_len) (new tokens included)
    kv_indices: torch.Tensor  # [L]
    total_local: int
    prefix_kv_indptr: Optional[torch.Tensor] = None  # extend: local list of positions [0, prefix_len)
    prefix_kv_indices: Optional[torch.Tensor] = None
    qo_indptr: Optional[torch.Tensor] = None  # extend: [B+1]
    # torch_native: global positions of the listed keys [L], and kv_indptr on the host
    kv_positions: Optional[torch.Tensor] = None
    kv_indptr_host: Optional[list] = None
    # triton decode: stage-1 split buffers, allocated on the first layer and reused by the others
    decode_splits: Optional[tuple] = None  # (attn_logits [B, H, S, Dv], attn_lse [B, H, S], num_kv_splits [B])

    @classmethod
    def build(cls, forward_batch) -> "HelixForwardMetadata":
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        k, n, c = parallel.helix_kvp_rank, parallel.helix_kvp_size, parallel.helix_kvp_chunk_size
        rows, owned = kv_layout.write_rows(forward_batch.out_cache_loc, k, n, c)
        rows = torch.where(owned, rows, TRASH_ROW)
        pool = _req_to_token(get_attn_backend())
        total = kv_layout.total_local_len(forward_batch.seq_lens_cpu, k, n, c)
        indptr, indices, _ = kv_layout.local_kv_indices(
            pool, forward_batch.req_pool_indices, forward_batch.seq_lens, total, k, n, c
        )
        meta = cls(k, n, c, rows, indptr, indices, total)
        if forward_batch.forward_mode.is_extend():
            device = forward_batch.seq_lens.device
            prefix_cpu = forward_batch.extend_prefix_lens_cpu
            prefix_total = kv_layout.total_local_len(prefix_cpu, k, n, c)
            meta.prefix_kv_indptr, meta.prefix_kv_indices, _ = kv_layout.local_kv_indices(
                pool, forward_batch.req_pool_indices, forward_batch.extend_prefix_lens, prefix_total, k, n, c
            )
            qo = torch.zeros(len(prefix_cpu) + 1, dtype=torch.int32, device=device)
            torch.cumsum(forward_batch.extend_seq_lens, dim=0, out=qo[1:])
            meta.qo_indptr = qo
        return meta

    @classmethod
    def of(cls, forward_batch) -> "HelixForwardMetadata":
        meta = getattr(forward_batch, "helix_metadata", None)
        if meta is None:
            meta = cls.build(forward_batch)
            forward_batch.helix_metadata = meta
        return meta


def _req_to_token(backend) -> torch.Tensor:
    """``[R, max_context]`` logical KV ids by (request slot, position), as the backend holds it."""
    if hasattr(backend, "req_to_token_pool"):  # torch_native
        return backend.req_to_token_pool.req_to_token
    return backend.req_to_token  # triton


def helix_attention(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch) -> torch.Tensor:
    """Exact attention of this rank's ``Q/N`` heads: ``[T, Q/N * Dv]``, ready for ``o_proj``.

    ``layer`` is the ``RadixAttention`` built with the TPA-local head counts.
    """
    from sglang.srt.layers.helix.groups import get_helix_kvp_group

    meta = HelixForwardMetadata.of(forward_batch)
    num_heads, num_kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    q = q.reshape(-1, num_heads, layer.qk_head_dim)  # [T, Q/TPA, D]
    k = k.reshape(-1, num_kv_heads, layer.qk_head_dim)  # [T, K/TPA, D]
    v = v.reshape(-1, num_kv_heads, layer.v_head_dim)
    backend = get_attn_backend()
    kv_pool = backend.token_to_kv_pool
    if forward_batch.forward_mode.is_extend() and _kv_scales(layer, kv_pool, k.dtype):
        # The write divides k/v by the KV scales in place; the Triton extend still reads the
        # chunk being prefilled from them (as upstream's Triton backend, clone first).
        kv_pool.set_kv_buffer(layer, meta.write_rows, k.clone(), v.clone(), layer.k_scale, layer.v_scale)
    else:
        kv_pool.set_kv_buffer(layer, meta.write_rows, k, v, layer.k_scale, layer.v_scale)
    if _DEBUG_KV_DIR:  # debug only (SGLANG_HELIX_DEBUG_KV_DIR); off by default
        _debug_dump_kv(layer, forward_batch, meta, kv_pool)

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    if isinstance(backend, TritonAttnBackend):
        out, lse = _triton_partial(layer, q, k, v, forward_batch, meta, backend)
    elif isinstance(backend, TorchNativeAttnBackend):
        out, lse = _torch_partial(layer, q, forward_batch, meta, kv_pool)
    else:  # e.g. a HybridAttnBackend: the Helix hook refuses the flags that build one
        raise NotImplementedError(
            f"helix attention: no Helix path for the attention backend {type(backend).__name__}; "
            "only TritonAttnBackend and TorchNativeAttnBackend run under --helix-kvp-size > 1"
        )
    merged = helix_a2a_merge(out, lse, get_helix_kvp_group())  # [T, Q/N, Dv]
    return merged.reshape(merged.shape[0], -1)


def _check_layer(layer) -> None:
    if getattr(layer, "sliding_window_size", -1) not in (-1, None) or layer.logit_cap:
        raise NotImplementedError("helix attention: sliding window / logit cap are not supported")


def _torch_partial(layer, q, forward_batch, meta: HelixForwardMetadata, kv_pool):
    """Masked softmax per request in fp32: ``out [T, H, Dv]``, ``lse [T, H]``."""
    _check_layer(layer)
    k_buf = kv_pool.get_key_buffer(layer.layer_id)
    v_buf = kv_pool.get_value_buffer(layer.layer_id)
    k_descale, v_descale = _kv_scales(layer, kv_pool, q.dtype) or (1.0, 1.0)
    T, H, _ = q.shape
    group = H // layer.tp_k_head_num
    out = torch.zeros(T, H, layer.v_head_dim, dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if meta.kv_positions is None:  # once per batch (CPU path: host values are free here)
        meta.kv_positions = kv_layout.owned_positions(
            meta.kv_indptr, meta.total_local, meta.kvp_rank, meta.kvp_size, meta.chunk
        )
        meta.kv_indptr_host = meta.kv_indptr.tolist()
    key_pos, indptr = meta.kv_positions, meta.kv_indptr_host
    if forward_batch.forward_mode.is_decode():
        q_lens = [1] * (len(indptr) - 1)
    else:
        q_lens = forward_batch.extend_seq_lens_cpu
    start = 0
    for b, q_len in enumerate(q_lens):
        lo, hi = indptr[b], indptr[b + 1]
        tok = slice(start, start + q_len)
        start += q_len
        if hi == lo:
            continue  # this rank owns none of the request's tokens: neutral partial
        rows = meta.kv_indices[lo:hi]
        kb = (k_buf[rows].float() * k_descale).repeat_interleave(group, dim=1)  # [L, H, D]
        vb = (v_buf[rows].float() * v_descale).repeat_interleave(group, dim=1)
        s = torch.einsum("thd,lhd->htl", q[tok].float(), kb) * layer.scaling  # [H, t, L]
        visible = key_pos[lo:hi][None, :] <= forward_batch.positions[tok][:, None].long()  # [t, L]
        s = s.masked_fill(~visible[None], float("-inf"))
        m = torch.logsumexp(s, dim=-1)  # [H, t]; -inf where nothing is visible
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])
        o = torch.einsum("htl,lhd->thd", p, vb)
        out[tok] = o.to(out.dtype)
        lse[tok] = m.transpose(0, 1)
    return out, lse


def _kv_scales(layer, kv_pool, dtype: torch.dtype) -> Optional[Tuple[float, float]]:
    """``(k_scale, v_scale)`` when the pool's write divides K/V of ``dtype`` by them, else None.

    As ``MHATokenToKVPool.set_kv_buffer``: it scales only when it converts (an fp8 pool), by the
    layer's KV scales (a checkpoint's, or floats set by ``--quantization-param-path``). Reads of
    the pool multiply them back.
    """
    if layer.k_scale is None or layer.v_scale is None or dtype == kv_pool.dtype:
        return None
    if layer.k_scale_float is not None:
        return layer.k_scale_float, layer.v_scale_float
    return float(layer.k_scale), float(layer.v_scale)


def _triton_partial(layer, q, k, v, forward_batch, meta: HelixForwardMetadata, backend):
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    _check_layer(layer)
    k_buf = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_buf = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    k_descale, v_descale = _kv_scales(layer, backend.token_to_kv_pool, q.dtype) or (1.0, 1.0)
    T, H, _ = q.shape
    out = torch.empty(T, H, layer.v_head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if forward_batch.forward_mode.is_decode():
        splits = backend.max_kv_splits
        shape = (T, H, splits, layer.v_head_dim)
        if meta.decode_splits is None or meta.decode_splits[0].shape != shape:
            meta.decode_splits = (
                torch.empty(shape, dtype=torch.float32, device=q.device),
                torch.empty(shape[:3], dtype=torch.float32, device=q.device),
                torch.full((T,), splits, dtype=torch.int32, device=q.device),
            )  # once per batch: every layer has the same head counts
        attn_logits, attn_lse, num_kv_splits = meta.decode_splits
        decode_attention_fwd(
            q, k_buf, v_buf, out, meta.kv_indptr, meta.kv_indices, attn_logits, attn_lse,
            num_kv_splits, splits, layer.scaling, k_descale, v_descale, output_lse=lse,
        )  # fmt: skip
        return out, lse
    # Extend: owned prefix on every rank; the chunk's own causal part on KVP rank 0 only.
    extend_attention_fwd(
        q, k.contiguous(), v.contiguous(), out, k_buf, v_buf,
        meta.qo_indptr, meta.prefix_kv_indptr, meta.prefix_kv_indices,
        None, True, None, max(forward_batch.extend_seq_lens_cpu), k_descale, v_descale,
        sm_scale=layer.scaling, lse_extend=lse, skip_extend=meta.kvp_rank != 0,
        extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
    )  # fmt: skip
    return out, lse


def _debug_dump_kv(layer, forward_batch, meta: HelixForwardMetadata, kv_pool) -> None:
    """DEBUG ONLY (``SGLANG_HELIX_DEBUG_KV_DIR``): dump this rank's stored K/V after the write.

    For every request of the batch, (over)writes ``layer{L}_slot{S}_tp{R}.pt`` in the directory:
    the global positions in ``[0, seq_len)`` this rank owns and their K/V rows read back from the
    pool (``[n, K/TPA, D]``), with the rank's place in the KVP x TPA grid. Host syncs and file I/O
    on every layer: for tests (test/test_helix_kv_consistency.py), never for serving.
    """
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    positions = kv_layout.owned_positions(meta.kv_indptr, meta.total_local, meta.kvp_rank, meta.kvp_size, meta.chunk)
    k_buf = kv_pool.get_key_buffer(layer.layer_id)
    v_buf = kv_pool.get_value_buffer(layer.layer_id)
    indptr = meta.kv_indptr.tolist()
    for b, (slot, seq_len) in enumerate(zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens_cpu.tolist())):
        lo, hi = indptr[b], indptr[b + 1]
        rows = meta.kv_indices[lo:hi]
        record = {
            "layer_id": layer.layer_id, "slot": slot, "seq_len": int(seq_len),
            "tp_rank": parallel.tp_rank, "kvp_rank": meta.kvp_rank, "kvp_size": meta.kvp_size,
            "tpa_rank": parallel.helix_tpa_rank, "chunk": meta.chunk,
            "positions": positions[lo:hi].cpu(), "k": k_buf[rows].float().cpu(), "v": v_buf[rows].float().cpu(),
        }  # fmt: skip
        path = os.path.join(_DEBUG_KV_DIR, f"layer{layer.layer_id}_slot{slot}_tp{parallel.tp_rank}.pt")
        torch.save(record, path + ".tmp")
        os.replace(path + ".tmp", path)
