"""The sgl_kernel import stub imports, but every kernel in it fails loudly and is recorded."""

import subprocess
import sys

from sglang_helix.testing.cpu_env import STUB_DIR, cpu_server_env

SCRIPT = r"""
import sgl_kernel
assert sgl_kernel.IS_SGLANG_HELIX_STUB
from sgl_kernel import rmsnorm, silu_and_mul            # names import fine
from sgl_kernel.flash_attn import flash_attn_with_kvcache  # so do submodules
import sgl_kernel.allreduce as ar
for fn in (rmsnorm, flash_attn_with_kvcache, ar.init_custom_ar, sgl_kernel.common_ops.anything):
    try:
        fn(1, 2)
    except sgl_kernel.SglKernelStubCalled as e:
        assert "stub" in str(e)
    else:
        raise SystemExit("stub call did not raise")
assert not hasattr(sgl_kernel, "__wrapped__")  # dunder lookups are not faked
print("ok")
"""


def test_stub_imports_and_every_call_raises_and_is_logged(tmp_path):
    log = tmp_path / "calls.log"
    env = cpu_server_env(1, stub_log=str(log))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    names = [line.split()[1] for line in log.read_text().splitlines()]
    assert names == ["rmsnorm", "flash_attn.flash_attn_with_kvcache", "allreduce.init_custom_ar", "common_ops.anything"]


def test_stub_shadows_the_real_wheel():
    env = cpu_server_env(1)
    r = subprocess.run(
        [sys.executable, "-c", "import sgl_kernel; print(sgl_kernel.__file__)"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(STUB_DIR)
