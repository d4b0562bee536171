"""FP8 checkpoints on the CPU engine without AMX (the series' "[CPU] FP8 linear and MoE without AMX"
patch), tested on upstream's FP8 methods alone.

The patch keeps the weight in FP8 and, where the AMX kernels do not run, multiplies by the weight
dequantized exactly as each format defines it, with activations left unquantized (W8A16, as the
AMX kernels, FP8 Marlin and compressed-tensors' W8A16 scheme compute):

- unit: ``Fp8LinearMethod`` (SGLang ``fp8``: per-tensor scales of a fused module's shards,
  128x128 blocks; online ``--quantization fp8``), compressed-tensors' ``CompressedTensorsW8A8Fp8``
  (per channel, per tensor, block) and ``cpu_fp8_moe_forward`` (the FP8 experts' path) against a
  float64 evaluation of the format's definition, ``y = x @ (q * scale)^T``; shapes where a
  transposed per-channel scale or a transposed block scale still broadcasts (square weights,
  square block grids), fused shards with scales far apart, ragged edge blocks. The float32 output
  is within 1e-5 of the float64 one relative to its RMS (float32 dequantization and GEMM: ~1e-7);
  a misapplied scale is off by O(1), and quantizing activations per token, as the GPU kernels do,
  is off by ~1e-2 (checked: the tolerance does tell W8A16 from W8A8);
- end to end: the real server (``--device cpu``, ``--dtype bfloat16``: FP8 and compressed-tensors
  serve bf16/fp16 activations only) on an FP8 checkpoint against the same checkpoint dequantized
  (``q.float() * scale``, the reference server casting it to bf16 exactly as the fallback does)
  and served unquantized, at the same ``--tp``. The two servers multiply by the same bf16 numbers
  in the same GEMMs, so the FP8 error (e4m3, 3 mantissa bits: up to 2^-4 relative per weight) is
  in both, and W8A16 adds none of its own: the tokens and logprobs must be equal (measured: equal
  to the last bit). For ``--quantization fp8`` the reference is what each rank's quantization
  makes of its shard (``fp8_checkpoints.write_online_fp8_reference``).

The default tier serves one format (compressed-tensors per channel, a tiny Qwen3 at ``--tp 2``: two
server starts); ``HELIX_TEST_FULL=1`` adds SGLang ``fp8`` per tensor and block-wise, Llama,
Qwen3-MoE and Mixtral experts, ``--quantization fp8`` at ``--tp 1`` and ``--tp 2``, and the trained
SmolLM2-135M quantized per channel at ``--tp 3``.

Not served, upstream (0.5.23) limits outside the FP8 methods: a Llama block-wise ``fp8`` checkpoint
loads no block scale (``llama.py`` renames ``.weight_scale_inv`` to ``.weight_scale``, which the
block method does not register: "Parameter ...weight_scale not found in params_dict", the scales
stay at float32 min and every logprob is NaN); ``--dtype float32`` is refused by both FP8 configs.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import FULL, fp8_workload, run_workload
from sglang_helix.testing import fp8_checkpoints
from sglang_helix.testing.cpu_env import STUB_DIR
from sglang_helix.testing.openai_probe import assert_same_probe

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)

from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy  # noqa: E402

from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.quantization import fp8 as fp8_module  # noqa: E402
from sglang.srt.layers.quantization import fp8_utils  # noqa: E402
from sglang.srt.layers.quantization.compressed_tensors import compressed_tensors as ct_module  # noqa: E402
from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_w8a8_fp8 as ct_fp8  # noqa: E402
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod  # noqa: E402

FP8_MAX = 448.0
FLOAT32_MIN = torch.finfo(torch.float32).min  # what a scale nothing was loaded into holds


@pytest.fixture
def cpu_without_amx(monkeypatch):
    """The modules' platform flags as the CPU engine on this machine sets them
    (``SGLANG_USE_CPU_ENGINE=1``, no AMX), whatever imported them first."""
    monkeypatch.setattr(fp8_module, "_is_cpu", True)
    monkeypatch.setattr(fp8_module, "_is_cpu_amx_available", False)
    monkeypatch.setattr(ct_fp8, "_is_cpu", True)
    monkeypatch.setattr(ct_module, "_is_cpu", True)


# -- the formats' definitions, in float64 --------------------------------------------------------
def _fp8(shape, gen):
    """Random FP8 values over the whole e4m3 range."""
    return (torch.randn(shape, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _spread(n, gen):
    """n positive scales spread over 2^-12 .. 2^-4: a scale applied to the wrong row, column or
    block changes the result by O(1)."""
    return (2.0 ** -torch.randint(4, 13, (n,), generator=gen).double()) * (1 + torch.rand(n, generator=gen, dtype=torch.float64))


def _ref_linear(x, w64, bias=None):
    y = x.double() @ w64.t()
    return y if bias is None else y + bias.double()


def _assert_close(got, ref, what, rel=1e-5):
    """float32 against float64: within ``rel`` of the reference's RMS."""
    scale = ref.pow(2).mean().sqrt().item()
    err = (got.double() - ref).abs().max().item()
    assert err <= rel * scale, f"{what}: max |err| {err:.3e} > {rel:g} x rms {scale:.3e}"
    return err / scale


