"""The GPU roles' Ubuntu and Debian paths, rendered (no Ubuntu host can be built here).

tests/ansible/render_gpu_roles.yml loads the roles' own vars files (the Debian ones
read the engine's `oldgpu distro`) and renders their templates with Ansible for
faked Ubuntu 22.04, 20.04, Debian 12 and Debian 13 facts; these tests check the
package lists, apt sources and pins it produced. Debian 12 also runs for real in
molecule/nvidia.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINS = json.loads((ROOT / "files" / "pins.json").read_text())
HOSTS = ("jammy", "focal", "bookworm", "trixie")
GPU_ROLES = ("nvidia_driver", "cuda", "nvidia_cuda_repo")


def _ansible_playbook() -> str | None:
    # The controller venv (make bootstrap) has Ansible; the engine venv does not.
    local = ROOT / ".venv" / "bin" / "ansible-playbook"
    return str(local) if local.is_file() else shutil.which("ansible-playbook")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    exe = _ansible_playbook()
    if exe is None:
        pytest.skip("ansible-playbook not found (run scripts/bootstrap-controller.sh)")
    out = tmp_path_factory.mktemp("rendered")
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [exe, "-i", ",".join(HOSTS), "tests/ansible/render_gpu_roles.yml", "-e", f"out={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return out


def decided(rendered: Path, host: str) -> dict:
    return json.loads((rendered / f"{host}.json").read_text())


def driver_set(rendered: Path, host: str, source: str, variant: str, branch: int, flavour: str):
    for entry in decided(rendered, host)["driver_sets"]:
        if (entry["source"], entry["variant"], entry["branch"], entry["flavour"]) == (
            source,
            variant,
            branch,
            flavour,
        ):
            return entry["set"]
    raise AssertionError(f"{host}: no rendered set for {source} {variant} {branch} {flavour}")


# "source variant branch flavour": "metapackage kernel-module-package utils"
UBUNTU = {
    "distribution headless 535 proprietary": "nvidia-headless-535 nvidia-dkms-535 nvidia-utils-535",
    "distribution desktop 535 proprietary": "nvidia-driver-535 nvidia-dkms-535 nvidia-utils-535",
    "distribution server 535 proprietary":
        "nvidia-driver-535-server nvidia-dkms-535-server nvidia-utils-535-server",
    "distribution server-headless 580 proprietary":
        "nvidia-headless-580-server nvidia-dkms-580-server nvidia-utils-580-server",
    "distribution headless 470 proprietary": "nvidia-headless-470 nvidia-dkms-470 nvidia-utils-470",
    "distribution headless 535 open":
        "nvidia-headless-535-open nvidia-dkms-535-open nvidia-utils-535",
    "distribution server 580 open":
        "nvidia-driver-580-server-open nvidia-dkms-580-server-open nvidia-utils-580-server",
    "cuda_repo headless 535 proprietary": "cuda-drivers-535 nvidia-dkms-535 nvidia-utils-535",
    "cuda_repo headless 470 proprietary": "cuda-drivers-470 nvidia-dkms-470 nvidia-utils-470",
    "cuda_repo headless 580 open": "nvidia-driver-580-open nvidia-dkms-580-open nvidia-utils-580",
}  # fmt: skip


@pytest.mark.parametrize("host", ["jammy", "focal"])
@pytest.mark.parametrize("choice", sorted(UBUNTU))
def test_ubuntu_driver_packages(rendered, host, choice):
    source, variant, branch, flavour = choice.split()
    branch = int(branch)
    top, module, utils = UBUNTU[choice].split()
    s = driver_set(rendered, host, source, variant, branch, flavour)
    assert s["install"][0] == top
    assert s["module"] == module
    suffix = "-server" if source == "distribution" and variant.startswith("server") else ""
    assert s["install"][1:] == [
        module,
        utils,
        f"libnvidia-compute-{branch}{suffix}",  # libcuda
        f"nvidia-compute-utils-{branch}{suffix}",  # nvidia-persistenced
    ]
    assert set(s["install"]) <= set(s["hold"])
    assert all(str(branch) in name for name in s["hold"])
    # Never the open modules unless asked for (and validated by the engine).
    assert any("-open" in n for n in s["install"]) is (flavour == "open")


@pytest.mark.parametrize("host", ["jammy", "focal"])
def test_ubuntu_sets_cover_every_choice(rendered, host):
    d = decided(rendered, host)
    assert d["os_branches"] == [470, 535, 580]
    assert d["os_sources"] == ["distribution", "cuda_repo"]
    assert d["os_headers"] == "linux-headers-generic"
    # 470 predates the open modules: the engine never selects 470/open.
    assert not [e for e in d["driver_sets"] if e["branch"] == 470 and e["flavour"] == "open"]
    assert len(d["driver_sets"]) == 5 * 2 * 2 + 2  # (4 variants + cuda_repo) x 535/580 x flavours


@pytest.mark.parametrize(("host", "distro"), [("jammy", "ubuntu2204"), ("focal", "ubuntu2004")])
def test_ubuntu_cuda_repository_source(rendered, host, distro):
    text = (rendered / f"{host}-cuda.sources").read_text()
    fields = dict(
        line.split(": ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert fields == {
        "Types": "deb",
        "URIs": f"http://cuda-mirror.invalid/compute/cuda/repos/{distro}/x86_64/",
        "Suites": "/",
        "Signed-By": "/usr/share/keyrings/cuda-archive-keyring.gpg",
    }
    repo = decided(rendered, host)["repo"]
    keyring = PINS["cuda"]["cuda_keyring_version"]
    assert repo["distro"] == distro
    assert repo["keyring_deb"] == (
        f"http://cuda-mirror.invalid/compute/cuda/repos/{distro}/x86_64/cuda-keyring_{keyring}_all.deb"
    )
    # cuda-keyring's own one-line source (NVIDIA's host) is the one the role removes.
    assert repo["keyring_list"] == f"/etc/apt/sources.list.d/cuda-{distro}-x86_64.list"
    assert repo["url_matches"] is True
    # A 22.04 repository on a 20.04 host is refused.
    assert repo["ubuntu2204_url_matches"] is (distro == "ubuntu2204")


@pytest.mark.parametrize("host", ["jammy", "focal"])
def test_ubuntu_cuda_toolkit(rendered, host):
    cuda = decided(rendered, host)["cuda"]
    assert cuda["packages"] == [PINS["cuda"]["ubuntu_toolkit_package"]] == ["cuda-toolkit-11-8"]
    assert cuda["hold"] == cuda["packages"]
    assert (cuda["layout"], cuda["prefix"]) == ("native", "/usr/local/cuda-11.8")
    # The driver minimum the role reports is the engine's: tests/test_driver.py.


@pytest.mark.parametrize("host", HOSTS)
def test_branch_pins(rendered, host):
    branches = decided(rendered, host)["os_branches"]
    for branch in branches:
        text = (rendered / f"{host}-{branch}.pref").read_text()
        stanza = dict(
            line.split(": ", 1) for line in text.splitlines() if line and not line.startswith("#")
        )
        assert stanza["Pin"] == f"version {branch}.*"
        assert stanza["Pin-Priority"] == "1001"
        packages = stanza["Package"].split()
        assert packages == sorted(packages) and packages
        # Debian's main driver packages carry no branch in their names (nvidia-driver).
        assert all(str(branch) in p or host in ("bookworm", "trixie") for p in packages)


@pytest.mark.parametrize("host", HOSTS)
def test_exact_version_pin(rendered, host):
    text = (rendered / f"{host}-exact.pref").read_text()
    stanza = dict(
        line.split(": ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    # Exactly 535.216.01, whatever the distribution's revision (-1~deb12u1, -0ubuntu0.22.04.1).
    assert stanza["Pin"] == "version 535.216.01-*"
    assert stanza["Pin-Priority"] == "1001"


def test_debian_sets(rendered):
    d = decided(rendered, "bookworm")
    assert (d["os_branches"], d["os_flavours"], d["os_sources"]) == (
        [470, 535],
        ["proprietary"],
        ["distribution"],
    )
    assert d["os_headers"] == "linux-headers-amd64"
    sets = {e["branch"]: e["set"] for e in d["driver_sets"]}
    assert sets[535]["install"][:2] == ["nvidia-driver", "nvidia-kernel-dkms"]
    assert sets[470]["install"][:2] == ["nvidia-tesla-470-driver", "nvidia-tesla-470-kernel-dkms"]
    for s in sets.values():
        assert s["module"] in s["hold"] and "nvidia-persistenced" in s["install"]
    cuda = d["cuda"]
    assert cuda["packages"] == [f"nvidia-cuda-toolkit={PINS['cuda']['debian_toolkit_version']}*"]
    assert cuda["links"]["lib64"] == "/usr/lib/x86_64-linux-gnu"


def test_trixie_sets_come_from_the_engine(rendered):
    d = decided(rendered, "trixie")
    assert (d["os_branches"], d["os_sources"]) == ([535, 550], ["distribution"])
    assert d["os_flavours"] == ["open", "proprietary"]  # the default branch's, 550
    assert d["os_profile_args"] == ["--distro", "debian-13"]
    assert decided(rendered, "bookworm")["os_profile_args"] == ["--distro", "debian-12"]
    sets = {(e["branch"], e["flavour"]): e["set"] for e in d["driver_sets"]}
    assert sets[(550, "proprietary")]["module"] == "nvidia-kernel-dkms"
    assert sets[(550, "open")]["module"] == "nvidia-open-kernel-dkms"
    assert "nvidia-kernel-dkms" not in sets[(550, "open")]["install"]
    assert sets[(535, "proprietary")]["install"][:2] == [
        "nvidia-tesla-535-driver",
        "nvidia-tesla-535-kernel-dkms",
    ]
    # Trixie's firmware for the 535 module comes with it (GSP firmware, Turing and newer).
    assert "firmware-nvidia-gsp" in sets[(535, "proprietary")]["install"]
    cuda = d["cuda"]
    assert (cuda["source"], cuda["layout"]) == ("pip-wheels", "wheels")
    assert cuda["packages"] == ["python3-venv"] and cuda["hold"] == []
    assert cuda["wheels"] == PINS["cuda"]["wheels"]
    assert cuda["wheel_links"]["bin"] == "cuda_nvcc/bin"
    assert decided(rendered, "bookworm")["cuda"]["source"] == "distribution"


def test_headers_for_installed_kernels(rendered):
    # linux-image-X -> linux-headers-X; not the -dbg, -unsigned or unsigned- images.
    assert decided(rendered, "bookworm")["kernel_headers"] == [
        "linux-headers-amd64",
        "linux-headers-6.1.0-57-amd64",
        "linux-headers-generic",
        "linux-headers-5.15.0-91-generic",
        "linux-headers-generic-hwe-22.04",
    ]


# dkms status's lines: tests/test_driver.py (the engine parses them, oldgpu driver).


def test_profile_d_file(rendered):
    text = (rendered / "jammy-cuda.sh").read_text()
    assert "export CUDA_HOME=/usr/local/cuda\n" in text
    assert '"${CUDA_HOME}/bin${PATH:+:${PATH}}"' in text
    assert '"${CUDA_HOME}/lib64${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"' in text


def test_no_registry_host_and_no_apt_key_in_the_gpu_roles():
    # Sources come from variables (NVIDIA's repository: nvidia_cuda_repo_url);
    # keys from cuda-keyring with signed-by, never apt-key.
    hosts = re.compile(
        r"download\.nvidia|deb\.debian|archive\.ubuntu|://[a-z0-9.-]+\.(com|org|net)/"
    )
    apt_key = re.compile(r"\bapt_key\b|apt-key\s+(add|adv)")
    for role in GPU_ROLES:
        for path in (ROOT / "roles" / role).rglob("*"):
            if path.is_file():
                text = path.read_text()
                assert not hosts.search(text), path
                assert not apt_key.search(text), path


def test_reboot_only_off_local_connections_and_outside_containers(rendered):
    cases = ["ssh", "local", "ansible.builtin.local", "ssh", "ssh", "ssh"]
    flags = ["True True True", "True True True", "True True True"]
    flags += ["False True True", "True False True", "True True False"]
    keys = [f"{c} {f}" for c, f in zip(cases, flags, strict=True)]
    why = [
        "reboot",
        "the play runs on a local connection",
        "the play runs on a local connection",
        "nvidia_driver_reboot is false",
        "no GPU is expected (nvidia_driver_expect_gpu)",
        "the module was installed by an earlier run",
    ]
    for host in ("jammy", "focal"):  # a VM and bare metal
        assert decided(rendered, host)["reboots"] == [
            f"{k}: {w}" for k, w in zip(keys, why, strict=True)
        ]
    # A container never reboots, whatever else holds (molecule runs this case for real).
    container = decided(rendered, "bookworm")["reboots"]
    assert container[1] == f"{keys[1]}: the play runs on a local connection"
    for line in container[:1] + container[3:]:
        assert line.endswith(": this host is a container (podman)"), line


# How the driver fits CUDA 11.8 (the cuda role's message): tests/test_driver.py.
