"""The doctor's checks, in the order it reports them: ``evaluate`` runs each on a facts dict.

A check is a function ``facts, profile -> dict`` in the ``checks_*`` module of
what it judges (the GPU, the venv's packages, the verl tree, memory); a new one
is added there, to ``CHECK_IDS`` and to ``evaluate``. Pure: no host is asked.
``gpu-topology`` (``OPTIONAL_CHECK_IDS``) follows them only when the facts hold a
multi-GPU host's topology (see ``checks_topology``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oldgpu.doctor.checks_gpu import check_bf16, check_driver, check_gpu_capability
from oldgpu.doctor.checks_kernels import CHECK_ID as KERNELS_CHECK_ID
from oldgpu.doctor.checks_kernels import check_kernels
from oldgpu.doctor.checks_memory import check_gpu_memory, check_host_memory
from oldgpu.doctor.checks_topology import CHECK_ID as TOPOLOGY_CHECK_ID
from oldgpu.doctor.checks_topology import check_topology
from oldgpu.doctor.checks_torch import (
    check_flash_attn,
    check_torch_build,
    check_triton,
    check_vllm,
)
from oldgpu.doctor.checks_verl import check_verl_patch
from oldgpu.doctor.common import resolve_profile

DEFAULT_MIN_FREE_GPU_MIB = 1024
DEFAULT_MIN_FREE_HOST_MIB = 2048

CHECK_IDS = (
    "driver",
    "gpu-capability",
    "torch-build",
    "triton",
    "flash-attn",
    "vllm",
    "verl-patch",
    "gpu-memory",
    "host-memory",
    "bf16",
)
# Reported after CHECK_IDS when they apply (never counted as a skip otherwise).
OPTIONAL_CHECK_IDS = (TOPOLOGY_CHECK_ID, KERNELS_CHECK_ID)


def evaluate(
    facts: Mapping[str, Any],
    *,
    min_free_gpu_mib: int = DEFAULT_MIN_FREE_GPU_MIB,
    min_free_host_mib: int = DEFAULT_MIN_FREE_HOST_MIB,
) -> dict[str, Any]:
    """The doctor's report on a facts dict (``gather_facts``'s, or a recorded one)."""
    prof, error = resolve_profile(facts)
    checks = [
        check_driver(facts, prof),
        check_gpu_capability(facts, prof, error),
        check_torch_build(facts, prof),
        check_triton(facts, prof),
        check_flash_attn(facts, prof),
        check_vllm(facts, prof),
        check_verl_patch(facts, prof),
        check_gpu_memory(facts, prof, min_free_gpu_mib),
        check_host_memory(facts, min_free_host_mib),
        check_bf16(facts, prof),
    ]
    for optional in (check_topology(facts), check_kernels(facts)):
        if optional is not None:
            checks.append(optional)
    counts = {s: sum(ch["status"] == s for ch in checks) for s in ("ok", "warn", "fail", "skip")}
    return {
        "ok": counts["fail"] == 0,
        "profile": prof["name"] if prof else None,
        "checks": checks,
        "counts": counts,
        "summary": f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail",
    }
