"""The engine's choices per Debian release (oldgpu distro, oldgpu profile --distro): the
driver branch per card from the release's own archive, the CUDA 11.8 toolkit's source, the
venv's interpreter, and the refusals."""

from __future__ import annotations

import re

import pytest
from conftest import cli_runner

from oldgpu import distro, interpreter, pins, profile
from oldgpu.output import EngineError


@pytest.fixture
def run_cli(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, ("oldgpu.distro",), "distro")


@pytest.mark.parametrize(
    ("arch", "branch", "flavours", "module"),
    [
        ("maxwell", 550, ["proprietary"], "nvidia-kernel-dkms"),
        ("pascal", 550, ["proprietary"], "nvidia-kernel-dkms"),
        ("volta", 550, ["proprietary"], "nvidia-kernel-dkms"),
        ("turing", 550, ["proprietary", "open"], "nvidia-kernel-dkms"),
        ("ampere", 550, ["proprietary", "open"], "nvidia-kernel-dkms"),
        ("hopper", 550, ["proprietary", "open"], "nvidia-kernel-dkms"),
        ("cpu", 550, ["proprietary", "open"], "nvidia-kernel-dkms"),
    ],
)
def test_trixie_drives_each_card_with_its_own_550(arch, branch, flavours, module):
    d = profile.profile_for_arch(arch, distro_key="debian-13")["driver"]
    assert (d["selected"], d["flavours"], d["distro"]) == (branch, flavours, "debian-13")
    assert d["branches"] == [535, 550]
    assert distro.RELEASES["debian-13"].drivers[d["selected"]][d["flavour"]]["module"] == module


def test_bookworm_choices_are_as_before():
    for arch, branch in (("kepler", 470), ("pascal", 535), ("turing", 535), ("hopper", 535)):
        d = profile.profile_for_arch(arch, distro_key="debian-12")["driver"]
        assert d["selected"] == branch, arch
        # Without a distribution the table's own default, as the Ubuntu path asks.
        assert profile.profile_for_arch(arch)["driver"]["selected"] == branch
    # Debian 12 packages no open modules in step with the driver: only proprietary.
    assert profile.profile_for_arch("turing", distro_key="debian-12")["driver"]["flavours"] == [
        "proprietary"
    ]


def test_pascal_can_take_trixies_tesla_535():
    d = profile.profile_for_arch("pascal", requested_branch=535, distro_key="debian-13")["driver"]
    assert d["selected"] == 535
    packages = distro.RELEASES["debian-13"].drivers[535]["proprietary"]
    assert packages["module"] == "nvidia-tesla-535-kernel-dkms"
    assert "nvidia-tesla-535-driver" in packages["install"]


@pytest.mark.parametrize(
    ("arch", "kwargs", "error"),
    [
        # Open modules on Pascal: the card, not the archive, refuses.
        ("pascal", {"requested_flavour": "open"}, "open-modules-unsupported"),
        # A branch trixie does not package, though the card takes it.
        ("pascal", {"requested_branch": 470}, "driver-branch-not-packaged"),
        ("pascal", {"requested_branch": 580}, "driver-branch-not-packaged"),
        # Cards no trixie branch drives.
        ("kepler", {}, "driver-branch-not-packaged"),
        ("blackwell", {}, "driver-branch-not-packaged"),
        # Open modules on Turing with tesla-535: trixie's open package is 550's.
        (
            "turing",
            {"requested_branch": 535, "requested_flavour": "open"},
            "driver-flavour-not-packaged",
        ),
    ],
)
def test_trixie_refusals_are_named(arch, kwargs, error):
    with pytest.raises(EngineError) as exc:
        profile.profile_for_arch(arch, distro_key="debian-13", **kwargs)
    assert exc.value.name == error


