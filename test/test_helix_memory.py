"""Every byte of Helix's persistent decode buffers is counted before the KV pool is sized.

``decode_state.graph_buffer_bytes`` is what ``DefaultPoolConfigurator`` charges against the KV
budget (the Triton-backend patch); the shipped ``DcpGqaDecodeState`` then allocates its graph
buffers (``init_graph_state``: a list set per draft step) and the per-layer workspace (the hooks'
``workspace``, for each head configuration). Here
both run for real model shapes on the meta device (no memory), and the bytes allocated must equal
the bytes reserved exactly. Upstream's own graph split buffers are not allocated under Helix
(``cuda_graph_attn_logits`` is empty), and eager decode reuses the graph buffers when a batch fits.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

import sglang.srt.utils  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.layers.dcp import gqa_decode as decode_state, gqa_layout as kv_layout  # noqa: E402
from sglang.srt.layers.dcp.gqa_decode import DcpGqaDecodeState, graph_buffer_bytes  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

# (name, query heads Q, KV heads K, v_head_dim): the published config.json values.
MODELS = {
    "Llama-3.1-70B": (64, 8, 128),
    "Qwen3-235B-A22B": (64, 4, 128),
}
CONTEXT, MAX_BS, TP, KVP, CHUNK = 1 << 20, 256, 8, 2, 64


def _reserved(
    monkeypatch, q, k, v_head_dim, dtype=torch.bfloat16, splits_flag=8, helix=True, cores=132, topk=None,
    graphs=True, decode_backend=None, cpu=False, draft=None, steps=None,
):  # fmt: skip
    from sglang.srt.model_executor.cuda_graph_config import Backend

    parallel = SimpleNamespace(
        dcp_gqa_mode=helix, attn_dcp_size=KVP, attn_tp_size=TP, dcp_interleave_size=CHUNK,
    )  # fmt: skip
    exec_ = SimpleNamespace(
        graph=SimpleNamespace(disable_cuda_graph=not graphs, cuda_graph_config=SimpleNamespace(
            decode=SimpleNamespace(bs=[1, 2, 4, 8, 16, 32, 64, 128, MAX_BS], backend=decode_backend or Backend.FULL))),
        kernel=SimpleNamespace(triton_attention_num_kv_splits=splits_flag),
    )  # fmt: skip
    monkeypatch.setattr(sglang.srt.utils, "is_cpu", lambda: cpu)
    spec = SimpleNamespace(
        speculative_algorithm="STANDALONE" if draft else "EAGLE" if topk else None, speculative_eagle_topk=topk,
        speculative_draft_model_path="/draft" if draft else None, speculative_num_steps=steps,
    )  # fmt: skip
    if draft:  # the draft's config.json, as upstream's get_config reads it: (Q, K, head_dim)
        from sglang.srt.utils import hf_transformers_utils

        dq, dk, dd = draft
        hf = SimpleNamespace(num_attention_heads=dq, num_key_value_heads=dk, head_dim=dd, hidden_size=dq * dd)
        monkeypatch.setattr(hf_transformers_utils, "get_config", lambda path, **_: hf)
    monkeypatch.setattr(decode_state, "get_parallel", lambda: parallel)
    monkeypatch.setattr(decode_state, "get_spec", lambda: spec)
    monkeypatch.setattr(runtime_context, "get_exec", lambda: exec_)
    monkeypatch.setattr(sglang.srt.utils, "get_device_core_count", lambda device_id=0: cores)
    kvc = SimpleNamespace(
        model_config=SimpleNamespace(
            num_attention_heads=q, get_total_num_kv_heads=lambda: k, v_head_dim=v_head_dim, context_len=CONTEXT,
            dtype=dtype,
        )
    )  # fmt: skip
    return graph_buffer_bytes(kvc)


def _allocated(q, k, v_head_dim, dtype=torch.bfloat16, cores=132, splits_flag=8, draft=None, list_sets=1):
    """What the shipped state allocates for the graph: lists (a set per draft step) + one head
    configuration's workspace (meta), and a draft's when its heads ``draft`` (Q, K, head_dim) differ."""
    req_to_token = torch.empty(MAX_BS + 1, CONTEXT, dtype=torch.int32, device="meta")
    state = DcpGqaDecodeState(req_to_token, 0, KVP, CHUNK, list_sets=list_sets)
    state.init_graph_state(MAX_BS, CONTEXT)
    buffers = state.graph
    tpa = TP // KVP
    policy = decode_state.KVSplitPolicy(splits_flag, max(splits_flag, decode_state.DCP_GQA_MAX_KV_SPLITS), cores)
    if not cores:  # the backend's fixed setting (kv_split_policy): no per-request policy
        policy = decode_state.KVSplitPolicy(splits_flag, splits_flag, 0)
    buffers.workspace(MAX_BS, q // tpa, max(1, k // tpa), v_head_dim, dtype, policy)
    if draft:
        buffers.workspace(MAX_BS, draft[0] // tpa, max(1, draft[1] // tpa), draft[2], dtype, policy)
    workspaces = [t for ws in buffers._workspaces.values() for t in ws]
    tensors = [buffers.kv_indptr, buffers.kv_indices, buffers.num_kv_splits, *workspaces]
    assert all(t.device.type == "meta" for t in tensors)
    return sum(t.nbytes for t in tensors)


@pytest.mark.parametrize("cores", [132, 0], ids=["gpu", "cpu"])
@pytest.mark.parametrize("name", list(MODELS))
def test_reserved_equals_allocated_for_real_models(name, cores, monkeypatch):
    q, k, v_head_dim = MODELS[name]
    reserved = _reserved(monkeypatch, q, k, v_head_dim, cores=cores)
    allocated = _allocated(q, k, v_head_dim, cores=cores)
    # Byte for byte: leaving out any buffer (the All-to-All's are < 0.3 % of the total at 1M) fails.
    assert reserved == allocated, (name, reserved, allocated)
    # The lists are 1/KVP of upstream's full-context index buffer (int64): rank 0 owns the most.
    assert allocated > MAX_BS * CONTEXT // KVP * 8


@pytest.mark.parametrize("draft", [(32, 8, 64), (64, 8, 128)], ids=["standalone-heads", "target-heads"])
def test_a_draft_with_its_own_heads_is_charged_its_workspace(draft, monkeypatch):
    """A STANDALONE draft (Llama-3.1-70B's target with a Llama-3.2-1B-shaped draft: 32 / 8 heads, head
    dim 64) gets its own workspace in the rank's buffer set: charged from the draft's config, byte
    for byte what its step backends' hooks allocate; a draft with its target's heads (an EAGLE head) shares
    the target's and adds nothing."""
    q, k, v_head_dim = MODELS["Llama-3.1-70B"]
    reserved = _reserved(monkeypatch, q, k, v_head_dim, draft=draft)
    assert reserved == _allocated(q, k, v_head_dim, draft=draft)
    alone = _allocated(q, k, v_head_dim)
    assert (reserved > alone) == (draft != (q, k, v_head_dim))


