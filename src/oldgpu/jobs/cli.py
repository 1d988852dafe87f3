"""``oldgpu job``'s sub-commands: ``command``, ``env`` and ``fields``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oldgpu import detect, subcommand, topology
from oldgpu.jobs.compose import compose_for_host
from oldgpu.jobs.settings import (
    ENV_FIELDS,
    FIELDS,
    JOBS_DIR,
    LOG_DIR,
    REQUIRED,
    STATE_DIR,
    Job,
    check_for_unit,
    choices,
    invalid,
    job_from_env,
    job_from_mapping,
    load_env_file,
    load_job,
    render_env,
)
from oldgpu.output import Result


def _read_job(args: argparse.Namespace) -> Job:
    if args.env_file:
        return load_env_file(Path(args.env_file))
    if args.name:
        return load_job(args.name, Path(args.jobs_dir))
    return job_from_env(os.environ)


def _command_text(doc: Mapping[str, Any]) -> str:
    lines = [f"job {doc['job']}: profile {doc['profile']}, memory {doc['memory_mib']} MiB"]
    lines += [f"  {k}={v}" for k, v in doc["environment"].items()]
    lines.append("  python " + " ".join(doc["argv"]))
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> Result:
    doc = compose_for_host(_read_job(args), args=args)
    if args.write_plan:
        target = Path(doc["paths"]["plan"])
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(target)
    if args.print0:
        # For the start script: the environment as NAME=value, a blank, then the argv.
        out = [f"{k}={v}" for k, v in doc["environment"].items()] + [""] + doc["argv"]
        sys.stdout.write("".join(item + "\0" for item in out))
        sys.stdout.flush()
        return Result(doc)
    return Result(doc, _command_text(doc))


def run_env(args: argparse.Namespace) -> Result:
    """Render a job's env file from inventory-style JSON (what the front-ends write)."""
    try:
        values = json.loads(
            Path(args.spec).read_text(encoding="utf-8") if args.spec != "-" else sys.stdin.read()
        )
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise invalid(f"cannot read a JSON job from {args.spec}: {exc}") from None
    job = job_from_mapping(values)
    if not args.outside_unit:
        check_for_unit(job)  # the unit's sandbox: refused here, not when it starts
    text = render_env(job)
    # ``job``: the settings as the engine resolved them (the verl_jobs role's assets
    # phase reads the model and data set from it).
    return Result({"name": job.name, "env": text, "job": dataclasses.asdict(job)}, text)


def run_fields(args: argparse.Namespace) -> Result:
    doc = [
        {
            "name": f.name,
            "env": f.env if f in ENV_FIELDS else None,
            "type": f.kind,
            "required": f.default is REQUIRED,
            "default": None if f.default is REQUIRED else f.default,
            "help": f.help,
            "choices": choices(f),
        }
        for f in FIELDS
    ]
    text = "\n".join(
        f"{d['name']:<20} {d['type']:<5} {d['help']}"
        + (f"\n{'':<27}one of: {', '.join(d['choices'])}" if d["choices"] else "")
        for d in doc
    )
    return Result(doc, text)


def add_dir_args(parser: argparse.ArgumentParser, *dirs: str) -> None:
    """The hidden ``--jobs-dir``/``--state-dir``/``--log-dir`` (tests point them elsewhere)."""
    defaults = {"jobs": JOBS_DIR, "state": STATE_DIR, "log": LOG_DIR}
    for name in dirs:
        parser.add_argument(f"--{name}-dir", default=str(defaults[name]), help=argparse.SUPPRESS)


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "a training job's settings and the verl command they make"
    doc = sys.modules[__package__].__doc__
    parser = subcommand.add(subparsers, common, "job", None, doc, help=summary)
    sub = parser.add_subparsers(dest="job_command", required=True)
    summary = "the profile, the plan and verl's argv for a job on this host"
    cmd = subcommand.add(sub, common, "command", run_command, help=summary)
    source = cmd.add_mutually_exclusive_group()
    source.add_argument("--name", help=f"a job under --jobs-dir (default {JOBS_DIR})")
    source.add_argument("--env-file", metavar="FILE", help="a job's env file")
    add_dir_args(cmd, "jobs")
    cmd.add_argument(
        "--print0",
        action="store_true",
        help="NUL-separated NAME=value environment, an empty item, then the argv",
    )
    cmd.add_argument(
        "--write-plan", action="store_true", help="also save the result as the job's plan.json"
    )
    detect.add_source_args(cmd)
    recorded = cmd.add_argument_group("recorded topology (replaces nvidia-smi topo and /sys)")
    recorded.add_argument("--topo-file", metavar="FILE", help="output of nvidia-smi topo -m")
    recorded.add_argument("--p2p-file", metavar="FILE", help="output of nvidia-smi topo -p2p r")
    recorded.add_argument(
        "--ib-dir", metavar="DIR", default=topology.IB_DIR, help=f"default {topology.IB_DIR}"
    )
    recorded.add_argument(
        "--cluster-nodes-file",
        metavar="FILE",
        help="a cluster job: ray.nodes() as JSON, instead of asking the live cluster",
    )
    env = subcommand.add(sub, common, "env", run_env, help="render a job's env file from JSON")
    env.add_argument("spec", help="a JSON object with the job's settings, or - for stdin")
    env.add_argument(
        "--outside-unit",
        action="store_true",
        help="the job runs outside verl-train@.service (a benchmark): skip the checks of "
        "what its sandbox hides (/tmp, /home)",
    )
    subcommand.add(sub, common, "fields", run_fields, help="the settings a job has")
