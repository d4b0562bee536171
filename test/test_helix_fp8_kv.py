"""Helix attention over an FP8 KV cache with per-tensor KV scales != 1 (both backends).

The pool quantizes on write: ``MHATokenToKVPool.set_kv_buffer`` divides K/V by the layer's
``k_scale`` / ``v_scale`` *in place* and stores fp8. Helix attention must

- leave the K/V of an extend intact: the Triton extend attends each segment of the chunk being
  prefilled over itself from the K/V in hand (upstream's Triton backend clones before the write
  for this);
- multiply what it reads back from the pool by the scales (both backends).

Each case drives ``dcp_gqa_attention`` on both ranks of a KVP = 2 layout, one real fp8
``MHATokenToKVPool`` per rank (CPU; Triton kernels under the interpreter), through a chunked
prefill of two requests (two extends) and two decode steps. The All-to-All is replaced by
collecting every rank's partials and merging them with upstream's ``dcp_lse_combine_triton``. Reference: float64
attention over the dequantized stored K/V (``stored * scale``), except, for a Triton extend, the
keys of a query's own ownership-chunk segment, which the kernel reads unquantized from the K/V in
hand. The default (a float32
pool, no scales) runs the same way.
"""

from __future__ import annotations

import os
import sys

# CPU tensors need the interpreter; must be set before the Triton kernels are imported.
os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

if STUB_DIR not in sys.path:  # the sglang imports below pull in sgl_kernel
    sys.path.insert(0, STUB_DIR)

from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.layers.attention import torch_native_backend  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.attention.triton_backend import ForwardMetadata, TritonAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402
from sglang.kernels.ops.attention.dcp_kernels import dcp_lse_combine_triton  # noqa: E402
from sglang.srt.layers.dcp import gqa_attention as attention, gqa_layout as kv_layout  # noqa: E402
from sglang.srt.layers.dcp.gqa_decode import DcpGqaDecodeState, send_views  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: log(0) of empty KV

H, KVH, D = 4, 2, 16  # query heads, KV heads (GQA 2), head dim
KVP, CHUNK = 2, 2
MAX_LEN = 32
# (slot, prefix_len, seq_len) per request, per step: a chunked prefill, then two decode steps.
STEPS = [
    ("extend", [(0, 0, 4), (1, 0, 3)]),
    ("extend", [(0, 4, 7), (1, 3, 5)]),
    ("decode", [(0, 7, 8), (1, 5, 6)]),
    ("decode", [(0, 8, 9), (1, 6, 7)]),
]


class _TritonBackend(TritonAttnBackend):
    """The fields of the backend that Helix attention reads."""

    def __init__(self, pool, req_to_token):
        self.token_to_kv_pool, self.req_to_token, self.max_kv_splits = pool, req_to_token, 4
        self.dcp_gqa_decode = None  # the mode's state: set per rank below
        self.static_kv_splits, self.device_core_count, self.split_tile_size = False, 0, None  # the CPU's
        # the decode workspace's heads and dtype; not a draft step's backend
        self.num_head, self.num_kv_head, self.v_head_dim, self.dcp_gqa_dtype = H, KVH, D, torch.float32
        self.dcp_draft_step = None

    # What _set_kv_buffer reads (TritonAttnBackend.__init__ sets them from the parallel state)
    dcp_size = property(lambda self: runtime_context.get_parallel().attn_dcp_size)
    dcp_rank = property(lambda self: runtime_context.get_parallel().attn_dcp_rank)
    dcp_interleave_size = property(lambda self: runtime_context.get_parallel().dcp_interleave_size)
    # What forward_decode / forward_extend read before their DCP branch (a plain fp32 target)
    use_dense_fp8_chunked_prefill = use_mla = allow_bidirectional_attention_in_extend = False
    is_draft_runner = enable_deterministic = enable_lean_attention = False
    forward_metadata = ForwardMetadata(*[None] * 13)  # the GQA mode's: none of upstream's lists


