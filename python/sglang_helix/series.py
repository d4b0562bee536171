"""The Helix patch series: install into / check / revert from an installed SGLang, and the
maintainer workflow (pristine tree, editable workspace, export, upstream branch).

The series has two parts, both in this repository:

- ``patches/NNNN-*.patch``: ``git format-patch`` files against the pinned SGLang release, with
  upstream-repo paths (``a/python/sglang/...``). They only modify upstream files.
- ``python/sglang/**``: new modules at their upstream import paths.

Installing into a virtualenv applies the patches to ``site-packages/sglang`` (``git apply -p2``)
and copies the new modules in. Whether the series is applied, and applied exactly, is decided
against the wheel's own ``RECORD`` hashes: reverse-applying the series to a copy of the touched
files must give back the pristine bytes. So ``check`` can say "applied", "pristine" or "modified",
and ``revert`` returns the tree to exactly what pip installed.

Commands (``python -m sglang_helix.series CMD``): install, check, revert, pristine DIR,
workspace DIR, export DIR, upstream-branch CHECKOUT, prefixes.

``prefixes`` checks that the series is bisectable: on a pristine tree it applies the patches one
by one with ``git am`` and, after each, imports every module touched so far and every new module,
probes whether DCP's GQA mode (``--dcp-size 2 --dcp-replicate-q-proj``) is accepted (only from
the first model patch on, which opts a model in), and runs that patch's own tests (``PREFIX_TESTS``) against the tree as it stands.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sglang_helix import PINNED_SGLANG_VERSION

REPO = Path(__file__).resolve().parents[2]
PRISTINE_TAG = f"v{PINNED_SGLANG_VERSION}-pristine"
GIT_ID = {
    "GIT_AUTHOR_NAME": "sglang-helix",
    "GIT_AUTHOR_EMAIL": "sglang-helix@localhost",
    "GIT_COMMITTER_NAME": "sglang-helix",
    "GIT_COMMITTER_EMAIL": "sglang-helix@localhost",
}


class SeriesError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# The series as files in this repository
# --------------------------------------------------------------------------------------------
@dataclass
class Series:
    repo: Path = REPO

    @property
    def patches(self) -> list[Path]:
        return sorted((self.repo / "patches").glob("*.patch"))

    @property
    def new_files(self) -> list[str]:
        """New modules, as paths relative to ``python/`` (e.g. ``sglang/srt/helix/x.py``)."""
        root = self.repo / "python"
        out = []
        for p in sorted((root / "sglang").rglob("*")) if (root / "sglang").exists() else []:
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                out.append(p.relative_to(root).as_posix())
        return out

    def touched_files(self) -> list[str]:
        """Upstream files the patches modify, relative to site-packages (``sglang/...``)."""
        touched = []
        for patch in self.patches:
            touched += [rel for rel in self.touched_files_of(patch) if rel not in touched]
        return touched

    @staticmethod
    def touched_files_of(patch: Path) -> list[str]:
        """Upstream files one patch modifies, relative to site-packages (``sglang/...``)."""
        touched = []
        for line in patch.read_text().splitlines():
            if line.startswith("+++ ") or line.startswith("--- "):
                path = line[4:].strip()
                if path == "/dev/null":
                    if line.startswith("+++ "):
                        raise SeriesError(f"{patch.name} deletes a file; the series only edits")
                    raise SeriesError(
                        f"{patch.name} creates a file; new files belong in python/ instead"
                    )
                rel = path.split("/", 1)[1]  # drop a/ or b/
                if not rel.startswith("python/"):
                    raise SeriesError(f"{patch.name}: path {path} is outside python/")
                rel = rel[len("python/") :]
                if rel not in touched:
                    touched.append(rel)
        return touched


# --------------------------------------------------------------------------------------------
# The installed SGLang
# --------------------------------------------------------------------------------------------
def _run(cmd, cwd=None, check=True, env=None, capture=True):
    full_env = dict(os.environ, **GIT_ID, **(env or {}))
    r = subprocess.run(cmd, cwd=cwd, env=full_env, text=True, capture_output=capture)
    if check and r.returncode != 0:
        raise SeriesError(f"{' '.join(map(str, cmd))} failed:\n{r.stdout}{r.stderr}")
    return r


def _sha256_b64(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@dataclass
class Installed:
    site: Path  # site-packages holding sglang/
    version: str
    record: dict[str, str]  # relative path -> sha256 (RECORD format)

    @classmethod
    def find(cls, python: str | None = None) -> "Installed":
        import importlib.metadata as md

        if python and Path(python).resolve() != Path(sys.executable).resolve():
            raise SeriesError("run this module with the target environment's python")
        try:
            dist = md.distribution("sglang")
        except md.PackageNotFoundError:
            raise SeriesError("sglang is not installed in this environment") from None
        site = Path(dist.locate_file(""))
        record = {}
        for f in dist.files or []:
            if f.hash is not None and f.hash.mode == "sha256":
                record[f.as_posix()] = f.hash.value
        return cls(site=site, version=dist.version, record=record)

    def require_pinned(self) -> None:
        if self.version != PINNED_SGLANG_VERSION:
            raise SeriesError(
                f"installed sglang is {self.version}, but sglang-helix is pinned to "
                f"sglang=={PINNED_SGLANG_VERSION}; install sglang=={PINNED_SGLANG_VERSION} "
                f"in a fresh environment (bash scripts/setup.sh creates one in .venv/)"
            )

    def is_pristine(self, rel: str) -> bool:
        p = self.site / rel
        return p.exists() and self.record.get(rel) == _sha256_b64(p)


# --------------------------------------------------------------------------------------------
# install / check / revert
# --------------------------------------------------------------------------------------------
def _git_apply(patch: Path, cwd: Path, reverse=False, check_only=False):
    cmd = ["git", "apply", "-p2", "--whitespace=nowarn"]
    if reverse:
        cmd.append("-R")
    if check_only:
        cmd.append("--check")
    cmd.append(str(patch))
    # --unsafe-paths is not needed: paths stay under cwd. GIT_DIR points nowhere so that an
    # enclosing repository (a venv inside a checkout) never changes how paths are resolved.
    return _run(cmd, cwd=cwd, check=False, env={"GIT_DIR": str(cwd / ".no-git")})


def state(series: Series, inst: Installed) -> tuple[str, list[str]]:
    """Return ("applied" | "pristine" | "modified", problems)."""
    touched = series.touched_files()
    problems = []
    for rel in touched:
        if rel not in inst.record:
            problems.append(f"{rel}: not a file of the sglang {inst.version} wheel")
    if problems:
        return "modified", problems
    new_present = [rel for rel in series.new_files if (inst.site / rel).exists()]
    upstream_pristine = all(inst.is_pristine(rel) for rel in touched)
    if upstream_pristine and not new_present:
        return "pristine", []
    # Reverse-apply the whole series to a copy of the touched files: it must give back the
    # wheel's bytes, or the tree is not exactly "pristine + series".
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for rel in touched:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if (inst.site / rel).exists():
                shutil.copy2(inst.site / rel, tmp / rel)
        for patch in reversed(series.patches):
            r = _git_apply(patch, tmp, reverse=True)
            if r.returncode != 0:
                problems.append(f"{patch.name} is not applied: {r.stderr.strip()}")
                break
        if not problems:
            for rel in touched:
                if inst.record.get(rel) != _sha256_b64(tmp / rel):
                    problems.append(f"{rel}: differs from pristine + series")
    for rel in series.new_files:
        src, dst = series.repo / "python" / rel, inst.site / rel
        if not dst.exists():
            problems.append(f"{rel}: new module missing")
        elif dst.read_bytes() != src.read_bytes():
            problems.append(f"{rel}: new module differs from python/{rel}")
    return ("applied" if not problems else "modified"), problems


def _clear_bytecode(inst: Installed, rels: list[str]) -> None:
    for rel in rels:
        p = inst.site / rel
        cache = p.parent / "__pycache__"
        if cache.is_dir():
            for pyc in cache.glob(p.stem + ".*.pyc"):
                pyc.unlink()


MANIFEST_DIR = ".sglang-helix-series"  # in site-packages: what install() changed, and backups


def _manifest(inst: Installed) -> Path:
    return inst.site / MANIFEST_DIR / "manifest.json"


def _restore_pristine(inst: Installed, series: Series | None = None) -> list[str]:
    """Undo whatever series install() last applied, from its backups; return the touched files."""
    manifest = _manifest(inst)
    if manifest.exists():
        data = json.loads(manifest.read_text())
        backups = inst.site / MANIFEST_DIR / "pristine"
        for rel in data["touched"]:
            shutil.copyfile(backups / rel, inst.site / rel)
    elif series is not None and state(series, inst)[0] == "applied":
        # No record (e.g. applied by hand), but the tree is exactly pristine + this series.
        data = {"touched": series.touched_files(), "new_files": series.new_files}
        for patch in reversed(series.patches):
            r = _git_apply(patch, inst.site, reverse=True)
            if r.returncode != 0:
                raise SeriesError(f"reverting {patch.name} failed:\n{r.stderr}")
    else:
        return []
    for rel in data["new_files"]:
        (inst.site / rel).unlink(missing_ok=True)
        parent = (inst.site / rel).parent
        while parent != inst.site and parent.is_dir():
            if any(p.name != "__pycache__" for p in parent.iterdir()):
                break
            shutil.rmtree(parent)
            parent = parent.parent
    _clear_bytecode(inst, data["touched"] + data["new_files"])
    bad = [rel for rel in data["touched"] if not inst.is_pristine(rel)]
    if bad:
        raise SeriesError(f"restored files do not match the wheel's RECORD: {bad}")
    shutil.rmtree(inst.site / MANIFEST_DIR, ignore_errors=True)
    return data["touched"]


def install(series: Series, inst: Installed) -> str:
    """Apply the series; if another version of it is installed, undo that one first."""
    inst.require_pinned()
    st, problems = state(series, inst)
    if st == "applied" and _manifest(inst).exists():
        return f"sglang {inst.version}: series already applied ({len(series.patches)} patches, {len(series.new_files)} new modules)"
    _restore_pristine(inst, series)
    touched = series.touched_files()
    bad = [rel for rel in touched if not inst.is_pristine(rel)]
    if bad:
        raise SeriesError(
            "these sglang files differ from the wheel and no series install recorded why: "
            f"{bad}. Reinstall sglang (pip install --force-reinstall --no-deps "
            f"sglang=={PINNED_SGLANG_VERSION}) and re-run."
        )
    backups = inst.site / MANIFEST_DIR / "pristine"
    for rel in touched:
        (backups / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(inst.site / rel, backups / rel)
    _manifest(inst).write_text(json.dumps({"touched": touched, "new_files": series.new_files}, indent=1))
    for patch in series.patches:
        r = _git_apply(patch, inst.site)
        if r.returncode != 0:
            _restore_pristine(inst)
            raise SeriesError(f"{patch.name} does not apply (tree restored to pristine):\n{r.stderr}")
    for rel in series.new_files:
        dst = inst.site / rel
        if dst.exists():
            _restore_pristine(inst)
            raise SeriesError(f"new module {rel} would overwrite an upstream file")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(series.repo / "python" / rel, dst)
    _clear_bytecode(inst, touched + series.new_files)
    st, problems = state(series, inst)
    if st != "applied":
        raise SeriesError("series did not verify after install:\n  " + "\n  ".join(problems))
    return f"sglang {inst.version}: applied {len(series.patches)} patches and {len(series.new_files)} new modules"


def revert(series: Series, inst: Installed) -> str:
    """Return every file a series install changed to the wheel's bytes, remove new modules."""
    touched = _restore_pristine(inst, series)
    st, problems = state(series, inst)
    if st != "pristine":
        raise SeriesError("tree is not pristine after revert:\n  " + "\n  ".join(problems))
    if not touched:
        return f"sglang {inst.version}: already pristine"
    return f"sglang {inst.version}: reverted {len(touched)} files to pristine"


