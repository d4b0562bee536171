"""Decode latency and KV footprint versus context length: plain TP against Helix.

Two ways to run it.

Against servers you started (a GPU node; one server at a time or several on different ports):

    python -m sglang.launch_server --model-path M --tp 8 --port 30000
    python -m sglang.launch_server --model-path M --tp 8 --helix-kvp-size 4 --port 30001
    python benchmark/bench_helix_decode.py --base-url http://127.0.0.1:30000 \
        --base-url http://127.0.0.1:30001 --context 16384,65536,131072 --batch 1,8

On the CPU harness (tiny random Llamas, or with --qwen3-5 Qwen3.5s, written on the fly, servers
launched and stopped for you):

    .venv/bin/python benchmark/bench_helix_decode.py --cpu --tp 4 --kvp 1,2,4 --kv-heads 1,4 \
        --context 1024,4096,16384,32768 --batch 1,8 --batch-max-context 4096 \
        --csv cpu.csv --png cpu.png

(one model per K, same Q = 16 and head dim 128; a --kvp runs where TPA = tp/kvp divides K).
Upstream decode context parallelism runs beside them with ``--dcp D`` (``--dcp-size D``: Q
all-gathered, LSE all-gathered, output all-reduced) and ``--dcp-rq D`` (``--dcp-size D
--dcp-comm-backend a2a --dcp-replicate-q-proj``: replicated Q, one All-to-All, i.e. Helix's layout
at interleave 1); their rows are ``tp4-dcp2`` and ``tp4-dcp2-rq``.

For every (server, context S, batch B) it sends B concurrent streaming /generate requests of S
random prompt tokens (distinct per request: no prefix sharing) and T greedy new tokens (EOS
ignored), and reports per request, median over the batch:

    ttft_s    time to the first token (prefill of S tokens)
    tpot_ms   time per output token after the first (the decode step, what Helix targets)
    tok_s     B / tpot: decode throughput of the batch

next to what the layout implies per rank and decode step, from the model's config.json:

    kv_heads/rank   plain TP max(1, K/N) (KV heads replicated once N > K), Helix K/TPA
    tokens/rank     plain TP S, Helix ~S/KVP (round-robin chunks)
    kv_read_MiB     KV bytes one rank reads per decode step, the whole batch, all layers
    a2a_KiB_layer   bytes one rank hands to the layer's All-to-All per step, B * (Q/TPA) * (D * bytes + 4)
    capacity        the global token capacity the server reports (max_total_num_tokens)

With --spec-steps 0,3 each layout also runs with speculative decoding (STANDALONE, the target as
its own draft, a chain of 3): its rows are named ``<layout>+standalone-3`` and carry the accept
length (tokens per verify, from the ``meta_info`` counters); tpot_ms is then the time per output
token, verify steps and draft steps together. --spec none,chain-3,tree-3x2,ngram-6 runs trees
(``+standalone-3x2``: top-k 2, 6 draft tokens) and NGRAM (``+ngram-6``, no draft model) beside the chain.

Then, per model and batch (rows without speculation), what the KV bytes predict: plain TP's TPOT at the same context minus
the KV bytes Helix does not read, priced at plain TP's marginal cost per MiB (between its two
largest contexts), and the plain/Helix TPOT ratio measured against the predicted one. Progress
goes to stderr; --json, --csv and --png (TPOT vs context, log axes) write the results. Nothing here runs in CI; the targets and results are in
benchmark/README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import subprocess
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
    chunked_prefill: int | None = None  # the server's --chunked-prefill-size
    spec: str | None = None  # speculative decoding: "<algorithm>-<steps>" (e.g. standalone-3)
    dcp: int = 1  # upstream --dcp-size (Helix off)
    dcp_replicated_q: bool = False  # --dcp-replicate-q-proj (the a2a exchange)

    @property
    def name(self) -> str:
        base = f"tp{self.tp}" if self.kvp == 1 else f"tp{self.tp}-kvp{self.kvp}"
        if self.dcp > 1:
            base = f"tp{self.tp}-dcp{self.dcp}" + ("-rq" if self.dcp_replicated_q else "")
        return base if self.spec is None else f"{base}+{self.spec}"


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
    chunked = info.get("chunked_prefill_size")
    spec = spec_name(info)
    dcp, rq = int(info.get("dcp_size") or 1), bool(info.get("dcp_replicate_q_proj"))
    return Layout(base_url, tp, kvp, tp // kvp, chunk, int(capacity), model_path, config, chunked, spec, dcp, rq)


def spec_name(info: dict) -> str | None:
    """A server's speculation as a row name: ``standalone-3`` (a chain of 3), ``standalone-3x2`` (a
    tree: 3 steps, top-k 2), ``ngram-6`` (6 draft tokens); None without speculation."""
    algorithm = info.get("speculative_algorithm")
    if not algorithm:
        return None
    if str(algorithm).upper() == "NGRAM":
        return f"ngram-{info.get('speculative_num_draft_tokens')}"
    topk = int(info.get("speculative_eagle_topk") or 1)
    return f"{str(algorithm).lower()}-{info.get('speculative_num_steps')}" + (f"x{topk}" if topk > 1 else "")


def spec_flags(spec: str, model: str) -> list[str]:
    """The launch flags of one ``--spec`` entry: ``none``, ``chain-S`` (STANDALONE, the target as
    its own draft, S steps), ``tree-SxK`` (the same with top-k K, S * K draft tokens), ``ngram-N``."""
    kind, _, size = spec.partition("-")
    if kind == "none":
        return []
    if kind == "ngram":
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", size]
    steps, _, topk = size.partition("x")
    steps, topk = int(steps), int(topk or 1)
    if kind not in ("chain", "tree") or (kind == "tree") != (topk > 1):
        raise SystemExit(f"--spec {spec}: use none, chain-S, tree-SxK (K > 1) or ngram-N")
    return [
        "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model,
        "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
        "--speculative-num-draft-tokens", str(steps + 1 if topk == 1 else steps * topk),
    ]  # fmt: skip


def stream_generate(
    base_url: str, input_ids: list[int], new_tokens: int, on_mark=None, last_meta=None
) -> tuple[float, list[tuple[float, int]]]:
    """One streaming /generate request: (send time, [(arrival time, completion tokens so far)]).
    ``on_mark(marks)`` is called after every arrival (the profiler starts from it); the last
    chunk's ``meta_info`` is appended to ``last_meta`` when given (speculative counters)."""
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
            if "meta_info" not in msg:
                raise RuntimeError(f"{base_url}/generate: {msg}")
            marks.append((time.perf_counter(), int(msg["meta_info"]["completion_tokens"])))
            if on_mark is not None:
                on_mark(marks)
            meta = msg["meta_info"]
    if last_meta is not None:
        last_meta.append(meta)
    return t0, marks


