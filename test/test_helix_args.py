"""The Helix flags and their fail-fast validation (sglang/srt/arg_groups/helix_hook.py).

Everything but the two ``launch_server`` tests runs SGLang's own argument path in-process:
``prepare_server_args(argv)`` (what ``python -m sglang.launch_server`` calls) and
``ServerArgs.resolve_once()`` (the resolution pipeline ``run_server`` starts with), against tiny
Llama checkpoints. No server starts, no weights load.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from sglang_helix.testing.cpu_env import STUB_DIR, cpu_server_env
from sglang_helix.testing.tiny_models import ARCHS, TinyModelSpec, write_tiny_model

HELIX_FIELDS = ("helix_kvp_size", "helix_kvp_chunk_size", "dcp_interleave_size")
GQA_MODE = ["--dcp-size", "2", "--dcp-replicate-q-proj"]  # DCP's spelling of the mode (Helix's: later)
HOOK_SOURCE = "handle_helix_parallelism"


@pytest.fixture(scope="module", autouse=True)
def cpu_engine_env():
    """Without a GPU, resolve as the CPU server does: ``SGLANG_USE_CPU_ENGINE=1`` and the
    sgl_kernel stub first on the path (the real wheel cannot load without libcuda, and the CPU
    platform's resolution imports it). With a GPU the platform is left alone: SGLang caches it
    per process, and this process may run GPU tests after these."""
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        if not torch.cuda.is_available():
            mp.setenv("SGLANG_USE_CPU_ENGINE", "1")
            mp.syspath_prepend(STUB_DIR)
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """``model(q, k, inter)``: a tiny Llama with q query heads, k KV heads and MLP width inter
    (written once)."""
    root = tmp_path_factory.mktemp("helix-args-models")
    cache = {}

    def make(q: int = 8, k: int = 4, inter: int = 128) -> str:
        if (q, k, inter) not in cache:
            cache[(q, k, inter)] = write_tiny_model(
                str(root / f"q{q}k{k}i{inter}"),
                TinyModelSpec(num_heads=q, num_kv_heads=k, intermediate_size=inter),
            )
        return cache[(q, k, inter)]

    return make


def parse(model_path: str, args: list[str]):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", model_path, "--device", "cpu", *args])


def resolve(model_path: str, args: list[str]):
    server_args = parse(model_path, args)
    server_args.resolve_once()
    return server_args


def helix_error(model_path: str, args: list[str]) -> str:
    from sglang.srt.arg_groups.resolution_hooks import ServerArgsError

    with pytest.raises(ServerArgsError) as info:
        resolve(model_path, args)
    assert isinstance(info.value, ValueError)  # caught like every other arg hook's error
    return str(info.value)


def view(server_args):
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(server_args)


def gqa_mode(cfg) -> bool:
    from sglang.srt.arg_groups.helix_hook import dcp_gqa_mode

    return dcp_gqa_mode(cfg)


@contextmanager
def helix_log():
    """Records of the Helix hook's logger (``prepare_server_args`` resets the root handlers,
    so pytest's caplog does not see them)."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.INFO)
    loggers = [logging.getLogger(f"sglang.srt.arg_groups.{m}") for m in ("helix_hook", "parallel_hook")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


# --------------------------------------------------------------------------------------------
# The three flags
# --------------------------------------------------------------------------------------------
def test_kvp_size_below_one(model):
    assert helix_error(model(), ["--tp", "4", "--helix-kvp-size", "0"]) == (
        "--helix-kvp-size must be >= 1, got --helix-kvp-size 0. Use a positive --helix-kvp-size, "
        "or use --helix-kvp-size 1."
    )


def test_interleave_size_below_one(model):
    assert helix_error(model(), ["--tp", "4", "--dcp-interleave-size", "0"]) == (
        "--dcp-interleave-size must be >= 1, got --dcp-interleave-size 0. Use a positive "
        "--dcp-interleave-size."
    )


@pytest.mark.parametrize("chunk", ["0", "-64"])
def test_chunk_size_below_one(model, chunk):
    assert helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", chunk]) == (
        f"--helix-kvp-chunk-size must be >= 1, got --helix-kvp-chunk-size {chunk}. Use a positive "
        "--helix-kvp-chunk-size, or use --helix-kvp-size 1."
    )


def test_tp_not_divisible_by_kvp(model):
    assert helix_error(model(), ["--tp", "4", "--helix-kvp-size", "3"]) == (
        "--helix-kvp-size 3 does not divide --tp 4: Helix arranges the --tp ranks as a KVP x TPA "
        "grid. Use --helix-kvp-size 2 or 4, or use --helix-kvp-size 1."
    )


# --------------------------------------------------------------------------------------------
# The model: K KV heads, Q query heads, architecture
# --------------------------------------------------------------------------------------------
def test_tpa_exceeds_kv_heads(model):
    path = model(8, 2)
    assert helix_error(path, ["--tp", "8", "--helix-kvp-size", "2"]) == (
        f"TPA = --tp 8 / --helix-kvp-size 2 = 4 exceeds the 2 KV heads of --model-path {path}: "
        "each attention-TP rank holds whole KV heads, none duplicated. Use --helix-kvp-size 4 or 8, "
        "or use --helix-kvp-size 1."
    )


def test_kv_heads_not_divisible_by_tpa(model):
    path = model(24, 6)
    assert helix_error(path, ["--tp", "8", "--helix-kvp-size", "2"]) == (
        f"TPA = --tp 8 / --helix-kvp-size 2 = 4 does not divide the 6 KV heads of --model-path "
        f"{path}: each attention-TP rank holds whole KV heads, none duplicated. Use "
        "--helix-kvp-size 4 or 8, or use --helix-kvp-size 1."
    )


def test_query_heads_not_divisible_by_tp(model):
    path = model(6, 2)
    assert helix_error(path, ["--tp", "4", "--helix-kvp-size", "2"]) == (
        f"The 6 query heads of --model-path {path} are not divisible by --tp 4: after the Helix "
        "All-to-All each rank owns an equal share of them. Use a --tp that divides 6, or use "
        "--helix-kvp-size 1."
    )


def test_unsupported_architecture(model, tmp_path):
    import shutil

    path = str(tmp_path / "gemma")
    shutil.copytree(model(), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["GemmaForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    assert helix_error(path, ["--tp", "4", "--helix-kvp-size", "2"]) == (
        "--helix-kvp-size 2 supports only LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, "
        "Qwen3_5MoeForCausalLM or Qwen3_5MoeForConditionalGeneration models (SGLang's own model code), but "
        f"--model-path {path} is GemmaForCausalLM. Serve a supported model, or use --helix-kvp-size 1."
    )


def test_model_class_must_opt_in(model, monkeypatch):
    """An architecture is served only while its model class declares ``supports_dcp_gqa`` in its own
    body (set by the model's patch; the one source of the opt-in): before that patch,
    --helix-kvp-size > 1 is refused at argument time instead of running an attention that ignores
    it. What every prefix of the series checks (``series prefixes``)."""
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.mistral import MistralForCausalLM

    assert vars(LlamaForCausalLM)["supports_dcp_gqa"] and vars(MistralForCausalLM)["supports_dcp_gqa"]
    from sglang.srt.arg_groups.helix_hook import helix_architectures, join

    monkeypatch.setattr(LlamaForCausalLM, "supports_dcp_gqa", False)
    path = model()
    others = helix_architectures()  # (this prefix's opted-in families)
    assert "LlamaForCausalLM" not in others and others[:2] == ["MistralForCausalLM", "MixtralForCausalLM"]
    assert helix_error(path, ["--tp", "4", *GQA_MODE]) == (
        f"--dcp-size 2 --dcp-replicate-q-proj supports only {join(others)} models (SGLang's own model code), "
        f"but --model-path {path} is LlamaForCausalLM. Serve a supported model, or drop --dcp-replicate-q-proj."
    )


def test_inherited_opt_in_is_not_enough(model, tmp_path):
    """A subclass of an opted-in class that does not opt in itself (here the Llama-based
    ``LlamaForCausalLMEagle``) is refused: the opt-in is not inherited, so what is served is what
    the tests cover."""
    import shutil

    from sglang.srt.models.registry import ModelRegistry

    arch = "LlamaForCausalLMEagle"
    assert getattr(ModelRegistry.models.get(arch), "supports_dcp_gqa", False)
    path = str(tmp_path / "eagle")
    shutil.copytree(model(), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = [arch]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    assert f"but --model-path {path} is {arch}." in helix_error(path, ["--tp", "4", *GQA_MODE])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_supported_architectures(tmp_path, arch):
    """Every family whose attention opts in is accepted, from its real config fields (rope
    scaling, tied embeddings, experts), with K < N: Helix is on and shards the KV."""
    path = write_tiny_model(str(tmp_path / arch), TinyModelSpec(arch=arch, num_heads=8, num_kv_heads=2))
    with open(os.path.join(path, "config.json")) as f:
        assert f"{ARCHS[arch][1]}" in json.load(f)["architectures"]
    cfg = view(resolve(path, ["--tp", "4", *GQA_MODE, "--dcp-interleave-size", "64"]))
    assert gqa_mode(cfg) and cfg.page_size == 64  # DCP allocates pages of 64 x 2: one run per rank
    # DCP's GQA mode: the group, exchange, replicated Q and interleave are DCP's
    assert (cfg.dcp_size, cfg.dcp_comm_backend, cfg.dcp_replicate_q_proj, cfg.dcp_interleave_size) == (2, "a2a", True, 64)


def test_unsupported_model_impl(model):
    """The class checked is the one the model resolves to, --model-impl included (upstream's
    ``get_model_architecture``), so the Transformers backend's class is refused."""
    message = helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", "--model-impl", "transformers"])
    assert "(SGLang's own model code), but --model-path" in message and message.endswith(
        " is TransformersForCausalLM. Serve a supported model, or use --helix-kvp-size 1."), message


# --------------------------------------------------------------------------------------------
# Combinations Helix does not support
# --------------------------------------------------------------------------------------------
def _unsupported(feature, given, fix, why=""):  # the why is in docs/helix-flags.md, not in the message
    return f"--helix-kvp-size 2 does not support {feature} ({given}). {fix}, or use --helix-kvp-size 1."


_FP8_FIX = "Serve a bf16 or FP8 checkpoint (fp8, compressed-tensors FP8)"
_WRAPPED = "it wraps the attention backend, which the Helix attention does not dispatch"

UNSUPPORTED = {
    "dcp-other-size": (  # Helix is DCP's GQA mode: a DCP flag that says otherwise is refused
        ["--dcp-size", "4"],
        "--helix-kvp-size 2 --helix-kvp-chunk-size 64 is --dcp-size 2 --dcp-comm-backend a2a "
        "--dcp-replicate-q-proj --dcp-interleave-size 64, but --dcp-size is 4. Drop --dcp-size, or "
        "use --helix-kvp-size 1.",
    ),
    "dcp-other-exchange": (
        ["--dcp-comm-backend", "ag_rs"],
        "--helix-kvp-size 2 --helix-kvp-chunk-size 64 is --dcp-size 2 --dcp-comm-backend a2a "
        "--dcp-replicate-q-proj --dcp-interleave-size 64, but --dcp-comm-backend is ag_rs. Drop "
        "--dcp-comm-backend, or use --helix-kvp-size 1.",
    ),
    "attn-cp": (
        ["--attn-cp-size", "2"],
        _unsupported("prefill context parallelism", "--attn-cp-size 2", "Set --attn-cp-size 1"),
    ),
    "prefill-cp": (
        ["--enable-prefill-cp"],
        _unsupported("prefill context parallelism", "--enable-prefill-cp", "Drop --enable-prefill-cp"),
    ),
    "dp-attention": (
        ["--enable-dp-attention", "--dp-size", "2"],
        _unsupported("DP attention", "--enable-dp-attention --dp-size 2", "Drop --enable-dp-attention",
                     "Helix shards every request over all KVP ranks"),
    ),
    "attn-dp": (
        ["--attn-dp-size", "2"],
        _unsupported("DP attention", "--attn-dp-size 2", "Set --attn-dp-size 1",
                     "Helix shards every request over all KVP ranks"),
    ),
    "pp": (
        ["--pp-size", "2"],
        _unsupported("pipeline parallelism yet", "--pp-size 2", "Set --pp-size 1"),
    ),
    "speculative-eagle3": (
        ["--speculative-algorithm", "EAGLE3"],
        _unsupported("EAGLE3 speculation yet", "--speculative-algorithm EAGLE3",
                     "Use --speculative-algorithm EAGLE, STANDALONE or NGRAM"),
    ),
    "pd-prefill": (  # Helix is a decode server; a decode server is accepted (test_pd_decode_is_accepted)
        ["--disaggregation-mode", "prefill"],
        _unsupported("the prefill side of prefill/decode disaggregation (Helix is a decode server)",
                     "--disaggregation-mode prefill", "Run the prefill server with plain --tp (no --helix-kvp-size)"),
    ),
    "pd-decode-nixl": (
        ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"],
        _unsupported("the nixl KV transfer backend yet", "--disaggregation-transfer-backend nixl",
                     "Use --disaggregation-transfer-backend mooncake"),
    ),
    "pd-decode-speculative": (  # EAGLE (NEXTN) is served there (test_qwen3_5_pd_decode_with_the_mtp_draft_is_accepted)
        ["--disaggregation-mode", "decode", "--speculative-algorithm", "NGRAM"],
        _unsupported("NGRAM speculation on a prefill/decode disaggregation decode server yet",
                     "--speculative-algorithm NGRAM", "Use --speculative-algorithm EAGLE (NEXTN), or drop --speculative-algorithm"),
    ),
    "lora": (
        ["--enable-lora"],
        _unsupported("LoRA adapters yet", "--enable-lora", "Drop --enable-lora",
                     "adapters are sliced for the TP layout, not the KVP x TPA one"),
    ),
    "hicache": (
        ["--enable-hierarchical-cache"],
        _unsupported("prefix-cache extensions", "--enable-hierarchical-cache",
                     "Drop --enable-hierarchical-cache",
                     "other tree backends, host or remote KV tiers and sessions are not verified with the sequence-sharded pool"),
    ),
    "page-size": (
        ["--page-size", "16"],
        "--helix-kvp-size 2 allocates KV in pages of one --helix-kvp-chunk-size (64) per rank, but "
        "--page-size is 16. Pass --page-size 1 (or 64), or use --helix-kvp-size 1.",
    ),
    "attention-backend": (
        ["--attention-backend", "flashinfer"],
        "--helix-kvp-size 2 supports only the attention backends triton or torch_native, but "
        "--attention-backend is flashinfer. Pass --attention-backend triton (or torch_native), "
        "or use --helix-kvp-size 1.",
    ),
    "decode-attention-backend": (
        ["--attention-backend", "triton", "--decode-attention-backend", "fa3"],
        "--helix-kvp-size 2 supports only the attention backends triton or torch_native, but "
        "--decode-attention-backend is fa3. Pass --attention-backend triton (or torch_native), "
        "or use --helix-kvp-size 1.",
    ),
    # Prefill and decode on different backends: SGLang wraps them in a HybridAttnBackend, which
    # the GQA mode does not run (one backend serves both phases).
    "split-backends": (
        ["--prefill-attention-backend", "triton", "--decode-attention-backend", "torch_native"],
        _unsupported("different prefill and decode attention backends",
                     "--prefill-attention-backend triton --decode-attention-backend torch_native",
                     "Pass one --attention-backend"),
    ),
    "split-decode-backend": (
        ["--attention-backend", "triton", "--decode-attention-backend", "torch_native"],
        _unsupported("different prefill and decode attention backends",
                     "--attention-backend triton --decode-attention-backend torch_native",
                     "Pass one --attention-backend"),
    ),
    # From the pass over every flag group (docs/helix-flags.md).
    **{
        case: (flags, _unsupported(feature, given or " ".join(flags), fix, why))
        for case, flags, feature, given, fix, why in [
            ("decoupled-spec", ["--decoupled-spec-role", "verifier"], "decoupled speculative decoding yet",
             None, "Drop --decoupled-spec-role", ""),
            ("flexkv", ["--enable-flexkv"], "prefix-cache extensions", None, "Drop --enable-flexkv",
             "other tree backends, host or remote KV tiers and sessions are not verified with the sequence-sharded pool"),
            ("session-radix", ["--enable-session-radix-cache"], "prefix-cache extensions", None,
             "Drop --enable-session-radix-cache", "other tree backends, host or remote KV tiers and sessions are not verified with the sequence-sharded pool"),
            ("streaming-session", ["--enable-streaming-session"], "prefix-cache extensions", None,
             "Drop --enable-streaming-session", "a session's next request reuses its KV as a prefix"),
            ("unified-memory", ["--enable-unified-memory"], "the unified memory pool", None,
             "Drop --enable-unified-memory", "Helix shards the per-layer KV pool by rows"),
            ("page-major-kv", ["--enable-page-major-kv-layout"], "the unified memory pool", None,
             "Drop --enable-page-major-kv-layout", "Helix shards the per-layer KV pool by rows"),
            ("hisparse", ["--enable-hisparse"], "hierarchical sparse attention", None,
             "Drop --enable-hisparse", ""),
            ("kv-canary", ["--kv-canary", "log"], "the KV cache canary", None, "Drop --kv-canary",
             "it reads the KV pool by allocator id, and Helix ids are not rows"),
            ("mixed-chunk", ["--enable-mixed-chunk"], "mixed chunked prefill yet", None,
             "Drop --enable-mixed-chunk", ""),
            ("two-batch-overlap", ["--enable-two-batch-overlap"], "attention-backend wrappers", None,
             "Drop --enable-two-batch-overlap", _WRAPPED),
            ("pdmux", ["--enable-pdmux"], "attention-backend wrappers", None, "Drop --enable-pdmux", _WRAPPED),
            ("megakernel", ["--enable-nvidia-megakernel"], "decode megakernels", None,
             "Drop --enable-nvidia-megakernel", "they replace the decode forward, Helix attention included"),
            ("mis", ["--enable-mis"], "multi-item scoring", None, "Drop --enable-mis",
             "the Helix attention does not apply its attention mask"),
            ("dllm", ["--dllm-algorithm", "LowConfidence"], "diffusion LLM inference", None,
             "Drop --dllm-algorithm", ""),
            ("layernorm-sp", ["--enable-layernorm-sp"], "sequence-parallel attention input", None,
             "Drop --enable-layernorm-sp", "the Helix attention needs every token on every rank"),
            ("attn-input-scattered", ["--enable-attn-tp-input-scattered"], "sequence-parallel attention input",
             None, "Drop --enable-attn-tp-input-scattered", "the Helix attention needs every token on every rank"),
            ("torch-compile", ["--enable-torch-compile"], "torch.compile yet", None,
             "Drop --enable-torch-compile", "the KVP All-to-All is not captured yet"),
            ("deterministic", ["--enable-deterministic-inference"], "deterministic inference yet", None,
             "Drop --enable-deterministic-inference",
             "batch invariance of the Helix attention and merge is not verified"),
            ("offload", ["--cpu-offload-gb", "1"], "weight offloading yet", None, "Set --cpu-offload-gb 0", ""),
            ("embedding", ["--is-embedding"], "embedding models yet", None, "Drop --is-embedding", ""),
            ("ep-size", ["--ep-size", "2"], "expert parallelism yet", None, "Set --ep-size 1",
             "Helix MoE models are verified with the experts sharded as plain TP shards them"),
            ("quantization-awq", ["--quantization", "awq"], "awq weights yet", None, _FP8_FIX, ""),
            ("quantization-w8a8-int8", ["--quantization", "w8a8_int8"], "w8a8_int8 weights yet", None, _FP8_FIX, ""),
            ("modelopt", ["--modelopt-quant", "fp8"], "ModelOpt quantization yet", None, "Drop --modelopt-quant", ""),
            ("kv-nvfp4", ["--kv-cache-dtype", "nvfp4"], "block-scaled KV cache recipes yet", None,
             "Use --kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2", ""),
            ("kv-mxfp8", ["--kv-cache-dtype", "mxfp8"], "block-scaled KV cache recipes yet", None,
             "Use --kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2", ""),
        ]
    },
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_combination(model, case):
    extra, message = UNSUPPORTED[case]
    assert helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", *extra]) == message


@pytest.mark.parametrize(
    "field,value,message",
    [
        (
            "attention_backend",
            "flashinfer",
            "--helix-kvp-size 2 supports only the attention backends triton or torch_native, "
            "but --attention-backend is flashinfer. Pass --attention-backend triton "
            "(or torch_native), or use --helix-kvp-size 1.",
        ),
        (
            "page_size",
            16,
            "--helix-kvp-size 2 allocates KV in pages of one --helix-kvp-chunk-size (64) per rank, "
            "but --page-size is 16. Pass --page-size 1 (or 64), or use --helix-kvp-size 1.",
        ),
    ],
)
def test_final_values_are_checked(model, field, value, message):
    """A handler after the mode's resolution that picks another backend or page size is caught
    by ``finalize_dcp_gqa_mode``, over the final values."""
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.arg_groups.overrides import declare_resolution

    def late_change(server_args, previous):
        previous(server_args)
        declare_resolution(server_args, "test_late_change", **{field: value})

    name = "handle_model_capability_adjustments"
    resolution_hooks.register_resolution_hook(name)(late_change)
    try:
        assert helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", "--attention-backend", "torch_native"]) == message
    finally:
        resolution_hooks._HOOKS[name].remove(late_change)
        if not resolution_hooks._HOOKS[name]:
            del resolution_hooks._HOOKS[name]


@pytest.mark.parametrize("extra", [[], ["--chunked-prefill-size", "100"]], ids=["defaults", "chunk"])
def test_each_check_runs_once(model, monkeypatch, extra):
    """The mode's checks run once per launch (``resolve_dcp_gqa_mode``: the flags, the features, the
    linear-attention cache; ``finalize_dcp_gqa_mode``: the final backend and page); its resolution
    step after the CUDA graph step checks nothing, and resolving twice declares nothing new."""
    from sglang.srt.arg_groups import helix_hook

    calls = []
    for name in ("check_unsupported_flags", "_check_features", "_check_attention_backends",
                 "_check_kv_page", "_check_linear_attention_cache"):  # fmt: skip
        def counted(cfg, *rest, _name=name, _check=getattr(helix_hook, name)):
            calls.append(_name)
            return _check(cfg, *rest)

        monkeypatch.setattr(helix_hook, name, counted)
    on = resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--attention-backend", "triton", *extra])
    assert sorted(calls) == sorted(["check_unsupported_flags", "_check_features", "_check_attention_backends",
                                    "_check_kv_page", "_check_linear_attention_cache"]), calls  # fmt: skip
    declared = [fields for src, fields in on._resolved_overrides if src == HOOK_SOURCE]
    calls.clear()
    helix_hook.handle_helix_parallelism(on)  # the resolution again over the final values
    assert calls == [] and [f for src, f in on._resolved_overrides if src == HOOK_SOURCE] == declared
    assert view(on).chunked_prefill_size % 128 == 0  # whole pages of 64 x 2, the default chunk too


def test_a_device_the_mode_does_not_run_on_is_refused(model):
    assert helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", "--device", "xpu"]) == (
        "--helix-kvp-size 2 runs on --device cuda or cpu, not xpu. Use --helix-kvp-size 1."
    )


# --------------------------------------------------------------------------------------------
# What Helix switches off, and what it resolves
# --------------------------------------------------------------------------------------------
def test_helix_keeps_the_radix_cache_and_decode_cuda_graphs(model):
    """Decode CUDA graphs stay on under Helix, as under upstream DCP (the Triton decode step is
    captured); prefill graphs are switched off (the extend lists are sized on the host), with a
    warning only when they were on."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    # Upstream defaults: radix cache on, CUDA graphs on (decode; prefill too on some platforms).
    args = ["--tp", "4", "--attention-backend", "triton"]
    plain = view(resolve(model(), args))
    assert plain.disable_radix_cache is False
    assert plain.cuda_graph_config.decode.backend != Backend.DISABLED
    prefill_on = plain.cuda_graph_config.prefill.backend != Backend.DISABLED

    with helix_log() as records:
        cfg = view(resolve(model(), [*args, "--helix-kvp-size", "2"]))
    assert cfg.disable_radix_cache is False  # prefix reuse in whole KV pages (test_helix_prefix_cache.py)
    assert cfg.disable_cuda_graph is False
    assert cfg.cuda_graph_config.decode.backend == plain.cuda_graph_config.decode.backend
    assert cfg.cuda_graph_config.prefill.backend == Backend.DISABLED
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings == [
        "Helix parallelism (--helix-kvp-size 2): disabling prefill CUDA graphs (the extend lists are sized "
        "on the host); decode graphs stay on."
    ] * prefill_on


def test_disable_cuda_graph_turns_helix_decode_graphs_off(model):
    from sglang.srt.model_executor.cuda_graph_config import Backend

    cfg = view(resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--attention-backend", "triton",
                                 "--disable-cuda-graph"]))  # fmt: skip
    assert cfg.disable_cuda_graph is True
    assert cfg.cuda_graph_config is None or cfg.cuda_graph_config.decode.backend == Backend.DISABLED


def test_no_warning_when_already_off(model):
    with helix_log() as records:
        cfg = view(resolve(model(), [
            "--tp", "4", "--helix-kvp-size", "2", "--attention-backend", "triton",
            "--disable-radix-cache", "--cuda-graph-backend-decode", "disabled",
        ]))  # fmt: skip
    assert cfg.disable_radix_cache is True  # --disable-radix-cache still works
    assert [r for r in records if r.levelno >= logging.WARNING] == []


def test_flags_resolve_into_dcp_and_default_backend(model):
    with helix_log() as records:
        server_args = resolve(model(), ["--tp", "4", "--helix-kvp-size", "2"])
    cfg = view(server_args)
    assert (cfg.dcp_size, cfg.dcp_comm_backend, cfg.dcp_replicate_q_proj, cfg.dcp_interleave_size) == (2, "a2a", True, 64)
    assert cfg.page_size == 64  # DCP allocates in pages of page x dcp_size: one chunk per rank
    assert server_args.dcp_size == 1  # the raw input is kept; the 2 is a declaration
    assert cfg.attention_backend == "torch_native"  # --device cpu; triton elsewhere
    messages = [r.getMessage() for r in records]
    assert "Helix parallelism: attention backend not specified; using torch_native." in messages
    assert (
        "Helix parallelism: --helix-kvp-size 2 --helix-kvp-chunk-size 64 resolves to --dcp-size 2 "
        "--dcp-comm-backend a2a --dcp-replicate-q-proj --dcp-interleave-size 64 (TPA = --tp 4 / 2 = 2)."
    ) in messages


RESOLVED_FIELDS = (
    "dcp_size", "dcp_comm_backend", "dcp_replicate_q_proj",
    "dcp_interleave_size", "page_size", "attention_backend", "chunked_prefill_size", "max_prefill_tokens",
    "disable_cuda_graph", "tp_size",
)  # fmt: skip


@pytest.mark.parametrize("chunk", ["64", "16", "1"])
def test_both_spellings_resolve_the_same(model, chunk):
    """``--helix-kvp-size K --helix-kvp-chunk-size C`` and ``--dcp-size K --dcp-comm-backend a2a
    --dcp-replicate-q-proj --dcp-interleave-size C`` on a GQA model are one server."""
    helix = view(resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", chunk]))
    dcp = view(resolve(model(), [
        "--tp", "4", "--dcp-size", "2", "--dcp-comm-backend", "a2a", "--dcp-replicate-q-proj",
        "--dcp-interleave-size", chunk,
    ]))  # fmt: skip
    assert {f: getattr(dcp, f) for f in RESOLVED_FIELDS} == {f: getattr(helix, f) for f in RESOLVED_FIELDS}
    assert gqa_mode(helix) and gqa_mode(dcp) and helix.dcp_size == 2


def test_dcp_spelling_refusals_name_the_dcp_flags(model):
    """A refusal names the mode as it was launched: DCP's flags, or Helix's."""
    message = helix_error(model(), [
        "--tp", "4", "--dcp-size", "2", "--dcp-comm-backend", "a2a", "--dcp-replicate-q-proj", "--pp-size", "2",
    ])  # fmt: skip
    assert message == (
        "--dcp-size 2 --dcp-replicate-q-proj does not support pipeline parallelism yet (--pp-size 2). "
        "Set --pp-size 1, or drop --dcp-replicate-q-proj."
    )
    message = helix_error(model(), ["--tp", "4", "--dcp-size", "3", "--dcp-replicate-q-proj"])
    assert message == (
        "--dcp-size 3 does not divide --tp 4: Helix arranges the --tp ranks as a KVP x TPA grid. "
        "Use --dcp-size 2 or 4, or drop --dcp-replicate-q-proj."
    )


def test_interleave_needs_the_gqa_mode(model):
    assert helix_error(model(), ["--tp", "4", "--dcp-size", "2", "--dcp-interleave-size", "4"]) == (
        "--dcp-interleave-size 4 needs DCP's GQA mode (--dcp-size > 1 --dcp-replicate-q-proj on a GQA "
        "model). Drop --dcp-interleave-size."
    )


# DCP's default exchange per platform (overrides._dcp_comm_backend_default): (is_cuda, is_hip, is_xpu,
# fi_a2a supported) -> the exchange plain --dcp-size picks there.
PLATFORM_DEFAULTS = {
    "cuda": ((True, False, False, False), "a2a"),
    "blackwell": ((True, False, False, True), "fi_a2a"),
    "hip": ((False, True, False, False), "a2a"),
    "xpu": ((False, False, True, False), "a2a"),
    "cpu": ((False, False, False, False), "ag_rs"),
}


@pytest.mark.parametrize("platform", list(PLATFORM_DEFAULTS))
def test_replicated_q_without_an_exchange_is_the_gqa_mode_on_every_platform(model, monkeypatch, platform):
    """``--dcp-size 2 --dcp-replicate-q-proj`` with no ``--dcp-comm-backend`` on a GQA model is the
    server ``--helix-kvp-size 2 --helix-kvp-chunk-size 1`` starts, whatever exchange DCP's default
    would pick on the platform (fi_a2a on Blackwell, a2a on CUDA/HIP/XPU, ag_rs on the CPU, where
    upstream refused replicated Q)."""
    from sglang.srt.arg_groups import overrides, parallel_hook

    (cuda, hip, xpu, fi_a2a), default = PLATFORM_DEFAULTS[platform]
    comm_backend_default = parallel_hook._dcp_comm_backend_default

    def on_platform(view):  # DCP's default exchange as that platform picks it (only there: the rest is the CPU's)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(overrides, "get_platform", lambda: SimpleNamespace(is_cuda=cuda, is_hip=hip, is_xpu=xpu))
            mp.setattr(overrides, "is_fi_a2a_supported", lambda **_: fi_a2a)
            return comm_backend_default(view)

    monkeypatch.setattr(parallel_hook, "_dcp_comm_backend_default", on_platform)
    plain = SimpleNamespace(dcp_comm_backend=None, dcp_size=2, tp_size=4, pp_size=1, nnodes=1)  # --dcp-size 2
    assert on_platform(plain) == {"dcp_comm_backend": default}  # what plain DCP gets there
    dcp = view(resolve(model(), ["--tp", "4", "--dcp-size", "2", "--dcp-replicate-q-proj"]))
    helix = view(resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", "1"]))
    assert {f: getattr(dcp, f) for f in RESOLVED_FIELDS} == {f: getattr(helix, f) for f in RESOLVED_FIELDS}
    assert (gqa_mode(dcp), dcp.dcp_comm_backend, dcp.dcp_replicate_q_proj) == (True, "a2a", True)


def test_replicated_q_with_an_all_to_all_named_is_the_gqa_mode(model):
    """``--dcp-comm-backend a2a`` named with ``--dcp-replicate-q-proj`` on a GQA model: the GQA
    mode too, so the Triton backend has one replicated-Q path."""
    args = ["--tp", "4", "--dcp-size", "2", "--dcp-comm-backend", "a2a", "--dcp-replicate-q-proj"]
    cfg = view(resolve(model(), args))
    assert (gqa_mode(cfg), cfg.dcp_comm_backend, cfg.dcp_replicate_q_proj) == (True, "a2a", True)


SPELLINGS = {
    "dcp": ["--dcp-size", "2", "--dcp-replicate-q-proj"],
    "helix": ["--helix-kvp-size", "2", "--helix-kvp-chunk-size", "1"],
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_fi_a2a_named_is_kept_in_both_spellings_and_refused_off_cuda_as_upstream(model, monkeypatch, spelling):
    """``--dcp-comm-backend fi_a2a`` named with either spelling of the mode is the mode with
    FlashInfer's exchange; off CUDA upstream DCP's own check refuses it, with its message."""
    from sglang.srt.arg_groups import parallel_hook

    args = ["--tp", "4", *SPELLINGS[spelling], "--dcp-comm-backend", "fi_a2a"]
    with pytest.raises(ValueError, match="--dcp-comm-backend fi_a2a delegates the exchange to FlashInfer"):
        resolve(model(), args)
    cuda = SimpleNamespace(is_cuda=True, is_hip=False, is_xpu=False, is_npu=False)
    monkeypatch.setattr(parallel_hook, "get_platform", lambda: cuda)
    cfg = view(resolve(model(), args))
    assert (gqa_mode(cfg), cfg.dcp_comm_backend, cfg.dcp_replicate_q_proj) == (True, "fi_a2a", True)


def test_replicated_q_with_another_exchange_stays_upstream(model):
    """An exchange the user names other than a2a is upstream DCP's (and its refusal on GQA)."""
    with pytest.raises(ValueError, match="--dcp-replicate-q-proj only applies to the a2a/fi_a2a"):
        resolve(model(), ["--tp", "4", "--dcp-size", "2", "--dcp-comm-backend", "ag_rs", "--dcp-replicate-q-proj"])


def test_plain_dcp_stays_upstream(model):
    """``--dcp-size`` with its default exchange (Q gathered) is upstream's DCP, not Helix."""
    cfg = view(resolve(model(), ["--tp", "4", "--dcp-size", "2"]))
    assert (gqa_mode(cfg), cfg.dcp_size, cfg.dcp_interleave_size) == (False, 2, 1)


def test_split_backend_flag_names_the_default(model):
    """With only --prefill-attention-backend (or --decode-...) given, the backend Helix picks for
    the other phase is that one, not the platform default: one backend runs both phases."""
    cfg = view(resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--prefill-attention-backend", "triton"]))
    assert (cfg.attention_backend, cfg.prefill_attention_backend, cfg.decode_attention_backend) == ("triton", "triton", None)


def _with_quantization_config(model_path: str, out: str, quantization_config: dict) -> str:
    import shutil

    shutil.copytree(model_path, out)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def _ct(weights: dict) -> dict:  # a compressed-tensors config of one scheme
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}


_FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
_FP8_BLOCK = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True}


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "fp8", "activation_scheme": "dynamic"},
    _ct(_FP8_CHANNEL),
], ids=["fp8-per-tensor", "ct-fp8-channel"])  # fmt: skip
def test_fp8_checkpoint_is_served(model, tmp_path, quantization_config):
    """FP8 checkpoints (SGLang fp8, compressed-tensors FP8) run under the mode (served:
    test_helix_fp8.py); so does --quantization fp8 on a bf16 checkpoint."""
    path = _with_quantization_config(model(), str(tmp_path / "fp8"), quantization_config)
    assert view(resolve(path, ["--tp", "4", "--helix-kvp-size", "2"])).helix_kvp_size == 2
    assert view(resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--quantization", "fp8"])).quantization == "fp8"


@pytest.mark.parametrize("method,what", [
    ("awq", "awq weights yet"),
    ("ct-int4", "compressed-tensors (4-bit int) weights yet"),
])  # fmt: skip
# (gptq and mxfp4 are refused the same way on the CPU engine; a process that imported sglang's
# quantization registry off the CPU engine first, as this session's collection can, stops earlier
# at upstream's "Unknown quantization method", so they are not asserted here.)
def test_non_fp8_checkpoint_is_refused_in_one_line(model, tmp_path, method, what):
    """A checkpoint whose own config declares a format the mode does not serve (no --quantization
    given) is refused at start, naming the format."""
    from sglang_helix.testing.fp8_checkpoints import write_int4_config_checkpoint

    out = str(tmp_path / method)
    if method == "ct-int4":
        path = _with_quantization_config(model(), out, _ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}))
    else:
        path = write_int4_config_checkpoint(model(), out, method)
    quant = "compressed-tensors" if method == "ct-int4" else method
    assert helix_error(path, ["--tp", "4", "--helix-kvp-size", "2"]) == _unsupported(what, f"--model-path {path} is {quant}-quantized", _FP8_FIX)


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    _ct(_FP8_BLOCK),
], ids=["fp8-block", "ct-fp8-block"])  # fmt: skip
def test_misaligned_fp8_block_is_refused_in_one_line(model, tmp_path, quantization_config):
    """A block-wise checkpoint whose qkv_proj shard at TPA is not whole 128-row blocks (here: head
    dim 16, 4 query / 2 KV heads per TPA rank) cannot be served: upstream would floor-divide the
    block offsets and give a rank another shard's scales."""
    path = _with_quantization_config(model(), str(tmp_path / "block"), quantization_config)
    method = quantization_config["quant_method"]
    assert helix_error(path, ["--tp", "4", "--helix-kvp-size", "2"]) == (
        f"--helix-kvp-size 2: --model-path {path} is {method}-quantized in 128-row blocks, but at TPA = --tp 4 / "
        "--helix-kvp-size 2 = 2 a qkv_proj shard has 32 or 64 rows per head group (not whole blocks). Serve a "
        "per-channel or per-tensor FP8 checkpoint, or use --helix-kvp-size 1."
    )


