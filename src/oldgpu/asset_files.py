"""What a placed model or data set holds, where it lands, and how a copy is checked.

``oldgpu.assets`` puts copies in place; this module owns the rules it checks them by:
ids and revisions (one directory name each), the places (under ``oldgpu paths``'
models_dir, datasets_dir and prepared_dir), the files a model or a data set needs,
the statements a source makes (``oldgpu-assets.json``, ``SHA256SUMS``) and the record
a placed copy keeps of itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from oldgpu import paths
from oldgpu.output import EngineError

KINDS = ("model", "dataset")
SOURCES = ("mirror", "hub")
MANIFEST = "oldgpu-assets.json"  # a mirror's statement, and a placed copy's record
SHA256SUMS = "SHA256SUMS"
STATEMENTS = (MANIFEST, SHA256SUMS)
# What the hub's snapshot_download leaves beside the files.
SKIPPED_DIRS = (".cache", ".git")
CHUNK = 1 << 20

# Exit codes (the job settings' own refusal is 4).
EXIT_SPEC = 4
EXIT_SOURCE = 20
EXIT_REVISION = 21
EXIT_MISSING = 22
EXIT_SHA = 23
EXIT_INDEX = 24
EXIT_PLACE = 25
EXIT_HUB = 26
EXIT_CODES = (EXIT_SPEC, EXIT_SOURCE, EXIT_REVISION, EXIT_MISSING, EXIT_SHA, EXIT_INDEX,
              EXIT_PLACE, EXIT_HUB)  # fmt: skip

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


def error(name: str, message: str, code: int) -> EngineError:
    return EngineError(name, message, code=code)


def check_id(kind: str, asset_id: str, revision: str) -> None:
    """Refuse an id or revision that is not one directory name (or org/name)."""
    if kind not in KINDS:
        raise error("asset-kind-unknown", f"{kind!r} is not one of {list(KINDS)}", EXIT_SPEC)
    if not ID_RE.match(asset_id) or ".." in asset_id:
        raise error(
            "asset-id-invalid",
            f"{kind} {asset_id!r}: an id is name or org/name (letters, digits, . _ -)",
            EXIT_SPEC,
        )
    if not REVISION_RE.match(revision) or ".." in revision:
        raise error(
            "asset-revision-invalid",
            f"{kind} {asset_id}: revision {revision!r} is one name (letters, digits, . _ -): "
            "a branch, a tag or a commit",
            EXIT_SPEC,
        )


def place_of(kind: str, asset_id: str, revision: str, root: Path | None = None) -> Path:
    """Where a model or data set lands (``oldgpu paths`` owns the roots)."""
    check_id(kind, asset_id, revision)
    return root_of(kind, root) / asset_id / revision


def root_of(kind: str, root: Path | None = None) -> Path:
    if root is not None:
        return Path(root)
    return paths.MODELS_DIR if kind == "model" else paths.DATASETS_DIR


def prepared_of(dataset_id: str, revision: str) -> Path:
    """Where ``oldgpu data`` writes a placed data set in verl's layout."""
    check_id("dataset", dataset_id, revision)
    return paths.PREPARED_DIR / dataset_id / revision


def job_paths(kind: str, asset_id: str, revision: str) -> tuple[str, ...]:
    """A job's ``model_path``, or its ``train_files`` and ``val_files``, for an id."""
    if kind == "model":
        return (str(place_of("model", asset_id, revision)),)
    out = prepared_of(asset_id, revision)
    return (str(out / "train.parquet"), str(out / "test.parquet"))


