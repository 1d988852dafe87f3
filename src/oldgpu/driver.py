"""``oldgpu driver``: the NVIDIA driver of this host: installed, loaded, built, and its CUDA fit.

What is installed comes from ``dpkg-query`` (the kernel-module and libcuda
packages; ``modinfo`` where no package carries the module), what is loaded from
/proc/driver/nvidia/version and /proc/modules, what DKMS built from ``dkms
status`` against the kernels that have headers (/lib/modules/<kernel>/build).
From those: whether a reboot is needed to load the installed module, and how the
driver fits CUDA: at or above the pinned CUDA's minimum (pins ``cuda.min_driver``),
only through CUDA minor-version compatibility (``MINOR_COMPAT_DRIVER``), or not
at all. The roles read this JSON instead of parsing any of it themselves.

Read-only. Each source can be a recorded file instead (``--dkms-status-file``,
``--proc-version-file``, ...); given any, the host is asked for none of the others.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oldgpu import kernels, pins, subcommand
from oldgpu.output import EngineError, Result
from oldgpu.versions import compare_versions, version_tuple

PROC_VERSION = "/proc/driver/nvidia/version"
PROC_MODULES = "/proc/modules"
LIB_MODULES = "/lib/modules"
REBOOT_REQUIRED = "/var/run/reboot-required"
COMMAND_TIMEOUT_S = 120
DPKG_FORMAT = "${Package}\\t${Version}\\t${db:Status-Status}\\n"

# The oldest driver a CUDA major's runtime runs on through minor-version
# compatibility (NVIDIA's CUDA compatibility guide: no PTX JIT below the
# release's own minimum); the pinned CUDA's own minimum is pins cuda.min_driver.
MINOR_COMPAT_DRIVER = {11: "450.80.02", 12: "525.60.13"}
# Each CUDA release's own minimum driver (its release notes' table, Linux) for the
# CUDAs the project runs besides the pinned one: 12.4 is what the default index's
# torch 2.6.0, and so vLLM 0.8.5's wheels, are built with (pins vllm.cuda). The 535
# branch runs it only through minor-version compatibility; 550 and newer fully.
CUDA_MIN_DRIVER = {"12.4": "550.54.14"}

# Packages that carry the kernel module: Debian's nvidia-kernel-dkms,
# nvidia-tesla-470-kernel-dkms, nvidia-open-kernel-dkms; Ubuntu's and NVIDIA's
# nvidia-dkms-<branch>(-server)(-open).
MODULE_PACKAGE_RE = re.compile(
    r"^(nvidia(-tesla-[0-9]+)?(-open)?-kernel-dkms|nvidia-dkms-[0-9]+(-server)?(-open)?)$"
)
# Packages that carry the driver's libcuda: Debian's libcuda1 and
# libnvidia-tesla-470-cuda1, Ubuntu's libnvidia-compute-<branch>(-server).
LIBCUDA_PACKAGE_RE = re.compile(
    r"^(libcuda1|libnvidia-tesla-[0-9]+-cuda1|libnvidia-compute-[0-9]+(-server)?)$"
)
# dpkg states in which the package's files are not on disk.
ABSENT_STATES = ("not-installed", "config-files")

# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  ..." and the open
# modules' "NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  ...".
PROC_VERSION_RE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
PROC_MODULES_RE = re.compile(r"^(\S+) \d+ (?:\d+|-) ")
# `dkms status`, dkms 3: "nvidia-current/535.216.01, 6.1.0-28-amd64, x86_64: installed";
# dkms 2 (Ubuntu 20.04): "nvidia, 535.183.01, 5.4.0-150-generic, x86_64: installed";
# either: "MODULE/VERSION: added" (built for no kernel: a failed build) or ": broken",
# and notes after the state ("(Original modules exist)", "from KERNEL").
DKMS_LINE_RE = re.compile(
    r"^(?P<module>[^\s,/:]+)(?:/|,\s*)(?P<version>[^\s,:]+)"
    r"(?:,\s*(?P<kernel>[^\s,:]+),\s*(?P<arch>[^\s,:]+))?"
    r":\s*(?P<state>[A-Za-z-]+)\s*(?P<note>.*)$"
)
INSTALLED_STATES = ("installed", "installed-weak")
NO_JIT = "no PTX JIT, so every kernel needs SASS built for the card"


# -- parsing what the host says (pure) ------------------------------------------


def parse_proc_version(text: str) -> str | None:
    """The loaded module's version in /proc/driver/nvidia/version, or None."""
    match = PROC_VERSION_RE.search(text)
    return match.group(1) if match else None