class _TorchNativeBackend(TorchNativeAttnBackend):
    """The fields of the backend that its DCP path reads (TorchNativeAttnBackend.__init__ sets them
    from the parallel state): replicated Q, so the layer holds the group's heads."""

    def __init__(self, pool, req_to_token):
        self.token_to_kv_pool, self.req_to_token_pool = pool, SimpleNamespace(req_to_token=req_to_token)
        self.dcp_metadata = self.draft_decode_metadata = None
        self.use_sliding_window_kv_pool, self.dcp_num_heads = False, H

    dcp_size = property(lambda self: runtime_context.get_parallel().attn_dcp_size)
    dcp_rank = property(lambda self: runtime_context.get_parallel().attn_dcp_rank)
    dcp_interleave_size = property(lambda self: runtime_context.get_parallel().dcp_interleave_size)


BACKENDS = {"triton": _TritonBackend, "torch_native": _TorchNativeBackend}


def attend(backend, layer, q, k, v, batch):
    """What a model layer's ``self.attn`` runs in DCP's GQA mode: Triton's ``forward_decode`` /
    ``forward_extend`` (upstream's K/V store, then the DCP branch), torch_native's ``_forward_dcp``."""
    if isinstance(backend, TritonAttnBackend):  # (RadixAttention views K/V as [T, K, D] first)
        k, v = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim), v.view(-1, layer.tp_k_head_num, layer.v_head_dim)
        forward = backend.forward_decode if batch.forward_mode.is_decode() else backend.forward_extend
        return forward(q, k, v, layer, batch)
    return backend._forward_dcp(q, k, v, layer, batch, True)


def init_forward_metadata(backend, batch):
    """This forward's lists: the backend's own ``init_forward_metadata`` (Triton's, in DCP's GQA
    mode: ``dcp_gqa_forward_metadata``, a decode's from the decode state)."""
    type(backend).init_forward_metadata(backend, batch)


def _layer(scales):
    k_scale, v_scale = scales or (None, None)
    return SimpleNamespace(
        layer_id=0, tp_q_head_num=H, tp_k_head_num=KVH, tp_v_head_num=KVH, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5,
        k_scale=None if scales is None else torch.tensor(k_scale),
        v_scale=None if scales is None else torch.tensor(v_scale),
        k_scale_float=k_scale, v_scale_float=v_scale, logit_cap=0.0, sliding_window_size=-1,
        logit_capping_method="tanh", is_cross_attention=False, attn_type=AttentionType.DECODER,
    )  # fmt: skip


EXTEND_MODES = {  # a prefill, and a speculative draft's extend after a verify
    "extend": ForwardMode.EXTEND,
    "draft_extend_v2": ForwardMode.DRAFT_EXTEND_V2,
}


def _forward_batch(mode, reqs, req_to_token, extend_as="extend"):
    """The ForwardBatch fields Helix attention reads; a fresh one per rank (metadata is cached on it)."""
    slots = torch.tensor([s for s, _, _ in reqs])
    prefix = torch.tensor([p for _, p, _ in reqs])
    seq = torch.tensor([n for _, _, n in reqs])
    positions = torch.cat([torch.arange(p, n) for _, p, n in reqs])
    return SimpleNamespace(
        forward_mode=EXTEND_MODES[extend_as] if mode == "extend" else ForwardMode.DECODE,
        req_pool_indices=slots, seq_lens=seq, seq_lens_cpu=seq, positions=positions, spec_info=None,
        out_cache_loc_is_physical=False, mha_one_shot=False, out_cache_loc=torch.cat([req_to_token[s, p:n] for s, p, n in reqs]).long(),
        extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix.tolist(),
        extend_seq_lens=seq - prefix, extend_seq_lens_cpu=(seq - prefix).tolist(),
    )  # fmt: skip


