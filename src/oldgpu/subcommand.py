"""One call for a command module's ``oldgpu NAME`` parser, instead of argparse's boilerplate.

``oldgpu.cli`` calls each command module's ``add_parser(subparsers, common)``; ``common``
is the parent parser that carries ``--json``. With :func:`add` a module writes::

    from oldgpu import subcommand

    def add_parser(subparsers, common):
        summary = "batch sizes, micro batches, checkpointing and offload that fit the GPU"
        parser = subcommand.add(subparsers, common, "plan", run, __doc__, help=summary)
        parser.add_argument("--gpu-mib", type=int, metavar="N", help="one GPU's memory")

and gets a parser with ``--json``, ``summary`` as its line in ``oldgpu --help``, the
first paragraph of ``__doc__`` (the module's docstring) as its own ``--help`` text, and
``args.func = run``, which the CLI calls. ``whole_doc=True`` shows all of the docstring
with its line breaks kept (one with a list); no ``doc``, no description. A command with
sub-commands passes ``run=None`` and calls :func:`add` again on its own sub-parsers::

    parser = subcommand.add(subparsers, common, "job", None, __doc__, help=summary)
    sub = parser.add_subparsers(dest="job_command", required=True)
    subcommand.add(sub, common, "fields", run_fields, help="the settings a job has")
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add(
    subparsers: Any,
    common: argparse.ArgumentParser,
    name: str,
    run: Callable[[argparse.Namespace], Any] | None,
    doc: str | None = None,
    *,
    help: str,  # argparse's own name for it
    whole_doc: bool = False,
) -> argparse.ArgumentParser:
    """Add the sub-command ``name`` to ``subparsers``; see the module's docstring."""
    kwargs: dict[str, Any] = {}
    if doc and whole_doc:
        kwargs.update(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    elif doc:
        kwargs["description"] = doc.split("\n\n")[0]
    parser = subparsers.add_parser(name, parents=[common], help=help, **kwargs)
    if run is not None:
        parser.set_defaults(func=run)
    return parser
