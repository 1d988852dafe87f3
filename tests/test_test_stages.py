"""``make test``'s drivers: scripts/test-stages.sh (the stage table on every run) and
scripts/molecule-all.sh (the lanes, the fleet after this run's jobs image, verdicts).

Both run for real against stand-ins: a Makefile whose targets pass, fail or hang, and
a ``molecule`` on PATH that logs what it was asked and when.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ROOT / "scripts" / "test-stages.sh"
MOLECULE_ALL = ROOT / "scripts" / "molecule-all.sh"

MAKEFILE = """\
ok:
\t@echo fine
bad:
\t@exit 3
slow:
\t@touch slow.started && sleep 30
molecule:
\t@echo "molecule/jobs 12 3 passed" >> $$OLDGPU_STAGE_TIMES
\t@echo "molecule/fleet 7 FAILED" >> $$OLDGPU_STAGE_TIMES
test:
\t@bash {stages} ok slow+ok
"""


def stages(tmp_path: Path, *names: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "Makefile").write_text(MAKEFILE.format(stages=STAGES))
    env = dict(os.environ, OLDGPU_CACHE=str(cache or tmp_path / "cache"))
    return subprocess.run(
        ["bash", str(STAGES), *names],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def table(out: str) -> dict[str, tuple[int, str]]:
    """{row name: (seconds, verdict)} from the table after '[stage] times'."""
    rows = {}
    for line in out.split("[stage] times", 1)[1].splitlines()[1:]:
        m = re.match(r"\s+(\S+)\s+(\d+) s\s*(.*)$", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), m.group(3).strip())
    return rows


def test_a_passing_run_prints_every_stage_and_the_scenarios_under_molecule(tmp_path):
    run = stages(tmp_path, "ok", "molecule+ok")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[stage] caches in" in run.stdout and ": cold" in run.stdout
    rows = table(run.stdout)
    assert list(rows) == [
        "ok",
        "molecule",
        "molecule/jobs",
        "molecule/fleet",
        "(molecule+ok)",
        "total",
    ]
    assert rows["molecule/jobs"] == (12, "3 passed")
    assert rows["molecule/fleet"] == (7, "FAILED")
    assert rows["total"][1] == "passed"
    # The scenarios' rows are indented under molecule's.
    text = run.stdout.split("[stage] times", 1)[1]
    assert re.search(r"^    molecule/jobs ", text, re.M)


def test_a_failed_stage_still_prints_the_table_and_names_it(tmp_path):
    run = stages(tmp_path, "ok", "bad", "ok")
    assert run.returncode == 1
    rows = table(run.stdout)
    assert rows["bad"][1] == "FAILED"
    assert rows["total"][1] == "FAILED"
    assert list(rows) == ["ok", "bad", "total"]  # nothing ran after the failure


def test_a_failed_side_by_side_stage_marks_the_part_and_the_pair(tmp_path):
    run = stages(tmp_path, "ok+bad")
    assert run.returncode == 1
    rows = table(run.stdout)
    assert rows["ok"][1] == "" and rows["bad"][1] == "FAILED"
    assert rows["(ok+bad)"][1] == "FAILED"


def started(tmp_path: Path, proc: subprocess.Popen) -> None:
    """Until the slow stage's own make is running (it writes slow.started): the stop
    then lands inside the stage, however loaded the machine is."""
    deadline = time.monotonic() + 60
    while not (tmp_path / "slow.started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the slow stage never started"
        time.sleep(0.05)


def test_a_run_stopped_from_outside_prints_the_table_with_the_stage_it_was_in(tmp_path):
    """As CI's time limit ends `make test`: a TERM to the whole process group, which make
    passes on to its children once more."""
    (tmp_path / "Makefile").write_text(MAKEFILE.format(stages=STAGES))
    env = dict(os.environ, OLDGPU_CACHE=str(tmp_path / "cache"))
    log = tmp_path / "make-test.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["make", "--no-print-directory", "test"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started(tmp_path, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    out = log.read_text()
    assert proc.returncode != 0
    rows = table(out)
    assert rows["ok"][1] == ""
    assert rows["slow+ok"][1] == "stopped", out
    assert rows["total"][1] == "FAILED"


def test_terms_that_keep_coming_while_it_stops_do_not_cut_the_table_short(tmp_path):
    """The race behind issue 33's flake, made likely: a TERM that arrives while the first
    one's exit is printing the table. The table comes out once and whole."""
    (tmp_path / "Makefile").write_text(MAKEFILE.format(stages=STAGES))
    env = dict(os.environ, OLDGPU_CACHE=str(tmp_path / "cache"))
    log = tmp_path / "stages.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", str(STAGES), "ok", "slow+ok"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started(tmp_path, proc)
        while proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
        proc.wait(timeout=60)
        os.killpg(proc.pid, signal.SIGKILL)  # the stage's own make, left behind by design
    out = log.read_text()
    assert proc.returncode == 143, out
    assert out.count("[stage] times") == 1, out
    rows = table(out)
    assert rows["slow+ok"][1] == "stopped", out
    assert rows["total"][1] == "FAILED"


