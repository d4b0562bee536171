"""The environment SGLang's CPU engine needs (see docs/cpu-harness.md)."""

from __future__ import annotations

import os

STUB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sgl_kernel_stub")

# The model modules the test servers serve: the families the series opts in (and SmolLM2, a
# Llama), the Llama EAGLE head, and the hybrid Qwen3.5 (its text-only entry classes live in
# qwen3_5_text, its layers in qwen3_5; test/test_qwen3_5_harness.py). Every other module of
# sglang.srt.models is skipped by the default tier's servers (SGLANG_DISABLED_MODEL_ARCHS, below).
SERVED_MODEL_MODULES = (
    "llama", "llama_eagle", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text",
    "qwen3_5_mtp",
)  # fmt: skip


def unserved_model_modules() -> list[str]:
    """Every module of ``sglang.srt.models`` but ``SERVED_MODEL_MODULES`` (read from the package's
    directory: nothing is imported)."""
    import importlib.util

    (models_dir,) = importlib.util.find_spec("sglang.srt.models").submodule_search_locations
    names = (f[:-3] for f in os.listdir(models_dir) if f.endswith(".py") and f != "__init__.py")
    return sorted(n for n in names if n not in SERVED_MODEL_MODULES)


def omp_threads_bind(num_ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND``: one core per rank, round-robin over the usable cores.

    SGLang asserts one entry per TP rank; on a 2-core machine 4 ranks share cores (``0|1|0|1``).
    """
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[r % len(cores)]) for r in range(num_ranks))


def cpu_server_env(
    num_ranks: int,
    attention_backend: str = "torch_native",
    stub_log: str | None = None,
    base: dict | None = None,
) -> dict:
    """Environment for ``python -m sglang.launch_server --device cpu`` with ``num_ranks`` ranks."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_threads_bind(num_ranks)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STUB_DIR, env.get("PYTHONPATH", "")) if p)
    # Triton kernels run on CPU tensors under the interpreter: slow but exact -- the kernel source
    # a GPU compiles. Only for the triton attention backend: torch_native needs no Triton kernel
    # (Helix's merge takes its torch path on a CPU without the interpreter, helix/comm.py), and
    # the variable is removed even when the caller has it (test modules set it in pytest itself).
    if attention_backend == "triton":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    if stub_log:
        env["SGL_KERNEL_STUB_LOG"] = stub_log
    # Nothing may be fetched at run time.
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    # Upstream torch.compiles a few helpers on the CPU too (the vocab-parallel embedding's integer
    # input mask at every --tp > 1; the seeded sampler): each rank ran dynamo + inductor (with its
    # compile workers) on its first forward, ~3 CPU-s and more per rank and server start. The
    # default test tier runs them eagerly (the same ops; the series changes none of them);
    # HELIX_TEST_FULL=1 keeps upstream's compiled path. A caller's own TORCHDYNAMO_DISABLE wins.
    # Likewise SGLang's model registry imports every module of sglang.srt.models (~250; 2.6
    # CPU-s) in the launcher and in every rank, for the one architecture a server serves: the
    # default tier's servers skip the modules no test serves (upstream's own switch);
    # HELIX_TEST_FULL=1 imports them all. A caller's own SGLANG_DISABLED_MODEL_ARCHS wins.
    if env.get("HELIX_TEST_FULL") != "1":
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
        env.setdefault("SGLANG_DISABLED_MODEL_ARCHS", ",".join(unserved_model_modules()))
    # On SIGTERM the server sleeps 5 s "to let GPU activity settle" before py-spy / CUDA coredump
    # diagnostics (tokenizer_manager.py, both on by default): on the CPU there is no GPU activity
    # and no coredump, and every test server's stop paid the 5 s.
    env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
    env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env
