"""``oldgpu status``: how each training job is doing, from what it leaves on disk.

Per job (default: every ``/etc/verl/jobs/<name>.env``): the state of its unit
``verl-train@<name>.service`` (``systemctl show``; "unknown" where there is no
systemd to ask), the last step of ``total_steps``, steps per hour (event wall
times of the recent steps of the current run), the last reward and KL, the last
checkpoint and the log file.

Metrics come from the job's TensorBoard event files (verl's tracking adapter:
``SummaryWriter(TENSORBOARD_DIR).add_scalar(key, value, step)`` for every metric
each step), read with TensorBoard's own reader, imported only when needed so
this module imports on the system python; ``REQUIRES`` makes the CLI re-run the
command with the training venv's python. A restart that resumes from a
checkpoint writes the steps after it again, in a new event file: the later
writes replace the earlier ones (TensorBoard's orphaned-data rule).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from oldgpu import jobs, subcommand
from oldgpu.output import EngineError, Result

REQUIRES = ("tensorboard",)

UNIT_TEMPLATE = "verl-train@{}.service"
UNIT_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "ExecMainStatus",
    "NRestarts",
    "ActiveEnterTimestamp",
    "UnitFileState",
)
SYSTEMCTL_TIMEOUT_S = 15

# verl's metric names (verl/trainer/ppo/metric_utils.py, ray_trainer.py, dp_actor.py).
STEP_KEYS = ("training/global_step", "timing_s/step")
REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")
# kl_loss: use_kl_loss (GRPO); reward_kl_penalty: use_kl_in_reward; ppo_kl: always.
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")
STEP_SECONDS_KEY = "timing_s/step"
RATE_WINDOW = 10  # steps per hour over the last this many step intervals
CHECKPOINT_MARKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_DIR_RE = re.compile(r"^global_step_(\d+)$")
EVENT_NAME_RE = re.compile(r"tfevents\.(\d+)")


class Point(NamedTuple):
    step: int
    wall_time: float
    value: float
    run: int  # which event file (one per trainer start) it came from


Scalars = dict[str, list[Point]]
# ``systemctl ARGS...`` -> stdout; FileNotFoundError where there is no systemctl,
# SystemctlError where it cannot answer (no systemd as PID 1, say).
Systemctl = Callable[[Sequence[str]], str]


class SystemctlError(RuntimeError):
    pass


# ---------------------------------------------------------------------------
# The unit.


def run_systemctl(argv: Sequence[str]) -> str:
    exe = shutil.which("systemctl")
    if exe is None:
        raise FileNotFoundError("systemctl")
    try:
        proc = subprocess.run(
            [exe, *argv],
            capture_output=True,
            text=True,
            timeout=SYSTEMCTL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SystemctlError(f"no answer in {SYSTEMCTL_TIMEOUT_S}s") from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise SystemctlError(lines[0] if lines else f"exit status {proc.returncode}")
    return proc.stdout


def parse_show(text: str) -> dict[str, str]:
    """``systemctl show --property=...`` output: ``Key=value`` lines, in systemd's order."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "[not set]") else None
    except ValueError:
        return None


def unit_summary(unit: Mapping[str, Any]) -> str:
    """One phrase: ``active (running)``, ``failed (exit-code, status 1)``, ``not installed``."""
    state = unit.get("state") or "unknown"
    if state == "unknown":
        return "unknown"
    if unit.get("load_state") == "not-found":
        return "not installed"
    details = [unit["sub_state"]] if unit.get("sub_state") not in (None, "", state) else []
    if unit.get("result") not in (None, "", "success"):
        details.append(unit["result"])
    if unit.get("exit_status") and state != "active":
        details.append(f"status {unit['exit_status']}")
    if unit.get("restarts"):
        count = unit["restarts"]
        details.append(f"{count} restart{'s' if count != 1 else ''}")
    return f"{state} ({', '.join(details)})" if details else state


