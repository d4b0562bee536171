# SPDX-License-Identifier: Apache-2.0
"""Server arguments of Helix parallelism (arXiv 2507.07120), DCP's GQA mode:

    --helix-kvp-size K --helix-kvp-chunk-size C
      == --dcp-size K --dcp-comm-backend a2a --dcp-replicate-q-proj --dcp-interleave-size C

``resolve_helix_layout`` (before DCP's step) declares either spelling from the other;
``handle_helix_parallelism`` (after the CUDA graph step, again at the end) refuses what the mode
does not run with and resolves the attention backend, prefill CUDA graphs (off) and the KV page
(``page_size`` C: DCP allocates pages of C x K, one interleave run per rank)."""

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

BACKENDS = ("triton", "torch_native")
# KV cache dtypes with per-layer scales
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
OFF = "--helix-kvp-size 1"
GRID = "Helix arranges the --tp ranks as a KVP x TPA grid"
PAGE = "Helix KV page (--helix-kvp-chunk-size {c} x --helix-kvp-size {k} = {p} tokens)"
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
# Weight formats the mode serves: FP8, whose scales linear.py loads with the qkv rows of the TPA
# shard (per tensor, per channel, 128-blocks), so every KVP rank of a TPA shard holds the same.
FP8_METHODS = ("fp8", "compressed-tensors")
# With an algorithm set: what the mode's draft/verify path does not run with.
SPEC_UNSUPPORTED = {
    "adaptive speculation yet": "speculative_adaptive speculative_adaptive_config",
    "a draft attention window yet": "speculative_draft_window_size speculative_draft_sink_size",
    "decode-mode speculative attention": "speculative_attention_mode=prefill",
    "multi-layer EAGLE yet": "enable_multi_layer_eagle",
}


class HelixConfigError(ValueError):  # launch_server reports it as a usage error
    pass


def fail(problem: str, fix: str = "") -> None:
    message = f"{problem}. {f'{fix}, or use' if fix else 'Use'} {OFF}."
    raise HelixConfigError(message)


def unsupported(cfg: Any, feature: str, given: list, fix: str) -> None:
    mode = f"--helix-kvp-size {cfg.helix_kvp_size}"
    fail(f"{mode} does not support {feature} ({' '.join(given)})", fix)


def raw(server_args: Any, field: str, default: Any = None) -> Any:  # as typed
    return (getattr(server_args, "_raw_input", None) or {}).get(field, default)


def join(items) -> str:  # "a, b or c"
    return " or ".join(", ".join(map(str, items)).rsplit(", ", 1))


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def declare(server_args: Any, **fields: Any) -> None:
    declare_resolution(server_args, "handle_helix_parallelism", **fields)


def dcp_gqa_mode(cfg: Any) -> bool:  # a resolved view, or the published bag
    return cfg.helix_kvp_size > 1


