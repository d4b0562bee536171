#!/usr/bin/env bash
# The one-GPU checks of benchmark/, in one device call (device time is scarce: the slowest last).
# Build .gpu/src first (bash scripts/gpu-src.sh) and carry .gpu; rows and logs go to $OUT.
#   run: bash benchmark/gpu_checks.sh      (carry: [".gpu"], timeout_s ~500)
# 1. one rank's decoder layer at 1M tokens, every layout (gpu_rank_step.py);
# 2. batch-1 decode's share of the copy bandwidth, eager and graph-replayed, two head shapes
#    (gpu_kernels.py, Helix's split policy on);
# 3. the rank step at 32K and 128K with the same policy, for one table.
set -u
OUT=${OUT:-/tmp/gpu-checks}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
step() {  # step NAME SECONDS CMD...: run with a limit, keep its log, say how it ended
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s"; grep -v '^{' "$OUT/$name.log" | tail -40
}
step rank_step_1m 170 python benchmark/gpu_rank_step.py --context 1048576 --json "$OUT/rank_step_1m.json"
step kernels_b1_q8k1 100 python benchmark/gpu_kernels.py --context 131072,524288,1048576 --batch 1 --kvp 2,4,8 \
  --split-policy on --json "$OUT/kernels_b1_q8k1.json"
step kernels_b1_q32k2 60 python benchmark/gpu_kernels.py --heads 32 --kv-heads 2 --context 131072,1048576 --batch 1 \
  --kvp 2,4 --split-policy on --json "$OUT/kernels_b1_q32k2.json"
python - "$OUT" <<'PY'
import json, os, sys
for f in ("kernels_b1_q8k1.json", "kernels_b1_q32k2.json"):
    p = os.path.join(sys.argv[1], f)
    if not os.path.exists(p):
        continue
    d = json.load(open(p))
    print(f, "copy", round(d["copy_gbps"]), "GB/s")
    for r in d["rows"]:
        print(r["heads"], r["kv_heads"], r["context"], r["kvp"], "splits", r["helix_splits"],
              "helix eager/graph %", round(r.get("helix_pct_of_copy", 0), 1), round(r.get("helix_graph_pct_of_copy", 0), 1),
              "tp eager/graph %", round(r.get("plain_tp_pct_of_copy", 0), 1), round(r.get("plain_tp_graph_pct_of_copy", 0), 1),
              "err", "%.1e" % r["max_abs_err_vs_fp64"], "graph==eager", r.get("graph_equals_eager"))
PY
step rank_step_32k_128k 150 python benchmark/gpu_rank_step.py --context 32768,131072 --json "$OUT/rank_step_32k_128k.json"
