"""The oldgpu-hf rollout in the real verl 0.9.0 (the sdist, cpu-patched), in its own venv.

verl 0.9.0 needs numpy 2, transformers 5 and Ray, which the engine's test venv (the
0.5.0 lock) does not have: these tests run the venv ``scripts/verl09-venv.sh`` builds
from the release's lock ($VERL09_VENV, which ``make unit`` sets) in subprocesses, and
skip without it.
The 2-step GRPO run itself is opt-in (OLDGPU_VERL09_SMOKE=1: about ten minutes on two
cores).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import fresh_copy

from oldgpu import cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VERL09_VENV", "/tmp/verl09-venv"))
PYTHON = VENV / "bin" / "python"

needs_venv = pytest.mark.skipif(
    not PYTHON.exists(),
    reason=f"needs the verl 0.9.0 venv at {VENV} (scripts/verl09-cpu-smoke.sh builds it)",
)


@pytest.fixture(scope="module")
def cpu_tree(verl09_pristine: Path, tmp_path_factory) -> Path:
    tree = fresh_copy(verl09_pristine, tmp_path_factory.mktemp("verl09-cpu"))
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["patch", str(tree), "--profile", "cpu", "--json"]) == 0
    return tree


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("assets")
    proc = subprocess.run(
        [str(PYTHON), "-m", "oldgpu", "smoke-assets", "--out", str(out), "--json"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def run_verl(tree: Path, script: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OLDGPU_", "VERL_"))}
    environ.update(
        PYTHONPATH=f"{tree}:{ROOT / 'src'}",
        VERL_USE_EXTERNAL_MODULES="oldgpu.verl_plugin.hook",
        PYTHONDONTWRITEBYTECODE="1",
        **env,
    )
    proc = subprocess.run(
        [str(PYTHON), "-c", textwrap.dedent(script)],
        cwd=tree,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()


@needs_venv
def test_verl_finds_the_rollout_by_name_in_a_fresh_process(cpu_tree):
    (line,) = run_verl(
        cpu_tree,
        """
        import json
        import verl
        from verl.workers.rollout.base import get_rollout_class
        from verl.workers.rollout.replica import get_rollout_replica_class
        adapter = get_rollout_class("oldgpu-hf", "async")
        replica = get_rollout_replica_class("oldgpu-hf")
        print(json.dumps([adapter.__module__, adapter.__name__, replica.__module__,
                          [c.__name__ for c in replica.__mro__]]))
        """,
    )
    module, name, replica_module, mro = json.loads(line)
    assert (module, name) == ("oldgpu.rollout.adapter", "HFServerAdapter")
    assert replica_module == "oldgpu.rollout.replica" and "RolloutReplica" in mro


@needs_venv
def test_the_cpu_platform_only_when_asked(cpu_tree):
    script = """
        from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
        shim = hasattr(get_torch_device(), "memory_allocated")
        print(get_device_name(), get_nccl_backend(), shim)
        """
    assert run_verl(cpu_tree, script, VERL_PLATFORM="cpu") == ["cpu gloo True"]
    # Without VERL_PLATFORM, verl decides as ever (this host has no GPU: its CUDA fallback).
    assert run_verl(cpu_tree, script)[-1].split()[0] == "cuda"


@needs_venv
def test_the_server_answers_the_agent_loops_call_with_a_token_output(cpu_tree, assets):
    """HFRolloutServer as the agent loop calls it (no Ray cluster: the class itself), with
    weights pushed through the adapter's buckets."""
    (line,) = run_verl(
        cpu_tree,
        f"""
        import asyncio, json
        import torch
        from omegaconf import OmegaConf
        from transformers import AutoModelForCausalLM
        from verl.workers.config import RolloutConfig
        from verl.workers.rollout.replica import RolloutMode, TokenOutput
        from oldgpu.rollout.adapter import buckets
        from oldgpu.rollout.server import HFRolloutServer

        model_path = {str(assets / "model")!r}
        config = RolloutConfig(name="oldgpu-hf", tensor_model_parallel_size=1,
                               prompt_length=32, response_length=8, load_format="dummy")
        model_config = OmegaConf.create({{"path": model_path}})

        async def main():
            server = HFRolloutServer(config, model_config, RolloutMode.HYBRID, replica_rank=0)
            await server.launch_server()
            trained = AutoModelForCausalLM.from_pretrained(model_path)
            sent = 0
            for bucket in buckets(trained.state_dict().items(), 1 << 16):
                sent += await server.load_weights(bucket)
            await server.end_weight_update(global_steps=3)
            params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                          logprobs=True)
            outs = await asyncio.gather(*[
                server.generate(prompt_ids=[1, 10 + i, 11, 12], sampling_params=dict(params),
                                request_id=str(i))
                for i in range(5)
            ])
            greedy = await server.generate(
                prompt_ids=[1, 10, 11, 12], request_id="g",
                sampling_params=dict(temperature=0, top_p=1.0, top_k=-1, logprobs=False))
            stats = await server.stats()
            return sent, outs, greedy, stats

        sent, outs, greedy, stats = asyncio.run(main())
        assert all(isinstance(o, TokenOutput) for o in outs + [greedy])
        print(json.dumps(dict(
            sent=sent,
            lengths=[(len(o.token_ids), len(o.log_probs)) for o in outs],
            max_lp=max(lp for o in outs for lp in o.log_probs),
            steps=[o.extra_fields["global_steps"] for o in outs],
            reasons=sorted({{o.stop_reason for o in outs}}),
            greedy_log_probs=greedy.log_probs,
            stats=stats,
        )))
        """,
        VERL_PLATFORM="cpu",
    )
    doc = json.loads(line)
    assert doc["sent"] > 0
    assert all(1 <= n <= 8 and n == m for n, m in doc["lengths"])
    assert doc["max_lp"] <= 1e-6
    assert doc["steps"] == [3] * 5
    assert doc["reasons"] == ["completed"]
    assert doc["greedy_log_probs"] is None
    assert doc["stats"]["largest_batch"] == 5  # the five arrived together: one batch


@needs_venv
@pytest.mark.skipif(
    os.environ.get("OLDGPU_VERL09_SMOKE") != "1", reason="the 2-step run is opt-in (minutes)"
)
def test_grpo_trains_two_steps_on_the_cpu(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "verl09-cpu-smoke.sh")],
        env={**os.environ, "VERL09_WORK": str(tmp_path), "STEPS": "2"},
        capture_output=True,
        text=True,
        check=False,
        timeout=3000,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "step:2" in out, out[-6000:]
