"""The mutation check of issue 46: break the GQA mode's KV layout in the *installed* sglang, so that
the retrieval test and a random-model test can be run against the broken layout.

    .venv/bin/python benchmark/retrieval_mutation.py apply    # break it
    .venv/bin/python benchmark/retrieval_mutation.py revert   # restore the series' bytes
    bash scripts/setup.sh --check                             # must say applied afterwards

The change: torch_native's DCP lists (``dcp_torch_metadata`` in ``layers/dcp/torch_attention.py``, the
rows of the keys a rank attends to, for prefill and decode alike) point, on KVP rank 1 only, its owned
chunk number ``DROP_LOCAL_CHUNK`` (global positions ``[DROP_LOCAL_CHUNK * chunk * KVP + chunk, ... + 2 *
chunk)``) at row 0, the reserved page's row, instead of their own rows. The rank then attends to the
wrong K/V for those ``chunk`` positions: a silently wrong attention, no crash. With chunk 64 and KVP 3
that is positions 1792-1855, which hold the key of the retrieval test's ~2K-token prompt at 90 % depth
(token 1812); with chunk 4 and KVP 2 positions 76-79 (inside the random-model tests' ~300-token prompt).

The original file is kept next to it as ``torch_attention.py.orig-mutation`` and put back by ``revert``.
"""

from __future__ import annotations

import os
import shutil
import sys

DROP_LOCAL_CHUNK = 9

ANCHOR = "    indptr_host = indptr.tolist()  # (the CPU path: host values are free)\n"
MUTATED = (
    "    if k == 1:  # MUTATION (benchmark/retrieval_mutation.py): one owned chunk reads row 0\n"
    "        req = torch.repeat_interleave(torch.arange(len(local_lens)), local_lens, output_size=total)\n"
    "        local = torch.arange(total) - indptr[:-1].long()[req]\n"
    f"        indices[(local // c) == {DROP_LOCAL_CHUNK}] = 0\n"
) + ANCHOR


def target() -> str:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    return os.path.join(os.path.dirname(spec.origin), "srt", "layers", "dcp", "torch_attention.py")


def main(mode: str) -> None:
    path = target()
    backup = path + ".orig-mutation"
    if mode == "apply":
        text = open(path).read()
        assert text.count(ANCHOR) == 1, f"{path}: the anchor is not there once (already mutated?)"
        shutil.copy2(path, backup)
        with open(path, "w") as f:
            f.write(text.replace(ANCHOR, MUTATED))
        print(f"mutated {path} (rank 1 reads row 0 for its owned chunk {DROP_LOCAL_CHUNK}); backup {backup}")
    elif mode == "revert":
        assert os.path.exists(backup), f"no backup at {backup}"
        shutil.copyfile(backup, path)  # new mtime: the stale .pyc is recompiled
        os.remove(backup)
        print(f"restored {path}")
    else:
        sys.exit("usage: retrieval_mutation.py apply|revert")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
