"""Read a CPU server's KV pool state: rank 0 over HTTP, every rank from its own checks in the log.

Upstream's debug checks (``DEBUG_ENV``) make every scheduler rank check its own allocator after
every batch and whenever it is idle, and log its counts; a failed check raises in that rank's
scheduler, which takes the server down. ``busy_counts`` reads the per-rank counts back from the
log, ``wait_idle`` / ``loads`` read rank 0's view through ``/v1/loads``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

DEBUG_ENV = {
    # the paged allocator asserts after every free that its free list holds no page twice
    "SGLANG_DEBUG_MEMORY_POOL": "1",
    # after every batch, every rank asserts available + evictable + protected + uncached == total
    # and logs "[Mem Check (BUSY)] [full] total=..., available=..., ... uncached=..."
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "2",
    # after every batch: no page both owned by a request and free, no page free twice
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
    # whenever a rank is idle: nothing is held but what the prefix cache holds
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
}
# A line with one of these in the server log is a check that fired.
LEAK_PATTERNS = [
    "memory leak detected", "Mem Leak Detected", "double free", "use-after-free",
    "AssertionError", "hit an exception",
]  # fmt: skip
BUSY_RE = re.compile(r"TP(\d+)\] \[Mem Check \(BUSY\)\] \[full\] total=(\d+), available=(\d+), .*uncached=(\d+)")
RETRACT_LINE = "KV cache pool is full. Retract requests."


def post(base_url: str, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read()
    try:
        return json.loads(data) if data else {}
    except ValueError:  # some control endpoints answer plain text
        return {"text": data.decode(errors="replace")}


def get(base_url: str, path: str, timeout: float = 60):
    with urllib.request.urlopen(base_url + path, timeout=timeout) as r:
        return r.status, r.read()


def loads(base_url: str) -> dict:
    """Rank 0's scheduler load: num_running_reqs, num_waiting_reqs, num_used_tokens, ..."""
    status, body = get(base_url, "/v1/loads")
    assert status == 200
    data = json.loads(body)
    out = data["loads"] if isinstance(data, dict) and "loads" in data else data
    return out[0] if isinstance(out, list) else out


def wait_idle(base_url: str, timeout: float = 300) -> dict:
    """Until rank 0 has no running or waiting request and no used token."""
    deadline = time.monotonic() + timeout
    while True:
        load = loads(base_url)
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 and load["num_used_tokens"] == 0:
            return load
        assert time.monotonic() < deadline, f"server not idle after {timeout}s: {load}"
        time.sleep(0.5)


def busy_counts(log: str) -> dict:
    """``{tp_rank: [(total, available, uncached), ...]}`` from the busy-check lines, in log order."""
    out: dict = {}
    for m in BUSY_RE.finditer(log):
        out.setdefault(int(m.group(1)), []).append(tuple(int(x) for x in m.group(2, 3, 4)))
    return out


def ranks_disagree(log: str) -> list:
    """Where a rank's busy checks part from TP0's. Every rank runs the same batches on an allocator
    that is rank-invariant by design, so the k-th check of every rank logs the same
    ``(total, available, uncached)``: a page kept or lost on one rank shows here, where rank 0's
    ``/v1/loads`` cannot see it and upstream's conservation check, which excuses DCP, does not fail."""
    counts = busy_counts(log)
    ref = counts.get(0, [])
    out = []
    for rank, seq in sorted(counts.items()):
        if len(seq) != len(ref):
            out.append(f"TP{rank}: {len(seq)} busy checks, TP0: {len(ref)}")
        k = next((i for i, (a, b) in enumerate(zip(seq, ref)) if a != b), None)
        if k is not None:
            out.append(f"TP{rank}: busy check {k} (total, available, uncached) = {seq[k]}, TP0's {ref[k]}")
    return out


def fired_checks(log: str) -> list:
    """Log lines of checks that fired (empty when every rank's checks passed)."""
    return [line for line in log.splitlines() if any(p in line for p in LEAK_PATTERNS)]
