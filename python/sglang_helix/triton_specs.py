"""The Triton kernels Helix launches, at the exact specializations the server uses, compiled
for the GPU on a machine without one (issue 35).

Three parts:

- **record**: under ``TRITON_INTERPRET=1`` a kernel launch goes through
  ``InterpretedFunction.run``. ``Recorder`` wraps it (in the test harness only, never in the
  runtime) and computes, for each launch of a tracked kernel, what ``JITFunction.run`` would
  compute on a GPU: the signature (argument dtypes), the integer/pointer specializations
  (``tt.divisibility`` 16, ``== 1`` folded into a constexpr), the constexprs and the launch
  options (``num_warps``, ``num_stages``, ...). Triton's own binder does it
  (``create_function_from_signature`` with the CUDA backend), so the record is what the compiler
  would be asked for.
- **fixture**: ``test/data/helix_triton_specializations.json``, the union of what the in-process
  Helix tests and the unit-level model shapes (``sglang_helix.triton_shapes``) launch.
  Regenerate: ``.venv/bin/python -m sglang_helix.triton_specs record``.
- **compile**: each specialization with ``triton.compile(ASTSource(...), target=GPUTarget("cuda",
  90|100, 32))`` in a process without ``TRITON_INTERPRET``, with ``ptxas -v``'s registers, spills
  and the shared memory. Results are cached by the kernel's source hash (``JITFunction.cache_key``:
  the source and every jit function it calls), the specialization, the target and the Triton
  version, under ``~/.cache/sglang-helix/triton-compile`` (``HELIX_TRITON_COMPILE_CACHE``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(os.environ.get("HELIX_TRITON_FIXTURE", REPO / "test" / "data" / "helix_triton_specializations.json"))
CACHE_DIR = Path(
    os.environ.get("HELIX_TRITON_COMPILE_CACHE", Path.home() / ".cache" / "sglang-helix" / "triton-compile")
)
TARGETS = {"sm90": ("cuda", 90, 32), "sm100": ("cuda", 100, 32)}
# Shared memory per block a kernel may use (opt-in maximum): H100 227 KiB, B200 227 KiB.
SHARED_LIMIT = {"sm90": 232448, "sm100": 232448}

# The kernel modules of the Helix path (decode, extend, DCP lists/pack/combine, split counts).
TRACKED_MODULES = (
    "sglang.kernels.ops.attention.decode_attention",
    "sglang.kernels.ops.attention.extend_attention",
    "sglang.kernels.ops.attention.dcp_kernels",
    "sglang.kernels.ops.attention.metadata",
)
# Kernels whose compiled form must not spill (decode stage 1 / stage 2).
NO_SPILL = ("_fwd_kernel_stage1", "_fwd_grouped_kernel_stage1", "_fwd_kernel_stage2")


# --------------------------------------------------------------------------------------------
# Specializations as JSON
# --------------------------------------------------------------------------------------------
def _json_value(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    name = type(v).__name__
    if name == "dtype":  # tl.dtype
        return {"tl.dtype": str(v)}
    if hasattr(v, "value") and name == "constexpr":
        return _json_value(v.value)
    raise TypeError(f"constexpr value of type {name} not recorded: {v!r}")


def _py_value(v):
    if isinstance(v, dict) and "tl.dtype" in v:
        import triton.language as tl

        return getattr(tl, v["tl.dtype"]) if hasattr(tl, v["tl.dtype"]) else tl.dtype(v["tl.dtype"])
    return v


def spec_key(spec: dict) -> str:
    """A specialization's identity: kernel, argument types, specializations, constexprs, options."""
    return json.dumps({k: spec[k] for k in ("kernel", "args", "options")}, sort_keys=True)


_TRACKED_FILES: dict = {}


def _tracked_module(fn, modules=TRACKED_MODULES):
    """The tracked module ``fn`` is defined in, by its file (a test may load the installed kernel
    file under another module name), or None."""
    if not _TRACKED_FILES:
        import importlib.util

        for m in TRACKED_MODULES:
            spec = importlib.util.find_spec(m)
            if spec is not None and spec.origin:
                _TRACKED_FILES[os.path.realpath(spec.origin)] = m
    m = _TRACKED_FILES.get(os.path.realpath(fn.__code__.co_filename))
    return m if m in modules else None


