"""The patched tree's records: ``.oldgpu-patch.json`` (versions, options, per file the
original and patched sha256) and the originals kept in ``.oldgpu-originals/``; reading
them back, and refusing a tree edited by hand since."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any

from oldgpu.output import EngineError

MANIFEST_NAME = ".oldgpu-patch.json"
ORIGINALS_DIR = ".oldgpu-originals"
MANIFEST_SCHEMA = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_rel(root: Path, rel: str) -> bytes | None:
    try:
        return (root / rel).read_bytes()
    except FileNotFoundError:
        return None


def safe_rel(rel: object) -> str:
    path = PurePosixPath(str(rel))
    if not isinstance(rel, str) or path.is_absolute() or ".." in path.parts or not path.parts:
        raise EngineError("manifest-invalid", f"{MANIFEST_NAME}: bad path {rel!r}")
    return str(path)


def read_verl_version(root: Path) -> str:
    """verl 0.5.0 keeps its version in verl/version/version (setup.py reads it from there)."""
    data = read_rel(root, "verl/version/version")
    if data is not None:
        return data.decode("utf-8").strip()
    pkg_info = read_rel(root, "PKG-INFO")
    if pkg_info is not None:
        for line in pkg_info.decode("utf-8", "replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    raise EngineError(
        "verl-version-unknown",
        f"{root}: neither verl/version/version nor PKG-INFO says the version",
    )


def check_tree(root: Path) -> None:
    if not (root / "verl" / "__init__.py").is_file():
        raise EngineError(
            "not-a-verl-tree", f"{root}: no verl/__init__.py (give the checkout or sdist root)"
        )


def read_manifest(root: Path) -> dict[str, Any] | None:
    data = read_rel(root, MANIFEST_NAME)
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
            safe_rel(rel)
    return manifest


def recorded_originals(root: Path, manifest: dict[str, Any] | None) -> dict[str, bytes]:
    """The kept originals, checked against their recorded hashes."""
    originals: dict[str, bytes] = {}
    for rel, rec in (manifest or {}).get("files", {}).items():
        data = read_rel(root, f"{ORIGINALS_DIR}/{rel}")
        if data is None or sha256(data) != rec.get("original_sha256"):
            raise EngineError(
                "originals-corrupt",
                f"{root / ORIGINALS_DIR / rel} is missing or does not match the hash in "
                f"{MANIFEST_NAME}; restore the tree from a fresh verl copy",
            )
        originals[rel] = data
    return originals


def check_untouched(root: Path, manifest: dict[str, Any] | None) -> None:
    """Refuse a tree edited by hand since it was patched."""
    for rel, rec in (manifest or {}).get("files", {}).items():
        data = read_rel(root, rel)
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
        data = read_rel(root, rel)
        if data is not None and sha256(data) != rec.get("sha256"):
            raise EngineError(
                "tree-modified",
                f"{root / rel} (added by oldgpu) was changed since; undo the edit or start from a "
                "fresh verl copy",
            )


def dump_manifest(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
