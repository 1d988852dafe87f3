"""Bad role and job input, as a user would write it, against the converged host.

One ansible-playbook run, one play per case: each play includes a role with the
bad variables inside block/rescue and reports the task that stopped it and its
message. Every case must be stopped (rescued) in its role's preflight with a
message that names the variable or the job, the whole run must change nothing,
and a --check run of site.yml afterwards must find the host as converged.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from playbook import playbook
from waiting import wait_for

HOST = "jobs-host"
SECRET = "sekrit-value-4c1d"
JOB = {
    "name": "bad",
    "model_path": "/var/lib/verl/smoke/model",
    "train_files": "/var/lib/verl/smoke/data/train.parquet",
    "val_files": "/var/lib/verl/smoke/data/test.parquet",
    "total_steps": 2,
    "profile": "cpu",
}


def job(**changes):
    out = {**JOB, **changes}
    return {k: v for k, v in out.items() if v is not None}


# (case, role, variables, what the message must name)
CASES = [
    (
        "job name with a space",
        "verl_jobs",
        {"verl_jobs": [job(name="Bad Name")]},
        ["job Bad Name", "name:"],
    ),
    (
        "job name not a unit instance",
        "verl_jobs",
        {"verl_jobs": [job(name="smoke.service")]},
        ["job smoke.service"],
    ),
    (
        "relative data path",
        "verl_jobs",
        {"verl_jobs": [job(train_files="data/train.parquet")]},
        ["train_files", "absolute"],
    ),
    (
        "relative model path",
        "verl_jobs",
        {"verl_jobs": [job(model_path="models/qwen")]},
        ["model_path", "absolute"],
    ),
    ("missing model path", "verl_jobs", {"verl_jobs": [job(model_path=None)]}, ["model_path"]),
    (
        "total_steps not a number",
        "verl_jobs",
        {"verl_jobs": [job(total_steps="many")]},
        ["total_steps"],
    ),
    ("total_steps 0", "verl_jobs", {"verl_jobs": [job(total_steps=0)]}, ["total_steps", "job bad"]),
    ("save_freq 0", "verl_jobs", {"verl_jobs": [job(save_freq=0)]}, ["save_freq", "job bad"]),
    (
        "unknown profile",
        "verl_jobs",
        {"verl_jobs": [job(profile="quantum")]},
        ["profile", "job bad"],
    ),
    (
        "malformed profile name",
        "verl_jobs",
        {"verl_jobs": [job(profile="pascal-abc")]},
        ["profile", "job bad"],
    ),
    (
        "profile with a foreign compute capability",
        "verl_jobs",
        {"verl_jobs": [job(profile="pascal-9.9")]},
        ["profile", "job bad"],
    ),
    (
        "unknown algorithm",
        "verl_jobs",
        {"verl_jobs": [job(algorithm="dpo")]},
        ["algorithm", "job bad"],
    ),
    (
        "grpo with one response per prompt",
        "verl_jobs",
        {"verl_jobs": [job(algorithm="grpo", rollout_n=1)]},
        ["rollout_n", "job bad"],
    ),
    ("gpus not a count", "verl_jobs", {"verl_jobs": [job(gpus="lots")]}, ["gpus", "job bad"]),
    (
        "devices not indices",
        "verl_jobs",
        {"verl_jobs": [job(devices=["x"])]},
        ["devices"],
    ),
    (
        "negative LoRA rank",
        "verl_jobs",
        {"verl_jobs": [job(lora_rank=-1)]},
        ["lora_rank", "job bad"],
    ),
    (
        "response_length 0",
        "verl_jobs",
        {"verl_jobs": [job(response_length=0)]},
        ["response_length", "job bad"],
    ),
    ("overrides a mapping", "verl_jobs", {"verl_jobs": [job(overrides={"a": 1})]}, ["overrides"]),
    (
        "misspelt setting",
        "verl_jobs",
        {"verl_jobs": [job(totl_steps=3)]},
        # The role's argument spec refuses it first, naming it among the supported ones;
        # `oldgpu job env` adds "did you mean total_steps" (tests/test_jobs.py).
        ["totl_steps", "total_steps"],
    ),
    ("enabled not a boolean", "verl_jobs", {"verl_jobs": [job(enabled="maybe")]}, ["enabled"]),
    (
        "model under /home (ProtectHome)",
        "verl_jobs",
        {"verl_jobs": [job(model_path="/home/alice/qwen")]},
        ["job-path-protected", "model_path"],
    ),
    (
        "data under /tmp (PrivateTmp)",
        "verl_jobs",
        {"verl_jobs": [job(train_files="/tmp/gsm8k/train.parquet")]},
        ["job-path-protected", "train_files", "PrivateTmp=yes"],
    ),
    ("two jobs with one name", "verl_jobs", {"verl_jobs": [job(), job()]}, ["verl-jobs-duplicate"]),
    ("verl_jobs not a list", "verl_jobs", {"verl_jobs": "smoke"}, ["verl_jobs"]),
    (
        "secret name not a variable",
        "verl_jobs",
        {"verl_jobs": [job(secrets={"WANDB-KEY": SECRET})]},
        ["verl-job-secrets-invalid", "job bad"],
    ),
    (
        "bad job that has secrets",
        "verl_jobs",
        {"verl_jobs": [job(name="Bad", secrets={"WANDB_API_KEY": SECRET})]},
        ["job Bad", "name:"],
    ),
    (
        "driver branch not a number",
        "nvidia_driver",
        {"nvidia_driver_branch": "latest"},
        ["nvidia_driver_branch"],
    ),
    (
        "unknown module flavour",
        "nvidia_driver",
        {"nvidia_driver_flavour": "closed"},
        ["nvidia_driver_flavour"],
    ),
    (
        "-open on Pascal",
        "nvidia_driver",
        {"nvidia_driver_arch": "pascal", "nvidia_driver_flavour": "open"},
        ["open-modules-unsupported"],
    ),
    (
        "branch the GPU cannot use",
        "nvidia_driver",
        {"nvidia_driver_arch": "kepler", "nvidia_driver_branch": 535},
        ["driver-branch-unsupported", "470"],
    ),
    (
        "unknown architecture",
        "nvidia_driver",
        {"nvidia_driver_arch": "quantum"},
        ["--arch", "quantum"],
    ),
    (
        "unknown driver source",
        "nvidia_driver",
        {"nvidia_driver_source": "ppa"},
        ["nvidia_driver_source"],
    ),
    (
        "Secure Boot on, no key",
        "nvidia_driver",
        {"fake_secure_boot": True},
        ["nvidia-secure-boot-unsigned", "mokutil --import"],
    ),
    (
        "Secure Boot on, key not on the host",
        "nvidia_driver",
        {
            "fake_secure_boot": True,
            "nvidia_driver_mok_key": "/etc/no/mok.key",
            "nvidia_driver_mok_cert": "/etc/no/mok.der",
        },
        ["nvidia_driver_mok_key"],
    ),
    (
        "unknown verl tag",
        "verl",
        {"verl_version": "v9.9.9"},
        ["verl-version-unsupported", "verl_version"],
    ),
    ("verl commit a branch name", "verl", {"verl_commit": "main"}, ["verl_commit"]),
    (
        "a model revision that is not one directory name",
        "verl_jobs",
        {"verl_jobs": [job(model_path=None, model="oldgpu/smoke-qwen2", model_revision="a/b")]},
        ["job-config-invalid", "job bad", "model"],
    ),
    (
        "a job's model by id from a mirror not given",
        "verl_jobs",
        {
            "verl_jobs": [job(model_path=None, model="oldgpu/smoke-qwen2")],
            "verl_jobs_assets_source": "mirror",
            "verl_jobs_assets_mirror_dir": "",
        },
        ["verl-jobs-assets-source-unset", "verl_jobs_assets_mirror_dir"],
    ),
    (
        "a job on a verl release the host does not carry",
        "verl_jobs",
        {"verl_jobs": [job(verl_version="0.9.0")], "verl_releases": []},
        ["job-verl-release-missing", "job bad", "verl_releases"],
    ),
    (
        "a verl release the pins do not know",
        "verl",
        {"verl_releases": ["0.9.0", "0.6.1"]},
        ["verl-version-unknown", "verl_releases", "0.6.1"],
    ),
    (
        "the default verl release as a newer one",
        "python_env",
        {"verl_releases": ["0.5.0"]},
        ["verl-version-unknown", "verl_releases", "always installed"],
    ),
    (
        "unknown torch variant",
        "python_env",
        {"python_env_variant": "cu999"},
        ["python_env_variant"],
    ),
    (
        "unpinned extra package",
        "python_env",
        {"python_env_extra_packages": ["flash-attn"]},
        ["python_env_extra_packages"],
    ),
]

FAKE_MOKUTIL = "/usr/local/sbin/mokutil"


def case_play(index: int, role: str, variables: dict) -> dict:
    variables = dict(variables)
    secure_boot = variables.pop("fake_secure_boot", False)
    tasks = []
    if secure_boot:
        # The test's own stand-in for a Secure Boot host (removed in the rescue).
        tasks.append({
            "name": "Fake a Secure Boot host",
            "ansible.builtin.copy": {"dest": FAKE_MOKUTIL, "mode": "0755",
                                     "content": "#!/bin/sh\necho 'SecureBoot enabled'\n"},
            "changed_when": False,
        })  # fmt: skip
    tasks.append(
        {
            "name": f"case {index}",
            "block": [
                {"ansible.builtin.include_role": {"name": role}},
                {
                    "name": "ACCEPTED",
                    "ansible.builtin.debug": {"msg": "the role accepted this input"},
                },
            ],
            "rescue": [
                {
                    "name": "REFUSED",
                    "ansible.builtin.debug": {
                        "msg": {
                            "task": "{{ ansible_failed_task.name }}",
                            "msg": "{{ ansible_failed_result.msg | default('') }}",
                            "items": "{{ ansible_failed_result.results | default([])"
                            " | selectattr('failed', 'defined') | selectattr('failed')"
                            " | map(attribute='msg') | list }}",
                        }
                    },
                }
            ],
            "always": [
                {
                    "name": "Remove the fake mokutil",
                    "ansible.builtin.file": {"path": FAKE_MOKUTIL, "state": "absent"},
                    "changed_when": False,
                }
            ]
            if secure_boot
            else [],
        }
    )
    return {
        "name": f"case {index}",
        "hosts": HOST,
        "become": True,
        "gather_facts": index == 0,
        "vars": variables,
        "tasks": tasks,
    }


@pytest.fixture(scope="module")
def refused(tmp_path_factory, pytestconfig):
    plays = [case_play(i, role, variables) for i, (_, role, variables, _) in enumerate(CASES)]
    path = tmp_path_factory.mktemp("bad") / "bad-input.yml"
    path.write_text(yaml.safe_dump(plays, sort_keys=False))
    mp = pytest.MonkeyPatch()
    mp.setenv("ANSIBLE_STDOUT_CALLBACK", "ansible.builtin.json")
    start = time.monotonic()
    try:
        run = playbook(playbook=str(path))
    finally:
        mp.undo()
    elapsed = time.monotonic() - start
    doc, _ = json.JSONDecoder().raw_decode(run.output[run.output.index("{") :])
    answers = {}
    for play in doc["plays"]:
        index = int(play["play"]["name"].split()[1])
        for task in play["tasks"]:
            result = task["hosts"].get(HOST, {})
            if task["task"]["name"] in ("REFUSED", "ACCEPTED"):
                answers[index] = (task["task"]["name"], result.get("msg"))
    print(f"bad input: {len(CASES)} cases in {elapsed:.0f} s")
    return run, doc, answers


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_bad_input_is_refused_in_preflight_naming_the_variable(refused, index):
    _, _, answers = refused
    name, role, _, expected = CASES[index]
    assert index in answers, f"{name}: neither refused nor accepted"
    verdict, answer = answers[index]
    assert verdict == "REFUSED", f"{name}: {role} accepted it"
    text = answer["msg"] + " " + " ".join(answer["items"])
    for word in expected:
        assert word in text, f"{name}: {word!r} not in {text!r}"
    # Stopped by the role's argument spec or its preflight, never later.
    preflight = ("Validat", "Check", "Stop", "Ask the engine", "Render")
    task = answer["task"].split(" : ")[-1]
    assert task.startswith(preflight) or "argument" in task, answer["task"]
    assert "Traceback" not in text


def test_bad_input_changed_nothing_and_leaked_no_secret(refused):
    run, doc, _ = refused
    stats = doc["stats"][HOST]
    assert stats["changed"] == 0, stats
    assert stats["failures"] == 0 and stats["rescued"] == len(CASES), stats
    assert SECRET not in run.output
    assert "Traceback" not in run.output


def test_check_run_afterwards_finds_the_host_converged(host, refused):
    run = playbook("--check")
    assert run.rc == 0, run.output[-3000:]
    assert run.recap(HOST)["changed"] == 0, run.output[-3000:]
    assert not host.file("/etc/verl/jobs/bad.env").exists
    assert not host.file(FAKE_MOKUTIL).exists


HOLD = (
    "systemd-run --unit={unit} --collect python3 -c "
    "\"import fcntl, time; f = open('/var/lib/dpkg/lock-frontend', 'a'); "
    'fcntl.lockf(f, fcntl.LOCK_EX); time.sleep({seconds})"'
)


def hold_dpkg_lock(host, unit, seconds):
    """Hold dpkg's lock as dpkg does (fcntl; flock(1) takes a lock apt never sees)."""
    host.check_output(HOLD.format(unit=unit, seconds=seconds))
    # Until it holds it, however slowly a loaded machine starts python (not a fixed count).
    wait_for(
        "the holder to take dpkg's lock",
        lambda: host.run("grep -q POSIX /proc/locks").rc == 0,
        timeout=min(seconds, 120),
        every=0.5,
    )


