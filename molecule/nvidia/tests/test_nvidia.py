"""What a user checks after site.yml installed the GPU stack on a Debian 12 box without a GPU.

Each test prints what it saw (pytest -rA / the molecule log shows it): the
closing note of the issue quotes those lines.
"""

from __future__ import annotations

import json
import re

import pytest
from playbook import PROJECT, playbook

PINS = json.loads((PROJECT / "files" / "pins.json").read_text())
CUDA = PINS["cuda"]
BRANCH = "535"  # the engine's choice for a host without GPU (Debian 12's nvidia-driver)
HELD = [
    "nvidia-driver",
    "nvidia-driver-bin",
    "nvidia-driver-libs",
    "nvidia-kernel-dkms",
    "nvidia-kernel-support",
    "firmware-nvidia-gsp",
    "libcuda1",
    "nvidia-smi",
    "libnvidia-cfg1",
]


def _version(host, package: str) -> str:
    return host.check_output(f"dpkg-query -W -f '${{Version}}' {package}")


def _upstream(version: str) -> str:
    return re.match(r"[0-9]+(\.[0-9]+)+", version).group(0)


def test_driver_package_at_the_chosen_branch_and_held(host):
    version = _version(host, "nvidia-driver")
    print(f"nvidia-driver {version}")
    assert version.startswith(BRANCH + ".")
    out = host.check_output("dpkg --get-selections " + " ".join(HELD))
    # Multi-arch libraries are listed as name:amd64.
    selections = {name.split(":")[0]: state for name, state in map(str.split, out.splitlines())}
    print("selections:", selections)
    assert selections == dict.fromkeys(HELD, "hold")
    # The pin keeps another branch's version from ever being the candidate.
    pref = host.file("/etc/apt/preferences.d/oldgpu-nvidia-driver.pref")
    assert pref.is_file
    assert f"Pin: version {BRANCH}.*" in pref.content_string
    assert "Pin-Priority: 1001" in pref.content_string
    policy = host.check_output("apt-cache policy nvidia-driver")
    installed = re.search(r"Installed: (\S+)", policy).group(1)
    candidate = re.search(r"Candidate: (\S+)", policy).group(1)
    print(f"apt-cache policy nvidia-driver: installed {installed}, candidate {candidate}")
    assert installed == candidate == version
    assert re.search(rf"1001 .*\n\s+{re.escape(version)}|\*\*\* {re.escape(version)} 1001", policy)


def test_dkms_built_the_module_for_the_installed_headers(host):
    module = _upstream(_version(host, "nvidia-kernel-dkms"))
    kernels = host.check_output(
        "for b in /lib/modules/*/build; do [ -d $b/ ] && basename $(dirname $b); done"
    ).split()
    status = host.check_output("dkms status")
    print("dkms status:", status)
    print("kernels with headers:", kernels, "running kernel:", host.check_output("uname -r"))
    assert kernels, "linux-headers installed no kernel's headers"
    for kernel in kernels:
        # The headers' kernel, not `uname -r`: a container runs the host's kernel.
        assert re.search(
            rf"^nvidia-current/{re.escape(module)}, {re.escape(kernel)}, \S+: installed$",
            status,
            re.M,
        ), status
        ko = host.file(f"/lib/modules/{kernel}/updates/dkms/nvidia-current.ko")
        assert ko.exists
        assert host.check_output(f"modinfo -F version {ko.path}") == module
    assert host.package("linux-headers-amd64").is_installed


def test_nouveau_blacklisted(host):
    conf = host.file("/etc/modprobe.d/blacklist-nouveau.conf")
    assert conf.is_file and conf.mode == 0o644
    lines = {line.strip() for line in conf.content_string.splitlines()}
    assert {"blacklist nouveau", "options nouveau modeset=0"} <= lines
    effective = host.check_output("modprobe --showconfig | grep -E '^(blacklist|options) nouveau'")
    print("modprobe --showconfig:", effective)
    assert "blacklist nouveau" in effective and "modeset=0" in effective


def test_nvcc_is_cuda_11_8(host):
    out = host.check_output("nvcc --version")
    line = next(line for line in out.splitlines() if "release" in line)
    print("nvcc --version:", line)
    assert f"release {CUDA['version']}, V{CUDA['debian_toolkit_version']}" in line
    toolkit = _version(host, CUDA["debian_toolkit_package"])
    print(f"{CUDA['debian_toolkit_package']} {toolkit}")
    assert toolkit.startswith(CUDA["debian_toolkit_version"])
    held = host.check_output(
        f"dpkg --get-selections {CUDA['debian_toolkit_package']} nvidia-cuda-dev"
    )
    assert held.split()[1::2] == ["hold", "hold"], held


