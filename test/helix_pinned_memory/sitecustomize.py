"""Test-only: pin the CPU engine's free-memory reading, so KV pool sizes are deterministic.

SGLang's CPU engine sizes the KV pool from ``psutil.virtual_memory().available`` (free *system*
memory, ``get_free_cpu_memory``), read once before the weights load and once when the pool is
sized: ``budget = available - available_before_load * (1 - mem_fraction_static)``. On a machine
shared with other work that reading moves by GBs between two server starts. When
``HELIX_TEST_AVAILABLE_MEMORY_BYTES`` is set, every process that puts this directory first on
``PYTHONPATH`` (the launcher and every scheduler rank) sees exactly that many bytes available;
everything else ``psutil`` reports is real. Then each rank's KV budget is exactly
``available * mem_fraction_static`` and two servers with the same memory flags get the same
budget, whatever else runs on the machine.

Nothing is done when the variable is unset. Used by ``helix_runs.py``.
"""

import os

_pinned = os.environ.get("HELIX_TEST_AVAILABLE_MEMORY_BYTES")
if _pinned:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a test dependency
        psutil = None
    if psutil is not None:
        _real_virtual_memory = psutil.virtual_memory
        _available = int(_pinned)

        def virtual_memory():
            return _real_virtual_memory()._replace(available=_available)

        virtual_memory.__doc__ = "psutil.virtual_memory() with `available` pinned (sglang-helix tests)."
        psutil.virtual_memory = virtual_memory
