"""One-GPU check of a Helix KVP group's decode attention step: exact, capturable, and how fast.

    python benchmark/gpu_kernels.py                       # a GPU: Llama-70B-like per-rank shapes
    python benchmark/gpu_kernels.py --context 4096,131072,1048576 --batch 1,8 --kvp 2,4,8
    TRITON_INTERPRET=1 python benchmark/gpu_kernels.py --cpu-smoke   # the same code on the CPU, tiny

Needs only torch, triton and the series' kernel sources: sglang's Triton decode kernel (with patch
the series' merged-LSE output), upstream's DCP pack/combine kernels and split heuristic
(``kernels/ops/attention/metadata.py``), ``srt/layers/dcp/layout.py`` and the GQA mode's
``gqa_decode``. On the lent GPU machine (no sglang installed) put those files under ``.gpu/src``
(see ../shared/notes/gpu-machine.md); that folder goes first on ``sys.path``. No server, no
network. Without a GPU (and without ``--cpu-smoke``) it says so and exits 0.

One KVP group of one TPA slice is emulated in one process, for ``H = Q/TPA`` query heads and
``KH = K/TPA`` KV heads (default Llama-70B at TPA 8: 8 query heads, 1 KV head, head dim 128,
bf16): the context's KV is sharded round-robin in chunks over KVP ranks, each rank runs the
decode kernel over its shard with the merged LSE, packs (``dcp_a2a_lse_reduce``'s send buffer), the All-to-All
is a device copy of the packed buffers, and each rank merges its head slice. Checked:

- exact: the merged output against float64 attention over the whole context (bf16 rounding);
- capturable: the whole step captured in a CUDA graph and replayed gives the eager result;
- timed (``triton.testing.do_bench``, and graph replay): one Helix rank's step (its shard's
  decode + pack + merge) against plain TP's per-rank attention at the same N = KVP x TPA (Q/N
  query heads, max(1, K/N) KV heads over the whole context);
- bandwidth: the KV bytes each rank's decode reads over its time, in GB/s and in percent of the
  device's measured copy bandwidth (read + write of 512 MiB), eager and graph-replayed
  (``*_graph_*``: no launch gaps, as a captured server step), for Helix and plain TP, with
  Helix's per-request split policy (``decode_state.num_kv_splits_by_local_len``) on and off
  (``--split-policy``; off = ``--splits`` for every request);
- fused: stage 2 writing the All-to-All send buffer itself (the head-split-output patch, what Helix attention
  runs; ``helix_rank_us``) against stage 2 + the pack kernel (``helix_rank_unfused_us``).

Prints one row per (context, batch, KVP) and writes the rows as JSON (``--json``, or under $OUT).

The recorded specializations (issue 35, ``test/data/helix_triton_specializations.json``: what the
server launches, as Triton specializes it; ``python -m sglang_helix.triton_specs record``):

- ``--specializations [PATH]``: compile every recorded specialization for this device's target
  and load it (``n_regs``, ``n_spills``, shared memory, as the driver reports them); a failure is
  listed with its kernel and specialization. Rows ``{"specialization": ...}``.
- ``--shapes-from-fixture``: run the cases above at every (query heads, KV heads, head dim) of the
  fixture's unit-level model shapes (``sglang_helix.triton_shapes``: Llama-3.1-70B and Qwen3-235B
  at TPA 2/4, head dim 64) instead of ``--heads/--kv-heads/--head-dim``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_SRC = os.path.join(ROOT, ".gpu", "src")
if os.path.isdir(GPU_SRC):
    sys.path.insert(0, GPU_SRC)
sys.path.append(os.path.join(ROOT, "python"))  # sglang_helix.triton_specs (stdlib-only at import)
FIXTURE = os.path.join(ROOT, "test", "data", "helix_triton_specializations.json")

import torch  # noqa: E402


def _kernels():
    from sglang.kernels.ops.attention import dcp_kernels
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    return decode_attention_fwd, dcp_kernels


def owner_rank(pos, kvp: int, chunk: int):
    """Helix's layout: DCP's with interleave_size = chunk (runs of chunk positions per rank)."""
    return (pos // chunk) % kvp


def split_counts(lens: torch.Tensor, heads: int, kv_heads: int, splits: int, policy: bool, cores: int):
    """``(num_kv_splits [B], max_kv_splits)``: the decode kernel's split setting for requests of
    ``lens`` KV tokens. Off: ``splits`` for every request (SGLang's default, 8). On: Helix's
    policy (``decode_state.KVSplitPolicy`` with ``splits`` as the backend's setting: the batch's
    split extent for ``cores`` SMs, then ``num_kv_splits_by_local_len`` per request)."""
    num = torch.full(lens.shape, splits, dtype=torch.int32, device=lens.device)
    if not policy:
        return num, splits
    from sglang.srt.layers.dcp import gqa_decode as decode_state

    kv_policy = decode_state.KVSplitPolicy(splits, max(splits, decode_state.DCP_GQA_MAX_KV_SPLITS), cores)
    extent = kv_policy.grid_splits(lens.shape[0], heads, kv_heads)
    decode_state.num_kv_splits_by_local_len(num, lens, heads, kv_heads, extent, cores)
    return num, extent


def stage2_split_tile(splits: int) -> int:
    from sglang.srt.layers.dcp import gqa_decode

    return gqa_decode.stage2_split_tile(splits)


def shard_positions(context: int, kvp: int, chunk: int) -> list:
    """Global positions each KVP rank owns, in order (round-robin chunks)."""
    pos = torch.arange(context)
    owner = owner_rank(pos, kvp, chunk)
    return [pos[owner == k] for k in range(kvp)]


class HelixGroupStep:
    """Static buffers and the step of one KVP group (one TPA slice), for eager runs and capture."""

    def __init__(self, q, k, v, kvp: int, chunk: int, splits: int, policy: bool = False, cores: int = 0,
                 split_tile: int = -1):  # fmt: skip
        decode, dcp_kernels = _kernels()
        self.decode, self.dcp = decode, dcp_kernels
        B, H, D = q.shape
        self.B, self.H, self.D, self.kvp = B, H, D, kvp
        self.fused = True
        self.q = q
        self.scale = D**-0.5
        self.shards, self.split_counts, self.kv_bytes = [], [], []
        lpd = dcp_kernels._lse_pack_dim(q.dtype)
        for positions in shard_positions(k.shape[1], kvp, chunk):
            n = positions.numel()
            lens = torch.full((B,), n, dtype=torch.int64, device=q.device)
            num_splits, self.splits = split_counts(lens, H, k.shape[2], splits, policy, cores)
            self.split_counts.append(int(num_splits[0]))
            self.kv_bytes.append(2 * B * n * k.shape[2] * D * k.element_size())  # K and V it reads
            kb = k[:, positions].reshape(B * n, k.shape[2], D).contiguous()  # rows of this shard
            vb = v[:, positions].reshape(B * n, v.shape[2], D).contiguous()
            indptr = torch.arange(B + 1, device=q.device, dtype=torch.int32) * n
            indices = torch.arange(B * n, device=q.device, dtype=torch.int64)
            out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
            lse = torch.empty(B, H, dtype=torch.float32, device=q.device)
            logits = torch.empty(B, H, self.splits, D, dtype=torch.float32, device=q.device)
            split_lse = torch.empty(B, H, self.splits, dtype=torch.float32, device=q.device)
            shape = (kvp, B, H // kvp, D + lpd)  # dcp_a2a_lse_reduce_packed's send buffer
            send = torch.empty(shape, dtype=q.dtype, device=q.device)
            self.shards.append((kb, vb, indptr, indices, out, lse, logits, split_lse, num_splits, send))
        # stage 2's split tile: -1 as the GQA mode launches it (gqa_decode.stage2_split_tile), 0 serial
        self.split_tile = stage2_split_tile(self.splits) if split_tile < 0 else split_tile
        self.recv = [torch.empty_like(self.shards[0][-1]) for _ in range(kvp)]
        self.merged = torch.empty(kvp, B, H // kvp, D, dtype=q.dtype, device=q.device)
        self.lpd = self.recv[0].shape[-1] - D

    def rank_decode_pack(self, r: int) -> None:
        kb, vb, indptr, indices, out, lse, logits, split_lse, num_splits, send = self.shards[r]
        if self.fused:  # stage 2 writes the send buffer (the head-split-output patch), as Helix attention does
            out, lse = send[..., : self.D], send.view(torch.float32)[..., self.D // self.lpd]
        self.decode(self.q, kb, vb, out, indptr, indices, logits, split_lse, num_splits, self.splits,
                    self.scale, 1.0, 1.0, output_lse=lse, split_tile=self.split_tile)  # fmt: skip
        if not self.fused:  # stage 2 into [B, H, D] + [B, H], then the pack kernel
            D = self.D
            self.dcp.dcp_pack_a2a_send(out, lse, send[..., :D], send.view(torch.float32)[..., D // self.lpd])

    def exchange(self) -> None:
        for dst in range(self.kvp):  # the All-to-All: chunk src of rank dst's receive = send[src][dst]
            for src in range(self.kvp):
                self.recv[dst][src].copy_(self.shards[src][-1][dst])

    def rank_merge(self, r: int) -> None:
        recv, D = self.recv[r], self.D
        out, _ = self.dcp.dcp_lse_combine_triton(recv[..., :D], recv.view(torch.float32)[..., D // self.lpd])
        self.merged[r].copy_(out)

    def __call__(self) -> torch.Tensor:
        for r in range(self.kvp):
            self.rank_decode_pack(r)
        self.exchange()
        for r in range(self.kvp):
            self.rank_merge(r)
        return self.merged.transpose(0, 1).reshape(self.B, self.H, self.D)  # [B, H, D], heads in order


def reference(q, k, v) -> torch.Tensor:
    """float64 attention of q [B, H, D] over k/v [B, S, KH, D] (GQA), one request at a time and
    without repeating K/V per query head (1M tokens x batch 8 would need 64 GiB in float64)."""
    B, H, D = q.shape
    KH = k.shape[2]
    out = torch.empty(B, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        qb = q[b].double().view(KH, H // KH, D)  # [KH, G, D]
        kb, vb = k[b].double(), v[b].double()  # [S, KH, D]
        s = torch.einsum("kgd,skd->kgs", qb, kb) * D**-0.5  # [KH, G, S]
        out[b] = torch.einsum("kgs,skd->kgd", s.softmax(-1), vb).reshape(H, D)
        del kb, vb, s
    return out


def plain_tp_rank(q, k, v, n_heads: int, kv_heads: int, splits: int, policy: bool = False, cores: int = 0):
    """Plain TP's per-rank attention: ``n_heads`` query heads over the whole context with
    ``kv_heads`` KV heads (KV replicated once N > K). ``(step, KV bytes it reads, splits)``."""
    decode, _ = _kernels()
    B, S, _, D = k.shape
    qq = q[:, :n_heads].contiguous()
    kb = k[:, :, :kv_heads].reshape(B * S, kv_heads, D).contiguous()
    vb = v[:, :, :kv_heads].reshape(B * S, kv_heads, D).contiguous()
    indptr = torch.arange(B + 1, device=q.device, dtype=torch.int32) * S
    indices = torch.arange(B * S, device=q.device, dtype=torch.int64)
    out = torch.empty(B, n_heads, D, dtype=q.dtype, device=q.device)
    lens = torch.full((B,), S, dtype=torch.int64, device=q.device)
    num_splits, max_splits = split_counts(lens, n_heads, kv_heads, splits, policy, cores)
    logits = torch.empty(B, n_heads, max_splits, D, dtype=torch.float32, device=q.device)
    split_lse = torch.empty(B, n_heads, max_splits, dtype=torch.float32, device=q.device)

    def step():
        decode(qq, kb, vb, out, indptr, indices, logits, split_lse, num_splits, max_splits, D**-0.5, 1.0, 1.0)

    return step, out, 2 * B * S * kv_heads * D * k.element_size(), int(num_splits[0])


def copy_bandwidth_gbps(device) -> float:
    """The device's copy bandwidth (read + write bytes per second) over 512 MiB, in GB/s."""
    from triton.testing import do_bench

    x = torch.empty(1 << 28, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


def run_case(context, batch, kvp, heads, kv_heads, head_dim, chunk, splits, dtype, device, timing: bool,
             policy: bool = False, cores: int = 0, copy_gbps: float = 0.0, split_tile: int = -1) -> dict:  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(context + batch + kvp)
    q = torch.randn(batch, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(batch, context, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, context, kv_heads, head_dim, generator=g).to(device, dtype)
    step = HelixGroupStep(q, k, v, kvp, chunk, splits, policy, cores, split_tile)
    step.fused = False
    unfused = step().clone()
    step.fused = True
    eager = step().clone()
    err = (eager.double() - reference(q, k, v)).abs().max().item()
    row = {"context": context, "batch": batch, "kvp": kvp, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "split_policy": "on" if policy else "off",
           "helix_splits": step.split_counts[0], "split_extent": step.splits, "split_tile": step.split_tile,
           "max_abs_err_vs_fp64": err,
           "fused_equals_unfused": bool(torch.equal(eager, unfused))}  # fmt: skip
    # Plain TP at N = KVP x TPA: Q/N = H/KVP query heads, max(1, K/N) = max(1, KH/KVP) KV heads.
    tp_heads, tp_kv_heads = max(1, heads // kvp), max(1, kv_heads // kvp)
    tp, tp_out, tp_bytes, row["plain_tp_splits"] = plain_tp_rank(q, k, v, tp_heads, tp_kv_heads, splits, policy, cores)
    tp()
    tp_ref = reference(q[:, :tp_heads], k[:, :, :tp_kv_heads], v[:, :, :tp_kv_heads])
    row["plain_tp_max_abs_err_vs_fp64"] = (tp_out.double() - tp_ref).abs().max().item()
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        row["graph_equals_eager"] = bool(torch.equal(step.merged.transpose(0, 1).reshape_as(eager), eager))
    if timing and device == "cuda":
        from triton.testing import do_bench

        def one_rank():  # rank 0: its shard's decode + pack, its merge (the exchange is a copy here)
            step.rank_decode_pack(0)
            step.rank_merge(0)

        def rank_decode():  # rank 0's decode alone: what reads the KV
            step.rank_decode_pack(0)

        step.fused = False  # the measurement issue 16 asks for: stage 2 + pack, against fused
        row["helix_rank_unfused_us"] = do_bench(one_rank) * 1e3
        step.fused = True
        row["helix_rank_us"] = do_bench(one_rank) * 1e3
        row["helix_decode_us"] = do_bench(rank_decode) * 1e3
        row["plain_tp_rank_us"] = do_bench(tp) * 1e3
        row["speedup"] = row["plain_tp_rank_us"] / row["helix_rank_us"]
        # KV read bandwidth: the bytes each rank's decode reads over its time.
        row["helix_gbps"] = step.kv_bytes[0] / (row["helix_decode_us"] * 1e-6) / 1e9
        row["plain_tp_gbps"] = tp_bytes / (row["plain_tp_rank_us"] * 1e-6) / 1e9
        row["helix_pct_of_copy"] = 100 * row["helix_gbps"] / copy_gbps
        row["plain_tp_pct_of_copy"] = 100 * row["plain_tp_gbps"] / copy_gbps
        # The same decodes captured and replayed: the kernels' time without Python's launch gaps, as
        # a server's captured decode step runs them (the eager figures above include the gaps).
        for name, fn in (("helix_decode", rank_decode), ("plain_tp", tp)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            row[f"{name}_graph_us"] = do_bench(graph.replay) * 1e3
        row["helix_graph_gbps"] = step.kv_bytes[0] / (row["helix_decode_graph_us"] * 1e-6) / 1e9
        row["plain_tp_graph_gbps"] = tp_bytes / (row["plain_tp_graph_us"] * 1e-6) / 1e9
        row["helix_graph_pct_of_copy"] = 100 * row["helix_graph_gbps"] / copy_gbps
        row["plain_tp_graph_pct_of_copy"] = 100 * row["plain_tp_graph_gbps"] / copy_gbps
    return row


def fixture_shapes(path: str = FIXTURE) -> list:
    """(query heads, KV heads, head dim) of the fixture's decode launches at the model shapes."""
    with open(path) as f:
        specs = json.load(f)["specializations"]
    out = set()
    for s in specs:
        if not s["kernel"].endswith(("_fwd_grouped_kernel_stage1", "_fwd_kernel_stage1")):
            continue
        if not str(s.get("first_launched_by", "")).startswith("triton_shapes"):
            continue
        cx = {n: v for n, t, v in s["args"] if t == "constexpr"}
        group = cx.get("kv_group_num", 1)
        heads = cx.get("q_head_num") or group
        out.add((heads, max(1, heads // group), cx["Lk"]))
    return sorted(out)


def compile_specializations(path: str = FIXTURE) -> list:
    """Every recorded specialization compiled for this device and loaded: one row each."""
    import triton
    from triton.compiler import ASTSource

    from sglang_helix import triton_specs as ts

    target = triton.runtime.driver.active.get_current_target()
    name = {90: "sm90", 100: "sm100"}.get(target.arch)
    if name is None:  # another arch: compile for it with the sm90 backend options' names
        ts.TARGETS[f"sm{target.arch}"] = (target.backend, target.arch, target.warp_size)
        name = f"sm{target.arch}"
    rows = []
    for spec in ts.load_fixture(path):
        row = {"specialization": ts.describe(spec), "target": name}
        try:
            fn, signature, constexprs, attrs, options = ts._compile_inputs(spec, name)
            ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
            ck._init_handles()
            row.update(ok=True, n_regs=ck.n_regs, n_spills=ck.n_spills, shared=ck.metadata.shared)
        except Exception as e:  # noqa: BLE001 - listed
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", default="4096,131072,1048576")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--kvp", default="2,4,8")
    p.add_argument("--heads", type=int, default=8, help="Q/TPA query heads of one TPA slice")
    p.add_argument("--kv-heads", type=int, default=1, help="K/TPA KV heads of one TPA slice")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64, help="--helix-kvp-chunk-size")
    p.add_argument("--splits", type=int, default=8, help="KV splits of the decode kernel (policy off)")
    p.add_argument("--split-policy", default="on,off", help="Helix's per-request split policy: on, off or both")
    p.add_argument("--split-tile", default="-1", help="Helix's stage-2 split tile(s): -1 as the server, 0 serial")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--json", default=None)
    p.add_argument("--specializations", nargs="?", const=FIXTURE, default=None,
                   help="compile and load every recorded specialization (default: the fixture)")
    p.add_argument("--shapes-from-fixture", action="store_true",
                   help="run the cases at the fixture's model shapes (heads, KV heads, head dim)")
    args = p.parse_args(argv)
    shapes = fixture_shapes() if args.shapes_from_fixture else [(args.heads, args.kv_heads, args.head_dim)]
    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--cpu-smoke needs TRITON_INTERPRET=1 in the environment (Triton reads it at import)")
        device, dtype, timing = "cpu", torch.float32, False
        contexts, batches, kvps = [200], [2], [2, 4]
        args.head_dim, args.chunk, args.splits = 16, 8, 2
        cores, copy_gbps = 132, 0.0  # an H100's SM count, so the split policy runs
    elif not torch.cuda.is_available():
        print("gpu_kernels: no GPU here (torch.cuda.is_available() is False); nothing to run.")
        return 0
    else:
        device, dtype, timing = "cuda", torch.bfloat16, True
        contexts, batches, kvps = ([int(x) for x in s.split(",")] for s in (args.context, args.batch, args.kvp))
        cores = torch.cuda.get_device_properties(0).multi_processor_count
        copy_gbps = copy_bandwidth_gbps(device)
        print(json.dumps({"device": torch.cuda.get_device_name(0), "copy_gbps": copy_gbps}), flush=True)
    if args.cpu_smoke and args.shapes_from_fixture:
        shapes = [(h, kh, 16) for h, kh, _ in shapes if h <= 16][:1]  # the interpreter: one, tiny
    policies = [{"on": True, "off": False}[x] for x in args.split_policy.split(",")]
    rows = []
    spec_rows = compile_specializations(args.specializations) if args.specializations and device == "cuda" else []
    for heads, kv_heads, head_dim in shapes:
        for context in contexts:
            for batch in batches:
                for kvp in kvps:
                    if args.shapes_from_fixture and heads % kvp:
                        continue
                    for policy in policies:
                        for tile in (int(x) for x in args.split_tile.split(",")):
                            row = run_case(context, batch, kvp, heads, kv_heads, head_dim, args.chunk, args.splits,
                                           dtype, device, timing, policy, cores, copy_gbps, tile)  # fmt: skip
                            row.update(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_kernels.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                       "copy_gbps": copy_gbps, "rows": rows, "specializations": spec_rows}, f, indent=1)  # fmt: skip
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    bad = [
        r for r in rows
        if r["max_abs_err_vs_fp64"] > tol or r.get("graph_equals_eager") is False or not r["fused_equals_unfused"]
    ]  # fmt: skip
    bad_specs = [r for r in spec_rows if not r["ok"] or r.get("n_spills")]
    for r in bad_specs:
        print(f"gpu_kernels: specialization failed or spills: {json.dumps(r)}", file=sys.stderr)
    if bad or bad_specs:
        print(f"gpu_kernels: {len(bad)} case(s) failed the checks, {len(bad_specs)} specialization(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
