"""0.5.23's own code as a test's reference, beside the installed series.

``pristine_module("sglang/srt/.../x.py")`` loads the pinned wheel's copy of one upstream module
(``sglang_helix.series.pinned_wheel``) under a name of its own; its imports resolve to the installed
modules, so a test can call 0.5.23's function, or 0.5.23's method unbound on the series' object,
and compare what it does with what the series does on a path the series must leave as 0.5.23 has
it (issue 79: plain DCP, MLA transfers).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from functools import lru_cache
from types import ModuleType

from sglang_helix.series import pinned_wheel


@lru_cache(maxsize=None)
def pristine_module(rel: str) -> ModuleType:
    """The pinned wheel's ``rel`` (``sglang/...py``), imported as ``_pristine_<path>``."""
    with zipfile.ZipFile(pinned_wheel()) as wheel:
        source = wheel.read(rel)
    path = os.path.join(tempfile.mkdtemp(prefix="sglang-pristine-"), os.path.basename(rel))
    with open(path, "wb") as f:
        f.write(source)
    name = "_pristine_" + rel.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    with _metrics_registered_once():
        spec.loader.exec_module(module)
    return module


@contextmanager
def _metrics_registered_once():
    """A module that defines Prometheus metrics at import (mooncake/conn.py) registers them once:
    the installed copy has, so the pristine copy's metrics stay out of the registry."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        yield
        return
    register = REGISTRY.register
    REGISTRY.register = lambda collector: None
    try:
        yield
    finally:
        REGISTRY.register = register
