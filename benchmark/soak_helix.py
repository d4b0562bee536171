"""Soak Helix against plain TP on the CPU harness: thousands of requests, a KV pool that runs out.

    .venv/bin/python benchmark/soak_helix.py --requests 1000 --clients 16 --json soak.json

Starts a plain ``--tp 4`` server (the reference) and sends it the request list of
``sglang_helix.testing.soak.make_requests`` (every kind: completions, chat, ``/generate``,
streamed or not, ``n`` > 1, stop strings, disconnects, aborts, prompts over the context and over
the pool, shared prefixes); stops it; starts ``--tp 4 --helix-kvp-size 2`` with the same logical
KV pool and upstream's KV checks on every rank, sends the same list, and judges it
(``soak.failures``): every answer the reference's, nothing unanswered, no check fired, the pool ran
low, and every rank's free count back to its startup value. Exit status 0 only if all of it holds.
The CI form is ``test/test_helix_soak.py`` (60 requests). Results: benchmark/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

from sglang_helix.testing import kv_checks, soak
from sglang_helix.testing.server import CpuServer
from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--kvp", type=int, default=2)
    ap.add_argument("--pool-tokens", type=int, default=4096, help="logical KV pool of both servers (Helix: this / KVP rows per rank)")
    ap.add_argument("--context", type=int, default=8192, help="the tiny model's context length")
    ap.add_argument("--backend", default="torch_native")
    ap.add_argument("--json", help="write the summary (and every failure) here")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="helix-soak-")
    log_dir = args.log_dir or work
    os.makedirs(log_dir, exist_ok=True)
    spec = TinyModelSpec(num_heads=8, num_kv_heads=4, head_dim=16, num_layers=2, max_position_embeddings=args.context)
    model = write_tiny_model(os.path.join(work, "model"), spec)
    requests = soak.make_requests(args.requests, args.seed, context_len=args.context, pool_tokens=args.pool_tokens)
    plain_args = ["--tp", str(args.tp), "--max-total-tokens", str(args.pool_tokens)]
    helix_args = ["--tp", str(args.tp), "--helix-kvp-size", str(args.kvp), "--max-total-tokens", str(args.pool_tokens // args.kvp)]
    started = time.monotonic()

    def progress(name):
        step = max(1, len(requests) // 20)

        def report(done, total):
            if done % step == 0 or done == total:
                el = time.monotonic() - t0
                print(f"[{name}] {done}/{total} requests, {el:.0f}s, ETA {el / done * (total - done):.0f}s", flush=True)

        return report

    print(f"{len(requests)} requests from {args.clients} clients; servers log to {log_dir}", flush=True)
    with CpuServer(model, plain_args, args.backend, startup_timeout=900, log_dir=log_dir) as plain:
        t0 = time.monotonic()
        reference = soak.run(plain.base_url, requests, args.clients, progress("plain"))
    with CpuServer(model, helix_args, args.backend, startup_timeout=900, log_dir=log_dir, extra_env=kv_checks.DEBUG_ENV) as helix:
        t0 = time.monotonic()
        report = soak.soak_server(helix, requests, reference, args.clients, progress("helix"))
    found = soak.failures(report, args.tp)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["benchmark/soak_helix.py", *(argv if argv is not None else sys.argv[1:])]),
        "plain_args": plain_args, "helix_args": helix_args, "clients": args.clients,
        "total_s": round(time.monotonic() - started, 1),
        **soak.report_summary(report),
        "failures": found,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in out.items() if k != "kinds"}, indent=1))
    for kind, k in out["kinds"].items():
        print(f"  {kind:18s} {k['count']:6d} requests, {k['ok']:6d} answered 200, errors {sum(k['errors'].values())}")
    if args.json:
        # The outcomes of every request that failed, both servers', to look at afterwards.
        bad = {i for i, _, _ in soak.compare(requests, reference, report["outcomes"])}
        out["failed_outcomes"] = {
            i: {"request": asdict(requests[i]), "reference": reference[i].to_json(), "candidate": report["outcomes"][i].to_json()}
            for i in sorted(bad)
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print("SOAK PASSED" if not found else f"SOAK FAILED: {len(found)} problems", flush=True)
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
