# SPDX-License-Identifier: Apache-2.0
"""DCP's GQA mode, Helix parallelism (arXiv 2507.07120): ``--dcp-size K --dcp-replicate-q-proj``
on a model that is not MLA, the a2a exchange (fi_a2a where named), ``--dcp-interleave-size C``.

Each check runs once. ``resolve_dcp_gqa_mode`` (before DCP's step) checks the grid, the device,
the features the mode does not run with and the linear-attention cache, and names the exchange and
the KV page (``page_size`` C: DCP allocates pages of C x K, one interleave run per rank).
``handle_helix_parallelism`` (after the CUDA graph step) only resolves: the attention backend,
prefill CUDA graphs off. ``finalize_dcp_gqa_mode`` (at the end) checks the final attention backend
and page and puts the final prefill chunk (the platform's default too) in whole pages. The model, the
speculation and PD are checked in upstream's steps for them (attention_hook, speculative_hook,
pd_disaggregation_hook). Messages name the mode as launched (``parallel_hook.dcp_gqa_spelling``)."""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.arg_groups.overrides import (
    declare_resolution,
    model_config_of,
    resolving_view,
)
from sglang.srt.arg_groups.parallel_hook import dcp_gqa_spelling as spelling
from sglang.srt.arg_groups.resolution_hooks import ServerArgsError
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

logger = logging.getLogger(__name__)
HOOK = "handle_helix_parallelism"  # the source of the mode's declarations

DEVICES = ("cuda", "cpu")
BACKENDS = ("triton", "torch_native")
# KV cache dtypes with per-layer scales
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
# What the mode does not run with (yet) -> fields; "f=v": the fix sets v, else drops f.
UNSUPPORTED = {
    "prefill context parallelism": "enable_prefill_cp attn_cp_size=1",
    "pipeline parallelism yet": "pp_size=1",
    "decoupled speculative decoding yet": "decoupled_spec_role:null",
    "LoRA adapters yet": "enable_lora lora_paths",
    "prefix-cache extensions": "enable_hierarchical_cache enable_lmcache enable_unified_cache_external_linker radix_cache_backend enable_flexkv enable_session_radix_cache enable_streaming_session",
    "the unified memory pool": "enable_unified_memory enable_page_major_kv_layout",
    "hierarchical sparse attention": "enable_hisparse",
    "the KV cache canary": "kv_canary:none",
    "mixed chunked prefill yet": "enable_mixed_chunk",
    "attention-backend wrappers": "enable_two_batch_overlap enable_pdmux",
    "decode megakernels": "enable_nvidia_megakernel enable_amd_monokernel",
    "multi-item scoring": "enable_mis",
    "diffusion LLM inference": "dllm_algorithm",
    "sequence-parallel attention input": "enable_layernorm_sp enable_attn_tp_input_scattered",
    "torch.compile yet": "enable_torch_compile",
    "deterministic inference yet": "enable_deterministic_inference rl_on_policy_target",
    "weight offloading yet": "cpu_offload_gb=0 offload_group_size=-1",
    "embedding models yet": "is_embedding",
    "expert parallelism yet": "ep_size=1 moe_a2a_backend:none enable_eplb elastic_ep_backend moe_dense_tp_size",
    "ModelOpt quantization yet": "modelopt_quant",
}


def raw(cfg: Any, field: str) -> Any:  # as typed (a view reads its record's)
    return (getattr(cfg, "_raw_input", None) or {}).get(field)


def fail(cfg: Any, problem: str, fix: str = "") -> None:
    off = spelling(cfg)[3]
    fix = f"{fix}, or {off}" if fix else off.capitalize()
    raise ServerArgsError(f"{problem}. {fix}.")


def unsupported(cfg: Any, feature: str, given: list, fix: str) -> None:
    problem = f"{spelling(cfg)[0]} does not support {feature} ({' '.join(given)})"
    fail(cfg, problem, fix)


def join(items) -> str:  # "a, b or c"
    return " or ".join(", ".join(map(str, items)).rsplit(", ", 1))


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def dcp_gqa_mode(cfg: Any) -> bool:
    """Replicated Q, the All-to-All (or none named yet), a model that is not MLA."""
    a2a = cfg.dcp_comm_backend in (None, "a2a", "fi_a2a")
    if cfg.dcp_size <= 1 or not cfg.dcp_replicate_q_proj or not a2a:
        return False
    return model_config_of(cfg).attention_arch != AttentionArch.MLA


