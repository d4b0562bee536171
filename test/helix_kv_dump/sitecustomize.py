"""Per-rank K/V dumps for test/test_helix_kv_consistency.py.

On PYTHONPATH of a CPU server with HELIX_KV_DUMP_DIR set, this wraps the Triton backend's
``forward_decode`` / ``forward_extend`` (their DCP branches) when sglang imports the backend, and
torch_native's DCP path (``TorchNativeAttnBackend._forward_dcp``): after each layer's call, which has
written the batch's K/V, every rank (over)writes ``layer{L}_slot{S}_tp{R}.pt`` for every request of the batch: the global positions in
``[0, seq_len)`` it owns and their K/V rows read back from its pool (``[n, K/TPA, D]``), with its
place in the KVP x TPA grid (with HELIX_KV_DUMP_OWNED=1 the rows by the layout's rule instead of the
forward's lists: any forward, a speculative one's too). With HELIX_KV_DUMP_PLAIN=1, a plain-TP server's torch_native extends
(no DCP: a PD prefill server's, its speculative draft's included) write the same files, every position
of ``[0, seq_len)`` at its rows (``[n, K/tp, D]``). Host syncs and file I/O on every layer: a test
fixture, not a server feature. Every process without HELIX_KV_DUMP_DIR is untouched.
"""
import os

