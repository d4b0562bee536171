"""sglang-helix: Helix parallelism for SGLang, as a patch series on a pinned release.

This small package holds the project's tooling (series install/check/revert/export) and the CPU
test harness. The Helix runtime code itself lives under ``python/sglang/`` at its upstream import
paths and is installed into SGLang by ``scripts/setup.sh``.
"""

PINNED_SGLANG_VERSION = "0.5.23"
