"""Faults of a real training job under systemd, after test_jobs.py trained the smoke job.

The user raises total_steps and converges; the next start resumes from test_jobs.py's
checkpoint, and that same run is then hit by a SIGKILL mid-run, a kill during a
checkpoint write (the tracker file left empty, a checkpoint half written) and a stop
during a checkpoint write. Then a configuration error, a full disk under a job's state
directory, and the unit's sandbox and secrets. (One run proves the resume after a
converge and the faults: each verl start on CPU costs a minute of the CI budget.)
"""

from __future__ import annotations

import json
import re
import time

import pytest
from playbook import playbook
from test_jobs import CKPT, FIRST_STEPS, SECRETS, STATE, show, steps_logged
from waiting import wait_for

UNIT = "verl-train@smoke.service"
TRACKER = f"{CKPT}/latest_checkpointed_iteration.txt"
ENV = "/etc/verl/jobs/smoke.env"
# After test_jobs.py the smoke job's checkpoints end at step FIRST_STEPS (2). A CPU
# step of the smoke model takes about half a second: the tests watch the tracker file
# inside the host (a tight loop there), not the journal, to act at the right moment.
KILL_AT, LAST = 6, 20
WAIT_S = 900
# What the tests saw inside the host while the job ran (ps, the job's environ, restarts).
SEEN = "/run/oldgpu-test"


def tracker_wait(at, then="", timeout=WAIT_S):
    """Shell (for inside the host) that waits until verl's tracker reaches step `at`, then
    runs `then`; false after `timeout` s. (No single quote in `then`: it runs in bash -c.)"""
    return (
        f"end=$((SECONDS + {timeout})); while [ $SECONDS -lt $end ]; do"
        f' t=$(cat {TRACKER} 2>/dev/null); case $t in ""|*[!0-9]*) t=0;; esac;'
        f" [ $t -ge {at} ] && break; sleep 0.05; done; [ $t -ge {at} ] && {{ {then or ':'}; }}"
    )


def in_host(host, *scripts):
    """The scripts one after another in one bash inside the host, each only if the one
    before succeeded. Why one: a CPU step is half a second, and on a loaded test machine
    a podman exec takes seconds (a run once went from step 5 to its end, step 20, while
    the test made four separate execs between two steps it meant to act on)."""
    return host.check_output("bash -c '" + " && ".join(f"{{ {s}; }}" for s in scripts) + "'")


# The stop lands while a checkpoint is being written: a global_step_N newer than
# the tracker exists from the save's first file until the tracker names it.
STOP_IN_A_SAVE = (
    "end=$((SECONDS + 600)); while [ $SECONDS -lt $end ]; do"
    ' t=$(cat {tracker} 2>/dev/null); case $t in ""|*[!0-9]*) continue;; esac;'
    " [ -d {ckpt}/global_step_$((t + 1)) ] && break; done;"
    " s=$(date +%s.%N); systemctl stop {unit}; e=$(date +%s.%N); echo $t $s $e"
)


def cursor(host):
    return host.check_output("journalctl -n0 --show-cursor -q | sed -n 's/^-- cursor: //p'")


def journal(host, since, unit=UNIT):
    return host.check_output(f"journalctl -u {unit} --after-cursor '{since}' -o cat --no-pager")


def drop_in(host, unit, *lines):
    d = f"/etc/systemd/system/{unit}.d"
    items = " ".join(f"'{line}'" for line in ("[Service]", *lines))
    host.check_output(f"mkdir -p {d} && printf '%s\\n' {items} > {d}/test.conf")
    host.check_output("systemctl daemon-reload")


def ended(host, unit=UNIT):
    state = show(host, "ActiveState", unit=unit)
    return state["ActiveState"] in ("inactive", "failed")


# The smoke job as molecule.yml declares it, total_steps raised: what a user converges.
SMOKE_RAISED = {
    "name": "smoke",
    "model_path": "/var/lib/verl/smoke/model",
    "train_files": "/var/lib/verl/smoke/data/train.parquet",
    "val_files": "/var/lib/verl/smoke/data/test.parquet",
    "total_steps": LAST,
    "save_freq": 1,
    "profile": "cpu",
    "train_batch_size": 4,
    "prompt_length": 128,
    "response_length": 16,
    "overrides": ["actor_rollout_ref.actor.use_kl_loss=True"],
    "secrets": SECRETS,
}


