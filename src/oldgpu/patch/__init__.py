"""``oldgpu patch DIR``: patch a verl checkout (or unpacked sdist) for a profile.

How it works:

- Each ``Patch`` names the verl versions it is for, the files it edits, finds its sites
  by code structure (the AST, scoped by class and function) and checks the result
  itself after it is applied. ``applies(options)`` lets profile-specific patch sets (a
  ``cpu`` profile, say) join only for that profile.
- The patched content is always computed from the originals: pristine files, or the
  copies kept in ``DIR/.oldgpu-originals/`` after the first patch. So a second patch
  with the same options finds nothing to do, and patching with other options (eager
  instead of sdpa, say) is revert-then-apply in one atomic step.
- Sites call into ``verl/utils/oldgpu_compat.py``, written into the tree with the
  profile's compute dtype and attention implementation baked in; the environment
  variables OLDGPU_COMPUTE_DTYPE and OLDGPU_ATTN_IMPLEMENTATION override them at run
  time, so a card swap needs no re-patch.
- ``DIR/.oldgpu-patch.json`` records the engine and verl versions, the options, and per
  file the original and patched sha256. A file matching neither is a hand edit: the
  patcher refuses to touch the tree.
- All or nothing: every new content is computed and verified in memory, staged as
  temporary files, then renamed into place; a failed write rolls back the ones done.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from oldgpu import __version__
from oldgpu.output import EngineError, Result
from oldgpu.patch.source import MODULE_SCOPE, Edit, SourceFile, apply_edits

MANIFEST_NAME = ".oldgpu-patch.json"
ORIGINALS_DIR = ".oldgpu-originals"
MANIFEST_SCHEMA = 1

COMPAT_REL = "verl/utils/oldgpu_compat.py"
COMPAT_MODULE = "verl.utils.oldgpu_compat"
COMPAT_ALIAS = "oldgpu_compat"
COMPAT_IMPORT = "from verl.utils import oldgpu_compat"

COMPUTE_DTYPES = ("fp32", "fp16", "bf16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICES = ("cuda", "cpu")
PROFILE_KEYS = ("compute_dtype", "attn_implementation", "device")  # of profile's patch_options
# Pascal first: no bf16, no FlashAttention-2; PyTorch's SDPA runs on sm_50+.
DEFAULT_COMPUTE_DTYPE = "fp32"
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"


@dataclass(frozen=True)
class Options:
    compute_dtype: str = DEFAULT_COMPUTE_DTYPE
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION
    profile: str | None = None
    # From the profile; lets device-specific patch sets (a cpu one) join via applies().
    device: str = "cuda"

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise EngineError(
                "options-invalid",
                f"compute dtype {self.compute_dtype!r}: "
                f"expected one of {', '.join(COMPUTE_DTYPES)}",
            )
        if self.device not in DEVICES:
            raise EngineError(
                "options-invalid", f"device {self.device!r}: expected one of {', '.join(DEVICES)}"
            )
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise EngineError(
                "options-invalid",
                f"attention implementation {self.attn_implementation!r}: "
                f"expected one of {', '.join(ATTN_IMPLEMENTATIONS)}",
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "compute_dtype": self.compute_dtype,
            "attn_implementation": self.attn_implementation,
            "profile": self.profile,
            "device": self.device,
        }


@dataclass(frozen=True)
class Site:
    """One place a patch changed, for people: the line is the original's, informative only."""

    file: str
    function: str
    line: int
    change: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "function": self.function,
            "line": self.line,
            "change": self.change,
        }


@dataclass(frozen=True)
class Change:
    site: Site
    edits: tuple[Edit, ...]


class SiteNotFound(Exception):
    """The code a patch expects is not there (or not in the shape it expects)."""


class VerifyFailed(Exception):
    """A patched file does not have the shape the patch meant to give it."""


