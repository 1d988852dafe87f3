"""``oldgpu guard --check``: what the guard enforces in this process, read back from torch."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from oldgpu.guard.arm import active
from oldgpu.guard.policy import ENV_GUARD, SITE_DIR, GuardViolation, Policy
from oldgpu.guard.state import _STATE, probing


def check(probe: bool = True) -> dict[str, Any]:
    """What the guard enforces in this process, read back from torch where it can be."""
    policy = active()
    doc: dict[str, Any] = {
        "active": policy is not None,
        "policy": policy.as_dict() if policy else None,
        "site_dir": str(SITE_DIR),
        "sitecustomize_on_path": any(
            os.path.abspath(p or os.getcwd()) == str(SITE_DIR) for p in sys.path
        ),
        "torch": None,
        "events": dict(_STATE.events),
    }
    if policy is None:
        return doc
    probes: dict[str, Any] = {}
    if probe and not policy.flash_attn:
        try:
            with probing():
                importlib.import_module("flash_attn")
            probes["flash_attn_import"] = "imported (NOT blocked)"
        except ImportError as exc:
            probes["flash_attn_import"] = f"blocked: {type(exc).__name__}: {exc}"
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # arms the guard through the import hook
        except ImportError:
            torch = None
    if torch is None:
        doc["torch"] = {"importable": False}
        doc["probes"] = probes
        return doc

    def read(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # a newer torch may refuse a read; report, go on
            return f"unreadable: {exc!r}"[:300]

    t: dict[str, Any] = {
        "version": torch.__version__,
        "armed": _STATE.torch_armed,
        "float32_matmul_precision": read(torch.get_float32_matmul_precision),
        "cuda_matmul_allow_tf32": read(lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
        "cudnn_allow_tf32": read(lambda: bool(torch.backends.cudnn.allow_tf32)),
        "sdp_flash": read(lambda: bool(torch.backends.cuda.flash_sdp_enabled())),
        "sdp_mem_efficient": read(lambda: bool(torch.backends.cuda.mem_efficient_sdp_enabled())),
        "sdp_math": read(lambda: bool(torch.backends.cuda.math_sdp_enabled())),
        "torch_compile_guarded": bool(getattr(torch.compile, "_oldgpu_guard", False)),
        "dtype_mode_on_this_thread": threading.get_ident() in _STATE.thread_modes,
        "ops_check_ended": _STATE.ops_ended,
        "cuda_available": read(lambda: bool(torch.cuda.is_available())),
        "memory_cap": dict(_STATE.memory_cap),
    }
    if hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        t["sdp_cudnn"] = read(lambda: bool(torch.backends.cuda.cudnn_sdp_enabled()))
    doc["torch"] = t
    if probe:
        try:
            probes.update(_probe_torch(torch, policy))
        except Exception as exc:
            probes["error"] = f"{exc!r}"[:300]
    doc["probes"] = probes
    return doc


def _probe_torch(torch: Any, policy: Policy) -> dict[str, str]:
    out: dict[str, str] = {}
    if policy.device == "cuda" and not torch.cuda.is_available():
        out["dtype"] = "skipped: no CUDA device"
        return out
    with probing():
        for dtype_name in policy.forbidden_dtypes:
            dtype = getattr(torch, dtype_name)
            try:
                torch.ones(2, device=policy.device).to(dtype)
                out[f"dtype_{dtype_name}"] = "allowed (NOT guarded)"
            except GuardViolation as exc:
                out[f"dtype_{dtype_name}"] = f"raises {exc.name}"
        try:
            with torch.autocast(device_type=policy.device, dtype=torch.bfloat16):
                pass
            out["autocast_bf16"] = "allowed (NOT guarded)"
        except GuardViolation as exc:
            out["autocast_bf16"] = f"raises {exc.name}"
        if not policy.torch_compile:
            try:
                torch.compile(lambda x: x + 1)(torch.ones(2, device=policy.device))
                out["torch_compile"] = "ran (NOT guarded)"
            except GuardViolation as exc:
                out["torch_compile"] = f"raises {exc.name}"
    if policy.device == "cuda" and _STATE.memory_cap:
        cap = next(iter(_STATE.memory_cap.values()))
        out["memory_cap"] = (
            f"{cap['cap_mib']} MiB of {cap['total_mib']} (fraction {cap['fraction']:.4f})"
        )
    return out


def _text(doc: Mapping[str, Any]) -> str:
    if not doc["active"]:
        return (
            f"guard: not active in this process ({ENV_GUARD} unset); a job exports "
            f"{ENV_GUARD}=<profile> and puts {doc['site_dir']} first on PYTHONPATH"
        )
    p = doc["policy"]
    lines = [
        f"guard: active, profile {p['profile']} ({p['gpu_name']}, CC {p['compute_capability']}), "
        f"watching {p['device']}",
        f"dtype policy {p['compute_dtype']}: forbidden {', '.join(p['forbidden_dtypes'])} "
        f"(check: {p['dtype_check']})",
        f"tf32 {'allowed' if p['tf32'] else 'off'}; sdpa flash "
        f"{'allowed' if p['flash_sdp'] else 'off'}, "
        f"cudnn {'allowed' if p['cudnn_sdp'] else 'off'}, "
        f"mem-efficient {'on' if p['mem_efficient_sdp'] else 'off'}, math on",
        f"torch.compile {'allowed' if p['torch_compile'] else 'raises'}; flash_attn "
        f"{'allowed' if p['flash_attn'] else 'blocked'}",
        f"memory cap: {p['memory_mib'] or 'none'} MiB; log: {p['log'] or '-'}",
    ]
    t = doc.get("torch")
    if t and t.get("version"):
        lines.append(
            f"torch {t['version']}: armed {t['armed']}, matmul precision "
            f"{t['float32_matmul_precision']}, allow_tf32 cuda {t['cuda_matmul_allow_tf32']} "
            f"cudnn {t['cudnn_allow_tf32']}, sdp flash {t['sdp_flash']} mem-efficient "
            f"{t['sdp_mem_efficient']} math {t['sdp_math']}"
        )
    elif t:
        lines.append("torch: not importable")
    for key, value in (doc.get("probes") or {}).items():
        lines.append(f"probe {key}: {value}")
    return "\n".join(lines)