@pytest.fixture(scope="module")
def kill_stop_resume(host):
    """One run of the smoke job to step 20, after the user raised total_steps and
    converged: resumed from test_jobs.py's checkpoint, killed, repaired, restarted,
    stopped, resumed."""
    converge = playbook("-e", json.dumps({"verl_jobs": [SMOKE_RAISED]}), "--tags", "verl_jobs")
    assert converge.rc == 0, converge.output[-3000:]
    assert f"VERL_JOB_TOTAL_STEPS='{LAST}'" in host.file(ENV).content_string
    started = cursor(host)
    # The unit waits 60 s before a restart; the test 10 s (the restart itself is systemd's).
    # And until the stop below, 30 s for what a SIGKILL leaves: systemd in this container
    # (cgroup v1, no empty-cgroup notification) waits out TimeoutStopSec after a kill that
    # took the main process too (a host on cgroup v2 is told at once).
    drop_in(host, UNIT, "RestartSec=10s", "TimeoutStopSec=30s")
    host.check_output(f"systemctl start {UNIT}")
    # At step 5, what anyone on the host sees of the running job and what the job itself
    # got (its environ as the job's user: root here lacks CAP_SYS_PTRACE, which another
    # user's environ needs); at KILL_AT, SIGKILL to every process of the job (verl, Ray's
    # workers), as a crash would.
    in_host(
        host,
        f"mkdir -p {SEEN}",
        tracker_wait(
            5,
            f"pid=$(systemctl show -p MainPID --value {UNIT});"
            f" ps -eo user,pid,args --cols 10000 > {SEEN}/ps;"
            f' runuser -u verl -- cat /proc/$pid/environ | tr "\\000" "\\n" > {SEEN}/environ',
        ),
        tracker_wait(KILL_AT, f"systemctl kill --signal=KILL {UNIT}"),
    )
    killed = cursor(host)
    host.check_output("sleep 1")
    last = int(host.file(TRACKER).content_string.strip())
    # The worst a kill during a save leaves: verl's tracker truncated by its open("w")
    # and the next step's directory half written (models, no data.pt).
    host.check_output(
        f"cd {CKPT} && for d in global_step_*; do [ ${{d#global_step_}} -gt {last} ] && rm -rf $d;"
        f" done; : > {TRACKER}; mkdir -p global_step_{last + 1}/actor;"
        f" head -c 4096 /dev/urandom > global_step_{last + 1}/actor/partial.pt;"
        f" chown -R verl:verl {CKPT}"
    )
    before_kill = journal(host, started)
    # systemd restarts it (Restart=on-failure); once the restarted run has saved a step,
    # the drop-in loses its 30 s TimeoutStopSec (the stop runs under the unit's own 300 s)
    # and a stop lands in a save.
    d = f"/etc/systemd/system/{UNIT}.d"
    stop = in_host(
        host,
        tracker_wait(
            last + 1,
            f"systemctl show -p NRestarts --value {UNIT} > {SEEN}/restarts;"
            f' printf "%s\\n" "[Service]" "RestartSec=10s" > {d}/test.conf;'
            " systemctl daemon-reload",
        ),
        STOP_IN_A_SAVE.format(tracker=TRACKER, ckpt=CKPT, unit=UNIT),
    ).split()
    stopped = cursor(host)
    restarts = int(host.file(f"{SEEN}/restarts").content_string.strip())
    newest = host.check_output(f"ls {CKPT} | sed -n 's/^global_step_//p' | sort -n | tail -n1")
    tracker_at_stop = host.file(TRACKER).content_string.strip()
    data_at_stop = host.file(f"{CKPT}/global_step_{newest.strip()}/data.pt").exists
    after_kill = journal(host, killed)
    host.check_output(f"systemctl start {UNIT}")
    wait_for("the end of the run", lambda: ended(host), every=5)
    return {
        "converge_changed": converge.recap("jobs-host")["changed"],
        "before_kill": before_kill,
        "last": last,
        "restarts": restarts,
        "after_kill": after_kill,
        "stop": stop,
        "stop_s": float(stop[2]) - float(stop[1]),
        "at_stop": (newest.strip(), tracker_at_stop, data_at_stop),
        "after_stop": journal(host, stopped),
        "result": show(host, "Result", "ExecMainStatus"),
        "ps": host.file(f"{SEEN}/ps").content_string,
        "environ": host.file(f"{SEEN}/environ").content_string,
    }


