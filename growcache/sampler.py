"""SamplerPool: background processes that grow a cache from a source.

Each worker is a ``spawn``-started process (safe after TensorFlow or torch were imported)
with its own RNG stream, derived from ``(seed, worker index, restart count)``. It draws
samples from the source, writes them with a :class:`~growcache.ShardWriter` and publishes
a shard when it reaches ``shard_size`` or ``max_shard_age``. Publishing evicts the oldest
unleased shards to keep the cache's byte budget; when every shard left is leased, the
worker waits, never the trainer.

The training process sees workers through shared counters and one report pipe per worker: a
:class:`~growcache.SamplerError` with the worker's traceback surfaces from
:meth:`SamplerPool.raise_if_failed`, :meth:`~SamplerPool.wait_for` and
:meth:`~SamplerPool.stop`. Workers that die (SIGKILL, out of memory) are restarted a
bounded number of times, and their temporary shard files are removed; published shards
are never touched.

A source is one of two kinds:

* a *sample source* (:class:`~growcache.sources.Source`, or a plain ``sample(rng) -> dict``
  function): the worker encodes its samples into shards, as above;
* a *shard source* (:class:`~growcache.shard_source.ShardSource`, such as
  :class:`~growcache.TFRecordShardSource`): ``fetch(job)`` yields whole verified temporary
  shard files, which the worker publishes as they come (each one's ``commit`` hook runs
  under the cache lock as it appears); an empty ``fetch`` means nothing to do now, and
  the worker asks again shortly. ``shard_size`` caps the shards it yields;
  ``max_shard_age`` and ``stop_after`` do not apply.

Worker exit reasons, and what the pool does:

* a :class:`~growcache.TransientSourceError` (the store kept failing after its retries)
  or a death without a report: restart, up to ``max_restarts`` times per worker in 10 minutes;
* any other exception (a bug in a sample function, a schema mismatch, a permanent
  :class:`~growcache.SourceError`): the pool fails at once, since a restart would fail
  the same way;
* ``stop_after`` records sampled: the worker publishes its shard in progress and exits;
  it is not restarted.

Workers start without re-running the user's script (``__main__``) when the source pickles
without reference to it: each worker then imports only the modules the source needs, not
what the script imports at its top (TensorFlow costs about 500 MB and seconds per worker).
A source defined in the script itself needs the script, so its workers re-run it, and the
pool warns once.

The pool creates no POSIX named semaphore (``/dev/shm/sem.*``): a process-group kill
(``scancel``, ``docker kill``, a cgroup's OOM kill) also kills ``multiprocessing``'s
resource tracker, which would unlink them, so every one would stay behind until reboot.
Reports travel over pipes, stop is a flag in shared memory that workers poll, and the
``stop_after`` quota is claimed under an ``fcntl`` record lock on a file without a name;
all of it vanishes with the last process holding it.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import pickletools
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from multiprocessing import connection as mp_connection, reduction as mp_reduction
from typing import Any

import numpy as np

from ._size import format_size, parse_size
from . import _sampler_stats
from ._concurrent import (DEFAULT_CONCURRENCY, DEFAULT_MAX_BYTES_IN_FLIGHT, Flow, Task, Ticket, make_engine,
                          runs_concurrently)
from . import _proc
from .cache import Cache
from .errors import CacheFullError, GrowcacheError, SamplerError, SchemaError, TransientSourceError
from .example import ExampleCodec
from .records import FOOTER_BYTES, HEADER_BYTES
from .shard_source import FetchJob, ShardSource
from .sources import Source, as_source
from .shard import scan_shards
from .writer import discard_temporary, remove_abandoned_temporaries, temp_owner, temp_token

read_sampler_stats = _sampler_stats.read_sampler_stats

__all__ = ["SamplerPool", "SamplerStats", "describe_mismatch", "read_sampler_stats", "sample_rng", "worker_rng"]

logger = logging.getLogger(__name__)

# Per-worker slots of the shared counter array; each worker writes only its own slots.
(_RECORDS, _BYTES, _PUB_RECORDS, _PUB_BYTES, _SHARDS, _DISCARDED, _PEAK_RSS_KB, _DONE, _ANSWERED, _REQUESTS,
 _LIMIT, _P50_US, _P95_US, _P99_US, _THROTTLES, _PEAK_INFLIGHT_BYTES) = range(16)
_NSLOTS = 16
# Slots of the pool's shared control array: the stop flag (the parent writes it, workers poll
# it); the next global sample index, the end of the indices (stop_after, or -1) and how many
# indices wait in the returned pool (these three change only under the index lock).
_STOP, _NEXT, _END, _NRETURNED = range(4)
# A worker writes one shard while it publishes the one before (fsync and rename take long next
# to a far store's round trip), so its row of the open-index array has two shard areas. Each
# area's header: its records, a flag raised while it is being published, and the token of its
# temporary file's name (which tells, after a death, whether the rename happened).
_AREA_COUNT, _AREA_PUBLISHING, _AREA_TOKEN = 0, 1, 2
_AREA_HEAD = 3
_OPEN_HEAD = 0
# A shard in progress holds at most this many records, so that its indices fit a fixed array.
_MAX_SHARD_RECORDS = 65536
_POLL_S = 0.05
_FETCH_IDLE_S = 0.2  # a shard source with nothing to fetch is asked again after this long
DEFAULT_SHARD_SIZE = 256 * 10**6
_RATE_WINDOW_S = 5.0
_STATS_FILE_S = 1.0  # the stats file is rewritten this often
_FIRST_SHARD_AGE_S = 1.0  # a worker's first shard: after a tenth of max_shard_age, or this if longer
_SERIAL_CLAIMS = 8  # indices a worker drawing one sample at a time claims under one lock
_RESTART_WINDOW_S = 600.0  # max_restarts counts the restarts of this many seconds
# After stop(), a worker still inside one sample call this long is interrupted (a silent store).
_INTERRUPT_AFTER_S = 0.5
_PARENT_CHECK_S = 0.1  # a worker looks this often whether the training process is still there
_GATHER_S = 0.002  # finished samples a concurrent worker lets gather before it writes them (see _run_concurrent)
_MAIN_MODULES = frozenset({"__main__", "__mp_main__"})


def default_shard_size(capacity: int) -> int:
    """The shard size of a pool given none, for a cache of ``capacity`` bytes: a small cache
    still gets a few shards' worth of rotation without configuration."""
    return min(DEFAULT_SHARD_SIZE, max(1, capacity // 4))


def worker_rng(seed: int, worker: int, restart: int, run: int = 0) -> np.random.Generator:
    """The RNG of ``worker`` after ``restart`` restarts, in the ``run``-th pool started on its cache.

    Shard sources draw their choices from it. Independent streams, reproducible by seed.
    """
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(worker, restart, run)))


def sample_rng(seed: int, index: int, run: int = 0) -> np.random.Generator:
    """The RNG of the ``index``-th sample of the ``run``-th pool started on a cache.

    Every sample has its own stream, keyed by the pool's seed, the run and a global sample
    index that the workers claim from the pool one at a time. Which samples are drawn
    therefore depends on neither the number of workers, nor the concurrency, nor the order
    in which requests finish: a fresh cache sampled with one seed and ``stop_after`` gets the
    same set of records again, and a later pool on the same cache (a new run) never replays
    earlier ones.

    The stream is a counter-based Philox generator whose key is (a hash of seed and run, the
    index): a distinct key per sample, made in about half the time of a ``SeedSequence``.
    """
    return np.random.Generator(np.random.Philox(key=np.array([_run_key(seed, run), index], dtype=np.uint64)))


