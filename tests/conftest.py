"""Shared fixtures and helpers: the real verl sdist (downloaded once, unpacked fresh per
test), the CLI with only the commands under test, a Python run inside a verl tree, and
the model config the planner reads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest

from oldgpu import cli, pins

QWEN05B_CONFIG = {  # Qwen2.5-0.5B's public config.json, the fields the planner reads
    "model_type": "qwen2",
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}


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


def cli_runner(monkeypatch, capsys, modules: tuple[str, ...], *head: str):
    """``oldgpu.cli.main`` with only ``modules`` (others may be half-built), as a function:
    ``run(*argv) -> (exit code, output, stderr)``, ``head`` put before ``argv`` and the
    output parsed when ``--json`` is among them."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", modules)

    def run(*argv: str) -> tuple[int, Any, str]:
        argv = (*head, *argv)
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, json.loads(out) if "--json" in argv else out, err

    return run


def run_in_tree(tree: Path, script: str) -> subprocess.CompletedProcess:
    """``python -c script`` in ``tree`` with only it on the path, no GPU, no OLDGPU_ variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLDGPU_")}
    env.update(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
