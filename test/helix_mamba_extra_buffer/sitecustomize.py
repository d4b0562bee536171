"""Test-only: open SGLang's mamba extra-buffer platform gate on the CPU harness.

SGLang offers a hybrid model's radix cache with ``--mamba-radix-cache-strategy extra_buffer`` (state
snapshots at track boundaries, pages of more than one token) only where
``arg_groups/mamba_hook._platform_supports_mamba_cache_extra_buffer`` says the platform has it
(CUDA, MUSA, NPU, HIP, XPU; not the CPU: the real sgl-kernel CPU chunk kernel returns no per-chunk
states ``h``, which the extend's snapshot reads). The CPU harness's stub kernel returns them when
``HELIX_TEST_MAMBA_CHUNK_STATES=1`` (``sgl_kernel/mamba.py``); with ``HELIX_TEST_MAMBA_EXTRA_BUFFER=1``
every process that puts this directory first on ``PYTHONPATH`` (the launcher and every scheduler
rank) sees the gate open, so the same server arguments a GPU takes run the extra buffer's code
(``test/test_helix_qwen3_5_radix.py``). The helpers the extra buffer runs as Triton kernels (the
decode snapshot, ``track_mamba_states_all_layers``) run interpreted: ``TRITON_INTERPRET=1``.

One more line of that code assumes a GPU: ``ScheduleBatch.prepare_for_decode`` pins the decode
track mask unconditionally (``track_mask_cpu.pin_memory()``, ``managers/schedule_batch.py``; every
other pin there asks ``is_pin_memory_available``), and pinning needs a CUDA driver. On a machine
without one, ``Tensor.pin_memory`` returns the tensor itself here (pinning only speeds a host to
device copy; the copy's result is the same).

Nothing is done when the variable is unset. No part of the series: SGLang on a CPU still refuses
the extra buffer, and the mode refuses the radix cache there (``helix_hook._check_linear_attention_cache``).
"""

import importlib.abc
import importlib.machinery
import os
import sys

GATE = "_platform_supports_mamba_cache_extra_buffer"


def _open_gate(module) -> None:
    def platform_supports_extra_buffer() -> bool:
        return True

    platform_supports_extra_buffer.__doc__ = "Opened on the CPU harness (sglang-helix tests)."
    setattr(module, GATE, platform_supports_extra_buffer)


def _pin_without_cuda(module) -> None:
    import torch

    if torch.cuda.is_available() or getattr(torch.Tensor.pin_memory, "_helix_test", False):
        return
    pin = torch.Tensor.pin_memory

    def pin_memory(self, *args, **kwargs):
        return self if self.device.type == "cpu" else pin(self, *args, **kwargs)

    pin_memory._helix_test = True
    torch.Tensor.pin_memory = pin_memory


TARGETS = {
    "sglang.srt.arg_groups.mamba_hook": _open_gate,
    "sglang.srt.managers.schedule_batch": _pin_without_cuda,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_open(module):
            exec_module(module)
            TARGETS[fullname](module)

        spec.loader.exec_module = exec_and_open
        return spec


if os.environ.get("HELIX_TEST_MAMBA_EXTRA_BUFFER") == "1":
    for name, fix in TARGETS.items():
        if name in sys.modules:
            fix(sys.modules[name])
    sys.meta_path.insert(0, _Finder())
