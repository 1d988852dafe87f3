"""``oldgpu doctor``: is this host ready to train verl, and if not, what to do.

Facts first, judgement second: ``gather_facts`` asks the host (detect, the
driver's version, /proc/meminfo), the venv (a probe script run with the venv's
interpreter, so the engine itself imports no torch) and the patcher (``oldgpu
patch DIR --check``); ``evaluate`` turns a facts dict into checks and nothing
else, so tests feed it recorded facts. ``explain`` maps known error messages
(the seed article's and the ones verl meets on old GPUs) to a check and a fix.

Exit status: 0 when no check fails, ``DOCTOR_FAILED`` (3) when one does; the
start script and the systemd unit's RestartPreventExitStatus use it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import oldgpu
from oldgpu import detect, pins, profile
from oldgpu.output import EngineError, Result

DOCTOR_FAILED = 3
EXPLAIN_UNKNOWN = 1  # ``--explain`` with a message the table does not know

DEFAULT_MIN_FREE_GPU_MIB = 1024
DEFAULT_MIN_FREE_HOST_MIB = 2048

CHECK_IDS = (
    "driver",
    "gpu-capability",
    "torch-build",
    "triton",
    "flash-attn",
    "verl-patch",
    "gpu-memory",
    "host-memory",
    "bf16",
)
STATUSES = ("skip", "ok", "warn", "fail")  # in rising severity
MARKERS = {"ok": "✓", "warn": "!", "fail": "✗", "skip": "-"}

PROC_DRIVER_VERSION = "/proc/driver/nvidia/version"
PROC_MEMINFO = "/proc/meminfo"
PROBE_TIMEOUT_S = 300
PATCH_CHECK_TIMEOUT_S = 300
# The patcher's record in a patched tree (oldgpu.patch.MANIFEST_NAME; read as
# plain JSON here so the doctor asks the patcher only through its CLI).
PATCH_MANIFEST = ".oldgpu-patch.json"
ENV_KEYS = ("OLDGPU_COMPUTE_DTYPE", "OLDGPU_ATTN_IMPLEMENTATION", "CUDA_VISIBLE_DEVICES")

# The oldest driver a CUDA major's runtime runs on through minor-version
# compatibility (NVIDIA's CUDA compatibility guide); the pinned CUDA's full
# minimum is pins cuda.min_driver.
MINOR_COMPAT_DRIVER = {11: "450.80.02", 12: "525.60.13"}

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
    "verl": dist("verl"),
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


# -- host facts ----------------------------------------------------------------


def parse_proc_driver_version(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version (``... Kernel Module  535.183.01 ...``)."""
    match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return match.group(1) if match else None


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


def driver_facts(report: Mapping[str, Any], proc_text: str | None) -> dict[str, Any]:
    """The loaded driver's version: nvidia-smi's, else the kernel module's."""
    smi = next(
        (g["driver_version"] for g in report.get("gpus", []) if g.get("driver_version")), None
    )
    proc = parse_proc_driver_version(proc_text) if proc_text else None
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
    }
    if verl_dir:
        prof, _ = resolve_profile(facts)
        facts["verl"] = verl_facts(verl_dir, prof["name"] if prof else None)
    return facts


# -- judging the facts (pure) ---------------------------------------------------


class _Check:
    """Findings of one check: the worst status wins; fixes of warn/fail findings kept."""

    def __init__(self, check_id: str) -> None:
        self.id = check_id
        self.items: list[tuple[str, str, str]] = []
        self.details: dict[str, Any] = {}

    def add(self, status: str, seen: str, fix: str = "") -> _Check:
        self.items.append((status, seen, fix))
        return self

    def result(self) -> dict[str, Any]:
        items = self.items or [("skip", "nothing to check", "")]
        status = max((s for s, _, _ in items), key=STATUSES.index)
        fixes = dict.fromkeys(f for s, _, f in items if f and s in ("warn", "fail"))
        return {
            "id": self.id,
            "status": status,
            "seen": "; ".join(seen for _, seen, _ in items),
            "fix": "; ".join(fixes),
            "details": self.details,
        }


def _vtuple(version: str) -> tuple[int, ...]:
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def _vcmp(a: str, b: str) -> int:
    ta, tb = _vtuple(a), _vtuple(b)
    n = max(len(ta), len(tb))
    ta, tb = ta + (0,) * (n - len(ta)), tb + (0,) * (n - len(tb))
    return (ta > tb) - (ta < tb)