# --- files and their hashes ---


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def git_blob_id(path: Path) -> str:
    """The git blob id of a file (the hub states it for files outside LFS)."""
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def list_files(root: Path) -> list[str]:
    """The files under ``root`` as relative paths, without statements and hidden dirs."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel in STATEMENTS:
                continue
            out.append(rel)
    return sorted(out)


def digest_of(files: Mapping[str, str]) -> str:
    """One hash for a copy's content: its paths and their sha256."""
    text = "".join(f"{sha}  {rel}\n" for rel, sha in sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def read_statement(src: Path) -> tuple[dict[str, str], str | None]:
    """The sha256 a mirror states for each file, and its commit, if it states any."""
    manifest = src / MANIFEST
    if manifest.is_file():
        try:
            doc = json.loads(manifest.read_text(encoding="utf-8"))
            files = doc["files"]
            stated = {
                str(rel): str(v["sha256"] if isinstance(v, Mapping) else v)
                for rel, v in files.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise error(
                "asset-statement-invalid",
                f"{manifest}: not {{'files': {{path: sha256}}}} ({exc})",
                EXIT_SHA,
            ) from None
        commit = doc.get("commit") if isinstance(doc.get("commit"), str) else None
    elif (src / SHA256SUMS).is_file():
        stated, commit = {}, None
        for n, line in enumerate((src / SHA256SUMS).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            sha, _, rel = line.partition(" ")
            rel = rel.strip().lstrip("*")  # sha256sum's binary mark
            if not rel:
                raise error(
                    "asset-statement-invalid", f"{src / SHA256SUMS}:{n}: not '<sha256>  <path>'",
                    EXIT_SHA,
                )  # fmt: skip
            stated[rel] = sha
    else:
        return {}, None
    for rel, sha in stated.items():
        if not SHA_RE.match(sha) or os.path.isabs(rel) or ".." in Path(rel).parts:
            raise error(
                "asset-statement-invalid", f"{src}: {rel!r}: {sha!r} is not a sha256 of a file "
                "inside the revision", EXIT_SHA,
            )  # fmt: skip
    return stated, commit


def check_files(kind: str, root: Path, files: Iterable[str], where: str) -> None:
    """The files a model or a data set needs are there (and every file an index names)."""
    names = set(files)
    base = {Path(f).name for f in names}
    missing = []
    if kind == "model":
        if "config.json" not in names:
            missing.append("config.json")
        if not any(t in names for t in TOKENIZER_FILES):
            missing.append("a tokenizer (" + " or ".join(TOKENIZER_FILES) + ")")
        weights = [
            f for f in names
            if f.endswith(".safetensors") or re.match(r"pytorch_model.*\.bin$", Path(f).name)
        ]  # fmt: skip
        if not weights:
            missing.append("weights (*.safetensors or pytorch_model*.bin)")
        for index in WEIGHT_INDEXES:
            if index in names:
                _check_index(root / index, names, where)
    elif not any(f.endswith(DATA_SUFFIXES) for f in names):
        missing.append("data files (" + ", ".join("*" + s for s in DATA_SUFFIXES) + ")")
    if missing:
        raise error(
            "asset-files-missing",
            f"{where}: a {kind} needs {'; '.join(missing)} (has {', '.join(sorted(base)) or '-'})",
            EXIT_MISSING,
        )


def _check_index(index: Path, names: set[str], where: str) -> None:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise error(
            "asset-index-inconsistent", f"{where}: {index.name} has no weight_map ({exc})",
            EXIT_INDEX,
        ) from None  # fmt: skip
    absent = sorted(str(s) for s in shards if str(s) not in names)
    if absent:
        raise error(
            "asset-index-inconsistent",
            f"{where}: {index.name} names {', '.join(absent)}, which the copy lacks",
            EXIT_INDEX,
        )


# --- the placed copy ---


def read_placed(place: Path) -> dict[str, Any] | None:
    """The record of the copy at ``place``, or None when nothing (whole) is there."""
    try:
        doc = json.loads((place / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        return None
    for rel, entry in doc["files"].items():
        try:
            if (place / rel).stat().st_size != entry["size"]:
                return None  # changed under us: place it again
        except (OSError, KeyError, TypeError):
            return None
    return doc


def verify_placed(place: Path) -> list[str]:
    """The files of a placed copy whose sha256 no longer matches its record."""
    doc = read_placed(place)
    if doc is None:
        return ["(no whole copy)"]
    return sorted(rel for rel, e in doc["files"].items() if sha256_of(place / rel) != e["sha256"])
