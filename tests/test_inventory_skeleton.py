"""Steps 2-5 of the README's five steps, without a host.

The skeleton inventory/ lists every fleet knob; a copy filled in the way its
comments say (three 4xP40 boxes, one Ray cluster, the driver pin, a torch index
and a CUDA repository) is read by `ansible-inventory --list`, and site.yml's
preflights run against it in check mode over a local connection (the roles'
preflights ask the engine on the controller, so no host is needed): the roles'
argument specs accept every knob's example value, and a cluster job declared in
group_vars is refused on the workers (job-cluster-not-head) before anything changes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SKELETON = ROOT / "inventory"
GROUP_VARS = SKELETON / "group_vars" / "verl_hosts.yml"
HEAD, WORKERS = "p40-01.lab.example", ("p40-02.lab.example", "p40-03.lab.example")
# What a user sets first (README step 3), uncommented as the skeleton shows them.
USER_KNOBS = ("nvidia_driver_version", "python_env_torch_index_url", "nvidia_cuda_repo_url")
# The plays' own settings, given as -e (README "From one box to a fleet").
PLAY_KNOBS = {"oldgpu_serial", "oldgpu_max_fail_percentage", "oldgpu_stages"}
# Role variables the skeleton names but does not offer as a knob: the checkout's
# locks and the pinned verl commit, and the lists that follow verl_releases.
DERIVED = {
    "python_env_lock_file",
    "python_env_vllm_lock_file",
    "python_env_verl_releases",
    "verl_commit",
    "verl_version",
    "verl_jobs_verl_releases",
}


def _tool(name: str) -> str | None:
    local = ROOT / ".venv" / "bin" / name
    return str(local) if local.is_file() else shutil.which(name)


def _run(argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    env["ANSIBLE_FORCE_VALID_GROUP_NAMES"] = "ignore"
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def role_knobs() -> dict[str, str]:
    """Every variable of every role's main entry point (the private oldgpu_engine has none)."""
    knobs = {}
    for spec in sorted(ROOT.glob("roles/*/meta/argument_specs.yml")):
        main = yaml.safe_load(spec.read_text())["argument_specs"].get("main") or {}
        for name in main.get("options") or {}:
            knobs[name] = spec.parts[-3]
    return knobs


def commented_knobs(text: str) -> list[tuple[str, str]]:
    """The skeleton's one-line knobs, `# name: value  # why`, as (name, value)."""
    found = []
    for line in text.splitlines():
        m = re.match(r"# (\w+):(?:\s(.*))?$", line)
        if m:
            value = re.split(r"\s*#\s", m.group(2) or "", maxsplit=1)[0].strip()
            found.append((m.group(1), value))
    return found


def uncomment_groups(text: str, groups: set[str]) -> str:
    """hosts.yml as a user fills it in: each named group's `hosts: {}` replaced by
    the commented example under it."""
    out, lines, i, group = [], text.splitlines(), 0, None
    while i < len(lines):
        line = lines[i]
        m = re.match(r"\s*([\w-]+):\s*$", line)
        if m:
            group = m.group(1)
        m = re.match(r"(\s*)hosts: \{\}$", line)
        if m and group in groups:
            indent = m.group(1)
            i += 1
            while i < len(lines) and lines[i].startswith(indent + "# "):
                out.append(indent + lines[i][len(indent) + 2 :])
                i += 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out) + "\n"


def uncomment_knobs(text: str, names) -> str:
    names = set(names)
    return (
        "\n".join(
            line[2:] if (m := re.match(r"# (\w+): ", line)) and m.group(1) in names else line
            for line in text.splitlines()
        )
        + "\n"
    )


def fill_in(dest: Path, knobs=USER_KNOBS, extra_group_vars: str = "") -> Path:
    """A copy of inventory/ for three 4xP40 boxes in one Ray cluster, filled in
    as its comments say; the hosts reached over a local connection."""
    (dest / "group_vars").mkdir(parents=True)
    hosts = uncomment_groups(
        (SKELETON / "hosts.yml").read_text(), {"p40-hosts", "ray_head", "ray_workers"}
    )
    (dest / "hosts.yml").write_text(hosts)
    (dest / "group_vars" / "verl_hosts.yml").write_text(
        uncomment_knobs(GROUP_VARS.read_text(), knobs) + extra_group_vars
    )
    # The test's own: no SSH, the controller's Python.
    (dest / "group_vars" / "all.yml").write_text(
        "ansible_connection: local\nansible_python_interpreter: '{{ ansible_playbook_python }}'\n"
    )
    return dest / "hosts.yml"


@pytest.fixture(scope="module")
def ansible():
    if _tool("ansible-playbook") is None:
        pytest.skip("ansible-playbook not found (run scripts/bootstrap-controller.sh)")
    return {"playbook": _tool("ansible-playbook"), "inventory": _tool("ansible-inventory")}


def test_skeleton_names_every_role_knob():
    text = GROUP_VARS.read_text()
    knobs = role_knobs().items()
    missing = [f"{role}: {name}" for name, role in knobs if not re.search(rf"\b{name}\b", text)]
    assert missing == [], "inventory/group_vars/verl_hosts.yml lacks these role variables"


