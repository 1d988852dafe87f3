"""The cpu patch set against the real verl 0.5.0 sdist: only for device cpu."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import function_def, needs_torch, patch_cli, run_in_tree, tree_hashes, tree_state

from oldgpu import cli
from oldgpu import patch as patcher
from oldgpu.patch.verl_0_5_0 import cpu as verl_0_5_0_cpu

pytestmark = pytest.mark.slow

DEVICE = "verl/utils/device.py"
FSDP_UTILS = "verl/utils/fsdp_utils.py"
PERFORMANCE = "verl/utils/profiler/performance.py"
MAIN_PPO = "verl/trainer/main_ppo.py"
FSDP_WORKERS = "verl/workers/fsdp_workers.py"
ENGINE_IMPL = "verl/workers/engine/fsdp/engine_impl.py"
CPU_ONLY_FILES = (DEVICE, FSDP_UTILS, PERFORMANCE, MAIN_PPO)  # files only the cpu set edits
CPU_SITES = {
    "cpu-dist-backend": 1,
    "cpu-gloo-backend-string": 1,
    "cpu-torch-device": 1,
    "cpu-sync-module-states": 4,
    "cpu-no-meta-init": 1,
    "cpu-no-param-offload": 2,
    "cpu-timing-all-reduce": 1,
    "cpu-ray-resources": 1,
}
CPU_HELPERS = ("torch_device_module", "cpu_dist_backend", "all_reduce_avg", "ray_num_gpus")


def source(node: ast.AST) -> str:
    return ast.unparse(node)


def test_registered_for_cpu_only() -> None:
    names = set(CPU_SITES)
    assert {p.name for p in verl_0_5_0_cpu.PATCHES} == names
    for device in ("cuda", "cpu"):
        chosen = {p.name for p in patcher.select_patches("0.5.0", patcher.Options(device=device))}
        assert (names <= chosen) is (device == "cpu")
        assert not (names & chosen) or device == "cpu"
        assert "autocast-compute-dtype" in chosen  # the dtype set applies everywhere


@pytest.mark.parametrize("profile", ["pascal", "ampere"])
def test_gpu_profiles_leave_cpu_sites_alone(
    verl_tree: Path, verl_pristine: Path, capsys, profile: str
) -> None:
    code, out = patch_cli(capsys, str(verl_tree), "--profile", profile)
    assert code == 0 and out["options"]["device"] == "cuda"
    assert not {p["name"] for p in out["patches"]} & set(CPU_SITES)
    pristine, now = tree_hashes(verl_pristine), tree_hashes(verl_tree)
    for rel in CPU_ONLY_FILES:
        assert now[rel] == pristine[rel], rel
    workers = (verl_tree / FSDP_WORKERS).read_text()
    assert 'backend=f"cpu:gloo,' in workers and "sync_module_states=True" in workers
    compat = (verl_tree / patcher.COMPAT_REL).read_text()
    assert not any(name in compat for name in CPU_HELPERS)


def test_cpu_sites_are_rewritten(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    code, out = patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    assert code == 0 and out["options"]["device"] == "cpu"
    sites = {p["name"]: p["sites"] for p in out["patches"]}
    assert {name: len(sites.get(name, [])) for name in CPU_SITES} == CPU_SITES
    assert len(sites["autocast-compute-dtype"]) == 5  # the dtype set is there too
    changed = {f["path"] for f in out["files"] if f["status"] != "unchanged"}
    assert set(CPU_ONLY_FILES) <= changed

    fn = function_def(verl_tree, DEVICE, "get_nccl_backend")
    assert not [n for n in ast.walk(fn) if isinstance(n, ast.Raise)]
    assert "return oldgpu_compat.cpu_dist_backend()" in source(fn)
    fn = function_def(verl_tree, DEVICE, "get_torch_device")
    assert "oldgpu_compat.torch_device_module(device_name)" in source(fn)
    assert "getattr(torch, device_name)" not in source(fn)

    fn = function_def(verl_tree, FSDP_WORKERS, "ActorRolloutRefWorker.__init__")
    assert "backend=oldgpu_compat.cpu_dist_backend()" in source(fn)
    assert "cpu:gloo" not in source(fn)
    for rel, scope in (
        (FSDP_WORKERS, "ActorRolloutRefWorker._build_model_optimizer"),
        (FSDP_WORKERS, "CriticWorker._build_critic_model_optimizer"),
        (FSDP_WORKERS, "RewardModelWorker._build_model"),
        (ENGINE_IMPL, "FSDPEngine._build_model_optimizer"),
    ):
        text = source(function_def(verl_tree, rel, scope))
        assert "sync_module_states=True" not in text, scope
        assert "sync_module_states=oldgpu_compat.sync_module_states()" in text, scope
    # Without that broadcast, ranks != 0 must not start from meta tensors.
    text = source(function_def(verl_tree, FSDP_UTILS, "get_init_weight_context_manager"))
    assert "if use_meta_tensor and oldgpu_compat.sync_module_states():" in text
    # The ref model (role != "actor") and the reward model: no CPUOffload.
    text = source(
        function_def(verl_tree, FSDP_WORKERS, "ActorRolloutRefWorker._build_model_optimizer")
    )
    assert "cpu_offload = None if role == 'actor' else oldgpu_compat.fsdp_param_offload()" in text
    text = source(function_def(verl_tree, FSDP_WORKERS, "RewardModelWorker._build_model"))
    assert "cpu_offload=oldgpu_compat.fsdp_param_offload()" in text
    assert "CPUOffload(offload_params=True)" not in text

    text = source(function_def(verl_tree, PERFORMANCE, "reduce_timing"))
    assert "ReduceOp.AVG" not in text and "oldgpu_compat.all_reduce_avg(timing_list)" in text

    (init,) = [
        n
        for n in ast.walk(function_def(verl_tree, MAIN_PPO, "run_ppo"))
        if isinstance(n, ast.Call) and source(n.func) == "ray.init"
    ]
    kws = {kw.arg: source(kw.value) for kw in init.keywords}
    assert kws["num_gpus"] == "oldgpu_compat.ray_num_gpus(config)"
    assert kws["resources"] == "oldgpu_compat.ray_resources(config)"
    assert kws["num_cpus"] == "config.ray_init.num_cpus"  # the rest as it was
    # One keyword per line, like the original call.
    lines = (verl_tree / MAIN_PPO).read_text().splitlines()
    assert "            num_gpus=oldgpu_compat.ray_num_gpus(config)," in lines

    for rel in {*CPU_ONLY_FILES, FSDP_WORKERS, ENGINE_IMPL, patcher.COMPAT_REL}:
        path = verl_tree / rel
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    compat = (verl_tree / patcher.COMPAT_REL).read_text()
    assert all(f"def {name}(" in compat for name in CPU_HELPERS)
    manifest = json.loads((verl_tree / patcher.MANIFEST_NAME).read_text())
    assert manifest["options"]["device"] == "cpu"
    assert "cpu-torch-device" in manifest["files"][DEVICE]["patches"]
    pristine = tree_hashes(verl_pristine)
    for rel in CPU_ONLY_FILES:
        assert manifest["files"][rel]["original_sha256"] == pristine[rel]


def test_check_revert_round_trip(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    code, _ = patch_cli(capsys, str(verl_tree), "--profile", "cpu", "--check")
    assert code == 1
    patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    state = tree_state(verl_tree)
    code, out = patch_cli(capsys, str(verl_tree), "--profile", "cpu", "--check")
    assert code == 0 and out["changed"] is False
    code, out = patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    assert out["changed"] is False and tree_state(verl_tree) == state  # not even rewritten
    # cpu -> pascal is revert-then-apply: the cpu-only files come back byte for byte.
    code, out = patch_cli(capsys, str(verl_tree), "--profile", "pascal")
    assert code == 0 and out["changed"] is True
    pristine, now = tree_hashes(verl_pristine), tree_hashes(verl_tree)
    for rel in CPU_ONLY_FILES:
        assert now[rel] == pristine[rel]
        assert not (verl_tree / patcher.ORIGINALS_DIR / rel).exists()
    assert "torch_device_module" not in (verl_tree / patcher.COMPAT_REL).read_text()
    patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    code, out = patch_cli(capsys, str(verl_tree), "--revert")
    assert code == 0 and out["changed"] is True
    assert tree_hashes(verl_tree) == tree_hashes(verl_pristine)


def test_cpu_site_not_found_changes_nothing(verl_tree: Path, capsys) -> None:
    perf = verl_tree / PERFORMANCE
    text = perf.read_text()
    old = "op=torch.distributed.ReduceOp.AVG"
    assert text.count(old) == 1
    perf.write_text(text.replace(old, "op=torch.distributed.ReduceOp.SUM"))
    state = tree_state(verl_tree)
    code = cli.main(["patch", str(verl_tree), "--profile", "cpu", "--json"])
    err = json.loads(capsys.readouterr().out)
    assert code == 2 and err["error"] == "site-not-found"
    assert err["message"].startswith(f"patch cpu-timing-all-reduce: {PERFORMANCE}: reduce_timing")
    assert tree_state(verl_tree) == state  # all or nothing: no other file was patched
    # The cuda profile does not look there, so it still patches.
    code, _ = patch_cli(capsys, str(verl_tree), "--profile", "pascal")
    assert code == 0


RUNTIME_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from verl.utils import device, oldgpu_compat
from verl.utils.profiler.performance import reduce_timing
import verl.trainer.main_ppo  # noqa: F401  (imports with its patched ray.init)

assert device.get_nccl_backend() == "gloo"
dev = device.get_torch_device()
assert dev is oldgpu_compat.CPU_DEVICE
for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
             "max_memory_reserved"):
    assert getattr(dev, name)() > 0, name
free, total = dev.mem_get_info()
assert 0 < free <= total
dev.empty_cache(); dev.reset_peak_memory_stats(); dev.synchronize(); dev.set_device(0)
assert (dev.is_available(), dev.device_count(), device.get_device_id()) == (True, 1, "cpu")
state = dev.get_rng_state()
a = torch.rand(3)
dev.set_rng_state(state)
assert torch.equal(a, torch.rand(3))
dev.manual_seed(1)
assert dev.initial_seed() == 1
assert oldgpu_compat.torch_device_module("cuda") is torch.cuda
assert hasattr(dev, "Stream") and hasattr(dev, "current_stream")  # torch.cpu's own

dist.init_process_group(
    backend=oldgpu_compat.cpu_dist_backend(), init_method="file://" + sys.argv[1],
    rank=0, world_size=1,
)
print(sorted(reduce_timing({"gen": 2.0, "step": 3.0}).items()))
t = torch.tensor([2.0, 4.0])
oldgpu_compat.all_reduce_avg(t)
assert t.tolist() == [2.0, 4.0]
dist.destroy_process_group()

cfg = OmegaConf.create({"trainer": {"n_gpus_per_node": 2, "device": "cuda"}})
assert oldgpu_compat.ray_num_gpus(cfg) == 2 and oldgpu_compat.ray_resources(cfg) is None
cfg.trainer.device = "cpu"
assert oldgpu_compat.ray_resources(cfg) == {"cpu": 2.0}
os.environ["RAY_ADDRESS"] = "auto"  # joining a running cluster: no resource arguments
assert oldgpu_compat.ray_num_gpus(cfg) is None and oldgpu_compat.ray_resources(cfg) is None
del os.environ["RAY_ADDRESS"]
assert oldgpu_compat.sync_module_states() is False

from verl.utils.fsdp_utils import get_init_weight_context_manager

class Rank1Mesh:  # what a device mesh says on a rank that is not 0
    def get_coordinate(self):
        return [1]

assert get_init_weight_context_manager(True, Rank1Mesh())() == torch.device("cpu")
assert oldgpu_compat.fsdp_param_offload() is None
print("ok")
"""


@needs_torch
def test_patched_tree_runs_on_cpu(verl_tree: Path, tmp_path: Path, capsys) -> None:
    pristine = run_in_tree(verl_tree, "from verl.utils import device; device.get_nccl_backend()")
    assert pristine.returncode != 0 and "No available nccl backend" in pristine.stderr  # bites
    patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    proc = run_in_tree(verl_tree, RUNTIME_SCRIPT.replace("sys.argv[1]", repr(str(tmp_path / "pg"))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2:] == ["[('gen', 2.0), ('step', 3.0)]", "ok"]