def test_nothing_is_reserved_with_helix_off(monkeypatch):
    assert _reserved(monkeypatch, 64, 8, 128, helix=False) == 0


def test_nothing_is_reserved_without_decode_graphs(monkeypatch):
    """The buffer set is charged only when decode graphs are captured: not with
    ``--disable-cuda-graph``, the decode phase disabled, or on the CPU engine (it captures only with
    torch.compile, which Helix refuses). Eager decode then allocates each step's buffers (as
    upstream's eager decode its split buffers), so nothing persistent is left uncharged."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    assert _reserved(monkeypatch, 64, 8, 128) > 0
    assert decode_state.reserved_batch() == MAX_BS
    for off in (dict(graphs=False), dict(decode_backend=Backend.DISABLED), dict(cpu=True)):
        assert _reserved(monkeypatch, 64, 8, 128, **off) == 0, off
        assert decode_state.reserved_batch() == 0, off  # and the state allocates no persistent set


def test_each_head_configuration_gets_its_own_workspace():
    """A speculative draft whose layers have other heads than its target's (a STANDALONE draft)
    shares the rank's buffer set: in a graph's fixed set each head configuration gets its own
    workspace, allocated once, and the target's stays where the captured graph holds it."""
    state = DcpGqaDecodeState(torch.zeros(3, 64, dtype=torch.int32), 0, KVP, CHUNK)
    state.init_graph_state(4, 64)
    buffers = state.graph
    policy = decode_state.KVSplitPolicy(8, 8, 0)
    target = buffers.workspace(4, 8, 2, 64, torch.float32, policy)
    draft = buffers.workspace(4, 4, 1, 64, torch.float32, policy)  # the draft's heads
    assert draft[0].shape == (4, 4, 8, 64) and target[0].shape == (4, 8, 8, 64)
    again = buffers.workspace(2, 8, 2, 64, torch.float32, policy)  # the target's again: the same memory
    assert all(a.data_ptr() == t.data_ptr() for a, t in zip(again, target))
    assert len(buffers._workspaces) == 2


