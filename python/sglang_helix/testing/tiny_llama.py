"""Tiny deterministic Llama checkpoints for the CPU harness.

``write_tiny_llama(path, ...)`` writes a complete HF-style model directory that
``python -m sglang.launch_server --model-path path`` loads with no network access:

- ``config.json`` + ``model.safetensors``: a ``LlamaForCausalLM`` with random weights from a fixed
  seed, float32;
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


@dataclass(frozen=True)
class TinyLlamaSpec:
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


def write_tiny_llama(path: str, spec: TinyLlamaSpec = TinyLlamaSpec()) -> str:
    """Write the model directory (idempotent for the same spec) and return ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    stamp = os.path.join(path, "tiny_llama_spec.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == asdict(spec):
                return path
    os.makedirs(path, exist_ok=True)
    write_tokenizer(path, spec.vocab_size)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size()
    assert vocab <= spec.vocab_size, (vocab, spec.vocab_size)

    config = LlamaConfig(
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
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    hidden = spec.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif "lm_head" in name:
                p.normal_(0.0, spec.logit_scale * 4.0 / hidden**0.5)
            elif "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, spec.attn_scale / hidden**0.5)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)  # keep sampling defaults out of the picture: tests pass their own params
    with open(stamp, "w") as f:
        json.dump(asdict(spec), f)
    return path


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write a tiny random-weight Llama for the CPU harness.")
    p.add_argument("path")
    for field, default in asdict(TinyLlamaSpec()).items():
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    args = vars(p.parse_args())
    path = args.pop("path")
    print(write_tiny_llama(path, TinyLlamaSpec(**args)))


if __name__ == "__main__":
    main()