class Patch:
    """One change to verl, applied to every site it finds in ``files``.

    Subclasses set the class attributes and implement ``plan`` (find the sites in the
    original, return the edits) and ``verify`` (check the patched file).
    """

    name: str = ""
    description: str = ""
    versions: frozenset[str] = frozenset()
    files: tuple[str, ...] = ()
    # The patched sites refer to ``oldgpu_compat``: the file needs the module-level import.
    uses_compat: bool = True

    def applies(self, options: Options) -> bool:
        return True

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        raise NotImplementedError

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        raise NotImplementedError


def _registry() -> list[Patch]:
    # Imported here: the version modules import this package's classes.
    from oldgpu.patch import verl_0_5_0, verl_0_5_0_cpu

    return [*verl_0_5_0.PATCHES, *verl_0_5_0_cpu.PATCHES]


def supported_versions() -> list[str]:
    return sorted({v for p in _registry() for v in p.versions})


def select_patches(version: str, options: Options) -> list[Patch]:
    for_version = [p for p in _registry() if version in p.versions]
    if not for_version:
        raise EngineError(
            "verl-version-unsupported",
            f"no patch set for verl {version} (supported: {', '.join(supported_versions())}); "
            "pin verl to a supported version",
        )
    return [p for p in for_version if p.applies(options)]


# --- the compat module ---


def compat_source() -> str:
    return (resources.files("oldgpu.patch") / "compat.py").read_text(encoding="utf-8")


def compat_exports() -> set[str]:
    """The names the compat module's ``__all__`` lists."""
    tree = SourceFile(COMPAT_REL, compat_source().encode("utf-8")).tree
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__all__" for t in node.targets
        ):
            return {elt.value for elt in node.value.elts}
    raise RuntimeError("compat.py has no __all__")


def render_compat(options: Options) -> bytes:
    """The compat module with the profile's values baked in (by AST, not by text search)."""
    data = compat_source().encode("utf-8")
    src = SourceFile(COMPAT_REL, data)
    baked = {
        "BAKED_COMPUTE_DTYPE": options.compute_dtype,
        "BAKED_ATTN_IMPLEMENTATION": options.attn_implementation,
    }
    edits = []
    for node in src.tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in baked:
                start, end = src.span(node.value)
                edits.append(Edit(start, end, json.dumps(baked.pop(name))))
    if baked:
        raise RuntimeError(f"compat.py lacks {sorted(baked)}")
    rendered = apply_edits(data, edits)
    if options.device == "cpu":  # the cpu patch set's helpers, for cpu trees only
        cpu = (resources.files("oldgpu.patch") / "compat_cpu.py").read_bytes()
        rendered = rendered.rstrip(b"\n") + b"\n\n\n" + cpu
    return rendered


# --- files and hashes ---


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(root: Path, rel: str) -> bytes | None:
    try:
        return (root / rel).read_bytes()
    except FileNotFoundError:
        return None


def _safe_rel(rel: object) -> str:
    path = PurePosixPath(str(rel))
    if not isinstance(rel, str) or path.is_absolute() or ".." in path.parts or not path.parts:
        raise EngineError("manifest-invalid", f"{MANIFEST_NAME}: bad path {rel!r}")
    return str(path)


def read_verl_version(root: Path) -> str:
    """verl 0.5.0 keeps its version in verl/version/version (setup.py reads it from there)."""
    data = _read(root, "verl/version/version")
    if data is not None:
        return data.decode("utf-8").strip()
    pkg_info = _read(root, "PKG-INFO")
    if pkg_info is not None:
        for line in pkg_info.decode("utf-8", "replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    raise EngineError(
        "verl-version-unknown",
        f"{root}: neither verl/version/version nor PKG-INFO says the version",
    )


def _check_tree(root: Path) -> None:
    if not (root / "verl" / "__init__.py").is_file():
        raise EngineError(
            "not-a-verl-tree", f"{root}: no verl/__init__.py (give the checkout or sdist root)"
        )


