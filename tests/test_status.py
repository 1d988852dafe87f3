"""``oldgpu status``: real TensorBoard event files, a fake systemctl, a fake state dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from oldgpu import cli, jobs, status
from oldgpu.output import EngineError

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests/data/status"
SYSTEM_PYTHON = Path("/usr/bin/python3")
T0 = 1_750_000_000.0  # wall time of step 0, when a test controls them


def metrics_for(step: int, *, kl_keys=("actor/kl_loss", "actor/ppo_kl"), extra=None) -> dict:
    """One step's metrics under verl 0.5.0's names (a subset of what it logs)."""
    out = {
        "training/global_step": step,
        "training/epoch": 0,
        "critic/score/mean": 0.1 * step,
        "critic/rewards/mean": 0.1 * step - 0.01,
        "actor/pg_loss": -0.02 * step,
        "critic/vf_loss": 1.0 / step,
        "actor/entropy": 0.5,
        "perf/throughput": 100.0 + step,
        "timing_s/step": 60.0,
        "response_length/mean": 40.0 + step,
    }
    for key in kl_keys:
        out[key] = 0.001 * step
    out.update(extra or {})
    return out


def write_events(
    tb_dir: Path,
    steps,
    *,
    step_seconds: float | None = 60.0,
    start: float = T0,
    metrics=metrics_for,
    **kw,
) -> None:
    """As verl's ``_TensorboardAdapter``: one SummaryWriter, ``add_scalar`` per key per
    step; with ``step_seconds`` the wall times are ours (``start + step * step_seconds``)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb_dir))
    for step in steps:
        data = metrics(step, **kw)
        wall = None if step_seconds is None else start + step * step_seconds
        for key in data:
            writer.add_scalar(key, data[key], step, walltime=wall)
        if step_seconds is None:
            time.sleep(0.02)
    writer.close()


def make_job(tmp_path: Path, name: str = "gsm8k", total_steps: int = 100) -> dict[str, Path]:
    """An env file under a jobs dir, its state dir and a log dir, as on a host."""
    jobs_dir, state_root, log_dir = tmp_path / "etc", tmp_path / "state", tmp_path / "log"
    for d in (jobs_dir, state_root / name, log_dir):
        d.mkdir(parents=True, exist_ok=True)
    job = jobs.job_from_mapping(
        {
            "name": name,
            "model_path": "/srv/models/Qwen2.5-0.5B-Instruct",
            "train_files": "/srv/data/gsm8k/train.parquet",
            "val_files": "/srv/data/gsm8k/test.parquet",
            "total_steps": total_steps,
        }
    )
    (jobs_dir / f"{name}.env").write_text(jobs.render_env(job))
    (log_dir / f"{name}.log").write_text("verl-train: job starting\n")
    return {
        "jobs_dir": jobs_dir,
        "state_root": state_root,
        "log_dir": log_dir,
        "state": state_root / name,
        "tensorboard": state_root / name / "tensorboard",
        "checkpoints": state_root / name / "checkpoints",
    }


def save_checkpoint(checkpoints: Path, step: int, *, marker: bool = True) -> Path:
    """What verl's ``_save_checkpoint`` leaves: ``global_step_N/{actor,critic}``, the marker."""
    folder = checkpoints / f"global_step_{step}"
    for part in ("actor", "critic"):
        (folder / part).mkdir(parents=True, exist_ok=True)
    (folder / "data.pt").write_bytes(b"\0" * 16)
    if marker:
        (checkpoints / status.CHECKPOINT_MARKER).write_text(str(step))
    return folder


class FakeSystemctl:
    """Answers ``systemctl show`` with a recorded output and remembers what it was asked."""

    def __init__(self, recording: str = "active.show") -> None:
        self.text = (DATA / recording).read_text()
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(list(argv))
        return self.text


