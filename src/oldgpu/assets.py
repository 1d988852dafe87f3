"""``oldgpu assets``: a model or a data set put in place on a host, and verified.

A job names its model and data set by id and revision (``model``, ``model_revision``,
``dataset``, ``dataset_revision``); they land in fixed places (``oldgpu paths``):
``models_dir/<id>/<revision>`` and ``datasets_dir/<id>/<revision>``, readable by the
jobs' user and by the hardened unit. Sources:

- ``mirror``: a directory (local, NFS, or the copy the ``verl_jobs`` role synchronized
  from the controller) laid out ``<mirror>/<id>/<revision>/<files>``. Where it holds
  ``oldgpu-assets.json`` (``{"commit": ..., "files": {path: sha256}}``) or ``SHA256SUMS``
  (``<sha256>  <path>`` lines), every file is checked against it.
- ``hub``: ``huggingface_hub.snapshot_download`` of the revision's commit, from the
  endpoint given (empty: the library's own default); each LFS file is checked against
  the hub's sha256 and each other file against its git blob id.

Every copy is checked before it is used: a model has config.json, a tokenizer and
weights (every file its index names), a data set has parquet or jsonl files. The
placed copy records its source, commit and each file's sha256 (``oldgpu-assets.json``
in it): a source whose content changed for the same revision is reported changed and
placed again. A copy is staged beside its place and switched in by renaming a link,
so a reader sees the old copy or the new one, never half of one; ``--check`` says
what would change and changes nothing. ``changed`` in ``--json`` is for Ansible.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oldgpu import subcommand, switch
from oldgpu.asset_files import (
    EXIT_HUB,
    EXIT_MISSING,
    EXIT_PLACE,
    EXIT_REVISION,
    EXIT_SHA,
    EXIT_SOURCE,
    KINDS,
    MANIFEST,
    SKIPPED_DIRS,
    SOURCES,
    check_files,
    digest_of,
    error,
    git_blob_id,
    list_files,
    place_of,
    prepared_of,
    read_placed,
    read_statement,
    root_of,
    sha256_of,
    verify_placed,
)
from oldgpu.jobs.settings import FIELD_BY_NAME
from oldgpu.output import EngineError, Result


@dataclass
class Source:
    """Where one revision comes from: a way to know its content, and a way to copy it."""

    name: str  # for the record: "mirror:/srv/models" or "hub:<endpoint or default>"
    commit: str | None
    stated: dict[str, str]  # path -> sha256 the source states (may be partial or empty)
    files: list[str] | None  # the files, when known before copying
    fill: Callable[[Path], None]  # put the revision's files into an empty directory
    verify: Callable[[Path, dict[str, str]], None] | None = None  # extra checks after copy


def mirror_source(kind: str, asset_id: str, revision: str, mirror: Path, link: bool) -> Source:
    src = Path(mirror) / asset_id / revision
    if not Path(mirror).is_dir():
        raise error("asset-mirror-missing", f"{mirror}: no such directory", EXIT_SOURCE)
    if not src.is_dir():
        have = sorted(p.name for p in src.parent.iterdir()) if src.parent.is_dir() else []
        raise error(
            "asset-revision-missing",
            f"{kind} {asset_id}@{revision}: not in the mirror ({src} is missing; "
            f"revisions there: {', '.join(have) or 'none'})",
            EXIT_REVISION,
        )
    stated, commit = read_statement(src)
    files = list_files(src)
    absent = sorted(set(stated) - set(files))
    if absent:
        raise error(
            "asset-files-missing",
            f"{src}: its statement names {', '.join(absent)}, which it lacks",
            EXIT_MISSING,
        )
    check_files(kind, src, files, str(src))

    def fill(target: Path) -> None:
        for rel in files:
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if link:
                try:  # the controller's synchronized copy: no second copy of the bytes
                    os.link(src / rel, dest)
                    continue
                except OSError:
                    pass
            shutil.copyfile(src / rel, dest)

    return Source(f"mirror:{mirror}", commit, stated, files, fill)


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError as exc:  # the CLI re-runs under the training venv first
        raise error(
            "python-package-missing",
            f"the hub source needs huggingface_hub ({exc}); run with the training venv's python",
            EXIT_HUB,
        ) from None
    return huggingface_hub


def hub_source(kind: str, asset_id: str, revision: str, endpoint: str, token: str | None) -> Source:
    hf = _hub()
    repo_type = "model" if kind == "model" else "dataset"
    api = hf.HfApi(endpoint=endpoint or None, token=token)
    try:
        info = api.repo_info(asset_id, repo_type=repo_type, revision=revision, files_metadata=True)
    except Exception as exc:  # the hub's errors are many types; name them as one
        raise error(
            "asset-hub-failed",
            f"{kind} {asset_id}@{revision} from {endpoint or 'the default endpoint'}: "
            f"{type(exc).__name__}: {exc}",
            EXIT_HUB,
        ) from None
    commit = info.sha
    stated, blobs = {}, {}
    for sibling in info.siblings or ():
        lfs = getattr(sibling, "lfs", None)
        sha = getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)
        if sha:
            stated[sibling.rfilename] = sha
        elif getattr(sibling, "blob_id", None):
            blobs[sibling.rfilename] = sibling.blob_id

    def fill(target: Path) -> None:
        try:
            hf.snapshot_download(
                asset_id, repo_type=repo_type, revision=commit, local_dir=str(target),
                endpoint=endpoint or None, token=token,
            )  # fmt: skip
        except Exception as exc:
            raise error(
                "asset-hub-failed", f"{kind} {asset_id}@{commit}: {type(exc).__name__}: {exc}",
                EXIT_HUB,
            ) from None  # fmt: skip
        for skipped in SKIPPED_DIRS:
            shutil.rmtree(target / skipped, ignore_errors=True)

    def verify(target: Path, hashes: dict[str, str]) -> None:
        bad = sorted(rel for rel, blob in blobs.items() if git_blob_id(target / rel) != blob)
        if bad:
            raise error(
                "asset-sha-mismatch",
                f"{kind} {asset_id}@{commit}: {', '.join(bad)} differ from the hub's git blob id",
                EXIT_SHA,
            )

    return Source(f"hub:{endpoint or 'default'}", commit, stated, None, fill, verify)


def _unchanged(placed: dict[str, Any] | None, source: Source, src_dir: Path | None) -> bool:
    """The placed copy is the source's revision as it is now."""
    if placed is None:
        return False
    if source.commit and placed.get("commit") == source.commit and source.files is None:
        return True  # the hub: a commit names its content
    if source.files is None or sorted(placed["files"]) != source.files:
        return False
    for rel in source.files:
        want = source.stated.get(rel)
        if want is None:  # not stated: the mirror's file itself is the truth
            want = sha256_of(src_dir / rel) if src_dir else None
        if want != placed["files"][rel]["sha256"]:
            return False
    return True


