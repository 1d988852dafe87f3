"""The checks of free memory: each GPU's, and the host's (CPU offload lives there)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oldgpu.doctor.common import Check, torch_of
from oldgpu.doctor.facts import PROC_MEMINFO


def check_gpu_memory(
    facts: Mapping[str, Any], prof: Mapping[str, Any] | None, min_free_mib: int
) -> dict[str, Any]:
    c = Check("gpu-memory")
    if prof is None or prof["device"] == "cpu":
        return c.add("skip", "no device: the cpu profile").result()
    devices = [d for d in torch_of(facts).get("devices") or [] if d.get("free_mib") is not None]
    if not devices:
        return c.add("skip", "torch sees no GPU to measure (see torch-build)").result()
    c.details = {"min_free_mib": min_free_mib, "devices": devices}
    for d in devices:
        seen = f"cuda:{d['index']} {d.get('name')}: {d['free_mib']} MiB free of {d['total_mib']}"
        if d["free_mib"] < min_free_mib:
            c.add(
                "fail",
                f"{seen} (needs >= {min_free_mib})",
                f"stop what holds cuda:{d['index']}'s memory (nvidia-smi lists the processes), "
                "or lower --min-free-gpu-mib",
            )
        else:
            c.add("ok", seen)
    return c.result()


def check_host_memory(facts: Mapping[str, Any], min_free_mib: int) -> dict[str, Any]:
    c = Check("host-memory")
    host = facts.get("host") or {}
    available = host.get("mem_available_mib")
    c.details = {"min_free_mib": min_free_mib, **host}
    if available is None:
        return c.add(
            "warn", f"cannot read MemAvailable from {PROC_MEMINFO}", "check host memory by hand"
        ).result()
    seen = f"{available} MiB available of {host.get('mem_total_mib')} MiB"
    if available < min_free_mib:
        return c.add(
            "fail",
            f"{seen} (needs >= {min_free_mib})",
            "free host memory (CPU offload of parameters and optimizer state lives there), "
            "or lower --min-free-host-mib",
        ).result()
    return c.add("ok", seen).result()
