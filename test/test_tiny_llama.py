"""The tiny-checkpoint generator: deterministic, configurable, offline, with decisive greedy margins."""

import hashlib
import json
import os

import pytest

from sglang_helix.testing.tiny_llama import TinyLlamaSpec, write_tiny_llama


def _digest(path):
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


def test_deterministic_bytes(tmp_path):
    spec = TinyLlamaSpec(num_heads=4, num_kv_heads=1, head_dim=8, num_layers=1)
    a = write_tiny_llama(str(tmp_path / "a"), spec)
    b = write_tiny_llama(str(tmp_path / "b"), spec)
    assert _digest(a) == _digest(b)
    c = write_tiny_llama(str(tmp_path / "c"), TinyLlamaSpec(num_heads=4, num_kv_heads=1, head_dim=8, num_layers=1, seed=1))
    assert _digest(a) != _digest(c)


@pytest.mark.parametrize("q,k,d,layers", [(8, 1, 16, 1), (8, 2, 16, 2), (16, 4, 32, 3)])
def test_config_follows_spec(tmp_path, q, k, d, layers):
    from safetensors import safe_open

    path = write_tiny_llama(str(tmp_path / "m"), TinyLlamaSpec(num_heads=q, num_kv_heads=k, head_dim=d, num_layers=layers))
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]) == (q, k, d, layers)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (k * d, q * d)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").shape == (q * d, q * d)


def test_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_llama(str(tmp_path / "m"), TinyLlamaSpec(num_layers=1))
    tok = AutoTokenizer.from_pretrained(path)
    text = "the quick brown fox jumps over the lazy dog"
    assert tok.decode(tok(text).input_ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<s><|user|>hi<|end|><|assistant|>"


def test_greedy_margins_are_decisive(tmp_path):
    """Over 4 prompts x 32 greedy steps, the top-1/top-2 logit gap never falls below 1e-2.

    float32 layout differences are ~1e-5, so token equality across layouts is meaningful.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_llama(str(tmp_path / "m"), TinyLlamaSpec())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    gaps = []
    for prompt in ["the quick brown fox", "attention head query key value", "river mountain city garden music", "a"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=32, do_sample=False, output_scores=True, return_dict_in_generate=True)
        for s in out.scores:
            top = torch.topk(s[0], 2).values
            gaps.append((top[0] - top[1]).item())
    assert min(gaps) > 1e-2, sorted(gaps)[:5]