def test_a_packaged_branch_without_the_card_is_the_cards_refusal():
    # Debian 12 packages 470, but Hopper needs 535 or newer.
    with pytest.raises(EngineError) as exc:
        profile.profile_for_arch("hopper", requested_branch=470, distro_key="debian-12")
    assert exc.value.name == "driver-branch-unsupported"
    with pytest.raises(EngineError) as exc:
        profile.profile_for_arch("kepler", requested_branch=535, distro_key="debian-12")
    assert exc.value.name == "driver-branch-unsupported"


def test_the_cuda_toolkit_source_per_release():
    r12, r13 = distro.report("debian-12"), distro.report("debian-13")
    assert r12["cuda"]["source"] == "distribution"
    assert r12["cuda"]["package"] == "nvidia-cuda-toolkit"
    assert r13["cuda"]["source"] == "pip-wheels"
    wheels = r13["cuda"]["wheels"]
    assert wheels == pins.get("cuda.wheels")
    # nvcc of the pinned CUDA, and the runtime torch's cu118 build needs at the same version.
    assert wheels["nvidia-cuda-nvcc-cu11"].startswith(str(pins.get("cuda.version")))
    cu118 = pins.get("torch.variants.cu118.requires")
    assert wheels["nvidia-cuda-runtime-cu11"] == cu118["nvidia-cuda-runtime-cu11"]
    assert wheels["nvidia-cuda-nvrtc-cu11"] == cu118["nvidia-cuda-nvrtc-cu11"]
    assert r13["apt_sources"] == "deb822" and r12["apt_sources"] == "one-line"
    # NVIDIA's 11.8 wheels have ptxas, not nvcc: the roles check ptxas there.
    assert (r12["cuda"]["nvcc"], r13["cuda"]["nvcc"]) == (True, False)


