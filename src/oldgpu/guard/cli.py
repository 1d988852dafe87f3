"""``oldgpu guard``: enforce, on a newer GPU, what an old one cannot do.

The command: ``--check`` arms the guard here (from the environment or ``--profile``) and
reports; ``--env`` prints the exports a job needs.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from oldgpu import subcommand
from oldgpu.guard.arm import active, install
from oldgpu.guard.policy import DEFAULT_PROFILE, ENV_GUARD, ENV_LOG, environment, policy_for
from oldgpu.guard.report import _text, check
from oldgpu.output import Result


def run(args: argparse.Namespace) -> Result:
    if args.env:
        if args.profile:
            policy_for(args.profile)  # a name the processes would refuse at start is refused now
        env = environment(args.profile or DEFAULT_PROFILE, args.log)
        text = "\n".join(f"export {k}={json.dumps(v)}" for k, v in env.items())
        return Result(payload=env, text=text)
    if not active():
        if args.profile:
            install(policy_for(args.profile, log=os.environ.get(ENV_LOG) or None))
        else:
            install()
    doc = check(probe=not args.no_probe)
    code = 0 if doc["active"] else 1
    return Result(payload=doc, text=_text(doc), code=code)


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "enforce on a newer GPU what an old one cannot do (bf16, TF32, flash, compile)"
    parser = subcommand.add(subparsers, common, "guard", run, __doc__, help=summary)
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--check",
        action="store_true",
        help="print what the guard enforces in this process (the default)",
    )
    what.add_argument(
        "--env", action="store_true", help="print the exports a job needs to run guarded"
    )
    parser.add_argument(
        "--profile", metavar="NAME", help=f"the profile to guard as (default ${ENV_GUARD})"
    )
    parser.add_argument("--log", metavar="FILE", help=f"with --env: ${ENV_LOG}")
    parser.add_argument("--no-probe", action="store_true", help="do not try the forbidden things")