def parse_proc_modules(text: str) -> list[str] | None:
    """The module names /proc/modules lists; None when no line looks like its lines."""
    names = [m.group(1) for m in map(PROC_MODULES_RE.match, text.splitlines()) if m]
    return names if names or not text.strip() else None


def upstream_version(version: str) -> str | None:
    """The driver's own version in a package version: ``1:535.216.01-1~deb12u1`` -> 535.216.01."""
    match = re.match(r"(?:\d+:)?(\d+(?:\.\d+)+)", version.strip())
    return match.group(1) if match else None


def parse_dpkg(text: str) -> list[dict[str, Any]] | None:
    """The driver packages in ``dpkg-query -W -f DPKG_FORMAT``; None when no line parses."""
    packages, parsed = [], 0
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) != 3 or not re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", fields[0]):
            continue
        parsed += 1
        name, version, status = fields
        if MODULE_PACKAGE_RE.match(name):
            kind = "kernel-module"
        elif LIBCUDA_PACKAGE_RE.match(name):
            kind = "libcuda"
        else:
            continue
        upstream = upstream_version(version)
        packages.append(
            {
                "name": name,
                "version": version,
                "upstream": upstream,
                "branch": version_tuple(upstream)[0] if upstream else None,
                "flavour": ("open" if "-open" in name else "proprietary")
                if kind == "kernel-module"
                else None,
                "kind": kind,
                "status": status,
            }
        )
    return packages if parsed or not text.strip() else None