_RUN_KEYS: dict[tuple[int, int], int] = {}


def _run_key(seed: int, run: int) -> int:
    key = _RUN_KEYS.get((seed, run))
    if key is None:
        key = int(np.random.SeedSequence(seed, spawn_key=(run,)).generate_state(1, np.uint64)[0])
        _RUN_KEYS[(seed, run)] = key
    return key


class _ReusedSampleRNG:
    """:func:`sample_rng`'s streams through one generator whose key is reset per sample (a
    fifth of the cost of a new one): for a worker that draws one sample at a time."""

    def __init__(self, seed: int, run: int) -> None:
        self._key = np.array([_run_key(seed, run), 0], dtype=np.uint64)
        self._bits = np.random.Philox(key=self._key)
        self._rng = np.random.Generator(self._bits)
        # A fresh stream's state (counter zero, buffer empty), set again for every sample with
        # only the key's index changed in place: the setter copies the values it is given.
        self._state = self._bits.state
        self._state["state"] = {"counter": np.zeros(4, dtype=np.uint64), "key": self._key}
        self._state["buffer_pos"], self._state["has_uint32"], self._state["uinteger"] = 4, 0, 0

    def __call__(self, index: int) -> np.random.Generator:
        self._key[1] = index
        self._bits.state = self._state
        return self._rng