def satisfies(version: str, specifier: str) -> bool:
    """``version`` against a PEP 440-ish specifier (``==3.2.0``, ``>=3.1,<3.3``, ``==3.*``)."""
    public = str(version).split("+", 1)[0]
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        match = re.fullmatch(r"(===|==|!=|~=|>=|<=|>|<)\s*(\S+)", clause)
        if not match:
            return False
        op, want = match.groups()
        if op in ("==", "!=") and want.endswith(".*"):
            prefix = _vtuple(want[:-2])
            same = _vtuple(public)[: len(prefix)] == prefix
            if same != (op == "=="):
                return False
            continue
        if op == "===":
            if str(version) != want:
                return False
            continue
        c = _vcmp(public, want.split("+", 1)[0])
        ok = {
            "==": c == 0 and ("+" not in want or str(version) == want),
            "!=": c != 0,
            ">=": c >= 0,
            "<=": c <= 0,
            ">": c > 0,
            "<": c < 0,
            "~=": c >= 0 and _vtuple(public)[: len(_vtuple(want)) - 1] == _vtuple(want)[:-1],
        }[op]
        if not ok:
            return False
    return True


def parse_requirement(text: str) -> dict[str, str]:
    """``triton (==3.2.0) ; platform_system == "Linux"`` -> name, specifier, marker."""
    req, _, marker = text.partition(";")
    match = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[[^\]]*\])?\s*\(?\s*([^)]*?)\s*\)?\s*$", req)
    name, spec = (match.group(1), match.group(2)) if match else (req.strip(), "")
    return {"name": name.lower().replace("_", "-"), "specifier": spec, "marker": marker.strip()}


def _marker_applies(marker: str, probe: Mapping[str, Any]) -> bool:
    """The ``platform_system``/``platform_machine`` terms of an ``and``-only marker."""
    if not marker or " or " in marker:
        return True
    seen = {"platform_system": probe.get("system"), "platform_machine": probe.get("machine")}
    for key, want in re.findall(
        r"(platform_system|platform_machine)\s*==\s*['\"]([^'\"]+)", marker
    ):
        if seen.get(key) and seen[key] != want:
            return False
    return True


def arch_entries(arch_list: Sequence[str]) -> tuple[list[str], list[tuple[int, int]]]:
    """torch's ``sm_61``/``compute_90`` entries as SASS ``"6.1"`` strings and PTX tuples."""
    sass: list[str] = []
    ptx: list[tuple[int, int]] = []
    for entry in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", entry.strip())
        if not match:
            continue
        kind, digits, suffix = match.groups()
        major, minor = int(digits[:-1] or 0), int(digits[-1])
        if kind == "sm":
            sass.append(f"{major}.{minor}")
        elif not suffix:  # compute_90a PTX is not forward compatible
            ptx.append((major, minor))
    return sass, ptx


def kernel_coverage(cc: str, arch_list: Sequence[str]) -> dict[str, Any] | None:
    """What code of a torch build runs on ``cc``: SASS (profile.torch_kernels), else PTX."""
    sass, ptx = arch_entries(arch_list)
    sm = profile.torch_kernels(cc, sass)
    if sm:
        return {"kind": "sass", "code": sm}
    want = detect.cc_tuple(cc)
    usable = [p for p in ptx if p <= want]
    if usable:
        best = max(usable)
        return {"kind": "ptx", "code": f"compute_{best[0]}{best[1]}"}
    return None


