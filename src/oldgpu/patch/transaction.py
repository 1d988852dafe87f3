"""Writing a plan all or nothing, even when the process is killed halfway.

A commit first writes a journal, ``DIR/.oldgpu-patch.journal`` (fsync'd): every op with
its target, the sha256 of the target's old and new content, and the temporary file it
is staged in. It then stages every new file, renames the staged files into place (the
manifest last), prunes emptied directories, and removes the journal.

A journal found by a later run means a commit was interrupted. ``recover`` finishes it
when every op still to do has its staged file (so after the first rename it always
can), or else undoes it (only staging had started), then removes the journal and every
``*.oldgpu-tmp``. Either way the tree is the old one or the new one, byte for byte.

Runs on one tree exclude each other through a lock on the tree's directory; a failed
write in a live process rolls back the ops it did, as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from oldgpu.output import EngineError
from oldgpu.patch.manifest import read_rel, safe_rel, sha256
from oldgpu.patch.plans import Plan

JOURNAL_NAME = ".oldgpu-patch.journal"
JOURNAL_SCHEMA = 1
TMP_SUFFIX = ".oldgpu-tmp"
# For the tests only: a commit ends the process (exit 137, as a SIGKILL) just before
# its step N, to prove that every point of a commit can be recovered from.
CRASH_ENV = "OLDGPU_PATCH_CRASH_AT"


@dataclass(frozen=True)
class JournalOp:
    rel: str
    tmp: str | None  # where the new content is staged; None: the target is removed
    old: str | None  # sha256 of the target before; None: absent
    new: str | None  # sha256 after; None: removed

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.rel, "tmp": self.tmp, "old": self.old, "new": self.new}


class _Steps:
    """Counts the commit's steps; ends the process before step CRASH_ENV (tests)."""

    def __init__(self) -> None:
        value = os.environ.get(CRASH_ENV, "")
        self.crash_at = int(value) if value.isdigit() else 0
        self.n = 0

    def __call__(self) -> None:
        self.n += 1
        if self.n == self.crash_at:
            os._exit(137)


def tmp_rel(rel: str) -> str:
    path = PurePosixPath(rel)
    return str(path.parent / f".{path.name}{TMP_SUFFIX}")