def collect(where: dict[str, Path], names=(), systemctl=None):
    return status.collect(
        names,
        jobs_dir=where["jobs_dir"],
        state_root=where["state_root"],
        log_dir=where["log_dir"],
        systemctl=systemctl or FakeSystemctl(),
    )


@pytest.fixture
def host(tmp_path):
    where = make_job(tmp_path)
    write_events(where["tensorboard"], range(1, 6))
    save_checkpoint(where["checkpoints"], 5)
    return where


# --- the unit -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recording", "summary", "state"),
    [
        ("active.show", "active (running)", "active"),
        ("failed.show", "failed (exit-code, status 1, 3 restarts)", "failed"),
        (
            "auto-restart.show",
            "activating (auto-restart, exit-code, status 1, 1 restart)",
            "activating",
        ),
        ("not-found.show", "not installed", "inactive"),
    ],
)
def test_unit_state_from_recorded_show(recording, summary, state):
    fake = FakeSystemctl(recording)
    doc = status.unit_state("gsm8k", fake)
    assert doc["summary"] == summary
    assert doc["state"] == state
    (argv,) = fake.calls
    assert argv[0] == "show" and argv[-1] == "verl-train@gsm8k.service"
    (prop,) = [a for a in argv if a.startswith("--property=")]
    assert set(prop.split("=", 1)[1].split(",")) >= {
        "ActiveState",
        "SubState",
        "Result",
        "ExecMainStatus",
        "NRestarts",
        "ActiveEnterTimestamp",
        "UnitFileState",
    }


def test_unit_fields_typed():
    doc = status.unit_state("gsm8k", FakeSystemctl("failed.show"))
    assert doc["exit_status"] == 1 and doc["restarts"] == 3
    assert doc["result"] == "exit-code" and doc["enabled"] == "enabled"
    assert doc["active_since"] == "Tue 2025-06-10 13:41:17 UTC"
    assert status.unit_state("x", FakeSystemctl("not-found.show"))["active_since"] is None


def test_no_systemctl_is_unknown(host, monkeypatch):
    def absent(argv):
        raise FileNotFoundError("systemctl")

    def no_systemd(argv):
        raise status.SystemctlError("System has not been booted with systemd as init system")

    assert status.unit_state("gsm8k", absent)["summary"] == "unknown"
    doc = status.unit_state("gsm8k", no_systemd)
    assert doc["state"] == "unknown" and "not been booted" in doc["error"]
    # The default runner on a host without systemctl at all.
    monkeypatch.setenv("PATH", str(host["state"]))
    (job,) = status.collect(
        (), jobs_dir=host["jobs_dir"], state_root=host["state_root"], log_dir=host["log_dir"]
    )
    assert job["unit"] == {
        "unit": "verl-train@gsm8k.service",
        "state": "unknown",
        "summary": "unknown",
        "error": "no systemctl",
    }
    assert job["metrics"]["last_step"] == 5  # the rest is still there


# --- metrics ----------------------------------------------------------------------


def test_status_values(host):
    (job,) = collect(host)
    m = job["metrics"]
    assert job["name"] == "gsm8k" and job["total_steps"] == 100
    assert m["last_step"] == 5 and m["event_files"] == 1 and m["runs"] == 1
    assert m["steps_per_hour"] == pytest.approx(60.0)  # one step a minute
    assert m["eta_hours"] == pytest.approx(95 / 60, abs=0.01)
    assert m["step_seconds"] == pytest.approx(60.0)
    assert m["last_step_at"] == datetime.fromtimestamp(T0 + 300, timezone.utc).isoformat(
        timespec="seconds"
    )
    assert m["reward"]["key"] == "critic/score/mean"
    assert m["reward"]["value"] == pytest.approx(0.5) and m["reward"]["step"] == 5
    assert m["kl"]["key"] == "actor/kl_loss" and m["kl"]["value"] == pytest.approx(0.005)
    ckpt = job["checkpoint"]
    assert ckpt["step"] == 5 and ckpt["exists"] and ckpt["recorded"]
    assert ckpt["path"] == str(host["checkpoints"] / "global_step_5")
    mtime = (host["checkpoints"] / "global_step_5").stat().st_mtime
    assert datetime.fromisoformat(ckpt["mtime"]).timestamp() == pytest.approx(mtime, abs=1)
    assert job["log"] == {"path": str(host["log_dir"] / "gsm8k.log"), "exists": True}
    assert job["unit"]["summary"] == "active (running)"
    assert job["notes"] == []


