"""Which requests are generated together, and when.

verl's agent loop fires one ``generate`` per sample, all of a step's samples within
milliseconds of each other. A P40 has no continuous-batching engine, so the server
gathers what arrives together into one HF ``generate`` call: after the first request
of a batch it waits ``window_s`` (or until ``max_batch_size`` are waiting), takes the
waiting requests that share its batch key, and runs them while the next ones queue.
One batch runs at a time (one model, one device); it runs in a worker thread so the
actor's event loop keeps taking requests and control calls meanwhile.

Abort (verl's partial rollout, and its weight sync on the non-naive checkpoint
engines): ``abort()`` asks the running batch to stop at its next token, answers every
queued request as aborted, and refuses new ones until ``resume()``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

R = TypeVar("R")


class Keyed(Protocol):
    @property
    def batch_key(self) -> object: ...


Q = TypeVar("Q", bound=Keyed)

# run(requests, should_stop) -> one result per request, in order; `aborted` answers a
# request that was never run.
RunBatch = Callable[[Sequence[Q], Callable[[], bool]], Sequence[R]]


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
        max_batch_size: int,
        window_s: float = 0.02,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: expected >= 1")
        self._run = run
        self._aborted = aborted
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self._queue: list[_Pending[Q, R]] = []
        self._arrived: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._open: asyncio.Event | None = None
        self._stop = threading.Event()  # read by the worker thread
        self._task: asyncio.Task | None = None
        self.batches_run = 0
        self.requests_run = 0
        self.largest_batch = 0

    def _start(self) -> None:
        # Lazily, inside the event loop that will serve the requests (a Ray async actor's).
        if self._task is None:
            self._arrived = asyncio.Event()
            self._idle = asyncio.Event()
            self._idle.set()
            self._open = asyncio.Event()
            self._open.set()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def submit(self, request: Q) -> R:
        self._start()
        assert self._open is not None and self._arrived is not None
        if not self._open.is_set():
            return self._aborted(request)
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(request, future))
        self._arrived.set()
        return await future

    def _take(self) -> list[_Pending[Q, R]]:
        key = self._queue[0].request.batch_key
        batch = [p for p in self._queue if p.request.batch_key == key][: self.max_batch_size]
        taken = {id(p) for p in batch}
        self._queue = [p for p in self._queue if id(p) not in taken]
        return batch

    async def _loop(self) -> None:
        assert self._arrived is not None and self._idle is not None
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            if not self._queue:
                continue
            self._idle.clear()
            # Let the rest of the burst arrive, unless a full batch is already waiting.
            if len(self._queue) < self.max_batch_size and self.window_s > 0:
                await asyncio.sleep(self.window_s)
            while self._queue:
                batch = self._take()
                await self._run_one(batch)
            self._idle.set()

    async def _run_one(self, batch: list[_Pending[Q, R]]) -> None:
        requests = [p.request for p in batch]
        self.batches_run += 1
        self.requests_run += len(batch)
        self.largest_batch = max(self.largest_batch, len(batch))
        try:
            results = await asyncio.to_thread(self._run, requests, self._stop.is_set)
            if len(results) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} gave {len(results)} results")
        except BaseException as exc:  # the callers get the error, the loop goes on
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
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
        await self._idle.wait()
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
        while self._queue or not self._idle.is_set():
            await self._idle.wait()
            await asyncio.sleep(0)

    @property
    def queued(self) -> int:
        return len(self._queue)
