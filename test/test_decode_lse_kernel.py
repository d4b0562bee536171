"""The Triton decode kernel's optional merged-LSE output: the series patch "[Kernel] Triton
decode stage 2: optional merged-LSE output" to ``sglang/kernels/ops/attention/decode_attention.py``.

Checked against a float64 reference: the merged LSE is ``torch.logsumexp`` of the scaled
logits ``q.k * sm_scale`` (natural log, after the logit cap) over the request's KV, the
output is the softmax-weighted V; an empty KV gives O = 0 and LSE = -inf; a sink is one
more logit with a zero value. With ``output_lse=None`` the output is bit-identical to the
pristine sglang 0.5.23 kernel.

The kernels run on CPU tensors under the Triton interpreter. ``TRITON_INTERPRET`` is read
when ``@triton.jit`` decorates a kernel, i.e. when the kernel module is imported, so this
module loads its own copies of the patched and the pristine module by file path (after
setting the variable): the result does not depend on whether another test imported
sglang's kernels first.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import zipfile

# CPU tensors need the interpreter; must be set before the kernel modules are loaded.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from sglang_helix.series import pinned_wheel  # noqa: E402
from sglang_helix.testing.cpu_env import STUB_DIR  # noqa: E402

if STUB_DIR not in sys.path:  # in case an sglang import pulls in sgl_kernel
    sys.path.insert(0, STUB_DIR)

pytestmark = [
    pytest.mark.triton,
    # numpy under the interpreter warns on the log(0) / 0 / 0 that tl.where then discards
    # (empty KV); NaN and inf are checked explicitly instead.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

KERNEL_REL = "sglang/kernels/ops/attention/decode_attention.py"


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(mod._fwd_kernel_stage2, InterpretedFunction), "not interpreted"
    return mod


@pytest.fixture(scope="module")
def patched():
    origin = importlib.util.find_spec("sglang.kernels.ops.attention.decode_attention").origin
    assert "HAS_OUTPUT_LSE" in open(origin).read(), "series not applied: run scripts/setup.sh"
    return _load(origin, "_helix_test_decode_attention_patched")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "decode_attention_pristine.py"
    with zipfile.ZipFile(pinned_wheel()) as z:
        path.write_bytes(z.read(KERNEL_REL))
    assert b"HAS_OUTPUT_LSE" not in path.read_bytes()
    return _load(str(path), "_helix_test_decode_attention_pristine")


# --------------------------------------------------------------------------------------------
# Inputs, kernel call, reference
# --------------------------------------------------------------------------------------------
def make_inputs(lens, num_kv_heads, group, head_dim, seed=0):
    """q [B, H, D]; k, v [pool, KVH, D]; kv_indptr [B + 1]; kv_indices scattered in the pool."""
    g = torch.Generator().manual_seed(seed)
    B, H = len(lens), num_kv_heads * group
    lens_t = torch.tensor(lens, dtype=torch.int32)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(lens_t, 0)
    total = int(kv_indptr[-1])
    pool = total + 7  # slots nobody reads
    kv_indices = torch.randperm(pool, generator=g)[:total].to(torch.int64)
    q = torch.randn(B, H, head_dim, generator=g)
    k = torch.randn(pool, num_kv_heads, head_dim, generator=g)
    v = torch.randn(pool, num_kv_heads, head_dim, generator=g)
    return q, k, v, kv_indptr, kv_indices


def run_kernel(mod, q, k, v, kv_indptr, kv_indices, splits, max_splits, sm_scale,
               logit_cap=0.0, sinks=None, with_lse=True, output_lse=None, o=None, split_tile=0):  # fmt: skip
    """decode_attention_fwd; returns (o [B, H, Dv] (or the given o), lse [B, H] or None).

    Scratch and outputs start as NaN, so a value the kernel never writes (or a split stage 2
    reads that stage 1 left empty) shows up as NaN.
    """
    B, H, Dv = q.shape[0], q.shape[1], v.shape[-1]
    if isinstance(splits, int):
        splits = [splits] * B
    num_kv_splits = torch.tensor(splits, dtype=torch.int32)
    nan = float("nan")
    o = torch.full((B, H, Dv), nan) if o is None else o
    attn_logits = torch.full((B, H, max_splits, Dv), nan)
    attn_lse = torch.full((B, H, max_splits), nan)
    kwargs = {}
    if with_lse:
        if output_lse is None:
            output_lse = torch.full((B, H), nan)
        kwargs["output_lse"] = output_lse
    if split_tile:
        kwargs["split_tile"] = split_tile
    mod.decode_attention_fwd(
        q, k, v, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits, max_splits,
        sm_scale, 1.0, 1.0, logit_cap=logit_cap, sinks=sinks, **kwargs,
    )  # fmt: skip
    return o, (output_lse if with_lse else None)


def reference(q, k, v, kv_indptr, kv_indices, sm_scale, logit_cap=0.0, sinks=None):
    """float64: o [B, H, Dv] = softmax(s) @ v, lse [B, H] = logsumexp(s), s = q.k * sm_scale.

    A sink is one more logit with a zero value. Empty KV, no sink: o = 0, lse = -inf.
    """
    B, H = q.shape[:2]
    group = H // k.shape[1]
    o = torch.zeros(B, H, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        idx = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        kb = k[idx].double().repeat_interleave(group, dim=1)  # [L, H, D]
        vb = v[idx].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), kb) * sm_scale  # [H, L]
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
            vb = torch.cat([vb, torch.zeros_like(vb[:1])], dim=0)
        if s.shape[1] == 0:
            continue
        lse[b] = torch.logsumexp(s, dim=1)
        o[b] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=1), vb)
    return o, lse


def assert_matches(o, lse, o_ref, lse_ref, lens, atol=2e-5):
    assert not torch.isnan(o).any(), "NaN in the output"
    assert not torch.isnan(lse).any(), "NaN in the LSE"
    assert lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=1e-4)
    torch.testing.assert_close(lse.double(), lse_ref, atol=atol, rtol=1e-5)
    for b, n in enumerate(lens):
        if n == 0 and torch.isneginf(lse_ref[b]).all():  # the neutral state, exactly
            assert torch.equal(o[b], torch.zeros_like(o[b]))
            assert torch.isneginf(lse[b]).all()


# --------------------------------------------------------------------------------------------
# Merged LSE and output against the float64 reference
# --------------------------------------------------------------------------------------------
# group 1 takes the normal stage-1 kernel, group > 1 the grouped one (tl.dot over BLOCK_H).
# Lengths: empty (also last in the batch), a single token, a partial MIN_BLOCK_KV (32) tile,
# and 250 = 8 splits of 32 tokens (one split walks several BLOCK_Ns with 1 split); lengths
# below 8 * 32 leave some of 8 splits empty.
MIXED_LENS = [0, 1, 37, 250, 0]


@pytest.mark.parametrize("head_dim", [16, 64, 80])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_merged_lse_matches_reference(patched, head_dim, group):
    num_kv_heads = 1 if group == 8 else 2  # 16 query heads would double the interpreter's time
    seed = group * 1000 + head_dim
    q, k, v, indptr, indices = make_inputs(MIXED_LENS, num_kv_heads, group, head_dim, seed=seed)
    sm_scale = head_dim**-0.5
    o_ref, lse_ref = reference(q, k, v, indptr, indices, sm_scale)
    for splits in (1, 2, 4, 8):
        o, lse = run_kernel(patched, q, k, v, indptr, indices, splits, splits, sm_scale)
        assert_matches(o, lse, o_ref, lse_ref, MIXED_LENS)


@pytest.mark.parametrize("group", [1, 4])
def test_per_request_splits_and_splits_beyond_length(patched, group):
    # Each request its own num_kv_splits (as the backend sets them), some beyond its length
    # (length 1 with 8 splits) and some below max_kv_splits (grid wider than the splits).
    lens = [1, 3, 64, 65, 0, 200]
    splits = [8, 3, 1, 8, 8, 5]
    q, k, v, indptr, indices = make_inputs(lens, 2, group, 32, seed=7)
    o_ref, lse_ref = reference(q, k, v, indptr, indices, 0.2)
    o, lse = run_kernel(patched, q, k, v, indptr, indices, splits, 8, 0.2)
    assert_matches(o, lse, o_ref, lse_ref, lens)


@pytest.mark.parametrize("group", [1, 4])
def test_all_empty_shard_is_neutral(patched, group):
    lens = [0, 0, 0]
    q, k, v, indptr, indices = make_inputs(lens, 2, group, 64, seed=3)
    for splits in (1, 4):
        o, lse = run_kernel(patched, q, k, v, indptr, indices, splits, splits, 0.125)
        assert torch.equal(o, torch.zeros_like(o))
        assert torch.isneginf(lse).all()


@pytest.mark.parametrize("group", [1, 4])
def test_logit_cap_and_large_logits(patched, group):
    # Large scale: logits ~ +-50, so the LSE is far from 0; the cap is applied before the LSE.
    lens = [5, 90, 0]
    q, k, v, indptr, indices = make_inputs(lens, 2, group, 64, seed=11)
    for cap in (0.0, 30.0):
        o_ref, lse_ref = reference(q, k, v, indptr, indices, 6.0, logit_cap=cap)
        o, lse = run_kernel(patched, q, k, v, indptr, indices, 4, 4, 6.0, logit_cap=cap)
        assert_matches(o, lse, o_ref, lse_ref, lens, atol=2e-4)


@pytest.mark.parametrize("group", [1, 4])
def test_sinks(patched, group):
    # The sink adds exp(sink) to the denominator: it is a logit whose value is zero. With an
    # empty KV: O = 0 and LSE = sink.
    lens = [0, 1, 70]
    q, k, v, indptr, indices = make_inputs(lens, 2, group, 32, seed=5)
    H = q.shape[1]
    sinks = torch.linspace(-2.0, 3.0, H)
    o_ref, lse_ref = reference(q, k, v, indptr, indices, 0.3, sinks=sinks)
    o, lse = run_kernel(patched, q, k, v, indptr, indices, 4, 4, 0.3, sinks=sinks)
    assert_matches(o, lse, o_ref, lse_ref, lens)
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    assert torch.equal(lse[0], sinks)


@pytest.mark.parametrize("group", [1, 4])
def test_shard_partials_merge_to_full_attention(patched, group):
    # The point of the LSE: attention over a KV sharded across ranks (tokens round-robin over
    # 3 shards; a request with 1 token leaves two shards empty) is the LSE-weighted merge of
    # each shard's (O, LSE).
    lens, n_shards = [1, 2, 50, 97], 3
    q, k, v, indptr, indices = make_inputs(lens, 2, group, 64, seed=13)
    o_ref, lse_ref = reference(q, k, v, indptr, indices, 0.125)
    outs, lses = [], []
    for r in range(n_shards):
        parts = [indices[indptr[b] : indptr[b + 1]][r::n_shards] for b in range(len(lens))]
        s_lens = [len(p) for p in parts]
        s_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        s_indptr[1:] = torch.cumsum(torch.tensor(s_lens, dtype=torch.int32), 0)
        o, lse = run_kernel(patched, q, k, v, s_indptr, torch.cat(parts), 2, 2, 0.125)
        assert_matches(o, lse, *reference(q, k, v, s_indptr, torch.cat(parts), 0.125), s_lens)
        outs.append(o.double())
        lses.append(lse.double())
    lse_all = torch.stack(lses)  # [R, B, H]
    merged_lse = torch.logsumexp(lse_all, dim=0)
    weights = torch.exp(lse_all - merged_lse)  # an empty shard weighs exp(-inf) = 0
    merged_o = (weights[..., None] * torch.stack(outs)).sum(0)
    torch.testing.assert_close(merged_lse, lse_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(merged_o, o_ref, atol=2e-5, rtol=1e-4)


def test_strided_output_lse(patched):
    lens = [3, 40]
    q, k, v, indptr, indices = make_inputs(lens, 2, 2, 16, seed=17)
    buf = torch.full((q.shape[1], len(lens)), float("nan"))  # [H, B]
    out_lse = buf.t()  # [B, H] view, strides (1, B)
    _, lse_ref = reference(q, k, v, indptr, indices, 0.25)
    run_kernel(patched, q, k, v, indptr, indices, 2, 2, 0.25, output_lse=out_lse)
    torch.testing.assert_close(out_lse.double(), lse_ref, atol=2e-5, rtol=1e-5)


def test_output_lse_checks_dtype_and_shape(patched):
    lens = [3, 4]
    q, k, v, indptr, indices = make_inputs(lens, 2, 1, 16, seed=19)
    B, H = q.shape[:2]
    bads = (torch.empty(B, H, dtype=torch.float64), torch.empty(B + 1, H), torch.empty(B, H, 1))
    for bad in bads:
        with pytest.raises(AssertionError):
            run_kernel(patched, q, k, v, indptr, indices, 1, 1, 0.25, output_lse=bad)


# --------------------------------------------------------------------------------------------
# Head-split output (patch "[Kernel] Triton decode stage 2: optional head-split output layout")
# --------------------------------------------------------------------------------------------
# (query heads per KV head, head dim, KVP, KV heads): every case has H / KVP >= 2, where head groups
# laid out blocked (h // (H/KVP)) and interleaved (h % KVP) differ, on the MHA and grouped kernels
@pytest.mark.parametrize("group,head_dim,kvp,kv_heads", [(1, 16, 2, 4), (4, 64, 4, 2), (8, 128, 2, 2)])
def test_head_split_output_is_the_packed_send_buffer(patched, group, head_dim, kvp, kv_heads):
    """Stage 2 given the All-to-All send buffer's views (a [KVP, B, H/KVP, D] output and a
    [KVP, B, H/KVP] LSE) writes exactly the bytes that packing its [B, H, D] output and [B, H]
    LSE writes (``dcp_pack_a2a_send_torch``, the same bytes as upstream's ``dcp_pack_a2a_send``)
    into ``dcp_a2a_lse_reduce_packed``'s send buffer: bit for bit, an empty shard included.

    Upstream modules only (the per-prefix check runs this at the patch, before any Helix module);
    the GQA mode's decode hands stage 2 exactly these views (``dcp_a2a_send_buffer``)."""
    from sglang.kernels.ops.attention.dcp_kernels import _lse_pack_dim, dcp_pack_a2a_send_torch

    lens = [0, 5, 130]
    q, k, v, indptr, indices = make_inputs(lens, kv_heads, group, head_dim, seed=31 + group)
    B, H = q.shape[:2]
    assert H // kvp >= 2  # blocked and interleaved head groups differ
    args = (q, k, v, indptr, indices, [1, 2, 4], 4, 0.2)
    o, lse = run_kernel(patched, *args)
    lpd = _lse_pack_dim(q.dtype)
    shape = (kvp, B, H // kvp, head_dim + lpd)  # dcp_a2a_lse_reduce_packed's send buffer

    def views(buf):  # (out [KVP, B, H/KVP, D], lse [KVP, B, H/KVP] fp32: the word after the output)
        return buf[..., :head_dim], buf.view(torch.float32)[..., head_dim // lpd]

    packed = torch.full(shape, float("nan"))
    dcp_pack_a2a_send_torch(o, lse, *views(packed))
    send = torch.full(shape, float("nan"))
    out_view, lse_view = views(send)
    run_kernel(patched, *args, o=out_view, output_lse=lse_view)
    assert torch.equal(send.view(torch.int32), packed.view(torch.int32))
    comm = importlib.import_module("sglang.srt.layers.dcp.comm")
    if hasattr(comm, "dcp_a2a_send_buffer"):  # the GQA mode's decode hands the kernel these views
        buf, *gqa_views = comm.dcp_a2a_send_buffer(B, H, head_dim, q.dtype, kvp, "cpu")
        assert tuple(buf.shape) == shape
        for mine, gqa in zip(views(buf), gqa_views):
            assert (mine.data_ptr(), mine.shape, mine.stride(), mine.dtype) == (
                gqa.data_ptr(), gqa.shape, gqa.stride(), gqa.dtype,
            )  # fmt: skip
    # The same option writes any strided layout, e.g. [B, H/KVP, KVP, D] (FlashInfer's
    # decode_cp_a2a_lse_reduce partial_o) seen through a permute.
    fi_o = torch.full((B, H // kvp, kvp, head_dim), float("nan"))
    fi_lse = torch.full((B, H // kvp, kvp), float("nan"))
    run_kernel(patched, *args, o=fi_o.permute(2, 0, 1, 3), output_lse=fi_lse.permute(2, 0, 1))
    assert torch.equal(fi_o.permute(0, 2, 1, 3).reshape(B, H, head_dim), o)
    assert torch.equal(fi_lse.permute(0, 2, 1).reshape(B, H), lse)


# --------------------------------------------------------------------------------------------
# Stage 2's tiled split reduction (split_tile)
# --------------------------------------------------------------------------------------------
# An extent of 24 splits (a multiple of neither tile). 1000 tokens over 24 splits: 64-token splits,
# 16 non-empty; 600 over 13: 10 non-empty; 37 tokens: one; an empty request: none. A tile past the
# last non-empty split is skipped, a partly filled one masked.
TILED_LENS = [0, 1000, 37, 600, 0]
TILED_SPLITS = [3, 24, 24, 13, 24]


@pytest.mark.parametrize("split_tile", [4, 16])
@pytest.mark.parametrize("group,variant", [(1, "plain"), (4, "sinks"), (4, "send_layout")])
def test_tiled_split_reduction_matches_reference_and_serial_loop(patched, split_tile, group, variant):
    q, k, v, indptr, indices = make_inputs(TILED_LENS, 2, group, 32, seed=41 + group)
    kw = {"sinks": torch.linspace(-1.0, 1.0, q.shape[1])} if variant == "sinks" else {}
    args = (q, k, v, indptr, indices, TILED_SPLITS, 24, 0.2)
    serial = run_kernel(patched, *args, **kw)
    if variant == "send_layout":  # into the All-to-All's [G, B, H/G, Dv] send layout, as the GQA mode
        B, H, Dv = q.shape[0], q.shape[1], v.shape[-1]
        o = torch.full((2, B, H // 2, Dv), float("nan"))
        lse = torch.full((2, B, H // 2), float("nan"))
        run_kernel(patched, *args, o=o, output_lse=lse, split_tile=split_tile)
        tiled = (o.transpose(0, 1).reshape(B, H, Dv), lse.transpose(0, 1).reshape(B, H))
    else:
        tiled = run_kernel(patched, *args, split_tile=split_tile, **kw)
    assert_matches(*tiled, *reference(q, k, v, indptr, indices, 0.2, **kw), TILED_LENS)
    # the same merge as the serial loop, up to the fp32 sums' order
    torch.testing.assert_close(tiled[0], serial[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(tiled[1], serial[1], atol=1e-6, rtol=1e-6)


def test_split_tile_is_a_power_of_two(patched):
    args = make_inputs([5], 2, 1, 16, seed=3)
    with pytest.raises(AssertionError):
        run_kernel(patched, *args, 4, 4, 0.1, split_tile=3)


def test_the_gqa_mode_tiles_stage_2_by_its_split_extent():
    gqa_decode = pytest.importorskip("sglang.srt.layers.dcp.gqa_decode")
    tiles = {s: gqa_decode.stage2_split_tile(s) for s in (1, 8, 12, 32, 64, 256)}
    assert tiles == {1: 1, 8: 8, 12: 16, 32: 32, 64: 32, 256: 32}


# --------------------------------------------------------------------------------------------
# With output_lse=None nothing changes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 80)])
@pytest.mark.parametrize("variant", ["plain", "logit_cap", "sinks"])
def test_without_lse_bit_identical_to_pristine(patched, pristine, group, head_dim, variant):
    lens = [1, 37, 250]
    q, k, v, indptr, indices = make_inputs(lens, 2, group, head_dim, seed=23 + group)
    kw = {}
    if variant == "logit_cap":
        kw["logit_cap"] = 5.0
    if variant == "sinks":
        kw["sinks"] = torch.linspace(-1.0, 1.0, q.shape[1])
    for splits in (1, [8, 2, 8]):  # per-request splits, max_kv_splits 8
        args = (q, k, v, indptr, indices, splits, 8 if isinstance(splits, list) else splits, 0.1)
        o_new, lse_none = run_kernel(patched, *args, with_lse=False, **kw)
        o_old, _ = run_kernel(pristine, *args, with_lse=False, **kw)
        assert lse_none is None
        assert not torch.isnan(o_old).any()
        assert torch.equal(o_new, o_old)
        # With the LSE on, the output of a non-empty request is the same bits too.
        o_lse, _ = run_kernel(patched, *args, **kw)
        assert torch.equal(o_lse, o_old)