def resolve_helix_layout(server_args: Any) -> None:
    cfg = resolving_view(server_args)
    kvp, chunk, n = cfg.helix_kvp_size, cfg.helix_kvp_chunk_size, cfg.tp_size
    for field in ("helix_kvp_size", "helix_kvp_chunk_size", "dcp_interleave_size"):
        if getattr(cfg, field) < 1:
            got, fix = (
                f"{flag(field)} {getattr(cfg, field)}",
                f"Use a positive {flag(field)}",
            )
            fail(f"{flag(field)} must be >= 1, got {got}", fix)
    if n % kvp:
        good = join(d for d in range(2, n + 1) if n % d == 0)
        problem = f"--helix-kvp-size {kvp} does not divide --tp {n}: {GRID}"
        fail(problem, f"Use --helix-kvp-size {good}")
    # the exchange: a2a, or fi_a2a where named (upstream refuses it where it cannot run)
    exchange = "fi_a2a" if raw(server_args, "dcp_comm_backend") == "fi_a2a" else "a2a"
    layout = dict(dcp_size=kvp, dcp_comm_backend=exchange, dcp_replicate_q_proj=True)
    layout["dcp_interleave_size"] = chunk
    spelled = " ".join(f"{flag(f)} {v}" for f, v in layout.items())
    spelled = spelled.replace(" True", "")
    if kvp > 1:
        for field, value in layout.items():
            given = raw(server_args, field)
            one = given == 1 and field != "dcp_comm_backend"  # 1: DCP's default
            if given not in (None, value) and not one:
                helix = f"--helix-kvp-size {kvp} --helix-kvp-chunk-size {chunk}"
                problem = f"{helix} is {spelled}, but {flag(field)} is {given}"
                fail(problem, f"Drop {flag(field)}")
        if any(getattr(cfg, f) != v for f, v in layout.items()):
            tpa = f"TPA = --tp {n} / {kvp} = {n // kvp}"
            msg = f"Helix parallelism: --helix-kvp-size {kvp} --helix-kvp-chunk-size {chunk} resolves to {spelled} ({tpa})."
            logger.info(msg)
            declare(server_args, **layout)
    elif (
        cfg.dcp_size > 1
        and cfg.dcp_replicate_q_proj
        and cfg.dcp_comm_backend in (None, "a2a", "fi_a2a")
        and model_config_of(server_args).attention_arch != AttentionArch.MLA
    ):  # replicated Q on a GQA model is the mode on every platform (MLA's is upstream's)
        d, i = cfg.dcp_size, cfg.dcp_interleave_size
        dcp = f"--dcp-size {d} --dcp-replicate-q-proj --dcp-interleave-size {i}"
        helix = f"--helix-kvp-size {d} --helix-kvp-chunk-size {i}"
        msg = f"Decode context parallelism {dcp} on a GQA model is Helix parallelism ({helix}), with --dcp-comm-backend {exchange}."
        logger.info(msg)
        helix_fields = dict(helix_kvp_size=d, helix_kvp_chunk_size=i)
        declare(server_args, **helix_fields, dcp_comm_backend=exchange)
    cfg = resolving_view(server_args)
    if cfg.helix_kvp_size > 1:
        # before DCP's own step refuses some of them with a traceback
        check_unsupported_flags(cfg)
        _resolve_kv_page(server_args, cfg)
    elif cfg.dcp_interleave_size != 1:
        mode = "DCP's GQA mode (--dcp-size > 1 --dcp-replicate-q-proj on a GQA model, i.e. --helix-kvp-size)"
        problem = f"--dcp-interleave-size {cfg.dcp_interleave_size} needs {mode}"
        raise HelixConfigError(f"{problem}. Drop --dcp-interleave-size.")


def handle_helix_parallelism(server_args: Any) -> None:  # idempotent
    cfg = resolving_view(server_args)
    if cfg.helix_kvp_size == 1:
        return  # off: nothing is declared, resolution is upstream's
    check_unsupported_flags(cfg)
    _check_features(server_args, cfg)
    _check_model(server_args, cfg)
    _resolve_attention_backend(server_args, cfg)
    graphs = cfg.cuda_graph_config
    if graphs is not None and graphs.prefill.backend != Backend.DISABLED:
        why = "the extend lists are sized on the host"
        msg = f"Helix parallelism (--helix-kvp-size {cfg.helix_kvp_size}): disabling prefill CUDA graphs ({why}); decode graphs stay on."
        logger.warning(msg)
        off = with_phase(graphs, Phase.PREFILL, backend=Backend.DISABLED)
        declare(server_args, cuda_graph_config=off)
    _resolve_kv_page(server_args, cfg)
    _resolve_page_multiples(server_args, cfg)


def _check_model(server_args: Any, cfg: Any) -> None:
    """Its class (per ``--model-impl`` too) opts in in its own body; its heads fit the grid."""
    from sglang.srt.model_loader.utils import get_model_architecture

    kvp, mc = cfg.helix_kvp_size, model_config_of(server_args)
    model, (cls, arch) = f"--model-path {cfg.model_path}", get_model_architecture(mc)
    if not vars(cls).get("supports_dcp_gqa"):
        supported = f"{join(helix_architectures())} models (SGLang's own model code)"
        problem = f"supports only {supported}, but {model} is {arch}"
        fail(f"--helix-kvp-size {kvp} {problem}", "Serve a supported model")
    _check_heads(cfg, mc.num_attention_heads, mc.get_total_num_kv_heads(), model)
    for field, dim in (("head_dim", mc.head_dim), ("v_head_dim", mc.v_head_dim)):
        # the All-to-All packs each head's LSE after its whole row
        if dim < 2 or dim & (dim - 1):
            why = "(the All-to-All and LSE combine take whole head rows)"
            problem = f"--helix-kvp-size {kvp} needs power-of-two attention head dims {why}, but {model} has {field} {dim}"
            fail(problem)
    if mc.quantization:
        _check_quantization(cfg, mc, model)


