"""SamplerPool: background processes that grow a cache from a source.

Each worker is a ``spawn``-started process (safe after TensorFlow or torch were imported)
with its own RNG stream, derived from ``(seed, worker index, restart count)``. It draws
samples from the source, writes them with a :class:`~growcache.ShardWriter` and publishes
a shard when it reaches ``shard_size`` or ``max_shard_age``. Publishing evicts the oldest
unleased shards to keep the cache's byte budget; when every shard left is leased, the
worker waits, never the trainer.

The training process sees workers through shared counters and an error queue: a
:class:`~growcache.SamplerError` with the worker's traceback surfaces from
:meth:`SamplerPool.raise_if_failed`, :meth:`~SamplerPool.wait_for` and
:meth:`~SamplerPool.stop`. Workers that die (SIGKILL, out of memory) are restarted a
bounded number of times, and their temporary shard files are removed; published shards
are never touched.

Worker exit reasons, and what the pool does:

* a :class:`~growcache.TransientSourceError` (the store kept failing after its retries)
  or a death without a report: restart, up to ``max_restarts`` times per worker in 10 minutes;
* any other exception (a bug in a sample function, a schema mismatch, a permanent
  :class:`~growcache.SourceError`): the pool fails at once, since a restart would fail
  the same way.
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ._size import format_size, parse_size
from .cache import Cache
from .errors import CacheFullError, SamplerError, SchemaError, TransientSourceError
from .example import ExampleCodec
from .records import FOOTER_BYTES, HEADER_BYTES
from .sources import Source, as_source
from .writer import remove_abandoned_temporaries

__all__ = ["SamplerPool", "SamplerStats", "run_sample_command", "worker_rng"]

logger = logging.getLogger(__name__)

# Per-worker slots of the shared counter array; each worker writes only its own slots.
_RECORDS, _BYTES, _PUB_RECORDS, _PUB_BYTES, _SHARDS, _DISCARDED, _PEAK_RSS_KB = range(7)
_NSLOTS = 7
_POLL_S = 0.05
DEFAULT_SHARD_SIZE = 256 * 10**6
_RATE_WINDOW_S = 5.0
_RESTART_WINDOW_S = 600.0  # max_restarts counts the restarts of this many seconds


def worker_rng(seed: int, worker: int, restart: int, run: int = 0) -> np.random.Generator:
    """The RNG of ``worker`` after ``restart`` restarts, in the ``run``-th pool started on its cache.

    Independent streams, reproducible by seed: a fresh cache sampled with one seed gets the
    same records again, and a later pool on the same cache never replays earlier ones.
    """
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(worker, restart, run)))


@dataclass(frozen=True)
class SamplerStats:
    """Live figures of a :class:`SamplerPool`.

    Attributes:
        records: records in shards this pool published.
        bytes: bytes of shards this pool published.
        shards: shards published.
        records_written: records written, the shards in progress included.
        bytes_written: bytes written, the shards in progress included.
        discarded: shards in progress dropped at stop (no room without waiting).
        mb_per_s: write rate over the last few seconds, in MB/s (10**6 bytes).
        mb_per_s_total: average write rate since start, in MB/s.
        elapsed: seconds since start.
        workers: workers alive now.
        restarts: restarts so far, all workers together.
        last_error: the last error a worker reported or died of, or ``None``.
        failed: the pool gave up; :meth:`SamplerPool.raise_if_failed` raises.
        worker_peak_rss: peak resident memory of each worker slot, in bytes.
    """

    records: int
    bytes: int
    shards: int
    records_written: int
    bytes_written: int
    discarded: int
    mb_per_s: float
    mb_per_s_total: float
    elapsed: float
    workers: int
    restarts: int
    last_error: str | None
    failed: bool
    worker_peak_rss: tuple[int, ...]


@dataclass(frozen=True)
class _WorkerConfig:
    cache: Cache
    source: Source
    seed: int
    shard_size: int
    max_shard_age: float | None
    record_frame: int
    log_level: int
    run: int = 0


class SamplerPool:
    """Background processes that draw samples from a source into a cache.

    Use it as a context manager (leaving the block stops it, even on an exception)::

        with SamplerPool(cache, source, workers=4) as pool:
            pool.wait_for(records=10_000, timeout=600)
            train(...)

    Args:
        cache: the cache to grow; it must have a schema. Every sample is validated
            against it.
        source: a :class:`~growcache.sources.Source` or a picklable function
            ``sample(rng) -> dict[str, ndarray]`` (a module-level function: lambdas and
            closures cannot reach spawned processes).
        workers: sampler processes. Default: ``1``.
        shard_size: a shard is published before it would grow past this size (int or
            ``"256MB"``). Default: ``"256MB"``, or a quarter of the cache's capacity if
            that is smaller.
        max_shard_age: seconds after its first record a shard is published even if
            small, so the first epoch has shards soon; ``None`` for size only.
            Default: ``10.0``.
        seed: seed of every worker's RNG stream (see :func:`worker_rng`). The cache counts
            the pools started on it, and the count is part of every stream's seed: a pool
            resumed on a cache that already holds samples draws new ones instead of replaying
            them, and a fresh cache with the same seed gets the same records. Default: ``0``.
        max_restarts: restarts allowed per worker within 10 minutes before the pool fails;
            older restarts no longer count, so a long-running pool survives outages that
            are far apart. Default: ``3``.

    Raises:
        CacheFullError: ``shard_size`` is larger than the cache's capacity.
        SchemaError: the cache has no schema.
        TypeError: the source does not pickle.
        ValueError: ``workers``, ``shard_size`` or ``max_shard_age`` is invalid.
    """

    def __init__(
        self,
        cache: Cache,
        source: Source | Callable[[np.random.Generator], Mapping[str, Any]],
        *,
        workers: int = 1,
        shard_size: int | str | None = None,
        max_shard_age: float | None = 10.0,
        seed: int = 0,
        max_restarts: int = 3,
    ) -> None:
        if cache.schema is None:
            raise SchemaError(
                f"cache {cache.path} has no schema, so samplers cannot write to it: open it with "
                "Cache(path, schema=Schema({...}))"
            )
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        if max_shard_age is not None and not max_shard_age > 0:
            raise ValueError(f"max_shard_age must be positive seconds or None, got {max_shard_age!r}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts!r}")
        if shard_size is None:
            # A small cache still gets a few shards' worth of rotation without configuration.
            size = min(DEFAULT_SHARD_SIZE, max(1, cache.capacity // 4))
        else:
            size = parse_size(shard_size, name="shard_size")
        if size > cache.capacity:
            raise CacheFullError(
                f"shard_size={format_size(size)} is larger than the capacity {format_size(cache.capacity)} of cache "
                f"{cache.path}: no shard could ever be published. Lower shard_size (a few percent of the "
                "capacity is typical) or raise the capacity."
            )
        frame = ExampleCodec(cache.schema).record_nbytes + HEADER_BYTES + FOOTER_BYTES
        if frame > size:
            raise ValueError(
                f"shard_size={format_size(size)} is smaller than one record ({format_size(frame)}): raise shard_size"
            )
        source = as_source(source)
        try:
            pickle.loads(pickle.dumps(source))
        except Exception as exc:
            raise TypeError(
                f"the source {source!r} must pickle to reach the sampler processes, but pickling failed: {exc}. "
                "Define sample functions at module level (not lambdas, closures or notebook cells)."
            ) from exc
        self.cache = cache
        self.source = source
        self.workers = workers
        self.shard_size = size
        self.max_shard_age = max_shard_age
        if int(seed) < 0:
            raise ValueError(f"seed must be 0 or more, got {seed}")
        self.seed = int(seed)
        self.max_restarts = max_restarts
        self._config = _WorkerConfig(cache, source, self.seed, size, max_shard_age, frame,
                                     logging.getLogger("growcache").getEffectiveLevel())
        self._ctx = mp.get_context("spawn")
        self._counters: Any = None
        self._events: Any = None
        self._stop_event: Any = None
        self._procs: list[Any] = [None] * workers
        self._restarts = [0] * workers
        self._restart_times: list[collections.deque[float]] = [collections.deque() for _ in range(workers)]
        self._pids: set[int] = set()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()
        self._reports: dict[int, dict[str, Any]] = {}
        self._failure: SamplerError | None = None
        self._failure_reported = False
        self._last_error: str | None = None
        self._started_at: float | None = None
        self._stopped_at: float | None = None
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self._state = "new"  # new -> running -> stopped

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> SamplerPool:
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Never hide the exception that ends the block behind a sampler failure.
        self.stop(raise_on_failure=exc_type is None)

    def __repr__(self) -> str:
        if not hasattr(self, "_state"):  # construction failed
            return "SamplerPool(<not constructed>)"
        return (f"SamplerPool({self.cache.path!r}, {self.source!r}, workers={self.workers}, "
                f"shard_size={self.shard_size}, state={self._state!r})")

    def start(self) -> SamplerPool:
        """Start the worker processes (a no-op if running).

        Raises:
            RuntimeError: the pool was stopped; make a new one.
        """
        if self._state == "running":
            return self
        if self._state == "stopped":
            raise RuntimeError("this SamplerPool was stopped; create a new SamplerPool to sample again")
        self._counters = self._ctx.Array("q", self.workers * _NSLOTS, lock=False)
        self._events = self._ctx.Queue()
        self._stop_event = self._ctx.Event()
        self._config = replace(self._config, run=self.cache._next_sampler_run())
        self._started_at = time.monotonic()
        self._state = "running"
        with self._lock:
            for index in range(self.workers):
                self._spawn(index)
        self._monitor = threading.Thread(target=self._watch, name="growcache-sampler-monitor", daemon=True)
        self._monitor.start()
        logger.info("sampler pool started: %d workers into %s", self.workers, self.cache.path)
        return self

    def _spawn(self, index: int) -> None:
        """Assumes you hold ``self._lock``."""
        proc = self._ctx.Process(
            target=_worker_main,
            args=(self._config, index, self._restarts[index], self._counters, self._events, self._stop_event,
                  os.getpid()),
            name=f"growcache-sampler-{index}",
            daemon=True,  # dies with the training process if stop() is never called
        )
        proc.start()
        self._procs[index] = proc
        self._pids.add(proc.pid)

    def stop(self, timeout: float = 30.0, *, raise_on_failure: bool = True) -> SamplerStats:
        """Stop the workers and return the final figures; idempotent.

        Each worker finishes its shard in progress (published if it fits now, else
        discarded; a worker waiting for leases gives up), then exits. Workers still
        running after ``timeout`` seconds are terminated; no temporary file is left.

        Raises:
            SamplerError: the pool failed and the failure was not raised before.
        """
        if self._state == "running":
            self._state = "stopped"
            self._stop_event.set()
            deadline = time.monotonic() + timeout
            self._monitor_stop.set()
            if self._monitor is not None:
                self._monitor.join()
            with self._lock:
                procs = [p for p in self._procs if p is not None]
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            for proc in procs:
                if proc.is_alive():
                    logger.warning("sampler %s did not stop within %.0f s; terminating it", proc.name, timeout)
                    proc.terminate()  # SIGTERM: the worker discards its shard and exits
                    proc.join(5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            self._drain_events()
            for index, report in sorted(self._reports.items()):
                if not report["transient"]:  # a worker failed while the pool stopped
                    self._fail(index, report)
            self._reports.clear()
            self._remove_temporaries()
            self._events.close()
            self._events.join_thread()
            self._stopped_at = time.monotonic()
            logger.info("sampler pool stopped: %s", self._summary())
        elif self._state == "new":
            self._state = "stopped"
        if raise_on_failure and self._failure is not None and not self._failure_reported:
            self._failure_reported = True
            raise self._failure
        return self.stats()

    # -- monitoring (a thread of the training process) -------------------------------------
    def _watch(self) -> None:
        while not self._monitor_stop.wait(_POLL_S):
            try:
                self._check_workers()
            except Exception:  # the monitor must never die silently
                logger.exception("sampler monitor error")
            now = time.monotonic()
            self._rate.append((now, self._total(_BYTES)))
            while self._rate and now - self._rate[0][0] > _RATE_WINDOW_S:
                self._rate.popleft()

    def _check_workers(self) -> None:
        with self._lock:
            dead = [(i, p) for i, p in enumerate(self._procs) if p is not None and not p.is_alive()]
        # A dead worker flushed its report before exiting, so reading reports after the
        # liveness check sees every report of every worker found dead.
        self._drain_events()
        for index, proc in dead:
            proc.join()
            self._remove_temporaries()
            report = self._reports.pop(index, None)
            if self._stop_event.is_set():
                with self._lock:
                    self._procs[index] = None
                if report is not None and not report["transient"]:
                    self._fail(index, report)
                continue
            if report is not None and not report["transient"]:
                self._fail(index, report)
                continue
            why = (report["summary"] if report is not None
                   else f"worker {index} (pid {proc.pid}) died with {_exit_reason(proc.exitcode)}")
            self._last_error = why
            recent = self._restart_times[index]
            while recent and time.monotonic() - recent[0] > _RESTART_WINDOW_S:
                recent.popleft()  # a pool that runs for days must survive an outage a day
            if len(recent) >= self.max_restarts:
                self._fail(index, {"summary": (
                    f"{why}; it was restarted {len(recent)} times in the last {_RESTART_WINDOW_S:.0f} s "
                    f"(max_restarts={self.max_restarts}), "
                    "so the pool gives up. If workers die at start, check that the source is importable in a new "
                    "process (module-level code, not a notebook's __main__); if they are killed, check memory."
                ), "traceback": report["traceback"] if report else "",
                    "exception": report["exception"] if report else None})
                continue
            with self._lock:
                if self._state != "running" or self._stop_event.is_set():
                    continue
                self._restarts[index] += 1  # never reused: each restart's random stream is new
                recent.append(time.monotonic())
                logger.warning("%s; restarting it (restart %d of %d within %.0f s)", why, len(recent),
                               self.max_restarts, _RESTART_WINDOW_S)
                self._spawn(index)

    def _drain_events(self) -> None:
        """Move worker reports from the queue into ``self._reports`` (latest per worker)."""
        while True:
            try:
                event = self._events.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            self._reports[event["worker"]] = event
            self._last_error = event["summary"]
            logger.info("sampler %s", event["summary"])

    def _fail(self, index: int, report: Mapping[str, Any]) -> None:
        if self._failure is not None:
            return
        message = report["summary"]
        if report.get("traceback"):
            message += "\n\nWorker traceback:\n" + report["traceback"]
        error = SamplerError(message)
        if report.get("exception") is not None:
            try:
                error.__cause__ = pickle.loads(report["exception"])
            except Exception:  # an exception class the training process cannot import
                pass
        error.worker = index  # type: ignore[attr-defined]
        error.worker_traceback = report.get("traceback", "")  # type: ignore[attr-defined]
        self._failure = error
        self._last_error = report["summary"]
        logger.error("sampler pool failed: %s", report["summary"])
        self._stop_event.set()  # the other workers stop too: the pool never limps on silently

    def _remove_temporaries(self) -> None:
        """Delete temporary shards of this pool's dead workers (a SIGKILL leaves one)."""
        for name in remove_abandoned_temporaries(self.cache.shards_dir, owners=self._pids):
            logger.info("removed %s, left by a dead sampler", name)

    # -- figures --------------------------------------------------------------------------------
    def _total(self, slot: int) -> int:
        if self._counters is None:
            return 0
        return sum(self._counters[i * _NSLOTS + slot] for i in range(self.workers))

    def stats(self) -> SamplerStats:
        """The pool's figures now (cheap: shared counters, no I/O)."""
        # A stopped pool's figures are final: its clock stops with it, and it writes nothing more.
        end = self._stopped_at if self._stopped_at is not None else time.monotonic()
        elapsed = end - self._started_at if self._started_at is not None else 0.0
        written = self._total(_BYTES)
        rate = 0.0
        if len(self._rate) >= 2 and self._stopped_at is None:
            (t0, b0), (t1, b1) = self._rate[0], self._rate[-1]
            rate = (b1 - b0) / (t1 - t0) / 1e6 if t1 > t0 else 0.0
        with self._lock:
            alive = sum(1 for p in self._procs if p is not None and p.is_alive())
        return SamplerStats(
            records=self._total(_PUB_RECORDS),
            bytes=self._total(_PUB_BYTES),
            shards=self._total(_SHARDS),
            records_written=self._total(_RECORDS),
            bytes_written=written,
            discarded=self._total(_DISCARDED),
            mb_per_s=rate,
            mb_per_s_total=written / elapsed / 1e6 if elapsed > 0 else 0.0,
            elapsed=elapsed,
            workers=alive,
            restarts=sum(self._restarts),
            last_error=self._last_error,
            failed=self._failure is not None,
            worker_peak_rss=tuple(
                (self._counters[i * _NSLOTS + _PEAK_RSS_KB] * 1024 if self._counters is not None else 0)
                for i in range(self.workers)
            ),
        )

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers alive now."""
        with self._lock:
            return [p.pid for p in self._procs if p is not None and p.is_alive()]

    def _summary(self) -> str:
        s = self.stats()
        return (f"{s.records} records in {s.shards} shards ({format_size(s.bytes)}), "
                f"{s.mb_per_s_total:.1f} MB/s, {s.restarts} restarts")

    def raise_if_failed(self) -> None:
        """Raise the pool's :class:`~growcache.SamplerError` (with the worker's traceback) if it failed."""
        if self._failure is not None:
            self._failure_reported = True
            raise self._failure

    def wait_for(self, records: int | None = None, *, shards: int | None = None,
                 timeout: float | None = None) -> SamplerStats:
        """Block until this pool published ``records`` records (and/or ``shards`` shards).

        Counts what this pool published, evicted or not, so a small cache cannot make
        it wait forever.

        Raises:
            SamplerError: the pool failed (at once, not at the timeout).
            TimeoutError: ``timeout`` seconds passed first.
            RuntimeError: the pool is not running.
        """
        if records is None and shards is None:
            raise ValueError("wait_for needs records= or shards=")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.raise_if_failed()
            s = self.stats()
            if (records is None or s.records >= records) and (shards is None or s.shards >= shards):
                return s
            if self._state != "running":
                raise RuntimeError(f"the SamplerPool is {self._state}: call start() (or use `with`) first")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {timeout} s for {records} records / {shards} shards; the pool published "
                    f"{s.records} records in {s.shards} shards ({s.mb_per_s:.1f} MB/s, {s.workers} workers alive, "
                    f"last error: {s.last_error}). Raise the timeout, add workers or check the source."
                )
            time.sleep(_POLL_S)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


# -- the worker process ---------------------------------------------------------------------
class _Terminated(BaseException):
    """Raised in a worker by SIGTERM, so that the shard in progress is discarded on the way out."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def _peak_rss_kb() -> int:
    """Peak resident memory of this process in KiB.

    ``VmHWM`` rather than ``ru_maxrss``: the latter survives ``exec``, so a spawned worker
    would report the peak of the training process it was forked from.
    """
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except (ImportError, OSError):
        return 0


