"""bench/: the fp16 settings (fp16-volta, fp32-volta, learn-fp16) run the production path
with the volta profile: a 32 GB V100's plan, the volta guard, verl patched for volta."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from test_bench import FAKE_PYTHON, fake_assets

from oldgpu import jobs

ROOT = Path(__file__).resolve().parents[1]

# As bench/setup.sh writes it: `job command` plans against a recorded nvidia-smi line
# (BENCH_SMI_FILE's when set); the doctor fails, as on the lent machine.
FAKE_OLDGPU = """#!/bin/bash
if [[ $1 == doctor ]]; then echo "doctor $*" >>"$FAKE_LOG"; exit 3; fi
smi={p40}
[[ -n ${{BENCH_SMI_FILE:-}} ]] && smi=$BENCH_SMI_FILE
if [[ "${{1:-}} ${{2:-}}" == "job command" ]]; then set -- "$@" --nvidia-smi-file "$smi"; fi
exec {python} -m oldgpu "$@"
"""
# verl's step lines with the fp16 tree's loss-scaler metrics: one skip at step 1.
SCALER_PYTHON = FAKE_PYTHON.replace(
    "perf/max_memory_reserved_gb:1.5",
    "perf/max_memory_reserved_gb:1.5 - actor/grad_scale:{{32768.0 if step == 1 else 65536.0}}"
    " - actor/skipped_steps:{{1 if step == 1 else 0}} - critic/grad_scale:65536.0"
    " - critic/skipped_steps:0",
)


@pytest.fixture
def pb(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        module = importlib.import_module("ppo_bench")
        monkeypatch.setattr(module, "HOME", tmp_path / "home")
        monkeypatch.setattr(module, "build_assets", lambda kind, home: qwen_assets(tmp_path))
        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))
        for name in ("ppo_bench", "bench_report", "bench_assets"):
            sys.modules.pop(name, None)


def qwen_assets(tmp_path: Path) -> dict:
    """The bench's 0.5B shape (its config only) with 256 + 256 tokens, as on the GPU."""
    assets = fake_assets(tmp_path)
    config = dict(
        assets["config"], hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
    )  # fmt: skip
    Path(assets["model"], "config.json").write_text(json.dumps(config))
    return {**assets, "kind": "bench", "config": config, "prompt_length": 256,
            "response_length": 256}  # fmt: skip


