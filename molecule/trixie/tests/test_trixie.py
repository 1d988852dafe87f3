"""What site.yml's GPU stage left on a stock Debian 13 (trixie) box without a GPU.

The engine's choices (oldgpu distro, oldgpu profile --distro debian-13) as installed:
trixie's own nvidia-driver 550 built by DKMS for trixie's 6.12 headers, CUDA 11.8 from
NVIDIA's wheels, contrib/non-free on the deb822 sources; and the Python stage refusing
a venv it has no interpreter for. (The venv, verl and the job: test_trixie_stack.py.)
Each test prints what it saw (pytest -rA).
"""

from __future__ import annotations

import json
import re

from playbook import PROJECT, playbook

PINS = json.loads((PROJECT / "files" / "pins.json").read_text())
CUDA = PINS["cuda"]
BRANCH = "550"  # the engine's choice on Debian 13 (oldgpu distro)


def _json(host, cmd: str) -> dict:
    return json.loads(host.check_output(cmd))


def test_the_engine_names_trixie_and_its_choices(host):
    d = _json(host, "oldgpu distro --json")
    print("oldgpu distro:", d["name"], d["driver"], d["cuda"]["source"])
    assert (d["key"], d["driver"]["branches"], d["driver"]["default"]) == (
        "debian-13",
        [535, 550],
        550,
    )
    p = _json(host, "oldgpu profile --json --distro debian-13")
    assert p["driver"]["selected"] == int(BRANCH) and p["driver"]["required"] is False


def test_deb822_sources_got_contrib_and_non_free(host):
    text = host.file("/etc/apt/sources.list.d/debian.sources").content_string
    print(text)
    for stanza in text.strip().split("\n\n"):
        components = re.search(r"^Components: (.*)$", stanza, re.M).group(1).split()
        assert {"main", "contrib", "non-free", "non-free-firmware"} <= set(components), stanza
    assert not host.file("/etc/apt/sources.list").exists  # no one-line file written beside


def test_trixies_550_driver_installed_held_and_pinned(host):
    version = host.check_output("dpkg-query -W -f '${Version}' nvidia-driver")
    print("nvidia-driver", version)
    assert version.startswith(BRANCH + ".")
    held = host.check_output("dpkg --get-selections nvidia-driver nvidia-kernel-dkms libcuda1")
    assert [line.split()[1] for line in held.splitlines()] == ["hold"] * 3, held
    pref = host.file("/etc/apt/preferences.d/oldgpu-nvidia-driver.pref").content_string
    assert f"Pin: version {BRANCH}.*" in pref


def test_dkms_built_550_for_trixies_6_12_headers(host):
    status = host.check_output("dkms status")
    kernels = host.check_output(
        "for b in /lib/modules/*/build; do [ -d $b/ ] && basename $(dirname $b); done"
    ).split()
    print("dkms status:", status, "kernels with headers:", kernels)
    assert kernels and all(k.startswith("6.12.") for k in kernels), kernels
    for kernel in kernels:
        assert re.search(
            rf"^nvidia-current/{BRANCH}\.[0-9.]+, {re.escape(kernel)}, \S+: installed", status, re.M
        ), status
    # The engine's account: every kernel has the module; what a kernel hold would hold.
    k = _json(host, "oldgpu driver --json")["kernels"]
    print("oldgpu driver kernels:", k)
    assert k["without_module"] == [] and "linux-headers-amd64" in k["metapackages"]
    # Off by default: the kernel metapackages are not held.
    sel = host.check_output("dpkg --get-selections linux-headers-amd64").split()
    assert sel[1] == "install", sel


def test_cuda_11_8_from_the_wheels(host):
    assert host.file("/usr/local/cuda").linked_to == f"/usr/local/cuda-{CUDA['version']}"
    # NVIDIA's 11.8 wheels carry ptxas (and libdevice), not nvcc: ptxas says the release.
    out = host.check_output("bash -lc 'ptxas --version'")
    line = next(line for line in out.splitlines() if "release" in line)
    print("ptxas --version:", line, "->", host.file("/usr/local/cuda/bin").linked_to)
    assert f"release {CUDA['version']}, V{CUDA['wheels']['nvidia-cuda-nvcc-cu11']}" in line
    for path in ("include/cuda_runtime.h", "lib64/libcudart.so.11.0", "nvvm/libdevice"):
        assert host.file(f"/usr/local/cuda/{path}").exists, path
    assert not host.file("/usr/local/cuda/bin/nvcc").exists
    held = host.check_output("/opt/cuda-wheels-11.8/bin/pip freeze")
    for name, version in CUDA["wheels"].items():
        assert f"{name}=={version}" in held, held
    # Trixie's own toolkit (12.4) is not what was installed.
    assert not host.package("nvidia-cuda-toolkit").is_installed


def test_check_mode_changes_nothing(host):
    # The GPU and Python stages: the driver, CUDA's wheels, Debian 12's pinned python3.11.
    stages = json.dumps({"oldgpu_stages": ["base", "gpu", "python"]})
    run = playbook("--check", "-e", stages, limit=host.backend.get_hostname())
    assert run.rc == 0, run.output[-3000:]
    assert run.recap(host.backend.get_hostname())["changed"] == 0, run.output[-3000:]


def test_the_python_stage_refuses_a_venv_without_its_interpreter(host):
    name = host.backend.get_hostname()
    # Debian 12's python3.11 refused (python_env_python_apt: false) and none named: the
    # python stage needs base's facts (the engine's paths): both, base converged already.
    off = {"oldgpu_stages": ["base", "python"], "python_env_python_apt": False}
    run = playbook("-e", json.dumps(off), limit=name)
    assert run.rc != 0
    assert "python-interpreter-unavailable: Debian 13's python3 is 3.13" in run.output, run.output[
        -2000:
    ]
    assert "python_env_python_apt is off" in run.output
    recap = run.recap(name)
    print("python stage ->", recap)
    assert recap["changed"] == 0 and recap["failed"] == 1, recap
