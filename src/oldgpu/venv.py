"""One venv per lock: built, verified, then linked in (``oldgpu venv ensure``).

The python_env role, the NixOS module's verl-venv service, the dev shell and
the engine's test venv (scripts/engine-venv.sh) all call this command; none of
them builds a venv itself.

- A venv is named by its key, a hash of the lock, the extra packages and the
  interpreter (the formula the python_env role used, so a host's venv keeps its
  name): DIR/venvs/<key>, with DIR/venv linking to the current one.
- A venv that already holds exactly the lock is used as it is: nothing is
  downloaded. Otherwise pip installs exactly the lock (``--no-deps``: the lock
  is the whole closure) from the sources given (index, extra index, wheelhouse).
- Verified before it can become current: every package at the lock's version
  and nothing else (the lock-check), ``pip check``, and torch, triton and
  transformers imported at the lock's versions (pip moves packages around a
  conflict without a word).
- Built in place and never renamed: a venv's scripts (bin/pip, bin/torchrun)
  carry its absolute path, so a venv cannot move. A marker ``.<key>.building``
  beside it says a build is under way; a killed build leaves the marker, and
  the next run removes that venv first. Runs on one DIR are serialised.
- Then ``oldgpu switch`` moves the link and prunes older venvs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from oldgpu import lockcheck, subcommand, switch
from oldgpu.output import EngineError, Result

# Checked by importing them: the packages whose version decides what runs.
KEY_PACKAGES = ("torch", "triton", "transformers")
PIP_INSTALL = (
    "-m", "pip", "install", "--no-deps", "--no-cache-dir",
    "--disable-pip-version-check", "--progress-bar", "off",
)  # fmt: skip
# Debian's wheel of pip (python3-pip-whl), which its ensurepip installs: the venv's pip
# where the interpreter has none (Debian 12's python3.11 on Debian 13, whose
# python3.11-venv cannot install there; oldgpu.interpreter says why).
PIP_WHEELS = Path("/usr/share/python-wheels")
# Exit status of a build or verification that failed (bad input exits 2).
BUILD_FAILED = 1
BUILDING = ".building"
_IMPORTED_VERSIONS = (
    "import importlib, json, sys;"
    "print(json.dumps({n: getattr(importlib.import_module(n), '__version__', None)"
    " for n in sys.argv[1:]}))"
)
_PIP_ERROR = re.compile(r"^(?:ERROR|error):.*$|^.*No matching distribution.*$", re.MULTILINE)


@dataclass(frozen=True)
class Venv:
    """What ``ensure`` was asked for, checked."""

    lock: Path
    key: str
    pins: dict[str, str]  # the lock and the extras, by normalised name
    pip_extras: tuple[str, ...]  # the extras the lock does not list already
    python: str  # the interpreter, as given (part of the key)
    python_path: str
    venvs: Path
    link: Path
    keep: int
    sources: tuple[str, ...]
    ignore: frozenset[str]

    @property
    def target(self) -> Path:
        return self.venvs / self.key


def venv_key(lock_text: str, extras: Sequence[str], python: str) -> str:
    # The python_env role's key (its file lookup strips trailing whitespace).
    text = lock_text.rstrip() + " ".join(extras) + python
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def read_lock_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise EngineError("lock-missing", f"{path}: no such file") from None
    except OSError as exc:
        raise EngineError("lock-unreadable", f"{path}: {exc.strerror}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EngineError("lock-not-utf8", f"{path}: not UTF-8 text ({exc.reason})") from exc


def _extra_pins(extras: Sequence[str], lock: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    pins, new = {}, []
    for extra in extras:
        m = lockcheck.PIN.fullmatch(extra.strip())
        if not m:
            raise EngineError("extra-not-exact", f"--extra {extra!r} is not name==version")
        name = lockcheck.normalise(m.group(1))
        if name in lock and lock[name] != m.group(2):
            raise EngineError(
                "extra-conflicts-lock", f"--extra {extra}: the lock has {name}=={lock[name]}"
            )
        pins[name] = m.group(2)
        if name not in lock:
            new.append(extra.strip())
    return pins, new


def pip_sources(
    wheelhouse: str | None, no_index: bool, index_url: str | None, extra_index_urls: Sequence[str]
) -> tuple[str, ...]:
    """pip's source options, as the roles named them (python_env_wheelhouse, ...)."""
    if wheelhouse and "://" not in wheelhouse and not os.path.isdir(wheelhouse):
        raise EngineError("wheelhouse-missing", f"--wheelhouse {wheelhouse}: no such directory")
    if no_index and not wheelhouse:
        raise EngineError("no-source", "--no-index needs --wheelhouse: pip would have no source")
    out = ["--no-index"] if no_index else []
    out += ["--index-url", index_url] if index_url else []
    for url in extra_index_urls:
        out += ["--extra-index-url", url]
    out += ["--find-links", wheelhouse] if wheelhouse else []
    return tuple(out)


