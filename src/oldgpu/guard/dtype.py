"""The dtype checks: no forbidden dtype (bf16; fp16 under fp32) on the guarded device.

``ops`` pushes a TorchDispatchMode that sees every aten op's outputs, on every thread
(a hook on ``threading.Thread``; a module forward pre-hook for threads made in C++),
until :func:`end_ops_check` (after ``OLDGPU_GUARD_OPS_STEPS`` optimizer steps);
``conversions`` wraps the Tensor conversions only. ``torch.autocast`` to a forbidden
dtype raises in both.

A policy's ``storage_dtypes`` (a LoRA job's frozen base stored at 16 bits) may be made,
moved, viewed and converted by the ops in STORAGE_OPS, as a P40 can (copies and
conversions are bit moves, not 16-bit math); any other op that makes one (a matmul,
attention, a reduction, elementwise math) is still 16-bit arithmetic and raises.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

from oldgpu.guard.policy import GuardViolation, Policy
from oldgpu.guard.state import _STATE, _patch, call_site, record, violation

# aten ops that store, move, view or convert a tensor without computing in its dtype
# (the overload name dropped: aten.cat.default -> cat).
STORAGE_OPS = frozenset(
    {
        "_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "clone", "contiguous",
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
        "zeros", "zeros_like", "zero_", "new_zeros", "fill_", "resize_", "set_",
        "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "scalar_tensor",
        "view", "_unsafe_view", "view_as", "reshape", "_reshape_alias", "flatten",
        "as_strided", "alias", "detach", "t", "transpose", "permute", "expand",
        "unsqueeze", "squeeze", "slice", "select", "narrow", "split", "split_with_sizes",
        "chunk", "unbind", "cat", "stack", "lift_fresh", "_pin_memory", "record_stream",
        "index_select", "embedding",
    }
)  # fmt: skip


def _device_of(tensor: Any) -> str:
    return tensor.device.type


def _forbidden(torch: Any, policy: Policy) -> frozenset[Any]:
    return frozenset(getattr(torch, name) for name in policy.forbidden_dtypes)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _tensors(value: Any) -> Iterator[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _on_guarded_device(value: Any, policy: Policy) -> bool:
    return any(_device_of(t) == policy.device for t in _tensors(value))


def _arm_autocast(torch: Any, policy: Policy) -> None:
    forbidden = _forbidden(torch, policy)
    autocast_cls = torch.amp.autocast_mode.autocast
    original_init = autocast_cls.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        original_init(self, device_type, *args, **kwargs)
        dtype = getattr(self, "fast_dtype", None)
        if device_type == policy.device and getattr(self, "_enabled", False) and dtype in forbidden:
            raise violation(
                "guard-autocast",
                f"torch.autocast(device_type={device_type!r}, dtype={dtype}): "
                f"{_dtype_name(dtype)} is not allowed (policy {policy.compute_dtype})",
                op="torch.autocast",
            )

    _patch(autocast_cls, "__init__", __init__)


def _dtype_error(func: Any, tensor: Any, policy: Policy) -> GuardViolation:
    op = str(func)  # aten._to_copy.default
    return violation(
        "guard-dtype",
        f"{op} made a {_dtype_name(tensor.dtype)} tensor {tuple(tensor.shape)} on "
        f"{tensor.device}: {_dtype_name(tensor.dtype)} is not allowed (policy "
        f"{policy.compute_dtype})",
        op=op,
        site=call_site(3),
    )


def _make_dispatch_mode(torch: Any, policy: Policy) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    forbidden = _forbidden(torch, policy)
    stored = frozenset(getattr(torch, name) for name in policy.storage_dtypes)
    device = policy.device
    tensor_type = torch.Tensor
    is_cuda = device == "cuda"

    def storage_only(func: Any, tensor: Any) -> bool:
        return tensor.dtype in stored and func.__name__.split(".")[0] in STORAGE_OPS

    class DtypeGuardMode(TorchDispatchMode):
        """Checks every aten op's outputs for a forbidden dtype on the guarded device."""

        checking = True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            out = func(*args, **kwargs) if kwargs else func(*args)
            if not self.checking:
                return out
            if isinstance(out, tensor_type):
                if (
                    out.dtype in forbidden
                    and (out.is_cuda if is_cuda else _device_of(out) == device)
                    and not storage_only(func, out)
                ):
                    raise _dtype_error(func, out, policy)
            elif isinstance(out, (tuple, list)):
                for item in out:
                    if (
                        isinstance(item, tensor_type)
                        and item.dtype in forbidden
                        and (item.is_cuda if is_cuda else _device_of(item) == device)
                        and not storage_only(func, item)
                    ):
                        raise _dtype_error(func, item, policy)
            return out

    return DtypeGuardMode


def _push_mode_on_this_thread() -> None:
    torch = sys.modules.get("torch")
    policy = _STATE.policy
    if (
        torch is None
        or policy is None
        or policy.dtype_check != "ops"
        or not _STATE.torch_armed
        or _STATE.ops_ended
    ):
        return
    ident = threading.get_ident()
    if ident in _STATE.thread_modes:
        return
    mode = _STATE.mode_cls()
    mode.__enter__()  # stays on this thread's mode stack for the thread's life
    _STATE.thread_modes[ident] = mode


