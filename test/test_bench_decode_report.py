"""benchmark/bench_helix_decode.py's report logic, on synthetic rows (no server, no timing): the
KV-bytes prediction, the All-to-All bytes column, the layouts it launches, the CSV and the plot."""

import importlib.util
import os
import sys

import pytest

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:  # a2a_kib imports sglang's helix comm module, which pulls in sgl_kernel
    sys.path.insert(0, STUB_DIR)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bench_helix_decode", os.path.join(ROOT, "benchmark", "bench_helix_decode.py"))
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up there
_spec.loader.exec_module(bench)


def _row(layout, context, tpot_ms, kv_mib, batch=1, k=1):
    return bench.Row(layout, k, context, batch, 0.1, tpot_ms, batch / tpot_ms * 1e3, 1.0, context, kv_mib, 0.0, 0)


def test_kv_model_prices_the_kv_helix_does_not_read():
    # plain TP: 10 ms + 2 ms per MiB above 4K (the two largest contexts), cheaper below; Helix reads a quarter
    rows = [_row("tp4", 1024, 11, 1), _row("tp4", 4096, 18, 4), _row("tp4", 16384, 42, 16)]
    rows += [_row("tp4-kvp4", 16384, 20.0, 4.0)]
    (m,) = bench.kv_model(rows)
    assert m["ms_per_mib"] == pytest.approx(2)  # (42 - 18) / (16 - 4)
    assert m["predicted_tpot_ms"] == pytest.approx(18)  # 42 - 2 * (16 - 4)
    assert m["measured_ratio"] == pytest.approx(42 / 20, abs=0.01) and m["predicted_ratio"] == pytest.approx(42 / 18, abs=0.01)
    assert m["within_25pct"]
    rows[-1] = _row("tp4-kvp4", 16384, 40.0, 4.0)  # 1.05x measured against 2.33x predicted
    assert not bench.kv_model(rows)[0]["within_25pct"]


def test_kv_model_needs_two_plain_contexts_per_model_and_batch():
    rows = [_row("tp4", 1024, 12, 1), _row("tp4-kvp4", 1024, 11, 0.25), _row("tp4", 4096, 18, 4, k=4)]
    assert bench.kv_model(rows) == []


def test_a2a_bytes_column():
    cfg = {"num_attention_heads": 16, "num_key_value_heads": 1, "hidden_size": 2048, "head_dim": 128, "num_hidden_layers": 2}
    lay = bench.Layout("u", 4, 4, 1, 64, 0, "m", cfg)
    # fp32: B * (Q/TPA) * (D * 4 + 4) bytes; 3/4 of them leave the rank
    assert bench.a2a_kib(lay, 8, 4) == pytest.approx(8 * 16 * (128 * 4 + 4) / 1024)
    assert bench.a2a_kib(bench.Layout("u", 4, 1, 4, 64, 0, "m", cfg), 8, 4) == 0.0


def test_cpu_layouts_keep_tpa_dividing_k(capsys):
    args = type("A", (), {"kv_heads": [1, 4], "kvp": [1, 2, 4], "tp": 4, "chunk": 8, "dcp": [2], "dcp_rq": [2]})
    layouts = bench.cpu_layouts(args)
    helix = [(k, int(f[1])) for k, f in layouts if f[0] == "--helix-kvp-size"]
    assert helix == [(1, 1), (1, 4), (4, 1), (4, 2), (4, 4)]
    assert "skip K=1 --helix-kvp-size 2" in capsys.readouterr().err
    # upstream DCP beside them, per model: Q gathered, and replicated Q with the All-to-All
    assert [(k, f) for k, f in layouts if f[0] == "--dcp-size"] == [
        (k, f) for k in (1, 4)
        for f in (["--dcp-size", "2"], ["--dcp-size", "2", "--dcp-comm-backend", "a2a", "--dcp-replicate-q-proj"])
    ]  # fmt: skip


