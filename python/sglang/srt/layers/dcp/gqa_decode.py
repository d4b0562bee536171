"""DCP's GQA-mode decode metadata and workspaces in persistent buffers: one implementation, eager and graph.

Per forward batch: this rank's local KV lists ``kv_indptr [B+1]`` / ``kv_indices [capacity]``
(upstream DCP's list kernel at ``interleave_size = chunk``). Per layer, reused by every layer: the stage-1 split buffers
``[T, H, S, Dv]`` and the All-to-All ``send`` / ``recv`` ``[KVP, T, H/KVP, Dv + lpd]`` that stage 2
writes straight into (``H = Q/TPA``, ``S`` = ``KVSplitPolicy.grid_splits``). ``fill``'s shapes come
only from the batch's tensor shapes, so the same code runs eagerly (``prepare_eager``: buffers grown
on the host) and in a CUDA graph (``init_graph_state`` once, ``prepare_in_graph`` at capture: buffers
sized for the largest captured batch, never reallocated). A replayed graph's padded requests list
position 0 on KVP rank 0 and write rank 0's reserved row 0; their outputs are dropped
(docs/helix-design.md, section 4).
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
from sglang.srt.runtime_context import get_parallel, get_spec

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
    """One decode batch's lists (views into the persistent buffers)."""

    kv_indptr: torch.Tensor  # [B+1] ([T+1] for a tree draft step: one list per token)
    kv_indices: torch.Tensor  # [capacity]
    local_lens: torch.Tensor  # [B] this rank's KV length per request
    buffers: "DcpGqaDecodeBuffers"
    splits_ready: bool = False  # num_kv_splits set for this batch (by its first layer)


class DcpGqaDecodeBuffers:
    """Persistent decode buffers for up to ``max_bs`` requests (= tokens) and ``capacity`` listed KV."""

    def __init__(
        self,
        max_bs: int,
        capacity: int,
        kvp_size: int,
        device: torch.device,
        fixed: bool,
    ):
        self.max_bs, self.capacity, self.kvp_size, self.device = (
            max_bs,
            capacity,
            kvp_size,
            device,
        )
        self.fixed = fixed  # a graph's buffers: never reallocated (the graph holds their addresses)
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(capacity, dtype=torch.int64, device=device)
        # The per-layer workspaces by head configuration (a speculative draft's layers may have
        # other heads than the target's), and the one the last layer used: (key, tensors).
        self._workspaces: dict = {}
        self._workspace: Optional[Tuple] = None

    def workspace(
        self,
        num_tokens: int,
        num_heads: int,
        num_kv_heads: int,
        v_head_dim: int,
        dtype: torch.dtype,
        splits: KVSplitPolicy,
    ):
        """``(attn_logits [T, H, S, Dv], attn_lse [T, H, S], num_kv_splits [T], send, recv)``:
        allocated once per head configuration by the first layer that asks (before any capture:
        the target's layers, and a draft's whose heads differ) for every batch up to ``max_bs``,
        views after."""
        kvp_size = self.kvp_size
        key = (num_heads, num_kv_heads, v_head_dim, dtype, splits)
        if key not in self._workspaces:
            rows = splits.workspace_rows(self.max_bs, num_heads, num_kv_heads)
            tensors = self._allocate(num_heads, v_head_dim, dtype, rows, kvp_size)
            self._workspaces[key] = tensors
        self._workspace = (key, self._workspaces[key])
        logits, lse_s, num_kv_splits, send, recv = self._workspace[1]
        T, S = num_tokens, splits.grid_splits(num_tokens, num_heads, num_kv_heads)
        a2a = a2a_buffer_shape(T, num_heads, v_head_dim, dtype, kvp_size)
        n = a2a[0] * a2a[1] * a2a[2] * a2a[3]
        return (
            logits[: T * num_heads * S * v_head_dim].view(T, num_heads, S, v_head_dim),
            lse_s[: T * num_heads * S].view(T, num_heads, S),
            num_kv_splits[:T],
            send[:n].view(a2a),
            recv[:n].view(a2a),
        )

    def _allocate(self, num_heads, v_head_dim, dtype, split_rows, kvp_size):
        T, device = self.max_bs, self.device
        a2a = a2a_buffer_shape(T, num_heads, v_head_dim, dtype, kvp_size)
        n = a2a[0] * a2a[1] * a2a[2] * a2a[3]
        return (
            torch.empty(
                split_rows * num_heads * v_head_dim, dtype=torch.float32, device=device
            ),
            torch.empty(split_rows * num_heads, dtype=torch.float32, device=device),
            torch.ones(T, dtype=torch.int32, device=device),
            torch.empty(n, dtype=dtype, device=device),
            torch.empty(n, dtype=dtype, device=device),
        )


def buffer_bytes(
    max_bs: int,
    capacity: int,
    num_heads: int,
    v_head_dim: int,
    dtype: torch.dtype,
    split_rows: int,
    kvp_size: int,
) -> int:
    """Bytes of one ``DcpGqaDecodeBuffers(max_bs, capacity)`` with its workspace: the lists, the split
    buffers (``split_rows`` rows of ``[H, Dv]`` + ``[H]`` fp32, ``num_kv_splits``) and ``send``/``recv``.
    """
    lists = 4 * (max_bs + 1) + 8 * capacity
    return lists + workspace_bytes(
        max_bs, num_heads, v_head_dim, dtype, split_rows, kvp_size
    )


