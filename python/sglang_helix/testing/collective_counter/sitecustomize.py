"""Test-only: count torch.distributed collectives in every process of a CPU server.

Put this directory on PYTHONPATH and set HELIX_COLLECTIVE_LOG=<file>; each call of a wrapped
collective appends ``<pid> <op> <dtype> <numel>`` to the file. Used by
test/test_helix_collectives.py to count the collectives of decode steps. Never used in production.
"""

import os

_LOG = os.environ.get("HELIX_COLLECTIVE_LOG")
if _LOG:
    import torch.distributed as _dist

    def _wrap(name):
        real = getattr(_dist, name)

        def counted(*args, **kwargs):
            tensor = args[0] if args and hasattr(args[0], "dtype") else None
            if name == "all_to_all_single" and len(args) > 1:
                tensor = args[1]  # the input
            desc = f"{tensor.dtype} {tensor.numel()}" if tensor is not None else "- -"
            with open(_LOG, "a") as f:
                f.write(f"{os.getpid()} {name} {desc}\n")
            return real(*args, **kwargs)

        setattr(_dist, name, counted)

    for _name in ("all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"):
        _wrap(_name)
