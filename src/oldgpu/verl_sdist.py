"""A newer verl release's source: its sdist, checked against the pins (``oldgpu verl-sdist``).

verl 0.5.0 comes from a git clone at a pinned commit; a newer release (``pins.verl_releases``)
comes from its sdist, whose sha256 the pins record. ``oldgpu verl-sdist VERSION DIR`` puts
``DIR/verl-<VERSION>.tar.gz`` in place and says where it came from:

- kept when it is there with the pinned sha256 (nothing is downloaded);
- else copied from ``--mirror`` (a directory or URL holding ``verl-<VERSION>.tar.gz``: an
  air-gapped fleet's copy), or downloaded by pip (``pip download``, the sdist only, with
  ``--require-hashes``: pip checks the archive before it runs anything of it) through the
  index options given, else pip's own configuration;
- written under a temporary name, checked, and only then renamed into place: a cut
  download or a file with another sha256 never looks fetched (``sdist-sha256-mismatch``
  names both sums, and nothing changes).

The verl role calls it with the release's venv (``--python``), the test machine's scripts
with their own python, both read the sum from the pins here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from oldgpu import subcommand, verl_release
from oldgpu.output import EngineError, Result

CHUNK = 1 << 20


def sdist_name(version: str) -> str:
    return f"verl-{version}.tar.gz"


def pinned_sha256(version: str) -> str:
    """The release's sdist sum from the pins; a named error for the default (a git clone)."""
    pin = verl_release.release(version).get("sdist_sha256")
    if not pin:
        raise EngineError(
            "verl-sdist-not-pinned",
            f"verl {version} has no sdist_sha256 in files/pins.json: the default release comes "
            "from its git clone (role verl), not from an sdist",
        )
    return str(pin)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _holds(path: Path, want: str) -> bool:
    return path.is_file() and sha256_of(path) == want


def _from_mirror(mirror: str, name: str, dest: Path) -> None:
    """Copy ``mirror``/``name`` (a directory or a URL) to ``dest``."""
    if "://" in mirror:
        url = mirror.rstrip("/") + "/" + name
        try:
            with urllib.request.urlopen(url, timeout=120) as answer, open(dest, "wb") as out:
                shutil.copyfileobj(answer, out, CHUNK)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            raise EngineError("verl-sdist-fetch-failed", f"{url}: {exc}") from exc
        return
    source = Path(mirror) / name
    try:
        shutil.copyfile(source, dest)
    except OSError as exc:
        raise EngineError("verl-sdist-fetch-failed", f"{source}: {exc.strerror}") from exc


def _from_pip(
    version: str, want: str, python: str, sources: list[str], isolated: bool, dest: Path
) -> None:
    """``pip download`` the sdist, hash-checked, into ``dest``'s directory as ``dest``."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".verl-sdist-") as tmp:
        requirement = Path(tmp) / "verl.txt"
        requirement.write_text(f"verl=={version} --hash=sha256:{want}\n", encoding="utf-8")
        cmd = [
            python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--require-hashes", "--disable-pip-version-check", "--progress-bar", "off",
            "-r", str(requirement), "-d", tmp, *sources,
        ]  # fmt: skip
        if not isolated:
            # The interpreter's own setuptools prepares the metadata: no build requirement
            # is fetched (an offline wheelhouse need not hold setuptools and wheel).
            cmd.insert(cmd.index("-r"), "--no-build-isolation")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        except OSError as exc:
            raise EngineError("verl-sdist-fetch-failed", f"{python}: {exc}") from exc
        got = Path(tmp) / sdist_name(version)
        if proc.returncode != 0 or not got.is_file():
            lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            why = " ".join(lines[-6:]) or f"pip exited {proc.returncode}"
            name = "verl-sdist-sha256-mismatch" if "HASHES" in why.upper() else ""
            raise EngineError(
                name or "verl-sdist-fetch-failed",
                f"pip download verl=={version} (source only; {' '.join(sources) or 'pip config'})"
                f": {why}",
            )
        os.replace(got, dest)


def fetch(
    version: str,
    directory: Path,
    *,
    python: str | None = None,
    sources: tuple[str, ...] = (),
    mirror: str | None = None,
    isolated: bool = True,
    check: bool = False,
) -> dict:
    """Make ``directory``/verl-<version>.tar.gz the pinned sdist; with ``check``, only say."""
    want = pinned_sha256(version)
    directory = Path(os.path.abspath(directory))
    path = directory / sdist_name(version)
    doc = {
        "version": version,
        "path": str(path),
        "sha256": want,
        "check": check,
        "source": "kept",
        "changed": False,
    }
    if _holds(path, want):
        return doc
    doc.update(changed=True, source="mirror" if mirror else "pip")
    if check:
        return doc
    if not mirror and not python:
        raise EngineError(
            "verl-sdist-no-source", "give --mirror, or --python (an interpreter with pip)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{path.name}.{os.getpid()}.partial"
    try:
        if mirror:
            _from_mirror(mirror, path.name, partial)
        else:
            _from_pip(version, want, str(python), list(sources), isolated, partial)
        got = sha256_of(partial)
        if got != want:
            where = f"{mirror}/{path.name}" if mirror else "pip's download"
            raise EngineError(
                "verl-sdist-sha256-mismatch",
                f"{where} has sha256 {got}; files/pins.json says {want} for verl {version}. "
                f"Nothing was changed",
            )
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return doc


def add_parser(subparsers, common) -> None:
    summary = "put a newer verl release's sdist in place, checked against its pinned sha256"
    p = subcommand.add(subparsers, common, "verl-sdist", run, __doc__, help=summary)
    p.add_argument("version", help="a release of files/pins.json's verl_releases")
    p.add_argument("dir", type=Path, help="where verl-VERSION.tar.gz is kept")
    p.add_argument("--mirror", help="a directory or URL holding verl-VERSION.tar.gz")
    p.add_argument("--python", help="the interpreter whose pip downloads it (without --mirror)")
    p.add_argument("--index-url", help="pip's index (default: pip's configuration)")
    p.add_argument("--extra-index-url", action="append", default=[], help="another index")
    p.add_argument("--find-links", action="append", default=[], help="a directory or URL")
    p.add_argument("--no-index", action="store_true", help="only --find-links")
    p.add_argument(
        "--no-build-isolation",
        action="store_true",
        help="prepare the metadata with --python's own setuptools (offline)",
    )
    p.add_argument("--check", action="store_true", help="report what would change, change nothing")


def run(args) -> Result:
    sources: list[str] = ["--no-index"] if args.no_index else []
    sources += ["--index-url", args.index_url] if args.index_url else []
    for url in args.extra_index_url:
        sources += ["--extra-index-url", url]
    for where in args.find_links:
        sources += ["--find-links", where]
    doc = fetch(
        args.version,
        args.dir,
        python=args.python or (None if args.mirror else sys.executable),
        sources=tuple(sources),
        mirror=args.mirror,
        isolated=not args.no_build_isolation,
        check=args.check,
    )
    if args.check and doc["changed"]:
        text = f"{doc['path']}: would be fetched ({doc['source']})"
    else:
        verb = {"kept": "in place", "mirror": "copied from the mirror", "pip": "downloaded by pip"}
        text = f"{doc['path']}: {verb[doc['source']]}"
    return Result(doc, f"{text} (sha256 {doc['sha256']})")