def parse_dkms_status(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """``dkms status``'s lines as entries, and the lines that are not entries."""
    entries, unparsed = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        match = DKMS_LINE_RE.match(line.strip())
        if match:
            entries.append(match.groupdict())
        else:
            unparsed.append(line)
    return entries, unparsed


# -- judging (pure) ----------------------------------------------------------------


def installed_state(
    packages: Sequence[Mapping[str, Any]], modinfo_version: str | None = None
) -> dict[str, Any]:
    """The installed driver: its kernel-module package (the newest, if several), libcuda."""
    present = [dict(p) for p in packages if p["status"] not in ABSENT_STATES]
    modules = [p for p in present if p["kind"] == "kernel-module" and p["upstream"]]
    libcuda = [p for p in present if p["kind"] == "libcuda" and p["upstream"]]
    module = max(modules, key=lambda p: version_tuple(p["upstream"]), default=None)
    newest_libcuda = max(libcuda, key=lambda p: version_tuple(p["upstream"]), default=None)
    version = module["upstream"] if module else modinfo_version
    return {
        "packages": present,
        "module_package": module["name"] if module else None,
        "version": version,
        "branch": version_tuple(version)[0] if version else None,
        "branches": sorted({p["branch"] for p in modules}),
        "flavour": module["flavour"] if module else None,
        "libcuda_version": newest_libcuda["upstream"] if newest_libcuda else None,
        "from": "package" if module else ("modinfo" if modinfo_version else None),
    }


def dkms_state(
    entries: Sequence[Mapping[str, Any]], header_kernels: Sequence[str], version: str | None
) -> dict[str, Any]:
    """Per kernel, whether DKMS installed nvidia ``version`` for it; the kernels that lack it."""
    nvidia = [e for e in entries if e["module"].startswith("nvidia")]
    kernels = list(header_kernels) + sorted(
        {e["kernel"] for e in nvidia if e["kernel"]} - set(header_kernels)
    )
    per_kernel = []
    for kernel in kernels:
        mine = [e for e in nvidia if e["kernel"] == kernel]
        states = [e["state"] for e in mine if e["version"] == version]
        state = next((s for s in (*INSTALLED_STATES, "built") if s in states), None)
        per_kernel.append(
            {
                "kernel": kernel,
                "headers": kernel in header_kernels,
                "state": (state or "missing") if version else None,
                "modules": [
                    {"module": e["module"], "version": e["version"], "state": e["state"]}
                    for e in mine
                ],
            }
        )
    built_for = [k["kernel"] for k in per_kernel if k["state"] in INSTALLED_STATES]
    return {
        "version": version,
        "kernels": per_kernel,
        "built_for": built_for,
        # Nothing can be missing before a driver is installed.
        "missing": [k for k in header_kernels if k not in built_for] if version else [],
        "installed": [
            {"module": e["module"], "version": e["version"], "kernel": e["kernel"]}
            for e in nvidia
            if e["kernel"] and e["state"] in INSTALLED_STATES
        ],
        # "added": registered but built for no kernel (its builds failed); "broken": no source.
        "unbuilt": [
            {"module": e["module"], "version": e["version"], "state": e["state"]}
            for e in nvidia
            if not e["kernel"]
        ],
    }


def reboot_state(
    installed_version: str | None,
    loaded: Mapping[str, Any],
    required_file: bool = False,
    required_by: Sequence[str] = (),
) -> dict[str, Any]:
    """A reboot loads the installed module while another (or none, or nouveau) is loaded."""
    reasons = []
    if installed_version:
        if not loaded.get("version"):
            reasons.append(f"nvidia {installed_version} is installed, no NVIDIA module is loaded")
        elif loaded["version"] != installed_version:
            reasons.append(f"nvidia {loaded['version']} is loaded, {installed_version} installed")
        if loaded.get("nouveau"):
            reasons.append("nouveau is loaded")
    driver = bool(reasons)
    if required_file:
        by = f" (by {', '.join(required_by)})" if required_by else ""
        reasons.append(f"{REBOOT_REQUIRED} asks for one{by}")
    return {
        "needed": driver or required_file,
        "driver": driver,
        "reasons": reasons,
        "required_file": required_file,
        "required_by": list(required_by),
    }


def minor_compat_floor(cuda: str) -> str | None:
    """The oldest driver that runs ``cuda`` through minor-version compatibility, if known."""
    major = version_tuple(cuda)[:1]
    return MINOR_COMPAT_DRIVER.get(major[0]) if major else None


def cuda_fit(
    driver: str | None, cuda: str | None = None, source: str | None = None
) -> dict[str, Any]:
    """How ``driver`` fits ``cuda`` (default: the pinned CUDA).

    ``fit``: ``ok`` (at or above the pinned CUDA's minimum), ``compat`` (runs it
    only through minor-version compatibility: no PTX JIT), ``too-old`` (below even
    that), ``unknown`` (neither minimum is known for this CUDA), ``none`` (no driver).
    """
    pinned = str(pins.get("cuda.version"))
    cuda = cuda or pinned
    is_pinned = version_tuple(cuda)[:2] == version_tuple(pinned)[:2]
    floor = minor_compat_floor(cuda)
    minor = ".".join(map(str, version_tuple(cuda)[:2]))
    minimum = str(pins.get("cuda.min_driver")) if is_pinned else CUDA_MIN_DRIVER.get(minor)
    if not driver:
        fit = "none"
    elif minimum and compare_versions(driver, minimum) >= 0:
        fit = "ok"
    elif floor and compare_versions(driver, floor) < 0:
        fit = "too-old"
    else:
        fit = "compat" if floor else "unknown"
    return {
        "version": cuda,
        "pinned": pinned,
        "is_pinned": is_pinned,
        "min_driver": minimum,
        "minor_compat_driver": floor,
        "driver": driver or None,
        "driver_source": source if driver else None,
        "fit": fit,
        "message": _fit_message(fit, f"driver {driver} ({source})", cuda, minimum, floor),
    }


def _fit_message(fit: str, drv: str, cuda: str, minimum: str | None, floor: str | None) -> str:
    compat = f"CUDA minor-version compatibility (driver >= {floor})"
    cannot = f"WARNING: {drv} cannot run CUDA {cuda} programs"
    if fit == "none":
        need = minimum or floor
        return f"no NVIDIA driver is installed: CUDA {cuda} programs need a driver" + (
            f" >= {need} to run" if need else " to run"
        )
    if fit == "ok":
        return f"{drv} meets CUDA {cuda}'s minimum {minimum}"
    if fit == "compat":
        head = (
            f"WARNING: {drv} is older than CUDA {cuda}'s minimum {minimum}; "
            f"CUDA {cuda} programs run on it"
            if minimum
            else f"WARNING: CUDA {cuda} programs run on {drv}"
        )
        return f"{head} only through {compat}: {NO_JIT}"
    if fit == "too-old":
        needs = f">= {minimum}, or >= {floor} through" if minimum else f">= {floor} through"
        return f"{cannot} (needs {needs} minor-version compatibility)"
    if minimum:
        return f"WARNING: {drv} is older than CUDA {cuda}'s minimum {minimum}"
    return f"{drv}: what CUDA {cuda} needs is not known here"


# -- what the host says --------------------------------------------------------------


@dataclass
class Inputs:
    """The host's answers as text (None: not available), and where each came from."""

    dpkg: str | None = None
    proc_version: str | None = None
    proc_modules: str | None = None
    dkms_status: str | None = None
    header_kernels: list[str] = field(default_factory=list)
    modinfo_version: str | None = None
    running_kernel: str | None = None
    reboot_required: bool = False
    reboot_required_by: list[str] = field(default_factory=list)
    sources: dict[str, str | None] = field(default_factory=dict)


def _text(data: bytes, where: str) -> str:
    """Recorded input as text; a binary or non-UTF-8 file is a named error."""
    if b"\0" in data:
        raise EngineError("driver-input-not-text", f"{where}: binary data (a NUL byte), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EngineError(
            "driver-input-not-text", f"{where}: not UTF-8 text (byte {exc.start})"
        ) from exc


def _read_file(path: str) -> str:
    try:
        return _text(Path(path).read_bytes(), path)
    except OSError as exc:
        raise EngineError("driver-input-unreadable", f"{path}: {exc.strerror or exc}") from exc


def _read_host(path: str) -> str | None:
    try:
        return Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def _run(argv: Sequence[str]) -> str | None:
    """A command's stdout; None when the command is not there."""
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
            env={**os.environ, "LC_ALL": "C"},
        )
    except subprocess.TimeoutExpired as exc:
        raise EngineError(
            "driver-command-timeout", f"`{' '.join(argv)}` ran over {COMMAND_TIMEOUT_S} s"
        ) from exc
    except OSError:
        return None
    return proc.stdout.decode("utf-8", errors="replace") if proc.returncode == 0 else None


