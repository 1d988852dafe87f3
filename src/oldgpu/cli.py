"""The ``oldgpu`` command line: one sub-command per engine module, ``--json`` on all."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from oldgpu import __version__
from oldgpu.output import EngineError

# Each module exposes ``add_parser(subparsers)`` and sets ``func(args) -> Result``.
COMMAND_MODULES = (
    "oldgpu.detect",
    "oldgpu.profile",
    "oldgpu.patch",
    "oldgpu.doctor",
    "oldgpu.lockcheck",
    "oldgpu.plan",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oldgpu", description=__doc__)
    parser.add_argument("--version", action="version", version=f"oldgpu {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a command not built yet
                continue
            raise
        module.add_parser(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except EngineError as exc:
        if getattr(args, "json", False):
            json.dump(exc.as_dict(), sys.stdout, indent=2)
            sys.stdout.write("\n")
        print(f"oldgpu {args.command}: {exc}", file=sys.stderr)
        return exc.code
    return result.emit(args.json)


if __name__ == "__main__":
    sys.exit(main())
