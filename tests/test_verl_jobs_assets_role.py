"""The verl_jobs role's assets phase, run here with a stand-in engine that records its argv.

tests/ansible/verl_jobs_assets.yml runs roles/verl_jobs/tasks/assets.yml for a Ray
worker (whose head declares a cluster job) and a host with its own jobs; the
engine's own behaviour is tests/test_assets.py's, the real host molecule/jobs'.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ["--source", "mirror", "--mirror", "/srv/mirror"]


def run(out: Path, *extra: str) -> tuple[str, dict[str, list[list[str]]]]:
    local = ROOT / ".venv" / "bin" / "ansible-playbook"
    exe = str(local) if local.is_file() else shutil.which("ansible-playbook")
    if exe is None:
        pytest.skip("ansible-playbook not found (run scripts/bootstrap-controller.sh)")
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [exe, "-i", "tests/ansible/verl_jobs_assets.inventory.yml",
         "tests/ansible/verl_jobs_assets.yml", "-e", f"out={out}", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    calls = {}
    for host in ("worker1", "solo"):
        log = out / host / "argv.jsonl"
        calls[host] = [json.loads(line) for line in log.read_text().splitlines()]
    return proc.stdout + proc.stderr, calls


def test_each_host_asks_for_its_jobs_and_its_cluster_jobs(tmp_path):
    output, calls = run(tmp_path)
    # The worker places the model of its head's job on its cluster (c1), not c2's.
    assert calls["worker1"] == [
        ["assets", "job", "--json", "--model", "acme/big", "--model-revision", "v2", *SOURCE]
    ]
    # Its own job by id; the job with paths only needs nothing.
    assert calls["solo"] == [
        ["assets", "job", "--json", "--model", "acme/tiny", "--model-revision", "r1",
         "--dataset", "acme/gsm8k", "--dataset-revision", "main",
         "--data-source", "openai/gsm8k", *SOURCE]
    ]  # fmt: skip
    assert "hf_never_in_argv" not in output  # a job's secrets never reach the step
    # changed as the engine's JSON says (the stand-in: changed unless --check).
    assert "changed: [solo] => (item=own)" in output


def test_hub_source_and_check_mode(tmp_path):
    output, calls = run(
        tmp_path, "--check", "-e", "verl_jobs_assets_source=hub",
        "-e", "verl_jobs_assets_hub_endpoint=http://mirror.lab.example",
        "-e", "verl_jobs_assets_hub_token_file=/etc/verl/hf-token",
    )  # fmt: skip
    hub = ["--source", "hub", "--endpoint", "http://mirror.lab.example"]
    assert calls["worker1"] == [
        ["assets", "job", "--json", "--model", "acme/big", "--model-revision", "v2", *hub,
         "--token-file", "/etc/verl/hf-token", "--check"]
    ]  # fmt: skip
    assert "ok: [worker1] => (item=big)" in output
