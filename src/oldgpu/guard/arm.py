"""Arm the guard in this process (what ``guard_site/sitecustomize.py`` calls) and disarm it."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import suppress
from typing import Any

from oldgpu.guard import phases
from oldgpu.guard.backends import (
    _arm_compile,
    _arm_memory,
    _arm_sdpa,
    _arm_tf32,
    _arm_triton,
)
from oldgpu.guard.dtype import (
    _arm_autocast,
    _arm_conversions,
    _arm_thread_coverage,
    _hook_threads,
    _make_dispatch_mode,
    _push_mode_on_this_thread,
    _remove_handles,
)
from oldgpu.guard.imports import _block_flash_attn, _PostImportHooks, _when_imported
from oldgpu.guard.policy import ENV_MEMORY_PHASES, Policy, policy_from_env
from oldgpu.guard.state import _STATE, record


def _arm_torch(torch: Any) -> None:
    policy = _STATE.policy
    if policy is None or _STATE.torch_armed:
        return
    with _STATE.lock:
        _arm_tf32(torch, policy)
        _arm_sdpa(torch, policy)
        _arm_compile(torch, policy)
        _arm_autocast(torch, policy)
        if policy.dtype_check == "ops":
            _STATE.mode_cls = _make_dispatch_mode(torch, policy)
            _STATE.torch_armed = True
            _push_mode_on_this_thread()
            _arm_thread_coverage(torch, policy)
        else:
            _arm_conversions(torch, policy)
            _STATE.torch_armed = True
        _arm_memory(torch, policy)
        if policy.device == "cuda" and os.environ.get(ENV_MEMORY_PHASES) == "1":
            phases.start(torch)
    record(
        "armed",
        torch=getattr(torch, "__version__", "?"),
        thread=threading.current_thread().name,
        main_thread=threading.current_thread() is threading.main_thread(),
        dtype_check=policy.dtype_check,
        ops_steps=policy.ops_steps,
        memory_mib=policy.memory_mib,
    )


def install(policy: Policy | None = None) -> Policy | None:
    """Arm the guard in this process (idempotent); the policy from the environment by default.

    Returns the policy, or None when the environment does not ask for the guard.
    """
    with _STATE.lock:
        if _STATE.installed:
            return _STATE.policy
        policy = policy or policy_from_env()
        if policy is None:
            return None
        _STATE.policy = policy
        _STATE.installed = True
        if not policy.flash_attn:
            _block_flash_attn()
        hooks = _PostImportHooks()
        sys.meta_path.insert(0, hooks)
        _STATE.meta_finders.append(hooks)
        if policy.dtype_check == "ops":
            _hook_threads()
        _arm_triton(policy)
        _when_imported("torch", _arm_torch)
        return policy


def uninstall() -> None:
    """Undo :func:`install` in this process (tests). Modes pushed on other threads stay."""
    with _STATE.lock:
        _remove_handles()
        mode = _STATE.thread_modes.pop(threading.get_ident(), None)
        if mode is not None:
            mode.__exit__(None, None, None)
        for other in _STATE.thread_modes.values():
            other.checking = False
        _STATE.thread_modes.clear()
        for owner, attr, old, had in reversed(_STATE.patches):
            if had:
                setattr(owner, attr, old)
            else:
                with suppress(AttributeError):
                    delattr(owner, attr)
        _STATE.patches.clear()
        for finder in _STATE.meta_finders:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
        _STATE.meta_finders.clear()
        _STATE.import_hooks.clear()
        torch = sys.modules.get("torch")
        policy = _STATE.policy
        if torch is not None and _STATE.torch_armed and policy is not None:
            # Put back torch's defaults for what the guard turned off.
            torch._C._set_sdp_use_flash(True)
            if hasattr(torch._C, "_set_sdp_use_cudnn"):
                torch._C._set_sdp_use_cudnn(True)
            torch._C._set_sdp_use_mem_efficient(True)
            torch.backends.cudnn.allow_tf32 = True
        _STATE.policy = None
        _STATE.installed = False
        _STATE.torch_armed = False
        _STATE.memory_cap = {}
        _STATE.card = {}
        _STATE.set_fraction = lambda fraction, index: None
        _STATE.events = {}
        _STATE.mode_cls = None
        _STATE.ops_ended = False
        _STATE.optimizer_steps = 0
        _STATE.blocked_seen = set()


def active() -> Policy | None:
    return _STATE.policy if _STATE.installed else None
