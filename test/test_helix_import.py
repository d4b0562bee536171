"""With Helix off, a model module loads nothing new: ``import sglang.srt.models.llama`` (and the
other models the series touches) loads exactly the modules it loads from the pristine 0.5.23
wheel -- no Helix module and no attention backend. Helix is DCP's GQA mode: a model only shards
its qkv through DCP's partitions and declares support; the backends run the Helix attention."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from sglang_helix.series import pinned_wheel
from sglang_helix.testing.cpu_env import STUB_DIR

MODELS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
PROBE = "import importlib, sys; importlib.import_module(sys.argv[1]); print('\\n'.join(sorted(sys.modules)))"


def _modules(model: str, pythonpath: str | None = None) -> set:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, STUB_DIR) if p)
    r = subprocess.run([sys.executable, "-c", PROBE, f"sglang.srt.models.{model}"], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return set(r.stdout.split())


@pytest.fixture(scope="module")
def pristine_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine-sglang")
    with zipfile.ZipFile(pinned_wheel()) as z:
        z.extractall(root, [m for m in z.namelist() if m.startswith("sglang/")])
    return str(root)


@pytest.mark.parametrize("model", ["llama"])
def test_model_import_loads_what_the_pristine_wheel_loads(model, pristine_root):
    patched = _modules(model)
    assert not [m for m in patched if m.startswith("sglang.srt.layers.dcp.gqa_")], "a GQA-mode module is loaded with it off"
    assert "sglang.srt.layers.attention.triton_backend" not in patched
    assert "sglang.srt.layers.attention.torch_native_backend" not in patched
    pristine = _modules(model, pristine_root)
    assert any(m.startswith("sglang.srt.models.") for m in pristine)
    assert patched == pristine, (sorted(patched - pristine), sorted(pristine - patched))


@pytest.mark.parametrize("model", MODELS)
def test_models_call_self_attn(model):
    """No model calls Helix: its forward calls ``self.attn`` and the attention backends dispatch
    (section 3 of the issue that made Helix DCP's GQA mode)."""
    import importlib.util

    path = importlib.util.find_spec(f"sglang.srt.models.{model}").origin
    code = [line.split("#")[0] for line in open(path).read().splitlines()]
    assert not [line for line in code if "helix" in line.lower()]  # DCP names upstream
    mentions = [line.strip() for line in code if "dcp_gqa" in line]
    assert all(m == "supports_dcp_gqa = True" or "get_parallel().dcp_gqa_mode" in m for m in mentions), mentions
    assert not [line for line in code if "self.dcp_gqa" in line or "dcp_gqa_attention" in line]
