"""bench/: the benchmark runs the production path (a job env file, files/bin/verl-train),
reads verl's console metrics, and summarises."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from oldgpu import jobs
from oldgpu import plan as planner
from oldgpu.output import EngineError

ROOT = Path(__file__).resolve().parents[1]
START = ROOT / "files/bin/verl-train"


@pytest.fixture(scope="module")
def pb():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module("ppo_bench")
    finally:
        sys.path.remove(str(ROOT / "bench"))
        sys.modules.pop("ppo_bench", None)
        sys.modules.pop("bench_report", None)
        sys.modules.pop("bench_assets", None)
        sys.modules.pop("bench_run", None)


def test_parse_verl_console_line(pb) -> None:
    # verl's LocalLogger: "step:N - key:pprint(value) - ...", behind Ray's actor prefix.
    line = (
        "(TaskRunner pid=4242) step:3 - timing_s/step:np.float64(6.25) - "
        "perf/throughput:77.5 - perf/max_memory_reserved_gb:17.75 - "
        "critic/score/mean:np.float32(0.125) - training/global_step:3 - response_length/mean:256.0"
    )
    m = pb.report.parse_step(line)
    assert m == {
        "step": 3,
        "timing_s/step": 6.25,
        "perf/throughput": 77.5,
        "perf/max_memory_reserved_gb": 17.75,
        "critic/score/mean": 0.125,
        "training/global_step": 3.0,
        "response_length/mean": 256.0,
    }
    assert pb.report.parse_step("Training Progress: 10%") is None
    assert pb.report.parse_value("nan") != pb.report.parse_value("nan")  # a float nan
    assert pb.report.parse_value("tensor(2.5000)") == 2.5


def test_ops_steps_from_the_composed_argv(pb) -> None:
    argv = [
        "-m",
        "verl.trainer.main_ppo",
        "+actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
        "data.train_batch_size=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "critic.ppo_mini_batch_size=64",
    ]
    assert pb.report.ops_steps(argv) == 8  # 4 actor + 4 critic optimizer steps
    # GRPO has no critic; verl scales the mini batch by rollout.n itself.
    grpo = [*argv, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]
    assert pb.report.ops_steps(grpo) == 4
    assert pb.report.ops_steps(["data.train_batch_size=1"]) == 2


def test_settings_are_jobs_or_name_the_fields_they_lack(pb, tmp_path) -> None:
    assets = fake_assets(tmp_path)
    for setting in pb.SETTINGS.values():
        for scale in ("gpu", "smoke"):
            spec = pb.job_spec(setting, 3, scale, assets)
            # no save inside the timed steps, unless the setting proves a checkpoint
            assert ("trainer.save_freq=-1" in spec["overrides"]) != setting.save
            assert spec["save_freq"] == 3
            assert all("{" not in o for o in spec["overrides"])
            missing = pb.missing_fields(setting)
            if missing:  # GRPO / LoRA before the engine has their fields
                with pytest.raises(EngineError) as err:
                    jobs.job_from_mapping(spec)
                assert all(name in err.value.message for name in missing)
                continue
            job = jobs.job_from_mapping(spec)
            assert job.profile == (setting.profile if scale == "gpu" else "cpu")
            if scale == "smoke":
                assert 1 <= job.train_batch_size <= pb.SMOKE_BATCH
            offload = [o for o in job.overrides if "offload" in o]
            assert not offload if scale == "smoke" else offload == list(setting.gpu_only)
    assert pb.SETTINGS["a"].job == {"train_batch_size": 1}


def test_the_15b_setting_builds_the_planners_qwen25_15b(pb) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    shape = importlib.import_module("bench_assets").model_shape("bench-1.5b")
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]) == (
        1536,
        28,
        8960,
    )
    assert (shape["num_attention_heads"], shape["num_key_value_heads"]) == (12, 2)
    assert shape["vocab_size"] == 151936 and shape["tie_word_embeddings"]
    config, model_class = transformers.Qwen2Config(**shape), transformers.Qwen2ForCausalLM
    with torch.device("meta"):  # the shape only: no 6 GB of weights
        model = model_class(config)
    params = sum(p.numel() for p in model.parameters())
    assert params == planner.SHAPES["qwen2.5-1.5b"].params()


# --- the production path: a job env file, then verl-train ---------------------------------

FAKE_OLDGPU = """#!/bin/bash
# The real engine; a doctor that fails, as on the lent GPU machine.
if [[ $1 == doctor ]]; then echo "doctor $*" >>"$FAKE_LOG"; exit 3; fi
exec {python} -m oldgpu "$@"
"""
# verl's interpreter: records what it was started with, prints verl's step lines.
FAKE_PYTHON = """#!{python}
import json, os, sys
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}},
          open(os.environ["FAKE_EXEC"], "w"))
