#!/usr/bin/env bash
# A trained model (SmolLM2-135M-Instruct, installed by setup.sh) served on the CPU by the real SGLang
# server with Helix (--tp 3 --helix-kvp-size 3) and with plain --tp 3: the same passkey question over
# a ~2K-token text to each, the answers side by side with their time per output token.
# Needs `bash scripts/setup.sh` first.
#   bash scripts/demo.sh [--tp N] [--helix-kvp-size KVP] [--prompt-tokens T] [--depth D]
#                        [--attention-backend torch_native|triton] [-- extra server flags]
#   bash scripts/demo.sh --random-model   # the tiny random-weight Llama under Helix (noise text)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  echo "demo.sh: run 'bash scripts/setup.sh' first" >&2; exit 1
fi
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/demo.py" "$@"
