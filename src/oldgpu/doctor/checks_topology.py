"""The doctor's ``gpu-topology`` check: how a multi-GPU host's cards are wired.

``oldgpu.topology`` owns the judgement (P2P broken by ACS/IOMMU, no
InfiniBand, their causes and fixes); this module turns the facts' recorded
report into the doctor's check. Hosts without a driver or with one GPU have no
topology in their facts, and the check is left out of the report rather than
counted as a skip, so their reports (and the recorded facts') stay as they were.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oldgpu import topology

CHECK_ID = topology.DOCTOR_CHECK_ID


def check_topology(facts: Mapping[str, Any]) -> dict[str, Any] | None:
    """The check, or None when the facts hold no topology (no driver, one GPU)."""
    topo = facts.get("topology")
    if not topo:
        return None
    if "error" in topo:
        # Jobs on several GPUs read the same matrix: they would refuse to start too.
        return {
            "id": CHECK_ID,
            "status": "warn",
            "seen": f"cannot read the GPUs' topology: {topo['error']}",
            "fix": "check `nvidia-smi topo -m` works (the driver's tools installed); "
            "jobs on several GPUs need it to choose NCCL's settings",
            "details": {},
        }
    return topology.doctor_check(topo)
