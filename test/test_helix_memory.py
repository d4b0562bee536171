"""DCP's GQA mode allocates its decode buffers where upstream DCP does, sized for the mode.

The mode keeps no buffers of its own: its decode lists and split buffers are the Triton backend's
(``init_cuda_graph_state``), and nothing is charged for them before the KV pool is sized, as for
upstream's. Sized for the mode: a rank's graph KV index buffer lists 1/KVP of the context per
request (upstream's lists the whole context), and its graph split buffers hold, for every captured
batch, the rows of its split extent (``KVSplitPolicy.split_rows``, the policy the decode runs):
at most upstream's rows once the largest captured batch reaches 64, ~512 rows below. The backends
here are the real ones (``dcp_ranks``) on real model shapes' heads per rank; their buffers are on
the CPU, so the context is scaled down (the sizes are linear in it).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

from sglang_helix.testing.dcp_ranks import Ranks, Shape  # noqa: E402
from sglang.srt.layers.dcp import gqa_decode  # noqa: E402

# (name, query heads Q, KV heads K, v_head_dim): the published config.json values.
MODELS = {
    "Llama-3.1-70B": (64, 8, 128),
    "Qwen3-235B-A22B": (64, 4, 128),
}
CONTEXT, TP, KVP, CHUNK = 4096, 8, 2, 64


@pytest.mark.parametrize("max_bs", [256, 16])
@pytest.mark.parametrize("cores", [132, 0], ids=["gpu", "cpu"])
@pytest.mark.parametrize("name", list(MODELS))
def test_graph_buffers_are_upstreams_sized_for_the_mode(name, cores, max_bs):
    q, k, v_head_dim = MODELS[name]
    tpa = TP // KVP
    shape = Shape(heads=q // tpa, kv_heads=max(1, k // tpa), head_dim=v_head_dim, kvp=KVP, chunk=CHUNK,
                  slots=max_bs, max_len=CONTEXT, max_kv_splits=8)  # fmt: skip
    ranks = Ranks(shape, "triton")
    for backend in ranks.backends:
        backend.device_core_count = cores
        backend.dcp_split_policy = gqa_decode.kv_split_policy(8, cores, False, None)
    ranks.run(lambda r: ranks.backends[r].init_cuda_graph_state(max_bs, max_bs))
    for rank, backend in enumerate(ranks.backends):
        # this rank's share of the context per request (rank 0 owns the most)
        local = sum(1 for p in range(CONTEXT) if (p // CHUNK) % KVP == rank)
        assert (
            backend.cuda_graph_kv_indices.numel()
            == max_bs * local
            == max_bs * CONTEXT // KVP
        )
        upstream_rows = max_bs * 8  # max_num_tokens x max_kv_splits
        rows = backend.cuda_graph_attn_logits.numel() // (shape.heads * v_head_dim)
        assert rows == backend.cuda_graph_attn_lse.numel() // shape.heads
        if cores == 0:
            assert (
                rows == upstream_rows
            )  # no SM count: upstream's splits, upstream's buffer
        else:
            policy = backend.dcp_split_policy
            assert rows == policy.split_rows(max_bs, shape.heads, shape.kv_heads)
            assert rows <= max(upstream_rows, 512 * 2), (rows, upstream_rows)
            for bs in (1, 3, max_bs):  # every captured batch's view fits
                logits, lse = backend._graph_split_buffers(bs)
                assert logits.shape == (
                    bs,
                    shape.heads,
                    policy.grid_splits(bs, shape.heads, shape.kv_heads),
                    v_head_dim,
                )
                assert logits.data_ptr() == backend.cuda_graph_attn_logits.data_ptr()


def _configurator(monkeypatch, helix, disagg=None, page_size=64):
    """``DefaultPoolConfigurator`` over a Llama-3.1-70B-shaped config with its sizing inputs stubbed
    (cell 1024 bytes a token, page-shard scratch 4096)."""
    from sglang.srt.model_executor import pool_configurator

    q, k, v_head_dim = MODELS["Llama-3.1-70B"]
    parallel = SimpleNamespace(
        dcp_gqa_mode=helix,
        attn_dcp_size=KVP,
        attn_tp_size=TP,
        dcp_interleave_size=CHUNK,
    )
    monkeypatch.setattr(pool_configurator, "get_parallel", lambda: parallel)
    monkeypatch.setattr(
        pool_configurator,
        "get_schedule",
        lambda: SimpleNamespace(max_total_tokens=None, page_size=page_size),
    )
    monkeypatch.setattr(pool_configurator, "get_disagg", lambda: disagg or SimpleNamespace(
        disaggregation_mode="null", disaggregation_transfer_backend="mooncake"))  # fmt: skip
    monkeypatch.setattr(pool_configurator, "mambaish_config", lambda model_config: None)
    monkeypatch.setattr(
        pool_configurator,
        "compute_page_shard_scratch_bytes",
        lambda kvc, include_mtp: 4096,
    )
    monkeypatch.setattr(
        pool_configurator.DefaultPoolConfigurator,
        "_compute_cell_size",
        lambda self, kvc, n: 1024,
    )
    parallel.attn_dcp_size = KVP
    algorithm = SimpleNamespace(
        is_eagle=lambda: False,
        is_standalone=lambda: False,
        is_dflash_family=lambda: False,
    )
    kvc = SimpleNamespace(
        kv_cache_dtype_str="auto", layer_info=SimpleNamespace(num_effective_layers=80), pp_size=1,
        is_draft_worker=False, spec_algorithm=algorithm, use_mla_backend=False,
        model_config=SimpleNamespace(
            num_attention_heads=q, get_total_num_kv_heads=lambda: k, v_head_dim=v_head_dim, context_len=CONTEXT,
            dtype=torch.bfloat16,
        ),
    )  # fmt: skip
    return pool_configurator.DefaultPoolConfigurator(kvc)


@pytest.mark.parametrize("helix", [True, False], ids=["helix", "off"])
def test_the_pool_configurator_charges_nothing_for_the_mode(helix, monkeypatch):
    """The KV pool is sized after the same fixed overhead with the mode on or off: its decode
    buffers are the attention backend's, allocated where upstream's are."""
    configurator = _configurator(monkeypatch, helix)
    assert configurator._fixed_overhead_bytes == 4096


@pytest.mark.parametrize("mode", ["prefill", "decode", "null"])
@pytest.mark.parametrize("helix", [True, False], ids=["helix", "off"])
def test_a_pd_server_charges_nothing_before_its_pool(mode, helix, monkeypatch):
    """A server of PD disaggregation over Mooncake, prefill or decode, in the mode or not, sizes its
    KV pool after upstream's fixed overhead alone: the mode's prefill packs head sub-slices into
    upstream's DCP pack buffers, allocated when a DCP decode registers (as for MLA), not into a
    staging of its own charged here (issue 69; a real prefill server's pool: test_helix_pd_e2e)."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_QUEUE_SIZE", "3")
    disagg = SimpleNamespace(disaggregation_mode=mode, disaggregation_transfer_backend="mooncake")
    configurator = _configurator(monkeypatch, helix, disagg, page_size=64)
    assert configurator._fixed_overhead_bytes == 4096
