"""The fp16 patch set (a loss scaler) against the real verl 0.5.0 sdist: fp16 only."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest
from conftest import run_in_tree, tree_hashes

from oldgpu import cli
from oldgpu import patch as patcher
from oldgpu.patch.options import Options
from oldgpu.patch.registry import select_patches

pytestmark = pytest.mark.slow

DP_ACTOR = "verl/workers/actor/dp_actor.py"
DP_CRITIC = "verl/workers/critic/dp_critic.py"
ROLES = {
    DP_ACTOR: ("DataParallelPPOActor", "update_policy", "actor_optimizer", "actor"),
    DP_CRITIC: ("DataParallelPPOCritic", "update_critic", "critic_optimizer", "critic"),
}
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="needs the engine test venv (torch)"
)


def run_cli(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["patch", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def method(tree: Path, rel: str, cls: str, name: str) -> ast.FunctionDef:
    module = ast.parse((tree / rel).read_bytes())
    (klass,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return fn


def calls(fn: ast.AST) -> list[str]:
    """Every call in ``fn`` as ``ast.unparse`` writes it, in source order."""
    found = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    return [ast.unparse(n) for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def test_registered_for_fp16_only() -> None:
    for dtype in ("fp32", "bf16"):
        names = {p.name for p in select_patches("0.5.0", Options(compute_dtype=dtype))}
        assert "fp16-loss-scaler" not in names
    cpu = {p.name for p in select_patches("0.5.0", Options(device="cpu"))}
    assert "fp16-loss-scaler" not in cpu
    names = {p.name for p in select_patches("0.5.0", Options(compute_dtype="fp16"))}
    assert "fp16-loss-scaler" in names


def test_scaler_is_on_the_update_paths_in_order(verl_tree: Path, capsys) -> None:
    code, out = run_cli(capsys, str(verl_tree), "--profile", "volta")
    assert code == 0 and out["changed"] is True
    sites = {p["name"]: p["sites"] for p in out["patches"]}
    assert len(sites["fp16-loss-scaler"]) == 6  # per role: backward, metrics, step
    for rel, (cls, update, opt, role) in ROLES.items():
        fn = method(verl_tree, rel, cls, update)
        backwards = [c for c in calls(fn) if c.endswith(".backward()")]
        assert backwards == ["oldgpu_compat.scale_loss(self, loss).backward()"], rel
        assert ast.unparse(fn.body[-2]) == f"oldgpu_compat.scaler_metrics(self, metrics, '{role}')"
        step = calls(method(verl_tree, rel, cls, "_optimizer_step"))
        order = [
            f"oldgpu_compat.unscale_grads(self, self.{opt})",
            next(c for c in step if "clip_grad_norm_" in c),
            f"oldgpu_compat.scaler_step(self, self.{opt})",
            "oldgpu_compat.scaler_update(self, grad_norm)",
        ]
        assert [c for c in step if c in order] == order, step
        assert f"self.{opt}.step()" not in step
    compat = (verl_tree / patcher.COMPAT_REL).read_text()
    assert 'BAKED_COMPUTE_DTYPE = "fp16"' in compat and "ShardedGradScaler(" in compat


def test_pascal_and_fp32_trees_have_no_scaler(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    pristine = tree_hashes(verl_pristine)
    code, out = run_cli(capsys, str(verl_tree), "--profile", "pascal")
    assert code == 0 and "fp16-loss-scaler" not in {p["name"] for p in out["patches"]}
    for rel, (cls, update, _, _) in ROLES.items():
        assert "loss.backward()" in calls(method(verl_tree, rel, cls, update))
        assert "scaler" not in (verl_tree / rel).read_text()
    assert "ShardedGradScaler" not in (verl_tree / patcher.COMPAT_REL).read_text()
    run_cli(capsys, str(verl_tree), "--revert")
    assert tree_hashes(verl_tree) == pristine


def test_revert_is_byte_identical(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    run_cli(capsys, str(verl_tree), "--profile", "turing")
    assert tree_hashes(verl_tree) != tree_hashes(verl_pristine)
    code, out = run_cli(capsys, str(verl_tree), "--check", "--profile", "turing")
    assert code == 0 and out["changed"] is False  # a second run changes nothing
    run_cli(capsys, str(verl_tree), "--revert")
    assert tree_hashes(verl_tree) == tree_hashes(verl_pristine)


def test_changed_shape_is_refused(verl_tree: Path, capsys) -> None:
    critic = verl_tree / DP_CRITIC
    text = critic.read_text()
    critic.write_text(text.replace("loss.backward()", "(loss * 1).backward()", 1))
    before = tree_hashes(verl_tree)
    code = cli.main(["patch", str(verl_tree), "--profile", "volta", "--json"])
    err = json.loads(capsys.readouterr().out)
    assert code == 2 and err["error"] == "site-not-found", err
    assert "fp16-loss-scaler" in err["message"] and "update_critic" in err["message"]
    assert tree_hashes(verl_tree) == before  # all or nothing


# The patched _optimizer_step of the real classes, on a tiny CPU model: one overflowing
# loss (skipped step, scale halved), then a clean one (grads unscaled before the clip).
RUNTIME_SCRIPT = """
import math, os, sys, types
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from verl.utils import oldgpu_compat
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic.dp_critic import DataParallelPPOCritic