def _bare_layer():
    layer = torch.nn.Module()
    layer.tp_group = None  # validate_block_quant_shapes reads it
    layer.deepgemm_mxfp8_input = False
    return layer


# -- unit: SGLang fp8 ----------------------------------------------------------------------------
def test_fp8_per_tensor_fused_shards_keep_their_own_scales(cpu_without_amx):
    """A fused qkv_proj of SGLang's fp8 format: one scale per shard (q, k, v), far apart. Each
    shard is its own q * scale; upstream's requantization to the max scale would re-round the
    smaller shards (and on this CPU it has no kernel at all)."""
    gen = torch.Generator().manual_seed(0)
    widths, k = [256, 128, 128], 384
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic"))
    layer = _bare_layer()
    method.create_weights(layer, k, widths, k, sum(widths), torch.float32, weight_loader=None)
    q = _fp8((sum(widths), k), gen)
    scales = torch.tensor([2.0**-10, 2.0**-4, 3 * 2.0**-7])
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scales)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (sum(widths), k)  # kept in FP8

    x = torch.randn(5, k, generator=gen)
    bias = torch.randn(sum(widths), generator=gen)
    w64 = torch.cat([q[a:b].double() * s for (a, b), s in zip([(0, 256), (256, 384), (384, 512)], scales.double())])
    _assert_close(method.apply(layer, x, bias), _ref_linear(x, w64, bias), "per-tensor fused")
    # bfloat16 activations (what an FP8 server runs): the weight is dequantized into bf16.
    got16 = method.apply(layer, x.bfloat16(), bias.bfloat16())
    assert got16.dtype == torch.bfloat16
    _assert_close(got16, _ref_linear(x.bfloat16(), w64, bias.bfloat16()), "per-tensor fused, bf16", rel=2e-2)


def test_fp8_per_tensor_module_stored_fused_keeps_its_one_scale(cpu_without_amx):
    """A checkpoint that stores qkv_proj already fused loads one scale into the first slot; the
    others keep their float32-min init and must not be used."""
    gen = torch.Generator().manual_seed(1)
    widths, k = [128, 128, 128], 256
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic"))
    layer = _bare_layer()
    method.create_weights(layer, k, widths, k, sum(widths), torch.float32, weight_loader=None)
    q = _fp8((sum(widths), k), gen)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(torch.tensor([2.0**-6, FLOAT32_MIN, FLOAT32_MIN]))
    method.process_weights_after_loading(layer)
    x = torch.randn(3, k, generator=gen)
    _assert_close(method.apply(layer, x), _ref_linear(x, q.double() * 2.0**-6), "stored fused")


