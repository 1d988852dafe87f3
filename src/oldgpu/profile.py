"""``oldgpu profile``: what a GPU architecture needs to train with verl 0.5.0.

``PROFILES`` is the project's one table of per-architecture decisions (driver
branch, dtype, attention, rollout, torch.compile, what may be installed);
Ansible, Nix and the patcher read them from ``oldgpu profile --json`` and
must not repeat them.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oldgpu import detect, distro, pins, subcommand
from oldgpu.output import EngineError, Result

FLAVOURS = ("proprietary", "open")

# Driver branches the project installs, with the kernel-module flavours each
# ships: 470 predates NVIDIA's open modules (first in 515).
BRANCH_FLAVOURS: dict[int, tuple[str, ...]] = {
    470: ("proprietary",),
    535: ("proprietary", "open"),
    550: ("proprietary", "open"),
    580: ("proprietary", "open"),
}


@dataclass(frozen=True)
class ArchProfile:
    order: int  # generation; a host takes the decisions of its oldest GPU
    cc: str | None  # representative compute capability for ``--arch``
    driver_branches: tuple[int, ...]
    default_branch: int
    flavours: tuple[str, ...]
    compute_dtype: str
    attn_implementation: str
    attn_fallback: str
    rollout: str
    torch_compile: bool
    flash_attn_allowed: bool
    vllm_allowed: bool
    device: str = "cuda"


_P, _PO, _O = ("proprietary",), FLAVOURS, ("open",)
_ALL = tuple(BRANCH_FLAVOURS)

# Why each decision:
# - driver: 470 is the last branch for Kepler and still drives Maxwell..Ampere;
#   535, 550 and 580 drive Maxwell..Hopper, and 580 is the last for Maxwell,
#   Pascal and Volta. Open kernel modules need Turing or newer; Blackwell needs
#   them. The default is Debian 12's packaged 535 (470 for Kepler); with a
#   distribution (--distro) only its archive's branches count and its default
#   wins where the GPUs take it (Debian 13: 550; oldgpu.distro says why).
# - dtype: no bf16 below CC 8.0 (gate on the capability: torch's
#   is_bf16_supported() counts emulation). fp16 is 1/64 rate on 6.1 (and 6.0 has
#   no tensor cores), so Kepler..Pascal train in fp32. Volta and Turing have fp16
#   tensor cores (V100 ~125 TFLOPS fp16 against 15.7 fp32, T4 65 against 8.1):
#   fp16 autocast with weights and optimizer state in fp32, and the engine's
#   fp16-loss-scaler patch (verl 0.5.0 has no loss scaler). A job may force fp32.
# - attention: FlashAttention-2 needs sm80; PyTorch's SDPA (mem-efficient
#   kernel from sm50) is the choice below, HF's eager the fallback.
# - rollout: vLLM needs CC >= 7.0, so Kepler..Pascal have only verl 0.5.0's HF
#   rollout. Volta and Turing take vLLM 0.8.5 (the newest verl 0.5.0 accepts) in
#   fp16 on its V0 engine with the XFORMERS attention backend (its V1 engine and
#   FlashAttention need newer cards); HF stays a fallback a job can choose.
# - torch.compile: Triton/Inductor refuse CC < 7.0.
# - cpu: no GPU (CI smoke runs); any branch may be installed, none is needed.
# Rows are in generation order, which ``order`` records.
# fmt: off
_TABLE: dict[str, tuple[Any, ...]] = {
    # arch       cc      branches         dflt  flav  dtype   attention            fallbk   rollout compile flash  vllm   # noqa: E501
    "cpu":       (None,   _ALL,            535,  _PO,  "fp32", "sdpa",              "eager", "hf",   False,  False, False),  # noqa: E501
    "kepler":    ("3.7",  (470,),          470,  _P,   "fp32", "sdpa",              "eager", "hf",   False,  False, False),  # noqa: E501
    "maxwell":   ("5.2",  (470, 535, 550, 580), 535,  _P,   "fp32", "sdpa",              "eager", "hf",   False,  False, False),  # noqa: E501
    "pascal":    ("6.1",  (470, 535, 550, 580), 535,  _P,   "fp32", "sdpa",              "eager", "hf",   False,  False, False),  # noqa: E501
    "volta":     ("7.0",  (470, 535, 550, 580), 535,  _P,   "fp16", "sdpa",              "eager", "vllm", True,   False, True),   # noqa: E501
    "turing":    ("7.5",  (470, 535, 550, 580), 535,  _PO,  "fp16", "sdpa",              "eager", "vllm", True,   False, True),   # noqa: E501
    "ampere":    ("8.0",  (470, 535, 550, 580), 535,  _PO,  "bf16", "flash_attention_2", "sdpa",  "vllm", True,   True,  True),   # noqa: E501
    "ada":       ("8.9",  (535, 550, 580), 535,  _PO,  "bf16", "flash_attention_2", "sdpa",  "vllm", True,   True,  True),   # noqa: E501
    "hopper":    ("9.0",  (535, 550, 580), 535,  _PO,  "bf16", "flash_attention_2", "sdpa",  "vllm", True,   True,  True),   # noqa: E501
    "blackwell": ("10.0", (580,),          580,  _O,   "bf16", "flash_attention_2", "sdpa",  "vllm", True,   True,  True),   # noqa: E501
}
# fmt: on
PROFILES: dict[str, ArchProfile] = {
    arch: ArchProfile(order - 1, *row, device="cpu" if arch == "cpu" else "cuda")
    for order, (arch, row) in enumerate(_TABLE.items())
}
ROLLOUTS = ("hf", "vllm")
# vLLM's environment below CC 8.0: the V0 engine (V1 failed on V100 in 0.8.x) and the
# XFORMERS attention backend (vLLM's FlashAttention needs CC 8.0).
VLLM_PRE_AMPERE_ENV = {"VLLM_USE_V1": "0", "VLLM_ATTENTION_BACKEND": "XFORMERS"}
VLLM_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# What a host without a GPU installs if the role runs anyway (Debian 12's
# non-free nvidia-driver is 535).
NO_GPU_BRANCH = PROFILES["cpu"].default_branch


def _get(gpu: Any, key: str) -> Any:
    if isinstance(gpu, Mapping):
        return gpu.get(key)
    return getattr(gpu, key, None)


def _rows(gpus: Sequence[Any]) -> list[tuple[str, ArchProfile, str | None]]:
    """(architecture, table row, compute capability) of each GPU."""
    rows = []
    for gpu in gpus:
        arch = _get(gpu, "architecture")
        if arch not in PROFILES or arch == "cpu":
            what = " ".join(str(v) for v in (_get(gpu, "name"), _get(gpu, "pci_id")) if v)
            raise EngineError(
                "unknown-gpu-architecture",
                f"cannot tell the architecture of {what or 'a GPU'}; install the pci.ids "
                "package or load the driver, or pass --arch/--cc",
            )
        rows.append((arch, PROFILES[arch], _get(gpu, "compute_capability")))
    return rows


def select_driver(
    gpus: Sequence[Any],
    requested_branch: int | None = None,
    requested_flavour: str | None = None,
    distro_key: str | None = None,
) -> dict[str, Any]:
    """The driver branch and module flavour that drive every GPU of a host.

    Without a request: the distro default if all GPUs take it, else the
    newest branch they share. No GPU: nothing required, ``NO_GPU_BRANCH``.
    With ``distro_key`` (``oldgpu.distro``), only the branches and flavours its
    archive packages, and its default first.
    """
    archs = _rows(gpus)
    rows = [row for _, row, _ in archs] or [PROFILES["cpu"]]
    common = set.intersection(*(set(row.driver_branches) for row in rows))
    release = distro.get(distro_key) if distro_key else None
    packaged = distro.packaged(distro_key) if distro_key else None
    if common and release and packaged and not common & set(packaged):
        raise EngineError(
            "driver-branch-not-packaged",
            f"{release.name} packages driver branches {sorted(packaged)}; this host "
            f"({_arch_names(archs)}) needs one of {sorted(common)}",
        )
    if packaged is not None:
        common &= set(packaged)
    if not common:
        support = ", ".join(
            dict.fromkeys(f"{a}: {list(row.driver_branches)}" for a, row, _ in archs)
        )
        raise EngineError(
            "no-common-driver-branch",
            f"no driver branch supports all GPUs of this host ({support}); "
            "put them in different hosts",
        )
    defaults = sorted({row.default_branch for row in rows} & common, reverse=True)
    if release and release.default_branch in common:
        defaults = [release.default_branch]
    default = defaults[0] if defaults else max(common)

    selected = default
    if requested_branch is not None:
        if requested_branch not in BRANCH_FLAVOURS:
            raise EngineError(
                "driver-branch-unknown",
                f"driver branch {requested_branch} is not one the project installs "
                f"({sorted(BRANCH_FLAVOURS)})",
            )
        if release and packaged and requested_branch not in packaged:
            raise EngineError(
                "driver-branch-not-packaged",
                f"driver branch {requested_branch} is not in {release.name}'s archive "
                f"(it packages {sorted(packaged)}); choose one of {sorted(common)}",
            )
        if requested_branch not in common:
            raise EngineError(
                "driver-branch-unsupported",
                f"driver branch {requested_branch} does not support all GPUs of this host; "
                f"choose one of {sorted(common)}",
            )
        selected = requested_branch

    flavours = [
        f
        for f in FLAVOURS
        if f in BRANCH_FLAVOURS[selected]
        and all(f in row.flavours for row in rows)
        and (packaged is None or f in packaged[selected])
    ]
    if requested_flavour is not None:
        if requested_flavour not in FLAVOURS:
            raise EngineError(
                "driver-flavour-unknown", f"{requested_flavour!r} is not one of {FLAVOURS}"
            )
        if requested_flavour not in flavours:
            if release and packaged and all(requested_flavour in r.flavours for r in rows):
                raise EngineError(
                    "driver-flavour-not-packaged",
                    f"{release.name} packages no {requested_flavour} kernel modules in step with "
                    f"branch {selected} (it has {list(packaged[selected])})",
                )
            if requested_flavour == "open":
                raise EngineError(
                    "open-modules-unsupported",
                    "NVIDIA's open kernel modules need Turing or newer and branch 515+; "
                    f"this host ({_arch_names(archs)}, branch {selected}) needs the "
                    "proprietary modules",
                )
            raise EngineError(
                "proprietary-modules-unsupported",
                f"this host ({_arch_names(archs)}) needs NVIDIA's open kernel modules",
            )
        flavour = requested_flavour
    elif flavours:
        flavour = flavours[0]
    else:
        raise EngineError(
            "no-common-driver-flavour",
            f"no kernel-module flavour drives all GPUs of this host ({_arch_names(archs)}) "
            f"with branch {selected}",
        )
    return {
        "required": bool(archs),
        "branches": sorted(common),
        "default": default,
        "selected": selected,
        "flavours": flavours,
        "flavour": flavour,
        "distro": release.key if release else None,
    }


def _arch_names(archs: Sequence[tuple[str, ArchProfile, str | None]]) -> str:
    return "+".join(dict.fromkeys(a for a, _, _ in archs)) or "no GPU"


def torch_kernels(cc: str, arch_list: Sequence[str]) -> str | None:
    """The ``sm_XY`` code of a torch build that runs on ``cc``, or None.

    SASS runs on the same major version at an equal or higher minor, so sm_61
    runs sm_60 code; a different major gets nothing.
    """
    major, minor = detect.cc_tuple(cc)
    best = None
    for entry in arch_list:
        e_major, e_minor = detect.cc_tuple(entry.replace("+PTX", ""))
        if e_major == major and e_minor <= minor and (best is None or e_minor > best[1]):
            best = (e_major, e_minor)
    return f"sm_{best[0]}{best[1]}" if best else None


def torch_info(ccs: Sequence[str]) -> dict[str, Any]:
    """The pinned torch build and whether it has code for each compute capability."""
    arch_list = list(pins.get("torch.cuda_arch_list"))
    kernels = {cc: torch_kernels(cc, arch_list) for cc in dict.fromkeys(ccs)}
    return {
        "version": pins.get("torch.version"),
        "variant": pins.get("torch.variant"),
        "triton": pins.get("torch.triton"),
        "cuda_arch_list": arch_list,
        "kernels": kernels,
        "has_kernels": all(kernels.values()),
        "min_driver": pins.get("cuda.min_driver"),
    }


def hydra_overrides(row: ArchProfile) -> list[str]:
    """verl 0.5.0 command-line overrides for a profile.

    ``+`` marks keys absent from verl's composed ppo_trainer config (a test
    checks each against the yaml); Hydra refuses ``+`` on a key that exists.
    """
    out: list[str] = []
    if row.compute_dtype in ("fp32", "fp16"):
        # FSDP mixed precision and the ref model default to bf16. fp16 keeps the
        # weights (and so the optimizer state) in fp32 too: only autocast is fp16.
        out += [
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
            "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
            "+critic.model.fsdp_config.mixed_precision.param_dtype=fp32",
            "+actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
        ]
    if not row.torch_compile:
        # The ref's use_torch_compile follows the actor's through oc.select.
        out.append("actor_rollout_ref.actor.use_torch_compile=False")
    if not row.flash_attn_allowed:
        # Remove-padding needs flash-attn's helpers; liger and the fused kernels
        # are Triton. Pinned off rather than left to defaults that may move.
        out += [
            "actor_rollout_ref.model.use_remove_padding=False",
            "critic.model.use_remove_padding=False",
            "actor_rollout_ref.model.use_liger=False",
            "actor_rollout_ref.model.use_fused_kernels=False",
        ]
    if row.rollout == "hf":
        # The rollout's default tensor parallelism is 2; HF rollout is one device each.
        out += [
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        ]
    if row.rollout == "vllm" and row.compute_dtype != "bf16":
        # verl's rollout config says bfloat16; vLLM refuses it below CC 8.0.
        out += [
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.dtype={VLLM_DTYPES[row.compute_dtype]}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        ]
    if row.device == "cpu":
        out.append("trainer.device=cpu")
    return out


def rollout_environment(row: ArchProfile) -> dict[str, str]:
    """What the rollout needs in the environment (vLLM's engine and backend below 8.0)."""
    if row.rollout == "vllm" and row.compute_dtype != "bf16":
        return dict(VLLM_PRE_AMPERE_ENV)
    return {}


def with_choices(
    prof: Mapping[str, Any], rollout: str = "", compute_dtype: str = ""
) -> dict[str, Any]:
    """A profile with a job's choices applied: the HF rollout where the profile says
    vLLM, or fp32 where it says fp16 (the baseline fp16 is compared against). Only
    what the card can do; anything else is a named error."""
    if not rollout and not compute_dtype:
        return dict(prof)
    arch = prof["architecture"]
    row = PROFILES[arch]
    if rollout and rollout not in ROLLOUTS:
        raise EngineError("rollout-unknown", f"rollout {rollout!r}: expected one of {ROLLOUTS}")
    if rollout == "vllm" and not row.vllm_allowed:
        raise EngineError(
            "rollout-unsupported",
            f"rollout vllm: vLLM needs compute capability 7.0 or newer; profile "
            f"{prof['name']} has only the HF rollout",
        )
    if compute_dtype and compute_dtype not in (row.compute_dtype, "fp32"):
        raise EngineError(
            "compute-dtype-unsupported",
            f"compute dtype {compute_dtype!r}: profile {prof['name']} computes in "
            f"{row.compute_dtype} and may be forced to fp32, nothing else",
        )
    changed = dataclasses.replace(
        row,
        rollout=rollout or row.rollout,
        compute_dtype=compute_dtype or row.compute_dtype,
    )
    out = dict(prof)
    out.update(
        compute_dtype=changed.compute_dtype,
        rollout=changed.rollout,
        hydra_overrides=hydra_overrides(changed),
        rollout_environment=rollout_environment(changed),
    )
    # The patch keeps the profile's dtype (its fp16 set is a pass-through at fp32
    # through OLDGPU_COMPUTE_DTYPE), so one patched tree serves both.
    return out


def _notes(
    archs: Sequence[tuple[str, ArchProfile, str | None]],
    row: ArchProfile,
    driver: Mapping[str, Any],
    torch: Mapping[str, Any],
) -> list[str]:
    notes = []
    build = f"torch {torch['version']}+{torch['variant']}"
    for cc, sm in torch["kernels"].items():
        if sm is None:
            notes.append(
                f"{build} has no kernels for compute capability {cc} "
                f"(built for {';'.join(torch['cuda_arch_list'])})"
            )
        elif sm != "sm_" + cc.replace(".", ""):
            notes.append(f"compute capability {cc} runs the {sm} code of {build}")
    min_major = int(str(torch["min_driver"]).split(".")[0])
    if driver["required"] and driver["selected"] < min_major:
        notes.append(
            f"driver {driver['selected']} is older than CUDA {pins.get('cuda.version')}'s "
            f"{torch['min_driver']}: {build} relies on CUDA minor-version compatibility"
        )
    if row.device == "cpu":
        notes.append("no GPU: the cpu profile (CI smoke runs)")
    elif row.compute_dtype == "fp32":
        notes.append("fp32: no bf16 below compute capability 8.0")
    elif row.compute_dtype == "fp16":
        notes.append(
            "fp16 autocast with a loss scaler (oldgpu patch's fp16-loss-scaler): no bf16 "
            "below compute capability 8.0; weights and optimizer state stay fp32"
        )
    if row.rollout == "vllm" and row.compute_dtype != "bf16":
        notes.append(
            f"vLLM {pins.get('vllm.version')} on its V0 engine with the XFORMERS attention "
            "backend (FlashAttention needs 8.0); a job may choose rollout hf instead"
        )
    return notes


def profile_for_gpus(
    gpus: Sequence[Any],
    requested_branch: int | None = None,
    requested_flavour: str | None = None,
    distro_key: str | None = None,
) -> dict[str, Any]:
    """The decisions for a host: its oldest GPU's, and a driver for all of them.

    ``gpus`` are detect's GPUs (objects or their dicts); none gives the cpu profile.
    """
    archs = _rows(gpus)
    driver = select_driver(gpus, requested_branch, requested_flavour, distro_key)
    if archs:
        # The table only loosens with generation (tested), so the oldest GPU
        # is the most restrictive for every decision.
        arch, row, cc = min(
            ((a, r, c or r.cc) for a, r, c in archs),
            key=lambda x: (x[1].order, detect.cc_tuple(x[2])),
        )
        ccs = sorted({c or r.cc for _, r, c in archs}, key=detect.cc_tuple)
        name = f"{arch}-{cc}"
    else:
        arch, row, ccs, cc, name = "cpu", PROFILES["cpu"], [], None, "cpu"
    torch = torch_info(ccs)
    return {
        "name": name,
        "architecture": arch,
        "architectures": list(
            dict.fromkeys(a for a, _, _ in sorted(archs, key=lambda a: a[1].order))
        ),
        "compute_capability": cc,
        "compute_capability_tuple": list(detect.cc_tuple(cc)) if cc else None,
        "compute_capabilities": ccs,
        "device": row.device,
        "gpu_count": len(archs),
        "driver": driver,
        "torch": torch,
        "compute_dtype": row.compute_dtype,
        "attn_implementation": row.attn_implementation,
        "attn_fallback": row.attn_fallback,
        "rollout": row.rollout,
        "torch_compile": row.torch_compile,
        "flash_attn_allowed": row.flash_attn_allowed,
        "vllm_allowed": row.vllm_allowed,
        "hydra_overrides": hydra_overrides(row),
        "rollout_environment": rollout_environment(row),
        # The Python lock the host takes besides the variant's (python_env reads it).
        "python_lock": "vllm" if row.rollout == "vllm" else None,
        "patch_options": {
            "compute_dtype": row.compute_dtype,
            "attn_implementation": row.attn_implementation,
            "device": row.device,
        },
        "notes": _notes(archs, row, driver, torch),
    }


def profile_for_arch(
    arch: str,
    cc: str | None = None,
    requested_branch: int | None = None,
    requested_flavour: str | None = None,
    distro_key: str | None = None,
) -> dict[str, Any]:
    """The profile of one GPU of ``arch`` (``cpu`` for none)."""
    if arch not in PROFILES:
        raise EngineError("unknown-architecture", f"{arch!r} is not one of {sorted(PROFILES)}")
    if cc:
        # "pascal-abc" or "pascal-9.9" would otherwise plan for a card that does not exist.
        try:
            cc_arch = detect.arch_for_cc(cc)
        except ValueError as exc:
            raise EngineError("bad-compute-capability", f"profile {arch}-{cc}: {exc}") from exc
        if cc_arch != arch:
            raise EngineError(
                "profile-cc-mismatch",
                f"profile {arch}-{cc}: compute capability {cc} is "
                f"{'no known GPU' if cc_arch is None else 'a ' + cc_arch + ' GPU'}'s, "
                f"not a {arch} one",
            )
        cc = "{}.{}".format(*detect.cc_tuple(cc))
    if arch == "cpu":
        return profile_for_gpus([], requested_branch, requested_flavour, distro_key)
    gpu = {"architecture": arch, "compute_capability": cc or PROFILES[arch].cc}
    return profile_for_gpus([gpu], requested_branch, requested_flavour, distro_key)


def profile_for_cc(
    cc: str,
    requested_branch: int | None = None,
    requested_flavour: str | None = None,
    distro_key: str | None = None,
) -> dict[str, Any]:
    """The profile of one GPU of compute capability ``cc`` ("6.1")."""
    try:
        arch = detect.arch_for_cc(cc)
    except ValueError as exc:
        raise EngineError("bad-compute-capability", str(exc)) from exc
    if arch is None:
        raise EngineError("unknown-compute-capability", f"no known architecture has CC {cc}")
    major, minor = detect.cc_tuple(cc)
    return profile_for_arch(
        arch, f"{major}.{minor}", requested_branch, requested_flavour, distro_key
    )


# -- CLI --------------------------------------------------------------------------


def _text(p: Mapping[str, Any]) -> str:
    d, t = p["driver"], p["torch"]
    gpus = "+".join(p["architectures"]) or "no GPU"
    lines = [
        f"profile {p['name']} ({gpus}, {p['gpu_count']} GPU(s), device {p['device']})",
        f"driver: {d['selected']} {d['flavour']} (supported: {d['branches']}, "
        f"default {d['default']}{'' if d['required'] else ', not required'})",
        f"torch: {t['version']}+{t['variant']} kernels {t['kernels'] or '-'}",
        f"dtype {p['compute_dtype']}, attention {p['attn_implementation']} "
        f"(fallback {p['attn_fallback']}), rollout {p['rollout']}, "
        f"torch.compile {'on' if p['torch_compile'] else 'off'}",
        f"flash-attn {'allowed' if p['flash_attn_allowed'] else 'not allowed'}, "
        f"vLLM {'allowed' if p['vllm_allowed'] else 'not allowed'}",
        "hydra overrides:",
        *(f"  {o}" for o in p["hydra_overrides"]),
        *(f"note: {n}" for n in p["notes"]),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Result:
    branch, flavour, key = args.driver_branch, args.driver_flavour, args.distro
    if args.arch:
        prof = profile_for_arch(args.arch, None, branch, flavour, key)
    elif args.cc:
        prof = profile_for_cc(args.cc, branch, flavour, key)
    else:
        report = detect.detect_from_args(args)
        prof = profile_for_gpus(report["gpus"], branch, flavour, key)
    return Result(payload=prof, text=_text(prof))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "what this host's GPUs need (driver, torch, dtype, attention, overrides)"
    parser = subcommand.add(
        subparsers, common, "profile", run, __doc__, help=summary, whole_doc=True
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--arch", choices=sorted(PROFILES), help="profile of this architecture")
    source.add_argument("--cc", metavar="X.Y", help="profile of this compute capability")
    source.add_argument(
        "--gpus-from-detect",
        action="store_true",
        help="profile of the GPUs detect finds (the default)",
    )
    parser.add_argument("--driver-branch", type=int, metavar="N", help="driver branch wanted")
    parser.add_argument("--driver-flavour", choices=FLAVOURS, help="kernel-module flavour wanted")
    parser.add_argument(
        "--distro",
        choices=sorted(distro.RELEASES),
        help="only the driver branches this Debian release packages (oldgpu distro)",
    )
    detect.add_source_args(parser)
