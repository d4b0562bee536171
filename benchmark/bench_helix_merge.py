"""Cost of Helix's pack + N-way LSE merge for one layer on one rank (no collective), both paths.

``triton``: upstream's DCP Triton kernels (``dcp_pack_a2a_send``, ``dcp_lse_combine_triton`` from
``sglang.kernels.ops.attention.dcp_kernels``, what ``dcp_a2a_lse_reduce`` runs around its
All-to-All), compiled on a GPU; without one they run under ``TRITON_INTERPRET=1`` (set here when
CUDA is absent), as on the CPU harness with ``--attention-backend triton``. ``torch``: the series'
torch pack and combine (``dcp_pack_a2a_send_torch``, ``dcp_lse_combine_torch``: what the reduce
runs on a CPU without the interpreter, e.g. ``--attention-backend torch_native`` on the CPU
harness). The send buffer is the GQA mode's decode's (``comm.dcp_a2a_send_buffer``).

    .venv/bin/python benchmark/bench_helix_merge.py [--head-dim 64] [--tokens 1,64]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from sglang.kernels.ops.attention.dcp_kernels import (  # noqa: E402
    dcp_lse_combine_torch,
    dcp_lse_combine_triton,
    dcp_pack_a2a_send,
    dcp_pack_a2a_send_torch,
)
from sglang.srt.layers.dcp.comm import dcp_a2a_send_buffer  # noqa: E402

PATHS = {  # name: (pack, combine)
    "triton": (dcp_pack_a2a_send, dcp_lse_combine_triton),
    "torch": (dcp_pack_a2a_send_torch, dcp_lse_combine_torch),
}


def _timed(fn, device, repeats):
    fn()  # warm-up (compile or first interpretation)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", default="1,64", help="tokens in the batch (T), comma-separated")
    p.add_argument("--layouts", default="2:4,4:8", help="KVP:Q/TPA pairs, comma-separated")
    p.add_argument("--repeats", type=int, default=None, help="Triton: 2 interpreted, 100 on a GPU")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    repeats = args.repeats or (100 if device == "cuda" else 2)
    D = args.head_dim
    print(f"device {device}{' (TRITON_INTERPRET=1)' if device == 'cpu' else ''}, head_dim {D}, fp32")
    for pair in args.layouts.split(","):
        kvp, H = (int(x) for x in pair.split(":"))
        for T in (int(t) for t in args.tokens.split(",")):
            out, lse = torch.randn(T, H, D, device=device), torch.randn(T, H, device=device)
            _, dst_o, dst_lse = dcp_a2a_send_buffer(T, H, D, out.dtype, kvp, device)
            outs = torch.randn(kvp, T, H // kvp, D, device=device)
            lses = torch.randn(kvp, T, H // kvp, device=device)
            times = []
            for name, n in (("triton", repeats), ("torch", 100)):
                pack, combine = PATHS[name]
                times.append(_timed(lambda: pack(out, lse, dst_o, dst_lse), device, n))
                times.append(_timed(lambda: combine(outs, lses, True, False), device, n))
            print(
                f"KVP {kvp} Q/TPA {H} T {T:4d}: triton pack {times[0] * 1e3:9.3f} ms, merge "
                f"{times[1] * 1e3:9.3f} ms | torch pack {times[2] * 1e3:7.3f} ms, merge "
                f"{times[3] * 1e3:7.3f} ms (per layer, per rank)"
            )


if __name__ == "__main__":
    main()
