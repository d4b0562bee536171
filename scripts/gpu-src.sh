#!/usr/bin/env bash
# Build .gpu/src: the kernel sources the one-GPU checks (benchmark/gpu_kernels.py,
# benchmark/gpu_rank_step.py) import, copied from the patched install, for a machine without
# sglang (the lent GPU machine: torch + triton only). See ../shared/notes/gpu-machine.md.
# Usage: bash scripts/gpu-src.sh   (then carry .gpu in the device call)
set -euo pipefail
cd "$(dirname "$0")/.."
SP=$(.venv/bin/python -c "import importlib.util,os;print(os.path.dirname(importlib.util.find_spec('sglang').origin))")
DST=.gpu/src/sglang
rm -rf .gpu/src && mkdir -p "$DST"
for f in kernels/ops/attention/{decode_attention,extend_attention,dcp_kernels,score_mod,metadata}.py \
         srt/environ.py srt/layers/dcp/{layout,gqa_decode}.py; do
  mkdir -p "$DST/$(dirname "$f")"; cp "$SP/$f" "$DST/$f"
done
# Empty package __init__s: the real ones import the server.
find "$DST" -type d -exec sh -c 'touch "$1/__init__.py"' _ {} \;
# Stand-ins for the two heavy modules the kernels import names from.
cat > "$DST/srt/utils.py" <<'PY'
import functools
import torch
def is_hip(): return False
def is_cuda(): return torch.cuda.is_available()
def is_gfx95_supported(): return False
def is_gfx1250_supported(): return False
@functools.lru_cache(maxsize=None)
def get_device_core_count(device_id: int = 0) -> int:
    return torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0
PY
cat > "$DST/srt/runtime_context.py" <<'PY'
def get_parallel():  # no server here: the kernel checks never read the parallel state
    raise RuntimeError("no sglang runtime on this machine (.gpu/src stand-in)")
def get_spec():  # nor the speculative config
    raise RuntimeError("no sglang runtime on this machine (.gpu/src stand-in)")
def max_speculative_num_draft_tokens():
    raise RuntimeError("no sglang runtime on this machine (.gpu/src stand-in)")
PY
grep -qs '^/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
du -sh .gpu
