"""``oldgpu paths``: where everything lives on a host. Constants, one owner.

The template unit ``files/systemd/verl-train@.service`` is one static file that
Ansible and NixOS install byte for byte, and it names the user and the
directories; so they cannot be options, and they live here. Everything else
reads them from this module: the engine imports it, the roles ask
``oldgpu paths --json`` (role ``oldgpu_engine``, entry point ``paths``: the fact
``oldgpu_engine_paths``), the NixOS module reads ``nix/engine.json``
(``scripts/nix_engine_data.py``), and the two static files that must name them
literally (the unit and ``files/bin/verl-train``) are checked against this table
by ``tests/test_paths.py``. Each newer verl release of files/pins.json has its own
places beside the default's (``releases`` in ``--json``: its venv link and venvs, its
tree link and trees, its sdist).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from oldgpu import pins, subcommand
from oldgpu.output import Result

# The unprivileged account the jobs run as (the unit's User= and Group=).
USER = "verl"
GROUP = "verl"

# Code: root-owned, readable by the jobs.
CODE_DIR = Path("/opt/verl")
BIN_DIR = CODE_DIR / "bin"
START_SCRIPT = BIN_DIR / "verl-train"  # the unit's ExecStart=
ENGINE_DIR = CODE_DIR / "engine"  # releases of the engine; current -> the active one
VENVS_DIR = CODE_DIR / "venvs"  # one venv per lock
VENV_DIR = CODE_DIR / "venv"  # -> the active venv
VENV_PYTHON = VENV_DIR / "bin" / "python"
VERL_SRC_DIR = CODE_DIR / "src" / "verl"  # the pristine clone
TREES_DIR = CODE_DIR / "trees"  # patched trees, one per commit and profile
VERL_DIR = CODE_DIR / "verl"  # -> the active patched tree


# A verl release other than the default (oldgpu.verl_release) beside it: its venv and
# patched tree are links like the two above, named for the release, each to one of its
# own directory of builds (a switch prunes its target's siblings: one release's builds
# must not be another's), and its source is the sdist kept beside the default's clone.
def release_venv(version: str) -> Path:
    return CODE_DIR / f"venv-{version}"


def release_venvs(version: str) -> Path:
    return CODE_DIR / f"venvs-{version}"


def release_tree(version: str) -> Path:
    return CODE_DIR / f"verl-{version}"


def release_trees(version: str) -> Path:
    return CODE_DIR / f"trees-{version}"


def release_sdist(version: str) -> Path:
    return VERL_SRC_DIR.parent / f"verl-{version}.tar.gz"


# Data, models and checkpoints (owned by USER); the unit's StateDirectory= is
# verl/jobs/<name>, so systemd puts a job's state in STATE_DIR / <name>.
DATA_DIR = Path("/var/lib/verl")
STATE_DIR = DATA_DIR / "jobs"
# Models and data sets as published, one directory per id and revision (oldgpu.assets
# places them, root-owned and world-readable: the unit reads /var/lib), and the data
# sets in verl's layout that `oldgpu data` makes from them.
MODELS_DIR = DATA_DIR / "models"
DATASETS_DIR = DATA_DIR / "datasets"
PREPARED_DIR = DATA_DIR / "prepared"
# Where the verl_jobs role synchronizes models and data sets from the controller
# (<id>/<revision>/), placed from there like from a mirror.
INCOMING_DIR = DATA_DIR / "incoming"
# The jobs' log files (the unit's LogsDirectory=verl).
LOG_DIR = Path("/var/log/verl")
# One <job>.env per job (root:GROUP 0750: it may hold secrets).
CONFIG_DIR = Path("/etc/verl")
JOBS_DIR = CONFIG_DIR / "jobs"

# The engine's command on a host Ansible provisions (the start script's default;
# NixOS sets OLDGPU_BIN to its store path instead).
ENGINE_BIN = Path("/usr/local/bin/oldgpu")


def as_dict() -> dict[str, str]:
    """The table as ``oldgpu paths --json`` prints it (and nix/engine.json holds it)."""
    return {
        "user": USER,
        "group": GROUP,
        "code_dir": str(CODE_DIR),
        "bin_dir": str(BIN_DIR),
        "start_script": str(START_SCRIPT),
        "engine_dir": str(ENGINE_DIR),
        "engine_bin": str(ENGINE_BIN),
        "venvs_dir": str(VENVS_DIR),
        "venv_dir": str(VENV_DIR),
        "venv_python": str(VENV_PYTHON),
        "verl_src_dir": str(VERL_SRC_DIR),
        "trees_dir": str(TREES_DIR),
        "verl_dir": str(VERL_DIR),
        "data_dir": str(DATA_DIR),
        "state_dir": str(STATE_DIR),
        "models_dir": str(MODELS_DIR),
        "datasets_dir": str(DATASETS_DIR),
        "prepared_dir": str(PREPARED_DIR),
        "incoming_dir": str(INCOMING_DIR),
        "log_dir": str(LOG_DIR),
        "config_dir": str(CONFIG_DIR),
        "jobs_dir": str(JOBS_DIR),
    }


def releases() -> dict[str, dict[str, str]]:
    """Where each newer release of files/pins.json lives (``releases`` in ``--json``)."""
    newer = pins.load().get("verl_releases") or {}
    return {
        v: {
            "venv_dir": str(release_venv(v)),
            "venvs_dir": str(release_venvs(v)),
            "verl_dir": str(release_tree(v)),
            "trees_dir": str(release_trees(v)),
            "sdist": str(release_sdist(v)),
        }
        for v in newer
        if v != pins.get("verl.version")
    }


def run(args: argparse.Namespace) -> Result:
    table = as_dict()
    width = max(map(len, table))
    lines = [f"{k:<{width}}  {v}" for k, v in table.items()]
    for version, where in releases().items():
        lines += [f"verl {version}:"] + [f"  {k:<{width - 2}}  {v}" for k, v in where.items()]
    return Result({**table, "releases": releases()}, "\n".join(lines))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "where the user, code, venv, state, logs and jobs live (fixed; not options)"
    subcommand.add(subparsers, common, "paths", run, __doc__, help=summary)
