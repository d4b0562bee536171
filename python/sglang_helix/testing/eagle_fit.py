"""An EAGLE draft head that accepts: fitted in seconds to a tiny target's own greedy continuations.

A random EAGLE head's proposals are rejected, so a test with one cannot tell a working EAGLE path
from one that only falls back to the target's token. ``fit_eagle_draft`` writes a
``LlamaForCausalLMEagle`` checkpoint (the layout of ``tiny_models.write_tiny_eagle_draft``) whose
``fc`` and decoder layer are trained, teacher-forced as EAGLE trains, on the target's greedy
continuations of the given prompts:

    input at position p:  fc(cat(embed(x[p + 1]), h[p]))   h: the target's final (normed) hidden state
    -> one Llama decoder layer without its input norm (causal attention over the draft's positions)
    -> the target's lm_head                                 label: x[p + 2]

The target's ``embed_tokens`` and ``lm_head`` are frozen and written into the checkpoint (the
server shares the target's anyway). On the tiny random targets the continuations settle into short
cycles, which one layer learns: the head proposes what the target then produces, so speculation's
accept length is well above 1 -- what the EAGLE tests assert, beside plain TP's tokens.
"""

from __future__ import annotations

import json
import os
import shutil


def greedy_continuations(model, tokenizer, prompts: list, new_tokens: int) -> list:
    """Each prompt's token ids followed by ``new_tokens`` greedy tokens of ``model`` (no EOS stop,
    as the tests' ``ignore_eos``)."""
    import torch

    out = []
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            for _ in range(new_tokens):
                nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
            out.append(ids)
    return out


def fit_eagle_draft(path: str, target_path: str, prompts: list, new_tokens: int = 48, steps: int = 400,
                    seed: int = 1) -> dict:  # fmt: skip
    """Write the fitted head to ``path`` (idempotent for the same target, prompts and settings);
    returns ``{"path", "train_accuracy"}`` (first-draft-token accuracy on the training tokens)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    stamp = os.path.join(path, "eagle_fit.json")
    with open(os.path.join(target_path, "tiny_model_spec.json")) as f:
        want = {"target": json.load(f), "prompts": list(prompts), "new_tokens": new_tokens, "steps": steps, "seed": seed}
    if os.path.exists(stamp):
        with open(stamp) as f:
            done = json.load(f)
        if done["settings"] == want:
            return {"path": path, "train_accuracy": done["train_accuracy"]}

    torch.manual_seed(seed)
    target = transformers.LlamaForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_path)
    seqs = greedy_continuations(target, tokenizer, prompts, new_tokens)
    with torch.no_grad():
        hidden = [target.model(input_ids=s).last_hidden_state for s in seqs]  # [1, L, H], after the final norm
    embed, lm_head = target.model.embed_tokens, target.lm_head

    config = transformers.LlamaConfig.from_pretrained(target_path)
    config.num_hidden_layers = 1
    config._attn_implementation = "sdpa"  # causal when no mask is given
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE's first layer has none
    rotary = LlamaRotaryEmbedding(config)
    H = config.hidden_size
    fc = torch.nn.Linear(2 * H, H)

    def logits_of(x, h):  # x [1, L], h [1, L, H] -> [1, L - 1, V] (the draft at positions 0..L-2)
        inp = fc(torch.cat([embed(x[:, 1:]), h[:, :-1]], dim=-1))
        pos = torch.arange(inp.shape[1])[None]
        out = layer(inp, attention_mask=None, position_ids=pos, position_embeddings=rotary(inp, pos))
        return lm_head(out[0] if isinstance(out, tuple) else out)

    params = list(fc.parameters()) + list(layer.parameters())
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(logits_of(x, h)[0, :-1], x[0, 2:]) for x, h in zip(seqs, hidden))
        loss.backward()
        opt.step()
    with torch.no_grad():
        hits = total = 0
        for x, h in zip(seqs, hidden):
            pred = logits_of(x, h)[0, :-1].argmax(-1)
            hits += int((pred == x[0, 2:]).sum())
            total += pred.numel()

    os.makedirs(path, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(target_path, name), os.path.join(path, name))
    tensors = {"embed_tokens.weight": embed.weight, "lm_head.weight": lm_head.weight,
               "fc.weight": fc.weight, "fc.bias": fc.bias}  # fmt: skip
    for name, p in layer.named_parameters():
        tensors[f"layers.0.{name}"] = p
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    config = transformers.LlamaConfig.from_pretrained(target_path)  # without the training's attention setting
    config.num_hidden_layers = 1
    config.architectures = ["LlamaForCausalLMEagle"]
    config.to_json_file(os.path.join(path, "config.json"))
    result = {"path": path, "train_accuracy": hits / total}
    with open(stamp, "w") as f:
        json.dump({"settings": want, "train_accuracy": result["train_accuracy"]}, f)
    return result
