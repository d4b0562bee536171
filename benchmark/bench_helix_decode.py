"""Decode latency and KV footprint versus context length: plain TP against Helix.

Two ways to run it.

Against servers you started (a GPU node; one server at a time or several on different ports):

    python -m sglang.launch_server --model-path M --tp 8 --port 30000
    python -m sglang.launch_server --model-path M --tp 8 --helix-kvp-size 4 --port 30001
    python benchmark/bench_helix_decode.py --base-url http://127.0.0.1:30000 \
        --base-url http://127.0.0.1:30001 --context 16384,65536,131072 --batch 1,8

On the CPU harness (tiny random Llama written on the fly, servers launched and stopped for you):

    .venv/bin/python benchmark/bench_helix_decode.py --cpu --tp 4 --kvp 1,2,4 \
        --kv-heads 2 --context 512,2048,8192

For every (server, context S, batch B) it sends B concurrent streaming /generate requests of S
random prompt tokens (distinct per request: no prefix sharing) and T greedy new tokens (EOS
ignored), and reports per request, median over the batch:

    ttft_s    time to the first token (prefill of S tokens)
    tpot_ms   time per output token after the first (the decode step, what Helix targets)
    tok_s     B / tpot: decode throughput of the batch

next to what the layout implies per rank and decode step, from the model's config.json:

    kv_heads/rank   plain TP max(1, K/N) (KV heads replicated once N > K), Helix K/TPA
    tokens/rank     plain TP S, Helix ~S/KVP (round-robin chunks)
    kv_read_MiB     KV bytes one rank reads per decode step for one request, all layers
    capacity        the global token capacity the server reports (max_total_num_tokens)

Timings on the CPU harness are dominated by fixed per-step overhead (~0.25 s, see
docs/cpu-harness.md) and only say that Helix is not slower; the footprint columns are exact.
Nothing here runs in CI; speed and memory targets live in benchmark/README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass


# -- talking to a server -------------------------------------------------------------------------


def _get_json(url: str, timeout: float = 60) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@dataclass
class Layout:
    base_url: str
    tp: int
    kvp: int
    tpa: int
    chunk: int  # --helix-kvp-chunk-size
    capacity: int  # global tokens the scheduler admits (max_total_num_tokens)
    model_path: str
    config: dict | None  # the model's config.json when the path is local

    @property
    def name(self) -> str:
        return f"tp{self.tp}" if self.kvp == 1 else f"tp{self.tp}-kvp{self.kvp}"


def read_layout(base_url: str, default_chunk: int = 64) -> Layout:
    info = _get_json(base_url + "/server_info")
    states = info.get("internal_states") or [{}]
    capacity = info.get("max_total_num_tokens") or states[0].get("max_total_num_tokens") or 0
    tp = int(info.get("tp_size") or 1)
    kvp = int(info.get("helix_kvp_size") or 1)
    chunk = int(info.get("helix_kvp_chunk_size") or default_chunk)
    model_path = _get_json(base_url + "/model_info")["model_path"]
    config = None
    cfg_path = os.path.join(model_path, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            config = json.load(f)
    return Layout(base_url, tp, kvp, tp // kvp, chunk, int(capacity), model_path, config)


def stream_generate(base_url: str, input_ids: list[int], new_tokens: int) -> tuple[float, list[tuple[float, int]]]:
    """One streaming /generate request: (send time, [(arrival time, completion tokens so far)])."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    req = urllib.request.Request(
        base_url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    marks = []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            msg = json.loads(line[len("data:"):])
            marks.append((time.perf_counter(), int(msg["meta_info"]["completion_tokens"])))
    return t0, marks


@dataclass
class Row:
    layout: str
    context: int
    batch: int
    ttft_s: float
    tpot_ms: float
    tok_s: float
    kv_heads_per_rank: float | None
    tokens_per_rank: int | None
    kv_read_mib: float | None
    capacity: int


def kv_footprint(layout: Layout, context: int, dtype_bytes: int):
    """(KV heads per rank, tokens per rank, MiB of KV one rank reads per decode step)."""
    cfg = layout.config
    if not cfg:
        return None, None, None
    k = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if layout.kvp == 1:
        heads, tokens = max(1.0, k / layout.tp), context
    else:
        from sglang.srt.layers.helix.ownership import local_kv_len_upper_bound

        heads = k / layout.tpa
        tokens = local_kv_len_upper_bound(context, layout.kvp, layout.chunk)  # the largest shard
    mib = heads * tokens * 2 * head_dim * dtype_bytes * cfg["num_hidden_layers"] / (1 << 20)
    return heads, tokens, mib


