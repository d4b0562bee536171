"""Prefill/decode disaggregation: time to first token and per-token decode time through
sglang-router, a Helix decode server against a plain-TP decode server and against colocated serving.

On the CPU harness (tiny random models written on the fly; servers and router launched for you):

    .venv/bin/python benchmark/bench_helix_pd.py --shapes q16k1d64,q16k2d128 --context 16384 \
        --json benchmark/results/cpu-pd-decode.json

Layouts (prefill ``--tp P``, decode ``--tp N``):

    colocated       one plain ``--tp N`` server, no router
    pd plain        a ``--tp N`` prefill server -> a plain ``--tp N`` decode server, behind the router
                    (the CPU engine pads K < N heads, so the plain decode takes a prefill padded alike)
    pd kvpK         a ``--tp P`` prefill (P divides K) -> ``--tp N --helix-kvp-size K``

TTFT then compares different prefill widths; the decode time per token is what the layouts differ
in.

For each prompt length S, one streamed request of 65 tokens: ``ttft_s`` (request sent -> first
token: the prefill, under PD the KV transfer, the first decode step) and ``tpot_ms`` (the mean time
between the following tokens: the decode). The KV moves over Mooncake's TCP transport between processes of
one machine: not RDMA between nodes; these numbers show what the decode layout does to decode time
and that the transfer completes, not a deployment's TTFT. Nothing here runs in CI; results go in
benchmark/README.md.
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


def _measure(url: str, input_ids: list, new_tokens: int, tries: int = 3) -> tuple:
    """``_measure_once``, again after a pause if the router answered without tokens (it can, just
    after it admits the workers)."""
    for attempt in range(tries):
        try:
            return _measure_once(url, input_ids, new_tokens)
        except RuntimeError:
            if attempt + 1 == tries:
                raise
            time.sleep(10)


def _measure_once(url: str, input_ids: list, new_tokens: int) -> tuple:
    """(ttft_s, tpot_ms) of one streamed greedy generate: request sent -> first token (the prefill,
    under PD the KV transfer, the first decode step), then the mean time between the following
    tokens (the decode)."""
    body = {"input_ids": input_ids, "stream": True, "sampling_params": {"max_new_tokens": new_tokens,
            "temperature": 0, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0, stamps, seen = time.perf_counter(), [], 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            n = json.loads(line[5:]).get("meta_info", {}).get("completion_tokens", 0)
            if n > seen:
                stamps.append((n, time.perf_counter()))
                seen = n
    if seen != new_tokens or len(stamps) < 2:
        raise RuntimeError(f"{url}: {seen} of {new_tokens} tokens streamed")
    (n0, t_first), (n1, t_last) = stamps[0], stamps[-1]
    return t_first - t0, (t_last - t_first) / (n1 - n0) * 1e3


def _shape(text: str) -> dict:  # "q16k2d128" -> heads
    q, rest = text[1:].split("k")
    k, d = rest.split("d")
    return {"num_heads": int(q), "num_kv_heads": int(k), "head_dim": int(d)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="q16k1d64,q16k2d128", help="model shapes qQkKdD")
    p.add_argument("--prefill-tp", type=int, default=1, help="a divisor of K (the CPU engine pads K otherwise)")
    p.add_argument("--tp", type=int, default=4, help="decode --tp N")
    p.add_argument("--kvp", default="2,4", help="Helix decode --helix-kvp-size values")
    p.add_argument("--context", default="16384")
    p.add_argument("--new-tokens", type=int, default=65)
    p.add_argument("--chunk", type=int, default=64, help="--helix-kvp-chunk-size (and both servers' --page-size)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--layouts", default="colocated,pd plain,helix", help="which of: colocated, pd plain, helix")
    p.add_argument("--work-dir", default=os.path.join(ROOT, ".cache", "bench-pd"))
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()

    from sglang_helix.testing.pd import PDCluster
    from sglang_helix.testing.server import CpuServer
    from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model

    contexts = [int(x) for x in args.context.split(",")]
    common = ["--context-length", str(max(contexts) + args.new_tokens + 64), "--max-total-tokens",
              str(2 * (max(contexts) + 256)), "--chunked-prefill-size", "4096"]  # fmt: skip
    rows, rng = [], random.Random(0)
    os.makedirs(args.work_dir, exist_ok=True)
    print(f"{'shape':>10} {'layout':>12} {'S':>6} {'ttft_s':>8} {'tpot_ms':>8}", flush=True)
    for shape in args.shapes.split(","):
        spec = TinyModelSpec(**_shape(shape), num_layers=args.layers, max_position_embeddings=max(contexts) + 256)
        model = write_tiny_model(os.path.join(args.work_dir, shape), spec)
        prompts = {s: [rng.randrange(10, 400) for _ in range(s)] for s in contexts}
        kvps = [int(k) for k in args.kvp.split(",") if args.tp // int(k) <= spec.num_kv_heads]  # TPA <= K
        layouts = [("colocated", None), ("pd plain", 1)] + [(f"pd kvp{k}", k) for k in kvps]
        layouts = [(n, k) for n, k in layouts if n in args.layouts.split(",") or (k and k > 1 and "helix" in args.layouts)]
        for name, kvp in layouts:
            decode = ["--tp", str(args.tp), *common]
            if kvp is not None and kvp > 1:
                decode += ["--helix-kvp-size", str(kvp), "--helix-kvp-chunk-size", str(args.chunk)]
            # The plain decode's prefill has its --tp: the CPU engine pads K heads to a multiple of
            # the TP width, so a plain --tp N decode (K < N) reads only a prefill padded alike.
            prefill_tp = args.tp if kvp == 1 else args.prefill_tp
            if kvp is None:
                ctx = CpuServer(model, decode, log_dir=args.work_dir)
            else:
                ctx = PDCluster(model, ["--tp", str(prefill_tp), *common], decode, args.work_dir, page_size=args.chunk)
            with ctx as srv:
                url = srv.base_url if kvp is None else srv.url
                for s in contexts:
                    ttft, tpot = _measure(url, prompts[s], args.new_tokens)
                    row = {"shape": shape, "layout": name, "context": s, "ttft_s": ttft, "tpot_ms": tpot}
                    rows.append(row)
                    print(f"{shape:>10} {name:>12} {s:>6} {ttft:>8.2f} {tpot:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
