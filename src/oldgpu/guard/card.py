"""The card-wide memory cap: every guarded process on one GPU shares the profile's memory.

A P40 has 24 GiB for all of a job's processes together (the trainer, a rollout server,
each with its CUDA context); capping each process's allocator alone lets two of them
hold more than the card. So each guarded process records what it holds in a ledger per
GPU, and what the card has left for it becomes its allocator's limit:

- The ledger is a directory per GPU (its UUID) under ``OLDGPU_GUARD_LEDGER`` (default
  ``/dev/shm/oldgpu-guard-<uid>``): one ``<pid>.json`` per process (its reserved bytes,
  its CUDA context allowance ``OLDGPU_GUARD_CONTEXT_MIB``, its command line), written
  with temp + rename under an ``flock`` on the directory's ``.lock``. An entry whose
  process is gone (no such pid, or a pid reused by a later process) is ignored and
  removed, so a killed worker frees its share.
- The check costs nothing per tensor: the process's ``set_per_process_memory_fraction``
  is the card's cap less the other processes' entries and its own context, so the
  caching allocator itself refuses growth past what the card has left (the check runs in
  C++ only when the allocator grows). When it refuses, an out-of-memory observer reads
  the ledger afresh and raises :class:`GuardViolation` ``guard-card-memory``, naming
  this process (pid, command line) and the others with their MiB.
- A watcher thread (every ``EVERY_S``) publishes this process's reserved bytes when they
  changed and re-reads the others' (so the limit follows a server that sleeps or wakes).
  Two processes that grow within one interval may both pass their stale limits: the
  publication that brings the sum over the cap records the violation naming its process
  and stops that process's allocator from growing, so the next growth raises.

Why a ledger and not NVML's per-process memory: inside a container NVML reports host
pids (or no per-process memory at all) and counts processes no guard speaks for (on the
lent GPU, others'); a ledger counts exactly the guarded processes, works on CPU in
tests, and reads in microseconds. The context allowance is a measured constant (a CUDA
context outside the allocator: 500-612 MiB on the H100), the same the planner counts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oldgpu.guard.policy import GuardViolation, Policy, memory_fraction
from oldgpu.guard.state import _STATE, record, violation
from oldgpu.output import EngineError

ENV_LEDGER = "OLDGPU_GUARD_LEDGER"  # a directory; off/0: each process capped alone
ENV_CONTEXT = "OLDGPU_GUARD_CONTEXT_MIB"
DEFAULT_CONTEXT_MIB = 600  # a CUDA context outside the allocator: 500-612 MiB measured
EVERY_S = 0.05
PUBLISH_STEP_MIB = 16  # publish a change of reserved memory at least this large
MIB = 1024 * 1024
_OFF = ("0", "off", "no", "false")


def ledger_root(environ: dict[str, str] | None = None) -> Path | None:
    """Where the ledgers live, or None when the card-wide cap is off."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_LEDGER, "").strip()
    if raw.lower() in _OFF:
        return None
    if raw:
        return Path(raw)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"oldgpu-guard-{os.getuid()}"


