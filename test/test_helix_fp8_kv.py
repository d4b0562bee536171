"""An FP8 KV cache (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``) on a CPU without AMX, plain TP and
DCP's GQA mode (Helix): the other half of what long-context deployments turn on.

Before the CPU-engine patch ``[CPU] FP8 KV cache without AMX`` every rank exited at start ("CPU FP8
KV cache requires Intel AMX support"; fp8_e5m2: "--kv-cache-dtype fp8_e5m2 is not supported on
CPU."). Now the pool stores FP8 bytes, one per element, and the torch attention path reads them
back as the format defines: ``fp8(k / k_scale)`` converted to the query's dtype times ``k_scale``
(likewise V), once per request's rows read, never the whole pool.

- **read-back, plain TP** (default tier, no server): the real ``TorchNativeAttnBackend`` of one
  rank (``sglang_helix.testing.dcp_ranks`` at KVP 1: no DCP) over an FP8 ``MHATokenToKVPool`` with
  scales != 1 (2.5 for K, 0.25 for V): a prefill in two chunks then decodes, each rank's output
  against float64 attention over ``fp8(k / s) * s`` (``test_helix_attention``'s reference and
  bound); the mode's own FP8 reads are ``test_helix_attention.py``'s e4m3/e5m2 cases, and KVP 2
  runs here too, the same numbers through the same harness.
- **end to end** (default tier: one case): ``--tp 4 --helix-kvp-size 2 --kv-cache-dtype
  fp8_e4m3`` (K = 2 < N = 4, float32, torch_native) against plain ``--tp 4 --kv-cache-dtype
  fp8_e4m3``: the standard probe's greedy tokens equal and logprobs within ``LOGPROB_ATOL``, the
  float32 bound of ``test_helix_e2e.py`` (1e-4 nats + 2^-15 |logprob|). Why the float32 bound,
  with FP8 in between: both servers store ``fp8(k)`` of the same float32 K/V up to the layouts'
  reassociation (layer 0's where the two layouts' qkv GEMMs round differently, later layers' in
  their last bits: layer 0's attention sums in another order), and
  FP8's rounding is a function of its input, so the pools hold the same bytes except where a
  value lies within that difference of an FP8 rounding midpoint (e4m3's steps are 2^-4..2^-3
  relative apart): on this 2-layer model and ~300-token prompts, rarely enough that no logprob
  moves more than in float32 (measured 2026-11-29: max |difference| 8.9e-6 over the 80 compared
  steps; the run is deterministic). Where flips do add up (a trained model, 30 layers, 4K tokens:
  ``test_smollm2_with_an_fp8_kv_cache...``) the bound is bfloat16's. Plus, per server
  (``kv_checks.DEBUG_ENV``): every rank's pool checks
  pass after every batch and at idle, and rank 0 is back to no used token; capacity, as the
  servers report it, with the same 4 MiB KV budget per rank: plain TP's FP8 pool holds the rows a
  1-byte cell gives (twice a bf16 pool's: 65,536 vs 32,768, both measured 2026-11-29; the bf16
  server is the full tier's), and the mode's max_total_num_tokens is N / K = 2x plain TP's on top.

Full tier (``HELIX_TEST_FULL=1``): fp8_e5m2 at K < N; K = N (``--tp 4 --helix-kvp-size 2`` and
``4``, fp8_e4m3 and fp8_e5m2); interpreted Triton (K < N, fp8_e4m3); the bf16 pool's capacity
measured by its own server; FP8 weights with an FP8 KV cache; SmolLM2's passkeys; a PD decode
server in the mode taking a plain prefill server's FP8 pages.

Interpreted Triton with an FP8 pool is compared otherwise. Upstream's Triton kernels cast q to the
pool's FP8 type (the decode, and the extend's pass over a cached prefix) and the softmax weights too,
relative to the running maximum of the blocks read so far (``p.to(v.dtype)`` in
``decode_attention.py`` and ``extend_attention.py``). So their answer depends on how the sequence
is split (a radix hit's prefix and extend, the KV splits, the mode's shards) on FP8's scale, and each
step's difference feeds the next. Measured 2026-12-06 on the K < N case: plain TP's own radix hit
moves its prefill step by 0.80 nats; the mode's first decode parts from plain TP's by 0.026, and
with the decode's weights kept in float32 (a local edit of the kernel, not kept) the mode's whole
first answer met the float32 bound. That case keeps the probe (every prompt split alike) and the
repeated prompt's prefill step (every token in hand, nothing cast) at the float32 bound, and the
first decode (every rank's FP8 shard read) within twice what Triton's casts move plain TP from
torch_native over the same pool at that step (0.19 measured); the radix hit's answers are the
torch_native cases' to compare, and ``test_helix_attention``'s Triton e4m3/e5m2 cases hold the
kernels to float64 within FP8's bound.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are imported

import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import test_helix_attention as ta  # noqa: E402
from conftest import FULL, GQA, KV2, start_server, stop_server  # noqa: E402
from helix_runs import PINNED_AVAILABLE_BYTES, Capacity, pinned_memory_env  # noqa: E402
from sglang_helix.testing import kv_checks  # noqa: E402
from sglang_helix.testing.dcp_ranks import Ranks, Shape  # noqa: E402
from sglang_helix.testing.openai_probe import (  # noqa: E402
    LOGPROB_ATOL, assert_same_generation, assert_same_probe, generate_ids_meta, generation_of, probe,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# -- the read-back, against float64 --------------------------------------------------------------
@pytest.mark.parametrize("kv_cache", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kvp", [1, 2], ids=["plain_tp", "helix-kvp2"])
def test_torch_native_reads_an_fp8_pool_as_the_format_defines(monkeypatch, kv_cache, kvp):
    """A prefill in two chunks, then three decodes, through the real torch_native backend over an
    FP8 pool with k_scale 2.5 and v_scale 0.25: the write stores ``fp8(k / s)``, every read gives
    ``fp8(k / s) * s`` (float64 reference: ``test_helix_attention.Record``), on plain TP (KVP 1)
    and in the mode (KVP 2)."""
    shape = Shape(**{**ta.SHAPE.__dict__, "kvp": kvp})
    monkeypatch.setattr(ta, "SHAPE", shape)  # run() builds the layer and slices heads from it
    kv_dtype, rounding, scales = ta.KV_CACHES[kv_cache]
    ranks = Ranks(Shape(**{**shape.__dict__, "kv_dtype": kv_dtype}), "torch_native")
    assert ranks.pools[0].store_dtype == torch.uint8 and ranks.pools[0].dtype == kv_dtype  # one byte per element
    record, g, scaling = ta.Record(kv_dtype, scales, rounding), torch.Generator().manual_seed(0), 0.37
    for reqs in ([(0, 0, 1), (1, 0, 6)], [(0, 1, 7), (1, 6, 9)]):
        batch = ta.extend_batch(ranks, reqs)
        writes = [(s, i) for s, p, n in reqs for i in range(p, n)]
        seen = [[ta._pool(record, s, j) for j in range(i + 1)] for s, p, n in reqs for i in range(p, n)]
        ta.run(ranks, record, batch, *ta._tensors(g, len(writes), kv_dtype), scaling, writes, seen)
    for step in range(3):
        lens = [7 + step, 9 + step]
        writes = list(zip([0, 1], lens))
        batch = ta._batch(ranks, ta.ForwardMode.DECODE, [0, 1], [n + 1 for n in lens], lens, writes)
        seen = [[ta._pool(record, s, j) for j in range(n + 1)] for s, n in writes]
        ta.run(ranks, record, batch, *ta._tensors(g, 2, kv_dtype), scaling, writes, seen)


# -- end to end: the real server, plain TP against the mode, both with an FP8 KV cache -------------
MEM_FRACTION = 1 / 512  # of the pinned 2 GiB (helix_runs): a 4 MiB KV budget per rank
BUDGET_BYTES = PINNED_AVAILABLE_BYTES * MEM_FRACTION


# ~300 tokens, sent twice: the second is served from the radix cache over the FP8 pool
RADIX_PROMPT = [(11 * i + 5) % 400 + 10 for i in range(300)]


def generate(base_url: str, input_ids: list, max_tokens: int = 8):
    """One greedy ``/generate``: ``(Generation, cached prompt tokens)``."""
    meta = generate_ids_meta(base_url, input_ids, max_tokens)
    return generation_of(meta), meta["cached_tokens"]


def fp8_kv_workload(base_url):
    """The standard probe; one ~300-token prompt twice (the second a radix-cache hit); then rank 0
    idle, every rank's checks (``kv_checks.DEBUG_ENV``) silent and every rank's counts rank 0's."""
    result = probe(base_url)
    radix = [generate(base_url, RADIX_PROMPT) for _ in range(2)]
    idle = kv_checks.wait_idle(base_url)
    time.sleep(2)  # every rank idles and checks its pool (a failed check takes the server down)
    return {"probe": result, "radix": radix, "idle": idle}


