# SPDX-License-Identifier: Apache-2.0
"""Validation of the Helix flags: what is refused at argument time, and how it is reported.

Every refusal is one ``HelixConfigError`` naming the flags, their values and what to do. The
checks here are about the grid and the model (``check_flags``, ``check_model``), the attention
backend (``check_attention_backend``); the server features Helix does not run with are listed in
``helix_unsupported``, the KV page in ``helix_sizes``.
"""

from __future__ import annotations

from typing import Any

# What the Helix attention path is implemented for. Other backends size heads
# by the attention-TP width and have no partial-output + LSE path.
HELIX_ATTENTION_BACKENDS = ("triton", "torch_native")


class HelixConfigError(ValueError):
    """An invalid or unsupported Helix configuration, found at argument time.

    A ``ValueError``, as every resolution hook reports a user error, so ``Engine`` callers and
    tests handle it like the others; ``launch_server`` prints it as argparse prints a usage error
    (``sglang serve: error: <message>``, exit status 2).
    """


def fail(message: str) -> None:
    raise HelixConfigError(message)


def unsupported(cfg: Any, feature: str, given: list, fix: str, why: str = "") -> None:
    """The standard refusal of a feature Helix does not run with."""
    fail(
        f"--helix-kvp-size {cfg.helix_kvp_size} does not support {feature} "
        f"({' '.join(given)}){': ' + why if why else ''}. {fix}, or use "
        "--helix-kvp-size 1."
    )


def raw(server_args: Any, field: str, default: Any) -> Any:
    """What the caller asked for, before any declaration (the pipeline's ``_raw_input``
    snapshot)."""
    snapshot = getattr(server_args, "_raw_input", None) or {}
    return snapshot.get(field, default)


def join(items, last: str = "or") -> str:
    items = [str(i) for i in items]
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} {last} {items[-1]}"


# ---------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------


def check_flags(server_args: Any, cfg: Any) -> None:
    """The two flags and the KVP x TPA = N grid (TPA = N / KVP); checked with Helix off too."""
    kvp, n = cfg.helix_kvp_size, cfg.tp_size
    if kvp < 1:
        fail(
            f"--helix-kvp-size must be >= 1, got --helix-kvp-size {kvp}. Use 1 "
            "to run without Helix, or the KV-parallel width (a divisor of "
            f"--tp {n}) to enable it."
        )
    for flag, value in (("--helix-kvp-chunk-size", cfg.helix_kvp_chunk_size), ("--dcp-interleave-size", cfg.dcp_interleave_size)):
        if value < 1:
            fail(
                f"{flag} must be >= 1, got {flag} {value}. It is the number of consecutive tokens "
                "one KVP (DCP) rank stores before ownership moves to the next rank."
            )
    if n % kvp:
        fail(
            f"--helix-kvp-size {kvp} does not divide --tp {n}: Helix arranges "
            "the --tp ranks as a KVP x TPA grid, so --tp must be a multiple of "
            f"--helix-kvp-size. Valid values for --tp {n}: {join(_divisors(n))}."
        )


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


def check_model(server_args: Any, cfg: Any) -> None:
    """Architecture and head-count checks; reads the HF config and resolves the model class
    (as ``supports_cuda_vmm_feature_transport`` does), not weights."""
    from sglang.srt.arg_groups.overrides import model_config_of

    kvp, n = cfg.helix_kvp_size, cfg.tp_size
    tpa = n // kvp
    model_config = model_config_of(server_args)
    if cfg.model_impl not in ("auto", "sglang"):
        fail(
            f"--helix-kvp-size {kvp} is implemented in SGLang's own model code, "
            f"not --model-impl {cfg.model_impl}. Use --model-impl sglang (or "
            "auto), or use --helix-kvp-size 1."
        )
    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    supported = helix_architectures()
    if not archs or any(a not in supported for a in archs):
        given = f"--model-path {cfg.model_path} is {join(archs) or 'an unknown architecture'}"
        if not supported:  # no model's attention implements Helix in this build
            fail(f"--helix-kvp-size {kvp}: no model supports Helix in this build ({given}). Use --helix-kvp-size 1.")
        fail(
            f"--helix-kvp-size {kvp} supports only {join(supported)} models, but {given}. Serve a "
            "supported model, or use --helix-kvp-size 1."
        )
    k = model_config.get_total_num_kv_heads()
    q = model_config.num_attention_heads
    if tpa > k or k % tpa:
        width = f"TPA = --tp {n} / --helix-kvp-size {kvp} = {tpa}"
        relation = "exceeds" if tpa > k else "does not divide"
        good = _valid_kvp(n, q, k)
        if good:
            hint = f"Use --helix-kvp-size {join(good)} with --tp {n}"
        else:
            hint = f"No --helix-kvp-size fits --tp {n} for this model; change --tp"
        fail(
            f"{width} {relation} the {k} KV heads of --model-path "
            f"{cfg.model_path} (num_key_value_heads): each attention-TP rank "
            f"must hold whole KV heads, none duplicated. {hint}."
        )
    if q % n:
        fail(
            f"The {q} query heads of --model-path {cfg.model_path} "
            f"(num_attention_heads) are not divisible by --tp {n}: after the "
            "Helix All-to-All each of the --tp ranks owns an equal share of the "
            f"query heads. Use a --tp that divides {q}, or use "
            "--helix-kvp-size 1."
        )
    _check_head_dim(cfg, model_config)
    quantization = model_config.quantization
    if quantization:  # a quantized checkpoint (the flags: helix_unsupported)
        unsupported(
            cfg,
            "quantized weights yet",
            [f"--model-path {cfg.model_path} is {quantization}-quantized"],
            "Serve an unquantized checkpoint",
        )
    if cfg.device == "cpu":
        _check_cpu_mlp_padding(cfg, model_config, kvp, n, tpa)