def fetch(
    kind: str,
    asset_id: str,
    revision: str,
    source: str,
    *,
    mirror: Path | None = None,
    endpoint: str = "",
    token: str | None = None,
    link: bool = False,
    check: bool = False,
    root: Path | None = None,
) -> dict[str, Any]:
    """Put ``kind`` ``asset_id``@``revision`` in place from ``source``; what changed."""
    place = place_of(kind, asset_id, revision, root)
    if source == "mirror":
        if mirror is None:
            raise error("asset-mirror-missing", "the mirror source needs --mirror DIR", EXIT_SOURCE)
        src = mirror_source(kind, asset_id, revision, mirror, link)
        src_dir: Path | None = Path(mirror) / asset_id / revision
    elif source == "hub":
        src, src_dir = hub_source(kind, asset_id, revision, endpoint, token), None
    else:
        raise error(
            "asset-source-unknown", f"{source!r} is not one of {list(SOURCES)}", EXIT_SOURCE
        )
    placed = read_placed(place)
    report = {
        "kind": kind, "id": asset_id, "revision": revision, "path": str(place),
        "source": src.name, "commit": src.commit,
        "previous_digest": placed.get("digest") if placed else None,
    }  # fmt: skip
    if _unchanged(placed, src, src_dir):
        assert placed is not None
        return {**report, "changed": False, "action": "unchanged", "digest": placed["digest"]}
    action = "replace" if place.exists() or place.is_symlink() else "place"
    if check:
        return {**report, "changed": True, "action": f"would-{action}", "digest": None}
    digest = _stage_and_switch(kind, asset_id, place, src, root_of(kind, root))
    return {**report, "changed": True, "action": action + "d", "digest": digest}


