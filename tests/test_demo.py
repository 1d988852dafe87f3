"""`make demo`'s wait for the smoke job's first step, against a fake container."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "scripts/demo.sh"

# A stand-in for `podman exec`: the journal of a job that trained at once (a
# step line first, then far more than a pipe holds), and the unit's state.
FAKE = r"""
set -euo pipefail
journal_calls=0
podman() {
  case "$*" in
    *journalctl*)
      echo "(TaskRunner pid=42) step:1 - actor/pg_loss:0.1 - critic/vf_loss:0.2"
      seq 200000 | sed 's/^/(TaskRunner pid=42) filler line /' ;;
    *is-active*) echo "${FAKE_STATE:-active}" ;;
    *) return 1 ;;
  esac
}
sleep() { :; }
"""


def _bash(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", FAKE + script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def test_the_wait_ends_at_the_first_step():
    run = _bash(f'source {DEMO}\nwait_for_first_step p40-demo 3 5\necho "waited: $?"')
    assert run.stdout.strip() == "waited: 0", run.stderr


def test_the_step_lines_are_shown():
    run = _bash(f"source {DEMO}\nstep_lines p40-demo | head -n 1")
    assert run.stdout.startswith("(TaskRunner pid=42) step:1 - actor/pg_loss:0.1"), run.stderr


def test_a_failed_job_ends_the_wait():
    run = _bash(
        f"source {DEMO}\n"
        'podman() { case "$*" in *is-active*) echo failed ;; *) echo no steps ;; esac; }\n'
        'rc=0; wait_for_first_step p40-demo 120 5 || rc=$?; echo "waited: $rc"'
    )
    assert run.stdout.strip() == "waited: 1", run.stderr


def test_the_fake_journal_defeats_the_old_pipeline():
    """What demo.sh did before: under pipefail, `journalctl | grep -q` never matched."""
    old = (
        "for round in 1 2 3; do\n"
        "  podman exec p40-demo journalctl -u verl-train@smoke.service -o cat --no-pager |\n"
        "    grep -qE '(^|\\) )step:[0-9]+ ' && break\n"
        "done\n"
        'echo "rounds: $round"'
    )
    assert _bash(old).stdout.strip() == "rounds: 3"
