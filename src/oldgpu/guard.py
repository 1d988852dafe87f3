"""``oldgpu guard``: enforce, on a newer GPU, what an old one cannot do.

Training on a big GPU proves the Pascal path only if nothing on the way used what a
Tesla P40 lacks. Under the guard a process behaves, in those respects, like one on the
profile's GPU (``OLDGPU_GUARD=pascal``: a P40, compute capability 6.1):

- TF32 off (cuBLAS, cuDNN, ``float32_matmul_precision='highest'``); later requests to
  turn it on are ignored (a P40 has no TF32, so its numbers are the strict fp32 ones).
- SDPA's FlashAttention and cuDNN backends off (both need sm80+); mem-efficient and
  math stay. Re-enabling them is ignored, as a P40 would never pick them.
- ``import flash_attn`` (and ``flash_attn_2_cuda``, ``flash_attn_interface``) fails with
  ModuleNotFoundError and ``importlib.util.find_spec`` / ``importlib.metadata`` say it is
  not installed, as on a host where it cannot be built.
- ``torch.compile`` (Inductor) and Triton kernels on the guarded device raise the error
  Inductor gives below CC 7.0 ("... too old to be supported by the triton GPU
  compiler ...").
- Any tensor on the guarded device created or returned in bf16 (and fp16 when the
  dtype policy is fp32, the profile's) raises :class:`GuardViolation` naming the aten op
  and the Python call site; ``torch.autocast`` to such a dtype raises when entered.
- The caching allocator is capped at the GPU's usable memory (``set_per_process_memory_
  fraction``, applied when CUDA initialises); ``torch.cuda.mem_get_info`` reports the cap.

Activation is by environment, so Ray's workers inherit it: ``OLDGPU_GUARD=<profile>``
plus ``src/oldgpu/guard_site`` first on PYTHONPATH (its ``sitecustomize`` calls
:func:`install`). Variables:

- ``OLDGPU_GUARD``: a profile (``pascal``, ``pascal-6.1``, ``volta``...; ``1`` = pascal).
- ``OLDGPU_GUARD_MEMORY_MIB``: what torch's allocator may reserve; default per compute
  capability (``DEFAULT_MEMORY_MIB``; P40: 23040 = 22.5 GiB); ``0`` = no cap.
- ``OLDGPU_GUARD_DTYPE``: the dtype policy, ``fp32`` (forbid bf16 and fp16) or ``fp16``
  (forbid bf16); default the profile's compute dtype.
- ``OLDGPU_GUARD_DTYPE_CHECK``: ``ops`` (default: a TorchDispatchMode on every thread
  sees every aten op's outputs) or ``conversions`` (cheaper: autocast and the Tensor
  conversions only, ``.to``/``.bfloat16()``/``.half()``/``.type()``/``.cuda()``, which
  module ``.to`` uses; a factory call with ``dtype=torch.bfloat16`` goes unseen).
- ``OLDGPU_GUARD_OPS_STEPS``: with ``ops``, end the per-op check after this many
  optimizer steps of the process (``0``, the default: never). The per-op check costs
  about 6-12 us per aten op on the CPU side; a benchmark proves its first PPO step op by
  op (set it to the actor's plus the critic's optimizer steps per PPO step) and times
  the later ones without that cost. Everything else stays enforced.
- ``OLDGPU_GUARD_LOG``: a file to append one JSON line per event (``armed``,
  ``violation``, ``ignored``, ``blocked-import``, ``memory-cap``), so a benchmark can
  assert that every torch process armed and none violated.
- ``OLDGPU_GUARD_DEVICE``: the device type watched, ``cuda``; tests use ``cpu``.

Modes are thread-local in torch: the dispatch mode is pushed on the thread that imports
torch, through a hook on ``threading.Thread`` on every thread started after, and through
a global module forward pre-hook on any other thread (one made in C++) the first time it
runs a module; the autograd engine's device threads inherit the caller's modes. The
guard never imports torch itself: it hooks torch's import, so non-torch processes pay
nothing.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oldgpu.output import EngineError, Result

ENV_GUARD = "OLDGPU_GUARD"
ENV_MEMORY = "OLDGPU_GUARD_MEMORY_MIB"
ENV_DTYPE = "OLDGPU_GUARD_DTYPE"
ENV_DTYPE_CHECK = "OLDGPU_GUARD_DTYPE_CHECK"
ENV_OPS_STEPS = "OLDGPU_GUARD_OPS_STEPS"
ENV_LOG = "OLDGPU_GUARD_LOG"
ENV_DEVICE = "OLDGPU_GUARD_DEVICE"

SITE_DIR = Path(__file__).resolve().parent / "guard_site"
_OFF = ("", "0", "off", "no", "false")
_ON = ("1", "on", "yes", "true")
DEFAULT_PROFILE = "pascal"
DTYPE_CHECKS = ("ops", "conversions")

# The card each compute capability stands for in messages, and what torch's caching
# allocator may reserve on it: the card's memory less about 1.5 GiB for the CUDA context
# (about 0.5 GiB, outside the allocator) and what the driver and ECC keep. The P40:
# 24 GiB -> 22.5 GiB. An estimate until measured on the card; OLDGPU_GUARD_MEMORY_MIB
# overrides it.
GPU_NAMES = {
    "3.7": "Tesla K80",
    "5.2": "Tesla M40",
    "6.0": "Tesla P100-PCIE-16GB",
    "6.1": "Tesla P40",
    "7.0": "Tesla V100-SXM2-16GB",
    "7.5": "Tesla T4",
}
DEFAULT_MEMORY_MIB = {
    "3.7": 12 * 1024 - 1536,
    "5.2": 24 * 1024 - 1536,
    "6.0": 16 * 1024 - 1536,
    "6.1": 24 * 1024 - 1536,
    "7.0": 16 * 1024 - 1536,
    "7.5": 16 * 1024 - 1536,
}
# flash-attn's importable names (the package, its CUDA extension, the FA3 interface).
BLOCKED_MODULES = ("flash_attn", "flash_attn_2_cuda", "flash_attn_interface", "flash_attn_3")
BLOCKED_DISTRIBUTIONS = ("flash-attn", "flash_attn", "flash-attn-3")


def triton_too_old_message(gpu_name: str, cc: str) -> str:
    """What Inductor says on a GPU below CC 7.0 (torch/_inductor/scheduler.py, 2.6)."""
    return (
        f"Found {gpu_name} which is too old to be supported by the triton GPU compiler, "
        "which is used as the backend. Triton only supports devices of CUDA Capability "
        f">= 7.0, but your device is of CUDA capability {cc}"
    )


class GuardViolation(EngineError):
    """Something a process on the guarded GPU could not do (or the policy forbids)."""

    def __init__(self, name: str, message: str, *, op: str = "", site: str = "") -> None:
        super().__init__(name, message)
        self.op = op
        self.site = site


# -- the policy: what is enforced, from the profile and the environment ----------------


@dataclass(frozen=True)
class Policy:
    profile: str  # the profile's name, e.g. pascal-6.1
    architecture: str
    compute_capability: str
    gpu_name: str
    device: str  # the device type watched
    compute_dtype: str  # the dtype policy: fp32 or fp16
    forbidden_dtypes: tuple[str, ...]  # torch dtype names
    tf32: bool  # allowed?
    flash_sdp: bool
    cudnn_sdp: bool
    mem_efficient_sdp: bool
    torch_compile: bool
    flash_attn: bool
    memory_mib: int | None
    dtype_check: str
    log: str | None
    ops_steps: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cc_tuple(cc: str) -> tuple[int, int]:
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def policy_for(
    name: str,
    *,
    memory_mib: int | str | None = "default",
    compute_dtype: str | None = None,
    dtype_check: str = "ops",
    device: str = "cuda",
    log: str | None = None,
    ops_steps: int = 0,
) -> Policy:
    """The guard's policy for a profile name (``pascal``, ``pascal-6.1``, ``volta``...)."""
    from oldgpu import profile

    arch, _, cc = name.strip().lower().partition("-")
    try:
        prof = profile.profile_for_arch(arch, cc or None)
    except EngineError as exc:
        raise EngineError("guard-profile-unknown", f"{ENV_GUARD}={name!r}: {exc.message}") from exc
    if prof["device"] != "cuda" or prof["compute_dtype"] == "bf16":
        raise EngineError(
            "guard-profile-unsupported",
            f"{name!r} is a GPU with bf16 and FlashAttention-2 (or no GPU): there is nothing "
            "to guard; use kepler, maxwell, pascal, volta or turing",
        )
    cc = prof["compute_capability"]
    major_minor = _cc_tuple(cc)
    dtype = (compute_dtype or prof["compute_dtype"]).lower()
    if dtype not in ("fp32", "fp16"):
        raise EngineError(
            "guard-dtype-invalid", f"{ENV_DTYPE}={dtype!r}: expected fp32 or fp16 (no bf16 here)"
        )
    if dtype_check not in DTYPE_CHECKS:
        raise EngineError(
            "guard-dtype-check-invalid",
            f"{ENV_DTYPE_CHECK}={dtype_check!r}: expected one of {', '.join(DTYPE_CHECKS)}",
        )
    if memory_mib == "default":
        memory_mib = DEFAULT_MEMORY_MIB.get(cc)
    elif isinstance(memory_mib, str):
        raise EngineError("guard-memory-invalid", f"memory_mib={memory_mib!r}")
    if memory_mib is not None and memory_mib <= 0:
        memory_mib = None
    forbidden = ("bfloat16",) if dtype == "fp16" else ("bfloat16", "float16")
    return Policy(
        profile=prof["name"],
        architecture=prof["architecture"],
        compute_capability=cc,
        gpu_name=GPU_NAMES.get(cc, f"a {prof['architecture']} GPU"),
        device=device,
        compute_dtype=dtype,
        forbidden_dtypes=forbidden,
        tf32=major_minor >= (8, 0),
        flash_sdp=major_minor >= (8, 0),
        cudnn_sdp=major_minor >= (8, 0),
        # PyTorch's mem-efficient kernel runs from sm50.
        mem_efficient_sdp=major_minor >= (5, 0),
        torch_compile=bool(prof["torch_compile"]),
        flash_attn=bool(prof["flash_attn_allowed"]),
        memory_mib=memory_mib,
        dtype_check=dtype_check,
        log=log,
        ops_steps=max(0, ops_steps),
    )


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV_GUARD, "").strip().lower() not in _OFF


