"""Qwen3.5's output gate in DCP's GQA mode gates the heads the All-to-All hands each rank.

Under ``--dcp-replicate-q-proj`` (``--helix-kvp-size``) every rank of a DCP group projects the
group's Q / TPA query heads and their gate rows; after the exchange (``dcp_a2a_lse_reduce``) DCP
rank r holds heads [r * Q/N, (r + 1) * Q/N) of them, and its ``o_proj`` shard reads global heads
[tp_rank * Q/N, (tp_rank + 1) * Q/N). The full-attention layer's ``gate_heads`` must pick exactly
those heads' gate rows.

For the published shapes (Qwen3.5-397B-A17B: 32 query heads, 2 KV heads; Qwen3.5-35B-A3B: 16 and
2; head dim 256) at N = 8 and 16 and KVP = N/2 (TPA 2) and N (TPA 1), every rank:
``Qwen3_5AttentionDecoderLayer`` is built on the meta device with that rank's runtime context
(a subprocess with the CPU engine's environment), and the heads its gate slice selects are compared
with the heads the real exchange returns to that rank (the group's partials tagged with their
global head, merged by ``dcp_a2a_lse_reduce`` between threads, ``testing.dcp_ranks.Exchange``) and
with its ``o_proj`` shard. Most of these cases keep 2-4 heads a rank, where a slice off by the
``Q/N`` factor or taken from another rank's rows is visible (docs/testing.md, the mutations).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch
from sglang_helix.testing.cpu_env import cpu_server_env
from sglang_helix.testing.dcp_ranks import Exchange

# name: (query heads, KV heads, hidden size); head dim 256 (perf_model.MODELS)
SHAPES = {"397b-a17b": (32, 2, 4096), "35b-a3b": (16, 2, 2048)}
GRIDS = [(n, kvp) for n in (8, 16) for kvp in (n // 2, n)]  # TPA = N / KVP <= K = 2

# Every rank's layer, built on the meta device with that rank's context as the launcher
# publishes it (dcp_rank = tp_rank % KVP, the DCP group a slice of consecutive ranks).
BUILD_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
import torch
from sglang.srt import runtime_context
from sglang.srt.configs.qwen3_5 import Qwen3_5TextConfig
from sglang.srt.layers.linear import get_group_rank_size
from sglang.srt.models import qwen3_5

shapes, grids = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for name, (q, kv, hidden) in shapes.items():
    cfg = Qwen3_5TextConfig(
        hidden_size=hidden, num_attention_heads=q, num_key_value_heads=kv, head_dim=256,
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        full_attention_interval=4, attn_output_gate=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    for n, kvp in grids:
        for rank in range(n):
            group = lambda r, size: SimpleNamespace(rank_in_group=r, world_size=size)
            runtime_context._PARALLEL = SimpleNamespace(
                tp_size=n, tp_rank=rank, attn_tp_size=n, attn_tp_rank=rank,
                tp_group=group(rank, n), attn_tp_group=group(rank, n),
                dcp_enabled=True, dcp_gqa_mode=True, dcp_size=kvp, dcp_rank=rank % kvp,
                attn_dcp_size=kvp, attn_dcp_rank=rank % kvp, dcp_group=group(rank % kvp, kvp),
                pp_size=1, pp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0,
            )
            with torch.device("meta"):
                layer = qwen3_5.Qwen3_5AttentionDecoderLayer(cfg, 3, build_stages=False)
            gate = layer.gate_heads
            out[f"{name}/{n}/{kvp}/{rank}"] = dict(
                num_heads=layer.num_heads,
                q_partition=list(get_group_rank_size(layer.qkv_proj.tp_group)),
                o_partition=list(get_group_rank_size(layer.o_proj.tp_group)),
                gate=None if gate is None else [gate.start, gate.stop],
            )
print("LAYERS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def layers():
    r = subprocess.run(
        [sys.executable, "-c", BUILD_SCRIPT, json.dumps(SHAPES), json.dumps(GRIDS)],
        env=cpu_server_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [l for l in r.stdout.splitlines() if l.startswith("LAYERS ")]
    return json.loads(line[len("LAYERS ") :])


def exchanged_heads(group_heads: list, kvp: int, monkeypatch) -> list:
    """The global heads ``dcp_a2a_lse_reduce`` hands each rank of one DCP group whose ranks all
    computed partials for ``group_heads`` (the group's Q/TPA heads in local order): each partial
    is its head's global index, with an LSE of 0 on every rank, so the merge returns the index.
    The pack and combine run in torch (the CPU's; the Triton ones are held to them in
    ``test_dcp_extensions.py``)."""
    from sglang.srt.layers.dcp import comm

    monkeypatch.setattr(comm, "dcp_a2a_kernels_run_on", lambda device: False)

    exchange, got, errors = Exchange(kvp, lambda rank: None), [None] * kvp, []
    tags = torch.tensor(group_heads, dtype=torch.float32)

    def rank_body(rank: int):
        exchange.turn.acquire()
        try:
            out = tags.view(1, -1, 1).expand(2, -1, 8).contiguous()  # [B, Q/TPA, D]
            lse = torch.zeros(2, len(group_heads))  # [B, Q/TPA]
            merged = comm.dcp_a2a_lse_reduce(out, lse, exchange.group(rank))  # [B, Q/N, D]
            got[rank] = merged[0, :, 0].round().int().tolist()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
            exchange.barrier.abort()
        finally:
            exchange.turn.release()

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(kvp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return got


@pytest.mark.parametrize("grid", GRIDS, ids=[f"n{n}-kvp{k}" for n, k in GRIDS])
@pytest.mark.parametrize("model", list(SHAPES))
def test_gate_heads_are_the_heads_the_exchange_returns(layers, model, grid, monkeypatch):
    q = SHAPES[model][0]
    n, kvp = grid
    tpa, q_out = n // kvp, q // n
    for tpa_rank in range(tpa):
        group_heads = list(range(tpa_rank * q // tpa, (tpa_rank + 1) * q // tpa))
        received = exchanged_heads(group_heads, kvp, monkeypatch)
        for kvp_rank in range(kvp):
            rank = tpa_rank * kvp + kvp_rank
            layer = layers[f"{model}/{n}/{kvp}/{rank}"]
            where = f"{model} N={n} KVP={kvp} rank {rank}"
            # the rank projects its group's Q / TPA heads (the qkv rows of TPA rank tpa_rank)
            assert layer["num_heads"] == q // tpa, where
            assert layer["q_partition"] == [tpa_rank, tpa], where
            # its o_proj reads heads [rank * Q/N, (rank + 1) * Q/N): what the exchange hands it
            assert layer["o_partition"] == [rank, n], where
            assert received[kvp_rank] == list(range(rank * q_out, (rank + 1) * q_out)), where
            # and the gate multiplies exactly those heads' attention
            start, stop = layer["gate"]
            gated = group_heads[start:stop]
            assert gated == received[kvp_rank], f"{where}: gate rows of heads {gated}, attention of heads {received[kvp_rank]}"
