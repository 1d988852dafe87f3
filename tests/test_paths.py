"""The fixed paths have one owner (oldgpu.paths); everything that names them agrees."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

import yaml

from oldgpu import cli, jobs, paths, verl_release

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "files/systemd/verl-train@.service"
START = ROOT / "files/bin/verl-train"
ENGINE_JSON = ROOT / "nix/engine.json"
ENGINE_VARS = ROOT / "roles/oldgpu_engine/vars/main.yml"
TABLE = paths.as_dict()
# The newer releases' places (``releases`` in `oldgpu paths --json`), by release.
RELEASES = paths.releases()
# A literal that looks like one of the fixed paths.
LITERAL = re.compile(
    r"(?:/opt/verl|/var/lib/verl|/var/log/verl|/etc/verl|/usr/local/bin/oldgpu)[^\s\"',)}]*"
)
# Literals YAML on another branch still holds; the lead removes each on merge.
ELSEWHERE = {
    # nvidia_driver is rewritten for `oldgpu driver --json` on another branch.
    ("roles/nvidia_driver/tasks/preflight.yml", "/usr/local/bin/oldgpu"),
}


def _unit() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def _known(literal: str) -> bool:
    """A fixed path, or a name under one (…/<name>.env, …/*.log)."""
    known = [*TABLE.values(), *(p for where in RELEASES.values() for p in where.values())]
    return any(literal == v or literal.startswith(v + "/") for v in known)


def test_the_table_is_absolute_and_nested_as_the_unit_expects():
    for key, value in TABLE.items():
        if key not in ("user", "group"):
            assert PurePosixPath(value).is_absolute(), key
    assert paths.JOBS_DIR.parent == paths.CONFIG_DIR
    assert paths.STATE_DIR.parent == paths.DATA_DIR
    for inside in ("bin_dir", "engine_dir", "venv_dir", "venvs_dir", "verl_dir", "trees_dir"):
        assert PurePosixPath(TABLE[inside]).parent == paths.CODE_DIR, inside


def test_the_newer_releases_live_beside_the_default_each_in_its_own_directories():
    assert RELEASES and paths.pins.get("verl.version") not in RELEASES
    for version, where in RELEASES.items():
        for key in ("venv_dir", "venvs_dir", "verl_dir", "trees_dir"):
            assert PurePosixPath(where[key]).parent == paths.CODE_DIR, (version, key)
            assert version in where[key]
        # A switch prunes its target's siblings: no release shares the default's builds.
        assert where["venvs_dir"] != TABLE["venvs_dir"] and where["trees_dir"] != TABLE["trees_dir"]
        assert PurePosixPath(where["sdist"]).parent == PurePosixPath(TABLE["verl_src_dir"]).parent
        assert verl_release.dirs(version) == {"venv": where["venv_dir"], "tree": where["verl_dir"]}


def test_oldgpu_engine_paths_json_prints_the_table(capsys):
    assert cli.main(["paths", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {**TABLE, "releases": RELEASES}
    assert cli.main(["paths"]) == 0
    text = capsys.readouterr().out
    assert f"jobs_dir      {paths.JOBS_DIR}" in text


def test_the_engine_reads_the_same_table():
    assert (jobs.JOBS_DIR, jobs.STATE_DIR, jobs.LOG_DIR) == (
        paths.JOBS_DIR,
        paths.STATE_DIR,
        paths.LOG_DIR,
    )
    assert str(paths.VENV_PYTHON) == cli.DEFAULT_VENV_PYTHON


def test_the_unit_names_the_tables_paths():
    unit = _unit()
    assert unit["User"] == [paths.USER] and unit["Group"] == [paths.GROUP]
    env = f"{paths.JOBS_DIR}/%i.env"
    assert unit["ConditionPathExists"] == [env]
    assert unit["EnvironmentFile"] == [env, f"-{paths.JOBS_DIR}/%i.secrets.env"]
    assert unit["ExecStart"] == [str(paths.START_SCRIPT)]
    assert unit["ExecStop"] == [f"{paths.START_SCRIPT} --reap"]
    # systemd puts StateDirectory= under /var/lib and LogsDirectory= under /var/log.
    assert unit["StateDirectory"] == [f"{paths.STATE_DIR.relative_to('/var/lib')}/%i"]
    assert unit["LogsDirectory"] == [str(paths.LOG_DIR.relative_to("/var/log"))]
    doc = unit["Documentation"][0].removeprefix("file://")
    assert doc.startswith(f"{paths.ENGINE_DIR}/"), doc


def test_the_start_scripts_defaults_are_the_tables():
    text = START.read_text(encoding="utf-8")
    defaults = dict(re.findall(r"^\w+=\$\{(\w+):-([^}]+)\}$", text, re.M))
    assert defaults == {
        "OLDGPU_BIN": str(paths.ENGINE_BIN),
        "VERL_VENV": str(paths.VENV_DIR),
        "VERL_DIR": str(paths.VERL_DIR),
        "LOGS_DIRECTORY": str(paths.LOG_DIR),
    }


def test_nix_reads_the_same_table():
    want = {**TABLE, "releases": RELEASES}
    assert json.loads(ENGINE_JSON.read_text(encoding="utf-8"))["paths"] == want


def test_the_retired_role_options_map_to_the_table():
    retired = yaml.safe_load(ENGINE_VARS.read_text(encoding="utf-8"))
    table = retired["oldgpu_engine_retired_path_options"]
    assert set(table.values()) <= set(TABLE)
    assert {"base_user", "base_data_dir", "python_env_dir", "verl_dir"} <= set(table)
    # None of them is still an option of a role.
    for specs in ROOT.glob("roles/*/meta/argument_specs.yml"):
        for entry in yaml.safe_load(specs.read_text(encoding="utf-8"))["argument_specs"].values():
            assert not set(entry.get("options") or {}) & set(table), specs
    for defaults in ROOT.glob("roles/*/defaults/main.yml"):
        assert not set(yaml.safe_load(defaults.read_text(encoding="utf-8")) or {}) & set(table)


def test_roles_take_the_paths_from_the_engine():
    """What a role does takes the paths from oldgpu_engine_paths; its prose names them right."""
    problems = []
    files = (p for p in (ROOT / "roles").rglob("*") if p.is_file() and not p.is_symlink())
    for path in sorted(files):
        rel = str(path.relative_to(ROOT))
        prose_only = "/meta/" in rel
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            comment = line.lstrip().startswith("#")
            for literal in LITERAL.findall(line):
                where = f"{rel}:{number}: {literal}"
                if (rel, literal) in ELSEWHERE:
                    continue
                if not (prose_only or comment):
                    problems.append(f"{where}: use the fact oldgpu_engine_paths")
                elif not _known(literal):
                    problems.append(f"{where} is none of `oldgpu paths`")
    assert not problems, "\n".join(problems)
