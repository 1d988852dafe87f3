"""The guard's policy: what a profile's GPU cannot do, from the profile and the environment.

The profile table (:mod:`oldgpu.profile`) says the architecture, the compute capability,
the compute dtype and whether torch.compile and flash-attn may run; this adds what the
guard enforces on top (TF32 and the SDPA backends by compute capability, the dtypes to
forbid, the allocator's cap) and reads the ``OLDGPU_GUARD*`` variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oldgpu.output import EngineError

ENV_GUARD = "OLDGPU_GUARD"
ENV_MEMORY = "OLDGPU_GUARD_MEMORY_MIB"
ENV_DTYPE = "OLDGPU_GUARD_DTYPE"
ENV_DTYPE_CHECK = "OLDGPU_GUARD_DTYPE_CHECK"
ENV_OPS_STEPS = "OLDGPU_GUARD_OPS_STEPS"
ENV_LOG = "OLDGPU_GUARD_LOG"
ENV_DEVICE = "OLDGPU_GUARD_DEVICE"
# The 16-bit dtypes a job may store (not compute in) on the card: a LoRA job's frozen base
# at 16 bits (its base_dtype), upcast to fp32 one FSDP unit at a time. Set by the job.
ENV_STORAGE_DTYPES = "OLDGPU_GUARD_STORAGE_DTYPES"
STORAGE_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
# Bench only: trace the peak memory per verl phase (guard/phases.py).
ENV_MEMORY_PHASES = "OLDGPU_GUARD_MEMORY_PHASES"

SITE_DIR = Path(__file__).resolve().parents[1] / "guard_site"
_OFF = ("", "0", "off", "no", "false")
_ON = ("1", "on", "yes", "true")
DEFAULT_PROFILE = "pascal"
DTYPE_CHECKS = ("ops", "conversions")

# The card each compute capability stands for in messages, and what torch's caching
# allocator may reserve on it: the card's memory less about 1.5 GiB for the CUDA context
# (about 0.5 GiB, outside the allocator) and what the driver and ECC keep. The P40:
# 24 GiB -> 22.5 GiB. An estimate until measured on the card; OLDGPU_GUARD_MEMORY_MIB
# overrides it. Volta stands for the 32 GB V100 (the card the fp16 bench plans for);
# OLDGPU_GUARD_MEMORY_MIB=14848 guards a 16 GB one.
GPU_NAMES = {
    "3.7": "Tesla K80",
    "5.2": "Tesla M40",
    "6.0": "Tesla P100-PCIE-16GB",
    "6.1": "Tesla P40",
    "7.0": "Tesla V100-SXM2-32GB",
    "7.5": "Tesla T4",
}
DEFAULT_MEMORY_MIB = {
    "3.7": 12 * 1024 - 1536,
    "5.2": 24 * 1024 - 1536,
    "6.0": 16 * 1024 - 1536,
    "6.1": 24 * 1024 - 1536,
    "7.0": 32 * 1024 - 1536,
    "7.5": 16 * 1024 - 1536,
}
# flash-attn's importable names (the package, its CUDA extension, the FA3 interface).
BLOCKED_MODULES = ("flash_attn", "flash_attn_2_cuda", "flash_attn_interface", "flash_attn_3")
BLOCKED_DISTRIBUTIONS = ("flash-attn", "flash_attn", "flash-attn-3")


def triton_too_old_message(gpu_name: str, cc: str) -> str:
    """What Inductor says on a GPU below CC 7.0 (torch/_inductor/scheduler.py, 2.6)."""
    return (
        f"Found {gpu_name} which is too old to be supported by the triton GPU compiler, "
        "which is used as the backend. Triton only supports devices of CUDA Capability "
        f">= 7.0, but your device is of CUDA capability {cc}"
    )


class GuardViolation(EngineError):
    """Something a process on the guarded GPU could not do (or the policy forbids)."""

    def __init__(self, name: str, message: str, *, op: str = "", site: str = "") -> None:
        super().__init__(name, message)
        self.op = op
        self.site = site

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles a worker's exception to the driver: keep the name and the message
        # (the default would call __init__ with the message alone and lose both).
        return (_rebuild_violation, (self.name, self.message, self.op, self.site))


def _rebuild_violation(name: str, message: str, op: str, site: str) -> GuardViolation:
    return GuardViolation(name, message, op=op, site=site)


@dataclass(frozen=True)
class Policy:
    profile: str  # the profile's name, e.g. pascal-6.1
    architecture: str
    compute_capability: str
    gpu_name: str
    device: str  # the device type watched
    compute_dtype: str  # the dtype policy: fp32 or fp16
    forbidden_dtypes: tuple[str, ...]  # torch dtype names
    tf32: bool  # allowed?
    flash_sdp: bool
    cudnn_sdp: bool
    mem_efficient_sdp: bool
    torch_compile: bool
    flash_attn: bool
    memory_mib: int | None
    dtype_check: str
    log: str | None
    ops_steps: int = 0
    # Forbidden dtypes that may still be stored and converted (never computed in).
    storage_dtypes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cc_tuple(cc: str) -> tuple[int, int]:
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def policy_for(
    name: str,
    *,
    memory_mib: int | str | None = "default",
    compute_dtype: str | None = None,
    dtype_check: str = "ops",
    device: str = "cuda",
    log: str | None = None,
    ops_steps: int = 0,
    storage_dtypes: tuple[str, ...] = (),
) -> Policy:
    """The guard's policy for a profile name (``pascal``, ``pascal-6.1``, ``volta``...)."""
    from oldgpu import profile

    arch, _, cc = name.strip().lower().partition("-")
    try:
        prof = profile.profile_for_arch(arch, cc or None)
    except EngineError as exc:
        raise EngineError("guard-profile-unknown", f"{ENV_GUARD}={name!r}: {exc.message}") from exc
    if prof["device"] != "cuda" or prof["compute_dtype"] == "bf16":
        raise EngineError(
            "guard-profile-unsupported",
            f"{name!r} is a GPU with bf16 and FlashAttention-2 (or no GPU): there is nothing "
            "to guard; use kepler, maxwell, pascal, volta or turing",
        )
    cc = prof["compute_capability"]
    major_minor = _cc_tuple(cc)
    dtype = (compute_dtype or prof["compute_dtype"]).lower()
    if dtype not in ("fp32", "fp16"):
        raise EngineError(
            "guard-dtype-invalid", f"{ENV_DTYPE}={dtype!r}: expected fp32 or fp16 (no bf16 here)"
        )
    if dtype_check not in DTYPE_CHECKS:
        raise EngineError(
            "guard-dtype-check-invalid",
            f"{ENV_DTYPE_CHECK}={dtype_check!r}: expected one of {', '.join(DTYPE_CHECKS)}",
        )
    if memory_mib == "default":
        memory_mib = DEFAULT_MEMORY_MIB.get(cc)
    elif isinstance(memory_mib, str):
        raise EngineError("guard-memory-invalid", f"memory_mib={memory_mib!r}")
    if memory_mib is not None and memory_mib <= 0:
        memory_mib = None
    forbidden = ("bfloat16",) if dtype == "fp16" else ("bfloat16", "float16")
    storage = _storage_dtypes(storage_dtypes, forbidden)
    return Policy(
        profile=prof["name"],
        architecture=prof["architecture"],
        compute_capability=cc,
        gpu_name=GPU_NAMES.get(cc, f"a {prof['architecture']} GPU"),
        device=device,
        compute_dtype=dtype,
        forbidden_dtypes=forbidden,
        tf32=major_minor >= (8, 0),
        flash_sdp=major_minor >= (8, 0),
        cudnn_sdp=major_minor >= (8, 0),
        # PyTorch's mem-efficient kernel runs from sm50.
        mem_efficient_sdp=major_minor >= (5, 0),
        torch_compile=bool(prof["torch_compile"]),
        flash_attn=bool(prof["flash_attn_allowed"]),
        memory_mib=memory_mib,
        dtype_check=dtype_check,
        log=log,
        ops_steps=max(0, ops_steps),
        storage_dtypes=storage,
    )


