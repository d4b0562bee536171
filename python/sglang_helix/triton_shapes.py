"""Unit-level Helix launches at real model shapes, for the Triton specialization record (issue 35).

Drives the Triton backend's ``init_forward_metadata`` and ``forward_extend`` / ``forward_decode``
(the K/V store, then their DCP branch) on KVP rank 0 of a group (``testing.dcp_ranks``: the real
backend; the others' All-to-All contributions copies of its own, as every rank launches the same) -- a chunked prefill of two requests (an extend
without and one with a prefix), then decode steps at every batch that gives a different split
extent -- with the GPU's split policy (an SM count, so the per-request split counts and the
batch-dependent split extent are what an H100 server launches), at the per-rank head counts of:

- Llama-3.1-70B (64 query / 8 KV heads, head dim 128) at TPA 2 and 4;
- Qwen3-235B-A22B (64 / 4, head dim 128) at TPA 2 and 4;
- a head-dim-64 GQA model (Llama-3.2-1B: 32 / 8, head dim 64) at TPA 2;
- Qwen3.5's full-attention layers (head dim 256): 397B-A17B (32 / 2) at TPA 2 and 1, 35B-A3B
  (16 / 2) at TPA 2;
- the e2e suites' tiny Llamas (8 query heads, 4/2 KV heads (1 KV head gives q8k2/tpa2's shape), head dim 16) at TPA 2 and 4 (their
  layouts' per-rank shapes: the e2e servers run interpreted in other processes, which the
  recorder does not see);

each with a bf16 KV cache and an fp8 (e4m3, scaled) one, at KVP 2 and 4 (stage 2's head groups).
Under ``TRITON_INTERPRET=1`` on CPU tensors; no result is checked here (the tests check them).

``python -m sglang_helix.triton_shapes --record OUT.json`` runs them all under the recorder;
``--quick`` only the first shape (the default tier's fixture check).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from types import SimpleNamespace  # noqa: E402

# (name, query heads per rank, KV heads per rank, head dim)
SHAPES = [
    ("llama-3.1-70b/tpa2", 32, 4, 128),
    ("llama-3.1-70b/tpa4", 16, 2, 128),
    ("qwen3-235b/tpa2", 32, 2, 128),
    ("qwen3-235b/tpa4", 16, 1, 128),
    ("llama-3.2-1b/tpa2", 16, 4, 64),
    ("qwen3.5-397b-a17b/tpa2", 16, 1, 256),  # full-attention layers: 32 / 2 heads, head dim 256
    ("qwen3.5-397b-a17b/tpa1", 32, 2, 256),
    ("qwen3.5-35b-a3b/tpa2", 8, 1, 256),  # 16 / 2, head dim 256
    ("tiny-q8k4/tpa2", 4, 2, 16),
    ("tiny-q8k4/tpa4", 2, 1, 16),
    ("tiny-q8k2/tpa2", 4, 1, 16),
]
KV_DTYPES = ("bf16", "fp8_e4m3")
KVPS = (2, 4)
CHUNK = 64  # --helix-kvp-chunk-size's default
CORE_COUNT = 132  # an H100's / H200's SMs (a B200: 148; both neither 1 nor a multiple of 16)
MAX_KV_SPLITS = 8  # --triton-attention-num-kv-splits' default
MAX_BATCH = 64
# The extend kernel's tile sizes follow the device (``extend_attention._get_block_sizes``: an
# H100 takes BLOCK_M 128 at head dim <= 128, a B200 and the CPU 64): its launches are recorded as
# each target configures them. Nothing else on the Helix path reads the device's capability.
EXTEND_CAPABILITIES = (None, (9, 0), (10, 0))


@contextlib.contextmanager
def extend_configured_for(capability):
    """Upstream's extend wrapper choosing its tiles as on a GPU of ``capability`` (None: as here)."""
    from sglang.kernels.ops.attention import extend_attention as ea

    missing = object()
    saved = (ea._is_cuda, getattr(ea, "CUDA_CAPABILITY", missing))
    if capability is not None:
        ea._is_cuda, ea.CUDA_CAPABILITY = True, capability
    try:
        yield
    finally:
        ea._is_cuda = saved[0]
        if saved[1] is missing:
            ea.__dict__.pop("CUDA_CAPABILITY", None)
        else:
            ea.CUDA_CAPABILITY = saved[1]


def _setup():
    from sglang_helix.testing.cpu_env import STUB_DIR

    if STUB_DIR not in sys.path:
        sys.path.insert(0, STUB_DIR)


def decode_batches(h: int, kvh: int) -> list[int]:
    """The first batch of each split extent the GPU policy gives, plus 1, 16 and 64 (an int
    argument's specializations: == 1, a multiple of 16, neither)."""
    from sglang.srt.layers.dcp.gqa_decode import DCP_GQA_MAX_KV_SPLITS, KVSplitPolicy

    policy = KVSplitPolicy(MAX_KV_SPLITS, DCP_GQA_MAX_KV_SPLITS, CORE_COUNT)
    seen, out = set(), []
    for t in range(1, MAX_BATCH + 1):
        s = policy.grid_splits(t, h, kvh)
        if s not in seen:
            seen.add(s)
            out.append(t)
    return sorted(set(out) | {1, 3, 16})


