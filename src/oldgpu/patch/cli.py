"""``oldgpu patch``'s command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from oldgpu.output import EngineError, Result
from oldgpu.patch.manifest import MANIFEST_NAME
from oldgpu.patch.options import ATTN_IMPLEMENTATIONS, COMPUTE_DTYPES, Options, profile_options
from oldgpu.patch.plans import Plan, plan_patch, plan_revert
from oldgpu.patch.transaction import commit


def options_from_args(args: argparse.Namespace) -> Options:
    values: dict[str, str] = {}
    if args.profile:
        values.update(profile_options(args.profile))
    # Explicit flags win over the profile.
    if args.compute_dtype:
        values["compute_dtype"] = args.compute_dtype
    if args.attn_implementation:
        values["attn_implementation"] = args.attn_implementation
    return Options(profile=args.profile, **values)


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "patch",
        parents=[common],
        help="patch a verl tree for a profile (dtype, attention, flash-attn-free padding)",
        description=(sys.modules[__package__].__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("dir", type=Path, help="verl checkout or unpacked sdist (holds verl/)")
    parser.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, help="default fp32")
    parser.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, help="default sdpa")
    parser.add_argument(
        "--profile",
        help="take the options from this oldgpu profile (pascal, pascal-6.1, cpu, ...); "
        "--compute-dtype/--attn-implementation override it",
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if changes are needed"
    )
    parser.add_argument(
        "--diff", action="store_true", help="print what would change; change nothing"
    )
    parser.add_argument(
        "--revert", action="store_true", help="restore every file byte for byte, remove added ones"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> Result:
    if args.revert and (args.compute_dtype or args.attn_implementation or args.profile):
        raise EngineError("options-invalid", "--revert takes no patch options")
    plan = plan_revert(args.dir) if args.revert else plan_patch(args.dir, options_from_args(args))
    dry_run = args.check or args.diff
    diff = plan.diff() if args.diff else None
    if not dry_run and plan.changed:
        commit(plan)
    payload = {
        "action": plan.action,
        "changed": plan.changed,
        "dry_run": bool(dry_run),
        "dir": str(plan.root),
        "verl_version": plan.verl_version,
        "options": plan.options.as_dict() if plan.options else None,
        "manifest": str(plan.root / MANIFEST_NAME),
        "files": plan.files,
        "patches": plan.patches,
    }
    if diff is not None:
        payload["diff"] = diff
    code = 1 if args.check and plan.changed else 0
    return Result(payload, _text(plan, dry_run, diff), code)


def _text(plan: Plan, dry_run: bool, diff: str | None) -> str:
    if diff is not None:
        if diff:
            return diff
        return f"{plan.root}: " + (
            "only oldgpu's records change" if plan.changed else "nothing to change"
        )
    verb = {"patch": "patch", "revert": "revert"}[plan.action]
    if not plan.changed:
        state = "not patched" if plan.action == "revert" else "already patched as asked"
        return f"{plan.root}: {state}; nothing to change"
    head = f"{plan.root}: verl {plan.verl_version}"
    if plan.options:
        head += f" ({plan.options.compute_dtype}, {plan.options.attn_implementation})"
    head += f": {'would ' + verb if dry_run else verb + 'ed'}"
    lines = [head]
    lines += [f"  {f['status']:<9} {f['path']}" for f in plan.files if f["status"] != "unchanged"]
    return "\n".join(lines)