def helix_architectures() -> list:
    """The architectures whose model class opts into Helix in its own body (``supports_helix =
    True``, where its qkv_proj shards through DCP's partitions and it calls ``self.attn``:
    docs/helix-design.md, "Adding a model"). The opt-in is not inherited: a subclass is not served
    unverified."""
    from sglang.srt.models.registry import ModelRegistry

    ModelRegistry.get_supported_archs()  # imports the model modules once
    return sorted(arch for arch, cls in ModelRegistry.models.items() if vars(cls).get("supports_helix", False))


def helix_draft_architectures() -> list:
    """What a Helix target accepts as its speculative draft: the Helix architectures and the draft
    heads that opt in as drafts in their own body (``supports_helix_draft = True``)."""
    from sglang.srt.models.registry import ModelRegistry

    drafts = [arch for arch, cls in ModelRegistry.models.items() if vars(cls).get("supports_helix_draft", False)]
    return sorted(set(helix_architectures()) | set(drafts))


def _check_head_dim(cfg: Any, model_config: Any) -> None:
    """The All-to-All packs each head's fp32 LSE after its output, and the LSE combine loads a
    head row whole (``tl.arange(0, D)``): the head dims must be powers of two, at least 2 (the
    LSE takes 2 columns of a 16-bit output). Refused here, not at the first forward."""
    kvp = cfg.helix_kvp_size
    for field, dim in (("head_dim", model_config.head_dim), ("v_head_dim", model_config.v_head_dim)):
        if dim < 2 or dim & (dim - 1):
            fail(
                f"--helix-kvp-size {kvp} needs power-of-two attention head dims, but --model-path "
                f"{cfg.model_path} has {field} {dim}: the Helix All-to-All and LSE combine "
                "(upstream DCP's dcp_a2a_lse_reduce) take whole power-of-two head rows. Use "
                "--helix-kvp-size 1."
            )


# The MLP widths adjust_config_with_unaligned_cpu_tp pads (dense and expert MLPs).
_CPU_PADDED_MLP_FIELDS = (
    "intermediate_size",
    "moe_intermediate_size",
    "intermediate_size_mlp",
    "shared_expert_intermediate_size",
)


def _check_cpu_mlp_padding(cfg: Any, model_config: Any, kvp: int, n: int, tpa: int) -> None:
    """The CPU engine pads intermediate_size to a multiple of 32 x the width it pads for
    (``adjust_config_with_unaligned_cpu_tp``), which under Helix is TPA (the CPU-engine patch),
    while the MLP stays sharded over N: refuse what does not come out divisible by N, before it
    fails at load. (Unquantized weights: Helix refuses quantized ones, whose block size changes
    32.)"""
    from sglang.srt.configs.update_config import get_moe_padding_size

    step = tpa * get_moe_padding_size(None)
    for field in _CPU_PADDED_MLP_FIELDS:
        inter = getattr(model_config.hf_text_config, field, None)
        if not inter:
            continue
        padded = inter if inter % step == 0 else -(-inter // step) * step
        if padded % n:
            fail(
                f"--helix-kvp-size {kvp} on --device cpu cannot shard the MLP of --model-path "
                f"{cfg.model_path} over --tp {n}: its {field} {inter}, which the CPU "
                f"engine pads to a multiple of {step} for the attention width TPA = {tpa} only "
                f"({padded}), is not divisible by --tp {n}. Use a --helix-kvp-size that divides "
                "32, or use --helix-kvp-size 1."
            )


# ---------------------------------------------------------------------------
# The attention backend
# ---------------------------------------------------------------------------


def check_attention_backend(server_args: Any, cfg: Any) -> None:
    """Refuse a backend the Helix attention does not implement (``helix_defaults`` picks one
    when none is given)."""
    kvp = cfg.helix_kvp_size
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        backend = getattr(cfg, field)
        if backend is None or backend in HELIX_ATTENTION_BACKENDS:
            continue
        flag = "--" + field.replace("_", "-")
        given = raw(server_args, field, backend)
        value = f"{flag} is {backend}" if given == backend else f"{flag} resolves to {backend}"
        fail(
            f"--helix-kvp-size {kvp} supports only the attention backends "
            f"{join(HELIX_ATTENTION_BACKENDS)}, but {value}. Pass "
            "--attention-backend triton (or torch_native), or use "
            "--helix-kvp-size 1."
        )


def check_one_attention_backend(server_args: Any, cfg: Any) -> None:
    """One backend object must run both phases: different ones make SGLang build a
    HybridAttnBackend around them, which the Helix attention does not dispatch."""
    prefill, decode = cfg.prefill_attention_backend, cfg.decode_attention_backend
    if (prefill or cfg.attention_backend) != (decode or cfg.attention_backend):
        given = [f"--attention-backend {cfg.attention_backend}"] if not (prefill and decode) else []
        given += [f"--prefill-attention-backend {prefill}"] if prefill else []
        given += [f"--decode-attention-backend {decode}"] if decode else []
        unsupported(
            cfg,
            "different prefill and decode attention backends",
            given,
            "Pass one --attention-backend (triton or torch_native)",
            "SGLang runs them through a HybridAttnBackend, which the Helix "
            "attention does not dispatch",
        )


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid_kvp(n: int, q: int, k: int) -> list:
    """KVP > 1 values that make a valid grid for --tp n and this model."""
    if q % n:
        return []
    return [kvp for kvp in _divisors(n)[1:] if n // kvp <= k and k % (n // kvp) == 0]
