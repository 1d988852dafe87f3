"""The user docs say what the code does (issue 34, item 8), and their examples run."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from oldgpu import jobs, verl_release

ROOT = Path(__file__).resolve().parent.parent


def test_the_jobs_page_example_is_a_job_the_engine_accepts():
    """docs/jobs.md's first job, `secrets:` and all, as the role hands it to `job env`."""
    text = (ROOT / "docs/jobs.md").read_text()
    block = re.search(r"```yaml\n(verl_jobs:.*?)```", text, re.S)
    assert block, "docs/jobs.md lost its example"
    (example,) = yaml.safe_load(block.group(1))["verl_jobs"]
    assert "secrets" in example
    job = jobs.job_from_mapping(example)
    jobs.check_for_unit(job)  # under /var/lib/verl: the unit sees it
    assert "WANDB" not in jobs.render_env(job)


def test_the_jobs_page_no_longer_calls_cluster_mode_unbuilt():
    text = (ROOT / "docs/jobs.md").read_text()
    assert "not built here" not in text
    assert "cluster_environment" in text  # where the cluster's environment is built


def test_the_newer_verl_page_says_its_rollout_ran_on_a_gpu():
    text = (ROOT / "docs/newer-verl.md").read_text()
    assert "has not run on a GPU" not in text
    assert "## On the GPU: verl 0.9.0" in text


def test_the_readme_says_what_each_release_gives():
    text = (ROOT / "README.md").read_text()
    for version in verl_release.releases()[1:]:
        rows = [line for line in text.splitlines() if line.startswith(f"| {version} ")]
        assert len(rows) == 1, version
        release = rows[0].split(" | ")[0]
        assert "transformers 5" in release and "trainer" in release, release


def test_the_jobs_page_states_the_defaults_the_engine_has():
    text = (ROOT / "docs/jobs.md").read_text()
    assert jobs.FIELD_BY_NAME["gpus"].default == "all"
    assert "`gpus` is a number or `all`, the default" in text
    length = jobs.FIELD_BY_NAME["prompt_length"].default
    assert f"`prompt_length` {length}" in text