def workspace_bytes(
    max_bs: int,
    num_heads: int,
    v_head_dim: int,
    dtype: torch.dtype,
    split_rows: int,
    kvp_size: int,
) -> int:
    """Bytes of one head configuration's workspace (``DcpGqaDecodeBuffers.workspace``): the split
    buffers (``split_rows`` rows of ``[H, Dv]`` + ``[H]`` fp32, ``num_kv_splits``), ``send``/``recv``.
    """
    a2a = a2a_buffer_shape(max_bs, num_heads, v_head_dim, dtype, kvp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    splits = 4 * split_rows * num_heads * (v_head_dim + 1) + 4 * max_bs
    return splits + 2 * elem * a2a[0] * a2a[1] * a2a[2] * a2a[3]


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
    # NGRAM's top-k shapes its verify; it has no draft steps
    alg = get_spec().speculative_algorithm
    ngram = alg is None or str(alg).upper() == "NGRAM"
    topk = None if ngram else get_spec().speculative_eagle_topk
    return max(get_exec().graph.cuda_graph_config.decode.bs or [0]) * max(1, topk or 1)


def graph_buffer_bytes(kvc) -> int:
    """What the one decode buffer set (``reserved_batch()`` requests at the model's context; graphs and
    every eager batch that fits use it) allocates on this rank, for the KV pool sizing to charge; 0
    outside the GQA mode or without decode graphs."""
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
    total = buffer_bytes(
        max_bs,
        capacity,
        num_heads,
        model_config.v_head_dim,
        model_config.dtype,
        rows,
        kvp,
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
    """This rank's GQA-mode decode lists for the Triton backend: ``prepare_eager``, ``init_graph_state``
    (once), ``prepare_in_graph`` (capture); ``dcp_gqa_attention`` reads ``metadata``."""

    def __init__(
        self,
        req_to_token: torch.Tensor,
        kvp_rank: int,
        kvp_size: int,
        chunk: int,
        reserved_bs: int = 0,
        max_context_len: Optional[int] = None,
    ):
        self.req_to_token = req_to_token
        self.reserved_bs = (
            reserved_bs  # the set the KV pool sizing charged (graph_buffer_bytes) ...
        )
        # ... for requests of the model's context length, as the charge counts them
        self.max_context_len = max_context_len or req_to_token.shape[1]
        self.kvp_rank, self.kvp_size, self.chunk = kvp_rank, kvp_size, chunk
        self.device = req_to_token.device
        self.graph: Optional[DcpGqaDecodeBuffers] = None
        self.metadata: Optional[DcpGqaDecodeMetadata] = None
        # A draft decode step is being captured (prepare_in_graph): its first layer fills the
        # graph buffers from device values only (prepare_draft_step without a host bound).
        self.draft_in_graph = False

    @classmethod
    def for_this_rank(
        cls, req_to_token_pool, max_context_len: Optional[int] = None
    ) -> Optional["DcpGqaDecodeState"]:
        """This rank's state in DCP's GQA mode, else None, owned by the request-table pool
        (``req_to_token_pool.dcp_gqa_decode``): every Triton backend over that table (the target's, a
        draft's per-step ones, run one at a time) shares the one buffer set the pool sizing charged.
        """
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
            )
            req_to_token_pool.dcp_gqa_decode = state
        return state

    # -- the one implementation -----------------------------------------------------------

    def fill(
        self,
        buffers: DcpGqaDecodeBuffers,
        forward_batch,
        kv_ends: Optional[torch.Tensor] = None,
    ) -> DcpGqaDecodeMetadata:
        """Write the batch's lists into ``buffers`` in place: device ops, shapes from ``[B]``/``[T]``.
        Each request lists the positions ``[0, kv_ends)`` this rank owns (default ``seq_lens``).
        """
        k, n, c = self.kvp_rank, self.kvp_size, self.chunk
        batch = forward_batch.req_pool_indices.shape[0]
        ends = (
            forward_batch.seq_lens if kv_ends is None else kv_ends
        )  # [B], or a tree draft step's [T]
        kv_indptr = buffers.kv_indptr[: ends.shape[0] + 1]
        local_lens = local_kv_lens(ends, k, n, c)  # [B] / [T]
        torch.cumsum(local_lens, dim=0, dtype=torch.int32, out=kv_indptr[1:])
        slots, lens, offsets, starts = (
            forward_batch.req_pool_indices,
            local_lens,
            kv_indptr,
            None,
        )
        if (
            ends.shape[0] != batch and batch
        ):  # a tree draft step: the prefix, then the branch's drafts
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
                buffers.kv_indices,
                self.req_to_token.stride(0),
                n,
                k,
                interleave_size=c,
            )
        return DcpGqaDecodeMetadata(kv_indptr, buffers.kv_indices, local_lens, buffers)

    def _tree_segments(
        self,
        forward_batch,
        ends: torch.Tensor,
        local_lens: torch.Tensor,
        kv_indptr: torch.Tensor,
    ):
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
        branch = torch.arange(topk, device=seq.device).repeat(
            forward_batch.req_pool_indices.shape[0]
        )
        start = (
            seq + branch * ((seq % page + steps + page - 1) // page) * page
        )  # [T] row of the branch's first draft
        prefix_lens = local_kv_lens(
            seq, k, n, c
        )  # [T]; the branch: local_lens - prefix_lens
        pair = lambda a, b: torch.stack([a, b], dim=1).reshape(-1)  # noqa: E731
        slots = forward_batch.req_pool_indices.repeat_interleave(topk)
        offsets = kv_indptr[:-1].to(torch.int64)
        return (
            pair(slots, slots),
            pair(prefix_lens, local_lens - prefix_lens),
            pair(offsets, offsets + prefix_lens),
            pair(torch.zeros_like(start), start),
        )

    # -- eager ----------------------------------------------------------------------------

    def prepare_eager(self, forward_batch, kv_ends=None, kv_ends_cpu=None) -> None:
        """Eager decode: grow the buffers on the host if needed, then fill. A draft step (a decode with
        ``spec_info``) is filled by ``prepare_draft_step``, when its writes and positions are bound.
        """
        self.draft_in_graph = False
        if kv_ends is None and forward_batch.spec_info is not None:
            self.metadata = None
            return
        if kv_ends is None:
            kv_ends_cpu = forward_batch.seq_lens_cpu
        batch, num_tokens = (
            forward_batch.req_pool_indices.shape[0],
            forward_batch.out_cache_loc.shape[0],
        )
        total = int(
            local_kv_lens(kv_ends_cpu, self.kvp_rank, self.kvp_size, self.chunk).sum()
        )
        if (
            self.graph is None and self.reserved_bs
        ):  # the charged set, at the first decode
            self.graph = self._buffers(self.reserved_bs, self.max_context_len)
        graph = self.graph
        if (
            graph is not None
            and max(batch, num_tokens) <= graph.max_bs
            and total <= graph.capacity
        ):
            self.metadata = self.fill(
                graph, forward_batch, kv_ends
            )  # one set of buffers, not two
            return
        # A batch beyond the charged set (more requests than the largest graph batch): buffers of
        # this step only, as upstream's eager decode allocates its split buffers per step (from the
        # activation memory), never kept past it.
        step = DcpGqaDecodeBuffers(
            max(batch, num_tokens),
            max(total, 1),
            self.kvp_size,
            self.device,
            fixed=False,
        )
        self.metadata = self.fill(step, forward_batch, kv_ends)

    def prepare_draft_step(
        self, forward_batch, kv_ends: torch.Tensor, kv_ends_cpu: Optional[list] = None
    ) -> None:
        """A speculative draft decode step: its lists end at each token's position + 1 (``kv_ends``
        ``[B]``, a tree's ``[T]``), past ``seq_lens``. Eager: ``kv_ends_cpu`` bounds them on the host.
        In a CUDA graph (``kv_ends_cpu`` None) the graph buffers, sized for the largest step's
        tokens at the model's context, take them: device ops only, shapes from ``[T]``.
        """
        if kv_ends_cpu is None:
            if self.graph is None:
                raise RuntimeError(
                    "dcp gqa decode: init_graph_state was not called before a draft step's capture"
                )
            self.metadata = self.fill(self.graph, forward_batch, kv_ends)
            return
        self.prepare_eager(forward_batch, kv_ends, kv_ends_cpu)

    # -- CUDA graph -----------------------------------------------------------------------

    def init_graph_state(self, max_bs: int, max_context_len: int) -> torch.Tensor:
        """Allocate the graph buffers once (``max_bs`` requests of ``max_context_len``); returns the KV
        index buffer (1/KVP of upstream's rows), which the backend may hold as its own.
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
        return self.graph.kv_indices

    def _capacity(self, max_bs: int, max_context_len: int) -> int:
        return max_bs * int(
            local_kv_lens(max_context_len, 0, self.kvp_size, self.chunk)
        )  # rank 0 owns the most

    def _buffers(self, max_bs: int, max_context_len: int) -> DcpGqaDecodeBuffers:
        """One fixed set for ``max_bs`` requests of up to ``max_context_len`` tokens."""
        capacity = self._capacity(max_bs, max_context_len)
        return DcpGqaDecodeBuffers(
            max_bs, capacity, self.kvp_size, self.device, fixed=True
        )

    def prepare_in_graph(self, forward_batch) -> None:
        """Graph capture (and warm-up): fill the graph buffers from the runner's static inputs. A
        draft decode step (``spec_info``) is filled by its first layer, once the step's positions
        and writes are bound (``prepare_draft_step``, no host bound)."""
        if self.graph is None:
            raise RuntimeError(
                "dcp gqa decode: init_graph_state was not called before capture"
            )
        self.draft_in_graph = forward_batch.spec_info is not None
        self.metadata = (
            None if self.draft_in_graph else self.fill(self.graph, forward_batch)
        )
