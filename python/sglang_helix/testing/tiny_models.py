"""Tiny deterministic checkpoints for the CPU harness: Llama, Mistral, Qwen2, Qwen3 and their MoE kin.

``write_tiny_model(path, spec)`` writes a complete HF-style model directory that
``python -m sglang.launch_server --model-path path`` loads with no network access:

- ``config.json`` + ``model.safetensors``: the architecture ``spec.arch`` names (``ARCHS``), written
  by transformers' own model class with random weights from a fixed seed, float32, and the config
  fields the real checkpoints of that family carry (rope scaling, tied embeddings, qkv bias, q/k
  norms, experts);
- ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE tokenizer trained offline with
  ``tokenizers`` on a built-in corpus, with a chat template.

The weights are scaled so that greedy choices are decisive: logits have a spread of several nats
(``logit_scale``), so layouts that differ only by float reassociation pick the same token, while a
wrong attention result (a missing or duplicated KV shard) visibly moves the logprobs. Attention
scores are sharpened (``attn_scale``) so outputs really depend on which tokens are attended to.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_WORDS = (
    "the a of to and in is it that for on with as was at by an be this which or from but not are "
    "have had one all were when we there can been has more if no out do so up said what its about "
    "into than them time only could new some these two may first then any like other after "
    "attention head query key value cache token sequence shard rank merge parallel helix decode "
    "prefill chunk layer model tensor kernel memory context window long short fast slow exact "
    "river mountain city garden music paper light stone water fire cloud forest ocean desert "
    "north south east west red green blue yellow black white quick lazy brown fox dog jumps over"
).split()


# arch -> (transformers config class, model class, the config fields real checkpoints of the family
# carry). Rope scaling is the published long-context recipe of the family, shrunk to the tiny
# max_position_embeddings; tied embeddings as the family's small checkpoints have them.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": (  # Mistral-7B-v0.3: rope 1e6, no sliding window, untied
        "MistralConfig", "MistralForCausalLM", {"rope_theta": 1e6, "sliding_window": None},
    ),
    "qwen2": (  # Qwen2.5: qkv bias (always, no flag), tied at <= 3B, YaRN for > 32K
        "Qwen2Config", "Qwen2ForCausalLM",
        {"rope_theta": 1e6, "tie_word_embeddings": True, "use_sliding_window": False,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}},
    ),
    "qwen3": (  # Qwen3: per-head q/k RMSNorm, no bias, tied at <= 4B
        "Qwen3Config", "Qwen3ForCausalLM",
        {"rope_theta": 1e6, "tie_word_embeddings": True, "attention_bias": False},
    ),
    "qwen3_moe": (  # Qwen3-30B-A3B / 235B-A22B: Qwen3 attention, routed experts in every layer
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        {"rope_theta": 1e6, "attention_bias": False, "norm_topk_prob": True, "decoder_sparse_step": 1,
         "mlp_only_layers": []},
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"rope_theta": 1e6, "sliding_window": None}),
}  # fmt: skip


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"  # a key of ARCHS
    num_heads: int = 8  # Q: query heads
    num_kv_heads: int = 4  # K: KV heads
    head_dim: int = 16
    num_layers: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 8192
    logit_scale: float = 4.0  # std of lm_head rows, in units of 1/sqrt(hidden)
    attn_scale: float = 2.0  # extra std of q/k projections
    seed: int = 0
    num_experts: int = 4  # MoE archs only: routed experts per layer, top-k of them per token
    experts_per_token: int = 2

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim


def _corpus(n_lines: int = 4000, seed: int = 1234):
    import random

    rng = random.Random(seed)
    for _ in range(n_lines):
        yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))


def write_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _config(spec: TinyModelSpec):
    import transformers

    config_cls, _, family = ARCHS[spec.arch]
    fields = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    fields.update(family)
    if spec.arch == "qwen3_moe":
        fields.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                      moe_intermediate_size=spec.intermediate_size)  # fmt: skip
    elif spec.arch == "mixtral":
        fields.update(num_local_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token)
    return getattr(transformers, config_cls)(**fields)


def write_tiny_model(path: str, spec: TinyModelSpec = TinyModelSpec()) -> str:
    """Write the model directory (idempotent for the same spec) and return ``path``."""
    import torch
    import transformers

    stamp = os.path.join(path, "tiny_model_spec.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == asdict(spec):
                return path
    os.makedirs(path, exist_ok=True)
    write_tokenizer(path, spec.vocab_size)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size()
    assert vocab <= spec.vocab_size, (vocab, spec.vocab_size)

    config = _config(spec)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, ARCHS[spec.arch][1])(config).to(torch.float32)
    hidden = spec.hidden_size
    lm_head_std = spec.logit_scale * 4.0 / hidden**0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # layer norms and Qwen3's per-head q/k norms
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):  # Qwen2's qkv bias
                p.normal_(0.0, 0.1)
            elif "embed_tokens" in name:  # tied: also the lm_head, at its scale (decisive margins)
                p.normal_(0.0, lm_head_std if config.tie_word_embeddings else 1.0)
            elif "lm_head" in name:
                p.normal_(0.0, lm_head_std)
            elif "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, spec.attn_scale / hidden**0.5)
            else:  # o_proj, MLP, routers, experts ([E, out, in] fused by transformers)
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)  # keep sampling defaults out of the picture: tests pass their own params
    with open(stamp, "w") as f:
        json.dump(asdict(spec), f)
    return path


def write_tiny_eagle_draft(path: str, target: TinyModelSpec = TinyModelSpec(), seed: int = 1) -> str:
    """Write a tiny random EAGLE (v1) draft head for ``target`` (a Llama-family spec), as
    ``--speculative-algorithm EAGLE --speculative-draft-model-path path`` loads it with sglang's
    ``LlamaForCausalLMEagle`` (``srt/models/llama_eagle.py``):

    - ``config.json``: the target's Llama config with one decoder layer and
      ``architectures: ["LlamaForCausalLMEagle"]``;
    - ``model.safetensors``: the EAGLE checkpoint layout, names without the ``model.`` prefix:
      ``embed_tokens``, ``fc`` (``[hidden, 2 * hidden]`` + bias: the token embedding concatenated
      with the target's hidden state), ``layers.0.*`` without ``input_layernorm`` (EAGLE skips
      it), no final ``norm``, and ``lm_head``. The server replaces ``embed_tokens`` and
      ``lm_head`` by the target's (EAGLE shares them), so only ``fc`` and the layer matter;
    - the target's tokenizer files.

    The weights are random (fixed ``seed``), so the draft's proposals are mostly rejected: the
    point is that whatever it proposes, the served tokens are the target's.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    assert target.arch == "llama", "the EAGLE head in sglang is LlamaForCausalLMEagle"
    stamp = os.path.join(path, "tiny_model_spec.json")
    want = {"eagle_draft_for": asdict(target), "seed": seed}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return path
    os.makedirs(path, exist_ok=True)
    write_tokenizer(path, target.vocab_size)
    config = _config(target)
    config.num_hidden_layers = 1
    config.architectures = ["LlamaForCausalLMEagle"]
    torch.manual_seed(seed)
    layer_model = transformers.LlamaForCausalLM(config).to(torch.float32)
    hidden = target.hidden_size
    tensors = {}
    with torch.no_grad():
        for name, p in layer_model.named_parameters():
            name = name.removeprefix("model.")
            if name in ("norm.weight", "layers.0.input_layernorm.weight"):
                continue  # not in an EAGLE head
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, target.attn_scale / hidden**0.5)
            elif name == "lm_head.weight":
                p.normal_(0.0, target.logit_scale * 4.0 / hidden**0.5)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
            tensors[name] = p.detach().clone().contiguous()
        tensors["fc.weight"] = torch.randn(hidden, 2 * hidden) / (2 * hidden) ** 0.5
        tensors["fc.bias"] = torch.zeros(hidden)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.to_json_file(os.path.join(path, "config.json"))
    with open(stamp, "w") as f:
        json.dump(want, f)
    return path


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write a tiny random-weight checkpoint for the CPU harness.")
    p.add_argument("path")
    for field, default in asdict(TinyModelSpec()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    args = vars(p.parse_args())
    path = args.pop("path")
    print(write_tiny_model(path, TinyModelSpec(**args)))


if __name__ == "__main__":
    main()