def unit_state(name: str, systemctl: Systemctl | None = None) -> dict[str, Any]:
    unit = UNIT_TEMPLATE.format(name)
    runner = run_systemctl if systemctl is None else systemctl
    try:
        props = parse_show(runner(["show", f"--property={','.join(UNIT_PROPERTIES)}", unit]))
    except FileNotFoundError:
        return {"unit": unit, "state": "unknown", "summary": "unknown", "error": "no systemctl"}
    except (SystemctlError, OSError) as exc:
        return {
            "unit": unit,
            "state": "unknown",
            "summary": "unknown",
            "error": f"systemctl: {exc}",
        }
    since = props.get("ActiveEnterTimestamp", "")
    doc: dict[str, Any] = {
        "unit": unit,
        "load_state": props.get("LoadState") or None,
        "state": props.get("ActiveState") or "unknown",
        "sub_state": props.get("SubState") or None,
        "result": props.get("Result") or None,
        "exit_status": _int_or_none(props.get("ExecMainStatus")),
        "restarts": _int_or_none(props.get("NRestarts")),
        "active_since": since if since and since != "n/a" else None,
        "enabled": props.get("UnitFileState") or None,
    }
    doc["summary"] = unit_summary(doc)
    return doc


# ---------------------------------------------------------------------------
# The event files.


def event_files(tensorboard_dir: Path) -> list[Path]:
    """The event files under a directory, oldest writer first."""

    def order(path: Path) -> tuple[int, int, str]:
        # The writer's start (in the name, whole seconds), then the last write.
        stat = path.stat()
        found = EVENT_NAME_RE.search(path.name)
        return (int(found.group(1)) if found else int(stat.st_mtime), stat.st_mtime_ns, str(path))

    if not tensorboard_dir.is_dir():
        return []
    if not os.access(tensorboard_dir, os.R_OK | os.X_OK):
        raise PermissionError(f"cannot read {tensorboard_dir}: permission denied")
    files = [p for p in tensorboard_dir.rglob("*tfevents*") if p.is_file()]
    return sorted(files, key=order)