def read_manifest(root: Path) -> dict[str, Any] | None:
    data = _read(root, MANIFEST_NAME)
    if data is None:
        return None
    try:
        manifest = json.loads(data)
    except json.JSONDecodeError as exc:
        raise EngineError("manifest-invalid", f"{root / MANIFEST_NAME}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        raise EngineError(
            "manifest-invalid", f"{root / MANIFEST_NAME}: expected schema {MANIFEST_SCHEMA}"
        )
    for key in ("files", "added"):
        if not isinstance(manifest.get(key), dict):
            raise EngineError("manifest-invalid", f"{root / MANIFEST_NAME}: no {key!r} table")
        for rel in manifest[key]:
            _safe_rel(rel)
    return manifest


def _recorded_originals(root: Path, manifest: dict[str, Any] | None) -> dict[str, bytes]:
    """The kept originals, checked against their recorded hashes."""
    originals: dict[str, bytes] = {}
    for rel, rec in (manifest or {}).get("files", {}).items():
        data = _read(root, f"{ORIGINALS_DIR}/{rel}")
        if data is None or sha256(data) != rec.get("original_sha256"):
            raise EngineError(
                "originals-corrupt",
                f"{root / ORIGINALS_DIR / rel} is missing or does not match the hash in "
                f"{MANIFEST_NAME}; restore the tree from a fresh verl copy",
            )
        originals[rel] = data
    return originals


def _check_untouched(root: Path, manifest: dict[str, Any] | None) -> None:
    """Refuse a tree edited by hand since it was patched."""
    for rel, rec in (manifest or {}).get("files", {}).items():
        data = _read(root, rel)
        if data is None or sha256(data) not in (
            rec.get("original_sha256"),
            rec.get("patched_sha256"),
        ):
            raise EngineError(
                "tree-modified",
                f"{root / rel} was changed since oldgpu patched it (its sha256 matches neither the "
                f"original nor the patched one in {MANIFEST_NAME}); undo the edit or start from a "
                "fresh verl copy",
            )
    for rel, rec in (manifest or {}).get("added", {}).items():
        data = _read(root, rel)
        if data is not None and sha256(data) != rec.get("sha256"):
            raise EngineError(
                "tree-modified",
                f"{root / rel} (added by oldgpu) was changed since; undo the edit or start from a "
                "fresh verl copy",
            )


# --- patching one file ---


def _compat_import_edit(src: SourceFile) -> tuple[Edit, Site]:
    """Insert the compat import after the module's last top-level import (before any def)."""
    last = None
    for node in src.tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            break
        if isinstance(node, ast.Import | ast.ImportFrom):
            last = node
        if isinstance(node, ast.Import | ast.ImportFrom) and COMPAT_ALIAS in {
            a.asname or a.name for a in node.names
        }:
            raise SiteNotFound(f"already imports {COMPAT_ALIAS}")
    if last is None:
        raise SiteNotFound("no module-level import block to add the compat import to")
    pos = src.after_line(last.end_lineno)
    lead = "" if src.ends_with_newline(last.end_lineno) else "\n"
    text = f"{lead}{COMPAT_IMPORT}  # oldgpu: the profile's dtype and attention\n"
    site = Site(src.rel, MODULE_SCOPE, last.end_lineno + 1, f"added `{COMPAT_IMPORT}`")
    return Edit(pos, pos, text), site


def _verify_compat_import(src: SourceFile) -> None:
    hits = [
        n
        for n in src.tree.body
        if isinstance(n, ast.ImportFrom)
        and n.module == "verl.utils"
        and [a.name for a in n.names] == [COMPAT_ALIAS]
    ]
    if len(hits) != 1:
        raise VerifyFailed(f"expected one module-level `{COMPAT_IMPORT}`, found {len(hits)}")


@dataclass
class _FileResult:
    data: bytes
    sites: dict[str, list[Site]]  # patch name -> sites