def _block_ref(q, s, block=(128, 128)):
    """weight[i, j] = q[i, j] * s[i // bn, j // bk], one block at a time."""
    bn, bk = block
    w = q.double().clone()
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            w[bi * bn : (bi + 1) * bn, bj * bk : (bj + 1) * bk] *= s[bi, bj].double()
    return w


@pytest.mark.parametrize("n,k", [(256, 256), (300, 200), (512, 384)], ids=["square-grid", "ragged", "wide"])
def test_fp8_block_scales_per_128x128_block(cpu_without_amx, n, k):
    """SGLang fp8 with ``weight_block_size [128, 128]``: one scale per block, ragged at the edges
    (300 x 200: a 3 x 2 grid with 44- and 72-wide edge blocks); on a square grid a transposed
    block scale would still broadcast."""
    gen = torch.Generator().manual_seed(2)
    cfg = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    method = Fp8LinearMethod(cfg)
    layer = _bare_layer()
    method.create_weights(layer, k, [n], k, n, torch.float32, weight_loader=None)
    q = _fp8((n, k), gen)
    s = _spread(layer.weight_scale_inv.numel(), gen).float().view(layer.weight_scale_inv.shape)
    assert s.shape == (-(-n // 128), -(-k // 128))
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    method.process_weights_after_loading(layer)
    x = torch.randn(4, k, generator=gen)
    _assert_close(method.apply(layer, x), _ref_linear(x, _block_ref(q, s)), f"block {n}x{k}")


def test_fp8_online_quantization_one_scale_per_tensor(cpu_without_amx):
    """``--quantization fp8`` on a float checkpoint: the rank's (fused) weight quantized to FP8 with
    one scale, ``amax / 448`` (``input_to_float8``: the stored scale is the reciprocal of
    ``448 / amax``), then served as the per-tensor format."""
    gen = torch.Generator().manual_seed(3)
    widths, k = [128, 64, 64], 192
    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=False, activation_scheme="dynamic"))
    layer = _bare_layer()
    method.create_weights(layer, k, widths, k, sum(widths), torch.float32, weight_loader=None)
    w = torch.randn(sum(widths), k, generator=gen) * 0.05
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.numel() == 1

    amax = w.abs().max()
    inv = FP8_MAX / amax
    q = (w * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    x = torch.randn(3, k, generator=gen)
    w64 = q.double() * inv.reciprocal().double()
    _assert_close(method.apply(layer, x), _ref_linear(x, w64), "online")
    # and it is the float weight up to e4m3's rounding: half an ulp, 2^-4 relative, at most
    assert ((w64 - w.double()).abs() <= 2.0**-4 * w.double().abs() + 2.0**-9 * amax.double() / FP8_MAX).all()


# -- unit: compressed-tensors --------------------------------------------------------------------
def _ct_layer(strategy, widths, k, gen, block=None):
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False,
                            block_structure=block)  # fmt: skip
    scheme = ct_fp8.CompressedTensorsW8A8Fp8(weight_quant=args, is_static_input_scheme=False)
    layer = _bare_layer()
    scheme.create_weights(layer, output_partition_sizes=widths, input_size_per_partition=k, params_dtype=torch.bfloat16,
                          weight_loader=None, input_size=k, output_size=sum(widths))  # fmt: skip
    q = _fp8((sum(widths), k), gen)
    layer.weight.data.copy_(q)
    return scheme, layer, q


def test_ct_per_channel_scale_per_output_row(cpu_without_amx):
    """compressed-tensors FP8_DYNAMIC: ``weight_scale`` [N, 1], row i scaled by scale[i]. Square
    (N = K = 256), so a scale applied per input column would broadcast too."""
    gen = torch.Generator().manual_seed(4)
    scheme, layer, q = _ct_layer(QuantizationStrategy.CHANNEL, [256], 256, gen)
    s = _spread(256, gen)
    layer.weight_scale.data.copy_(s.float().view(256, 1))
    scheme.process_weights_after_loading(layer)
    assert layer.weight.shape == (256, 256) and layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(6, 256, generator=gen)
    bias = torch.randn(256, generator=gen)
    _assert_close(scheme.apply_weights(layer, x, bias), _ref_linear(x, q.double() * s.view(256, 1), bias), "ct channel")