def test_usr_local_cuda_is_a_cuda_layout(host):
    assert host.file("/usr/local/cuda").linked_to == f"/usr/local/cuda-{CUDA['version']}"
    for path in ("bin/nvcc", "bin/ptxas", "include/cuda_runtime.h", "lib64/libcudart.so"):
        assert host.file(f"/usr/local/cuda/{path}").exists, path
    assert host.file("/usr/local/cuda/nvvm/libdevice/libdevice.10.bc").exists
    assert CUDA["version"] in host.check_output("/usr/local/cuda/bin/nvcc --version")


def test_profile_d_exports_cuda_for_login_shells(host):
    script = host.file("/etc/profile.d/cuda.sh")
    assert script.is_file and script.mode == 0o644
    env = host.check_output(
        "env -i HOME=/root PATH=/usr/bin:/bin bash -lc "
        "'echo $CUDA_HOME; echo $PATH; echo $LD_LIBRARY_PATH; command -v nvcc'"
    ).splitlines()
    print("login shell:", env)
    cuda_home, path, ld_path, nvcc = env
    assert cuda_home == "/usr/local/cuda"
    assert path.split(":")[0] == "/usr/local/cuda/bin"
    assert "/usr/local/cuda/lib64" in ld_path.split(":")
    assert nvcc == "/usr/local/cuda/bin/nvcc"
    # Sourcing it twice adds nothing twice.
    twice = host.check_output(
        "bash -c '. /etc/profile.d/cuda.sh; . /etc/profile.d/cuda.sh; echo $PATH'"
    )
    assert twice.split(":").count("/usr/local/cuda/bin") == 1


def test_nvidia_smi_present_and_says_driver_not_loaded(host):
    assert host.file("/usr/bin/nvidia-smi").exists
    run = host.run("nvidia-smi")
    print(f"nvidia-smi exit {run.rc}: {run.stdout.strip()}")
    # 9: "couldn't communicate with the NVIDIA driver" (no module loaded, no GPU).
    assert run.rc == 9, (run.rc, run.stdout, run.stderr)
    assert "couldn't communicate with the NVIDIA driver" in run.stdout


def test_persistenced_enabled_but_not_started_without_gpu(host):
    service = host.service("nvidia-persistenced")
    state = host.run("systemctl is-active nvidia-persistenced").stdout.strip()
    print(f"nvidia-persistenced: enabled={service.is_enabled} active={state}")
    assert service.is_enabled
    assert not service.is_running  # it cannot run without a device


def test_check_mode_changes_nothing_and_reboot_is_only_reported(host):
    name = host.backend.get_hostname()
    run = playbook("--check", limit=name)
    assert run.rc == 0, run.output[-3000:]
    recap = run.recap(name)
    print("--check recap:", recap)
    assert recap["changed"] == 0 and recap["failed"] == 0, recap
    pending = re.search(r"reboot pending to load nvidia [0-9.]+[^\n]*(\n\s+[^\n]*)?", run.output)
    assert pending, run.output[-3000:]
    print("message:", " ".join(pending.group(0).split()))
    assert "not rebooting: this host is a container (podman)" in " ".join(pending.group(0).split())
    # The reboot task was skipped, never run.
    reboot = re.search(r"TASK \[nvidia_driver : Reboot to load[^\n]*\n(\S+):", run.output)
    assert reboot and reboot.group(1) == "skipping", run.output[-3000:]
    assert "no device: nvidia-smi exited 9" in run.output


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        # A P40 cannot use NVIDIA's open kernel modules.
        (["nvidia_driver_arch=pascal", "nvidia_driver_flavour=open"], "open-modules-unsupported"),
        # 470 is Kepler's last branch; 535 does not drive it.
        (["nvidia_driver_arch=kepler", "nvidia_driver_branch=535"], "driver-branch-unsupported"),
        # A branch the card takes but Debian 12's archive does not package (trixie's).
        (["nvidia_driver_branch=550"], "driver-branch-not-packaged"),
    ],
)
def test_bad_driver_requests_stop_with_the_engines_error(host, extra, error):
    name = host.backend.get_hostname()
    args = [a for e in extra for a in ("-e", e)]
    run = playbook(*args, playbook="playbooks/gpu.yml", limit=name)
    assert run.rc != 0
    assert f"{error}: " in run.output, run.output[-2000:]
    recap = run.recap(name)
    print(error, "->", recap)
    assert recap["changed"] == 0 and recap["failed"] == 1, recap


def test_470_on_a_p40_is_allowed(host):
    # Preflight only: the decision, not a branch switch on the converged host.
    name = host.backend.get_hostname()
    run = playbook(
        "--check",
        "--tags",
        "nvidia_driver_preflight",
        "-e",
        "nvidia_driver_arch=pascal",
        "-e",
        "nvidia_driver_branch=470",
        playbook="playbooks/gpu.yml",
        limit=name,
    )
    assert run.rc == 0, run.output[-3000:]
    said = " ".join(run.output.split())
    assert "NVIDIA driver 470 (proprietary modules) for pascal-6.1" in said, run.output[-3000:]
    assert "nvidia-tesla-470-driver" in said