def _digest(data: bytes | None) -> str | None:
    return None if data is None else sha256(data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new(path: Path, data: bytes, mode: int, step: _Steps | None = None) -> None:
    """Create or truncate ``path`` and write ``data`` durably (a step between the two)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if step is not None:
            step()  # an empty staged file: recovery must not take it for the content
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _missing_dirs(root: Path, rels: Iterable[str]) -> list[str]:
    """Directories the targets need that do not exist yet, parents first."""
    missing: dict[str, None] = {}
    for rel in rels:
        chain = []
        parent = (root / rel).parent
        while not parent.exists():
            chain.append(str(parent.relative_to(root)))
            parent = parent.parent
        missing.update(dict.fromkeys(reversed(chain)))
    return list(missing)


def _emptied_dirs(rels: Iterable[str]) -> list[str]:
    """The parents of removed files: pruned when a commit leaves them empty."""
    return sorted({str(p) for rel in rels for p in PurePosixPath(rel).parents if str(p) != "."})


def _prune(root: Path, rels: Iterable[str]) -> None:
    for rel in sorted(set(rels), key=lambda r: len(PurePosixPath(r).parts), reverse=True):
        directory = root / rel
        with contextlib.suppress(OSError):
            if directory != root and directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()


# --- the lock ---


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold the tree's lock (a flock on its directory) for one run."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise EngineError("not-a-verl-tree", f"{root}: {exc.strerror}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise EngineError("patch-write-failed", f"{root}: cannot lock: {exc}") from exc
            raise EngineError(
                "patch-in-progress",
                f"{root}: another oldgpu patch is running on this tree; try again when it ends",
            ) from exc
        yield
    finally:
        os.close(fd)  # releases the lock


# --- commit ---


def commit(plan: Plan) -> None:
    """Write the plan's ops all or nothing (see the module's docstring)."""
    root = plan.root
    step = _Steps()
    for op in plan.ops:
        if read_rel(root, op.rel) != op.old:
            raise EngineError(
                "tree-modified", f"{root / op.rel} changed since the plan was made; run again"
            )
    ops = [
        JournalOp(
            op.rel, None if op.new is None else tmp_rel(op.rel), _digest(op.old), _digest(op.new)
        )
        for op in plan.ops
    ]
    new_data = {op.rel: op.new for op in plan.ops}
    journal = {
        "schema": JOURNAL_SCHEMA,
        "action": plan.action,
        "ops": [op.as_dict() for op in ops],
        "dirs": _missing_dirs(root, [op.rel for op in ops if op.tmp]),
        "prune": _emptied_dirs([op.rel for op in ops if op.new is None]),
    }
    # Directories whose entries change: fsync'd before the journal that vouches for them goes.
    touched = sorted(
        {(root / op.rel).parent for op in ops} | {(root / d).parent for d in journal["dirs"]}
    )
    try:
        step()
        _write_new(root / JOURNAL_NAME, _dump(journal), 0o644, step)
        _fsync_dir(root)
        for rel in journal["dirs"]:
            step()
            (root / rel).mkdir(exist_ok=True)
        for op in ops:
            if op.tmp is not None:
                target = root / op.rel
                mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o644
                step()
                _write_new(root / op.tmp, new_data[op.rel], mode, step)
        for directory in touched:
            _fsync_dir(directory)
    except OSError as exc:
        _undo_staging(root, ops, journal["dirs"])
        raise EngineError("patch-write-failed", f"{root}: {exc}; nothing was changed") from exc
    done: list[int] = []
    try:
        for i, op in enumerate(ops):
            step()
            if op.tmp is None:
                (root / op.rel).unlink(missing_ok=True)
            else:
                os.replace(root / op.tmp, root / op.rel)
            done.append(i)
    except OSError as exc:
        problems = _roll_back(plan, done)
        if problems:  # the journal stays: the next run finishes or says what is left
            detail = "ROLLBACK INCOMPLETE: " + "; ".join(problems)
        else:
            _undo_staging(root, ops, journal["dirs"])
            detail = "rolled back"
        raise EngineError("patch-write-failed", f"{root}: {exc}; {detail}") from exc
    step()
    _finish(root, journal["prune"], touched, step)


def _roll_back(plan: Plan, done: list[int]) -> list[str]:
    """Put back the old content of the ops done; the problems met."""
    root = plan.root
    problems = []
    for i in reversed(done):
        op = plan.ops[i]
        target = root / op.rel
        try:
            if op.old is None:
                target.unlink(missing_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = root / tmp_rel(op.rel)
                mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o644
                _write_new(tmp, op.old, mode)
                os.replace(tmp, target)
        except OSError as again:
            problems.append(f"{target}: {again}")
    return problems


def _undo_staging(root: Path, ops: list[JournalOp], dirs: list[str]) -> None:
    """Remove the staged files, the directories made for them and the journal."""
    for op in ops:
        if op.tmp is not None:
            (root / op.tmp).unlink(missing_ok=True)
    _prune(root, dirs)
    (root / JOURNAL_NAME).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        _fsync_dir(root)


def _finish(root: Path, prune: list[str], touched: Iterable[Path], step: _Steps | None) -> None:
    """Make the renames durable, prune emptied directories, then drop the journal."""
    for directory in touched:
        if directory.is_dir():
            _fsync_dir(directory)
    _prune(root, prune)
    if step is not None:
        step()
    (root / JOURNAL_NAME).unlink(missing_ok=True)
    _fsync_dir(root)


def _dump(journal: dict[str, Any]) -> bytes:
    return (json.dumps(journal, indent=1) + "\n").encode("utf-8")


# --- recovery ---


def recover(root: Path, *, sweep: bool) -> str | None:
    """Finish or undo an interrupted commit; say which (None: there was none).

    With ``sweep`` (runs that write), also remove any ``*.oldgpu-tmp`` left in the tree
    (by an interrupted commit of an oldgpu without the journal, say).
    """
    data = read_rel(root, JOURNAL_NAME)
    outcome = None
    if data is not None:
        journal = _parse(data)
        # None: cut short while being written, so nothing was staged yet.
        outcome = "rolled back" if journal is None else _replay(root, journal)
        (root / JOURNAL_NAME).unlink(missing_ok=True)
        _fsync_dir(root)
    if sweep or outcome:
        _sweep(root)
    return outcome


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        journal = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    try:
        if journal["schema"] != JOURNAL_SCHEMA:
            raise ValueError(f"schema {journal['schema']!r}")
        ops = [
            JournalOp(
                safe_rel(o["path"]),
                None if o["tmp"] is None else safe_rel(o["tmp"]),
                o["old"],
                o["new"],
            )
            for o in journal["ops"]
        ]
        dirs = [safe_rel(d) for d in journal["dirs"]]
        prune = [safe_rel(d) for d in journal["prune"]]
    except (KeyError, TypeError, ValueError, EngineError) as exc:
        raise EngineError(
            "patch-journal-invalid",
            f"{JOURNAL_NAME} is not an oldgpu journal ({exc}); start from a fresh verl copy",
        ) from exc
    return {"ops": ops, "dirs": dirs, "prune": prune}


def _replay(root: Path, journal: dict[str, Any]) -> str:
    ops: list[JournalOp] = journal["ops"]
    done, pending = [], []
    for op in ops:
        current = _digest(read_rel(root, op.rel))
        if current == op.new:
            done.append(op)
        elif current == op.old:
            pending.append(op)
        else:
            raise EngineError(
                "patch-journal-conflict",
                f"{root / op.rel} matches neither side of an interrupted oldgpu patch "
                f"({JOURNAL_NAME}); start from a fresh verl copy",
            )
    staged = all(op.tmp is None or _digest(read_rel(root, op.tmp)) == op.new for op in pending)
    if staged:
        for op in pending:
            target = root / op.rel
            if op.tmp is None:
                target.unlink(missing_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(root / op.tmp, target)
        _finish(root, journal["prune"], sorted({(root / op.rel).parent for op in ops}), None)
        return "rolled forward"
    if done:
        raise EngineError(
            "patch-journal-unrecoverable",
            f"{root}: an interrupted oldgpu patch can be neither finished (staged files are "
            "missing) nor undone; start from a fresh verl copy",
        )
    _undo_staging(root, ops, journal["dirs"])
    return "rolled back"


def _sweep(root: Path) -> None:
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d != ".git"]
        for name in files:
            if name.endswith(TMP_SUFFIX):
                (Path(directory) / name).unlink(missing_ok=True)