def kv_server(model_path, args, log_dir, workload=None, backend="torch_native"):
    """Start with the pinned memory and the pool checks, run ``workload`` (or nothing), stop."""
    env = {**pinned_memory_env(), **kv_checks.DEBUG_ENV}
    srv = start_server(model_path, [*args, "--mem-fraction-static", str(MEM_FRACTION)], backend, log_dir, env)
    try:
        result = workload(srv.base_url) if workload else None
        alive = srv.proc.poll() is None
    finally:
        stop_server(srv)
    log = srv.log_text()
    return SimpleNamespace(result=result, alive=alive, log=log, capacity=Capacity.parse(log), log_path=srv.log_path)


def pool_rows(run, what):
    """Every rank's pool rows (one number: all ranks equal) and the capacity TP0 reports."""
    cap = run.capacity
    assert cap.rows and len(set(cap.rows.values())) == 1, f"{what}: KV pool lines {cap.rows} ({run.log_path})"
    return cap.rows[0], cap.global_tokens


def cell_bytes(spec, tp, kvp, itemsize):
    """One pool row: this rank's KV heads (K/TPA; plain TP on the CPU engine pads K up to N, one
    head a rank) x head_dim x layers x (K, V) x the element size."""
    heads = max(1, spec.num_kv_heads * kvp // tp)
    return heads * spec.head_dim * spec.num_layers * 2 * itemsize


def assert_served_and_released(run, what, tp):
    assert run.alive, f"{what}: the server died ({run.log_path})"
    fired = kv_checks.fired_checks(run.log)
    assert not fired, f"{what}: {fired[:5]}"
    assert run.result["idle"]["num_used_tokens"] == 0, f"{what}: {run.result['idle']}"
    busy = kv_checks.busy_counts(run.log)
    assert sorted(busy) == list(range(tp)), f"{what}: pool checks from ranks {sorted(busy)}"
    # every rank's pool as rank 0's at every batch (the radix cache keeps pages, so not its start)
    assert not kv_checks.ranks_disagree(run.log), f"{what}: {kv_checks.ranks_disagree(run.log)[:5]}"


def step_distance(a, b, i) -> float:
    """|top-2 logprob difference| of two greedy answers at step ``i`` (NaN once they have parted)."""
    if a.tokens[:i] != b.tokens[:i]:
        return float("nan")
    return round(max(abs(p - q) for p, q in zip(a.top2[i], b.top2[i])), 6)


def max_logprob_diff(ref, got) -> float:
    pairs = zip([*ref.completions, ref.chat], [*got.completions, got.chat])
    return max(abs(a - b) for r, g in pairs for a, b in zip(r.logprobs, g.logprobs))


# (model, --tp, --helix-kvp-size, --kv-cache-dtype, backend); the first is the default tier's
CASES = [
    (KV2, 4, 2, "fp8_e4m3", "torch_native"),  # K < N: TPA 2
    (KV2, 4, 2, "fp8_e5m2", "torch_native"),
    (GQA, 4, 2, "fp8_e4m3", "torch_native"),  # K = N = 4: TPA 2, two KV heads a rank
    (GQA, 4, 4, "fp8_e5m2", "torch_native"),  # K = N = 4: TPA 1, every KV head on every rank
    (KV2, 4, 2, "fp8_e4m3", "triton"),  # the kernels interpreted: 5-10 min a server
]


def _id(case):
    spec, tp, kvp, dtype, backend = case
    return f"q{spec.num_heads}k{spec.num_kv_heads}-tp{tp}-kvp{kvp}-{dtype}-{backend}"


@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(c, id=_id(c), marks=() if i == 0 else FULL) for i, c in enumerate(CASES)])
def test_fp8_kv_cache_under_helix_serves_plain_tps_tokens(model_dir, server_log_dir, case):
    """``--tp N --helix-kvp-size KVP --kv-cache-dtype D`` serves plain ``--tp N --kv-cache-dtype
    D``'s greedy tokens within the float32 bound (module docstring), every rank's pool checks pass
    and rank 0 ends with no used token; the FP8 pool's rows are the budget over a 1-byte cell, and
    the mode holds max(1, N / K) x plain TP's tokens."""
    spec, tp, kvp, dtype, backend = case
    path = model_dir(spec)
    kv = ["--kv-cache-dtype", dtype]
    ref = kv_server(path, ["--tp", str(tp), *kv], server_log_dir, fp8_kv_workload, backend)
    got = kv_server(path, ["--tp", str(tp), "--helix-kvp-size", str(kvp), *kv], server_log_dir, fp8_kv_workload, backend)
    what = f"{_id(case)}: Helix vs plain TP"
    assert_served_and_released(ref, f"plain --tp {tp} {dtype}", tp)
    assert_served_and_released(got, f"--tp {tp} --helix-kvp-size {kvp} {dtype}", tp)
    torch_dtype = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[dtype]
    assert f"dtype: torch.{torch_dtype}," in ref.log and f"dtype: torch.{torch_dtype}," in got.log, "not an FP8 pool"
    print(f"{what}: max |logprob difference| {max_logprob_diff(ref.result['probe'], got.result['probe']):.2e}")
    assert_same_probe(ref.result["probe"], got.result["probe"], LOGPROB_ATOL, what)
    # the radix cache over an FP8 pool: the repeated prompt hits (the mode in whole pages of
    # --helix-kvp-chunk-size 64 x KVP) and is answered as plain TP answers it
    (ref_first, _), (ref_again, ref_cached) = ref.result["radix"]
    (first, cached_first), (again, cached) = got.result["radix"]
    page = 64 * kvp
    print(f"{what}: radix cache hit {cached} of {len(RADIX_PROMPT)} prompt tokens (plain TP {ref_cached})")
    assert cached_first == 0 and cached == len(RADIX_PROMPT) // page * page, (cached_first, cached)
    comparisons = (("first", ref_first, first), ("from the radix cache", ref_first, again), ("plain TP's hit", ref_first, ref_again))
    if backend != "triton":
        for name, r, g in comparisons:
            assert_same_generation(r, g, LOGPROB_ATOL, f"{what}: the repeated prompt, {name}")
    else:
        # Triton's kernels round q and the softmax weights to FP8 as the sequence is split (the
        # module docstring): the prefill step at the float32 bound, the first decode within twice
        # what that rounding moves plain TP from torch_native over the same FP8 pool
        exact = kv_server(path, ["--tp", str(tp), *kv], server_log_dir, fp8_kv_workload, "torch_native")
        exact_first = exact.result["radix"][0][0]
        steps = [[step_distance(r, g, i) for i in range(4)] for r, g in ((ref_first, exact_first), *((r, g) for _, r, g in comparisons))]
        print(f"{what}: |top-2 logprob difference| at steps 0-3: plain TP vs torch_native {steps[0]}; "
              + "; ".join(f"{name} {d}" for (name, _, _), d in zip(comparisons, steps[1:])))  # fmt: skip
        assert first.tokens[0] == ref_first.tokens[0] and steps[1][0] <= LOGPROB_ATOL, (first.tokens, ref_first.tokens, steps[1])
        assert steps[1][1] <= 2 * steps[0][1] + LOGPROB_ATOL, f"{what}: the first decode parts by {steps[1][1]:.4f} > 2 x {steps[0][1]:.4f}"
    # capacity, as the servers report it
    rows_tp, tokens_tp = pool_rows(ref, "plain TP")
    rows_helix, tokens_helix = pool_rows(got, "Helix")
    print(f"{what}: KV capacity at {BUDGET_BYTES / 2**20:.0f} MiB a rank: plain TP {tokens_tp}, Helix {tokens_helix} "
          f"({rows_helix} rows a rank x KVP {kvp})")  # fmt: skip
    assert rows_tp == BUDGET_BYTES // cell_bytes(spec, tp, 1, 1), (rows_tp, cell_bytes(spec, tp, 1, 1))
    assert rows_helix == BUDGET_BYTES // cell_bytes(spec, tp, kvp, 1), (rows_helix, cell_bytes(spec, tp, kvp, 1))
    assert tokens_tp == rows_tp and tokens_helix == rows_helix * kvp, (tokens_tp, tokens_helix)
    gain = max(1.0, tp / spec.num_kv_heads)
    assert 0.95 * gain * tokens_tp <= tokens_helix <= 1.001 * gain * tokens_tp, (tokens_tp, tokens_helix, gain)


