"""The guard's memory tracer (bench only): which verl phase a window's peak belongs to."""

from __future__ import annotations

import sys
import threading

from oldgpu.guard import phases


def _stack_of(*names: str):
    """Run nested functions named ``names`` (outermost first) in a thread, stopped in the
    innermost; return (that thread's id, a snapshot of every thread's frames, release)."""
    ready, release = threading.Event(), threading.Event()

    def make(i: int):
        if i == len(names):

            def leaf():
                ready.set()
                release.wait(10)

            return leaf
        inner = make(i + 1)
        ns: dict = {"inner": inner}
        exec(f"def {names[i]}():\n    inner()", ns)
        return ns[names[i]]

    t = threading.Thread(target=make(0), daemon=True)
    t.start()
    assert ready.wait(10)
    return t.ident, sys._current_frames(), release


def test_the_outermost_worker_method_and_the_innermost_step():
    ident, frames, release = _stack_of(
        "compute_ref_log_prob", "compute_log_prob", "_forward_micro_batch", "entropy_from_logits"
    )
    try:
        mine = {ident: frames[ident]}
        # The ref's log-prob runs the actor's compute_log_prob: the worker method decides.
        assert phases.where(mine) == ("ref_log_prob", "entropy_from_logits")
    finally:
        release.set()


def test_update_backward_and_nothing_outside_a_phase():
    ident, frames, release = _stack_of("update_actor", "update_policy", "backward")
    try:
        assert phases.where({ident: frames[ident]}) == ("actor_update", "backward")
        assert phases.where({ident: frames[ident]}, skip=ident) == ("", "")
        me = threading.get_ident()
        assert phases.where({me: sys._current_frames()[me]}) == ("", "")
    finally:
        release.set()


class FakeCuda:
    """torch.cuda's peak counters, as the caching allocator keeps them."""

    def __init__(self, peaks):
        self.peaks = list(peaks)
        self.resets = 0

    def is_initialized(self):
        return True

    def max_memory_allocated(self):
        return self.peaks[self.resets][0] * phases.MIB

    def max_memory_reserved(self):
        return self.peaks[self.resets][1] * phases.MIB

    def reset_peak_memory_stats(self):
        self.resets += 1


def test_tracer_keeps_the_maximum_per_phase_and_resets_the_window():
    ident, frames, release = _stack_of("update_critic", "backward")
    try:
        cuda = FakeCuda([(100, 150), (300, 350), (200, 400), (50, 60)])
        tracer = phases.Tracer(cuda)
        for _ in range(3):
            tracer.sample({ident: frames[ident]})
        assert cuda.resets == 3
        assert tracer.peaks == {
            "critic_update/backward": {"allocated_mib": 300.0, "reserved_mib": 400.0}
        }
        tracer.sample({})  # no phase on any stack
        assert "other/-" in tracer.peaks
    finally:
        release.set()
