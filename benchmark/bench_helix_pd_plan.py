"""The PD transfer plan into a Helix decode server at deployment shapes, before and after the
transfer went to pages (issue 47). No tensors of that size: the send's real code path (upstream's
``MooncakeKVManager.send_kvcache_dcp`` with ``dcp_gqa.head_slice_rows``, issue 69) over pointers,
on the CPU: an engine that counts what ``batch_transfer_sync`` gets, and upstream's DCP pack
(``try_pack_dcp_src``, which a GPU prefill runs for every DCP decode) over pointers (``dry_pack``).

    .venv/bin/python benchmark/bench_helix_pd_plan.py --json benchmark/results/pd-plan.json

For each model shape, context and layout (prefill ``--tp P`` -> decode ``--tp N --helix-kvp-size
KVP``; a layout whose TPA = N / KVP exceeds the model's KV heads is not served and skipped), for
decode rank 0 (every decode rank has the same counts, up to its last page): the blocks its prefill
ranks send, the bytes they send together against the decode rank's KV bytes, the most bytes one
send packs, and the host time of the send up to the lists ``batch_transfer_sync`` takes (per prefill
rank, the most of them: they plan in parallel; the best of ``--repeat`` runs), the prompt sent in chunks of
``--chunk`` tokens and the decode's pages taken in a random order (a pool in use: no two pages
adjacent by luck). ``before`` is the plan this replaced (a block per token and K/V entry for a
partial head slice, replicas each sending everything), kept below verbatim; at long contexts it is
timed on a few of the model's KV entries and scaled (its work is the same for each entry;
``before_entries_timed``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

sys.path.insert(0, STUB_DIR)  # before sglang: the CPU engine's sgl_kernel

MODELS = {  # layers, KV heads, head dim (bf16)
    "llama-3.1-70b": (80, 8, 128),
    "qwen3-235b-a22b": (94, 4, 128),
    "qwen2.5-72b": (80, 8, 128),
}
LAYOUTS = [(8, 8, 2), (8, 16, 4), (4, 8, 2), (16, 16, 2), (2, 8, 2)]  # (P, N, KVP); 2 -> 8x2 packs sub-slices


def _before_blocks(src_ptrs, dst_ptrs, src_token_bytes, dst_token_bytes, slices, src_tokens, dst_tokens):
    """``dcp_gqa.transfer_blocks`` before issue 47 (commit 24c4409), verbatim but for black; a slice
    has ``src_offset``, ``dst_offset``, ``copy_bytes``."""
    src_tokens, dst_tokens = np.asarray(src_tokens, np.int64), np.asarray(dst_tokens, np.int64)
    if src_tokens.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(src_tokens) != 1) | (np.diff(dst_tokens) != 1)) + 1
    run_starts = np.concatenate([[0], breaks])
    run_lens = np.diff(np.concatenate([run_starts, [src_tokens.size]]))
    blocks: List[Tuple[int, int, int]] = []
    for src_ptr, dst_ptr, src_bytes, dst_bytes, cut in zip(src_ptrs, dst_ptrs, src_token_bytes, dst_token_bytes, slices):
        if cut is None:
            continue
        if cut.copy_bytes == src_bytes == dst_bytes:
            src = src_ptr + src_tokens[run_starts] * src_bytes
            dst = dst_ptr + dst_tokens[run_starts] * dst_bytes
            blocks.extend(zip(src.tolist(), dst.tolist(), (run_lens * src_bytes).tolist()))
        else:
            src = src_ptr + src_tokens * src_bytes + cut.src_offset
            dst = dst_ptr + dst_tokens * dst_bytes + cut.dst_offset
            blocks.extend((s, d, cut.copy_bytes) for s, d in zip(src.tolist(), dst.tolist()))
    return blocks


def _before_lists(blocks):
    """What ``_transfer_data`` made of a batch for ``batch_transfer_sync`` (upstream, unchanged)."""
    src, dst, lengths = zip(*blocks)
    return list(src), list(dst), list(lengths)


def _prefill_token_bytes(P: int, K: int, head_bytes: int) -> int:
    return (K // P if P <= K else 1) * head_bytes  # one replicated head where P > K


def _cut(P: int, r: int, tpa: int, head_rank: int, K: int, head_bytes: int):
    """What prefill rank ``r`` gives of a decode token (the byte ranges ``compute_head_slice_params`` names)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params

    src_start, heads, dst_start, _ = compute_head_slice_params(P, tpa, r, head_rank, K)
    return SimpleNamespace(src_offset=src_start * head_bytes, dst_offset=dst_start * head_bytes,
                           copy_bytes=heads * head_bytes)  # fmt: skip


def _counting_rank(rank: int, P: int, K: int, ptrs, item_lens, page: int):
    """A ``PrefillRank`` whose engine only counts blocks and bytes (a real one takes the lists)."""
    from sglang_helix.testing.pd_send import PrefillRank

    class Counting(PrefillRank):
        blocks = sent = 0

        def batch_transfer_sync(self, session, src, dst, lengths) -> int:
            self.blocks += len(lengths)
            self.sent += sum(lengths)
            return 0

    return Counting(rank, P, K, ptrs, item_lens, page)