TRIXIE_SOURCES = """\
Types: deb
URIs: http://mirror.lab.example/debian
Suites: trixie trixie-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.lab.example/debian-security/
Suites: trixie-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


@pytest.fixture
def trixie_apt(tmp_path, monkeypatch):
    """A stock trixie host's apt sources (deb822), plus a third party's one-line entry."""
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(TRIXIE_SOURCES)
    (tmp_path / "sources.list.d" / "other.list").write_text(
        "deb [signed-by=/k.gpg] http://other.lab.example/repo stable main\n"
    )
    monkeypatch.setattr(interpreter, "APT_DIR", tmp_path)
    return tmp_path


def test_the_venv_interpreter_is_the_locks_not_trixies(trixie_apt):
    assert pins.get("python.version") == "3.11"
    r12 = distro.report("debian-12")["python"]
    assert (r12["source"], r12["path"], r12["interpreter"]) == (
        "system",
        "/usr/bin/python3.11",
        "python3.11",
    )
    assert r12["install"] == ["python3.11", "python3.11-venv"] and r12["apt"] is None
    # Debian 13: Debian 12's python3.11 from the host's own mirrors, pip from trixie's wheel.
    r13 = distro.report("debian-13")["python"]
    assert (r13["source"], r13["path"], r13["interpreter"]) == (
        "debian-12",
        "/usr/bin/python3.11",
        "python3.11",  # the venv key's interpreter, as on Debian 12
    )
    assert r13["install"] == ["python3.11", "python3-pip-whl"]
    apt = r13["apt"]
    assert (apt["mirror"], apt["security_mirror"]) == (
        "http://mirror.lab.example/debian",
        "http://mirror.lab.example/debian-security",
    )
    assert apt["packages"] == [
        "python3.11",
        "python3.11-minimal",
        "libpython3.11-minimal",
        "libpython3.11-stdlib",
    ]
    stanzas = [s for s in apt["sources"].split("\n\n") if "Types:" in s]
    assert [re.search(r"Suites: (.*)", s).group(1) for s in stanzas] == [
        "bookworm",
        "bookworm-security",
    ]
    assert all("Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" in s for s in stanzas)
    assert "URIs: http://mirror.lab.example/debian-security\n" in stanzas[1]
    # Nothing else from bookworm: every package of it at -1, its python3.11 at 500.
    pins_ = [
        dict(re.findall(r"^([\w-]+): (.*)$", p, re.M)) for p in apt["preferences"].split("\n\n")
    ]
    pins_ = [p for p in pins_ if "Package" in p]
    for suite in ("bookworm", "bookworm-security"):
        rules = {p["Package"]: p["Pin-Priority"] for p in pins_ if p["Pin"] == f"release n={suite}"}
        assert rules == {"*": "-1", " ".join(apt["packages"]): "500"}, suite
    given = distro.report("debian-13", "/opt/cpython-3.11/bin/python3.11")["python"]
    assert (given["source"], given["path"], given["install"]) == (
        "given",
        "/opt/cpython-3.11/bin/python3.11",
        [],
    )


def test_the_mirrors_can_be_named(trixie_apt):
    r = distro.report(
        "debian-13",
        mirror="http://deb.lab.example/debian/",
        security_mirror="http://sec.lab.example/debian-security",
    )["python"]["apt"]
    assert (r["mirror"], r["security_mirror"]) == (
        "http://deb.lab.example/debian",
        "http://sec.lab.example/debian-security",
    )


def test_one_line_sources_are_read_too(tmp_path):
    (tmp_path / "sources.list").write_text(
        "# a comment\n"
        "deb http://mirror.lab.example/debian trixie main contrib\n"
        "deb-src http://mirror.lab.example/debian trixie main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg]"
        " http://sec.lab.example/ds trixie-security main\n"
    )
    found = interpreter.host_mirrors("trixie", interpreter.host_entries(tmp_path))
    assert found == {
        "archive": "http://mirror.lab.example/debian",
        "security": "http://sec.lab.example/ds",
        "signed_by": "/usr/share/keyrings/k.gpg",
    }


def test_without_a_way_to_the_interpreter_it_is_refused_by_name(trixie_apt, tmp_path):
    off = distro.report("debian-13", apt=False)["python"]
    assert off["source"] == "missing" and off["error"] == "python-interpreter-unavailable"
    assert "numpy" in off["message"] and "python_env_python_apt is off" in off["message"]
    assert "python_env_python" in off["message"]
    # A host whose sources name no trixie mirror, and no mirror given.
    none = distro.interpreter.choose(distro.get("debian-13"), distro.RELEASES, entries=[])
    assert none["error"] == "python-interpreter-unavailable"
    assert "python_env_python_mirror" in none["message"], none["message"]


def test_cli_refuses_a_venv_without_an_interpreter(run_cli, trixie_apt):
    code, out, err = run_cli("--distro", "debian-13", "--need-python", "--no-python-apt")
    assert code != 0 and "python-interpreter-unavailable" in err
    code, out, _ = run_cli("--json", "--distro", "debian-13", "--need-python", "--python", "/p")
    assert code == 0 and out["python"]["path"] == "/p"
    code, out, _ = run_cli("--json", "--distro", "debian-13", "--need-python")
    assert code == 0 and out["python"]["source"] == "debian-12"
    code, out, _ = run_cli(
        "--json", "--distro", "debian-13", "--python-mirror", "http://m.lab.example/debian"
    )
    assert out["python"]["apt"]["mirror"] == "http://m.lab.example/debian"
    code, out, _ = run_cli("--json", "--distro", "debian-12", "--need-python")
    assert code == 0 and out["driver"]["default"] == 535


def test_unknown_release_and_os_release():
    with pytest.raises(EngineError) as exc:
        distro.get("debian-11")
    assert exc.value.name == "distro-unsupported"
    text = 'PRETTY_NAME="Debian GNU/Linux 13 (trixie)"\nID=debian\nVERSION_ID="13"\n'
    assert distro.key_from_os_release(text) == "debian-13"
    assert distro.key_from_os_release('ID=ubuntu\nVERSION_ID="22.04"\n') == "ubuntu-22"
    assert distro.key_from_os_release("") == ""