def test_ct_per_channel_fused_rows(cpu_without_amx):
    """A fused gate_up_proj in compressed-tensors per channel: the shards' scale rows in order."""
    gen = torch.Generator().manual_seed(5)
    scheme, layer, q = _ct_layer(QuantizationStrategy.CHANNEL, [128, 128], 192, gen)
    s = _spread(256, gen)
    layer.weight_scale.data.copy_(s.float().view(256, 1))
    scheme.process_weights_after_loading(layer)
    x = torch.randn(2, 192, generator=gen)
    _assert_close(scheme.apply_weights(layer, x), _ref_linear(x, q.double() * s.view(256, 1)), "ct channel fused")


def test_ct_per_tensor_and_block(cpu_without_amx):
    """compressed-tensors per tensor (one scale per fused shard, exact) and block [128, 128]."""
    gen = torch.Generator().manual_seed(6)
    scheme, layer, q = _ct_layer(QuantizationStrategy.TENSOR, [128, 256], 128, gen)
    s = torch.tensor([2.0**-3, 2.0**-11])
    layer.weight_scale.data.copy_(s)
    scheme.process_weights_after_loading(layer)
    x = torch.randn(3, 128, generator=gen)
    w64 = torch.cat([q[:128].double() * s[0].double(), q[128:].double() * s[1].double()])
    _assert_close(scheme.apply_weights(layer, x), _ref_linear(x, w64), "ct tensor")

    scheme, layer, q = _ct_layer(QuantizationStrategy.BLOCK, [256], 256, gen, block=[128, 128])
    s = _spread(4, gen).float().view(2, 2)
    layer.weight_scale.data.copy_(s)
    scheme.process_weights_after_loading(layer)
    x = torch.randn(3, 256, generator=gen)
    _assert_close(scheme.apply_weights(layer, x), _ref_linear(x, _block_ref(q, s)), "ct block")


def test_ct_scheme_on_the_cpu(cpu_without_amx):
    """On the CPU, compressed-tensors picks its W8A8-FP8 scheme without asking torch.cuda for a
    capability (0.5.23: "Found no NVIDIA driver"), and refuses a scheme with no CPU path in one
    line."""
    from sglang_helix.testing.fp8_checkpoints import quantization_config

    def scheme_of(qc):
        config = ct_module.CompressedTensorsConfig.from_config(qc)
        return config.get_linear_scheme(torch.nn.Linear(8, 8), "model.layers.0.mlp.down_proj")

    assert isinstance(scheme_of(quantization_config("ct-channel")), ct_fp8.CompressedTensorsW8A8Fp8)
    int4 = quantization_config("ct-channel")
    int4["format"] = "pack-quantized"
    int4["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int", strategy="group", group_size=128)
    int4["config_groups"]["group_0"]["input_activations"] = None
    with pytest.raises(RuntimeError, match="CompressedTensorsWNA16 is not supported on CPU"):
        scheme_of(int4)