def _worker_main(cfg: _WorkerConfig, index: int, restart: int, counters: Any, events: Any, stop_event: Any,
                 parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group: the training process decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    log = logging.getLogger("growcache")
    log.setLevel(cfg.log_level)
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"growcache sampler {index} %(levelname)s %(message)s"))
        log.addHandler(handler)
    base = index * _NSLOTS

    def stopping() -> bool:
        # The parent may die without calling stop(): never outlive it.
        return stop_event.is_set() or os.getppid() != parent_pid

    writer = None
    source = cfg.source
    try:
        cache, rng = cfg.cache, worker_rng(cfg.seed, index, restart, cfg.run)
        opened = 0.0
        sample_s = 0.0  # running mean of one sample's time, to publish before a slow one

        def publish() -> None:
            nonlocal writer
            current, writer = writer, None
            try:
                info = current.close()
            except CacheFullError:
                if not stopping():
                    raise
                counters[base + _DISCARDED] += 1  # stopping while leases fill the budget
                return
            if info is not None:
                counters[base + _PUB_RECORDS] += info.records
                counters[base + _PUB_BYTES] += info.nbytes
                counters[base + _SHARDS] += 1
            counters[base + _PEAK_RSS_KB] = _peak_rss_kb()

        while not stopping():
            if (writer is not None and cfg.max_shard_age is not None
                    and time.monotonic() - opened + sample_s >= cfg.max_shard_age):
                publish()
            start = time.monotonic()
            sample = source(rng)
            took = time.monotonic() - start
            sample_s = took if sample_s == 0.0 else 0.8 * sample_s + 0.2 * took
            if writer is None:
                writer = cache.writer(should_stop=stopping)
                opened = time.monotonic()
            writer.write(sample)  # validates against the schema
            counters[base + _RECORDS] += 1
            counters[base + _BYTES] += cfg.record_frame
            if writer.nbytes + cfg.record_frame > cfg.shard_size:
                publish()
        if writer is not None:
            publish()  # the shard in progress is finished: published if it fits without waiting
        counters[base + _PEAK_RSS_KB] = _peak_rss_kb()
    except _Terminated:
        pass  # the finally below discards the shard in progress
    except BaseException as exc:
        _report(events, source, index, restart, exc)
        raise SystemExit(1) from None
    finally:
        if writer is not None:
            writer.abort()
        events.close()
        events.join_thread()  # the report must reach the pipe before the process exits