def patch_file(rel: str, original: bytes, patches: list[Patch], options: Options) -> _FileResult:
    """Apply every patch that edits ``rel`` to its original; verify; return the new bytes."""
    names = ", ".join(p.name for p in patches)
    try:
        src = SourceFile(rel, original)
    except SyntaxError as exc:
        raise EngineError(
            "verl-source-unparsable",
            f"{rel} does not parse (line {exc.lineno}: {exc.msg}), so patch(es) {names} "
            "cannot find their sites; start from a fresh verl copy",
        ) from exc
    edits: list[Edit] = []
    sites: dict[str, list[Site]] = {}
    planned: dict[str, list[Change]] = {}
    for patch in patches:
        try:
            changes = patch.plan(src, options)
        except SiteNotFound as exc:
            name = "site-not-found"
            if COMPAT_ALIAS.encode() in original:
                name = "tree-patched-without-manifest"
            raise EngineError(
                name,
                f"patch {patch.name}: {rel}: {exc}"
                + (
                    f" (the file mentions {COMPAT_ALIAS} but there is no {MANIFEST_NAME}: "
                    "start from a fresh verl copy)"
                    if name == "tree-patched-without-manifest"
                    else ""
                ),
            ) from exc
        planned[patch.name] = changes
        sites[patch.name] = [c.site for c in changes]
        edits.extend(e for c in changes for e in c.edits)
    if any(p.uses_compat for p in patches):
        try:
            edit, site = _compat_import_edit(src)
        except SiteNotFound as exc:
            raise EngineError("site-not-found", f"patch compat-module: {rel}: {exc}") from exc
        edits.append(edit)
        sites.setdefault("compat-module", []).append(site)
    new = apply_edits(original, edits)
    try:
        new_src = SourceFile(rel, new)
        compile(new, rel, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise EngineError(
            "patch-verify-failed",
            f"patch(es) {names}: {rel} no longer parses (line {exc.lineno}: {exc.msg})",
        ) from exc
    for patch in patches:
        try:
            patch.verify(new_src, options, planned[patch.name])
        except VerifyFailed as exc:
            raise EngineError("patch-verify-failed", f"patch {patch.name}: {rel}: {exc}") from exc
    if any(p.uses_compat for p in patches):
        try:
            _verify_compat_import(new_src)
        except VerifyFailed as exc:
            raise EngineError("patch-verify-failed", f"patch compat-module: {rel}: {exc}") from exc
    return _FileResult(new, sites)


# --- plans ---


@dataclass
class _Op:
    rel: str
    old: bytes | None
    new: bytes | None
    tree: bool  # a verl file (reported, diffed) rather than bookkeeping
    order: int  # bookkeeping that lets a half-done run be understood goes first


@dataclass
class Plan:
    root: Path
    action: str  # "patch" or "revert"
    verl_version: str | None
    options: Options | None
    ops: list[_Op] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)
    patches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.ops)

    def diff(self) -> str:
        chunks = []
        for op in self.ops:
            if not op.tree:
                continue
            old = (op.old or b"").decode("utf-8").splitlines(keepends=True)
            new = (op.new or b"").decode("utf-8").splitlines(keepends=True)
            chunks.extend(
                difflib.unified_diff(
                    old,
                    new,
                    fromfile=f"a/{op.rel}" if op.old is not None else "/dev/null",
                    tofile=f"b/{op.rel}" if op.new is not None else "/dev/null",
                )
            )
        return "".join(line if line.endswith("\n") else line + "\n" for line in chunks)


def _status(old: bytes | None, new: bytes | None, restoring: bool) -> str:
    if old == new:
        return "unchanged"
    if new is None:
        return "remove"
    if old is None:
        return "add"
    return "restore" if restoring else "patch"


def _add_op(plan: Plan, rel: str, new: bytes | None, *, tree: bool, order: int) -> None:
    old = _read(plan.root, rel)
    if old != new:
        plan.ops.append(_Op(rel, old, new, tree, order))


