"""Peak GPU memory per phase of a verl step, for calibrating the planner (benchmarks only).

With ``OLDGPU_GUARD_MEMORY_PHASES=1`` a guarded process on CUDA starts a daemon thread
that reads the caching allocator's peak every ``EVERY_S``, resets it, and files that
window's peak under the phase the process is in: the outermost verl worker method on
any thread's Python stack, and the innermost step of it that the planner tells apart
(the entropy, a backward, the optimizer step...). Every few seconds it appends a
``memory-phases`` event (the running maxima, MiB) to the guard's log. It resets torch's
peak counters, so verl's own ``perf/max_memory_*`` metrics of a traced run report
windows, not the step: trace a calibration run, never a timed one.
"""

from __future__ import annotations

import sys
import threading
import time
from types import FrameType
from typing import Any

from oldgpu.guard.state import record

# verl 0.5.0's worker methods, one per phase the planner estimates (plan/memory.py).
PHASES = {
    "generate_sequences": "generate",
    "compute_log_prob": "actor_log_prob",
    "compute_ref_log_prob": "ref_log_prob",
    "compute_values": "critic_values",
    "update_critic": "critic_update",
    "update_actor": "actor_update",
    "save_checkpoint": "save_checkpoint",
}
# Inside a phase, the steps whose memory the planner counts apart (its "moments").
STEPS = (
    "entropy_from_logits",
    "logprobs_from_logits",
    "fp16_copy",
    "generate",
    "backward",
    "clip_grad_norm_",
    "step",  # the optimizer's
    "_forward_micro_batch",
)
EVERY_S = 0.01
WRITE_EVERY_S = 5.0
MIB = 1024 * 1024


def where(frames: dict[int, FrameType], skip: int | None = None) -> tuple[str, str]:
    """(phase, step) of the stacks in ``frames`` (thread id -> innermost frame): the
    outermost worker method in PHASES and, inside it, the innermost name in STEPS."""
    for ident, frame in frames.items():
        if ident == skip:
            continue
        phase = step = ""
        f: FrameType | None = frame
        while f is not None:
            name = f.f_code.co_name
            if name in PHASES:
                phase = PHASES[name]  # walking outward: the last one found is the outermost
            elif not step and name in STEPS:
                step = name
            f = f.f_back
        if phase:
            return phase, step
    return "", ""


class Tracer:
    """The maxima per "phase/step" seen so far, in MiB."""

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self.peaks: dict[str, dict[str, float]] = {}

    def sample(self, frames: dict[int, FrameType], skip: int | None = None) -> None:
        if not self.cuda.is_initialized():
            return
        allocated = self.cuda.max_memory_allocated() / MIB
        reserved = self.cuda.max_memory_reserved() / MIB
        self.cuda.reset_peak_memory_stats()
        phase, step = where(frames, skip)
        key = f"{phase or 'other'}/{step or '-'}"
        old = self.peaks.setdefault(key, {"allocated_mib": 0.0, "reserved_mib": 0.0})
        old["allocated_mib"] = round(max(old["allocated_mib"], allocated), 1)
        old["reserved_mib"] = round(max(old["reserved_mib"], reserved), 1)


def _loop(tracer: Tracer) -> None:
    me = threading.get_ident()
    last = time.monotonic()
    while True:
        time.sleep(EVERY_S)
        try:
            tracer.sample(sys._current_frames(), skip=me)
        except Exception as e:  # a traced run must never fail because of the tracer
            record("memory-phases-failed", error=repr(e))
            return
        if time.monotonic() - last >= WRITE_EVERY_S and tracer.peaks:
            record("memory-phases", peaks=dict(sorted(tracer.peaks.items())))
            last = time.monotonic()


def start(torch: Any) -> threading.Thread:
    thread = threading.Thread(
        target=_loop, args=(Tracer(torch.cuda),), name="oldgpu-memory-phases", daemon=True
    )
    thread.start()
    record("memory-phases-started", every_s=EVERY_S)
    return thread
