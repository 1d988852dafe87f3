"""``oldgpu distro``: what each supported Debian release packages for the GPU stack.

The driver branches in the release's own archive (and the packages of each), which
of them the profile takes by default, where the CUDA 11.8 toolkit comes from, and
which interpreter the training venv is built with. ``oldgpu profile --distro KEY``
intersects the GPUs' branches with the release's; the roles read ``oldgpu distro
--json`` instead of a table per release in YAML. Facts read from each release's
archive (apt-cache policy/show against its non-free component), December 2026:

- Debian 12 (bookworm): nvidia-driver 535 (proprietary modules; its open-module
  package lags the security updates), nvidia-tesla-470-driver, nvidia-cuda-toolkit
  11.8.89, python3 3.11, kernel 6.1.
- Debian 13 (trixie): nvidia-driver 550.163.01 (nvidia-kernel-dkms and
  nvidia-open-kernel-dkms at the same version; trixie-backports has 550 too, no
  580), nvidia-tesla-535-driver 535.274.02, no 470; nvidia-cuda-toolkit is 12.4
  (no 11.8 in the archive); python3 3.13, no python3.11; kernel 6.12, dkms 3.2.

Why 550 on Debian 13: it is trixie's main driver (nvidia-graphics-drivers, the
package Debian rebuilds against trixie's kernel updates), it drives Maxwell to
Hopper (Pascal included, with the proprietary modules) and it meets CUDA 12.4's
minimum (vLLM's wheels) outright where 535 needs minor-version compatibility.
Tesla 535 stays selectable (nvidia_driver_branch: 535) for a fleet that must match
its Debian 12 hosts.

Why CUDA 11.8 comes from the pip index on Debian 13: NVIDIA publishes no 11.8
repository for Debian 13, and its runfile is a 4 GB download from a host an
air-gapped fleet mirrors by hand; the nvidia-cuda-*-cu11 wheels (runtime, cupti,
nvrtc, cccl headers, and nvidia-cuda-nvcc-cu11's ptxas and libdevice:
py3-none-manylinux2014, any interpreter) come through the same pip index or
wheelhouse as torch's own CUDA 11.8 libraries. NVIDIA's 11.8 wheels carry no nvcc
(its wheels have it from 12.x): nothing in the training stack compiles CUDA on the
host, and a host that must gets the runfile's toolkit by hand.

The venv's interpreter is the locks' Python (3.11): Debian 13 takes Debian 12's
python3.11 from the host's own mirror, apt-pinned to its four packages, unless the
operator names one (oldgpu.interpreter says why and how).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oldgpu import interpreter, pins, subcommand
from oldgpu.output import EngineError, Result

OS_RELEASE = "/etc/os-release"

# The package sets: what is installed (no Recommends), the module package, what is held.
_DEBIAN_MAIN = {
    "install": [
        "nvidia-driver",
        "nvidia-kernel-dkms",
        "firmware-nvidia-gsp",
        "libcuda1",
        "nvidia-smi",
        "libnvidia-cfg1",
        "nvidia-persistenced",
    ],
    "module": "nvidia-kernel-dkms",
    "hold": [
        "nvidia-driver",
        "nvidia-driver-bin",
        "nvidia-driver-libs",
        "nvidia-kernel-dkms",
        "nvidia-kernel-support",
        "nvidia-alternative",
        "firmware-nvidia-gsp",
        "libcuda1",
        "nvidia-smi",
        "libnvidia-cfg1",
    ],
}


def _open(main: Mapping[str, Any]) -> dict[str, Any]:
    """The same set with NVIDIA's open kernel modules in place of the proprietary ones."""
    swap = {"nvidia-kernel-dkms": "nvidia-open-kernel-dkms"}
    return {
        "install": [swap.get(p, p) for p in main["install"]],
        "module": "nvidia-open-kernel-dkms",
        "hold": [swap.get(p, p) for p in main["hold"]],
    }


def _tesla(branch: int, firmware: bool) -> dict[str, Any]:
    t = f"nvidia-tesla-{branch}"
    libs = [f"lib{t}-cuda1", f"{t}-smi", f"lib{t}-cfg1"]
    return {
        "install": [f"{t}-driver", f"{t}-kernel-dkms", *libs, "nvidia-persistenced"]
        + (["firmware-nvidia-gsp"] if firmware else []),
        "module": f"{t}-kernel-dkms",
        "hold": [
            f"{t}-driver",
            f"{t}-driver-bin",
            f"{t}-driver-libs",
            f"{t}-kernel-dkms",
            f"{t}-kernel-support",
            f"{t}-alternative",
            *libs,
        ],
    }


@dataclass(frozen=True)
class Release:
    key: str
    name: str
    codename: str
    kernel: str
    system_python: str
    # branch -> flavour -> package set
    drivers: Mapping[int, Mapping[str, Mapping[str, Any]]]
    default_branch: int
    cuda: Mapping[str, Any]
    apt_sources: str  # how a stock install writes its sources: one-line or deb822


