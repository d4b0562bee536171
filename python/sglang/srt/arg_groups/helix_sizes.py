# SPDX-License-Identifier: Apache-2.0
"""The KV page under Helix, and the sizes that must be counted in it.

Helix allocates KV ids in pages of ``P = --helix-kvp-chunk-size x --helix-kvp-size`` tokens
(``helix_kv_page_size``), a page the user never typed. Sizes that SGLang requires to be
multiples of the page, or that mean nothing below one page, are resolved here, each change
logged with the flag, the old and new value and why:

- ``chunked_prefill_size`` (``check_server_args`` asserts ``% page_size == 0``): rounded
  *down* to a multiple of P -- the scheduler already cuts every chunk at a page boundary
  (``PrefillAdder``: ``limit // page_size * page_size``), so nothing it does changes -- and
  *up* to one page where it is smaller, since a chunk under one page truncates to zero tokens
  and a long prompt would never be scheduled. ``-1`` (disabled) stays disabled.
- ``max_prefill_tokens`` (no assertion; the per-batch input budget, which the scheduler
  charges in whole pages and admits against while any of it is left): rounded *up* to a
  multiple of P, which admits exactly the same batches and states the real budget.
- ``max_total_tokens`` (under Helix: KV rows per rank, which the pool configurator rounds down
  to whole pages): below one page it leaves no KV at all, and no value can be chosen for the
  user, so it is refused.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.arg_groups.helix_checks import fail, raw
from sglang.srt.arg_groups.helix_defaults import declare

logger = logging.getLogger(__name__)


def helix_kv_page_size(cfg: Any) -> int:
    """The KV allocator page under Helix: one ownership chunk per KVP rank.

    The allocator hands out rank-invariant logical ids in pages of ``chunk * KVP``; a page holds
    one chunk for each KVP rank, so the owner and the physical row of a KV id are pure functions
    of the id (``sglang.srt.layers.helix.kv_layout``) and every rank's allocator, and so every
    scheduling decision, is identical.
    """
    return cfg.helix_kvp_chunk_size * cfg.helix_kvp_size


def check_page_size(server_args: Any, cfg: Any) -> None:
    """``--page-size`` must be unset, 1 or the chunk: the page is Helix's (``resolve_kv_page``)."""
    page_size, chunk = cfg.page_size, cfg.helix_kvp_chunk_size
    given = raw(server_args, "page_size", page_size)
    if given in (None, 1, chunk) and page_size in (None, 1, chunk):
        return
    value = f"--page-size is {page_size}" if given == page_size else f"--page-size resolves to {page_size}"
    fail(
        f"--helix-kvp-size {cfg.helix_kvp_size} allocates KV in pages of one --helix-kvp-chunk-size "
        f"({chunk}) per rank, but {value}. Pass --page-size 1 (or {chunk}), or use --helix-kvp-size 1."
    )


def resolve_kv_page(server_args: Any, cfg: Any) -> None:
    """Declare ``page_size = chunk``: DCP allocates in pages of ``page_size x dcp_size`` (one chunk
    per rank, ``helix_kv_page_size``), and its tree cache matches in those pages."""
    chunk = cfg.helix_kvp_chunk_size
    check_page_for_device(cfg, helix_kv_page_size(cfg))
    if cfg.page_size != chunk:
        logger.info(
            "Helix parallelism: --page-size %d; KV ids are allocated in pages of --helix-kvp-chunk-size %d x "
            "--helix-kvp-size %d = %d tokens (one ownership chunk per KVP rank).",
            chunk, chunk, cfg.helix_kvp_size, helix_kv_page_size(cfg),
        )  # fmt: skip
        declare(server_args, page_size=chunk)


def check_page_for_device(cfg: Any, page: int) -> None:
    """Off the CPU the paged allocator runs Triton kernels that lay a page out with
    ``tl.arange(0, page_size)`` (``alloc_extend_kernel``): the page must be a power of two, or the
    first prefill fails to compile. The CPU engine's allocator path is plain torch."""
    if cfg.device == "cpu" or page & (page - 1) == 0:
        return
    kvp = cfg.helix_kvp_size
    hint = (
        "a power-of-two --helix-kvp-chunk-size"
        if kvp & (kvp - 1) == 0
        else f"a power-of-two --helix-kvp-size (a divisor of --tp {cfg.tp_size})"
    )
    fail(
        f"--helix-kvp-chunk-size {cfg.helix_kvp_chunk_size} x --helix-kvp-size {kvp} = {page}: "
        f"on --device {cfg.device} the Helix KV page must be a power of two (the paged "
        f"allocator's Triton kernels lay out one page per program). Use {hint}, or use "
        "--helix-kvp-size 1."
    )


def resolve_page_multiples(server_args: Any, cfg: Any) -> None:
    """Make every page-counted size valid for the Helix page. Idempotent."""
    page = helix_kv_page_size(cfg)
    what = (
        f"Helix KV page (--helix-kvp-chunk-size {cfg.helix_kvp_chunk_size} x "
        f"--helix-kvp-size {cfg.helix_kvp_size} = {page} tokens)"
    )

    total = cfg.max_total_tokens
    if total is not None and 0 < total < page:
        fail(
            f"--max-total-tokens {total} is less than one {what}: under Helix it "
            "bounds each rank's KV rows, which are allocated in whole pages. Pass "
            f"--max-total-tokens {page} or more, or a smaller --helix-kvp-chunk-size, or use "
            "--helix-kvp-size 1."
        )

    chunk = cfg.chunked_prefill_size
    if chunk is not None and chunk > 0 and chunk % page:
        if chunk < page:
            new, why = page, "a prefill chunk must hold at least one page"
        else:
            new, why = chunk // page * page, "the scheduler cuts prefill chunks at page boundaries"
        _change(server_args, "chunked_prefill_size", chunk, new, what, why)

    budget = cfg.max_prefill_tokens
    if budget is not None and budget > 0 and budget % page:
        new = -(-budget // page) * page
        why = "the scheduler charges prefill in whole pages, so it admits the same batches"
        _change(server_args, "max_prefill_tokens", budget, new, what, why)


def _change(server_args: Any, field: str, old: int, new: int, what: str, why: str) -> None:
    flag = "--" + field.replace("_", "-")
    logger.info(
        "Helix parallelism: %s %d -> %d, a multiple of the %s: %s.", flag, old, new, what, why
    )
    declare(server_args, **{field: new})