def test_smollm2_block_fp8_is_refused_in_one_line(tmp_path):
    """SmolLM2's 9 query heads of dim 64 make 576 q rows per TPA rank at ``--tp 3
    --helix-kvp-size 3``: not whole 128-row blocks, so its block-wise FP8 form is refused at start
    (the config alone: the refusal comes before any weight is read)."""
    import json
    import shutil

    from sglang_helix.testing.fp8_checkpoints import quantization_config
    from sglang_helix.testing.smollm2 import smollm2_checkpoint

    src, out = smollm2_checkpoint(), str(tmp_path / "smollm2-fp8-block")
    os.makedirs(out)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            shutil.copy2(os.path.join(src, f), out)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config("fp8-block")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    assert helix_error(out, ["--tp", "3", "--helix-kvp-size", "3"]) == (
        f"--helix-kvp-size 3: --model-path {out} is fp8-quantized in 128-row blocks, but at TPA = --tp 3 / "
        "--helix-kvp-size 3 = 1 a qkv_proj shard has 192 or 576 rows per head group (not whole blocks). Serve a "
        "per-channel or per-tensor FP8 checkpoint, or use --helix-kvp-size 1."
    )


# --------------------------------------------------------------------------------------------
# The CPU engine's MLP padding (the CPU-engine patch pads for TPA; the MLP stays sharded over N)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q,k,inter,tp,kvp", [
    (8, 4, 130, 4, 2),  # the CPU engine pads it for --tp 4 to 256 (served: test_helix_launch_sizes.py)
    (6, 3, 192, 3, 3),  # divisible as it is
    (6, 3, 128, 3, 3),  # padded for --tp 3 to 192 (the heads for TPA 1): accepted, no longer refused
])  # fmt: skip
def test_cpu_mlp_is_padded_for_tp(model, q, k, inter, tp, kvp):
    resolve(model(q, k, inter), ["--tp", str(tp), "--helix-kvp-size", str(kvp)])  # no error