if os.environ.get("HELIX_KV_DUMP_DIR"):
    import importlib.abc
    import importlib.util
    import sys

    DUMP_DIR = os.environ["HELIX_KV_DUMP_DIR"]

    def dump(layer, forward_batch, backend):
        import torch

        from sglang.srt.layers.dcp.torch_attention import dcp_torch_metadata
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        kvp_rank, kvp_size, chunk = parallel.attn_dcp_rank, parallel.attn_dcp_size, parallel.dcp_interleave_size
        table = backend.req_to_token_pool.req_to_token
        if os.environ.get("HELIX_KV_DUMP_OWNED") == "1":
            return dump_owned(layer, forward_batch, backend, parallel)
        meta = dcp_torch_metadata(forward_batch, table, kvp_size, kvp_rank, chunk)  # the host-built lists
        kv_pool = backend.token_to_kv_pool
        positions = meta.kv_positions  # [longest]: the global position of local index j
        k_buf = kv_pool.get_key_buffer(layer.layer_id)
        v_buf = kv_pool.get_value_buffer(layer.layer_id)
        indptr = meta.kv_indptr.tolist()
        slots = forward_batch.req_pool_indices.tolist()
        for b, (slot, seq_len) in enumerate(zip(slots, forward_batch.seq_lens_cpu.tolist())):
            rows = meta.kv_indices[indptr[b] : indptr[b + 1]]
            record = {
                "layer_id": layer.layer_id, "slot": slot, "seq_len": int(seq_len),
                "tp_rank": parallel.tp_rank, "kvp_rank": kvp_rank, "kvp_size": kvp_size,
                "tpa_rank": parallel.tp_rank // parallel.attn_dcp_size, "chunk": chunk,
                "positions": positions[: indptr[b + 1] - indptr[b]].cpu(),  # of local 0, 1, ...
                "k": k_buf[rows].float().cpu(), "v": v_buf[rows].float().cpu(),
            }  # fmt: skip
            path = os.path.join(DUMP_DIR, f"layer{layer.layer_id}_slot{slot}_tp{parallel.tp_rank}.pt")
            torch.save(record, path + ".tmp")
            os.replace(path + ".tmp", path)

    def dump_owned(layer, forward_batch, backend, parallel):
        """HELIX_KV_DUMP_OWNED=1: the positions of ``[0, seq_len)`` this rank owns and their rows by
        the layout's own rule (``localize_dcp_indices`` of each request's logical ids), not the
        forward's lists (a speculative forward's -- verify, draft extend, draft step -- lists
        include drafts): a PD decode's pools, its draft's included, as the transfer left them."""
        import torch

        from sglang.srt.layers.dcp.layout import localize_dcp_indices

        kvp_rank, kvp_size, chunk = parallel.attn_dcp_rank, parallel.attn_dcp_size, parallel.dcp_interleave_size
        table = backend.req_to_token_pool.req_to_token
        kv_pool = backend.token_to_kv_pool
        k_buf = kv_pool.get_key_buffer(layer.layer_id)
        v_buf = kv_pool.get_value_buffer(layer.layer_id)
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        for slot, seq_len in zip(forward_batch.req_pool_indices.tolist(), seq_lens.tolist()):
            local = localize_dcp_indices(table[slot, : int(seq_len)].to(torch.int64), kvp_size, kvp_rank, chunk)
            owned = torch.nonzero(local >= 0).flatten()
            rows = local[owned].to(k_buf.device)
            record = {
                "layer_id": layer.layer_id, "slot": slot, "seq_len": int(seq_len), "tp_rank": parallel.tp_rank,
                "kvp_rank": kvp_rank, "kvp_size": kvp_size, "tpa_rank": parallel.tp_rank // kvp_size, "chunk": chunk,
                "positions": owned.cpu(), "k": k_buf[rows].float().cpu(), "v": v_buf[rows].float().cpu(),
            }  # fmt: skip
            path = os.path.join(DUMP_DIR, f"layer{layer.layer_id}_slot{slot}_tp{parallel.tp_rank}.pt")
            torch.save(record, path + ".tmp")
            os.replace(path + ".tmp", path)

    def dump_plain(layer, forward_batch, backend):
        """A plain-TP extend: every position of each request, read back at its rows."""
        import torch

        from sglang.srt.runtime_context import get_parallel

        tp_rank = get_parallel().tp_rank
        table = backend.req_to_token_pool.req_to_token
        kv_pool = backend.token_to_kv_pool
        k_buf = kv_pool.get_key_buffer(layer.layer_id)
        v_buf = kv_pool.get_value_buffer(layer.layer_id)
        slots = forward_batch.req_pool_indices.tolist()
        for slot, seq_len in zip(slots, forward_batch.seq_lens_cpu.tolist()):
            rows = table[slot, : int(seq_len)].to(torch.int64)
            record = {
                "layer_id": layer.layer_id, "slot": slot, "seq_len": int(seq_len), "tp_rank": tp_rank,
                "positions": torch.arange(int(seq_len)), "k": k_buf[rows].float().cpu(), "v": v_buf[rows].float().cpu(),
            }  # fmt: skip
            path = os.path.join(DUMP_DIR, f"layer{layer.layer_id}_slot{slot}_tp{tp_rank}.pt")
            torch.save(record, path + ".tmp")
            os.replace(path + ".tmp", path)

    def patch_triton(module):
        """The Triton backend's forwards under DCP (their DCP branches store, then attend)."""
        cls = module.TritonAttnBackend

        def wrap(orig):
            def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
                out = orig(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
                if self.dcp_size > 1 and not forward_batch.forward_mode.is_idle():
                    dump(layer, forward_batch, self)
                return out

            return forward

        cls.forward_decode = wrap(cls.forward_decode)
        cls.forward_extend = wrap(cls.forward_extend)

    def patch_torch_native(module):
        """torch_native's DCP path (every DCP layout, the GQA mode's too): the same dump after its
        write."""
        cls = module.TorchNativeAttnBackend
        orig = cls._forward_dcp

        def _forward_dcp(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            out = orig(self, q, k, v, layer, forward_batch, save_kv_cache)
            dump(layer, forward_batch, self)
            return out

        cls._forward_dcp = _forward_dcp
        if os.environ.get("HELIX_KV_DUMP_PLAIN") != "1":
            return
        extend = cls.forward_extend

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            out = extend(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            if self.dcp_size == 1:
                dump_plain(layer, forward_batch, self)
            return out

        cls.forward_extend = forward_extend

    PATCHES = {
        "sglang.srt.layers.attention.triton_backend": patch_triton,
        "sglang.srt.layers.attention.torch_native_backend": patch_torch_native,
    }

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in PATCHES or getattr(self, "busy", False):
                return None
            self.busy = True
            try:
                spec = importlib.util.find_spec(name)
            finally:
                self.busy = False
            orig_exec = spec.loader.exec_module

            def exec_module(module):
                orig_exec(module)
                PATCHES[name](module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())
