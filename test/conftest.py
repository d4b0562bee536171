"""Shared fixtures: tiny models and real SGLang servers on the CPU (see docs/cpu-harness.md)."""

from __future__ import annotations

import hashlib
import os

# The Triton kernels under test run under the interpreter on the CPU. Triton reads this when it is
# first imported, and any test module that imports sglang imports it: set it before collection.
# (Servers started by the tests get their own environment: testing/cpu_env.py.)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Every in-process launch of a Helix Triton kernel is recorded; a specialization missing from
# test/data/helix_triton_specializations.json (what test_triton_compile.py compiles for sm_90 and
# sm_100) fails the run (issue 35; python/sglang_helix/testing/triton_record.py).
from sglang_helix.testing.triton_record import (  # noqa: E402,F401
    pytest_configure,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

from sglang_helix.testing.server import CpuServer  # noqa: E402
from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model  # noqa: E402
from sglang_helix.testing.bytecode import compile_series_bytecode  # noqa: E402

# The series' files in site-packages have no bytecode after an install (it clears theirs), and with
# PYTHONDONTWRITEBYTECODE=1 no process writes it: every process of every test server compiled those
# ~2.7 MB of source again (~1 CPU-s each). Compile them once per session (the same source).
compile_series_bytecode()

# Tiers. The default run (CI, the README's test command) covers every concern once; the rest of
# each end-to-end matrix is marked FULL and runs with HELIX_TEST_FULL=1 (README, "Test").
FULL_RUN = os.environ.get("HELIX_TEST_FULL") == "1"
FULL = pytest.mark.full


def pytest_collection_modifyitems(config, items):
    if FULL_RUN:
        return
    skip = pytest.mark.skip(reason="full matrix: HELIX_TEST_FULL=1")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


# GQA: 8 query heads, 4 KV heads (K = N at --tp 4).
GQA = TinyModelSpec(num_heads=8, num_kv_heads=4, head_dim=16, num_layers=2)
# Fewer KV heads than ranks at --tp 4: the case Helix exists for.
MQA = TinyModelSpec(num_heads=8, num_kv_heads=1, head_dim=16, num_layers=2)
KV2 = TinyModelSpec(num_heads=8, num_kv_heads=2, head_dim=16, num_layers=2)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(spec)`` writes (once per session) and returns a tiny Llama checkpoint."""
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def make(spec: TinyModelSpec = GQA) -> str:
        if spec not in cache:
            # Every field in the name (a digest of the rest): two specs never share a directory.
            digest = hashlib.sha1(repr(spec).encode()).hexdigest()[:8]
            name = f"{spec.arch}_q{spec.num_heads}_k{spec.num_kv_heads}_d{spec.head_dim}_{digest}"
            cache[spec] = write_tiny_model(str(root / name), spec)
        return cache[spec]

    return make


@pytest.fixture(scope="session")
def eagle_draft(model_dir, tmp_path_factory):
    """A ``LlamaForCausalLMEagle`` head fitted to GQA's greedy continuations of ``PROMPTS``
    (``sglang_helix.testing.eagle_fit``, ~10 s): its drafts are accepted, so an EAGLE test can
    tell speculation that works from a fallback to the target's token."""
    from sglang_helix.testing.eagle_fit import fit_eagle_draft
    from sglang_helix.testing.openai_probe import PROMPTS

    fitted = fit_eagle_draft(str(tmp_path_factory.mktemp("eagle-fit") / "draft"), model_dir(GQA), PROMPTS, new_tokens=24)
    assert fitted["train_accuracy"] > 0.9, fitted
    return fitted["path"]


@pytest.fixture(scope="session")
def server_log_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("server-logs"))


