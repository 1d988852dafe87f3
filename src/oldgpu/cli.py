"""The ``oldgpu`` command line: one sub-command per engine module, ``--json`` on all."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence

from oldgpu import __version__, paths
from oldgpu.output import EngineError

# Each module exposes ``add_parser(subparsers, common)`` (oldgpu.subcommand.add),
# which sets ``func(args) -> Result``.
COMMAND_MODULES = (
    "oldgpu.detect",
    "oldgpu.profile",
    "oldgpu.patch",
    "oldgpu.doctor",
    "oldgpu.driver",
    "oldgpu.distro",
    "oldgpu.lockcheck",
    "oldgpu.plan",
    "oldgpu.jobs",
    "oldgpu.status",
    "oldgpu.plot",
    "oldgpu.smoke",
    "oldgpu.data",
    "oldgpu.assets",
    "oldgpu.guard",
    "oldgpu.topology",
    "oldgpu.venv",
    "oldgpu.verl_sdist",
    "oldgpu.switch",
    "oldgpu.paths",
    "oldgpu.raynode",
    "oldgpu.fleet",
    "oldgpu.base_dtype",
)
# A module may name the packages it needs beyond the standard library in
# ``REQUIRES``: the command then re-runs itself with the training venv's
# interpreter, which has them (the engine itself runs on the system python3). A
# module whose needs depend on the call has ``requires(args)`` instead.
VENV_PYTHON_ENV = "OLDGPU_VENV_PYTHON"
DEFAULT_VENV_PYTHON = str(paths.VENV_PYTHON)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oldgpu", description=__doc__)
    parser.add_argument("--version", action="version", version=f"oldgpu {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a sub-command's parser sets no default over its parent's, so `oldgpu job
    # --json fields` is JSON as `oldgpu job fields --json` is (main fills in False).
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
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


def _missing(requires: Sequence[str]) -> list[str]:
    return [name for name in requires if importlib.util.find_spec(name) is None]


def _reexec_in_venv(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Run again under the venv's interpreter when this one lacks a package the command needs."""
    module = sys.modules.get(getattr(args.func, "__module__", ""), None)
    requires = getattr(module, "requires", None)
    missing = _missing(requires(args) if requires else getattr(module, "REQUIRES", ()))
    if not missing:
        return
    venv = os.environ.get(VENV_PYTHON_ENV, DEFAULT_VENV_PYTHON)
    # A venv's python is a link to the system's: tell them apart by prefix, and
    # re-run once at most.
    venv_prefix = os.path.realpath(os.path.dirname(os.path.dirname(venv)))
    if (
        os.path.exists(venv)
        and venv_prefix != os.path.realpath(sys.prefix)
        and not os.environ.get("OLDGPU_REEXECUTED")
    ):
        os.environ["OLDGPU_REEXECUTED"] = "1"
        os.execv(venv, [venv, "-m", "oldgpu", *argv])
    raise EngineError(
        "python-package-missing",
        f"`oldgpu {args.command}` needs {', '.join(missing)}: run it with the training "
        f"venv's python (set {VENV_PYTHON_ENV}; {venv} not found)",
    )


# A reader that stopped early (``oldgpu profile --json | head``): the status a process
# killed by SIGPIPE reports in a shell, 128 + 13, without a traceback.
BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.json = getattr(args, "json", False)
    try:
        return _run(args, argv)
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE


def _run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    try:
        _reexec_in_venv(args, argv)
        result = args.func(args)
    except EngineError as exc:
        if args.json:
            json.dump(exc.as_dict(), sys.stdout, indent=2)
            sys.stdout.write("\n")
        print(f"oldgpu {args.command}: {exc}", file=sys.stderr)
        sys.stdout.flush()  # a closed reader shows here, inside main's handler
        return exc.code
    code = result.emit(args.json)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