def test_start_after_raising_total_steps_resumes_from_the_checkpoint(kill_stop_resume):
    run = kill_stop_resume
    assert run["converge_changed"] >= 1  # the env file took the new total_steps
    text = run["before_kill"]
    # The step counter continues from test_jobs.py's checkpoint; it does not restart at 1.
    assert f"Setting global step to {FIRST_STEPS}" in text, text[-3000:]
    steps = sorted(steps_logged(text))
    assert steps and steps[0] == FIRST_STEPS + 1, text[-3000:]
    # (Step KILL_AT's own line comes after its save, which the kill may cut off.)
    assert set(range(FIRST_STEPS + 1, KILL_AT)) <= set(steps), text[-3000:]


def test_sigkill_restarts_and_resumes_from_the_last_complete_checkpoint(kill_stop_resume):
    run = kill_stop_resume
    last, text = run["last"], run["after_kill"]
    print(f"SIGKILL after step {last}'s checkpoint; restarts {run['restarts']}")
    assert run["restarts"] == 1, text[-3000:]
    assert "the checkpoint tracker reads ''" in text, text[-3000:]
    assert f"resuming from step {last}" in text
    assert f"removing the incomplete checkpoint global_step_{last + 1}" in text
    assert f"Setting global step to {last}" in text
    # The step counter continues after the last complete checkpoint. (The killed run's
    # own last line, its step's metrics printed after the save, may reach the journal
    # after the kill's cursor: count from the restart.)
    restarted = text[text.index("starting as user") :]
    steps = sorted(steps_logged(restarted))
    assert steps and steps[0] == last + 1, restarted[-3000:]


# (CI saw 303.5 s before verl-train reaped Ray's processes itself: with KillMode=mixed
# systemd signals only the main process, the rest waited for TimeoutStopSec.)
def test_stop_during_a_save_completes_it_within_timeoutstopsec(host, kill_stop_resume):
    assert show(host, "TimeoutStopUSec")["TimeoutStopUSec"] == "5min"
    run = kill_stop_resume
    newest, tracker, data = run["at_stop"]
    text = run["after_kill"]  # from the kill to the stop
    print(f"stop in the save after step {run['stop'][0]}: {run['stop_s']:.1f} s; newest {newest}")
    assert run["stop_s"] < 60, run["stop_s"]  # the save, verl's exit, Ray's reaped
    assert "stopped on request" in text, text[-3000:]
    # The save the stop came in was finished, not left half-written, and the job stopped
    # there: verl trains in a Ray actor, which must not go on saving steps after the
    # stop (it saved 8 more before the script froze the unit's processes). One more is
    # allowed: a save that began while the script looked (a CPU step here is 0.5 s).
    assert int(newest) - int(run["stop"][0]) in (1, 2), (newest, run["stop"])
    assert tracker == newest and data, (newest, tracker, data, text[-2000:])


def test_run_after_the_stop_resumes_and_finishes(host, kill_stop_resume):
    run = kill_stop_resume
    assert run["result"] == {"Result": "success", "ExecMainStatus": "0"}, run["after_stop"][-3000:]
    steps = sorted(steps_logged(run["after_stop"]))
    assert steps and steps[-1] == LAST, run["after_stop"][-3000:]
    # Resumed from a complete checkpoint: the first step it logs is the one after it.
    resumed = re.search(r"Setting global step to (\d+)", run["after_stop"])
    assert resumed and steps[0] == int(resumed.group(1)) + 1, run["after_stop"][-3000:]
    assert host.file(TRACKER).content_string.strip() == str(LAST)
    for step in range(1, LAST + 1):
        assert host.file(f"{CKPT}/global_step_{step}/data.pt").exists, step


