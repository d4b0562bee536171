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
  (a ``ValueError``) naming the flags, their values, and what to do
  (``helix_checks``: the grid, the model, the backend; ``helix_unsupported``:
  the server features Helix does not run with);
- sets what the user left unset (``helix_defaults``): ``helix_tpa_size``
  (0 -> N / KVP), a supported attention backend, and CUDA graphs off (decode's
  stay on with the opt-in ``--helix-enable-cuda-graph``);
- resolves the KV page and the sizes counted in it (``helix_sizes``).

Runtime code asks ``get_parallel().helix_enabled`` / ``helix_tpa_size`` /
``helix_kvp_chunk_size`` after publish, or ``helix_enabled(cfg)`` on a
ServerArgs or view.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.arg_groups import helix_checks, helix_defaults, helix_sizes
from sglang.srt.arg_groups.helix_unsupported import check_unsupported_features


def handle_helix_parallelism(server_args: Any) -> None:
    """Validate the Helix flags and resolve what Helix implies. Idempotent."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    helix_checks.check_flags(server_args, cfg)
    if cfg.helix_kvp_size == 1:
        # Helix off: nothing is declared, so resolution is upstream's.
        return

    check_unsupported_features(server_args, cfg)
    helix_checks.check_model(server_args, cfg)
    helix_sizes.check_page_size(server_args, cfg)
    helix_checks.check_attention_backend(server_args, cfg)

    helix_defaults.resolve_tpa_size(server_args, cfg)
    helix_defaults.pick_attention_backend(server_args, cfg)
    helix_checks.check_one_attention_backend(server_args, cfg)
    helix_defaults.switch_off_cuda_graphs(server_args, cfg)
    helix_sizes.resolve_kv_page(server_args, cfg)
    helix_sizes.resolve_page_multiples(server_args, cfg)


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


def _view(cfg: Any) -> Any:
    """Read a ServerArgs record through its declarations; pass views and
    published bags through."""
    from sglang.srt.arg_groups.arg_utils import is_record

    if is_record(cfg):
        from sglang.srt.arg_groups.overrides import resolving_view

        return resolving_view(cfg)
    return cfg