def request(
    lock: Path,
    directory: Path,
    *,
    python: str = "python3",
    keep: object = 1,
    extras: Sequence[str] = (),
    sources: Sequence[str] = (),
    ignore: Sequence[str] = (),
    link: Path | None = None,
    venvs: Path | None = None,
) -> Venv:
    """Check the inputs, before anything changes."""
    lock = Path(os.path.abspath(lock))
    directory = Path(os.path.abspath(directory))
    text = read_lock_text(lock)
    pins = lockcheck.parse_lock(text, lock)
    if not pins:
        raise EngineError("lock-empty", f"{lock}: no name==version line")
    extra_pins, pip_extras = _extra_pins(extras, pins)
    python_path = shutil.which(python)
    if python_path is None:
        raise EngineError("python-missing", f"--python {python}: no such interpreter")
    v = Venv(
        lock=lock,
        key=venv_key(text, extras, python),
        pins={**pins, **extra_pins},
        pip_extras=tuple(pip_extras),
        python=python,
        python_path=python_path,
        venvs=Path(os.path.abspath(venvs or directory / "venvs")),
        link=Path(os.path.abspath(link or directory / "venv")),
        keep=switch.parse_keep(keep),
        sources=tuple(sources),
        ignore=frozenset(ignore),
    )
    switch.validate(v.link, v.target, v.keep)
    return v


# --- verification -------------------------------------------------------------


def _run(cmd: Sequence[str], error: str) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise EngineError(error, f"{cmd[0]}: {exc}", code=BUILD_FAILED) from exc
    if proc.returncode != 0:
        found = _PIP_ERROR.findall(proc.stderr + "\n" + proc.stdout)
        tail = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()][-5:]
        raise EngineError(
            error, f"{' '.join(cmd[:5])} ...: {' '.join(found or tail)}", code=BUILD_FAILED
        )
    return proc


def _same_version(imported: str | None, locked: str) -> bool:
    # A lock without a local label (torch==2.6.0) accepts the build's own
    # (2.6.0+cu124 from the default index); one with a label wants that label.
    if imported is None:
        return False
    return imported == locked or ("+" not in locked and imported.split("+")[0] == locked)