def resolve_profile(facts: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The profile the checks judge against, or None and why not."""
    request = facts.get("request") or {}
    try:
        if request.get("arch"):
            return profile.profile_for_arch(request["arch"]), None
        if request.get("cc"):
            return profile.profile_for_cc(request["cc"]), None
        return profile.profile_for_gpus((facts.get("detect") or {}).get("gpus", [])), None
    except EngineError as exc:
        return None, str(exc)


def _gpus(facts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """detect's GPUs; torch's devices when detect found none."""
    found = list((facts.get("detect") or {}).get("gpus", []))
    if found:
        return found
    out = []
    for d in _torch(facts).get("devices") or []:
        cc = d.get("capability")
        out.append(
            {
                "index": d.get("index"),
                "name": d.get("name"),
                "compute_capability": cc,
                "architecture": detect.arch_for_cc(cc) if cc else None,
                "source": "torch",
            }
        )
    return out


def _probe(facts: Mapping[str, Any]) -> dict[str, Any]:
    return facts.get("probe") or {"error": "no probe facts"}


def _torch(facts: Mapping[str, Any]) -> dict[str, Any]:
    return _probe(facts).get("torch") or {}


def _gpu_label(g: Mapping[str, Any]) -> str:
    index = "-" if g.get("index") is None else g["index"]
    return f"GPU {index} {g.get('name') or '?'}"


def _min_cc(ccs: Sequence[str]) -> str | None:
    return min(ccs, key=detect.cc_tuple) if ccs else None


def _ccs(gpus: Sequence[Mapping[str, Any]]) -> list[str]:
    return [g["compute_capability"] for g in gpus if g.get("compute_capability")]


def _expects_gpu(prof: Mapping[str, Any] | None, gpus: Sequence[Any]) -> bool:
    return prof["device"] == "cuda" if prof else bool(gpus)


def _driver_fix(prof: Mapping[str, Any] | None) -> str:
    if prof and prof["driver"]["required"]:
        d = prof["driver"]
        return (
            f"install NVIDIA driver branch {d['selected']} ({d['flavour']} kernel modules; "
            f"this host's GPUs take {d['branches']}) with the nvidia_driver role, then reboot"
        )
    return "install the NVIDIA driver branch `oldgpu profile` selects (nvidia_driver role)"


def check_driver(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = _Check("driver")
    gpus = list((facts.get("detect") or {}).get("gpus", []))
    drv = facts.get("driver") or {}
    version = drv.get("version")
    c.details = {"version": version, "source": drv.get("source")}
    if not _expects_gpu(prof, gpus):
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

    t = _torch(facts)
    cuda = t.get("cuda") or pins.get("cuda.version")
    pinned_cuda = pins.get("cuda.version")
    full = pins.get("cuda.min_driver")
    major = _vtuple(cuda)[0] if _vtuple(cuda) else None
    floor = MINOR_COMPAT_DRIVER.get(major)
    c.details.update(cuda=cuda, min_driver=full, minor_compat_driver=floor)
    if _vtuple(cuda)[:2] == _vtuple(pinned_cuda)[:2] and _vcmp(version, full) >= 0:
        c.add("ok", f"driver {version} ({drv.get('source')}) >= {full}, CUDA {cuda}'s minimum")
    elif floor and _vcmp(version, floor) < 0:
        c.add(
            "fail",
            f"driver {version} is too old for torch's CUDA {cuda}: it needs >= {floor} even "
            "with CUDA minor-version compatibility",
            _driver_fix(prof) + f" (CUDA {pinned_cuda} wants >= {full})",
        )
    elif _vtuple(cuda)[:2] == _vtuple(pinned_cuda)[:2]:
        c.add(
            "warn",
            f"driver {version} is older than {full}, CUDA {cuda}'s minimum: torch runs only "
            "through CUDA minor-version compatibility (no PTX JIT)",
            _driver_fix(prof) + f" (>= {full})",
        )
    elif floor:
        c.add(
            "ok",
            f"driver {version} >= {floor}, enough for torch's CUDA {cuda} (minor-version "
            f"compatibility); the project's CUDA {pinned_cuda} wants >= {full}",
        )
    elif _vcmp(version, full) >= 0:
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
    c = _Check("gpu-capability")
    gpus = _gpus(facts)
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
        label = _gpu_label(g)
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
    devices = _torch(facts).get("devices") or []
    driven = [g for g in gpus if g.get("index") is not None]
    if devices and not env.get("CUDA_VISIBLE_DEVICES") and len(devices) == len(driven):
        for g, d in zip(driven, devices, strict=True):
            if d.get("capability") and g.get("compute_capability") != d["capability"]:
                c.add(
                    "warn",
                    f"{_gpu_label(g)}: detect says CC {g.get('compute_capability')}, torch "
                    f"says {d['capability']}",
                    "check pci.ids and the driver; torch's answer is the one that runs",
                )
    return c.result()


def _torch_fix() -> str:
    build = f"torch=={pins.get('torch.version')}+{pins.get('torch.variant')}"
    return (
        f"install the project's lock into the venv (python_env role): {build} from "
        f"PyTorch's {pins.get('torch.variant')} wheel index, set as python_env_torch_index_url "
        "(kernels for "
        f"sm_{pins.get('torch.cuda_arch_list')[0].replace('.', '')} and up)"
    )


def check_torch_build(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = _Check("torch-build")
    probe = _probe(facts)
    if "error" in probe:
        return c.add(
            "fail",
            f"cannot probe the venv: {probe['error']}",
            "pass --python the venv's interpreter (VENV/bin/python)",
        ).result()
    t = probe.get("torch") or {}
    if not t.get("importable"):
        return c.add(
            "fail", f"{probe.get('python')} cannot import torch: {t.get('error')}", _torch_fix()
        ).result()
    version, cuda = t.get("version"), t.get("cuda")
    arch_list = list(t.get("arch_list") or [])
    c.details = {
        "version": version,
        "cuda": cuda,
        "cuda_available": t.get("cuda_available"),
        "device_count": t.get("device_count"),
        "arch_list": arch_list,
        "kernels": {},
    }
    build = f"torch {version} (CUDA {cuda or 'none'})"
    pinned_version, variant = pins.get("torch.version"), pins.get("torch.variant")
    if str(version).split("+", 1)[0] != pinned_version:
        c.add(
            "warn",
            f"{build} is not the pinned torch {pinned_version}",
            _torch_fix() if prof and prof["device"] == "cuda" else "install the project's lock",
        )
    if prof is None or prof["device"] == "cpu":
        return c.add("ok", f"{build}: the cpu profile needs no CUDA kernels").result()
    if not cuda:
        return c.add("fail", f"{build} is a CPU-only build", _torch_fix()).result()
    if _vtuple(cuda)[:2] != _vtuple(pins.get("cuda.version"))[:2]:
        c.add(
            "warn",
            f"{build}: not the pinned +{variant} build (CUDA {pins.get('cuda.version')})",
            _torch_fix(),
        )
    ccs = list(dict.fromkeys(_ccs(_gpus(facts)) or [prof["compute_capability"]]))
    drv = facts.get("driver") or {}
    if not arch_list:
        c.add("warn", f"{build}: cannot read its kernel arch list", "")
    for cc in ccs:
        if not arch_list:
            break
        cover = kernel_coverage(cc, arch_list)
        c.details["kernels"][cc] = cover
        listed = " ".join(arch_list)
        if cover is None:
            c.add(
                "fail",
                f"{build} has no kernels for CC {cc} (built for {listed}): 'no kernel image is "
                "available for execution on the device'",
                _torch_fix() + "; cu128 and newer builds dropped Pascal",
            )
        elif cover["kind"] == "ptx":
            full = pins.get("cuda.min_driver")
            old = drv.get("version") and _vcmp(drv["version"], full) < 0
            c.add(
                "fail" if old else "warn",
                f"CC {cc} runs {build} only through {cover['code']} PTX (JIT-compiled at "
                "start-up" + (f"; driver {drv['version']} cannot JIT it" if old else "") + ")",
                _torch_fix(),
            )
        else:
            c.add("ok", f"CC {cc} runs the {cover['code']} code of {build}")
    if not t.get("cuda_available"):
        why = (
            t.get("cuda_error")
            or "; ".join(t.get("warnings") or [])
            or "torch found no usable CUDA device"
        )
        c.add(
            "fail",
            f"torch.cuda.is_available() is False ({why[:300]})",
            "load the driver (see the driver check) and check CUDA_VISIBLE_DEVICES",
        )
    for d in t.get("devices") or []:
        if d.get("kernel_ok") is False:
            c.add(
                "fail",
                f"a test kernel on cuda:{d.get('index')} failed: {d.get('kernel_error')}",
                _torch_fix(),
            )
    driven = [g for g in _gpus(facts) if g.get("index") is not None]
    count = t.get("device_count") or 0
    visible = (facts.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    if t.get("cuda_available") and count != len(driven) and visible is None:
        c.add(
            "warn",
            f"torch sees {count} device(s), detect {len(driven)}",
            "check that every GPU is driven by the loaded driver",
        )
    return c.result()


def check_triton(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = _Check("triton")
    probe = _probe(facts)
    t = probe.get("torch") or {}
    if "error" in probe or not t.get("importable"):
        return c.add("skip", "no torch in the venv (see torch-build)").result()
    dists = probe.get("distributions") or {}
    torch_version = t.get("version")
    reqs = [parse_requirement(r) for r in probe.get("torch_requires_triton") or []]
    reqs = [r for r in reqs if _marker_applies(r["marker"], probe)]
    c.details = {"installed": dists.get("triton"), "requires": reqs}
    if not reqs:
        pinned = pins.get("torch.triton")
        if str(torch_version).split("+", 1)[0] == pins.get("torch.version") and t.get("cuda"):
            reqs = [{"name": "triton", "specifier": f"=={pinned}", "marker": ""}]
        else:
            have = dists.get("triton")
            return c.add(
                "ok",
                f"torch {torch_version} requires no triton"
                + (f" (triton {have} installed)" if have else ""),
            ).result()
    for req in reqs:
        name, spec = req["name"], req["specifier"]
        have = dists.get(name)
        want = f"{name}{spec}"
        if have is None:
            c.add(
                "fail",
                f"torch {torch_version} requires {want}; it is not installed",
                f"pip install '{want}' (the project's lock has it)",
            )
        elif spec and not satisfies(have, spec):
            seen = f"{name} {have} installed; torch {torch_version} requires {want}"
            if have == "2.3.1":
                seen += " (2.3.1 is the seed article's pick: it goes with torch 2.3, not 2.6)"
            c.add("fail", seen, f"pip install '{want}' (the project's lock has it)")
        else:
            c.add("ok", f"{name} {have}, as torch {torch_version} requires ({want})")
    if prof and prof["device"] == "cuda" and not prof["torch_compile"]:
        c.add(
            "ok",
            "Triton refuses CC < 7.0: the profile keeps torch.compile, liger and fused kernels off",
        )
    if dists.get("triton-pascal"):
        c.add(
            "warn",
            f"triton-pascal {dists['triton-pascal']} is installed too: it ships the same "
            "`triton` module",
            "pip uninstall triton-pascal (the project runs no Triton kernels on Pascal)",
        )
    return c.result()


def check_flash_attn(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = _Check("flash-attn")
    probe = _probe(facts)
    if "error" in probe:
        return c.add("skip", "cannot probe the venv (see torch-build)").result()
    if prof is None:
        return c.add("skip", "no profile (see gpu-capability)").result()
    where = (probe.get("modules") or {}).get("flash_attn")
    version = (probe.get("distributions") or {}).get("flash-attn")
    present = where is not None
    c.details = {"importable": present, "origin": where, "version": version}
    label = f"flash-attn {version or '(version unknown)'} at {where}" if present else ""
    attn_env = (facts.get("env") or {}).get("OLDGPU_ATTN_IMPLEMENTATION")
    if present and not prof["flash_attn_allowed"]:
        c.add(
            "fail",
            f"{label} is importable on profile {prof['name']} (FlashAttention-2 needs CC >= 8.0)",
            "verl's log-prob path would use its Triton cross-entropy kernel; "
            "pip uninstall flash-attn",
        )
    elif present:
        c.add("ok", f"{label}; profile {prof['name']} may use it")
    elif prof["flash_attn_allowed"] and prof["attn_implementation"] == "flash_attention_2":
        c.add(
            "warn",
            f"flash-attn is not installed; profile {prof['name']} uses flash_attention_2",
            "pip install flash-attn, or patch verl with --attn-implementation sdpa",
        )
    else:
        c.add("ok", f"flash-attn not installed ({prof['attn_implementation']} attention)")
    if attn_env == "flash_attention_2" and not prof["flash_attn_allowed"]:
        c.add(
            "fail",
            "OLDGPU_ATTN_IMPLEMENTATION=flash_attention_2 is set on a GPU without FlashAttention-2",
            f"unset OLDGPU_ATTN_IMPLEMENTATION (or set it to {prof['attn_implementation']})",
        )
    return c.result()


def _patch_cmd(v: Mapping[str, Any], prof: Mapping[str, Any] | None) -> str:
    return f"oldgpu patch {v.get('dir')}" + (f" --profile {prof['name']}" if prof else "")


def check_verl_patch(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = _Check("verl-patch")
    v = facts.get("verl")
    origin = (_probe(facts).get("modules") or {}).get("verl")
    if not v:
        where = f"; the venv imports verl from {origin}" if origin else ""
        return c.add("skip", f"no --verl-dir given{where}").result()
    root = v.get("dir")
    c.details = {
        "dir": root,
        "manifest": v.get("manifest"),
        "modified": v.get("modified"),
        "check": v.get("check"),
        "error": v.get("error"),
        "imported_from": origin,
    }
    manifest = v.get("manifest")
    error = v.get("error")
    if error:
        name, message = error.get("error"), error.get("message", "")
        if name == "tree-modified":
            files = v.get("modified") or []
            what = ", ".join(files) if files else "a patched file"
            c.add(
                "fail",
                f"{root}: hand-modified since oldgpu patched it: {what}",
                f"undo the edit to {what} or start from a fresh verl copy, then run "
                + _patch_cmd(v, prof),
            )
        elif name in ("verl-dir-missing", "not-a-verl-tree"):
            c.add(
                "fail",
                f"{name}: {message}",
                "give --verl-dir the verl checkout or sdist root (the directory holding verl/)",
            )
        else:
            c.add("fail", f"{root}: {name}: {message}", f"see the message; {_patch_cmd(v, prof)}")
    elif v.get("check_rc") == 0:
        opts = (manifest or {}).get("options") or {}
        c.add(
            "ok",
            f"{root}: verl {(manifest or {}).get('verl_version')} patched as its manifest says "
            f"({opts.get('compute_dtype')}, {opts.get('attn_implementation')}, "
            f"profile {opts.get('profile')})",
        )
        if prof:
            want = prof["patch_options"]
            differ = {
                k: (opts.get(k), want[k])
                for k in ("compute_dtype", "attn_implementation", "device")
                if opts.get(k, "cuda" if k == "device" else None) != want[k]
            }
            if differ:
                what = ", ".join(f"{k} {a} (profile wants {b})" for k, (a, b) in differ.items())
                c.add(
                    "warn",
                    f"patched with other options than profile {prof['name']}: {what}",
                    f"run {_patch_cmd(v, prof)}",
                )
    else:
        files = ", ".join(f["path"] for f in (v.get("check") or {}).get("files", [])[:5])
        if manifest is None:
            c.add(
                "fail",
                f"{root}: verl {(v.get('check') or {}).get('verl_version')} is not patched",
                f"run {_patch_cmd(v, prof)}",
            )
        else:
            c.add(
                "fail",
                f"{root}: patched, but not as this engine would patch it now"
                + (f" ({files} would change)" if files else ""),
                f"run {_patch_cmd(v, prof)}",
            )
    if origin is not None and root:
        tree = os.path.dirname(os.path.dirname(origin)) if origin else ""
        if os.path.realpath(tree) != os.path.realpath(root):
            c.add(
                "warn",
                f"the venv imports verl from {origin}, not from {root}",
                f"pip install --no-deps -e {root} into the venv",
            )
    elif "error" not in _probe(facts) and root and not error:
        c.add(
            "warn", "the venv cannot import verl", f"pip install --no-deps -e {root} into the venv"
        )
    return c.result()


def check_gpu_memory(
    facts: Mapping[str, Any], prof: Mapping[str, Any] | None, min_free_mib: int
) -> dict[str, Any]:
    c = _Check("gpu-memory")
    if prof is None or prof["device"] == "cpu":
        return c.add("skip", "no device: the cpu profile").result()
    devices = [d for d in _torch(facts).get("devices") or [] if d.get("free_mib") is not None]
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
    c = _Check("host-memory")
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


def check_bf16(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = _Check("bf16")
    if prof is None:
        return c.add("skip", "no profile (see gpu-capability)").result()
    note = (
        "torch.cuda.is_bf16_supported() is not consulted (torch >= 2.3 counts emulation: "
        "True on Pascal/Volta)"
    )
    said = _torch(facts).get("bf16_supported")
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
    ccs = _ccs(_gpus(facts)) or [prof["compute_capability"]]
    low = _min_cc(ccs)
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
                    + _patch_cmd(facts.get("verl") or {"dir": "DIR"}, fixed)
                    + " and drop --cc/--arch"
                )
            c.add("fail", f"{what} computes in bf16, but the oldest GPU has CC {low} (< 8.0)", fix)
    if dtype == "bf16" and has_bf16:
        c.add("ok", f"bf16: every GPU has CC >= 8.0 (oldest {low}); {note}")
    elif dtype != "bf16":
        why = "no bf16 below CC 8.0" if not has_bf16 else "the profile asks for it"
        c.add("ok", f"{dtype}: oldest GPU CC {low}, {why}; {note}")
    return c.result()


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
        check_verl_patch(facts, prof),
        check_gpu_memory(facts, prof, min_free_gpu_mib),
        check_host_memory(facts, min_free_host_mib),
        check_bf16(facts, prof),
    ]
    counts = {s: sum(ch["status"] == s for ch in checks) for s in ("ok", "warn", "fail", "skip")}
    return {
        "ok": counts["fail"] == 0,
        "profile": prof["name"] if prof else None,
        "checks": checks,
        "counts": counts,
        "summary": f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail",
    }


# -- known errors -----------------------------------------------------------------

# (id, pattern, check, cause, fix); the first match wins, so specific ones come first.
KNOWN_ERRORS: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "no-kernel-image",
        r"no kernel image is available|is not compatible with the current PyTorch installation",
        "torch-build",
        "the torch wheel (or a compiled extension such as flash-attn) has no kernels for this "
        "GPU's compute capability: cu128 and newer torch builds start at sm_75, no Pascal. It is "
        "the wheel's arch list that matters, not the host's CUDA toolkit (nvcc) the seed article "
        "blames",
        "install torch 2.6.0+cu118 (kernels for sm_50..sm_90; sm_61 runs the sm_60 code) from "
        "PyTorch's cu118 wheel index (python_env_torch_index_url) with the project's lock; "
        "`oldgpu doctor --python "
        "VENV/bin/python` shows the build's arch list; pip uninstall flash-attn on pre-Ampere",
    ),
    (
        "vllm-bf16",
        r"Bfloat16 is only supported on GPUs with compute capability of at least 8\.0",
        "bf16",
        "vLLM's worker refuses bf16 below CC 8.0, and vLLM itself needs CC >= 7.0: on Pascal "
        "no vLLM setting helps",
        "use verl's HF rollout (actor_rollout_ref.rollout.name=hf, "
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1) and fp32: oldgpu patch DIR "
        "--profile pascal-6.1 plus the hydra overrides `oldgpu profile` prints; do not sed "
        "bfloat16 out of verl",
    ),
    (
        "flash-attn-ampere",
        r"FlashAttention only supports Ampere GPUs or newer",
        "flash-attn",
        "FlashAttention-2 needs CC >= 8.0, and verl 0.5.0 hard-codes "
        'attn_implementation="flash_attention_2"',
        "oldgpu patch DIR (sdpa attention below CC 8.0, eager the fallback) and "
        "pip uninstall flash-attn",
    ),
    (
        "triton-too-old-gpu",
        r"Triton only supports devices of CUDA Capability >= 7\.0|GPUTooOldForTriton",
        "triton",
        "torch.compile (Inductor) or a Triton kernel (liger, verl's fused kernels, flash-attn's "
        "Triton cross-entropy) ran on a GPU of CC < 7.0, which Triton refuses",
        "actor_rollout_ref.actor.use_torch_compile=False, actor_rollout_ref.model.use_liger=False, "
        "actor_rollout_ref.model.use_fused_kernels=False (the overrides `oldgpu profile` prints) "
        "and pip uninstall flash-attn",
    ),
    (
        "triton-shared-memory",
        r"out of resource: shared memory",
        "flash-attn",
        "a Triton kernel asked for more shared memory per block than the GPU has (48 KiB on "
        "Pascal): on verl that is flash-attn's Triton cross-entropy on the log-prob path, liger "
        "or a compiled kernel. Not a batch-size problem, and max_num_batched_tokens (a vLLM "
        "setting) does nothing with the HF rollout",
        "pip uninstall flash-attn; keep use_torch_compile=False, use_liger=False, "
        "use_fused_kernels=False (`oldgpu profile`'s overrides); oldgpu patch DIR",
    ),
    (
        "triton-compiler-error",
        r"Triton compiler error|CompilationError",
        "triton",
        "a Triton kernel failed to compile: a triton that does not match torch, or any Triton "
        "on CC < 7.0",
        "install the triton torch requires (3.2.0 for torch 2.6.0, not the seed article's "
        "2.3.1; the project's lock has it) and keep Triton off below CC 7.0 "
        "(use_torch_compile=False, use_liger=False, use_fused_kernels=False)",
    ),
    (
        "cuda-out-of-memory",
        r"CUDA out of memory|OutOfMemoryError",
        "gpu-memory",
        "the step needs more GPU memory than is free: fp32 doubles bf16's footprint, and "
        "another process may hold memory",
        "see oldgpu doctor's gpu-memory check; lower ppo_micro_batch_size_per_gpu and the "
        "log-prob micro batches, enable actor_rollout_ref.model.enable_gradient_checkpointing, "
        "offload parameters/optimizer to CPU",
    ),
    (
        "flash-attn-missing",
        r"No module named 'flash_attn'|flash_attn.*not installed|flash_attention_2",
        "verl-patch",
        "unpatched verl imports flash_attn at module level and asks transformers for "
        "flash_attention_2",
        "oldgpu patch DIR (guards the imports, sdpa attention); do not install flash-attn on "
        "pre-Ampere GPUs",
    ),
    (
        "offloaded-params",
        r"Expects tensor to be on the compute device",
        "verl-patch",
        "verl 0.5.0's HF rollout never reloads offloaded actor parameters (param_offload=True)",
        "oldgpu patch DIR (loads the actor to the GPU around generation), or "
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    ),
    (
        "driver-too-old",
        r"CUDA driver version is insufficient|Found no NVIDIA driver|NVIDIA driver on your "
        r"system is too old|couldn't communicate with the NVIDIA driver",
        "driver",
        "no NVIDIA driver is loaded, or it is older than torch's CUDA runtime needs "
        "(CUDA 11.8: >= 520.61.05)",
        "install the driver branch `oldgpu profile` selects (535 on Pascal; proprietary kernel "
        "modules before Turing) with the nvidia_driver role, then reboot",
    ),
    (
        "bf16",
        r"bfloat16|bf16",
        "bf16",
        "a bf16 tensor or autocast on a GPU without bf16 (CC < 8.0): verl 0.5.0 hard-codes "
        "autocast(dtype=torch.bfloat16) and its FSDP mixed precision defaults to bf16",
        "oldgpu patch DIR --profile pascal-6.1 and the fp32 overrides `oldgpu profile` prints "
        "(mixed_precision.param_dtype=fp32, ref model_dtype=fp32); unset "
        "OLDGPU_COMPUTE_DTYPE=bf16",
    ),
)


def explain(message: str) -> dict[str, str] | None:
    """The first known error in ``message``: its check id, cause and fix; None if unknown."""
    for key, pattern, check_id, cause, fix in KNOWN_ERRORS:
        match = re.search(pattern, message, re.IGNORECASE)
        if match:
            return {
                "error": key,
                "check": check_id,
                "matched": match.group(0),
                "cause": cause,
                "fix": fix,
            }
    return None


# -- CLI ------------------------------------------------------------------------


def render(report: Mapping[str, Any], facts: Mapping[str, Any] | None = None) -> str:
    probe = (facts or {}).get("probe") or {}
    t = probe.get("torch") or {}
    head = f"oldgpu doctor: profile {report['profile'] or '(none)'}"
    if probe.get("python"):
        head += f", python {probe['python']}"
        if t.get("version"):
            head += f" (torch {t['version']})"
    lines = [head]
    width = max(len(c["id"]) for c in report["checks"])
    for c in report["checks"]:
        lines.append(f"{MARKERS[c['status']]} {c['id']:<{width}}  {c['seen']}")
        if c["status"] in ("fail", "warn") and c["fix"]:
            lines.append(f"    fix: {c['fix']}")
    skipped = report["counts"]["skip"]
    verdict = "ready" if report["ok"] else "NOT ready"
    lines.append(f"{report['summary']}{f', {skipped} skip' if skipped else ''}: {verdict}")
    return "\n".join(lines)


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "doctor",
        parents=[common],
        help=f"preflight: is this host ready to train verl? (exit {DOCTOR_FAILED} if not)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--python",
        metavar="VENV_PYTHON",
        help="the training venv's interpreter, probed for torch facts (default: this one)",
    )
    parser.add_argument("--verl-dir", metavar="DIR", help="the verl tree to check the patch of")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--profile-from-detect",
        action="store_true",
        help="judge against the profile of the GPUs detect finds (the default)",
    )
    source.add_argument("--cc", metavar="X.Y", help="judge against this compute capability")
    source.add_argument("--arch", choices=sorted(profile.PROFILES), help="... this architecture")
    parser.add_argument(
        "--min-free-gpu-mib",
        type=int,
        default=DEFAULT_MIN_FREE_GPU_MIB,
        metavar="N",
        help=f"free memory each GPU needs (default {DEFAULT_MIN_FREE_GPU_MIB})",
    )
    parser.add_argument(
        "--min-free-host-mib",
        type=int,
        default=DEFAULT_MIN_FREE_HOST_MIB,
        metavar="N",
        help=f"MemAvailable the host needs (default {DEFAULT_MIN_FREE_HOST_MIB})",
    )
    parser.add_argument(
        "--facts",
        metavar="FILE",
        help="judge facts recorded before (the JSON report's facts) instead of this host",
    )
    parser.add_argument(
        "--explain",
        metavar="TEXT",
        help=f"name the cause and fix of an error message (exit {EXPLAIN_UNKNOWN} if unknown)",
    )
    detect.add_source_args(parser)
    parser.set_defaults(func=run)


def _explain_result(text: str) -> Result:
    found = explain(text)
    payload = {"message": text, "known": found is not None, "explanation": found}
    if found is None:
        return Result(payload, "not a known error; run `oldgpu doctor`", EXPLAIN_UNKNOWN)
    lines = [
        f"{found['error']} (check {found['check']}): {found['matched']!r}",
        f"cause: {found['cause']}",
        f"fix: {found['fix']}",
    ]
    return Result(payload, "\n".join(lines), 0)


def run(args: argparse.Namespace) -> Result:
    if args.explain is not None:
        return _explain_result(args.explain)
    # A profile asked for by hand is checked up front: a typo is a usage error.
    if args.cc:
        profile.profile_for_cc(args.cc)
    if args.facts:
        try:
            facts = json.loads(Path(args.facts).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise EngineError("facts-unreadable", f"{args.facts}: {exc}") from exc
        if args.cc or args.arch:
            facts["request"] = {"cc": args.cc, "arch": args.arch}
    else:
        facts = gather_facts(
            python=args.python,
            verl_dir=args.verl_dir,
            cc=args.cc,
            arch=args.arch,
            detect_args=args,
        )
    report = evaluate(
        facts, min_free_gpu_mib=args.min_free_gpu_mib, min_free_host_mib=args.min_free_host_mib
    )
    payload = {**report, "facts": facts}
    return Result(payload, render(report, facts), 0 if report["ok"] else DOCTOR_FAILED)
