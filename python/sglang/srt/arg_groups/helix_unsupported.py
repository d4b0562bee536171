# SPDX-License-Identifier: Apache-2.0
"""Server features Helix does not run with (yet), refused at argument time.

Each is refused with one ``HelixConfigError``:

    --helix-kvp-size KVP does not support <feature> (<the flags as given>)[: why]. <fix>, or
    use --helix-kvp-size 1.

The list comes from a pass over every flag group (``srt/arg_groups/fields/*.py``); what was
decided per group, and why the rest is harmless, is in docs/helix-flags.md. A feature belongs
here when it changes the attention, the KV cache or the model forward in a way no Helix test
covers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sglang.srt.arg_groups.helix_checks import HELIX_ATTENTION_BACKENDS, raw, unsupported


class Flag(NamedTuple):
    flag: str
    field: str
    off: Any = None  # the value that turns the feature off
    reset: bool = False  # the fix is "set <flag> <off>" rather than "drop <flag>"


class Feature(NamedTuple):
    name: str
    flags: tuple
    why: str = ""


_RADIX = "other tree backends, host or remote KV tiers and sessions are not verified with the sequence-sharded pool"
_WRAPPED = "it wraps the attention backend, which the Helix attention does not dispatch"

UNSUPPORTED = (
    Feature(
        "prefill context parallelism",
        (
            Flag("--enable-prefill-cp", "enable_prefill_cp", False),
            Flag("--attn-cp-size", "attn_cp_size", 1, reset=True),
        ),
    ),
    Feature("pipeline parallelism yet", (Flag("--pp-size", "pp_size", 1, reset=True),)),
    Feature(
        "decoupled speculative decoding yet",
        (Flag("--decoupled-spec-role", "decoupled_spec_role", "null"),),
    ),
    Feature(
        "prefill/decode disaggregation yet",
        (Flag("--disaggregation-mode", "disaggregation_mode", "null"),),
    ),
    Feature(
        "LoRA adapters yet",
        (Flag("--enable-lora", "enable_lora"), Flag("--lora-paths", "lora_paths")),
        "adapters are sliced for the TP layout, not the KVP x TPA one",
    ),
    Feature(
        "prefix-cache extensions",
        (
            Flag("--enable-hierarchical-cache", "enable_hierarchical_cache"),
            Flag("--enable-lmcache", "enable_lmcache"),
            Flag("--enable-unified-cache-external-linker", "enable_unified_cache_external_linker"),
            Flag("--radix-cache-backend", "radix_cache_backend"),
            Flag("--enable-flexkv", "enable_flexkv"),
            Flag("--enable-session-radix-cache", "enable_session_radix_cache"),
        ),
        _RADIX,
    ),
    Feature(
        "streaming sessions yet",
        (Flag("--enable-streaming-session", "enable_streaming_session"),),
        "a session's next request reuses its KV as a prefix",
    ),
    Feature(
        "the unified memory pool",
        (
            Flag("--enable-unified-memory", "enable_unified_memory"),
            Flag("--enable-page-major-kv-layout", "enable_page_major_kv_layout"),
        ),
        "Helix shards the per-layer KV pool by rows",
    ),
    Feature(
        "hierarchical sparse attention", (Flag("--enable-hisparse", "enable_hisparse"),)
    ),
    Feature(
        "the KV cache canary",
        (Flag("--kv-canary", "kv_canary", "none"),),
        "it reads the KV pool by allocator id, and Helix ids are not rows",
    ),
    Feature(
        "mixed chunked prefill yet", (Flag("--enable-mixed-chunk", "enable_mixed_chunk"),)
    ),
    Feature(
        "two-batch overlap", (Flag("--enable-two-batch-overlap", "enable_two_batch_overlap"),), _WRAPPED
    ),
    Feature("PD multiplexing", (Flag("--enable-pdmux", "enable_pdmux"),), _WRAPPED),
    Feature(
        "decode megakernels",
        (
            Flag("--enable-nvidia-megakernel", "enable_nvidia_megakernel"),
            Flag("--enable-amd-monokernel", "enable_amd_monokernel"),
        ),
        "they replace the decode forward, Helix attention included",
    ),
    Feature(
        "multi-item scoring",
        (Flag("--enable-mis", "enable_mis"),),
        "the Helix attention does not apply its attention mask",
    ),
    Feature("diffusion LLM inference", (Flag("--dllm-algorithm", "dllm_algorithm"),)),
    Feature(
        "sequence-parallel attention input",
        (
            Flag("--enable-layernorm-sp", "enable_layernorm_sp"),
            Flag("--enable-attn-tp-input-scattered", "enable_attn_tp_input_scattered"),
        ),
        "the Helix attention needs every token on every rank",
    ),
    Feature(
        "torch.compile yet",
        (Flag("--enable-torch-compile", "enable_torch_compile"),),
        "the KVP All-to-All is not captured yet",
    ),
    Feature(
        "deterministic inference yet",
        (
            Flag("--enable-deterministic-inference", "enable_deterministic_inference"),
            Flag("--rl-on-policy-target", "rl_on_policy_target"),
        ),
        "batch invariance of the Helix attention and merge is not verified",
    ),
    Feature(
        "weight offloading yet",
        (
            Flag("--cpu-offload-gb", "cpu_offload_gb", 0, reset=True),
            Flag("--offload-group-size", "offload_group_size", -1, reset=True),
        ),
    ),
    Feature("embedding models yet", (Flag("--is-embedding", "is_embedding"),)),
    Feature(
        "expert parallelism yet",
        (
            Flag("--ep-size", "ep_size", 1, reset=True),
            Flag("--moe-a2a-backend", "moe_a2a_backend", "none", reset=True),
            Flag("--enable-eplb", "enable_eplb"),
            Flag("--elastic-ep-backend", "elastic_ep_backend"),
            Flag("--moe-dense-tp-size", "moe_dense_tp_size"),
        ),
        "Helix MoE models are verified with the experts sharded as plain TP shards them",
    ),
    Feature(
        "quantized weights yet",  # a quantized checkpoint: helix_checks.check_model
        (Flag("--quantization", "quantization"), Flag("--modelopt-quant", "modelopt_quant")),
    ),
)


# KV dtypes whose pool Helix attention reads (plain or fp8 with per-layer scales, both verified in
# test_helix_fp8_kv.py). The block-scaled recipes (mxfp8, nvfp4, fp4_mx_block16) store packed data
# and block scales that the Helix paths do not read.
HELIX_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")


# Speculative settings the Helix draft/verify path does not run with (checked with an algorithm set).
SPEC_UNSUPPORTED = (
    Feature(
        "adaptive speculation yet",
        (
            Flag("--speculative-adaptive", "speculative_adaptive"),
            Flag("--speculative-adaptive-config", "speculative_adaptive_config"),
        ),
        "the draft's step count changes at run time, which the sequence-sharded draft lists are not verified with",
    ),
    Feature(
        "a draft attention window yet",
        (
            Flag("--speculative-draft-window-size", "speculative_draft_window_size"),
            Flag("--speculative-draft-sink-size", "speculative_draft_sink_size"),
        ),
        "the Helix attention has no sliding window",
    ),
    Feature(
        "decode-mode speculative attention",
        (Flag("--speculative-attention-mode", "speculative_attention_mode", "prefill", reset=True),),
        "the verify is the Helix extend of the drafts over the sequence-sharded KV",
    ),
    Feature("multi-layer EAGLE yet", (Flag("--enable-multi-layer-eagle", "enable_multi_layer_eagle"),)),
)


def check_unsupported_flags(server_args: Any, cfg: Any, features=UNSUPPORTED) -> None:
    """The features of ``UNSUPPORTED``: run before DCP's own step, so the refusal names Helix."""
    for feature in features:
        on = [(f, getattr(cfg, f.field)) for f in feature.flags if _on(getattr(cfg, f.field), f.off)]
        if on:
            given = [_given(f, value) for f, value in on]
            unsupported(cfg, feature.name, given, _fix([f for f, _ in on]), feature.why)


