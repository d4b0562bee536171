"""FP8 checkpoints written at test time (never downloaded), and their dequantized references.

Each writer takes an unquantized checkpoint directory (a tiny random model from ``tiny_models``,
or the trained SmolLM2 from ``smollm2``) and writes, next to its tokenizer files, the same model
in one of the FP8 formats SGLang loads, exactly as the format specifies:

- ``"fp8-tensor"``: SGLang's ``fp8`` format (AutoFP8 / ``quant_method: fp8``), one float32 scale
  per weight tensor, ``weight_scale`` (0-dim), ``activation_scheme: dynamic``. A fused module
  (``qkv_proj``, ``gate_up_proj``) therefore has one scale per shard.
  ``weight = q * weight_scale``, ``weight_scale = amax(|W|) / 448``.
- ``"fp8-block"``: SGLang's ``fp8`` format with ``weight_block_size: [128, 128]`` (DeepSeek-V3,
  Qwen3-*-FP8): ``weight_scale_inv`` of shape ``[ceil(N/128), ceil(K/128)]``, one scale per
  128x128 tile (ragged tiles at the edges); ``weight[i, j] = q[i, j] * weight_scale_inv[i // 128,
  j // 128]``, each tile's scale ``amax(|tile|) / 448``.
- ``"ct-channel"``: compressed-tensors ``float-quantized`` with llm-compressor's ``FP8_DYNAMIC``
  preset (weights: float 8-bit, symmetric, static, strategy ``channel``; input activations:
  float 8-bit, symmetric, dynamic, strategy ``token``), config and quantization both from the
  ``compressed-tensors`` package itself: ``weight_scale`` of shape ``[N, 1]``,
  ``weight[i, :] = q[i, :] * weight_scale[i]``.

The decoder's linear layers are quantized (``q/k/v/o_proj``, ``gate/up/down_proj``, and a MoE
model's experts: Qwen3-MoE's ``gate/up/down_proj``, Mixtral's ``w1/w2/w3``); embeddings, norms, ``lm_head`` and a MoE router
(``mlp.gate``) keep the source's float tensors, as real FP8 checkpoints of these families do.

``write_dequantized(fp8_dir, out)`` writes the FP8 checkpoint's weights dequantized by the
definitions above (``q.float() * scale``, then ``dtype``) as an unquantized checkpoint: the
reference an FP8 server is compared with. ``write_int4_config_checkpoint`` writes a checkpoint whose
``config.json`` claims int4 AWQ or GPTQ (the tensors stay float): for refusal tests, which must
stop at the config, before any tensor is read.

    python -m sglang_helix.testing.fp8_checkpoints SRC OUT --format fp8-block [--dequantized REF]
"""

from __future__ import annotations

import json
import os
import shutil

FORMATS = ("fp8-tensor", "fp8-block", "ct-channel")
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
# The decoder linears the writers quantize, by the last component of the module name.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_STAMP = "fp8_checkpoint.json"
_TENSORS = "model.safetensors"


MIXTRAL_EXPERT_NAMES = ("w1", "w2", "w3")  # block_sparse_moe.experts.N.w{1,2,3}


def is_quantized_linear(name: str) -> bool:
    """``name`` is a ``*.weight`` of a decoder linear layer or expert (a MoE router, ``mlp.gate``
    or ``block_sparse_moe.gate``, is not)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] != "weight":
        return False
    return parts[-2] in LINEAR_NAMES or (parts[-2] in MIXTRAL_EXPERT_NAMES and parts[-4] == "experts")


# -- the formats' definitions --------------------------------------------------------------------
def quantize_per_tensor(w):
    """SGLang ``fp8`` per-tensor: ``(q, scale)`` with ``scale`` 0-dim float32."""
    import torch

    w = w.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(())


def quantize_block(w, block=BLOCK):
    """SGLang ``fp8`` block-wise: ``(q, weight_scale_inv)``, ``[ceil(N/bn), ceil(K/bk)]`` scales."""
    import torch
    import torch.nn.functional as F

    bn, bk = block
    w = w.float()
    n, k = w.shape
    tn, tk = -(-n // bn), -(-k // bk)
    padded = F.pad(w, (0, tk * bk - k, 0, tn * bn - n))  # zeros: they never raise an amax
    tiles = padded.reshape(tn, bn, tk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [tn, tk]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(tn * bn, tk * bk)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def ct_fp8_dynamic_args():
    """compressed-tensors' ``FP8_DYNAMIC`` preset: ``(weights, input_activations)`` QuantizationArgs."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    return scheme.weights, scheme.input_activations