def _releases() -> dict[str, Release]:
    cuda = pins.get("cuda")
    wheels = dict(pins.get("cuda.wheels"))
    return {
        "debian-12": Release(
            key="debian-12",
            name="Debian 12",
            codename="bookworm",
            kernel="6.1",
            system_python="3.11",
            drivers={
                470: {"proprietary": _tesla(470, firmware=False)},
                535: {"proprietary": _DEBIAN_MAIN},
            },
            default_branch=535,
            cuda={
                "source": "distribution",
                "package": cuda["debian_toolkit_package"],
                "version": cuda["debian_toolkit_version"],
                "nvcc": True,
            },
            apt_sources="one-line",
        ),
        "debian-13": Release(
            key="debian-13",
            name="Debian 13",
            codename="trixie",
            kernel="6.12",
            system_python="3.13",
            drivers={
                535: {"proprietary": _tesla(535, firmware=True)},
                550: {"proprietary": _DEBIAN_MAIN, "open": _open(_DEBIAN_MAIN)},
            },
            default_branch=550,
            # NVIDIA's 11.8 wheels carry ptxas and libdevice, not nvcc.
            cuda={"source": "pip-wheels", "wheels": wheels, "nvcc": False},
            apt_sources="deb822",
        ),
    }


RELEASES = _releases()


def get(key: str) -> Release:
    if key not in RELEASES:
        raise EngineError(
            "distro-unsupported",
            f"{key!r}: the GPU stack is built for {', '.join(sorted(RELEASES))} "
            "(Ubuntu 20.04/22.04 through the roles' own tables)",
        )
    return RELEASES[key]


def packaged(key: str) -> dict[int, tuple[str, ...]]:
    """Branch -> the kernel-module flavours the release packages in step with it."""
    return {b: tuple(f) for b, f in get(key).drivers.items()}


def key_from_os_release(text: str) -> str:
    fields = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    os_id = fields.get("ID", "").strip().strip('"')
    version = fields.get("VERSION_ID", "").strip().strip('"').split(".")[0]
    return f"{os_id}-{version}" if os_id and version else ""


def report(key: str, python: str | None = None, **where: Any) -> dict[str, Any]:
    """The release's choices; ``where``: interpreter.choose's apt, mirror, security_mirror."""
    r = get(key)
    return {
        "schema": 1,
        "key": r.key,
        "name": r.name,
        "codename": r.codename,
        "kernel": r.kernel,
        "system_python": r.system_python,
        "driver": {
            "branches": sorted(r.drivers),
            "default": r.default_branch,
            "flavours": {str(b): sorted(f) for b, f in r.drivers.items()},
            "packages": {str(b): dict(f) for b, f in r.drivers.items()},
        },
        "cuda": dict(r.cuda, version=str(pins.get("cuda.version"))),
        "python": interpreter.choose(r, RELEASES, python, **where),
        "apt_sources": r.apt_sources,
    }


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "what this Debian release packages for the GPU stack (branches, CUDA, Python)"
    parser = subcommand.add(subparsers, common, "distro", run, __doc__, help=summary)
    parser.add_argument(
        "--distro", metavar="KEY", help=f"debian-12 or debian-13 (default: {OS_RELEASE})"
    )
    parser.add_argument(
        "--python", metavar="PATH", help="an installed interpreter of the locks' version"
    )
    parser.add_argument(
        "--no-python-apt",
        dest="python_apt",
        action="store_false",
        help="never take the interpreter from another Debian release's archive",
    )
    parser.add_argument(
        "--python-mirror", metavar="URI", help="the Debian mirror for it (default: the host's)"
    )
    parser.add_argument(
        "--python-security-mirror",
        metavar="URI",
        help="the Debian security mirror for it (default: the host's)",
    )
    parser.add_argument(
        "--need-python",
        action="store_true",
        help="stop with python-interpreter-unavailable when the venv would have no interpreter",
    )


def run(args: argparse.Namespace) -> Result:
    key = args.distro
    if not key:
        try:
            key = key_from_os_release(Path(OS_RELEASE).read_text(encoding="utf-8"))
        except OSError as exc:
            raise EngineError("os-release-unreadable", f"{OS_RELEASE}: {exc}") from exc
    r = report(
        key,
        args.python,
        apt=args.python_apt,
        mirror=args.python_mirror,
        security_mirror=args.python_security_mirror,
    )
    if args.need_python and r["python"]["source"] == "missing":
        raise EngineError(r["python"]["error"], r["python"]["message"])
    d = r["driver"]
    text = [
        f"{r['name']} ({r['codename']}), kernel {r['kernel']}, python3 {r['system_python']}",
        f"driver branches: {d['branches']} (default {d['default']})",
        f"cuda {r['cuda']['version']}: from {r['cuda']['source']}",
        f"venv interpreter: {r['python']['path']} ({r['python']['source']})"
        if r["python"]["path"]
        else f"venv interpreter: {r['python']['message']}",
    ]
    return Result(payload=r, text="\n".join(text))