def policy_from_env(environ: Mapping[str, str] | None = None) -> Policy | None:
    """The policy the environment asks for, or None when ``OLDGPU_GUARD`` is unset/off."""
    env = os.environ if environ is None else environ
    if not enabled(env):
        return None
    name = env.get(ENV_GUARD, "").strip().lower()
    if name in _ON:
        name = DEFAULT_PROFILE
    raw_memory = env.get(ENV_MEMORY, "").strip()
    memory: int | str | None = "default"
    if raw_memory:
        try:
            memory = int(float(raw_memory))
        except ValueError:
            raise EngineError(
                "guard-memory-invalid", f"{ENV_MEMORY}={raw_memory!r}: expected MiB"
            ) from None
    raw_steps = env.get(ENV_OPS_STEPS, "").strip() or "0"
    try:
        ops_steps = int(raw_steps)
    except ValueError:
        raise EngineError(
            "guard-ops-steps-invalid", f"{ENV_OPS_STEPS}={raw_steps!r}: expected a count"
        ) from None
    return policy_for(
        name,
        ops_steps=ops_steps,
        memory_mib=memory,
        compute_dtype=env.get(ENV_DTYPE, "").strip() or None,
        dtype_check=env.get(ENV_DTYPE_CHECK, "").strip().lower() or "ops",
        device=env.get(ENV_DEVICE, "").strip().lower() or "cuda",
        log=env.get(ENV_LOG, "").strip() or None,
    )


