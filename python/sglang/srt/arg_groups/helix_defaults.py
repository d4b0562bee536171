# SPDX-License-Identifier: Apache-2.0
"""What Helix sets when the user did not: DCP's fields for its layout (both spellings), the
attention backend, and the CUDA graphs it cannot run with. Each is a declaration of the ``handle_helix_parallelism`` step,
made only where the value differs, and logged once."""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.arg_groups.helix_checks import fail, raw

logger = logging.getLogger(__name__)


def declare(server_args: Any, **fields: Any) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, "handle_helix_parallelism", **fields)


def declare_dcp_layout(server_args: Any, cfg: Any) -> None:
    """``--helix-kvp-size K --helix-kvp-chunk-size C`` is DCP's GQA mode: ``--dcp-size K
    --dcp-comm-backend a2a --dcp-replicate-q-proj --dcp-interleave-size C`` with ``--page-size C``
    (DCP allocates in pages of page x K: one chunk per rank). Refuses a DCP flag given to
    something else; declares the rest, logged once."""
    kvp, chunk = cfg.helix_kvp_size, cfg.helix_kvp_chunk_size
    layout = {"dcp_size": kvp, "dcp_comm_backend": "a2a", "dcp_replicate_q_proj": True, "dcp_interleave_size": chunk}
    for field, value in layout.items():
        given = raw(server_args, field, None)
        if given not in (None, value) and not (field == "dcp_size" and given == 1) and not (field == "dcp_interleave_size" and given == 1):
            flag = "--" + field.replace("_", "-")
            fail(
                f"--helix-kvp-size {kvp} --helix-kvp-chunk-size {chunk} is --dcp-size {kvp} --dcp-comm-backend a2a "
                f"--dcp-replicate-q-proj --dcp-interleave-size {chunk}, but {flag} is {given}. Drop {flag}, or "
                "spell the layout with the DCP flags alone."
            )
    if any(getattr(cfg, f) != v for f, v in layout.items()):
        logger.info(
            "Helix parallelism: --helix-kvp-size %d --helix-kvp-chunk-size %d resolves to --dcp-size %d "
            "--dcp-comm-backend a2a --dcp-replicate-q-proj --dcp-interleave-size %d (TPA = --tp %d / %d = %d).",
            kvp, chunk, kvp, chunk, cfg.tp_size, kvp, cfg.tp_size // kvp,
        )  # fmt: skip
        declare(server_args, **layout)


def spelled_with_dcp_flags(server_args: Any, cfg: Any) -> bool:
    """Whether DCP's own flags ask for Helix's layout: ``--dcp-size K > 1 --dcp-comm-backend a2a
    --dcp-replicate-q-proj`` on a model that is not MLA (MLA's replicated Q is upstream's)."""
    if raw(server_args, "helix_kvp_size", 1) != 1 or cfg.dcp_size <= 1:
        return False
    if not cfg.dcp_replicate_q_proj or cfg.dcp_comm_backend != "a2a":
        return False
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.configs.model_config import AttentionArch

    return model_config_of(server_args).attention_arch != AttentionArch.MLA


def declare_helix_flags(server_args: Any, cfg: Any) -> None:
    """The DCP spelling of Helix's layout: the Helix fields follow (``--helix-kvp-size K
    --helix-kvp-chunk-size I``), so both spellings resolve to the same server."""
    layout = {"helix_kvp_size": cfg.dcp_size, "helix_kvp_chunk_size": cfg.dcp_interleave_size}
    if any(getattr(cfg, f) != v for f, v in layout.items()):
        logger.info(
            "Decode context parallelism --dcp-size %d --dcp-comm-backend a2a --dcp-replicate-q-proj "
            "--dcp-interleave-size %d on a GQA model is Helix parallelism (--helix-kvp-size %d "
            "--helix-kvp-chunk-size %d).",
            cfg.dcp_size, cfg.dcp_interleave_size, cfg.dcp_size, cfg.dcp_interleave_size,
        )  # fmt: skip
        declare(server_args, **layout)


def pick_attention_backend(server_args: Any, cfg: Any) -> None:
    """Before the platform default (fa3, flashinfer, intel_amx, ...) is chosen, choose one Helix
    supports: the one a split flag names, if it names one, else the platform's."""
    if cfg.attention_backend is not None:
        return
    split = {cfg.prefill_attention_backend, cfg.decode_attention_backend} - {None}
    if len(split) == 1:
        backend = split.pop()
    else:
        backend = "torch_native" if cfg.device == "cpu" else "triton"
    logger.info("Helix parallelism: attention backend not specified; using %s.", backend)
    declare(server_args, attention_backend=backend)


def switch_off_cuda_graphs(server_args: Any, cfg: Any) -> None:
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
        declare(server_args, cuda_graph_config=graphs)
    if not keep:
        declare(server_args, disable_cuda_graph=True)
