"""What a job's start would refuse and its settings already tell is refused by `oldgpu job
env`, which the verl_jobs role's preflight and the NixOS module call (issue 34, item 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import job_spec as spec

from oldgpu import cli, jobs
from oldgpu.jobs import unit

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "files" / "systemd" / "verl-train@.service"
SRV = Path("/srv/job")  # a path the unit sees


def job_env(capsys, tmp_path, values, *flags) -> tuple[int, dict]:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(values))
    code = cli.main(["job", "env", "--json", *flags, str(path)])
    return code, json.loads(capsys.readouterr().out)


def test_the_engine_reads_the_units_own_file():
    assert unit.unit_text() == UNIT.read_text()
    assert unit.CONFIG_INVALID == jobs.CONFIG_INVALID
    hidden = unit.hidden()
    assert hidden == {
        "/home": "ProtectHome=yes",
        "/root": "ProtectHome=yes",
        "/run/user": "ProtectHome=yes",
        "/tmp": "PrivateTmp=yes",
        "/var/tmp": "PrivateTmp=yes",
    }


def test_what_is_hidden_follows_the_unit_file():
    text = UNIT.read_text()
    assert "/tmp" not in unit.hidden(text.replace("PrivateTmp=yes", "PrivateTmp=no"))
    assert "/home" not in unit.hidden(text.replace("ProtectHome=yes", "ProtectHome=read-only"))
    more = unit.hidden(text + "\n[Service]\nInaccessiblePaths=-/mnt/secret /data/private/\n")
    assert more["/mnt/secret"] == "InaccessiblePaths=/mnt/secret"
    assert more["/data/private"].startswith("InaccessiblePaths=")


@pytest.mark.parametrize(
    ("field", "path", "hidden_by"),
    [
        ("model_path", "/tmp/qwen", "PrivateTmp=yes"),
        ("train_files", "/var/tmp/d/train.parquet", "PrivateTmp=yes"),
        ("val_files", "/home/alice/test.parquet", "ProtectHome=yes"),
        ("critic_model_path", "/root/critic", "ProtectHome=yes"),
    ],
)
def test_a_path_the_unit_cannot_see_is_refused_at_job_env(capsys, tmp_path, field, path, hidden_by):
    code, doc = job_env(capsys, tmp_path, spec(SRV, **{field: path}))
    assert code == jobs.CONFIG_INVALID
    assert doc["error"] == "job-path-protected"
    assert doc["message"].startswith(f"{field}: ") and hidden_by in doc["message"]
    # a run outside the unit (a benchmark) names it, and is rendered
    code, doc = job_env(capsys, tmp_path, spec(SRV, **{field: path}), "--outside-unit")
    assert code == 0, doc


def test_a_path_beside_a_hidden_one_is_accepted(capsys, tmp_path):
    code, doc = job_env(capsys, tmp_path, spec(SRV, model_path="/tmpdata/qwen"))
    assert code == 0, doc
    assert "/tmpdata/qwen" in doc["env"]


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"cluster": "lab", "cluster_address": "head:6379", "cluster_nodes": 2}, "one host"),
        ({"rollout": "vllm", "profile": "ampere"}, "no vLLM"),
        ({"profile": "ampere"}, "no vLLM"),  # the forced profile's rollout is vLLM
    ],
)
def test_what_the_newer_release_cannot_run_is_refused_at_job_env(capsys, tmp_path, extra, why):
    """Not only when the unit starts (a cluster job: after exit 5 and systemd's retries
    while the head is down)."""
    code, doc = job_env(capsys, tmp_path, spec(SRV, verl_version="0.9.0", **extra))
    assert code == jobs.CONFIG_INVALID
    assert doc["error"] == "verl-version-unsupported"
    assert why in doc["message"]
    code, doc = job_env(capsys, tmp_path, spec(SRV, **extra))  # 0.5.0 runs them
    assert code == 0, doc


def test_the_roles_preflight_asks_job_env_with_the_units_checks():
    tasks = yaml.safe_load((ROOT / "roles/verl_jobs/tasks/preflight.yml").read_text())
    argv = [
        t["ansible.builtin.command"]["argv"]
        for t in tasks
        if "ansible.builtin.command" in t and "argv" in t["ansible.builtin.command"]
    ]
    env_calls = [a for a in argv if a[-5:-2] == ["job", "env", "--json"] or "env" in a]
    assert env_calls, argv
    for a in env_calls:
        assert "--outside-unit" not in a


# -- smaller: secrets, typos --------------------------------------------------------------


def test_the_roles_secrets_are_checked_and_never_rendered(capsys, tmp_path):
    """docs/jobs.md's job carries `secrets:` (the role writes them to <name>.secrets.env)."""
    secret = "s3cr3t-value"
    code, doc = job_env(capsys, tmp_path, spec(SRV, secrets={"WANDB_API_KEY": secret}))
    assert code == 0, doc
    assert secret not in doc["env"] and "WANDB" not in doc["env"]
    code, doc = job_env(capsys, tmp_path, spec(SRV, secrets={"WANDB-KEY": secret}))
    assert (code, doc["error"]) == (jobs.CONFIG_INVALID, "job-secrets-invalid")
    assert secret not in json.dumps(doc)
    code, doc = job_env(capsys, tmp_path, spec(SRV, secrets={"K": "it's"}))
    assert (code, doc["error"]) == (jobs.CONFIG_INVALID, "job-secrets-invalid")


def test_a_mistyped_setting_gets_a_did_you_mean(capsys, tmp_path):
    code, doc = job_env(capsys, tmp_path, spec(SRV, rollout_nn=2, modle_path="/srv/m"))
    assert code == jobs.CONFIG_INVALID
    assert "rollout_nn (did you mean rollout_n?)" in doc["message"]
    assert "modle_path (did you mean model_path?)" in doc["message"]
    code, doc = job_env(capsys, tmp_path, spec(SRV, zzz=1))
    assert "zzz" in doc["message"] and "did you mean" not in doc["message"]
