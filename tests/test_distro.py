"""The engine's choices per Debian release (oldgpu distro, oldgpu profile --distro): the
driver branch per card from the release's own archive, the CUDA 11.8 toolkit's source, the
venv's interpreter, and the refusals."""

from __future__ import annotations

import pytest
from conftest import cli_runner

from oldgpu import distro, pins, profile
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


def test_the_venv_interpreter_is_the_locks_not_trixies():
    assert pins.get("python.version") == "3.11"
    r12 = distro.report("debian-12")["python"]
    assert (r12["source"], r12["path"]) == ("system", "/usr/bin/python3.11")
    r13 = distro.report("debian-13")["python"]
    assert r13["source"] == "missing" and r13["error"] == "python-interpreter-unavailable"
    assert "numpy" in r13["message"] and "python_env_python" in r13["message"]
    given = distro.report("debian-13", "/opt/cpython-3.11/bin/python3.11")["python"]
    assert (given["source"], given["path"]) == ("given", "/opt/cpython-3.11/bin/python3.11")


def test_cli_refuses_a_venv_without_an_interpreter(run_cli):
    code, out, err = run_cli("--distro", "debian-13", "--need-python")
    assert code != 0 and "python-interpreter-unavailable" in err
    code, out, _ = run_cli("--json", "--distro", "debian-13", "--need-python", "--python", "/p")
    assert code == 0 and out["python"]["path"] == "/p"
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