def check_unsupported_features(server_args: Any, cfg: Any) -> None:
    check_unsupported_flags(server_args, cfg)
    if cfg.kv_cache_dtype not in HELIX_KV_CACHE_DTYPES:
        unsupported(
            cfg, "block-scaled KV cache recipes yet", [f"--kv-cache-dtype {cfg.kv_cache_dtype}"],
            "Use --kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2",
        )  # fmt: skip
    _check_dp_attention(server_args, cfg)
    check_speculative(server_args, cfg)


# Speculative decoding under Helix (docs/helix-flags.md, "Speculative decoding"): a chain draft
# (top-k 1) whose verify is a causal extend of the draft tokens over the sequence-sharded KV.
HELIX_SPEC_ALGORITHMS = ("EAGLE", "STANDALONE")
_TREE_MASK = "its verify attends through a custom tree mask, which the sequence-sharded attention does not apply yet"


def check_speculative(server_args: Any, cfg: Any) -> None:
    """Which ``--speculative-*`` settings Helix serves: EAGLE and STANDALONE chain drafts on
    torch_native and triton, eager, the draft a Helix model too. Refuses the rest with one line
    naming the flag."""
    algorithm = cfg.speculative_algorithm
    if algorithm is None:
        return
    name = str(algorithm).upper()
    if name not in HELIX_SPEC_ALGORITHMS:
        why = _TREE_MASK if name == "NGRAM" else "only EAGLE and STANDALONE chain drafts are verified"
        unsupported(
            cfg, f"{name} speculation yet", [f"--speculative-algorithm {algorithm}"],
            "Use --speculative-algorithm EAGLE or STANDALONE", why,
        )  # fmt: skip
    topk = cfg.speculative_eagle_topk
    if topk is not None and topk > 1:
        unsupported(
            cfg, "tree drafts yet", [f"--speculative-eagle-topk {topk}"],
            "Set --speculative-eagle-topk 1 (a chain draft)", _TREE_MASK,
        )  # fmt: skip
    draft_backend = cfg.speculative_draft_attention_backend  # the target's is checked with the Helix flags
    if draft_backend is not None and draft_backend not in HELIX_ATTENTION_BACKENDS:
        unsupported(
            cfg, f"speculative decoding on --speculative-draft-attention-backend {draft_backend} yet",
            [f"--speculative-algorithm {algorithm}", f"--speculative-draft-attention-backend {draft_backend}"],
            "Use --speculative-draft-attention-backend triton or torch_native, or drop it",
            "the draft's attention reads the same sequence-sharded KV pool",
        )  # fmt: skip
    if getattr(cfg, "helix_enable_cuda_graph", False):
        unsupported(
            cfg, "speculative decoding in CUDA graphs yet",
            [f"--speculative-algorithm {algorithm}", "--helix-enable-cuda-graph"],
            "Drop --helix-enable-cuda-graph (speculation under Helix runs eagerly)",
            "a draft step's local KV lists end at its position, sized on the host",
        )  # fmt: skip
    check_unsupported_flags(None, cfg, SPEC_UNSUPPORTED)
    _check_draft_model(cfg)


