"""The Pascal rollout's batcher: requests that arrive together run as one batch."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from oldgpu.rollout.batching import Batcher, BatchLoopDead, RolloutTimeout


@dataclass(frozen=True)
class Req:
    n: int
    key: str = "a"
    size: int = 1

    @property
    def request_id(self) -> str:
        return f"req-{self.n}"

    @property
    def batch_key(self) -> str:
        return self.key


class Recorder:
    def __init__(self, delay: float = 0.0):
        self.batches: list[list[int]] = []
        self.delay = delay
        self.threads: set[str] = set()
        self.started = threading.Event()  # a batch is running

    def run(self, requests, should_stop):
        self.threads.add(threading.current_thread().name)
        self.started.set()
        self.batches.append([r.n for r in requests])
        time.sleep(self.delay)
        return [("done", r.n, should_stop()) for r in requests]


def aborted(r: Req):
    return ("aborted", r.n, True)


def rows(requests) -> int:
    return sum(r.size for r in requests)


def make(run, *, budget=1 << 20, **kw) -> Batcher:
    kw.setdefault("window_s", 0.05)
    return Batcher(run, aborted, max_batch_tokens=budget, cost=rows, **kw)


def test_a_burst_is_one_batch_and_answers_each_caller_in_order():
    rec = Recorder()

    async def main():
        b = make(rec.run)
        out = await asyncio.gather(*[b.submit(Req(i)) for i in range(10)])
        return b, out

    b, out = asyncio.run(main())
    assert rec.batches == [list(range(10))]
    assert out == [("done", i, False) for i in range(10)]
    assert b.batches_run == 1 and b.largest_batch == 10
    assert "MainThread" not in rec.threads  # the event loop stays free


def test_batches_are_capped_and_split_by_key():
    rec = Recorder()

    async def main():
        b = make(rec.run, budget=3)
        reqs = [Req(i, "a" if i % 2 else "b") for i in range(8)]
        return await asyncio.gather(*[b.submit(r) for r in reqs])

    out = asyncio.run(main())
    assert len(out) == 8
    for batch in rec.batches:
        assert len(batch) <= 3
        assert len({n % 2 for n in batch}) == 1  # one key per batch
    assert sorted(n for batch in rec.batches for n in batch) == list(range(8))


def test_requests_arriving_while_a_batch_runs_form_the_next_one():
    rec = Recorder(delay=0.2)

    async def main():
        b = make(rec.run, window_s=0.01)
        first = asyncio.ensure_future(b.submit(Req(0)))
        # Until batch [0] runs (a fixed sleep lost the race to the window on a loaded machine).
        while not rec.started.is_set():
            await asyncio.sleep(0.005)
        rest = [asyncio.ensure_future(b.submit(Req(i))) for i in (1, 2, 3)]
        await asyncio.gather(first, *rest)

    asyncio.run(main())
    assert rec.batches == [[0], [1, 2, 3]]


def test_an_error_reaches_the_callers_and_the_loop_goes_on():
    calls = []

    def run(requests, should_stop):
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return [r.n for r in requests]

    async def main():
        b = make(run, window_s=0.01)
        with pytest.raises(RuntimeError, match="boom"):
            await b.submit(Req(1))
        return await b.submit(Req(2))

    assert asyncio.run(main()) == 2


def test_abort_stops_the_running_batch_answers_the_queue_and_closes_until_resume():
    started = threading.Event()

    def run(requests, should_stop):
        started.set()
        deadline = time.time() + 5
        while not should_stop() and time.time() < deadline:
            time.sleep(0.01)
        return [("stopped" if should_stop() else "ran", r.n) for r in requests]

    async def main():
        b = make(run, budget=1, window_s=0.0)
        running = asyncio.ensure_future(b.submit(Req(0)))
        while not started.is_set():
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(b.submit(Req(1)))
        await asyncio.sleep(0.01)
        count = await b.abort()
        refused = await b.submit(Req(2))
        b.resume()
        started.clear()

        def quick(requests, should_stop):
            return [("ran", r.n) for r in requests]

        b._run = quick
        after = await b.submit(Req(3))
        return count, await running, await queued, refused, after

    count, running, queued, refused, after = asyncio.run(main())
    assert count == 1
    assert running == ("stopped", 0)
    assert queued == ("aborted", 1, True)
    assert refused == ("aborted", 2, True)
    assert after == ("ran", 3)


def test_drain_waits_for_the_running_batch():
    rec = Recorder(delay=0.1)

    async def main():
        b = make(rec.run, budget=4, window_s=0.0)
        fut = asyncio.ensure_future(b.submit(Req(0)))
        while not rec.started.is_set():
            await asyncio.sleep(0.005)
        await b.drain()
        return fut.done()

    assert asyncio.run(main())


def test_settings_must_be_positive():
    for kw in ({"budget": 0}, {"max_rows": 0}, {"timeout_s": 0}):
        with pytest.raises(ValueError):
            make(lambda r, s: r, **kw)
    with pytest.raises(ValueError, match="needs a bound"):
        Batcher(lambda r, s: r, aborted)


def test_rows_alone_bound_a_batch_under_the_earlier_name():
    rec = Recorder()

    async def main():
        b = Batcher(rec.run, aborted, max_batch_size=4, window_s=0.05)
        return await asyncio.gather(*[b.submit(Req(i, size=1000)) for i in range(6)])

    asyncio.run(main())
    assert [len(batch) for batch in rec.batches] == [4, 2]


def test_no_fixed_row_cap_only_the_token_budget():
    rec = Recorder()

    async def main():
        b = make(rec.run, budget=1000)
        return await asyncio.gather(*[b.submit(Req(i, size=4)) for i in range(300)])

    asyncio.run(main())
    # 250 rows of 4 tokens fit 1000; the rest is the next batch.
    assert [len(batch) for batch in rec.batches] == [250, 50]


def test_a_request_over_the_budget_runs_alone_and_max_rows_caps():
    rec = Recorder()

    async def main():
        b = make(rec.run, budget=10, max_rows=2)
        reqs = [Req(0, size=3), Req(1, size=30), Req(2, size=1), Req(3, size=1), Req(4, size=1)]
        return await asyncio.gather(*[b.submit(r) for r in reqs])

    asyncio.run(main())
    assert rec.batches == [[0], [1], [2, 3], [4]]


class Fatal(BaseException):
    pass


def test_a_dying_loop_fails_the_batch_the_queue_and_later_requests():
    started = threading.Event()

    def run(requests, should_stop):
        started.set()
        time.sleep(0.1)
        raise Fatal("worker killed")

    async def main():
        b = make(run, budget=1, window_s=0.0)
        futs = [asyncio.ensure_future(b.submit(Req(i))) for i in range(3)]
        results = await asyncio.gather(*futs, return_exceptions=True)
        with pytest.raises(BatchLoopDead, match=r"rollout-batch-loop-dead.*worker killed"):
            await b.submit(Req(9))
        await b.drain()  # returns: nothing will run again
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, BatchLoopDead) for r in results), results
    assert isinstance(results[0].__cause__, Fatal)


def test_a_cancelled_loop_fails_what_waits():
    rec = Recorder(delay=0.3)

    async def main():
        b = make(rec.run, window_s=0.0)
        fut = asyncio.ensure_future(b.submit(Req(0)))
        while not rec.started.is_set():
            await asyncio.sleep(0.005)
        b._task.cancel()
        with pytest.raises(BatchLoopDead):
            await fut
        with pytest.raises(BatchLoopDead):
            await b.submit(Req(1))

    asyncio.run(main())


def test_every_wait_has_a_timeout():
    release = threading.Event()
    ran: list[list[int]] = []

    def run(requests, should_stop):
        ran.append([r.n for r in requests])
        release.wait(5)
        return [r.n for r in requests]

    async def main():
        b = make(run, budget=1, window_s=0.0, timeout_s=0.2)
        first = asyncio.ensure_future(b.submit(Req(0)))
        await asyncio.sleep(0.05)
        with pytest.raises(RolloutTimeout, match=r"rollout-timeout: request 'req-1'.*0.2 s"):
            await b.submit(Req(1))  # queued behind the stuck batch
        with pytest.raises(RolloutTimeout, match="rollout-timeout: drain"):
            await b.drain()
        with pytest.raises(RolloutTimeout, match="rollout-timeout: abort"):
            await b.abort()
        with pytest.raises(RolloutTimeout):
            await first
        release.set()
        b.resume()
        b.timeout_s = 5
        return await b.submit(Req(2))

    assert asyncio.run(main()) == 2
    assert [1] not in ran  # the request whose caller gave up never ran


async def send_spaced(b: Batcher, count: int, gap_s: float, until=lambda: False) -> int:
    """Submit Req(0..count-1) gap_s apart (stopping early once ``until()``); wait for all
    the answers; return how many were sent."""
    futures = []
    for i in range(count):
        futures.append(asyncio.ensure_future(b.submit(Req(i))))
        await asyncio.sleep(gap_s)
        if until():
            break
    await asyncio.gather(*futures)
    return len(futures)


def test_a_burst_spread_past_the_window_is_still_one_batch():
    # verl's agent loop tokenizes each sample before it sends it: a step's requests come
    # over tens of milliseconds with gaps between them. Each gap here (30 ms) is well
    # inside the quiet window (0.5 s, room for a loaded host's late wake-ups), the whole
    # burst (1.2 s) past it: one batch, as a fixed window after the first would not give.
    rec = Recorder()
    asyncio.run(send_spaced(make(rec.run, window_s=0.5, max_wait_s=30.0), 40, 0.03))
    assert rec.batches == [list(range(40))]


def test_a_full_batch_runs_without_waiting_for_the_quiet_gap():
    rec = Recorder()

    async def main():
        b = make(rec.run, max_rows=4, window_s=30.0, max_wait_s=30.0)
        out = await asyncio.wait_for(asyncio.gather(*[b.submit(Req(i)) for i in range(4)]), 10)
        return out

    assert len(asyncio.run(main())) == 4
    assert rec.batches == [[0, 1, 2, 3]]


def test_a_steady_trickle_runs_at_the_longest_wait():
    # Requests that never pause still run: the batch closes max_wait_s after its first,
    # not after a quiet gap (5 s) that never comes.
    rec = Recorder()
    b = make(rec.run, window_s=5.0, max_wait_s=0.5)
    sent = asyncio.run(send_spaced(b, 200, 0.02, until=lambda: bool(rec.batches)))
    # The first batch started while requests were still coming (about 0.5 s / 20 ms of
    # them), not after the 200 of them (4 s) or a 5 s quiet gap.
    assert sent < 200
    assert rec.batches[0][0] == 0 and 2 <= len(rec.batches[0]) <= sent


@pytest.mark.parametrize("bad", [{"window_s": -1.0}, {"max_wait_s": -0.5}])
def test_a_negative_wait_is_refused(bad):
    with pytest.raises(ValueError, match="expected >= 0"):
        make(lambda r, s: r, **bad)
