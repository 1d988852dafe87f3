"""``oldgpu venv ensure`` and ``oldgpu switch``: real venvs, real pip, tiny wheels.

The wheels are made on the spot (tests/tinywheel.py), so the tests run offline
on any machine: pip installs them with --no-index from a temporary wheelhouse,
into venvs of the interpreter running the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tinywheel import make_wheel

from oldgpu import cli, venv
from oldgpu.output import EngineError

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    wh = tmp_path_factory.mktemp("wheelhouse")
    make_wheel(wh, "tinyapp", "1.0")
    make_wheel(wh, "tinyapp", "2.0")
    # Metadata says 2.0, the module says 1.9: only importing it tells.
    make_wheel(wh, "skewed", "2.0", module_version="1.9")
    # Needs tinylib, which no lock below lists: pip check fails.
    make_wheel(wh, "needy", "1.0", requires=("tinylib>=1",))
    return wh


def write_lock(path: Path, *pins: str) -> Path:
    path.write_text("# test lock\n" + "".join(f"{p}\n" for p in pins))
    return path


def ensure(lock: Path, directory: Path, wheelhouse: Path, *extra: str) -> tuple[int, dict]:
    """The command as the roles run it (in this process)."""
    argv = ["venv", "ensure", str(lock), str(directory), "--python", sys.executable]
    argv += ["--no-index", "--wheelhouse", str(wheelhouse), "--json", *extra]
    out = subprocess.run(
        [sys.executable, "-m", "oldgpu", *argv],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        check=False,
    )
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else {}


@pytest.fixture(scope="module")
def built(tmp_path_factory, wheelhouse: Path) -> dict:
    """One venv built from a lock of tinyapp 1.0 and skewed 2.0, link DIR/venv."""
    root = tmp_path_factory.mktemp("built")
    lock = write_lock(root / "a.lock", "tinyapp==1.0", "skewed==2.0")
    rc, doc = ensure(lock, root / "opt", wheelhouse)
    assert rc == 0, doc
    return {"root": root, "lock": lock, "dir": root / "opt", "doc": doc}


# --- venv ensure ----------------------------------------------------------------


def test_builds_verifies_and_links_the_lock(built: dict) -> None:
    doc, d = built["doc"], built["dir"]
    assert doc["changed"] and doc["built"] and doc["switched"]
    assert doc["previous"] is None and doc["pruned"] == [] and doc["removed"] == []
    assert doc["path"] == str(d / "venvs" / doc["key"])
    assert os.readlink(d / "venv") == doc["path"]
    # The venv's scripts work through the link: it was built where it lives.
    out = subprocess.run([d / "venv" / "bin" / "tinyapp"], capture_output=True, text=True)
    assert out.stdout.strip() == "tinyapp 1.0"
    assert not [p.name for p in (d / "venvs").iterdir() if p.name.endswith(".building")]


def test_the_key_is_the_python_env_roles(built: dict) -> None:
    # lookup('file', lock) ~ extras | join(' ') ~ interpreter, sha256, 16 characters.
    text = built["lock"].read_text().rstrip() + "" + sys.executable
    assert built["doc"]["key"] == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_second_run_changes_nothing(built: dict, wheelhouse: Path) -> None:
    venvs = built["dir"] / "venvs"
    before = {p.name: p.stat().st_mtime_ns for p in venvs.iterdir()}
    rc, doc = ensure(built["lock"], built["dir"], wheelhouse)
    assert rc == 0
    assert doc["changed"] is False and doc["built"] is False and doc["switched"] is False
    assert doc["path"] == built["doc"]["path"]
    assert {p.name: p.stat().st_mtime_ns for p in venvs.iterdir()} == before


def test_check_reports_a_new_lock_and_changes_nothing(built: dict, wheelhouse: Path) -> None:
    d = built["dir"]
    rc, doc = ensure(built["lock"], d, wheelhouse, "--check")
    assert rc == 0 and doc["changed"] is False and doc["check"] is True
    new = write_lock(built["root"] / "b.lock", "tinyapp==2.0")
    rc, doc = ensure(new, d, wheelhouse, "--check", "--keep", "0")
    assert rc == 0
    assert doc["changed"] and doc["built"] and doc["switched"]
    assert doc["pruned"] == [built["doc"]["path"]]
    assert not Path(doc["path"]).exists()
    assert os.readlink(d / "venv") == built["doc"]["path"]
    assert Path(built["doc"]["path"]).is_dir()


def test_imported_versions_are_checked_against_the_lock(built: dict) -> None:
    python = str(built["dir"] / "venv" / "bin" / "python")
    pins = {"tinyapp": "1.0", "skewed": "2.0"}
    venv.verify(python, pins, imports=("tinyapp",))
    with pytest.raises(EngineError) as err:
        venv.verify(python, pins, imports=("tinyapp", "skewed"))
    assert err.value.name == "venv-verify-failed"
    assert "skewed imports as 1.9, the lock says 2.0" in err.value.message
    # A lock pin without a local label accepts the build's label (torch 2.6.0+cu124).
    assert venv._same_version("2.6.0+cu124", "2.6.0")
    assert not venv._same_version("2.6.0+cu124", "2.6.0+cu118")
    assert not venv._same_version("2.7.0", "2.6.0")


def test_new_lock_switches_and_prunes_beyond_keep(tmp_path: Path, wheelhouse: Path) -> None:
    d = tmp_path / "opt"
    rc, first = ensure(write_lock(tmp_path / "a.lock", "tinyapp==1.0"), d, wheelhouse)
    assert rc == 0
    # Another lock: a second venv, the first kept for rollback (--keep 1).
    second_lock = write_lock(tmp_path / "b.lock", "tinyapp==2.0")
    rc, second = ensure(second_lock, d, wheelhouse)
    assert rc == 0 and second["built"] and second["switched"]
    assert second["previous"] == first["path"]
    assert second["pruned"] == [] and Path(first["path"]).is_dir()
    out = subprocess.run([d / "venv" / "bin" / "tinyapp"], capture_output=True, text=True)
    assert out.stdout.strip() == "tinyapp 2.0"
    # --keep 0: the older one goes, the current one stays; nothing is rebuilt.
    rc, again = ensure(second_lock, d, wheelhouse, "--keep=0")
    assert rc == 0 and again["changed"] and not again["built"] and not again["switched"]
    assert again["pruned"] == [first["path"]]
    assert sorted(p.name for p in (d / "venvs").iterdir() if not p.name.startswith(".")) == [
        second["key"]
    ]


def test_extras_are_part_of_the_key() -> None:
    lock = "tinyapp==1.0\n"
    assert (
        venv.venv_key(lock, ["skewed==2.0"], "python3")
        == (hashlib.sha256(b"tinyapp==1.0skewed==2.0python3").hexdigest()[:16])
    )
    assert venv.venv_key(lock, [], "python3") != venv.venv_key(lock, ["skewed==2.0"], "python3")
    assert venv.venv_key(lock, [], "python3") != venv.venv_key(lock, [], "python3.11")


def test_failed_verification_keeps_the_old_link(built: dict, wheelhouse: Path) -> None:
    d = built["dir"]
    lock = write_lock(built["root"] / "needy.lock", "needy==1.0")
    rc, doc = ensure(lock, d, wheelhouse)
    assert rc == venv.BUILD_FAILED
    assert doc["error"] == "venv-verify-failed"
    assert "needy 1.0 requires tinylib" in doc["message"]
    assert os.readlink(d / "venv") == built["doc"]["path"]
    # Nothing of the failed venv is left: no directory, no marker.
    names = {p.name for p in (d / "venvs").iterdir()}
    assert names == {built["doc"]["key"], ".oldgpu-venv.lock"}


def test_failed_install_names_pip_error_and_keeps_the_old_link(
    built: dict, wheelhouse: Path
) -> None:
    lock = write_lock(built["root"] / "bad.lock", "tinyapp==9.9.9")
    rc, doc = ensure(lock, built["dir"], wheelhouse)
    assert rc == venv.BUILD_FAILED and doc["error"] == "venv-install-failed"
    assert "tinyapp==9.9.9" in doc["message"]
    assert os.readlink(built["dir"] / "venv") == built["doc"]["path"]


def test_interrupted_build_never_becomes_current_and_is_removed(
    tmp_path: Path, wheelhouse: Path
) -> None:
    d = tmp_path / "opt"
    lock = write_lock(tmp_path / "a.lock", "tinyapp==1.0")
    key = venv.request(lock, d, python=sys.executable).key
    cmd = [sys.executable, "-m", "oldgpu", "venv", "ensure", str(lock), str(d)]
    cmd += ["--python", sys.executable, "--no-index", "--wheelhouse", str(wheelhouse)]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(SRC)), start_new_session=True)
    target = d / "venvs" / key
    deadline = time.monotonic() + 120
    while not (target / "pyvenv.cfg").exists() and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # Killed in the middle of the build (the venv and pip run as its children).
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (d / "venvs" / f".{key}.building").exists()
    assert not os.path.lexists(d / "venv")
    rc, doc = ensure(lock, d, wheelhouse)
    assert rc == 0 and doc["built"] and doc["removed"] == [str(target)]
    assert os.readlink(d / "venv") == str(target)
    assert not (d / "venvs" / f".{key}.building").exists()


@pytest.mark.parametrize(
    ("setup", "args", "error"),
    [
        (lambda p: None, [], "lock-missing"),
        (lambda p: p.mkdir(), [], "lock-unreadable"),
        (lambda p: p.write_bytes(b"torch==2.6.0\n\xff\xfe\n"), [], "lock-not-utf8"),
        (lambda p: p.write_text("torch>=2\n"), [], "lock-not-exact"),
        (lambda p: p.write_text("# nothing\n"), [], "lock-empty"),
        (lambda p: p.write_text("torch==2.6.0\n"), ["--keep", "-1"], "keep-invalid"),
        (lambda p: p.write_text("torch==2.6.0\n"), ["--keep", "two"], "keep-invalid"),
        (lambda p: p.write_text("torch==2.6.0\n"), ["--extra", "ray"], "extra-not-exact"),
        (
            lambda p: p.write_text("torch==2.6.0\n"),
            ["--extra", "torch==2.7.0"],
            "extra-conflicts-lock",
        ),
        (lambda p: p.write_text("torch==2.6.0\n"), ["--python", "no-such-py"], "python-missing"),
        (
            lambda p: p.write_text("torch==2.6.0\n"),
            ["--wheelhouse", "/nonexistent/wheels"],
            "wheelhouse-missing",
        ),
        (lambda p: p.write_text("torch==2.6.0\n"), ["--no-index"], "no-source"),
    ],
)
def test_bad_input_is_named_before_anything_changes(
    tmp_path: Path, capsys, setup, args, error
) -> None:
    lock = tmp_path / "x.lock"
    setup(lock)
    code = cli.main(["venv", "ensure", str(lock), str(tmp_path / "opt"), "--json", *args])
    assert code == 2
    assert json.loads(capsys.readouterr().out)["error"] == error
    assert not (tmp_path / "opt").exists()


def _python_without_ensurepip(root: Path) -> Path:
    """This interpreter as Debian 12's python3.11 is on Debian 13: no ensurepip."""
    block = root / "block" / "ensurepip"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text(
        "raise ImportError('no ensurepip: python3.11-venv absent')\n"
    )
    wrapper = root / "python3.11"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={root / "block"} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _a_pip_wheel(into: Path) -> Path:
    """A pip wheel as Debian's python3-pip-whl lays it down (this Python's own, or Debian's)."""
    import ensurepip

    found = sorted(Path(ensurepip.__file__).parent.glob("_bundled/pip-*.whl")) or sorted(
        Path("/usr/share/python-wheels").glob("pip-*.whl")
    )
    assert found, "no pip wheel on this machine to stand in for python3-pip-whl"
    into.mkdir()
    (into / found[-1].name).write_bytes(found[-1].read_bytes())
    return into


