"""Shared fixtures and helpers: the real verl sdist (downloaded once, unpacked fresh per
test), the CLI with only the commands under test, a Python run inside a verl tree, the
model config the planner reads, the planner's inputs for a P40, verl's own config with
overrides applied, a job's files and settings, and the patcher's CLI and sites."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import io
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

from oldgpu import cli, pins, plan

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


class SdistUnavailable(Exception):
    """pip could not download the sdist (the message is pip's stderr, cut)."""


def download_verl_sdist(version: str) -> Path:
    """verl ``version``'s sdist from the configured pip index, cached (never committed)."""
    cache = _cache_dir()
    found = sorted(cache.glob(f"verl-{version}.tar.gz"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    # Download next to the cache and move in, so a cut download never looks cached.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"verl=={version}", "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SdistUnavailable(proc.stderr[-2000:])
        (archive,) = Path(tmp).glob(f"verl-{version}.tar.gz")
        target = cache / archive.name
        os.replace(archive, target)
    return target


def unpack_verl_sdist(sdist: Path, version: str, dest: Path) -> Path:
    """Unpack ``sdist`` under ``dest``; the tree's root (it holds verl/)."""
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Python without extraction filters
            tar.extractall(dest)
    root = dest / f"verl-{version}"
    assert (root / "verl" / "__init__.py").is_file()
    return root


@pytest.fixture(scope="session")
def verl_sdist(verl_version: str) -> Path:
    """The pinned verl's sdist from the configured pip index, cached (never committed)."""
    try:
        return download_verl_sdist(verl_version)
    except SdistUnavailable as exc:
        pytest.fail(f"cannot download verl {verl_version} sdist: {exc}")


@pytest.fixture(scope="session")
def verl_pristine(verl_sdist: Path, verl_version: str, tmp_path_factory) -> Path:
    """One unpacked copy per session, for comparison only: tests never change it."""
    return unpack_verl_sdist(verl_sdist, verl_version, tmp_path_factory.mktemp("verl-pristine"))


def fresh_copy(pristine: Path, tmp_path: Path) -> Path:
    """A copy of an unpacked verl tree for one test to patch."""
    root = tmp_path / pristine.name
    shutil.copytree(pristine, root, symlinks=True)
    return root


@pytest.fixture
def verl_tree(verl_pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the pristine tree for one test to patch."""
    return fresh_copy(verl_pristine, tmp_path)


@pytest.fixture(scope="session")
def verl09_pristine(tmp_path_factory) -> Path:
    """verl 0.9.0 unpacked once per session, for comparison only: tests never change it."""
    try:
        sdist = download_verl_sdist("0.9.0")
    except SdistUnavailable as exc:
        pytest.skip(f"verl 0.9.0 sdist cannot be downloaded from the pip index: {exc}")
    return unpack_verl_sdist(sdist, "0.9.0", tmp_path_factory.mktemp("verl09-pristine"))


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


def run_patched(
    tree: Path, tmp_path: Path, profile: str, script: str, env: dict[str, str] | None = None
) -> list[str]:
    """Patch ``tree`` for ``profile``, run ``script`` in it with ``env`` set first (its
    ``sys.argv[1]`` a fresh file for a process group's rendezvous); its output's lines."""
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["patch", str(tree), "--profile", profile, "--json"]) == 0
    script = script.replace("sys.argv[1]", repr(str(tmp_path / "pg")))
    if env:
        script = f"import os; os.environ.update({env!r})\n" + script
    proc = run_in_tree(tree, script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


# -- the planner -------------------------------------------------------------------------


@pytest.fixture
def verls_own_logits(monkeypatch):
    """The planner as it was before the logits patch set: for runs measured on trees
    without it (verl's entropy over whole micro batches, logits over the whole sequence)."""
    from oldgpu.plan import memory

    monkeypatch.setattr(memory, "ENTROPY_ROWS", None)
    monkeypatch.setattr(memory, "RESPONSE_LOGITS", False)


def plan_inputs(**kw: Any) -> plan.Inputs:
    """The planner's inputs for Qwen2.5-0.5B on one P40 (24 GiB), with ``kw`` changed."""
    base: dict[str, Any] = {
        "memory_mib": 24576,
        "gpus": 1,
        "shape": plan.SHAPES["qwen2.5-0.5b"],
        "prompt_length": 256,
        "response_length": 256,
        "model_name": "qwen2.5-0.5b",
        "profile_name": "pascal-6.1",
    }
    base.update(kw)
    return plan.Inputs(**base)


def verl_config(verl_tree: Path, overrides: list[str]) -> Any:
    """verl's ``ppo_trainer`` config in ``verl_tree`` with ``overrides`` applied by Hydra,
    as verl's main_ppo composes it (skips without Hydra)."""
    hydra = pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir

    config_dir = verl_tree / "verl" / "trainer" / "config"
    hydra.core.global_hydra.GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def assert_overrides_land(cfg: Any, overrides: list[str], target_modules: list[str]) -> None:
    """Each override's value is the composed config's (LoRA's target list compared as a
    list; trainer.logger is a list Hydra parses)."""
    from omegaconf import OmegaConf

    from oldgpu import jobs

    for override in overrides:
        key, value = jobs.override_key(override), override.split("=", 1)[1]
        got = OmegaConf.select(cfg, key)
        if key == "actor_rollout_ref.model.target_modules":
            assert list(got) == target_modules, override
        elif key != "trainer.logger":
            assert str(got) == value, override


# -- jobs --------------------------------------------------------------------------------


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A job's inputs: a model directory with Qwen2.5-0.5B's config, train and test parquet."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN05B_CONFIG))
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"PAR1")
    return tmp_path


def job_spec(job_dir: Path, **extra: Any) -> dict[str, Any]:
    """A job's settings (inventory-style) over the files of ``job_dir``, with ``extra``."""
    return {
        "name": "gsm8k",
        "model_path": str(job_dir / "model"),
        "train_files": str(job_dir / "train.parquet"),
        "val_files": str(job_dir / "test.parquet"),
        "total_steps": 100,
        # explicit: the default (all) needs the host's cards, which compose() alone lacks
        "gpus": 1,
        **extra,
    }


# -- the patcher -------------------------------------------------------------------------

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="needs the engine test venv (torch)"
)


def patch_cli(capsys, *argv: str) -> tuple[int, dict]:
    """``oldgpu patch ARGV --json``: the exit code and the JSON."""
    code = cli.main(["patch", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def patch_refused(capsys, tree: Path, name: str, *argv: str) -> dict:
    """``oldgpu patch TREE ARGV --json`` refused as ``name`` (exit 2) with every file of
    the tree byte-identical and unrewritten; the error's JSON."""
    state = tree_state(tree)
    code = cli.main(["patch", str(tree), *argv, "--json"])
    captured = capsys.readouterr()
    assert code == 2, captured
    err = json.loads(captured.out)
    assert err["error"] == name, err
    assert tree_state(tree) == state  # every file byte-identical, nothing rewritten
    return err


def function_def(tree: Path, rel: str, qualname: str) -> ast.FunctionDef:
    """The function (or class) ``qualname`` of ``tree/rel``, found by its dotted name."""
    node: ast.AST = ast.parse((tree / rel).read_bytes())
    for part in qualname.split("."):
        (node,) = [
            n
            for n in node.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and n.name == part
        ]
    return node
