"""Every sub-command's ``--json``, read by a reader that stops early (``| head -1``): no
traceback, a sane exit (issue 34, item 7). The sub-commands come from the CLI's own
parser, so a new one is covered without a list to keep up to date."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oldgpu import asset_files, cli

ROOT = Path(__file__).resolve().parent.parent
# Commands that wait for something that is not here (a Ray head) by design.
WAITS = {("ray-node", "wait-head")}
SANE = (0, 1, 2, 3, 4, 5, 6, cli.BROKEN_PIPE, *asset_files.EXIT_CODES)


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(sub-command path, its parser) for every command that runs (no sub-commands)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaves(sub, (*path, name))


def argv_for(path: tuple[str, ...], parser: argparse.ArgumentParser) -> list[str]:
    """The command with ``--json`` and a made-up value per required argument (files that
    do not exist, in an empty directory): enough to reach the command's own answer."""
    argv = [*path, "--json"]
    for action in parser._actions:
        if action.option_strings and action.required:
            value = next(iter(action.choices)) if action.choices else "missing-value"
            argv += [action.option_strings[0], value]
        elif not action.option_strings and action.nargs not in ("?", "*", argparse.SUPPRESS):
            if action.choices:
                argv.append(next(iter(action.choices)))
            else:
                argv.append(f"missing-{action.dest}")
    return argv


COMMANDS = [
    (path, argv_for(path, parser))
    for path, parser in leaves(cli.build_parser())
    if any("--json" in a.option_strings for a in parser._actions) and path not in WAITS
]


def test_every_command_is_found():
    names = {p[0] for p, _ in COMMANDS}
    assert {"profile", "plan", "job", "detect", "paths"} <= names
    assert ("job", "fields") in {p for p, _ in COMMANDS}


def env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OLDGPU_CACHE": str(tmp_path / "cache"),
        "HOME": str(tmp_path),
        # the engine's own interpreter: no re-exec into a training venv
        "OLDGPU_REEXECUTED": "1",
    }


@pytest.mark.parametrize(("path", "argv"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_json_through_head(tmp_path, path, argv):
    shell = (
        f"{sys.executable} -m oldgpu {' '.join(argv)} | head -1; "
        'echo "status ${PIPESTATUS[0]}" >&2'
    )
    out = subprocess.run(
        ["bash", "-c", shell], cwd=tmp_path, env=env(tmp_path), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in out.stderr, out.stderr
    status = int(out.stderr.rsplit("status ", 1)[1])
    # 0, a command's own status (guard: 1, not armed), a named error's code, or 141 (the
    # reader left); never an uncaught exception (its traceback is checked above)
    assert status in SANE, out.stderr
    assert out.stdout.strip() in ("{", "["), out.stdout


@pytest.mark.parametrize(("path", "argv"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_json_into_a_closed_pipe(tmp_path, path, argv):
    """The reader gone before the first byte (head's race, made certain)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "oldgpu", *argv], cwd=tmp_path, env=env(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proc.stdout.close()
    err = proc.stderr.read()
    code = proc.wait(timeout=120)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert code in SANE, (code, err)


def test_a_parent_json_flag_reaches_the_sub_command(capsys):
    assert cli.main(["job", "--json", "fields"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_name = {f["name"]: f for f in doc}
    assert by_name["verl_version"]["choices"][0] == "0.5.0"
    assert "gae" in by_name["algorithm"]["choices"]
    assert by_name["model_path"]["choices"] is None
