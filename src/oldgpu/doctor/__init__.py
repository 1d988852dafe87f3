"""``oldgpu doctor``: is this host ready to train verl, and if not, what to do.

Facts first, judgement second: ``gather_facts`` asks the host (detect, the
driver's version, /proc/meminfo), the venv (a probe script run with the venv's
interpreter, so the engine itself imports no torch) and the patcher (``oldgpu
patch DIR --check``); ``evaluate`` turns a facts dict into checks and nothing
else, so tests feed it recorded facts. ``explain`` maps known error messages
(the seed article's and the ones verl meets on old GPUs) to a check and a fix.

Where each part lives: ``facts`` gathers, ``checks`` runs the checks (each in
the ``checks_*`` module of what it judges), ``known_errors`` holds the table,
and this module is the command line.

Exit status: 0 when no check fails, ``DOCTOR_FAILED`` (3) when one does; the
start script and the systemd unit's RestartPreventExitStatus use it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oldgpu import detect, profile, subcommand
from oldgpu.doctor.checks import DEFAULT_MIN_FREE_GPU_MIB, DEFAULT_MIN_FREE_HOST_MIB, evaluate
from oldgpu.doctor.facts import gather_facts
from oldgpu.doctor.known_errors import explain
from oldgpu.output import EngineError, Result

DOCTOR_FAILED = 3
EXPLAIN_UNKNOWN = 1  # ``--explain`` with a message the table does not know
MARKERS = {"ok": "✓", "warn": "!", "fail": "✗", "skip": "-"}


def render(report: Mapping[str, Any], facts: Mapping[str, Any] | None = None) -> str:
    probe = (facts or {}).get("probe") or {}
    t = probe.get("torch") or {}
    head = f"oldgpu doctor: profile {report['profile'] or '(none)'}"
    if probe.get("python"):
        head += f", python {probe['python']}"
        if t.get("version"):
            head += f" (torch {t['version']})"
    lines = [head]
    width = max(len(c["id"]) for c in report["checks"])
    for c in report["checks"]:
        lines.append(f"{MARKERS[c['status']]} {c['id']:<{width}}  {c['seen']}")
        if c["status"] in ("fail", "warn") and c["fix"]:
            lines.append(f"    fix: {c['fix']}")
    skipped = report["counts"]["skip"]
    verdict = "ready" if report["ok"] else "NOT ready"
    lines.append(f"{report['summary']}{f', {skipped} skip' if skipped else ''}: {verdict}")
    return "\n".join(lines)


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = f"preflight: is this host ready to train verl? (exit {DOCTOR_FAILED} if not)"
    parser = subcommand.add(subparsers, common, "doctor", run, __doc__, help=summary)
    parser.add_argument(
        "--python",
        metavar="VENV_PYTHON",
        help="the training venv's interpreter, probed for torch facts (default: this one)",
    )
    parser.add_argument("--verl-dir", metavar="DIR", help="the verl tree to check the patch of")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--profile-from-detect",
        action="store_true",
        help="judge against the profile of the GPUs detect finds (the default)",
    )
    source.add_argument("--cc", metavar="X.Y", help="judge against this compute capability")
    source.add_argument("--arch", choices=sorted(profile.PROFILES), help="... this architecture")
    parser.add_argument(
        "--min-free-gpu-mib",
        type=int,
        default=DEFAULT_MIN_FREE_GPU_MIB,
        metavar="N",
        help=f"free memory each GPU needs (default {DEFAULT_MIN_FREE_GPU_MIB})",
    )
    parser.add_argument(
        "--min-free-host-mib",
        type=int,
        default=DEFAULT_MIN_FREE_HOST_MIB,
        metavar="N",
        help=f"MemAvailable the host needs (default {DEFAULT_MIN_FREE_HOST_MIB})",
    )
    parser.add_argument(
        "--facts",
        metavar="FILE",
        help="judge facts recorded before (the JSON report's facts) instead of this host",
    )
    parser.add_argument(
        "--explain",
        metavar="TEXT",
        help=f"name the cause and fix of an error message (exit {EXPLAIN_UNKNOWN} if unknown)",
    )
    detect.add_source_args(parser)


def _explain_result(text: str) -> Result:
    found = explain(text)
    payload = {"message": text, "known": found is not None, "explanation": found}
    if found is None:
        return Result(payload, "not a known error; run `oldgpu doctor`", EXPLAIN_UNKNOWN)
    lines = [
        f"{found['error']} (check {found['check']}): {found['matched']!r}",
        f"cause: {found['cause']}",
        f"fix: {found['fix']}",
    ]
    return Result(payload, "\n".join(lines), 0)


def run(args: argparse.Namespace) -> Result:
    if args.explain is not None:
        return _explain_result(args.explain)
    # A profile asked for by hand is checked up front: a typo is a usage error.
    if args.cc:
        profile.profile_for_cc(args.cc)
    for flag in ("min_free_gpu_mib", "min_free_host_mib"):
        if (getattr(args, flag) or 0) < 0:
            option = "--" + flag.replace("_", "-")
            raise EngineError("doctor-bad-input", f"{option} must be 0 or more")
    if args.facts:
        try:
            facts = json.loads(Path(args.facts).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise EngineError("facts-unreadable", f"{args.facts}: {exc}") from exc
        if not isinstance(facts, dict):
            raise EngineError("facts-invalid", f"{args.facts}: not a JSON object of facts")
        if args.cc or args.arch:
            facts["request"] = {"cc": args.cc, "arch": args.arch}
    else:
        facts = gather_facts(
            python=args.python,
            verl_dir=args.verl_dir,
            cc=args.cc,
            arch=args.arch,
            detect_args=args,
        )
    try:
        report = evaluate(
            facts, min_free_gpu_mib=args.min_free_gpu_mib, min_free_host_mib=args.min_free_host_mib
        )
    except (TypeError, KeyError, AttributeError, ValueError, IndexError) as exc:
        if not args.facts:
            raise
        # Recorded facts are outside input: a hand-edited file of the wrong shape.
        raise EngineError(
            "facts-invalid", f"{args.facts}: not doctor's facts ({type(exc).__name__}: {exc})"
        ) from exc
    payload = {**report, "facts": facts}
    return Result(payload, render(report, facts), 0 if report["ok"] else DOCTOR_FAILED)