@dataclass
class Row:
    layout: str
    kv_heads: int | None  # the model's K
    context: int
    batch: int
    ttft_s: float
    tpot_ms: float
    tok_s: float
    kv_heads_per_rank: float | None
    tokens_per_rank: int | None
    kv_read_mib: float | None  # one rank, one decode step, the whole batch, all layers
    a2a_kib_layer: float | None  # bytes one rank hands to the All-to-All per layer and step (KiB)
    capacity: int
    # the model's shape and the server's prefill chunk (None in rows saved before 2026-11-25)
    head_dim: int | None = None
    hidden: int | None = None
    ffn: int | None = None
    chunked_prefill: int | None = None
    tpot_profiled_ms: float | None = None  # the step while py-spy samples every rank (--profile)
    # speculative decoding (--spec-steps): tokens per verify, (accepted drafts + verifies) / verifies
    accept_length: float | None = None


def kv_footprint(layout: Layout, context: int, dtype_bytes: int):
    """(KV heads per rank, tokens per rank, MiB of KV one rank reads per decode step and request)."""
    cfg = layout.config
    if not cfg:
        return None, None, None
    k = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if layout.dcp > 1:  # K/V replicated in the DCP group (the series' first patch), tokens dealt one by one
        heads, tokens = max(1.0, k / (layout.tp // layout.dcp)), -(-context // layout.dcp)
    elif layout.kvp == 1:
        heads, tokens = max(1.0, k / layout.tp), context
    else:
        import torch

        from sglang.srt.layers.dcp.layout import get_dcp_lens

        heads = k / layout.tpa
        # the largest shard: rank 0's
        tokens = int(get_dcp_lens(torch.tensor(context), layout.kvp, 0, interleave_size=layout.chunk))
    kv_layers = cfg.get("layer_types", []).count("full_attention") or cfg["num_hidden_layers"]  # (hybrid: KV layers)
    mib = heads * tokens * 2 * head_dim * dtype_bytes * kv_layers / (1 << 20)
    return heads, tokens, mib


def measure(layout: Layout, context: int, batch: int, new_tokens: int, dtype_bytes: int, seed: int, profiler=None) -> Row:
    """``profiler`` (``RankProfiler``, --profile): each request decodes ``profiler.tokens`` more
    tokens after the ``new_tokens`` that are timed, and every rank is sampled over those."""
    rng = random.Random(seed)
    vocab = (layout.config or {}).get("vocab_size", 1000)
    prompts = [[rng.randrange(10, vocab) for _ in range(context)] for _ in range(batch)]
    extra = profiler.tokens if profiler else 0
    on_mark = profiler.on_mark(new_tokens, f"{layout.name}-S{context}-B{batch}") if profiler else None
    metas: list = []
    with cf.ThreadPoolExecutor(batch) as pool:
        results = list(pool.map(lambda ids: stream_generate(layout.base_url, ids, new_tokens + extra, on_mark, metas), prompts))
    if profiler:
        profiler.stop()
    ttft, tpot, tpot_prof = [], [], []
    for t0, marks in results:
        (t_first, n_first) = marks[0]
        timed = [m for m in marks if m[1] <= n_first + new_tokens]
        (t_last, n_last) = timed[-1]
        ttft.append(t_first - t0)
        if n_last > n_first:
            tpot.append((t_last - t_first) / (n_last - n_first))
        if extra and marks[-1][1] > n_last:
            tpot_prof.append((marks[-1][0] - t_last) / (marks[-1][1] - n_last))
    tpot_s = statistics.median(tpot) if tpot else float("nan")
    heads, tokens, mib = kv_footprint(layout, context, dtype_bytes)
    cfg = layout.config or {}
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // cfg["num_attention_heads"] if cfg else None)
    return Row(
        layout.name, cfg.get("num_key_value_heads"), context, batch, round(statistics.median(ttft), 4),
        round(tpot_s * 1e3, 3), round(batch / tpot_s, 2), heads, tokens,
        None if mib is None else round(batch * mib, 3), a2a_kib(layout, batch, dtype_bytes), layout.capacity,
        head_dim, cfg.get("hidden_size"), cfg.get("intermediate_size"), layout.chunked_prefill,
        round(statistics.median(tpot_prof) * 1e3, 3) if tpot_prof else None, accept_length(metas),
    )  # fmt: skip


def accept_length(metas: list) -> float | None:
    """Tokens per verify over the requests: (accepted drafts + verifies) / verifies, from the
    counters upstream's scheduler puts in ``meta_info``; None without speculation."""
    verifies = sum(m.get("spec_verify_ct") or 0 for m in metas)
    if not verifies:
        return None
    return round((sum(m.get("spec_num_correct_drafts") or 0 for m in metas) + verifies) / verifies, 3)


def a2a_kib(layout: Layout, batch: int, dtype_bytes: int) -> float | None:
    """KiB one rank hands to the layer's All-to-All in a decode step: B * (Q/TPA) * (D * bytes + 4)."""
    cfg = layout.config
    if not cfg:
        return None
    if layout.dcp > 1 and not layout.dcp_replicated_q:
        return None  # Q all-gather + LSE all-gather + output all-reduce, not one All-to-All
    if layout.kvp == 1 and layout.dcp == 1:
        return 0.0
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = cfg["num_attention_heads"] // (layout.tp // layout.dcp if layout.dcp > 1 else layout.tpa)
    return batch * heads * (head_dim * dtype_bytes + 4) / 1024  # output + the fp32 LSE packed after it


class Progress:
    """``[i/n] what  (elapsed, ETA)`` on stderr, one line per measurement."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {what}  ({elapsed:.0f}s elapsed, ~{eta:.0f}s left)", file=sys.stderr, flush=True)


def cases(args) -> list[tuple[int, int]]:
    """(context, batch) pairs: batches above 1 only up to ``--batch-max-context``."""
    return [(c, b) for c in args.context for b in args.batch if b == 1 or c <= args.batch_max_context]


def bench_server(base_url: str, args, progress: Progress, profiler=None) -> list[Row]:
    layout = read_layout(base_url, args.chunk)
    print(f"# {layout.name} at {base_url}: tpa {layout.tpa}, capacity {layout.capacity} tokens", file=sys.stderr)
    stream_generate(base_url, [11, 12, 13, 14], 4)  # warm-up
    rows = []
    for context, batch in cases(args):
        row = measure(layout, context, batch, args.new_tokens, args.dtype_bytes, args.seed, profiler)
        progress.step(f"{layout.name} K={row.kv_heads} S={context} B={batch}: ttft {row.ttft_s}s, tpot {row.tpot_ms}ms")
        rows.append(row)
    return rows


# -- the CPU harness -----------------------------------------------------------------------------


def cpu_layouts(args) -> list[tuple[int, list]]:
    """(K, flags) to launch: for each model, plain TP and every --kvp whose TPA divides K, then
    upstream DCP at each --dcp (Q gathered, all-gather + reduce) and --dcp-rq (replicated Q, one
    All-to-All: Helix's layout at interleave 1)."""
    out = []
    for k in args.kv_heads:
        for kvp in args.kvp:
            tpa = args.tp // kvp if kvp >= 1 and args.tp % kvp == 0 else 0
            if kvp == 1 or (tpa and k % tpa == 0):  # the rules: docs/helix-flags.md
                out.append((k, ["--helix-kvp-size", str(kvp), "--helix-kvp-chunk-size", str(args.chunk)]))
            else:
                print(f"# skip K={k} --helix-kvp-size {kvp}: TPA = {args.tp}/{kvp} must divide K", file=sys.stderr)
        out += [(k, ["--dcp-size", str(d)]) for d in args.dcp]
        rq = ["--dcp-comm-backend", "a2a", "--dcp-replicate-q-proj"]
        out += [(k, ["--dcp-size", str(d)] + rq) for d in args.dcp_rq]
    return out


def bench_cpu(args) -> list[Row]:
    from sglang_helix.testing.server import CpuServer
    from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model

    new_tokens = args.new_tokens + (args.profile_tokens if args.profile else 0)
    max_context = max(args.context) + new_tokens + 16
    need = max(b * (c + new_tokens + 16) for c, b in cases(args))
    specs = list(args.spec or []) + [f"chain-{s}" if s else "none" for s in args.spec_steps if args.spec is None or s]
    launches = [(k, layout, spec) for k, layout in cpu_layouts(args) for spec in dict.fromkeys(specs)]
    progress = Progress(len(launches) * len(cases(args)))
    rows = []
    for k, layout, spec_entry in launches:
        spec = TinyModelSpec(
            num_heads=args.heads, num_kv_heads=k, head_dim=args.head_dim, num_layers=args.layers,
            intermediate_size=args.intermediate_size, max_position_embeddings=max(8192, max_context),
        )  # fmt: skip
        model = write_tiny_model(os.path.join(args.work_dir, f"model-k{k}"), spec)
        flags = ["--tp", str(args.tp)] + layout
        if args.qwen3_5:  # the hybrid model: 1 full-attention layer in 4, the rest Gated DeltaNet
            from sglang_helix.testing.qwen3_5_models import Qwen35Spec, write_qwen3_5_model

            qspec = Qwen35Spec(num_heads=args.heads, num_kv_heads=k, head_dim=args.head_dim, num_layers=args.layers,
                               max_position_embeddings=max(8192, max_context), mrope=args.head_dim == 256)  # fmt: skip
            model = write_qwen3_5_model(os.path.join(args.work_dir, f"qwen3_5-k{k}-d{args.head_dim}"), qspec)
            flags += ["--max-mamba-cache-size", str(4 * max(args.batch))]  # (sized from host memory otherwise)
        if args.fp8:  # the same model's weights in FP8 (the CPU FP8 linear: W8A16, bf16 activations)
            from sglang_helix.testing.fp8_checkpoints import write_fp8_checkpoint

            model = write_fp8_checkpoint(model, os.path.join(args.work_dir, f"model-k{k}-{args.fp8}"), args.fp8)
            flags += ["--dtype", "bfloat16"]
        flags += ["--context-length", str(max_context), "--max-total-tokens", str(max(args.max_total_tokens, need))]
        if args.kv_cache_dtype:  # an FP8 KV cache: one byte an element, read back with its scales
            flags += ["--kv-cache-dtype", args.kv_cache_dtype]
        flags += ["--disable-radix-cache"]  # decode timing: no prefix reuse in either layout
        # One prefill chunk per prompt: upstream's torch_native extend re-attends the whole
        # sequence at every chunk, which makes plain TP's 32K prefill take many minutes at 2K chunks.
        chunk_tokens = args.chunked_prefill_size or max(need, 16384)
        flags += ["--chunked-prefill-size", str(chunk_tokens), "--max-prefill-tokens", str(chunk_tokens)]
        flags += ["--watchdog-timeout", "3600"]  # a 32K-token prefill forward takes minutes on 2 cores
        flags += spec_flags(spec_entry, model)
        with CpuServer(model, flags, attention_backend=args.attention_backend, log_dir=args.work_dir) as srv:
            profiler = RankProfiler(srv.proc.pid, args) if args.profile else None
            rows += bench_server(srv.base_url, args, progress, profiler)
    return rows


# -- per-rank profiles (--profile) ----------------------------------------------------------------

# Where a sampled stack of a scheduler's main thread spends its time, first match wins (a frame's
# function name, as py-spy writes it). Collectives first: a wait inside the MLP's all-reduce is a wait.
PROFILE_BUCKETS = (
    ("scheduler broadcast (waiting for rank 0 / the others)", ("broadcast_pyobj", "recv_requests")),
    ("helix All-to-All + merge", ("dcp_a2a_lse_reduce", "dcp_lse_combine", "all_to_all")),
    ("all-reduce (o_proj / MLP / embedding)", ("all_reduce", "tensor_model_parallel_all_reduce")),
    ("all-gather (logits)", ("all_gather", "tensor_model_parallel_all_gather")),
    ("helix metadata (lists, write rows)", ("_dcp_kv_indices", "dcp_torch_metadata", "create_kv_indices_for_dcp_torch", "localize_dcp_indices")),
    ("helix KV gather (_read_rows)", ("_read_rows",)),
    ("helix partial (einsum, softmax)", ("dcp_partial_attention",)),
    ("helix KV write + other", ("_forward_extend_dcp", "_forward_dcp")),
    ("plain TP attention (SDPA decode)", ("forward_decode", "_run_sdpa_forward_decode")),
    ("MLP GEMMs", ("LlamaMLP.forward", "SiluAndMul")),
    ("qkv / o projections, norms, RoPE", ("LlamaAttention.forward", "LlamaDecoderLayer.forward", "RMSNorm")),
    ("lm_head, logits, sampling", ("LogitsProcessor", "Sampler", "sample")),
    ("model forward other", ("forward_batch_generation", "ModelRunner.forward")),
    ("scheduler other (batching, output, idle loop)", ("",)),
)


def _stack_bucket(stack: str) -> str:
    frames = stack.split(";")
    for name, keys in PROFILE_BUCKETS:
        for key in keys:
            if not key:
                return name
            for f in frames:
                func = f.split(" (", 1)[0]  # py-spy: "Class.method (file.py:line)"
                if func.endswith(key) if "." in key else key in func.split("."):
                    return name
    return PROFILE_BUCKETS[-1][0]


def summarize_profile(path: str) -> dict:
    """``{bucket: fraction}`` of the main thread's samples (stacks through the scheduler's event
    loop) in one py-spy raw (folded) file, recorded with ``--idle``: wall time, waits included."""
    counts, total = {}, 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if "event_loop" not in stack or not n.isdigit():
                continue
            b = _stack_bucket(stack)
            counts[b] = counts.get(b, 0) + int(n)
            total += int(n)
    return {"samples": total, **{b: round(c / total, 4) for b, c in sorted(counts.items(), key=lambda x: -x[1])}} if total else {"samples": 0}


class RankProfiler:
    """py-spy on every scheduler rank of one CPU server over a decode window (--profile).

    ``on_mark`` starts one ``py-spy record --idle --nonblocking`` per rank once a request has
    decoded the timed tokens; ``stop`` ends them with SIGINT (py-spy writes its file then) when
    the request is done, and writes ``<name>-summary.json``: per rank, the share of wall time per
    ``PROFILE_BUCKETS`` entry. Sampling perturbs the step (the row's ``tpot_profiled_ms``).
    """

    def __init__(self, launcher_pid: int, args):
        self.launcher_pid, self.dir, self.tokens, self.rate = launcher_pid, args.profile, args.profile_tokens, args.profile_rate
        self.spy = args.py_spy
        self.procs, self.name = [], None
        os.makedirs(self.dir, exist_ok=True)

    def ranks(self) -> dict:
        import psutil

        out = {}
        for p in psutil.Process(self.launcher_pid).children(recursive=True):
            cmd = " ".join(p.cmdline())
            if "scheduler_TP" in cmd:
                out[cmd.split("scheduler_TP")[1].split()[0].split("_")[0]] = p.pid
        return out

    def on_mark(self, timed_tokens: int, name: str):
        import threading

        lock = threading.Lock()

        def hook(marks):
            with lock:
                if self.procs or marks[-1][1] < marks[0][1] + timed_tokens:
                    return
                self.name = name
                for rank, pid in sorted(self.ranks().items()):
                    out = os.path.join(self.dir, f"{name}-rank{rank}.txt")
                    cmd = [self.spy, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw",
                           "--idle", "--nonblocking", "--output", out]  # fmt: skip
                    self.procs.append((rank, out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))

        return hook

    def stop(self) -> None:
        import signal

        for _, _, p in self.procs:
            p.send_signal(signal.SIGINT)
        summary = {}
        for rank, out, p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
            if os.path.exists(out):
                summary[f"rank{rank}"] = summarize_profile(out)
        if self.procs:
            with open(os.path.join(self.dir, f"{self.name}-summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
            print(f"# profile {self.name}: " + json.dumps(summary), file=sys.stderr)
        self.procs = []


# -- what the KV bytes predict -------------------------------------------------------------------


def kv_model(rows: list[Row]) -> list[dict]:
    """What the KV bytes alone predict, per model (K) and batch: plain TP's step at the same
    context minus the KV Helix does not read, priced at plain TP's marginal cost per MiB (the
    slope between its two largest contexts, where the KV no longer fits in the CPU's caches):

        predicted_helix(S) = plain(S) - b * (kv_plain(S) - kv_helix(S)),
        b = (plain(S2) - plain(S1)) / (kv_plain(S2) - kv_plain(S1))

    It leaves out everything else Helix changes: its All-to-All and merge, the QKV weights it
    replicates over KVP, and a different attention kernel (on the CPU harness: the Helix torch
    path against upstream's SDPA) with its own cost per byte.
    """
    out = []
    rows = [r for r in rows if not r.accept_length]  # without speculation only
    for k in sorted({r.kv_heads for r in rows if r.kv_heads is not None}):
        for batch in sorted({r.batch for r in rows}):
            plain = {
                r.context: r for r in rows
                if r.kv_heads == k and r.batch == batch and "kvp" not in r.layout and "dcp" not in r.layout
            }  # fmt: skip
            if len(plain) < 2 or any(r.kv_read_mib is None for r in plain.values()):
                continue
            s1, s2 = sorted(plain)[-2:]
            b = (plain[s2].tpot_ms - plain[s1].tpot_ms) / (plain[s2].kv_read_mib - plain[s1].kv_read_mib)
            for r in rows:
                if r.kv_heads != k or r.batch != batch or "kvp" not in r.layout or r.context not in plain:
                    continue
                base = plain[r.context]
                predicted = base.tpot_ms - b * (base.kv_read_mib - r.kv_read_mib)
                measured_ratio = base.tpot_ms / r.tpot_ms
                predicted_ratio = base.tpot_ms / predicted
                out.append(dict(
                    kv_heads=k, batch=batch, layout=r.layout, context=r.context, ms_per_mib=round(b, 3),
                    plain_tpot_ms=base.tpot_ms, tpot_ms=r.tpot_ms, predicted_tpot_ms=round(predicted, 2),
                    measured_ratio=round(measured_ratio, 2), predicted_ratio=round(predicted_ratio, 2),
                    within_25pct=abs(measured_ratio / predicted_ratio - 1) <= 0.25,
                ))  # fmt: skip
    return out


def write_csv(rows: list[dict], path: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_png(rows: list[Row], path: str, title: str) -> None:
    """TPOT against context, one line per (model K, layout, batch), log axes."""
    from sglang_helix.plot import line_plot_png

    series = {}
    for r in rows:
        name = f"K={r.kv_heads} {r.layout} B={r.batch}"
        series.setdefault(name, []).append((r.context, r.tpot_ms))
    line_plot_png(series, path, title, "context (tokens)", "TPOT (ms)", logx=True, logy=True)


# -- main ----------------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for d in rows:
        print("| " + " | ".join("-" if d[c] is None else str(d[c]) for c in cols) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", action="append", default=[], help="a running server (repeatable)")
    p.add_argument("--from-json", action="append", default=[], help="report rows saved by --json (repeatable; no measuring)")
    p.add_argument("--context", type=_ints, default=[1024, 4096], help="prompt lengths, comma-separated")
    p.add_argument("--batch", type=_ints, default=[1], help="concurrent requests, comma-separated")
    p.add_argument("--batch-max-context", type=int, default=1 << 30, help="run batches > 1 only up to this context")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64, help="--helix-kvp-chunk-size of launched servers (read from running ones)")
    p.add_argument("--dtype-bytes", type=int, default=None, help="KV element size (default: 4 with --cpu, else 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--csv", help="also write the rows here as CSV (and the KV-model rows next to it, *-model.csv)")
    p.add_argument("--png", help="plot TPOT against context per layout here")
    cpu = p.add_argument_group("--cpu: launch tiny-model servers on the CPU harness")
    cpu.add_argument("--cpu", action="store_true")
    cpu.add_argument("--tp", type=int, default=4)
    cpu.add_argument("--kvp", type=_ints, default=[1, 2, 4], help="--helix-kvp-size values (1 = plain TP)")
    cpu.add_argument("--dcp", type=_ints, default=[], help="upstream --dcp-size values (Q all-gathered)")
    cpu.add_argument("--dcp-rq", type=_ints, default=[], help="--dcp-size values with --dcp-replicate-q-proj (a2a)")
    cpu.add_argument("--heads", type=int, default=16)
    cpu.add_argument("--kv-heads", type=_ints, default=[1, 4], help="K of each model; a --kvp runs where TPA = tp/kvp divides K")
    cpu.add_argument("--head-dim", type=int, default=128)
    cpu.add_argument("--layers", type=int, default=2)
    cpu.add_argument("--intermediate-size", type=int, default=128)
    cpu.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the largest batch of prompts in one chunk")
    cpu.add_argument("--attention-backend", default="torch_native", choices=["torch_native", "triton"])
    cpu.add_argument(
        "--spec-steps", type=_ints, default=[0],
        help="speculative chains to run each layout with: 0 = none, s = STANDALONE (the target as its own draft), "
        "--speculative-num-steps s, top-k 1; e.g. 0,3",
    )  # fmt: skip
    cpu.add_argument(
        "--spec", type=lambda v: v.split(","), default=None,
        help="speculation per layout, any of none, chain-S, tree-SxK (STANDALONE, top-k K), ngram-N (NGRAM, "
        "N draft tokens); e.g. none,chain-3,tree-3x2,ngram-6 (with --spec-steps: added to its chains)",
    )  # fmt: skip
    cpu.add_argument("--qwen3-5", action="store_true", help="tiny Qwen3.5 (hybrid: --layers of which 1 in 4 full attention, output gate) instead of Llama")
    cpu.add_argument("--fp8", choices=["fp8-tensor", "fp8-block", "ct-channel"], help="serve each model quantized to this FP8 format, in bfloat16 (KV in bfloat16: pass --dtype-bytes 2)")
    cpu.add_argument("--kv-cache-dtype", choices=["fp8_e4m3", "fp8_e5m2", "bf16"], help="the servers' KV cache dtype (FP8: pass --dtype-bytes 1)")
    cpu.add_argument("--max-total-tokens", type=int, default=65536, help="at least; raised to fit the largest batch")
    cpu.add_argument("--profile", help="py-spy every scheduler rank over --profile-tokens extra decode steps of each request; files and a per-rank summary here")
    cpu.add_argument("--profile-tokens", type=int, default=24)
    cpu.add_argument("--profile-rate", type=int, default=50, help="py-spy samples per second")
    cpu.add_argument("--py-spy", default=os.path.join(os.path.dirname(sys.executable), "py-spy"))
    cpu.add_argument("--work-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "bench"))
    args = p.parse_args()
    if args.dtype_bytes is None:
        args.dtype_bytes = 4 if args.cpu else 2
    if sum(map(bool, (args.cpu, args.base_url, args.from_json))) != 1:
        p.error("give either --cpu, one or more --base-url, or one or more --from-json")
    if args.cpu and not any(f != ["--helix-kvp-size", "1"] for _, f in cpu_layouts(args) if f[0] != "--helix-kvp-chunk-size"):
        p.error(f"no --kvp in {args.kvp} runs with --tp {args.tp} and --kv-heads {args.kv_heads}: TPA = tp/kvp must divide K")

    if args.from_json:
        rows = []
        for path in args.from_json:
            with open(path) as f:
                rows += [Row(**r) for r in json.load(f)["rows"]]
    elif args.cpu:
        os.makedirs(args.work_dir, exist_ok=True)
        rows = bench_cpu(args)
    else:
        progress = Progress(len(args.base_url) * len(cases(args)))
        rows = [r for url in args.base_url for r in bench_server(url.rstrip("/"), args, progress)]
    table = [asdict(r) for r in rows]
    print_table(table)
    model_rows = kv_model(rows)
    if model_rows:
        print("\nplain TP / Helix TPOT, measured and predicted from the KV bytes (plain TP's step minus the KV Helix does not read)")
        print_table(model_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "kv_model": model_rows}, f, indent=1)
    if args.csv:
        write_csv(table, args.csv)
        if model_rows:
            write_csv(model_rows, os.path.splitext(args.csv)[0] + "-model.csv")
    if args.png:
        where = "CPU harness" if args.cpu else ", ".join(args.base_url or args.from_json)
        write_png(rows, args.png, f"decode TPOT vs context ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