def check(series: Series, inst: Installed) -> tuple[bool, str]:
    st, problems = state(series, inst)
    n = len(series.patches)
    if st == "applied":
        lines = [f"sglang {inst.version}: series applied ({n} patches, {len(series.new_files)} new modules)"]
        lines += [f"  applied  {p.name}" for p in series.patches]
        return True, "\n".join(lines)
    if st == "pristine":
        return True, f"sglang {inst.version}: pristine (series not applied; all {len(series.touched_files())} touched files match the wheel's RECORD)"
    return False, f"sglang {inst.version}: modified\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------------------------------
# Maintainer workflow: pristine tree, workspace, export, upstream branch
# --------------------------------------------------------------------------------------------
def pinned_wheel(cache: Path = REPO / ".cache" / "wheels") -> Path:
    if not list(cache.glob(f"sglang-{PINNED_SGLANG_VERSION}-*.whl")):
        cache.mkdir(parents=True, exist_ok=True)
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "-d", str(cache), f"sglang=={PINNED_SGLANG_VERSION}"],
        )  # fmt: skip
    wheels = list(cache.glob(f"sglang-{PINNED_SGLANG_VERSION}-*.whl"))
    if not wheels:
        raise SeriesError(f"no sglang {PINNED_SGLANG_VERSION} wheel in {cache}")
    return wheels[0]


