"""The rollout patch set for verl 0.9.0 (``shared-weights-sync``): a rollout that
generates from the trainer's own parameters gets its wake-ups and the step's stamp, and
verl's weight export (the engine's state dict, two cache flushes) is skipped; any other
rollout keeps verl's path. The site on the real sdist here; the patched worker's
``update_weights`` run in the 0.9.0 venv (tests/test_rollout_verl09.py's)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import fresh_copy, function_def, patch_cli
from test_rollout_verl09 import needs_venv, run_verl

ENGINE_WORKERS = "verl/workers/engine_workers.py"
SCOPE = "ActorRolloutRefWorker.update_weights"


@pytest.fixture
def tree(verl09_pristine: Path, tmp_path: Path) -> Path:
    return fresh_copy(verl09_pristine, tmp_path)


def _body(tree: Path) -> list[str]:
    return [ast.unparse(s).splitlines()[0] for s in function_def(tree, ENGINE_WORKERS, SCOPE).body]


def test_the_stamp_comes_before_the_naive_sync(tree: Path, capsys) -> None:
    before = _body(tree)
    anchor = before.index("set_expandable_segments(False)")
    assert not any("oldgpu_compat" in line for line in before)
    code, out = patch_cli(capsys, str(tree), "--profile", "pascal-6.1")
    assert code == 0
    (sites,) = [p["sites"] for p in out["patches"] if p["name"] == "shared-weights-sync"]
    assert [(s["file"], s["function"]) for s in sites] == [(ENGINE_WORKERS, SCOPE)]
    after = _body(tree)
    # One statement added, right before the anchor; the rest of verl's code as it was.
    assert after[:anchor] == before[:anchor]
    assert after[anchor] == "if oldgpu_compat.shares_trainer_weights(self.rollout):"
    assert after[anchor + 1 :] == before[anchor:]
    fn = function_def(tree, ENGINE_WORKERS, SCOPE)
    (guard,) = [s for s in fn.body if isinstance(s, ast.If) and "oldgpu" in ast.unparse(s)]
    assert ast.unparse(guard.body[0]) == (
        "return await oldgpu_compat.stamp_shared_weights(self, global_steps)"
    )


def test_a_changed_sync_is_refused_and_nothing_written(tree: Path, capsys) -> None:
    path = tree / ENGINE_WORKERS
    text = path.read_text()
    # A release whose naive sync no longer opens with the allocator switch.
    changed = text.replace("        set_expandable_segments(False)\n", "", 1)
    assert changed != text
    path.write_text(changed)
    code, err = patch_cli(capsys, str(tree), "--profile", "pascal-6.1")
    assert code != 0 and "shared-weights-sync" in err["message"] and SCOPE in err["message"]
    assert path.read_text() == changed
    assert not (tree / "verl/utils/oldgpu_compat.py").exists()


SCRIPT = """
import asyncio, json, types
from verl.workers import engine_workers

# verl's own path logs the card's memory: there is no card here.
engine_workers.log_gpu_memory_usage = lambda *a, **k: None

calls = []

class Exported(Exception):
    pass

class Rollout:
    def __init__(self, shares):
        self.shares_trainer_weights = shares
    async def resume(self, tags):
        calls.append(["resume", tags])
    async def update_weights(self, weights, **kw):
        calls.append(["update_weights", list(weights), kw])

class Engine:
    is_param_offload_enabled = False
    def get_per_tensor_param(self, **kw):
        calls.append(["get_per_tensor_param"])
        raise Exported()

def worker(shares):
    w = types.SimpleNamespace()
    w.rollout = Rollout(shares)
    w.actor = types.SimpleNamespace(engine=Engine())
    w.config = types.SimpleNamespace(rollout=types.SimpleNamespace(
        free_cache_engine=True,
        checkpoint_engine=types.SimpleNamespace(backend="naive")))
    w.base_sync_done = False
    w.layered_summon = False
    w.peft_merge = False
    return w

fn = engine_workers.ActorRolloutRefWorker.update_weights
shared = worker(True)
asyncio.run(fn(shared, global_steps=7))
out = {"shared": calls, "base_sync_done": shared.base_sync_done}
calls = []
try:
    asyncio.run(fn(worker(False), global_steps=7))
except Exported:
    pass
out["other"] = calls
print(json.dumps(out))
"""


@needs_venv
def test_the_patched_worker_stamps_a_shared_rollout_and_exports_for_others(tree, capsys):
    code, _ = patch_cli(capsys, str(tree), "--profile", "cpu")
    assert code == 0
    (line,) = run_verl(tree, SCRIPT)[-1:]
    out = json.loads(line)
    assert out["shared"] == [
        ["resume", ["weights"]],
        ["update_weights", [], {"peft_config": None, "base_sync_done": True, "global_steps": 7}],
        ["resume", ["kv_cache"]],
    ]
    assert out["base_sync_done"] is True
    # Any other rollout: verl's own path, which exports the weights (stopped there).
    assert out["other"] == [["resume", ["weights"]], ["get_per_tensor_param"]]