def quantize_ct_channel(w):
    """compressed-tensors channel-wise FP8, by the package's own ``calculate_qparams`` and
    ``quantize``: ``(q, weight_scale)`` with ``weight_scale`` ``[N, 1]`` float32."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args, _ = ct_fp8_dynamic_args()
    w = w.float()
    scale, zero_point = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
    q = quantize(w, scale, zero_point, args, dtype=torch.float8_e4m3fn)
    return q.contiguous(), scale.float().contiguous()


def dequantize(q, scale, fmt: str):
    """The float32 weight an FP8 tensor stands for, by ``fmt``'s definition."""
    import torch

    q = q.float()
    if fmt == "fp8-tensor":
        return q * scale.float().reshape(())
    if fmt == "ct-channel":
        assert scale.shape == (q.shape[0], 1), (scale.shape, q.shape)
        return q * scale.float()
    if fmt == "fp8-block":
        bn, bk = BLOCK
        n, k = q.shape
        assert scale.shape == (-(-n // bn), -(-k // bk)), (scale.shape, q.shape)
        full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        return q * full
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


def quantization_config(fmt: str) -> dict:
    """The ``quantization_config`` entry of ``config.json`` for ``fmt``."""
    if fmt == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(BLOCK), "ignored_layers": ["lm_head"]}  # fmt: skip
    if fmt == "ct-channel":
        from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

        weights, inputs = ct_fp8_dynamic_args()
        config = QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)},
            quant_method="compressed-tensors", format="float-quantized", quantization_status="compressed",
            ignore=["lm_head"],
        )  # fmt: skip
        return config.to_dict()
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


_SCALE_NAME = {"fp8-tensor": "weight_scale", "fp8-block": "weight_scale_inv", "ct-channel": "weight_scale"}
_QUANTIZE = {"fp8-tensor": quantize_per_tensor, "fp8-block": quantize_block, "ct-channel": quantize_ct_channel}


# -- writers -------------------------------------------------------------------------------------
def _load_state(src: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    assert files, f"no safetensors in {src}"
    state = {}
    for f in files:
        state.update(load_file(os.path.join(src, f)))
    return state


def _copy_side_files(src: str, out: str) -> dict:
    """Copy tokenizer (and other non-weight) files; return the source's config.json."""
    for f in os.listdir(src):
        path = os.path.join(src, f)
        if not os.path.isfile(path) or f.endswith(".safetensors") or f.endswith(".lock"):
            continue
        if f in ("config.json", "model.safetensors.index.json", "tiny_model_spec.json", _STAMP, ".converted"):
            continue
        shutil.copy2(path, os.path.join(out, f))
    with open(os.path.join(src, "config.json")) as f:
        return json.load(f)


def _fresh(out: str, want: dict) -> bool:
    stamp = os.path.join(out, _STAMP)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return False
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    return True


def _finish(out: str, config: dict, state: dict, want: dict) -> str:
    from safetensors.torch import save_file

    save_file(state, os.path.join(out, _TENSORS), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, _STAMP), "w") as f:  # last: an interrupted write is redone
        json.dump(want, f)
    return out


