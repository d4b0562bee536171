"""Qwen3.5 in DCP's GQA mode with the radix cache on: a shared-prefix hit reuses the linear layers'
cached states and the mode's sharded KV together.

The mode keeps KV in pages of chunk x KVP tokens, so a hybrid model's radix cache needs upstream's
mamba extra buffer (``--mamba-radix-cache-strategy extra_buffer``: the linear-attention states are
snapshotted at track boundaries on DCP's widened page grid, ``runtime_context.mamba_track_grid``);
``no_buffer`` takes one-token pages only. SGLang offers the extra buffer on GPUs, not on the CPU:
its extend snapshot reads the chunk kernel's per-chunk states ``h``
(``gdn_backend.forward_extend`` -> ``_track_mamba_state_extend``), which the sgl-kernel CPU chunk
kernel does not return, and the mode refuses the radix cache there
(``helix_hook._check_linear_attention_cache``). So this test runs the GPU's cache path on the CPU
harness by a test-only arrangement, no part of the series:

- the stub's ``chunk_gated_delta_rule_cpu`` returns ``h`` as the Triton/FLA kernel lays it out
  (``[1, NT, Hv, V, K]``, the state each 64-token chunk starts from) when
  ``HELIX_TEST_MAMBA_CHUNK_STATES=1`` (``sgl_kernel/mamba.py``; checked against prefix runs in
  ``test_sgl_kernel_stub_gdn.py``);
- ``helix_mamba_extra_buffer/sitecustomize.py``, first on the servers' ``PYTHONPATH`` with
  ``HELIX_TEST_MAMBA_EXTRA_BUFFER=1``, opens ``mamba_hook._platform_supports_mamba_cache_extra_buffer``
  in the launcher and every rank;
- ``TRITON_INTERPRET=1``: the decode-time snapshot (``track_mamba_states_all_layers``) is a Triton
  kernel, run interpreted.

Workload (greedy, output logprobs, top-2), one request at a time on the dense tiny model: A = P + a
(P a 200-token prefix; a miss, its extend donates the linear states at P's last checkpoint), then
B = P + b (a hit: ``cached_tokens`` > 0, the states restored from the snapshot the extend's ``h``
gave, the KV rows of the cached pages read where they lie), then C = A + A's first output tokens +
c, past the decode track boundary (a hit deeper than A's prompt: the states the decode snapshot
took). Every answer is compared with plain ``--tp 4 --disable-radix-cache`` (nothing cached: the
same prompts computed from scratch) and the mode with plain ``--tp 4`` on the same cache flags:
greedy tokens within the reference's decisive prefix and output logprobs within
``test_qwen3_5_harness``'s float32 bound. The KV debug checks run on every rank, and after the
workload the cache is flushed and every rank's full-attention KV pool counts equal those at start
(``test_helix_qwen3_5.assert_pools_back``); the mamba pool's own idle check (nothing held but
what the cache holds) runs on every rank too.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import test_qwen3_5_harness as harness
from conftest import FULL, start_server, stop_server
from sglang_helix.testing import kv_checks
from sglang_helix.testing.cpu_env import STUB_DIR
from sglang_helix.testing.openai_probe import generate_ids_meta
from sglang_helix.testing.qwen3_5_models import DENSE
from test_helix_qwen3_5 import assert_pools_back

pytestmark = [pytest.mark.e2e, FULL]
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helix_mamba_extra_buffer")
EXTRA_BUFFER = ["--mamba-radix-cache-strategy", "extra_buffer"]
PREFIX_LEN = 200
A_TOKENS = 56  # A's decode crosses 256, the track interval: a decode snapshot
NEW_TOKENS = 8
# rank 0's linear-state pool in use when a prefill batch is scheduled (slots / pool size)
MAMBA_USAGE = re.compile(r"TP0\] Prefill batch, .*mamba usage: ([0-9.]+)")
LAYOUTS = {
    "tp4": [],
    "kvp2": ["--helix-kvp-size", "2"],
}


def extra_buffer_env() -> dict:
    path = [SITE_DIR, STUB_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        "PYTHONPATH": os.pathsep.join(path),
        "HELIX_TEST_MAMBA_EXTRA_BUFFER": "1",
        "HELIX_TEST_MAMBA_CHUNK_STATES": "1",
        "TRITON_INTERPRET": "1",
    }


def _tokens(n: int, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(7, DENSE.vocab_size, (n,), generator=g).tolist()


def _generate(base_url: str, ids: list, new_tokens: int = NEW_TOKENS) -> dict:
    meta = generate_ids_meta(base_url, ids, new_tokens)
    return {
        "prompt_lp": [],  # a cache hit computes no prompt logprobs
        "ids": [t for _, t, _ in meta["output_token_logprobs"]],
        "lp": [lp for lp, _, _ in meta["output_token_logprobs"]],
        "top2": [[lp for lp, _, _ in step] for step in meta["output_top_logprobs"]],
        "cached": meta.get("cached_tokens", 0),
    }


def workload(base_url: str) -> list:
    prefix = _tokens(PREFIX_LEN, 67)
    a = prefix + _tokens(6, 68)
    out = [_generate(base_url, a, A_TOKENS)]
    out.append(_generate(base_url, prefix + _tokens(9, 69)))
    out.append(_generate(base_url, a + out[0]["ids"] + _tokens(5, 70)))
    return out


def serve(model_path: str, args: list, log_dir: str, env: dict) -> dict:
    """The workload on ``--tp 4 args`` with the KV debug checks; then the cache flushed, idle, one
    more request: the results and every rank's (total, available, uncached) at start and after."""
    env = {**harness.SERVER_ENV, **kv_checks.DEBUG_ENV, **env}
    srv = start_server(model_path, ["--tp", "4", *harness.SERVER_ARGS, *args], "torch_native", log_dir, env)
    try:
        t0 = time.monotonic()
        results = workload(srv.base_url)
        seconds = time.monotonic() - t0
        kv_checks.wait_idle(srv.base_url)
        flushed = kv_checks.post(srv.base_url, "/flush_cache", {})
        kv_checks.wait_idle(srv.base_url)
        mark = os.path.getsize(srv.log_path)
        status, _ = kv_checks.get(srv.base_url, "/health_generate")
        kv_checks.wait_idle(srv.base_url)
        time.sleep(2.0)
        with open(srv.log_path, "rb") as f:
            raw = f.read()
        log = raw.decode(errors="replace")
        out = dict(
            results=results, seconds=seconds, flushed=flushed, healthy=status == 200,
            fired=kv_checks.fired_checks(log), start=kv_checks.busy_counts(log),
            after=kv_checks.busy_counts(raw[mark:].decode(errors="replace")),
            mamba=[MAMBA_USAGE.findall(text)[:1] for text in (log, raw[mark:].decode(errors="replace"))],
        )  # fmt: skip
    finally:
        stop_server(srv)
    return out


_REFERENCE: dict = {}


def reference(model_path: str, log_dir: str) -> dict:
    if model_path not in _REFERENCE:
        _REFERENCE[model_path] = serve(model_path, ["--disable-radix-cache"], log_dir, {})
    return _REFERENCE[model_path]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shared_prefix_hit_serves_uncached_tokens(qwen3_5_dirs, server_log_dir, layout):
    path = qwen3_5_dirs["dense"]
    ref = reference(path, server_log_dir)
    got = serve(path, [*LAYOUTS[layout], *EXTRA_BUFFER], server_log_dir, extra_buffer_env())
    cached = [r["cached"] for r in got["results"]]
    print(f"{layout} extra_buffer: cached tokens {cached}, workload {got['seconds']:.1f} s")
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > PREFIX_LEN + 6, cached
    worst = harness.assert_same_results(ref["results"], got["results"], f"{layout} extra_buffer")
    print(f"{layout} extra_buffer vs plain --tp 4 without the cache: {worst}")
    assert_pools_back(got, f"{layout} extra_buffer")
    first, after = got["mamba"]
    assert first and after == first, f"{layout}: rank 0's mamba usage {after}, at start {first}"