@pytest.fixture(scope="session")
def qwen3_5_dirs(tmp_path_factory):
    """The tiny Qwen3.5 checkpoints (``qwen3_5_models``: dense, MoE), one copy for the session, so
    the plain-TP servers of ``test_qwen3_5_harness.py`` are the baselines of ``test_helix_qwen3_5.py``."""
    from sglang_helix.testing.qwen3_5_models import DENSE, MOE, write_qwen3_5_model

    root = tmp_path_factory.mktemp("qwen3_5")
    return {
        "dense": write_qwen3_5_model(str(root / "dense"), DENSE),
        "moe": write_qwen3_5_model(str(root / "moe"), MOE),
    }


@pytest.fixture(scope="session")
def mtp_dirs(tmp_path_factory):
    """``mtp_dirs(model)``: the tiny Qwen3.5 checkpoint with its MTP layer (written once a session:
    ``test_qwen3_5_mtp.py``'s plain-TP MTP servers are the references of the PD pairs with the
    draft, ``test_helix_qwen3_5_pd.py``)."""
    from sglang_helix.testing.qwen3_5_models import DENSE_MTP, MOE_MTP, write_qwen3_5_model

    root = tmp_path_factory.mktemp("qwen3_5_mtp")
    cache = {}

    def make(model: str) -> str:
        if model not in cache:
            spec = {"dense": DENSE_MTP, "moe": MOE_MTP}[model]
            cache[model] = write_qwen3_5_model(str(root / model), spec)
        return cache[model]

    return make


def start_server(
    model_path: str, args: list[str], backend: str, log_dir: str, extra_env: dict | None = None
) -> CpuServer:
    timeout = float(os.environ.get("HELIX_TEST_STARTUP_TIMEOUT", "900"))
    return CpuServer(
        model_path, args, attention_backend=backend, startup_timeout=timeout, log_dir=log_dir, extra_env=extra_env
    ).start()


def stop_server(srv: CpuServer) -> None:
    """Stop ``srv``; fail if any process survived or any sgl_kernel stub function was called."""
    calls = srv.stub_calls()
    srv.stop()  # raises if a process of the tree survives
    assert not calls, f"sgl_kernel stub functions were called: {calls}"


# Results of workloads against servers, shared by every test module of the session, so a
# baseline run once serves as the reference for every layout compared with it.
_RESULTS: dict = {}


def run_workload(model_path: str, args: list, backend: str, log_dir: str, workload, key=None, extra_env=None):
    """Start a server with ``args``, run ``workload(base_url)``, stop it; cached per session."""
    key = key or (model_path, tuple(args), backend, getattr(workload, "__name__", str(workload)))
    if key not in _RESULTS:
        srv = start_server(model_path, list(args), backend, log_dir, extra_env)
        try:
            _RESULTS[key] = workload(srv.base_url)
        finally:
            stop_server(srv)
    return _RESULTS[key]


@pytest.fixture(scope="session")
def fp8_root(tmp_path_factory):
    """Where the FP8 checkpoints are written (``fp8_checkpoints``), shared by the FP8 modules."""
    return str(tmp_path_factory.mktemp("fp8-checkpoints"))


def fp8_workload(base_url):
    """The probe (greedy tokens, logprobs, top-2) and every rank's weight checksums: an FP8
    server's results, shared by test_fp8_cpu.py and test_helix_fp8.py (the same plain TP server)."""
    from sglang_helix.testing.openai_probe import probe
    from sglang_helix.testing.weights import weight_checksums

    return {"probe": probe(base_url), "checksums": weight_checksums(base_url)}


def plain_tp_reference(base_url):
    """What every layout is compared with: the probe, the long prompt, one answer per wave prompt;
    and every rank's weight checksums (test_helix_weights.py reads the plain ``--tp 4`` server's,
    so that plain TP's loader is checked without a server of its own)."""
    from sglang_helix.testing.openai_probe import long_completion, probe, single_completions, sized_completions
    from sglang_helix.testing.weights import weight_checksums

    return {"probe": probe(base_url), "long": long_completion(base_url), "singles": single_completions(base_url),
            "sized": sized_completions(base_url), "checksums": weight_checksums(base_url)}  # fmt: skip