def measure(model: str, context: int, P: int, N: int, KVP: int, *, page: int, chunk: int, d: int = 0,
            before_budget: int = 4_000_000, repeat: int = 1) -> Optional[dict]:  # fmt: skip
    from sglang.srt.disaggregation.common.utils import build_dcp_token_transfer_plan
    from sglang_helix.testing.pd_send import decode_reads, dry_pack

    layers, K, head_dim = MODELS[model]
    tpa = N // KVP
    if tpa > K:
        return None
    entries, head_bytes = 2 * layers, head_dim * 2
    src_tb, dst_tb = _prefill_token_bytes(P, K, head_bytes), K // tpa * head_bytes
    src_item, dst_item = [src_tb * page] * entries, [dst_tb * page] * entries
    rng = np.random.default_rng(0)
    src_pages = rng.permutation(-(-context // page)).astype(np.int64)
    dst_pages = rng.permutation(-(-context // (page * KVP))).astype(np.int64)
    src_ptrs = [(1 << 44) + e * (1 << 36) for e in range(entries)]
    dst_ptrs = [(2 << 44) + e * (1 << 36) for e in range(entries)]
    ranks = decode_reads(d, N, KVP, P)[0]
    owned = sum(min(page, max(0, context - q)) for q in range((d % KVP) * page, context, page * KVP))
    before_entries = max(1, min(entries, before_budget // max(1, owned)))
    row = {"model": model, "context": context, "P": P, "N": N, "KVP": KVP, "decode_rank": d,
           "prefill_ranks": ranks, "decode_kv_bytes": owned * dst_tb * entries,
           "before_entries_timed": before_entries}  # fmt: skip
    for name in ("before", "after") * repeat:
        blocks = sent = 0
        host = []
        packed = []
        for r in ranks:
            t = 0.0
            rank = _counting_rank(r, P, K, src_ptrs, src_item, page)
            for start in range(0, context, chunk):
                n = min(chunk, context - start)
                src = src_pages[start // page : -(-(start + n) // page)]
                t0 = time.perf_counter()
                if name == "after":
                    with dry_pack() as sizes:
                        rank.send(src, dst_ptrs, dst_pages, dst_item, dcp_size=KVP, dst_rank=d, dst_tp_size=N,
                                  src_page_offset=start // page, num_tokens=n, pack=object())  # fmt: skip
                    t += time.perf_counter() - t0
                    packed += sizes
                    continue
                plan = build_dcp_token_transfer_plan(
                    src, dst_pages, physical_page_size=page, dcp_size=KVP, dcp_rank=d % KVP,
                    src_page_offset=start // page, num_kv_tokens=n, interleave_size=page,
                )  # fmt: skip
                cuts = [_cut(P, r, tpa, d // KVP, K, head_bytes)] * before_entries
                got = _before_blocks(src_ptrs, dst_ptrs, [src_tb] * entries, [dst_tb] * entries, cuts,
                                     plan.target_src_token_indices, plan.target_dst_token_indices)  # fmt: skip
                batches = [_before_lists(got[i : i + 512]) for i in range(0, len(got), 512)]
                t += (time.perf_counter() - t0) * entries / before_entries
                blocks += len(got) * entries // before_entries
                sent += sum(b[2] for b in got) * entries // before_entries
                del got, batches
            host.append(t)
            blocks, sent = blocks + rank.blocks, sent + rank.sent
        best = min(max(host), row.get(name, {}).get("plan_host_s", float("inf")))
        row[name] = {"blocks": blocks, "bytes_sent_all_prefill_ranks": sent, "plan_host_s": best}
        if name == "after":
            row[name]["packed_bytes"] = max(packed, default=0)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--contexts", default="32768,131072,1048576")
    p.add_argument("--layouts", default=",".join(f"{a}-{b}x{c}" for a, b, c in LAYOUTS), help="P-NxKVP,...")
    p.add_argument("--page", type=int, default=64, help="--helix-kvp-chunk-size = both servers' --page-size")
    p.add_argument("--chunk", type=int, default=8192, help="tokens a prefill sends at a time (chunked prefill)")
    p.add_argument("--repeat", type=int, default=3, help="host time: the best of this many runs")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    layouts = [(int(a), *map(int, b.split("x"))) for a, b in (x.split("-") for x in args.layouts.split(","))]
    rows = []
    head = (f"{'model':>16} {'ctx':>8} {'layout':>9} {'blocks before':>14} {'after':>9} {'GB sent before':>15} "
            f"{'after':>7} {'decode GB':>10} {'plan s before':>14} {'after':>7}")  # fmt: skip
    print(head, flush=True)
    for model in args.models.split(","):
        for context in map(int, args.contexts.split(",")):
            for P, N, KVP in layouts:
                row = measure(model, context, P, N, KVP, page=args.page, chunk=args.chunk, repeat=args.repeat)
                layout = f"{P}->{N}x{KVP}"
                if row is None:
                    print(f"{model:>16} {context:>8} {layout:>9}  not served (TPA {N // KVP} > K)", flush=True)
                    continue
                rows.append(row)
                b, a = row["before"], row["after"]
                print(f"{model:>16} {context:>8} {layout:>9} {b['blocks']:>14} {a['blocks']:>9} "
                      f"{b['bytes_sent_all_prefill_ranks'] / 1e9:>15.3f} {a['bytes_sent_all_prefill_ranks'] / 1e9:>7.3f} "
                      f"{row['decode_kv_bytes'] / 1e9:>10.3f} {b['plan_host_s']:>14.3f} {a['plan_host_s']:>7.3f}",
                      flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
