"""The guard's state in this process, its event log, and how it reports a violation."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from oldgpu.guard.policy import ENV_LOG, GuardViolation, Policy


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
        # The card-wide cap (guard/card.py): a watch per CUDA device, and torch's own
        # set_per_process_memory_fraction (the guard's wrapper caps what programs ask).
        self.card: dict[int, Any] = {}
        self.set_fraction: Callable[[float, int], None] = lambda fraction, index: None


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


# Frames skipped when naming the call site: the guard's own files, torch, the stdlib's glue.
_HERE = os.path.dirname(os.path.abspath(__file__))
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
    while frame is not None:
        filename = frame.f_code.co_filename
        if os.path.dirname(os.path.abspath(filename)) != _HERE and not any(
            p in filename for p in _SKIP_PARTS
        ):
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


def _patch(owner: Any, attr: str, value: Any) -> None:
    had = attr in vars(owner) if isinstance(owner, type) else hasattr(owner, attr)
    old = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    _STATE.patches.append((owner, attr, old, had))  # for uninstall() to put back
    setattr(owner, attr, value)
