"""Bytecode for the series' files in the installed SGLang, compiled once (test machinery).

``series.install`` clears the bytecode of every file it patches or adds, so that no stale ``.pyc``
outlives a change; Python writes it again on the next import, unless ``PYTHONDONTWRITEBYTECODE``
is set (as on the CI machines), in which case every process that imports SGLang compiles those
files from source: ~2.7 MB, ~1 CPU-s a process, and a ``--tp 4`` test server starts six. This
writes the ``.pyc`` files that are missing or stale (``py_compile``'s default timestamp check, the
one imports use), for the installed series' files only. Best effort: a file that does not compile
is left to the import that will report it.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile


def compile_series_bytecode() -> int:
    """Compile the series' installed ``.py`` files whose bytecode is missing or stale; return how many."""
    try:
        from sglang_helix.series import Installed, Series

        series, inst = Series(), Installed.find()
        rels = series.touched_files() + series.new_files
    except Exception:
        return 0
    done = 0
    for rel in rels:
        src = inst.site / rel
        if not rel.endswith(".py") or not src.is_file():
            continue
        try:
            cfile = importlib.util.cache_from_source(str(src))
            st = os.stat(src)
            with open(cfile, "rb") as f:
                head = f.read(16)
            # flags 0 (timestamp pyc), then the source's mtime and size: current
            if (
                len(head) == 16
                and int.from_bytes(head[4:8], "little") == 0
                and int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF
            ):
                continue
        except OSError:
            pass
        try:
            py_compile.compile(str(src), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
            done += 1
        except (py_compile.PyCompileError, OSError):
            pass
    return done