def _kernel_name(fn) -> str:
    return f"{_tracked_module(fn) or fn.__module__}:{fn.__qualname__}"


_BINDERS: dict = {}


def _binder(fn, kwargs):
    """Triton's own binder for ``fn`` (a JITFunction built beside the interpreted one)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    key = id(fn)
    if key not in _BINDERS:
        jf = JITFunction(
            fn,
            do_not_specialize=kwargs.get("do_not_specialize"),
            do_not_specialize_on_alignment=kwargs.get("do_not_specialize_on_alignment"),
        )
        backend = make_backend(GPUTarget(*TARGETS["sm90"]))
        _BINDERS[key] = (jf, backend, create_function_from_signature(jf.signature, jf.params, backend))
        del triton
    return _BINDERS[key]


def specialization_of(fn, interp_kwargs, args, kwargs) -> dict:
    """What ``JITFunction.run`` would specialize a launch ``fn[grid](*args, **kwargs)`` on."""
    jf, backend, binder = _binder(fn, interp_kwargs)
    bound, spec, _opts = binder(*args, **kwargs)
    names = [p.name for p in jf.params]
    out_args = []
    for name, (ty, val) in zip(names, spec):
        if ty == "constexpr":
            out_args.append([name, "constexpr", _json_value(val)])
        else:
            out_args.append([name, ty, val])
    options = {k: _json_value(v) for k, v in sorted(kwargs.items()) if k not in names}
    return {"kernel": _kernel_name(fn), "args": out_args, "options": options}


class Recorder:
    """Wraps ``InterpretedFunction.run``: records each tracked launch's specialization."""

    def __init__(self, modules=TRACKED_MODULES):
        self.modules = tuple(modules)
        self.specs: dict[str, dict] = {}
        self.sources: dict[str, str] = {}  # spec key -> which test/shape launched it first
        self.errors: list[str] = []
        self.context = ""
        self._orig = None

    def install(self):
        from triton.runtime.interpreter import InterpretedFunction

        if self._orig is not None:
            return self
        orig = InterpretedFunction.run
        recorder = self

        def run(self_, *args, grid, warmup, **kwargs):
            if not warmup and _tracked_module(self_.fn, recorder.modules):
                try:
                    spec = specialization_of(self_.fn, self_.kwargs, args, kwargs)
                except Exception as e:  # noqa: BLE001 - a record failure must not change the test
                    recorder.errors.append(f"{_kernel_name(self_.fn)}: {type(e).__name__}: {e}")
                else:
                    key = spec_key(spec)
                    if key not in recorder.specs:
                        recorder.specs[key] = spec
                        recorder.sources[key] = recorder.context
            return orig(self_, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        self._orig = orig
        return self

    def uninstall(self):
        from triton.runtime.interpreter import InterpretedFunction

        if self._orig is not None:
            InterpretedFunction.run = self._orig
            self._orig = None

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()


# --------------------------------------------------------------------------------------------
# The fixture
# --------------------------------------------------------------------------------------------
def load_fixture(path: Path = FIXTURE) -> list[dict]:
    return json.loads(Path(path).read_text())["specializations"]


def write_fixture(specs: list[dict], sources: dict, path: Path = FIXTURE) -> None:
    specs = sorted(specs, key=spec_key)
    rows = []
    for s in specs:
        row = dict(s)
        src = sources.get(spec_key(s))
        if src:
            row["first_launched_by"] = src
        rows.append(row)
    doc = {
        "about": "Triton kernel specializations the Helix path launches (issue 35). Regenerate: "
        ".venv/bin/python -m sglang_helix.triton_specs record",
        "specializations": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    body = ",\n".join(json.dumps(r, sort_keys=True) for r in rows)  # one specialization a line
    path.write_text(f'{{"about": {json.dumps(doc["about"])},\n"specializations": [\n{body}\n]}}\n')


def missing_from_fixture(specs, path: Path = FIXTURE) -> list[dict]:
    known = {spec_key(s) for s in load_fixture(path)}
    return [s for s in specs if spec_key(s) not in known]


def describe(spec: dict) -> str:
    """One line: the kernel, its non-default specialization and options."""
    parts = []
    for name, ty, val in spec["args"]:
        if ty == "constexpr":
            parts.append(f"{name}={val}")
        else:
            parts.append(f"{name}:{ty}{'/' + val if val else ''}")
    opts = ",".join(f"{k}={v}" for k, v in spec["options"].items())
    return f"{spec['kernel']}({', '.join(parts)}) [{opts}]"


# --------------------------------------------------------------------------------------------
# Which patch owns a kernel
# --------------------------------------------------------------------------------------------
def owning_patches(kernel: str, repo: Path = REPO) -> list[str]:
    """The patches whose hunks fall in ``kernel``'s function (by the hunk's ``def`` context or
    an added ``def``), else 'upstream (no patch changes it)'."""
    module, qualname = kernel.split(":")
    rel = "python/" + module.replace(".", "/") + ".py"
    fn = qualname.split(".")[-1]
    owners = []
    for patch in sorted((repo / "patches").glob("*.patch")):
        text = patch.read_text(errors="replace")
        on = False
        for line in text.splitlines():
            if line.startswith("diff --git"):
                on = line.endswith("b/" + rel)
            elif on and line.startswith("@@") and re.search(rf"def {re.escape(fn)}\(", line):
                owners.append(patch.name)
                break
            elif on and line.startswith("+") and re.match(rf"\+def {re.escape(fn)}\(", line):
                owners.append(patch.name)
                break
    return owners


# --------------------------------------------------------------------------------------------
# Compile (in a process without TRITON_INTERPRET)
# --------------------------------------------------------------------------------------------
_PTXAS_RE = {
    "regs": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def _jit_function(kernel: str, variant: str | None = None):
    """The JITFunction of ``kernel``; ``variant == "upstream"``: the pinned wheel's own (pristine)
    kernel, loaded from the wheel's file."""
    import importlib

    module, qualname = kernel.split(":")
    if variant == "upstream":
        obj = _pristine_module(module)
    else:
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_PRISTINE: dict = {}


def _pristine_module(module: str):
    import importlib.util
    import zipfile

    if module not in _PRISTINE:
        from sglang_helix.series import pinned_wheel

        rel = module.replace(".", "/") + ".py"
        with zipfile.ZipFile(pinned_wheel()) as z:
            data = z.read(rel)
        path = CACHE_DIR / "pristine" / hashlib.sha256(data).hexdigest()[:16] / rel.replace("/", "_")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        name = "_helix_pristine_" + module.replace(".", "_")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _PRISTINE[module] = mod
    return _PRISTINE[module]


class NotApplicable(Exception):
    """The kernel at this tree has no argument for a feature the specialization turns on."""


_OFF = (None, False, 0)


def adapt(spec: dict, fn) -> list:
    """``spec``'s arguments for ``fn``'s signature (an older or pristine kernel): an argument the
    kernel lacks is dropped if it is a constexpr at an "off" value (None / False / 0) or a runtime
    value (its feature's flag decides), else ``NotApplicable``; one the spec lacks takes its
    default."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    have = {name: (ty, val) for name, ty, val in spec["args"]}
    names = [p.name for p in fn.params]
    for name, (ty, val) in have.items():
        if name not in names and ty == "constexpr" and val not in _OFF:
            raise NotApplicable(f"{name}={val}")
    backend = make_backend(GPUTarget(*TARGETS["sm90"]))
    out = []
    for p in fn.params:
        if p.name in have:
            out.append([p.name, *have[p.name]])
        elif not p.has_default:
            raise NotApplicable(f"{p.name} has no default and no recorded value")
        elif p.is_constexpr or p.default is None:
            out.append([p.name, "constexpr", _json_value(p.default)])
        else:
            ty, val = native_specialize_impl(backend, p.default, False, True, True)
            out.append([p.name, ty, val if ty != "constexpr" else _json_value(val)])
    return out


def _compile_inputs(spec: dict, target_name: str, variant: str | None = None):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    fn = _jit_function(spec["kernel"], variant)
    if variant == "upstream":
        spec = upstream_spec(spec)
    backend = make_backend(GPUTarget(*TARGETS[target_name]))
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, ty, val) in enumerate(adapt(spec, fn)):
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = _py_value(val)
            attrs[(i,)] = []
        else:
            attrs[(i,)] = backend.parse_attr(val) if isinstance(val, str) else []
    options = backend.parse_options(dict(spec["options"]))
    return fn, signature, constexprs, attrs, options


def cache_entry(spec: dict, target_name: str, variant: str | None = None) -> Path:
    import triton

    fn = _jit_function(spec["kernel"], variant)
    key = spec_key(upstream_spec(spec) if variant == "upstream" else spec)
    h = hashlib.sha256(
        json.dumps([fn.cache_key, key, target_name, variant, triton.__version__], sort_keys=True).encode()
    ).hexdigest()
    return CACHE_DIR / h[:2] / f"{h}.json"


def compile_one(spec: dict, target_name: str, variant: str | None = None, use_cache: bool = True) -> dict:
    """Compile ``spec`` for ``target_name``: {ok, error, regs, spill_stores, spill_loads, shared,
    seconds, cached}; ``{"skipped": reason}`` where the kernel of this tree lacks a feature the
    specialization uses (an earlier prefix of the series)."""
    try:
        entry = cache_entry(spec, target_name, variant)
    except Exception as e:  # noqa: BLE001 - the kernel does not import: a compile error
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "cached": False}
    if use_cache and entry.exists():
        try:
            cached = json.loads(entry.read_text())
            if not _decode_spill(spec, cached):  # a spill is compiled again, never read back
                return {**cached, "cached": True}
        except (OSError, ValueError):
            pass
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.time()
    result: dict = {"ok": False}
    try:
        fn, signature, constexprs, attrs, options = _compile_inputs(spec, target_name, variant)
    except NotApplicable as e:
        return {"ok": True, "skipped": str(e), "cached": False}
    try:
        triton.knobs.nvidia.dump_ptxas_log = True
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            ck = triton.compile(
                ASTSource(fn, signature, constexprs, attrs),
                target=GPUTarget(*TARGETS[target_name]),
                options=options.__dict__,
            )
        log = buf.getvalue()
        result = {"ok": True, "shared": int(ck.metadata.shared), "num_warps": ck.metadata.num_warps}
        for k, rx in _PTXAS_RE.items():
            vals = [int(x) for x in rx.findall(log)]
            result[k] = max(vals) if vals else None
    except Exception as e:  # noqa: BLE001 - reported with the kernel and specialization
        msg = f"{type(e).__name__}: {e}"
        result = {"ok": False, "error": msg[-4000:]}
    result["seconds"] = round(time.time() - t0, 3)
    if use_cache:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, entry)
    return {**result, "cached": False}


def jobs(specs: list[dict], upstream: bool = True, owned_only: bool = False) -> list[tuple[int, str, str | None]]:
    """(spec index, target, variant) to compile: every spec for both targets; for a kernel the
    series changes, also the pinned wheel's own kernel at the same shape with the series' flags
    off (variant "upstream"), once per distinct such shape."""
    out = []
    seen_up = set()
    owners = {}
    for i, s in enumerate(specs):
        if s["kernel"] not in owners:
            owners[s["kernel"]] = owning_patches(s["kernel"])
        if owned_only and not owners[s["kernel"]]:
            continue
        for t in TARGETS:
            out.append((i, t, None))
        if upstream and (owners[s["kernel"]] or s["kernel"].split(":")[1] in FLAGS_OFF):
            k = spec_key(upstream_spec(s))
            if k not in seen_up:
                seen_up.add(k)
                for t in TARGETS:
                    out.append((i, t, "upstream"))
    return out


_SERIES_ONLY: dict = {}


def series_only_args(kernel: str) -> set:
    """The arguments of ``kernel`` that the pinned wheel's kernel does not have (the series' own),
    from the wheel's source (parsed, not imported)."""
    if kernel not in _SERIES_ONLY:
        import ast
        import importlib.util
        import zipfile

        from sglang_helix.series import pinned_wheel

        module, qualname = kernel.split(":")
        fn = qualname.split(".")[-1]
        rel = module.replace(".", "/") + ".py"

        def params(src):
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.FunctionDef) and node.name == fn:
                    a = node.args
                    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            return None

        with zipfile.ZipFile(pinned_wheel()) as z:
            pristine = params(z.read(rel).decode())
        patched = params(Path(importlib.util.find_spec(module).origin).read_text())
        _SERIES_ONLY[kernel] = set(patched or []) - set(pristine or patched or [])
    return _SERIES_ONLY[kernel]


# Upstream features Helix turns on in a kernel the series does not change, and their values in
# plain TP's launch: Helix's three extend calls store the LSE and skip the prefix or the extend
# part; plain TP's one call does neither.
FLAGS_OFF = {
    "_fwd_kernel": {"LSE_Extend": None, "STORE_LSE": False, "SKIP_PREFIX": False, "SKIP_EXTEND": False},
}


def upstream_spec(spec: dict) -> dict:
    """``spec`` as upstream runs the pinned wheel's kernel: without the series' own arguments
    (their features off: the arguments stage 2 had before the series) and with the upstream
    features Helix turns on off (``FLAGS_OFF``)."""
    drop = series_only_args(spec["kernel"])
    off = FLAGS_OFF.get(spec["kernel"].split(":")[1], {})
    args = [[n, "constexpr", off[n]] if n in off else [n, t, v] for n, t, v in spec["args"] if n not in drop]
    return {**spec, "args": args}


def _decode_spill(spec: dict, r: dict) -> bool:
    fn = spec["kernel"].split(":")[1]
    return fn in NO_SPILL and r.get("ok") and bool(r.get("spill_stores") or r.get("spill_loads"))


def _worker(payload_path: str, out_path: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    payload = json.loads(Path(payload_path).read_text())
    results = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # ptxas runs (and logs) for every miss of ours
        for spec, target, variant, use_cache in payload:
            r = compile_one(spec, target, variant, use_cache)
            if _decode_spill(spec, r):  # never kept: it is tried again (``_retry_decode_spills``)
                cache_entry(spec, target, variant).unlink(missing_ok=True)
            results.append(r)
    Path(out_path).write_text(json.dumps(results))


def _run_workers(items: list, procs: int) -> list[dict]:
    """Compile ``items`` ([spec, target, variant, use_cache]) in ``procs`` fresh worker processes
    without ``TRITON_INTERPRET``; the results in ``items``' order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The caller's PYTHONPATH first (an earlier prefix's tree), then the sgl_kernel stub (the
    # kernel modules import sglang, which imports sgl_kernel).
    from sglang_helix.testing.cpu_env import STUB_DIR

    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH", ""), STUB_DIR] if p)
    chunks = [list(range(w, len(items), procs)) for w in range(procs)]
    out: list = [None] * len(items)
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        for w, chunk in enumerate(chunks):
            if not chunk:
                continue
            pin = Path(tmp) / f"in{w}.json"
            pout = Path(tmp) / f"out{w}.json"
            pin.write_text(json.dumps([items[j] for j in chunk]))
            p = subprocess.Popen(
                [sys.executable, "-c", f"from sglang_helix.triton_specs import _worker; _worker({str(pin)!r}, {str(pout)!r})"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            running.append((p, chunk, pout))
        for p, chunk, pout in running:
            log, _ = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"compile worker failed (rc {p.returncode}):\n{log[-6000:]}")
            for j, r in zip(chunk, json.loads(pout.read_text())):
                out[j] = r
    return out


SPILL_TRIES = 3


def _retry_decode_spills(items: list, results: list, tries: int = SPILL_TRIES) -> list:
    """A decode-stage spill counts only if it comes back: each spilling specialization is compiled
    again, one at a time, in a fresh process (a fresh Triton cache), up to ``tries`` compiles in
    all. ptxas reported 4-12 B for upstream's stage 1 at sm_100 in three full CI runs (2026-12-06,
    2026-12-07: 168 registers where every other compile of it takes 175 and spills nothing, the
    second try in the same process spilling too), while 90 fresh-process compiles and a 222-compile
    worker sequence of the same specialization never did. A clean retry replaces the result (and
    is cached) with the spills it saw recorded (``unreproduced_spill``); a spill that every try
    reports stays a problem and is never cached, so a later run compiles it again."""
    results = list(results)
    for j, (item, r) in enumerate(zip(items, results)):
        spec = item[0]
        seen = []
        while _decode_spill(spec, r) and len(seen) + 1 < tries:
            seen.append([r["spill_stores"], r["spill_loads"]])
            [r] = _run_workers([item], 1)
        if seen and not _decode_spill(spec, r):
            r = {**r, "unreproduced_spill": seen}
        results[j] = r
    return results


def compile_all(specs: list[dict], procs: int | None = None, use_cache: bool = True, upstream: bool = True,
                owned_only: bool = False):
    """Compile every (spec, target[, upstream]) in ``procs`` worker processes without
    ``TRITON_INTERPRET``. Returns [(spec, target, variant, result)]."""
    todo = jobs(specs, upstream, owned_only)
    procs = procs or max(1, min(len(todo), os.cpu_count() or 1))
    # Round-robin by estimated cost (the decode kernels first) so the workers end together.
    order = sorted(range(len(todo)), key=lambda j: ("stage" not in specs[todo[j][0]]["kernel"], j))
    items = [[specs[todo[j][0]], todo[j][1], todo[j][2], use_cache] for j in order]
    results = _retry_decode_spills(items, _run_workers(items, procs))
    out: list = [None] * len(todo)
    for j, r in zip(order, results):
        out[j] = r
    return [(specs[i], t, f, r) for (i, t, f), r in zip(todo, out)]


def known_upstream_failure(spec: dict, result: dict) -> str | None:
    """Why a compile error is upstream's and expected, or None. Upstream's GQA decode stage 1 and
    extend kernels ``tl.dot`` an fp8 K at head dim < 32, which the compiler rejects (an fp8 MMA
    needs K >= 32); the interpreter runs it. Only the CPU harness's tiny models (head dim 16) with
    an fp8 KV cache launch that; no GPU model has such a head dim."""
    fn = spec["kernel"].split(":")[1]
    args = {n: (t, v) for n, t, v in spec["args"]}
    kv = (args.get("K_Buffer") or ("", None))[0]
    dim = (args.get("Lk") or args.get("Lq") or (None, 0))[1]
    if (
        fn in ("_fwd_grouped_kernel_stage1", "_fwd_kernel")
        and kv.startswith("*fp8")
        and isinstance(dim, int) and dim < 32
        and "K >= 32" in (result.get("error") or "")
    ):
        return "upstream: an fp8 tl.dot needs K >= 32 (head dim %d, CPU-harness tiny model)" % dim
    return None


def problems(results, allow_known: bool = True) -> list[str]:
    """Compile errors, spills in decode stage 1/2, shared memory over the limit, and a compile
    without its resource figures (no ``ptxas -v`` registers or spill lines: the spill check could
    not run). An upstream kernel's known failure (``known_upstream_failure``) is not a problem."""
    out = []
    for spec, target, variant, r in results:
        if r.get("skipped"):
            continue
        what = f"{describe(spec)} for {target}" + (" (the pinned wheel's kernel, flags off)" if variant else "")
        owner = ", ".join(owning_patches(spec["kernel"])) or "upstream (no patch changes this kernel)"
        if not r["ok"]:
            if allow_known and known_upstream_failure(spec, r):
                continue
            out.append(f"compile error: {what}; owned by {owner}:\n{r.get('error')}")
            continue
        fn = spec["kernel"].split(":")[1]
        absent = [k for k in ("regs", "spill_stores", "spill_loads") if r.get(k) is None]
        if absent:
            out.append(f"no resource figures ({', '.join(absent)} absent: no ptxas -v log): {what}; owned by {owner}")
        if fn in NO_SPILL and ((r.get("spill_stores") or 0) or (r.get("spill_loads") or 0)):
            out.append(f"spill ({r['spill_stores']} B stores, {r['spill_loads']} B loads): {what}; owned by {owner}")
        if r["shared"] > SHARED_LIMIT[target]:
            out.append(f"shared memory {r['shared']} B > {SHARED_LIMIT[target]} B: {what}; owned by {owner}")
    return out


# --------------------------------------------------------------------------------------------
# The resource table (benchmark/results/triton-compile.md)
# --------------------------------------------------------------------------------------------
_TABLE_KEYS = {
    "_fwd_grouped_kernel_stage1": ("Lk", "kv_group_num", "BLOCK_H", "BLOCK_N"),
    "_fwd_kernel_stage1": ("Lk", "kv_group_num", "BLOCK_N"),
    "_fwd_kernel_stage2": ("Lv", "MAX_KV_SPLITS", "HAS_OUTPUT_LSE", "O_HEAD_GROUP"),
    "_fwd_kernel": ("Lq", "BLOCK_M", "BLOCK_N", "SKIP_PREFIX", "SKIP_EXTEND", "STORE_LSE", "USE_CUSTOM_MASK"),
    "create_triton_kv_indices_for_dcp_triton": ("dcp_size", "interleave_size"),
    "_dcp_lse_combine_kernel": ("N", "HEAD_DIM", "RETURN_LSE"),
    "_dcp_pack_a2a_send_kernel": ("HEAD_DIM",),
    "get_num_kv_splits_triton": ("MAX_NUM_SEQ",),
}


# The README's table: stage 2's split extents (8..256) in one row (the heaviest shown).
_CONDENSED_KEYS = {**_TABLE_KEYS, "_fwd_kernel_stage2": ("Lv", "HAS_OUTPUT_LSE", "O_HEAD_GROUP")}


def shape_label(spec: dict, keys_by_kernel=None) -> str:
    fn = spec["kernel"].split(":")[1]
    args = {n: (t, v) for n, t, v in spec["args"]}
    keys = (keys_by_kernel or _TABLE_KEYS).get(fn) or [n for n, (t, _) in args.items() if t == "constexpr" and n.isupper()][:5]
    label = " ".join(f"{k}={args[k][1]}" for k in keys if k in args and args[k][0] == "constexpr")
    ptrs = [t for t, _ in args.values() if t.startswith("*")]
    kv = (args.get("K_Buffer") or ("", None))[0]
    q = (args.get("Q") or args.get("Q_Extend") or ("", None))[0]
    dt = f"q {q[1:]} kv {kv[1:]}" if kv else (ptrs[0][1:] if fn.startswith("_dcp") and ptrs else "")
    opts = spec["options"].get("num_warps")
    return " ".join(x for x in (label, dt, f"w{opts}" if opts else "") if x)


def _figure(spec, r):
    if r.get("skipped"):
        return None
    if not r["ok"]:
        return ("known upstream error (fp8 dot, K < 32)" if known_upstream_failure(spec, r) else "ERROR"), -1
    spill = (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0)
    return f"{r.get('regs')} / {spill} / {r.get('shared')}", (r.get("regs") or 0) + spill


def from_model_shapes(spec: dict) -> bool:
    """Launched first by the unit-level model shapes (``sglang_helix.triton_shapes``) at a GPU
    model's head dim (64 / 128), not the CPU harness's tiny ones."""
    args = {n: v for n, t, v in spec["args"] if t == "constexpr"}
    dim = args.get("Lk") or args.get("Lq") or args.get("Lv") or args.get("HEAD_DIM")
    return str(spec.get("first_launched_by", "")).startswith("triton_shapes") and (dim is None or dim >= 64)


def table(results, select=None, condensed: bool = False) -> str:
    """Markdown: one row per (kernel, shape label); per target Helix's registers / spill bytes
    (stores + loads) / static shared bytes, and the pinned wheel's kernel at the same shape with
    the series' flags off. Specializations that differ only in strides' divisibility or an
    unlisted constexpr share a row (the heaviest is shown). ``select(spec)``: which rows."""
    upstream = {}
    for spec, target, variant, r in results:
        fig = _figure(spec, r)
        if variant and fig:
            upstream[(spec_key(upstream_spec(spec)), target)] = fig
    rows: dict = {}
    changed = {s["kernel"].split(":")[1]: bool(owning_patches(s["kernel"])) for s, _, _, _ in results}

    def put(row, col, fig):
        if fig and (col not in row or fig[1] > row[col][1]):
            row[col] = fig

    for spec, target, variant, r in results:
        if variant or (select and not select(spec)):
            continue
        fn = spec["kernel"].split(":")[1]
        row = rows.setdefault((fn, shape_label(spec, _CONDENSED_KEYS if condensed else None)), {})
        put(row, (target, "helix"), _figure(spec, r))
        put(row, (target, "upstream"), upstream.get((spec_key(upstream_spec(spec)), target)))
    lines = [
        "| kernel | specialization | sm_90 Helix | sm_90 upstream | sm_100 Helix | sm_100 upstream |",
        "|---|---|---|---|---|---|",
    ]
    for (fn, label), row in sorted(rows.items()):
        cells = []
        for t in TARGETS:
            cells.append(row.get((t, "helix"), ("",))[0])
            cells.append(row.get((t, "upstream"), ("same kernel" if not changed.get(fn) else "n/a",))[0])
        lines.append(f"| `{fn}` | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
# Every in-process test (the full tier's too), not the servers (other processes) nor the per-prefix
# check (other trees): what test/conftest.py checks against the fixture is a subset of this run.
RECORD_PYTEST_ARGS = ["test", "-m", "not e2e", "-k", "not every_prefix and not test_triton_compile"]


def record(out: Path = FIXTURE, pytest_args=None) -> int:
    """Run the in-process tests (full tier) with ``HELIX_TRITON_RECORD`` (``test/conftest.py``
    records every launch of a tracked kernel) and the unit-level model shapes under the recorder,
    and write the fixture (~30 min on 2 cores). A failing test is reported; its launches are kept."""
    env = dict(os.environ, TRITON_INTERPRET="1", HELIX_TEST_FULL="1")
    rc_tests = 0
    with tempfile.TemporaryDirectory() as tmp:
        parts = []
        dump = Path(tmp) / "tests.json"
        env["HELIX_TRITON_RECORD"] = str(dump)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(pytest_args or RECORD_PYTEST_ARGS)]
        print("+", " ".join(cmd), flush=True)
        rc_tests = subprocess.call(cmd, cwd=REPO, env=env)
        if rc_tests not in (0, 5):
            print(f"record: pytest rc {rc_tests} (launches of the tests that ran are kept)", file=sys.stderr)
        if not dump.exists():
            return rc_tests or 1
        parts.append(json.loads(dump.read_text()))
        dump = Path(tmp) / "shapes.json"
        env.pop("HELIX_TRITON_RECORD")
        rc = subprocess.call([sys.executable, "-m", "sglang_helix.triton_shapes", "--record", str(dump)], cwd=REPO, env=env)
        if rc:
            return rc
        parts.append(json.loads(dump.read_text()))
    return merge_records(parts, out) or (rc_tests if rc_tests not in (0, 5) else 0)


def merge_records(parts: list, out: Path = FIXTURE) -> int:
    """Write the union of recorder dumps (``{"specs", "sources", "errors"}``) as the fixture."""
    specs, sources, errors = {}, {}, []
    for p in parts[-1:] + parts[:-1]:  # the model shapes (last) first: their rows are the table's
        for s, src in zip(p["specs"], p["sources"]):
            specs.setdefault(spec_key(s), s)
            sources.setdefault(spec_key(s), src)
        errors += p["errors"]
    if errors:
        print("record errors:\n" + "\n".join(sorted(set(errors))), file=sys.stderr)
        return 1
    write_fixture(list(specs.values()), sources, out)
    print(f"{len(specs)} specializations -> {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_helix.triton_specs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="regenerate the fixture from the in-process Helix tests")
    r.add_argument("--out", type=Path, default=FIXTURE)
    r.add_argument("pytest_args", nargs="*", help=f"default: {' '.join(RECORD_PYTEST_ARGS)}")
    c = sub.add_parser("compile", help="compile the fixture for sm_90 and sm_100; print the table")
    c.add_argument("--fixture", type=Path, default=FIXTURE)
    c.add_argument("--no-cache", action="store_true")
    c.add_argument("--procs", type=int, default=None)
    c.add_argument("--table", type=Path, default=None, help="write the markdown table of every row here")
    c.add_argument("--model-shapes-table", type=Path, default=None,
                   help="write the table of the unit-level model shapes' launches (benchmark/results/triton-compile.md) here")
    a = ap.parse_args(argv)
    if a.cmd == "record":
        return record(a.out, a.pytest_args or None)
    specs = load_fixture(a.fixture)
    t0 = time.time()
    res = compile_all(specs, a.procs, use_cache=not a.no_cache)
    print(table(res))
    if a.table:
        a.table.write_text(table(res) + "\n")
    if a.model_shapes_table:
        a.model_shapes_table.write_text(table(res, select=from_model_shapes, condensed=True) + "\n")
    bad = problems(res)
    print(f"\n{len(res)} compiles in {time.time() - t0:.0f} s; {len(bad)} problems")
    for b in bad:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