for cls, mod, opt, role in (
    (DataParallelPPOActor, "actor_module", "actor_optimizer", "actor"),
    (DataParallelPPOCritic, "critic_module", "critic_optimizer", "critic"),
):
    torch.manual_seed(0)
    worker = cls.__new__(cls)
    model = torch.nn.Linear(4, 1)
    setattr(worker, mod, model)
    setattr(worker, opt, torch.optim.SGD(model.parameters(), lr=0.1))
    worker.config = types.SimpleNamespace(grad_clip=100.0)
    x = torch.ones(1, 4)
    w0 = model.weight.detach().clone()
    scaled = oldgpu_compat.scale_loss(worker, model(x).sum() * 1e35)
    scaled.backward()
    norm = worker._optimizer_step()
    assert not math.isfinite(float(norm)), norm
    assert torch.equal(model.weight, w0), "an overflowing step was taken"
    getattr(worker, opt).zero_grad()
    loss = model(x).sum()
    scaled = oldgpu_compat.scale_loss(worker, loss)
    scaled.backward()
    norm = float(worker._optimizer_step())
    assert abs(norm - math.sqrt(5.0)) < 1e-4, norm  # unscaled before the clip
    assert torch.allclose(model.weight, w0 - 0.1), "the clean step was not taken"
    metrics = {}
    oldgpu_compat.scaler_metrics(worker, metrics, role)
    print(role, float(scaled / loss), metrics)
print("ok")
"""


@needs_torch
@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (
            None,
            [
                "actor 32768.0 {'actor/grad_scale': [32768.0], 'actor/skipped_steps': [1]}",
                "critic 32768.0 {'critic/grad_scale': [32768.0], 'critic/skipped_steps': [1]}",
            ],
        ),
        # An fp16 tree run as fp32 (the bench's baseline): the scaler passes through;
        # verl's own non-finite check still skips the step, and it is counted.
        (
            "fp32",
            [
                "actor 1.0 {'actor/grad_scale': [1.0], 'actor/skipped_steps': [1]}",
                "critic 1.0 {'critic/grad_scale': [1.0], 'critic/skipped_steps': [1]}",
            ],
        ),
    ],
)
def test_overflow_skips_the_step(
    verl_tree: Path, tmp_path: Path, capsys, dtype: str | None, expected: list[str]
) -> None:
    run_cli(capsys, str(verl_tree), "--profile", "volta")
    script = RUNTIME_SCRIPT.replace("sys.argv[1]", repr(str(tmp_path / "pg")))
    if dtype:
        script = f"import os; os.environ['OLDGPU_COMPUTE_DTYPE'] = {dtype!r}\n" + script
    proc = run_in_tree(verl_tree, script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [x for x in lines if not x.startswith("WARN")] == [*expected, "ok"], lines