def header_kernels(lib_modules: str) -> list[str]:
    """Kernels whose headers are installed: /lib/modules/<kernel>/build is a directory."""
    try:
        return sorted(p.name for p in Path(lib_modules).iterdir() if (p / "build").is_dir())
    except OSError:
        return []


def _reboot_required(path: str) -> tuple[bool, list[str]]:
    if not os.path.exists(path):
        return False, []
    pkgs = _read_host(path + ".pkgs") or ""
    return True, sorted({line.strip() for line in pkgs.splitlines() if line.strip()})


def from_host(reboot_required_file: str = REBOOT_REQUIRED) -> Inputs:
    """Ask this host (a source it lacks is None: no dpkg-query, no dkms, no module loaded)."""
    inputs = Inputs(
        dpkg=_run(["dpkg-query", "-W", "-f", DPKG_FORMAT]),
        proc_version=_read_host(PROC_VERSION),
        proc_modules=_read_host(PROC_MODULES),
        dkms_status=_run(["dkms", "status"]),
        header_kernels=header_kernels(LIB_MODULES),
        running_kernel=os.uname().release,
    )
    for attr, where in (
        ("dpkg", "dpkg-query"),
        ("proc_version", PROC_VERSION),
        ("proc_modules", PROC_MODULES),
        ("dkms_status", "dkms status"),
    ):
        inputs.sources[attr] = where if getattr(inputs, attr) is not None else None
    inputs.sources["lib_modules"] = LIB_MODULES
    packages = parse_dpkg(inputs.dpkg or "") or []
    if not any(p["kind"] == "kernel-module" for p in packages if p["status"] not in ABSENT_STATES):
        # A driver from NVIDIA's .run installer has no package: ask the module itself.
        found = (_run(["modinfo", "-F", "version", "nvidia"]) or "").strip()
        inputs.modinfo_version = found if re.fullmatch(r"\d+(\.\d+)+", found) else None
    inputs.reboot_required, inputs.reboot_required_by = _reboot_required(reboot_required_file)
    return inputs