def _stage_and_switch(kind: str, asset_id: str, place: Path, src: Source, root: Path) -> str:
    """Copy into a staging dir beside ``place``, check it, then switch the link to it."""
    parent = place.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for d in [parent, *parent.parents]:
            if not d.is_relative_to(root):
                break
            d.chmod(d.stat().st_mode | 0o755)  # the jobs' user reads through them
        staging = new_staging(place)
    except OSError as exc:
        raise error("asset-place-failed", f"{place}: {exc}", EXIT_PLACE) from None
    try:
        src.fill(staging)
        files = list_files(staging)
        hashes = {rel: sha256_of(staging / rel) for rel in files}
        bad = sorted(rel for rel, sha in src.stated.items() if hashes.get(rel) != sha)
        if bad:
            raise error(
                "asset-sha-mismatch",
                f"{src.name}: {', '.join(bad)}: sha256 differs from the stated one "
                "(the old copy, if any, is left in place)",
                EXIT_SHA,
            )
        if src.verify:
            src.verify(staging, hashes)
        check_files(kind, staging, files, src.name)
        digest = digest_of(hashes)
        record = {
            "kind": kind, "id": asset_id,
            "revision": place.name, "source": src.name, "commit": src.commit, "digest": digest,
            "files": {
                rel: {"sha256": hashes[rel], "size": (staging / rel).stat().st_size}
                for rel in files
            },
        }  # fmt: skip
        (staging / MANIFEST).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        switch_in(place, staging, digest)
        return digest
    except OSError as exc:
        raise error("asset-place-failed", f"{place}: {exc}", EXIT_PLACE) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def copies_of(place: Path) -> Path:
    """Where a place's copies live, one per content (its digest); the link names one."""
    return place.parent / f".{place.name}+copies"  # "+" is in no id or revision


