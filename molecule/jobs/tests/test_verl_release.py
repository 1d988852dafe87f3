"""A second verl release beside the default: what site.yml laid down for verl_releases
["0.9.0"] (its venv from its own lock, its patched tree from the sdist), and a GRPO job
with verl_version "0.9.0" trained by that release under systemd through the engine's
oldgpu-hf rollout server (the 0.5.0 jobs of test_jobs.py run on the same host)."""

from __future__ import annotations

import json
import re

import pytest
from playbook import PROJECT
from test_jobs import run_to_end, show, steps_logged

VERSION = "0.9.0"
PINS = json.loads((PROJECT / "files/pins.json").read_text())
RELEASE = PINS["verl_releases"][VERSION]
LOCK = PROJECT / "files/requirements" / f"{RELEASE['lock']}.lock"  # the cpu hosts' variant
VENV, VENVS = f"/opt/verl/venv-{VERSION}", f"/opt/verl/venvs-{VERSION}"
TREE, TREES = f"/opt/verl/verl-{VERSION}", f"/opt/verl/trees-{VERSION}"
PY = f"{VENV}/bin/python"
UNIT = "verl-train@verl09.service"
CKPT = "/var/lib/verl/jobs/verl09/checkpoints"
STEPS = 2


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_versions() -> dict[str, str]:
    pairs = (line.split("==") for line in LOCK.read_text().splitlines() if "==" in line)
    return {normalise(n): v for n, v in pairs}


def test_the_release_venv_is_its_own_lock_beside_the_default(host):
    link = host.file(VENV)
    assert link.is_symlink and link.linked_to.startswith(f"{VENVS}/"), link.linked_to
    freeze = host.check_output(f"{PY} -m pip freeze --exclude-editable --all")
    have = {normalise(n): v for n, _, v in (line.partition("==") for line in freeze.splitlines())}
    for tool in ("pip", "setuptools", "wheel"):
        have.pop(tool, None)
    want = lock_versions()
    want.pop("setuptools", None)
    assert have == want
    assert host.run(f"{PY} -m pip check").rc == 0
    # The default release's venv is another one, on its own lock (test_stack.py checks it).
    assert host.file("/opt/verl/venv").linked_to.startswith("/opt/verl/venvs/")


def test_the_release_venv_imports_the_release_from_its_patched_tree(host):
    code = (
        "import json, torch, transformers, ray, verl;"
        'print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,'
        '"ray": ray.__version__, "verl": verl.__version__, "verl_file": verl.__file__}))'
    )
    seen = json.loads(host.check_output(f"cd /tmp && {PY} -c '{code}'"))
    pins = RELEASE["python_packages"]
    assert seen["torch"].split("+")[0] == pins["torch"] == RELEASE["torch"]["version"]
    assert seen["transformers"] == pins["transformers"]
    assert seen["ray"] == pins["ray"] == PINS["python_packages"]["ray"]  # one Ray per cluster
    assert seen["verl"] == VERSION
    assert seen["verl_file"] == f"{host.check_output(f'readlink -f {TREE}')}/verl/__init__.py"


def test_the_release_tree_comes_from_the_pinned_sdist_patched_for_the_profile(host):
    sdist = host.file(f"/opt/verl/src/verl-{VERSION}.tar.gz")
    assert sdist.is_file and sdist.sha256sum == RELEASE["sdist_sha256"]
    assert host.file(TREE).is_symlink and host.file(TREE).linked_to.startswith(f"{TREES}/")
    manifest = json.loads(host.file(f"{TREE}/.oldgpu-patch.json").content_string)
    assert manifest["verl_version"] == VERSION
    opts = "--profile cpu --compute-dtype fp32 --attn-implementation sdpa"
    check = host.run(f"oldgpu patch {TREE} --check {opts}")
    assert check.rc == 0, check.stdout + check.stderr
    # Nothing is left of a build (staging or set-aside trees).
    assert host.check_output(f"ls -A {TREES}").split() == [host.file(TREE).linked_to.split("/")[-1]]
    for path in (f"{TREE}/verl", VENV + "/bin"):
        assert host.run(f"runuser -u verl -- test -w {path}").rc != 0, path


def test_the_doctor_judges_the_release_against_its_own_pins(host):
    doc = json.loads(host.run(f"oldgpu doctor --json --python {PY} --verl-dir {TREE}").stdout)
    checks = {c["id"]: c for c in doc["checks"]}
    assert checks["verl-patch"]["status"] == "ok", checks["verl-patch"]
    assert checks["verl-patch"]["details"]["verl_version"] == VERSION
    assert "not the pinned" not in checks["torch-build"]["seen"], checks["torch-build"]


@pytest.fixture(scope="module")
def release_run(host):
    return run_to_end(host, UNIT)


def test_the_release_job_ran_unprivileged_to_completion(host, release_run):
    result, journal = release_run
    assert result["Result"] == "success", journal[-4000:]
    assert result["ExecMainStatus"] == "0"
    assert show(host, "User", unit=UNIT)["User"] == "verl"
    assert "as user verl" in journal
    assert not host.service(UNIT).is_enabled


def test_the_release_trained_both_steps_through_the_oldgpu_hf_server(release_run):
    _, journal = release_run
    command = next(line for line in journal.splitlines() if line.startswith("verl-train: /"))
    # The release's venv and verl 0.9.0's legacy trainer, rolling out through the engine.
    assert command.startswith(f"verl-train: {PY} -m verl.trainer.main_ppo "), command
    for key in ("actor_rollout_ref.rollout.name=oldgpu-hf", "trainer.use_v1=False",
                "trainer.device=cpu", "algorithm.adv_estimator=grpo"):  # fmt: skip
        assert f" {key}" in command, key
    steps = steps_logged(journal)
    assert sorted(steps) == list(range(1, STEPS + 1)), journal[-4000:]
    for line in steps.values():
        assert "actor/pg_loss:" in line and "actor/kl_loss:" in line, line
    # The engine's server answered verl's agent loop by generating in the trainer's process
    # from the trainer's own parameters (issue 32): no model of its own, no weight copied.
    assert "oldgpu-hf server 0: generates in its trainer worker" in journal, journal[-4000:]
    assert len(re.findall(r"oldgpu-hf server 0: \d+ requests in \d+ batches", journal)) >= STEPS
    assert not re.search(r"oldgpu-hf replica 0: \d+ tensors to the server", journal)
    # So the old policy's log-probs are the rollout's own (verl's bypass mode): no actor
    # pass for them, and the update's look at them (actor/ppo_kl: the policy against the
    # rollout's log-probs, before any change in a one-mini-batch step) finds them equal.
    assert " algorithm.rollout_correction.bypass_mode=True" in command, command
    for line in steps.values():
        assert "timing_s/old_log_prob:" not in line, line
        kl = re.search(r"actor/ppo_kl:(?:np\.float64\()?([-+.\deE]+)", line)
        assert kl and abs(float(kl.group(1))) < 1e-4, line


def test_the_release_jobs_last_checkpoint_is_complete(host, release_run):
    step = f"{CKPT}/global_step_{STEPS}"
    for path in (step, f"{step}/actor"):
        f = host.file(path)
        assert f.is_directory and f.user == "verl", path
    # What the start script resumes from: data.pt is written after the models.
    assert host.file(f"{step}/data.pt").size > 0
    assert host.file(f"{step}/actor").listdir(), "the actor's checkpoint is empty"
    latest = host.file(f"{CKPT}/latest_checkpointed_iteration.txt")
    assert latest.content_string.strip() == str(STEPS)
