"""Tiny deterministic Qwen3.5 checkpoints (the hybrid Gated DeltaNet + attention family).

``write_qwen3_5_model(path, spec)`` writes what ``python -m sglang.launch_server --model-path path``
and ``transformers.AutoModelForCausalLM.from_pretrained(path)`` both load, offline:

- ``config.json``: a text-only ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``) or
  ``Qwen3_5MoeForCausalLM`` (``qwen3_5_moe_text``), written by transformers' own classes, with the
  fields Qwen3.5's published ``text_config`` carries: ``layer_types`` three ``linear_attention``
  to one ``full_attention`` and ``full_attention_interval`` 4 (SGLang reads the interval, transformers
  the list), the attention output gate (``attn_output_gate``), partial rotary 0.25 in
  ``rope_parameters`` (the dense spec with the published interleaved M-RoPE sections), float32
  ``mamba_ssm_dtype``;
- ``model.safetensors``: float32 weights from a fixed seed, the checkpoint's own names (``q_proj``
  with each head's query and gate rows, ``linear_attn.in_proj_qkv/z/b/a``, ``conv1d``, ``A_log``,
  ``dt_bias``, zero-centred RMSNorms);
- the tiny harness tokenizer (``tiny_models.write_tokenizer``).

Scaling as in ``tiny_models``: lm_head rows make greedy choices decisive, q/k are sharpened. The
GDN decays are kept long (``exp(g)`` mostly 0.5-0.99 per token) so the recurrent state carries
across chunks of 64 and from prefill into decode: a state lost between the two visibly moves the
logprobs. Head counts fit ``--tp 4``: 16 query heads and 2 KV heads (replicated past 2 ranks), so
every rank holds 4 query heads after DCP's All-to-All at any KVP (a gate slice off by its ``Q/N``
factor or taken from another rank's rows moves the logprobs; with one head a rank it could not), GDN
key/value heads 4/8 (a power-of-two group, SGLang's fused CPU split), GDN head dims 64 (the real
CPU chunk kernel supports 64 and 128).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

from sglang_helix.testing.tiny_models import write_tokenizer

ARCHS = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
# Qwen3.5's published text_config: M-RoPE sections for a 64-dim rotary part (head dim 256 x 0.25).
PUBLISHED_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
}


@dataclass(frozen=True)
class Qwen35Spec:
    arch: str = "qwen3_5"  # a key of ARCHS
    num_layers: int = 8  # layer i is full attention when (i + 1) % 4 == 0
    hidden_size: int = 128
    num_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_head_dim: int = (
        64  # key and value head dims (the real CPU kernel wants them equal)
    )
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    mrope: bool = True  # the published interleaved M-RoPE sections (needs head_dim 256)
    logit_scale: float = 4.0
    attn_scale: float = 2.0
    seed: int = 0
    num_experts: int = 4  # MoE only
    experts_per_token: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64
    # The MTP layer Qwen publishes beside the model (``mtp.*``, ``mtp_num_hidden_layers: 1``),
    # which ``--speculative-algorithm NEXTN`` serves as the draft (``_mtp_tensors``). Off: the
    # checkpoint and its stamp are byte-for-byte what they were before the field existed.
    mtp: bool = False


DENSE = Qwen35Spec()
MOE = Qwen35Spec(
    arch="qwen3_5_moe", num_layers=4, head_dim=64, mrope=False, intermediate_size=64
)
DENSE_MTP = replace(DENSE, mtp=True)
MOE_MTP = replace(MOE, mtp=True)

# The MTP layer's draft (``_mtp_tensors``): it knows the target's greedy continuation of each of
# these prompts (``mtp_prompts``, the workload of ``test/test_qwen3_5_harness.py``) for its first
# ``MTP_KNOWN_STEPS`` tokens, and nothing else.
MTP_PROMPT_LENS = (1, 5, 13, 150)
MTP_PROMPT_SEED = 35
MTP_KNOWN_STEPS = 6
MTP_RESIDUAL_SCALE = 0.1  # the MTP decoder layer's o_proj / down_proj: a small, live contribution
MTP_HIDDEN_SCALE = 0.02  # fc's target-hidden-state half


def _stamp(spec: Qwen35Spec) -> dict:
    """The spec as its stamp records it; without ``mtp`` when off (stamps of old checkpoints)."""
    d = asdict(spec)
    if not spec.mtp:
        del d["mtp"]
    return d


def mtp_prompts(vocab_size: int = 512) -> list[list[int]]:
    """The prompts whose greedy continuations the MTP draft knows: token ids of 1, 5, 13 and 150
    tokens (``test_qwen3_5_harness.prompts()``)."""
    import torch

    g = torch.Generator().manual_seed(MTP_PROMPT_SEED)
    return [torch.randint(7, vocab_size, (n,), generator=g).tolist() for n in MTP_PROMPT_LENS]


def layer_types(spec: Qwen35Spec) -> list[str]:
    return [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
        for i in range(spec.num_layers)
    ]


def _config(spec: Qwen35Spec):
    import transformers

    if spec.mrope:
        assert (
            spec.head_dim == 256
        ), "the published M-RoPE sections fit a 64-dim rotary part"
        rope = dict(PUBLISHED_ROPE)
    else:
        rope = {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        }
    fields = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        layer_types=layer_types(spec),
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if spec.arch == "qwen3_5_moe":
        config = transformers.Qwen3_5MoeTextConfig(
            **fields,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        )
    else:
        config = transformers.Qwen3_5TextConfig(
            **fields, intermediate_size=spec.intermediate_size
        )
    config.architectures = [ARCHS[spec.arch]]
    return config


def _init_weights(model, spec: Qwen35Spec) -> None:
    import torch

    hidden = spec.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(
                "linear_attn.norm.weight"
            ):  # the gated RMSNorm multiplies by w
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(
                "norm.weight"
            ):  # zero-centred RMSNorms multiply by 1 + w
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):  # exp(A_log) in [0.02, 0.3]: long decays
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.3).log())
            elif name.endswith("dt_bias"):
                p.normal_(-1.0, 0.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif "lm_head" in name:
                p.normal_(0.0, spec.logit_scale * 4.0 / hidden**0.5)
            elif "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, spec.attn_scale / hidden**0.5)
            else:  # projections, conv1d ([dim, 1, 4]), router, experts ([E, out, in]), shared gate
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)


def write_qwen3_5_model(path: str, spec: Qwen35Spec = DENSE) -> str:
    """Write the model directory (idempotent for the same spec) and return ``path``."""
    import torch
    import transformers

    assert spec.arch in ARCHS, spec.arch
    stamp = os.path.join(path, "tiny_model_spec.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == _stamp(spec):
                return path
    os.makedirs(path, exist_ok=True)
    write_tokenizer(path, spec.vocab_size)
    config = _config(spec)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, ARCHS[spec.arch])(config).to(torch.float32)
    _init_weights(model, spec)
    model.save_pretrained(path, safe_serialization=True)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    # Fields of the published text_config transformers does not keep: SGLang reads the interval
    # (Qwen3NextConfig.layers_block_type), the output gate and the SSM state dtype.
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(
        full_attention_interval=4,
        attn_output_gate=True,
        mamba_ssm_dtype="float32",
        dtype="float32",
    )
    if spec.mtp:
        _add_mtp_layer(path, model, spec)
        cfg["mtp_num_hidden_layers"] = 1
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    with open(stamp, "w") as f:
        json.dump(_stamp(spec), f)
    return path


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt) :].tolist()


def _gemma_norm(x, weight, eps: float = 1e-6):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * (1.0 + weight)


def _mtp_tensors(model, spec: Qwen35Spec) -> dict:
    """The MTP layer in the layout Qwen publishes (what ``qwen3_5_mtp.py``'s ``load_weights``
    reads): ``mtp.fc`` ``[H, 2H]`` over ``cat(pre_fc_norm_embedding(embed(x)),
    pre_fc_norm_hidden(h))``, one full-attention decoder layer ``mtp.layers.0.*`` (the
    checkpoint's own names: gated ``q_proj``, q/k norms, the dense MLP or the experts, router and
    gated shared expert as the model's layers are written), ``mtp.norm``; the embedding and
    ``lm_head`` are the target's (the server shares them).

    A random MTP layer's drafts are all rejected, so its verify never keeps a partial prefix. This
    one proposes, for a token ``x``, the target's greedy successor of ``x`` in the continuations of
    ``mtp_prompts`` (their first ``MTP_KNOWN_STEPS`` tokens; a token seen twice keeps its first
    successor): ``fc``'s embedding half maps each known token's normed embedding onto the
    ``lm_head`` row of its successor (least squares, exact: fewer tokens than hidden dims), the
    decoder layer adds a small random contribution (``o_proj`` / ``down_proj`` scaled by
    ``MTP_RESIDUAL_SCALE``), ``fc``'s hidden half a smaller one. So a chain of drafts along a
    known continuation is accepted to its end and the first draft past it is rejected: accept
    lengths vary within one request and between requests. Any other token's draft is noise."""
    import tempfile

    import torch
    import transformers
    from safetensors.torch import load_file

    hidden = spec.hidden_size
    known: dict[int, int] = {}
    for prompt in mtp_prompts(spec.vocab_size):
        cont = _greedy(model, prompt, MTP_KNOWN_STEPS)
        for x, y in zip(cont[:-1], cont[1:]):
            known.setdefault(x, y)
    assert len(known) < hidden, len(known)

    # One decoder layer of the model's own class and names (a 1-layer full-attention model).
    config = _config(spec)
    config.num_hidden_layers = 1
    config.layer_types = ["full_attention"]
    torch.manual_seed(spec.seed + 1)
    layer_model = getattr(transformers, ARCHS[spec.arch])(config).to(torch.float32)
    _init_weights(layer_model, spec)
    with tempfile.TemporaryDirectory() as tmp:
        layer_model.save_pretrained(tmp, safe_serialization=True)
        written = load_file(os.path.join(tmp, "model.safetensors"))
    out = {}
    for name, t in written.items():
        if not name.startswith("model.layers.0."):
            continue
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            t = t * MTP_RESIDUAL_SCALE
        out["mtp." + name[len("model.") :]] = t.contiguous()

    g = torch.Generator().manual_seed(spec.seed + 2)
    embed = model.get_input_embeddings().weight.detach().float()
    head = model.get_output_embeddings().weight.detach().float()
    norm_embedding = 0.1 * torch.randn(hidden, generator=g)
    xs = torch.tensor(sorted(known))
    keys = _gemma_norm(embed[xs], norm_embedding)  # [n, H]: what fc's embedding half sees
    values = head[torch.tensor([known[int(x)] for x in xs])]  # [n, H]: the successors' rows
    # A keys^T = values^T with the minimum norm: A = values^T (keys keys^T)^-1 keys.
    fc_embedding = values.T @ torch.linalg.solve(keys @ keys.T, keys)
    fc_hidden = MTP_HIDDEN_SCALE * torch.randn(hidden, hidden, generator=g) / hidden**0.5
    out.update(
        {
            "mtp.fc.weight": torch.cat([fc_embedding, fc_hidden], dim=1).contiguous(),
            "mtp.pre_fc_norm_embedding.weight": norm_embedding,
            "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(hidden, generator=g),
            "mtp.norm.weight": torch.zeros(hidden),
        }
    )
    return out


def _add_mtp_layer(path: str, model, spec: Qwen35Spec) -> None:
    """Append ``_mtp_tensors`` to the directory's ``model.safetensors`` (one file at this size)."""
    from safetensors.torch import load_file, save_file

    st = os.path.join(path, "model.safetensors")
    assert os.path.exists(st) and not os.path.exists(st + ".index.json"), path
    tensors = load_file(st)
    tensors.update(_mtp_tensors(model, spec))
    save_file(tensors, st, metadata={"format": "pt"})


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(
        description="Write a tiny random-weight Qwen3.5 checkpoint."
    )
    p.add_argument("path")
    p.add_argument(
        "--moe",
        action="store_true",
        help="Qwen3_5MoeForCausalLM (default: the dense one)",
    )
    p.add_argument(
        "--mtp", action="store_true", help="with the MTP layer (the NEXTN draft)"
    )
    args = p.parse_args()
    spec = MOE if args.moe else DENSE
    print(write_qwen3_5_model(args.path, replace(spec, mtp=args.mtp)))


if __name__ == "__main__":
    main()


def write_qwen3_5_fp8_block(src: str, out: str) -> str:
    """``src`` (a checkpoint of ``write_qwen3_5_model``) in SGLang's block-wise ``fp8`` format
    (128 x 128 tiles, ``fp8_checkpoints``), as Qwen publishes Qwen3.5: the attention and MLP
    projections FP8, the Gated DeltaNet projections (``linear_attn``), norms, embeddings and
    ``lm_head`` in their float dtype (``ignored_layers``). Idempotent."""
    from sglang_helix.testing.fp8_checkpoints import write_fp8_checkpoint

    write_fp8_checkpoint(src, out, "fp8-block")
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["ignored_layers"] = ["lm_head", "linear_attn"]
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return out


def write_qwen3_5_vl_model(path: str, spec: Qwen35Spec = DENSE) -> str:
    """The multimodal form Qwen publishes (``Qwen3_5ForConditionalGeneration`` /
    ``Qwen3_5MoeForConditionalGeneration``): ``spec``'s text model under ``model.language_model``
    beside a one-block vision encoder (``model.visual``), written by transformers (idempotent).
    """
    import torch
    import transformers

    want = {**_stamp(spec), "vl": True}
    stamp = os.path.join(path, "tiny_model_spec.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return path
    os.makedirs(path, exist_ok=True)
    write_tokenizer(path, spec.vocab_size)
    text = _config(spec).to_dict()
    text.update(
        full_attention_interval=4, attn_output_gate=True, mamba_ssm_dtype="float32"
    )
    vision = dict(
        depth=1,
        hidden_size=64,
        num_heads=4,  # (--tp 4: the vision encoder's heads shard over attn_tp)
        intermediate_size=128,
        out_hidden_size=spec.hidden_size,
    )
    moe = spec.arch == "qwen3_5_moe"
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_cls(
        text_config=text, vision_config=vision, tie_word_embeddings=False
    )
    config.architectures = [
        (
            "Qwen3_5MoeForConditionalGeneration"
            if moe
            else "Qwen3_5ForConditionalGeneration"
        )
    ]
    torch.manual_seed(spec.seed)
    model_cls = (
        transformers.Qwen3_5MoeForConditionalGeneration
        if moe
        else transformers.Qwen3_5ForConditionalGeneration
    )
    model = model_cls(config).to(torch.float32)
    _init_weights(model, spec)
    model.save_pretrained(path, safe_serialization=True)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    # The processors the server loads for a multimodal checkpoint (the published patch geometry).
    geometry = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
    transformers.Qwen2VLImageProcessor(**geometry).save_pretrained(path)
    transformers.Qwen3VLVideoProcessor(**geometry).save_pretrained(path)
    with open(stamp, "w") as f:
        json.dump(want, f)
    return path


def write_qwen3_5_decision_config(path: str, attention_mode: str) -> str:
    """A Qwen3.5 "decision" checkpoint's configuration: the multimodal checkpoint's ``config.json``
    as a bare backbone (``Qwen3_5Model``, no LM head) beside the ``decision_config.json`` that 0.5.23
    serves it by (``model_config.load_decision_config``: its readout in the LM head rows of its
    codes). ``attention_mode`` ``noncausal_full_attention``: the full-attention layers read the
    whole prompt (``is_causal`` False). The configuration only, for argument resolution."""
    src = write_qwen3_5_vl_model(os.path.join(path, "vl"))
    out = os.path.join(path, attention_mode)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["Qwen3_5Model"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    decision = dict(format_version=1, attention_mode=attention_mode, pooling="last", token_ids=[3, 4])
    with open(os.path.join(out, "decision_config.json"), "w") as f:
        json.dump(decision, f)
    return out