# (what the env file gets, what the journal must say): a field the engine refuses, and
# overrides that break a rule verl 0.5.0 would assert only in its workers, minutes later.
# With RestartSec=1s, a restart that was coming has come after 4 s (systemd's timer, not
# the job's speed); each case waits this long once the unit failed.
NO_RESTART_S = 4
CONFIG_ERRORS = {
    "total-steps": (
        "s/^VERL_JOB_TOTAL_STEPS=.*/VERL_JOB_TOTAL_STEPS='zero'/",
        ["total_steps"],
    ),
    "micro-batch": (
        "s/^VERL_JOB_OVERRIDES=.*/VERL_JOB_OVERRIDES="
        "'[\\\"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3\\\"]'/",
        ["job broken", "ppo_micro_batch_size_per_gpu=3", "does not divide"],
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_configuration_error_does_not_restart_and_the_journal_says_why(host, case):
    edit, named = CONFIG_ERRORS[case]
    unit = "verl-train@broken.service"
    env = "/etc/verl/jobs/broken.env"
    host.check_output(
        f'sed -e "s/^VERL_JOB_NAME=.*/VERL_JOB_NAME=\'broken\'/" -e "{edit}" {ENV} > {env}'
        f" && chown root:verl {env} && chmod 0640 {env}"
    )
    assert host.file(env).content_string != host.file(ENV).content_string.replace("smoke", "broken")
    # A restart would come 1 s after the failure: NO_RESTART_S of none is a refusal.
    drop_in(host, unit, "RestartSec=1s")
    try:
        since = cursor(host)
        host.run(f"systemctl start {unit}")
        wait_for(
            "the broken job to end",
            lambda: ended(host, unit),
            timeout=120,
            explain=lambda: (
                host.run(
                    f"systemctl status --no-pager {unit}; journalctl -u {unit} --no-pager"
                    f" -o cat --after-cursor '{since}' | tail -n 60"
                ).stdout
            ),
        )
        time.sleep(NO_RESTART_S)
        state = show(host, "ActiveState", "Result", "ExecMainStatus", "NRestarts", unit=unit)
        text = journal(host, since, unit)
        assert state["ExecMainStatus"] == "4", text
        assert state["NRestarts"] == "0" and state["ActiveState"] == "failed", state
        assert "its settings are invalid" in text, text
        for word in named:
            assert word in text, (word, text[-2000:])
        assert "Traceback" not in text
    finally:
        host.run(f"rm -rf {env} /etc/systemd/system/{unit}.d; systemctl daemon-reload;")
        host.run(f"systemctl reset-failed {unit}")


def test_job_cannot_write_outside_its_state_and_log_dirs(host):
    """The unit's own sandbox (its properties, as systemd-run applies them) as the job's user."""
    props = host.check_output(
        f"systemctl cat {UNIT} | sed -n 's/^\\(ProtectSystem\\|ProtectHome\\|PrivateTmp\\|"
        "NoNewPrivileges\\|ReadWritePaths\\|CapabilityBoundingSet\\)=\\(.*\\)$/--property=\\1=\\2/p'"
    ).split("\n")
    args = " ".join(f"'{p}'" for p in props if p) + " -p StateDirectory=verl/jobs/smoke"
    args += " -p LogsDirectory=verl -p User=verl -p Group=verl"
    # /var/tmp and another job's state directory are writable for verl without the
    # sandbox (the control run below); /tmp is private and /dev/shm is Ray's object store.
    dirs = "/etc /opt/verl /usr/local /var/lib/verl /var/lib/verl/smoke"
    dirs += " /var/lib/verl/jobs/grpo-lora"
    dirs += " /var/tmp /root /home /var/log"
    probe = (
        f"for d in {dirs}; do"
        ' if touch "$d/.probe" 2>/dev/null; then echo "WROTE $d"; rm -f "$d/.probe"; fi; done;'
        f" touch {STATE}/.probe && echo STATE-OK && rm {STATE}/.probe;"
        " touch /var/log/verl/.probe && echo LOG-OK && rm /var/log/verl/.probe"
    )
    # systemd sandboxes only where it may make mount namespaces: in a container
    # without CAP_SYS_ADMIN it logs "ignoring namespace setup" and runs unsandboxed.
    enforced = host.run(
        "systemd-run --wait --pipe --quiet -p ProtectSystem=strict -p User=verl"
        " /bin/sh -c 'touch /var/tmp/.ns && echo WROTE; rm -f /var/tmp/.ns'"
    )
    if "WROTE" in enforced.stdout:
        pytest.skip("no mount namespaces in this container: systemd ignores ProtectSystem= here")
    out = host.run(f"systemd-run --wait --pipe --quiet {args} /bin/sh -c '{probe}'")
    assert "STATE-OK" in out.stdout and "LOG-OK" in out.stdout, out.stdout + out.stderr
    assert "WROTE" not in out.stdout, out.stdout
    control = host.run(f"runuser -u verl -- /bin/sh -c '{probe}'")
    assert "WROTE /var/tmp" in control.stdout, control.stdout + control.stderr
    assert "WROTE /var/lib/verl/jobs/grpo-lora" in control.stdout, control.stdout


def test_secrets_reach_the_job_and_nothing_else(host, kill_stop_resume):
    secrets = host.file("/etc/verl/jobs/smoke.secrets.env")
    assert (secrets.user, secrets.group, secrets.mode) == ("root", "root", 0o600)
    environ = kill_stop_resume["environ"].splitlines()
    log = host.check_output("cat /var/log/verl/smoke.log")
    every = host.check_output(f"journalctl -u {UNIT} -o cat --no-pager")
    for key, value in SECRETS.items():
        assert f"{key}={value}" in environ, key  # the job got it (systemd's EnvironmentFile=)
        assert value not in kill_stop_resume["ps"]
        assert value not in log and value not in every
        assert value not in host.file(ENV).content_string


def test_apt_sources_are_signed_and_nothing_under_opt_verl_is_world_writable(host):
    bad = host.run(
        "grep -rhs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | grep -v signed-by"
    )
    assert bad.stdout.strip() == "", bad.stdout
    for source in host.check_output("ls /etc/apt/sources.list.d/").split():
        if source.endswith(".sources"):
            text = host.file(f"/etc/apt/sources.list.d/{source}").content_string
            # Debian's own (debian.sources) is signed by the archive keyring it names.
            assert "Signed-By:" in text, source
    writable = host.check_output("find /opt/verl -xdev -perm -0002 ! -type l | head -n 20")
    assert writable.strip() == "", writable


def test_security_exposure_score(host):
    out = host.check_output(f"systemd-analyze security --no-pager {UNIT}")
    score = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", out).group(1))
    print(f"systemd-analyze security {UNIT}: {score}")
    assert score <= 5.0


DISKFULL = "verl-train@diskfull.service"
DF_STATE = "/var/lib/verl/jobs/diskfull"
DF_CKPT = f"{DF_STATE}/checkpoints"
FILLER = f"{DF_STATE}/filler"


def test_disk_full_fails_cleanly_and_resumes_from_the_last_complete_checkpoint(host):
    """The job's state directory is a 512 MiB tmpfs (molecule.yml); a filler leaves room
    for one checkpoint and a half, so the second save runs out of space."""
    assert host.mount_point(DF_STATE).filesystem == "tmpfs"
    one = int(host.check_output(f"du -sb {CKPT}/global_step_1 | cut -f1"))
    avail = int(host.check_output(f"df --output=avail -B1 {DF_STATE} | tail -n1"))
    host.check_output(f"fallocate -l {avail - one - one // 2} {FILLER}")
    since = cursor(host)
    host.check_output(f"systemctl start {DISKFULL}")

    def failed():
        s = show(host, "ActiveState", "SubState", "Result", unit=DISKFULL)
        return s if s["Result"] not in ("success",) or s["ActiveState"] == "inactive" else None

    state = wait_for("diskfull to fail", failed, every=3)
    text = journal(host, since, DISKFULL)
    print(f"disk full: one checkpoint {one} B; {state}")
    assert state["Result"] == "exit-code", text[-3000:]
    # ENOSPC, in the OS's words or torch's ("failed writing file ...: file write failed").
    assert "No space left on device" in text or "file write failed" in text, text[-3000:]
    assert sorted(steps_logged(text)) == [1], text[-3000:]
    assert host.file(f"{DF_CKPT}/global_step_1/data.pt").exists
    tracker = host.file(f"{DF_CKPT}/latest_checkpointed_iteration.txt").content_string.strip()
    assert tracker in ("1", ""), tracker  # never a step whose save failed

    # The user frees space and starts it again: it resumes from step 1 and finishes.
    host.check_output(f"systemctl stop {DISKFULL}; rm -f {FILLER}")
    since = cursor(host)
    host.check_output(f"systemctl start {DISKFULL}")
    wait_for("diskfull to finish", lambda: ended(host, DISKFULL), every=5)
    text = journal(host, since, DISKFULL)
    assert show(host, "Result", unit=DISKFULL)["Result"] == "success", text[-3000:]
    assert "Setting global step to 1" in text, text[-3000:]
    assert sorted(steps_logged(text)) == [2, 3], text[-3000:]
    assert host.file(f"{DF_CKPT}/latest_checkpointed_iteration.txt").content_string.strip() == "3"