def _reference(q, keys, values, reqs, in_hand=None):
    """float64 causal attention of the new tokens: keys/values[slot][pos] -> out [T, H, D].

    ``in_hand[slot][pos] = (k, v)``: the new tokens' K/V as the layer got them, which a query
    reads instead of the stored ones for the keys of its own ownership-chunk segment."""
    out, t = [], 0
    for slot, prefix, seq in reqs:
        for pos in range(prefix, seq):
            ks, vs = list(keys[slot][: pos + 1]), list(values[slot][: pos + 1])
            if in_hand is not None:
                for kpos in range(max(prefix, pos // CHUNK * CHUNK), pos + 1):
                    ks[kpos], vs[kpos] = in_hand[slot][kpos]
            kb = torch.stack(ks).double().repeat_interleave(H // KVH, dim=1)  # [pos + 1, H, D]
            vb = torch.stack(vs).double().repeat_interleave(H // KVH, dim=1)
            s = torch.einsum("hd,lhd->hl", q[t].double(), kb) * D**-0.5
            out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vb))
            t += 1
    return torch.stack(out)


# KV dtype, its largest relative rounding error (3 or 2 mantissa bits), the layer's (k, v) scales.
# "plain": the default, a pool in the model dtype and no scales.
KV_CACHES = {
    "e4m3": (torch.float8_e4m3fn, 2**-4, (2.5, 0.25)),
    "e5m2": (torch.float8_e5m2, 2**-3, (2.5, 0.25)),
    "plain": (torch.float32, 0.0, None),
}


def paged_table_and_pools(kv_dtype):
    """``req_to_token [2, MAX_LEN]`` of logical locs, paged as the Helix allocator pages them
    (``loc % page == pos % page``, page 0 reserved), and one ``MHATokenToKVPool`` per KVP rank."""
    page = CHUNK * KVP
    req_to_token = torch.zeros(2, MAX_LEN, dtype=torch.int32)
    for slot in range(2):
        req_to_token[slot] = page * (1 + slot * MAX_LEN) + torch.arange(MAX_LEN, dtype=torch.int32)
    rows_per_rank = (2 * MAX_LEN + 1) * CHUNK
    pools = [
        MHATokenToKVPool(rows_per_rank, 1, kv_dtype, KVH, D, 1, "cpu", enable_memory_saver=False)
        for _ in range(KVP)
    ]  # fmt: skip
    return req_to_token, pools


def capture_partials(monkeypatch) -> list:
    """Replace the All-to-All + merge: every call appends its rank's ``(out [T, H, D], lse [T, H])``
    to the returned list (a Triton decode's from the send layout) and returns ``out``."""
    partials = []
    for module in (attention, torch_native_backend):  # Triton's DCP branch; torch_native's DCP path
        monkeypatch.setattr(module, "dcp_a2a_lse_reduce", lambda out, lse, group: partials.append((out, lse)) or out)

    def merge_packed(send, recv, T, group):  # a Triton decode: partials in the send layout
        out, lse = send_views(send, D)  # [KVP, T, H/KVP, D], [KVP, T, H/KVP]
        partials.append((out.transpose(0, 1).reshape(T, H, D).clone(), lse.transpose(0, 1).reshape(T, H).clone()))
        return partials[-1][0]

    monkeypatch.setattr(attention, "dcp_a2a_lse_reduce_packed", merge_packed)
    return partials


@pytest.mark.parametrize(
    "kv_cache,extend_as",
    [(kv, "extend") for kv in KV_CACHES] + [("e4m3", "draft_extend_v2")],
)
@pytest.mark.parametrize("backend_name", ["torch_native", "triton", "torch_native-blocked"])
def test_fp8_kv_with_scales(monkeypatch, backend_name, kv_cache, extend_as):
    """Every extend-like forward (a prefill, a draft extend: ``ForwardMode.is_extend()`` leaves
    DRAFT_EXTEND_V2 out) stores fp8(k / scale) and attends over the K/V as given."""
    if backend_name == "torch_native-blocked":  # the torch path one query row at a time (long prefills)
        from sglang.srt.layers.dcp import torch_attention

        monkeypatch.setattr(torch_attention, "_SCORE_ELEMS", 1)
        backend_name = "torch_native"
    kv_dtype, rounding, scales = KV_CACHES[kv_cache]
    k_scale, v_scale = scales or (1.0, 1.0)
    g = torch.Generator().manual_seed(0)
    req_to_token, pools = paged_table_and_pools(kv_dtype)
    layer = _layer(scales)
    partials = capture_partials(monkeypatch)
    keys = {0: [None] * MAX_LEN, 1: [None] * MAX_LEN}  # what attention should see, by (slot, pos)
    values = {0: [None] * MAX_LEN, 1: [None] * MAX_LEN}

    for mode, reqs in STEPS:
        T = sum(n - p for _, p, n in reqs)
        # q exactly representable in fp8: the Triton extend kernel casts q to the KV dtype for the prefix.
        q = torch.randn(T, H, D, generator=g).to(kv_dtype).float()
        k = torch.randn(T, KVH, D, generator=g) * 2
        v = torch.randn(T, KVH, D, generator=g)
        partials.clear()
        for kvp_rank in range(KVP):
            parallel = SimpleNamespace(
                attn_dcp_rank=kvp_rank, attn_dcp_size=KVP, dcp_interleave_size=CHUNK, dcp_group=None,
                dcp_comm_backend="a2a",
            )
            backend = BACKENDS[backend_name](pools[kvp_rank], req_to_token)
            monkeypatch.setattr(runtime_context, "_PARALLEL", parallel)
            batch = _forward_batch(mode, reqs, req_to_token, extend_as)
            if backend_name == "triton":  # the mode's decode state (which marks the mode on Triton)
                backend.dcp_gqa_decode = DcpGqaDecodeState(req_to_token, kvp_rank, KVP, CHUNK)
            init_forward_metadata(backend, batch)
            k_in, v_in = k.clone(), v.clone()
            attend(backend, layer, q.reshape(T, -1), k_in.reshape(T, -1), v_in.reshape(T, -1), batch)
            if mode == "extend":  # the pool's write must not have scaled the K/V in hand
                assert torch.equal(k_in, k) and torch.equal(v_in, v)

        # What attention should have used: the stored fp8 K/V times the scales, read from the
        # owner's pool; a Triton extend reads the keys of each query's own segment (the new tokens
        # of its ownership chunk) from the K/V in hand.
        t, in_hand = 0, {0: {}, 1: {}}
        for slot, prefix, seq in reqs:
            locs = req_to_token[slot, :seq].long()
            for pos in range(seq):
                owner = (pos // CHUNK) % KVP
                pool = pools[owner]
                rows = kv_layout.write_rows(locs, owner, KVP, CHUNK)
                keys[slot][pos] = pool.get_key_buffer(0)[rows[pos]].float() * k_scale
                values[slot][pos] = pool.get_value_buffer(0)[rows[pos]].float() * v_scale
            for pos in range(prefix, seq):
                # stored = fp8(k / scale), or k itself in a plain pool
                torch.testing.assert_close(keys[slot][pos], k[t], rtol=rounding, atol=0.02 if scales else 0)
                torch.testing.assert_close(values[slot][pos], v[t], rtol=rounding, atol=0.02 if scales else 0)
                in_hand[slot][pos] = (k[t], v[t])
                t += 1

        out, _ = dcp_lse_combine_triton(torch.stack([o for o, _ in partials]), torch.stack([lse for _, lse in partials]))
        ref = _reference(q, keys, values, reqs, in_hand if backend_name == "triton" and mode == "extend" else None)
        # Triton's GQA kernels multiply fp8 V by the probabilities cast to fp8: up to ~0.06 (e4m3)
        # and ~0.18 (e5m2) off here. K/V left divided by the scales, or read back unscaled: > 2.
        atol = 2.5 * rounding if backend_name == "triton" and scales else 1e-5
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0, msg=lambda m: f"{mode} {reqs}: {m}")