def _check_quantization(cfg: Any, mc: Any, model: str) -> None:
    """FP8 only; a block-wise checkpoint's qkv rows per TPA rank in whole blocks."""
    method, hf = mc.quantization, mc._parse_quant_hf_config() or {}
    given = f"{model} is {method}-quantized"
    given = f"--quantization {method}" if cfg.quantization else given
    weights = [g.get("weights") or {} for g in (hf.get("config_groups") or {}).values()]
    kinds = {f"{w.get('num_bits')}-bit {w.get('type')}" for w in weights}
    if method not in FP8_METHODS or kinds - {"8-bit float"}:
        what = f"{method} ({join(sorted(kinds))})" if kinds else method
        fix = "Serve a bf16 or FP8 checkpoint (fp8, compressed-tensors FP8)"
        unsupported(cfg, f"{what} weights yet", [given], fix)
    blocks = [hf.get("weight_block_size")] + [w.get("block_structure") for w in weights]
    block = next((b[0] for b in blocks if b), 0)
    n, kvp, heads = cfg.tp_size, cfg.helix_kvp_size, mc.num_attention_heads
    heads = (heads, mc.get_total_num_kv_heads())

    def rows(
        v: int,
    ) -> list:  # q and k/v rows of a TPA rank's qkv_proj at --helix-kvp-size v
        return sorted({h // (n // v) * mc.head_dim for h in heads})

    def whole(v: int) -> bool:
        return n // v <= heads[1] and all(r % block == 0 for r in rows(v))

    if block and not whole(kvp):
        tpa = f"TPA = --tp {n} / --helix-kvp-size {kvp} = {n // kvp}"
        problem = f"--helix-kvp-size {kvp}: {given} in {block}-row blocks, but at {tpa} a qkv_proj shard has {join(rows(kvp))} rows per head group (not whole blocks)"
        good = [v for v in range(2, n + 1) if n % v == 0 and whole(v)]
        fix = "Serve a per-channel or per-tensor FP8 checkpoint"
        fail(problem, f"Use --helix-kvp-size {join(good)}" if good else fix)


def _check_heads(cfg: Any, q: int, k: int, model: str) -> None:
    n, kvp, tpa = cfg.tp_size, cfg.helix_kvp_size, cfg.tp_size // cfg.helix_kvp_size
    if tpa > k or k % tpa:
        fits = lambda v: n % v == 0 and n // v <= k and k % (n // v) == 0  # noqa: E731
        good = [v for v in range(2, n + 1) if fits(v) and q % n == 0]
        fix = f"Use --helix-kvp-size {join(good)}" if good else f"Change --tp {n}"
        grid = f"TPA = --tp {n} / --helix-kvp-size {kvp} = {tpa}"
        why = "each attention-TP rank holds whole KV heads, none duplicated"
        problem = f"{grid} {'exceeds' if tpa > k else 'does not divide'} the {k} KV heads of {model}: {why}"
        fail(problem, fix)
    if q % n:
        why = "after the Helix All-to-All each rank owns an equal share of them"
        problem = f"The {q} query heads of {model} are not divisible by --tp {n}: {why}"
        fail(problem, f"Use a --tp that divides {q}")


def helix_architectures(drafts: bool = False) -> list:
    """Classes that opt in in their own body: ``supports_dcp_gqa``
    (as drafts: ``supports_dcp_gqa_draft``)."""
    from sglang.srt.models.registry import ModelRegistry

    keys = ("supports_dcp_gqa", "supports_dcp_gqa_draft")[: 1 + drafts]
    models = ModelRegistry.models.items()
    return sorted(a for a, cls in models if any(vars(cls).get(k) for k in keys))


def _resolve_attention_backend(server_args: Any, cfg: Any) -> None:
    """One backend for both phases (not a HybridAttnBackend); unset: a split flag's,
    else the platform's."""
    fields = ("attention_backend", "prefill_attention_backend")
    fields += ("decode_attention_backend",)
    main, prefill, decode = values = [getattr(cfg, f) for f in fields]
    given = [f"{flag(f)} {v}" for f, v in zip(fields, values) if v]
    for field, backend in zip(fields, values):
        if backend not in (None, *BACKENDS):
            supported = "the attention backends triton or torch_native"
            problem = f"--helix-kvp-size {cfg.helix_kvp_size} supports only {supported}, but {flag(field)} is {backend}"
            fail(problem, "Pass --attention-backend triton (or torch_native)")
    if (prefill or main or decode) != (decode or main or prefill):
        split = "different prefill and decode attention backends"
        unsupported(cfg, split, given[-2:], "Pass one --attention-backend")
    if main is None:
        platform = "torch_native" if cfg.device == "cpu" else "triton"
        backend = prefill or decode or platform
        msg = f"Helix parallelism: attention backend not specified; using {backend}."
        logger.info(msg)
        declare(server_args, attention_backend=backend)


def _resolve_kv_page(server_args: Any, cfg: Any) -> None:
    kvp, chunk = cfg.helix_kvp_size, cfg.helix_kvp_chunk_size
    typed = raw(server_args, "page_size")
    if cfg.page_size not in (None, 1, chunk) or typed not in (None, 1, chunk):
        pages = f"pages of one --helix-kvp-chunk-size ({chunk}) per rank"
        problem = f"--helix-kvp-size {kvp} allocates KV in {pages}, but --page-size is {cfg.page_size}"
        fail(problem, f"Pass --page-size 1 (or {chunk})")
    # the GPU allocator's kernels: tl.arange(0, page)
    if cfg.device != "cpu" and (kvp * chunk) & (kvp * chunk - 1):
        why = "the Helix KV page must be a power of two (the paged allocator's Triton kernels)"
        product = f"--helix-kvp-chunk-size {chunk} x --helix-kvp-size {kvp}"
        product += f" = {kvp * chunk}"
        fix = f"Use a power-of-two {'--helix-kvp-size' if kvp & (kvp - 1) else '--helix-kvp-chunk-size'}"
        fail(f"{product}: on --device {cfg.device} {why}", fix)
    if cfg.page_size != chunk:
        pages = f"pages of --helix-kvp-chunk-size {chunk} x --helix-kvp-size {kvp} = {kvp * chunk} tokens"
        msg = f"Helix parallelism: --page-size {chunk}; KV ids are allocated in {pages} (one interleave run per KVP rank)."
        logger.info(msg)
        declare(server_args, page_size=chunk)


def _resolve_page_multiples(server_args: Any, cfg: Any) -> None:
    """--max-total-tokens at least one page; --chunked-prefill-size whole pages, at least one."""
    kvp, chunk = cfg.helix_kvp_size, cfg.helix_kvp_chunk_size
    page = kvp * chunk
    what = PAGE.format(c=chunk, k=kvp, p=page)
    if 0 < (cfg.max_total_tokens or 0) < page:
        problem = f"--max-total-tokens {cfg.max_total_tokens} is less than one {what}, in which each rank's KV rows are allocated"
        fix = f"Pass --max-total-tokens {page} or more, or a smaller --helix-kvp-chunk-size"
        fail(problem, fix)
    old = cfg.chunked_prefill_size or 0
    if old > 0 and old % page:
        new = max(page, old // page * page)
        why = "the scheduler cuts prefill chunks at page boundaries"
        if old < page:
            why = "a prefill chunk must hold at least one page"
        msg = f"Helix parallelism: --chunked-prefill-size {old} -> {new}, a multiple of the {what}: {why}."
        logger.info(msg)
        declare(server_args, chunked_prefill_size=new)


def check_unsupported_flags(cfg: Any, features: dict = UNSUPPORTED) -> None:
    for feature, spec in features.items():
        on = []  # (the flag as given, its fix)
        for item in spec.split():
            field, _, off = item.replace(":", "=").partition("=")
            value = getattr(cfg, field)
            default = int(off) if off[-1:].isdigit() else off
            if value not in (None, False) and value != default:
                bare = value is True or isinstance(value, (list, dict))
                fix = f"drop {flag(field)}"
                if "=" in item:
                    fix = f"set {flag(field)} {off}"
                on.append((flag(field) if bare else f"{flag(field)} {value}", fix))
        if on:
            fix = " and ".join(f for _, f in on)
            unsupported(cfg, feature, [g for g, _ in on], fix[0].upper() + fix[1:])


def _check_features(server_args: Any, cfg: Any) -> None:
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        given = [f"--kv-cache-dtype {cfg.kv_cache_dtype}"]
        fix = "Use --kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2"
        unsupported(cfg, "block-scaled KV cache recipes yet", given, fix)
    if cfg.attn_dp_size > 1:
        typed = raw(server_args, "enable_dp_attention", False)
        dp = f"--enable-dp-attention --dp-size {raw(server_args, 'dp_size', cfg.attn_dp_size)}"
        fix = "Drop --enable-dp-attention" if typed else "Set --attn-dp-size 1"
        given = [dp if typed else f"--attn-dp-size {cfg.attn_dp_size}"]
        unsupported(cfg, "DP attention", given, fix)
    if cfg.speculative_algorithm is not None:
        _check_speculative(cfg)
    mode, transfer = cfg.disaggregation_mode, cfg.disaggregation_transfer_backend
    # a PD decode server takes its KV relaid out; a prefill server runs plain TP
    if mode == "prefill":
        side = "the prefill side of prefill/decode disaggregation (Helix is a decode server)"
        fix = "Run the prefill server with plain --tp (no --helix-kvp-size)"
        unsupported(cfg, side, ["--disaggregation-mode prefill"], fix)
    if mode == "decode" and cfg.speculative_algorithm is not None:
        spec = "speculative decoding on a prefill/decode disaggregation decode server"
        spec += " yet"
        given = [f"--speculative-algorithm {cfg.speculative_algorithm}"]
        unsupported(cfg, spec, given, "Drop --speculative-algorithm")
    if mode == "decode" and transfer != "mooncake":
        given = [f"--disaggregation-transfer-backend {transfer}"]
        fix = "Use --disaggregation-transfer-backend mooncake"
        unsupported(cfg, f"the {transfer} KV transfer backend yet", given, fix)


def _check_speculative(cfg: Any) -> None:
    """EAGLE / STANDALONE drafts (chains and trees) and NGRAM on the mode's backends,
    of its models."""
    from sglang.srt.utils.hf_transformers_utils import get_config

    alg, backend = cfg.speculative_algorithm, cfg.speculative_draft_attention_backend
    given = [f"--speculative-algorithm {alg}"]
    drafts = set(helix_architectures(drafts=True)) - set(helix_architectures())
    if not drafts:  # no draft model opted in
        fix = "Drop --speculative-algorithm"
        unsupported(cfg, "speculative decoding yet", given, fix)
    if str(alg).upper() not in ("EAGLE", "STANDALONE", "NGRAM"):
        fix = "Use --speculative-algorithm EAGLE, STANDALONE or NGRAM"
        unsupported(cfg, f"{alg} speculation yet", given, fix)
    if backend not in (None, *BACKENDS):
        given = [f"--speculative-draft-attention-backend {backend}"]
        fix = "Use triton or torch_native, or drop the flag"
        unsupported(cfg, "this draft attention backend", given, fix)
    check_unsupported_flags(cfg, SPEC_UNSUPPORTED)
    path = cfg.speculative_draft_model_path
    override = (cfg.decrypted_draft_config_file or "").strip()
    if not path:
        return
    try:  # upstream's cached get_config, as its speculative step calls it: no second read
        kwargs = {"_configuration_file": override} if override else {}
        hf = get_config(path, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError):
        return  # upstream's draft loading reports a path it cannot read
    archs = list(getattr(hf, "architectures", None) or [])
    supported = helix_architectures(drafts=True)
    draft = f"--speculative-draft-model-path {path}"
    if not archs or any(a not in supported for a in archs):
        fix = f"Use a draft of a Helix architecture ({join(supported)})"
        given = [f"{draft} is {join(archs) or '?'}"]
        unsupported(cfg, "this draft model yet", given, fix)
    q = hf.num_attention_heads
    k = getattr(hf, "num_key_value_heads", None) or q
    _check_heads(cfg, q, k, draft)
