# SPDX-License-Identifier: Apache-2.0
"""Server-argument resolution for Helix parallelism (arXiv 2507.07120): the GQA mode of DCP.

With ``--tp N --helix-kvp-size K`` the N tensor-parallel ranks form a K x TPA grid for attention
(TPA = N / K): each request's KV cache is sharded along the sequence over the K ranks of a DCP
group, in round-robin chunks of ``--helix-kvp-chunk-size`` tokens; Q, K and V heads are sharded
over TPA and replicated inside the group; one All-to-All of the partials merges them; the FFN
stays tensor parallel over all N ranks. That is decode context parallelism with replicated Q and
the a2a exchange, so the flags resolve into DCP's fields (``resolve_helix_layout``, before DCP's
own step):

    --helix-kvp-size K --helix-kvp-chunk-size C
      == --dcp-size K --dcp-comm-backend a2a --dcp-replicate-q-proj --dcp-interleave-size C

and DCP's spelling on a GQA model sets the Helix fields, so both start the same server.
``--helix-kvp-size 1`` with no such DCP flags declares nothing.

``handle_helix_parallelism`` then runs twice, like ``handle_kv_cache_sharding``: right after the
CUDA graph configuration is parsed, and again at the end over the final values. Each run rejects
what Helix does not run with (one ``HelixConfigError`` naming the flags: ``helix_checks``,
``helix_unsupported``), picks an attention backend and switches CUDA graphs off
(``helix_defaults``), and resolves the sizes counted in the KV page (``helix_sizes``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from sglang.srt.arg_groups import helix_checks, helix_defaults, helix_sizes
from sglang.srt.arg_groups.helix_checks import HelixConfigError
from sglang.srt.arg_groups.helix_unsupported import check_unsupported_features, check_unsupported_flags


def resolve_helix_layout(server_args: Any) -> None:
    """Helix's flags -> DCP's fields, or DCP's GQA spelling -> Helix's. Idempotent."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    helix_checks.check_flags(server_args, cfg)
    if cfg.helix_kvp_size > 1:
        helix_defaults.declare_dcp_layout(server_args, cfg)
    elif helix_defaults.spelled_with_dcp_flags(server_args, cfg):
        helix_defaults.declare_helix_flags(server_args, cfg)
    elif cfg.dcp_interleave_size != 1:
        helix_checks.fail(
            f"--dcp-interleave-size {cfg.dcp_interleave_size} needs DCP's GQA mode (--dcp-size > 1 "
            "--dcp-comm-backend a2a --dcp-replicate-q-proj on a GQA model, i.e. --helix-kvp-size): "
            "the other DCP paths store tokens round robin one at a time. Drop --dcp-interleave-size."
        )
    cfg = resolving_view(server_args)
    if cfg.helix_kvp_size > 1:
        with _named_for_the_spelling(server_args, cfg):
            check_unsupported_flags(server_args, cfg)  # before DCP's own step refuses them
            helix_sizes.check_page_size(server_args, cfg)
            helix_sizes.resolve_kv_page(server_args, cfg)


def handle_helix_parallelism(server_args: Any) -> None:
    """Validate what Helix runs with and resolve what it implies. Idempotent."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if cfg.helix_kvp_size == 1:
        return  # Helix off: nothing is declared, so resolution is upstream's.
    with _named_for_the_spelling(server_args, cfg):
        check_unsupported_features(server_args, cfg)
        helix_checks.check_model(server_args, cfg)
        helix_sizes.check_page_size(server_args, cfg)
        helix_checks.check_attention_backend(server_args, cfg)

        helix_defaults.pick_attention_backend(server_args, cfg)
        helix_checks.check_one_attention_backend(server_args, cfg)
        helix_defaults.switch_off_cuda_graphs(server_args, cfg)
        helix_sizes.resolve_kv_page(server_args, cfg)
        helix_sizes.resolve_page_multiples(server_args, cfg)


@contextmanager
def _named_for_the_spelling(server_args: Any, cfg: Any):
    """A refusal of the DCP spelling says which Helix layout it asked for."""
    try:
        yield
    except HelixConfigError as e:
        if helix_checks.raw(server_args, "helix_kvp_size", 1) != 1:
            raise
        raise HelixConfigError(
            f"--dcp-size {cfg.dcp_size} --dcp-comm-backend a2a --dcp-replicate-q-proj on a GQA model "
            f"is Helix parallelism (--helix-kvp-size {cfg.dcp_size}): {e}"
        ) from None


# ---------------------------------------------------------------------------
# Accessors
# ---------------------------------------------------------------------------


def helix_enabled(cfg: Any) -> bool:
    """Whether Helix (DCP's GQA mode) is on: ``helix_kvp_size > 1``, which either spelling sets.

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
