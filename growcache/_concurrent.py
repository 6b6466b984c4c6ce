"""Many samples in flight in one sampler process: the in-flight limit, the byte budget and the engines.

A sampler process runs its samples in one of four ways (:func:`make_engine` picks):

* one at a time in its main thread (``concurrency=1``, or a user source that did not
  declare itself safe to run concurrently): the behaviour of growcache before concurrency;
* as tasks of one asyncio event loop (fsspec's I/O loop of the process): store sources on
  async filesystems (s3, gs, http) and user sources with ``async def sample_async(rng)``;
* in threads: store sources on sync filesystems (local files) and user sources declared
  ``thread_safe``;
* in batches handed to ``sample_many(rngs)``.

Each sample carries a :class:`Ticket`, which the store sources find through a context
variable: its requests count against the process's :class:`Flow` (requests in flight,
latency, throttling) and its bytes against the byte budget until the sampler has written
the sample into its shard.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger("growcache.sampler")

#: Samples (or a shard's ranged parts) each sampler worker keeps in flight: measured, see
#: docs/benchmarks.md, Filling the cache from a far store.
DEFAULT_CONCURRENCY = 64
# With the default concurrency (64) this bounds the samples in flight by their size: 64 windows
# of 1 MiB, 16 of 4 MiB (see SamplerPool's docstring and docs/benchmarks.md).
DEFAULT_MAX_BYTES_IN_FLIGHT = 64 * 2**20
# The in-flight limit is halved at most once per this many seconds: the requests in flight when
# a store first throttles all fail together, and one cut answers all of them.
_CUT_INTERVAL_S = 0.25
_LATENCIES = 2048  # latencies kept for the percentiles (a window, so RSS stays flat)


class Flow:
    """Requests of one sampler process: the in-flight limit (AIMD), the byte budget and the figures.

    The limit starts at ``concurrency``. A throttled request (HTTP 429/503, SlowDown) or a
    dropped connection halves it (multiplicative decrease, at most once per 0.25 s); every
    answered request adds ``1/limit`` back (additive increase: one more per round of answers),
    up to ``concurrency``. Thread-safe; the async waiters of the byte budget are woken on
    their own loop.
    """

    def __init__(self, concurrency: int, max_bytes_in_flight: int) -> None:
        self.concurrency = concurrency
        self.max_bytes = max_bytes_in_flight
        self.limit = float(concurrency)
        self.requests = 0  # requests in flight now
        self.bytes = 0  # bytes claimed by samples not yet written
        self.peak_bytes = 0
        self.throttles = 0
        self.answered = 0
        self._latencies: collections.deque[float] = collections.deque(maxlen=_LATENCIES)
        self._last_cut = 0.0
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._holders: set[int] = set()  # numbers of the tickets that hold bytes
        # New claims that did not fit, oldest first: a claim waits its turn behind them, or a large
        # sample would wait for good while smaller ones, arriving later, took every byte set free.
        self._turns: collections.deque[_Turn] = collections.deque()
        self._warned_throttle = False

    # -- in-flight limit -----------------------------------------------------------------------
    def allowed(self) -> int:
        return max(1, int(self.limit))

    def throttled(self, url: str, detail: str) -> None:
        with self._cond:
            self.throttles += 1
            now = time.monotonic()
            cut = now - self._last_cut >= _CUT_INTERVAL_S and self.limit > 1
            if cut:
                self.limit = max(1.0, self.limit / 2)
                self._last_cut = now
            first, self._warned_throttle = not self._warned_throttle, True
        if first:
            logger.warning("the store throttles or drops connections (first: %s: %s); cutting the requests in flight "
                           "of this sampler to %d, then growing them back as requests succeed", url, detail,
                           self.allowed())

    def request_started(self) -> None:
        with self._cond:
            self.requests += 1

    def request_ended(self, latency: float | None) -> None:
        """A request ended; ``latency`` is given when the store answered it."""
        with self._cond:
            self.requests -= 1
            if latency is not None:
                self.answered += 1
                self._latencies.append(latency)
                if self.limit < self.concurrency:
                    self.limit = min(float(self.concurrency), self.limit + 1.0 / self.limit)

    def sampled(self, seconds: float) -> None:
        """A whole sample's time, as the latency figure of a sampler that draws one at a time."""
        self._latencies.append(seconds)

    def latency_percentiles(self) -> tuple[float, float, float]:
        """p50, p95 and p99 of the recent request latencies, in seconds (zeros before any)."""
        with self._cond:
            recent = list(self._latencies)
        if not recent:
            return 0.0, 0.0, 0.0
        p50, p95, p99 = np.percentile(np.asarray(recent), [50, 95, 99])
        return float(p50), float(p95), float(p99)

    # -- byte budget ---------------------------------------------------------------------------
    def _holds(self, holder: int | None) -> bool:
        return holder is not None and holder in self._holders

    def _fits(self, nbytes: int, holder: int | None = None, turn: _Turn | None = None) -> bool:
        # One sample larger than the whole budget is still fetched: alone. A sample that holds
        # bytes and needs more (a source that reads several windows per sample) would wait on
        # samples that wait on it: the oldest such sample goes over the budget, so one always
        # finishes, and the budget is exceeded by at most that one sample's later reads. It is
        # finishing work under way, so it does not queue behind new claims; a new claim does,
        # in its turn (``turn``: its place in the queue, ``None`` before it has one).
        if self._holds(holder):
            if holder == min(self._holders):
                return True
        elif nbytes and self._turns and self._turns[0] is not turn:
            self._drop_abandoned()
            if self._turns and self._turns[0] is not turn:
                return False
        return self.bytes == 0 or self.bytes + nbytes <= self.max_bytes

    def _drop_abandoned(self) -> None:
        # A claim whose event loop was closed while it waited, without cancelling it (a loop a user's
        # source ran and closed), never takes its turn nor leaves: the claims behind it would wait for good.
        turns = self._turns
        while turns and turns[0].loop is not None and turns[0].loop.is_closed():
            turns.popleft()

    def _take(self, nbytes: int, holder: int | None = None) -> None:
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        # A claim of no bytes (an object whose size the store did not tell) holds nothing, and its
        # release is a no-op: registered, it stayed for good, one number per sample (RSS grew all
        # run), and the oldest of them, long written, barred the oldest real holder from going over.
        if holder is not None and nbytes:
            self._holders.add(holder)

    def _queue(self, nbytes: int, holder: int | None, turn: _Turn | None,
               loop: asyncio.AbstractEventLoop | None = None) -> _Turn | None:
        """``turn``, or a new place at the end of the queue for a new claim that did not fit (waiting
        in ``loop``, or in a thread)."""
        if turn is None and nbytes and not self._holds(holder):
            turn = _Turn(loop)
            self._turns.append(turn)
        return turn

    def _leave(self, turn: _Turn | None) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]:
        """Take ``turn`` out of the queue; assumes you hold ``self._cond``. The claim after it may
        fit now: the waiters to wake are returned, to be woken without the lock (:func:`_wake_all`)."""
        if turn is None:
            return []
        try:
            self._turns.remove(turn)
        except ValueError:
            return []
        waiters, self._waiters = self._waiters, []
        self._cond.notify_all()
        return waiters

    def acquire(self, nbytes: int, holder: int | None = None) -> None:
        """Wait until ``nbytes`` fit in the budget, then hold them. ``holder``: the number of the
        :class:`Ticket` that claims them, when it may already hold bytes. New claims are served
        in the order they came."""
        turn: _Turn | None = None
        woken = None
        with self._cond:
            try:
                while not self._fits(nbytes, holder, turn):
                    turn = self._queue(nbytes, holder, turn)
                    self._cond.wait(0.5)
                self._take(nbytes, holder)
            finally:
                woken = self._leave(turn)
        _wake_all(woken)

    async def acquire_async(self, nbytes: int, holder: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        turn: _Turn | None = None
        try:
            while True:
                with self._cond:
                    if self._fits(nbytes, holder, turn):
                        self._take(nbytes, holder)
                        return
                    turn = self._queue(nbytes, holder, turn, loop)
                    waiter = loop.create_future()
                    self._waiters.append((loop, waiter))
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), 0.5)
                except asyncio.TimeoutError:
                    pass
                finally:
                    # A waiter not woken (timed out or cancelled) leaves the list now, not at the next
                    # release: while publishing blocks for minutes, they would pile up every 0.5 s.
                    if not waiter.done():
                        with self._cond:
                            try:
                                self._waiters.remove((loop, waiter))
                            except ValueError:
                                pass
        finally:
            # Served, cancelled (stop()) or failed: the claims behind this one must not wait on it.
            with self._cond:
                woken = self._leave(turn)
            _wake_all(woken)

    def take(self, nbytes: int, holder: int | None = None) -> None:
        """Hold ``nbytes`` more at once, over the budget if need be: bytes a sample already has
        in memory (an object larger than the size it claimed)."""
        with self._cond:
            self._take(nbytes, holder)

    def release(self, nbytes: int, holder: int | None = None) -> None:
        if not nbytes:
            return
        with self._cond:
            self.bytes -= nbytes
            self._holders.discard(holder)
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        _wake_all(waiters)


