"""bench/ppo_bench.py's pure parts: verl's console metrics, override merging, summaries."""

from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pb():
    spec = importlib.util.spec_from_file_location("ppo_bench", ROOT / "bench" / "ppo_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_verl_console_line(pb) -> None:
    # verl's LocalLogger: "step:N - key:pprint(value) - ...", behind Ray's actor prefix.
    line = (
        "(TaskRunner pid=4242) step:3 - timing_s/step:np.float64(6.25) - "
        "perf/throughput:77.5 - perf/max_memory_reserved_gb:17.75 - "
        "critic/score/mean:np.float32(0.125) - training/global_step:3 - response_length/mean:256.0"
    )
    m = pb.parse_step(line)
    assert m == {
        "step": 3,
        "timing_s/step": 6.25,
        "perf/throughput": 77.5,
        "perf/max_memory_reserved_gb": 17.75,
        "critic/score/mean": 0.125,
        "training/global_step": 3.0,
        "response_length/mean": 256.0,
    }
    assert pb.parse_step("Training Progress: 10%") is None
    assert pb.parse_value("nan") != pb.parse_value("nan")  # a float nan
    assert pb.parse_value("tensor(2.5000)") == 2.5


def test_merge_and_ops_steps(pb) -> None:
    merged = pb.merge(
        ["data.train_batch_size=1", "trainer.n_gpus_per_node=8"],
        ["+actor_rollout_ref.ref.fsdp_config.model_dtype=fp32", "trainer.n_gpus_per_node=1"],
        ["data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=64"],
    )
    assert merged == [
        "+actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
        "trainer.n_gpus_per_node=1",
        "data.train_batch_size=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    ]
    assert pb.ops_steps(merged) == 8  # 4 actor + 4 critic optimizer steps
    assert pb.ops_steps(["data.train_batch_size=1"]) == 2


def _fake_run(tmp_path: Path, pb, name: str, scores: list[float]) -> Path:
    d = tmp_path / "runs" / name
    d.mkdir(parents=True)
    run = {
        "setting": name,
        "kind": "learn" if name == "learn" else "bench",
        "tiny": False,
        "cpu": True,
        "steps": len(scores),
        "attn_implementation": "sdpa",
        "assets": {"params": 494032768},
        "planner": None,
        "argv": ["python", "-m", "verl.trainer.main_ppo", "data.train_batch_size=4"],
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
    result = pb.summarize(run, steps, d)
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
    files = pb.export(tmp_path / "runs", tmp_path / "out")
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
    pb.export(tmp_path / "runs", tmp_path / "call1")
    (tmp_path / "runs" / "a").rename(tmp_path / "old-a")
    _fake_run(tmp_path, pb, "b", [0.0, 0.0, 0.0, 0.0])
    pb.export(tmp_path / "runs", tmp_path / "call2")
    table = pb.merge_calls(
        [tmp_path / "call1" / "bench.json", tmp_path / "call2" / "bench.json"],
        tmp_path / "merged",
    )
    assert "| a | ok |" in table and "| b | ok | 4 (2-4) | 300.00 |" in table
    assert "| 1.20x |" in table  # b's tokens/s over a's


def test_reward_digits() -> None:
    spec = importlib.util.spec_from_file_location("reward", ROOT / "bench" / "reward_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score("openai/gsm8k", "a1 b2", "3") == 0.5
    assert module.compute_score("openai/gsm8k", "   ", "3") == 0.0
