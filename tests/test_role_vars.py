"""Every role variable a task uses has a definition (defaults, vars, specs or the task itself).

Ansible only finds an undefined variable when the task runs, on a host; this
finds it when a default is dropped as "unused" while a task still reads it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROLES = Path(__file__).resolve().parents[1] / "roles"


def _code(path: Path) -> str:
    """The file without its comment lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def _defined(role: Path, code: str) -> set[str]:
    names: set[str] = set()
    for path in [*role.glob("defaults/*.yml"), *role.glob("vars/*.yml")]:
        names |= set(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    for path in role.glob("meta/argument_specs.yml"):
        for entry in yaml.safe_load(path.read_text(encoding="utf-8"))["argument_specs"].values():
            names |= set(entry.get("options") or {})
    names |= set(re.findall(r"register:\s*(\w+)", code))
    # A loop's own variable name (an include_tasks loop over a list).
    names |= set(re.findall(r"loop_var:\s*(\w+)", code))
    # set_fact keys, task and block vars, loop_var: a key at the start of a line.
    names |= set(re.findall(r"^\s+(\w+):", code, re.MULTILINE))
    # Phase tags (<role>_<phase>) are names, not variables.
    for tags in re.findall(r"tags:\s*\[([^\]]*)\]", code):
        names |= {t.strip() for t in tags.split(",")}
    return names


@pytest.mark.parametrize("role", sorted(p.name for p in ROLES.iterdir() if p.is_dir()))
def test_role_variables_are_defined(role: str) -> None:
    path = ROLES / role
    files = [*path.glob("tasks/*.yml"), *path.glob("handlers/*.yml"), *path.glob("templates/*")]
    code = "\n".join(_code(f) for f in files)
    used = set(re.findall(rf"\b({role}_\w+)\b(?!\s*\|\s*default)", code))
    assert sorted(used - _defined(path, code)) == []
