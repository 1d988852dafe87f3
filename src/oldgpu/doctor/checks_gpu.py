"""The checks of the GPU itself: the driver that drives it, its compute capability, bf16."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oldgpu import detect, driver, pins, profile
from oldgpu.doctor.common import (
    Check,
    ccs_of,
    expects_gpu,
    gpu_label,
    gpus_of,
    min_cc,
    patch_cmd,
    torch_of,
)
from oldgpu.doctor.facts import PROC_DRIVER_VERSION
from oldgpu.versions import compare_versions


def _driver_fix(prof: Mapping[str, Any] | None) -> str:
    if prof and prof["driver"]["required"]:
        d = prof["driver"]
        return (
            f"install NVIDIA driver branch {d['selected']} ({d['flavour']} kernel modules; "
            f"this host's GPUs take {d['branches']}) with the nvidia_driver role, then reboot"
        )
    return "install the NVIDIA driver branch `oldgpu profile` selects (nvidia_driver role)"


def check_driver(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = Check("driver")
    gpus = list((facts.get("detect") or {}).get("gpus", []))
    drv = facts.get("driver") or {}
    version = drv.get("version")
    c.details = {"version": version, "source": drv.get("source")}
    if not expects_gpu(prof, gpus):
        if version:
            return c.add("ok", f"driver {version} loaded (the cpu profile needs none)").result()
        return c.add("skip", "no device: the cpu profile needs no driver").result()
    if not version:
        smi = drv.get("nvidia_smi")
        how = {"failed": "nvidia-smi failed", "missing": "no nvidia-smi"}.get(smi, "no nvidia-smi")
        seen = f"no NVIDIA driver loaded ({how}; no {PROC_DRIVER_VERSION})"
        if gpus:
            seen += f" but {len(gpus)} GPU(s) on the PCI bus"
        return c.add("fail", seen, _driver_fix(prof) + " (or `modprobe nvidia`)").result()

    # How the driver fits torch's CUDA is the driver module's answer (oldgpu driver).
    cuda = torch_of(facts).get("cuda") or pins.get("cuda.version")
    pinned_cuda = pins.get("cuda.version")
    full = pins.get("cuda.min_driver")
    fit = driver.cuda_fit(version, cuda)
    floor = fit["minor_compat_driver"]
    c.details.update(cuda=cuda, min_driver=full, minor_compat_driver=floor)
    if fit["fit"] == "ok":
        c.add("ok", f"driver {version} ({drv.get('source')}) >= {full}, CUDA {cuda}'s minimum")
    elif fit["fit"] == "too-old":
        c.add(
            "fail",
            f"driver {version} is too old for torch's CUDA {cuda}: it needs >= {floor} even "
            "with CUDA minor-version compatibility",
            _driver_fix(prof) + f" (CUDA {pinned_cuda} wants >= {full})",
        )
    elif fit["is_pinned"]:
        c.add(
            "warn",
            f"driver {version} is older than {full}, CUDA {cuda}'s minimum: torch runs only "
            "through CUDA minor-version compatibility (no PTX JIT)",
            _driver_fix(prof) + f" (>= {full})",
        )
    elif fit["fit"] == "compat":
        c.add(
            "ok",
            f"driver {version} >= {floor}, enough for torch's CUDA {cuda} (minor-version "
            f"compatibility); the project's CUDA {pinned_cuda} wants >= {full}",
        )
    elif compare_versions(version, full) >= 0:
        c.add(
            "ok",
            f"driver {version} >= {full}, CUDA {pinned_cuda}'s minimum (the project's); what "
            f"torch's CUDA {cuda} needs is not known here (see torch-build)",
        )
    else:
        c.add(
            "warn",
            f"driver {version}: older than CUDA {pinned_cuda}'s {full}, and what torch's "
            f"CUDA {cuda} needs is not known here",
            _driver_fix(prof),
        )
    undriven = [g for g in gpus if g.get("index") is None]
    if undriven and drv.get("nvidia_smi") == "ok":
        names = ", ".join(f"{g.get('name')} at {g.get('bus_id')}" for g in undriven)
        c.add(
            "fail",
            f"driver {version} does not drive {names} (lspci sees it, nvidia-smi does not)",
            _driver_fix(prof),
        )
    return c.result()


def check_gpu_capability(
    facts: Mapping[str, Any], prof: Mapping[str, Any] | None, error: str | None
) -> dict[str, Any]:
    c = Check("gpu-capability")
    gpus = gpus_of(facts)
    if prof is None:
        return c.add(
            "fail",
            f"no profile: {error}",
            "install the pci.ids package or load the driver so detect can name the GPUs, "
            "or pass --cc X.Y / --arch A",
        ).result()
    c.details = {"profile": prof["name"], "gpus": []}
    if not gpus:
        if prof["device"] == "cpu":
            return c.add("skip", "no device: the cpu profile (no NVIDIA GPU found)").result()
        return c.add(
            "fail",
            f"profile {prof['name']} expects a GPU, but detect found none",
            "check `lspci -nn | grep -i nvidia`, or use --arch cpu for a CPU run",
        ).result()
    if prof["device"] == "cpu":
        return c.add(
            "warn",
            f"the cpu profile was asked for but {len(gpus)} GPU(s) are present; training "
            "will not use them",
            "drop --arch cpu to judge the host by its GPUs",
        ).result()
    decisions = (
        f"{prof['compute_dtype']}, {prof['attn_implementation']} attention (fallback "
        f"{prof['attn_fallback']}), {prof['rollout']} rollout, torch.compile "
        f"{'on' if prof['torch_compile'] else 'off'}"
        f"{'' if prof['flash_attn_allowed'] else ', no flash-attn'}"
    )
    pcc = prof["compute_capability"]
    request = facts.get("request") or {}
    explicit = bool(request.get("arch") or request.get("cc"))
    pinned = f"torch {pins.get('torch.version')}+{pins.get('torch.variant')}"
    arch_list = list(pins.get("torch.cuda_arch_list"))
    for g in gpus:
        cc, arch = g.get("compute_capability"), g.get("architecture")
        label = gpu_label(g)
        c.details["gpus"].append({"index": g.get("index"), "compute_capability": cc, "arch": arch})
        if not cc:
            c.add(
                "warn",
                f"{label}: compute capability unknown",
                "load the driver or install pci.ids so detect can tell",
            )
            continue
        if profile.torch_kernels(cc, arch_list) is None:
            c.add(
                "fail",
                f"{label}: CC {cc} ({arch}) is older than any GPU {pinned} has kernels for "
                f"({';'.join(arch_list)}): 'no kernel image is available for execution on the "
                "device'",
                f"this GPU cannot run the project's torch; use a GPU of CC >= {arch_list[0]} "
                "(Maxwell or newer)",
            )
        elif explicit and detect.cc_tuple(cc) < detect.cc_tuple(pcc):
            c.add(
                "fail",
                f"{label}: CC {cc} is older than profile {prof['name']} assumes (CC {pcc}): "
                f"its decisions ({decisions}) may not run on it",
                "drop --cc/--arch and let the profile come from detect",
            )
        elif explicit and arch != prof["architecture"]:
            c.add(
                "warn",
                f"{label}: CC {cc} ({arch}) runs profile {prof['name']} ({decisions}), "
                "chosen with --cc/--arch rather than detected",
                "drop --cc/--arch unless you mean it",
            )
        else:
            c.add("ok", f"{label}: CC {cc} ({arch}) -> profile {prof['name']}: {decisions}")
    # torch's view of the same GPUs (unless CUDA_VISIBLE_DEVICES renumbers them).
    env = facts.get("env") or {}
    devices = torch_of(facts).get("devices") or []
    driven = [g for g in gpus if g.get("index") is not None]
    if devices and not env.get("CUDA_VISIBLE_DEVICES") and len(devices) == len(driven):
        for g, d in zip(driven, devices, strict=True):
            if d.get("capability") and g.get("compute_capability") != d["capability"]:
                c.add(
                    "warn",
                    f"{gpu_label(g)}: detect says CC {g.get('compute_capability')}, torch "
                    f"says {d['capability']}",
                    "check pci.ids and the driver; torch's answer is the one that runs",
                )
    return c.result()


def check_bf16(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = Check("bf16")
    if prof is None:
        return c.add("skip", "no profile (see gpu-capability)").result()
    note = (
        "torch.cuda.is_bf16_supported() is not consulted (torch >= 2.3 counts emulation: "
        "True on Pascal/Volta)"
    )
    said = torch_of(facts).get("bf16_supported")
    if said is not None:
        note += f"; here it says {said}"
    env_dtype = (facts.get("env") or {}).get("OLDGPU_COMPUTE_DTYPE")
    baked = (((facts.get("verl") or {}).get("manifest") or {}).get("options") or {}).get(
        "compute_dtype"
    )
    dtype = prof["compute_dtype"]
    c.details = {"profile": dtype, "verl_tree": baked, "env": env_dtype, "bf16_supported": said}
    if prof["device"] == "cpu":
        return c.add("ok", f"cpu profile: {dtype}; {note}").result()
    ccs = ccs_of(gpus_of(facts)) or [prof["compute_capability"]]
    low = min_cc(ccs)
    has_bf16 = detect.cc_tuple(low) >= (8, 0)
    for what, value in (
        (f"profile {prof['name']}", dtype),
        ("the verl tree (baked in by oldgpu patch)", baked),
        ("OLDGPU_COMPUTE_DTYPE", env_dtype),
    ):
        if value == "bf16" and not has_bf16:
            if what == "OLDGPU_COMPUTE_DTYPE":
                fix = "unset OLDGPU_COMPUTE_DTYPE (or set it to fp32)"
            else:
                fixed = profile.profile_for_cc(low)
                fix = (
                    f"train with profile {fixed['name']} ({fixed['compute_dtype']}): "
                    + patch_cmd(facts.get("verl") or {"dir": "DIR"}, fixed)
                    + " and drop --cc/--arch"
                )
            c.add("fail", f"{what} computes in bf16, but the oldest GPU has CC {low} (< 8.0)", fix)
    if dtype == "bf16" and has_bf16:
        c.add("ok", f"bf16: every GPU has CC >= 8.0 (oldest {low}); {note}")
    elif dtype != "bf16":
        why = "no bf16 below CC 8.0" if not has_bf16 else "the profile asks for it"
        c.add("ok", f"{dtype}: oldest GPU CC {low}, {why}; {note}")
    return c.result()
