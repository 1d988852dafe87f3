"""Which of a host's cards a job runs on: the cards of one profile only.

On a host of mixed cards (P40s and a V100), the profile of all GPUs is the
oldest card's; a job that ran on all of them, or on whichever card CUDA
numbers first, would get a profile that does not fit its cards. So a job runs
on the cards of one profile, through ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from oldgpu import profile as profiles
from oldgpu.output import EngineError


def _get(gpu: Any, key: str) -> Any:
    return gpu.get(key) if isinstance(gpu, Mapping) else getattr(gpu, key, None)


def gpu_profiles(gpus: Sequence[Any]) -> list[str | None]:
    """Each detected GPU's profile name (``pascal-6.1``); None for one the driver does not drive."""
    return [
        None if _get(g, "index") is None else profiles.profile_for_gpus([g])["name"] for g in gpus
    ]


def _profile_rank(name: str) -> tuple[int, tuple[int, ...]]:
    arch, _, cc = name.partition("-")
    row = profiles.PROFILES.get(arch)
    return (row.order if row else -1, tuple(int(x) for x in cc.split(".") if x.isdigit()))


def _matches(name: str, wanted: str) -> bool:
    return name == wanted or name.partition("-")[0] == wanted


def choose_devices(
    gpus_detected: Sequence[Any],
    profile_of_each: Sequence[str | None],
    requested: int | str,
    devices: Sequence[int] | None = None,
    *,
    profile: str | None = None,
) -> list[int]:
    """The GPU indices a job runs on: cards of one profile only.

    ``gpus_detected`` are detect's GPUs (objects or dicts), ``profile_of_each``
    their profile names in the same order (``gpu_profiles``). ``devices``
    names the cards; else ``profile`` (a name such as ``pascal`` or
    ``pascal-6.1``) picks its cards; else a host of one profile gives its
    cards, and a mixed host the most capable profile with enough of them
    (``all`` on a mixed host must say which). Never mixes profiles.
    """
    if len(profile_of_each) != len(gpus_detected):
        raise ValueError("profile_of_each must have one entry per detected GPU")
    host = {
        int(_get(g, "index")): p
        for g, p in zip(gpus_detected, profile_of_each, strict=True)
        if _get(g, "index") is not None and p is not None
    }
    if requested != "all" and (
        isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
    ):
        raise EngineError("gpus-invalid", f"gpus: {requested!r} is not a count >= 1 or 'all'")
    if isinstance(requested, int) and requested > len(host):
        raise EngineError(
            "gpus-exceed-host",
            f"the job asks for {requested} GPU(s) and this host has {len(host)} "
            f"({_host_text(host)})",
        )
    if devices is not None:
        return _check_devices(host, requested, list(devices), profile)
    groups: dict[str, list[int]] = {}
    for index, name in sorted(host.items()):
        groups.setdefault(name, []).append(index)
    if profile:
        groups = {n: g for n, g in groups.items() if _matches(n, profile)}
        if not groups:
            raise EngineError(
                "profile-not-on-host",
                f"no GPU of profile {profile} on this host ({_host_text(host)})",
            )
    if requested == "all":
        if len(groups) > 1:
            raise EngineError(
                "gpus-all-mixed-host",
                f"gpus: all on a host of mixed cards ({_groups_text(groups)}) would mix "
                "profiles: set the job's devices or profile",
            )
        return next(iter(groups.values()), [])
    count = int(requested)
    fitting = [n for n, g in groups.items() if len(g) >= count]
    if not fitting:
        raise EngineError(
            "gpus-exceed-profile",
            f"the job asks for {count} GPU(s) of one profile; this host has {_groups_text(groups)}",
        )
    # The newest profile that fits: its cards are the ones the job's plan is for.
    best = max(fitting, key=_profile_rank)
    return groups[best][:count]


def _groups_text(groups: Mapping[str, Sequence[int]]) -> str:
    return "; ".join(f"{n}: GPUs {list(g)}" for n, g in groups.items())


def _host_text(host: Mapping[int, str]) -> str:
    return ", ".join(f"GPU {i}: {p}" for i, p in sorted(host.items())) or "no GPU driven"


def _check_devices(
    host: Mapping[int, str], requested: int | str, devices: list[int], profile: str | None
) -> list[int]:
    if not devices or any(isinstance(d, bool) or not isinstance(d, int) for d in devices):
        raise EngineError("devices-invalid", f"devices: {devices!r} is not a list of GPU indices")
    if len(set(devices)) != len(devices):
        raise EngineError("devices-invalid", f"devices: {devices} names a GPU twice")
    unknown = [d for d in devices if d not in host]
    if unknown:
        raise EngineError(
            "device-unknown",
            f"devices: GPU(s) {unknown} are not driven on this host (GPUs {sorted(host)})",
        )
    names = {host[d] for d in devices}
    if len(names) > 1:
        raise EngineError(
            "devices-mixed-profiles",
            f"devices {devices} are of different profiles "
            f"({_host_text({d: host[d] for d in devices})}): a job runs on cards of one profile",
        )
    if profile and not _matches(next(iter(names)), profile):
        raise EngineError(
            "devices-profile-mismatch",
            f"devices {devices} are {names.pop()}, the job's profile is {profile}",
        )
    if requested != "all" and requested != len(devices):
        raise EngineError(
            "devices-count-mismatch",
            f"gpus: {requested} but devices lists {len(devices)}: {devices}",
        )
    return sorted(devices)


def visible_devices_env(indices: Sequence[int]) -> dict[str, str]:
    """The CUDA variables that give a job exactly these nvidia-smi indices.

    CUDA numbers devices fastest first unless told otherwise, nvidia-smi by
    PCI bus: without CUDA_DEVICE_ORDER the indices would name other cards.
    """
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, indices))}