# --------------------------------------------------------------------------------------------
# Sizes counted in KV pages (page = --helix-kvp-chunk-size x --helix-kvp-size)
# --------------------------------------------------------------------------------------------
PAGE_TABLE = [
    (kvp, chunk, cpp)
    for kvp in (2, 3, 4, 6, 8)
    for chunk in (1, 4, 64, 96)
    for cpp in (None, 128, 100, 8192, -1)
]


@pytest.fixture(scope="module")
def upstream_chunked_prefill(model):
    """The chunked prefill size resolution picks with Helix off, per --tp."""
    cache = {}

    def get(path, tp):
        if tp not in cache:
            cache[tp] = view(resolve(path, ["--tp", str(tp)])).chunked_prefill_size
        return cache[tp]

    return get


@pytest.mark.parametrize("kvp,chunk,cpp", PAGE_TABLE, ids=[f"kvp{k}-chunk{c}-cpp{p}" for k, c, p in PAGE_TABLE])
def test_page_multiples_resolve(model, upstream_chunked_prefill, kvp, chunk, cpp):
    """Every (KVP, chunk, chunked prefill) resolves to sizes the pipeline and check_server_args
    accept (it asserted ``chunked_prefill_size % page_size == 0`` for any page that did not divide
    the chunk: 128 at KVP 4, the default at KVP 3 or 6 or chunk 96)."""
    path = model(24, 4, 192)  # Q and intermediate_size divisible by every --tp here; TPA = 1
    args = ["--tp", str(kvp), "--helix-kvp-size", str(kvp), "--helix-kvp-chunk-size", str(chunk)]
    if cpp is not None:
        args += ["--chunked-prefill-size", str(cpp)]
    server_args = resolve(path, args)
    server_args.check_server_args()  # where the assertion was
    cfg = view(server_args)
    page = kvp * chunk  # DCP's allocation page: page_size (the chunk) x dcp_size
    assert (cfg.page_size, cfg.dcp_size) == (chunk, kvp)
    given = cpp if cpp is not None else upstream_chunked_prefill(path, kvp)
    if given == -1:
        assert cfg.chunked_prefill_size == -1  # disabled stays disabled
    else:
        assert cfg.chunked_prefill_size == max(page, given // page * page)
    assert cfg.max_prefill_tokens == 16384  # upstream's: it admits the same batches either way


def test_page_multiples_are_logged(model):
    with helix_log() as records:
        cfg = view(resolve(model(), ["--tp", "4", "--helix-kvp-size", "4", "--chunked-prefill-size", "100",
                                     "--max-prefill-tokens", "1000"]))  # fmt: skip
    assert (cfg.page_size, cfg.chunked_prefill_size, cfg.max_prefill_tokens) == (64, 256, 1000)
    page = "the Helix KV page (--helix-kvp-chunk-size 64 x --helix-kvp-size 4 = 256 tokens)"
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert f"Helix parallelism: --chunked-prefill-size 100 -> 256, a multiple of {page}: a prefill chunk must hold at least one page." in infos
    with helix_log() as records:
        cfg = view(resolve(model(), ["--tp", "2", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", "96"]))
    assert cfg.chunked_prefill_size % 192 == 0
    page = "the Helix KV page (--helix-kvp-chunk-size 96 x --helix-kvp-size 2 = 192 tokens)"
    down = [r.getMessage() for r in records if "--chunked-prefill-size" in r.getMessage()]
    assert down == [f"Helix parallelism: --chunked-prefill-size 4096 -> 4032, a multiple of {page}: the scheduler cuts prefill chunks at page boundaries."]


def test_page_multiples_final_values(model):
    """A handler after the first Helix run that sets another chunked prefill size is resolved by
    the second run, over the final values."""
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.arg_groups.overrides import declare_resolution

    def late_change(server_args, previous):
        previous(server_args)
        declare_resolution(server_args, "test_late_change", chunked_prefill_size=1000)

    name = "handle_model_capability_adjustments"
    resolution_hooks.register_resolution_hook(name)(late_change)
    try:
        server_args = resolve(model(), ["--tp", "4", "--helix-kvp-size", "2"])
    finally:
        resolution_hooks._HOOKS[name].remove(late_change)
        if not resolution_hooks._HOOKS[name]:
            del resolution_hooks._HOOKS[name]
    server_args.check_server_args()
    assert view(server_args).chunked_prefill_size == 896


def test_max_total_tokens_below_one_page(model):
    assert helix_error(model(), ["--tp", "4", "--helix-kvp-size", "4", "--max-total-tokens", "200"]) == (
        "--max-total-tokens 200 is less than one Helix KV page (--helix-kvp-chunk-size "
        "64 x --helix-kvp-size 4 = 256 tokens), in which each rank's KV rows are allocated. Pass "
        "--max-total-tokens 256 or more, or a smaller "
        "--helix-kvp-chunk-size, or use --helix-kvp-size 1."
    )
    resolve(model(), ["--tp", "4", "--helix-kvp-size", "4", "--max-total-tokens", "256"])


def test_accessors_and_published_parallel(model):
    from sglang.srt.arg_groups.helix_hook import dcp_gqa_mode
    from sglang.srt.runtime_context import create_context

    on = resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", "128"])
    off = resolve(model(), ["--tp", "4"])
    assert dcp_gqa_mode(view(on)) and not dcp_gqa_mode(view(off))

    parallel = create_context(on, role="test").parallel
    assert parallel.dcp_gqa_mode is True
    # The runtime reads DCP's fields: group width, exchange, interleave (no Helix group or ranks).
    assert (parallel.dcp_size, parallel.attn_dcp_size, parallel.dcp_interleave_size) == (2, 2, 128)
    assert (parallel.dcp_comm_backend, parallel.dcp_replicate_q_proj) == ("a2a", True)
    for gone in ("helix_tpa_size", "helix_kvp_rank", "helix_tpa_rank", "helix_kvp_group"):
        assert not hasattr(parallel, gone), gone
    parallel = create_context(off, role="test").parallel
    assert parallel.dcp_gqa_mode is False
    assert (parallel.helix_kvp_size, parallel.dcp_size, parallel.dcp_interleave_size) == (1, 1, 1)


@pytest.mark.parametrize(
    "helix_args",
    [[], ["--helix-kvp-size", "1", "--helix-kvp-chunk-size", "16"]],
    ids=["defaults", "explicit-kvp-1"],
)
def test_kvp1_resolves_like_upstream(model, monkeypatch, helix_args):
    """With --helix-kvp-size 1 the resolved ServerArgs equal those of the pipeline without the
    Helix step (upstream's: the series changes nothing else in resolution), helix fields aside."""
    from sglang.srt.arg_groups import helix_hook

    args = ["--tp", "4", "--attention-backend", "triton", "--random-seed", "1"]  # else it is random
    helix = resolve(model(), args + helix_args)
    assert [src for src, _ in helix._resolved_overrides if src == HOOK_SOURCE] == []

    for step in ("resolve_dcp_gqa_mode", "handle_helix_parallelism", "finalize_dcp_gqa_mode"):
        monkeypatch.setattr(helix_hook, step, lambda server_args: None)  # the pipeline without them
    upstream = resolve(model(), args)

    def strip(d):
        return {k: v for k, v in d.items() if k not in HELIX_FIELDS}

    assert strip(helix.resolved_dict()) == strip(upstream.resolved_dict())


def test_help_documents_flags(capsys):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(SystemExit) as info:
        prepare_server_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--helix-kvp-size HELIX_KVP_SIZE", "--helix-kvp-chunk-size HELIX_KVP_CHUNK_SIZE",
                 "--dcp-interleave-size DCP_INTERLEAVE_SIZE"):  # fmt: skip
        assert f"  {flag}\n" in out  # a documented option, not only the usage line
    assert "--helix-enable-cuda-graph" not in out  # decode graphs are on by default, as DCP's

    def squeeze(text):  # argparse wraps help text at any space or hyphen
        return "".join(text.split())

    for phrase in (
        "1 (the default) disables Helix.",
        "the same as --dcp-size KVP --dcp-comm-backend a2a --dcp-replicate-q-proj --dcp-interleave-size CHUNK",
        "the token at position p is stored on KVP rank (p // chunk) mod KVP (--dcp-interleave-size).",
    ):
        assert squeeze(phrase) in squeeze(out)
    # The reasons behind the defaults live in docs/helix-flags.md, not in --help.
    assert "TensorRT" not in out.split("--helix-kvp-size")[-1]


# --------------------------------------------------------------------------------------------
# What the user sees: python -m sglang.launch_server
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,args,message",
    [
        (
            (8, 4),
            ["--tp", "4", "--helix-kvp-size", "3"],
            "sglang serve: error: --helix-kvp-size 3 does not divide --tp 4: Helix arranges the "
            "--tp ranks as a KVP x TPA grid. Use --helix-kvp-size 2 or 4, or use --helix-kvp-size 1.",
        ),
        (
            # Model-dependent: fails after the HF config is read, still before any process starts.
            (8, 1),
            ["--tp", "4", "--helix-kvp-size", "2", "--attention-backend", "triton"],
            "sglang serve: error: TPA = --tp 4 / --helix-kvp-size 2 = 2 exceeds the 1 KV heads "
            "of --model-path {path}: each attention-TP rank holds whole KV heads, none duplicated. "
            "Use --helix-kvp-size 4, or use --helix-kvp-size 1.",
        ),
    ],
    ids=["kvp-does-not-divide-tp", "tpa-exceeds-kv-heads"],
)
def test_launch_server_fails_fast_without_traceback(model, spec, args, message):
    path = model(*spec)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", path, "--device", "cpu", *args]
    proc = subprocess.run(
        cmd, env=cpu_server_env(4), capture_output=True, text=True, timeout=180,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output  # like argparse's usage errors
    assert message.format(path=path) in proc.stderr.splitlines(), output
    assert "Traceback" not in output, output


def test_an_upstream_argument_error_is_a_usage_error_not_a_traceback(model):
    """launch_server prints a ServerArgsError as argparse prints a usage error: here upstream
    DCP's own check, which raises one, with Helix off (the [Server] patch)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model(), "--device", "cpu", "--tp", "2",
           "--dcp-size", "0"]  # fmt: skip
    proc = subprocess.run(cmd, env=cpu_server_env(2), capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output
    assert "sglang serve: error: Decode context parallel size (--dcp-size / --decode-context-parallel-size) must be >= 1, but got dcp_size=0." in proc.stderr.splitlines(), output


@pytest.mark.parametrize("error", ["ServerArgsError", "ValueError"])
def test_only_a_server_args_error_is_a_usage_error(error, capsys):
    """launch_server prints a ServerArgsError (a user's mistake) as a usage error; an internal
    ValueError (a bug in a resolution step) keeps its traceback (the [Server] patch)."""
    from types import SimpleNamespace

    from sglang.launch_server import run_server
    from sglang.srt.arg_groups.resolution_hooks import ServerArgsError

    exc = {"ServerArgsError": ServerArgsError, "ValueError": ValueError}[error]("a message")

    def resolve_once():
        raise exc

    server_args = SimpleNamespace(smg_grpc_mode=False, grpc_mode=False, resolve_once=resolve_once)
    if error == "ValueError":
        with pytest.raises(ValueError) as info:
            run_server(server_args)
        assert info.value is exc
        return
    with pytest.raises(SystemExit) as info:
        run_server(server_args)
    assert info.value.code == 2
    assert capsys.readouterr().err == "sglang serve: error: a message\n"


@pytest.mark.parametrize("chunk,kvp,ok", [(64, 2, True), (64, 4, True), (1, 8, True), (64, 3, False), (96, 2, False), (48, 4, False)])
def test_gpu_page_must_be_a_power_of_two(chunk, kvp, ok):
    """Off the CPU the paged allocator's Triton kernels take ``tl.arange(0, page_size)``: a page of
    chunk x KVP that is not a power of two would crash the first prefill on a GPU. The CPU engine
    allocates in torch (the table above serves pages of 192 there)."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups.helix_hook import _check_kv_page
    from sglang.srt.arg_groups.resolution_hooks import ServerArgsError

    cfg = SimpleNamespace(device="cuda", dcp_interleave_size=chunk, dcp_size=kvp, tp_size=kvp * 2, page_size=chunk,
                          max_total_tokens=None, chunked_prefill_size=None, _raw_input={"helix_kvp_size": kvp})  # fmt: skip
    _check_kv_page(SimpleNamespace(**{**vars(cfg), "device": "cpu"}))  # never on CPU
    if ok:
        _check_kv_page(cfg)
        return
    with pytest.raises(ServerArgsError) as info:
        _check_kv_page(cfg)
    msg = str(info.value)
    assert msg.startswith(f"--helix-kvp-chunk-size {chunk} x --helix-kvp-size {kvp} = {chunk * kvp}: on --device cuda")
    assert ("power-of-two --helix-kvp-size" in msg) == (kvp == 3), msg


def test_head_dim_the_exchange_cannot_take_is_refused_at_launch(tmp_path):
    """The All-to-All + LSE combine takes whole power-of-two head rows: a head dim of 24 is
    refused by the resolution step, naming the flag and the value, not at the first forward."""
    path = write_tiny_model(str(tmp_path / "hd24"), TinyModelSpec(num_heads=8, num_kv_heads=4, head_dim=24))
    msg = helix_error(path, ["--tp", "4", "--helix-kvp-size", "2"])
    assert "--helix-kvp-size 2 needs power-of-two attention head dims" in msg and "head_dim 24" in msg
    resolve(path, ["--tp", "4"])  # Helix off: upstream's


# --------------------------------------------------------------------------------------------
# Speculative decoding (issues 27, 33): EAGLE / STANDALONE chains and trees on torch_native and triton
# --------------------------------------------------------------------------------------------
def _spec(draft: str, topk: int = 1, steps: int = 3) -> list:
    return [
        "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
        "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
        "--speculative-num-draft-tokens", str(steps + 1 if topk == 1 else steps * topk),
    ]  # fmt: skip


def test_standalone_chain_on_torch_native_is_accepted(model):
    """The supported case resolves: the target as its own draft, a chain, torch_native (the
    CPU default under Helix)."""
    server_args = resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", *_spec(model())])
    cfg = view(server_args)
    assert cfg.speculative_algorithm == "STANDALONE" and cfg.speculative_eagle_topk == 1
    assert cfg.attention_backend == "torch_native" and cfg.helix_kvp_size == 2


@pytest.mark.parametrize("draft_backend", [None, "triton", "torch_native"])
def test_standalone_chain_on_triton_is_accepted(model, draft_backend):
    """Triton serves it too, the draft on either Helix backend."""
    extra = [] if draft_backend is None else ["--speculative-draft-attention-backend", draft_backend]
    server_args = resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--attention-backend", "triton", *_spec(model()), *extra])
    cfg = view(server_args)
    assert cfg.attention_backend == "triton" and cfg.speculative_algorithm == "STANDALONE"


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_tree_drafts_are_accepted(model, backend):
    """Tree drafts (top-k > 1) resolve on both Helix backends, pages of chunk x KVP included
    (upstream's paged tree drafting; torch_native joins its backends in the CPU speculative patch)."""
    server_args = resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--attention-backend", backend,
                                    *_spec(model(), topk=2)])  # fmt: skip
    cfg = view(server_args)
    assert (cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens, cfg.attention_backend) == (2, 6, backend)
    assert cfg.page_size > 1  # the Helix chunk: the paged tree layout


def test_ngram_resolves_on_torch_native(model):
    """NGRAM (no draft model; its default breadth-10 trees) at the default chunk (page 64)."""
    args = ["--tp", "4", "--helix-kvp-size", "2", "--attention-backend", "torch_native", "--speculative-algorithm", "NGRAM"]
    cfg = view(resolve(model(), args))
    assert (cfg.speculative_algorithm, cfg.speculative_eagle_topk, cfg.page_size) == ("NGRAM", 10, 64)


def test_ngram_trees_on_triton_are_upstreams_refusal(model):
    """On triton upstream's NGRAM check refuses trees on a paged pool (its verify's page tables); one
    line naming both values, no traceback through launch_server (its usage-error patch)."""
    args = ["--tp", "4", "--helix-kvp-size", "2", "--attention-backend", "triton", "--speculative-algorithm", "NGRAM"]
    with pytest.raises(ValueError, match=r"speculative_eagle_topk\(10\) > 1 with page_size\(64\) > 1"):
        resolve(model(), args)


@pytest.mark.parametrize(
    "extra, feature, given, fix, why",
    [
        (["--speculative-draft-attention-backend", "flashinfer"], "this draft attention backend",
         "--speculative-draft-attention-backend flashinfer", "Use triton or torch_native, or drop the flag", ""),
    ],
    ids=["draft-flashinfer"],
)  # fmt: skip
def test_speculative_refusals(model, extra, feature, given, fix, why):
    args = _spec(model())
    message = helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", *args, *extra])
    assert message == _unsupported(feature, given, fix, why)


def test_speculation_keeps_decode_graphs(model):
    """Speculation keeps decode CUDA graphs on: the draft's decode steps are captured (their lists
    fill in the graph); the verify and draft extend run eagerly (the draft-graph patch)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    for topk in (1, 2):
        args = ["--tp", "4", "--helix-kvp-size", "2", *_spec(model(), topk), "--attention-backend", "triton"]
        cfg = view(resolve(model(), args))
        assert cfg.disable_cuda_graph is False and cfg.cuda_graph_config.decode.backend != Backend.DISABLED
        assert cfg.cuda_graph_config.prefill.backend == Backend.DISABLED
        assert (cfg.speculative_algorithm, cfg.speculative_eagle_topk) == ("STANDALONE", topk)


@pytest.mark.parametrize(
    "extra,feature,given,fix,why",
    [
        (["--speculative-adaptive"], "adaptive speculation yet", "--speculative-adaptive",
         "Drop --speculative-adaptive",
         "the draft's step count changes at run time, which the sequence-sharded draft lists are not verified with"),
        (["--speculative-draft-window-size", "64"], "a draft attention window yet",
         "--speculative-draft-window-size 64", "Drop --speculative-draft-window-size",
         "the Helix attention has no sliding window"),
        (["--speculative-attention-mode", "decode"], "decode-mode speculative attention",
         "--speculative-attention-mode decode", "Set --speculative-attention-mode prefill",
         "the verify is the Helix extend of the drafts over the sequence-sharded KV"),
        (["--enable-multi-layer-eagle"], "multi-layer EAGLE yet", "--enable-multi-layer-eagle",
         "Drop --enable-multi-layer-eagle", ""),
    ],
    ids=["adaptive", "draft-window", "attention-mode-decode", "multi-layer-eagle"],
)  # fmt: skip
def test_speculative_settings_refused_in_one_line(model, extra, feature, given, fix, why):
    """Every speculative setting the Helix draft/verify path is not verified with is refused at
    launch, naming the flag (issue 33: "works under Helix (tested) or is refused")."""
    message = helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", *_spec(model()), *extra])
    assert message == _unsupported(feature, given, fix, why)


def test_speculative_draft_must_be_a_helix_model(model, tmp_path):
    """A draft whose attention is not Helix's would read the sequence-sharded pool as a whole one."""
    import json

    draft = write_tiny_model(str(tmp_path / "draft"), TinyModelSpec())
    with open(f"{draft}/config.json") as f:
        config = json.load(f)
    config["architectures"] = ["LlamaForSequenceClassification"]
    with open(f"{draft}/config.json", "w") as f:
        json.dump(config, f)
    message = helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", *_spec(draft)])
    assert "does not support this draft model yet (--speculative-draft-model-path" in message, message
    assert "Use a draft of a Helix architecture (" in message and "LlamaForCausalLMEagle" in message, message


def test_the_draft_config_is_read_once(model, tmp_path, monkeypatch):
    """Helix's draft check reads the draft's config through upstream's cached ``get_config``, with
    the arguments of upstream's own speculative step: the draft path is read as often as without
    Helix, so Helix adds no hub call to argument resolution."""
    import transformers

    draft = write_tiny_model(str(tmp_path / "draft"), TinyModelSpec())
    reads = []
    real = transformers.AutoConfig.from_pretrained.__func__

    def counting(cls, path, *args, **kwargs):
        reads.append(str(path))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(counting))
    from sglang.srt.utils.hf_transformers_utils import get_config

    resolve(model(), ["--tp", "4", *_spec(draft)])
    plain = reads.count(draft)
    get_config.cache_clear()  # the second resolution reads from scratch too
    reads.clear()
    resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", *_spec(draft)])
    assert 1 <= reads.count(draft) == plain, (plain, reads)


def test_speculative_draft_heads_must_fit_the_grid(model):
    """The draft's heads are sharded over the same KVP x TPA grid: a 1-KV-head draft under TPA 2."""
    message = helix_error(model(), ["--tp", "4", "--helix-kvp-size", "2", *_spec(model(8, 1))])
    assert message == (  # the target's head check, on the draft
        f"TPA = --tp 4 / --helix-kvp-size 2 = 2 exceeds the 1 KV heads of --speculative-draft-model-path "
        f"{model(8, 1)}: each attention-TP rank holds whole KV heads, none duplicated. Use --helix-kvp-size 4, "
        "or use --helix-kvp-size 1."
    )


def test_pd_decode_is_accepted(model):
    """A Helix decode server of prefill/decode disaggregation over Mooncake resolves (test_helix_pd_e2e)."""
    cfg = view(resolve(model(), ["--tp", "4", "--helix-kvp-size", "2", "--disaggregation-mode", "decode"]))
    assert (cfg.disaggregation_mode, cfg.disaggregation_transfer_backend, cfg.dcp_size) == ("decode", "mooncake", 2)


def test_the_speculative_step_checks_the_mode(model):
    """The mode's speculation checks live in upstream's speculative step (speculative_hook): tested
    on their own, before the EAGLE head opts in."""
    message = helix_error(model(), [
        "--tp", "4", "--helix-kvp-size", "2", *_spec(model()), "--speculative-draft-attention-backend", "flashinfer",
    ])  # fmt: skip
    assert message == _unsupported(
        "this draft attention backend", "--speculative-draft-attention-backend flashinfer",
        "Use triton or torch_native, or drop the flag",
    )  # fmt: skip


# Plain DCP (Q gathered) with speculation (issue 79): 0.5.23 accepted it on a GQA model and every
# rank stopped at its first speculative forward (triton: its DCP extend refuses the verify's custom
# mask; torch_native: its DCP forward refuses a verify, a draft extend and a draft step). Refused at
# launch in one line, in the attention-backend step; MLA models keep upstream's acceptance, and the
# GQA mode runs speculation (accepted in both spellings).
def _plain_dcp_speculation_refusal(backend: str, alg: str) -> str:
    return (
        f"--dcp-size 2 runs no speculative decoding on the {backend} attention backend with Q gathered "
        f"over the DCP group (--attention-backend {backend}, --speculative-algorithm {alg}). "
        "Drop --speculative-algorithm."
    )


@pytest.mark.parametrize(
    "backend,size_flag,alg",
    [(b, f, "STANDALONE") for b in ("triton", "torch_native") for f in ("--dcp-size", "--decode-context-parallel-size")]
    + [(b, "--dcp-size", "EAGLE") for b in ("triton", "torch_native")],
)
def test_plain_dcp_speculation_is_refused_at_launch(model, backend, size_flag, alg):
    """``--tp 4 --dcp-size 2`` (Q gathered, no --dcp-replicate-q-proj) with a draft, on both backends,
    both spellings of the DCP size, a STANDALONE and an EAGLE draft: one line naming the flags."""
    spec = _spec(model())
    spec[1] = alg
    message = helix_error(model(), ["--tp", "4", size_flag, "2", "--attention-backend", backend, *spec])
    assert message == _plain_dcp_speculation_refusal(backend, alg)


def _write_mla_config(path) -> None:
    """A tiny DeepSeek-V3 (MLA) config, no weights: enough for argument resolution."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
    )  # fmt: skip
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(str(path))


def test_plain_dcp_speculation_on_an_mla_model_resolves_as_upstream(tmp_path):
    """An MLA model keeps 0.5.23's resolution under --dcp-size with speculation on triton (resolution
    only: a DeepSeek-V3 config, no weights)."""
    _write_mla_config(tmp_path)
    args = ["--tp", "2", "--dcp-size", "2", "--attention-backend", "triton", "--speculative-algorithm", "NGRAM"]
    cfg = view(resolve(str(tmp_path), args))
    assert (cfg.dcp_size, cfg.speculative_algorithm, cfg.attention_backend) == (2, "NGRAM", "triton")


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_speculative_draft_in_the_gqa_mode_is_accepted_in_dcps_spelling(model, backend):
    """The GQA mode with a draft stays accepted: DCP's spelling (``--dcp-size 2 --dcp-replicate-q-proj``)
    here, the Helix spelling in the tests above (``test_standalone_chain_on_*_is_accepted``)."""
    cfg = view(resolve(model(), ["--tp", "4", *GQA_MODE, "--attention-backend", backend, *_spec(model())]))
    assert gqa_mode(cfg) and (cfg.speculative_algorithm, cfg.attention_backend) == ("STANDALONE", backend)


def test_the_helix_spelling_on_an_mla_model_is_refused(tmp_path):
    """``--helix-kvp-size`` is DCP's GQA mode; on an MLA model replicated Q is upstream DCP's own, so
    the Helix spelling is refused there naming that spelling, not with a message about the interleave
    it set (resolution only: a DeepSeek-V3 config, no weights)."""
    _write_mla_config(tmp_path)
    for chunk in ("64", "1"):
        message = helix_error(str(tmp_path), ["--tp", "2", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", chunk])
        assert message == (
            f"--helix-kvp-size 2 is DCP's GQA mode, but --model-path {tmp_path} is MLA. Use --dcp-size 2 "
            "--dcp-replicate-q-proj (upstream DCP's replicated Q for MLA), or use --helix-kvp-size 1."
        )


# --------------------------------------------------------------------------------------------
# Qwen3.5: a hybrid model (Gated DeltaNet + gated full attention) opts in (test_helix_qwen3_5.py serves it)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """``qwen3_5(arch)``: the tiny Qwen3.5 checkpoints of ``qwen3_5_models`` (dense, MoE)."""
    from sglang_helix.testing.qwen3_5_models import DENSE, MOE, write_qwen3_5_model

    root = tmp_path_factory.mktemp("helix-args-qwen3_5")
    specs = {"qwen3_5": DENSE, "qwen3_5_moe": MOE}
    return lambda arch="qwen3_5": write_qwen3_5_model(str(root / arch), specs[arch])


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize(
    "args", [["--helix-kvp-size", "2"], ["--dcp-size", "4", "--dcp-replicate-q-proj"]]
)
def test_qwen3_5_is_accepted(qwen3_5, arch, args):
    """Qwen3.5 dense and MoE (2 KV heads) resolve into the mode in both spellings (on the CPU engine
    with the radix cache off: see the next test)."""
    cfg = view(resolve(qwen3_5(arch), ["--tp", "4", *args, "--disable-radix-cache"]))
    assert (
        gqa_mode(cfg) and cfg.dcp_size == int(args[1]) and cfg.dcp_comm_backend == "a2a"
    )


def test_qwen3_5_radix_cache_without_extra_buffer_is_refused_in_one_line(qwen3_5):
    """The radix cache of Qwen3.5's linear-attention states keeps pages of more than one token only
    with its extra buffer, which the CPU platform lacks (upstream asserts at start otherwise).
    """
    path = qwen3_5()
    message = helix_error(path, ["--tp", "4", "--helix-kvp-size", "2"])
    assert message == (
        "--helix-kvp-size 2 keeps KV in pages of --helix-kvp-chunk-size 64 x --helix-kvp-size 2 = 128 tokens, "
        f"but the radix cache of {path}'s linear-attention states takes pages of more than one token only with "
        "its extra buffer, not on --device cpu. Pass --disable-radix-cache (on a GPU: --mamba-radix-cache-strategy "
        "extra_buffer), or use --helix-kvp-size 1."
    ), message
    message = helix_error(path, ["--tp", "4", "--helix-kvp-size", "2", "--helix-kvp-chunk-size", "1",
                                 "--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"])  # fmt: skip
    assert (
        "= 2 tokens" in message
        and "not on --mamba-radix-cache-strategy no_buffer." in message
    ), message


def test_qwen3_5_mtp_draft_is_accepted(qwen3_5):
    """Qwen3.5's MTP draft (NEXTN, upstream's alias of EAGLE: the model's own MTP layer) resolves
    into the mode (served: test_qwen3_5_mtp.py)."""
    path = qwen3_5()
    args = ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache"]
    spec = ["--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", path,
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
    cfg = view(resolve(path, [*args, *spec]))
    assert gqa_mode(cfg) and cfg.speculative_algorithm == "EAGLE"


def test_qwen3_5_pd_decode_is_accepted(qwen3_5):
    """A Qwen3.5 PD decode server resolves into the mode (served: test_helix_qwen3_5_pd.py)."""
    path = qwen3_5()
    args = ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache"]
    pd = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    cfg = view(resolve(path, [*args, *pd]))
    assert gqa_mode(cfg) and cfg.disaggregation_mode == "decode"


@pytest.mark.parametrize("spelling", [["--helix-kvp-size", "2"], ["--dcp-size", "2", "--dcp-replicate-q-proj"]])
@pytest.mark.parametrize("alg", ["NEXTN", "EAGLE"])
def test_qwen3_5_pd_decode_with_the_mtp_draft_is_accepted(qwen3_5, alg, spelling):
    """A Qwen3.5 PD decode server in the mode with its MTP draft (NEXTN, or EAGLE naming the
    checkpoint) resolves: the draft's KV arrives relaid out like the target's (served:
    test_helix_qwen3_5_pd.py::test_qwen3_5_mtp_draft_on_a_decode_in_the_mode)."""
    path = qwen3_5()
    pd = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    spec = ["--speculative-algorithm", alg, "--speculative-draft-model-path", path,
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
    cfg = view(resolve(path, ["--tp", "4", *spelling, "--disable-radix-cache", *pd, *spec]))
    assert gqa_mode(cfg) and cfg.disaggregation_mode == "decode" and cfg.speculative_algorithm == "EAGLE"


def test_qwen3_5_pd_decode_with_another_draft_is_refused_in_one_line(qwen3_5):
    """A STANDALONE draft on a PD decode server in the mode is refused in one line, naming the flag
    (the mode's own check of a hybrid model's drafts comes later and says the same of it)."""
    path = qwen3_5()
    pd = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    spec = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", path]
    message = helix_error(path, ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache", *pd, *spec])
    assert message == _unsupported(
        "STANDALONE speculation on a prefill/decode disaggregation decode server yet",
        "--speculative-algorithm STANDALONE", "Use --speculative-algorithm EAGLE (NEXTN), or drop --speculative-algorithm",
    ), message


@pytest.mark.parametrize("alg", ["STANDALONE", "NGRAM"])
def test_qwen3_5_speculation_other_than_its_mtp_layer_is_refused_in_one_line(qwen3_5, alg):
    """A hybrid model's drafts other than its own MTP layer (a STANDALONE Qwen3.5 draft keeps
    linear-attention states of its own; NGRAM's verify is not served on it) are refused."""
    path = qwen3_5()
    spec = ["--speculative-draft-model-path", path] if alg == "STANDALONE" else []
    message = helix_error(
        path,
        ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache", "--speculative-algorithm", alg, *spec],
    )
    assert message == _unsupported(
        f"{alg} speculation of a hybrid linear-attention model yet", f"--speculative-algorithm {alg}",
        "Use --speculative-algorithm NEXTN (the model's MTP layer)",
    ), message


