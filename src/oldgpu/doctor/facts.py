"""The doctor's facts: what ``evaluate`` judges, gathered from the host, the venv and verl.

``gather_facts`` asks the host (detect, the loaded driver's version, /proc/meminfo),
the venv (``PROBE_SOURCE``, run with the venv's interpreter, so the engine itself
imports no torch) and the patcher (``oldgpu patch DIR --check``); the result is a
plain dict that can be recorded and judged later (``oldgpu doctor --facts FILE``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import oldgpu
from oldgpu import detect, driver, topology
from oldgpu.doctor.common import resolve_profile
from oldgpu.output import EngineError

PROC_DRIVER_VERSION = driver.PROC_VERSION
PROC_MEMINFO = "/proc/meminfo"
PROBE_TIMEOUT_S = 300
PATCH_CHECK_TIMEOUT_S = 300
# The patcher's record in a patched tree (oldgpu.patch.MANIFEST_NAME; read as
# plain JSON here so the doctor asks the patcher only through its CLI).
PATCH_MANIFEST = ".oldgpu-patch.json"
ENV_KEYS = ("OLDGPU_COMPUTE_DTYPE", "OLDGPU_ATTN_IMPLEMENTATION", "CUDA_VISIBLE_DEVICES")

# -- the probe: runs inside the venv, standard library plus whatever it finds --

PROBE_MARK = "OLDGPU-PROBE "
PROBE_SOURCE = r"""
import importlib.metadata as md, importlib.util, json, platform, re, sys, warnings

if sys.path and sys.path[0] == "":  # -c puts the caller's directory first: not the venv's
    del sys.path[0]

out = {"python": platform.python_version(), "executable": sys.executable,
       "machine": platform.machine(), "system": platform.system()}

