"""What the profile's GPU lacks, turned off in torch and Triton.

TF32 and SDPA's flash and cuDNN kernels (sm80+), Inductor and Triton kernels (CC 7.0+ for
Triton; they raise Inductor's own error), and memory beyond the card's (the caching
allocator's cap).
"""

from __future__ import annotations

import functools
from typing import Any

from oldgpu.guard.dtype import _device_of, _on_guarded_device
from oldgpu.guard.imports import _when_imported
from oldgpu.guard.policy import GuardViolation, Policy, memory_fraction, triton_too_old_message
from oldgpu.guard.state import _STATE, _patch, call_site, record, violation


def _arm_tf32(torch: Any, policy: Policy) -> None:
    if policy.tf32:
        return
    matmul = torch.backends.cuda.matmul
    torch.set_float32_matmul_precision("highest")
    matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    original_precision = torch.set_float32_matmul_precision

    def set_float32_matmul_precision(precision: str) -> None:
        if precision != "highest":
            record("ignored", what=f"set_float32_matmul_precision({precision!r})")
        original_precision("highest")

    _patch(torch, "set_float32_matmul_precision", set_float32_matmul_precision)
    # torch.backends.cuda.matmul.allow_tf32 = True: a setter on its class.
    matmul_cls = type(matmul)
    original_setattr = matmul_cls.__setattr__

    def matmul_setattr(self: Any, name: str, value: Any) -> None:
        if name == "allow_tf32" and value:
            record("ignored", what="torch.backends.cuda.matmul.allow_tf32 = True")
            value = False
        elif name == "fp32_precision" and value not in ("ieee", "highest"):
            record("ignored", what=f"torch.backends.cuda.matmul.fp32_precision = {value!r}")
            value = "ieee"
        original_setattr(self, name, value)

    _patch(matmul_cls, "__setattr__", matmul_setattr)
    cudnn_setter = getattr(torch._C, "_set_cudnn_allow_tf32", None)
    if cudnn_setter is not None:

        def set_cudnn_allow_tf32(value: bool) -> None:
            if value:
                record("ignored", what="torch.backends.cudnn.allow_tf32 = True")
            cudnn_setter(False)

        # CudnnModule.allow_tf32 is a ContextProp over this function, found by name.
        prop_cls = type(torch.backends.cudnn)
        prop = vars(prop_cls).get("allow_tf32")
        if prop is not None and hasattr(prop, "setter"):
            _patch(prop, "setter", set_cudnn_allow_tf32)


def _arm_sdpa(torch: Any, policy: Policy) -> None:
    backends = (
        ("flash", "_set_sdp_use_flash", policy.flash_sdp),
        ("cudnn", "_set_sdp_use_cudnn", policy.cudnn_sdp),
        ("mem_efficient", "_set_sdp_use_mem_efficient", policy.mem_efficient_sdp),
    )
    for name, setter_name, allowed in backends:
        setter = getattr(torch._C, setter_name, None)
        if setter is None or allowed:
            continue
        setter(False)

        def guarded(value: bool, _setter: Any = setter, _name: str = name) -> None:
            if value:
                record("ignored", what=f"enable_{_name}_sdp(True)")
            _setter(False)

        # torch.backends.cuda.enable_*_sdp and torch.nn.attention.sdpa_kernel call these.
        _patch(torch._C, setter_name, guarded)


def _arm_compile(torch: Any, policy: Policy) -> None:
    if policy.torch_compile:
        return
    original = torch.compile
    message = triton_too_old_message(policy.gpu_name, policy.compute_capability)

    def refuse(target: Any) -> GuardViolation:
        what = type(target).__name__ if isinstance(target, torch.nn.Module) else target
        what = getattr(what, "__qualname__", what)
        return violation(
            "guard-torch-compile",
            f"torch.compile({what}): backend='inductor' raised: RuntimeError: {message}",
            op="torch.compile",
            site=call_site(3),
        )

    def on_guarded_device(target: Any, args: Any, kwargs: Any) -> bool:
        if _on_guarded_device((args, kwargs), policy):
            return True
        params = getattr(target, "parameters", None)
        if callable(params):
            return any(_device_of(p) == policy.device for p in params())
        return False

    @functools.wraps(original)
    def compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(...)
            return lambda fn: compile(fn, **kwargs)
        if kwargs.get("backend", "inductor") != "inductor" or kwargs.get("disable"):
            return original(model, **kwargs)  # eager/aot_eager need no Triton
        if isinstance(model, torch.nn.Module):
            compiled = original(model, **kwargs)
            forward = compiled.forward

            @functools.wraps(forward)
            def guarded_forward(*args: Any, **kw: Any) -> Any:
                if on_guarded_device(model, args, kw):
                    raise refuse(model)
                return forward(*args, **kw)

            compiled.forward = guarded_forward
            return compiled
        compiled_fn: list[Any] = []  # compiled on first use off the guarded device

        @functools.wraps(model)
        def guarded(*args: Any, **kw: Any) -> Any:
            if on_guarded_device(model, args, kw):
                raise refuse(model)
            if not compiled_fn:
                compiled_fn.append(original(model, **kwargs))
            return compiled_fn[0](*args, **kw)

        return guarded

    compile._oldgpu_guard = True  # type: ignore[attr-defined]
    _patch(torch, "compile", compile)


