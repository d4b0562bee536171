#!/usr/bin/env bash
# Serve a tiny Llama on the CPU with the real SGLang server (--tp 4 --helix-kvp-size 2) and query
# it with the openai client: one chat completion and one streaming completion.
# Needs `bash scripts/setup.sh` first.
#   bash scripts/demo.sh [--tp N] [--helix-kvp-size KVP (1 = plain TP)]
#                        [--attention-backend torch_native|triton] [-- extra server flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  echo "demo.sh: run 'bash scripts/setup.sh' first" >&2; exit 1
fi
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/demo.py" "$@"
