"""Micro-batching: windows of concurrent calls gathered into one ONNX Runtime run.

Calls `submit` their payload (checked series) and await their result. One loop forms
batches and runs them, one at a time, on a single worker thread (ONNX
Runtime releases the GIL, so the event loop keeps accepting and preparing calls while a
batch runs; calls that arrive meanwhile form the next batch). A lone call with nothing else
queued runs on the event loop itself when it is expected to take under `inline_max_s` (50 ms),
rather than on the worker: besides the two thread hand-overs, a run on the worker is slower in
itself, since that thread wakes on an idle core with cold caches. The limit bounds how long a
run on the loop is expected to hold it (health checks, signals and arriving calls wait for it);
calls expected to take longer run on the worker. The expectation is the call's windows times
the time per window of recent lone runs of the same model (the runs' own time, wherever they
ran, not the hand-overs around them; a moving average, each run counted as at most twice the
limit per window, failed runs too), so one slow run does not move quick calls off the loop, a
call of many windows is not taken for a quick one, and a newly loaded model's first lone run
is measured on the worker. Only while the loop is quiet, though:
when other calls' work ran on it while the batch gathered (or, with no gathering round, as with
a fixed wait or no delay left, in one round timed for the purpose), the server is under load,
and a run on the loop would stop it from receiving the calls that should join the next batch
(batches would stay at one call, each run blocking the loop in turn). When the batch loop is
idle (nothing queued, no batch running), such a call does not even queue: after two quiet
rounds (as many as its batch would have had: the batch loop's wake-up and one gathering round)
it runs in its caller's task, saving the hops through the queue and the batch loop's task;
calls that arrive meanwhile queue instead, and share a batch.

What runs is a `process(key, payloads)` function (serving.inference.run_batch: features
of all the batch's series, one model run); the batcher only forms the batches.

A batch closes when it holds `max_batch` windows, or when its first call has waited
`max_delay_s`, whichever comes first. With `wait="adaptive"` (the default) it also closes
as soon as no other call is ready to join — so a lone call never waits for company,
and under load batches grow by themselves — except when the server is saturated: calls
arrive faster than batches finish (moving averages of the time between arrivals and of a
batch's wall time), so a batch of one would leave the next call waiting while it ran. Then
a batch of one call waits, as a fixed wait does, for company until its delay is up, and no
call takes the quick path. Calls otherwise reach the loop one at a time where gRPC's threads
and the loop share a core (a server on one CPU), and batching would never start. A single
closed-loop caller is never saturated: its next call arrives after the previous batch ended.
(When heavy load gives way to one caller, the averages take a few calls to say so, each of which
may wait out the delay: about six after batches of 7 ms, for a caller whose calls take 1.3 ms.)
With `wait="fixed"` a batch always waits the full delay unless it fills up (the classic
dynamic batcher, for throughput-first deployments).

Only windows of the same model snapshot share a batch (a reload never mixes models).
A call whose deadline passed while queued, or that was cancelled, is never run.
Rows are independent, so each call's outputs equal those of running it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from serving.errors import NotReady, QueueDeadlineExceeded

log = logging.getLogger("serving")

WAIT_POLICIES = ("adaptive", "fixed")
INLINE_MAX_S = 0.05  # lone calls expected to run in less than this run on the event loop
LONE_RUN_WEIGHT = 0.2  # weight of the latest lone run in that average (an exponential moving average)
# A loop round (asyncio.sleep(0)) longer than this ran other calls' work: the server is under load. An idle
# round takes a few microseconds; one that handles a gRPC call's events, tens to hundreds.
QUIET_ROUND_S = 25e-6
RATE_WEIGHT = 0.2  # weight of the latest sample in the moving averages of arrival gaps and batch wall times
MAX_GAP_S = 1.0  # a longer gap between two calls counts as this long (an idle spell is not a trend)
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


class _NoObserver:
    def on_batch(self, windows: int, calls: int, inference_s: float) -> None:
        pass

    def on_queue_time(self, seconds: float) -> None:
        pass

    def on_expired(self) -> None:
        pass


@dataclass(eq=False)
class _Item(Generic[K, P, R]):
    key: K
    payload: P
    n: int  # windows
    future: asyncio.Future[R]
    deadline: float | None  # time.monotonic() after which the call is not run
    enqueued: float  # time.monotonic() when submitted


def _weak(key: K) -> Callable[[], K | None]:
    """A reference to `key` that does not keep it alive where it can be weak (a model snapshot: a
    replaced model is freed), else a plain one (a string)."""
    try:
        return weakref.ref(key)
    except TypeError:
        return lambda: key


def _no_key() -> None:
    return None


class MicroBatcher(Generic[K, P, R]):
    def __init__(self, process: Process[K, P, R], max_batch: int, max_delay_s: float, wait: str = "adaptive",
                 observer: BatchObserver | None = None, inline_max_s: float = INLINE_MAX_S,
                 quiet_round_s: float = QUIET_ROUND_S, busy_poll_s: float = 0.0) -> None:
        if max_batch < 1 or max_delay_s < 0 or wait not in WAIT_POLICIES or not busy_poll_s >= 0:
            raise ValueError(f"need max_batch >= 1, max_delay_s >= 0, wait in {WAIT_POLICIES}, busy_poll_s >= 0")
        self._process = process
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.wait = wait
        self._observer: BatchObserver = observer or _NoObserver()
        self._queue: deque[_Item[K, P, R]] = deque()
        self._arrived = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._task: asyncio.Task[None] | None = None
        self._window_s = float("inf")  # lone runs' average time per window, on _cost_key's model
        self._cost_key: Callable[[], K | None] = _no_key  # whose runs those were (unknown until one ran)
        self._inline_max_s = inline_max_s
        self._quiet_round_s = quiet_round_s
        self._busy_poll_s = busy_poll_s  # 0: off; inf: always; else: this long after each call's arrival and end
        self._spin_until = math.inf if busy_poll_s == math.inf else -math.inf  # time.monotonic()
        self._spin_on = False
        self._spin_gen = 0  # a paused spin's pending callback sees a newer generation and stops
        self._spin_holds = 0  # spin_paused() blocks entered and not left
        self._parked = False  # the batch loop is waiting for calls: none queued, no batch running
        self._trying_here = 0  # calls in the quiet rounds that may let them run at once (see submit)
        self._last_arrival = -float("inf")
        self._gap_s = MAX_GAP_S  # moving average of the time between two calls' arrivals
        self._batch_s = 0.0  # moving average of a batch's wall time, wherever it ran

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="micro-batcher")
        self._spin_resume()

    # ---- busy polling ---------------------------------------------------------------------
    # While busy polling, the loop does not sleep: a callback that schedules itself makes every loop
    # round poll for I/O without waiting, so the loop's thread (which runs lone calls) stays on a hot
    # core. With busy_poll_s = inf it polls always; with a finite busy_poll_s, until that long after the
    # latest call's arrival or end, then it sleeps until a call arrives (a caller's next call within the
    # window finds the core hot; an idle server costs nothing). The spin pauses while other threads of
    # the process do Python work (a batch on the worker, the warm-up, a reload: see spin_paused), since
    # the spinning thread keeps taking the interpreter lock back from them, and it ends with the
    # batcher's task (closed, failed or cancelled).
    def _spin(self, gen: int) -> None:
        if self._spin_on and gen == self._spin_gen and self._task is not None and not self._task.done():
            if time.monotonic() < self._spin_until:
                asyncio.get_running_loop().call_soon(self._spin, gen)
            else:
                self._spin_on = False

    def _spin_extend(self) -> None:
        """A call arrived or ended: poll for busy_poll_s from now (no-op when polling is off or always)."""
        if 0 < self._busy_poll_s < math.inf:
            self._spin_until = time.monotonic() + self._busy_poll_s
            if not self._spin_on:
                self._spin_resume()

    def _spin_resume(self) -> None:
        if self._busy_poll_s > 0 and not self._closing and self._spin_holds == 0:
            self._spin_gen += 1
            self._spin_on = True
            asyncio.get_running_loop().call_soon(self._spin, self._spin_gen)

    @contextlib.contextmanager
    def spin_paused(self) -> Iterator[None]:
        """No busy polling inside this block (nestable; a no-op without busy_poll)."""
        self._spin_holds += 1
        self._spin_on = False
        try:
            yield
        finally:
            self._spin_holds -= 1
            self._spin_resume()

    async def close(self) -> None:
        """Finish what is queued, then stop."""
        self._closing = True
        self._spin_on = False
        self._arrived.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    # ---- calls ----------------------------------------------------------------------------
    async def submit(self, key: K, payload: P, n: int, deadline: float | None = None) -> R:
        """The result for `payload` (n windows), computed in a batch with other calls on the same key.

        A call of more than max_batch windows runs as a batch of its own. Raises NotReady once
        close() has begun (also for a call still in its quiet rounds then).
        """
        self._spin_extend()
        try:
            return await self._submit(key, payload, n, deadline)
        finally:
            self._spin_extend()

    async def _submit(self, key: K, payload: P, n: int, deadline: float | None) -> R:
        if self._closing:
            raise NotReady("the server is shutting down; retry on another replica")
        arrived = time.monotonic()
        gap = min(arrived - self._last_arrival, MAX_GAP_S)
        self._last_arrival = arrived
        self._gap_s = RATE_WEIGHT * gap + (1 - RATE_WEIGHT) * self._gap_s
        if self._may_run_here(key, n):
            # The batch loop is idle. A lone quick call runs right here after as many quiet rounds as its
            # batch would have had, without the hops through the queue and the batch loop's task; if
            # another call arrives meanwhile (tries too, or queues), this one queues, to share a batch.
            self._trying_here += 1
            try:
                quiet = await self._quiet_round() and await self._quiet_round()
                alone = self._trying_here == 1
            finally:
                self._trying_here -= 1
            if quiet and alone and self._may_run_here(key, n):
                return self._run_here(key, payload, n, deadline, arrived)
            if self._closing:
                raise NotReady("the server is shutting down; retry on another replica")
        item: _Item[K, P, R] = _Item(key, payload, n, asyncio.get_running_loop().create_future(), deadline,
                                     arrived)
        self._queue.append(item)
        self._arrived.set()
        try:
            return await item.future
        finally:
            item.future.cancel()  # no-op when done; when the caller was cancelled, it is never run

    def _may_run_here(self, key: K, n: int) -> bool:
        """A call of n windows would be a lone batch that runs on the loop, if the loop stays quiet."""
        return (self.wait == "adaptive" and self._parked and not self._queue and not self._closing
                and n <= self.max_batch and self._quick(key, n) and not self.saturated())

    def saturated(self) -> bool:
        """Calls arrive faster than batches finish (recent averages): a batch of one call should wait for
        company rather than run at once. Never for one closed-loop caller, whose gap includes the batch."""
        return self._gap_s < self._batch_s

    def _batch_done(self, wall_s: float) -> None:
        self._batch_s = RATE_WEIGHT * wall_s + (1 - RATE_WEIGHT) * self._batch_s

    def _quick(self, key: K, n: int) -> bool:
        """A lone run of n windows on `key` is expected to take under the limit (from that model's
        recent lone runs; never for a model without any)."""
        return self._cost_key() is key and n * self._window_s < self._inline_max_s

    def _run_here(self, key: K, payload: P, n: int, deadline: float | None, arrived: float) -> R:
        """Run one call on the loop now, as a batch of its own, observed and counted as one."""
        started = time.monotonic()
        if deadline is not None and started >= deadline:
            raise self._expired(started - arrived)
        self._observer.on_queue_time(started - arrived)
        outcome, run_s = self._timed(key, [payload])
        self._count_lone_run(key, n, run_s)
        wall_s = time.monotonic() - started
        self._batch_done(wall_s)
        self._observer.on_batch(n, 1, wall_s)
        if isinstance(outcome, Exception):
            log.error("inference failed for a batch of 1 calls", exc_info=outcome)
            raise outcome
        result = outcome[0]
        if isinstance(result, Exception):
            raise result
        return result

    def _count_lone_run(self, key: K, n: int, run_s: float) -> None:
        """Add a lone run's own time per window to the moving average (a run of another model starts it
        afresh); a hiccup (GC, preemption) counts as at most twice the limit per window."""
        per_window = min(run_s / max(n, 1), 2 * self._inline_max_s)
        if self._cost_key() is key:
            self._window_s = LONE_RUN_WEIGHT * per_window + (1 - LONE_RUN_WEIGHT) * self._window_s
        else:
            self._cost_key, self._window_s = _weak(key), per_window

    # ---- the loop -------------------------------------------------------------------------
    def _windows_ready(self, key: K) -> int:
        return sum(it.n for it in self._queue if it.key is key and not it.future.done())

    async def _gather(self, first: _Item[K, P, R]) -> bool:
        """Wait until the batch that `first` opens should close; whether the loop was quiet meanwhile
        (no other call's work ran on it: the server is not under load)."""
        close_at = first.enqueued + self.max_delay_s
        rounds = 0
        quiet = True
        if self.wait == "adaptive":
            # let calls that are already runnable on the loop prepare and join; stop when none do
            seen = -1
            while seen != len(self._queue) and self._windows_ready(first.key) < self.max_batch \
                    and time.monotonic() < close_at and not self._closing:
                seen = len(self._queue)
                quiet = await self._quiet_round() and quiet
                rounds += 1
            if self._windows_ready(first.key) == first.n and self.saturated() and not self._closing:
                # saturated, and no company ready: wait for it as a fixed wait does; calls were arriving, so
                # the loop was not idle (the batch runs on the worker, leaving the loop to receive the next)
                await self._wait_until(close_at, first.key)
                quiet = False
        else:
            await self._wait_until(close_at, first.key)
        if rounds == 0:  # no round was timed (a fixed wait, no delay left, a full batch): time one now
            quiet = await self._quiet_round()
        return quiet

    async def _wait_until(self, close_at: float, key: K) -> None:
        """Wait for calls until `close_at` (time.monotonic()) or until `key`'s batch is full."""
        while self._windows_ready(key) < self.max_batch and not self._closing:
            remaining = close_at - time.monotonic()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                continue  # uvloop rounds timers to the millisecond, so this can fire early: re-check the time

    async def _quiet_round(self) -> bool:
        """One loop round (the calls already runnable do their work); whether it was idle."""
        t0 = time.monotonic()
        await asyncio.sleep(0)
        return time.monotonic() - t0 < self._quiet_round_s

    def _take(self, key: K) -> list[_Item[K, P, R]]:
        """Pop up to max_batch windows of `key`'s calls, in arrival order; fail the expired ones."""
        now = time.monotonic()
        batch: list[_Item[K, P, R]] = []
        windows = 0
        kept: deque[_Item[K, P, R]] = deque()
        while self._queue:
            it = self._queue.popleft()
            if it.future.done():  # cancelled by its caller (deadline at the client, disconnect)
                continue
            if it.deadline is not None and now >= it.deadline:
                it.future.set_exception(self._expired(now - it.enqueued))
                continue
            if it.key is key and (not batch or windows + it.n <= self.max_batch):
                batch.append(it)
                windows += it.n
            else:
                kept.append(it)
        self._queue = kept
        return batch

    def _expired(self, waited_s: float) -> QueueDeadlineExceeded:
        """The error of a call whose deadline passed before it ran (counted as expired)."""
        self._observer.on_expired()
        return QueueDeadlineExceeded(f"deadline exceeded after {waited_s * 1e3:,.1f} ms in the queue; not run")

    def _timed(self, key: K, payloads: list[P]) -> tuple[Sequence[R | Exception] | Exception, float]:
        """process(key, payloads), or what it raised, and how long it took, timed on the thread it ran on."""
        t0 = time.monotonic()
        try:
            return self._process(key, payloads), time.monotonic() - t0
        except Exception as exc:
            return exc, time.monotonic() - t0

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._arrived.clear()
                self._parked = True
                try:
                    await self._arrived.wait()
                finally:
                    self._parked = False
                continue
            first = self._queue[0]
            if first.future.done():
                self._queue.popleft()
                continue
            quiet = await self._gather(first)
            batch = self._take(first.key)
            if not batch:
                continue
            started = time.monotonic()
            for it in batch:
                self._observer.on_queue_time(started - it.enqueued)
            payloads = [it.payload for it in batch]
            try:
                lone = len(batch) == 1 and not self._queue
                if lone and quiet and self._quick(first.key, batch[0].n):
                    # a quick lone call runs on the loop itself: on the worker it would cost two thread
                    # hand-overs and run slower, on a core woken cold
                    outcome, run_s = self._timed(first.key, payloads)
                else:
                    with self.spin_paused():
                        outcome, run_s = await loop.run_in_executor(self._executor, self._timed, first.key, payloads)
                if lone:
                    self._count_lone_run(first.key, batch[0].n, run_s)
                if isinstance(outcome, Exception):
                    raise outcome
                results = outcome
            except Exception as exc:  # a failed run fails its calls, never the loop
                log.exception("inference failed for a batch of %d calls", len(batch))
                results = [exc] * len(batch)
            wall_s = time.monotonic() - started
            self._batch_done(wall_s)
            self._observer.on_batch(sum(it.n for it in batch), len(batch), wall_s)
            for it, result in zip(batch, results, strict=True):
                if it.future.done():
                    continue
                if isinstance(result, Exception):
                    it.future.set_exception(result)
                else:
                    it.future.set_result(result)
