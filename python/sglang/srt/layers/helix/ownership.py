"""Which KVP rank owns the KV of each token, and where it stores it (Helix).

Tokens are dealt to the ``kvp_size`` ranks of a KVP group round-robin in chunks of ``chunk``
tokens: the token at global position ``p`` belongs to rank ``(p // chunk) % kvp_size``. Every rank
stores its own tokens compactly, in position order: the owned token ``p`` sits at local position
``(p // (chunk * kvp_size)) * chunk + p % chunk``, so a rank that owns ``L`` of a request's tokens
holds them at local positions ``0 .. L-1`` with no gaps (the contiguous-range assumption of the KV
index builders holds unchanged).

All functions are elementwise integer arithmetic. Positions, lengths and (where noted) ranks may be
Python ints or integer tensors of any shape (``[*]``, typically ``[B]`` per request or ``[T]`` per
token); tensor arguments broadcast, results keep the argument's device and dtype, and nothing
reads a tensor value on the host (no device syncs, safe under CUDA-graph capture). ``kvp_size``
and ``chunk`` are Python ints (layout constants, checked). Positions and lengths must be >= 0.
"""

from __future__ import annotations

from typing import Tuple, Union

import torch

IntOrTensor = Union[int, torch.Tensor]


def _check_layout(kvp_size: int, chunk: int) -> None:
    for name, value in (("kvp_size", kvp_size), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"helix ownership: {name} must be a Python int, got {value!r}")
        if value < 1:
            raise ValueError(f"helix ownership: {name} must be >= 1, got {value}")


def _check_rank(kvp_rank: IntOrTensor, kvp_size: int) -> None:
    # Tensor ranks are not range-checked: that would read the tensor on the host.
    if not isinstance(kvp_rank, torch.Tensor) and not 0 <= kvp_rank < kvp_size:
        raise ValueError(
            f"helix ownership: kvp_rank must be in [0, kvp_size={kvp_size}), got {kvp_rank}"
        )


def _clip(x: IntOrTensor, lo: int, hi: int) -> IntOrTensor:
    if isinstance(x, torch.Tensor):
        return x.clamp(lo, hi)
    return min(max(x, lo), hi)


def owner_rank(pos: IntOrTensor, kvp_size: int, chunk: int) -> IntOrTensor:
    """KVP rank that owns global position ``pos``: ``[*] -> [*]``."""
    _check_layout(kvp_size, chunk)
    return (pos // chunk) % kvp_size


def local_position(pos: IntOrTensor, kvp_size: int, chunk: int) -> IntOrTensor:
    """Compact local position of global position ``pos`` on the rank that owns it: ``[*] -> [*]``.

    Only meaningful where ``owner_rank(pos) == kvp_rank`` for the rank asking; for a position the
    rank does not own the value is the local position that position's owner uses.
    """
    _check_layout(kvp_size, chunk)
    return (pos // (chunk * kvp_size)) * chunk + pos % chunk


def global_position(
    local_pos: IntOrTensor, kvp_rank: IntOrTensor, kvp_size: int, chunk: int
) -> IntOrTensor:
    """Inverse of ``local_position`` on rank ``kvp_rank``: local ``[*]`` -> global ``[*]``."""
    _check_layout(kvp_size, chunk)
    _check_rank(kvp_rank, kvp_size)
    return (local_pos // chunk) * (chunk * kvp_size) + kvp_rank * chunk + local_pos % chunk


def local_kv_len(
    seq_len: IntOrTensor, kvp_rank: IntOrTensor, kvp_size: int, chunk: int
) -> IntOrTensor:
    """How many of the first ``seq_len`` tokens rank ``kvp_rank`` owns: ``[B] -> [B]``.

    Equals the rank's local KV length for a request of ``seq_len`` tokens (sum over ranks is
    ``seq_len``). ``kvp_rank`` may be an int or a tensor broadcasting with ``seq_len``.
    """
    _check_layout(kvp_size, chunk)
    _check_rank(kvp_rank, kvp_size)
    cycle = chunk * kvp_size
    return (seq_len // cycle) * chunk + _clip(seq_len % cycle - kvp_rank * chunk, 0, chunk)


def local_kv_len_upper_bound(seq_len: IntOrTensor, kvp_size: int, chunk: int) -> IntOrTensor:
    """Largest local KV length over all ranks for ``seq_len`` tokens: ``[B] -> [B]``.

    Rank 0 always owns the most tokens (the round-robin starts there), so this is exact, not a
    bound: it is the worst-case per-rank KV footprint of a request, what scheduler-side accounting
    that is identical on every rank must reserve. It is at most ``ceil(seq_len / kvp_size)``
    rounded up to a multiple of ``chunk``.
    """
    return local_kv_len(seq_len, 0, kvp_size, chunk)


def owned_count(
    start: IntOrTensor, end: IntOrTensor, kvp_rank: IntOrTensor, kvp_size: int, chunk: int
) -> IntOrTensor:
    """How many positions of ``[start, end)`` rank ``kvp_rank`` owns: ``[B], [B] -> [B]``.

    For an extend segment ``[prefix_len, seq_len)`` this is the number of KV slots the rank
    allocates; the new tokens land at local positions ``local_kv_len(start) ..
    local_kv_len(end) - 1``. Requires ``start <= end``.
    """
    return local_kv_len(end, kvp_rank, kvp_size, chunk) - local_kv_len(
        start, kvp_rank, kvp_size, chunk
    )


def owned_mask(
    pos: IntOrTensor, kvp_rank: IntOrTensor, kvp_size: int, chunk: int
) -> IntOrTensor:
    """Whether rank ``kvp_rank`` owns global position ``pos``: ``[*] -> [*]`` bool."""
    _check_rank(kvp_rank, kvp_size)
    return owner_rank(pos, kvp_size, chunk) == kvp_rank


def extend_ownership(
    positions: torch.Tensor, kvp_rank: int, kvp_size: int, chunk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ownership of a flat batch of extend tokens, for the prefill KV write path.

    Args:
        positions: ``[T]`` int, the global position of each extend token (all requests
            concatenated, e.g. ``ForwardBatch.positions``).
    Returns:
        ``(mask [T] bool, local_pos [T])``: ``mask`` marks the tokens whose KV this rank stores,
        ``local_pos`` their compact local positions (entries where ``mask`` is False hold the
        owner's local position, not this rank's, and must be ignored).
    """
    return (
        owned_mask(positions, kvp_rank, kvp_size, chunk),
        local_position(positions, kvp_size, chunk),
    )
