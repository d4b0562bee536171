"""Import stub for the CUDA-only ``sgl_kernel`` package (CPU test harness only).

The real ``sgl_kernel`` wheel cannot be imported on a machine without libcuda, yet several SGLang
modules import names from it at import time. Putting this directory first on ``PYTHONPATH`` lets
those imports succeed. Every attribute is a ``StubKernel``: calling it, or any attribute of it,
raises ``SglKernelStubCalled`` and, when ``SGL_KERNEL_STUB_LOG`` names a file, appends the kernel's
name to it first. Tests assert that the log stays empty, so a test can never silently run through a
fake kernel (even if some caller swallows the exception).

Never install this into a real environment: it exists for the CPU harness only.
"""

import importlib.abc
import importlib.machinery
import os
import sys

__version__ = "0.0.0+cpu-stub"
IS_SGLANG_HELIX_STUB = True


class SglKernelStubCalled(RuntimeError):
    pass


def _record(name: str) -> None:
    log = os.environ.get("SGL_KERNEL_STUB_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {name}\n")


class StubKernel:
    """Stands in for any object of sgl_kernel; fails loudly when used."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        _record(self._name)
        raise SglKernelStubCalled(
            f"sgl_kernel.{self._name} was called, but sgl_kernel is the CPU-harness stub "
            f"(sglang_helix/testing/sgl_kernel_stub). This code path needs a real CUDA kernel."
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return StubKernel(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stub {self._name}>"


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return StubKernel(name)


class _StubSubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import sgl_kernel.anything`` yield a stub module as well."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        import types

        module = types.ModuleType(spec.name)
        module.__path__ = []
        prefix = spec.name[len(__name__) + 1 :]
        module.__getattr__ = lambda attr: (
            (_ for _ in ()).throw(AttributeError(attr))
            if attr.startswith("__") and attr.endswith("__")
            else StubKernel(f"{prefix}.{attr}")
        )
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StubSubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubSubmoduleFinder())