def _configurator(monkeypatch, helix, disagg=None, page_size=64):
    """``DefaultPoolConfigurator`` over a Llama-3.1-70B-shaped config with its sizing inputs stubbed
    (cell 1024 bytes a token, page-shard scratch 4096), and the decode buffers' charge."""
    from sglang.srt.model_executor import pool_configurator

    q, k, v_head_dim = MODELS["Llama-3.1-70B"]
    charge = _reserved(monkeypatch, q, k, v_head_dim, helix=helix)  # installs the same parallel/exec
    parallel = decode_state.get_parallel()
    monkeypatch.setattr(pool_configurator, "get_parallel", lambda: parallel)
    monkeypatch.setattr(pool_configurator, "get_schedule", lambda: SimpleNamespace(max_total_tokens=None, page_size=page_size))
    monkeypatch.setattr(pool_configurator, "get_disagg", lambda: disagg or SimpleNamespace(
        disaggregation_mode="null", disaggregation_transfer_backend="mooncake"))  # fmt: skip
    monkeypatch.setattr(pool_configurator, "mambaish_config", lambda model_config: None)
    monkeypatch.setattr(pool_configurator, "compute_page_shard_scratch_bytes", lambda kvc, include_mtp: 4096)
    monkeypatch.setattr(pool_configurator.DefaultPoolConfigurator, "_compute_cell_size", lambda self, kvc, n: 1024)
    parallel.attn_dcp_size = KVP
    algorithm = SimpleNamespace(is_eagle=lambda: False, is_standalone=lambda: False, is_dflash_family=lambda: False)
    kvc = SimpleNamespace(
        kv_cache_dtype_str="auto", layer_info=SimpleNamespace(num_effective_layers=80), pp_size=1,
        is_draft_worker=False, spec_algorithm=algorithm, use_mla_backend=False,
        model_config=SimpleNamespace(
            num_attention_heads=q, get_total_num_kv_heads=lambda: k, v_head_dim=v_head_dim, context_len=CONTEXT,
            dtype=torch.bfloat16,
        ),
    )  # fmt: skip
    return pool_configurator.DefaultPoolConfigurator(kvc), charge


@pytest.mark.parametrize("helix", [True, False], ids=["helix", "off"])
def test_the_pool_configurator_charges_it_before_sizing_the_pool(helix, monkeypatch):
    """``DefaultPoolConfigurator`` (the Triton-backend patch) adds ``graph_buffer_bytes`` to its
    fixed overhead, which the KV pool's token count is sized after; with Helix off nothing."""
    configurator, charge = _configurator(monkeypatch, helix)
    assert configurator._fixed_overhead_bytes == 4096 + charge
    assert (charge > 0) == helix


@pytest.mark.parametrize("mode", ["prefill", "decode", "null"])
@pytest.mark.parametrize("staging", [None, 1024])
def test_a_pd_prefill_charges_its_transfer_staging(mode, staging, monkeypatch):
    """A prefill server of PD disaggregation over Mooncake (the PD patch) charges what its transfer
    workers may allocate for head sub-slices a decode in DCP's GQA mode takes: one staging buffer
    per transfer queue (``SGLANG_DISAGGREGATION_QUEUE_SIZE``), each the larger of
    ``SGLANG_DCP_PD_STAGING_BYTES`` (64 MiB unset) and one page of every K/V entry, the size
    ``MooncakeKVManager._dcp_gqa_staging`` allocates; a decode server or no PD, nothing."""
    from sglang.srt.disaggregation.common import dcp_gqa

    if staging is not None:
        monkeypatch.setenv(dcp_gqa.STAGING_BYTES_ENV, str(staging))
    monkeypatch.setenv("SGLANG_DISAGGREGATION_QUEUE_SIZE", "3")
    disagg = SimpleNamespace(disaggregation_mode=mode, disaggregation_transfer_backend="mooncake")
    configurator, _ = _configurator(monkeypatch, False, disagg, page_size=64)
    page_bytes = 1024 * 64  # one page of every K/V entry: the cell (bytes a token) x the page
    per_queue = 64 << 20 if staging is None else page_bytes  # 1024 bytes < a page: the page wins
    want = 3 * per_queue if mode == "prefill" else 0
    assert configurator._fixed_overhead_bytes == 4096 + want


