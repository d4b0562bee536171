"""Helix KVP exchange: one All-to-All of partial attention + LSE, then the N-way LSE merge.

Every rank of a KVP group of size ``KVP`` holds, for all ``H = Q/TPA`` query heads of its TPA slice,
partial attention over the KV tokens it owns: ``out [T, H, D]`` and ``lse [T, H]`` (fp32, natural
log of the sum of exp of the scaled scores). Heads are split into ``KVP`` contiguous slices of
``H/KVP = Q/N`` heads; slice ``k`` goes to KVP rank ``k``. After the exchange rank ``k`` holds the
``KVP`` partials (in source-rank order) of head slice ``k`` and merges them into exact attention
``[T, H/KVP, D]``: the heads its ``o_proj`` row shard expects (``tp_rank = tpa_rank * KVP + k``).

Reuses upstream's DCP A2A kernels (``sglang.kernels.ops.attention.dcp_kernels``), the same ones
``sglang.srt.layers.dcp.comm.dcp_a2a_lse_reduce`` uses for MLA decode-context-parallel:

- ``dcp_pack_a2a_send`` scatters ``out`` and ``lse`` into one send buffer laid out
  ``[KVP, T, H/KVP, D + lpd]`` in the output dtype: the fp32 LSE is bit-packed into ``lpd`` extra
  output-dtype columns (``lpd = 4 / sizeof(dtype)``), so output and LSE travel in ONE collective.
- ``dcp_lse_combine_triton`` is the N-way merge (fp32 accumulation; NaN / +inf LSE treated as an
  empty shard; a token whose shards are all empty merges to 0 with LSE -inf).

Constraints they bring (checked, fail fast): ``H % KVP == 0``; ``D % lpd == 0``; ``D`` a power of
two (the combine kernel loads a whole head row with ``tl.arange(0, D)``).

Where the Triton kernels cannot run -- a CPU tensor without ``TRITON_INTERPRET=1`` (Triton reads it
when the kernels are decorated, at import), or a device Triton does not target -- the same two steps
run as plain torch ops (``_pack_send_torch``, ``_combine_torch``): the same send buffer bytes (so a
peer's receive side never depends on which path the sender took), the same merge formula and
empty-shard / NaN rules in fp32, one collective either way. ``use_triton(device)`` picks, once per
call. Under the interpreter the kernels run on CPU tensors too (about 2 ms per (token, head)
program), which is how the CPU harness exercises the GPU code.

Not reused:
- upstream ``merge_state`` (``merge_state_triton`` / ``merge_state_v2``) is two-way: ``KVP - 1``
  launches, contiguous inputs only (not the packed receive buffer), NaN when both sides are empty.
- ``dcp_a2a_lse_reduce`` is the same pack / one All-to-All / combine, but it accepts no plain
  ``ProcessGroup`` and never exposes the received partials; the few lines of glue below are
  therefore ours, around the same two kernels.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from sglang.kernels.ops.attention import dcp_kernels
from sglang.kernels.ops.attention.dcp_kernels import (
    _lse_pack_dim,
    dcp_lse_combine_triton,
    dcp_pack_a2a_send,
)

# The KVP group: a SGLang GroupCoordinator (used through ``world_size`` and ``all_to_all_single``;
# on CPU that needs the all_to_all_single patch) or a plain torch.distributed ProcessGroup.
HelixGroup = Union["GroupCoordinator", dist.ProcessGroup]  # noqa: F821

# Triton decided when it decorated the kernels (at import) whether they run interpreted.
_KERNELS_INTERPRETED = type(dcp_kernels._dcp_lse_combine_kernel).__name__ == "InterpretedFunction"
_TRITON_DEVICES = ("cuda", "xpu")  # compiled kernels (ROCm tensors are "cuda" too)


def use_triton(device: torch.device) -> bool:
    """Whether the Triton pack / combine kernels can run on ``device``; else the torch path.

    Compiled on CUDA / ROCm / XPU; on any other device (the CPU) only under the interpreter.
    """
    return device.type in _TRITON_DEVICES or _KERNELS_INTERPRETED


def _group_size(group: HelixGroup) -> int:
    if isinstance(group, dist.ProcessGroup):
        return dist.get_world_size(group)
    return group.world_size


def _all_to_all_single(group: HelixGroup, output: torch.Tensor, input: torch.Tensor) -> None:
    """Equal-split ``all_to_all_single`` over ``group`` (same collective on every device)."""
    if isinstance(group, dist.ProcessGroup):
        dist.all_to_all_single(output, input, group=group)
    else:
        # pynccl where the group has it (CUDA-graph capturable), else torch.distributed.
        group.all_to_all_single(output, input)


def _check_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    lpd = _lse_pack_dim(dtype)
    if head_dim < 1 or head_dim & (head_dim - 1) or head_dim % lpd:
        raise ValueError(
            f"helix merge: head_dim={head_dim} must be a power of two (and a multiple of "
            f"{lpd} for {dtype}) for the upstream DCP pack/combine kernels"
        )
    return lpd


def a2a_buffer_shape(
    num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, kvp_size: int
) -> Tuple[int, int, int, int]:
    """Shape of the packed send (and receive) buffer: ``[KVP, T, H/KVP, D + lpd]`` of ``dtype``."""
    if kvp_size < 1 or num_heads % kvp_size:
        raise ValueError(
            f"helix merge: num_heads={num_heads} (Q/TPA) must be divisible by kvp_size={kvp_size}"
        )
    lpd = _check_head_dim(head_dim, dtype)
    return (kvp_size, num_tokens, num_heads // kvp_size, head_dim + lpd)


def helix_a2a_bytes(
    num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, kvp_size: int
) -> int:
    """Bytes one rank hands to the single All-to-All of ``helix_a2a_merge`` (0 when KVP == 1).

    ``T * H * (D + lpd) * sizeof(dtype)`` = ``T * (Q/TPA) * (D * sizeof(dtype) + 4)``: output plus
    fp32 LSE of every local head. It depends on the number of tokens in the batch, never on the
    sequence (KV) length. ``(KVP - 1) / KVP`` of it leaves the rank; the rest is its own slice.
    """
    if kvp_size == 1:
        return 0
    shape = a2a_buffer_shape(num_tokens, num_heads, head_dim, dtype, kvp_size)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    return numel * torch.empty((), dtype=dtype).element_size()


def _pack_send_torch(partial_out: torch.Tensor, lse: torch.Tensor, send: torch.Tensor) -> None:
    """``dcp_pack_a2a_send`` as two copies: ``send [KVP, T, H/KVP, D + lpd]``, same bytes."""
    kvp_size, _, h, _ = send.shape  # h = H/KVP
    D = partial_out.shape[2]
    lpd = _lse_pack_dim(partial_out.dtype)
    send[..., :D].copy_(partial_out.unflatten(1, (kvp_size, h)).transpose(0, 1))
    send.view(torch.float32)[..., D // lpd].copy_(lse.unflatten(1, (kvp_size, h)).transpose(0, 1))


def _pack_send(
    partial_out: torch.Tensor, lse: torch.Tensor, send: torch.Tensor, triton: bool
) -> None:
    """Fill ``send [KVP, T, H/KVP, D + lpd]`` from ``partial_out [T, H, D]`` and ``lse [T, H]``.

    ``send[k, t, h, :D] = partial_out[t, k * H/KVP + h]``; the fp32 word right after it (``lpd``
    columns of the output dtype) holds ``lse[t, k * H/KVP + h]``.
    """
    if triton:
        D = partial_out.shape[2]
        lpd = _lse_pack_dim(partial_out.dtype)
        dcp_pack_a2a_send(partial_out, lse, send[..., :D], send.view(torch.float32)[..., D // lpd])
    else:
        _pack_send_torch(partial_out, lse, send)


def _combine_torch(
    outs: torch.Tensor, lses: torch.Tensor, return_lse: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``dcp_lse_combine_triton`` (base e) in torch ops, the kernel's rules and fp32 math."""
    neg_inf = float("-inf")
    lses = lses.float().masked_fill(torch.isnan(lses) | torch.isposinf(lses), neg_inf)  # [N, T, H]
    m = lses.amax(0)  # [T, H]
    m = m.masked_fill(torch.isneginf(m), 0.0)  # every shard empty: all weights 0 below, not NaN
    w = torch.exp(lses - m)  # [N, T, H]
    total = w.sum(0)  # [T, H]: >= 1 (the max shard weighs 1) unless every shard is empty
    out = (w[..., None] * outs.float()).sum(0) / total.clamp_min(1.0)[..., None]  # [T, H, D]
    lse = torch.log(total) + m if return_lse else None  # -inf when every shard is empty
    return out.to(outs.dtype), lse