def _arm_triton(policy: Policy) -> None:
    if policy.torch_compile:
        return
    message = triton_too_old_message(policy.gpu_name, policy.compute_capability)

    def arm(triton: Any) -> None:
        try:
            from triton.runtime import jit
        except Exception:
            return
        run = getattr(getattr(jit, "JITFunction", None), "run", None)
        if run is None:
            record("note", what="triton.runtime.jit.JITFunction.run not found: not guarded")
            return

        def guarded_run(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise violation(
                "guard-triton",
                f"Triton kernel {getattr(self, '__name__', '?')}: {message}",
                op="triton.JITFunction.run",
                site=call_site(2),
            )

        functools.update_wrapper(guarded_run, run)
        _patch(jit.JITFunction, "run", guarded_run)

    _when_imported("triton", arm)


def _arm_memory(torch: Any, policy: Policy) -> None:
    if policy.device != "cuda" or not policy.memory_mib:
        return
    from oldgpu.guard import card

    cap_bytes = policy.memory_mib * 1024 * 1024
    cuda = torch.cuda
    set_fraction = cuda.set_per_process_memory_fraction
    _STATE.set_fraction = set_fraction

    def apply_cap() -> None:
        for index in range(cuda.device_count()):
            total = cuda.get_device_properties(index).total_memory
            fraction = memory_fraction(policy.memory_mib, total)
            set_fraction(fraction, index)
            _STATE.memory_cap[str(index)] = {
                "cap_mib": policy.memory_mib,
                "total_mib": total // (1024 * 1024),
                "fraction": fraction,
            }
        record("memory-cap", devices=_STATE.memory_cap)
        try:  # the card-wide cap: every guarded process on a GPU together
            card.arm(torch, policy)
        except Exception as exc:  # recorded: a bench counts it as a failed guard
            record("card-arm-failed", error=repr(exc))

    cuda._lazy_call(apply_cap)

    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        index = cuda._utils._get_device_index(device, optional=True) if device is not None else None
        index = cuda.current_device() if index is None else index
        total = cuda.get_device_properties(index).total_memory
        capped = min(fraction, memory_fraction(policy.memory_mib, total))
        if capped < fraction:
            record("ignored", what=f"set_per_process_memory_fraction({fraction}) above the cap")
        watch = _STATE.card.get(index)
        if watch is not None:
            watch.requested = capped
            watch.apply_limit()  # the lower of what is asked and what the card has left
            return
        set_fraction(capped, index)

    _patch(cuda, "set_per_process_memory_fraction", set_per_process_memory_fraction)
    mem_get_info = cuda.mem_get_info

    @functools.wraps(mem_get_info)
    def guarded_mem_get_info(device: Any = None) -> tuple[int, int]:
        free, _total = mem_get_info(device)
        reserved = cuda.memory_reserved(device)
        index = cuda._utils._get_device_index(device, optional=True) if device is not None else None
        watch = _STATE.card.get(cuda.current_device() if index is None else index)
        limit = cap_bytes if watch is None else int(watch.limit_mib * 1024 * 1024)
        return max(0, min(free, limit - reserved)), cap_bytes

    _patch(cuda, "mem_get_info", guarded_mem_get_info)
    if getattr(cuda, "memory", None) is not None and hasattr(cuda.memory, "mem_get_info"):
        _patch(cuda.memory, "mem_get_info", guarded_mem_get_info)