# -- unit: the experts ---------------------------------------------------------------------------
def _moe_ref(x, topk_w, topk_ids, w13, w2):
    """sum over the routed experts of weight * W2 (silu(W1 x) * W3 x), in float64."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e] @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += topk_w[t, j].double() * (w2[e] @ act)
    return out


@pytest.mark.parametrize("fmt", ["per-tensor", "per-channel", "block"])
def test_fp8_experts(cpu_without_amx, fmt):
    """``cpu_fp8_moe_forward``: each routed expert's w13 and w2 dequantized by its own scales
    (SGLang fp8 per tensor: one per w13 shard, gate's and up's; compressed-tensors per channel;
    128x128 blocks), through moe_forward_native."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(7)
    experts, hidden, inter, tokens = 4, 256, 128, 6
    w13_q, w2_q = _fp8((experts, 2 * inter, hidden), gen), _fp8((experts, hidden, inter), gen)
    if fmt == "per-tensor":
        s13, s2 = _spread(experts * 2, gen).view(experts, 2), _spread(experts, gen)
        w13 = w13_q.double() * s13.repeat_interleave(inter, dim=1)[:, :, None]
        w2 = w2_q.double() * s2[:, None, None]
        block = None
    elif fmt == "per-channel":
        s13, s2 = _spread(experts * 2 * inter, gen).view(experts, -1, 1), _spread(experts * hidden, gen).view(experts, -1, 1)
        w13, w2, block = w13_q.double() * s13, w2_q.double() * s2, None
    else:
        s13, s2 = _spread(experts * 4, gen).view(experts, 2, 2), _spread(experts * 2, gen).view(experts, 2, 1)
        w13 = torch.stack([_block_ref(w13_q[e], s13[e]) for e in range(experts)])
        w2 = torch.stack([_block_ref(w2_q[e], s2[e]) for e in range(experts)])
        block = [128, 128]
    layer = SimpleNamespace(num_experts=experts, intermediate_size_per_partition=inter, w13_weight=w13_q, w2_weight=w2_q)
    x = torch.randn(tokens, hidden, generator=gen)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    topk_w = torch.rand(tokens, 2, generator=gen)
    dispatch = SimpleNamespace(hidden_states=x, topk_output=(topk_w, topk_ids, None))
    got = fp8_utils.cpu_fp8_moe_forward(layer, dispatch, MoeRunnerConfig(activation="silu"), s13.float(), s2.float(), block)
    _assert_close(got, _moe_ref(x, topk_w, topk_ids, w13, w2), f"experts {fmt}")