def context_mib(environ: dict[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    raw = env.get(ENV_CONTEXT, "").strip()
    if not raw:
        return DEFAULT_CONTEXT_MIB
    try:
        value = int(float(raw))
    except ValueError:
        value = -1
    if value < 0:
        raise EngineError("guard-context-invalid", f"{ENV_CONTEXT}={raw!r}: expected MiB >= 0")
    return value


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc): a reused pid has another."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return started is None or _start_time(pid) in (None, started)


def command_of(pid: int) -> str:
    """A process's command line as ``ps`` shows it (Ray's workers set ``ray::Role.method``)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return " ".join(sys.argv) if pid == os.getpid() else "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160] or "?"


@dataclass
class Entry:
    pid: int
    reserved_mib: float
    context_mib: float
    command: str
    started: str | None = None

    @property
    def total_mib(self) -> float:
        return self.reserved_mib + self.context_mib

    def describe(self) -> str:
        return (
            f"pid {self.pid} ({self.command}): {self.total_mib:.0f} MiB "
            f"({self.reserved_mib:.0f} reserved + {self.context_mib:.0f} context)"
        )


class CardLedger:
    """The guarded processes' memory on one GPU, and the check that their sum fits."""

    def __init__(self, root: Path, device_key: str, cap_mib: int) -> None:
        self.dir = Path(root) / device_key.replace("/", "_")
        self.cap_mib = cap_mib
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _entries(self) -> list[Entry]:
        found = []
        for path in self.dir.glob("*.json"):
            try:
                entry = Entry(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # a torn or foreign file counts for nothing
            if _alive(entry.pid, entry.started):
                found.append(entry)
            else:
                path.unlink(missing_ok=True)  # a dead process frees its share
        return sorted(found, key=lambda e: e.pid)

    def _write(self, entry: Entry) -> None:
        tmp = self.dir / f".{entry.pid}.tmp"
        tmp.write_text(json.dumps(asdict(entry)))
        os.replace(tmp, self.dir / f"{entry.pid}.json")  # readers see old or new, never half

    def entries(self) -> list[Entry]:
        with self._locked():
            return self._entries()

    def others(self, pid: int) -> list[Entry]:
        return [e for e in self.entries() if e.pid != pid]

    def left_for(self, pid: int, context: float) -> float:
        """MiB this process's allocator may reserve: the cap less the others and its context."""
        return self.cap_mib - sum(e.total_mib for e in self.others(pid)) - context

    def publish(self, entry: Entry, extra_mib: float = 0.0) -> tuple[float, list[Entry]]:
        """Record ``entry`` and return (the card's sum, the others); the sum counts
        ``extra_mib`` more (an allocation asked for) that is not recorded."""
        with self._locked():
            others = [e for e in self._entries() if e.pid != entry.pid]
            self._write(entry)
        return sum(e.total_mib for e in others) + entry.total_mib + extra_mib, others

    def claim(self, entry: Entry, extra_mib: float) -> float:
        """Grow ``entry`` (what the process holds now) by ``extra_mib`` if the card's sum
        stays under the cap, and record it; else record ``entry`` as it is and raise
        ``guard-card-memory``, naming the process. Returns the card's sum."""
        with self._locked():
            others = [e for e in self._entries() if e.pid != entry.pid]
            total = sum(e.total_mib for e in others) + entry.total_mib + extra_mib
            fits = total <= self.cap_mib
            grown = Entry(**{**asdict(entry), "reserved_mib": entry.reserved_mib + extra_mib})
            self._write(grown if fits else entry)
        if not fits:
            raise over_card(entry, others, self.cap_mib, extra_mib)
        return total

    def release(self, pid: int) -> None:
        with self._locked():
            (self.dir / f"{pid}.json").unlink(missing_ok=True)


def over_card(entry: Entry, others: list[Entry], cap_mib: int, extra_mib: float) -> GuardViolation:
    asked = f" asking {extra_mib:.0f} MiB more" if extra_mib else ""
    beside = "; ".join(o.describe() for o in others) or "no other guarded process"
    total = entry.total_mib + extra_mib + sum(o.total_mib for o in others)
    message = (
        f"the card's memory: {entry.describe()}{asked} would bring the guarded processes "
        f"on this GPU to {total:.0f} MiB, over the card's {cap_mib} MiB; beside it: {beside}"
    )
    return violation(
        "guard-card-memory", message, op="card-memory", site=f"pid {entry.pid} ({entry.command})"
    )


class CardWatch:
    """This process's side of the ledger on one CUDA device (its allocator's limit)."""

    def __init__(self, torch: Any, index: int, ledger: CardLedger, context: int) -> None:
        self.torch = torch
        self.index = index
        self.ledger = ledger
        self.context = context
        self.total = torch.cuda.get_device_properties(index).total_memory
        self.pid = os.getpid()
        self.started = _start_time(self.pid)
        self.requested = 1.0  # the fraction the program asked for (never raised above)
        self.published = -1.0
        self.peak_mib = 0.0
        self.peak_processes: list[dict[str, Any]] = []
        self.limit_mib = 0.0
        self.over = False

    def entry(self, reserved_mib: float) -> Entry:
        return Entry(
            self.pid, round(reserved_mib, 1), self.context, command_of(self.pid), self.started
        )

    def reserved_mib(self) -> float:
        return self.torch.cuda.memory_reserved(self.index) / MIB

    def apply_limit(self, others: list[Entry] | None = None) -> None:
        if others is None:
            others = self.ledger.others(self.pid)
        left = self.ledger.cap_mib - sum(e.total_mib for e in others) - self.context
        if self.over:  # the sum crossed the cap: no growth until the others shrink
            left = min(left, self.reserved_mib())
        self.limit_mib = max(0.0, left)
        fraction = min(self.requested, memory_fraction(int(self.limit_mib), self.total))
        _STATE.set_fraction(fraction, self.index)

    def tick(self) -> None:
        """Publish a change of this process's memory, note the card's peak, follow the others."""
        reserved = self.reserved_mib()
        if abs(reserved - self.published) >= PUBLISH_STEP_MIB or self.published < 0:
            entry = self.entry(reserved)
            total, others = self.ledger.publish(entry)
            self.published = reserved
            if total > self.peak_mib:
                self.peak_mib = total
                self.peak_processes = [
                    {"pid": e.pid, "mib": round(e.total_mib), "command": e.command}
                    for e in sorted([*others, entry], key=lambda e: e.pid)
                ]
            if total > self.ledger.cap_mib and not self.over:
                self.over = True  # the violation is recorded (the log); growth now raises
                over_card(entry, others, self.ledger.cap_mib, 0.0)
            elif total <= self.ledger.cap_mib:
                self.over = False
            self.apply_limit(others)
        else:
            self.apply_limit()

    def on_oom(self, alloc_bytes: int) -> None:
        """The allocator refused to grow: if the card is why, raise the named violation."""
        reserved = self.reserved_mib()
        entry = self.entry(reserved)
        total, others = self.ledger.publish(entry, alloc_bytes / MIB)
        self.published = reserved
        if total > self.ledger.cap_mib:
            raise over_card(entry, others, self.ledger.cap_mib, alloc_bytes / MIB)
        self.over = False
        # The limit was stale (another process shrank since): the next try may pass.
        record("card-limit-stale", device=self.index, asked_mib=round(alloc_bytes / MIB))
        self.apply_limit(others)


def arm(torch: Any, policy: Policy) -> dict[int, CardWatch]:
    """Put this process's CUDA devices under the card-wide cap (after CUDA initialised)."""
    root = ledger_root()
    if root is None or not policy.memory_mib:
        return {}
    context = context_mib()
    cuda = torch.cuda
    watches: dict[int, CardWatch] = {}
    for index in range(cuda.device_count()):
        props = cuda.get_device_properties(index)
        key = str(getattr(props, "uuid", "") or f"index-{index}")
        watches[index] = CardWatch(torch, index, CardLedger(root, key, policy.memory_mib), context)
    _STATE.card = watches

    def observer(device: int, alloc: int, _allowed: int, _free: int) -> None:
        watch = watches.get(device)
        if watch is not None:
            watch.on_oom(alloc)

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(observer)
    for watch in watches.values():
        # The limit from the start; the entry once the process holds memory there (a
        # context is made on a device's first allocation, not when CUDA initialises).
        watch.apply_limit()

    def loop() -> None:
        last_record = time.monotonic()
        recorded = 0.0
        while True:
            time.sleep(EVERY_S)
            try:
                for watch in watches.values():
                    # only devices this process holds (or held) memory on
                    if watch.published >= 0 or cuda.memory_reserved(watch.index) > 0:
                        watch.tick()
            except Exception as exc:  # the cap never kills the process it guards
                record("card-watch-failed", error=repr(exc))
                return
            peak = max(w.peak_mib for w in watches.values())
            if peak > recorded and time.monotonic() - last_record >= 2.0:
                record("card-memory", devices=card_summary(watches))
                recorded, last_record = peak, time.monotonic()

    threading.Thread(target=loop, name="oldgpu-card-watch", daemon=True).start()
    import atexit

    def release() -> None:
        for watch in watches.values():
            if watch.published >= 0:
                with contextlib.suppress(OSError):
                    watch.ledger.release(watch.pid)
        if any(w.peak_mib for w in watches.values()):
            record("card-memory", devices=card_summary(watches))

    atexit.register(release)
    record("card-cap", ledger=str(root), context_mib=context, cap_mib=policy.memory_mib)
    return watches


def card_summary(watches: dict[int, CardWatch]) -> dict[str, Any]:
    return {
        str(i): {
            "peak_mib": round(w.peak_mib),
            "cap_mib": w.ledger.cap_mib,
            "limit_mib": round(w.limit_mib),
            "at_peak": w.peak_processes,
        }
        for i, w in watches.items()
        if w.peak_mib
    }
