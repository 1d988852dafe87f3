"""Writing a plan all or nothing: stage every new file, then rename into place; a failed
write rolls back the ones done."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from oldgpu.output import EngineError
from oldgpu.patch.plans import Op, Plan


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
    done: list[Op] = []
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
