"""The KVP ranks of one DCP group on the CPU, each with the real attention backend over its own KV
pool, for unit tests of the attention path without a server.

``Ranks(shape, backend="triton" | "torch_native", spec=...)`` builds, per KVP rank, the backend the
model runner builds (``TritonAttnBackend(model_runner)``; for speculation also the multi-step draft
backend) from a model runner's fields, with its own ``MHATokenToKVPool`` and one request table shared
by all ranks, paged as DCP's allocator pages it (``loc % page == pos % page``, page = chunk x KVP).
``solo_rank=r``: only rank ``r`` runs, the others' contributions copies of its own (for recording
kernel launches, not for results). ``replicated_q=False``: upstream DCP's layout instead (Q gathered over the group, all-gather +
reduce). ``ranks.run(fn)`` runs ``fn(rank)`` on every rank, each in a thread with that rank's runtime context
(``get_parallel()``: its DCP rank, its group), one thread at a time (the Triton interpreter is not
thread-safe); the DCP group's collectives go between the threads (``Exchange``), so the backends'
own exchange (the All-to-All of ``dcp_a2a_lse_reduce``) runs as on a GPU group.

The harness is only the plumbing: every test computes what attention should give itself.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, List, Optional

import torch

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in os.sys.path:  # sglang's imports pull in sgl_kernel
    os.sys.path.insert(0, STUB_DIR)


@dataclass(frozen=True)
class Shape:
    """One TPA rank's attention: ``heads`` query heads (Q/TPA) over ``kv_heads`` KV heads (K/TPA) of
    ``head_dim``, the KV sharded over ``kvp`` ranks in runs of ``chunk`` tokens."""

    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    kvp: int = 2
    chunk: int = 2
    slots: int = 4
    max_len: int = 48
    kv_dtype: torch.dtype = torch.float32
    dtype: torch.dtype = torch.float32
    max_kv_splits: int = 4

    @property
    def page(self) -> int:
        return self.chunk * self.kvp


class Exchange:
    """The collectives of one DCP group between the threads of ``Ranks.run``; the caller holds
    ``turn`` whenever it runs, and gives it up only while it waits for the others. ``solo``: one
    rank runs alone and every other rank's contribution is a copy of its own (shapes and launches
    as in the group, values not: for recording kernel launches)."""

    def __init__(self, size: int, on_turn: Callable[[int], None], solo: bool = False):
        self.size, self.on_turn, self.solo = size, on_turn, solo
        self.turn = threading.Lock()
        self.barrier = threading.Barrier(size)
        self.inputs: List[Optional[torch.Tensor]] = [None] * size
        self.calls = [0] * size  # all_to_all_single calls per rank

    def wait(self, rank: int) -> None:
        if self.solo:
            self.inputs = [self.inputs[rank]] * self.size
            return
        self.turn.release()
        self.barrier.wait()
        self.turn.acquire()
        self.on_turn(rank)

    def group(self, rank: int):
        exchange = self

        class Group:  # what the DCP exchanges use of a GroupCoordinator
            world_size = exchange.size
            rank_in_group = rank

            def all_to_all_single(self, output, input):
                exchange.calls[rank] += 1
                exchange.inputs[rank] = input
                exchange.wait(rank)
                rows = [x.reshape(exchange.size, -1)[rank] for x in exchange.inputs]
                output.reshape(exchange.size, -1).copy_(torch.stack(rows))
                exchange.wait(rank)

            def all_gather(self, input, dim=0):
                exchange.inputs[rank] = input
                exchange.wait(rank)
                out = torch.cat([x.clone() for x in exchange.inputs], dim=dim)
                exchange.wait(rank)
                return out

            def all_reduce(self, input):
                exchange.inputs[rank] = input
                exchange.wait(rank)
                out = torch.stack([x.clone() for x in exchange.inputs]).sum(dim=0)
                exchange.wait(rank)
                return out

        return Group()


def _bags(shape: Shape, spec, backend: str) -> dict:
    steps = spec.num_steps if spec else None
    return {
        "exec": SimpleNamespace(
            kernel=SimpleNamespace(
                attention_backend=backend,  # (read where upstream picks a verify mask's layout)
                prefill_attention_backend=None,
                decode_attention_backend=None,
                enable_lean_attention=False,
                triton_attention_num_kv_splits=shape.max_kv_splits,
                triton_attention_split_tile_size=None,
            ),
            dllm=SimpleNamespace(dllm_algorithm=None),
            comm=SimpleNamespace(enable_symm_mem=False),
            deterministic=SimpleNamespace(enable_deterministic_inference=False),
            graph=SimpleNamespace(cuda_graph_config=None, disable_cuda_graph=True),
        ),
        "schedule": SimpleNamespace(chunked_prefill_size=-1, page_size=shape.chunk),
        "spec": SimpleNamespace(
            speculative_algorithm=spec.algorithm if spec else None,
            speculative_num_draft_tokens=spec.num_draft_tokens if spec else None,
            speculative_num_steps=steps,
            speculative_eagle_topk=spec.topk if spec else None,
            speculative_draft_window_size=None,
            speculative_draft_sink_size=None,
        ),
    }


class _Context:
    """What ``runtime_context``'s config getters read (``config_bag``)."""

    def __init__(self, bags: dict, parallel):
        self.bags, self.parallel = bags, parallel

    def config_bag(self, name: str):
        return self.bags[name]


