"""What a user checks after site.yml installed the venv and the patched verl.

(These ran in a scenario of their own, `verl`, on a host converged with the same
stages minus the jobs; they run on the jobs scenario's host now: one converge fewer.
test_bad_input.py's --check run covers the converged host.)"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from playbook import PROJECT, playbook

PY = "/opt/verl/venv/bin/python"
LOCK = PROJECT / "files/requirements/pypi.lock"
MIRROR = Path(os.environ.get("OLDGPU_CACHE", "/var/cache/oldgpu")) / "verl-mirror/verl.git"


def lock_versions():
    return dict(
        line.split("==")
        for line in LOCK.read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )


def test_venv_imports_the_stack_at_the_locked_versions(host):
    code = (
        "import json, torch, triton, transformers, tensordict, ray, verl;"
        'print(json.dumps({"torch": torch.__version__, "triton": triton.__version__,'
        '"transformers": transformers.__version__, "verl": verl.__version__,'
        '"verl_file": verl.__file__}))'
    )
    out = host.check_output(f"{PY} -c '{code}'")
    seen = json.loads(out)
    want = lock_versions()
    # The default index's build says +cu124; the version is the lock's.
    assert seen["torch"].split("+")[0] == want["torch"] == "2.6.0"
    assert seen["triton"] == want["triton"] == "3.2.0"
    assert seen["transformers"] == want["transformers"]
    assert seen["verl"] == "0.5.0"
    # From the active patched tree (the editable install records where the link points).
    active = host.check_output("readlink -f /opt/verl/verl")
    assert seen["verl_file"] == f"{active}/verl/__init__.py"


def test_pip_freeze_in_the_host_equals_the_lock(host):
    freeze = host.check_output(f"{PY} -m pip freeze --exclude-editable --all")
    have = {}
    for line in freeze.splitlines():
        name, _, version = line.partition("==")
        have[re.sub(r"[-_.]+", "-", name).lower()] = version
    for tool in ("pip", "setuptools", "wheel"):
        have.pop(tool, None)
    want = {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in lock_versions().items()}
    want.pop("setuptools", None)
    assert have == want


def test_pip_check_is_clean(host):
    assert host.run(f"{PY} -m pip check").rc == 0


def test_verl_tree_is_patched_and_the_manifest_matches(host):
    assert host.file("/opt/verl/verl").is_symlink
    assert host.file("/opt/verl/verl/.oldgpu-patch.json").is_file
    # The options the role passes for this host's profile (cpu: no GPU here).
    opts = "--profile cpu --compute-dtype fp32 --attn-implementation sdpa"
    check = host.run(f"oldgpu patch /opt/verl/verl --check {opts}")
    assert check.rc == 0, check.stdout + check.stderr


def test_the_clone_stays_pristine_at_the_pinned_commit(host):
    want = subprocess.check_output(
        ["git", "--git-dir", str(MIRROR), "rev-parse", "v0.5.0^{commit}"], text=True
    ).strip()
    assert host.check_output("git -C /opt/verl/src/verl rev-parse HEAD") == want
    assert host.check_output("git -C /opt/verl/src/verl status --porcelain") == ""


def test_fsdp_workers_import_without_flash_attn(host):
    code = (
        'import importlib.util as u; assert u.find_spec("flash_attn") is None;'
        'import verl.workers.fsdp_workers; print("ok")'
    )
    r = host.run(f"cd /tmp && {PY} -c '{code}'")
    assert r.rc == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_no_bf16_autocast_left_on_the_ppo_path(host):
    files = [
        "verl/workers/actor/dp_actor.py",
        "verl/workers/critic/dp_critic.py",
        "verl/workers/rollout/hf_rollout.py",
    ]
    for f in files:
        text = host.file(f"/opt/verl/verl/{f}").content_string
        autocasts = re.findall(r"torch\.autocast\([^)]*\)", text)
        assert autocasts, f"{f}: no autocast site found at all"
        assert not [a for a in autocasts if "bfloat16" in a], f
    workers = host.file("/opt/verl/verl/verl/workers/fsdp_workers.py").content_string
    assert 'attn_implementation="flash_attention_2"' not in workers


def test_venv_is_not_writable_by_verl(host):
    site = host.check_output(
        f"{PY} -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'"
    )
    for path in ("/opt/verl/venv/bin", site, "/opt/verl/verl/verl"):
        assert host.run(f"runuser -u verl -- test -w {path}").rc != 0, path
        assert host.run(f"runuser -u verl -- test -r {path}").rc == 0, path


def state(host):
    return (
        host.check_output("readlink /opt/verl/venv"),
        host.check_output("readlink /opt/verl/verl"),
        host.check_output(f"{PY} -c 'import torch; print(torch.__version__)'"),
    )


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ("python_env_lock_file={lock}", "python-env-install-failed"),
        ("verl_repo_url=file:///srv/mirror/nonexistent.git", "verl-fetch-failed"),
        ("verl_version=v9.9.9-unknown verl_commit={unknown}", "verl-version-unsupported"),
    ],
    ids=["torch-absent-from-index", "mirror-unreachable", "verl-version-unknown"],
)
def test_failures_are_named_and_leave_the_working_venv_and_tree(host, tmp_path, extra, named):
    bad_lock = tmp_path / "bad.lock"
    bad_lock.write_text(LOCK.read_text().replace("torch==2.6.0", "torch==9.9.9"))
    unknown = subprocess.check_output(
        ["git", "--git-dir", str(MIRROR), "rev-parse", "v9.9.9-unknown^{commit}"], text=True
    ).strip()
    before = state(host)
    run = playbook("-e", extra.format(lock=bad_lock, unknown=unknown))
    assert run.rc != 0
    assert named in run.output, run.output[-3000:]
    if "torch" in extra or "lock" in extra:
        assert "torch==9.9.9" in run.output
    assert state(host) == before
