"""Which tree a link points at, and which older trees are kept (``oldgpu switch``).

Venvs, patched verl trees and engine releases are each built beside the active
one and linked in only once complete, so a failed build leaves the working one
in place. This module is the one place that moves such a link and prunes the
trees behind it:

- the link is switched atomically: a new link under a temporary name is renamed
  over the old one, so a reader sees the old target or the new one, never none;
- the target's mtime is set when it becomes current, so "older" means "made
  current longer ago" (a rollback target stays newest among the old ones);
- the target's siblings (directories not starting with ".") beyond the ``keep``
  most recent are removed; the target never is. Without ``keep`` nothing is.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from oldgpu import subcommand
from oldgpu.output import EngineError, Result


def parse_keep(value: object) -> int:
    """``--keep``: a count of older trees, 0 or more (named error otherwise)."""
    text = str(value).strip()
    if not text.isdigit():
        raise EngineError("keep-invalid", f"--keep {value!r}: expected a whole number, 0 or more")
    return int(text)


def validate(link: Path, target: Path, keep: int | None) -> None:
    """Refuse, before anything changes, a link that is not one or a prune that is unsafe."""
    if os.path.lexists(link) and not link.is_symlink():
        raise EngineError(
            "link-not-symlink",
            f"{link} exists and is not a symlink; move it away (nothing was changed)",
        )
    if keep is not None and target.parent == link.parent:
        # Pruning the target's siblings would remove the link's own neighbours.
        raise EngineError(
            "switch-prune-unsafe",
            f"{target} is beside {link}: targets must live in a directory of their own",
        )


def current(link: Path) -> str | None:
    return os.readlink(link) if link.is_symlink() else None


def prune_candidates(parent: Path, keep: int, target: Path) -> list[Path]:
    """The target's siblings beyond the ``keep`` most recently made current."""
    try:
        entries = list(parent.iterdir())
    except FileNotFoundError:
        return []
    older = [
        p
        for p in entries
        if not p.name.startswith(".") and p.is_dir() and not p.is_symlink() and p != target
    ]
    older.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return sorted(older[keep:])


def switch(link: Path, target: Path, keep: int | None = None, *, check: bool = False) -> dict:
    """Point ``link`` at ``target`` and prune; with ``check``, only say what would change."""
    link, target = Path(os.path.abspath(link)), Path(os.path.abspath(target))
    validate(link, target, keep)
    # In check mode the target may not be built yet: it would be by then.
    if not target.is_dir() and not (check and not target.exists()):
        raise EngineError("switch-target-missing", f"{target} is not a directory")
    previous = current(link)
    switched = previous != str(target)
    pruned = prune_candidates(target.parent, keep, target) if keep is not None else []
    if not check:
        if switched:
            link.parent.mkdir(parents=True, exist_ok=True)
            os.utime(target)
            for stale in link.parent.glob(f".{link.name}.*.new"):
                stale.unlink(missing_ok=True)  # a switch killed before its rename
            tmp = link.with_name(f".{link.name}.{os.getpid()}.new")
            os.symlink(target, tmp)
            os.replace(tmp, link)
        for path in pruned:
            try:
                shutil.rmtree(path)
            except OSError as exc:
                raise EngineError("prune-failed", f"cannot remove {path}: {exc}") from exc
    return {
        "changed": switched or bool(pruned),
        "check": check,
        "link": str(link),
        "target": str(target),
        "previous": previous,
        "switched": switched,
        "pruned": [str(p) for p in pruned],
    }


def describe(doc: dict) -> str:
    verb = "would point" if doc["check"] else "points"
    text = f"{doc['link']} {verb} at {doc['target']}"
    if doc["switched"]:
        text += f" (was {doc['previous'] or 'absent'})"
    if doc["pruned"]:
        text += f"; {'would remove' if doc['check'] else 'removed'} " + ", ".join(doc["pruned"])
    return text


def add_parser(subparsers, common) -> None:
    summary = "point a link at a built tree atomically and prune older trees"
    p = subcommand.add(subparsers, common, "switch", run, __doc__, help=summary)
    p.add_argument("link", type=Path, help="the symlink jobs use")
    p.add_argument("target", type=Path, help="the verified tree it should point at")
    p.add_argument("--keep", help="older sibling trees of TARGET to keep (default: prune none)")
    p.add_argument("--check", action="store_true", help="report what would change, change nothing")


def run(args) -> Result:
    keep = None if args.keep is None else parse_keep(args.keep)
    doc = switch(args.link, args.target, keep, check=args.check)
    return Result(doc, describe(doc))