def test_an_interpreter_without_ensurepip_gets_debians_pip_wheel(
    tmp_path: Path, wheelhouse: Path, monkeypatch
) -> None:
    python = _python_without_ensurepip(tmp_path)
    assert subprocess.run([python, "-c", "import ensurepip"], capture_output=True).returncode != 0
    lock = write_lock(tmp_path / "a.lock", "tinyapp==1.0")
    sources = ("--no-index", "--find-links", str(wheelhouse))
    v = venv.request(lock, tmp_path / "opt", python=str(python), sources=sources)
    # No wheel of pip: refused by name before anything is made.
    monkeypatch.setattr(venv, "PIP_WHEELS", tmp_path / "none")
    with pytest.raises(EngineError) as exc:
        venv.ensure(v)
    assert exc.value.name == "venv-no-pip" and "python3-pip-whl" in exc.value.message
    assert not v.target.exists()
    monkeypatch.setattr(venv, "PIP_WHEELS", _a_pip_wheel(tmp_path / "wheels"))
    doc = venv.ensure(v)
    assert doc["built"] and os.readlink(tmp_path / "opt" / "venv") == str(v.target)
    pip = subprocess.run(
        [v.target / "bin" / "python", "-m", "pip", "--version"], capture_output=True, text=True
    )
    assert pip.returncode == 0 and str(v.target) in pip.stdout, pip.stderr
    # Installed by name, as ensurepip does: pip freeze names its version, not a file.
    freeze = subprocess.run(
        [v.target / "bin" / "python", "-m", "pip", "freeze", "--all"],
        capture_output=True,
        text=True,
    ).stdout
    assert re.search(r"^pip==[0-9.]+$", freeze, re.M), freeze
    out = subprocess.run([v.target / "bin" / "tinyapp"], capture_output=True, text=True)
    assert out.stdout.strip() == "tinyapp 1.0"


