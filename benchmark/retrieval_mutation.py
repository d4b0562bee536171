"""The mutation check of issue 46: break the GQA mode's KV layout in the *installed* sglang, so that
the retrieval test and a random-model test can be run against the broken layout.

    .venv/bin/python benchmark/retrieval_mutation.py apply    # break it
    .venv/bin/python benchmark/retrieval_mutation.py revert   # restore the series' bytes
    bash scripts/setup.sh --check                             # must say applied afterwards

The change: ``gqa_layout.local_kv_indices`` (the torch_native path's list of the KV rows a rank
attends to, for prefill and decode alike) drops, on KVP rank 1 only, its owned chunk number
``DROP_LOCAL_CHUNK`` (global positions ``[DROP_LOCAL_CHUNK * chunk * KVP + chunk, ... + 2 * chunk)``).
The rank then attends to every owned key but those ``chunk`` positions: a silently wrong attention,
no crash. With chunk 64 and KVP 3 that is positions 1792-1855, which hold the key of the retrieval
test's ~2K-token prompt at 90 % depth (token 1812); with chunk 4 and KVP 2 positions 76-79 (inside
the random-model tests' ~300-token prompt).

The original file is kept next to it as ``gqa_layout.py.orig-mutation`` and put back by ``revert``.
"""

from __future__ import annotations

import os
import shutil
import sys

DROP_LOCAL_CHUNK = 9

ANCHOR = "    rows = localize_dcp_indices(loc, kvp_size, kvp_rank, interleave_size=chunk)\n    return kv_indptr, rows, pos\n"
MUTATED = (
    "    rows = localize_dcp_indices(loc, kvp_size, kvp_rank, interleave_size=chunk)\n"
    "    if kvp_rank == 1:  # MUTATION (benchmark/retrieval_mutation.py): drop one owned chunk\n"
    f"        keep = (pos // (chunk * kvp_size)) != {DROP_LOCAL_CHUNK}\n"
    "        counts = torch.bincount(batch[keep], minlength=kv_lens.shape[0])\n"
    "        kv_indptr = torch.zeros_like(kv_indptr)\n"
    "        torch.cumsum(counts, dim=0, out=kv_indptr[1:])\n"
    "        rows, pos = rows[keep], pos[keep]\n"
    "    return kv_indptr, rows, pos\n"
)


def target() -> str:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    return os.path.join(os.path.dirname(spec.origin), "srt", "layers", "dcp", "gqa_layout.py")


def main(mode: str) -> None:
    path = target()
    backup = path + ".orig-mutation"
    if mode == "apply":
        text = open(path).read()
        assert text.count(ANCHOR) == 1, f"{path}: the anchor is not there once (already mutated?)"
        shutil.copy2(path, backup)
        with open(path, "w") as f:
            f.write(text.replace(ANCHOR, MUTATED))
        print(f"mutated {path} (rank 1 drops its owned chunk {DROP_LOCAL_CHUNK}); backup {backup}")
    elif mode == "revert":
        assert os.path.exists(backup), f"no backup at {backup}"
        shutil.copyfile(backup, path)  # new mtime: the stale .pyc is recompiled
        os.remove(backup)
        print(f"restored {path}")
    else:
        sys.exit("usage: retrieval_mutation.py apply|revert")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