def test_rate_uses_recent_steps(tmp_path):
    where = make_job(tmp_path)
    # 20 slow steps then 10 fast ones: the rate is the recent one.
    with_slow = [(s, T0 + s * 600.0) for s in range(1, 21)]
    fast = [(s, with_slow[-1][1] + (s - 20) * 30.0) for s in range(21, 31)]
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(where["tensorboard"]))
    for step, wall in with_slow + fast:
        writer.add_scalar("training/global_step", step, step, walltime=wall)
    writer.close()
    (job,) = collect(where)
    # The last 10 intervals: 10 steps, of 30 s each.
    assert job["metrics"]["steps_per_hour"] == pytest.approx(120.0)
    assert job["metrics"]["reward"] is None and job["metrics"]["kl"] is None


def test_real_wall_times_give_a_positive_rate(tmp_path):
    where = make_job(tmp_path)
    write_events(where["tensorboard"], range(1, 6), step_seconds=None)  # wall times: now
    (job,) = collect(where)
    assert job["metrics"]["last_step"] == 5
    assert job["metrics"]["steps_per_hour"] > 0


@pytest.mark.parametrize(
    ("kl_keys", "chosen"),
    [
        (("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"), "actor/kl_loss"),
        (("actor/reward_kl_penalty", "actor/ppo_kl"), "actor/reward_kl_penalty"),
        (("actor/ppo_kl",), "actor/ppo_kl"),
        ((), None),
    ],
)
def test_kl_key_chosen(tmp_path, kl_keys, chosen):
    where = make_job(tmp_path)
    write_events(where["tensorboard"], range(1, 4), kl_keys=kl_keys)
    (job,) = collect(where)
    kl = job["metrics"]["kl"]
    assert (kl["key"] if kl else None) == chosen
    text = status.render_text([job])
    assert (f"({chosen.rsplit('/', 1)[1]})" in text) if chosen else ("  -  " in text)


def test_reward_falls_back_to_rewards_mean(tmp_path):
    def no_score(step, **kw):
        out = metrics_for(step, **kw)
        del out["critic/score/mean"]
        return out

    where = make_job(tmp_path)
    write_events(where["tensorboard"], range(1, 4), metrics=no_score)
    (job,) = collect(where)
    assert job["metrics"]["reward"]["key"] == "critic/rewards/mean"
    assert job["metrics"]["reward"]["value"] == pytest.approx(0.29)


def test_resumed_run_replaces_the_steps_it_wrote_again(tmp_path):
    where = make_job(tmp_path)
    # Run 1 reaches step 5 and dies; the checkpoint was at 3; run 2 redoes 4.. at 30 s a step.
    write_events(where["tensorboard"], range(1, 6))
    write_events(
        where["tensorboard"],
        range(4, 8),
        step_seconds=30.0,
        start=T0 + 3600,
        extra={"critic/score/mean": 0.9},
    )
    scalars = status.read_scalars(where["tensorboard"])
    score = scalars["critic/score/mean"]
    assert [p.step for p in score] == [1, 2, 3, 4, 5, 6, 7]
    assert [round(p.value, 3) for p in score] == [0.1, 0.2, 0.3, 0.9, 0.9, 0.9, 0.9]
    (job,) = collect(where)
    m = job["metrics"]
    assert m["event_files"] == 2 and m["runs"] == 2 and m["last_step"] == 7
    assert m["steps_per_hour"] == pytest.approx(120.0)  # run 2's only, not the gap