def memory_fraction(cap_mib: int, total_bytes: int) -> float:
    """The fraction of a device's memory that is ``cap_mib`` (at most 1)."""
    if total_bytes <= 0:
        return 1.0
    return min(1.0, cap_mib * 1024 * 1024 / total_bytes)


def environment(profile_name: str = DEFAULT_PROFILE, log: str | None = None) -> dict[str, str]:
    """The variables a job exports (before Ray starts) to run under the guard."""
    path = os.environ.get("PYTHONPATH", "")
    parts = [str(SITE_DIR)] + [p for p in path.split(os.pathsep) if p and p != str(SITE_DIR)]
    env = {ENV_GUARD: profile_name, "PYTHONPATH": os.pathsep.join(parts)}
    if log:
        env[ENV_LOG] = log
    return env


# -- state, events ----------------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.policy: Policy | None = None
        self.installed = False
        self.torch_armed = False
        self.patches: list[tuple[Any, str, Any, bool]] = []  # (owner, attr, old, had)
        self.meta_finders: list[Any] = []
        self.modes: list[Any] = []  # (thread id, mode) pushed by the guard
        self.thread_modes: dict[int, Any] = {}
        self.events: dict[str, int] = {}
        self.probing = threading.local()
        self.lock = threading.RLock()
        self.memory_cap: dict[str, Any] = {}
        self.import_hooks: dict[str, list[Callable[[Any], None]]] = {}
        self.mode_cls: Any = None
        self.ops_ended = False
        self.handles: list[Any] = []  # torch hook handles to remove
        self.optimizer_steps = 0
        self.blocked_seen: set[str] = set()