def make_pristine(dest: Path, wheel: Path | None = None) -> Path:
    """A git repository whose one commit is the pinned wheel's ``sglang/`` under ``python/``."""
    wheel = wheel or pinned_wheel()
    if dest.exists() and any(dest.iterdir()):
        raise SeriesError(f"{dest} exists and is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if member.startswith("sglang/") and not member.endswith("/"):
                target = dest / "python" / member
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(member))
    _run(["git", "init", "-q", "-b", "main"], cwd=dest)
    _run(["git", "config", "core.autocrlf", "false"], cwd=dest)
    _run(["git", "add", "-A"], cwd=dest)
    _run(["git", "commit", "-q", "-m", f"sglang {PINNED_SGLANG_VERSION} (pristine, from the PyPI wheel)"], cwd=dest)
    _run(["git", "tag", PRISTINE_TAG], cwd=dest)
    return dest


def _git_am(series: Series, checkout: Path) -> None:
    if series.patches:
        r = _run(["git", "am", "--keep-cr", "--keep-non-patch", "--committer-date-is-author-date",
                  *map(str, series.patches)], cwd=checkout, check=False)  # fmt: skip
        if r.returncode != 0:
            _run(["git", "am", "--abort"], cwd=checkout, check=False)
            raise SeriesError(f"git am failed:\n{r.stdout}{r.stderr}")


def make_workspace(series: Series, dest: Path, wheel: Path | None = None) -> Path:
    """Pristine tree + the series as one commit per patch, ready to edit and ``export``."""
    make_pristine(dest, wheel)
    _git_am(series, dest)
    return dest


def export(series: Series, workspace: Path) -> list[Path]:
    """Write ``PRISTINE_TAG..HEAD`` of ``workspace`` back to ``patches/`` (replacing it)."""
    r = _run(["git", "status", "--porcelain"], cwd=workspace)
    if r.stdout.strip():
        raise SeriesError(f"{workspace} has uncommitted changes; commit them first:\n{r.stdout}")
    with tempfile.TemporaryDirectory() as tmp:
        _run(["git", "format-patch", "-N", "--zero-commit", "--no-signature", "--full-index",
              "-o", tmp, f"{PRISTINE_TAG}..HEAD"], cwd=workspace)  # fmt: skip
        out = series.repo / "patches"
        for old in out.glob("*.patch"):
            old.unlink()
        out.mkdir(exist_ok=True)
        written = []
        for p in sorted(Path(tmp).glob("*.patch")):
            shutil.copyfile(p, out / p.name)
            written.append(out / p.name)
    series.touched_files()  # refuse a series that creates or deletes files
    return written


def upstream_branch(series: Series, checkout: Path, branch: str) -> str:
    """Turn the series into ``branch`` on an sglang git checkout at the pinned release.

    One commit per patch, with the patch's own message; each new module is added in the commit of
    the patch that first uses it (``NEW_MODULE_PATCHES``), so no commit brings in code nothing runs.
    """
    if not (checkout / "python" / "sglang" / "version.py").exists():
        raise SeriesError(f"{checkout} is not an sglang checkout (no python/sglang/version.py)")
    tag = _run(["git", "describe", "--tags", "--exact-match", "HEAD"], cwd=checkout, check=False)
    generated = checkout / "python" / "sglang" / "_version.py"
    at_pin = tag.stdout.strip() in (f"v{PINNED_SGLANG_VERSION}", PRISTINE_TAG) or (
        generated.exists() and f"'{PINNED_SGLANG_VERSION}'" in generated.read_text()
    )
    if not at_pin:
        raise SeriesError(
            f"{checkout} is not at sglang {PINNED_SGLANG_VERSION} "
            f"(git describe: {tag.stdout.strip() or tag.stderr.strip()}); check out v{PINNED_SGLANG_VERSION} first"
        )
    _run(["git", "checkout", "-q", "-b", branch], cwd=checkout)
    for patch in series.patches:  # each new module in the commit of the patch that first uses it
        _run(["git", "am", "--keep-non-patch", "--committer-date-is-author-date", str(patch)], cwd=checkout)
        rels = modules_of(series, _patch_subject(patch))
        for rel in rels:
            dst = checkout / "python" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(series.repo / "python" / rel, dst)
            _run(["git", "add", f"python/{rel}"], cwd=checkout)
        if rels:
            _run(["git", "commit", "-q", "--amend", "--no-edit"], cwd=checkout)
    return f"branch {branch} on {checkout}: {len(series.patches)} commits, new modules in the commits that use them"


