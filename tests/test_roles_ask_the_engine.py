"""One owner per fact: the roles read the engine's JSON instead of re-deriving it in YAML.

``oldgpu driver`` owns the loaded module's version (the "Kernel Module" line of
/proc/driver/nvidia/version), the parsing of ``dkms status``, and the driver/CUDA
fit (the pinned CUDA's minimum driver and the minor-version compatibility floors).
This fails when YAML under roles/, or a shell script of the Nix front-end or of
scripts/ (nix/host-driver.sh once grepped the version line and compared it with
``sort -V``), does any of that again. Comment lines are not read: a comment may
say what the engine does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from oldgpu import driver, pins

ROOT = Path(__file__).resolve().parents[1]
ROLES = ROOT / "roles"

# What the engine owns, as a role would write it again.
FORBIDDEN = {
    "the loaded module's version line": re.compile(r"Kernel Module"),
    "reading the loaded driver's version": re.compile(re.escape(driver.PROC_VERSION)),
    "running or parsing `dkms status`": re.compile(r"\bdkms\b[\s,'\"\]]+status\b"),
    "a regex over dkms status lines": re.compile(r":\\s\*installed|dkms_line_re"),
    "the driver/CUDA fit's driver versions": re.compile(
        "|".join(
            re.escape(v)
            for v in (*driver.MINOR_COMPAT_DRIVER.values(), str(pins.get("cuda.min_driver")))
        )
    ),
}


# The shell the Nix front-end and scripts/ run may hand the engine the version
# file (`oldgpu driver --proc-version-file`), never read or compare it themselves.
SCRIPT_FORBIDDEN = {
    **{k: v for k, v in FORBIDDEN.items() if k != "reading the loaded driver's version"},
    "reading the loaded driver's version with a text tool": re.compile(
        r"\b(grep|sed|awk|cut|cat|head|tail)\b.*"
        + re.escape(driver.PROC_VERSION)
        + "|<\\s*"
        + re.escape(driver.PROC_VERSION)
    ),
    "comparing driver versions": re.compile(r"\bsort\s+(-\w*V|--version-sort)"),
}
SCRIPT_DIRS = ("nix", "scripts", "files/bin")


def _lines(paths: list[Path]) -> list[tuple[Path, int, str]]:
    lines = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.lstrip().startswith("#"):
                lines.append((path, number, line))
    return lines


def _yaml_lines() -> list[tuple[Path, int, str]]:
    return _lines(
        [
            p
            for p in sorted(ROLES.rglob("*"))
            if p.suffix in (".yml", ".yaml", ".j2") and p.is_file()
        ]
    )


def _script_paths() -> list[Path]:
    """The shell and Nix files of the front-ends (files/bin's scripts have no suffix)."""
    paths = []
    for top in SCRIPT_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and (path.suffix in (".sh", ".nix") or top == "files/bin"):
                paths.append(path)
    return paths


def _matches(lines: list[tuple[Path, int, str]], pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path, number, line in lines
        if pattern.search(line)
    ]


@pytest.fixture(scope="module")
def role_lines() -> list[tuple[Path, int, str]]:
    if not ROLES.is_dir():  # the Nix build's copy of the tree has src/ and tests/ only
        pytest.skip("no roles/ next to tests/")
    return _yaml_lines()


@pytest.fixture(scope="module")
def script_lines() -> list[tuple[Path, int, str]]:
    if not (ROOT / "nix").is_dir():  # the Nix build's copy of the tree has src/ and tests/ only
        pytest.skip("no nix/ next to tests/")
    return _lines(_script_paths())


@pytest.mark.parametrize("what", sorted(FORBIDDEN))
def test_no_role_re_derives_what_the_engine_answers(role_lines, what):
    found = _matches(role_lines, FORBIDDEN[what])
    assert not found, f"{what} is oldgpu driver's (read oldgpu_engine_driver):\n" + "\n".join(found)


@pytest.mark.parametrize("what", sorted(SCRIPT_FORBIDDEN))
def test_no_script_re_derives_what_the_engine_answers(script_lines, what):
    found = _matches(script_lines, SCRIPT_FORBIDDEN[what])
    assert not found, f"{what} is oldgpu driver's (read its --json):\n" + "\n".join(found)


def test_the_scanned_scripts_include_the_host_driver_helper(script_lines):
    scanned = {path.relative_to(ROOT).as_posix() for path, _, _ in script_lines}
    assert {"nix/host-driver.sh", "nix/packages.nix", "files/bin/verl-train"} <= scanned


# The YAML each pattern was written against (what the roles held before the
# engine answered): the patterns catch it, so the test above can fail.
WRITTEN_BEFORE = {
    "the loaded module's version line": (
        "regex_search('Kernel Module(?: for \\S+)?\\s+([0-9.]+)', '\\1')"
    ),
    "reading the loaded driver's version": "    src: /proc/driver/nvidia/version",
    "running or parsing `dkms status`": "  ansible.builtin.command: dkms status",
    "a regex over dkms status lines": (
        "nvidia_driver_dkms_line_re: "
        "'^(nvidia[\\w-]*)[/,]\\s*([0-9.]+),\\s*(\\S+),\\s*[^:]*:\\s*installed'"
    ),
    "the driver/CUDA fit's driver versions": "cuda_minor_compat_driver: 450.80.02",
}


@pytest.mark.parametrize("what", sorted(FORBIDDEN))
def test_each_pattern_catches_what_it_was_written_for(what):
    assert FORBIDDEN[what].search(WRITTEN_BEFORE[what])


# What nix/host-driver.sh held before it asked the engine, and what it does now.
SCRIPT_WRITTEN_BEFORE = {
    **{k: v for k, v in WRITTEN_BEFORE.items() if k in SCRIPT_FORBIDDEN},
    "the loaded module's version line": (
        "  have=$(grep -oE 'Kernel Module +[0-9.]+' /proc/driver/nvidia/version"
        " | grep -oE '[0-9.]+$' || true)"
    ),
    "reading the loaded driver's version with a text tool": (
        "  have=$(grep -oE 'Kernel Module +[0-9.]+' /proc/driver/nvidia/version)"
    ),
    "comparing driver versions": (
        """  if [[ $(printf '%s\\n%s\\n' "$OLDGPU_MIN_DRIVER" "$have" | sort -V | head -n 1) ]]"""
    ),
}


@pytest.mark.parametrize("what", sorted(SCRIPT_FORBIDDEN))
def test_each_script_pattern_catches_what_it_was_written_for(what):
    assert SCRIPT_FORBIDDEN[what].search(SCRIPT_WRITTEN_BEFORE[what])


def test_handing_the_version_file_to_the_engine_is_allowed():
    asks = 'doc=$(oldgpu driver --json --proc-version-file "$proc" 2>/dev/null)'
    default = "proc=${OLDGPU_PROC_DRIVER_VERSION:-/proc/driver/nvidia/version}"
    for line in (asks, default):
        assert not any(p.search(line) for p in SCRIPT_FORBIDDEN.values())


def test_argv_form_of_dkms_status_is_caught_too():
    assert FORBIDDEN["running or parsing `dkms status`"].search("argv: [dkms, status]")
    # Building the module is the role's job, not a re-derivation.
    assert not FORBIDDEN["running or parsing `dkms status`"].search(
        'argv: [dkms, autoinstall, -k, "{{ item }}"]'
    )


def test_the_gpu_roles_read_the_engines_answer(role_lines):
    asks = {
        path.relative_to(ROLES).parts[0]
        for path, _, line in role_lines
        if re.search(r"tasks_from:\s*driver\b", line)
    }
    assert {"nvidia_driver", "cuda"} <= asks
    # One place for the supported distributions, used by both preflights.
    os_checks = [
        path.relative_to(ROLES).as_posix()
        for path, _, line in role_lines
        if "distribution_major_version'] in [" in line
    ]
    assert os_checks == ["oldgpu_engine/tasks/supported_os.yml"]
    users = {
        path.relative_to(ROLES).parts[0]
        for path, _, line in role_lines
        if re.search(r"tasks_from:\s*supported_os\b", line)
    }
    assert users == {"nvidia_driver", "cuda"}