_STATE = _State()


def _probing() -> bool:
    return bool(getattr(_STATE.probing, "on", False))


@contextmanager
def probing() -> Iterator[None]:
    """Violations raised inside are not written to the log (``--check``'s probes)."""
    old = _probing()
    _STATE.probing.on = True
    try:
        yield
    finally:
        _STATE.probing.on = old


def record(event: str, **fields: Any) -> None:
    """Count an event and append it to ``$OLDGPU_GUARD_LOG`` (one JSON line)."""
    if _probing():
        return
    _STATE.events[event] = _STATE.events.get(event, 0) + 1
    policy = _STATE.policy
    path = policy.log if policy else os.environ.get(ENV_LOG)
    if not path:
        return
    line = {
        "event": event,
        "pid": os.getpid(),
        "time": round(time.time(), 3),
        "profile": policy.profile if policy else None,
        "argv": sys.argv[:3],
        **fields,
    }
    try:
        data = (json.dumps(line, default=str) + "\n").encode("utf-8")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write with O_APPEND: lines of processes do not mix
        finally:
            os.close(fd)
    except OSError as exc:
        sys.stderr.write(f"oldgpu guard: cannot write {path}: {exc}\n")


_SKIP_PARTS = (
    os.sep + "torch" + os.sep,
    os.sep + "contextlib.py",
    os.sep + "threading.py",
    os.sep + "functools.py",
    "<frozen ",
)


def call_site(skip: int = 1) -> str:
    """The first Python frame outside torch and the guard: ``file:line in function``."""
    frame = sys._getframe(skip)
    here = os.path.abspath(__file__)
    while frame is not None:
        filename = frame.f_code.co_filename
        if os.path.abspath(filename) != here and not any(p in filename for p in _SKIP_PARTS):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<no Python caller: C++ or the autograd engine>"