def _combine(
    outs: torch.Tensor, lses: torch.Tensor, return_lse: bool, triton: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if not triton:
        return _combine_torch(outs, lses, return_lse)
    if return_lse:
        # The upstream kernel stores the merged LSE with the *input* LSE's (T, H) strides into a
        # contiguous [T, H] tensor, so the input must be contiguous for that store to be right.
        lses = lses.contiguous()
    return dcp_lse_combine_triton(outs, lses, is_lse_base_on_e=True, return_lse=return_lse)


def merge_partials(
    outs: torch.Tensor, lses: torch.Tensor, return_lse: bool = True
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Exact attention from ``KVP`` partials over disjoint KV shards (LSE-weighted merge).

    Args:
        outs: ``[KVP, T, H, D]`` partial outputs (any strides; ``D`` a power of two).
        lses: ``[KVP, T, H]`` fp32 natural-log LSE; ``-inf`` (with output 0) marks an empty shard.
        return_lse: also return the merged LSE.
    Returns:
        ``(out [T, H, D] in outs.dtype, lse [T, H] fp32 or None)``. With ``m = max_k lse_k`` and
        ``w_k = exp(lse_k - m)``: ``out = sum_k w_k o_k / sum_k w_k``, ``lse = m + log sum_k w_k``;
        all shards empty gives ``out = 0``, ``lse = -inf`` (never NaN).
    """
    if outs.dim() != 4 or lses.shape != outs.shape[:3]:
        raise ValueError(
            f"helix merge: expected outs [KVP, T, H, D] and lses [KVP, T, H], got "
            f"{tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    if lses.dtype != torch.float32:
        raise ValueError(f"helix merge: lses must be float32, got {lses.dtype}")
    _check_head_dim(outs.shape[3], outs.dtype)
    return _combine(outs, lses, return_lse, use_triton(outs.device))


def _check_lse(partial_out: torch.Tensor, lse: torch.Tensor) -> None:
    if partial_out.dim() != 3 or lse.shape != partial_out.shape[:2]:
        raise ValueError(
            f"helix merge: lse {tuple(lse.shape)} does not match partial_out "
            f"{tuple(partial_out.shape)}"
        )


def _exchange(
    partial_out: torch.Tensor, lse: torch.Tensor, group: HelixGroup, kvp_size: int, triton: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_lse(partial_out, lse)
    T, H, D = partial_out.shape
    shape = a2a_buffer_shape(T, H, D, partial_out.dtype, kvp_size)
    send = torch.empty(shape, dtype=partial_out.dtype, device=partial_out.device)
    recv = torch.empty_like(send)
    _pack_send(partial_out, lse, send, triton)
    return _all_to_all_packed(send, recv, group, D)


def send_views(send: torch.Tensor, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The output and LSE parts of a packed send buffer ``[KVP, T, H/KVP, D + lpd]``:
    ``(out [KVP, T, H/KVP, D], lse [KVP, T, H/KVP] fp32)``, strided views a kernel can write
    (the decode kernel's stage 2 with a 4-D output, the head-split-output patch) instead of ``_pack_send``."""
    lpd = send.shape[3] - head_dim
    return send[..., :head_dim], send.view(torch.float32)[..., head_dim // lpd]


def _all_to_all_packed(
    send: torch.Tensor, recv: torch.Tensor, group: HelixGroup, head_dim: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    # ONE collective, as raw bytes (as upstream does: fp8 outputs have no collective dtype; equal
    # chunks stay exact). Chunk j of recv comes from rank j.
    _all_to_all_single(group, recv.view(-1).view(torch.uint8), send.view(-1).view(torch.uint8))
    return send_views(recv, head_dim)


def helix_a2a_exchange(
    partial_out: torch.Tensor, lse: torch.Tensor, group: HelixGroup
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The All-to-All alone: send head slice ``k`` of the partials to KVP rank ``k``.

    Args: as ``helix_a2a_merge``.
    Returns:
        ``(outs [KVP, T, H/KVP, D], lses [KVP, T, H/KVP] fp32)``: ``outs[j]`` / ``lses[j]`` are
        source rank ``j``'s partials of this rank's head slice (strided views into one receive
        buffer). With ``KVP == 1``: ``(partial_out[None], lse[None])``, no collective.
    """
    kvp_size = _group_size(group)
    if kvp_size == 1:
        _check_lse(partial_out, lse)
        return partial_out[None], lse[None]
    return _exchange(partial_out, lse, group, kvp_size, use_triton(partial_out.device))


def helix_a2a_merge_packed(
    send: torch.Tensor, recv: torch.Tensor, group: HelixGroup, head_dim: int
) -> torch.Tensor:
    """``helix_a2a_merge`` for partials already in the send layout (``send_views``): ONE
    All-to-All of ``send`` into ``recv`` (both ``[KVP, T, H/KVP, D + lpd]``, contiguous), then the
    merge. Returns ``[T, H/KVP, D]``."""
    kvp_size = _group_size(group)
    if kvp_size == 1:
        return send_views(send, head_dim)[0][0]
    outs, lses = _all_to_all_packed(send, recv, group, head_dim)
    out, _ = _combine(outs, lses, False, use_triton(send.device))
    return out


def helix_a2a_merge(
    partial_out: torch.Tensor, lse: torch.Tensor, group: HelixGroup
) -> torch.Tensor:
    """Exchange partial attention over the KVP group and merge it: ONE All-to-All per call.

    Args:
        partial_out: ``[T, H, D]`` (``H = Q/TPA``) attention of this rank's TPA heads over the KV
            tokens this rank owns; last dim contiguous. An empty shard is output 0, LSE -inf.
        lse: ``[T, H]`` fp32 natural-log LSE of the scaled scores.
        group: the KVP group, a ``GroupCoordinator`` or a ``torch.distributed.ProcessGroup``.
            All ranks must pass the same ``T`` (they run the same batch).
    Returns:
        ``[T, H/KVP, D]`` in ``partial_out.dtype``: exact attention for head slice
        ``[k * H/KVP, (k + 1) * H/KVP)`` of the local heads, ``k`` = this rank's index in
        ``group``. With ``KVP == 1`` this is ``partial_out`` itself (no copy, no collective).
    """
    kvp_size = _group_size(group)
    if kvp_size == 1:
        return partial_out
    triton = use_triton(partial_out.device)  # Triton kernels or the torch path, for both steps
    outs, lses = _exchange(partial_out, lse, group, kvp_size, triton)
    out, _ = _combine(outs, lses, False, triton)
    return out