RECORDED = {
    "dpkg_file": "dpkg",
    "proc_version_file": "proc_version",
    "modules_file": "proc_modules",
    "dkms_status_file": "dkms_status",
}


def from_args(args: argparse.Namespace) -> Inputs:
    """Recorded files when any is given (the host is then asked for nothing), else the host."""
    given = {key: getattr(args, key, None) for key in (*RECORDED, "lib_modules_dir")}
    reboot_file = getattr(args, "reboot_required_file", None)
    if not any(given.values()) and reboot_file is None:
        return from_host()
    inputs = Inputs()
    for key, attr in RECORDED.items():
        if given[key]:
            setattr(inputs, attr, _read_file(given[key]))
            inputs.sources[attr] = given[key]
    if given["lib_modules_dir"]:
        if not os.path.isdir(given["lib_modules_dir"]):
            raise EngineError(
                "lib-modules-missing", f"{given['lib_modules_dir']} is not a directory"
            )
        inputs.header_kernels = header_kernels(given["lib_modules_dir"])
        inputs.sources["lib_modules"] = given["lib_modules_dir"]
    if reboot_file:
        inputs.reboot_required, inputs.reboot_required_by = _reboot_required(reboot_file)
    inputs.running_kernel = getattr(args, "running_kernel", None)
    return inputs


# -- the answer ------------------------------------------------------------------------


def loaded_state(inputs: Inputs) -> dict[str, Any]:
    """The loaded NVIDIA module's version, the NVIDIA modules loaded, and nouveau."""
    version = None
    if inputs.proc_version is not None and inputs.proc_version.strip():
        version = parse_proc_version(inputs.proc_version)
        if version is None:
            raise EngineError(
                "proc-version-unparsable",
                f"{inputs.sources.get('proc_version')}: no 'Kernel Module <version>' in it",
            )
    modules = None
    if inputs.proc_modules is not None:
        modules = parse_proc_modules(inputs.proc_modules)
        if modules is None:
            raise EngineError(
                "proc-modules-unparsable",
                f"{inputs.sources.get('proc_modules')}: no line is 'NAME SIZE USERS ...'",
            )
    return {
        "version": version,
        "module": ("nvidia" in modules) if modules is not None else (True if version else None),
        "modules": [m for m in modules or [] if m == "nvidia" or m.startswith("nvidia_")],
        "nouveau": ("nouveau" in modules) if modules is not None else None,
    }