@pytest.fixture
def host(tmp_path, monkeypatch):
    fake = tmp_path / "oldgpu"
    p40 = ROOT / "tests/data/detect/p40.nvidia-smi.csv"
    fake.write_text(FAKE_OLDGPU.format(python=sys.executable, p40=p40))
    fake.chmod(0o755)
    venv = tmp_path / "venv/bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(SCALER_PYTHON.format(python=sys.executable))
    (venv / "python").chmod(0o755)
    monkeypatch.setenv("OLDGPU_BIN", str(fake))
    monkeypatch.setenv("VERL_VENV", str(tmp_path / "venv"))
    monkeypatch.setenv("VERL_DIR", str(tmp_path / "verl-tree"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    monkeypatch.setenv("FAKE_EXEC", str(tmp_path / "exec.json"))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake.log"))
    monkeypatch.delenv("BENCH_SMI_FILE", raising=False)
    return tmp_path


def overrides(argv: list[str]) -> dict[str, str]:
    return {jobs.override_key(o): o.split("=", 1)[1] for o in argv[2:]}


def test_fp16_and_fp32_volta_run_one_batch_under_the_volta_guard(pb, host) -> None:
    runs = {}
    for name in ("fp16-volta", "fp32-volta"):
        out = host / "runs" / name
        run = pb.prepare(name, 3, out, "gpu")
        result = pb.execute(run, out, deadline=None)
        seen = json.loads((host / "exec.json").read_text())
        assert seen["argv"] == run["argv"] and result["ran_job_command"]
        composed = run["composed"]
        # A 32 GB V100's plan (the recorded nvidia-smi line), the volta profile.
        assert (composed["profile"], composed["memory_mib"]) == ("volta-7.0", 32768)
        env = seen["env"]
        assert env["OLDGPU_GUARD"] == "volta"
        # verl patched for volta (setup.sh's re-patched copy), first on the path.
        tree = str(pb.HOME / "env" / "verl-tree-volta")
        assert env["VERL_DIR"] == tree and env["PYTHONPATH"].split(":")[0] == tree
        o = overrides(run["argv"])
        assert o["actor_rollout_ref.rollout.name"] == "hf"
        assert o["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "fp32"
        assert "actor_rollout_ref.rollout.gpu_memory_utilization" not in o
        runs[name] = (run, env, o, result)
    (f16, env16, o16, r16), (f32, env32, o32, r32) = runs["fp16-volta"], runs["fp32-volta"]
    assert (env16["OLDGPU_COMPUTE_DTYPE"], env32["OLDGPU_COMPUTE_DTYPE"]) == ("fp16", "fp32")
    # The fp32 baseline: fp16 tensors refused by the guard too; fp16 allows them.
    assert env32["OLDGPU_GUARD_DTYPE"] == "fp32" and "OLDGPU_GUARD_DTYPE" not in env16
    assert "VERL_JOB_COMPUTE_DTYPE='fp32'" in f32["env_file"]
    assert "VERL_JOB_ROLLOUT='hf'" in f16["env_file"]
    # One batch for both, so tokens/s compare.
    assert o16["data.train_batch_size"] == o32["data.train_batch_size"] == str(pb.VOLTA_BATCH)
    # The loss scaler's metrics from the step lines.
    assert r16["grad_scale_last"] == {"actor/grad_scale": 65536.0, "critic/grad_scale": 65536.0}
    assert (r16["skipped_steps"], r16["skipped_after_step_2"]) == (1, 0)
    # The projection (a model): a V100 for the volta runs, fp16 on its tensor cores.
    v16, v32 = r16["projection"]["v100"], r32["projection"]["v100"]
    assert "p40" not in r16["projection"]
    v100 = pb.report.V100
    ratio = v100["fp32_tflops"] / v100["fp16_tflops"]
    assert v16["compute_s"] == pytest.approx(v32["compute_s"] * ratio, rel=0.05)
    table = pb.report.summary(host / "runs")
    assert "| V100: " in table
    assert "| fp16-volta loss scale | fp16 |" in table
    assert "fp16-volta / fp32-volta tokens/s: 1.00x" in table


def test_learn_fp16_is_learns_job_in_fp16_on_volta(pb, host) -> None:
    run = pb.prepare("learn-fp16", 20, host / "runs" / "learn-fp16", "gpu")
    learn = pb.SETTINGS["learn"]
    assert pb.SETTINGS["learn-fp16"].overrides == learn.overrides
    assert run["job"]["train_batch_size"] == learn.job["train_batch_size"]
    assert run["composed"]["environment"]["OLDGPU_COMPUTE_DTYPE"] == "fp16"
    assert run["env"]["OLDGPU_GUARD"] == "volta" and "OLDGPU_GUARD_DTYPE" not in run["env"]


@pytest.mark.parametrize("name", ["fp16-volta", "fp32-volta", "learn-fp16"])
def test_smoke_scale_runs_the_cpu_profile_with_the_jobs_choices(
    pb, host, monkeypatch, name
) -> None:
    monkeypatch.setattr(pb, "build_assets", lambda kind, home: fake_assets(host))
    run = pb.prepare(name, 2, host / "runs" / name, "smoke")
    assert run["composed"]["profile"] == "cpu"
    assert run["env"]["OLDGPU_GUARD"] == "volta" and run["env"]["OLDGPU_GUARD_DEVICE"] == "cpu"
    assert "VERL_DIR" not in run["env"] and "BENCH_SMI_FILE" not in run["env"]
    assert "VERL_JOB_ROLLOUT='hf'" in run["env_file"]
    assert run["composed"]["environment"]["OLDGPU_COMPUTE_DTYPE"] == "fp32"
