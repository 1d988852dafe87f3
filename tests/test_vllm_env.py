"""The vLLM environment built from files/requirements/vllm.lock, as python_env builds it
(``oldgpu venv ensure``, offline, from the wheelhouse).

Runs where every wheel of the lock is in the wheelhouse ($OLDGPU_WHEELHOUSE, default
$OLDGPU_CACHE/wheelhouse): ``make unit`` puts them there first (scripts/wheelhouse.sh;
vLLM's closure is 4 GB of wheels, 0.7 GB of them beyond pypi.lock's). On a CPU host it
checks what can be checked without a GPU: the venv matches the lock, pip check, vLLM's and
torch's versions from their metadata, and that ``import vllm`` works (vLLM imports without
a GPU; it cannot start an engine there).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from oldgpu import pins

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "files/requirements/vllm.lock"
CACHE = Path(os.environ.get("OLDGPU_CACHE", "/var/cache/oldgpu"))
WHEELHOUSE = Path(os.environ.get("OLDGPU_WHEELHOUSE", CACHE / "wheelhouse"))

pytestmark = pytest.mark.slow


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def missing_wheels(lock: Path, wheelhouse: Path) -> list[str]:
    """The lock's name==version that have no wheel in the wheelhouse."""
    have = set()
    if wheelhouse.is_dir():
        for f in wheelhouse.glob("*.whl"):
            name, version = f.name.split("-")[:2]
            have.add((_norm(name), version))
    missing = []
    for line in lock.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.strip().split("==")
            if (_norm(name), version) not in have:
                missing.append(f"{name}=={version}")
    return missing


def test_missing_wheels_reads_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    lock.write_text("# a lock\nfoo-bar==1.0\nbaz==2\n")
    (tmp_path / "foo_bar-1.0-py3-none-any.whl").write_bytes(b"")
    assert missing_wheels(lock, tmp_path) == ["baz==2"]


def test_vllm_env_from_the_lock() -> None:
    missing = missing_wheels(LOCK, WHEELHOUSE)
    if missing:
        pytest.skip(f"{len(missing)} wheels of vllm.lock not in {WHEELHOUSE} (e.g. {missing[0]})")
    # Kept in the cache, named by the lock's hash like every venv there: the first run on
    # a machine builds it, a later one verifies it against the lock (what a second
    # converge does); OLDGPU_VLLM_VENV_DIR=<empty dir> builds a fresh one.
    where = os.environ.get("OLDGPU_VLLM_VENV_DIR") or str(CACHE / "venvs" / "vllm")
    argv = [sys.executable, "-m", "oldgpu", "venv", "ensure", str(LOCK), where, "--keep", "0",
            "--python", sys.executable, "--no-index", "--wheelhouse", str(WHEELHOUSE),
            "--ignore", "verl", "--json"]  # fmt: skip
    proc = subprocess.run(
        argv, capture_output=True, text=True, check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    print(f"vLLM venv {'built' if doc['built'] else 'verified'}: {doc['path']}")
    python = Path(doc["path"]) / "bin" / "python"
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, vllm; "
         "print(m.version('vllm'), m.version('torch'), m.version('xformers'))"],
        capture_output=True, text=True, check=False, env={"CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    vllm, torch, _ = probe.stdout.split()[-3:]
    assert (vllm, torch) == (pins.get("vllm.version"), pins.get("torch.version"))