class _Turn:
    """A new claim's place in the queue of :class:`Flow`; ``loop``: the event loop it waits in
    (``None``: a thread)."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop


def _wake_all(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] | None) -> None:
    for loop, waiter in waiters or ():
        try:
            loop.call_soon_threadsafe(_wake, waiter)
        except RuntimeError:
            pass  # its loop was closed with the claim waiting (see Flow._drop_abandoned): none to wake


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


_ticket_numbers = itertools.count()


@dataclass
class Ticket:
    """One sample's claim on its process's :class:`Flow`: the bytes it holds until written."""

    flow: Flow
    nbytes: int = 0
    number: int = field(default_factory=lambda: next(_ticket_numbers))  # older tickets have smaller ones

    def acquire(self, nbytes: int) -> None:
        self.flow.acquire(nbytes, self.number)
        self.nbytes += nbytes

    async def acquire_async(self, nbytes: int) -> None:
        await self.flow.acquire_async(nbytes, self.number)
        self.nbytes += nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        self.flow.release(nbytes, self.number)

    def give_back(self, nbytes: int) -> None:
        """Release ``nbytes`` of the bytes held (a read the sample dropped); the rest stay held."""
        nbytes = min(nbytes, self.nbytes)
        self.nbytes -= nbytes
        self.flow.release(nbytes, None if self.nbytes else self.number)

    def share_with(self, tickets: list[Ticket], weights: list[int]) -> None:
        """Hand the bytes held to ``tickets`` (this one among them) in proportion to ``weights``
        (equal shares if they are all 0): the reads of a whole ``sample_many`` batch claimed on its
        first ticket, and each sample of it holds its part until it is written."""
        if not self.nbytes:
            return
        total, parts = sum(weights), len(tickets)
        with self.flow._cond:
            held, given = self.nbytes, 0
            for n, ticket in enumerate(tickets):
                share = held - given if n == parts - 1 else (
                    held * weights[n] // total if total else held // parts)
                given += share
                ticket.nbytes = share
                if share:
                    self.flow._holders.add(ticket.number)
            if not self.nbytes:
                self.flow._holders.discard(self.number)

    def settle(self, claimed: int, nbytes: int) -> None:
        """A read that claimed ``claimed`` bytes gave ``nbytes``: hold what it gave (the claim of an
        object of unknown size was the whole budget; a listed size can be out of date)."""
        if nbytes < claimed:
            self.give_back(claimed - nbytes)
        elif nbytes > claimed:
            self.flow.take(nbytes - claimed, self.number)
            self.nbytes += nbytes - claimed


_TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("growcache_ticket", default=None)


def current_ticket() -> Ticket | None:
    """The ticket of the sample this thread or task is drawing, if a sampler runs it."""
    return _TICKET.get()


@dataclass
class Task:
    """One sample to draw: its global index, its RNG, its in-flight slot and its ticket."""

    index: int
    rng: np.random.Generator
    slot: int
    ticket: Ticket
    result: Any = None
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    """Runs tasks concurrently; finished tasks go to ``done`` (a queue the sampler drains)."""

    def __init__(self, source: Any, concurrency: int) -> None:
        self.source = source
        self.concurrency = concurrency
        self.done: queue.SimpleQueue[Task] = queue.SimpleQueue()

    def submit(self, task: Task) -> None:
        raise NotImplementedError

    def submit_many(self, tasks: list[Task]) -> None:
        for task in tasks:
            self.submit(task)

    def close(self) -> None:
        """Cancel what is in flight, without waiting for it."""


class AsyncEngine(Engine):
    """Tasks of one event loop: fsspec's I/O loop of this process (the async filesystems' own).

    Tasks cross into the loop in batches (one wake-up of the loop per batch, not per sample):
    on 2 cores each wake-up of another thread costs as much CPU as a small request.
    """

    def __init__(self, source: Any, concurrency: int) -> None:
        super().__init__(source, concurrency)
        import fsspec.asyn

        self._loop = fsspec.asyn.get_loop()
        self._running: set[asyncio.Task[None]] = set()
        self._closed = False

    def submit(self, task: Task) -> None:
        self.submit_many([task])

    def submit_many(self, tasks: list[Task]) -> None:
        if tasks:
            self._loop.call_soon_threadsafe(self._start, tasks)

    def _start(self, tasks: list[Task]) -> None:
        if self._closed:
            return
        for task in tasks:
            running = self._loop.create_task(self._run(task))
            self._running.add(running)
            running.add_done_callback(self._running.discard)

    async def _run(self, task: Task) -> None:
        _TICKET.set(task.ticket)
        try:
            task.result = await self.source.sample_async(task.rng)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the sampler, which reports it
            task.error = exc
        self.done.put(task)

    def close(self) -> None:
        def cancel() -> None:
            self._closed = True
            for running in list(self._running):
                running.cancel()

        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(cancel)


class ThreadEngine(Engine):
    """Daemon threads (never joined at exit: a stopped sampler does not wait for a slow store)."""

    def __init__(self, source: Any, concurrency: int) -> None:
        super().__init__(source, concurrency)
        self._todo: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"growcache-sample-{n}", daemon=True)
                         for n in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def submit(self, task: Task) -> None:
        self._todo.put(task)

    def _serve(self) -> None:
        while True:
            task = self._todo.get()
            if task is None:
                return
            _TICKET.set(task.ticket)
            try:
                task.result = self.source(task.rng)
            except BaseException as exc:  # noqa: BLE001 - handed to the sampler, which reports it
                task.error = exc
            self.done.put(task)

    def close(self) -> None:
        for _ in self._threads:
            self._todo.put(None)


class DaemonThreads:
    """A pool of daemon threads running calls, each with its :class:`concurrent.futures.Future`.

    ``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so a
    read hung on a silent store (NFS, a stalled server) would hold a stopped sampler process until
    the read returned; these threads are never joined. Threads start as calls come, up to ``workers``.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = max(1, workers), name
        self._todo: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple] | None] = \
            queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._todo.put((future, fn, args))
        if len(self._threads) < self._workers:
            thread = threading.Thread(target=self._serve, name=f"{self._name}-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return future

    def _serve(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the caller gets it from the future
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Take no more calls; the threads end once the calls they run return (never waited for)."""
        for _ in self._threads:
            self._todo.put(None)


class BatchEngine(Engine):
    """One thread that hands every task waiting to the source's ``sample_many(rngs)`` at once."""

    def __init__(self, source: Any, concurrency: int) -> None:
        super().__init__(source, concurrency)
        self._todo: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="growcache-sample-many", daemon=True).start()

    def submit(self, task: Task) -> None:
        self._todo.put(task)

    def _serve(self) -> None:
        while True:
            first = self._todo.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.concurrency:
                try:
                    task = self._todo.get_nowait()
                except queue.Empty:
                    break
                if task is None:
                    self._todo.put(None)
                    break
                batch.append(task)
            _TICKET.set(batch[0].ticket)
            try:
                results = list(self.source.sample_many([t.rng for t in batch]))
                if len(results) != len(batch):
                    raise ValueError(f"sample_many was given {len(batch)} RNGs and returned {len(results)} samples; "
                                     "it must return one sample per RNG, in their order")
                for task, result in zip(batch, results):
                    task.result = result
                # The batch's reads claimed their bytes on its first ticket, which the first sample
                # written would have let go for all: each sample now holds its own part.
                batch[0].ticket.share_with([t.ticket for t in batch], [_payload_bytes(r) for r in results])
            except BaseException as exc:  # noqa: BLE001 - handed to the sampler, which reports it
                for task in batch:
                    task.error = exc
            for task in batch:
                self.done.put(task)

    def close(self) -> None:
        self._todo.put(None)


def _payload_bytes(sample: Any) -> int:
    """The bytes of a sample's arrays (0 for what is not an array)."""
    values = sample.values() if isinstance(sample, Mapping) else ()
    return sum(int(getattr(value, "nbytes", 0)) for value in values)


def _ours(fn: Any) -> bool:
    return getattr(fn, "__module__", "").startswith("growcache.")


def _defines(source: Any, name: str) -> bool:
    """True if ``source``'s class has a method ``name`` of the user's own (not one a growcache base
    class defines: a store source's ``sample_async`` draws the store's sample, not an override's)."""
    fn = getattr(type(source), name, None)
    return callable(fn) and not _ours(fn)


def _store_source(source: Any) -> bool:
    """True for one of growcache's store sources that draws its samples with growcache's own methods.

    A subclass that replaces :meth:`sample` or ``sample_async`` is a user source: its
    ``concurrent_mode`` would bypass the override on an async store and call it from threads on
    a sync one, so the user-source rules decide instead.
    """
    return (getattr(source, "concurrent_mode", None) is not None
            and all(_ours(getattr(type(source), name, None)) for name in ("sample", "sample_async")))


def runs_concurrently(source: Any) -> bool:
    """True if ``source`` declared how to run concurrently (or is a store source, which always can)."""
    return (_store_source(source) or _defines(source, "sample_async") or _defines(source, "sample_many")
            or bool(getattr(source, "thread_safe", False)))


def make_engine(source: Any, concurrency: int) -> Engine | None:
    """The engine that runs ``source`` with ``concurrency`` samples in flight, or ``None`` for one at a time.

    Store sources declare their mode (:meth:`~growcache.store.StoreSource.concurrent_mode`);
    a user source runs concurrently only if it says it can, never by surprise.
    """
    if concurrency <= 1:
        return None
    if _store_source(source):
        how = source.concurrent_mode()
        if how == "async":
            return AsyncEngine(source, concurrency)
        if how == "threads":
            return ThreadEngine(source, concurrency)
    if _defines(source, "sample_async"):
        return AsyncEngine(source, concurrency)
    if _defines(source, "sample_many"):
        return BatchEngine(source, concurrency)
    if getattr(source, "thread_safe", False):
        return ThreadEngine(source, concurrency)
    return None
