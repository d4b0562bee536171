"""One KVP rank's batch-1 decode launches, for Nsight Compute (which kernel holds the time).

    ncu -k regex:_fwd --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__grid_size python benchmark/gpu_decode_ncu.py --context 1048576 --kvp 8

Builds ``gpu_kernels.HelixGroupStep`` for one case (8 query / 1 KV head, head dim 128, bf16, Helix's
split policy) and runs rank 0's decode (stage 1, stage 2 writing the send buffer) ``--repeat`` times.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_kernels as gk  # noqa: E402  (puts .gpu/src first on sys.path)
import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=1 << 20)
    p.add_argument("--kvp", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    dev = "cuda"
    q = torch.randn(a.batch, a.heads, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(a.batch, a.context, a.kv_heads, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cores = torch.cuda.get_device_properties(0).multi_processor_count
    step = gk.HelixGroupStep(q, k, v, a.kvp, 64, 8, policy=True, cores=cores)
    print(f"context {a.context} kvp {a.kvp} splits {step.split_counts[0]} extent {step.splits}", flush=True)
    for _ in range(a.repeat):
        step.rank_decode_pack(0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