def dist(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return None

def where(name):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    return spec.origin or (locations[0] if locations else "")

out["distributions"] = {
    "torch": dist("torch"), "triton": dist("triton"),
    "pytorch-triton": dist("pytorch-triton", "pytorch_triton"),
    "triton-pascal": dist("triton-pascal", "triton_pascal"),
    "flash-attn": dist("flash-attn", "flash_attn"),
    "nvidia-ml-py": dist("nvidia-ml-py", "nvidia_ml_py"), "pynvml": dist("pynvml"),
    "verl": dist("verl"), "vllm": dist("vllm"),
}
out["modules"] = {name: where(name) for name in ("flash_attn", "pynvml", "verl")}
try:
    requires = md.requires("torch") or []
except md.PackageNotFoundError:
    requires = []
out["torch_requires_triton"] = [
    r for r in requires if re.match(r"\s*(triton|pytorch[-_]triton)\b", r, re.I)
]

t = {"importable": False}
try:
    import torch
except Exception as exc:
    t["error"] = "%s: %s" % (type(exc).__name__, exc)
else:
    t.update(importable=True, version=torch.__version__, cuda=torch.version.cuda,
             file=torch.__file__, devices=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t["cuda_available"] = bool(torch.cuda.is_available())
        except Exception as exc:
            t["cuda_available"] = False
            t["cuda_error"] = "%s: %s" % (type(exc).__name__, exc)
        if t["cuda_available"]:
            t["arch_list"] = list(torch.cuda.get_arch_list())
            t["arch_list_source"] = "torch.cuda.get_arch_list()"
        else:
            # get_arch_list() is [] without a device; the build's flags are not.
            flags = getattr(torch._C, "_cuda_getArchFlags", None)
            t["arch_list"] = (flags() or "").split() if flags else []
            t["arch_list_source"] = "torch._C._cuda_getArchFlags()"
        t["device_count"] = torch.cuda.device_count() if t["cuda_available"] else 0
        for i in range(t["device_count"]):
            d = {"index": i}
            try:
                p = torch.cuda.get_device_properties(i)
                d.update(name=p.name, capability="%d.%d" % (p.major, p.minor),
                         total_mib=p.total_memory // 2**20)
                free, total = torch.cuda.mem_get_info(i)
                d.update(free_mib=free // 2**20, total_mib=total // 2**20)
            except Exception as exc:
                d["error"] = "%s: %s" % (type(exc).__name__, exc)
            try:
                x = torch.ones(8, device="cuda:%d" % i)
                d["kernel_ok"] = float((x + x).sum().item()) == 16.0
            except Exception as exc:
                d["kernel_ok"] = False
                d["kernel_error"] = "%s: %s" % (type(exc).__name__, exc)
            t["devices"].append(d)
        try:
            t["bf16_supported"] = (
                bool(torch.cuda.is_bf16_supported()) if t["device_count"] else None
            )
        except Exception:
            t["bf16_supported"] = None
    t["warnings"] = [str(w.message) for w in caught][:10]
out["torch"] = t
print("OLDGPU-PROBE " + json.dumps(out))
"""


def run_probe(python: str, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The probe's facts from ``python``, or ``{"error": ...}`` when it cannot run."""
    try:
        proc = subprocess.run(
            [python, "-c", PROBE_SOURCE],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        return {"python": python, "error": f"{python}: no such interpreter"}
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"python": python, "error": f"{python}: {exc}"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(PROBE_MARK):
            try:
                facts = json.loads(line[len(PROBE_MARK) :])
            except json.JSONDecodeError:
                break
            facts["python"] = python
            return facts
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {
        "python": python,
        "error": f"{python}: the probe exited {proc.returncode}: {' | '.join(tail)}",
    }


# -- host facts -----------------------------------------------------------------


def parse_meminfo(text: str) -> dict[str, int | None]:
    values = {}
    for line in text.splitlines():
        match = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if match:
            values[match.group(1)] = int(match.group(2)) // 1024
    return {
        "mem_available_mib": values.get("MemAvailable"),
        "mem_total_mib": values.get("MemTotal"),
    }


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def kernel_facts() -> dict[str, Any] | None:
    """Each installed kernel and whether the nvidia module is built for it (``oldgpu driver``'s
    answer); None where dpkg is not there to say what is installed."""
    try:
        inputs = driver.from_host()
        return driver.report(inputs)["kernels"] if inputs.dpkg is not None else None
    except EngineError as exc:
        return {"installed": [], "error": exc.name}


def driver_facts(report: Mapping[str, Any], proc_text: str | None) -> dict[str, Any]:
    """The loaded driver's version: nvidia-smi's, else the kernel module's."""
    smi = next(
        (g["driver_version"] for g in report.get("gpus", []) if g.get("driver_version")), None
    )
    proc = driver.parse_proc_version(proc_text) if proc_text else None
    version, source = (smi, "nvidia-smi") if smi else (proc, PROC_DRIVER_VERSION)
    return {
        "version": version,
        "source": source if version else None,
        "nvidia_smi": report.get("sources", {}).get("nvidia-smi"),
        "proc_version": proc,
    }


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def verl_facts(verl_dir: str, profile_name: str | None, timeout: float = PATCH_CHECK_TIMEOUT_S):
    """Is ``verl_dir`` patched as its manifest says? Asked of ``oldgpu patch --check``.

    With a manifest the check runs with the manifest's options; without one,
    with the profile's (``--profile NAME``): either way exit 0 means nothing to do.
    """
    root = Path(verl_dir)
    facts: dict[str, Any] = {"dir": str(root), "manifest": None, "modified": []}
    if not root.is_dir():
        facts["error"] = {"error": "verl-dir-missing", "message": f"{root} is not a directory"}
        return facts
    argv = [sys.executable, "-m", "oldgpu", "patch", str(root), "--check", "--json"]
    manifest_path = root / PATCH_MANIFEST
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifest = None  # the patcher names what is wrong with it
        if isinstance(manifest, dict):
            options = manifest.get("options") or {}
            facts["manifest"] = {
                "options": options,
                "verl_version": manifest.get("verl_version"),
                "engine": manifest.get("engine"),
                # the patch set it carries, by name
                "patches": [
                    {"name": p.get("name")}
                    for p in manifest.get("patches") or []
                    if isinstance(p, dict)
                ],
            }
            facts["modified"] = _modified_files(root, manifest)
            if options.get("profile"):
                argv += ["--profile", str(options["profile"])]
            for key in ("compute_dtype", "attn_implementation"):
                if options.get(key):
                    argv += [f"--{key.replace('_', '-')}", str(options[key])]
    elif profile_name:
        argv += ["--profile", profile_name]
    facts["check_argv"] = argv[3:]
    env = dict(os.environ)
    src = str(Path(oldgpu.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        facts["error"] = {"error": "patch-check-failed", "message": str(exc)}
        return facts
    try:
        payload = json.loads(proc.stdout)
    except ValueError:
        payload = None
    facts["check_rc"] = proc.returncode
    if isinstance(payload, dict) and "error" in payload:
        facts["error"] = payload
    elif isinstance(payload, dict):
        facts["check"] = {
            "changed": payload.get("changed"),
            "verl_version": payload.get("verl_version"),
            "options": payload.get("options"),
            "files": [
                {"path": f.get("path"), "status": f.get("status")}
                for f in payload.get("files", [])
                if f.get("status") != "unchanged"
            ],
        }
    else:
        facts["error"] = {
            "error": "patch-check-failed",
            "message": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}",
        }
    return facts


def _modified_files(root: Path, manifest: Mapping[str, Any]) -> list[str]:
    """Files whose sha256 matches neither the original nor the patched one recorded."""
    modified = []
    for rel, rec in (manifest.get("files") or {}).items():
        if isinstance(rec, dict) and _sha256(root / rel) not in (
            rec.get("original_sha256"),
            rec.get("patched_sha256"),
        ):
            modified.append(rel)
    for rel, rec in (manifest.get("added") or {}).items():
        digest = _sha256(root / rel)
        if isinstance(rec, dict) and digest is not None and digest != rec.get("sha256"):
            modified.append(rel)
    return sorted(modified)


def topology_facts(
    report: Mapping[str, Any], detect_args: argparse.Namespace | None = None
) -> dict[str, Any] | None:
    """``oldgpu topology``'s report for a host with a driver and several GPUs, else None.

    Recorded detect input (``--nvidia-smi-file``) describes another host: its
    topology is not this one's, so none is read.
    """
    args = detect_args or argparse.Namespace()
    if getattr(args, "nvidia_smi_file", None) or getattr(args, "lspci_file", None):
        return None
    driven = [g for g in report.get("gpus", []) if g.get("index") is not None]
    if len(driven) < 2:
        return None
    try:
        return topology.report(topology.read_host(), None, topology.ib_devices())
    except EngineError as exc:
        return {"error": exc.message}


def gather_facts(
    *,
    python: str | None = None,
    verl_dir: str | None = None,
    cc: str | None = None,
    arch: str | None = None,
    detect_args: argparse.Namespace | None = None,
) -> dict[str, Any]:
    """Everything ``evaluate`` judges, from this host, the venv and the verl tree."""
    report = detect.detect_from_args(detect_args or argparse.Namespace())
    facts: dict[str, Any] = {
        "schema": 1,
        "request": {"cc": cc, "arch": arch},
        "detect": report,
        "driver": driver_facts(report, _read_text(PROC_DRIVER_VERSION)),
        "probe": run_probe(python or sys.executable),
        "host": parse_meminfo(_read_text(PROC_MEMINFO) or ""),
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "verl": None,
        "topology": topology_facts(report, detect_args),
        "kernels": kernel_facts(),
    }
    if verl_dir:
        prof, _ = resolve_profile(facts)
        facts["verl"] = verl_facts(verl_dir, prof["name"] if prof else None)
    return facts