def test_event_file_without_scalars_yet(tmp_path):
    """verl opens its writer at start; the first scalars come after step 1."""
    from torch.utils.tensorboard import SummaryWriter

    where = make_job(tmp_path)
    SummaryWriter(str(where["tensorboard"])).close()
    (job,) = collect(where)
    assert job["metrics"]["event_files"] == 1 and job["metrics"]["last_step"] is None
    assert any("no steps logged" in n for n in job["notes"])


# --- checkpoints ----------------------------------------------------------------------


def test_checkpoint_marker_and_dirs(tmp_path):
    ckpts = tmp_path / "checkpoints"
    assert status.last_checkpoint(ckpts) is None
    save_checkpoint(ckpts, 3, marker=False)
    save_checkpoint(ckpts, 12, marker=False)
    doc = status.last_checkpoint(ckpts)
    assert doc["step"] == 12 and not doc["recorded"] and doc["exists"]
    (ckpts / status.CHECKPOINT_MARKER).write_text("3\n")  # the marker wins
    assert status.last_checkpoint(ckpts)["step"] == 3
    (ckpts / status.CHECKPOINT_MARKER).write_text("20")  # pruned or not there
    doc = status.last_checkpoint(ckpts)
    assert doc["step"] == 20 and not doc["exists"] and doc["mtime"] is None
    assert (
        "20 (missing)"
        in status.row(
            {
                "name": "j",
                "unit": {"summary": "unknown"},
                "total_steps": None,
                "metrics": status.summarize({}, None),
                "checkpoint": doc,
                "log": {"path": "/var/log/verl/j.log"},
            }
        )["CHECKPOINT"]
    )


# --- jobs and text -------------------------------------------------------------------


def test_text_table(host, tmp_path):
    other = make_job(tmp_path, "math", total_steps=40)  # same dirs: a second job, no metrics
    assert other["jobs_dir"] == host["jobs_dir"]
    docs = collect(host, systemctl=FakeSystemctl("failed.show"))
    assert [d["name"] for d in docs] == ["gsm8k", "math"]
    text = status.render_text(docs)
    lines = text.splitlines()
    assert lines[0].split() == [
        "JOB",
        "UNIT",
        "STEP",
        "STEPS/H",
        "REWARD",
        "KL",
        "CHECKPOINT",
        "LOG",
    ]
    gsm8k = lines[1]
    for cell in ("gsm8k", "failed (exit-code, status 1, 3 restarts)", "5/100", "60.0", "0.5"):
        assert cell in gsm8k
    assert "0.005 (kl_loss)" in gsm8k and "5 @ " in gsm8k
    assert gsm8k.endswith(str(host["log_dir"] / "gsm8k.log"))
    assert lines[2].startswith("math") and " -/40 " in lines[2]
    assert any(line.startswith("math: metrics: no steps logged") for line in lines)
    # Columns line up.
    assert lines[1].index("5/100") == lines[0].index("STEP") == lines[2].index("-/40")


def test_named_jobs_and_unknown(host):
    assert [d["name"] for d in collect(host, ["gsm8k"])] == ["gsm8k"]
    with pytest.raises(EngineError) as err:
        collect(host, ["nope"])
    assert err.value.name == "job-unknown"
    with pytest.raises(EngineError):
        collect(host, ["../etc"])


def test_job_with_broken_settings_still_shows(host):
    (host["jobs_dir"] / "gsm8k.env").write_text("VERL_JOB_NAME='gsm8k'\n")  # the rest gone
    (job,) = collect(host, ["gsm8k"])
    assert job["total_steps"] is None and job["metrics"]["last_step"] == 5
    assert any(n.startswith("settings: ") for n in job["notes"])
    assert "5/?" in status.render_text([job])


def test_no_jobs(tmp_path):
    empty = tmp_path / "jobs"
    empty.mkdir()
    assert status.collect((), jobs_dir=empty, state_root=tmp_path, log_dir=tmp_path) == []
    assert status.render_text([], empty) == f"no jobs in {empty}"