def _check_draft_model(cfg: Any) -> None:
    """The draft model's attention runs on the same sequence-sharded pool: it must be a Helix
    model too (an opted-in architecture, its K and Q heads fitting the grid like the target's)."""
    from sglang.srt.arg_groups.helix_checks import helix_draft_architectures, join

    path = cfg.speculative_draft_model_path
    if not path:
        return
    try:  # the call (and cache entry) of upstream's handle_speculative_decoding: no second read
        from sglang.srt.utils.hf_transformers_utils import get_config

        override = (cfg.decrypted_draft_config_file or "").strip()
        extra = {"_configuration_file": override} if override else {}
        hf = get_config(path, trust_remote_code=cfg.trust_remote_code, **extra)
    except (OSError, ValueError):
        return  # upstream's draft loading reports a path it cannot read
    archs = list(getattr(hf, "architectures", None) or [])
    supported = helix_draft_architectures()
    if not archs or any(a not in supported for a in archs):
        unsupported(
            cfg, "this draft model yet",
            [f"--speculative-draft-model-path {path} is {join(archs) or 'an unknown architecture'}"],
            f"Use a draft of a Helix architecture ({join(supported)})",
            "the draft's attention reads the same sequence-sharded KV pool",
        )  # fmt: skip
    k = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    tpa = cfg.tp_size // cfg.helix_kvp_size
    if tpa > k or k % tpa or hf.num_attention_heads % cfg.tp_size:
        unsupported(
            cfg, "this draft model's head counts",
            [f"--speculative-draft-model-path {path} has {hf.num_attention_heads} query and {k} KV heads"],
            f"Use a draft whose KV heads are a multiple of TPA = {tpa} and whose query heads divide by --tp {cfg.tp_size}",
        )  # fmt: skip


def _check_dp_attention(server_args: Any, cfg: Any) -> None:
    if cfg.attn_dp_size <= 1:
        return
    if raw(server_args, "enable_dp_attention", False):
        dp = raw(server_args, "dp_size", cfg.attn_dp_size)
        given, fix = ["--enable-dp-attention", f"--dp-size {dp}"], "Drop --enable-dp-attention"
    else:
        given, fix = [f"--attn-dp-size {cfg.attn_dp_size}"], "Set --attn-dp-size 1"
    unsupported(cfg, "DP attention", given, fix, "Helix shards every request over all KVP ranks")


def _on(value: Any, off: Any) -> bool:
    return value != off and value is not None and value is not False


def _given(flag: Flag, value: Any) -> str:
    if value is True or not isinstance(value, (str, int, float)):
        return flag.flag  # a switch, or a list (--lora-paths)
    return f"{flag.flag} {value}"


def _fix(flags: list) -> str:
    """``Drop --a and --b``, ``Set --c 1``, ``Drop --a and set --c 1``."""
    if all(not f.reset for f in flags):
        text = "drop " + " and ".join(f.flag for f in flags)
    else:
        text = " and ".join(f"set {f.flag} {f.off}" if f.reset else f"drop {f.flag}" for f in flags)
    return text[0].upper() + text[1:]
