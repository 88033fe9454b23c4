"""Micro-batching: the windows of concurrent calls gathered into one ONNX Runtime run.

A batch closes at `max_batch` windows, when its first call has waited `max_delay_s`, or, with `wait="adaptive"` (the
default), as soon as no other call is ready to join; `wait="fixed"` waits the delay unless the batch fills up. Only
calls with the same key (model snapshot) share a batch. Expired or cancelled calls never run. Batches run one at a time
on one worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from serving.errors import NotReady, QueueDeadlineExceeded

log = logging.getLogger("serving")

WAIT_POLICIES = ("adaptive", "fixed")
K = TypeVar("K")  # what a batch runs on (the model snapshot); only calls with the same key share a batch
P = TypeVar("P")  # one call's payload (its series)
R = TypeVar("R")  # one call's result
# process(key, payloads) -> one result or exception per payload, in order; runs on the worker thread
Process = Callable[[K, list[P]], Sequence["R | Exception"]]


class BatchObserver(Protocol):
    """Receives timings (seconds) and sizes; serving.metrics implements it."""

    def on_batch(self, windows: int, calls: int, inference_s: float) -> None: ...

    def on_queue_time(self, seconds: float) -> None: ...

    def on_expired(self) -> None: ...


@dataclass(eq=False)
class _Item(Generic[K, P, R]):
    key: K
    payload: P
    n: int  # windows
    future: asyncio.Future[R]
    deadline: float | None  # time.monotonic() after which the call is not run
    enqueued: float  # time.monotonic() when submitted


class MicroBatcher(Generic[K, P, R]):
    def __init__(self, process: Process[K, P, R], max_batch: int, max_delay_s: float, wait: str = "adaptive",
                 observer: BatchObserver | None = None) -> None:
        self._process = process
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.wait = wait
        self._observer = observer
        self._queue: deque[_Item[K, P, R]] = deque()
        self._arrived = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="micro-batcher")

    async def close(self) -> None:
        """Finish what is queued, then stop."""
        self._closing = True
        self._arrived.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    async def submit(self, key: K, payload: P, n: int, deadline: float | None = None) -> R:
        """The result for `payload` (n windows), computed in a batch with other calls on the same key (alone when
        n > max_batch). NotReady once close() has begun; QueueDeadlineExceeded when `deadline` passes first."""
        if self._closing:
            raise NotReady("the server is shutting down; retry on another replica")
        item: _Item[K, P, R] = _Item(key, payload, n, asyncio.get_running_loop().create_future(), deadline,
                                     time.monotonic())
        self._queue.append(item)
        self._arrived.set()
        try:
            return await item.future
        finally:
            item.future.cancel()  # no-op when done; when the caller was cancelled, it is never run

    async def _loop(self) -> None:
        while (first := await self._next_call()) is not None:
            await self._gather(first)
            batch = self._take(first.key)
            if batch:
                await self._run(first.key, batch)

    async def _next_call(self) -> _Item[K, P, R] | None:
        """The oldest live call, once there is one; None when closing with nothing queued."""
        while True:
            while self._queue and self._queue[0].future.done():  # cancelled by its caller
                self._queue.popleft()
            if self._queue:
                return self._queue[0]
            if self._closing:
                return None
            self._arrived.clear()
            await self._arrived.wait()

    def _full(self, key: K) -> bool:
        return sum(it.n for it in self._queue if it.key is key and not it.future.done()) >= self.max_batch

    async def _gather(self, first: _Item[K, P, R]) -> None:
        """Wait until the batch that `first` opens should close."""
        close_at = first.enqueued + self.max_delay_s
        if self.wait == "adaptive":
            seen = -1  # each loop round lets the calls already runnable reach submit; stop when a round brings none
            while seen != len(self._queue) and not self._full(first.key) and time.monotonic() < close_at \
                    and not self._closing:
                seen = len(self._queue)
                await asyncio.sleep(0)
            return
        while not self._full(first.key) and not self._closing:  # fixed: until the delay, or a full batch
            remaining = close_at - time.monotonic()
            if remaining <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):  # uvloop rounds timers to the millisecond: re-check the time
                await asyncio.wait_for(self._arrived.wait(), remaining)

    def _take(self, key: K) -> list[_Item[K, P, R]]:
        """Pop up to max_batch windows of `key`'s calls, in arrival order; fail the expired ones."""
        now = time.monotonic()
        batch: list[_Item[K, P, R]] = []
        windows = 0
        kept: deque[_Item[K, P, R]] = deque()
        for it in self._queue:
            if it.future.done():  # cancelled by its caller (deadline at the client, disconnect)
                continue
            if it.deadline is not None and now >= it.deadline:
                if self._observer is not None:
                    self._observer.on_expired()
                it.future.set_exception(QueueDeadlineExceeded(
                    f"deadline exceeded after {(now - it.enqueued) * 1e3:,.1f} ms in the queue; not run"))
            elif it.key is key and (not batch or windows + it.n <= self.max_batch):
                batch.append(it)
                windows += it.n
            else:
                kept.append(it)
        self._queue = kept
        return batch

    async def _run(self, key: K, batch: list[_Item[K, P, R]]) -> None:
        """Run one batch on the worker thread and hand each call its result; a failed run fails its calls."""
        started = time.monotonic()
        payloads = [it.payload for it in batch]
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, self._process, key, payloads)
        except Exception as exc:
            log.exception("inference failed for a batch of %d calls", len(batch))
            results = [exc] * len(batch)
        if self._observer is not None:
            for it in batch:
                self._observer.on_queue_time(started - it.enqueued)
            self._observer.on_batch(sum(it.n for it in batch), len(batch), time.monotonic() - started)
        for it, result in zip(batch, results, strict=True):
            if it.future.done():
                continue
            if isinstance(result, Exception):
                it.future.set_exception(result)
            else:
                it.future.set_result(result)
