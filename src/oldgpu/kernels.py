"""Which installed kernels have the NVIDIA module built, which kernel boots next, and what to hold.

A kernel upgrade that DKMS cannot build the pinned branch for (no headers for it,
or a branch too old for the new kernel) boots a host with no NVIDIA module: the GPU
is gone until someone notices. ``oldgpu driver`` reports it before the reboot, from
what it already reads: ``dpkg-query`` (the installed ``linux-image-*`` packages, and
the kernel metapackages that pull upgrades in), ``/lib/modules`` (headers) and
``dkms status`` (what was built), plus the running kernel. The roles read the JSON:
``without_module`` for the warning, ``metapackages`` for the optional kernel hold.

Pure functions: the driver module gathers the text, recorded or from the host.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from oldgpu.versions import version_tuple

# A versioned kernel image: Debian's linux-image-6.12.41+deb13-amd64, linux-image-6.1.0-28-amd64;
# Ubuntu's linux-image-5.15.0-100-generic and its linux-image-unsigned-... twin. Not -dbg.
IMAGE_RE = re.compile(r"^linux-image-(?:unsigned-)?(?P<kernel>\d[^\s]*?)(?<!-dbg)$")
# What pulls the next kernel in: Debian's linux-image-amd64 / linux-headers-amd64 (and
# -cloud-, -rt- flavours), Ubuntu's linux-generic(-hwe-22.04), linux-image-generic, ...
# A name with a version in it is a kernel, not a metapackage; -common are headers' parts.
METAPACKAGE_RE = re.compile(
    r"^linux-(?:(?:image|headers)-(?!\d)(?!unsigned-)[a-z][a-z0-9.+-]*"
    r"|(?:generic|virtual|lowlatency|aws|azure|gcp|oracle|kvm)(?:-hwe-[0-9.]+)?)$"
)
NOT_METAPACKAGE_RE = re.compile(r"(-common|-dbg|-all|-all-amd64|-all-arm64)$")
INSTALLED = ("installed", "installed-weak")


def parse_dpkg_kernels(text: str) -> tuple[list[str], list[str]]:
    """(kernels with an image installed, installed kernel metapackages) from ``dpkg-query -W -f
    '${Package}\\t${Version}\\t${db:Status-Status}\\n'``."""
    images, metas = set(), set()
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) != 3 or fields[2].strip() != "installed":
            continue
        name = fields[0]
        image = IMAGE_RE.match(name)
        if image:
            images.add(image.group("kernel"))
        elif METAPACKAGE_RE.match(name) and not NOT_METAPACKAGE_RE.search(name):
            metas.add(name)
    return sorted(images, key=kernel_key), sorted(metas)


def kernel_key(kernel: str) -> tuple[int, ...]:
    """Order kernels by their version numbers (6.1.0-28-amd64 < 6.1.0-30-amd64 < 6.12.41+deb13)."""
    return version_tuple(re.sub(r"[^0-9]+", ".", kernel).strip("."))


def state(
    *,
    images: Sequence[str],
    header_kernels: Sequence[str],
    dkms_kernels: Sequence[Mapping[str, Any]],
    running: str | None,
    metapackages: Sequence[str],
    driver_version: str | None,
) -> dict[str, Any]:
    """Per installed kernel: image, headers, the nvidia module's DKMS state; the next boot's.

    ``dkms_kernels`` is ``driver.dkms_state``'s ``kernels`` (a state per kernel for the
    installed driver's version). The next boot is the newest installed image (what
    Debian's and Ubuntu's boot loaders default to). With no driver installed nothing
    can lack a module; with no image (a container) only the header kernels are listed.
    """
    dkms = {k["kernel"]: k["state"] for k in dkms_kernels}
    kernels = sorted(set(images) | set(header_kernels), key=kernel_key)
    next_boot = max(images, key=kernel_key) if images else None
    rows, without = [], []
    for kernel in kernels:
        built = dkms.get(kernel) in INSTALLED
        row = {
            "kernel": kernel,
            "image": kernel in images,
            "headers": kernel in header_kernels,
            "module": ("built" if built else "missing") if driver_version else None,
            "running": kernel == running,
            "next_boot": kernel == next_boot,
        }
        rows.append(row)
        # A kernel that can boot (an image) or that DKMS was asked for (headers).
        if driver_version and not built:
            why = "its headers are not installed" if not row["headers"] else "DKMS did not build it"
            without.append({**row, "why": why})
    pending = next_boot if next_boot and next_boot != running else None
    return {
        "running": running,
        "next_boot": next_boot,
        # A newer kernel than the running one, installed and waiting for a reboot.
        "pending": pending,
        "installed": rows,
        "without_module": without,
        "next_boot_without_module": any(k["next_boot"] for k in without),
        "metapackages": list(metapackages),
        "messages": [message(k, driver_version or "") for k in without],
    }


def message(row: Mapping[str, Any], version: str) -> str:
    when = (
        "the next boot's kernel"
        if row["next_boot"] and not row["running"]
        else ("the running kernel" if row["running"] else "an installed kernel")
    )
    return (
        f"kernel {row['kernel']} ({when}) has no nvidia {version} module: {row['why']}; "
        f"booted, it has no GPU"
    )


def render(k: Mapping[str, Any]) -> list[str]:
    """Lines for ``oldgpu driver``'s text; none without kernel images (a container: its
    headers' kernels are on the dkms line already)."""
    if not any(r["image"] for r in k["installed"]):
        return []
    lines = [
        "kernels: "
        + "; ".join(
            f"{r['kernel']}"
            + "".join(f" [{t}]" for t in ("running", "next_boot") if r[t])
            + (f" {r['module']}" if r["module"] else "")
            for r in k["installed"]
        )
    ]
    lines += [f"WARNING: {m}" for m in k["messages"]]
    return lines