def _load_file(path: Path) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(
        str(path),
        size_guidance={event_accumulator.SCALARS: 0},  # 0: keep every point
        purge_orphaned_data=False,  # done across files in read_scalars
    )
    acc.Reload()
    return {
        tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def read_scalars(tensorboard_dir: Path) -> Scalars:
    """Every scalar series, by step; a step written again (a resumed run) replaces
    the points from it on."""
    series: Scalars = {}
    for run, path in enumerate(event_files(tensorboard_dir)):
        for tag, events in _load_file(path).items():
            points = series.setdefault(tag, [])
            for step, wall_time, value in events:
                while points and points[-1].step >= step:
                    points.pop()
                points.append(Point(int(step), float(wall_time), float(value), run))
    return series


def steps_per_hour(points: Sequence[Point], window: int = RATE_WINDOW) -> float | None:
    """From wall times of the last ``window`` intervals of the current run."""
    if not points:
        return None
    run = points[-1].run
    tail: list[Point] = []
    for point in reversed(points):
        if point.run != run or len(tail) > window:
            break
        tail.append(point)
    if len(tail) < 2:
        return None
    last, first = tail[0], tail[-1]
    seconds = last.wall_time - first.wall_time
    if seconds <= 0:
        return None
    return (last.step - first.step) * 3600.0 / seconds


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds")


def first_present(scalars: Mapping[str, Sequence[Point]], keys: Iterable[str]) -> str | None:
    return next((key for key in keys if scalars.get(key)), None)


def _last(scalars: Mapping[str, Sequence[Point]], keys: Iterable[str]) -> dict[str, Any] | None:
    key = first_present(scalars, keys)
    if key is None:
        return None
    point = scalars[key][-1]
    return {"key": key, "value": _finite(point.value), "step": point.step}


def step_series(scalars: Mapping[str, Sequence[Point]]) -> list[Point]:
    """The series that marks steps: verl's ``training/global_step``, else the longest."""
    key = first_present(scalars, STEP_KEYS)
    if key is None and scalars:
        key = max(scalars, key=lambda k: (len(scalars[k]), k))
    return list(scalars[key]) if key else []


def summarize(scalars: Mapping[str, Sequence[Point]], total_steps: int | None) -> dict[str, Any]:
    steps = step_series(scalars)
    last = steps[-1] if steps else None
    rate = steps_per_hour(steps)
    seconds = _last(scalars, (STEP_SECONDS_KEY,))
    eta = None
    if rate and last is not None and total_steps:
        eta = max(total_steps - last.step, 0) / rate
    return {
        "last_step": last.step if last else None,
        "last_step_at": _iso(last.wall_time) if last else None,
        "steps_per_hour": round(rate, 3) if rate else None,
        "eta_hours": round(eta, 2) if eta is not None else None,
        "step_seconds": seconds["value"] if seconds else None,
        "reward": _last(scalars, REWARD_KEYS),
        "kl": _last(scalars, KL_KEYS),
        "runs": len({p.run for p in steps}),
    }


# ---------------------------------------------------------------------------
# Checkpoints, the log, a job.


def last_checkpoint(checkpoints: Path) -> dict[str, Any] | None:
    """verl's ``latest_checkpointed_iteration.txt`` and its ``global_step_N``; else
    the highest ``global_step_N`` (a save cut before the marker was written)."""
    marker = checkpoints / CHECKPOINT_MARKER
    step: int | None = None
    recorded = False
    try:
        step = int(marker.read_text(encoding="utf-8").strip())
        recorded = True
    except (OSError, ValueError):
        try:
            found = [
                int(m.group(1))
                for p in checkpoints.iterdir()
                if p.is_dir() and (m := CHECKPOINT_DIR_RE.match(p.name))
            ]
        except OSError:
            found = []
        step = max(found) if found else None
    if step is None:
        return None
    path = checkpoints / f"global_step_{step}"
    try:
        mtime: float | None = path.stat().st_mtime
    except OSError:
        mtime = None
    return {
        "step": step,
        "path": str(path),
        "exists": mtime is not None,
        "mtime": _iso(mtime),
        "recorded": recorded,
    }


def job_paths(name: str, job: jobs.Job | None, state_root: Path) -> dict[str, Path]:
    state = state_root / name
    if job is not None:
        return job.paths({"STATE_DIRECTORY": str(state)})
    return {
        "state": state,
        "checkpoints": state / "checkpoints",
        "tensorboard": state / "tensorboard",
    }


def cluster_of(job: jobs.Job | None, state: Path) -> dict[str, Any] | None:
    """A cluster job's cluster: its settings, and the shape its last start chose (plan.json)."""
    if job is None or not job.cluster:
        return None
    out: dict[str, Any] = {
        "name": job.cluster,
        "address": job.cluster_address,
        "nodes": job.cluster_nodes,
        "nnodes": None,
        "n_gpus_per_node": None,
    }
    try:
        planned = json.loads((state / "plan.json").read_text(encoding="utf-8")).get("cluster")
    except (OSError, ValueError, AttributeError):
        planned = None
    if isinstance(planned, dict):
        out.update({k: planned.get(k) for k in ("nnodes", "n_gpus_per_node")})
    return out


def job_status(
    name: str,
    *,
    jobs_dir: Path = jobs.JOBS_DIR,
    state_root: Path = jobs.STATE_DIR,
    log_dir: Path = jobs.LOG_DIR,
    systemctl: Systemctl | None = None,
) -> dict[str, Any]:
    notes: list[str] = []
    job: jobs.Job | None = None
    try:
        job = jobs.load_job(name, jobs_dir)
    except EngineError as exc:
        notes.append(f"settings: {exc.message}")
    paths = job_paths(name, job, state_root)
    total = job.total_steps if job else None
    metrics: dict[str, Any] = summarize({}, total)
    metrics["event_files"] = 0
    try:
        files = event_files(paths["tensorboard"])
        metrics["event_files"] = len(files)
        if files:
            metrics.update(summarize(read_scalars(paths["tensorboard"]), total))
        if metrics["last_step"] is None:
            notes.append(f"metrics: no steps logged under {paths['tensorboard']} yet")
    except OSError as exc:
        notes.append(f"metrics: {exc}")
    unit = unit_state(name, systemctl)
    if unit.get("error"):
        notes.append(f"unit: {unit['error']}")
    log = log_dir / f"{name}.log"
    cluster = cluster_of(job, paths["state"])
    if cluster:
        shape = (
            f"{cluster['nnodes']} node(s) x {cluster['n_gpus_per_node']} GPU(s)"
            if cluster.get("nnodes")
            else "not started yet"
        )
        notes.append(
            f"cluster {cluster['name']} at {cluster['address']} "
            f"({cluster['nodes']} host(s) in the inventory): {shape}; its metrics and "
            "checkpoint marker are on the node that runs verl's trainer"
        )
    return {
        "name": name,
        "cluster": cluster,
        "unit": unit,
        "total_steps": total,
        "state_dir": str(paths["state"]),
        "tensorboard_dir": str(paths["tensorboard"]),
        "metrics": metrics,
        "checkpoint": last_checkpoint(paths["checkpoints"]),
        "log": {"path": str(log), "exists": log.is_file()},
        "notes": notes,
    }


def collect(
    names: Sequence[str] = (),
    *,
    jobs_dir: Path = jobs.JOBS_DIR,
    state_root: Path = jobs.STATE_DIR,
    log_dir: Path = jobs.LOG_DIR,
    systemctl: Systemctl | None = None,
) -> list[dict[str, Any]]:
    """The status of the named jobs, else of every job under ``jobs_dir``."""
    known = jobs.job_names(jobs_dir)
    for name in names:
        if not jobs.NAME_RE.match(name):
            raise EngineError("job-unknown", f"{name!r} is not a job name")
        if name not in known and not (state_root / name).is_dir():
            raise EngineError(
                "job-unknown",
                f"no job {name}: neither {jobs_dir / (name + '.env')} nor {state_root / name}",
            )
    return [
        job_status(
            n, jobs_dir=jobs_dir, state_root=state_root, log_dir=log_dir, systemctl=systemctl
        )
        for n in (names or known)
    ]


# ---------------------------------------------------------------------------
# Text.


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _local(iso: str | None) -> str:
    if not iso:
        return "?"
    return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")


def row(doc: Mapping[str, Any]) -> dict[str, str]:
    m = doc["metrics"]
    total = doc["total_steps"]
    step = "-" if m["last_step"] is None else str(m["last_step"])
    kl = m["kl"]
    ckpt = doc["checkpoint"]
    if ckpt is None:
        ckpt_text = "-"
    else:
        ckpt_text = (
            f"{ckpt['step']} @ {_local(ckpt['mtime'])}"
            if ckpt["exists"]
            else f"{ckpt['step']} (missing)"
        )
    cluster = doc.get("cluster")
    return {
        # A cluster job: the name and its cluster's.
        "JOB": doc["name"] + (f"@{cluster['name']}" if cluster else ""),
        "UNIT": doc["unit"]["summary"],
        "STEP": f"{step}/{total if total else '?'}",
        "STEPS/H": "-" if m["steps_per_hour"] is None else f"{m['steps_per_hour']:.1f}",
        "REWARD": _number(m["reward"]["value"]) if m["reward"] else "-",
        "KL": f"{_number(kl['value'])} ({kl['key'].rsplit('/', 1)[-1]})" if kl else "-",
        "CHECKPOINT": ckpt_text,
        "LOG": doc["log"]["path"],
    }


def render_text(docs: Sequence[Mapping[str, Any]], jobs_dir: Path = jobs.JOBS_DIR) -> str:
    if not docs:
        return f"no jobs in {jobs_dir}"
    rows = [row(d) for d in docs]
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns).rstrip() for r in rows]
    for doc in docs:
        lines += [f"{doc['name']}: {note}" for note in doc["notes"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Result:
    jobs_dir, state_root = Path(args.jobs_dir), Path(args.state_dir)
    docs = collect(args.jobs, jobs_dir=jobs_dir, state_root=state_root, log_dir=Path(args.log_dir))
    return Result({"jobs": docs}, render_text(docs, jobs_dir))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "each training job's unit, step, rate, reward, KL and last checkpoint"
    parser = subcommand.add(subparsers, common, "status", run, __doc__, help=summary)
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="jobs to show (default: all)")
    jobs.add_dir_args(parser, "jobs", "state", "log")
