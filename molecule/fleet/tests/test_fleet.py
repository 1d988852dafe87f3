"""A user's checks of a three-host Ray cluster under systemd: it forms, loses and
regains a worker, a worker cut off from its head fails clearly and slowly, a job
trains across two nodes and survives a worker killed in its middle."""

import itertools
import os
import re
import time
from pathlib import Path

import pytest
import testinfra
from playbook import PROJECT
from waiting import wait_for

WORKERS = ("fleet-w1", "fleet-w2")
RAY = "/opt/verl/venv/bin/ray"
WAIT_S = 240
# The unit's RestartSec= and the scenario's ray_cluster_head_wait_s.
RESTART_SEC, HEAD_WAIT_S = 15, 10
# Where the test leaves the `ray status` it saw (for the report).
SEEN = Path(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/tmp")) / "ray-status.txt"


def worker(name):
    return testinfra.get_host(f"podman://{name}")


def head_ip(host):
    cmd = "ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -n1"
    return host.check_output(cmd)


def ray_status(host):
    return host.run(f"{RAY} status --address={head_ip(host)}:6379")


def active_nodes(text):
    active = text.split("Active:", 1)[-1].split("Pending:", 1)[0]
    return re.findall(r"^\s*\d+ (node_[0-9a-f]+)", active, re.M)


def wait_nodes(host, count):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        out = ray_status(host)
        if out.rc == 0 and len(active_nodes(out.stdout)) == count:
            return out.stdout
        time.sleep(5)
    pytest.fail(f"not {count} nodes after {WAIT_S} s:\n{out.stdout}\n{out.stderr}")


def test_units_are_the_projects_files(host):
    for h, unit in (
        (host, "ray-head.service"),
        *((worker(w), "ray-worker.service") for w in WORKERS),
    ):
        installed = h.file(f"/etc/systemd/system/{unit}")
        assert (installed.user, installed.mode) == ("root", 0o644)
        assert installed.content_string == (PROJECT / "files/systemd" / unit).read_text()
        assert h.service(unit).is_enabled and h.service(unit).is_running
        other = "ray-worker.service" if unit == "ray-head.service" else "ray-head.service"
        assert not h.service(other).is_enabled
        env = h.file("/etc/verl/ray/node.env")
        assert (env.user, env.group, env.mode) == ("root", "verl", 0o640)
        # Ray runs as verl, from the venv.
        owner = h.check_output("ps -o user= -C raylet | sort -u")
        assert owner.split() == ["verl"], owner


def test_units_pass_systemd_verify_and_score_5_or_better(host):
    for h, unit in ((host, "ray-head.service"), (worker(WORKERS[0]), "ray-worker.service")):
        verify = h.run(f"systemd-analyze verify {unit}")
        assert verify.rc == 0, verify.stderr
        out = h.run(f"systemd-analyze security --no-pager {unit}")
        score = re.search(r"Overall exposure level for \S+: ([\d.]+ \S+)", out.stdout)
        assert score, out.stdout[-2000:]
        print(f"systemd-analyze security {unit}: {score.group(1)}")
        assert float(score.group(1).split()[0]) <= 5.0, out.stdout[-2000:]


def test_ray_status_lists_three_nodes_with_resources(host):
    status = wait_nodes(host, 3)
    SEEN.write_text(status)
    print(f"ray status on the head:\n{status}")
    assert re.search(r"0\.0/6\.0 CPU", status), status  # 2 CPUs per container
    assert "object_store_memory" in status


def test_stopping_a_worker_drops_it_and_starting_brings_it_back(host):
    w1 = worker(WORKERS[0])
    w1.check_output("systemctl stop ray-worker.service")
    assert not w1.service("ray-worker.service").is_running
    wait_nodes(host, 2)
    w1.check_output("systemctl start ray-worker.service")
    wait_nodes(host, 3)


def test_a_worker_without_its_head_fails_clearly_and_not_faster_than_restartsec(host):
    w2 = worker(WORKERS[1])
    # The head stays up for the others; this worker is pointed at an address
    # where nothing answers (a later EnvironmentFile= overrides the role's).
    w2.check_output(
        "mkdir -p /run/systemd/system/ray-worker.service.d /run/fleet-test && "
        "echo RAY_HEAD_ADDRESS=127.0.0.1 > /run/fleet-test/unreachable.env && "
        "printf '[Service]\\nEnvironmentFile=/run/fleet-test/unreachable.env\\n' "
        "> /run/systemd/system/ray-worker.service.d/unreachable.conf && systemctl daemon-reload"
    )
    try:
        cursor = w2.check_output("journalctl -n0 --show-cursor -q | sed -n 's/^-- cursor: //p'")
        w2.check_output("systemctl restart --no-block ray-worker.service")

        def seen():
            """The journal's starts and failures since the restart, once two failed."""
            journal = w2.check_output(
                f"journalctl -u ray-worker.service --after-cursor '{cursor}' -o short-unix"
                " --no-pager"
            )
            events = [
                ("fail" if "did not answer" in line else "start", float(line.split()[0]))
                for line in journal.splitlines()
                if "ray-head-unreachable: the Ray head at 127.0.0.1:6379 did not answer" in line
                or "Starting ray-worker.service" in line
            ]
            return (journal, events) if sum(k == "fail" for k, _ in events) >= 2 else None

        # Two tries, each its bounded wait, with RestartSec between: read as they happen.
        journal, events = wait_for(
            "two failed tries of the cut-off worker", seen, timeout=4 * (HEAD_WAIT_S + RESTART_SEC)
        )
        for (a, ta), (b, tb) in itertools.pairwise(events):
            if (a, b) == ("fail", "start"):  # systemd waits RestartSec before it tries again
                assert tb - ta >= RESTART_SEC - 0.5, (tb - ta, journal)
            if (a, b) == ("start", "fail"):  # each try waits the whole bounded wait
                assert tb - ta >= HEAD_WAIT_S - 0.5, (tb - ta, journal)
        assert int(w2.check_output("systemctl show -p NRestarts --value ray-worker.service")) >= 1
    finally:
        w2.check_output(
            "rm -rf /run/systemd/system/ray-worker.service.d /run/fleet-test && "
            "systemctl daemon-reload && systemctl reset-failed ray-worker.service; "
            "systemctl restart ray-worker.service"
        )
    wait_nodes(host, 3)


JOB = "verl-train@smoke.service"
STATE = "/var/lib/verl/jobs/smoke"
JOB_STEPS = 2
JOB_TIMEOUT_S = 900
# Where the test leaves the job's step lines (for the report).
STEPS_SEEN = SEEN.with_name("cluster-job-steps.txt")


def show(host, unit, *props):
    out = host.check_output(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.fixture(scope="module")
def cluster_run(host):
    """The smoke job with `cluster: ray`, started on the head, run to its end."""
    wait_nodes(host, 3)
    cursor = host.check_output("journalctl -n0 --show-cursor -q | sed -n 's/^-- cursor: //p'")
    host.check_output(f"systemctl start {JOB}")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        state = show(host, JOB, "ActiveState")
        if state["ActiveState"] in ("inactive", "failed"):
            break
        time.sleep(5)
    else:
        pytest.fail(f"{JOB} still {state} after {JOB_TIMEOUT_S} s")
    journal = host.check_output(f"journalctl -u {JOB} --after-cursor '{cursor}' -o cat --no-pager")
    return show(host, JOB, "Result", "ExecMainStatus"), journal


def test_cluster_job_trains_across_the_two_workers(host, cluster_run):
    result, journal = cluster_run
    assert result["Result"] == "success", journal[-6000:]
    command = next(line for line in journal.splitlines() if line.startswith("verl-train: /"))
    assert " trainer.nnodes=2" in command and " trainer.n_gpus_per_node=1" in command
    steps = {int(m.group(1)): m.group(0) for m in re.finditer(r"step:(\d+) - .*", journal)}
    STEPS_SEEN.write_text("\n".join(steps[k] for k in sorted(steps)) + "\n")
    print("the two-node job's steps:\n" + STEPS_SEEN.read_text())
    assert sorted(steps) == list(range(1, JOB_STEPS + 1)), journal[-6000:]
    for line in steps.values():
        assert "actor/pg_loss:" in line and "critic/vf_loss:" in line


def test_cluster_job_wrote_its_checkpoint_on_both_workers(host, cluster_run):
    step = f"{STATE}/checkpoints/global_step_{JOB_STEPS}/actor"
    shards = []
    for name in WORKERS:
        w = worker(name)
        found = w.check_output(
            f"ls {step} 2>/dev/null | grep -E '^model_world_size_2_rank_' || true"
        )
        shards += found.split()
        assert found.strip(), f"no checkpoint shard on {name}"
    assert sorted(shards) == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    latest = [
        h.file(f"{STATE}/checkpoints/latest_checkpointed_iteration.txt")
        for h in (host, *map(worker, WORKERS))
    ]
    assert [f.content_string.strip() for f in latest if f.exists] == [str(JOB_STEPS)]


# A worker's unit killed in the middle of a job: the job (resumed from the run
# above to KILL_LAST) loses that worker's ranks and fails, systemd restarts it
# (RestartSec 20 s here, 60 s in the unit; the restart itself is systemd's), and
# once the worker's own unit has brought it back (its RestartSec, 15 s) the job
# resumes from its last checkpoint. A restart that comes before the worker is back
# finds the cluster not whole (cluster-nodes-missing, exit 5) and tries again.
KILL_AFTER, KILL_LAST = 4, 30
TRACKER = f"{STATE}/checkpoints/latest_checkpointed_iteration.txt"


def cursor(host):
    return host.check_output("journalctl -n0 --show-cursor -q | sed -n 's/^-- cursor: //p'")


def journal(host, since, unit=JOB):
    return host.check_output(f"journalctl -u {unit} --after-cursor '{since}' -o cat --no-pager")


def steps_in(text):
    return sorted({int(m.group(1)) for m in re.finditer(r"step:(\d+) - ", text)})


@pytest.fixture(scope="module")
def killed_worker_run(host, cluster_run):
    w1 = worker(WORKERS[0])
    wait_nodes(host, 3)
    env = "/etc/verl/jobs/smoke.env"
    host.check_output(
        f"sed -i \"s/^VERL_JOB_TOTAL_STEPS=.*/VERL_JOB_TOTAL_STEPS='{KILL_LAST}'/\" {env}"
    )
    drop_in = f"/run/systemd/system/{JOB}.d"
    host.check_output(
        f"mkdir -p {drop_in} && printf '[Service]\\nRestartSec=20s\\n' > {drop_in}/test.conf"
        f" && systemctl daemon-reload; systemctl reset-failed {JOB} 2>/dev/null || true"
    )
    # systemd in these containers (cgroup v1, no empty-cgroup notification) waits out
    # TimeoutStopSec (60 s) after a SIGKILL that took the unit's main process; a host on
    # cgroup v2 is told at once. 10 s here, so the worker is back within the job's
    # restarts (StartLimitBurst) as it would be on a host.
    worker_drop_in = "/run/systemd/system/ray-worker.service.d"
    w1.check_output(
        f"mkdir -p {worker_drop_in} && printf '[Service]\\nTimeoutStopSec=10s\\n'"
        f" > {worker_drop_in}/test.conf && systemctl daemon-reload"
    )
    try:
        started = time.monotonic()
        host.check_output(f"systemctl start {JOB}")
        # A CPU step takes under a second: wait inside the host that holds verl's
        # tracker (the driver's node, where the run above left it), a tight loop there.
        watched = next(h for h in (host, *map(worker, WORKERS)) if h.file(TRACKER).exists)
        at_kill = int(
            watched.check_output(
                f"bash -c 'end=$((SECONDS + {JOB_TIMEOUT_S})); while [ $SECONDS -lt $end ]; do"
                f' t=$(cat {TRACKER} 2>/dev/null); case $t in ""|*[!0-9]*) t=0;; esac;'
                f" [ $t -ge {KILL_AFTER} ] && break; sleep 0.05; done; echo $t'"
            )
        )
        assert at_kill >= KILL_AFTER, f"the job did not reach step {KILL_AFTER}"
        killed = cursor(host)
        w1.check_output("systemctl kill --signal=KILL ray-worker.service")
        kill_t = time.monotonic()
        wait_for("the job's restart", lambda: int(show(host, JOB, "NRestarts")["NRestarts"]) >= 1)
        restart_t = time.monotonic()
        # read now: the unit's count is 0 again by the time the job has ended
        restarts = show(host, JOB, "NRestarts")["NRestarts"]
        wait_for(
            "the end of the job",
            lambda: show(host, JOB, "ActiveState")["ActiveState"] in ("inactive", "failed"),
            every=5,
        )
        end_t = time.monotonic()
        return {
            "at_kill": at_kill,
            "after_kill": journal(host, killed),
            "result": show(host, JOB, "Result", "ExecMainStatus", "NRestarts"),
            "worker": show(w1, "ray-worker.service", "NRestarts", "ActiveState"),
            "restarts": restarts,
            "to_restart_s": restart_t - kill_t,
            "total_s": end_t - started,
            "nodes": wait_nodes(host, 3),
        }
    finally:
        host.check_output(f"rm -rf {drop_in} && systemctl daemon-reload")
        w1.check_output(f"rm -rf {worker_drop_in} && systemctl daemon-reload")


def test_killing_a_worker_mid_job_fails_it_and_it_resumes_when_the_worker_is_back(
    host, killed_worker_run
):
    run = killed_worker_run
    text = run["after_kill"]
    # The run that lost the worker failed; systemd restarted the job.
    failed = re.search(r"Main process exited, code=exited, status=(\d+)", text)
    assert failed and failed.group(1) not in ("0", "3", "4"), text[-6000:]
    assert "Scheduled restart job" in text, text[-6000:]
    # The worker's unit brought it back by itself (Restart=on-failure).
    assert run["worker"] == {"NRestarts": "1", "ActiveState": "active"}, run["worker"]
    # The last start resumed from the last complete checkpoint and trained to the end.
    last_start = text.rsplit("verl-train: job smoke starting as user", 1)[-1]
    resumed = re.search(r"Setting global step to (\d+)", last_start)
    steps = steps_in(last_start)
    print(
        f"worker killed after step {run['at_kill']}; the job restarted "
        f"{run['restarts']} time(s), {run['to_restart_s']:.0f} s after the kill; "
        f"resumed from step {resumed.group(1) if resumed else '?'}, trained steps {steps}; "
        f"{run['total_s']:.0f} s from start to end"
    )
    assert run["result"]["Result"] == "success", last_start[-6000:]
    assert resumed and int(resumed.group(1)) >= run["at_kill"], last_start[-6000:]
    assert steps == list(range(int(resumed.group(1)) + 1, KILL_LAST + 1)), last_start[-6000:]
    trackers = [
        h.file(f"{STATE}/checkpoints/latest_checkpointed_iteration.txt")
        for h in (host, *map(worker, WORKERS))
    ]
    assert [f.content_string.strip() for f in trackers if f.exists] == [str(KILL_LAST)]
