"""What a patch or revert run changes: each file's new bytes, computed from the
originals and verified in memory, as ordered ops for the transaction to write."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oldgpu import __version__
from oldgpu.output import EngineError
from oldgpu.patch.compat_module import (
    COMPAT_ALIAS,
    COMPAT_REL,
    compat_import_edit,
    render_compat,
    verify_compat_import,
)
from oldgpu.patch.manifest import (
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    ORIGINALS_DIR,
    check_tree,
    check_untouched,
    dump_manifest,
    read_manifest,
    read_rel,
    read_verl_version,
    recorded_originals,
    sha256,
)
from oldgpu.patch.options import Options
from oldgpu.patch.registry import select_patches
from oldgpu.patch.sitepatch import Change, Patch, Site, SiteNotFound, VerifyFailed
from oldgpu.patch.source import MODULE_SCOPE, Edit, SourceFile, apply_edits


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
            edit, site = compat_import_edit(src)
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
            verify_compat_import(new_src)
        except VerifyFailed as exc:
            raise EngineError("patch-verify-failed", f"patch compat-module: {rel}: {exc}") from exc
    return _FileResult(new, sites)


@dataclass
class Op:
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
    ops: list[Op] = field(default_factory=list)
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
    old = read_rel(plan.root, rel)
    if old != new:
        plan.ops.append(Op(rel, old, new, tree, order))


def plan_patch(root: Path, options: Options) -> Plan:
    root = Path(root)
    check_tree(root)
    manifest = read_manifest(root)
    version = read_verl_version(root)
    if manifest is not None and manifest.get("verl_version") != version:
        raise EngineError(
            "tree-modified",
            f"{root}: verl/version/version says {version} but the tree was patched as verl "
            f"{manifest.get('verl_version')}; start from a fresh verl copy",
        )
    patches = select_patches(version, options)
    check_untouched(root, manifest)
    originals = recorded_originals(root, manifest)
    recorded_files = dict((manifest or {}).get("files", {}))
    recorded_added = dict((manifest or {}).get("added", {}))

    targeted: list[str] = []
    for patch in patches:
        targeted.extend(rel for rel in patch.files if rel not in targeted)
    sources: dict[str, bytes] = {}
    for rel in targeted:
        data = originals.get(rel, read_rel(root, rel))
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
        if rel not in recorded_added and read_rel(root, rel) is not None:
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
    _add_op(plan, MANIFEST_NAME, dump_manifest(new_manifest), tree=False, order=1)
    plan.ops.sort(key=lambda op: op.order)
    return plan


def _file_entry(
    plan: Plan, rel: str, original: bytes | None, new: bytes | None, *, restoring: bool
):
    current = read_rel(plan.root, rel)
    return {
        "path": rel,
        "status": _status(current, new, restoring),
        "original_sha256": sha256(original) if original is not None else None,
        "target_sha256": sha256(new) if new is not None else None,
    }


def plan_revert(root: Path) -> Plan:
    root = Path(root)
    check_tree(root)
    manifest = read_manifest(root)
    plan = Plan(root, "revert", manifest.get("verl_version") if manifest else None, None)
    if manifest is None:
        return plan
    check_untouched(root, manifest)
    originals = recorded_originals(root, manifest)
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
