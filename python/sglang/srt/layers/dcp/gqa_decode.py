"""DCP's GQA-mode decode metadata and workspaces in persistent buffers: one implementation, eager and graph.

Per forward batch, built by the Triton backend's hooks before the layers run
(``DcpGqaDecodeState.prepare``): this rank's local KV lists ``kv_indptr [T+1]`` / ``kv_indices``
(upstream DCP's list kernel at ``interleave_size = chunk``) and split counts ``num_kv_splits [T]``;
views of the per-layer workspace every layer reuses: the stage-1 split buffers ``[T, H, S, Dv]``
and the All-to-All ``send`` / ``recv`` ``[KVP, T, H/KVP, Dv + lpd]`` that stage 2 writes straight
into (``H = Q/TPA``, ``S`` = ``KVSplitPolicy.grid_splits``). The fill's shapes come only from the
batch's tensor shapes, so the same code runs eagerly (``init_forward_metadata``) and in a CUDA
graph (``init_graph_state`` once, ``init_forward_metadata_in_graph`` at capture: buffers sized for
the largest captured batch, never reallocated). A multi-step draft's step backends
(``dcp_draft_step``) each fill a list set of their own before the steps run. A replayed graph's
padded requests list position 0 on KVP rank 0 and write rank 0's reserved row 0; their outputs are
dropped (docs/helix-design.md, section 4).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton

from sglang.kernels.ops.attention.dcp_kernels import (
    _lse_pack_dim,
    create_triton_kv_indices_for_dcp_triton,
)
from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton
from sglang.srt.layers.dcp.gqa_layout import local_kv_lens
from sglang.srt.runtime_context import (
    get_parallel,
    get_spec,
    max_speculative_num_draft_tokens,
)

logger = logging.getLogger(__name__)

# Split cap of the per-request split policy (a GPU): at batch 1 a rank's shard of a long context
# needs far more than upstream's default 8 splits to fill the SMs. Measured on an H200
# (benchmark/README.md, 8 query / 1 KV head): at 1M tokens batch 1, 256 splits are 1.6-2.7x faster
# than 64; at batch 4, 128 splits beat 256 by 1.2-1.4x ...
DCP_GQA_MAX_KV_SPLITS = 256
# ... so a batch's split extent fills the SMs this many CTAs deep and no more (batch 1: 528 CTAs on
# 132 SMs caps at 256 splits, batch 4 gets 128, batch 8 64, batch 64 upstream's 8).
DCP_GQA_CTAS_PER_SM = 4
# ... and at least this many KV tokens per split: upstream's heuristic alone spreads a lone short
# request over every split (64 tokens over 64 splits), where the stage-2 reduction costs more.
DCP_GQA_MIN_TOKENS_PER_SPLIT = 256
# Stage 2 merges a request's splits this many at a time (``split_tile``): its serial loop waits on
# two dependent loads per split, and at 256 splits took 2/3 of a lone request's decode on an H200
# (benchmark/results/gpu-kernels.md, 2026-11-28).
DCP_GQA_SPLIT_TILE = 32


def stage2_split_tile(max_kv_splits: int) -> int:
    """Stage 2's ``split_tile`` for a split extent: a power of two, at most ``DCP_GQA_SPLIT_TILE``."""
    return min(DCP_GQA_SPLIT_TILE, triton.next_power_of_2(max(1, max_kv_splits)))


def a2a_buffer_shape(
    num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, kvp_size: int
):
    """The send / receive buffer of ``dcp_a2a_lse_reduce_packed``: ``[KVP, T, H/KVP, D + lpd]`` of
    ``dtype``, the fp32 LSE packed into ``lpd = 4 / sizeof(dtype)`` columns after each head's output.
    """
    return (
        kvp_size,
        num_tokens,
        num_heads // kvp_size,
        head_dim + _lse_pack_dim(dtype),
    )


