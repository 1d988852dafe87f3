"""Start a converge of the scenario and kill it in the middle of an install, on purpose.

Run from a scenario's prepare playbook (molecule's environment: its inventory,
ANSIBLE_CONFIG, podman settings). It starts ``ansible-playbook converge.yml``
against the test host, waits until a process matching ``--when`` runs inside
the host (dpkg unpacking the driver, pip filling the venv) while ``--ready`` (a
shell test in the host) passes, waits ``--after`` seconds more, and kills one of two:

- ``--kill controller``: ansible-playbook itself (SIGKILL to its process group),
  as a closed laptop or a dropped SSH session does. What it had started in the
  host may run on.
- ``--kill host --pattern RE``: the processes matching RE inside the host
  (SIGKILL), as the OOM killer or a person's kill does; the play then fails.

What happened is appended to /var/lib/oldgpu-faults/interrupted.log in the host;
the scenario's converge (which must complete), idempotence (changed=0) and tests
(which read that log) come after. Exit status: 0 when the kill landed, 1 when
the converge ended or timed out before the process showed up (the fault was not
exercised: the scenario must not pass on that).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RECORD = "/var/lib/oldgpu-faults/interrupted.log"


def in_host(host: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", "exec", host, "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        check=False,
    )


def matching(host: str, pattern: str) -> str:
    # pgrep run directly, not through a shell whose own command line holds the pattern.
    out = subprocess.run(
        ["podman", "exec", host, "pgrep", "-af", "--", pattern],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return out.strip()


def failure_excerpt(lines: list[str], head: int = 40, tail: int = 25) -> list[str]:
    """What says why a converge ended: the first failed task's report from its start
    (its msg and stderr come before a long stdout), then the log's end (the recap)."""
    first = next((i for i, line in enumerate(lines) if "fatal: [" in line or "FAILED! =>" in line),
                 None)  # fmt: skip
    if first is None or first >= len(lines) - tail:
        return lines[-(head + tail) :]
    return [*lines[first : first + head], "  ...", *lines[-tail:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", required=True)
    ap.add_argument("--name", required=True, help="what this fault is called in the record")
    ap.add_argument("--when", required=True, help="extended regex of the process to wait for")
    ap.add_argument("--ready", default="true", help="and a shell test that passes in the host")
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--kill", choices=("controller", "host"), required=True)
    ap.add_argument("--pattern", help="with --kill host: the processes to kill (regex)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--log", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.kill == "host" and not args.pattern:
        ap.error("--kill host needs --pattern")

    scenario = os.environ["MOLECULE_SCENARIO_DIRECTORY"]
    inventory = os.path.join(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"], "inventory")
    cmd = ["ansible-playbook", "-i", inventory, "--limit", args.host, f"{scenario}/converge.yml"]
    start = time.monotonic()
    with open(args.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen = ""
    while time.monotonic() - start < args.timeout and proc.poll() is None:
        seen = matching(args.host, args.when)
        if seen and in_host(args.host, args.ready).returncode != 0:
            seen = ""
        if seen:
            break
        time.sleep(1)
    if not seen:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        why = f"no process matching {args.when!r} in {args.host} before the converge ended"
        print(f"interrupt {args.name}: {why} (rc {proc.poll()}); see {args.log}", file=sys.stderr)
        # The log lives in molecule's ephemeral directory, which destroy removes: its
        # end goes to stderr, so the scenario's own log keeps why the converge ended.
        lines = args.log.read_text(errors="replace").splitlines()
        print("\n".join(f"  | {line}" for line in failure_excerpt(lines)), file=sys.stderr)
        return 1
    time.sleep(args.after)
    at = time.monotonic() - start
    if args.kill == "controller":
        os.killpg(proc.pid, signal.SIGKILL)
        killed = f"ansible-playbook (pid {proc.pid})"
    else:
        killed = matching(args.host, args.pattern).replace("\n", " | ")[:600]
        subprocess.run(
            ["podman", "exec", args.host, "pkill", "-KILL", "-f", "--", args.pattern], check=False
        )
    rc = proc.wait()
    time.sleep(2)
    left = matching(args.host, args.when).replace("\n", " | ")[:300] or "none"
    line = (
        f"{args.name}: kill {args.kill} at {at:.0f} s while '{args.when}' ran; killed {killed};"
        f" converge rc {rc}; still running in the host 2 s later: {left}"
    )
    in_host(args.host, f"mkdir -p {os.path.dirname(RECORD)}")
    subprocess.run(
        ["podman", "exec", "-i", args.host, "/bin/sh", "-c", f"cat >> {RECORD}"],
        input=line + "\n",
        text=True,
        check=True,
    )
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
