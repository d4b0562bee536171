# SPDX-License-Identifier: Apache-2.0
"""Server arguments of Helix parallelism (arXiv 2507.07120), DCP's GQA mode:

    --helix-kvp-size K --helix-kvp-chunk-size C
      == --dcp-size K --dcp-comm-backend a2a --dcp-replicate-q-proj --dcp-interleave-size C

``resolve_helix_layout`` (before DCP's step) declares either spelling from the other; ``handle_helix_parallelism``
(after the CUDA graph step, again at the end) refuses what Helix does not run with and resolves the attention
backend, prefill CUDA graphs (off; decode graphs stay on) and the KV page (``page_size`` C: DCP allocates C x K,
one chunk per rank)."""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.arg_groups.overrides import (
    declare_resolution,
    model_config_of,
    resolving_view,
)
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

logger = logging.getLogger(__name__)

HELIX_ATTENTION_BACKENDS = ("triton", "torch_native")
# plain, or fp8 with per-layer scales
HELIX_KV_CACHE_DTYPES = (
    "auto",
    "bf16",
    "bfloat16",
    "fp8_e4m3",
    "fp8_e5m2",
)


class HelixConfigError(ValueError):  # launch_server reports it as a usage error
    pass


def fail(problem: str, fix: str = "") -> None:
    raise HelixConfigError(
        f"{problem}. {fix + ', or use' if fix else 'Use'} --helix-kvp-size 1."
    )


def unsupported(cfg: Any, feature: str, given: list, fix: str) -> None:
    fail(
        f"--helix-kvp-size {cfg.helix_kvp_size} does not support {feature} ({' '.join(given)})",
        fix,
    )


def raw(server_args: Any, field: str, default: Any) -> Any:  # what the caller typed
    return (getattr(server_args, "_raw_input", None) or {}).get(field, default)


def join(items) -> str:  # "a, b or c"
    return " or ".join(", ".join(map(str, items)).rsplit(", ", 1))


def declare(server_args: Any, **fields: Any) -> None:
    declare_resolution(server_args, "handle_helix_parallelism", **fields)


def dcp_gqa_mode(cfg: Any) -> bool:
    # cfg: a resolved view or the published bag (get_parallel().dcp_gqa_mode)
    return cfg.helix_kvp_size > 1