def test_w8a16_is_not_w8a8(cpu_without_amx):
    """The tolerance tells the two definitions apart: quantizing the activations per token to FP8
    (what the checkpoint's ``input_activations`` and the GPU kernels do) moves the result by
    ~2^-6 of its RMS, 1,000x the bound the fallback meets."""
    gen = torch.Generator().manual_seed(8)
    scheme, layer, q = _ct_layer(QuantizationStrategy.CHANNEL, [256], 512, gen)
    s = _spread(256, gen)
    layer.weight_scale.data.copy_(s.float().view(256, 1))
    scheme.process_weights_after_loading(layer)
    x = torch.randn(8, 512, generator=gen)
    w64 = q.double() * s.view(256, 1)
    xs = x.double().abs().amax(dim=1, keepdim=True) / FP8_MAX
    x_q = (x.double() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double() * xs
    ref, ref_w8a8 = _ref_linear(x, w64), x_q @ w64.t()
    _assert_close(scheme.apply_weights(layer, x), ref, "W8A16")
    gap = (ref_w8a8 - ref).abs().max() / ref.pow(2).mean().sqrt()
    assert gap > 1e-3, gap


# -- end to end ----------------------------------------------------------------------------------
# The FP8 server and its reference multiply by the same bf16 numbers in the same GEMMs: equal to
# the last bit (measured), so the bound is float noise, and every step is compared (margin 0).
SAME_WEIGHTS_ATOL = 1e-6

# id: (architecture, format, --tp); the first is the default tier's.
SERVE_CASES = [
    ("qwen3", "ct-channel", 2),
    ("llama", "ct-channel", 2),
    ("llama", "fp8-tensor", 2),
    ("qwen3", "fp8-tensor", 2),
    ("qwen3", "fp8-block", 2),  # (Llama's block-wise checkpoints load no scale in 0.5.23: module doc)
    ("qwen3_moe", "fp8-block", 2),
    ("qwen3_moe", "ct-channel", 2),
    ("mixtral", "fp8-tensor", 2),
]
ONLINE_CASES = [("llama", 1), ("llama", 2), ("mixtral", 2)]


def _params(cases):
    return [pytest.param(c, id="-".join(f"tp{x}" if isinstance(x, int) else x for x in c), marks=() if i == 0 else FULL)
            for i, c in enumerate(cases)]  # fmt: skip


# One request a forward on both servers: which prompts share a prefill batch depends on timing
# (a slower server admits more at once), and a bf16 GEMM's rounding on the number of rows, so
# equal weights give equal bits only in equal batches (SmolLM2: 0.13 nats apart otherwise).
ONE_AT_A_TIME = ["--max-running-requests", "1"]


def _serve_and_compare(fp8_path, fp8_args, ref_path, ref_args, log_dir, what):
    ref_args, fp8_args = [*ref_args, *ONE_AT_A_TIME], [*fp8_args, *ONE_AT_A_TIME]
    ref = run_workload(ref_path, ref_args, "torch_native", log_dir, fp8_workload)["probe"]
    got = run_workload(fp8_path, fp8_args, "torch_native", log_dir, fp8_workload)["probe"]
    assert_same_probe(ref, got, atol=SAME_WEIGHTS_ATOL, what=what, margin=0.0)
    # (the tiny models are decisive: a misapplied scale changes tokens, not just logprobs)
    assert len({tuple(c.tokens) for c in got.completions}) == len(got.completions)


@pytest.mark.e2e
@pytest.mark.parametrize("case", _params(SERVE_CASES))
def test_fp8_checkpoint_serves_its_dequantized_weights(case, fp8_root, server_log_dir):
    """Plain ``--tp N`` serves the FP8 checkpoint with the tokens and logprobs of the same
    checkpoint dequantized and served unquantized."""
    arch, fmt, tp = case
    fp8_path, ref_path = fp8_checkpoints.write_tiny_fp8(fp8_root, fmt, arch=arch)
    args = ["--tp", str(tp), "--dtype", "bfloat16"]
    _serve_and_compare(fp8_path, args, ref_path, args, server_log_dir, f"{arch} {fmt} --tp {tp}")


@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c[0]}-tp{c[1]}", marks=FULL) for c in ONLINE_CASES])
def test_online_fp8_serves(case, fp8_root, server_log_dir):
    """``--quantization fp8`` on a float32 checkpoint (served in bf16: Fp8Config refuses float32)
    at ``--tp 1`` and ``--tp 2``: what each rank's one-scale quantization of its shard makes of the
    weights, served unquantized, gives the same tokens and logprobs."""
    import os

    from sglang_helix.testing.tiny_models import write_tiny_model

    arch, tp = case
    src = write_tiny_model(os.path.join(fp8_root, f"{arch}_online_tied"), fp8_checkpoints.tiny_fp8_spec(arch))
    src = fp8_checkpoints.untie_embeddings(src, os.path.join(fp8_root, f"{arch}_online_src"))
    ref = fp8_checkpoints.write_online_fp8_reference(src, os.path.join(fp8_root, f"{arch}_online_ref_tp{tp}"), tp)
    args = ["--tp", str(tp), "--dtype", "bfloat16"]
    _serve_and_compare(src, [*args, "--quantization", "fp8"], ref, args, server_log_dir, f"{arch} online fp8 --tp {tp}")


@pytest.mark.e2e
@FULL
def test_smollm2_fp8_per_channel_serves(fp8_root, server_log_dir):
    """The trained SmolLM2-135M-Instruct quantized per channel in compressed-tensors form, at
    ``--tp 3`` (9 query / 3 KV heads), against its dequantized weights."""
    fp8_path, ref_path = fp8_checkpoints.write_smollm2_fp8(fp8_root)
    args = ["--tp", "3", "--dtype", "bfloat16"]
    _serve_and_compare(fp8_path, args, ref_path, args, server_log_dir, "SmolLM2 ct-channel --tp 3")