def verify(
    python: str,
    pins: dict[str, str],
    ignore: frozenset[str] = frozenset(),
    imports: Sequence[str] = KEY_PACKAGES,
) -> None:
    """Raise ``venv-verify-failed`` unless the venv holds exactly ``pins`` and imports them."""
    report = lockcheck.compare(pins, lockcheck.installed(python), set(ignore))
    if not report["matches"]:
        raise EngineError(
            "venv-verify-failed",
            f"{python} does not hold the lock: {lockcheck.differences(report)}",
            code=BUILD_FAILED,
        )
    check = [python, "-m", "pip", "check", "--disable-pip-version-check"]
    proc = subprocess.run(check, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        problems = "; ".join(line for line in proc.stdout.splitlines() if line.strip())
        raise EngineError("venv-verify-failed", f"pip check: {problems}", code=BUILD_FAILED)
    names = [n for n in imports if lockcheck.normalise(n) in pins]
    if not names:
        return
    proc = _run([python, "-I", "-c", _IMPORTED_VERSIONS, *names], "venv-verify-failed")
    seen = json.loads(proc.stdout)
    wrong = [
        f"{n} imports as {seen[n]}, the lock says {pins[lockcheck.normalise(n)]}"
        for n in names
        if not _same_version(seen[n], pins[lockcheck.normalise(n)])
    ]
    if wrong:
        raise EngineError("venv-verify-failed", "; ".join(wrong), code=BUILD_FAILED)


def holds_lock(v: Venv) -> bool:
    """Does the venv of this key exist and hold exactly the lock? (Reads only.)"""
    python = v.target / "bin" / "python"
    if not python.exists() or (v.venvs / f".{v.key}{BUILDING}").exists():
        return False
    try:
        have = lockcheck.installed(str(python))
    except EngineError:
        return False
    return lockcheck.compare(v.pins, have, set(v.ignore))["matches"]


# --- building -----------------------------------------------------------------


def leftovers(venvs: Path) -> list[Path]:
    """Venvs whose build was killed: their marker is still there."""
    return sorted(venvs / m.name[1 : -len(BUILDING)] for m in venvs.glob(f".*{BUILDING}"))


def _remove_leftover(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    (path.parent / f".{path.name}{BUILDING}").unlink(missing_ok=True)


def _synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build(v: Venv, imports: Sequence[str] = KEY_PACKAGES) -> None:
    """Build and verify the venv of ``v.key``; on any failure nothing of it is left."""
    pip_wheel = _pip_wheel(v.python_path)  # refused before anything changes
    marker = v.venvs / f".{v.key}{BUILDING}"
    _synced(marker, f"{os.getpid()}\n")
    try:
        if os.path.lexists(v.target):
            shutil.rmtree(v.target)
        print(f"oldgpu venv: building {v.target} from {v.lock}", file=sys.stderr, flush=True)
        _create(v.python_path, v.target, pip_wheel)
        python = str(v.target / "bin" / "python")
        install = [python, *PIP_INSTALL, "-r", str(v.lock), *v.pip_extras, *v.sources]
        _run(install, "venv-install-failed")
        verify(python, v.pins, v.ignore, imports)
    except BaseException:
        _remove_leftover(v.target)
        raise
    marker.unlink()


def _pip_wheel(python: str) -> str | None:
    """None where the interpreter's ensurepip gives the venv its pip, else Debian's wheel."""
    probe = subprocess.run([python, "-c", "import ensurepip"], capture_output=True, check=False)
    if probe.returncode == 0:
        return None
    wheels = sorted(PIP_WHEELS.glob("pip-*.whl"))
    if not wheels:
        raise EngineError(
            "venv-no-pip",
            f"{python} has no ensurepip and {PIP_WHEELS} holds no pip wheel: install "
            "python3-pip-whl (Debian's), or give an interpreter with ensurepip",
            code=BUILD_FAILED,
        )
    return str(wheels[-1])


def _create(python: str, target: Path, pip_wheel: str | None) -> None:
    if pip_wheel is None:
        _run([python, "-m", "venv", str(target)], "venv-create-failed")
        return
    _run([python, "-m", "venv", "--without-pip", str(target)], "venv-create-failed")
    # pip runs from its own wheel to install that wheel: no index, no network. By name
    # and version from the wheel's directory, so that pip freeze says pip==X, not a path.
    version = Path(pip_wheel).name.split("-")[1]
    pip = [str(target / "bin" / "python"), f"{pip_wheel}/pip", "install", "--no-index", "--no-deps"]
    links = ["--find-links", str(Path(pip_wheel).parent), f"pip=={version}"]
    _run([*pip, "--disable-pip-version-check", "-q", *links], "venv-create-failed")


@contextlib.contextmanager
def _serialised(venvs: Path) -> Iterator[None]:
    with open(venvs / ".oldgpu-venv.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure(v: Venv, *, check: bool = False, imports: Sequence[str] = KEY_PACKAGES) -> dict:
    """Make ``v.link`` point at a verified venv of the lock; with ``check``, only report."""
    # The venv is judged by what it holds: a caller's PYTHONPATH (scripts/engine-venv.sh
    # runs the engine from src/, next to an egg-info) must not leak into pip or the checks.
    for name in ("PYTHONPATH", "PYTHONHOME"):
        os.environ.pop(name, None)
    if check:
        return _ensure(v, check=True, imports=imports)
    v.venvs.mkdir(parents=True, exist_ok=True)
    with _serialised(v.venvs):
        return _ensure(v, check=False, imports=imports)


def _ensure(v: Venv, *, check: bool, imports: Sequence[str]) -> dict:
    removed = leftovers(v.venvs)
    if not check:
        for path in removed:
            _remove_leftover(path)
    reuse = holds_lock(v)
    if not reuse and not check:
        build(v, imports)
    doc = switch.switch(v.link, v.target, v.keep, check=check)
    return {
        "changed": doc["changed"] or not reuse or bool(removed),
        "check": check,
        "key": v.key,
        "path": str(v.target),
        "link": doc["link"],
        "previous": doc["previous"],
        "built": not reuse,
        "switched": doc["switched"],
        "pruned": doc["pruned"],
        "removed": [str(p) for p in removed],
        "lock": str(v.lock),
        "python": v.python,
    }


def describe(doc: dict) -> str:
    would = "would be " if doc["check"] else ""
    head = f"venv {doc['path']}: " + (
        f"{would}built from {doc['lock']}" if doc["built"] else f"holds {doc['lock']}"
    )
    lines = [head]
    if doc["removed"]:
        lines.append(f"interrupted builds {would}removed: {', '.join(doc['removed'])}")
    lines.append(switch.describe({**doc, "target": doc["path"]}))
    return "\n".join(lines)


# --- command line -------------------------------------------------------------


def add_parser(subparsers, common) -> None:
    summary = "the training venv of a lock: built, verified, switched in"
    parser = subcommand.add(subparsers, common, "venv", None, __doc__, help=summary)
    sub = parser.add_subparsers(dest="venv_command", required=True)
    summary = "build (if needed), verify and link in the venv of LOCK; prune older venvs"
    p = subcommand.add(sub, common, "ensure", run_ensure, help=summary)
    p.add_argument("lock", type=Path, help="the whole-closure lock (name==version lines)")
    p.add_argument("dir", type=Path, help="holds venvs/<key> and the link venv")
    p.add_argument("--link", type=Path, help="the link jobs use (default DIR/venv)")
    p.add_argument("--venvs", type=Path, help="where venvs are built (default DIR/venvs)")
    p.add_argument("--python", default="python3", help="the interpreter (default python3)")
    p.add_argument("--keep", default="1", help="older venvs kept for rollback (default 1)")
    p.add_argument("--wheelhouse", help="a directory or URL of wheels (pip --find-links)")
    p.add_argument("--no-index", action="store_true", help="install from --wheelhouse alone")
    p.add_argument("--index-url", help="the pip index (default: pip's configuration)")
    p.add_argument("--extra-index-url", action="append", default=[], help="another index (torch's)")
    p.add_argument(
        "--extra", action="append", default=[], metavar="NAME==VERSION", help="a package more"
    )
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="NAME",
        help="a package installed into the venv later (verl), not in the lock",
    )
    p.add_argument("--check", action="store_true", help="report what would change, change nothing")


def run_ensure(args) -> Result:
    v = request(
        args.lock,
        args.dir,
        python=args.python,
        keep=args.keep,
        extras=args.extra,
        sources=pip_sources(args.wheelhouse, args.no_index, args.index_url, args.extra_index_url),
        ignore=args.ignore,
        link=args.link,
        venvs=args.venvs,
    )
    doc = ensure(v, check=args.check)
    return Result(doc, describe(doc))