def test_held_dpkg_lock_stops_after_the_timeout_naming_the_holder(host):
    hold_dpkg_lock(host, "dpkg-holder-1", 60)
    try:
        start = time.monotonic()
        args = ("--tags", "base_preflight", "-e", "base_apt_lock_timeout=6")
        run = playbook(*args, playbook="playbooks/base.yml")
        waited = time.monotonic() - start
    finally:
        host.run("systemctl stop dpkg-holder-1")
    assert run.rc != 0, run.output[-2000:]
    assert "dpkg-lock-held: /var/lib/dpkg/lock-frontend is held by pid" in run.output
    assert "python3" in run.output and "base_apt_lock_timeout" in run.output
    assert waited >= 6
    assert run.recap(HOST)["changed"] == 0


def test_held_dpkg_lock_is_waited_for(host):
    # Longer than the play takes unhindered: it ends only after the holder let go.
    hold_dpkg_lock(host, "dpkg-holder-2", 30)
    start = time.monotonic()
    run = playbook("--tags", "base_preflight", playbook="playbooks/base.yml")
    waited = time.monotonic() - start
    holder = host.run("systemctl is-active dpkg-holder-2").stdout.strip()
    host.run("systemctl stop dpkg-holder-2")
    assert run.rc == 0, run.output[-2000:]
    print(f"dpkg lock: the play waited, {waited:.0f} s in all")
    assert holder != "active", "the play ended while the lock was still held"