@pytest.mark.e2e
@FULL
def test_an_fp8_pool_holds_twice_a_bf16_pools_tokens(model_dir, server_log_dir):
    """The same 4 MiB budget per rank, plain ``--tp 4`` on the K = 2 model: ``--kv-cache-dtype
    fp8_e4m3`` and ``fp8_e5m2`` hold exactly twice the rows of ``--kv-cache-dtype bf16``, and
    under the mode (``--helix-kvp-size 2``) twice that again, as the servers report them."""
    path = model_dir(KV2)
    runs = {
        name: kv_server(path, ["--tp", "4", *extra, "--kv-cache-dtype", dtype], server_log_dir)
        for name, extra, dtype in (
            ("bf16", [], "bf16"),
            ("fp8_e4m3", [], "fp8_e4m3"),
            ("fp8_e5m2", [], "fp8_e5m2"),
            ("helix fp8_e4m3", ["--helix-kvp-size", "2"], "fp8_e4m3"),
        )
    }
    tokens = {name: pool_rows(run, name)[1] for name, run in runs.items()}
    print(f"KV capacity at {BUDGET_BYTES / 2**20:.0f} MiB a rank, --tp 4, K = 2: {tokens}")
    assert tokens["fp8_e4m3"] == tokens["fp8_e5m2"] == 2 * tokens["bf16"], tokens
    assert tokens["helix fp8_e4m3"] == 2 * tokens["fp8_e4m3"], tokens