def send_views(send: torch.Tensor, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [KVP, T, H/KVP, D], lse [KVP, T, H/KVP] fp32)``: the strided views of a send buffer
    the decode kernel's stage 2 writes (its head-split output)."""
    lpd = send.shape[3] - head_dim
    return send[..., :head_dim], send.view(torch.float32)[..., head_dim // lpd]


def _head_tiles(num_heads: int, num_kv_heads: int) -> int:
    """Stage 1's grid extent along heads (``decode_attention_fwd``: grouped kernels take up to 16
    query heads of one KV head per program, the MHA kernel one head)."""
    group = num_heads // num_kv_heads
    return num_heads if group == 1 else triton.cdiv(num_heads, min(16, group))


@dataclass(frozen=True)
class KVSplitPolicy:
    """How the GQA mode's decode splits a rank's local KV over stage-1 programs. ``core_count == 0`` (the CPU,
    static splits, deterministic tiles): ``min_splits`` each, as upstream. Otherwise a batch of ``B``
    launches ``grid_splits(B)``: ``DCP_GQA_CTAS_PER_SM`` programs per SM, a power of two in
    ``[min_splits, max_splits]``, each request taking what its local length needs (``B`` is a shape).
    """

    min_splits: int
    max_splits: int
    core_count: int

    def grid_splits(self, batch: int, num_heads: int, num_kv_heads: int) -> int:
        if self.core_count <= 0:
            return self.min_splits
        fill = triton.cdiv(
            DCP_GQA_CTAS_PER_SM * self.core_count,
            max(1, batch) * _head_tiles(num_heads, num_kv_heads),
        )
        fill = 1 << (fill.bit_length() - 1)  # a power of two, at most the fill
        return min(self.max_splits, max(self.min_splits, fill))

    def workspace_rows(self, max_bs: int, num_heads: int, num_kv_heads: int) -> int:
        """``max(T * grid_splits(T))`` over batches up to ``max_bs``: the (token, split) rows one
        workspace holds for every batch it serves."""
        return max(
            t * self.grid_splits(t, num_heads, num_kv_heads)
            for t in range(1, max(1, max_bs) + 1)
        )


def kv_split_policy(backend) -> KVSplitPolicy:
    """The GQA-mode decode's split policy on ``backend`` (a TritonAttnBackend): per request, from its
    local KV length, with the SM count known and no static or tiled split setting; else the
    backend's fixed ``max_kv_splits``. ``--triton-attention-num-kv-splits`` above 256 raises the cap.
    """
    if (
        backend.static_kv_splits
        or backend.device_core_count <= 0
        or backend.split_tile_size is not None
    ):
        return KVSplitPolicy(backend.max_kv_splits, backend.max_kv_splits, 0)
    return KVSplitPolicy(
        backend.max_kv_splits,
        max(backend.max_kv_splits, DCP_GQA_MAX_KV_SPLITS),
        backend.device_core_count,
    )


def num_kv_splits_by_local_len(
    num_kv_splits: torch.Tensor,
    local_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    max_kv_splits: int,
    device_core_count: int,
) -> None:
    """Fill ``num_kv_splits [B]`` from the *local* KV lengths with upstream's heuristic
    (``get_num_kv_splits_triton``), then at most one split per ``DCP_GQA_MIN_TOKENS_PER_SPLIT`` local
    tokens; ``device_core_count <= 0``: all ``max_kv_splits``. Shapes from ``[B]`` only: capturable.
    """
    if device_core_count <= 0:
        num_kv_splits.fill_(max_kv_splits)
        return
    batch = local_lens.shape[0]
    get_num_kv_splits_triton[(1,)](
        num_kv_splits,
        local_lens.clamp_min(1),
        batch,
        1,
        num_heads,
        num_kv_heads,
        max_kv_splits,
        device_core_count,
        MAX_NUM_SEQ=256 if batch < 256 else triton.next_power_of_2(batch),
    )
    by_length = (
        local_lens + DCP_GQA_MIN_TOKENS_PER_SPLIT - 1
    ) // DCP_GQA_MIN_TOKENS_PER_SPLIT
    torch.minimum(
        num_kv_splits, by_length.clamp_min(1).to(num_kv_splits.dtype), out=num_kv_splits
    )


@dataclass
class DcpGqaDecodeMetadata:
    """One decode forward's lists and workspace, views into persistent buffers, built by the Triton
    backend's hooks before the layers run (``DcpGqaDecodeState.prepare``); every layer reads them.
    """

    # [T+1] (T = B; a tree draft step's B * topk: one list per token)
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor  # [capacity] this rank's KV rows
    # [T] stage-1 splits per token, from its local KV length
    num_kv_splits: torch.Tensor
    # [T, H, S, Dv] fp32, stage 1's split outputs (S: the split extent)
    attn_logits: torch.Tensor
    attn_lse: torch.Tensor  # [T, H, S] fp32
    send: torch.Tensor  # [KVP, T, H/KVP, Dv + lpd]: stage 2 writes the partials here
    recv: torch.Tensor  # [KVP, T, H/KVP, Dv + lpd]


class DcpGqaDecodeBuffers:
    """Persistent decode buffers for up to ``max_bs`` tokens: ``list_sets`` sets of lists (one per
    speculative draft step, each built before the steps run; a decode uses the first) of
    ``capacity`` listed KV rows each, and one workspace per head configuration (``workspace``).
    """

    def __init__(
        self, max_bs, capacity, kvp_size, device, fixed: bool, list_sets: int = 1
    ):
        self.max_bs, self.capacity, self.kvp_size, self.device = (
            max_bs,
            capacity,
            kvp_size,
            device,
        )
        self.fixed = fixed  # a graph's buffers: never reallocated (the graph holds their addresses)
        self.kv_indptr = torch.zeros(
            list_sets, max_bs + 1, dtype=torch.int32, device=device
        )
        self.kv_indices = torch.zeros(
            list_sets, capacity, dtype=torch.int64, device=device
        )
        self.num_kv_splits = torch.ones(
            list_sets, max_bs, dtype=torch.int32, device=device
        )
        # (H, K, Dv, dtype, policy) -> (logits, lse, send, recv)
        self._workspaces: dict = {}

    def workspace(self, num_tokens, num_heads, num_kv_heads, v_head_dim, dtype, policy):
        """``(attn_logits [T, H, S, Dv], attn_lse [T, H, S], send, recv)``: allocated once per head
        configuration (the target's, a draft's whose heads differ) for every batch up to ``max_bs``,
        by the hook that first asks (before any capture), views after."""
        key = (num_heads, num_kv_heads, v_head_dim, dtype, policy)
        if key not in self._workspaces:
            rows = policy.workspace_rows(self.max_bs, num_heads, num_kv_heads)
            a2a = a2a_buffer_shape(
                self.max_bs, num_heads, v_head_dim, dtype, self.kvp_size
            )
            n, device = a2a[0] * a2a[1] * a2a[2] * a2a[3], self.device
            self._workspaces[key] = (
                torch.empty(
                    rows * num_heads * v_head_dim, dtype=torch.float32, device=device
                ),
                torch.empty(rows * num_heads, dtype=torch.float32, device=device),
                torch.empty(n, dtype=dtype, device=device),
                torch.empty(n, dtype=dtype, device=device),
            )
        logits, lse, send, recv = self._workspaces[key]
        T, S = num_tokens, policy.grid_splits(num_tokens, num_heads, num_kv_heads)
        a2a = a2a_buffer_shape(T, num_heads, v_head_dim, dtype, self.kvp_size)
        n = a2a[0] * a2a[1] * a2a[2] * a2a[3]
        return (
            logits[: T * num_heads * S * v_head_dim].view(T, num_heads, S, v_head_dim),
            lse[: T * num_heads * S].view(T, num_heads, S),
            send[:n].view(a2a),
            recv[:n].view(a2a),
        )


def list_bytes(max_bs: int, capacity: int, list_sets: int = 1) -> int:
    """Bytes of ``list_sets`` sets of lists: ``kv_indptr``, ``kv_indices``, ``num_kv_splits``."""
    return list_sets * (4 * (max_bs + 1) + 8 * capacity + 4 * max_bs)


def workspace_bytes(max_bs, num_heads, v_head_dim, dtype, split_rows, kvp_size) -> int:
    """Bytes of one head configuration's workspace (``DcpGqaDecodeBuffers.workspace``): the split
    buffers (``split_rows`` rows of ``[H, Dv]`` + ``[H]`` fp32) and ``send``/``recv``.
    """
    a2a = a2a_buffer_shape(max_bs, num_heads, v_head_dim, dtype, kvp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    return (
        4 * split_rows * num_heads * (v_head_dim + 1)
        + 2 * elem * a2a[0] * a2a[1] * a2a[2] * a2a[3]
    )


def draft_list_sets() -> int:
    """List sets the one buffer set holds: one per draft decode step of EAGLE / STANDALONE
    speculation (``--speculative-num-steps`` - 1, every step's lists built before the steps run),
    else one (a decode)."""
    if not _has_draft_steps():
        return 1
    return max(1, (get_spec().speculative_num_steps or 1) - 1)


def _has_draft_steps() -> bool:
    # NGRAM's top-k shapes its verify; it has no draft steps
    alg = get_spec().speculative_algorithm
    return not (alg is None or str(alg).upper() == "NGRAM")


def reserved_batch() -> int:
    """``B``: the tokens the GQA mode's one decode buffer set is sized for -- the largest decode CUDA-graph
    batch configured (``cuda_graph_config.decode.bs``), times a tree draft's
    ``--speculative-eagle-topk`` (a draft step lists each of its tokens); 0 when no decode graph is
    captured (``--disable-cuda-graph``, the decode phase disabled, or the CPU engine, which captures
    only with torch.compile): eager decode then allocates each step's buffers, as upstream's eager
    decode allocates its split buffers.
    """
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.utils import is_cpu

    graph = get_exec().graph
    config = graph.cuda_graph_config
    if (
        is_cpu()
        or graph.disable_cuda_graph
        or config is None
        or config.decode.backend == Backend.DISABLED
    ):
        return 0
    topk = get_spec().speculative_eagle_topk if _has_draft_steps() else None
    return max(get_exec().graph.cuda_graph_config.decode.bs or [0]) * max(1, topk or 1)


def graph_buffer_bytes(kvc) -> int:
    """What the one decode buffer set (``reserved_batch()`` tokens at the model's context, a list set
    per draft step; graphs and every eager batch that fits use it) allocates on this rank, for the
    KV pool sizing to charge; 0 outside the GQA mode or without decode graphs."""
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.utils import get_device_core_count

    parallel = get_parallel()
    max_bs = reserved_batch() if parallel.dcp_gqa_mode else 0
    if max_bs == 0:
        return 0
    model_config = kvc.model_config
    kvp, chunk = parallel.attn_dcp_size, parallel.dcp_interleave_size
    capacity = max_bs * int(local_kv_lens(model_config.context_len, 0, kvp, chunk))
    tpa = parallel.attn_tp_size // kvp
    num_heads = model_config.num_attention_heads // tpa  # Q/TPA
    num_kv_heads = max(1, model_config.get_total_num_kv_heads() // tpa)  # K/TPA
    min_splits = get_exec().kernel.triton_attention_num_kv_splits
    policy = KVSplitPolicy(
        min_splits, max(min_splits, DCP_GQA_MAX_KV_SPLITS), get_device_core_count()
    )
    rows = policy.workspace_rows(max_bs, num_heads, num_kv_heads)
    total = list_bytes(max_bs, capacity, draft_list_sets()) + workspace_bytes(
        max_bs, num_heads, model_config.v_head_dim, model_config.dtype, rows, kvp
    )
    draft = draft_heads(model_config, tpa)
    if draft is not None and draft != (
        num_heads,
        num_kv_heads,
        model_config.v_head_dim,
    ):
        # A draft whose layers have other heads (a STANDALONE draft) gets its own workspace in
        # the same set (an EAGLE head has its target's heads and shares the target's).
        heads, kv_heads, head_dim = draft
        draft_rows = policy.workspace_rows(max_bs, heads, kv_heads)
        total += workspace_bytes(
            max_bs, heads, head_dim, model_config.dtype, draft_rows, kvp
        )
    return total


def draft_heads(model_config, tpa: int) -> Optional[Tuple[int, int, int]]:
    """``(Q/TPA, K/TPA, Dv)`` of the speculative draft model's layers, from its config (upstream's
    cached ``get_config``, the read its speculative step makes), else None (no draft model).
    """
    spec = get_spec()
    path = spec.speculative_draft_model_path if spec.speculative_algorithm else None
    if not path:
        return None
    from sglang.srt.utils.hf_transformers_utils import get_config

    try:
        hf = get_config(
            path, trust_remote_code=getattr(model_config, "trust_remote_code", False)
        )
    except (OSError, ValueError):
        return None  # upstream's draft loading reports a path it cannot read
    q = hf.num_attention_heads
    k = getattr(hf, "num_key_value_heads", None) or q
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // q
    return q // tpa, max(1, k // tpa), head_dim


class DcpGqaDecodeState:
    """This rank's GQA-mode decode buffers for the Triton backend, shared by every Triton backend over
    one request table (the target's, a draft's per-step ones): ``prepare`` builds a decode's (or a
    draft step's) metadata for ``init_forward_metadata`` and, into the graph buffers that
    ``init_graph_state`` allocated once, for ``init_forward_metadata_in_graph``."""

    def __init__(
        self,
        req_to_token: torch.Tensor,
        kvp_rank: int,
        kvp_size: int,
        chunk: int,
        reserved_bs: int = 0,
        max_context_len: Optional[int] = None,
        list_sets: int = 1,
    ):
        self.req_to_token = req_to_token
        self.reserved_bs = (
            reserved_bs  # the set the KV pool sizing charged (graph_buffer_bytes) ...
        )
        # ... for requests of the model's context length, as the charge counts them
        self.max_context_len = max_context_len or req_to_token.shape[1]
        self.list_sets = list_sets  # one per draft step (draft_list_sets)
        self.kvp_rank, self.kvp_size, self.chunk = kvp_rank, kvp_size, chunk
        self.device = req_to_token.device
        self.graph: Optional[DcpGqaDecodeBuffers] = None

    @classmethod
    def for_this_rank(cls, req_to_token_pool, max_context_len: Optional[int] = None):
        """This rank's state in DCP's GQA mode, else None, owned by the request-table pool
        (``req_to_token_pool.dcp_gqa_decode``): every Triton backend over that table shares the one
        buffer set the pool sizing charged."""
        parallel = get_parallel()
        if not parallel.dcp_gqa_mode:
            return None
        state = getattr(req_to_token_pool, "dcp_gqa_decode", None)
        if state is None:
            state = cls(
                req_to_token_pool.req_to_token,
                parallel.attn_dcp_rank,
                parallel.attn_dcp_size,
                parallel.dcp_interleave_size,
                reserved_batch(),
                max_context_len,
                draft_list_sets(),
            )
            req_to_token_pool.dcp_gqa_decode = state
        return state

    def prepare(
        self, forward_batch, backend, in_graph: bool = False
    ) -> DcpGqaDecodeMetadata:
        """The lists and workspace of a decode on ``backend`` (a TritonAttnBackend: its heads, split
        policy and ``dcp_draft_step``). A decode lists each request's positions ``[0, seq_len)`` this
        rank owns; draft decode step ``i`` (prepared with the others before the steps run, from the
        step-0 positions) ``[0, position + i + 1)``. Eager (``in_graph`` False): the charged set when
        the batch fits it, else buffers of this step only, as upstream's eager decode allocates its
        split buffers. In a graph: the graph buffers, device ops only, shapes from ``[B]``/``[T]``.
        """
        step = backend.dcp_draft_step
        ends = forward_batch.seq_lens  # [B]
        if step is not None:  # [B], a tree's [T]
            ends = forward_batch.positions.to(torch.int64) + (step + 1)
        T = ends.shape[0]
        buffers = (
            self.graph if in_graph else self._eager_buffers(forward_batch, T, step)
        )
        if buffers is None:
            raise RuntimeError(
                "dcp gqa decode: init_graph_state was not called before capture"
            )
        # a step's own buffers: one set
        list_set = step if step is not None and buffers.fixed else 0
        if list_set >= buffers.kv_indptr.shape[0]:
            raise RuntimeError(
                f"dcp gqa decode: draft step {step} has no list set of its own "
                f"({buffers.kv_indptr.shape[0]} sized by --speculative-num-steps)"
            )
        kv_indptr, local_lens = self._fill(buffers, list_set, forward_batch, ends)
        policy = kv_split_policy(backend)
        heads, kv_heads = backend.num_head, backend.num_kv_head
        logits, lse, send, recv = buffers.workspace(
            T, heads, kv_heads, backend.v_head_dim, backend.dcp_gqa_dtype, policy
        )
        num_kv_splits = buffers.num_kv_splits[list_set, :T]
        num_kv_splits_by_local_len(
            num_kv_splits,
            local_lens,
            heads,
            kv_heads,
            logits.shape[2],
            policy.core_count,
        )
        kv_indices = buffers.kv_indices[list_set]
        return DcpGqaDecodeMetadata(
            kv_indptr, kv_indices, num_kv_splits, logits, lse, send, recv
        )

    def _eager_buffers(self, forward_batch, num_tokens: int, step: Optional[int]):
        """The charged set (allocated at the first decode) if this batch fits it, else a step's own.
        The host bound of a draft step's lists: the committed length plus the most tokens a draft
        may write past it (``max_speculative_num_draft_tokens``, adaptive speculation's largest).
        """
        ends_cpu = torch.as_tensor(forward_batch.seq_lens_cpu, dtype=torch.int64)
        if step is not None:  # [T]: a tree step's top-k tokens per request
            bound = max_speculative_num_draft_tokens() or 1
            ends_cpu = (ends_cpu + bound).repeat_interleave(num_tokens // len(ends_cpu))
        total = int(
            local_kv_lens(ends_cpu, self.kvp_rank, self.kvp_size, self.chunk).sum()
        )
        if self.graph is None and self.reserved_bs:
            self.graph = self._buffers(self.reserved_bs, self.max_context_len)
        if (
            self.graph is not None
            and num_tokens <= self.graph.max_bs
            and total <= self.graph.capacity
        ):
            return self.graph  # one set of buffers, not two
        return DcpGqaDecodeBuffers(
            num_tokens, max(total, 1), self.kvp_size, self.device, fixed=False
        )

    def _fill(
        self,
        buffers: DcpGqaDecodeBuffers,
        list_set: int,
        forward_batch,
        ends: torch.Tensor,
    ):
        """Write the lists of ``[0, ends)`` into ``buffers``' set ``list_set`` in place (upstream DCP's
        list kernel at ``interleave_size = chunk``): ``(kv_indptr [T+1], local_lens [T])``.
        """
        k, n, c = self.kvp_rank, self.kvp_size, self.chunk
        kv_indptr = buffers.kv_indptr[list_set, : ends.shape[0] + 1]
        local_lens = local_kv_lens(ends, k, n, c)  # [T]
        torch.cumsum(local_lens, dim=0, dtype=torch.int32, out=kv_indptr[1:])
        slots, lens, offsets, starts = (
            forward_batch.req_pool_indices,
            local_lens,
            kv_indptr,
            None,
        )
        batch = slots.shape[0]
        # a tree draft step: the prefix, then the branch's drafts
        if ends.shape[0] != batch and batch:
            slots, lens, offsets, starts = self._tree_segments(
                forward_batch, ends, local_lens, kv_indptr
            )
        if lens.shape[0]:
            create_triton_kv_indices_for_dcp_triton[(lens.shape[0],)](
                self.req_to_token,
                slots,
                lens,
                offsets,
                starts,
                buffers.kv_indices[list_set],
                self.req_to_token.stride(0),
                n,
                k,
                interleave_size=c,
            )
        return kv_indptr, local_lens

    def _tree_segments(self, forward_batch, ends, local_lens, kv_indptr):
        """A tree draft step (top-k tokens per request): token ``m`` of branch ``t`` lists the
        committed prefix ``[0, seq_len)`` and its branch's drafts, which ``prepare_for_draft`` puts
        on the branch's own pages, ``t * num_new_pages * page`` rows past ``seq_len`` (a multiple of
        the page ``chunk x KVP``: the same owners as ``[seq_len, end)``). Per token two runs for
        the list kernel: ``(slot, local length, list offset, start position)`` ``[2T]``.
        """
        k, n, c = self.kvp_rank, self.kvp_size, self.chunk
        topk = ends.shape[0] // forward_batch.req_pool_indices.shape[0]
        seq = forward_batch.seq_lens.to(torch.int64).repeat_interleave(topk)  # [T]
        page, steps = c * n, get_spec().speculative_num_steps
        batch = forward_batch.req_pool_indices.shape[0]
        branch = torch.arange(topk, device=seq.device).repeat(batch)
        # [T] branch's first draft
        start = seq + branch * ((seq % page + steps + page - 1) // page) * page
        # [T]; the branch: local_lens - prefix_lens
        prefix_lens = local_kv_lens(seq, k, n, c)
        pair = lambda a, b: torch.stack([a, b], dim=1).reshape(-1)  # noqa: E731
        slots = forward_batch.req_pool_indices.repeat_interleave(topk)
        offsets = kv_indptr[:-1].to(torch.int64)
        return (
            pair(slots, slots),
            pair(prefix_lens, local_lens - prefix_lens),
            pair(offsets, offsets + prefix_lens),
            pair(torch.zeros_like(start), start),
        )

    # -- CUDA graph -----------------------------------------------------------------------

    def init_graph_state(self, max_bs: int, max_context_len: int) -> torch.Tensor:
        """Allocate the graph buffers once (``max_bs`` tokens of ``max_context_len``); returns the
        first list set's KV index buffer (1/KVP of upstream's rows), which the backend may hold.
        """
        if self.kvp_rank == 0:
            logger.warning(
                "DCP GQA mode: capturing the decode step in CUDA graphs (--disable-cuda-graph runs it eagerly). "
                "Replay equals eager on the CPU harness and for the kernels on one GPU; not yet verified "
                "in a multi-GPU server."
            )
        graph = self.graph
        if (
            graph is None
            or graph.max_bs < max_bs
            or graph.capacity < self._capacity(max_bs, max_context_len)
        ):
            self.graph = self._buffers(max_bs, max_context_len)
        return self.graph.kv_indices[0]

    def _capacity(self, max_bs: int, max_context_len: int) -> int:
        # rank 0 owns the most
        return max_bs * int(
            local_kv_lens(max_context_len, 0, self.kvp_size, self.chunk)
        )

    def _buffers(self, max_bs: int, max_context_len: int) -> DcpGqaDecodeBuffers:
        """One fixed set for ``max_bs`` tokens of up to ``max_context_len``, a list set per draft step."""
        capacity = self._capacity(max_bs, max_context_len)
        return DcpGqaDecodeBuffers(
            max_bs, capacity, self.kvp_size, self.device, True, self.list_sets
        )
