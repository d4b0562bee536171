# SPDX-License-Identifier: Apache-2.0
"""Server-argument resolution for Helix parallelism (arXiv 2507.07120).

With ``--tp N --helix-kvp-size KVP`` the N tensor-parallel ranks form a
KVP x TPA grid for attention (TPA = N / KVP): each request's KV cache is
sharded along the sequence over the KVP ranks that share a TPA rank, in
round-robin chunks of ``--helix-kvp-chunk-size`` tokens; the KV heads are
sharded over TPA; the FFN stays tensor parallel over all N ranks.
``--helix-kvp-size 1`` (the default) disables Helix and this module declares
nothing.

``handle_helix_parallelism`` is one idempotent resolution step, run twice by
the pipeline like ``handle_kv_cache_sharding``: early (right after the CUDA
graph configuration is parsed, before memory sizing and before anything reads
the radix-cache switch for sizing), and again at the end, over the final
values, so that a later handler that picks an attention backend or a page size
cannot slip an unsupported value past it. Each run

- rejects invalid or unsupported configurations with one ``HelixConfigError``
  (a ``ValueError``) naming the flags, their values, and what to do (the
  features Helix does not run with: ``helix_unsupported``);
- switches off what Helix cannot run with yet (CUDA graphs; decode's stay on
  with the opt-in ``--helix-enable-cuda-graph``), with one warning, only when
  it was on;
- resolves ``helix_tpa_size`` (0 -> N / KVP) and, when no attention backend was
  given, picks a supported one (one backend for both phases);
- resolves the KV page and the sizes counted in it (``helix_sizes``).

Runtime code asks ``get_parallel().helix_enabled`` / ``helix_tpa_size`` /
``helix_kvp_chunk_size`` after publish, or ``helix_enabled(cfg)`` /
``helix_tpa_size_of(cfg)`` on a ServerArgs or view.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

# What the Helix attention path is implemented for. Other backends size heads
# by the attention-TP width and have no partial-output + LSE path.
HELIX_ATTENTION_BACKENDS = ("triton", "torch_native")
# The architectures whose attention module opts into Helix (helix_attention_tp +
# helix_attention, one patch per model family; docs/helix-design.md, "Adding a model").
HELIX_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",  # a LlamaForCausalLM subclass
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
# The field default (arg_groups/fields/parallel.py; why 64: docs/helix-flags.md).
DEFAULT_HELIX_KVP_CHUNK_SIZE = 64

# How the argparse errors of `prepare_server_args` name the program.
_PROG = "sglang serve"


class HelixConfigError(ValueError):
    """An invalid or unsupported Helix configuration, found at argument time.

    A ``ValueError``, as every resolution hook reports a user error, so callers
    (``Engine``, tests) handle it like the others. When nothing catches it, the
    interpreter prints ``sglang serve: error: <message>`` and exits with status
    2 instead of printing a traceback: see ``_install_clean_exit``.
    """


# ---------------------------------------------------------------------------
# Accessors
# ---------------------------------------------------------------------------


def helix_enabled(cfg: Any) -> bool:
    """Whether Helix is on: ``helix_kvp_size > 1``.

    ``cfg`` is a ServerArgs, a resolving/resolved view, or a published
    parallel bag; this is also the ``Derived`` behind
    ``get_parallel().helix_enabled``.
    """
    return _view(cfg).helix_kvp_size > 1


def helix_tpa_size_of(cfg: Any) -> int:
    """The attention tensor-parallel width TPA: ``helix_tpa_size``, or
    ``tp_size // helix_kvp_size`` where it is 0 (unset). Equals ``tp_size``
    when Helix is off."""
    view = _view(cfg)
    return view.helix_tpa_size or view.tp_size // max(view.helix_kvp_size, 1)


def _view(cfg: Any) -> Any:
    """Read a ServerArgs record through its declarations; pass views and
    published bags through."""
    from sglang.srt.arg_groups.arg_utils import is_record

    if is_record(cfg):
        from sglang.srt.arg_groups.overrides import resolving_view

        return resolving_view(cfg)
    return cfg


# ---------------------------------------------------------------------------
# The resolution step
# ---------------------------------------------------------------------------


def handle_helix_parallelism(server_args: Any) -> None:
    """Validate the Helix flags and resolve what Helix implies. Idempotent."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    _check_flags(server_args, cfg)
    if cfg.helix_kvp_size == 1:
        # Helix off: nothing is declared, so resolution is upstream's.
        return

    from sglang.srt.arg_groups.helix_sizes import resolve_kv_page, resolve_page_multiples
    from sglang.srt.arg_groups.helix_unsupported import check_unsupported_features

    check_unsupported_features(server_args, cfg)
    _check_model(server_args, cfg)
    _check_page_size(server_args, cfg)
    _check_attention_backend(server_args, cfg)

    if cfg.helix_tpa_size == 0:
        _declare(server_args, helix_tpa_size=cfg.tp_size // cfg.helix_kvp_size)
    _switch_off_cuda_graphs(server_args, cfg)
    resolve_kv_page(server_args, cfg)
    resolve_page_multiples(server_args, cfg)


def _check_flags(server_args: Any, cfg: Any) -> None:
    """The three flags and the KVP x TPA = N grid; checked with Helix off too,
    so that a forgotten --helix-kvp-size next to --helix-tpa-size is caught."""
    kvp, n = cfg.helix_kvp_size, cfg.tp_size
    tpa = _raw(server_args, "helix_tpa_size", cfg.helix_tpa_size)
    if kvp < 1:
        _fail(
            f"--helix-kvp-size must be >= 1, got --helix-kvp-size {kvp}. Use 1 "
            "to run without Helix, or the KV-parallel width (a divisor of "
            f"--tp {n}) to enable it."
        )
    if tpa < 0:
        _fail(
            f"--helix-tpa-size must be >= 0, got --helix-tpa-size {tpa}. Leave "
            "it at 0 to derive it as --tp / --helix-kvp-size."
        )
    if cfg.helix_kvp_chunk_size < 1:
        _fail(
            "--helix-kvp-chunk-size must be >= 1, got --helix-kvp-chunk-size "
            f"{cfg.helix_kvp_chunk_size}. It is the number of consecutive tokens "
            "one KVP rank stores before ownership moves to the next rank; the "
            f"default is {DEFAULT_HELIX_KVP_CHUNK_SIZE}."
        )
    if n % kvp:
        _fail(
            f"--helix-kvp-size {kvp} does not divide --tp {n}: Helix arranges "
            "the --tp ranks as a KVP x TPA grid, so --tp must be a multiple of "
            f"--helix-kvp-size. Valid values for --tp {n}: {_join(_divisors(n))}."
        )
    if tpa and kvp * tpa != n:
        _fail(
            f"--helix-kvp-size {kvp} x --helix-tpa-size {tpa} = {kvp * tpa} does "
            f"not equal --tp {n}: Helix arranges the --tp ranks as a KVP x TPA "
            f"grid. Set --helix-tpa-size {n // kvp} (= --tp / --helix-kvp-size) "
            "or leave it at 0 to derive it."
        )


def _check_model(server_args: Any, cfg: Any) -> None:
    """Architecture and head-count checks; reads the HF config, not weights."""
    from sglang.srt.arg_groups.overrides import model_config_of

    kvp, n = cfg.helix_kvp_size, cfg.tp_size
    tpa_given = _raw(server_args, "helix_tpa_size", cfg.helix_tpa_size)
    tpa = tpa_given or n // kvp
    model_config = model_config_of(server_args)
    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    if not archs or any(a not in HELIX_ARCHITECTURES for a in archs):
        _fail(
            f"--helix-kvp-size {kvp} supports only {_join(HELIX_ARCHITECTURES)} "
            f"models, but --model-path {cfg.model_path} is "
            f"{_join(archs) or 'an unknown architecture'}. Serve a supported "
            "model, or use --helix-kvp-size 1."
        )
    if cfg.model_impl not in ("auto", "sglang"):
        _fail(
            f"--helix-kvp-size {kvp} is implemented in SGLang's own model code, "
            f"not --model-impl {cfg.model_impl}. Use --model-impl sglang (or "
            "auto), or use --helix-kvp-size 1."
        )
    k = model_config.get_total_num_kv_heads()
    q = model_config.num_attention_heads
    if tpa > k or k % tpa:
        if tpa_given:
            width = f"--helix-tpa-size {tpa}"
        else:
            width = f"TPA = --tp {n} / --helix-kvp-size {kvp} = {tpa}"
        relation = "exceeds" if tpa > k else "does not divide"
        good = _valid_kvp(n, q, k)
        if good:
            hint = f"Use --helix-kvp-size {_join(good)} with --tp {n}"
            if tpa_given:
                hint += " and --helix-tpa-size 0"
        else:
            hint = f"No --helix-kvp-size fits --tp {n} for this model; change --tp"
        _fail(
            f"{width} {relation} the {k} KV heads of --model-path "
            f"{cfg.model_path} (num_key_value_heads): each attention-TP rank "
            f"must hold whole KV heads, none duplicated. {hint}."
        )
    if q % n:
        _fail(
            f"The {q} query heads of --model-path {cfg.model_path} "
            f"(num_attention_heads) are not divisible by --tp {n}: after the "
            "Helix All-to-All each of the --tp ranks owns an equal share of the "
            f"query heads. Use a --tp that divides {q}, or use "
            "--helix-kvp-size 1."
        )
    quantization = model_config.quantization
    if quantization:  # a quantized checkpoint (the flags: helix_unsupported)
        _unsupported(
            cfg,
            "quantized weights yet",
            [f"--model-path {cfg.model_path} is {quantization}-quantized"],
            "Serve an unquantized checkpoint",
        )
    if cfg.device == "cpu":
        _check_cpu_mlp_padding(cfg, model_config, kvp, n, tpa)


# The MLP widths adjust_config_with_unaligned_cpu_tp pads (dense and expert MLPs).
_CPU_PADDED_MLP_FIELDS = (
    "intermediate_size",
    "moe_intermediate_size",
    "intermediate_size_mlp",
    "shared_expert_intermediate_size",
)


def _check_cpu_mlp_padding(cfg: Any, model_config: Any, kvp: int, n: int, tpa: int) -> None:
    """The CPU engine pads intermediate_size to a multiple of 32 x the width it pads for
    (``adjust_config_with_unaligned_cpu_tp``), which under Helix is TPA (patch 0009), while the
    MLP stays sharded over N: refuse what does not come out divisible by N, before it fails at
    load. (Unquantized weights: Helix refuses quantized ones, whose block size changes 32.)"""
    from sglang.srt.configs.update_config import get_moe_padding_size

    step = tpa * get_moe_padding_size(None)
    for field in _CPU_PADDED_MLP_FIELDS:
        inter = getattr(model_config.hf_text_config, field, None)
        if not inter:
            continue
        padded = inter if inter % step == 0 else -(-inter // step) * step
        if padded % n:
            _fail(
                f"--helix-kvp-size {kvp} on --device cpu cannot shard the MLP of --model-path "
                f"{cfg.model_path} over --tp {n}: its {field} {inter}, which the CPU "
                f"engine pads to a multiple of {step} for the attention width TPA = {tpa} only "
                f"({padded}), is not divisible by --tp {n}. Use a --helix-kvp-size that divides "
                "32, or use --helix-kvp-size 1."
            )


def _check_attention_backend(server_args: Any, cfg: Any) -> None:
    """Reject an unsupported backend; pick a supported one when none was given."""
    kvp = cfg.helix_kvp_size
    for field in (
        "attention_backend",
        "prefill_attention_backend",
        "decode_attention_backend",
    ):
        backend = getattr(cfg, field)
        if backend is None or backend in HELIX_ATTENTION_BACKENDS:
            continue
        flag = "--" + field.replace("_", "-")
        given = _raw(server_args, field, backend)
        value = (
            f"{flag} is {backend}"
            if given == backend
            else f"{flag} resolves to {backend}"
        )
        _fail(
            f"--helix-kvp-size {kvp} supports only the attention backends "
            f"{_join(HELIX_ATTENTION_BACKENDS)}, but {value}. Pass "
            "--attention-backend triton (or torch_native), or use "
            "--helix-kvp-size 1."
        )
    if cfg.attention_backend is None:
        # Before the platform default (fa3, flashinfer, intel_amx, ...) is
        # chosen, choose one Helix supports: the one a split flag names, if
        # it names one, else the platform's.
        split = {cfg.prefill_attention_backend, cfg.decode_attention_backend} - {None}
        if len(split) == 1:
            backend = split.pop()
        else:
            backend = "torch_native" if cfg.device == "cpu" else "triton"
        logger.info(
            "Helix parallelism: attention backend not specified; using %s.",
            backend,
        )
        _declare(server_args, attention_backend=backend)
    # One backend object must run both phases: different ones make SGLang
    # build a HybridAttnBackend around them, which helix_attention refuses.
    prefill, decode = cfg.prefill_attention_backend, cfg.decode_attention_backend
    if (prefill or cfg.attention_backend) != (decode or cfg.attention_backend):
        given = [f"--attention-backend {cfg.attention_backend}"] if not (prefill and decode) else []
        given += [f"--prefill-attention-backend {prefill}"] if prefill else []
        given += [f"--decode-attention-backend {decode}"] if decode else []
        _unsupported(
            cfg,
            "different prefill and decode attention backends",
            given,
            "Pass one --attention-backend (triton or torch_native)",
            "SGLang runs them through a HybridAttnBackend, which the Helix "
            "attention does not dispatch",
        )


def helix_kv_page_size(cfg: Any) -> int:
    """The KV allocator page under Helix: one ownership chunk per KVP rank.

    The allocator hands out rank-invariant logical ids in pages of ``chunk * KVP``; a page holds
    one chunk for each KVP rank, so the owner and the physical row of a KV id are pure functions
    of the id (``sglang.srt.layers.helix.kv_layout``) and every rank's allocator, and so every
    scheduling decision, is identical.
    """
    view = _view(cfg)
    return view.helix_kvp_chunk_size * view.helix_kvp_size


def _check_page_size(server_args: Any, cfg: Any) -> None:
    page_size = cfg.page_size
    given = _raw(server_args, "page_size", page_size)
    if given in (None, 1) and page_size in (None, 1, helix_kv_page_size(cfg)):
        return  # unset resolves to 1; the KV page is ours (helix_sizes.resolve_kv_page)
    value = (
        f"--page-size is {page_size}"
        if given == page_size
        else f"--page-size resolves to {page_size}"
    )
    _fail(
        f"--helix-kvp-size {cfg.helix_kvp_size} supports only --page-size 1 "
        f"yet, but {value}. Pass --page-size 1, or use --helix-kvp-size 1."
    )


def _switch_off_cuda_graphs(server_args: Any, cfg: Any) -> None:
    """CUDA graphs off under Helix, unless ``--helix-enable-cuda-graph`` keeps decode's on.

    The Helix decode step is capturable (layers/helix/decode_state.py; verified on the CPU through
    the backend's capture/replay hooks); prefill graphs are not (the extend lists have host-sized
    shapes), so they go off either way.
    """
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    graphs = cfg.cuda_graph_config
    on = [
        phase
        for phase in Phase.ALL
        if graphs is not None and getattr(graphs, phase).backend != Backend.DISABLED
    ]
    # Kept decode graphs log that they are unverified on GPUs when captured (decode_state.py).
    keep = [Phase.DECODE] if getattr(cfg, "helix_enable_cuda_graph", False) and Phase.DECODE in on else []
    off = [phase for phase in on if phase not in keep]
    if not off and (keep or cfg.disable_cuda_graph):
        return
    if off:
        logger.warning(
            "Helix parallelism (--helix-kvp-size %d): disabling CUDA graphs (%s)%s.",
            cfg.helix_kvp_size,
            ", ".join(off),
            "; prefill graphs are not supported under Helix" if keep else
            "; pass --helix-enable-cuda-graph to keep decode graphs (unverified on GPUs)",
        )
        for phase in off:
            graphs = with_phase(graphs, phase, backend=Backend.DISABLED)
        _declare(server_args, cuda_graph_config=graphs)
    if not keep:
        _declare(server_args, disable_cuda_graph=True)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _declare(server_args: Any, **fields: Any) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, "handle_helix_parallelism", **fields)


def _raw(server_args: Any, field: str, default: Any) -> Any:
    """What the caller asked for, before any declaration (the pipeline's
    ``_raw_input`` snapshot)."""
    raw = getattr(server_args, "_raw_input", None) or {}
    return raw.get(field, default)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid_kvp(n: int, q: int, k: int) -> list:
    """KVP > 1 values that make a valid grid for --tp n and this model."""
    if q % n:
        return []
    return [kvp for kvp in _divisors(n)[1:] if n // kvp <= k and k % (n // kvp) == 0]


def _join(items, last: str = "or") -> str:
    items = [str(i) for i in items]
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} {last} {items[-1]}"


def _unsupported(cfg: Any, feature: str, given: list, fix: str, why: str = "") -> None:
    """The standard refusal of a feature Helix does not run with."""
    _fail(
        f"--helix-kvp-size {cfg.helix_kvp_size} does not support {feature} "
        f"({' '.join(given)}){': ' + why if why else ''}. {fix}, or use "
        "--helix-kvp-size 1."
    )


def _fail(message: str) -> None:
    _install_clean_exit()
    raise HelixConfigError(message)


def _install_clean_exit() -> None:
    """Print an uncaught ``HelixConfigError`` like an argparse error.

    Upstream resolution hooks raise ``ValueError`` from
    ``ServerArgs.resolve_once``, which ``launch_server`` / ``sglang serve`` do
    not catch, so the user gets a traceback. A Helix misconfiguration is a
    command-line error: when nothing catches it, print one line on stderr and
    exit with status 2, as ``parser.error`` does. Every other exception goes to
    the previous hook. Installed only when a Helix error is raised.
    """
    previous = sys.excepthook
    if getattr(previous, "_helix_clean_exit", False):
        return

    def excepthook(exc_type, exc, tb):
        if isinstance(exc, HelixConfigError):
            sys.stderr.write(f"{_PROG}: error: {exc}\n")
            sys.stderr.flush()
            # The interpreter exits with the status a SystemExit raised by
            # the hook carries: 2, as argparse exits on a usage error.
            raise SystemExit(2)
        previous(exc_type, exc, tb)

    excepthook._helix_clean_exit = True
    sys.excepthook = excepthook