def plan_patch(root: Path, options: Options) -> Plan:
    root = Path(root)
    _check_tree(root)
    manifest = read_manifest(root)
    version = read_verl_version(root)
    if manifest is not None and manifest.get("verl_version") != version:
        raise EngineError(
            "tree-modified",
            f"{root}: verl/version/version says {version} but the tree was patched as verl "
            f"{manifest.get('verl_version')}; start from a fresh verl copy",
        )
    patches = select_patches(version, options)
    _check_untouched(root, manifest)
    originals = _recorded_originals(root, manifest)
    recorded_files = dict((manifest or {}).get("files", {}))
    recorded_added = dict((manifest or {}).get("added", {}))

    targeted: list[str] = []
    for patch in patches:
        targeted.extend(rel for rel in patch.files if rel not in targeted)
    sources: dict[str, bytes] = {}
    for rel in targeted:
        data = originals.get(rel, _read(root, rel))
        if data is None:
            owners = ", ".join(p.name for p in patches if rel in p.files)
            raise EngineError("site-not-found", f"patch {owners}: {rel} is not in {root}")
        sources[rel] = data

    results = {
        rel: patch_file(rel, sources[rel], [p for p in patches if rel in p.files], options)
        for rel in targeted
    }
    added: dict[str, bytes] = {}
    if any(p.uses_compat for p in patches):
        added[COMPAT_REL] = render_compat(options)
    for rel in added:
        if rel not in recorded_added and _read(root, rel) is not None:
            raise EngineError(
                "added-file-exists",
                f"{root / rel} already exists and oldgpu did not write it; start from a fresh "
                "verl copy",
            )

    plan = Plan(root, "patch", version, options)
    # Originals first, then the manifest, then the tree: a run cut short leaves files the
    # manifest can still account for.
    for rel in targeted:
        _add_op(plan, f"{ORIGINALS_DIR}/{rel}", sources[rel], tree=False, order=0)
    new_manifest = {
        "schema": MANIFEST_SCHEMA,
        "engine": {"name": "oldgpu", "version": __version__},
        "verl_version": version,
        "options": options.as_dict(),
        "originals_dir": ORIGINALS_DIR,
        "files": {
            rel: {
                "original_sha256": sha256(sources[rel]),
                "patched_sha256": sha256(results[rel].data),
                "patches": sorted(n for n in results[rel].sites if n != "compat-module"),
            }
            for rel in targeted
        },
        "added": {rel: {"sha256": sha256(data)} for rel, data in added.items()},
        "patches": [],
    }
    for rel in targeted:
        _add_op(plan, rel, results[rel].data, tree=True, order=2)
        plan.files.append(_file_entry(plan, rel, sources[rel], results[rel].data, restoring=False))
    for rel in sorted(set(recorded_files) - set(targeted)):
        _add_op(plan, rel, originals[rel], tree=True, order=2)
        _add_op(plan, f"{ORIGINALS_DIR}/{rel}", None, tree=False, order=4)
        plan.files.append(_file_entry(plan, rel, originals[rel], originals[rel], restoring=True))
    for rel, data in added.items():
        _add_op(plan, rel, data, tree=True, order=2)
        plan.files.append(_file_entry(plan, rel, None, data, restoring=False))
    for rel in sorted(set(recorded_added) - set(added)):
        _add_op(plan, rel, None, tree=True, order=2)
        plan.files.append(_file_entry(plan, rel, None, None, restoring=True))

    report: dict[str, dict[str, Any]] = {}
    for patch in patches:
        report[patch.name] = {"name": patch.name, "description": patch.description, "sites": []}
    report["compat-module"] = {
        "name": "compat-module",
        "description": f"adds {COMPAT_REL} (compute dtype {options.compute_dtype}, attention "
        f"{options.attn_implementation}; env overrides OLDGPU_COMPUTE_DTYPE, "
        "OLDGPU_ATTN_IMPLEMENTATION) and imports it where sites use it",
        "sites": [Site(COMPAT_REL, MODULE_SCOPE, 1, "added file").as_dict()] if added else [],
    }
    for rel in targeted:
        for name, sites in results[rel].sites.items():
            report[name]["sites"].extend(s.as_dict() for s in sites)
    plan.patches = [r for r in report.values() if r["sites"]]
    new_manifest["patches"] = plan.patches
    _add_op(plan, MANIFEST_NAME, _dump_manifest(new_manifest), tree=False, order=1)
    plan.ops.sort(key=lambda op: op.order)
    return plan