def test_qwen3_next_is_refused_in_one_line(tmp_path):
    """Qwen3-Next has its own attention module (no DCP upstream): not opted in (config only)."""
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    )  # fmt: skip
    config.architectures = ["Qwen3NextForCausalLM"]
    config.save_pretrained(str(tmp_path))
    message = helix_error(
        str(tmp_path), ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache"]
    )
    assert (
        f"but --model-path {tmp_path} is Qwen3NextForCausalLM. Serve a supported model"
        in message
    ), message
    assert "\n" not in message


def test_qwen3_5_block_fp8_is_served_where_shards_are_whole_blocks(qwen3_5, tmp_path):
    """A block-wise FP8 Qwen3.5 (as Qwen publishes it): the dense model's qkv rows per TPA rank
    (head dim 256) are whole 128-row blocks; the MoE model's (head dim 64) K/V rows are not at
    TPA 2 and are refused in one line, naming the KVP that aligns them."""
    from sglang_helix.testing.qwen3_5_models import write_qwen3_5_fp8_block

    dense = write_qwen3_5_fp8_block(qwen3_5(), str(tmp_path / "dense-fp8"))
    cfg = view(
        resolve(dense, ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache"])
    )
    from sglang.srt.arg_groups.overrides import model_config_of

    assert gqa_mode(cfg) and model_config_of(cfg).quantization == "fp8"
    moe = write_qwen3_5_fp8_block(qwen3_5("qwen3_5_moe"), str(tmp_path / "moe-fp8"))
    assert helix_error(
        moe, ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache"]
    ) == (
        f"--helix-kvp-size 2: --model-path {moe} is fp8-quantized in 128-row blocks, but at TPA = --tp 4 / "
        "--helix-kvp-size 2 = 2 a qkv_proj shard has 64 or 512 rows per head group (not whole blocks). "
        "Use --helix-kvp-size 4, or use --helix-kvp-size 1."
    )


@pytest.mark.parametrize("attention_mode", ["noncausal_full_attention", "causal"])
def test_qwen3_5_decision_checkpoint_noncausal_is_refused_in_one_line(tmp_path, attention_mode):
    """A Qwen3.5 "decision" checkpoint whose full-attention layers read the whole prompt
    (``decision_config.json`` ``attention_mode noncausal_full_attention``) is refused at launch in one
    line (0.5.23's torch_native DCP raised at the first forward, Triton's would attend causally);
    a causal decision checkpoint resolves into the mode."""
    from sglang_helix.testing.qwen3_5_models import write_qwen3_5_decision_config

    path = write_qwen3_5_decision_config(str(tmp_path), attention_mode)
    args = ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache"]
    if attention_mode == "causal":
        assert gqa_mode(view(resolve(path, args)))
        return
    assert helix_error(path, args) == (
        f"--helix-kvp-size 2 runs causal decoder attention, but --model-path {path} reads the whole "
        "prompt in its full-attention layers (decision_config.json attention_mode "
        "noncausal_full_attention). Use --helix-kvp-size 1."
    )


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_qwen3_5_multimodal_checkpoint_is_accepted(tmp_path, model):
    """The form Qwen publishes (``Qwen3_5ForConditionalGeneration`` and
    ``Qwen3_5MoeForConditionalGeneration``, here with a one-block vision encoder) resolves into the
    mode: its language model is the text model's layers (served: test_helix_qwen3_5.py)."""
    from sglang_helix.testing.qwen3_5_models import DENSE, MOE, write_qwen3_5_vl_model

    path = write_qwen3_5_vl_model(str(tmp_path / "vl"), {"dense": DENSE, "moe": MOE}[model])
    assert gqa_mode(
        view(
            resolve(
                path, ["--tp", "4", "--helix-kvp-size", "2", "--disable-radix-cache"]
            )
        )
    )
