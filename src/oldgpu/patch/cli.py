"""``oldgpu patch``'s command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from oldgpu import subcommand
from oldgpu.output import EngineError, Result
from oldgpu.patch.manifest import MANIFEST_NAME, check_tree
from oldgpu.patch.options import ATTN_IMPLEMENTATIONS, COMPUTE_DTYPES, Options, profile_options
from oldgpu.patch.plans import Plan, plan_patch, plan_revert
from oldgpu.patch.transaction import commit, locked, recover


def options_from_args(args: argparse.Namespace) -> Options:
    values: dict[str, str] = {}
    if args.profile:
        values.update(profile_options(args.profile))
    # Explicit flags win over the profile, unless the profile's GPU cannot run them:
    # bf16 needs CC 8.0, and so does FlashAttention-2 (the patched tree would fail at load).
    no_bf16 = values.get("device") == "cuda" and values.get("compute_dtype") != "bf16"
    if args.profile and args.compute_dtype == "bf16" and no_bf16:
        raise EngineError(
            "patch-dtype-unsupported",
            f"--compute-dtype bf16 with profile {args.profile}: its GPU has no bf16 "
            "(compute capability 8.0 or later); use fp32 or fp16",
        )
    gpu_attn = values.get("attn_implementation") == "flash_attention_2"
    if args.profile and args.attn_implementation == "flash_attention_2" and not gpu_attn:
        raise EngineError(
            "patch-attention-unsupported",
            f"--attn-implementation flash_attention_2 with profile {args.profile}: "
            "FlashAttention-2 needs compute capability 8.0 or later; use sdpa or eager",
        )
    if args.compute_dtype:
        values["compute_dtype"] = args.compute_dtype
    if args.attn_implementation:
        values["attn_implementation"] = args.attn_implementation
    return Options(profile=args.profile, **values)


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    summary = "patch a verl tree for a profile (dtype, attention, flash-attn-free padding)"
    doc = sys.modules[__package__].__doc__
    parser = subcommand.add(subparsers, common, "patch", run, doc, help=summary)
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


def run(args: argparse.Namespace) -> Result:
    if args.revert and (args.compute_dtype or args.attn_implementation or args.profile):
        raise EngineError("options-invalid", "--revert takes no patch options")
    options = None if args.revert else options_from_args(args)
    dry_run = args.check or args.diff
    check_tree(args.dir)
    with locked(args.dir):
        # An interrupted commit is finished or undone first, even by --check and --diff.
        recovered = recover(args.dir, sweep=not dry_run)
        plan = plan_revert(args.dir) if options is None else plan_patch(args.dir, options)
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
    if recovered:
        payload["recovered"] = recovered
    if diff is not None:
        payload["diff"] = diff
    code = 1 if args.check and plan.changed else 0
    text = _text(plan, dry_run, diff)
    if recovered and diff is None:
        text = f"{plan.root}: an interrupted commit was {recovered}\n{text}"
    return Result(payload, text, code)


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