def report(inputs: Inputs, cuda: str | None = None) -> dict[str, Any]:
    """The driver's state as the roles read it (``oldgpu driver --json``)."""
    packages: list[dict[str, Any]] = []
    if inputs.dpkg is not None:
        parsed = parse_dpkg(inputs.dpkg)
        if parsed is None:
            raise EngineError(
                "dpkg-query-unparsable",
                f"{inputs.sources.get('dpkg')}: no line is 'PACKAGE<TAB>VERSION<TAB>STATUS' "
                f"(dpkg-query -W -f '{DPKG_FORMAT}')",
            )
        packages = parsed
    installed = installed_state(packages, inputs.modinfo_version)
    loaded = loaded_state(inputs)
    entries, unparsed = parse_dkms_status(inputs.dkms_status or "")
    if unparsed and not entries:
        raise EngineError(
            "dkms-status-unparsable",
            f"{inputs.sources.get('dkms_status')}: no line is 'MODULE/VERSION, KERNEL, ARCH: "
            f"STATE' (first: {unparsed[0][:120]!r})",
        )
    dkms = dkms_state(entries, inputs.header_kernels, installed["version"])
    images, metas = kernels.parse_dpkg_kernels(inputs.dpkg or "")
    dkms.update(
        available=inputs.dkms_status is not None,
        lines=(inputs.dkms_status or "").splitlines(),
        unparsed=unparsed,
    )
    if loaded["version"]:
        driver, source = loaded["version"], "loaded module"
    elif installed["libcuda_version"]:
        driver, source = installed["libcuda_version"], "installed libcuda package"
    elif installed["version"]:
        driver, source = installed["version"], f"installed kernel module ({installed['from']})"
    else:
        driver, source = None, None
    return {
        "schema": 1,
        "installed": installed,
        "loaded": loaded,
        "dkms": dkms,
        "kernels": kernels.state(
            images=images,
            header_kernels=inputs.header_kernels,
            dkms_kernels=dkms["kernels"],
            running=inputs.running_kernel,
            metapackages=metas,
            driver_version=installed["version"],
        ),
        "reboot": reboot_state(
            installed["version"], loaded, inputs.reboot_required, inputs.reboot_required_by
        ),
        "cuda": cuda_fit(driver, cuda, source),
        # vLLM's CUDA (the vllm rollout's hosts: volta, turing and newer profiles).
        "vllm_cuda": cuda_fit(driver, str(pins.get("vllm.cuda")), source),
        "sources": dict(inputs.sources),
    }


def render(r: Mapping[str, Any]) -> str:
    inst, loaded, dkms, reboot = r["installed"], r["loaded"], r["dkms"], r["reboot"]
    if inst["version"]:
        what = inst["module_package"] or "the nvidia module (modinfo)"
        head = f"installed: {what} {inst['version']} (branch {inst['branch']}"
        head += f", {inst['flavour']} modules)" if inst["flavour"] else ")"
    else:
        head = "installed: no NVIDIA driver"
    lines = [head, f"loaded: {loaded['version'] or 'no NVIDIA module'}"]
    if loaded["nouveau"]:
        lines[-1] += "; nouveau is loaded"
    if dkms["kernels"]:
        states = [f"{k['kernel']} {k['state'] or 'no driver'}" for k in dkms["kernels"]]
        lines.append("dkms: " + "; ".join(states))
    lines += kernels.render(r["kernels"])
    lines.append(
        "reboot: "
        + ("needed: " + "; ".join(reboot["reasons"]) if reboot["needed"] else "not needed")
    )
    lines.append("cuda: " + r["cuda"]["message"])
    return "\n".join(lines)


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "the NVIDIA driver: installed, loaded, built by DKMS per kernel, reboot, CUDA fit"
    parser = subcommand.add(subparsers, common, "driver", run, __doc__, help=summary)
    recorded = parser.add_argument_group("recorded inputs (given any, the host is not asked)")
    recorded.add_argument(
        "--dpkg-file", metavar="FILE", help=f"output of dpkg-query -W -f '{DPKG_FORMAT}'"
    )
    recorded.add_argument("--proc-version-file", metavar="FILE", help=f"a copy of {PROC_VERSION}")
    recorded.add_argument("--modules-file", metavar="FILE", help=f"a copy of {PROC_MODULES}")
    recorded.add_argument("--dkms-status-file", metavar="FILE", help="output of `dkms status`")
    recorded.add_argument(
        "--lib-modules-dir",
        metavar="DIR",
        help=f"where each kernel with headers has KERNEL/build (host: {LIB_MODULES})",
    )
    recorded.add_argument("--running-kernel", metavar="RELEASE", help="host: uname -r")
    recorded.add_argument(
        "--reboot-required-file", metavar="FILE", help=f"the flag file (host: {REBOOT_REQUIRED})"
    )
    parser.add_argument(
        "--cuda", metavar="X.Y", help="judge the fit for this CUDA (default: the pinned one)"
    )


def run(args: argparse.Namespace) -> Result:
    if args.cuda is not None and not re.fullmatch(r"\d+\.\d+", args.cuda):
        raise EngineError("cuda-version-invalid", f"--cuda {args.cuda!r}: want MAJOR.MINOR")
    r = report(from_args(args), args.cuda)
    return Result(r, render(r))
