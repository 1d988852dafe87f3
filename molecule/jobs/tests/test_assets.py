"""The smoke job's model and data set, placed from the scenario's mirror by the assets phase.

The mirror is the smoke assets published by the role (``oldgpu assets publish``); a
second converge after the mirror's revision changed places the new copy whole.
"""

from __future__ import annotations

import json

import pytest
from playbook import playbook

MIRROR = "/var/lib/verl/smoke/mirror"
MODEL = "/var/lib/verl/models/oldgpu/smoke-qwen2/seed0"
PREPARED = "/var/lib/verl/prepared/oldgpu/smoke-gsm8k/seed0"
PROBE = "/var/lib/verl/models/oldgpu/probe/r1"
ENGINE = "/usr/local/bin/oldgpu"


def engine(host, *args: str) -> tuple[int, dict]:
    out = host.run(" ".join([ENGINE, *args, "--json"]))
    return out.rc, json.loads(out.stdout) if out.stdout.strip().startswith("{") else {}


def test_smoke_job_names_the_placed_copies(host):
    env = host.file("/etc/verl/jobs/smoke.env").content_string
    assert f"VERL_JOB_MODEL_PATH='{MODEL}'" in env
    assert f"VERL_JOB_TRAIN_FILES='{PREPARED}/train.parquet'" in env
    assert f"VERL_JOB_VAL_FILES='{PREPARED}/test.parquet'" in env


def test_placed_copies_are_verified_root_owned_and_readable_by_the_jobs(host):
    record = json.loads(host.file(f"{MODEL}/oldgpu-assets.json").content_string)
    assert record["source"] == f"mirror:{MIRROR}" and record["revision"] == "seed0"
    assert "model.safetensors" in record["files"]
    rc, doc = engine(host, "assets", "verify", "model", "oldgpu/smoke-qwen2", "--revision", "seed0")
    assert rc == 0 and doc["ok"]
    weights = host.file(f"{MODEL}/model.safetensors")
    assert (weights.user, weights.mode) == ("root", 0o644)
    for path in (f"{MODEL}/model.safetensors", f"{PREPARED}/train.parquet"):
        assert host.run(f"runuser -u verl -- test -r {path}").rc == 0, path
        assert host.run(f"runuser -u verl -- test -w {path}").rc != 0, path


@pytest.fixture
def probe(host):
    """A model oldgpu/probe@r1 in the mirror (the smoke model), removed afterwards."""
    host.run_expect([0], "rm -rf /tmp/probe && cp -r /var/lib/verl/smoke/model /tmp/probe")
    rc, doc = engine(host, "assets", "publish", "model", "oldgpu/probe", "--revision", "r1",
                     "--from", "/tmp/probe", "--mirror", MIRROR)  # fmt: skip
    assert rc == 0 and doc["changed"], doc
    yield
    host.run(f"rm -rf /tmp/probe {MIRROR}/oldgpu/probe /var/lib/verl/models/oldgpu/probe")


def probe_job() -> str:
    job = {
        "name": "probe",
        "model": "oldgpu/probe",
        "model_revision": "r1",
        "train_files": "/var/lib/verl/smoke/data/train.parquet",
        "val_files": "/var/lib/verl/smoke/data/test.parquet",
        "total_steps": 1,
        "profile": "cpu",
        "enabled": False,
    }
    return json.dumps({"verl_jobs": [job]})


def test_a_changed_revision_is_placed_whole_on_the_next_converge(host, probe):
    first = playbook("-e", probe_job(), "--tags", "verl_jobs_assets", playbook="playbooks/jobs.yml")
    assert first.rc == 0, first.output[-3000:]
    assert first.recap("jobs-host")["changed"] == 1
    old = host.file(PROBE).linked_to
    # The mirror's r1 now holds other content (a branch that moved): one more file.
    host.run_expect([0], "echo '# probe' > /tmp/probe/README.md")
    rc, doc = engine(host, "assets", "publish", "model", "oldgpu/probe", "--revision", "r1",
                     "--from", "/tmp/probe", "--mirror", MIRROR)  # fmt: skip
    assert rc == 0 and doc["changed"], doc
    check = playbook("-e", probe_job(), "--tags", "verl_jobs_assets", "--check",
                     playbook="playbooks/jobs.yml")  # fmt: skip
    assert check.rc == 0, check.output[-3000:]
    assert check.recap("jobs-host")["changed"] == 1  # noticed, and left alone
    assert host.file(PROBE).linked_to == old and not host.file(f"{PROBE}/README.md").exists
    second = playbook(
        "-e", probe_job(), "--tags", "verl_jobs_assets", playbook="playbooks/jobs.yml"
    )
    assert second.rc == 0, second.output[-3000:]
    assert second.recap("jobs-host")["changed"] == 1
    assert host.file(PROBE).linked_to != old and host.file(f"{PROBE}/README.md").exists
    assert not host.file(old).exists  # the old copy went once the link moved
    record = json.loads(host.file(f"{PROBE}/oldgpu-assets.json").content_string)
    assert "README.md" in record["files"]
    # Placed once: the engine's step again changes nothing.
    rc, doc = engine(host, "assets", "job", "--model", "oldgpu/probe", "--model-revision", "r1",
                     "--mirror", MIRROR)  # fmt: skip
    assert rc == 0 and doc["changed"] is False, doc


def test_a_corrupt_mirror_leaves_the_placed_copy(host, probe):
    rc, doc = engine(host, "assets", "fetch", "model", "oldgpu/probe", "--revision", "r1",
                     "--mirror", MIRROR)  # fmt: skip
    assert rc == 0 and doc["action"] == "placed", doc
    host.run_expect([0], "echo '# probe' > /tmp/probe/README.md")
    engine(host, "assets", "publish", "model", "oldgpu/probe", "--revision", "r1",
           "--from", "/tmp/probe", "--mirror", MIRROR)  # fmt: skip
    host.run_expect([0], f"echo rot >> {MIRROR}/oldgpu/probe/r1/README.md")
    rc, doc = engine(host, "assets", "fetch", "model", "oldgpu/probe", "--revision", "r1",
                     "--mirror", MIRROR)  # fmt: skip
    assert rc == 23 and doc["error"] == "asset-sha-mismatch", doc
    assert not host.file(f"{PROBE}/README.md").exists
    rc, doc = engine(host, "assets", "verify", "model", "oldgpu/probe", "--revision", "r1")
    assert rc == 0 and doc["ok"]
    leftovers = host.run("find /var/lib/verl/models/oldgpu -name '.staging-*'").stdout
    assert leftovers.strip() == ""