def violation(name: str, message: str, *, op: str = "", site: str | None = None) -> GuardViolation:
    """Record a violation and return the error to raise."""
    site = site if site is not None else call_site(2)
    policy = _STATE.policy
    where = f" at {site}" if site else ""
    gpu = f"{policy.gpu_name} ({policy.profile})" if policy else "the guarded GPU"
    full = f"{message}{where} [oldgpu guard: {gpu}]"
    record("violation", kind=name, op=op, site=site, message=message)
    return GuardViolation(name, full, op=op, site=site)


# -- patching helpers -------------------------------------------------------------------


def _patch(owner: Any, attr: str, value: Any) -> None:
    had = attr in vars(owner) if isinstance(owner, type) else hasattr(owner, attr)
    old = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    _STATE.patches.append((owner, attr, old, had))
    setattr(owner, attr, value)


def _is_blocked_module(fullname: str) -> bool:
    root = fullname.split(".", 1)[0]
    return root in BLOCKED_MODULES


def _norm_dist(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a module (torch, triton) finished importing."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _STATE.import_hooks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


class _HookedLoader:
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        for callback in _STATE.import_hooks.pop(self._name, []):
            _run_hook(callback, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _run_hook(callback: Callable[[Any], None], module: Any) -> None:
    try:
        callback(module)
    except Exception as exc:  # never break the import itself
        sys.stderr.write(f"oldgpu guard: arming after `import {module.__name__}` failed: {exc!r}\n")
        record("arm-failed", module=module.__name__, error=repr(exc))


def _when_imported(name: str, callback: Callable[[Any], None]) -> None:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and not getattr(spec, "_initializing", False):
        _run_hook(callback, module)
        return
    _STATE.import_hooks.setdefault(name, []).append(callback)


# -- flash-attn: not installed, as far as anyone can tell -------------------------------


def _block_flash_attn() -> None:
    path_finder = importlib.machinery.PathFinder
    original = path_finder.find_spec  # a bound classmethod

    def find_spec(cls: Any, fullname: str, path: Any = None, target: Any = None) -> Any:
        if _is_blocked_module(fullname):
            if fullname not in _STATE.blocked_seen:
                _STATE.blocked_seen.add(fullname)
                record("blocked-import", module=fullname)
            return None
        return original(fullname, path, target)

    _patch(path_finder, "find_spec", classmethod(find_spec))
    import importlib.metadata as metadata

    dist = metadata.Distribution
    original_from_name = dist.from_name  # bound classmethod

    def from_name(cls: Any, name: str) -> Any:
        if _norm_dist(name) in {_norm_dist(n) for n in BLOCKED_DISTRIBUTIONS}:
            raise metadata.PackageNotFoundError(name)
        return original_from_name(name)

    _patch(dist, "from_name", classmethod(from_name))
    for name in list(sys.modules):
        if _is_blocked_module(name):
            record("preimported", module=name)
            del sys.modules[name]


# -- torch ------------------------------------------------------------------------------


def _device_of(tensor: Any) -> str:
    return tensor.device.type


def _forbidden(torch: Any, policy: Policy) -> frozenset[Any]:
    return frozenset(getattr(torch, name) for name in policy.forbidden_dtypes)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


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
    device = policy.device
    tensor_type = torch.Tensor
    is_cuda = device == "cuda"

    class DtypeGuardMode(TorchDispatchMode):
        """Checks every aten op's outputs for a forbidden dtype on the guarded device."""

        checking = True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            out = func(*args, **kwargs) if kwargs else func(*args)
            if not self.checking:
                return out
            if isinstance(out, tensor_type):
                if out.dtype in forbidden and (
                    out.is_cuda if is_cuda else _device_of(out) == device
                ):
                    raise _dtype_error(func, out, policy)
            elif isinstance(out, (tuple, list)):
                for item in out:
                    if (
                        isinstance(item, tensor_type)
                        and item.dtype in forbidden
                        and (item.is_cuda if is_cuda else _device_of(item) == device)
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

    Threads other than the caller keep theirs (torch's modes are per thread) but do no
    checks any more. Everything else the guard enforces stays.
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
    record(
        "ops-check-ended",
        reason=reason,
        thread=threading.current_thread().name,
        popped=popped,
        other_threads=len(_STATE.thread_modes),
    )


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
    """Without the dispatch mode: ``.to``/``.bfloat16()``/``.half()``/``.type()`` only."""
    forbidden = _forbidden(torch, policy)

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


def _arm_memory(torch: Any, policy: Policy) -> None:
    if policy.device != "cuda" or not policy.memory_mib:
        return
    cap_bytes = policy.memory_mib * 1024 * 1024
    cuda = torch.cuda
    set_fraction = cuda.set_per_process_memory_fraction

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

    cuda._lazy_call(apply_cap)

    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        index = cuda._utils._get_device_index(device, optional=True) if device is not None else None
        index = cuda.current_device() if index is None else index
        total = cuda.get_device_properties(index).total_memory
        capped = min(fraction, memory_fraction(policy.memory_mib, total))
        if capped < fraction:
            record("ignored", what=f"set_per_process_memory_fraction({fraction}) above the cap")
        set_fraction(capped, index)

    _patch(cuda, "set_per_process_memory_fraction", set_per_process_memory_fraction)
    mem_get_info = cuda.mem_get_info

    @functools.wraps(mem_get_info)
    def guarded_mem_get_info(device: Any = None) -> tuple[int, int]:
        free, _total = mem_get_info(device)
        reserved = cuda.memory_reserved(device)
        return max(0, min(free, cap_bytes - reserved)), cap_bytes

    _patch(cuda, "mem_get_info", guarded_mem_get_info)
    if getattr(cuda, "memory", None) is not None and hasattr(cuda.memory, "mem_get_info"):
        _patch(cuda.memory, "mem_get_info", guarded_mem_get_info)


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
    record(
        "armed",
        torch=getattr(torch, "__version__", "?"),
        thread=threading.current_thread().name,
        main_thread=threading.current_thread() is threading.main_thread(),
        dtype_check=policy.dtype_check,
        ops_steps=policy.ops_steps,
        memory_mib=policy.memory_mib,
    )


# -- install / uninstall ----------------------------------------------------------------


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
        _STATE.events = {}
        _STATE.mode_cls = None
        _STATE.ops_ended = False
        _STATE.optimizer_steps = 0
        _STATE.blocked_seen = set()


def active() -> Policy | None:
    return _STATE.policy if _STATE.installed else None


# -- check: what this process enforces ---------------------------------------------------


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


def run(args: argparse.Namespace) -> Result:
    if args.env:
        env = environment(args.profile or DEFAULT_PROFILE, args.log)
        text = "\n".join(f"export {k}={json.dumps(v)}" for k, v in env.items())
        return Result(payload=env, text=text)
    if not active():
        if args.profile:
            install(policy_for(args.profile, log=os.environ.get(ENV_LOG) or None))
        else:
            install()
    doc = check(probe=not args.no_probe)
    code = 0 if doc["active"] else 1
    return Result(payload=doc, text=_text(doc), code=code)


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "guard",
        parents=[common],
        help="enforce on a newer GPU what an old one cannot do (bf16, TF32, flash, compile)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--check",
        action="store_true",
        help="print what the guard enforces in this process (the default)",
    )
    what.add_argument(
        "--env", action="store_true", help="print the exports a job needs to run guarded"
    )
    parser.add_argument(
        "--profile", metavar="NAME", help=f"the profile to guard as (default ${ENV_GUARD})"
    )
    parser.add_argument("--log", metavar="FILE", help=f"with --env: ${ENV_LOG}")
    parser.add_argument("--no-probe", action="store_true", help="do not try the forbidden things")
    parser.set_defaults(func=run)
