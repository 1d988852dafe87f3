"""lock-check against a real interpreter (the one running these tests)."""

import sys

import pytest

from oldgpu import lockcheck
from oldgpu.cli import main
from oldgpu.output import EngineError


def freeze() -> dict[str, str]:
    # What the interpreter sees as a fresh process (this one also sees src/ on sys.path).
    return lockcheck.installed(sys.executable)


def write_lock(tmp_path, entries):
    path = tmp_path / "x.lock"
    path.write_text("# header\n" + "".join(f"{n}=={v}\n" for n, v in entries.items()))
    return path


def test_a_venv_matches_its_own_freeze(tmp_path, capsys):
    lock = write_lock(tmp_path, freeze())
    assert main(["lock-check", str(lock), "--python", sys.executable, "--json"]) == 0
    assert '"matches": true' in capsys.readouterr().out


def test_a_moved_version_a_missing_and_an_extra_package_are_each_named(tmp_path):
    have = freeze()
    lock = dict(have)
    moved = "pytest" if "pytest" in lock else next(iter(lock))
    lock[moved] = "0.0.1"
    lock["not-installed-anywhere"] = "1.0"
    dropped = next(n for n in sorted(lock) if n not in (moved, "not-installed-anywhere", "pip"))
    del lock[dropped]
    report = lockcheck.compare(lockcheck.read_lock(write_lock(tmp_path, lock)), have)
    assert not report["matches"]
    assert report["mismatched"][moved] == {"lock": "0.0.1", "installed": have[moved]}
    assert report["missing"] == ["not-installed-anywhere"]
    assert dropped in report["extra"]


def test_a_lock_with_a_range_is_refused(tmp_path):
    path = tmp_path / "bad.lock"
    path.write_text("torch>=2.6\n")
    with pytest.raises(EngineError) as err:
        lockcheck.read_lock(path)
    assert err.value.name == "lock-not-exact"