class _Indices:
    """The ledger of global sample indices, shared by the pool's processes.

    An index is claimed from the returned pool first, else from the counter (up to
    ``stop_after``), under one process lock. Each worker records in its own row of a shared
    array the indices it holds: one slot per sample in flight, then two shard areas (the
    shard in progress, and the one being published). When a worker dies, the pool moves every
    index it held and did not publish back to the returned pool, so a restart neither replays
    nor skips one.

    The stores are ordered so that a worker killed between any two of them leaves an index
    either held twice (which :meth:`refund` removes) or still unclaimed, never lost. A shard
    being published is flagged first: if the worker dies then, whether its temporary file is
    still there tells whether the rename happened.
    """

    def __init__(self, control: Any, returned: Any, held: Any, lock: _ProcessLock, slots: int, shard_cap: int,
                 worker: int = -1) -> None:
        self.control, self.returned, self.held, self.lock = control, returned, held, lock
        self.slots, self.shard_cap = slots, shard_cap
        self.area_size = _AREA_HEAD + shard_cap
        self.row = _OPEN_HEAD + slots + 2 * self.area_size
        self.worker = worker
        self.base = worker * self.row

    @staticmethod
    def row_size(slots: int, shard_cap: int) -> int:
        return _OPEN_HEAD + slots + 2 * (_AREA_HEAD + shard_cap)

    def for_worker(self, worker: int) -> _Indices:
        return _Indices(self.control, self.returned, self.held, self.lock, self.slots, self.shard_cap, worker)

    def _area(self, area: int, base: int | None = None) -> int:
        return (self.base if base is None else base) + _OPEN_HEAD + self.slots + area * self.area_size

    # -- a worker's side -------------------------------------------------------------------------
    def claim_slots(self, slots: list[int]) -> list[tuple[int, int]]:
        """New indices, one held in each in-flight slot of ``slots`` in turn, under one lock;
        ``(slot, index)`` pairs in claim order, fewer than the slots once ``stop_after``
        indices are all claimed."""
        held, control, at = self.held, self.control, self.base + _OPEN_HEAD
        out: list[tuple[int, int]] = []
        with self.lock:
            for slot in slots:
                waiting = control[_NRETURNED]
                if waiting > 0:
                    index = self.returned[waiting - 1]
                    held[at + slot] = index
                    control[_NRETURNED] = waiting - 1
                else:
                    index = control[_NEXT]
                    if 0 <= control[_END] <= index:
                        break
                    held[at + slot] = index
                    control[_NEXT] = index + 1
                out.append((slot, index))
        return out

    def opened(self, area: int, token: int) -> None:
        """A new shard in progress, whose temporary's name ends in ``token``, fills ``area``."""
        at = self._area(area)
        self.held[at + _AREA_COUNT] = 0
        self.held[at + _AREA_PUBLISHING] = 0
        self.held[at + _AREA_TOKEN] = token

    def written(self, area: int, slot: int, index: int) -> None:
        """Index ``index`` of in-flight ``slot`` is now a record of the shard in ``area``."""
        held, at = self.held, self._area(area)
        count = held[at + _AREA_COUNT]
        held[at + _AREA_HEAD + count] = index
        held[at + _AREA_COUNT] = count + 1
        held[self.base + _OPEN_HEAD + slot] = -1

    def publishing(self, area: int, flag: bool) -> None:
        self.held[self._area(area) + _AREA_PUBLISHING] = int(flag)

    def published(self, area: int) -> None:
        """The shard of ``area`` was published: its indices are done."""
        at = self._area(area)
        self.held[at + _AREA_COUNT] = 0
        self.held[at + _AREA_PUBLISHING] = 0

    def give_back(self, area: int) -> None:
        """The shard of ``area`` was discarded: its indices go back to the pool."""
        self.refund(self.worker, lambda token: False, areas=(area,), in_flight=False)

    # -- the pool's side -------------------------------------------------------------------------
    def refund(self, worker: int, renamed: Callable[[int], bool], *, areas: tuple[int, ...] = (0, 1),
               in_flight: bool = True) -> int:
        """Move the indices ``worker`` held and did not publish back to the pool; return how many.

        ``renamed(token)`` tells whether the shard whose temporary's name ends in ``token``
        was published (its temporary is gone) when a shard was being published at the death.
        """
        base, held, control = worker * self.row, self.held, self.control
        with self.lock:
            lost = []
            for area in areas:
                at = self._area(area, base)
                count = min(max(held[at + _AREA_COUNT], 0), self.shard_cap)
                if not (held[at + _AREA_PUBLISHING] and renamed(held[at + _AREA_TOKEN])):
                    lost += list(held[at + _AREA_HEAD:at + _AREA_HEAD + count])
                held[at + _AREA_COUNT] = 0
                held[at + _AREA_PUBLISHING] = 0
            if in_flight:
                slots = base + _OPEN_HEAD
                lost += [i for i in held[slots:slots + self.slots] if i >= 0]
                held[slots:slots + self.slots] = [-1] * self.slots
            waiting = control[_NRETURNED]
            # A worker killed between two stores holds an index it never took, or one twice.
            already = set(self.returned[:waiting])
            fresh = sorted({i for i in lost if 0 <= i < control[_NEXT] and i not in already}, reverse=True)
            for n, index in enumerate(fresh):
                self.returned[waiting + n] = index
            control[_NRETURNED] = waiting + len(fresh)
            return len(fresh)


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
        finished: every worker stopped by itself after the pool's ``stop_after`` records.
        requests_in_flight: store requests in flight now, all workers together.
        in_flight_limit: samples each worker may keep in flight now, all workers together
            (``concurrency`` per worker, less while the store throttles).
        latency_p50: median latency of recent store requests, in seconds (the slowest
            worker's figure; ``0.0`` before any request or for sources without a store).
        latency_p95: 95th percentile of the same, in seconds.
        latency_p99: 99th percentile of the same, in seconds.
        throttle_events: requests the store throttled (HTTP 429/503, SlowDown) or dropped
            the connection of, each of which cut the in-flight limit.
        peak_bytes_in_flight: the most bytes one worker held in samples fetched or being
            fetched and not yet written (at most ``max_bytes_in_flight``).
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
    finished: bool = False
    requests_in_flight: int = 0
    in_flight_limit: int = 0
    latency_p50: float = 0.0
    latency_p95: float = 0.0
    latency_p99: float = 0.0
    throttle_events: int = 0
    peak_bytes_in_flight: int = 0


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
    stop_after: int | None = None
    concurrency: int = 1
    max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT
    shard_records: int = _MAX_SHARD_RECORDS


class SamplerPool:
    """Background processes that draw samples from a source into a cache.

    Use it as a context manager (leaving the block stops it, even on an exception)::

        with SamplerPool(cache, source, workers=4) as pool:
            pool.wait_for(records=10_000, timeout=600)
            train(...)

    Concurrent sampling: each worker keeps up to ``concurrency`` samples in flight. The store
    sources (:class:`~growcache.sources.NpyWindowSource`, :class:`~growcache.sources.ObjectSource`)
    run them as tasks of one event loop (fsspec's ``_cat_file``) on s3, gs and http, and in
    threads on local files. A user source runs concurrently only if it declares how, checked
    in this order: ``async def sample_async(self, rng)`` (tasks of one event loop);
    ``def sample_many(self, rngs)`` (one call with up to ``concurrency`` RNGs, one sample
    back per RNG, in order); ``thread_safe = True`` (``FunctionSource(fn, thread_safe=True)``:
    threads call it at once). Any other source is called one sample at a time, and the log
    says once how to enable concurrency. A subclass of a store source that overrides ``sample``
    is a user source too: it needs its own ``sample_async`` or ``thread_safe = True``. Each
    sample's RNG comes from (seed, run, a global
    sample index the workers claim from the pool), see :func:`sample_rng`; records are
    written in the order they finish. Each store request is retried under the source's
    :class:`~growcache.sources.RetryPolicy`; throttling (HTTP 429/503, SlowDown) and dropped
    connections halve the samples in flight, which then grow back by one per round of
    answers; an outage of a store that answered before is ridden out for
    ``RetryPolicy.outage_budget`` seconds (default 10 minutes) while training reads the
    cache. :meth:`stop` cancels the requests in flight without waiting for them.

    Args:
        cache: the cache to grow; it must have a schema. Every sample is validated
            against it.
        source: a :class:`~growcache.sources.Source` or a picklable function
            ``sample(rng) -> dict[str, ndarray]`` (a module-level function: lambdas and
            closures cannot reach spawned processes); or a shard source such as
            :class:`~growcache.TFRecordShardSource` (see the module docstring).
        workers: sampler processes. Default: ``1``.
        shard_size: a shard is published before it would grow past this size (int or
            ``"256MB"``). Default: ``"256MB"``, or a quarter of the cache's capacity if
            that is smaller.
        max_shard_age: seconds after its first record a shard is published even if
            small, so the first epoch has shards soon (a worker's first shard: after a tenth
            of it, or 1 s if that is longer: 1 s at the default); ``None`` for size only.
            Default: ``10.0``.
        seed: seed of every worker's RNG stream (see :func:`worker_rng`). The cache counts
            the pools started on it, and the count is part of every stream's seed: a pool
            resumed on a cache that already holds samples draws new ones instead of replaying
            them, and a fresh cache with the same seed gets the same records. Default: ``0``.
        max_restarts: restarts allowed per worker within 10 minutes before the pool fails;
            older restarts no longer count, so a long-running pool survives outages that
            are far apart. Default: ``3``.
        stop_after: sample this many records in all, then stop: each worker publishes its
            shard in progress, however small, and exits. Records of a shard a dead worker
            lost are sampled again, so the pool publishes exactly this many unless it is
            stopped first. :meth:`join` waits for the end. ``None`` samples until
            :meth:`stop`. Default: ``None``.
        concurrency: samples each worker keeps in flight. Store sources fetch them
            concurrently (fsspec's async interface on s3, gs and http, threads on local
            files), so one worker fills at many times one request per round trip; a user
            source runs concurrently only if it declares it can (see
            :class:`~growcache.sources.Source`), else one sample at a time. ``1`` draws one
            sample at a time, as growcache did before. Every sample has its own RNG (see
            :func:`sample_rng`), so the records drawn do not depend on it. Default: ``64``
            (measured: 32 in flight cannot reach 300 MB/s of 1 MiB windows at 100 ms, since
            a sample holds its slot until it is written; see docs/benchmarks.md).
        max_bytes_in_flight: bytes each worker may hold in samples being fetched or waiting
            for the shard writer (int or ``"64MiB"``); a sample larger than this is fetched
            alone. An object whose size the store does not tell is claimed piece by piece as
            it streams in (on an async filesystem; else as the whole budget, fetched alone),
            until a fetch tells its size. Samples get their bytes in the order they ask: a
            large one is not passed over by smaller ones asking after it. With large samples
            this, not ``concurrency``, bounds the samples in flight: 64 of 1 MiB, 16 of 4 MiB.
            A source that reads several times per sample (a user source drawing two windows,
            an object streamed in pieces) holds its first reads while it waits: the oldest
            such sample goes over the bound, by its later reads, so that one always finishes.
            Default: ``"64MiB"``.

    Raises:
        CacheFullError: ``shard_size`` is larger than the cache's capacity.
        SchemaError: the cache has no schema.
        TypeError: the source does not pickle.
        ValueError: ``workers``, ``shard_size``, ``max_shard_age``, ``concurrency`` or
            ``max_bytes_in_flight`` is invalid.
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
        stop_after: int | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        max_bytes_in_flight: int | str = DEFAULT_MAX_BYTES_IN_FLIGHT,
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
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= 4096:
            raise ValueError(f"concurrency must be an int from 1 to 4096 (samples in flight per worker), "
                             f"got {concurrency!r}")
        max_bytes_in_flight = parse_size(max_bytes_in_flight, name="max_bytes_in_flight")
        if max_bytes_in_flight < 1:
            raise ValueError(f"max_bytes_in_flight must be positive, got {max_bytes_in_flight!r}")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts!r}")
        if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int)
                                       or stop_after < 1):
            raise ValueError(f"stop_after must be a positive number of records or None, got {stop_after!r}")
        if shard_size is None:
            size = default_shard_size(cache.capacity)
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
        if isinstance(source, ShardSource):
            if stop_after is not None:
                raise ValueError("stop_after counts sampled records; a shard source copies whole shards: "
                                 "stop the pool with stop() instead")
        else:
            source = as_source(source)
        try:
            pickled = pickle.dumps(source)
            pickle.loads(pickled)
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
        self.stop_after = stop_after
        self.concurrency = concurrency
        self.max_bytes_in_flight = max_bytes_in_flight
        if concurrency > 1 and not isinstance(source, ShardSource) and not runs_concurrently(source):
            _hint_serial_once(source, concurrency)
        self._config = _WorkerConfig(cache, source, self.seed, size, max_shard_age, frame,
                                     logging.getLogger("growcache").getEffectiveLevel(), stop_after=stop_after,
                                     concurrency=concurrency, max_bytes_in_flight=max_bytes_in_flight,
                                     shard_records=max(1, min(_MAX_SHARD_RECORDS, size // frame)))
        self._ctx = mp.get_context("spawn")
        self._needs_main = _refers_to_main(pickled)
        self._counters: Any = None
        self._stats_number = next(_pool_numbers)  # its stats file's, apart from other pools of this process
        self._control: Any = None
        self._index_lock: _ProcessLock | None = None
        self._indices: _Indices | None = None
        self._reports_from: list[Any] = [None] * workers  # each worker's report pipe, read end
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
        self._finished: set[int] = set()
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
        self._control = self._ctx.Array("q", 4, lock=False)
        self._control[_END] = -1 if self.stop_after is None else self.stop_after
        self._index_lock = _ProcessLock()
        if not isinstance(self.source, ShardSource):
            slots, cap = max(self.concurrency, _SERIAL_CLAIMS), self._config.shard_records
            row = _Indices.row_size(slots, cap)
            held = self._ctx.Array("q", self.workers * row, lock=False)
            for worker in range(self.workers):
                held[worker * row + _OPEN_HEAD:worker * row + _OPEN_HEAD + slots] = [-1] * slots
            returned = self._ctx.Array("q", self.workers * row, lock=False)
            self._indices = _Indices(self._control, returned, held, self._index_lock, slots, cap)
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
        if self._needs_main:
            _warn_main_once(self.source)
            process_class = self._ctx.Process
        else:
            process_class = _WorkerProcess
        reports_from, reports_to = self._ctx.Pipe(duplex=False)
        proc = process_class(
            target=_worker_main,
            args=(self._config, index, self._restarts[index], self._counters, reports_to, self._control,
                  os.getpid(), self._indices),
            name=f"growcache-sampler-{index}",
            daemon=True,  # dies with the training process if stop() is never called
        )
        # The worker starts with SIGINT blocked (a mask survives fork and exec) and unblocks it
        # once it ignores it: a Ctrl-C to the process group while the worker's interpreter starts
        # and unpickles its arguments would otherwise print a KeyboardInterrupt traceback there.
        # multiprocessing's resource tracker is started first: starting it unblocks SIGINT.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            proc.start()
        except BaseException:
            reports_from.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            reports_to.close()  # the worker holds the only write end: its death reads as the pipe's end
        self._close_reports(index)
        self._reports_from[index] = reports_from
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
            self._control[_STOP] = 1
            deadline = time.monotonic() + timeout
            self._monitor_stop.set()
            if self._monitor is not None:
                self._monitor.join()
            with self._lock:
                procs = [p for p in self._procs if p is not None]
            self._join(procs, deadline)
            for proc in procs:
                if proc.is_alive():
                    logger.warning("sampler %s did not stop within %.0f s; terminating it", proc.name, timeout)
                    proc.terminate()  # SIGTERM: the worker discards its shard and exits
                    self._join([proc], time.monotonic() + 5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            self._drain_events()
            for index, report in sorted(self._reports.items()):
                if not report["transient"]:  # a worker failed while the pool stopped
                    self._fail(index, report)
            self._reports.clear()
            self._remove_temporaries()
            _sampler_stats.remove(self.cache.path, self._stats_number)
            for index in range(self.workers):
                self._close_reports(index)
            if self._index_lock is not None:
                self._index_lock.close()
            self._stopped_at = time.monotonic()
            logger.info("sampler pool stopped: %s", self._summary())
        elif self._state == "new":
            self._state = "stopped"
        if self._failure is not None and not self._failure_reported:
            self._failure_reported = True
            if raise_on_failure:
                raise self._failure
            # Not raised (another exception ends the caller's block): the log is its one report.
            logger.error("sampler pool failed: %s", self._last_error)
        return self.stats()

    # -- monitoring (a thread of the training process) -------------------------------------
    def _watch(self) -> None:
        written = 0.0
        while not self._monitor_stop.wait(_POLL_S):
            try:
                self._check_workers()
            except Exception:  # the monitor must never die silently
                logger.exception("sampler monitor error")
            now = time.monotonic()
            self._rate.append((now, self._total(_BYTES)))
            while self._rate and now - self._rate[0][0] > _RATE_WINDOW_S:
                self._rate.popleft()
            if now - written >= _STATS_FILE_S:
                written = now
                self._write_stats_file()

    def _write_stats_file(self) -> None:
        """The figures for other processes (``growcache status``, epoch meters): see :mod:`._sampler_stats`."""
        s = self.stats()
        _sampler_stats.write(self.cache.path, self._stats_number, {
            "pid": os.getpid(), "host": _proc.this_host(), "workers": s.workers, "concurrency": self.concurrency,
            "records": s.records, "bytes": s.bytes, "shards": s.shards, "mb_per_s": max(0.0, s.mb_per_s),
            "requests_in_flight": max(0, s.requests_in_flight), "in_flight_limit": s.in_flight_limit,
            "latency_p50": s.latency_p50, "latency_p95": s.latency_p95, "latency_p99": s.latency_p99,
            "throttle_events": s.throttle_events, "restarts": s.restarts, "failed": s.failed,
        }, dir_mode=self.cache.dir_mode, file_mode=self.cache.file_mode)

    def _check_workers(self) -> None:
        with self._lock:
            dead = [(i, p) for i, p in enumerate(self._procs) if p is not None and not p.is_alive()]
        # A dead worker flushed its report before exiting, so reading reports after the
        # liveness check sees every report of every worker found dead.
        self._drain_events()
        for index, proc in dead:
            proc.join()
            # Before its temporary goes: whether it is still there tells if a shard got its name.
            self._refund(index, proc.pid)
            self._remove_temporaries()
            report = self._reports.pop(index, None)
            if report is None and proc.exitcode == 0 and self._counters[index * _NSLOTS + _DONE]:
                with self._lock:  # sampled its part of stop_after and published it: not restarted
                    self._procs[index] = None
                    self._finished.add(index)
                continue
            if self._control[_STOP]:
                with self._lock:
                    self._procs[index] = None
                if report is not None and not report["transient"]:
                    self._fail(index, report)
                continue
            if report is not None and not report["transient"]:
                self._fail(index, report)
                continue
            if report is not None and not any(self._counters[i * _NSLOTS + _ANSWERED] for i in range(self.workers)):
                # The store never answered any worker: a wrong endpoint or credentials, not an outage.
                self._fail(index, {**report, "summary": report["summary"] + " The store never answered this pool, "
                                   "so it is not restarted: check the URL, endpoint and credentials."})
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
                if self._state != "running" or self._control[_STOP]:
                    continue
                self._restarts[index] += 1  # never reused: each restart's random stream is new
                recent.append(time.monotonic())
                logger.warning("%s; restarting it (restart %d of %d within %.0f s)", why, len(recent),
                               self.max_restarts, _RESTART_WINDOW_S)
                self._spawn(index)

    def _refund(self, index: int, pid: int) -> None:
        """Return the sample indices a dead worker held and did not publish to the pool."""
        if self._indices is None:
            return
        left = {name for name in scan_shards(self.cache.shards_dir).temporaries
                if (temp_owner(name) or (None,))[0] == pid}

        tokens = {temp_token(name) for name in left}

        def renamed(token: int) -> bool:
            return token not in tokens

        returned = self._indices.refund(index, renamed)
        if returned:
            logger.debug("sampler %d died holding %d unpublished samples; they go back to the pool", index, returned)

    def _drain_events(self) -> None:
        """Move worker reports from their pipes into ``self._reports`` (latest per worker)."""
        for index, reports_from in enumerate(self._reports_from):
            if reports_from is None:
                continue
            try:
                while reports_from.poll():
                    event = reports_from.recv()
                    self._reports[index] = event
                    self._last_error = event["summary"]
                    # The restart warning or the raised SamplerError reports it: one line, not one per worker.
                    logger.debug("sampler %s", event["summary"])
            except (EOFError, OSError):
                # The worker is gone and everything it sent has been read (or a killed worker's
                # report was cut short): nothing more can come.
                self._close_reports(index)
            except Exception:  # a report that does not unpickle here must not stop the monitor
                logger.exception("unreadable report from sampler %d", index)
                self._close_reports(index)

    def _close_reports(self, index: int) -> None:
        reports_from, self._reports_from[index] = self._reports_from[index], None
        if reports_from is not None:
            reports_from.close()

    def _join(self, procs: list[Any], deadline: float) -> None:
        """Wait until ``procs`` exit or ``deadline`` passes, reading reports meanwhile.

        A report larger than a pipe's buffer blocks its worker until it is read, so reports
        are read while waiting, never only after.
        """
        while True:
            alive = [p for p in procs if p.is_alive()]
            left = deadline - time.monotonic()
            if not alive or left <= 0:
                return
            pipes = [r for r in self._reports_from if r is not None]
            mp_connection.wait([p.sentinel for p in alive] + pipes, timeout=min(left, 1.0))
            self._drain_events()

    def _fail(self, index: int, report: Mapping[str, Any]) -> None:
        if self._failure is not None:
            return
        message = report["summary"]
        # growcache's own errors (a schema mismatch, a store error) say all in their message;
        # a user's sample function needs its traceback.
        if report.get("traceback") and not report.get("growcache_error"):
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
        logger.debug("sampler pool failed: %s", report["summary"])
        self._control[_STOP] = 1  # the other workers stop too: the pool never limps on silently

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
            finished=self.stop_after is not None and len(self._finished) == self.workers,
            requests_in_flight=self._total(_REQUESTS),
            in_flight_limit=self._total(_LIMIT),
            latency_p50=self._slowest(_P50_US) / 1e6,
            latency_p95=self._slowest(_P95_US) / 1e6,
            latency_p99=self._slowest(_P99_US) / 1e6,
            throttle_events=self._total(_THROTTLES),
            peak_bytes_in_flight=self._slowest(_PEAK_INFLIGHT_BYTES),
        )

    def _slowest(self, slot: int) -> int:
        if self._counters is None:
            return 0
        return max(self._counters[i * _NSLOTS + slot] for i in range(self.workers))

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
            if s.finished:
                raise RuntimeError(
                    f"waited for {records} records / {shards} shards, but the pool finished: it sampled its "
                    f"stop_after={self.stop_after} records and published {s.records} in {s.shards} shards"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {timeout} s for {records} records / {shards} shards; the pool published "
                    f"{s.records} records in {s.shards} shards ({s.mb_per_s:.1f} MB/s, {s.workers} workers alive, "
                    f"last error: {s.last_error}). Raise the timeout, add workers or check the source."
                )
            time.sleep(_POLL_S)


    def join(self, timeout: float | None = None) -> SamplerStats:
        """Block until every worker has sampled its part of ``stop_after`` and published it.

        Raises:
            SamplerError: the pool failed (at once, not at the end).
            TimeoutError: ``timeout`` seconds passed first.
            RuntimeError: the pool has no ``stop_after``, or is not running.
        """
        if self.stop_after is None:
            raise RuntimeError("join() waits for stop_after records; this pool samples until stop()")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.raise_if_failed()
            s = self.stats()
            if s.finished:
                return s
            if self._state != "running":
                raise RuntimeError(f"the SamplerPool is {self._state}: call start() (or use `with`) first")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"waited {timeout} s for {self.stop_after} records; the pool published "
                                   f"{s.records} so far (last error: {s.last_error})")
            time.sleep(_POLL_S)


def _refers_to_main(pickled: bytes) -> bool:
    """True if a pickle names an object of the user's script, which a worker can only load by running it."""
    for opcode, arg, _ in pickletools.genops(pickled):
        if opcode.name in ("GLOBAL", "INST") and str(arg).split(" ", 1)[0] in _MAIN_MODULES:
            return True
        if isinstance(arg, str) and arg in _MAIN_MODULES:  # the module name STACK_GLOBAL pops
            return True
    return False


_warned_main = False
_hinted_serial = False


_pool_numbers = itertools.count()


def _hint_serial_once(source: Source, concurrency: int) -> None:
    global _hinted_serial
    if _hinted_serial:
        return
    _hinted_serial = True
    logger.info(
        "%s draws one sample at a time although concurrency=%d: it did not declare itself safe to call "
        "concurrently. Wrap it as FunctionSource(fn, thread_safe=True) if it is, or give the source "
        "'async def sample_async(rng)' or 'sample_many(rngs)', or set thread_safe = True on its class "
        "(see SamplerPool in docs/api.md).",
        source.redact(repr(source)), concurrency)


def _warn_main_once(source: Source) -> None:
    global _warned_main
    if _warned_main:
        return
    _warned_main = True
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    logger.warning(
        "the sampler source %s is defined in %s, so every sampler process re-runs that script's top-level "
        "code when it starts, imports included (TensorFlow or torch cost hundreds of MB and seconds per "
        "worker). Move the source or sample function into a module of its own and import it; see "
        "docs/pitfalls.md.", source.redact(repr(source)), script)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


# -- the worker process ---------------------------------------------------------------------
def _preparation_without_main(name: str) -> dict[str, Any]:
    """What ``spawn`` tells a child about its parent, less the instruction to re-run ``__main__``."""
    from multiprocessing import spawn

    data = spawn.get_preparation_data(name)
    data.pop("init_main_from_path", None)
    data.pop("init_main_from_name", None)
    return data


try:
    from multiprocessing import popen_spawn_posix, spawn as _spawn, util as _mp_util
    from multiprocessing.context import reduction as _reduction, set_spawning_popen as _set_spawning_popen

    class _PopenWithoutMain(popen_spawn_posix.Popen):
        """``spawn``'s launcher, except that the child does not re-run the parent's script.

        The child still gets the parent's ``sys.path``, working directory and authkey, so
        every module the pickled worker arguments name imports as usual. Only
        ``_launch``'s preparation data differs from CPython's own (3.8 to 3.13).
        """

        def _launch(self, process_obj: Any) -> None:
            import io

            from multiprocessing import resource_tracker

            tracker_fd = resource_tracker.getfd()
            self._fds.append(tracker_fd)
            prep_data = _preparation_without_main(process_obj._name)
            fp = io.BytesIO()
            _set_spawning_popen(self)
            try:
                _reduction.dump(prep_data, fp)
                _reduction.dump(process_obj, fp)
            finally:
                _set_spawning_popen(None)
            parent_r = child_w = child_r = parent_w = None
            try:
                parent_r, child_w = os.pipe()
                child_r, parent_w = os.pipe()
                cmd = _spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
                self._fds.extend([child_r, child_w])
                self.pid = _mp_util.spawnv_passfds(_spawn.get_executable(), cmd, self._fds)
                self.sentinel = parent_r
                with open(parent_w, "wb", closefd=False) as f:
                    f.write(fp.getbuffer())
            finally:
                fds_to_close = [fd for fd in (parent_r, parent_w) if fd is not None]
                self.finalizer = _mp_util.Finalize(self, _mp_util.close_fds, fds_to_close)
                for fd in (child_r, child_w):
                    if fd is not None:
                        os.close(fd)

    class _WorkerProcess(mp.context.SpawnProcess):
        _start_method = "spawn"

        @staticmethod
        def _Popen(process_obj: Any) -> Any:
            return _PopenWithoutMain(process_obj)

except ImportError:  # no POSIX spawn launcher (Windows): workers re-run the script as usual
    _WorkerProcess = mp.get_context("spawn").Process  # type: ignore[misc,assignment]


class _ProcessLock:
    """A lock between the pool's processes that leaves nothing behind: an ``fcntl`` record lock
    on a temporary file that has no name.

    ``multiprocessing``'s locks are named semaphores, which a process-group kill leaves in
    ``/dev/shm`` forever (see the module docstring); a file without a name goes with the last
    descriptor of it. The kernel also drops the lock of a holder that dies, where a semaphore
    held by a killed worker would stay taken. Record locks belong to a process, not to a
    thread, so a thread lock orders the threads of one process (a worker's publishing thread
    gives indices back while its main thread claims).
    """

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            with tempfile.TemporaryFile() as f:  # O_TMPFILE where the kernel has it: never named
                fd = os.dup(f.fileno())
        self._fd = fd
        self._threads = threading.Lock()

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()

    def __reduce__(self) -> tuple[Any, ...]:
        # Only while spawning a worker: the descriptor itself is passed to the child.
        return _rebuild_process_lock, (mp_reduction.DupFd(self._fd),)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _rebuild_process_lock(dup: Any) -> _ProcessLock:
    return _ProcessLock(dup.detach())


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


class _Interrupted(BaseException):
    """Raised in a worker stuck in a sample call after stop(), so that it publishes and exits.

    A BaseException, so that no ``except Exception`` of a store client or of the retries
    takes it for a store error.
    """


def _worker_main(cfg: _WorkerConfig, index: int, restart: int, counters: Any, reports_to: Any, control: Any,
                 parent_pid: int, indices: _Indices | None = None) -> None:
    # Ctrl-C reaches the whole process group: the training process decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by _spawn until now
    signal.signal(signal.SIGTERM, _on_sigterm)
    log = logging.getLogger("growcache")
    log.setLevel(cfg.log_level)
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"growcache sampler {index} %(levelname)s %(message)s"))
        log.addHandler(handler)

    parent_checked = [time.monotonic()]

    def stopping() -> bool:
        if control[_STOP]:
            return True
        # The parent may die without calling stop(): never outlive it. Asked a few times a
        # second, not per sample (a system call, a tenth of a small sample's time).
        now = time.monotonic()
        if now - parent_checked[0] < _PARENT_CHECK_S:
            return False
        parent_checked[0] = now
        return os.getppid() != parent_pid

    sampling = _SampleWatch(stopping)
    source = cfg.source
    loop: _SampleLoop | None = None
    try:
        if isinstance(source, ShardSource):
            _fetch_shards(cfg, index, counters, stopping)
            return
        assert indices is not None
        loop = _SampleLoop(cfg, index, counters, indices.for_worker(index), stopping, sampling)
        loop.run()
    except _Terminated:
        pass  # the finally below discards the shard in progress
    except BaseException as exc:
        _report(reports_to, source, index, restart, exc)
        raise SystemExit(1) from None
    finally:
        sampling.close()
        if loop is not None:
            loop.close()
        reports_to.close()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
