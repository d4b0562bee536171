"""How DCP's GQA mode splits a rank's KV shard over the Triton decode's stage-1 programs.

A replicated-Q rank attends its ``H = Q/TPA`` heads over 1/KVP of each request's KV. At batch 1 a long
context's shard needs far more splits than upstream's default to fill the SMs, and a batch needs
fewer the larger it is. So a decode of ``T`` tokens launches a split extent of ``grid_splits(T)``
(its split buffers are ``[T, H, S, Dv]``: eager per step, in a CUDA graph views of one buffer of
``split_rows(max_bs)`` rows sized for every captured batch), each token takes the splits its local
length needs (``num_kv_splits_by_local_len``), and stage 2 merges them ``stage2_split_tile(S)`` at a
time. Measured on one H200: at 1M tokens, batch 1, 256 splits are 1.6-2.7x faster than 64, and at
batch 4, 128 beat 256 by 1.2-1.4x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

# The most splits a token's shard is spread over ...
DCP_GQA_MAX_KV_SPLITS = 256
# ... so that a batch's stage-1 grid fills the SMs this many programs deep and no more (batch 1:
# 528 programs on 132 SMs caps at 256 splits, batch 4 gets 128, batch 64 upstream's 8) ...
DCP_GQA_CTAS_PER_SM = 4
# ... with at least this many KV tokens per split: upstream's heuristic alone spreads a short
# request over every split, where stage 2's reduction costs more than it saves.
DCP_GQA_MIN_TOKENS_PER_SPLIT = 256
# Stage 2 merges a token's splits this many at a time (its serial loop waits on two dependent
# loads per split: at 256 splits 2/3 of a lone request's decode on an H200).
DCP_GQA_SPLIT_TILE = 32


def stage2_split_tile(max_kv_splits: int) -> int:
    """Stage 2's ``split_tile`` for a split extent: a power of two, at most ``DCP_GQA_SPLIT_TILE``."""
    return min(DCP_GQA_SPLIT_TILE, triton.next_power_of_2(max(1, max_kv_splits)))


def _head_tiles(num_heads: int, num_kv_heads: int) -> int:
    """Stage 1's grid extent along heads (grouped kernels take up to 16 query heads of one KV head
    per program, the MHA kernel one head)."""
    group = num_heads // num_kv_heads
    return num_heads if group == 1 else triton.cdiv(num_heads, min(16, group))


@dataclass(frozen=True)
class KVSplitPolicy:
    """``core_count == 0`` (no SM count: the CPU, static splits, tiled splits): ``min_splits``
    each, as upstream. Otherwise ``T`` tokens launch ``grid_splits(T)``: ``DCP_GQA_CTAS_PER_SM``
    programs per SM, a power of two in ``[min_splits, max_splits]``."""

    min_splits: int
    max_splits: int
    core_count: int

    def grid_splits(self, num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
        if self.core_count <= 0:
            return self.min_splits
        fill = triton.cdiv(
            DCP_GQA_CTAS_PER_SM * self.core_count,
            max(1, num_tokens) * _head_tiles(num_heads, num_kv_heads),
        )
        fill = 1 << (fill.bit_length() - 1)  # a power of two, at most the fill
        return min(self.max_splits, max(self.min_splits, fill))

    def split_rows(self, max_tokens: int, num_heads: int, num_kv_heads: int) -> int:
        """``max(T * grid_splits(T))`` over ``T <= max_tokens``: the (token, split) rows of one
        split buffer that serves every batch up to ``max_tokens``."""
        return max(
            t * self.grid_splits(t, num_heads, num_kv_heads)
            for t in range(1, max(1, max_tokens) + 1)
        )


def kv_split_policy(
    max_kv_splits: int, device_core_count: int, static_kv_splits: bool, split_tile_size
) -> KVSplitPolicy:
    """The policy of a Triton backend with these settings: per token from its local length where
    the SM count is known and no static or tiled split setting is given, else upstream's fixed
    ``max_kv_splits``. ``--triton-attention-num-kv-splits`` above 256 raises the cap."""
    if static_kv_splits or device_core_count <= 0 or split_tile_size is not None:
        return KVSplitPolicy(max_kv_splits, max_kv_splits, 0)
    return KVSplitPolicy(
        max_kv_splits, max(max_kv_splits, DCP_GQA_MAX_KV_SPLITS), device_core_count
    )


def num_kv_splits_by_local_len(
    num_kv_splits: torch.Tensor,
    local_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    max_kv_splits: int,
    device_core_count: int,
) -> None:
    """Fill ``num_kv_splits [T]`` from the local KV lengths ``[T]``: upstream's heuristic
    (``get_num_kv_splits_triton``) capped at ``max_kv_splits``, then at most one split per
    ``DCP_GQA_MIN_TOKENS_PER_SPLIT`` local tokens; no SM count: ``max_kv_splits`` each. Device ops
    whose shapes come from ``[T]`` only: capturable."""
    if device_core_count <= 0:
        num_kv_splits.fill_(max_kv_splits)
        return
    num_tokens = local_lens.shape[0]
    get_num_kv_splits_triton[(1,)](
        num_kv_splits,
        local_lens.clamp_min(1),
        num_tokens,
        1,
        num_heads,
        num_kv_heads,
        max_kv_splits,
        device_core_count,
        MAX_NUM_SEQ=256 if num_tokens < 256 else triton.next_power_of_2(num_tokens),
    )
    by_length = triton.cdiv(local_lens, DCP_GQA_MIN_TOKENS_PER_SPLIT).clamp_min(1)
    torch.minimum(num_kv_splits, by_length.to(num_kv_splits.dtype), out=num_kv_splits)
