"""Which requests are generated together, and when.

verl's agent loop fires one ``generate`` per sample, all of a step's samples within
milliseconds of each other. A P40 has no continuous-batching engine, so the server
gathers what arrives together into one decode batch: after the first request of a
batch it waits until the batch is full, or no request has come for ``window_s``, or
``max_wait_s`` has passed since the first; then it takes the waiting requests in arrival
order while they fit ``max_batch_tokens`` (the batch's padded ``rows x (prompt +
response)`` tokens, ``cost``) and ``max_rows``, and runs them while the next ones queue.
(A fixed wait after the first request cut verl's bursts: the agent loop tokenizes each
sample before it sends it, and on the lent H200 one step's 128 requests came over more
than 20 ms with gaps of up to 30 ms between them, so a rollout ran as two or three
passes of a full pass's length each.) One batch runs at a time (one model, one device); it runs in a
worker thread so the actor's event loop keeps taking requests and control calls.

Nothing waits forever: a request that gets no answer within ``timeout_s`` fails with
``RolloutTimeout``, and so do ``abort``/``drain``; if the loop itself dies (any
``BaseException``, cancellation included), the batch in flight, every queued request
and every later one fail with ``BatchLoopDead``.

Abort (verl's partial rollout, and its weight sync on the non-naive checkpoint
engines): ``abort()`` asks the running batch to stop at its next token, answers every
queued request as aborted, and refuses new ones until ``resume()``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)

R = TypeVar("R")

DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_WINDOW_S = 0.1  # the quiet gap that closes a batch (a pass is seconds long)
DEFAULT_MAX_WAIT_S = 2.0  # a steady trickle still runs


class Keyed(Protocol):
    @property
    def batch_key(self) -> object: ...


Q = TypeVar("Q", bound=Keyed)

# run(requests, should_stop) -> one result per request, in order; `aborted` answers a
# request that was never run.
RunBatch = Callable[[Sequence[Q], Callable[[], bool]], Sequence[R]]


class BatchLoopDead(RuntimeError):
    """The batch loop has stopped: no request will be answered (``rollout-batch-loop-dead``)."""

    code = "rollout-batch-loop-dead"


class RolloutTimeout(TimeoutError):
    """A wait ran past its timeout (``rollout-timeout``)."""

    code = "rollout-timeout"


@dataclass
class _Pending(Generic[Q, R]):
    request: Q
    future: asyncio.Future[R]


class Batcher(Generic[Q, R]):
    def __init__(
        self,
        run: RunBatch,
        aborted: Callable[[Q], R],
        *,
        max_batch_tokens: int | None = None,
        cost: Callable[[Sequence[Q]], int] = len,
        max_rows: int | None = None,
        window_s: float = DEFAULT_WINDOW_S,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_batch_size: int | None = None,
    ) -> None:
        # max_batch_size: the earlier name of max_rows (callers written against it).
        max_rows = max_batch_size if max_rows is None else max_rows
        if max_batch_tokens is None and max_rows is None:
            raise ValueError("a batch needs a bound: max_batch_tokens or max_rows")
        max_batch_tokens = (1 << 62) if max_batch_tokens is None else max_batch_tokens
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens}: expected >= 1")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows={max_rows}: expected >= 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: expected > 0")
        if window_s < 0 or max_wait_s < 0:
            raise ValueError(f"window_s={window_s}, max_wait_s={max_wait_s}: expected >= 0")
        self._run = run
        self._aborted = aborted
        self.max_batch_tokens = max_batch_tokens
        self.cost = cost
        self.max_rows = max_rows
        self.window_s = window_s
        self.max_wait_s = max_wait_s
        self.timeout_s = timeout_s
        self._queue: list[_Pending[Q, R]] = []
        self._running: list[_Pending[Q, R]] = []
        self._arrived: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._open: asyncio.Event | None = None
        self._stop = threading.Event()  # read by the worker thread
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self.batches_run = 0
        self.requests_run = 0
        self.largest_batch = 0
        self.largest_batch_tokens = 0

    def _start(self) -> None:
        # Lazily, inside the event loop that will serve the requests (a Ray async actor's).
        if self._task is None:
            self._arrived = asyncio.Event()
            self._idle = asyncio.Event()
            self._idle.set()
            self._open = asyncio.Event()
            self._open.set()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise BatchLoopDead(
                f"{BatchLoopDead.code}: the rollout's batch loop stopped "
                f"({type(self._dead).__name__}: {self._dead}); no request can be served"
            ) from self._dead

    async def _wait(self, awaitable, what: str):
        try:
            return await asyncio.wait_for(awaitable, self.timeout_s)
        except asyncio.TimeoutError:
            self._check_alive()  # a dead loop is the better answer, if that is why
            raise RolloutTimeout(
                f"{RolloutTimeout.code}: {what} got no answer within {self.timeout_s:g} s "
                "(engine setting request_timeout_s)"
            ) from None

    async def submit(self, request: Q) -> R:
        self._start()
        self._check_alive()
        assert self._open is not None and self._arrived is not None
        if not self._open.is_set():
            return self._aborted(request)
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(request, future))
        self._arrived.set()
        name = getattr(request, "request_id", "") or "a request"
        try:
            return await self._wait(future, f"request {name!r}")
        finally:
            future.cancel()  # a caller gone (timed out, cancelled): the batch skips it

    def _fits(self, batch: list[Q]) -> bool:
        if self.max_rows is not None and len(batch) > self.max_rows:
            return False
        return self.cost(batch) <= self.max_batch_tokens

    def _full(self) -> bool:
        waiting = [p.request for p in self._queue if not p.future.done()]
        if not waiting:
            return False
        if self.max_rows is not None and len(waiting) >= self.max_rows:
            return True
        return not self._fits(waiting)

    async def _gather(self) -> None:
        """Let the rest of the burst arrive: until the batch is full, no request has come
        for ``window_s``, or ``max_wait_s`` has passed since the first."""
        assert self._arrived is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while self.window_s > 0 and not self._full():
            left = deadline - loop.time()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(self.window_s, left))
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Pending[Q, R]]:
        # A caller that timed out left its future answered-or-abandoned: skip those.
        self._queue = [p for p in self._queue if not p.future.done()]
        if not self._queue:
            return []
        key = self._queue[0].request.batch_key
        batch: list[_Pending[Q, R]] = []
        for p in self._queue:
            if p.request.batch_key != key:
                continue
            # In arrival order, while they fit; the first one always goes (alone if need be).
            if batch and not self._fits([q.request for q in batch] + [p.request]):
                break
            batch.append(p)
        taken = {id(p) for p in batch}
        self._queue = [p for p in self._queue if id(p) not in taken]
        return batch

    async def _loop(self) -> None:
        assert self._arrived is not None and self._idle is not None
        try:
            while True:
                await self._arrived.wait()
                self._arrived.clear()
                if not self._queue:
                    continue
                self._idle.clear()
                await self._gather()
                while batch := self._take():
                    await self._run_one(batch)
                self._idle.set()
        except asyncio.CancelledError as exc:
            self._die(exc)
            raise
        except BaseException as exc:  # logged here: nobody awaits this task
            logger.exception("the rollout's batch loop stopped")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        error = BatchLoopDead(
            f"{BatchLoopDead.code}: the rollout's batch loop stopped "
            f"({type(exc).__name__}: {exc}); no request can be served"
        )
        error.__cause__ = exc
        for p in [*self._running, *self._queue]:
            if not p.future.done():
                p.future.set_exception(error)
        self._running, self._queue = [], []
        if self._idle is not None:
            self._idle.set()

    async def _run_one(self, batch: list[_Pending[Q, R]]) -> None:
        requests = [p.request for p in batch]
        self.batches_run += 1
        self.requests_run += len(batch)
        self.largest_batch = max(self.largest_batch, len(batch))
        self.largest_batch_tokens = max(self.largest_batch_tokens, self.cost(requests))
        self._running = batch  # a BaseException leaves it set: _die answers it
        try:
            results = await asyncio.to_thread(self._run, requests, self._stop.is_set)
            if len(results) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} gave {len(results)} results")
        except Exception as exc:  # the batch's callers get the error, the loop goes on
            self._running = []
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        self._running = []
        for p, result in zip(batch, results, strict=True):
            if not p.future.done():
                p.future.set_result(result)

    async def abort(self) -> int:
        """Stop the running batch at its next token, answer the queue as aborted,
        refuse new requests until ``resume``; returns how many were queued."""
        self._start()
        assert self._open is not None and self._idle is not None
        self._open.clear()
        self._stop.set()
        queued, self._queue = self._queue, []
        for p in queued:
            if not p.future.done():
                p.future.set_result(self._aborted(p.request))
        await self._wait(self._idle.wait(), "abort (waiting for the running batch)")
        return len(queued)

    def resume(self) -> None:
        self._start()
        assert self._open is not None
        self._stop.clear()
        self._open.set()

    async def drain(self) -> None:
        """Wait until nothing is queued or running."""
        self._start()
        assert self._idle is not None

        async def idle() -> None:
            while (self._queue or not self._idle.is_set()) and self._dead is None:
                await self._idle.wait()
                await asyncio.sleep(0)

        await self._wait(idle(), "drain")

    @property
    def queued(self) -> int:
        return len(self._queue)
