"""CPU test harness: run the real SGLang server on a machine without a GPU (see docs/cpu-harness.md)."""
