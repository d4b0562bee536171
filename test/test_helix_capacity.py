"""Issue 4 acceptance: Helix turns the KV memory plain TP wastes on replicated KV heads into tokens.

The comparison, exactly. Same memory settings for every server (helix_runs.py): each process's
free-memory reading pinned to 2 GiB and ``--mem-fraction-static 0.125``, so each of the N = 4
ranks gets exactly the same KV budget, 0.25 GiB (budget = available - available_before_load *
(1 - f)), whatever else runs on the machine. Capacity is the global token capacity the scheduler
admits against, ``max_total_num_tokens=`` logged by TP0. With P the capacity of plain
``--tp 4`` and H the capacity of ``--tp 4 --helix-kvp-size KVP`` on a model with K KV heads:

    H >= 0.95 * max(1, N / K) * P        (K=1, KVP 4 -> 4 P; K=2, KVP 2 -> 2 P; K=4, KVP 2 -> P)

and, since N / K (or 1) is the physical limit (plain TP stores max(1, K/N) KV heads per rank and
token, i.e. N heads per token in all when K < N; the K heads of a token cannot take less), also
``H <= 1.001 * max(1, N / K) * P``: more would mean the pool promises tokens its memory cannot hold.

P is measured once, on the K=4 model: plain TP's per-rank KV cell is one head of head_dim 16 x
2 layers x (K + V) x fp32 = 256 bytes for K = 1, 2 and 4 alike (the three models differ only in
K): max(1, K/N) heads on a GPU (KV heads replicated), and on the CPU engine, which pads K up to a
multiple of --tp (``adjust_config_with_unaligned_cpu_tp``), K_padded/N = 1. So with the same
budget P is the same for all three models.

Also checked, per server: the pin reached every rank (each logged 2.00 GB available at load);
every rank's pool spends its budget (K size + V size within 0.02 GiB of 0.25 GiB: no memory left
unused and none over-committed); the log line ``DCP GQA KV: R rows per rank x KVP k = G``
agrees with the pool rows R and with TP0's max_total_num_tokens = G.
"""

from __future__ import annotations

import pytest

from conftest import FULL
from helix_runs import (
    BUDGET_BYTES_PER_RANK,
    HELIX_K1,
    HELIX_K2,
    HELIX_K4,
    N,
    PINNED_AVAILABLE_BYTES,
    PLAIN_K4,
    layout_id,
    server_run,
)

GIB = 1 << 30
HELIX = [HELIX_K1, HELIX_K2, HELIX_K4]


def check_pool(run) -> None:
    cap = run.capacity
    where = f"{layout_id((run.spec, run.tp, run.kvp))} ({run.log_path})"
    assert sorted(cap.avail_gib) == list(range(run.tp)), f"{where}: load lines {cap.avail_gib}"
    assert set(cap.avail_gib.values()) == {PINNED_AVAILABLE_BYTES / GIB}, f"{where}: pin not applied: {cap.avail_gib}"
    assert sorted(cap.rows) == list(range(run.tp)), f"{where}: KV pool lines {cap.rows}"
    assert len(set(cap.rows.values())) == 1, f"{where}: ranks sized different pools: {cap.rows}"
    for r, gib in cap.kv_gib.items():
        assert abs(gib - BUDGET_BYTES_PER_RANK / GIB) <= 0.02, (
            f"{where}: rank {r} KV pool is {gib} GiB for a {BUDGET_BYTES_PER_RANK / GIB} GiB budget"
        )
    assert list(cap.max_total_num_tokens) == [0], f"{where}: {cap.max_total_num_tokens}"
    rows = cap.rows[0]
    if run.kvp > 1:
        assert sorted(cap.helix) == list(range(run.tp)), f"{where}: Helix KV lines {cap.helix}"
        assert set(cap.helix.values()) == {(rows, run.kvp, rows * run.kvp)}, f"{where}: {cap.helix} vs {rows} rows"
        assert cap.global_tokens == rows * run.kvp, f"{where}: max_total_num_tokens {cap.global_tokens}"
    else:
        assert not cap.helix, f"{where}: plain TP logged Helix lines"
        assert cap.global_tokens == rows, f"{where}: max_total_num_tokens {cap.global_tokens} vs {rows} rows"


@pytest.mark.e2e
# Full tier (two servers per layout, ~165 s for K = 1): the default run checks the same numbers
# without servers (test_helix_kv_cache.py: logical_token_capacity and the cell size; test_helix_memory.py).
@pytest.mark.parametrize("layout", [pytest.param(x, id=layout_id(x), marks=FULL) for x in HELIX])
def test_helix_global_capacity_vs_plain_tp(model_dir, server_log_dir, layout):
    plain = server_run(model_dir, server_log_dir, PLAIN_K4)
    helix = server_run(model_dir, server_log_dir, layout)
    check_pool(plain)
    check_pool(helix)
    k = helix.spec.num_kv_heads
    p, h = plain.capacity.global_tokens, helix.capacity.global_tokens
    ideal = max(1.0, N / k) * p
    spec = helix.spec
    head_bytes = spec.head_dim * 2 * spec.num_layers * 4  # K + V of one head, all layers, fp32
    heads_per_row = BUDGET_BYTES_PER_RANK / helix.capacity.rows[0] / head_bytes
    msg = (
        f"{layout_id(layout)}: Helix global capacity {h} tokens ({helix.capacity.rows[0]} rows per rank x "
        f"KVP {helix.kvp}) vs plain --tp {N} {p} tokens: ratio {h / p:.4f}, target max(1, N/K) = "
        f"{ideal / p:g}; the budget buys {heads_per_row:.2f} KV heads per row per rank where "
        f"K/TPA = {k / helix.tpa:g} (logs: {helix.log_path}, {plain.log_path})"
    )
    print(msg)
    assert h >= 0.95 * ideal, msg
    assert h <= 1.001 * ideal, "over-commit: " + msg
