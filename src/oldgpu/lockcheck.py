"""Does a venv hold exactly what a lock says? (``oldgpu lock-check``)

The python_env role asks this before touching pip, so a converge on a venv
that already matches downloads nothing; and after installing, so a pip that
"solved" a conflict by moving torch is caught (pip check stays clean then).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from oldgpu import subcommand
from oldgpu.output import EngineError, Result

# Run inside the venv's interpreter: its distributions, by normalised name.
_LIST_DISTRIBUTIONS = (
    "import json, importlib.metadata as m;"
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
)
# A lock's line: name[extras]==version, nothing looser.
PIN = re.compile(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;]+)")
# Tools a venv has that no lock lists.
_BOOTSTRAP = {"pip", "setuptools", "wheel"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EngineError("lock-unreadable", f"{path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise EngineError("lock-not-utf8", f"{path}: not UTF-8 text ({exc.reason})") from exc
    return parse_lock(text, path)


def parse_lock(text: str, path: Path) -> dict[str, str]:
    pins = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = PIN.fullmatch(line)
        if not m:
            raise EngineError("lock-not-exact", f"{path}:{number}: {raw!r} is not name==version")
        pins[normalise(m.group(1))] = m.group(2)
    return pins


def installed(python: str) -> dict[str, str]:
    try:
        out = subprocess.run(
            [python, "-c", _LIST_DISTRIBUTIONS], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise EngineError("venv-unusable", f"{python} cannot list its packages: {exc}") from exc
    return {normalise(k): v for k, v in json.loads(out).items()}


def compare(lock: dict[str, str], have: dict[str, str], ignore: set[str] = frozenset()) -> dict:
    skip = _BOOTSTRAP | {normalise(n) for n in ignore}
    missing = sorted(n for n in lock if n not in have and n not in skip)
    mismatched = {
        n: {"lock": v, "installed": have[n]}
        for n, v in sorted(lock.items())
        if n in have and n not in skip and have[n] != v
    }
    extra = sorted(n for n in have if n not in lock and n not in skip)
    return {
        "matches": not (missing or mismatched or extra),
        "missing": missing,
        "mismatched": mismatched,
        "extra": extra,
    }


def add_parser(subparsers, common) -> None:
    summary = "compare a venv with a lock (exit 1 if they differ)"
    p = subcommand.add(subparsers, common, "lock-check", run, help=summary)
    p.add_argument("lock", type=Path)
    p.add_argument("--python", required=True, help="the venv's interpreter")
    p.add_argument("--ignore", action="append", default=[], help="a package the lock may not list")


def run(args) -> Result:
    report = compare(read_lock(args.lock), installed(args.python), set(args.ignore))
    report.update(lock=str(args.lock), python=args.python)
    if report["matches"]:
        text = f"{args.python}: matches {args.lock}"
    else:
        text = f"{args.python} differs from {args.lock}: {differences(report)}"
    return Result(report, text, 0 if report["matches"] else 1)


def differences(report: dict) -> str:
    """What ``compare`` found, in one line."""
    parts = [f"missing: {', '.join(report['missing'])}"] if report["missing"] else []
    parts += [f"{n} {d['installed']} (lock {d['lock']})" for n, d in report["mismatched"].items()]
    parts += [f"not in lock: {', '.join(report['extra'])}"] if report["extra"] else []
    return "; ".join(parts)