_MALLOC_SLACK = 32 << 20  # glibc's largest mmap threshold on 64-bit
# Samples are allocated under the GIL, so more heaps than this gain nothing; each heap keeps its
# own free memory, and a thread per sample in flight (local files) had up to 16 of them.
_MALLOC_ARENAS = 2


def _tune_malloc(keep: int) -> None:
    """Let glibc's malloc reuse the memory of finished samples instead of returning it to the kernel.

    Every sample's bytes (a window, its response's chunks) are allocated, written into the
    shard and freed. glibc serves blocks above its mmap threshold (128 KiB at first) with
    ``mmap``, and gives back free memory at the top of its heaps above the trim threshold:
    each new window then cost fresh pages, faulted in and zeroed by the kernel, about a
    tenth of the sampler's CPU time at 1 MiB windows. Blocks up to 32 MiB now come from
    the heaps, which keep up to ``keep`` bytes free, and there are at most two heaps: the
    bytes in flight are bounded (``max_bytes_in_flight``), so the memory kept is too, and
    RSS stays flat (64 threads reading 1 MiB windows of local files peaked at 350 MB with
    glibc's defaults, 183 MB so). Other C libraries (musl) are left as they are.
    """
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_ARENA_MAX, _MALLOC_ARENAS)
    mallopt(_M_MMAP_THRESHOLD, _MALLOC_SLACK)
    mallopt(_M_TRIM_THRESHOLD, min(keep, 2**31 - 1))


