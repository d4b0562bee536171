"""A Helix rank's KV row holds K/TPA heads and its allocator's logical ids widen by KVP, so the
global token capacity is KVP times a rank's rows: DCP's own sizing, since Helix is DCP's GQA mode
(``attn_dcp_size`` = KVP). The Helix KV-cache patch makes a speculative draft's pool the same
(upstream's DCP drafts are replicated).

Driven through upstream's sizing code (``DefaultPoolConfigurator._compute_cell_size``,
``KVCacheConfigurator.logical_token_capacity`` / ``loc_space_scale``) with the parallel context of
a Helix launch.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:  # the configurators' imports pull in sgl_kernel
    sys.path.insert(0, STUB_DIR)

from sglang.srt.configs import model_config as model_config_module  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.cp import utils as cp_utils  # noqa: E402
from sglang.srt.mem_cache import kv_cache_configurator  # noqa: E402
from sglang.srt.model_executor import pool_configurator  # noqa: E402

LAYERS, HEAD_DIM = 4, 128


def _parallel(tp, kvp, helix=True):
    return SimpleNamespace(
        attn_tp_size=tp, attn_dcp_size=kvp, helix_kvp_size=kvp if helix else 1, dcp_gqa_mode=helix and kvp > 1,
        attn_cp_size=1,
    )  # fmt: skip


def _cell_size(monkeypatch, num_kv_heads, tp, kvp, draft=False, helix=True):
    monkeypatch.setattr(pool_configurator, "get_parallel", lambda: _parallel(tp, kvp, helix))
    monkeypatch.setattr(model_config_module, "_dcp_gqa_mode", lambda: helix and kvp > 1)
    monkeypatch.setattr(cp_utils, "is_glm_dsa_cache_layer_split_enabled", lambda _: False)  # not a DSA model
    model_config = SimpleNamespace(
        is_draft_model=draft, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
        hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
        get_total_num_kv_heads=lambda: num_kv_heads,
    )  # fmt: skip
    model_config.get_num_kv_heads = lambda t, d=1: ModelConfig.get_num_kv_heads(model_config, t, d)
    kvc = SimpleNamespace(
        model_config=model_config, kv_cache_dtype=torch.bfloat16, use_mla_backend=False,
        server_args=SimpleNamespace(enable_hisparse=False),
    )  # fmt: skip
    configurator = SimpleNamespace(
        kv_cache_dtype_str="auto",
        _compute_qsa_cell_size=pool_configurator.DefaultPoolConfigurator._compute_qsa_cell_size,
    )
    return pool_configurator.DefaultPoolConfigurator._compute_cell_size(configurator, kvc, LAYERS)


@pytest.mark.parametrize(
    "num_kv_heads, tp, kvp, heads_per_rank",
    [
        (8, 8, 1, 1),  # plain TP: K/N
        (8, 8, 2, 2),  # TPA 4: K/TPA
        (8, 8, 8, 8),  # TPA 1: every KV head, 1/8 of the tokens
        (4, 8, 2, 1),  # TPA 4 = K: one head
        (1, 4, 4, 1),  # K = 1
    ],
)
def test_a_row_holds_k_over_tpa_heads(monkeypatch, num_kv_heads, tp, kvp, heads_per_rank):
    cell = _cell_size(monkeypatch, num_kv_heads, tp, kvp)
    assert cell == heads_per_rank * 2 * HEAD_DIM * LAYERS * 2  # K and V, bf16


@pytest.mark.parametrize("kvp", [1, 2, 4])
def test_logical_capacity_is_kvp_times_the_rows(monkeypatch, kvp):
    monkeypatch.setattr(kv_cache_configurator, "get_parallel", lambda: _parallel(8, kvp))
    configurator = SimpleNamespace(is_hybrid_swa=False, loc_space_scale=1)
    rows = 1000
    assert kv_cache_configurator.KVCacheConfigurator.logical_token_capacity(configurator, max_total_num_tokens=rows) == rows * kvp


@pytest.mark.parametrize("helix", [True, False])
def test_a_draft_is_sharded_like_its_target_under_helix(monkeypatch, helix):
    """Under Helix a speculative draft's row holds K/TPA heads, its pool is a rank's rows
    (loc_space_scale 1); under plain DCP upstream's replicated draft stays (K/N, widened ids)."""
    cell = _cell_size(monkeypatch, 8, 8, 2, draft=True, helix=helix)
    heads = 2 if helix else 1  # K/TPA = 8/4, else K/N = 8/8
    assert cell == heads * 2 * HEAD_DIM * LAYERS * 2
    monkeypatch.setattr(kv_cache_configurator, "get_parallel", lambda: _parallel(8, 2, helix))
    draft = SimpleNamespace(is_draft_worker=True)
    assert kv_cache_configurator.KVCacheConfigurator.loc_space_scale.fget(draft) == (1 if helix else 2)
