"""The tiny-checkpoint generator: deterministic, configurable, offline, with decisive greedy margins."""

import hashlib
import json
import os

import pytest

from sglang_helix.testing.tiny_models import ARCHS, TinyModelSpec, write_tiny_model


def _digest(path):
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


def test_deterministic_bytes(tmp_path):
    spec = TinyModelSpec(num_heads=4, num_kv_heads=1, head_dim=8, num_layers=1)
    a = write_tiny_model(str(tmp_path / "a"), spec)
    b = write_tiny_model(str(tmp_path / "b"), spec)
    assert _digest(a) == _digest(b)
    c = write_tiny_model(str(tmp_path / "c"), TinyModelSpec(num_heads=4, num_kv_heads=1, head_dim=8, num_layers=1, seed=1))
    assert _digest(a) != _digest(c)


@pytest.mark.parametrize("q,k,d,layers", [(8, 1, 16, 1), (8, 2, 16, 2), (16, 4, 32, 3)])
def test_config_follows_spec(tmp_path, q, k, d, layers):
    from safetensors import safe_open

    path = write_tiny_model(str(tmp_path / "m"), TinyModelSpec(num_heads=q, num_kv_heads=k, head_dim=d, num_layers=layers))
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]) == (q, k, d, layers)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (k * d, q * d)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").shape == (q * d, q * d)


def test_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_model(str(tmp_path / "m"), TinyModelSpec(num_layers=1))
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

    path = write_tiny_model(str(tmp_path / "m"), TinyModelSpec())
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


# arch: (config fields the family's real checkpoints carry, tensors that must be in the file,
# tensors that must not).
FAMILY = {
    "mistral": ({"model_type": "mistral", "sliding_window": None, "tie_word_embeddings": False}, ["lm_head.weight"], []),
    "qwen2": (
        {"model_type": "qwen2", "tie_word_embeddings": True},
        ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.v_proj.bias"],
        ["lm_head.weight"],
    ),
    "qwen3": (
        {"model_type": "qwen3", "tie_word_embeddings": True, "attention_bias": False},
        ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"],
        ["lm_head.weight", "model.layers.0.self_attn.q_proj.bias"],
    ),
    "qwen3_moe": (
        {"model_type": "qwen3_moe", "num_experts_per_tok": 2, "moe_intermediate_size": 128},
        ["model.layers.1.self_attn.q_norm.weight", "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.3.down_proj.weight"],
        ["model.layers.0.mlp.gate_proj.weight"],
    ),
    "mixtral": (
        {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
        ["model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.experts.3.w2.weight"],
        [],
    ),
}


@pytest.mark.parametrize("arch", list(FAMILY))
def test_families_carry_their_real_config_fields(tmp_path, arch):
    from safetensors import safe_open

    fields, present, absent = FAMILY[arch]
    path = write_tiny_model(str(tmp_path / arch), TinyModelSpec(arch=arch, num_kv_heads=2))
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["architectures"] == [ARCHS[arch][1]]
    assert {k: cfg.get(k) for k in fields} == fields
    if arch in ("qwen3_moe", "mixtral"):  # transformers 5 writes Qwen3-MoE's num_experts under this name
        assert cfg["num_local_experts"] == 4
    if arch == "qwen2":  # YaRN, as Qwen2.5 ships it for > 32K (transformers 5 writes rope_parameters)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0, rope
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert set(present) <= keys, set(present) - keys
    assert not set(absent) & keys, set(absent) & keys