def resolve_dcp_gqa_mode(server_args: Any) -> None:
    cfg = resolving_view(server_args)
    i = cfg.dcp_interleave_size
    if i < 1:
        msg = f"--dcp-interleave-size must be >= 1, got --dcp-interleave-size {i}"
        raise ServerArgsError(f"{msg}. Use a positive --dcp-interleave-size.")
    if not dcp_gqa_mode(cfg):
        if i != 1:
            mode = "--dcp-size > 1 --dcp-replicate-q-proj on a GQA model"
            msg = f"--dcp-interleave-size {i} needs DCP's GQA mode ({mode})"
            raise ServerArgsError(f"{msg}. Drop --dcp-interleave-size.")
        return
    (mode, size, _, _), n, k = spelling(cfg), cfg.tp_size, cfg.dcp_size
    if n % k:
        good = join(d for d in range(2, n + 1) if n % d == 0)
        grid = "Helix arranges the --tp ranks as a KVP x TPA grid"
        fail(cfg, f"{size} {k} does not divide --tp {n}: {grid}", f"Use {size} {good}")
    if cfg.dcp_comm_backend is None:  # replicated Q is the mode on every platform
        declare_resolution(server_args, HOOK, dcp_comm_backend="a2a")
    msg = f"Helix parallelism: {mode} on a GQA model, --dcp-interleave-size {i}, TPA = --tp {n} / {k} = {n // k}."
    logger.info(msg)
    # Checked here, once: before DCP's own step refuses some with a traceback, and before
    # upstream's mamba step asserts on the linear-attention cache.
    if cfg.device not in DEVICES:
        fail(cfg, f"{mode} runs on --device {join(DEVICES)}, not {cfg.device}")
    check_unsupported_flags(cfg)
    _check_features(cfg)
    _resolve_kv_page(server_args, cfg)
    _check_linear_attention_cache(cfg)


def handle_helix_parallelism(server_args: Any) -> None:
    """After the CUDA graph step, before memory sizing and the platform defaults: the attention
    backend where none is given, prefill CUDA graphs off (resolution only, idempotent).
    """
    cfg = resolving_view(server_args)
    if not dcp_gqa_mode(cfg):
        return  # off: nothing is declared, resolution is upstream's
    if cfg.attention_backend is None:  # a split flag's, else the platform's
        split = cfg.prefill_attention_backend or cfg.decode_attention_backend
        backend = split or ("torch_native" if cfg.device == "cpu" else "triton")
        msg = f"Helix parallelism: attention backend not specified; using {backend}."
        logger.info(msg)
        declare_resolution(server_args, HOOK, attention_backend=backend)
    graphs = cfg.cuda_graph_config
    if graphs is not None and graphs.prefill.backend != Backend.DISABLED:
        why = "the extend lists are sized on the host"
        msg = f"Helix parallelism ({spelling(cfg)[0]}): disabling prefill CUDA graphs ({why}); decode graphs stay on."
        logger.warning(msg)
        off = with_phase(graphs, Phase.PREFILL, backend=Backend.DISABLED)
        declare_resolution(server_args, HOOK, cuda_graph_config=off)


def finalize_dcp_gqa_mode(server_args: Any) -> None:
    """At the end, over the final values (a later step may pick another backend or page size,
    or default the prefill chunk): the backend and the page checked, once; the chunk in whole
    pages."""
    cfg = resolving_view(server_args)
    if not dcp_gqa_mode(cfg):
        return
    _check_attention_backends(cfg)
    _check_kv_page(cfg)
    _resolve_kv_page(server_args, cfg)


def hybrid(cfg: Any) -> bool:
    """The model has linear-attention or SSM layers (Qwen3.5's Gated DeltaNet) with their states."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    return mambaish_config(model_config_of(cfg)) is not None


def helix_architectures(drafts: bool = False) -> list:
    """Classes that opt in in their own body: ``supports_dcp_gqa``
    (as drafts: ``supports_dcp_gqa_draft``)."""
    from sglang.srt.models.registry import ModelRegistry

    keys = ("supports_dcp_gqa", "supports_dcp_gqa_draft")[: 1 + drafts]
    models = ModelRegistry.models.items()
    return sorted(a for a, cls in models if any(vars(cls).get(k) for k in keys))


def _check_attention_backends(cfg: Any) -> None:
    """One backend of the mode's for both phases (not a HybridAttnBackend)."""
    fields = tuple(f"{phase}attention_backend" for phase in ("", "prefill_", "decode_"))
    main, prefill, decode = values = [getattr(cfg, f) for f in fields]
    for field, backend in zip(fields, values):
        if backend not in (None, *BACKENDS):
            problem = f"{spelling(cfg)[0]} supports only the attention backends triton or torch_native, but {flag(field)} is {backend}"
            fail(cfg, problem, "Pass --attention-backend triton (or torch_native)")
    if (prefill or main or decode) != (decode or main or prefill):
        given = [f"{flag(f)} {v}" for f, v in zip(fields, values) if v][-2:]
        split = "different prefill and decode attention backends"
        unsupported(cfg, split, given, "Pass one --attention-backend")


def kv_page(cfg: Any) -> tuple:
    """(C, the KV page C x K, its words)."""
    (_, size, chunk_flag, _), kvp = spelling(cfg), cfg.dcp_size
    chunk = cfg.dcp_interleave_size
    return chunk, chunk * kvp, f"{chunk_flag} {chunk} x {size} {kvp} = {chunk * kvp}"