def resolve_helix_layout(server_args: Any) -> None:
    cfg = resolving_view(server_args)
    kvp, chunk, n, interleave = (
        cfg.helix_kvp_size,
        cfg.helix_kvp_chunk_size,
        cfg.tp_size,
        cfg.dcp_interleave_size,
    )
    for flag, value in (
        ("--helix-kvp-size", kvp),
        ("--helix-kvp-chunk-size", chunk),
        ("--dcp-interleave-size", interleave),
    ):
        if value < 1:
            fail(f"{flag} must be >= 1, got {flag} {value}", f"Use a positive {flag}")
    if n % kvp:
        fail(
            f"--helix-kvp-size {kvp} does not divide --tp {n}: Helix arranges the --tp ranks as a KVP x TPA grid",
            f"Use --helix-kvp-size {join(d for d in range(2, n + 1) if n % d == 0)}",
        )
    layout = {
        "dcp_size": kvp,
        "dcp_comm_backend": "a2a",
        "dcp_replicate_q_proj": True,
        "dcp_interleave_size": chunk,
    }
    spelled = f"--dcp-size {kvp} --dcp-comm-backend a2a --dcp-replicate-q-proj --dcp-interleave-size {chunk}"
    if kvp > 1:
        for field, value in layout.items():
            given, flag = raw(server_args, field, None), "--" + field.replace("_", "-")
            if given not in (None, value) and not (
                field in ("dcp_size", "dcp_interleave_size") and given == 1
            ):
                fail(
                    f"--helix-kvp-size {kvp} --helix-kvp-chunk-size {chunk} is {spelled}, but {flag} is {given}",
                    f"Drop {flag}",
                )
        if any(getattr(cfg, f) != v for f, v in layout.items()):
            logger.info(
                "Helix parallelism: --helix-kvp-size %d --helix-kvp-chunk-size %d resolves to %s "
                "(TPA = --tp %d / %d = %d).",
                kvp,
                chunk,
                spelled,
                n,
                kvp,
                n // kvp,
            )
            declare(server_args, **layout)
    elif (
        cfg.dcp_size > 1
        and cfg.dcp_replicate_q_proj
        and cfg.dcp_comm_backend in (None, "a2a", "fi_a2a")
        # MLA's replicated Q is upstream's
        and (model_config_of(server_args).attention_arch != AttentionArch.MLA)
    ):
        # Replicated Q on a GQA model is the GQA mode whichever exchange DCP's default would pick (fi_a2a on
        # Blackwell, a2a on CUDA/HIP/XPU, ag_rs on the CPU) or the user names (a2a, fi_a2a; ag_rs is refused
        # upstream): one server for every spelling, on every platform, and one replicated-Q attention path.
        logger.info(
            "Decode context parallelism --dcp-size %d --dcp-replicate-q-proj --dcp-interleave-size %d on a "
            "GQA model is Helix parallelism (--helix-kvp-size %d --helix-kvp-chunk-size %d), with "
            "--dcp-comm-backend a2a.",
            cfg.dcp_size,
            interleave,
            cfg.dcp_size,
            interleave,
        )
        declare(
            server_args,
            helix_kvp_size=cfg.dcp_size,
            helix_kvp_chunk_size=interleave,
            dcp_comm_backend="a2a",
        )
    cfg = resolving_view(server_args)
    if cfg.helix_kvp_size > 1:
        # before DCP's own step refuses some of them with a traceback
        check_unsupported_flags(cfg)
        _resolve_kv_page(server_args, cfg)
    elif interleave != 1:
        raise HelixConfigError(
            f"--dcp-interleave-size {interleave} needs DCP's GQA mode (--dcp-size > 1 "
            "--dcp-replicate-q-proj on a GQA model, i.e. --helix-kvp-size). "
            "Drop --dcp-interleave-size."
        )


def handle_helix_parallelism(server_args: Any) -> None:  # idempotent
    cfg = resolving_view(server_args)
    if cfg.helix_kvp_size == 1:
        return  # Helix off: nothing is declared, resolution is upstream's
    check_unsupported_features(server_args, cfg)
    _check_model(server_args, cfg)
    _resolve_attention_backend(server_args, cfg)
    _switch_off_cuda_graphs(server_args, cfg)
    _resolve_kv_page(server_args, cfg)
    _resolve_page_multiples(server_args, cfg)


def _check_model(server_args: Any, cfg: Any) -> None:
    """Its class (per ``--model-impl`` too) opts in in its own body; its heads fit the grid and the exchange."""
    from sglang.srt.model_loader.utils import get_model_architecture

    kvp, mc, model = (
        cfg.helix_kvp_size,
        model_config_of(server_args),
        f"--model-path {cfg.model_path}",
    )
    cls, arch = get_model_architecture(mc)
    if not vars(cls).get("supports_dcp_gqa"):
        fail(
            f"--helix-kvp-size {kvp} supports only {join(helix_architectures())} models (SGLang's own model code), "
            f"but {model} is {arch}",
            "Serve a supported model",
        )
    _check_heads(cfg, mc.num_attention_heads, mc.get_total_num_kv_heads(), model)
    for field, dim in (("head_dim", mc.head_dim), ("v_head_dim", mc.v_head_dim)):
        # the All-to-All packs each head's LSE after its whole row
        if dim < 2 or dim & (dim - 1):
            fail(
                f"--helix-kvp-size {kvp} needs power-of-two attention head dims (the All-to-All and LSE combine "
                f"take whole head rows), but {model} has {field} {dim}"
            )
    if mc.quantization:
        unsupported(
            cfg,
            "quantized weights yet",
            [f"{model} is {mc.quantization}-quantized"],
            "Serve an unquantized checkpoint",
        )


