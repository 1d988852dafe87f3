"""The card-wide cap (guard/card.py): guarded processes on one GPU share its memory.

The ledger's tests run real processes on the CPU (each claims MiB as its allocator would
on growth); the CUDA test runs two guarded torch processes that each fit the cap alone
and together do not (skipped without a GPU; run on the lent one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from oldgpu import guard
from oldgpu.guard import card

SRC = Path(__file__).resolve().parents[1] / "src"

# A process that holds `held` MiB (plus its context) and asks the ledger for `ask` more,
# as the guard's allocator observer does on growth; then keeps what it holds until told.
CLAIMER = """
import json, os, sys
from pathlib import Path
from oldgpu.guard import card
root, cap, held, ask, ctx = sys.argv[2], int(sys.argv[3]), *map(float, sys.argv[4:7])
ledger = card.CardLedger(Path(root), "GPU-0000", cap)
pid = os.getpid()
entry = card.Entry(pid, held, ctx, card.command_of(pid), card._start_time(pid))
try:
    total = ledger.claim(entry, ask)
except Exception as exc:
    print(json.dumps({"refused": exc.name, "message": exc.message}), flush=True)
    sys.exit(3)
print(json.dumps({"total": total}), flush=True)
sys.stdin.readline()
"""


def _claimer(root: Path, cap: int, held: float, ask: float, ctx: float = 600, role: str = "x"):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    script = root / "claimer.py"
    script.write_text(CLAIMER)
    return subprocess.Popen(
        [sys.executable, str(script), role, str(root), str(cap), str(held), str(ask), str(ctx)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _first_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return json.loads(line)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.wait(timeout=30)


def test_two_processes_under_the_cap_alone_cross_it_together(tmp_path) -> None:
    trainer = _claimer(tmp_path, 23040, 0, 12000, role="trainer")
    try:
        assert _first_line(trainer) == {"total": 12600}
        server = _claimer(tmp_path, 23040, 0, 11000, role="server")
        out = _first_line(server)
        assert server.wait(timeout=30) == 3
        assert out["refused"] == "guard-card-memory"
        # the refused process named with its pid and command line, the other beside it
        assert f"pid {server.pid} (" in out["message"] and "server" in out["message"]
        assert f"pid {trainer.pid} (" in out["message"] and "trainer" in out["message"]
        assert "24200 MiB, over the card's 23040 MiB" in out["message"]
        # what it held stays counted until it is gone; it asked for nothing it got
        ledger = card.CardLedger(tmp_path, "GPU-0000", 23040)
        assert [(e.pid, e.reserved_mib) for e in ledger.entries()] == [(trainer.pid, 12000)]
    finally:
        _end(trainer)


def test_one_alone_passes_and_a_second_that_fits_passes(tmp_path) -> None:
    first = _claimer(tmp_path, 23040, 0, 22000)
    try:
        assert _first_line(first) == {"total": 22600}
    finally:
        _end(first)
    # gone: its entry no longer counts (released by its end, or stale)
    a, b = _claimer(tmp_path, 23040, 0, 10000), None
    try:
        assert _first_line(a) == {"total": 10600}
        b = _claimer(tmp_path, 23040, 0, 11000)
        assert _first_line(b) == {"total": 22200}
    finally:
        _end(a)
        if b is not None:
            _end(b)


def test_a_dead_process_entry_is_ignored(tmp_path) -> None:
    big = _claimer(tmp_path, 23040, 0, 20000)
    assert _first_line(big) == {"total": 20600}
    ledger = card.CardLedger(tmp_path, "GPU-0000", 23040)
    assert [e.pid for e in ledger.entries()] == [big.pid]
    os.kill(big.pid, signal.SIGKILL)  # no chance to release: the entry stays on disk
    big.wait(timeout=30)
    assert (ledger.dir / f"{big.pid}.json").exists()
    late = _claimer(tmp_path, 23040, 0, 20000)
    try:
        assert _first_line(late) == {"total": 20600}
    finally:
        _end(late)
    assert not (ledger.dir / f"{big.pid}.json").exists()  # removed as stale


def test_a_reused_pid_does_not_keep_a_dead_entry(tmp_path) -> None:
    ledger = card.CardLedger(tmp_path, "GPU-0000", 1000)
    me = os.getpid()
    # my pid, but another start time: the process that wrote it is gone
    ledger._write(card.Entry(me, 900, 0, "old", "1"))
    assert ledger.entries() == []
    ledger._write(card.Entry(me, 900, 0, "me", card._start_time(me)))
    assert [e.command for e in ledger.entries()] == ["me"]


def test_left_for_counts_the_others_and_both_contexts(tmp_path) -> None:
    ledger = card.CardLedger(tmp_path, "GPU-0000", 23040)
    ledger._write(card.Entry(os.getppid(), 9000, 600, "server", card._start_time(os.getppid())))
    assert ledger.left_for(os.getpid(), 600) == 23040 - 9600 - 600


def test_ledger_root_and_context_from_the_environment(tmp_path) -> None:
    assert card.ledger_root({card.ENV_LEDGER: "off"}) is None
    assert card.ledger_root({card.ENV_LEDGER: str(tmp_path)}) == tmp_path
    assert card.ledger_root({}).name == f"oldgpu-guard-{os.getuid()}"
    assert card.context_mib({}) == card.DEFAULT_CONTEXT_MIB
    assert card.context_mib({card.ENV_CONTEXT: "512"}) == 512
    with pytest.raises(guard.GuardViolation.__mro__[1]) as exc:  # EngineError
        card.context_mib({card.ENV_CONTEXT: "lots"})
    assert exc.value.name == "guard-context-invalid"


# -- on a GPU: two guarded torch processes -------------------------------------------------

TORCH_CHILD = """
import json, sys, time
import torch
gib = float(sys.argv[2])
x = torch.empty(int(gib * 1024**3), dtype=torch.uint8, device="cuda")
time.sleep(0.5)  # the watcher publishes (every 50 ms)
print(json.dumps({"held_gib": gib}), flush=True)
try:
    y = torch.empty(int(float(sys.argv[3]) * 1024**3), dtype=torch.uint8, device="cuda")
    print(json.dumps({"second": "allocated"}), flush=True)
