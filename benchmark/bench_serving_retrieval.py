"""SGLang's own serving benchmark (``python -m sglang.bench_serving``) on the trained model, plain
``--tp 3`` against ``--tp 3 --helix-kvp-size 3``, on the CPU harness (issue 46).

For each layout one server is started the way the tests start theirs
(``sglang_helix.testing.server.CpuServer``: the CPU env, gloo, the sgl_kernel stub), and for each
input length ``bench_serving`` runs against it with integer-token prompts (``--dataset-name
random-ids``: no dataset download; the tokenizer is the local checkpoint's, ``HF_HUB_OFFLINE=1``),
fixed input and output lengths (``--random-range-ratio 1``, EOS ignored), one request at a time
(``--max-concurrency 1``: batch 1, the latency case), one warmup request per server (before its
first length) and the radix cache flushed before each length's run (``--flush-cache``), so that
every measured prompt is prefilled in full.

    .venv/bin/python benchmark/bench_serving_retrieval.py [--lengths 2048 4096] [--num-prompts 2] [--output-len 32]

Writes ``benchmark/results/serving-smollm2.json`` (bench_serving's own result rows, plus the layout
and the machine) and ``serving-smollm2.md`` (TTFT, TPOT, ITL, output tokens/s), after each layout.

Results: ``benchmark/results/serving-smollm2.{json,md}`` (2026-11-27, ``--lengths 2048 4096 7680
--num-prompts 2 --output-len 32``, ~12 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

LAYOUTS = {
    "plain --tp 3": ["--tp", "3"],
    "--tp 3 --helix-kvp-size 3": ["--tp", "3", "--helix-kvp-size", "3"],
}
SERVER_ARGS = ["--max-total-tokens", "24576"]
FIELDS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "median_itl_ms",
          "output_throughput", "mean_e2e_latency_ms", "completed", "duration")  # fmt: skip


def bench(base_url: str, model: str, length: int, num_prompts: int, output_len: int, out_file: str, warmup: int) -> dict:
    cmd = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", base_url,
        "--dataset-name", "random-ids", "--tokenizer", model, "--model", model,
        "--random-input-len", str(length), "--random-output-len", str(output_len), "--random-range-ratio", "1",
        "--num-prompts", str(num_prompts), "--max-concurrency", "1", "--request-rate", "inf",
        "--warmup-requests", str(warmup), "--flush-cache", "--disable-tqdm", "--seed", "46", "--output-file", out_file,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env)
    with open(out_file) as f:
        return json.loads(f.readlines()[-1])


def write(a, rows) -> None:
    meta = {
        "what": "python -m sglang.bench_serving (random-ids, batch 1) on SmolLM2-135M-Instruct float32, CPU harness",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs, no GPU",
        "rows": rows,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    lines = [
        f"# Serving numbers, SmolLM2-135M-Instruct on the CPU harness ({meta['date']})",
        "",
        f"`{' '.join(['benchmark/bench_serving_retrieval.py', '--lengths', *map(str, a.lengths), '--num-prompts', str(a.num_prompts), '--output-len', str(a.output_len)])}`: "
        "SGLang's `python -m sglang.bench_serving --dataset-name random-ids --max-concurrency 1` against one "
        f"server per layout (torch_native, float32), {meta['machine']}. Batch 1, {a.num_prompts} measured "
        "prompts per length (one warmup request per server, the cache flushed before each length). CPU numbers: they show the harness's "
        "relative costs (Helix's torch_native prefill and the All-to-All over gloo), not GPU serving speed.",
        "",
        "| layout | input | TTFT mean (ms) | TPOT mean (ms) | ITL mean (ms) | output tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['input_len']} | {r['mean_ttft_ms']:.0f} | {r['mean_tpot_ms']:.0f} | "
                     f"{r['mean_itl_ms']:.0f} | {r['output_throughput']:.2f} |")  # fmt: skip
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results", "serving-smollm2"))
    a = ap.parse_args()

    from sglang_helix.testing.server import CpuServer
    from sglang_helix.testing.smollm2 import smollm2_checkpoint

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the servers
    model = smollm2_checkpoint()
    log_dir = tempfile.mkdtemp(prefix="bench-serving-")
    rows = []
    for name in a.layouts:
        t0 = time.monotonic()
        with CpuServer(model, [*LAYOUTS[name], *SERVER_ARGS], attention_backend="torch_native", log_dir=log_dir,
                       startup_timeout=900) as srv:  # fmt: skip
            for i, length in enumerate(a.lengths):  # one warmup request per server, before its first length
                res = bench(srv.base_url, model, length, a.num_prompts, a.output_len,
                            os.path.join(log_dir, f"{name.replace(' ', '_')}-{length}.jsonl"), 1 if i == 0 else 0)  # fmt: skip
                row = {"layout": name, "server_args": [*LAYOUTS[name], *SERVER_ARGS], "backend": "torch_native",
                       "input_len": length, "output_len": a.output_len, "num_prompts": a.num_prompts,
                       "max_concurrency": 1, **{k: res.get(k) for k in FIELDS}}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        print(f"{name}: {time.monotonic() - t0:.0f} s with startup", flush=True)
        write(a, rows)  # after each layout: a cut-short run keeps what it measured




if __name__ == "__main__":
    main()