def test_a_real_directory_at_the_link_is_refused(tmp_path: Path, capsys) -> None:
    lock = write_lock(tmp_path / "x.lock", "tinyapp==1.0")
    (tmp_path / "opt" / "venv").mkdir(parents=True)
    code = cli.main(["venv", "ensure", str(lock), str(tmp_path / "opt"), "--json"])
    assert code == 2
    assert json.loads(capsys.readouterr().out)["error"] == "link-not-symlink"
    assert sorted(p.name for p in (tmp_path / "opt").iterdir()) == ["venv"]


# --- switch ---------------------------------------------------------------------


def _trees(root: Path, *names: str) -> list[Path]:
    paths = []
    for age, name in enumerate(names):  # newest first
        path = root / "trees" / name
        path.mkdir(parents=True)
        os.utime(path, (1_000_000 - age * 1000, 1_000_000 - age * 1000))
        paths.append(path)
    return paths


def test_switch_is_atomic_and_prunes_all_but_keep(tmp_path: Path, capsys) -> None:
    new, old1, old2, old3 = _trees(tmp_path, "new", "old1", "old2", "old3")
    link = tmp_path / "current"
    link.symlink_to(old1)
    code = cli.main(["switch", str(link), str(new), "--keep", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["changed"] and doc["switched"]
    assert doc["previous"] == str(old1)
    # The previous target was made current last: it is the one kept.
    assert doc["pruned"] == [str(old2), str(old3)]
    assert os.readlink(link) == str(new) and old1.is_dir()
    assert not old2.exists() and not old3.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # Again: nothing to do.
    assert cli.main(["switch", str(link), str(new), "--keep", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] is False


def test_switch_check_and_no_keep_change_nothing(tmp_path: Path, capsys) -> None:
    new, old = _trees(tmp_path, "new", "old")
    link = tmp_path / "current"
    link.symlink_to(old)
    cli.main(["switch", str(link), str(new), "--keep", "0", "--check", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["changed"] and doc["pruned"] == [str(old)]
    assert os.readlink(link) == str(old) and old.is_dir()
    # Without --keep nothing is pruned.
    cli.main(["switch", str(link), str(new), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["switched"] and doc["pruned"] == [] and old.is_dir()
    # A target that is not built yet: only check mode accepts it.
    missing = tmp_path / "trees" / "later"
    assert cli.main(["switch", str(link), str(missing), "--check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["switched"] is True
    assert cli.main(["switch", str(link), str(missing), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "switch-target-missing"


def test_switch_refuses_pruning_beside_the_link(tmp_path: Path, capsys) -> None:
    (tmp_path / "tree").mkdir()
    (tmp_path / "precious").mkdir()
    code = cli.main(["switch", str(tmp_path / "cur"), str(tmp_path / "tree"), "--keep", "0"])
    assert code == 2 and "switch-prune-unsafe" in capsys.readouterr().err
    assert (tmp_path / "precious").is_dir() and not os.path.lexists(tmp_path / "cur")