# --------------------------------------------------------------------------------------------
# Bisectability: every prefix of the series
# --------------------------------------------------------------------------------------------
# The tests each patch brings into force, run at the prefix that ends with it (pytest arguments,
# relative to the repository; keyed by the patch subject). The whole suite runs on the full series.
_PD_RELAYOUT = "[DCP] PD: a GQA decode server in DCP's GQA mode takes its KV relaid out"
PREFIX_TESTS = {
    "[DCP] GQA models replicate K/V inside the DCP group": [
        "test/test_dcp_extensions.py", "test/test_dcp_gqa.py", "-m", "not e2e", "-k", "guard or kv_partition",
    ],
    "[DCP] KV index kernel: an interleave_size, as get_dcp_lens has": [
        # (+ the kernels this tree's patches change, compiled for sm_90 / sm_100: issue 35)
        "test/test_dcp_extensions.py", "test/test_triton_compile.py", "-k", "lists_follow or kernels_compile",
    ],
    "[DCP] a2a LSE reduce: an entry point for partials already in the send layout": [
        "test/test_dcp_extensions.py", "-k", "packed",
    ],
    "[DCP] dcp_group_ranks(): the DCP group layout as a function": ["test/test_dcp_extensions.py", "-k", "group_ranks"],
    "[CPU] DCP a2a LSE reduce: torch pack and combine where Triton does not run": [
        "test/test_dcp_extensions.py", "-k", "torch",
    ],
    "[CPU] Speculative verify: the QLEN_ONLY tree mask only for intel_amx": [
        # (+ full tier: torch_native STANDALONE served on the CPU engine, which needs this patch)
        "test/test_spec_baseline_e2e.py", "-k", "tree_mask_mode or standalone_torch_native_matches",
    ],
    "[torch_native] Speculative draft decode and target verify": [
        # (a server needs the CPU PR on this machine: served at the QLEN_ONLY patch's prefix)
        "test/test_helix_attention.py", "test/test_helix_args.py", "-k",
        "plain_torch_native_speculative or plain_dcp_speculation",
    ],
    "[Distributed] Do not create a PyNccl communicator for gloo groups": ["test/test_helix_groups.py"],
    "[Kernel] Triton decode stage 2: optional merged-LSE output": [
        # (the whole file runs on the full series; here the flag off and on, once each)
        "test/test_decode_lse_kernel.py", "test/test_triton_compile.py",
        "-k", "(bit_identical_to_pristine and plain) or shard_partials_merge_to_full_attention or kernels_compile",
    ],
    "[Kernel] Triton decode stage 2: optional head-split output layout": [
        "test/test_decode_lse_kernel.py", "test/test_triton_compile.py",
        "-k", "head_split or (bit_identical_to_pristine and plain) or kernels_compile",
    ],
    "[Kernel] Triton decode stage 2: optional tiled split reduction": [
        "test/test_decode_lse_kernel.py", "test/test_triton_compile.py",
        "-k", "tiled or power_of_two or (bit_identical_to_pristine and plain) or kernels_compile",
    ],
    "[Distributed] GroupCoordinator.all_to_all_single: direct path on CPU": [
        "test/test_dcp_extensions.py", "-k", "all_to_all_single",
    ],
    "[CPU] Decode context parallelism on the CPU engine: groups and allocation page": [
        "test/test_helix_groups.py", "test/test_dcp_gqa.py", "-k", "real_gloo or cpu_platform",
    ],
    "[DCP] Triton DCP extend: every rank joins the prefix merge, and the prefix call reads the pool's heads": [
        "test/test_helix_attention.py", "-k", "gathered_q_dcp_extend",
    ],
    "[DCP] GQA: replicated Q with the All-to-All (--dcp-replicate-q-proj)": [
        # (its servers, dcp2-rq-a2a / -triton, run at the Llama opt-in: no model serves the mode before)
        "test/test_dcp_gqa.py", "-k", "q_partition",
    ],
    "[DCP] Speculation with Q gathered: a draft keeps K/tp KV heads; triton refuses it at launch": [
        "test/test_dcp_gqa.py", "test/test_helix_args.py", "-k",
        "(draft_kv_heads_match_the_pool and not replicated-draft)"  # (that one: the Helix draft patch's)
        " or (plain_dcp_speculation and not torch_native)",  # (torch_native's: its speculation patch's)
    ],
    "[DCP] The fused rope + KV write is off under DCP on every platform": [
        "test/test_dcp_gqa.py", "-k", "fused_kv_write",
    ],
    "[torch_native] Decode context parallelism": [
        "test/test_dcp_gqa.py", "-m", "not e2e", "-k", "torch_attention",
    ],
    "[Scheduler] A prompt the KV pool can never hold is refused, not queued forever": [
        "test/test_scheduler_admission.py",
    ],
    "[Server] launch_server: an argument error is a usage error, not a traceback": [
        "test/test_helix_args.py", "-m", "not e2e", "-k", "a_usage_error_not_a_traceback or only_a_server_args_error",
    ],
    "[DCP] Server args: the GQA mode, its interleave and what it runs with": [
        "test/test_helix_args.py", "-m", "not e2e", "-k",
        "interleave_size_below_one or interleave_needs_the_gqa_mode or plain_dcp_stays_upstream or plain_dcp_speculation",
    ],
    "[Helix] Server args: --helix-kvp-size spells DCP's GQA mode": [
        "test/test_helix_args.py", "-m", "not e2e", "-k",
        "not launch_server and not speculative and not speculation and not standalone and not tree_drafts "
        # (speculation is accepted from the EAGLE patch on; the PD checks come with the PD patch)
        "and not ngram and not draft_config and not pd-prefill and not pd-decode and not mtp_draft",
    ],
    "[DCP] Server args: speculation in the GQA mode, checked in the speculative step": [
        "test/test_helix_args.py", "-m", "not e2e", "-k", "the_speculative_step_checks_the_mode",
    ],
    "[CPU] NGRAM: the verify's tree indices in torch on the CPU engine": ["test/test_ngram_tree_indices.py"],
    "[DCP] KV cache: a speculative draft is sharded like its target": ["test/test_helix_kv_cache.py"],
    "[DCP] KV cache: move_kv_cache moves a logical id's K/V to its target's owner": ["test/test_helix_kv_move.py"],
    "[DCP] Triton, torch_native: this rank's lists and K/V store at --dcp-interleave-size": [
        "test/test_helix_kv_layout.py", "test/test_helix_import.py", "test/test_helix_decode_graph.py",
        "test/test_helix_attention.py", "-k",
        "prefill_and_decode or store_owns or list_kernel or decode_capture or plain_dcp_graph",
    ],
    "[DCP] Llama, Mistral: opt in to DCP's GQA mode": [
        # (+ full tier: upstream's spelling, --dcp-replicate-q-proj with the exchange named, served)
        "test/test_helix_args.py", "test/test_dcp_gqa.py", "-k",
        "(supported_architectures and (llama or mistral)) or dcp_spelling_refusals or interleave or rq-a2a or rq-triton",
    ],
    "[DCP] Qwen2: opt in to DCP's GQA mode": [
        "test/test_helix_args.py", "-m", "not e2e", "-k", "supported_architectures and qwen2",
    ],
    "[DCP] Qwen3, Qwen3-MoE: opt in to DCP's GQA mode": [
        "test/test_helix_args.py", "-m", "not e2e", "-k", "supported_architectures and qwen3",
    ],
    "[DCP] Mixtral: opt in to DCP's GQA mode": [
        "test/test_helix_args.py", "-m", "not e2e", "-k", "supported_architectures or opt_in",
    ],
    "[DCP] Qwen3.5: opt in to DCP's GQA mode": [
        # (DCP's spelling: --helix-kvp-size comes with the next patch, whose selection runs the rest)
        "test/test_helix_args.py", "-m", "not e2e", "-k", "qwen3_5_is_accepted and args1",
    ],
    "[CPU] Qwen3.5 without AMX: the gated RMSNorm and the shared-expert gate in torch": [
        "test/test_qwen3_5_cpu_paths.py", "-k", "gated_rmsnorm",
    ],
    "[CPU] Hybrid models: the mamba radix cache takes no extra buffer where the platform has none": [
        "test/test_qwen3_5_cpu_paths.py", "-k", "not verify",
    ],
    "[CPU] Hybrid models: a verify's accepted linear-attention states are committed in torch": [
        "test/test_qwen3_5_cpu_paths.py", "-k", "verify",
    ],
    "[DCP] Qwen3.5: its MTP draft in DCP's GQA mode": [
        "test/test_helix_args.py", "test/test_qwen3_5_mtp.py", "-k",
        "qwen3_5_mtp_draft_is_accepted or other_than_its_mtp_layer or (in_the_mode and dcp4)",
    ],
    # (plain TP's reads: the mode's FP8 pools are tested at its own prefixes, test_helix_attention.py)
    "[torch_native] FP8 KV cache: the write divides K/V by the layer's scales, the reads multiply them back": [
        "test/test_helix_fp8_kv.py", "-m", "not e2e", "-k", "plain_tp",
    ],
    "[CPU] FP8 KV cache without AMX: the platform-independent FP8 pool, which torch attention reads": [
        "test/test_helix_fp8_kv.py", "-m", "not e2e", "-k", "plain_tp",
    ],
    "[DCP] EAGLE: the Llama draft head opts in as a draft": [
        "test/test_helix_args.py", "test/test_helix_attention.py", "-m", "not e2e", "-k",
        "(speculative or speculation_keeps) and not pd-decode",  # (PD's checks: the PD patch)
    ],
    "[CPU] Disaggregation: prefill/decode disaggregation on the CPU engine": [
        "test/test_helix_pd_e2e.py", "test/test_cpu_pd_paths.py", "-k", "plain_pd_pair or index_path",
    ],
    _PD_RELAYOUT: [
        "test/test_helix_pd.py", "test/test_helix_args.py", "-m", "not e2e", "-k",
        "test_helix_pd or pd- or qwen3_5_pd_decode",
    ],
    "[DCP] Speculation: the verify's and each draft step's lists over DCP's layout, eager and in CUDA graphs": [
        "test/test_helix_decode_graph.py", "test/test_helix_attention.py", "-m", "not e2e", "-k",
        "draft_steps or speculative or tree_verify",
    ],
    # (upstream's FP8 methods alone: the patch can move anywhere in the series)
    "[CPU] FP8 linear and MoE without AMX: dequantize the weight, multiply in torch": [
        "test/test_fp8_cpu.py", "-m", "not e2e",
    ],
    "[DCP] GQA-mode decode: stage 2 writes the All-to-All's send buffer": [
        "test/test_helix_decode_graph.py", "test/test_helix_merge.py", "-m", "not e2e", "-k", "not pd_prefill",
    ],
    "[DCP] GQA-mode decode: a split extent per batch from the SM count": [
        "test/test_helix_decode_graph.py", "test/test_helix_memory.py", "test/test_helix_merge.py", "-m", "not e2e",
        "-k", "not pd_prefill",
    ],
}
# Each new module enters with the patch that first uses it (the prefix check installs it there,
# the upstream branch adds it in that patch's commit): no patch brings in code nothing runs.
_SERVER_ARGS = "[DCP] Server args: the GQA mode, its interleave and what it runs with"
_DECODE_PERF = "[DCP] GQA-mode decode: a split extent per batch from the SM count"
NEW_MODULE_PATCHES = {
    "sglang/srt/layers/dcp/torch_attention.py": "[torch_native] Decode context parallelism",
    "sglang/srt/arg_groups/helix_hook.py": _SERVER_ARGS,
    "sglang/srt/layers/dcp/gqa_decode.py": _DECODE_PERF,
    "sglang/srt/layers/dcp/gqa_kv_move.py": "[DCP] KV cache: move_kv_cache moves a logical id's K/V to its target's owner",
    "sglang/srt/disaggregation/common/dcp_gqa.py": _PD_RELAYOUT,
}