def _check_heads(cfg: Any, q: int, k: int, model: str) -> None:
    n, kvp, tpa = cfg.tp_size, cfg.helix_kvp_size, cfg.tp_size // cfg.helix_kvp_size
    if tpa > k or k % tpa:
        good = [
            v
            for v in range(2, n + 1)
            if n % v == 0 and n // v <= k and k % (n // v) == 0
        ] * (q % n == 0)
        fail(
            f"TPA = --tp {n} / --helix-kvp-size {kvp} = {tpa} {'exceeds' if tpa > k else 'does not divide'} the "
            f"{k} KV heads of {model}: each attention-TP rank holds whole KV heads, none duplicated",
            f"Use --helix-kvp-size {join(good)}" if good else f"Change --tp {n}",
        )
    if q % n:
        fail(
            f"The {q} query heads of {model} are not divisible by --tp {n}: after the Helix All-to-All each rank "
            "owns an equal share of them",
            f"Use a --tp that divides {q}",
        )


def helix_architectures(drafts: bool = False) -> list:
    """Classes that opt in in their own body: ``supports_dcp_gqa`` (or, as drafts, ``supports_dcp_gqa_draft``)."""
    from sglang.srt.models.registry import ModelRegistry

    keys = ("supports_dcp_gqa", "supports_dcp_gqa_draft")[: 1 + drafts]
    return sorted(
        a
        for a, cls in ModelRegistry.models.items()
        if any(vars(cls).get(k) for k in keys)
    )


def _resolve_attention_backend(server_args: Any, cfg: Any) -> None:
    """One Helix backend for both phases (not a HybridAttnBackend); unset: a split flag's, else the platform's."""
    fields = (
        "attention_backend",
        "prefill_attention_backend",
        "decode_attention_backend",
    )
    main, prefill, decode = values = [getattr(cfg, f) for f in fields]
    given = [f"--{f.replace('_', '-')} {v}" for f, v in zip(fields, values) if v]
    for field, backend in zip(fields, values):
        if backend not in (None, *HELIX_ATTENTION_BACKENDS):
            fail(
                f"--helix-kvp-size {cfg.helix_kvp_size} supports only the attention backends triton or torch_native, "
                f"but --{field.replace('_', '-')} is {backend}",
                "Pass --attention-backend triton (or torch_native)",
            )
    if (prefill or main or decode) != (decode or main or prefill):
        unsupported(
            cfg,
            "different prefill and decode attention backends",
            given[-2:],
            "Pass one --attention-backend",
        )
    if main is None:
        backend = (
            prefill or decode or ("torch_native" if cfg.device == "cpu" else "triton")
        )
        logger.info(
            "Helix parallelism: attention backend not specified; using %s.", backend
        )
        declare(server_args, attention_backend=backend)


def _switch_off_cuda_graphs(server_args: Any, cfg: Any) -> None:
    """Prefill graphs off (host-sized extend lists); decode graphs stay on, as under upstream DCP."""
    graphs = cfg.cuda_graph_config
    if graphs is not None and graphs.prefill.backend != Backend.DISABLED:
        logger.warning(
            "Helix parallelism (--helix-kvp-size %d): disabling prefill CUDA graphs (the extend lists "
            "are sized on the host); decode graphs stay on.",
            cfg.helix_kvp_size,
        )
        declare(
            server_args,
            cuda_graph_config=with_phase(
                graphs, Phase.PREFILL, backend=Backend.DISABLED
            ),
        )


def _resolve_kv_page(server_args: Any, cfg: Any) -> None:
    kvp, chunk, typed = (
        cfg.helix_kvp_size,
        cfg.helix_kvp_chunk_size,
        raw(server_args, "page_size", None),
    )
    if cfg.page_size not in (None, 1, chunk) or typed not in (None, 1, chunk):
        fail(
            f"--helix-kvp-size {kvp} allocates KV in pages of one --helix-kvp-chunk-size ({chunk}) per rank, but "
            f"--page-size is {cfg.page_size}",
            f"Pass --page-size 1 (or {chunk})",
        )
    # the GPU allocator's kernels: tl.arange(0, page)
    if cfg.device != "cpu" and (kvp * chunk) & (kvp * chunk - 1):
        fail(
            f"--helix-kvp-chunk-size {chunk} x --helix-kvp-size {kvp} = {kvp * chunk}: on --device {cfg.device} the "
            "Helix KV page must be a power of two (the paged allocator's Triton kernels)",
            f"Use a power-of-two {'--helix-kvp-size' if kvp & (kvp - 1) else '--helix-kvp-chunk-size'}",
        )
    if cfg.page_size != chunk:
        logger.info(
            "Helix parallelism: --page-size %d; KV ids are allocated in pages of --helix-kvp-chunk-size %d "
            "x --helix-kvp-size %d = %d tokens (one ownership chunk per KVP rank).",
            chunk,
            chunk,
            kvp,
            kvp * chunk,
        )
        declare(server_args, page_size=chunk)