def new_staging(place: Path) -> Path:
    """An empty directory for ``place``'s next copy (an interrupted run's are removed)."""
    if place.exists() and not place.is_symlink():
        raise error(
            "asset-place-taken",
            f"{place} is a directory this command did not place; move it away",
            EXIT_PLACE,
        )
    copies = copies_of(place)
    copies.mkdir(parents=True, exist_ok=True)
    copies.chmod(0o755)  # the jobs' user reads through it
    for stale in copies.glob(".staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=copies, prefix=".staging-"))


def switch_in(place: Path, staging: Path, digest: str) -> None:
    """Name the staged copy by its digest and point ``place`` at it.

    oldgpu.switch moves the link (a new one renamed over the old: a job starting sees
    the old copy or the new one) and removes the other copies.
    """
    final = copies_of(place) / digest[:16]
    if final.exists():  # the same content, whose record was damaged: never remove a live copy
        final = final.with_name(f"{digest[:16]}-{staging.name.rsplit('-', 1)[-1]}")
    os.rename(staging, final)
    switch.switch(place, final, keep=0)


# --- a mirror, filled ---


def publish(kind: str, asset_id: str, revision: str, src: Path, mirror: Path) -> dict[str, Any]:
    """Copy a directory into a mirror as ``<mirror>/<id>/<revision>`` with its statement.

    How an air-gapped mirror is filled from a download (and the smoke assets become
    one): the sha256 of every file is written to ``oldgpu-assets.json`` beside them.
    The same content again changes nothing; new content for a revision replaces it.
    """
    src = Path(src)
    if not src.is_dir():
        raise error("asset-files-missing", f"{src}: no such directory", EXIT_MISSING)
    files = list_files(src)
    check_files(kind, src, files, str(src))
    hashes = {rel: sha256_of(src / rel) for rel in files}
    digest = digest_of(hashes)
    target = place_of(kind, asset_id, revision, Path(mirror))
    try:
        stated, _ = read_statement(target) if target.is_dir() else ({}, None)
    except EngineError:
        stated = {}
    report = {"kind": kind, "id": asset_id, "revision": revision, "path": str(target),
              "digest": digest}  # fmt: skip
    if stated == hashes and list_files(target) == files:
        return {**report, "changed": False}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{revision}+staging-"))
        try:
            for rel in files:
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, staging / rel)
            doc = {"kind": kind, "id": asset_id, "revision": revision, "files": hashes}
            (staging / MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
            for path in [staging, *staging.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            old = target.parent / f".{revision}+old-{os.getpid()}"
            if target.exists():
                os.rename(target, old)
            os.rename(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise error("asset-place-failed", f"{target}: {exc}", EXIT_PLACE) from None
    return {**report, "changed": True}


# --- CLI ---


def place_job(
    model: str = "",
    model_revision: str = "main",
    dataset: str = "",
    dataset_revision: str = "main",
    data_source: str = "openai/gsm8k",
    **source: Any,
) -> dict[str, Any]:
    """A job's model and data set in place, and the data set in verl's layout."""
    from oldgpu import data  # it needs pyarrow, which only the job command asks for

    done = []
    if model:
        done.append(fetch("model", model, model_revision, **source))
    if dataset:
        raw = fetch("dataset", dataset, dataset_revision, **source)
        done.append(raw)
        out = prepared_of(dataset, dataset_revision)
        if raw["changed"] and source.get("check"):
            done.append({"kind": "prepared", "path": str(out), "changed": True,
                         "action": "would-prepare"})  # fmt: skip
        else:
            place = place_of("dataset", dataset, dataset_revision, source.get("root"))
            done.append(data.prepare(place, data_source, out, check=bool(source.get("check"))))
    return {"changed": any(d["changed"] for d in done), "assets": done}


def requires(args: argparse.Namespace) -> tuple[str, ...]:
    """What a call needs beyond the standard library (the CLI re-runs it in the venv)."""
    need = ("huggingface_hub",) if getattr(args, "source", "") == "hub" else ()
    if getattr(args, "assets_command", "") == "job" and args.dataset:
        need += ("pyarrow",)
    return need


def _token(args: argparse.Namespace) -> str | None:
    if not args.token_file:
        return None
    try:
        if Path(args.token_file).stat().st_mode & 0o077:
            raise error(
                "asset-token-exposed",
                f"{args.token_file}: others may read it; chmod 0600 (it holds the hub's token)",
                EXIT_SOURCE,
            )
        return Path(args.token_file).read_text(encoding="utf-8").strip() or None
    except OSError as exc:
        raise error(
            "asset-token-unreadable", f"{args.token_file}: {exc.strerror}", EXIT_SOURCE
        ) from None


def add_source_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default="mirror", help="mirror (default) or hub")
    parser.add_argument("--mirror", type=Path, help="the mirror: <MIRROR>/<id>/<revision>/")
    parser.add_argument(
        "--link", action="store_true", help="hard-link from the mirror where it can (same disk)"
    )
    parser.add_argument(
        "--endpoint", default=os.environ.get("HF_ENDPOINT", ""),
        help="the hub's URL (default $HF_ENDPOINT; empty: huggingface_hub's own)",
    )  # fmt: skip
    parser.add_argument("--token-file", help="a file holding the hub's token (keep it 0600)")
    parser.add_argument(
        "--check", action="store_true", help="say what would change; change nothing"
    )


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "put a model or a data set in place from a mirror or the hub, verified"
    parser = subcommand.add(subparsers, common, "assets", None, __doc__, help=summary)
    sub = parser.add_subparsers(dest="assets_command", required=True)
    f = subcommand.add(sub, common, "fetch", run_fetch, help="place one model or data set")
    f.add_argument("kind", choices=KINDS)
    f.add_argument("id", help="org/name, as the hub names it")
    f.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    add_source_options(f)
    summary = "place a job's model and data set, and prepare the data set (oldgpu data)"
    j = subcommand.add(sub, common, "job", run_job, help=summary)
    # The job settings' own defaults (a worker of a cluster job gets them sparse).
    for name in ("model", "model_revision", "dataset", "dataset_revision", "data_source"):
        field = FIELD_BY_NAME[name]
        j.add_argument("--" + name.replace("_", "-"), default=field.default, help=field.help)
    add_source_options(j)
    summary = "copy a directory into a mirror, with the sha256 of each file"
    m = subcommand.add(sub, common, "publish", run_publish, help=summary)
    m.add_argument("kind", choices=KINDS)
    m.add_argument("id")
    m.add_argument("--revision", required=True)
    m.add_argument("--from", dest="src", type=Path, required=True, help="the files")
    m.add_argument("--mirror", type=Path, required=True, help="the mirror's root")
    v = subcommand.add(sub, common, "verify", run_verify, help="re-hash a placed copy")
    v.add_argument("kind", choices=KINDS)
    v.add_argument("id")
    v.add_argument("--revision", default="main")


def run_fetch(args: argparse.Namespace) -> Result:
    doc = fetch(
        args.kind, args.id, args.revision, args.source, mirror=args.mirror,
        endpoint=args.endpoint, token=_token(args), link=args.link, check=args.check,
    )  # fmt: skip
    return Result(doc, f"{doc['path']}: {doc['action']} ({doc['source']})")


def run_job(args: argparse.Namespace) -> Result:
    doc = place_job(
        args.model, args.model_revision, args.dataset, args.dataset_revision, args.data_source,
        source=args.source, mirror=args.mirror, endpoint=args.endpoint, token=_token(args),
        link=args.link, check=args.check,
    )  # fmt: skip
    text = "\n".join(f"{d['path']}: {d['action']}" for d in doc["assets"]) or "nothing to place"
    return Result(doc, text)


def run_publish(args: argparse.Namespace) -> Result:
    doc = publish(args.kind, args.id, args.revision, args.src, args.mirror)
    return Result(doc, f"{doc['path']}: {'published' if doc['changed'] else 'unchanged'}")


def run_verify(args: argparse.Namespace) -> Result:
    place = place_of(args.kind, args.id, args.revision)
    if read_placed(place) is None:
        raise error("asset-not-placed", f"{place}: no whole copy placed there", EXIT_MISSING)
    bad = verify_placed(place)
    if bad:
        raise error(
            "asset-sha-mismatch", f"{place}: {', '.join(bad)} differ from its record", EXIT_SHA
        )
    return Result({"path": str(place), "ok": True}, f"{place}: every file matches its record")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run: oldgpu assets")