def test_dcp_layouts_name_footprint_and_exchange():
    cfg = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 1}
    dcp = bench.Layout("u", 4, 1, 4, 64, 0, "m", cfg, dcp=2)
    rq = bench.Layout("u", 4, 1, 4, 64, 0, "m", cfg, dcp=2, dcp_replicated_q=True)
    assert (dcp.name, rq.name) == ("tp4-dcp2", "tp4-dcp2-rq")
    assert bench.kv_footprint(dcp, 1001, 4)[:2] == (1.0, 501)  # K / (tp / dcp) heads, every dcp-th token
    assert bench.a2a_kib(dcp, 1, 4) is None  # all-gathers + all-reduce, no All-to-All
    assert bench.a2a_kib(rq, 1, 4) == 4 * (8 * 4 + 4) / 1024  # the group's Q/(tp/dcp) heads


def test_csv_and_png(tmp_path):
    rows = [_row("tp4", s, 10 + s / 512, s / 1024) for s in (1024, 4096)] + [_row("tp4-kvp4", 4096, 9, 1)]
    bench.write_csv([r.__dict__ for r in rows], str(tmp_path / "r.csv"))
    assert (tmp_path / "r.csv").read_text().splitlines()[0].startswith("layout,kv_heads,context,batch")
    bench.write_png(rows, str(tmp_path / "r.png"), "t")
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG")



def test_from_json_reports_saved_rows(tmp_path, monkeypatch, capsys):
    rows = [_row("tp4", 1024, 11, 1), _row("tp4", 4096, 18, 4), _row("tp4-kvp4", 4096, 12, 1)]
    saved = tmp_path / "rows.json"
    saved.write_text(__import__("json").dumps({"rows": [r.__dict__ for r in rows], "kv_model": []}))
    png, csv = tmp_path / "p.png", tmp_path / "r.csv"
    monkeypatch.setattr(sys, "argv", ["bench", "--from-json", str(saved), "--png", str(png), "--csv", str(csv)])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "| tp4-kvp4 | 1 | 4096 |" in out and "predicted" in out
    assert png.exists() and (tmp_path / "r-model.csv").exists()


def test_profile_buckets_put_waits_before_compute(tmp_path):
    loop = "proc;Scheduler.event_loop_overlap (scheduler.py:1)"
    raw = tmp_path / "rank0.txt"
    raw.write_text("\n".join([
        f"{loop};LlamaMLP.forward (llama.py:1);GroupCoordinator.all_reduce (parallel_state.py:2) 6",
        f"{loop};_forward_dcp (torch_native_backend.py:1);dcp_partial_attention (attention.py:2);einsum (functional.py:3) 2",
        f"{loop};Scheduler.recv_requests (scheduler.py:3);broadcast_pyobj (common.py:4) 2",
        "proc;Thread._bootstrap (threading.py:1);WatchdogRaw._watchdog_thread (watchdog.py:2) 90",
    ]) + "\n")  # fmt: skip
    s = bench.summarize_profile(str(raw))
    assert s["samples"] == 10  # the main thread only
    assert s["all-reduce (o_proj / MLP / embedding)"] == 0.6
    assert s["helix partial (einsum, softmax)"] == 0.2
    assert s["scheduler broadcast (waiting for rank 0 / the others)"] == 0.2


def test_spec_entries_and_row_names():
    """``--spec``: a chain, a tree and NGRAM launch with their flags, and their rows are told apart."""
    assert bench.spec_flags("none", "M") == []
    chain, tree = bench.spec_flags("chain-3", "M"), bench.spec_flags("tree-3x2", "M")
    assert chain[chain.index("--speculative-eagle-topk") + 1] == "1" and chain[-1] == "4"
    assert tree[tree.index("--speculative-eagle-topk") + 1] == "2" and tree[-1] == "6"
    assert bench.spec_flags("ngram-6", "M") == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6"]
    for bad in ("tree-3", "chain-3x2", "beam-2"):
        with pytest.raises(SystemExit):
            bench.spec_flags(bad, "M")
    info = {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3, "speculative_eagle_topk": 2}
    assert bench.spec_name(info) == "standalone-3x2"
    assert bench.spec_name({**info, "speculative_eagle_topk": 1}) == "standalone-3"
    assert bench.spec_name({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}) == "ngram-6"
    assert bench.spec_name({}) is None
