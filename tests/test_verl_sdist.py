"""``oldgpu verl-sdist``: a newer release's sdist in place, checked, from a mirror or pip."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import SdistUnavailable, download_verl_sdist

from oldgpu import cli, pins, verl_sdist
from oldgpu.output import EngineError

VERSION = "0.9.0"


@pytest.fixture(scope="module")
def sdist() -> Path:
    try:
        return download_verl_sdist(VERSION)
    except SdistUnavailable as exc:
        pytest.skip(f"verl {VERSION} sdist cannot be downloaded from the pip index: {exc}")


@pytest.fixture
def mirror(sdist, tmp_path) -> Path:
    where = tmp_path / "mirror"
    where.mkdir()
    shutil.copyfile(sdist, where / sdist.name)
    return where


def run(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["verl-sdist", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_pinned_sum_is_the_cached_sdists(sdist):
    assert verl_sdist.sha256_of(sdist) == verl_sdist.pinned_sha256(VERSION)


def test_from_a_mirror_directory_then_kept(capsys, mirror, tmp_path):
    dest = tmp_path / "src"
    code, doc = run(capsys, VERSION, str(dest), "--mirror", str(mirror))
    assert code == 0 and doc["changed"] and doc["source"] == "mirror"
    assert verl_sdist.sha256_of(dest / "verl-0.9.0.tar.gz") == doc["sha256"]
    code, doc = run(capsys, VERSION, str(dest), "--mirror", str(mirror))
    assert code == 0 and not doc["changed"] and doc["source"] == "kept"
    assert sorted(p.name for p in dest.iterdir()) == ["verl-0.9.0.tar.gz"]


def test_from_a_mirror_url(capsys, mirror, tmp_path):
    code, doc = run(capsys, VERSION, str(tmp_path / "src"), "--mirror", mirror.as_uri())
    assert code == 0 and doc["source"] == "mirror"
    assert Path(doc["path"]).is_file()


def test_check_mode_says_and_writes_nothing(capsys, mirror, tmp_path):
    dest = tmp_path / "src"
    code, doc = run(capsys, VERSION, str(dest), "--mirror", str(mirror), "--check")
    assert code == 0 and doc["changed"] and doc["check"]
    assert not dest.exists()


def test_a_wrong_file_is_refused_naming_both_sums_and_nothing_is_left(capsys, mirror, tmp_path):
    dest = tmp_path / "src"
    dest.mkdir()
    (mirror / "verl-0.9.0.tar.gz").write_bytes(b"not verl")
    # A truncated copy already there is replaced only by a good one.
    (dest / "verl-0.9.0.tar.gz").write_bytes(b"cut")
    code, doc = run(capsys, VERSION, str(dest), "--mirror", str(mirror))
    assert code == 2 and doc["error"] == "verl-sdist-sha256-mismatch"
    assert verl_sdist.pinned_sha256(VERSION) in doc["message"]
    assert sorted(p.name for p in dest.iterdir()) == ["verl-0.9.0.tar.gz"]
    assert (dest / "verl-0.9.0.tar.gz").read_bytes() == b"cut"


def test_a_missing_mirror_is_named(capsys, tmp_path):
    code, doc = run(capsys, VERSION, str(tmp_path / "src"), "--mirror", str(tmp_path / "none"))
    assert code == 2 and doc["error"] == "verl-sdist-fetch-failed"


def test_through_pip_offline_with_the_interpreters_setuptools(capsys, mirror, tmp_path):
    # What the verl role runs on a host whose pip source is a wheelhouse.
    dest = tmp_path / "src"
    argv = [VERSION, str(dest), "--python", sys.executable, "--no-index"]
    code, doc = run(capsys, *argv, "--find-links", str(mirror), "--no-build-isolation")
    assert code == 0 and doc["source"] == "pip", doc
    assert verl_sdist.sha256_of(dest / "verl-0.9.0.tar.gz") == doc["sha256"]
    assert sorted(p.name for p in dest.iterdir()) == ["verl-0.9.0.tar.gz"]


def test_pip_refuses_an_archive_of_another_sum(capsys, sdist, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    data = bytearray(sdist.read_bytes())
    (other / sdist.name).write_bytes(bytes(data) + b"\0")  # gzip ignores trailing bytes
    dest = tmp_path / "src"
    argv = [VERSION, str(dest), "--python", sys.executable, "--no-index"]
    code, doc = run(capsys, *argv, "--find-links", str(other), "--no-build-isolation")
    assert code == 2 and doc["error"] == "verl-sdist-sha256-mismatch", doc
    assert not (dest / "verl-0.9.0.tar.gz").exists()


def test_the_default_release_and_unknown_ones_are_refused():
    with pytest.raises(EngineError) as err:
        verl_sdist.pinned_sha256(pins.get("verl.version"))
    assert err.value.name == "verl-sdist-not-pinned"
    with pytest.raises(EngineError) as err:
        verl_sdist.pinned_sha256("9.9.9")
    assert err.value.name == "verl-version-unknown"