def _check_kv_page(cfg: Any) -> None:
    """--page-size the interleave (DCP's pages hold one run per rank), a power of two on a GPU;
    --max-total-tokens at least one page."""
    (mode, size, chunk_flag, _), kvp = spelling(cfg), cfg.dcp_size
    chunk, page, pages = kv_page(cfg)
    for value in (raw(cfg, "page_size"), cfg.page_size):  # as given, as resolved by now
        if value not in (None, 1, chunk):
            problem = f"{mode} allocates KV in pages of one {chunk_flag} ({chunk}) per rank, but --page-size is {value}"
            fail(cfg, problem, f"Pass --page-size 1 (or {chunk})")
    if cfg.device != "cpu" and page & (page - 1):  # the allocator's tl.arange(0, page)
        why = "the Helix KV page must be a power of two (the paged allocator's Triton kernels)"
        fix = f"Use a power-of-two {size if kvp & (kvp - 1) else chunk_flag}"
        fail(cfg, f"{pages}: on --device {cfg.device} {why}", fix)
    if 0 < (cfg.max_total_tokens or 0) < page:
        problem = f"--max-total-tokens {cfg.max_total_tokens} is less than one Helix KV page ({pages} tokens), in which each rank's KV rows are allocated"
        fix = f"Pass --max-total-tokens {page} or more, or a smaller {chunk_flag}"
        fail(cfg, problem, fix)


def _resolve_kv_page(server_args: Any, cfg: Any) -> None:
    """--page-size the interleave; --chunked-prefill-size whole pages, at least one."""
    chunk, page, pages = kv_page(cfg)
    if cfg.page_size != chunk:
        msg = f"Helix parallelism: --page-size {chunk}; KV ids are allocated in pages of {pages} tokens (one interleave run per KVP rank)."
        logger.info(msg)
        declare_resolution(server_args, HOOK, page_size=chunk)
    if (old := cfg.chunked_prefill_size or 0) > 0 and old % page:
        new = max(page, old // page * page)
        why = "a prefill chunk must hold at least one page"
        if old > page:
            why = "the scheduler cuts prefill chunks at page boundaries"
        msg = f"Helix parallelism: --chunked-prefill-size {old} -> {new}, a multiple of the Helix KV page ({pages} tokens): {why}."
        logger.info(msg)
        declare_resolution(server_args, HOOK, chunked_prefill_size=new)


def _check_linear_attention_cache(cfg: Any) -> None:
    """A hybrid model's radix cache (Qwen3.5's linear-attention states) holds KV pages of more
    than one token only with upstream's extra buffer, which not every platform has."""
    from sglang.srt.arg_groups.mamba_hook import (
        _platform_supports_mamba_cache_extra_buffer as platform_has_extra_buffer,
    )
    from sglang.srt.arg_groups.overrides import _mamba_radix_cache_resolution

    resolved, given = _mamba_radix_cache_resolution(cfg), cfg.mamba_radix_cache_strategy
    strategy = resolved.get("mamba_radix_cache_strategy", given)  # ({}: no such cache)
    if not resolved or (
        strategy.startswith("extra_buffer") and platform_has_extra_buffer()
    ):
        return
    why = f"--mamba-radix-cache-strategy {given}"
    why = f"--device {cfg.device}" if given == "auto" else why
    problem = f"{spelling(cfg)[0]} keeps KV in pages of {kv_page(cfg)[2]} tokens, but the radix cache of {cfg.model_path}'s linear-attention states takes pages of more than one token only with its extra buffer, not on {why}"
    fix = "Pass --disable-radix-cache (on a GPU: --mamba-radix-cache-strategy extra_buffer)"
    fail(cfg, problem, fix)


def check_unsupported_flags(cfg: Any, features: dict = UNSUPPORTED) -> None:
    for feature, spec in features.items():
        on = []  # (the flag as given, its fix)
        for item in spec.split():
            field, _, off = item.replace(":", "=").partition("=")
            value = getattr(cfg, field)
            default = int(off) if off[-1:].isdigit() else off
            if value not in (None, False) and value != default:
                bare = value is True or isinstance(value, (list, dict))
                fix = ("drop ", "set ")["=" in item] + flag(field)
                fix += f" {off}" if "=" in item else ""
                on.append((flag(field) if bare else f"{flag(field)} {value}", fix))
        if on:
            fix = " and ".join(f for _, f in on)
            unsupported(cfg, feature, [g for g, _ in on], fix[0].upper() + fix[1:])


def _check_features(cfg: Any) -> None:
    """The KV dtype and DP attention (speculation and PD: their own hooks, in the mode's
    branch)."""
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        given = [f"--kv-cache-dtype {cfg.kv_cache_dtype}"]
        fix = "Use --kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2"
        unsupported(cfg, "block-scaled KV cache recipes yet", given, fix)
    if cfg.attn_dp_size > 1:
        width = raw(cfg, "dp_size") or cfg.attn_dp_size
        dp = f"--enable-dp-attention --dp-size {width}"
        given, fix = [dp], "Drop --enable-dp-attention"
        if not raw(cfg, "enable_dp_attention"):
            given, fix = [f"--attn-dp-size {cfg.attn_dp_size}"], "Set --attn-dp-size 1"
        unsupported(cfg, "DP attention", given, fix)
