"""The doctor's ``kernel-modules`` check: an installed kernel that would boot without the driver.

``oldgpu.kernels`` owns the judgement (per installed kernel: image, headers, the
nvidia module DKMS built); this module turns the facts' ``kernels`` into a check.
The next boot's kernel without the module fails (after the reboot there is no GPU);
an older kernel without it warns. Facts without ``kernels`` (recorded before it
existed, or a host without dpkg) leave the check out, as ``gpu-topology`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CHECK_ID = "kernel-modules"


def check_kernels(facts: Mapping[str, Any]) -> dict[str, Any] | None:
    k = facts.get("kernels")
    if not k or not k.get("installed"):
        return None
    without = k["without_module"]
    status = "fail" if k["next_boot_without_module"] else ("warn" if without else "ok")
    if without:
        seen = "; ".join(k["messages"])
        headers = [r["kernel"] for r in without if not r["headers"]]
        fixes = []
        if headers:
            fixes.append("apt-get install " + " ".join(f"linux-headers-{h}" for h in headers))
        fixes.append(
            "dkms autoinstall -k KERNEL for each (its make.log names a failed build); or boot "
            f"{k['running'] or 'a kernel that has it'} and remove the kernel the branch cannot"
            " build for (nvidia_driver_hold_kernel holds the kernel metapackages)"
        )
        fix = "; ".join(fixes)
    else:
        seen = "every installed kernel has the nvidia module: " + ", ".join(
            r["kernel"] for r in k["installed"]
        )
        fix = ""
    return {"id": CHECK_ID, "status": status, "seen": seen, "fix": fix, "details": dict(k)}