# --------------------------------------------------------------------------------------------
# The pull requests a maintainer takes one at a time, in merge order
# --------------------------------------------------------------------------------------------
# (number, title, subject of its first patch, subject of its last patch): each a contiguous range
# of the series; together they are the whole series, in order (``pr_ranges`` checks both).
PRS = [
    (0, "Two fixes: a prompt the pool cannot hold, an argument error at launch", "[Scheduler] ", "[Server] "),
    (1, "[DCP] fixes: GQA K/V, the Triton extend, drafts, the fused write",
     "[DCP] GQA models replicate K/V", "[DCP] The fused rope + KV write is off"),
    (2, "[torch_native] Decode context parallelism, speculative decoding, FP8 KV scales",
     "[torch_native] Decode context parallelism", "[torch_native] FP8 KV cache: the write divides"),
    (3, "[CPU] DCP on the CPU engine; FP8 and Qwen3.5 without AMX", "[Distributed] Do not create a PyNccl",
     "[CPU] FP8 KV cache without AMX"),
    (4, "[DCP] The GQA mode: replicated Q over tp / dcp, one All-to-All, models opting in",
     "[Kernel] Triton decode stage 2: optional merged-LSE", "[Helix] Server args: --helix-kvp-size spells"),
    (5, "[DCP] Speculation in the GQA mode", "[DCP] KV cache: a speculative draft is sharded", "[DCP] EAGLE: the Llama draft head"),
    (6, "[DCP] PD disaggregation into the GQA mode", "[DCP] PD: a GQA decode server", "[DCP] PD: a GQA decode server"),
    (7, "[DCP] GQA-mode decode performance (needs GPU numbers)",
     "[Kernel] Triton decode stage 2: optional head-split", "[DCP] GQA-mode decode: a split extent"),
    (8, "Qwen3.5's MTP draft: the verify's state commit on the CPU engine, the draft in the GQA mode",
     "[CPU] Hybrid models: a verify's accepted", "[DCP] Qwen3.5: its MTP draft"),
]  # fmt: skip
# The review budget (issue 60): the PRs that carry the mode's logic, together.
PR_BUDGET = ((1, 2, 4, 5), 2100)