def _arm_thread_coverage(torch: Any, policy: Policy) -> None:
    """A thread made in C++ gets the mode when it first calls a module."""
    thread_modes = _STATE.thread_modes
    get_ident = threading.get_ident

    def forward_pre_hook(module: Any, args: Any) -> None:
        if get_ident() not in thread_modes:
            _push_mode_on_this_thread()

    _STATE.handles.append(
        torch.nn.modules.module.register_module_forward_pre_hook(forward_pre_hook)
    )
    if not policy.ops_steps:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def optimizer_step_post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        _STATE.optimizer_steps += 1
        if _STATE.optimizer_steps >= policy.ops_steps:
            end_ops_check(f"{_STATE.optimizer_steps} optimizer steps")

    _STATE.handles.append(register_optimizer_step_post_hook(optimizer_step_post_hook))


def _remove_handles() -> None:
    for handle in _STATE.handles:
        handle.remove()
    _STATE.handles.clear()


def end_ops_check(reason: str = "asked") -> None:
    """End the per-op dtype check (this thread's mode off; no more on new threads).

    Threads other than the caller stop checking at once, and drop their mode (torch's
    modes are per thread: only the thread itself can) when they next call a module:
    a mode left on, even doing nothing, sends every aten op of that thread through
    Python, which a real P40 never pays (0.9.0's rollout decodes on another thread than
    the one whose optimizer ends the window). Everything else the guard enforces stays.
    """
    with _STATE.lock:
        if _STATE.ops_ended or _STATE.mode_cls is None:
            return
        _STATE.ops_ended = True
        _remove_handles()
        mode = _STATE.thread_modes.pop(threading.get_ident(), None)
        popped = False
        if mode is not None:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is mode:
                mode.__exit__(None, None, None)
                popped = True
            else:
                mode.checking = False
        for other in _STATE.thread_modes.values():
            other.checking = False
        if _STATE.thread_modes:
            _arm_mode_drop()
    record(
        "ops-check-ended",
        reason=reason,
        thread=threading.current_thread().name,
        popped=popped,
        other_threads=len(_STATE.thread_modes),
    )


def _drop_mode_on_this_thread() -> bool:
    """This thread's mode off, if it is the innermost; whether it was."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    ident = threading.get_ident()
    mode = _STATE.thread_modes.get(ident)
    if mode is None or _get_current_dispatch_mode() is not mode:
        return False
    mode.__exit__(None, None, None)
    _STATE.thread_modes.pop(ident, None)
    return True


def _arm_mode_drop() -> None:
    """A module pre-hook that drops the ended check's mode on each thread that still has
    one; it removes itself once none has."""
    torch = sys.modules["torch"]
    thread_modes = _STATE.thread_modes
    get_ident = threading.get_ident
    handle = None

    def forward_pre_hook(module: Any, args: Any) -> None:
        if get_ident() in thread_modes and _drop_mode_on_this_thread():
            record("ops-mode-dropped", thread=threading.current_thread().name)
        if not thread_modes and handle is not None:
            handle.remove()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(forward_pre_hook)
    _STATE.handles.append(handle)


def _hook_threads() -> None:
    original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def _bootstrap_inner(self: threading.Thread) -> None:
        try:
            _push_mode_on_this_thread()
        except Exception as exc:
            record("arm-failed", thread=self.name, error=repr(exc))
        try:
            original(self)
        finally:
            _STATE.thread_modes.pop(threading.get_ident(), None)

    _patch(threading.Thread, "_bootstrap_inner", _bootstrap_inner)


def _arm_conversions(torch: Any, policy: Policy) -> None:
    """Without the dispatch mode: ``.to``/``.bfloat16()``/``.half()``/``.type()`` only
    (conversions to a storage dtype are allowed: this mode sees no arithmetic)."""
    forbidden = _forbidden(torch, policy) - frozenset(
        getattr(torch, name) for name in policy.storage_dtypes
    )

    def check(result: Any, what: str) -> Any:
        for t in _tensors(result):
            if t.dtype in forbidden and _device_of(t) == policy.device:
                raise violation(
                    "guard-dtype",
                    f"{what} made a {_dtype_name(t.dtype)} tensor {tuple(t.shape)} on {t.device}: "
                    f"{_dtype_name(t.dtype)} is not allowed (policy {policy.compute_dtype})",
                    op=what,
                    site=call_site(3),
                )
        return result

    for method in ("to", "bfloat16", "half", "type", "cuda", "new_empty", "new_zeros"):
        original = getattr(torch.Tensor, method)

        def wrapper(self: Any, *args: Any, _original: Any = original, _m: str = method, **kw: Any):
            return check(_original(self, *args, **kw), f"Tensor.{_m}")

        functools.update_wrapper(wrapper, original)
        _patch(torch.Tensor, method, wrapper)
