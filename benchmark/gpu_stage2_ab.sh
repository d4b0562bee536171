#!/usr/bin/env bash
# Stage 2's tiled split reduction against its serial loop (gpu_kernels.py --split-tile), then the
# rank step at 1M and one ncu profile with the tile on. One device call; rows and logs under $OUT.
set -u
OUT=${OUT:-/tmp/gpu-stage2}; mkdir -p "$OUT"
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: rc=$? in $((SECONDS - t0)) s"; }
K="python benchmark/gpu_kernels.py --split-policy on"
run ab_q8k1 120 $K --context 131072,1048576 --batch 1,4,8 --kvp 2,8 --split-tile=0,32 --json "$OUT/ab_q8k1.json"
run tiles_q8k1 40 $K --context 1048576 --batch 1 --kvp 2,8 --split-tile=16,64 --json "$OUT/tiles_q8k1.json"
run ab_q32k2 60 $K --heads 32 --kv-heads 2 --context 1048576 --batch 1,4 --kvp 2,4 --split-tile=0,32 --json "$OUT/ab_q32k2.json"
python - "$OUT" <<'PY'
import json, os, sys
for f in ("ab_q8k1.json", "tiles_q8k1.json", "ab_q32k2.json"):
    p = os.path.join(sys.argv[1], f)
    if not os.path.exists(p):
        continue
    for r in json.load(open(p))["rows"]:
        print(f[:-5], r["heads"], r["kv_heads"], r["context"], "B", r["batch"], "kvp", r["kvp"], "ext", r["split_extent"],
              "tile", r["split_tile"], "decode graph us %.1f" % r["helix_decode_graph_us"], "%% copy %.1f" % r["helix_graph_pct_of_copy"],
              "rank eager us %.1f" % r["helix_rank_us"], "tp graph us %.1f" % r["plain_tp_graph_us"], "err %.1e" % r["max_abs_err_vs_fp64"],
              "graph==eager", r.get("graph_equals_eager"))
PY
run rank_step_1m 120 python benchmark/gpu_rank_step.py --context 1048576 --json "$OUT/rank_step_1m_tiled.json"
grep -v '^{' "$OUT/rank_step_1m.log" | tail -32
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 60 $NCU -k regex:_fwd --launch-skip 2 --launch-count 2 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size --csv python benchmark/gpu_decode_ncu.py --context 1048576 --kvp 8 > "$OUT/ncu_tiled_1048576_8.csv" 2>&1
grep -o '"_fwd[a-z_0-9]*".*' "$OUT/ncu_tiled_1048576_8.csv" | cut -c1-40 | head -0
python - "$OUT/ncu_tiled_1048576_8.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5 and not r[0].startswith("==")]
h = rows[0]; k, m, v = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value")
for r in rows[1:]:
    print("ncu", r[k][:28], r[m], r[v])
PY