def pr_ranges(series: "Series") -> list[tuple]:
    """``[(number, title, [patch, ...]), ...]``: each PR's patches, a contiguous range, all of
    them covered once, in order."""
    subjects = [_patch_subject(p) for p in series.patches]

    def index(prefix: str, start: int) -> int:
        for i in range(start, len(subjects)):
            if subjects[i].startswith(prefix):
                return i
        raise SeriesError(f"no patch from {start + 1} on starts with {prefix!r}")

    out, at = [], 0
    for number, title, first, last in PRS:
        lo = index(first, at)
        if lo != at:
            raise SeriesError(f"PR {number} starts at patch {lo + 1}, not {at + 1}: {subjects[at]!r} is in no PR")
        hi = index(last, lo)
        out.append((number, title, series.patches[lo : hi + 1]))
        at = hi + 1
    if at != len(subjects):
        raise SeriesError(f"patches {at + 1}-{len(subjects)} are in no PR (from {subjects[at]!r})")
    return out


def added_lines(patch: Path) -> int:
    """Lines a patch adds (``+`` lines of its diff, not the ``+++`` headers)."""
    return sum(1 for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++"))


def pr_sizes(series: "Series") -> list[dict]:
    """Per PR: its patch range, the lines its patches add and the lines of the new modules that
    enter with them (black-formatted files as committed, docstrings and comments included)."""
    rows = []
    for number, title, patches in pr_ranges(series):
        modules = [rel for p in patches for rel in modules_of(series, _patch_subject(p))]
        module_lines = sum(len((series.repo / "python" / rel).read_text().splitlines()) for rel in modules)
        patch_lines = sum(added_lines(p) for p in patches)
        first, last = (int(p.name[:4]) for p in (patches[0], patches[-1]))
        rows.append(dict(number=number, title=title, first=first, last=last, patches=patch_lines,
                         modules=module_lines, module_files=modules, total=patch_lines + module_lines))  # fmt: skip
    return rows


def print_prs(series: "Series") -> int:
    rows = pr_sizes(series)
    print(f"{'PR':>3}  {'patches':>9}  {'patch +':>8}  {'modules':>8}  {'total':>6}  title")
    for r in rows:
        span = f"{r['first']:04d}" if r["first"] == r["last"] else f"{r['first']:04d}-{r['last']:04d}"
        print(f"{r['number']:>3}  {span:>9}  {r['patches']:>8}  {r['modules']:>8}  {r['total']:>6}  {r['title']}")
        for rel in r["module_files"]:
            print(f"{'':>36}+ {rel}")
    budgeted, limit = PR_BUDGET
    total = sum(r["total"] for r in rows if r["number"] in budgeted)
    names = " + ".join(str(n) for n in budgeted)
    print(f"PRs {names}: {total} lines (budget {limit}: {'within' if total <= limit else 'over'})")
    return 0


def modules_of(series: "Series", subject: str) -> list[str]:
    """The new modules (paths under python/) that enter with the patch ``subject``."""
    unmapped = sorted(set(series.new_files) - set(NEW_MODULE_PATCHES))
    if unmapped:
        raise SeriesError(f"new modules with no introducing patch in NEW_MODULE_PATCHES: {unmapped}")
    return [rel for rel in series.new_files if NEW_MODULE_PATCHES[rel] == subject]


# The first patch from which DCP's GQA mode must be accepted: it opts Llama in (adds
# ``supports_dcp_gqa = True`` to this file; earlier patches may touch the file for other reasons).
FIRST_MODEL_FILE = "sglang/srt/models/llama.py"
OPT_IN = "+    supports_dcp_gqa = True"


def opts_llama_in(patch: Path) -> bool:
    """Whether ``patch`` declares Llama's Helix opt-in."""
    return FIRST_MODEL_FILE in Series.touched_files_of(patch) and OPT_IN in patch.read_text()

_PROBE = """
import importlib, sys
GQA_MODE = ["--dcp-size", "2", "--dcp-replicate-q-proj"]
import sglang
assert sglang.__file__.startswith(sys.argv[1]), f"sglang imported from {sglang.__file__}"
for name in sys.argv[3].split(","):
    importlib.import_module(name)
print("IMPORTED", len(sys.argv[3].split(",")), flush=True)
from sglang.srt.server_args import prepare_server_args
try:
    args = prepare_server_args(["--model-path", sys.argv[2], "--device", "cpu", "--tp", "2", *GQA_MODE])
    args.resolve_once()
    print("PROBE accepted")
except SystemExit:
    print("PROBE refused: not a flag")
except Exception as e:  # upstream refuses replicated Q off MLA in its own ways
    print("PROBE refused:", type(e).__name__, e)
"""


def _patch_subject(patch: Path) -> str:
    lines = patch.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Subject: "))
    subject = lines[start][len("Subject: ") :]
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        subject += line
    return subject.removeprefix("[PATCH] ")


def _module_name(rel: str) -> str:
    """``sglang/srt/x/y.py`` -> ``sglang.srt.x.y`` (``__init__.py`` -> its package)."""
    name = rel.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


# The probes' third-party imports (torch, transformers, ...: ~6 of a probe's ~8 s of imports on 2
# cores) are paid once per worker: a fork server imports them, then forks one child per prefix,
# which imports SGLang from that prefix's tree and runs _PROBE. Nothing of SGLang is imported before
# the fork (checked), so each child sees only its prefix's code.
_PRELOAD = "torch,transformers,triton,numpy,scipy,sympy,networkx,torchvision,openai,fastapi,uvicorn,aiohttp,zmq,pydantic,requests,flashinfer,cutlass"
_FORK_SERVER = """
import importlib, json, os, signal, sys, traceback

def preload(names):
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException:
            pass
    early = sorted(m for m in sys.modules if m.split(".")[0] in ("sglang", "sgl_kernel"))
    assert not early, f"imported before the fork: {early}"

preload(sys.argv[1].split(","))
probe = compile(sys.argv[2], "<probe>", "exec")
for line in sys.stdin:
    job = json.loads(line)
    preload(job.get("preload", []))
    pid = os.fork()
    if pid == 0:
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(1, "w", closefd=False)
        sys.argv = ["-c", job["root"], job["model"], job["modules"]]
        # The probe on the tree itself writes the bytecode it compiles there (the snapshots are
        # hard links of it), whatever PYTHONDONTWRITEBYTECODE says; a snapshot's probe writes none.
        sys.dont_write_bytecode = not job.get("write_bytecode", False)
        sys.path.insert(0, job["root"])
        signal.alarm(600)  # a probe that hangs is killed, and reported as failed
        code = 0
        try:
            exec(probe, {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        try:  # what this probe imported besides SGLang: the next forks start with it imported
            third_party = [m for m in list(sys.modules) if m.split(".")[0] not in ("sglang", "sgl_kernel", "__main__")]
            with open(job["log"] + ".modules", "w") as f:
                json.dump(third_party, f)
        except BaseException:
            pass
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class _ProbeServer:
    """One fork server (above): ``probe`` runs _PROBE on a tree in a fresh child, one at a time."""

    def __init__(self, env: dict, cwd: Path):
        self.cwd = cwd
        self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, _PRELOAD, _PROBE], env=env, cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip

    def probe(self, root: Path, model: str, modules: list[str], preload: list[str] = (),
              write_bytecode: bool = False) -> tuple[int, str, str, list]:  # fmt: skip
        """Run _PROBE on ``root``; return (exit code, output, error, the third-party modules the
        probe imported). ``preload``: modules the server imports first (never SGLang's)."""
        log = Path(tempfile.mkstemp(prefix="probe-", suffix=".log", dir=self.cwd)[1])
        job = {"root": str(root), "model": model, "modules": ",".join(modules), "log": str(log), "preload": list(preload),
               "write_bytecode": write_bytecode}  # fmt: skip
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        rc = self.proc.stdout.readline().strip()
        out = log.read_text(errors="replace")
        log.unlink()
        imported = Path(str(log) + ".modules")
        try:
            third_party = json.loads(imported.read_text())
        except (OSError, ValueError):
            third_party = []
        imported.unlink(missing_ok=True)
        if not rc:
            return -1, out, f"the probe server exited ({self.proc.poll()})", third_party
        return int(rc), out, "", third_party

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def check_prefixes(series: Series, work: Path, run_tests: bool = True, log=print, workers: int = 2,
                   tests_from: int = 1) -> list[str]:  # fmt: skip
    """Apply the series one patch at a time to a pristine tree in ``work`` and check each prefix.

    Returns one line per prefix; raises ``SeriesError`` at the first prefix that fails.

    Without tests, the import probes run ``workers`` at a time: each on a hard-linked snapshot of
    the prefix's ``python/`` (``git am`` replaces a file it changes, it never writes into it, so a
    snapshot keeps its prefix's bytes and the bytecode compiled so far), each probe a child forked
    from a server that imported the third-party modules once (``_FORK_SERVER``). With tests, one
    prefix at a time in the tree itself.
    """
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from sglang_helix.testing.cpu_env import cpu_server_env
    from sglang_helix.testing.tiny_models import TinyModelSpec, write_tiny_model

    tree = make_pristine(work / "tree")
    model = write_tiny_model(str(work / "llama"), TinyModelSpec(num_heads=8, num_kv_heads=4))
    root = tree / "python"
    env = cpu_server_env(2, attention_backend="triton")
    workers = 1 if run_tests else max(1, workers)
    servers: list[_ProbeServer] = []
    local = threading.local()

    # Third-party modules the probes imported (in import order): each fork server imports them
    # before its next fork, so a probe pays only for SGLang's own modules (~2.4 of its ~6 s).
    learned: dict[str, None] = {}

    def probe_prefix(probe_root: Path, modules: list[str], preload: list[str]) -> tuple[int, str, str, list]:
        if not hasattr(local, "server"):  # one fork server per pool thread
            local.server = _ProbeServer(env, work)
            servers.append(local.server)
        return local.server.probe(probe_root, model, modules, preload, write_bytecode=probe_root == root)

    new_modules: list[str] = []
    touched: list[str] = []
    report = []
    opted_in = False
    pool = ThreadPoolExecutor(max_workers=workers)
    # (prefix, patch, modules, probe, snapshot) in order; a snapshot is removed once its probe is read
    pending: list[tuple[int, Path, list[str], object, Path | None]] = []

    def finish(i: int, patch: Path, modules: list[str], probe_future, snapshot: Path | None) -> None:
        nonlocal opted_in
        subject = _patch_subject(patch)
        rc, out, err, third_party = probe_future.result()
        learned.update(dict.fromkeys(third_party))
        if snapshot is not None:
            shutil.rmtree(snapshot, ignore_errors=True)
        probe = [line for line in out.splitlines() if line.startswith("PROBE ")]
        if rc != 0 or not probe:
            raise SeriesError(f"prefix {i} ({patch.name}): import or probe failed:\n{out[-3000:]}{err[-3000:]}")
        accepted = probe[0] == "PROBE accepted"
        opted_in = opted_in or opts_llama_in(patch)
        expected = opted_in
        if accepted != expected:
            raise SeriesError(
                f"prefix {i} ({patch.name}): --dcp-size 2 --dcp-replicate-q-proj is "
                f"{'accepted' if accepted else 'refused'} on a Llama model, expected "
                f"{'accepted' if expected else 'refused'} ({probe[0]})"
            )
        tests = PREFIX_TESTS.get(subject, [])
        if run_tests and tests and i >= tests_from:
            # an earlier tree, not the installed series: the launch check does not apply (HELIX_CI off);
            # the tests run in this process with every model module, as pytest runs them in CI (a
            # server they start skips the unserved ones itself)
            prefix_env = {k: v for k, v in env.items() if k not in ("HELIX_CI", "SGLANG_DISABLED_MODEL_ARCHS")}
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", *tests],
                               cwd=series.repo, env={**prefix_env, "PYTHONPATH": os.pathsep.join([str(root), env["PYTHONPATH"]])},
                               capture_output=True, text=True, timeout=900)  # fmt: skip
            summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
            if r.returncode != 0:
                raise SeriesError(f"prefix {i} ({patch.name}): tests failed: {' '.join(tests)}\n{r.stdout[-5000:]}")
        else:
            summary = "its tests not run" if tests else "no tests of its own"
        line = f"{i:2d} {subject}: applies, imports {len(modules)} modules, flag {'accepted' if accepted else 'refused'}; {summary}"
        log(line)
        report.append(line)

    try:
        for i, patch in enumerate(series.patches, 1):
            subject = _patch_subject(patch)
            r = _run(["git", "am", "--keep-cr", "--keep-non-patch", "--committer-date-is-author-date", str(patch)],
                     cwd=tree, check=False)  # fmt: skip
            if r.returncode != 0:
                raise SeriesError(f"prefix {i} ({patch.name}): git am failed:\n{r.stdout}{r.stderr}")
            for rel in Series.touched_files_of(patch):
                if rel.endswith(".py") and rel not in touched:
                    touched.append(rel)
            for rel in modules_of(series, subject):  # the new modules this patch brings in
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).unlink(missing_ok=True)  # a new file: never write into a snapshot's link
                shutil.copyfile(series.repo / "python" / rel, root / rel)
                new_modules.append(_module_name(rel))
            # Bytecode: the first probe writes the tree's (below); from then on the files this patch
            # changed or added are compiled here, so that every snapshot (hard links) holds current
            # bytecode for them and no probe compiles the same source again. (py_compile replaces a
            # .pyc, never writes into it: a snapshot keeps its own. A file that does not compile is
            # left to the probe's import, which reports it.)
            for rel in Series.touched_files_of(patch) + modules_of(series, subject):
                if rel.endswith(".py") and (root / rel).is_file():
                    try:
                        py_compile.compile(str(root / rel), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
                    except (py_compile.PyCompileError, OSError):
                        Path(importlib.util.cache_from_source(str(root / rel))).unlink(missing_ok=True)
            modules = ["sglang.launch_server"] + [_module_name(rel) for rel in touched] + new_modules
            if workers == 1 or i == 1:  # the first probe compiles the tree's bytecode for the snapshots
                snapshot, probe_root = None, root
            else:
                snapshot = work / f"prefix-{i:02d}"
                _run(["cp", "-al", str(root), str(snapshot)])
                probe_root = snapshot
            pending.append((i, patch, modules, pool.submit(probe_prefix, probe_root, modules, list(learned)), snapshot))
            if snapshot is None or len(pending) >= workers:
                finish(*pending.pop(0))
        while pending:
            finish(*pending.pop(0))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for server in servers:
            server.close()
        for *_, snapshot in pending:
            if snapshot is not None:
                shutil.rmtree(snapshot, ignore_errors=True)
    return report



def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_helix.series", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="apply the series to the installed sglang (no-op if applied)")
    sub.add_parser("check", help="report applied / pristine / modified (exit 1 if modified)")
    sub.add_parser("revert", help="return the installed sglang to the wheel's bytes")
    for name, helptext in [
        ("pristine", "write a git repo of the pinned wheel's sources"),
        ("workspace", "pristine repo + the series as commits, to edit"),
        ("export", "write a workspace's commits back to patches/"),
    ]:
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("dir", type=Path)
    sp = sub.add_parser("prefixes", help="check every prefix of the series: git am, imports, flag gate, its tests")
    sp.add_argument("--no-tests", action="store_true", help="skip each patch's tests (PREFIX_TESTS)")
    sp.add_argument("--work", type=Path, help="work directory (default: a temporary one, removed)")
    sp.add_argument("--tests-from", type=int, default=1, metavar="N",
                    help="run the patches' tests from prefix N on (every prefix still applies, imports, probes)")  # fmt: skip
    sub.add_parser("prs", help="each PR's patch range and its added lines (patches + new modules)")
    sp = sub.add_parser("upstream-branch", help="make a PR branch on an sglang git checkout")
    sp.add_argument("checkout", type=Path)
    sp.add_argument("--branch", default="helix-parallelism")
    args = p.parse_args(argv)
    series = Series()
    try:
        if args.cmd in ("install", "check", "revert"):
            inst = Installed.find()
            if args.cmd == "install":
                print(install(series, inst))
            elif args.cmd == "revert":
                print(revert(series, inst))
            else:
                ok, msg = check(series, inst)
                print(msg)
                return 0 if ok else 1
        elif args.cmd == "pristine":
            print(make_pristine(args.dir))
        elif args.cmd == "workspace":
            print(make_workspace(series, args.dir))
        elif args.cmd == "export":
            for w in export(series, args.dir):
                print(w.relative_to(series.repo))
        elif args.cmd == "prefixes":
            if args.work:
                check_prefixes(series, args.work, run_tests=not args.no_tests, tests_from=args.tests_from)
            else:
                with tempfile.TemporaryDirectory(prefix="helix-prefixes-") as tmp:
                    check_prefixes(series, Path(tmp), run_tests=not args.no_tests, tests_from=args.tests_from)
            print(f"all {len(series.patches)} prefixes pass")
        elif args.cmd == "prs":
            return print_prs(series)
        elif args.cmd == "upstream-branch":
            print(upstream_branch(series, args.checkout, args.branch))
    except SeriesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