def _storage_dtypes(names: tuple[str, ...], forbidden: tuple[str, ...]) -> tuple[str, ...]:
    """``bf16``/``fp16`` (or torch's names) as torch dtype names; only forbidden ones
    matter (an allowed dtype needs no exception)."""
    found = []
    for raw in names:
        name = raw.strip().lower()
        if not name:
            continue
        torch_name = STORAGE_DTYPE_NAMES.get(name, name)
        if torch_name not in STORAGE_DTYPE_NAMES.values():
            raise EngineError(
                "guard-storage-dtypes-invalid",
                f"{ENV_STORAGE_DTYPES}={','.join(names)!r}: expected bf16 and/or fp16",
            )
        if torch_name in forbidden and torch_name not in found:
            found.append(torch_name)
    return tuple(found)


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV_GUARD, "").strip().lower() not in _OFF


def policy_from_env(environ: Mapping[str, str] | None = None) -> Policy | None:
    """The policy the environment asks for, or None when ``OLDGPU_GUARD`` is unset/off."""
    env = os.environ if environ is None else environ
    if not enabled(env):
        return None
    name = env.get(ENV_GUARD, "").strip().lower()
    if name in _ON:
        name = DEFAULT_PROFILE
    raw_memory = env.get(ENV_MEMORY, "").strip()
    memory: int | str | None = "default"
    if raw_memory:
        try:
            memory = int(float(raw_memory))
        except ValueError:
            raise EngineError(
                "guard-memory-invalid", f"{ENV_MEMORY}={raw_memory!r}: expected MiB"
            ) from None
    raw_steps = env.get(ENV_OPS_STEPS, "").strip() or "0"
    try:
        ops_steps = int(raw_steps)
    except ValueError:
        raise EngineError(
            "guard-ops-steps-invalid", f"{ENV_OPS_STEPS}={raw_steps!r}: expected a count"
        ) from None
    return policy_for(
        name,
        ops_steps=ops_steps,
        memory_mib=memory,
        compute_dtype=env.get(ENV_DTYPE, "").strip() or None,
        dtype_check=env.get(ENV_DTYPE_CHECK, "").strip().lower() or "ops",
        device=env.get(ENV_DEVICE, "").strip().lower() or "cuda",
        log=env.get(ENV_LOG, "").strip() or None,
        storage_dtypes=tuple(env.get(ENV_STORAGE_DTYPES, "").split(",")),
    )


def memory_fraction(cap_mib: int, total_bytes: int) -> float:
    """The fraction of a device's memory that is ``cap_mib`` (at most 1)."""
    if total_bytes <= 0:
        return 1.0
    return min(1.0, cap_mib * 1024 * 1024 / total_bytes)


def environment(profile_name: str = DEFAULT_PROFILE, log: str | None = None) -> dict[str, str]:
    """The variables a job exports (before Ray starts) to run under the guard."""
    path = os.environ.get("PYTHONPATH", "")
    parts = [str(SITE_DIR)] + [p for p in path.split(os.pathsep) if p and p != str(SITE_DIR)]
    env = {ENV_GUARD: profile_name, "PYTHONPATH": os.pathsep.join(parts)}
    if log:
        env[ENV_LOG] = log
    return env
