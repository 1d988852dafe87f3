"""The cpu patch set for verl 0.9.0 against the real sdist: only for device cpu.

What it is for is proven by scripts/verl09-cpu-smoke.sh (2 GRPO steps on the CPU,
docs/newer-verl.md); here: its sites, that the tree still compiles, that no GPU
profile gets it, and that a revert restores every byte.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import (
    fresh_copy,
    function_def,
    patch_cli,
    tree_hashes,
)

from oldgpu.patch.verl_0_9_0 import cpu as verl_0_9_0_cpu

pytestmark = pytest.mark.slow

DISTRIBUTED = "verl/utils/distributed.py"
FSDP_UTILS = "verl/utils/fsdp_utils.py"
FSDP_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
ENGINE_WORKERS = "verl/workers/engine_workers.py"
CPU_SITES = {  # patch name -> (file, function) of each site
    "cpu-gloo-backend-string": [(DISTRIBUTED, "initialize_global_process_group_ray")],
    "cpu-fsdp-load-device": [(FSDP_UTILS, "load_fsdp_model_to_gpu")],
    "cpu-sync-module-states": [(FSDP_ENGINE, "FSDPEngine._build_fsdp_module")],
    "cpu-no-meta-init": [(FSDP_UTILS, "get_init_weight_context_manager")],
    "cpu-no-param-offload": [(FSDP_ENGINE, "FSDPEngine._build_fsdp_module")],
    "cpu-loss-all-reduce": [(ENGINE_WORKERS, "TrainingWorker._postprocess_output")],
}


@pytest.fixture
def tree(verl09_pristine: Path, tmp_path: Path) -> Path:
    return fresh_copy(verl09_pristine, tmp_path)


def _source(tree: Path, rel: str, qualname: str) -> str:
    text = (tree / rel).read_text()
    return ast.get_source_segment(text, function_def(tree, rel, qualname)) or ""


def test_the_cpu_set_is_every_patch_of_the_module():
    assert {p.name for p in verl_0_9_0_cpu.PATCHES} == set(CPU_SITES)
    assert all(p.versions == frozenset({"0.9.0"}) for p in verl_0_9_0_cpu.PATCHES)


def test_cpu_profile_patches_the_sites(tree: Path, capsys):
    code, out = patch_cli(capsys, str(tree), "--profile", "cpu")
    assert code == 0 and out["changed"] is True
    sites = {p["name"]: [(s["file"], s["function"]) for s in p["sites"]] for p in out["patches"]}
    for name, expected in CPU_SITES.items():
        assert sites[name] == expected, name
    for rel in {rel for found in CPU_SITES.values() for rel, _ in found}:
        compile((tree / rel).read_bytes(), rel, "exec", dont_inherit=True)
    assert "backend = backend or oldgpu_compat.cpu_dist_backend()" in _source(
        tree, DISTRIBUTED, "initialize_global_process_group_ray"
    )
    assert "torch.device(oldgpu_compat.cpu_device())" in _source(
        tree, FSDP_UTILS, "load_fsdp_model_to_gpu"
    )
    build = _source(tree, FSDP_ENGINE, "FSDPEngine._build_fsdp_module")
    assert "sync_module_states=oldgpu_compat.sync_module_states()" in build
    assert "cpu_offload = oldgpu_compat.fsdp_param_offload()" in build
    # gloo has no AVG before torch 2.8: a sum over the same group, divided.
    post = _source(tree, ENGINE_WORKERS, "TrainingWorker._postprocess_output")
    assert "oldgpu_compat.all_reduce_avg(loss, group=dp_group)" in post
    assert "ReduceOp.AVG" not in post
    compat = (tree / "verl/utils/oldgpu_compat.py").read_text()
    assert "def all_reduce_avg(" in compat
    assert "def cpu_device()" in compat and "def cpu_dist_backend()" in compat


@pytest.mark.parametrize("profile", ["pascal", "ampere"])
def test_gpu_profiles_do_not_get_it(tree: Path, capsys, profile: str):
    code, out = patch_cli(capsys, str(tree), "--profile", profile)
    assert code == 0
    assert not {p["name"] for p in out["patches"]} & set(CPU_SITES)
    assert "oldgpu_compat" not in (tree / DISTRIBUTED).read_text()


def test_revert_restores_every_byte(tree: Path, capsys):
    before = tree_hashes(tree)
    assert patch_cli(capsys, str(tree), "--profile", "cpu")[0] == 0
    assert tree_hashes(tree) != before
    assert patch_cli(capsys, str(tree), "--revert")[0] == 0
    assert tree_hashes(tree) == before