def test_cli_json(host, monkeypatch, capsys):
    fake = FakeSystemctl("active.show")
    monkeypatch.setattr(status, "run_systemctl", fake)
    argv = ["status", "--json", "--jobs-dir", str(host["jobs_dir"])]
    argv += ["--state-dir", str(host["state_root"]), "--log-dir", str(host["log_dir"])]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    (job,) = doc["jobs"]
    assert job["metrics"]["last_step"] == 5 and job["total_steps"] == 100
    assert job["metrics"]["kl"]["key"] == "actor/kl_loss"
    assert job["unit"]["state"] == "active" and fake.calls


# --- the system python -------------------------------------------------------------


def _system_python_without_tensorboard() -> Path:
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"no {SYSTEM_PYTHON}")
    probe = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import tensorboard"], capture_output=True, check=False
    )
    if probe.returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has tensorboard")
    return SYSTEM_PYTHON


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OLDGPU_VENV_PYTHON"}
    return {**env, "PYTHONPATH": str(ROOT / "src"), **extra}


@pytest.mark.parametrize("command", ["status", "plot"])
def test_help_on_system_python(command):
    python = _system_python_without_tensorboard()
    proc = subprocess.run(
        [str(python), "-m", "oldgpu", command, "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"usage: oldgpu {command}" in proc.stdout and "--json" in proc.stdout


def test_system_python_runs_status_in_the_venv(host):
    python = _system_python_without_tensorboard()
    if os.path.realpath(sys.executable) == os.path.realpath(python):
        pytest.skip("the tests run on the system python")
    argv = [str(python), "-m", "oldgpu", "status", "--json", "gsm8k"]
    argv += ["--jobs-dir", str(host["jobs_dir"]), "--state-dir", str(host["state_root"])]
    argv += ["--log-dir", str(host["log_dir"])]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=_env(OLDGPU_VENV_PYTHON=sys.executable),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (job,) = json.loads(proc.stdout)["jobs"]
    assert job["metrics"]["last_step"] == 5 and job["metrics"]["steps_per_hour"] == 60.0
    # And without a venv to go to, a named error rather than a traceback.
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=_env(OLDGPU_VENV_PYTHON=str(host["state"] / "no-python")),
        check=False,
    )
    assert proc.returncode == 2 and "python-package-missing" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_cluster_job_shows_its_cluster(tmp_path):
    where = make_job(tmp_path, "dist")
    job = jobs.job_from_mapping(
        {
            "name": "dist",
            "model_path": "/srv/m",
            "train_files": "/srv/t.parquet",
            "val_files": "/srv/v.parquet",
            "total_steps": 10,
            "cluster": "ray",
            "cluster_address": "10.0.0.1:6379",
            "cluster_nodes": 3,
        }
    )
    (where["jobs_dir"] / "dist.env").write_text(jobs.render_env(job))
    (doc,) = collect(where)
    assert doc["cluster"] == {
        "name": "ray",
        "address": "10.0.0.1:6379",
        "nodes": 3,
        "nnodes": None,
        "n_gpus_per_node": None,
    }
    # The start wrote its plan: the shape the live cluster gave.
    plan = {"cluster": {"address": "10.0.0.1:6379", "nnodes": 2, "n_gpus_per_node": 1}}
    (where["state"] / "plan.json").write_text(json.dumps(plan))
    (doc,) = collect(where)
    assert (doc["cluster"]["nnodes"], doc["cluster"]["n_gpus_per_node"]) == (2, 1)
    lines = status.render_text([doc]).splitlines()
    assert lines[1].startswith("dist@ray ")
    assert any("cluster ray at 10.0.0.1:6379 (3 host(s) in the inventory): 2 node(s) x 1" in x
               for x in lines)  # fmt: skip
    # A job on this host only has no cluster.
    (local,) = collect(make_job(tmp_path / "b"))
    assert local["cluster"] is None