def _report(events: Any, source: Source, index: int, restart: int, exc: BaseException) -> None:
    redact = source.redact
    text = redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    summary = redact(f"worker {index} (restart {restart}) failed: {type(exc).__name__}: {exc}")
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    events.put({"worker": index, "restart": restart, "transient": isinstance(exc, TransientSourceError),
                "summary": summary, "traceback": text, "exception": pickled})


# -- command line -----------------------------------------------------------------------------
def _parse_storage_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["a=1", "client_kwargs.endpoint_url=http://h"]`` -> nested dict; values parsed as JSON if they are."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {pair!r}: write KEY=VALUE (nested keys with dots: client_kwargs.x=y)")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = options
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--storage-option {key}: {part} is already set to a value")
        node[leaf] = value
    return options


def _check_shard_size(shard_size: int | str | None, capacity: int | str | None) -> None:
    if shard_size is None or capacity is None:
        return
    shard_bytes, capacity_bytes = parse_size(shard_size, name="--shard-size"), parse_size(capacity, name="--capacity")
    if shard_bytes > capacity_bytes:
        raise ValueError(f"--shard-size {shard_size} is larger than the cache's capacity of {capacity_bytes} bytes: "
                         "lower --shard-size or raise --capacity")


def run_sample_command(args: Any) -> int:
    """``growcache sample``: grow a cache from a source URL until Ctrl-C or ``--records``.

    ``args`` carries: ``source`` (URL or glob), ``cache`` (directory), ``capacity``,
    ``workers``, ``window``, ``feature``, ``dtype``, ``shape``, ``storage_option`` (list of
    KEY=VALUE), ``records``, ``shard_size``, ``max_shard_age``, ``seed``, ``quiet``. When the
    cache has no schema yet, it is taken from one sample drawn here.

    Returns:
        0 when it stopped as asked (``--records`` reached or Ctrl-C), 1 on failure.
    """
    from tqdm import tqdm

    from .schema import Schema
    from .sources import open_source

    shape = getattr(args, "shape", None)
    if isinstance(shape, str):
        shape = tuple(int(d) for d in shape.replace("x", ",").split(",") if d.strip())
    # ValueErrors here are usage errors: the CLI reports them and exits 2.
    if (getattr(args, "dtype", None) is None) != (shape is None):
        raise ValueError("--dtype and --shape go together: raw objects need both; .npy objects need neither")
    workers = getattr(args, "workers", 1)
    if workers is None or workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    seed = getattr(args, "seed", 0) or 0
    if seed < 0:
        raise ValueError(f"--seed must be 0 or more, got {seed}")
    shard_size = getattr(args, "shard_size", None)
    _check_shard_size(shard_size, getattr(args, "capacity", None))
    options = _parse_storage_options(getattr(args, "storage_option", None))
    source = open_source(args.source, window=getattr(args, "window", None), feature=getattr(args, "feature", "x"),
                         dtype=getattr(args, "dtype", None), shape=shape, storage_options=options)
    cache = Cache(args.cache, capacity=getattr(args, "capacity", None))
    if cache.schema is None:
        probe = source(np.random.default_rng(seed))
        schema = Schema({k: (np.asarray(v).dtype.newbyteorder("<").name, np.asarray(v).shape) for k, v in probe.items()})
        cache = Cache(args.cache, capacity=getattr(args, "capacity", None), schema=schema)
        logger.info("cache %s: schema %r taken from the source", cache.path, schema)
    target = getattr(args, "records", None)
    _check_shard_size(shard_size, cache.capacity)
    pool = SamplerPool(cache, source, workers=workers, shard_size=shard_size,
                       max_shard_age=getattr(args, "max_shard_age", 10.0), seed=seed)
    interrupted = False
    with tqdm(total=target, unit="rec", desc="sample", disable=getattr(args, "quiet", False) or None) as bar:
        pool.start()
        try:
            while True:
                pool.raise_if_failed()
                s = pool.stats()
                bar.update(s.records - bar.n)
                cs = cache.stats()
                bar.set_postfix_str(f"{s.mb_per_s:.1f} MB/s, cache {format_size(cs.bytes)}/"
                                    f"{format_size(cs.capacity)}, evicted {cs.evicted}", refresh=False)
                if target is not None and s.records >= target:
                    break
                time.sleep(0.25)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            final = pool.stop(raise_on_failure=False)
    if final.failed:
        pool.raise_if_failed()
    logger.info("%s%s", "interrupted: " if interrupted else "", pool._summary())
    return 0