def measure(layout: Layout, context: int, batch: int, new_tokens: int, dtype_bytes: int, seed: int) -> Row:
    rng = random.Random(seed)
    vocab = (layout.config or {}).get("vocab_size", 1000)
    prompts = [[rng.randrange(10, vocab) for _ in range(context)] for _ in range(batch)]
    with cf.ThreadPoolExecutor(batch) as pool:
        results = list(pool.map(lambda ids: stream_generate(layout.base_url, ids, new_tokens), prompts))
    ttft, tpot = [], []
    for t0, marks in results:
        (t_first, n_first), (t_last, n_last) = marks[0], marks[-1]
        ttft.append(t_first - t0)
        if n_last > n_first:
            tpot.append((t_last - t_first) / (n_last - n_first))
    tpot_s = statistics.median(tpot) if tpot else float("nan")
    heads, tokens, mib = kv_footprint(layout, context, dtype_bytes)
    return Row(
        layout.name, context, batch, round(statistics.median(ttft), 4), round(tpot_s * 1e3, 3),
        round(batch / tpot_s, 2), heads, tokens, None if mib is None else round(mib, 3), layout.capacity,
    )  # fmt: skip


def bench_server(base_url: str, args) -> list[Row]:
    layout = read_layout(base_url, args.chunk)
    print(f"# {layout.name} at {base_url}: tpa {layout.tpa}, capacity {layout.capacity} tokens", file=sys.stderr)
    stream_generate(base_url, [11, 12, 13, 14], 4)  # warm-up
    rows = []
    for context in args.context:
        for batch in args.batch:
            row = measure(layout, context, batch, args.new_tokens, args.dtype_bytes, args.seed)
            print(f"#   S={context} B={batch}: ttft {row.ttft_s}s, tpot {row.tpot_ms}ms", file=sys.stderr)
            rows.append(row)
    return rows


# -- the CPU harness -----------------------------------------------------------------------------


def bench_cpu(args) -> list[Row]:
    from sglang_helix.testing.server import CpuServer
    from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model

    max_context = max(args.context) + args.new_tokens + 16
    spec = TinyModelSpec(
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_layers=args.layers,
        max_position_embeddings=max(8192, max_context),
    )  # fmt: skip
    model = write_tiny_model(os.path.join(args.work_dir, "model"), spec)
    rows = []
    for kvp in args.kvp:
        flags = ["--tp", str(args.tp), "--helix-kvp-size", str(kvp), "--helix-kvp-chunk-size", str(args.chunk)]
        flags += ["--context-length", str(max_context), "--max-total-tokens", str(args.max_total_tokens)]
        flags += ["--disable-radix-cache"]  # decode timing: no prefix reuse in either layout
        with CpuServer(model, flags, attention_backend=args.attention_backend, log_dir=args.work_dir) as srv:
            rows += bench_server(srv.base_url, args)
    return rows


# -- main ----------------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def print_table(rows: list[Row]) -> None:
    cols = ["layout", "context", "batch", "ttft_s", "tpot_ms", "tok_s", "kv_heads_per_rank", "tokens_per_rank", "kv_read_mib", "capacity"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        d = asdict(r)
        print("| " + " | ".join("-" if d[c] is None else str(d[c]) for c in cols) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", action="append", default=[], help="a running server (repeatable)")
    p.add_argument("--context", type=_ints, default=[1024, 4096], help="prompt lengths, comma-separated")
    p.add_argument("--batch", type=_ints, default=[1], help="concurrent requests, comma-separated")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64, help="--helix-kvp-chunk-size of launched servers (read from running ones)")
    p.add_argument("--dtype-bytes", type=int, default=None, help="KV element size (default: 4 with --cpu, else 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows here")
    cpu = p.add_argument_group("--cpu: launch tiny-model servers on the CPU harness")
    cpu.add_argument("--cpu", action="store_true")
    cpu.add_argument("--tp", type=int, default=4)
    cpu.add_argument("--kvp", type=_ints, default=[1, 2, 4], help="--helix-kvp-size values (1 = plain TP)")
    cpu.add_argument("--heads", type=int, default=8)
    cpu.add_argument("--kv-heads", type=int, default=2, help="K: --kvp values must keep TPA = tp/kvp <= K")
    cpu.add_argument("--head-dim", type=int, default=64)
    cpu.add_argument("--layers", type=int, default=2)
    cpu.add_argument("--attention-backend", default="torch_native", choices=["torch_native", "triton"])
    cpu.add_argument("--max-total-tokens", type=int, default=65536)
    cpu.add_argument("--work-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "bench"))
    args = p.parse_args()
    if args.dtype_bytes is None:
        args.dtype_bytes = 4 if args.cpu else 2
    if args.cpu == bool(args.base_url):
        p.error("give either --cpu or one or more --base-url")
    for kvp in [k for k in args.kvp if k != 1] if args.cpu else []:  # 1 = plain TP; the rules: docs/helix-flags.md
        tpa = args.tp // kvp if kvp >= 1 and args.tp % kvp == 0 else 0
        if not tpa or tpa > args.kv_heads or args.kv_heads % tpa:
            p.error(f"--kvp {kvp} with --tp {args.tp} and --kv-heads {args.kv_heads}: KVP must divide --tp and "
                    f"TPA = tp/kvp must divide the KV heads (for --kv-heads {args.kv_heads}: TPA in "
                    f"{[t for t in range(1, args.kv_heads + 1) if args.kv_heads % t == 0]})")

    if args.cpu:
        os.makedirs(args.work_dir, exist_ok=True)
        rows = bench_cpu(args)
    else:
        rows = [r for url in args.base_url for r in bench_server(url.rstrip("/"), args)]
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