def _file_entry(
    plan: Plan, rel: str, original: bytes | None, new: bytes | None, *, restoring: bool
):
    current = _read(plan.root, rel)
    return {
        "path": rel,
        "status": _status(current, new, restoring),
        "original_sha256": sha256(original) if original is not None else None,
        "target_sha256": sha256(new) if new is not None else None,
    }


def _dump_manifest(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")


def plan_revert(root: Path) -> Plan:
    root = Path(root)
    _check_tree(root)
    manifest = read_manifest(root)
    plan = Plan(root, "revert", manifest.get("verl_version") if manifest else None, None)
    if manifest is None:
        return plan
    _check_untouched(root, manifest)
    originals = _recorded_originals(root, manifest)
    for rel in sorted(manifest["files"]):
        _add_op(plan, rel, originals[rel], tree=True, order=0)
        plan.files.append(_file_entry(plan, rel, originals[rel], originals[rel], restoring=True))
    for rel in sorted(manifest["added"]):
        _add_op(plan, rel, None, tree=True, order=0)
        plan.files.append(_file_entry(plan, rel, None, None, restoring=True))
        # Bytecode of a module that is gone would only confuse the next reader of the tree.
        added = root / rel
        for pyc in sorted((added.parent / "__pycache__").glob(f"{added.stem}.*.pyc")):
            _add_op(plan, str(pyc.relative_to(root)), None, tree=False, order=1)
    # The manifest goes last but one and the originals last: until then a retry can finish.
    _add_op(plan, MANIFEST_NAME, None, tree=False, order=2)
    for rel in sorted(manifest["files"]):
        _add_op(plan, f"{ORIGINALS_DIR}/{rel}", None, tree=False, order=3)
    plan.ops.sort(key=lambda op: op.order)
    plan.patches = list(manifest.get("patches", []))
    return plan


# --- writing, all or nothing ---


def _stage(target: Path, data: bytes) -> Path:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".oldgpu-tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o644
        os.chmod(tmp, mode)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _mkdirs(path: Path, created: list[Path]) -> None:
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir()
        created.append(directory)


def _prune(root: Path, directories: Iterable[Path]) -> None:
    for directory in sorted(set(directories), key=lambda p: len(p.parts), reverse=True):
        try:
            if directory != root and directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
        except OSError:
            pass


def commit(plan: Plan) -> None:
    """Write the plan's ops: stage every new file, then rename/unlink; roll back on failure."""
    root = plan.root
    created: list[Path] = []
    staged: dict[int, Path] = {}
    try:
        for i, op in enumerate(plan.ops):
            if op.new is not None:
                target = root / op.rel
                _mkdirs(target.parent, created)
                staged[i] = _stage(target, op.new)
    except OSError as exc:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        _prune(root, created)
        raise EngineError("patch-write-failed", f"{root}: {exc}; nothing was changed") from exc
    done: list[_Op] = []
    try:
        for i, op in enumerate(plan.ops):
            target = root / op.rel
            if op.new is None:
                target.unlink(missing_ok=True)
            else:
                os.replace(staged[i], target)
                del staged[i]  # only once it is in place: a failed rename leaves it to clean up
            done.append(op)
    except OSError as exc:
        problems = []
        for op in reversed(done):
            target = root / op.rel
            try:
                if op.old is None:
                    target.unlink(missing_ok=True)
                else:
                    _mkdirs(target.parent, created)
                    os.replace(_stage(target, op.old), target)
            except OSError as again:
                problems.append(f"{target}: {again}")
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        _prune(root, created)
        detail = "rolled back" if not problems else "ROLLBACK INCOMPLETE: " + "; ".join(problems)
        raise EngineError("patch-write-failed", f"{root}: {exc}; {detail}") from exc
    # Directories emptied by a revert or a re-patch with fewer files.
    emptied = [
        parent
        for op in plan.ops
        if op.new is None
        for parent in (root / op.rel).parents
        if root in parent.parents
    ]
    _prune(root, emptied)


# --- CLI ---


def _profile_options(name: str) -> dict[str, str]:
    """The patch options of a profile: an architecture (``pascal``) or a profile name as
    ``oldgpu profile`` prints it (``pascal-6.1``, ``cpu``)."""
    from oldgpu import profile as profiles

    arch, _, cc = name.partition("-")
    if arch not in profiles.PROFILES:
        raise EngineError(
            "profile-unknown",
            f"no profile {name!r}: expected an architecture ({', '.join(profiles.PROFILES)}) "
            "or a name like pascal-6.1",
        )
    found = profiles.profile_for_arch(arch, cc or None)["patch_options"]
    return {key: str(found[key]) for key in PROFILE_KEYS if found.get(key) is not None}


def options_from_args(args: argparse.Namespace) -> Options:
    values: dict[str, str] = {}
    if args.profile:
        values.update(_profile_options(args.profile))
    # Explicit flags win over the profile.
    if args.compute_dtype:
        values["compute_dtype"] = args.compute_dtype
    if args.attn_implementation:
        values["attn_implementation"] = args.attn_implementation
    return Options(profile=args.profile, **values)


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "patch",
        parents=[common],
        help="patch a verl tree for a profile (dtype, attention, flash-attn-free padding)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("dir", type=Path, help="verl checkout or unpacked sdist (holds verl/)")
    parser.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, help="default fp32")
    parser.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, help="default sdpa")
    parser.add_argument(
        "--profile",
        help="take the options from this oldgpu profile (pascal, pascal-6.1, cpu, ...); "
        "--compute-dtype/--attn-implementation override it",
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if changes are needed"
    )
    parser.add_argument(
        "--diff", action="store_true", help="print what would change; change nothing"
    )
    parser.add_argument(
        "--revert", action="store_true", help="restore every file byte for byte, remove added ones"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> Result:
    if args.revert and (args.compute_dtype or args.attn_implementation or args.profile):
        raise EngineError("options-invalid", "--revert takes no patch options")
    plan = plan_revert(args.dir) if args.revert else plan_patch(args.dir, options_from_args(args))
    dry_run = args.check or args.diff
    diff = plan.diff() if args.diff else None
    if not dry_run and plan.changed:
        commit(plan)
    payload = {
        "action": plan.action,
        "changed": plan.changed,
        "dry_run": bool(dry_run),
        "dir": str(plan.root),
        "verl_version": plan.verl_version,
        "options": plan.options.as_dict() if plan.options else None,
        "manifest": str(plan.root / MANIFEST_NAME),
        "files": plan.files,
        "patches": plan.patches,
    }
    if diff is not None:
        payload["diff"] = diff
    code = 1 if args.check and plan.changed else 0
    return Result(payload, _text(plan, dry_run, diff), code)


def _text(plan: Plan, dry_run: bool, diff: str | None) -> str:
    if diff is not None:
        if diff:
            return diff
        return f"{plan.root}: " + (
            "only oldgpu's records change" if plan.changed else "nothing to change"
        )
    verb = {"patch": "patch", "revert": "revert"}[plan.action]
    if not plan.changed:
        state = "not patched" if plan.action == "revert" else "already patched as asked"
        return f"{plan.root}: {state}; nothing to change"
    head = f"{plan.root}: verl {plan.verl_version}"
    if plan.options:
        head += f" ({plan.options.compute_dtype}, {plan.options.attn_implementation})"
    head += f": {'would ' + verb if dry_run else verb + 'ed'}"
    lines = [head]
    lines += [f"  {f['status']:<9} {f['path']}" for f in plan.files if f["status"] != "unchanged"]
    return "\n".join(lines)
