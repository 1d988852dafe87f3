"""Shared fixtures: the real verl sdist, downloaded once and unpacked fresh per test."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from oldgpu import pins


def _cache_dir() -> Path:
    return Path(os.environ.get("OLDGPU_CACHE", "/var/cache/oldgpu")) / "sdists"


@pytest.fixture(scope="session")
def verl_version() -> str:
    return pins.get("verl.version")


@pytest.fixture(scope="session")
def verl_sdist(verl_version: str) -> Path:
    """verl's sdist from the configured pip index, cached (never committed)."""
    cache = _cache_dir()
    found = sorted(cache.glob(f"verl-{verl_version}.tar.gz"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    # Download next to the cache and move in, so a cut download never looks cached.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"verl=={verl_version}", "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.fail(f"cannot download verl {verl_version} sdist: {proc.stderr[-2000:]}")
        (archive,) = Path(tmp).glob(f"verl-{verl_version}.tar.gz")
        target = cache / archive.name
        os.replace(archive, target)
    return target


@pytest.fixture(scope="session")
def verl_pristine(verl_sdist: Path, verl_version: str, tmp_path_factory) -> Path:
    """One unpacked copy per session, for comparison only: tests never change it."""
    dest = tmp_path_factory.mktemp("verl-pristine")
    with tarfile.open(verl_sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Python without extraction filters
            tar.extractall(dest)
    root = dest / f"verl-{verl_version}"
    assert (root / "verl" / "__init__.py").is_file()
    return root


@pytest.fixture
def verl_tree(verl_pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the pristine tree for one test to patch."""
    root = tmp_path / verl_pristine.name
    shutil.copytree(verl_pristine, root, symlinks=True)
    return root


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root (hidden ones too), by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


def tree_state(root: Path) -> dict[str, tuple[str, int]]:
    """Hashes and mtimes: equal states mean nothing was even rewritten."""
    return {
        rel: (digest, (root / rel).stat().st_mtime_ns) for rel, digest in tree_hashes(root).items()
    }
