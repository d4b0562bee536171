# SPDX-License-Identifier: Apache-2.0
"""What Helix sets when the user did not: the attention width, the attention backend, and the
CUDA graphs it cannot run with. Each is a declaration of the ``handle_helix_parallelism`` step,
made only where the value differs, and logged once."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def declare(server_args: Any, **fields: Any) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, "handle_helix_parallelism", **fields)


def resolve_tpa_size(server_args: Any, cfg: Any) -> None:
    """``--helix-tpa-size 0`` (the default) resolves to N / KVP."""
    if cfg.helix_tpa_size == 0:
        declare(server_args, helix_tpa_size=cfg.tp_size // cfg.helix_kvp_size)


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