class _SampleLoop:
    """A worker's loop over samples: claim indices, draw them (up to ``concurrency`` in flight),
    write them into the shard in progress as they finish, publish by size and age."""

    def __init__(self, cfg: _WorkerConfig, index: int, counters: Any, indices: _Indices,
                 stopping: Callable[[], bool], sampling: _SampleWatch) -> None:
        self.cfg, self.counters, self.indices, self.stopping, self.sampling = cfg, counters, indices, stopping, sampling
        self.base = index * _NSLOTS
        self.cache = cfg.cache
        self.source = cfg.source
        self.writer: Any = None
        self.opened = 0.0
        self.first = True
        self.flow = Flow(cfg.concurrency, cfg.max_bytes_in_flight)
        self.engine: Any = None
        self.area = 0  # the ledger's shard area of the shard in progress
        self._publisher: threading.Thread | None = None
        self._publish_error: BaseException | None = None
        self._figures_at = 0.0
        self._throttles_before = counters[self.base + _THROTTLES]
        if hasattr(self.source, "store_answered") and any(
                counters[i * _NSLOTS + _ANSWERED] for i in range(len(counters) // _NSLOTS)):
            # An earlier sampler of this pool reached the store: an outage now is ridden out.
            self.source.store_answered = True
        if cfg.concurrency > 1 and hasattr(self.source, "set_concurrency"):
            self.source.set_concurrency(cfg.concurrency)
        _tune_malloc(cfg.max_bytes_in_flight + 2 * _MALLOC_SLACK)

    # -- shards ------------------------------------------------------------------------------------
    def publish(self, background: bool = False) -> None:
        """Publish the shard in progress; the next one fills the other shard area of the ledger.

        In the background (a thread), sampling goes on while the shard is fsynced and renamed:
        at most one publish is in flight, and its error is raised here at the next call.
        """
        writer, area = self.writer, self.area
        self.writer = None
        self.join_publisher()
        self.area = 1 - area
        if background:
            self._publisher = threading.Thread(target=self._publish_in_thread, args=(writer, area),
                                               name="growcache-publish", daemon=True)
            self._publisher.start()
        else:
            self._publish(writer, area)

    def join_publisher(self) -> None:
        if self._publisher is not None:
            self._publisher.join()
            self._publisher = None
        if self._publish_error is not None:
            error, self._publish_error = self._publish_error, None
            raise error

    def _publish_in_thread(self, writer: Any, area: int) -> None:
        try:
            self._publish(writer, area)
        except BaseException as exc:  # noqa: BLE001 - raised in the sampling thread by join_publisher
            self._publish_error = exc

    def _publish(self, writer: Any, area: int) -> None:
        counters, base = self.counters, self.base
        self.indices.publishing(area, True)
        try:
            info = writer.close()
        except CacheFullError:
            self.indices.publishing(area, False)
            if not self.stopping():
                raise
            counters[base + _DISCARDED] += 1  # stopping while leases fill the budget
            self.indices.give_back(area)
            return
        except BaseException:
            self.indices.publishing(area, False)  # not renamed: the pool returns its indices
            raise
        self.indices.published(area)
        if info is not None:
            counters[base + _PUB_RECORDS] += info.records
            counters[base + _PUB_BYTES] += info.nbytes
            counters[base + _SHARDS] += 1
        counters[base + _PEAK_RSS_KB] = _peak_rss_kb()

    def write(self, slot: int, index: int, sample: Any) -> None:
        cfg, counters, base = self.cfg, self.counters, self.base
        if self.first:
            _check_first_sample(self.cache, self.source, sample)
            self.first = False
            counters[base + _ANSWERED] = 1
        if self.writer is None:
            self.writer = self.cache.writer(should_stop=self.stopping)
            self.writer.reserve(cfg.shard_size)
            self.indices.opened(self.area, temp_token(os.path.basename(self.writer.path)) or 0)
            self.opened = time.monotonic()
        self.writer.write(sample)  # validates against the schema
        self.indices.written(self.area, slot, index)
        counters[base + _RECORDS] += 1
        counters[base + _BYTES] += cfg.record_frame
        if (self.writer.nbytes + cfg.record_frame > cfg.shard_size
                or self.writer.records >= cfg.shard_records):
            self.publish(background=self.engine is not None)

    def old_enough(self, expected_s: float) -> bool:
        age = self.cfg.max_shard_age
        if age is None or self.writer is None:
            return False
        if not self.counters[self.base + _SHARDS]:
            # Epoch 1 waits for the first shard: publish it soon, yet in proportion to an age the
            # user chose (an hour's max_shard_age is not rotated after 1 s).
            age = min(age, max(_FIRST_SHARD_AGE_S, age / 10))
        return time.monotonic() - self.opened + expected_s >= age

    def figures(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._figures_at < 0.5:
            return
        self._figures_at = now
        _flow_figures(self.flow, self.counters, self.base, self._throttles_before)

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        serial = cfg.concurrency <= 1
        try:
            # Making the filesystem (a token fetch) and listing a large or silent bucket can take
            # minutes: stop() interrupts them as it does a sample call, instead of waiting out its
            # timeout and terminating the worker.
            with self.sampling:
                if not serial:
                    self.engine = make_engine(self.source, cfg.concurrency)
                    serial = self.engine is None
                prepare = getattr(self.source, "prepare", None)
                if not serial and prepare is not None:
                    prepare()  # listing is a sync call: never from inside the event loop
        except _Interrupted:
            pass  # stopped before the first sample
        else:
            if serial:
                self._run_serial()
            else:
                self._run_concurrent()
        if self.writer is not None:
            self.publish()  # the shard in progress is finished: published if it fits without waiting
        self.join_publisher()
        self.figures(force=True)
        self.counters[self.base + _PEAK_RSS_KB] = _peak_rss_kb()
        if cfg.stop_after is not None and not self.stopping():
            self.counters[self.base + _DONE] = 1  # the quota is used up: the parent does not restart it

    def _run_serial(self) -> None:
        """One sample at a time, in this thread (``concurrency=1``, or a source that is not concurrent).

        Indices are claimed a few at a time (one lock for several samples); the sample's own
        time stands for its requests' latency in the figures.
        """
        cfg, indices, flow = self.cfg, self.indices, self.flow
        rng_of = _ReusedSampleRNG(cfg.seed, cfg.run)
        sample_s = 0.0  # running mean of one sample's time, to publish before a slow one
        claimed: list[tuple[int, int]] = []
        while not self.stopping():
            if self.old_enough(sample_s):
                self.publish()
            if not claimed:
                # Reversed, so that pop() takes them in claim order.
                claimed = indices.claim_slots(list(range(min(indices.slots, _SERIAL_CLAIMS))))[::-1]
                if not claimed:
                    break
            slot, index = claimed.pop()
            start = time.monotonic()
            try:
                with self.sampling:
                    sample = self.source(rng_of(index))
            except _Interrupted:
                break  # stop() came while a store call hung: publish what is written
            took = time.monotonic() - start
            sample_s = took if sample_s == 0.0 else 0.8 * sample_s + 0.2 * took
            flow.sampled(took)
            self.write(slot, index, sample)
            self.figures()

    def _run_concurrent(self) -> None:
        """Up to ``concurrency`` samples in flight; each is written as it finishes."""
        cfg, indices, engine, flow = self.cfg, self.indices, self.engine, self.flow
        free = list(range(cfg.concurrency - 1, -1, -1))  # in-flight slots of the index ledger
        outstanding = 0
        exhausted = False
        sample_s = 0.0  # running mean of the time between finished samples
        last = time.monotonic()
        while not self.stopping():
            if self.old_enough(min(sample_s, 1.0)):
                self.publish(background=True)
            if self._publish_error is not None:
                self.join_publisher()
            batch = []
            wanted = min(flow.allowed() - outstanding, len(free))
            if not exhausted and wanted > 0:
                slots = [free.pop() for _ in range(wanted)]
                claimed = indices.claim_slots(slots)  # one lock for all of them
                if len(claimed) < wanted:
                    free.extend(reversed(slots[len(claimed):]))
                    exhausted = True
                for slot, index in claimed:
                    batch.append(Task(index, sample_rng(cfg.seed, index, cfg.run), slot, Ticket(flow)))
                outstanding += len(claimed)
            engine.submit_many(batch)
            if exhausted and outstanding == 0:
                break
            try:
                finished = [engine.done.get(timeout=_POLL_S)]
            except queue.Empty:
                self.figures()
                continue
            if sample_s < _GATHER_S:
                # Samples finish faster than this: let a few gather for one wake-up. Each wake-up
                # of this thread takes the GIL from the event loop's, about a fifth of the CPU
                # time per sample of 16 KiB windows.
                time.sleep(_GATHER_S)
            while len(finished) < outstanding:  # everything finished meanwhile: one wake-up for all
                try:
                    finished.append(engine.done.get_nowait())
                except queue.Empty:
                    break
            for task in finished:
                outstanding -= 1
                free.append(task.slot)
                try:
                    if task.error is not None:
                        raise task.error
                    self.write(task.slot, task.index, task.result)
                finally:
                    task.ticket.release()
            now = time.monotonic()
            sample_s = 0.8 * sample_s + 0.2 * (now - last) / len(finished)
            last = now
            self.figures()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()  # cancels the requests in flight; never waits for them
        if self._publisher is not None:
            self._publisher.join()  # a shard being renamed into place: never left half-way
        if self.writer is not None:
            self.writer.abort()


def _flow_figures(flow: Flow, counters: Any, base: int, throttles_before: int) -> None:
    """A worker's request figures (in flight, limit, latency percentiles, throttles, peak bytes)
    into the pool's shared counters, which ``pool.stats()`` and the stats file read."""
    p50, p95, p99 = flow.latency_percentiles()
    counters[base + _P50_US], counters[base + _P95_US], counters[base + _P99_US] = (
        int(p50 * 1e6), int(p95 * 1e6), int(p99 * 1e6))
    counters[base + _REQUESTS] = flow.requests
    counters[base + _LIMIT] = flow.allowed()
    counters[base + _THROTTLES] = throttles_before + flow.throttles
    counters[base + _PEAK_INFLIGHT_BYTES] = max(counters[base + _PEAK_INFLIGHT_BYTES], flow.peak_bytes)


def _fetch_shards(cfg: _WorkerConfig, index: int, counters: Any, stopping: Callable[[], bool]) -> None:
    """The worker loop of a shard source: publish every shard it fetches; ask again when it has none."""
    base = index * _NSLOTS
    cache = cfg.cache
    flow = Flow(cfg.concurrency, cfg.max_bytes_in_flight)  # every fetch of this worker shares it
    throttles_before, figures_at = counters[base + _THROTTLES], 0.0

    def progress(nbytes: int) -> None:  # once per record copied
        nonlocal figures_at
        counters[base + _RECORDS] += 1
        counters[base + _BYTES] += nbytes
        now = time.monotonic()
        if now - figures_at >= 0.5:
            figures_at = now
            _flow_figures(flow, counters, base, throttles_before)

    job = FetchJob(cache, cfg.seed, index, stopping, max_bytes=cfg.shard_size, progress=progress,
                   concurrency=cfg.concurrency, max_bytes_in_flight=cfg.max_bytes_in_flight, flow=flow)
    while not stopping():
        published = 0
        with contextlib.closing(cfg.source.fetch(job)) as shards:
            for shard in shards:
                try:
                    info = cache._publish(shard.path, shard.records, shard.nbytes, should_stop=stopping,
                                          before_publish=shard.commit)
                except CacheFullError:
                    discard_temporary(shard.path)
                    if not stopping():
                        raise
                    counters[base + _DISCARDED] += 1  # stopping while leases fill the budget
                    return
                except BaseException:
                    discard_temporary(shard.path)
                    raise
                published += 1
                counters[base + _PUB_RECORDS] += info.records
                counters[base + _PUB_BYTES] += info.nbytes
                counters[base + _SHARDS] += 1
                counters[base + _PEAK_RSS_KB] = _peak_rss_kb()
        _flow_figures(flow, counters, base, throttles_before)  # between fetches: none in flight
        if not published:  # other workers hold the rest of the pass, or the cache holds it all
            deadline = time.monotonic() + _FETCH_IDLE_S
            while time.monotonic() < deadline and not stopping():
                time.sleep(_POLL_S)
    counters[base + _PEAK_RSS_KB] = _peak_rss_kb()


class _SampleWatch:
    """Interrupts the worker's main thread when it is still inside a sample call after stop().

    A store that accepts a connection and never answers can hold a read for as long as its
    stall timeout. stop() must not wait for that: a watcher thread sends SIGUSR1 to the main
    thread, whose handler raises :class:`_Interrupted` only while a sample call is running.
    """

    def __init__(self, stopping: Callable[[], bool]) -> None:
        self._stopping = stopping
        self._since: float | None = None  # when the running sample call started
        self._closed = threading.Event()
        self._main = threading.main_thread().ident
        signal.signal(signal.SIGUSR1, self._on_signal)
        threading.Thread(target=self._watch, name="growcache-sample-watch", daemon=True).start()

    def __enter__(self) -> None:
        self._since = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self._since = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._since is not None:
            self._since = None
            raise _Interrupted()

    def _watch(self) -> None:
        while not self._closed.wait(0.1):
            since = self._since
            if since is not None and self._stopping() and time.monotonic() - since > _INTERRUPT_AFTER_S:
                signal.pthread_kill(self._main, signal.SIGUSR1)
                self._closed.wait(1.0)

    def close(self) -> None:
        self._closed.set()


def _check_first_sample(cache: Cache, source: Source, sample: Mapping[str, Any]) -> None:
    """Raise a SchemaError whose hint fits the API when a source's first sample does not match the cache."""
    problem = describe_mismatch(cache.schema, sample)
    if problem is None:
        return
    hints = []
    if not isinstance(sample, Mapping) or sample.keys() != cache.schema.keys():
        hints.append(f"return exactly the stored features {list(cache.schema)}")
    else:
        given = {name: np.asarray(sample[name]) for name in cache.schema}
        if any(given[n].shape != cache.schema[n].shape for n in given):
            hints.append("return arrays of the stored shapes (an NpyWindowSource's window= sets the first dimension)")
        if any(given[n].dtype.newbyteorder("=") != cache.schema[n].dtype.newbyteorder("=") for n in given):
            hints.append("convert dtypes in the sample function (arr.astype(...))")
    raise SchemaError(
        f"{source.redact(repr(source))} does not fit cache {cache.path}: {problem}. To fix it, "
        f"{' and '.join(hints)}, or sample into a new cache: a cache keeps one schema."
    )


def describe_mismatch(schema: Any, sample: Mapping[str, Any]) -> str | None:
    """How ``sample`` differs from ``schema`` (features, dtypes, shapes), or ``None`` if it fits.

    Args:
        schema: the cache's :class:`~growcache.Schema`.
        sample: one sample, a dict of feature name -> array.
    """
    if not isinstance(sample, Mapping):
        return f"a sample is a dict of arrays, the source gave {type(sample).__name__}"
    missing = [n for n in schema if n not in sample]
    extra = [n for n in sample if n not in schema]
    if missing or extra:
        return (f"the cache stores features {list(schema)}, the source gives {sorted(map(str, sample))}"
                + (f" (missing {missing})" if missing else "") + (f" (not in the cache: {extra})" if extra else ""))
    problems = []
    for name in schema:
        spec = schema[name]
        array = np.asarray(sample[name])
        if array.dtype.newbyteorder("=") != spec.dtype.newbyteorder("=") or array.shape != spec.shape:
            problems.append(f"feature {name!r}: the cache stores dtype {spec.dtype.name} shape {spec.shape}, "
                            f"the source gives dtype {array.dtype.name} shape {array.shape}")
    return "; ".join(problems) or None


def _report(reports_to: Any, source: Source, index: int, restart: int, exc: BaseException) -> None:
    redact = source.redact
    text = redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    summary = redact(f"worker {index} (restart {restart}) failed: {type(exc).__name__}: {exc}")
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    try:  # send() returns once the whole report is in the pipe
        reports_to.send({"worker": index, "restart": restart, "transient": isinstance(exc, TransientSourceError),
                         "summary": summary, "traceback": text, "exception": pickled,
                         "growcache_error": isinstance(exc, GrowcacheError)})
    except OSError:  # the training process is gone: nobody is left to tell
        pass