def run_shape(name, H, KVH, D, kv_name, kvp, recorder=None, batches=None, extend=True, decode=True):
    import torch

    from sglang.srt.layers.dcp import gqa_decode
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_helix.testing.dcp_ranks import Ranks, Shape, layer, self_attn

    kv_dtype = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[kv_name]
    scales = (2.5, 0.25) if kv_name.startswith("fp8") else None
    batches = batches or decode_batches(H, KVH)
    shape = Shape(
        heads=H, kv_heads=KVH, head_dim=D, kvp=kvp, chunk=CHUNK, slots=max(max(batches), 2),
        max_len=2 * CHUNK * kvp + 8, kv_dtype=kv_dtype, dtype=torch.bfloat16, max_kv_splits=MAX_KV_SPLITS,
    )  # fmt: skip
    ranks = Ranks(shape, "triton", solo_rank=0)  # one rank's launches: every rank's are the same
    for backend in filter(None, ranks.backends):  # a GPU's split policy
        backend.device_core_count = CORE_COUNT
        backend.dcp_split_policy = gqa_decode.kv_split_policy(MAX_KV_SPLITS, CORE_COUNT, False, None)
    L = layer(shape, scales=scales)
    g = torch.Generator().manual_seed(0)
    table = ranks.req_to_token

    def batch_of(mode, reqs):
        sl = torch.tensor([s for s, _, _ in reqs])
        prefix = torch.tensor([p for _, p, _ in reqs])
        seq = torch.tensor([n for _, _, n in reqs])
        return SimpleNamespace(
            forward_mode=ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE, batch_size=len(reqs),
            req_pool_indices=sl, seq_lens=seq, seq_lens_cpu=seq, seq_lens_sum=int(seq.sum()),
            positions=torch.cat([torch.arange(p, n) for _, p, n in reqs]), spec_info=None, kv_loc_plan=None,
            out_cache_loc_is_physical=False, mha_one_shot=False, attn_attend_prefix_cache=False, encoder_lens=None,
            out_cache_loc=torch.cat([table[s, p:n] for s, p, n in reqs]).long(),
            extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix.tolist(),
            extend_seq_lens=seq - prefix, extend_seq_lens_cpu=(seq - prefix).tolist(),
        )  # fmt: skip

    def step(mode, reqs):
        T = sum(n - p for _, p, n in reqs)
        q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
        k = torch.randn(T, KVH, D, generator=g).to(torch.bfloat16)
        v = torch.randn(T, KVH, D, generator=g).to(torch.bfloat16)
        fb = batch_of(mode, reqs)
        if recorder is not None:
            from sglang.kernels.ops.attention import extend_attention as ea

            arch = f" sm{ea.CUDA_CAPABILITY[0]}0" if mode == "extend" and ea._is_cuda else ""
            recorder.context = f"triton_shapes {name} kv={kv_name} kvp={kvp} {mode} T={T}{arch}"

        def rank_step(rank):
            backend = ranks.backends[rank]
            backend.init_forward_metadata(fb)
            self_attn(backend, L, q, k.clone(), v.clone(), fb)

        ranks.run(rank_step)  # rank 0

    ctx = CHUNK * kvp + 5  # every rank owns a chunk, rank 0 two
    for capability in EXTEND_CAPABILITIES if extend else ():
        with extend_configured_for(capability):  # a chunked prefill: the first chunk, then the rest
            step("extend", [(0, 0, CHUNK + 3), (1, 0, 5)])
            step("extend", [(0, CHUNK + 3, ctx), (1, 5, ctx)])
    for b in batches if decode else ():
        step("decode", [(s, ctx, ctx + 1) for s in range(b)])


def run_all(recorder=None, quick=False):
    _setup()
    warnings.simplefilter("ignore")
    shapes = SHAPES[:1] if quick else SHAPES
    for name, H, KVH, D in shapes:
        for kv_name in KV_DTYPES[:1] if quick else KV_DTYPES:
            for i, kvp in enumerate(KVPS):
                if H % kvp:
                    continue
                t0 = time.time()
                # Stage 1 and the extend depend on the KV dtype, not on the batch; stage 2 and the
                # split counts on the batch (the split extent) and KVP (head groups), not on the KV
                # dtype: every batch with the first KV dtype, batch 1 with the others.
                batches = [1, 3] if quick else (None if kv_name == KV_DTYPES[0] else [1])
                run_shape(name, H, KVH, D, kv_name, kvp, recorder, batches=batches, extend=(i == 0))
                print(f"{name} kv={kv_name} kvp={kvp}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_helix.triton_shapes")
    ap.add_argument("--record", help="write the recorded specializations to this JSON file")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    from sglang_helix.triton_specs import Recorder

    rec = Recorder().install() if a.record else None
    run_all(rec, a.quick)
    if rec is not None:
        keys = list(rec.specs)
        with open(a.record, "w") as f:
            json.dump({"specs": [rec.specs[k] for k in keys], "sources": [rec.sources[k] for k in keys],
                       "errors": sorted(set(rec.errors))}, f)  # fmt: skip
        print(f"{len(keys)} specializations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