def _resolve_page_multiples(server_args: Any, cfg: Any) -> None:
    """--max-total-tokens at least one page; --chunked-prefill-size whole pages (the scheduler cuts chunks at
    page boundaries), at least one."""
    kvp, chunk, page = (
        cfg.helix_kvp_size,
        cfg.helix_kvp_chunk_size,
        cfg.helix_kvp_size * cfg.helix_kvp_chunk_size,
    )
    what = f"Helix KV page (--helix-kvp-chunk-size {chunk} x --helix-kvp-size {kvp} = {page} tokens)"
    if 0 < (cfg.max_total_tokens or 0) < page:
        fail(
            f"--max-total-tokens {cfg.max_total_tokens} is less than one {what}, in which each rank's KV rows are "
            f"allocated",
            f"Pass --max-total-tokens {page} or more, or a smaller --helix-kvp-chunk-size",
        )
    old = cfg.chunked_prefill_size or 0
    if old > 0 and old % page:
        new, why = max(page, old // page * page), (
            "a prefill chunk must hold at least one page"
            if old < page
            else ("the scheduler cuts prefill chunks at page boundaries")
        )
        logger.info(
            "Helix parallelism: --chunked-prefill-size %d -> %d, a multiple of the %s: %s.",
            old,
            new,
            what,
            why,
        )
        declare(server_args, chunked_prefill_size=new)


# Features Helix does not run with (yet; why: docs/helix-flags.md) -> fields; "f=v": the fix sets v, else drops it.
UNSUPPORTED = {
    "prefill context parallelism": "enable_prefill_cp attn_cp_size=1",
    "pipeline parallelism yet": "pp_size=1",
    "decoupled speculative decoding yet": "decoupled_spec_role:null",
    "LoRA adapters yet": "enable_lora lora_paths",
    "prefix-cache extensions": "enable_hierarchical_cache enable_lmcache enable_unified_cache_external_linker "
    "radix_cache_backend enable_flexkv enable_session_radix_cache enable_streaming_session",
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
    "quantized weights yet": "quantization modelopt_quant",
}
# With an algorithm set: what the Helix draft/verify path (drafts over the sharded KV) does not run with.
SPEC_UNSUPPORTED = {
    "adaptive speculation yet": "speculative_adaptive speculative_adaptive_config",
    "a draft attention window yet": "speculative_draft_window_size speculative_draft_sink_size",
    "decode-mode speculative attention": "speculative_attention_mode=prefill",
    "multi-layer EAGLE yet": "enable_multi_layer_eagle",
}


def check_unsupported_flags(cfg: Any, features: dict = UNSUPPORTED) -> None:
    for feature, spec in features.items():
        on = []  # (the flag as given, its fix)
        for item in spec.split():
            field, _, off = item.replace(":", "=").partition("=")
            value, flag = getattr(cfg, field), "--" + field.replace("_", "-")
            if (
                value is not None
                and value is not False
                and value != (int(off) if off[-1:].isdigit() else off)
            ):
                fix = f"set {flag} {off}" if "=" in item else f"drop {flag}"
                on.append(
                    (
                        (
                            flag
                            if value is True or isinstance(value, (list, dict))
                            else f"{flag} {value}"
                        ),
                        fix,
                    )
                )
        if on:
            fix = " and ".join(f for _, f in on)
            unsupported(cfg, feature, [g for g, _ in on], fix[0].upper() + fix[1:])