def write_fp8_checkpoint(src: str, out: str, fmt: str) -> str:
    """Write ``src`` quantized in ``fmt`` (one of ``FORMATS``) to ``out`` (idempotent)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    want = {"src": os.path.abspath(src), "format": fmt}
    if not _fresh(out, want):
        return out
    config = _copy_side_files(src, out)
    state = {}
    for name, t in _load_state(src).items():
        if is_quantized_linear(name):
            q, scale = _QUANTIZE[fmt](t)
            state[name] = q
            state[name.removesuffix("weight") + _SCALE_NAME[fmt]] = scale
        else:
            state[name] = t.contiguous()
    config["quantization_config"] = quantization_config(fmt)
    # compressed-tensors and fp8 serve bfloat16/float16 activations only (their
    # get_supported_act_dtypes): the checkpoint's own dtype is what --dtype auto picks.
    config["torch_dtype"] = "bfloat16"
    return _finish(out, config, state, want)


def checkpoint_format(path: str) -> str:
    """Which of ``FORMATS`` the checkpoint at ``path`` is (from its config.json)."""
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        return "fp8-block" if qc.get("weight_block_size") else "fp8-tensor"
    if qc.get("quant_method") == "compressed-tensors":
        weights = qc["config_groups"]["group_0"]["weights"]
        assert weights["strategy"] == "channel" and weights["type"] == "float", weights
        return "ct-channel"
    raise ValueError(f"{path}: not an FP8 checkpoint of {FORMATS}: {qc}")


def write_dequantized(fp8_dir: str, out: str, dtype: str = "float32") -> str:
    """The FP8 checkpoint's weights dequantized (``q.float() * scale``, cast to ``dtype``), as an
    unquantized checkpoint with the same config and tokenizer (idempotent)."""
    import torch

    fmt = checkpoint_format(fp8_dir)
    want = {"dequantized": os.path.abspath(fp8_dir), "format": fmt, "dtype": dtype}
    if not _fresh(out, want):
        return out
    config = _copy_side_files(fp8_dir, out)
    config.pop("quantization_config")
    config["torch_dtype"] = dtype
    src = _load_state(fp8_dir)
    scale_name = _SCALE_NAME[fmt]
    state = {}
    for name, t in src.items():
        if name.endswith("." + scale_name):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize(t, src[name.removesuffix("weight") + scale_name], fmt)
        state[name] = t.to(getattr(torch, dtype)).contiguous()
    return _finish(out, config, state, want)


def _online_fp8(w):
    """What ``--quantization fp8`` makes of one rank's (fused) weight on a CPU: one FP8 scale for
    the tensor, by ``input_to_float8``'s arithmetic (``scale = 448 / amax`` in float32, the stored
    scale its reciprocal), dequantized back in float32."""
    import torch

    amax = w.abs().amax().float().clamp(min=1e-12)
    scale = FP8_MAX / amax
    q = (w.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale.reciprocal()


def write_online_fp8_reference(src: str, out: str, tp: int, dtype: str = "bfloat16", qkv_tp: int | None = None) -> str:
    """The weights a ``--quantization fp8 --tp {tp} --dtype {dtype}`` server on a CPU without AMX
    multiplies with, as an unquantized checkpoint: every linear is cast to ``dtype`` (the
    loader's cast), cut into the ``tp`` shards the server's ranks hold (fused ``qkv_proj`` and
    ``gate_up_proj`` shards and each expert's ``w13`` as one tensor; ``o_proj``, ``down_proj`` and
    ``w2`` by input columns), each shard quantized with one scale (``_online_fp8``) and put back.
    Llama/Qwen families and Qwen3-MoE/Mixtral experts. ``tp`` must divide the KV heads: where
    ranks replicate a KV head, each quantizes its copy with its own shard's scale, and no single
    checkpoint holds those differing copies. ``qkv_tp``: the width ``qkv_proj`` is sharded over
    when it is not ``tp`` (Helix: TPA = tp / KVP, each TPA shard quantized whole)."""
    import torch

    qkv_tp = qkv_tp or tp
    want = {"online_fp8_of": os.path.abspath(src), "tp": tp, "dtype": dtype, "qkv_tp": qkv_tp}
    if not _fresh(out, want):
        return out
    config = _copy_side_files(src, out)
    state = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in _load_state(src).items()}
    q_heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // q_heads
    if q_heads % qkv_tp or kv_heads % qkv_tp:
        raise ValueError(f"{qkv_tp} qkv shards must divide the {q_heads} query and {kv_heads} KV heads")

    def rows(n, r, parts=tp):  # rank r's rows of an output dimension n split evenly
        return slice(r * n // parts, (r + 1) * n // parts)

    def fused(names, shards_of, parts=tp):  # one quantized tensor per rank over the fused shards
        for r in range(parts):
            parts = [state[n][shards_of(n, r)] for n in names]
            deq = _online_fp8(torch.cat(parts)).split([p.shape[0] for p in parts])
            for n, d in zip(names, deq):
                state[n][shards_of(n, r)] = d.to(state[n].dtype)

    def by_columns(name):
        w = state[name]
        for r in range(tp):
            cols = rows(w.shape[1], r)
            w[:, cols] = _online_fp8(w[:, cols]).to(w.dtype)

    layers = sorted({k.split(".layers.")[1].split(".")[0] for k in state if ".layers." in k}, key=int)
    for i in layers:
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj")]
        fused(attn, lambda n, r: rows(state[n].shape[0], r, qkv_tp), qkv_tp)
        by_columns(p + "self_attn.o_proj.weight")
        experts = sorted({k.split(".experts.")[1].split(".")[0] for k in state if k.startswith(p) and ".experts." in k}, key=int)
        if not experts:
            mlp = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            fused(mlp, lambda n, r: rows(state[n].shape[0], r))
            by_columns(p + "mlp.down_proj.weight")
        for e in experts:  # the fused w13 of one expert is quantized whole (one scale per expert)
            base = p + (f"mlp.experts.{e}." if p + "mlp.experts.0.gate_proj.weight" in state else f"block_sparse_moe.experts.{e}.")
            gate_up, down = (("gate_proj", "up_proj"), "down_proj") if "mlp." in base else (("w1", "w3"), "w2")
            fused([base + g + ".weight" for g in gate_up], lambda n, r: rows(state[n].shape[0], r))
            by_columns(base + down + ".weight")
    config["torch_dtype"] = dtype
    return _finish(out, config, state, want)


def write_int4_config_checkpoint(src: str, out: str, method: str = "awq") -> str:
    """``src`` with a ``config.json`` that declares int4 ``awq`` (GEMM, group 128, zero point)
    or ``gptq`` (4 bits, group 128, desc_act off, symmetric) quantization; the tensors stay the
    float ones (no qweight/qzeros): a server must refuse at its config, before reading them."""
    configs = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                 "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq"},
    }  # fmt: skip
    if method not in configs:
        raise ValueError(f"unknown int4 method {method!r}; one of {sorted(configs)}")
    want = {"src": os.path.abspath(src), "int4_config": method}
    if not _fresh(out, want):
        return out
    config = _copy_side_files(src, out)
    config["quantization_config"] = configs[method]
    config["torch_dtype"] = "float16"
    for f in os.listdir(src):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            shutil.copy2(os.path.join(src, f), os.path.join(out, f))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, _STAMP), "w") as f:
        json.dump(want, f)
    return out


# -- the models the tests serve ------------------------------------------------------------------
def tiny_fp8_spec(arch: str = "llama", **overrides):
    """A tiny random model whose every projection is a multiple of 128 wide at ``--tp 1`` and
    ``--tp 2``: 4 query / 2 KV heads of dim 128 (hidden 512), an MLP of 256 (MoE: 256 per expert),
    so 128x128 blocks align with every TP shard."""
    from sglang_helix.testing.tiny_models import TinyModelSpec

    fields = dict(arch=arch, num_heads=4, num_kv_heads=2, head_dim=128, num_layers=2, intermediate_size=256,
                  vocab_size=512)  # fmt: skip
    fields.update(overrides)
    return TinyModelSpec(**fields)


def untie_embeddings(src: str, out: str, seed: int = 7) -> str:
    """``src`` (tied embeddings) with an ``lm_head`` of its own: the tied matrix becomes
    ``lm_head.weight`` and ``embed_tokens`` is redrawn at std 1 (as ``tiny_models`` writes untied
    families). With tied random embeddings at hidden 512 the residual stream is dominated by the
    token's own embedding and a tiny Qwen3 repeats its last prompt token with logprob 0: nothing
    to compare. (Qwen3 ties only at <= 4B; the larger checkpoints FP8 serves are untied.)"""
    import torch

    want = {"untied": os.path.abspath(src), "seed": seed}
    if not _fresh(out, want):
        return out
    config = _copy_side_files(src, out)
    state = _load_state(src)
    if config.get("tie_word_embeddings"):
        emb = state["model.embed_tokens.weight"]
        state["lm_head.weight"] = emb.clone()
        state["model.embed_tokens.weight"] = torch.randn(emb.shape, generator=torch.Generator().manual_seed(seed))
        config["tie_word_embeddings"] = False
    return _finish(out, config, state, want)


def write_tiny_fp8(root: str, fmt: str, arch: str = "llama", **overrides) -> tuple[str, str]:
    """``(fp8 checkpoint, its dequantized reference)`` of ``tiny_fp8_spec(arch)`` under ``root``:
    the float32 source (untied: ``untie_embeddings``), the FP8 checkpoint, and the reference in
    float32."""
    from sglang_helix.testing.tiny_models import write_tiny_model

    spec = tiny_fp8_spec(arch, **overrides)
    tag = f"{arch}_" + "_".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    src = write_tiny_model(os.path.join(root, f"{tag}_tied"), spec)
    src = untie_embeddings(src, os.path.join(root, f"{tag}_src"))
    fp8 = write_fp8_checkpoint(src, os.path.join(root, f"{tag}_{fmt}"), fmt)
    ref = write_dequantized(fp8, os.path.join(root, f"{tag}_{fmt}_dequantized"))
    return fp8, ref


def write_smollm2_fp8(root: str, fmt: str = "ct-channel", ref_dtype: str = "bfloat16") -> tuple[str, str]:
    """``(fp8 checkpoint, its dequantized reference)`` of the trained SmolLM2-135M-Instruct
    (``smollm2.smollm2_checkpoint()``), quantized per channel in compressed-tensors form by default.
    The reference is written in ``ref_dtype`` (the servers' dtype: the same bytes the server's cast
    of a float32 reference gives, at half the size)."""
    from sglang_helix.testing.smollm2 import smollm2_checkpoint

    src = smollm2_checkpoint()
    fp8 = write_fp8_checkpoint(src, os.path.join(root, f"smollm2_{fmt}"), fmt)
    ref = write_dequantized(fp8, os.path.join(root, f"smollm2_{fmt}_dequantized_{ref_dtype}"), ref_dtype)
    return fp8, ref


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write an FP8 checkpoint of an unquantized one.")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--format", choices=FORMATS, default="ct-channel")
    p.add_argument("--dequantized", help="also write the dequantized reference here")
    args = p.parse_args()
    print(write_fp8_checkpoint(args.src, args.out, args.format))
    if args.dequantized:
        print(write_dequantized(args.out, args.dequantized))


if __name__ == "__main__":
    main()
