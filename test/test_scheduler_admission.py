"""A prompt the KV pool can never hold is refused at once (the "[Scheduler]" patch), not queued.

``BaseTokenToKVPoolAllocator.max_new_tokens_for_memory`` clips a request's generation to what an
empty pool leaves after its prompt's pages and one reserved page; ``None`` means the prompt's pages
and the reserved page exceed the pool (PrefillAdder never admits it), and ``Scheduler.init_req_max_new_tokens`` then aborts it with a message saying what it
needs. Unpatched, the budget was clamped at 0: the request waited for an admission that never
came, and every request behind it waited too (found with Helix's pages of chunk x KVP tokens in a
small pool; plain TP with ``--page-size 128`` does the same).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator  # noqa: E402

budget = BaseTokenToKVPoolAllocator.max_new_tokens_for_memory


def _budget(input_tokens, max_new, capacity, page):
    return budget(SimpleNamespace(page_size=page), input_tokens, max_new, token_capacity=capacity,
                  sliding_window_size=None, chunk_size=None)  # fmt: skip


@pytest.mark.parametrize(
    "input_tokens,capacity,page,expected",
    [
        (325, 384, 128, None),  # 3 pages + the reserved one > 384: never admissible
        (325, 512, 128, 0),  # fits with no room to generate: upstream's clip (finished by length)
        (325, 640, 128, 16),  # room: the request's own 16
        (325, 600, 128, 16),
        (255, 512, 128, 16),
        (100, 128, 64, None),
        (1, 4096, 1, 16),  # page 1 (plain TP's default)
        (4094, 4096, 1, 0),
        (4095, 4096, 1, 0),  # admitted (prompt + the reserved page fill the pool), nothing to generate
        (4096, 4096, 1, None),
    ],
)
def test_budget_is_none_exactly_when_the_prompt_cannot_fit(input_tokens, capacity, page, expected):
    assert _budget(input_tokens, 16, capacity, page) == expected


def _init(prompt_len: int):
    """``Scheduler.init_req_max_new_tokens`` for a prompt against a 384-token pool of 128-token
    pages (``max_req_input_len`` 377, as upstream derives it): ``(max_new_tokens, aborts)``."""
    from sglang.srt.managers.scheduler import Scheduler

    aborted = []
    req = SimpleNamespace(
        rid="r", origin_input_ids=list(range(prompt_len)),
        sampling_params=SimpleNamespace(max_new_tokens=16, min_new_tokens=0),
        set_finish_with_abort=aborted.append,
    )  # fmt: skip
    scheduler = SimpleNamespace(
        max_new_tokens_limit=None, max_req_len=383, max_req_input_len=378, max_total_num_tokens=384,
        kv_shard_widening=1, page_size=64, sliding_window_size=None, chunked_prefill_size=4096,
        token_to_kv_pool_allocator=SimpleNamespace(
            page_size=128, max_new_tokens_for_memory=lambda *a, **k: _budget(*a[:2], k["token_capacity"], 128)
        ),
    )  # fmt: skip
    Scheduler.init_req_max_new_tokens(scheduler, req)
    return req.sampling_params.max_new_tokens, aborted


def test_scheduler_refuses_with_what_the_prompt_needs():
    assert _init(325) == (0, [
        "Request prompt exceeds the KV memory budget: input_len=325 needs 3 pages of 128 tokens plus one "
        "reserved, the KV pool holds 384 tokens (raise --max-total-tokens or --mem-fraction-static)."
    ])  # fmt: skip


def test_a_prompt_over_the_input_limit_is_left_to_validate_input_length():
    """At or over ``max_req_input_len`` the prompt gets upstream's "Input length ... exceeds the
    maximum allowed length" (the same for every page size) or ``--allow-auto-truncate``'s
    truncation: an abort here would replace its input with one token and pre-empt both."""
    assert _init(378) == (0, [])
    assert _init(5000) == (0, [])