def test_the_cache_state_is_read_from_what_a_fresh_machine_lacks(tmp_path):
    cache = tmp_path / "cache"
    for d in ("podman/storage", "wheelhouse", "venvs"):
        (cache / d).mkdir(parents=True)
    assert ": warm" in stages(tmp_path, "ok", cache=cache).stdout
    (cache / "venvs").rmdir()
    assert "partly warm (podman/storage wheelhouse)" in stages(tmp_path, "ok", cache=cache).stdout


# A molecule stand-in: logs "start NAME t" and "end NAME t"; the jobs scenario touches
# the fleet's mark half-way (its side_effect step) unless FAKE_JOBS_FAIL is "early";
# FAKE_JOBS_FAIL=late fails it after the mark.
FAKE_MOLECULE = """\
#!/usr/bin/env bash
s=$3
echo "start $s $(date +%s.%N)" >> "$FAKE_LOG"
case $s in
  jobs)
    [[ ${FAKE_JOBS_FAIL:-} == early ]] && { echo "converge failed"; exit 1; }
    sleep 1; touch "$OLDGPU_JOBS_IMAGE_READY"; sleep 4
    [[ ${FAKE_JOBS_FAIL:-} == late ]] && { echo "verify failed"; exit 1; } ;;
  *) sleep 0.5 ;;
esac
echo "end $s $(date +%s.%N)" >> "$FAKE_LOG"
echo "===== 3 passed in 0.5s ====="
"""


def molecule_all(tmp_path: Path, *scenarios: str, **env: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "molecule"
    fake.write_text(FAKE_MOLECULE)
    fake.chmod(0o755)
    log = tmp_path / "molecule-calls.log"
    log.unlink(missing_ok=True)
    times = tmp_path / "times"
    times.unlink(missing_ok=True)
    run = subprocess.run(
        ["bash", str(MOLECULE_ALL), *scenarios],
        env=dict(
            os.environ,
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            OLDGPU_CACHE=str(tmp_path / "cache"),
            OLDGPU_STAGE_TIMES=str(times),
            FAKE_LOG=str(log),
            **env,
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    calls = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        what, name, t = line.split()
        calls[(what, name)] = float(t)
    return run, calls, times.read_text() if times.exists() else ""


def test_the_fleet_waits_for_this_runs_jobs_image_and_runs_after_the_others(tmp_path):
    run, calls, times = molecule_all(tmp_path, "default", "fleet", "jobs", "nvidia")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "two lanes: jobs default | nvidia fleet" in run.stdout
    # The fleet starts only after the jobs scenario's mark, and after the other lane's
    # scenarios; it does not wait for the jobs scenario's tests to end.
    assert calls[("start", "fleet")] >= calls[("start", "jobs")] + 1
    assert calls[("start", "fleet")] >= calls[("end", "nvidia")]
    assert calls[("start", "fleet")] < calls[("end", "jobs")]
    assert calls[("start", "nvidia")] < calls[("end", "jobs")]  # the lanes overlap
    for s in ("default", "fleet", "jobs", "nvidia"):
        assert re.search(rf"^molecule/{s} \d+ 3 passed$", times, re.M), times


def test_the_fleet_is_skipped_when_jobs_failed_before_its_image(tmp_path):
    run, calls, times = molecule_all(tmp_path, "jobs", "fleet", "default", FAKE_JOBS_FAIL="early")
    assert run.returncode == 1
    assert ("start", "fleet") not in calls
    assert "fleet skipped" in run.stdout
    assert re.search(r"^\[molecule\] fleet\s+failed$", run.stdout, re.M)
    assert "molecule/fleet 0 FAILED (skipped: no jobs image)" in times


def test_a_jobs_failure_after_its_image_fails_the_run_but_the_fleet_still_runs(tmp_path):
    run, calls, _ = molecule_all(tmp_path, "jobs", "fleet", FAKE_JOBS_FAIL="late")
    assert run.returncode == 1
    assert ("start", "fleet") in calls and ("end", "fleet") in calls
    assert re.search(r"^\[molecule\] jobs\s+failed$", run.stdout, re.M)
    assert re.search(r"^\[molecule\] fleet\s+ok$", run.stdout, re.M)


@pytest.mark.parametrize("lanes", ["1", "2"])
def test_the_fleet_comes_last_in_one_lane_and_on_the_jobs_image_in_two(tmp_path, lanes):
    run, calls, _ = molecule_all(tmp_path, "fleet", "jobs", "default", OLDGPU_MOLECULE_LANES=lanes)
    assert run.returncode == 0, run.stdout + run.stderr
    if lanes == "1":
        order = sorted((t, name) for (what, name), t in calls.items() if what == "start")
        assert [name for _, name in order] == ["jobs", "default", "fleet"]
    else:  # the fleet alone in its lane: it starts on the jobs image, beside the jobs tests
        assert calls[("start", "jobs")] + 1 <= calls[("start", "fleet")] < calls[("end", "jobs")]


def test_a_scenario_that_ran_no_test_fails(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "molecule").write_text("#!/bin/sh\necho 'collected 0 items'\n")
    (bin_dir / "molecule").chmod(0o755)
    run = subprocess.run(
        ["bash", str(MOLECULE_ALL), "default"],
        env=dict(
            os.environ,
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            OLDGPU_CACHE=str(tmp_path),
            # (not make test's own table, when these tests run inside it)
            OLDGPU_STAGE_TIMES=str(tmp_path / "times"),
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 1
    assert "default ran no test" in run.stdout