@pytest.mark.e2e
@FULL
def test_fp8_weights_and_fp8_kv_cache_together(fp8_root, server_log_dir):
    """FP8 weights (test_helix_fp8's default case: a tiny Qwen3, compressed-tensors per channel)
    with ``--kv-cache-dtype fp8_e4m3``: ``--tp 4 --helix-kvp-size 2`` serves plain ``--tp 4``'s
    tokens on the same checkpoint and KV dtype, within test_helix_fp8's bfloat16 bound (the
    servers run bfloat16: FP8 weights refuse float32). Compressed-tensors gives every attention
    layer its KV scales (1.0: the checkpoint has none), so the write divides and the read multiplies
    by the layer's own scale tensors here."""
    from conftest import fp8_workload, run_workload
    from test_helix_fp8 import assert_close_bf16
    from sglang_helix.testing import fp8_checkpoints

    fp8_path, _ = fp8_checkpoints.write_tiny_fp8(fp8_root, "ct-channel", arch="qwen3")
    args = ["--tp", "4", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3"]
    ref = run_workload(fp8_path, args, "torch_native", server_log_dir, fp8_workload)
    got = run_workload(fp8_path, [*args, "--helix-kvp-size", "2"], "torch_native", server_log_dir, fp8_workload)
    what = "FP8 weights + fp8_e4m3 KV, --tp 4 --helix-kvp-size 2"
    compared = [assert_close_bf16(r, g, f"{what} {i}") for i, (r, g) in enumerate(zip(ref["probe"].completions, got["probe"].completions))]
    compared.append(assert_close_bf16(ref["probe"].chat, got["probe"].chat, f"{what} chat"))
    assert sum(compared) >= 8, compared


@pytest.mark.e2e
@FULL
def test_smollm2_with_an_fp8_kv_cache_under_helix_retrieves_plain_tps_keys(server_log_dir):
    """The trained SmolLM2-135M-Instruct (float32) with ``--kv-cache-dtype fp8_e4m3``: ``--tp 3
    --helix-kvp-size 3`` retrieves every key plain ``--tp 3`` with an FP8 KV cache retrieves
    (test_helix_retrieval's default set: 10 % and 90 % of ~2K tokens, 50 % of ~4K), with its tokens
    where plain TP decides by more than test_helix_retrieval's bfloat16 margin, and its logprobs
    (chosen and runner-up) within twice what the FP8 KV cache itself moves plain TP's from float32
    on that prompt (plain ``--tp 3`` in float32: test_helix_retrieval's reference server).

    Not the float32 bound: from layer 1 on, the two layouts' K/V differ in their last float32 bits
    (layer 0's attention sums in another order), and an element that close to an FP8 rounding
    midpoint rounds to the neighbouring FP8 value in one layout only, a whole FP8 step (up to 2^-3
    relative). Over 30 layers and 4K tokens those flips move logprobs on FP8's own scale, not
    float32's: measured 2026-11-29 on the 4K prompt, the first step's logprob -0.843 (plain --tp 3,
    FP8), -0.898 (the mode, FP8), -0.799 (plain --tp 1, FP8), -0.672 (plain --tp 1, float32); a
    runner-up at step 4: -5.18, -4.78, -5.23, -4.78. Plain TP at two widths parts by as much as the
    mode does, and FP8 moves either by up to 0.45 from float32: the mode may round another set of
    elements than plain TP, so it is allowed twice FP8's own error, and a KV chunk dropped or
    misplaced by the mode loses the key (test_helix_retrieval)."""
    from test_helix_retrieval import BF16_MARGIN, DEFAULT_SET, SERVER_ARGS, assert_retrieves, retrieval_workload, summary

    from conftest import run_workload
    from sglang_helix.testing.smollm2 import smollm2_checkpoint

    path = smollm2_checkpoint()
    workload = retrieval_workload(path, DEFAULT_SET)
    f32 = run_workload(path, ["--tp", "3", *SERVER_ARGS], "torch_native", server_log_dir, workload)  # (shared)
    args = ["--tp", "3", *SERVER_ARGS, "--kv-cache-dtype", "fp8_e4m3"]
    ref = run_workload(path, args, "torch_native", server_log_dir, workload)
    got = run_workload(path, [*args, "--helix-kvp-size", "3"], "torch_native", server_log_dir, workload)
    print(f"plain --tp 3, float32 KV:\n{summary(f32)}\nplain --tp 3, fp8_e4m3 KV:\n{summary(ref)}\n"
          f"Helix, fp8_e4m3 KV:\n{summary(got)}")  # fmt: skip
    assert_retrieves(ref, "plain --tp 3, fp8_e4m3 KV")
    assert_retrieves(got, "--tp 3 --helix-kvp-size 3, fp8_e4m3 KV")
    assert sorted(got) == sorted(ref) == sorted(f32)
    for name, (_, r) in ref.items():
        g, f = got[name][1], f32[name][1]
        n = next((i for i, t in enumerate(r.top2) if len(t) > 1 and t[0] - t[1] < BF16_MARGIN), len(r.tokens))
        assert g.tokens[:n] == r.tokens[:n], f"{name}: tokens differ within the first {n} steps: {g.tokens} vs {r.tokens}"
        assert f.tokens[:n] == r.tokens[:n], f"{name}: FP8 changed plain TP's tokens: {r.tokens} vs float32 {f.tokens}"
        fp8_error = max(abs(a - b) for i in range(n) for a, b in zip([r.logprobs[i], *r.top2[i]], [f.logprobs[i], *f.top2[i]]))
        bound = 2 * fp8_error + LOGPROB_ATOL
        worst = max(abs(a - b) for i in range(n) for a, b in zip([g.logprobs[i], *g.top2[i]], [r.logprobs[i], *r.top2[i]]))
        print(f"{name}: max |logprob, mode vs plain TP, FP8| {worst:.3f}; FP8's own error on plain TP {fp8_error:.3f}")
        assert worst <= bound, f"{name}: the mode's logprobs part from plain TP's by {worst:.3f} > 2 x FP8's own {fp8_error:.3f}"


@pytest.mark.e2e
@FULL
def test_a_helix_pd_decode_server_takes_fp8_pages_from_a_plain_prefill(model_dir, server_log_dir):
    """A plain ``--tp 2`` prefill server with ``--kv-cache-dtype fp8_e4m3`` hands its FP8 pages over
    Mooncake to a ``--tp 4 --helix-kvp-size 2`` decode server with the same KV dtype: the pair
    serves the colocated plain ``--tp 4`` FP8 server's tokens (both hold the same FP8 bytes), and
    every decode rank's pool checks pass."""
    from sglang_helix.testing.pd import PDCluster

    from conftest import run_workload

    path = model_dir(GQA)
    kv = ["--kv-cache-dtype", "fp8_e4m3"]
    ref = run_workload(path, ["--tp", "4", *kv], "torch_native", server_log_dir, fp8_kv_probe)
    decode_args = ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", "4", *kv]
    with PDCluster(path, ["--tp", "2", *kv], decode_args, server_log_dir, page_size=4, decode_env=kv_checks.DEBUG_ENV) as pd:
        got = probe(pd.url)
        idle = kv_checks.wait_idle(pd.decode.base_url)
        time.sleep(2)
        alive = pd.decode.proc.poll() is None
        decode_log = pd.decode.log_text()
    assert "dtype: torch.float8_e4m3fn," in decode_log, "the decode pool is not FP8"
    assert_same_probe(ref, got, LOGPROB_ATOL, "PD --tp 2 -> --tp 4 --helix-kvp-size 2, fp8_e4m3 KV")
    assert not kv_checks.fired_checks(decode_log), kv_checks.fired_checks(decode_log)[:5]
    assert alive and idle["num_used_tokens"] == 0


def fp8_kv_probe(base_url):
    return probe(base_url)
