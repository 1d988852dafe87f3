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
- The GPU's usable memory is capped for every guarded process on it together, contexts
  counted (:mod:`~oldgpu.guard.card`, docs/guard.md): each process's allocator may grow
  only into what the others leave, and the growth that would cross the card raises
  ``guard-card-memory`` naming the process; ``torch.cuda.mem_get_info`` reports the cap.

Activation is by environment, so Ray's workers inherit it: ``OLDGPU_GUARD=<profile>``
plus ``src/oldgpu/guard_site`` first on PYTHONPATH (its ``sitecustomize`` calls
:func:`install`). Variables:

- ``OLDGPU_GUARD``: a profile (``pascal``, ``pascal-6.1``, ``volta``...; ``1`` = pascal).
- ``OLDGPU_GUARD_MEMORY_MIB``: what the guarded processes on one GPU may hold together
  (allocators + contexts); default per compute capability (``DEFAULT_MEMORY_MIB``; P40:
  23040 = 22.5 GiB); ``0`` = no cap.
- ``OLDGPU_GUARD_LEDGER``: the card-wide ledger's directory (default
  ``/dev/shm/oldgpu-guard-<uid>``; ``off``: each process capped alone);
  ``OLDGPU_GUARD_CONTEXT_MIB``: the context each process counts (default 600).
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
- ``OLDGPU_GUARD_STORAGE_DTYPES``: ``bf16`` and/or ``fp16``, forbidden dtypes that may
  still be stored and converted (a LoRA job's frozen base at 16 bits, its ``base_dtype``;
  the job sets it): copies, views and conversions pass, 16-bit arithmetic still raises.

Modes are thread-local in torch: the dispatch mode is pushed on the thread that imports
torch, through a hook on ``threading.Thread`` on every thread started after, and through
a global module forward pre-hook on any other thread (one made in C++) the first time it
runs a module; the autograd engine's device threads inherit the caller's modes. The
guard never imports torch itself: it hooks torch's import, so non-torch processes pay
nothing.

Where each part lives: :mod:`~oldgpu.guard.policy` (what a profile forbids, the
variables), :mod:`~oldgpu.guard.arm` (install, uninstall), :mod:`~oldgpu.guard.imports`
(the import hooks, flash-attn hidden), :mod:`~oldgpu.guard.dtype` (the dtype checks,
autocast), :mod:`~oldgpu.guard.backends` (TF32, SDPA, compile, Triton, the memory cap),
:mod:`~oldgpu.guard.card` (the card-wide cap), :mod:`~oldgpu.guard.state` (the event
log, violations), :mod:`~oldgpu.guard.report` (``--check``'s read-back) and
:mod:`~oldgpu.guard.cli` (the command).
"""

from __future__ import annotations

from oldgpu.guard.arm import active, install, uninstall
from oldgpu.guard.cli import add_parser, run
from oldgpu.guard.dtype import end_ops_check
from oldgpu.guard.imports import _block_flash_attn as _block_flash_attn
from oldgpu.guard.policy import (
    BLOCKED_DISTRIBUTIONS,
    BLOCKED_MODULES,
    DEFAULT_MEMORY_MIB,
    DEFAULT_PROFILE,
    DTYPE_CHECKS,
    ENV_DEVICE,
    ENV_DTYPE,
    ENV_DTYPE_CHECK,
    ENV_GUARD,
    ENV_LOG,
    ENV_MEMORY,
    ENV_OPS_STEPS,
    ENV_STORAGE_DTYPES,
    GPU_NAMES,
    SITE_DIR,
    GuardViolation,
    Policy,
    enabled,
    environment,
    memory_fraction,
    policy_for,
    policy_from_env,
    triton_too_old_message,
)
from oldgpu.guard.report import _text as _text
from oldgpu.guard.report import check
from oldgpu.guard.state import _STATE as _STATE
from oldgpu.guard.state import call_site, probing, record, violation

__all__ = [
    "BLOCKED_DISTRIBUTIONS",
    "BLOCKED_MODULES",
    "DEFAULT_MEMORY_MIB",
    "DEFAULT_PROFILE",
    "DTYPE_CHECKS",
    "ENV_DEVICE",
    "ENV_DTYPE",
    "ENV_DTYPE_CHECK",
    "ENV_GUARD",
    "ENV_LOG",
    "ENV_MEMORY",
    "ENV_OPS_STEPS",
    "ENV_STORAGE_DTYPES",
    "GPU_NAMES",
    "SITE_DIR",
    "GuardViolation",
    "Policy",
    "active",
    "add_parser",
    "call_site",
    "check",
    "enabled",
    "end_ops_check",
    "environment",
    "install",
    "memory_fraction",
    "policy_for",
    "policy_from_env",
    "probing",
    "record",
    "run",
    "triton_too_old_message",
    "uninstall",
    "violation",
]