for step in (1, 2, 3):
    print(f"(TaskRunner pid=9) step:{{step}} - timing_s/step:{{4.0 if step == 1 else 2.0}} - "
          f"perf/throughput:{{100.0 * step}} - perf/max_memory_reserved_gb:1.5", flush=True)
"""


def fake_assets(tmp_path: Path) -> dict:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 512, "tie_word_embeddings": True,
              "max_position_embeddings": 512}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"PAR1")
    return {
        "kind": "smoke",
        "model": str(model),
        "train": str(tmp_path / "train.parquet"),
        "test": str(tmp_path / "test.parquet"),
        "params": 100000,
        "config": config,
        "prompt_length": 128,
        "response_length": 16,
    }


@pytest.fixture
def host(tmp_path, monkeypatch):
    """verl-train's paths as bench/setup.sh sets them, with a fake doctor and python."""
    fake = tmp_path / "oldgpu"
    fake.write_text(FAKE_OLDGPU.format(python=sys.executable))
    fake.chmod(0o755)
    venv = tmp_path / "venv/bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    (venv / "python").chmod(0o755)
    monkeypatch.setenv("OLDGPU_BIN", str(fake))
    monkeypatch.setenv("VERL_VENV", str(tmp_path / "venv"))
    monkeypatch.setenv("VERL_DIR", str(tmp_path / "verl-tree"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    monkeypatch.setenv("FAKE_EXEC", str(tmp_path / "exec.json"))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake.log"))
    return tmp_path


def test_the_bench_runs_what_oldgpu_job_command_composes(pb, host, monkeypatch) -> None:
    monkeypatch.setattr(pb, "build_assets", lambda kind, home: fake_assets(host))
    out = host / "runs" / "b"
    run = pb.prepare("b", 3, out, "smoke")
    # The env file is the engine's rendering of the setting's job.
    spec = json.loads((out / "job.json").read_text())
    assert (out / "job.env").read_text() == jobs.render_env(jobs.job_from_mapping(spec))
    assert spec["overrides"] == ["trainer.save_freq=-1", "actor_rollout_ref.actor.use_kl_loss=True"]
    result = pb.execute(run, out, deadline=None)

    seen = json.loads((host / "exec.json").read_text())
    # verl-train exec'd exactly `oldgpu job command`'s argv, in the job's state directory,
    # with the engine's environment and the guard's.
    assert seen["argv"] == run["composed"]["argv"] == run["argv"]
    assert result["ran_job_command"]
    assert "trainer.save_freq=-1" in seen["argv"] and "trainer.save_freq=3" not in seen["argv"]
    for key, value in run["composed"]["environment"].items():
        assert seen["env"][key] == value, key
    assert seen["cwd"] == str(out / "state")
    assert seen["env"]["OLDGPU_GUARD"] == "pascal"
    assert seen["env"]["OLDGPU_GUARD_LOG"] == str(out / "guard.jsonl")
    assert seen["env"]["OLDGPU_GUARD_OPS_STEPS"] == str(pb.report.ops_steps(run["argv"]))
    path = seen["env"]["PYTHONPATH"].split(":")
    assert path[:2] == [str(host / "verl-tree"), str(ROOT / "src/oldgpu/guard_site")]
    # The doctor failed and the run went on: loudly, and only because the bench asked.
    assert "--arch cpu" in (host / "fake.log").read_text()
    log = (out / "train.log").read_text()
    assert "--doctor-warn-only-for-benchmarks" in log and "WARNING" in log
    assert result["doctor"] == "failed (exit 3), ran past it (--doctor-warn-only-for-benchmarks)"
    # Timing from verl's step lines, steps >= 2.
    assert result["steps_done"] == 3 and result["steps_timed"] == [2, 3]
    assert result["s_per_step"] == 2.0 and result["tokens_per_s"] == 250.0
    assert "verl-train --doctor-warn-only-for-benchmarks" in (out / "command.txt").read_text()


def test_verl_train_stops_on_a_failing_doctor_without_the_flag(pb, host, monkeypatch) -> None:
    monkeypatch.setattr(pb, "build_assets", lambda kind, home: fake_assets(host))
    out = host / "runs" / "a"
    run = pb.prepare("a", 2, out, "smoke")
    env = {**os.environ, **run["env"]}
    proc = subprocess.run([str(START)], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert not (host / "exec.json").exists()
    proc = subprocess.run(
        [str(START), "--skip-doctor"], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 4 and "unknown argument --skip-doctor" in proc.stderr


# --- summaries -----------------------------------------------------------------------------


def _fake_run(tmp_path: Path, pb, name: str, scores: list[float]) -> Path:
    d = tmp_path / "runs" / name
    d.mkdir(parents=True)
    run = {
        "setting": name,
        "scale": "cpu",
        "kind": "learn" if name.startswith("learn") else "bench",
        "steps": len(scores),
        "assets": {"params": 494032768},
        "composed": {"environment": {"OLDGPU_ATTN_IMPLEMENTATION": "sdpa"}, "plan": None},
        "argv": ["-m", "verl.trainer.main_ppo", "data.train_batch_size=4"],
        "env": {},
    }
    steps = [
        {
            "step": i + 1,
            "timing_s/step": 2.0 + (1.0 if i == 0 else 0.0),
            "timing_s/gen": 1.0,
            "perf/throughput": 100.0 * (i + 1),
            "perf/max_memory_reserved_gb": 3.0 + i,
            "perf/max_memory_allocated_gb": 2.0,
            "critic/score/mean": s,
        }
        for i, s in enumerate(scores)
    ]
    (d / "run.json").write_text(json.dumps(run))
    (d / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (d / "guard.jsonl").write_text(json.dumps({"event": "armed", "pid": 7}) + "\n")
    (d / "train.log").write_text("log\n")
    result = pb.report.summarize(run, steps, d)
    result.update(rc=0, timed_out=False, wall_s=30.0, first_step_wall_s=20.0)
    (d / "result.json").write_text(json.dumps(result))
    return d


def test_summaries_time_steps_from_2_and_judge_learning(pb, tmp_path) -> None:
    _fake_run(tmp_path, pb, "a", [0.0, 0.0, 0.0])
    _fake_run(tmp_path, pb, "learn", [0.1 + 0.01 * i for i in range(20)])
    a = json.loads((tmp_path / "runs" / "a" / "result.json").read_text())
    assert a["steps_timed"] == [2, 3]
    assert a["s_per_step"] == 2.0 and a["tokens_per_s"] == 250.0
    assert a["peak_reserved_gb"] == 5.0 and a["guard_ok"]
    learn = json.loads((tmp_path / "runs" / "learn" / "result.json").read_text())
    assert learn["learned"] and learn["score_slope_per_step"] == pytest.approx(0.01)
    files = pb.report.export(tmp_path / "runs", tmp_path / "out")
    assert len(files) <= 8  # the device tool returns 8 files at most
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "| a | ok | 3 (2-3) | 250.00 |" in table and "LEARNED" in table
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(doc["runs"]["learn"]["steps"]) == 20
    with tarfile.open(tmp_path / "out" / "logs.tar.xz") as tar:
        assert sorted(tar.getnames()) == [
            "a/guard.jsonl",
            "a/train.log",
            "learn/guard.jsonl",
            "learn/train.log",
        ]


def test_merge_calls_rebuilds_and_compares(pb, tmp_path) -> None:
    _fake_run(tmp_path, pb, "a", [0.0, 0.0, 0.0])
    pb.report.export(tmp_path / "runs", tmp_path / "call1")
    (tmp_path / "runs" / "a").rename(tmp_path / "old-a")
    _fake_run(tmp_path, pb, "b", [0.0, 0.0, 0.0, 0.0])
    _fake_run(tmp_path, pb, "grpo", [0.0, 0.0, 0.0, 0.0, 0.0])
    pb.report.export(tmp_path / "runs", tmp_path / "call2")
    table = pb.report.merge_calls(
        [tmp_path / "call1" / "bench.json", tmp_path / "call2" / "bench.json"],
        tmp_path / "merged",
    )
    assert "| a | ok |" in table and "| b | ok | 4 (2-4) | 300.00 |" in table
    assert "| 1.20x | 1.00x |" in table  # b's tokens/s over a's, over its own
    assert "| grpo | ok | 5 (2-5) | 350.00 |" in table and "| 1.40x | 1.17x |" in table


def test_the_projection_follows_the_recipe(pb) -> None:
    config = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864,
              "vocab_size": 151936}  # fmt: skip
    base = ["data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "critic.model.enable_gradient_checkpointing=True"]  # fmt: skip

    def proj(*extra: str, response_logits: bool = False) -> dict:
        run = {"assets": {"config": config, "params": 494032768}, "argv": [*base, *extra]}
        run["response_logits"] = response_logits
        return pb.report.project(run, {"gen_s": 10.0}, pb.report.P40)

    ppo = proj()
    grpo = proj("algorithm.adv_estimator=grpo")
    lora = proj("algorithm.adv_estimator=grpo", "actor_rollout_ref.model.lora_rank=32")
    # PPO: log-prob, ref, values; actor and critic updates with recompute: 3 + 4 + 4.
    assert ppo["forwards_per_sequence"] == 11
    assert grpo["forwards_per_sequence"] == 6  # no values, no critic update
    assert lora["forwards_per_sequence"] == 5  # no weight gradients for the frozen base
    assert lora["trained_params"] == 32 * 24 * (2 * 1792 + 2 * (896 + 128) + 3 * (896 + 4864))
    assert ppo["s_per_step"] > grpo["s_per_step"] > lora["s_per_step"]
    # The logits patch set: the actor's 6 forwards (log-prob, ref, update 3 + recompute)
    # skip the lm_head over the prompt's 255 positions of 512; the critic's 5 do not.
    kept = proj(response_logits=True)
    saved = 6 * 2 * 151936 * 896 * 255 * 256 / (pb.report.P40["fp32_tflops"] * 1e12 * 0.7)
    assert ppo["compute_s"] - kept["compute_s"] == pytest.approx(saved, abs=0.02)


def test_reward_digits() -> None:
    spec = importlib.util.spec_from_file_location("reward", ROOT / "bench" / "reward_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score("openai/gsm8k", "a1 b2", "3") == 0.5
    assert module.compute_score("openai/gsm8k", "   ", "3") == 0.0


def test_memory_phases_merges_each_process_last_maxima(pb):
    def ev(pid, peaks):
        return {"event": "memory-phases", "pid": pid, "peaks": peaks}

    a = {"allocated_mib": 100.0, "reserved_mib": 120.0}
    b = {"allocated_mib": 90.0, "reserved_mib": 200.0}
    events = [
        ev(1, {"actor_update/backward": {"allocated_mib": 50.0, "reserved_mib": 60.0}}),
        ev(1, {"actor_update/backward": a}),  # the running maxima: the last one counts
        ev(2, {"actor_update/backward": b, "generate/generate": a}),
        {"event": "armed", "pid": 3},
    ]
    assert pb.report.memory_phases(events) == {
        "actor_update/backward": {"allocated_mib": 100.0, "reserved_mib": 200.0},
        "generate/generate": a,
    }
    assert pb.report.memory_phases([{"event": "armed", "pid": 3}]) is None


def test_a_newer_releases_per_role_peaks_are_read(pb, tmp_path) -> None:
    """verl 0.9.0 reports the trainer's peaks as actor/perf/...: the summary finds them."""
    d = _fake_run(tmp_path, pb, "grpo-cmp-09", [0.0, 0.0, 0.0])
    run = json.loads((d / "run.json").read_text())
    steps = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    for s in steps:
        s["actor/perf/max_memory_reserved_gb"] = s.pop("perf/max_memory_reserved_gb")
        s["actor/perf/max_memory_allocated_gb"] = s.pop("perf/max_memory_allocated_gb")
    result = pb.report.summarize(run, steps, d)
    assert (result["peak_reserved_gb"], result["peak_allocated_gb"]) == (5.0, 2.0)


def test_the_checkpoint_record_judges_completeness_as_the_start_script(pb, tmp_path) -> None:
    root = tmp_path / "checkpoints"
    assert pb.checkpoint_record(root) is None
    step = root / "global_step_3"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"x")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    record = pb.checkpoint_record(root)
    assert record["tracker"] == "3" and not record["complete"]  # no data.pt yet
    (step / "data.pt").write_bytes(b"x")
    record = pb.checkpoint_record(root)
    assert record["complete"] and record["actor_files"] == ["model_world_size_1_rank_0.pt"]