@dataclass(frozen=True)
class Spec:
    """Speculation: ``num_steps`` draft steps of ``topk`` branches, ``num_draft_tokens`` verified."""

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    algorithm: str = "EAGLE"


def paged_table(shape: Shape) -> torch.Tensor:
    """``req_to_token [slots, max_len]`` of logical ids as DCP's allocator hands them out: each
    request on pages of ``chunk x KVP`` ids of its own (``loc % page == pos % page``), page 0 unused.
    """
    per_slot = -(-shape.max_len // shape.page) * shape.page
    table = torch.empty(shape.slots, shape.max_len, dtype=torch.int32)
    for slot in range(shape.slots):
        base = shape.page * (1 + slot * (per_slot // shape.page))
        table[slot] = base + torch.arange(shape.max_len, dtype=torch.int32)
    return table


def pool_rows(shape: Shape) -> int:
    """Rows a rank's pool needs for ``paged_table``'s ids (localized: 1/KVP of them)."""
    per_slot = -(-shape.max_len // shape.page) * shape.page
    return (shape.page * (1 + shape.slots * per_slot // shape.page)) // shape.kvp + 1


class Ranks:
    """The KVP ranks of one DCP group (module docstring); ``shape.kvp == 1``: one rank, no DCP."""

    def __init__(
        self,
        shape: Shape,
        backend: str = "triton",
        spec: Optional[Spec] = None,
        num_layers: int = 1,
        replicated_q: bool = True,
        solo_rank: Optional[int] = None,
    ):
        from sglang.srt import runtime_context
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        self.shape, self.backend_name, self.spec = shape, backend, spec
        self.req_to_token = paged_table(shape)
        self.bags = _bags(shape, spec, backend)
        self.solo_rank = solo_rank  # run only this rank (Exchange's solo)
        self.exchange = Exchange(shape.kvp, self._install, solo=solo_rank is not None)
        self.parallels = [
            SimpleNamespace(
                attn_dcp_size=shape.kvp,
                attn_dcp_rank=r,
                attn_tp_size=shape.kvp,
                attn_tp_rank=r,
                tp_size=shape.kvp,
                tp_rank=r,
                dcp_size=shape.kvp,
                dcp_rank=r,
                dcp_enabled=shape.kvp > 1,
                dcp_interleave_size=shape.chunk,
                dcp_group=self.exchange.group(r),
                dcp_comm_backend="a2a" if replicated_q else "ag_rs",
                dcp_replicate_q_proj=replicated_q,
                dcp_gqa_mode=replicated_q and shape.kvp > 1,
            )
            for r in range(shape.kvp)
        ]
        self._runtime_context = runtime_context
        self.pools = [
            MHATokenToKVPool(
                pool_rows(shape),
                1,
                shape.kv_dtype,
                shape.kv_heads,
                shape.head_dim,
                num_layers,
                "cpu",
                enable_memory_saver=False,
            )
            for _ in range(shape.kvp)
        ]
        self.backends: list = [None] * shape.kvp
        self.draft_backends: list = [None] * shape.kvp
        self.run(self._build)

    # -- the model runner each backend is built from ----------------------------------------

    def model_runner(self, rank: int, is_draft: bool = False):
        from transformers import LlamaConfig

        from sglang.srt.configs.model_config import AttentionArch

        s = self.shape
        hf_config = LlamaConfig(
            num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads,
            head_dim=s.head_dim,
            hidden_size=s.heads * s.head_dim,
            max_position_embeddings=s.max_len,
            architectures=["LlamaForCausalLM"],
        )
        model_config = SimpleNamespace(
            attention_arch=AttentionArch.MHA,
            get_max_num_attention_heads=lambda: s.heads,  # Q/TPA at attn_tp_size = KVP
            get_num_kv_heads=lambda tp, dcp=1: s.kv_heads,
            head_dim=s.head_dim,
            v_head_dim=s.head_dim,
            swa_v_head_dim=None,
            context_len=s.max_len,
            is_encoder_decoder=False,
            hf_config=hf_config,
            hf_text_config=hf_config,
            linear_attn_registry_result=None,
        )
        pool = self.pools[rank]
        return SimpleNamespace(
            req_to_token_pool=SimpleNamespace(
                req_to_token=self.req_to_token, size=s.slots
            ),
            token_to_kv_pool=pool,
            token_to_kv_pool_allocator=SimpleNamespace(page_size=s.page),
            sliding_window_size=None,
            page_size=s.chunk,
            kv_index_translator=None,
            decode_num_tokens_per_req=lambda: (
                self.spec.num_draft_tokens if self.spec else 1
            ),
            model_config=model_config,
            is_draft_worker=is_draft,
            spec_algorithm=SimpleNamespace(is_dspark=lambda: False),
            device="cpu",
            gpu_id=0,
            dtype=s.dtype,
            kv_cache_dtype=s.kv_dtype,
            server_args=SimpleNamespace(
                speculative_draft_window_size=None, speculative_draft_sink_size=None
            ),
        )

    def _build(self, rank: int) -> None:
        if self.backend_name == "triton":
            from sglang.srt.layers.attention.triton_backend import (
                TritonAttnBackend,
                TritonMultiStepDraftBackend,
            )

            self.backends[rank] = TritonAttnBackend(self.model_runner(rank))
            if self.spec is not None and self.spec.num_steps > 1:
                self.draft_backends[rank] = TritonMultiStepDraftBackend(
                    self.model_runner(rank, is_draft=True),
                    self.spec.topk,
                    self.spec.num_steps,
                )
        else:
            from sglang.srt.layers.attention import torch_native_backend as torch_native

            self.backends[rank] = torch_native.TorchNativeAttnBackend(self.model_runner(rank))
            if self.spec is not None and self.spec.num_steps > 1:  # (drafts: the torch_native speculation patch)
                self.draft_backends[rank] = torch_native.TorchNativeMultiStepDraftBackend(
                    self.model_runner(rank, is_draft=True),
                    self.spec.topk,
                    self.spec.num_steps,
                )

    # -- running the ranks ----------------------------------------------------------------

    def _install(self, rank: int) -> None:
        rc = self._runtime_context
        rc._PARALLEL = self.parallels[rank]
        rc._CONTEXT = _Context(self.bags, self.parallels[rank])

    def run(self, fn: Callable[[int], object]) -> list:
        """``[fn(rank) for each rank]``, each rank in its own thread with its runtime context; the
        first exception of any rank is raised."""
        rc = self._runtime_context
        saved = rc._PARALLEL, rc._CONTEXT
        results: list = [None] * self.shape.kvp
        errors: list = []

        def body(rank):
            self.exchange.turn.acquire()
            try:
                self._install(rank)
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)
                self.exchange.barrier.abort()  # the others must not wait for this rank
            finally:
                self.exchange.turn.release()

        ranks = range(self.shape.kvp) if self.solo_rank is None else [self.solo_rank]
        threads = [threading.Thread(target=body, args=(r,)) for r in ranks]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            rc._PARALLEL, rc._CONTEXT = saved
            if self.exchange.barrier.broken:
                self.exchange.barrier.reset()
        if errors:
            raise next(
                (e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                errors[0],
            )
        return results


def layer(shape: Shape, scaling: Optional[float] = None, scales=None, layer_id: int = 0):
    """The fields of a RadixAttention the backends read (``scales``: an fp8 pool's (k, v) scales)."""
    from sglang.srt.layers.radix_attention import AttentionType

    k_scale, v_scale = scales or (None, None)
    return SimpleNamespace(
        layer_id=layer_id,
        tp_q_head_num=shape.heads,
        tp_k_head_num=shape.kv_heads,
        tp_v_head_num=shape.kv_heads,
        qk_head_dim=shape.head_dim,
        v_head_dim=shape.head_dim,
        scaling=shape.head_dim**-0.5 if scaling is None else scaling,
        k_scale=None if scales is None else torch.tensor(k_scale),
        v_scale=None if scales is None else torch.tensor(v_scale),
        k_scale_float=k_scale,
        v_scale_float=v_scale,
        logit_cap=0.0,
        logit_capping_method="tanh",
        sliding_window_size=-1,
        is_cross_attention=False,
        attn_type=AttentionType.DECODER,
        xai_temperature_len=-1,
    )


def self_attn(backend, layer, q, k, v, batch, save_kv_cache: bool = True):
    """What a model layer's ``self.attn`` runs: RadixAttention views K/V as ``[T, K, D]`` and calls
    the backend's ``forward_decode`` / ``forward_extend``; ``[T, Q/N * D]`` comes back."""
    k = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)
    forward = (
        backend.forward_decode
        if batch.forward_mode.is_decode_or_idle()
        else backend.forward_extend
    )
    return forward(q.reshape(q.shape[0], -1), k, v, layer, batch, save_kv_cache)