def check_unsupported_features(server_args: Any, cfg: Any) -> None:
    check_unsupported_flags(cfg)
    if cfg.kv_cache_dtype not in HELIX_KV_CACHE_DTYPES:
        unsupported(
            cfg,
            "block-scaled KV cache recipes yet",
            [f"--kv-cache-dtype {cfg.kv_cache_dtype}"],
            "Use --kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2",
        )
    if cfg.attn_dp_size > 1:
        typed = raw(server_args, "enable_dp_attention", False)
        dp = f"--enable-dp-attention --dp-size {raw(server_args, 'dp_size', cfg.attn_dp_size)}"
        given = [dp if typed else f"--attn-dp-size {cfg.attn_dp_size}"]
        unsupported(
            cfg,
            "DP attention",
            given,
            "Drop --enable-dp-attention" if typed else "Set --attn-dp-size 1",
        )
    if cfg.speculative_algorithm is not None:
        check_speculative(cfg)
    check_disaggregation(cfg)


def check_disaggregation(cfg: Any) -> None:
    """Helix is a decode server of prefill/decode disaggregation (its KV arrives relaid out by DCP's PD
    code, over Mooncake); a prefill server runs plain TP."""
    mode, backend = cfg.disaggregation_mode, cfg.disaggregation_transfer_backend
    if mode == "prefill":
        unsupported(
            cfg,
            "the prefill side of prefill/decode disaggregation (Helix is a decode server)",
            ["--disaggregation-mode prefill"],
            "Run the prefill server with plain --tp (no --helix-kvp-size)",
        )
    if mode == "decode" and cfg.speculative_algorithm is not None:
        unsupported(
            cfg,
            "speculative decoding on a prefill/decode disaggregation decode server yet",
            [f"--speculative-algorithm {cfg.speculative_algorithm}"],
            "Drop --speculative-algorithm",
        )
    if mode == "decode" and backend != "mooncake":
        unsupported(
            cfg,
            f"the {backend} KV transfer backend yet",
            [f"--disaggregation-transfer-backend {backend}"],
            "Use --disaggregation-transfer-backend mooncake",
        )


def check_speculative(cfg: Any) -> None:
    """EAGLE / STANDALONE drafts (chains and trees) and NGRAM on Helix backends, of Helix models; the
    draft's decode steps are captured in CUDA graphs, the verify runs eagerly."""
    from sglang.srt.utils.hf_transformers_utils import get_config

    alg, backend = cfg.speculative_algorithm, cfg.speculative_draft_attention_backend
    # the speculation patches' opt-in
    if not set(helix_architectures(drafts=True)) - set(helix_architectures()):
        unsupported(
            cfg,
            "speculative decoding yet",
            [f"--speculative-algorithm {alg}"],
            "Drop --speculative-algorithm",
        )
    if str(alg).upper() not in ("EAGLE", "STANDALONE", "NGRAM"):
        unsupported(
            cfg,
            f"{alg} speculation yet",
            [f"--speculative-algorithm {alg}"],
            "Use --speculative-algorithm EAGLE, STANDALONE or NGRAM",
        )
    if backend not in (None, *HELIX_ATTENTION_BACKENDS):
        unsupported(
            cfg,
            "this draft attention backend",
            [f"--speculative-draft-attention-backend {backend}"],
            "Use triton or torch_native, or drop the flag",
        )
    check_unsupported_flags(cfg, SPEC_UNSUPPORTED)
    path, override = (
        cfg.speculative_draft_model_path,
        (cfg.decrypted_draft_config_file or "").strip(),
    )
    if not path:
        return
    try:  # upstream's cached get_config, called as its speculative step calls it: no second read
        hf = get_config(
            path,
            trust_remote_code=cfg.trust_remote_code,
            **({"_configuration_file": override} if override else {}),
        )
    except (OSError, ValueError):
        return  # upstream's draft loading reports a path it cannot read
    archs, supported = list(
        getattr(hf, "architectures", None) or []
    ), helix_architectures(drafts=True)
    if not archs or any(a not in supported for a in archs):
        unsupported(
            cfg,
            "this draft model yet",
            [f"--speculative-draft-model-path {path} is {join(archs) or '?'}"],
            f"Use a draft of a Helix architecture ({join(supported)})",
        )
    q = hf.num_attention_heads
    _check_heads(
        cfg,
        q,
        getattr(hf, "num_key_value_heads", None) or q,
        f"--speculative-draft-model-path {path}",
    )