def test_eager_decode_uses_the_one_charged_set():
    """Eager decode allocates the charged set (``reserved_bs`` requests) at its first step and fills
    it for every batch that fits, for requests of the model's context length as the charge counts
    them; graph capture then reuses it (no second copy); a larger batch gets buffers of its step
    only, never kept."""
    slots, max_len = 6, 64
    req_to_token = (CHUNK * KVP * (1 + torch.arange(slots)[:, None] * 2) + torch.arange(max_len)).int()
    state = DcpGqaDecodeState(req_to_token, 0, KVP, CHUNK, reserved_bs=4, max_context_len=max_len - 8)

    def batch(n):
        seq = torch.tensor([max_len - 1] * n)
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE, spec_info=None,
            req_pool_indices=torch.arange(n), seq_lens=seq, seq_lens_cpu=seq,
            out_cache_loc=req_to_token[torch.arange(n), seq - 1].long(),
        )  # fmt: skip

    # the fields of a TritonAttnBackend that prepare reads (its heads, its split setting, not a draft step's)
    backend = SimpleNamespace(
        num_head=4, num_kv_head=2, v_head_dim=8, dcp_gqa_dtype=torch.float32, dcp_draft_step=None,
        static_kv_splits=True, device_core_count=0, split_tile_size=None, max_kv_splits=4,
    )  # fmt: skip
    meta = state.prepare(batch(3), backend)
    charged = state.graph
    # sized by the model's context length (what graph_buffer_bytes charges), not req_to_token's width
    assert charged.max_bs == 4 and charged.capacity == state._capacity(4, max_len - 8)
    assert meta.kv_indices.data_ptr() == charged.kv_indices.data_ptr()
    assert state.prepare(batch(2), backend).kv_indices.data_ptr() == charged.kv_indices.data_ptr()
    reused = state.init_graph_state(4, max_len - 8)
    assert reused.data_ptr() == charged.kv_indices.data_ptr() and state.graph is charged  # reused
    step = state.prepare(batch(6), backend)  # larger than the charged set: buffers of this step only
    assert step.kv_indices.data_ptr() != charged.kv_indices.data_ptr() and step.num_kv_splits.shape == (6,)
    assert state.graph is charged  # the step's buffers are kept by its metadata only, like upstream's


def test_a_tree_draft_is_charged_per_token(monkeypatch):
    """With --speculative-eagle-topk K a draft step lists each of its K tokens per request (in a
    draft CUDA graph, into the one buffer set): the set is charged for K x the graph batch, a chain
    (topk 1) and no speculation alike for the batch."""
    q, k, v_head_dim = 64, 8, 128
    plain = _reserved(monkeypatch, q, k, v_head_dim)
    assert _reserved(monkeypatch, q, k, v_head_dim, topk=1) == plain
    tree = _reserved(monkeypatch, q, k, v_head_dim, topk=4)
    assert decode_state.reserved_batch() == 4 * MAX_BS
    capacity = 4 * MAX_BS * int(kv_layout.local_kv_lens(CONTEXT, 0, KVP, CHUNK))
    assert tree > plain and tree >= 8 * capacity  # the lists alone: int64 rows for 4x the tokens


def test_each_draft_step_is_charged_its_lists(monkeypatch):
    """EAGLE / STANDALONE with --speculative-num-steps S: the draft's S - 1 decode steps each build
    their lists before the steps run (``dcp_draft_step``), so the set holds S - 1 list sets, charged
    as allocated; NGRAM has no draft steps and no speculation one set."""
    q, k, v_head_dim = MODELS["Llama-3.1-70B"]
    plain = _reserved(monkeypatch, q, k, v_head_dim)
    assert decode_state.draft_list_sets() == 1 and plain == _allocated(q, k, v_head_dim)
    chain = _reserved(monkeypatch, q, k, v_head_dim, topk=1, steps=4)
    assert decode_state.draft_list_sets() == 3
    assert chain == _allocated(q, k, v_head_dim, list_sets=3) and chain > plain
    capacity = MAX_BS * int(kv_layout.local_kv_lens(CONTEXT, 0, KVP, CHUNK))
    assert chain - plain == 2 * (4 * (MAX_BS + 1) + 8 * capacity + 4 * MAX_BS)  # two more list sets
    monkeypatch.setattr(decode_state, "get_spec", lambda: SimpleNamespace(speculative_algorithm="NGRAM", speculative_num_steps=4))
    assert decode_state.draft_list_sets() == 1