def test_skeleton_knobs_are_real_and_offered():
    knobs = role_knobs()
    offered = {name for name, _ in commented_knobs(GROUP_VARS.read_text())}
    assert offered - set(knobs) - PLAY_KNOBS == set(), "stale or misspelt knobs"
    assert set(knobs) - offered - DERIVED == set(), "role variables with no example value"
    # The driver pin lives in the skeleton itself, not only in the examples.
    assert ("nvidia_driver_version", "535.216.01") in commented_knobs(GROUP_VARS.read_text())


def test_examples_never_name_a_real_index():
    for path in SKELETON.rglob("*.yml"):
        for name, value in commented_knobs(path.read_text()):
            if value.startswith(("http://", "https://", "git://")):
                assert ".example/" in value, f"{path}: {name}: {value}"


def test_empty_skeleton_parses(ansible):
    proc = _run([ansible["inventory"], "-i", str(SKELETON / "hosts.yml"), "--list"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for group in ("verl_hosts", "p40-hosts", "v100-hosts", "ray_head", "ray_workers"):
        assert group in doc["all"]["children"] + doc["verl_hosts"]["children"], group
    assert "hosts" not in doc.get("p40-hosts", {})


def test_three_p40_boxes_filled_in(ansible, tmp_path):
    proc = _run([ansible["inventory"], "-i", str(fill_in(tmp_path)), "--list"])
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    assert sorted(doc["p40-hosts"]["hosts"]) == [HEAD, *WORKERS]
    assert doc["ray_head"]["hosts"] == [HEAD]
    assert sorted(doc["ray_workers"]["hosts"]) == list(WORKERS)
    hostvars = doc["_meta"]["hostvars"]
    for host in (HEAD, *WORKERS):
        v = hostvars[host]
        assert v["nvidia_driver_version"] == "535.216.01"
        assert v["python_env_torch_index_url"].endswith("/whl/cu118")
        assert v["nvidia_cuda_repo_url"].endswith("/x86_64/")
    assert hostvars[HEAD]["verl_jobs"][0]["cluster"] == "ray"
    assert hostvars[HEAD]["verl_jobs"][0]["gpus"] == "all"
    assert all("verl_jobs" not in hostvars[w] for w in WORKERS)


def test_every_knob_passes_the_roles_argument_specs(ansible, tmp_path):
    """Each one-line knob's example value, all uncommented at once, is accepted by
    its role's argument spec (those validations run under any tag)."""
    knobs = [n for n, v in commented_knobs(GROUP_VARS.read_text()) if v and n not in PLAY_KNOBS]
    inventory = fill_in(tmp_path, knobs)
    proc = _run([ansible["playbook"], "-i", str(inventory), "site.yml", "--check", "-l", HEAD,
                 "--tags", "argument-specs-only"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for role in ("base", "nvidia_driver", "cuda", "python_env", "verl", "ray_cluster", "verl_jobs"):
        validated = rf"TASK \[{role} : Validating arguments against arg spec 'main'"
        assert re.search(validated, proc.stdout), role


# README step 4 as it once read: a cluster job in group_vars/verl_hosts.yml reaches every node.
CLUSTER_JOB_IN_GROUP_VARS = """
verl_jobs:
  - name: gsm8k-ppo
    model_path: /srv/models/Qwen2.5-0.5B-Instruct
    train_files: /srv/data/gsm8k/train.parquet
    val_files: /srv/data/gsm8k/test.parquet
    total_steps: 500
    save_freq: 20
    gpus: all
    cluster: ray
"""


def test_preflight_keeps_a_cluster_job_on_the_head(ansible, tmp_path):
    """The head (its job from hosts.yml) passes the ray_cluster and verl_jobs
    preflights; the workers, which read the same job from group_vars, are refused
    by name, and nothing changed anywhere."""
    inventory = fill_in(tmp_path, extra_group_vars=CLUSTER_JOB_IN_GROUP_VARS)
    proc = _run([ansible["playbook"], "-i", str(inventory), "site.yml", "--check",
                 "--tags", "ray_cluster_preflight,verl_jobs_preflight"])  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 2, out[-4000:] + proc.stderr[-2000:]
    recap = dict(re.findall(r"^(\S+)\s+: (ok=.*)$", out, re.MULTILINE))
    assert "failed=0" in recap[HEAD] and "changed=0" in recap[HEAD]
    for worker in WORKERS:
        assert "failed=1" in recap[worker] and "changed=0" in recap[worker]
        assert re.search(
            r"job-cluster-not-head in job gsm8k-ppo: it names cluster ray, "
            rf"whose head is {re.escape(HEAD)},"
            rf"\s+and {re.escape(worker)} is one of its workers",
            out,
        ), worker
    # The head's job went through the engine's validation (the env file, rendered).
    assert re.search(rf"ok: \[{re.escape(HEAD)} -> localhost\] => \(item=gsm8k-ppo\)", out)


@pytest.mark.parametrize("example", ["four-p40-boxes.yml", "mixed-fleet.yml"])
def test_examples_pin_the_driver_and_keep_cluster_jobs_on_the_head(ansible, example):
    proc = _run([ansible["inventory"], "-i", str(SKELETON / "examples" / example), "--list"])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    heads = set(doc.get("ray_head", {}).get("hosts", []))
    for host, v in doc["_meta"]["hostvars"].items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", v["nvidia_driver_version"]), host
        for job in v.get("verl_jobs", []):
            if job.get("cluster"):
                assert host in heads, f"{example}: cluster job {job['name']} on {host}"
