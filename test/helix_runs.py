"""Real ``--tp 4`` servers shared by test_helix_weights.py and test_helix_capacity.py.

Each layout is started once per pytest session (``server_run``), asked for its per-rank weight
checksums (``POST /weights_checker {"action": "checksum"}``), stopped (no orphans, no sgl_kernel
stub call), and its log kept; both test modules read the cached ``Run``. Four servers in all:

    q8k4 --tp 4 --helix-kvp-size 2   (K = N; TPA 2)
    q8k2 --tp 4 --helix-kvp-size 2   (K < N; TPA 2, one KV head per TPA rank)
    q8k1 --tp 4 --helix-kvp-size 4   (K = 1; TPA 1, qkv_proj replicated on all ranks)
    q8k4 --tp 4                      (plain TP: the capacity baseline; the check that the
                                      tests' shard reference agrees with upstream's TP loader
                                      reads the shared plain --tp 4 reference server instead)

Memory settings, identical for all four: the CPU engine's free-memory reading is pinned to
``PINNED_AVAILABLE_BYTES`` (``helix_pinned_memory/sitecustomize.py``) and
``--mem-fraction-static MEM_FRACTION_STATIC``, so every rank's KV budget is exactly
``BUDGET_BYTES_PER_RANK`` (0.25 GiB; 1 GiB for the four ranks), whatever else runs on the machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from conftest import GQA, start_server, stop_server
from sglang_helix.testing.cpu_env import STUB_DIR
from sglang_helix.testing.tiny_models import TinyModelSpec
from sglang_helix.testing.weights import weight_checksums

PIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helix_pinned_memory")
PINNED_AVAILABLE_BYTES = 2 << 30  # what every process of the server sees as free memory
MEM_FRACTION_STATIC = 0.125
# _profile_available_bytes: available - available_before_load * (1 - f) = 2 GiB * 0.125
BUDGET_BYTES_PER_RANK = PINNED_AVAILABLE_BYTES * MEM_FRACTION_STATIC

N = 4
K4 = GQA  # 8 query heads, 4 KV heads, head_dim 16, 2 layers
K2 = TinyModelSpec(num_heads=8, num_kv_heads=2, head_dim=16, num_layers=2)
K1 = TinyModelSpec(num_heads=8, num_kv_heads=1, head_dim=16, num_layers=2)

# (spec, --tp, --helix-kvp-size): 1 means plain TP (no Helix flag at all).
HELIX_K4 = (K4, N, 2)
HELIX_K2 = (K2, N, 2)
HELIX_K1 = (K1, N, 4)
# Plain TP on the K = N model: no KV head is replicated (GPU) or padded (the CPU engine pads K
# up to a multiple of --tp, see test_helix_capacity.py), so upstream's TP loader is exercised
# on exactly the sharding the reference describes.
PLAIN_K4 = (K4, N, 1)


def layout_id(layout) -> str:
    spec, tp, kvp = layout
    tail = f"kvp{kvp}" if kvp > 1 else "plain"
    return f"q{spec.num_heads}k{spec.num_kv_heads}-tp{tp}-{tail}"


_TAG = r"\[[^\]]*? TP(\d+)\] "
_KV_ALLOC = re.compile(
    _TAG + r"KV Cache is allocated\. dtype: \S+, #tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB"
)
_HELIX_KV = re.compile(_TAG + r"DCP GQA KV: (\d+) rows per rank x KVP (\d+) = (\d+) logical tokens")
_MAX_TOTAL = re.compile(_TAG + r"max_total_num_tokens=(\d+),")
_LOAD_AVAIL = re.compile(_TAG + r"Load weight begin\. avail mem=([\d.]+) GB")


@dataclass
class Capacity:
    """What one server logged about its KV pool (per TP rank where the log is per rank)."""

    max_total_num_tokens: dict = field(default_factory=dict)  # tp_rank -> global capacity (TP0 logs it)
    rows: dict = field(default_factory=dict)  # tp_rank -> KV pool rows ("#tokens")
    kv_gib: dict = field(default_factory=dict)  # tp_rank -> K size + V size (GiB, 2 decimals)
    helix: dict = field(default_factory=dict)  # tp_rank -> (rows per rank, KVP, logical tokens)
    avail_gib: dict = field(default_factory=dict)  # tp_rank -> free memory the rank saw at load

    @classmethod
    def parse(cls, log: str) -> "Capacity":
        c = cls()
        for m in _KV_ALLOC.finditer(log):
            c.rows[int(m[1])] = int(m[2])
            c.kv_gib[int(m[1])] = float(m[3]) + float(m[4])
        for m in _HELIX_KV.finditer(log):
            c.helix[int(m[1])] = (int(m[2]), int(m[3]), int(m[4]))
        for m in _MAX_TOTAL.finditer(log):
            c.max_total_num_tokens[int(m[1])] = int(m[2])
        for m in _LOAD_AVAIL.finditer(log):
            c.avail_gib[int(m[1])] = float(m[2])
        return c

    @property
    def global_tokens(self) -> int:
        return self.max_total_num_tokens[0]


@dataclass
class Run:
    spec: TinyModelSpec
    tp: int
    kvp: int
    model_path: str
    checksums: dict  # tp_rank -> {parameter name: hex hash}
    log: str
    log_path: str

    @property
    def tpa(self) -> int:
        return self.tp // self.kvp

    @property
    def capacity(self) -> Capacity:
        return Capacity.parse(self.log)


_runs: dict = {}


def server_args(tp: int, kvp: int) -> list:
    args = ["--tp", str(tp), "--mem-fraction-static", str(MEM_FRACTION_STATIC)]
    if kvp > 1:
        args += ["--helix-kvp-size", str(kvp)]
    return args


def pinned_memory_env() -> dict:
    path = [PIN_DIR, STUB_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(path), "HELIX_TEST_AVAILABLE_MEMORY_BYTES": str(PINNED_AVAILABLE_BYTES)}


def server_run(model_dir, log_dir: str, layout) -> Run:
    """Start the layout's server once per session, fetch checksums, stop it; cache the result
    (a failure too, so that the second test module does not pay for a second failing start)."""
    if layout not in _runs:
        spec, tp, kvp = layout
        path = model_dir(spec)
        try:
            srv = start_server(path, server_args(tp, kvp), "torch_native", log_dir, pinned_memory_env())
            try:
                checksums = weight_checksums(srv.base_url)
            finally:
                stop_server(srv)
            _runs[layout] = Run(spec, tp, kvp, path, checksums, srv.log_text(), srv.log_path)
        except Exception as e:  # re-raised below, and for every later user of the layout
            _runs[layout] = e
    run = _runs[layout]
    if isinstance(run, Exception):
        raise RuntimeError(f"{layout_id(layout)}: server run failed earlier in this session") from run
    return run
