"""The vLLM environment built from files/requirements/vllm.lock, as python_env builds it
(``oldgpu venv ensure``, offline, from the wheelhouse).

Runs only where every wheel of the lock is already in the wheelhouse
($OLDGPU_WHEELHOUSE, default /var/cache/oldgpu/wheelhouse): vLLM's closure is several GB
(CUDA 12 runtime wheels, xformers), which ``make test`` never downloads. On a CPU host it
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
WHEELHOUSE = Path(os.environ.get("OLDGPU_WHEELHOUSE", "/var/cache/oldgpu/wheelhouse"))

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


def test_vllm_env_from_the_lock(tmp_path: Path) -> None:
    missing = missing_wheels(LOCK, WHEELHOUSE)
    if missing:
        pytest.skip(f"{len(missing)} wheels of vllm.lock not in {WHEELHOUSE} (e.g. {missing[0]})")
    argv = [sys.executable, "-m", "oldgpu", "venv", "ensure", str(LOCK), str(tmp_path / "opt"),
            "--python", sys.executable, "--no-index", "--wheelhouse", str(WHEELHOUSE),
            "--ignore", "verl", "--json"]  # fmt: skip
    proc = subprocess.run(
        argv, capture_output=True, text=True, check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    python = Path(json.loads(proc.stdout)["path"]) / "bin" / "python"
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, vllm; "
         "print(m.version('vllm'), m.version('torch'), m.version('xformers'))"],
        capture_output=True, text=True, check=False, env={"CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    vllm, torch, _ = probe.stdout.split()[-3:]
    assert (vllm, torch) == (pins.get("vllm.version"), pins.get("torch.version"))
