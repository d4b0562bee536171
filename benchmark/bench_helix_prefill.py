"""Time to first token versus prompt length, cold and with a cached prefix: plain TP against Helix.

On the CPU harness (a tiny random model written on the fly; servers launched and stopped for you):

    .venv/bin/python benchmark/bench_helix_prefill.py --tp 4 --kvp 1,2,4 --context 2048,4096,8192,16384

For every layout and prompt length S it sends, one at a time (no batching):

    cold_s   a prompt of S random tokens, never seen: the whole prefill
    warm_s   the same S tokens plus a 16-token question: the radix cache holds the first S tokens
             (rounded down to whole pages of chunk x KVP under Helix), so only the rest is prefilled
    cached   the prompt tokens the server reports as reused for the warm request

and the (query, key) pairs the busiest rank's prefill attention computes for the cold prompt, over
the mean (1.00 = perfectly balanced; counted from the metadata, as in
test/test_helix_prefill_balance.py). Before this series' balanced prefill the Triton extend
computed every chunk's attention over itself on KVP rank 0 alone.

CPU timings mix the tiny model's GEMMs, the per-request torch attention and the per-step overhead
of the CPU engine; they show the effect of prefix reuse, not a GPU's prefill speed. Nothing here
runs in CI; results go in benchmark/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


def _generate(base_url: str, input_ids: list[int]) -> tuple[float, int]:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    req = urllib.request.Request(base_url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        meta = json.loads(r.read())["meta_info"]
    return time.perf_counter() - t0, int(meta.get("cached_tokens", 0))


def _balance(context: int, chunked_prefill: int, kvp: int, chunk: int) -> float:
    """Busiest rank's prefill pairs over the mean, for one prompt prefilled in chunks."""
    if kvp == 1:
        return 1.0
    sys.path.insert(0, os.path.join(ROOT, "test"))
    import test_helix_prefill_balance as counter  # the test's counter, over the real metadata

    counter.CHUNK = chunk
    pool = counter._pool(kvp, slots=1, max_len=context + chunk * kvp)
    work = [0] * kvp
    for start in range(0, context, chunked_prefill):
        reqs = [(0, start, min(context, start + chunked_prefill))]
        for r in range(kvp):
            work[r] += counter.triton_pairs(reqs, r, kvp, pool)
    return max(work) / (sum(work) / kvp)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--kvp", default="1,2,4", help="--helix-kvp-size values (1 = plain TP)")
    p.add_argument("--context", default="2048,4096,8192,16384", help="prompt lengths")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64, help="--helix-kvp-chunk-size")
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--attention-backend", default="torch_native", choices=["torch_native", "triton"])
    p.add_argument("--work-dir", default=os.path.join(ROOT, ".cache", "bench-prefill"))
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()

    from sglang_helix.testing.server import CpuServer
    from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model

    contexts = [int(x) for x in args.context.split(",")]
    spec = TinyModelSpec(num_heads=8, num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_layers=2,
                         max_position_embeddings=max(contexts) + 64)  # fmt: skip
    os.makedirs(args.work_dir, exist_ok=True)
    model = write_tiny_model(os.path.join(args.work_dir, "model"), spec)
    rng = random.Random(0)
    rows = []
    print(f"{'layout':>18} {'S':>6} {'cold_s':>8} {'warm_s':>8} {'cached':>7} {'busiest/mean':>12}", flush=True)
    for kvp in [int(x) for x in args.kvp.split(",")]:
        flags = ["--tp", str(args.tp), "--chunked-prefill-size", str(args.chunked_prefill_size),
                 "--context-length", str(max(contexts) + 64), "--max-total-tokens", str(4 * max(contexts))]  # fmt: skip
        if kvp > 1:
            flags += ["--helix-kvp-size", str(kvp), "--helix-kvp-chunk-size", str(args.chunk)]
        layout = f"tp{args.tp}" + (f" kvp{kvp}" if kvp > 1 else " plain")
        with CpuServer(model, flags, attention_backend=args.attention_backend, log_dir=args.work_dir) as srv:
            for s in contexts:
                prompt = [rng.randrange(10, 400) for _ in range(s)]
                cold, _ = _generate(srv.base_url, prompt)
                warm, cached = _generate(srv.base_url, prompt + [rng.randrange(10, 400) for _ in range(16)])
                balance = _balance(s, args.chunked_prefill_size, kvp, args.chunk)
                row = {"layout": layout, "context": s, "cold_s": cold, "warm_s": warm, "cached": cached, "balance": balance}
                rows.append(row)
                print(f"{layout:>18} {s:>6} {cold:>8.2f} {warm:>8.2f} {cached:>7} {balance:>12.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