except Exception as exc:
    print(json.dumps({"second": getattr(exc, "name", type(exc).__name__),
                      "message": str(exc)[:2000]}), flush=True)
sys.stdin.readline()
"""


def _torch_child(tmp_path: Path, first: float, second: float, role: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLDGPU_GUARD")}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(guard.SITE_DIR), str(SRC)]),
            guard.ENV_GUARD: "pascal",
            guard.ENV_LOG: str(tmp_path / "guard.jsonl"),
            card.ENV_LEDGER: str(tmp_path / "ledger"),
        }
    )
    script = tmp_path / "child.py"
    script.write_text(TORCH_CHILD)
    return subprocess.Popen(
        [sys.executable, str(script), role, str(first), str(second)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_on_cuda_the_second_process_that_crosses_the_card_is_refused(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # The P40's 22.5 GiB: 10 GiB each fits alone, and both fit; 10 + 10 more does not.
    trainer = _torch_child(tmp_path, 10, 0.001, "trainer")
    server = None
    try:
        assert _first_line(trainer) == {"held_gib": 10}
        assert _first_line(trainer) == {"second": "allocated"}
        server = _torch_child(tmp_path, 10, 2, "server")
        assert _first_line(server) == {"held_gib": 10}  # 20 GiB + 2 contexts: fits
        out = _first_line(server)
        assert out["second"] == "guard-card-memory", out
        assert f"pid {server.pid} (" in out["message"] and "server" in out["message"]
        assert f"pid {trainer.pid} (" in out["message"]
    finally:
        _end(trainer)
        if server is not None:
            _end(server)
    logged = [json.loads(x) for x in (tmp_path / "guard.jsonl").read_text().splitlines()]
    kinds = [e.get("kind") for e in logged if e["event"] == "violation"]
    assert kinds == ["guard-card-memory"]
    peaks = [e for e in logged if e["event"] == "card-memory"]
    assert peaks and max(d["peak_mib"] for e in peaks for d in e["devices"].values()) > 20 * 1024


# -- the watcher's arithmetic, on CPU (torch.cuda's few calls it makes, recorded) ----------


class _Cuda:
    """The calls CardWatch makes to torch.cuda: reserved bytes, total memory."""

    def __init__(self, reserved_mib: float, total_mib: int = 81559) -> None:
        self.reserved = reserved_mib * card.MIB
        self.total = total_mib * card.MIB

    def memory_reserved(self, index: int) -> int:
        return int(self.reserved)

    def get_device_properties(self, index: int):
        return type("Props", (), {"total_memory": self.total})()


def _watch(tmp_path, reserved_mib: float, fractions: list, cap: int = 23040) -> card.CardWatch:
    torch = type("Torch", (), {"cuda": _Cuda(reserved_mib)})()
    guard.uninstall()
    guard.install(guard.policy_for("pascal", device="cpu", memory_mib=None))
    card._STATE.set_fraction = lambda fraction, index: fractions.append(fraction)
    return card.CardWatch(torch, 0, card.CardLedger(tmp_path, "GPU-0000", cap), 600)


def test_the_limit_is_what_the_others_leave_and_follows_them(tmp_path) -> None:
    fractions: list[float] = []
    try:
        watch = _watch(tmp_path, 4096, fractions)
        other = os.getppid()
        watch.ledger._write(card.Entry(other, 9000, 600, "server", card._start_time(other)))
        watch.tick()  # publishes 4096 + 600, reads the server's 9600
        assert watch.limit_mib == 23040 - 9600 - 600
        assert fractions[-1] == pytest.approx((23040 - 9600 - 600) / 81559)
        watch.ledger.release(other)  # the server went to sleep (or died): its share is free
        watch.tick()
        assert watch.limit_mib == 23040 - 600
        assert watch.peak_mib == 4096 + 600 + 9600
        assert [p["pid"] for p in watch.peak_processes] == sorted([os.getpid(), other])
    finally:
        guard.uninstall()


def test_growth_that_crosses_between_ticks_is_recorded_and_stops(tmp_path) -> None:
    """Two processes that grew within one interval: the publication that crosses the cap
    records the violation naming this process, and its allocator may grow no further."""
    log = tmp_path / "guard.jsonl"
    fractions: list[float] = []
    try:
        watch = _watch(tmp_path / "ledger", 12000, fractions)
        guard.uninstall()
        guard.install(guard.policy_for("pascal", device="cpu", memory_mib=None, log=str(log)))
        card._STATE.set_fraction = lambda fraction, index: fractions.append(fraction)
        other = os.getppid()
        watch.ledger._write(card.Entry(other, 11000, 600, "trainer", card._start_time(other)))
        watch.tick()
        assert watch.over and watch.limit_mib == 23040 - 11600 - 600 < 12000  # no growth
        logged = [json.loads(x) for x in log.read_text().splitlines()]
        bad = [e for e in logged if e["event"] == "violation"]
        assert [e["kind"] for e in bad] == ["guard-card-memory"]
        assert f"pid {os.getpid()} (" in bad[0]["message"] and "trainer" in bad[0]["message"]
        # the next growth raises: the allocator's observer finds the card over
        with pytest.raises(guard.GuardViolation) as exc:
            watch.on_oom(64 * card.MIB)
        assert exc.value.name == "guard-card-memory" and "asking 64 MiB more" in exc.value.message
        # the other shrank: the card has room again, the limit follows
        watch.ledger._write(card.Entry(other, 1000, 600, "trainer", card._start_time(other)))
        watch.on_oom(64 * card.MIB)  # no violation: torch's own OOM stands (a stale limit)
        assert not watch.over and watch.limit_mib == 23040 - 1600 - 600
    finally:
        guard.uninstall()
