"""Is training waiting on data? Stall, rate, freshness and cache figures per epoch, for every adapter.

An adapter builds one :class:`InputMeter` beside its :class:`~growcache.epoch.Epochs` and tells
it when each epoch starts (:meth:`InputMeter.begin`) and how the training loop pulls batches:

* **at ``next()``** (PyTorch, eager TensorFlow): :meth:`InputMeter.timed` wraps the batch
  iterator, or the adapter calls :meth:`InputMeter.next_done` around its own ``next``.
  ``data_wait`` is the time the loop spent inside ``iter()`` and ``next()``: exact.
* **at growcache's last stage** (TensorFlow inside a compiled ``tf.function``, where no
  Python runs at ``next()``): :meth:`InputMeter.stage_enter`/:meth:`~InputMeter.stage_exit`
  around each batch growcache produces. ``data_wait`` is then the time in which that stage
  had no batch ready while one was asked for: an upper bound of the loop's wait, since the
  framework's prefetch buffer may still have held batches (``data_wait_bound`` says so).

The cost in the training process is two clock reads and a few integer updates per batch
(``benchmarks/metrics_overhead.py``), and nothing per record: records and bytes come from the
epoch's plan and its shards' sizes. The snapshot's freshness (records not in the previous
epoch's snapshot), the age of its shards and the cache's counters (:meth:`Cache.stats`, so
they are right whichever process publishes) are taken once per epoch.

Each epoch that ends logs one INFO line on the ``growcache.metrics`` logger, for example
``epoch 7: 1.2M records, 5.1 GB/s, waited 0.4 s (1.2%), 38% new since epoch 6, cache 412 GB
(+31 GB, -29 GB)``. :func:`input_stats` finds the figures by cache, for a framework whose
dataset object does not survive its own transformations (``ds.map()``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ._size import format_size
from .cache import Cache

__all__ = ["DEFAULT_LOGGED", "CacheFigures", "InputFigures", "InputMeter", "InputStats", "MeteredLoader",
           "TrainerSource", "input_stats", "live_meters", "sampler_reader", "sampler_summary", "stats_source"]

logger = logging.getLogger(__name__)

_clock = time.perf_counter

#: The figures the trainer callbacks log by default (:meth:`InputFigures.as_dict` names).
DEFAULT_LOGGED = ("data_wait_s", "data_wait_share", "records_per_s", "bytes_per_s", "first_batch_s", "new_share",
                  "cache_bytes")


@dataclass(frozen=True)
class CacheFigures:
    """The cache at the end of an epoch, from its own counters (:class:`~growcache.CacheStats`).

    Attributes:
        bytes: bytes of published shards now.
        shards: published shards now.
        capacity: the byte budget.
        published: shards published since the previous figures (the previous epoch's end;
            for the first epoch, the loader's construction).
        published_bytes: their bytes.
        evicted: shards evicted since the previous figures.
        evicted_bytes: their bytes.
        interval_s: seconds since the previous figures.
        leases: live leases now.
        leased_bytes: bytes of shards held by a lease now (pinned against eviction).
    """

    bytes: int
    shards: int
    capacity: int
    published: int
    published_bytes: int
    evicted: int
    evicted_bytes: int
    interval_s: float
    leases: int
    leased_bytes: int

    @property
    def fill_rate(self) -> float:
        """Bytes published per second since the previous figures."""
        return self.published_bytes / self.interval_s if self.interval_s > 0 else 0.0


@dataclass(frozen=True)
class InputFigures:
    """The input figures of one epoch (``epoch`` set), or of every epoch so far (``epoch=None``).

    Attributes:
        epoch: the epoch number; ``None`` for the cumulative figures.
        epochs: epochs counted (``1`` for an epoch's figures).
        finished: the epoch was read to its end (cumulative: every epoch was).
        batches: batches the training loop received.
        records: records in them: counted per batch at ``next()`` (PyTorch); as growcache's
            reader made them (TensorFlow: exact once the epoch is read to its end); else whole
            batches of the plan.
        bytes: shard bytes behind those records (the epoch's average bytes per record, framing
            included).
        wall_s: seconds from ``iter()`` to the end of the epoch (or to now, while it runs).
        data_wait_s: seconds the training loop waited for its next batch, ``iter()`` included;
            under DDP the most of any rank. ``None`` where it could not be measured
            (TensorFlow's ``reader="tensorflow"`` inside a ``tf.function``).
        data_wait_bound: ``data_wait_s`` is an upper bound (the time growcache's last stage had
            no batch ready, behind the framework's prefetch), not the wait at ``next()``.
        first_batch_s: seconds from ``iter()`` to the first batch (cumulative: the first epoch's).
        snapshot_shards: shards of the epoch's snapshot (all ranks').
        snapshot_records: records of the epoch's snapshot (all ranks').
        new_shards: shards of the snapshot not in the previous epoch's snapshot; ``None`` for a
            first epoch.
        new_records: their records.
        oldest_shard_age_s: age, at the epoch's start, of the oldest shard read.
        newest_shard_age_s: age, at the epoch's start, of the newest shard read.
        skipped_shards: shards passed over as corrupt (``on_corrupt="skip"``).
        ranks: ranks behind ``data_wait_s`` (the most of them) and the counts (their sum).
        cache: the cache's state at the epoch's end; ``None`` while it runs.
        samplers: the samplers' own figures (requests in flight, latency percentiles),
            when they publish them; ``None`` otherwise.
    """

    epoch: int | None
    epochs: int = 1
    finished: bool = False
    batches: int = 0
    records: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    data_wait_s: float | None = 0.0
    data_wait_bound: bool = False
    first_batch_s: float | None = None
    snapshot_shards: int = 0
    snapshot_records: int = 0
    new_shards: int | None = None
    new_records: int | None = None
    oldest_shard_age_s: float | None = None
    newest_shard_age_s: float | None = None
    skipped_shards: int = 0
    ranks: int = 1
    cache: CacheFigures | None = None
    samplers: Mapping[str, Any] | None = None

    @property
    def data_wait_share(self) -> float | None:
        """``data_wait_s`` as a share of ``wall_s`` (0 to 1)."""
        if self.data_wait_s is None or self.wall_s <= 0:
            return None
        return min(self.data_wait_s / self.wall_s, 1.0)

    @property
    def batches_per_s(self) -> float:
        """Batches per second of wall time."""
        return self.batches / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def records_per_s(self) -> float:
        """Records per second of wall time."""
        return self.records / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Bytes per second of wall time."""
        return self.bytes / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def new_share(self) -> float | None:
        """``new_records`` as a share of ``snapshot_records`` (0 to 1); ``None`` for a first epoch."""
        if self.new_records is None or self.snapshot_records <= 0:
            return None
        return self.new_records / self.snapshot_records

    def as_dict(self, prefix: str = "growcache/") -> dict[str, float]:
        """The numeric figures under flat names (``prefix`` + name), for a trainer's logger;
        figures that are unknown are left out."""
        out: dict[str, float] = {}
        for name in ("batches", "records", "bytes", "wall_s", "data_wait_s", "first_batch_s", "new_shards",
                     "new_records", "oldest_shard_age_s", "newest_shard_age_s", "skipped_shards"):
            value = getattr(self, name)
            if value is not None:
                out[prefix + name] = float(value)
        for name in ("data_wait_share", "batches_per_s", "records_per_s", "bytes_per_s", "new_share"):
            value = getattr(self, name)
            if value is not None:
                out[prefix + name] = float(value)
        cache = self.cache
        if cache is not None:
            out.update({prefix + "cache_bytes": float(cache.bytes), prefix + "cache_shards": float(cache.shards),
                        prefix + "cache_published_bytes": float(cache.published_bytes),
                        prefix + "cache_evicted_bytes": float(cache.evicted_bytes),
                        prefix + "cache_fill_rate": cache.fill_rate,
                        prefix + "cache_leased_bytes": float(cache.leased_bytes)})
        for name, value in (self.samplers or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{prefix}sampler_{name}"] = float(value)
        return out

    def line(self) -> str:
        """The one-line summary that is logged at the end of each epoch."""
        head = f"epoch {self.epoch}" if self.epoch is not None else f"{self.epochs} epochs"
        parts = [f"{_count(self.records)} records", f"{format_size(self.bytes_per_s)}/s"]
        if self.data_wait_s is None:
            parts.append("wait not measured")
        else:
            bound = "at most " if self.data_wait_bound else ""
            share = self.data_wait_share
            ranks = f", most of {self.ranks} ranks" if self.ranks > 1 else ""
            parts.append(f"waited {bound}{_seconds(self.data_wait_s)} ({100 * (share or 0.0):.1f}%{ranks})")
        if self.first_batch_s is not None and self.epoch is not None:
            parts.append(f"first batch {_seconds(self.first_batch_s)}")
        if self.new_share is not None and self.epoch is not None:
            parts.append(f"{100 * self.new_share:.0f}% new since epoch {self.epoch - 1}")
        elif self.epoch is not None:
            parts.append("first epoch")
        if self.skipped_shards:
            parts.append(f"{self.skipped_shards} corrupt shards skipped")
        if self.cache is not None:
            c = self.cache
            parts.append(f"cache {format_size(c.bytes)} (+{format_size(c.published_bytes)}, "
                         f"-{format_size(c.evicted_bytes)})")
        if self.samplers:
            parts.append(sampler_summary(self.samplers))
        if not self.finished and self.epoch is not None:
            parts.append("stopped early")
        return f"{head}: " + ", ".join(parts)


@dataclass(frozen=True)
class InputStats:
    """What ``loader.stats()`` and :func:`input_stats` return.

    Attributes:
        epoch: the latest epoch's :class:`InputFigures` (live while it runs); ``None`` before
            the first epoch.
        total: the cumulative :class:`InputFigures` of every epoch so far.
    """

    epoch: InputFigures | None
    total: InputFigures


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


class _Record:
    """One epoch as it runs. The loop's own thread writes the ``next()`` figures without a lock
    (one writer); framework threads write the stage's under the meter's lock."""

    __slots__ = ("batches", "bytes_per_record", "cache", "ended_at", "finished", "first_at", "gathered",
                 "number", "oldest_age", "newest_age", "plan_records", "rows", "samplers", "skipped_at_start",
                 "skipped", "snapshot_records", "snapshot_shards", "stage_batches", "stage_wait", "started_at",
                 "token", "wait", "waits_measured", "new_records", "new_shards", "batch_size", "staged", "epoch",
                 "any_finished", "stage_first_at", "figures", "loop_rows")

    def __init__(self) -> None:
        self.batches = self.stage_batches = self.rows = self.loop_rows = 0
        self.wait = self.stage_wait = 0.0
        self.waits_measured = self.staged = self.any_finished = False
        self.first_at: float | None = None  # the loop got its first batch (timed at next())
        self.stage_first_at: float | None = None  # growcache's last stage made its first batch
        self.figures: InputFigures | None = None  # final, once the epoch ended
        self.ended_at: float | None = None
        self.finished = False
        self.cache: CacheFigures | None = None
        self.samplers: Mapping[str, Any] | None = None
        self.gathered: tuple[float, float, int, int, int] | None = None  # wait, wall, records, bytes, ranks
        self.skipped = 0


_METERS: list[weakref.ref[InputMeter]] = []
_METERS_LOCK = threading.Lock()


class InputMeter:
    """Measures one adapter object's epochs (a torch loader, one TensorFlow input pipeline).

    Args:
        epochs: the adapter's :class:`~growcache.epoch.Epochs`.
        gather: under several ranks, the process group's gather of one picklable object from
            every rank, called once at the end of each epoch that was read to its end (every
            rank gets there, with equal batch counts): rank 0 then logs the most any rank
            waited. Default: ``None`` (each rank's own figures).
        samplers: returns the samplers' figures (a flat mapping), read once per epoch.
            Default: growcache's reader of the samplers' stats file in the cache, if any.
        log: log one INFO line per epoch. Default: ``True``.
    """

    #: The clock of every figure (monotonic seconds).
    clock = staticmethod(_clock)

    def __init__(self, epochs: Any, *, gather: Callable[[Any], list[Any]] | None = None,
                 samplers: Callable[[], Mapping[str, Any] | None] | None = None, log: bool = True) -> None:
        self.epochs = epochs
        self.cache = epochs.cache
        self.gather = gather
        self.log = log
        self._samplers = samplers if samplers is not None else sampler_reader(self.cache)
        self._lock = threading.Lock()
        self._records: dict[int, _Record] = {}  # token -> record, the open epochs
        self.latest: _Record | None = None
        self._done: list[InputFigures] = []
        self._previous_seqs: frozenset[int] | None = None
        self._cache_sample = self._sample_cache()
        self._in_flight = 0
        self._busy_since = 0.0
        with _METERS_LOCK:
            _METERS[:] = [ref for ref in _METERS if ref() is not None] + [weakref.ref(self)]

    # -- epoch boundaries -----------------------------------------------------------------------
    def begin(self, epoch: Any, started_at: float | None = None) -> None:
        """Epoch ``epoch`` (an :class:`~growcache.epoch.Epoch`) started; ``started_at`` is when
        the loop asked for it (``iter()``), whose time counts as waiting. A joined epoch (a
        second reader) is counted once; epochs still open from before end, not finished."""
        now = _clock()
        with self._lock:
            if epoch.token in self._records:
                return
            stale = list(self._records)
        for token in stale:
            self.end(token, False)
        record = _Record()
        record.epoch = epoch
        record.token = epoch.token
        record.number = epoch.number
        if started_at is not None:
            record.started_at, record.wait = started_at, now - started_at
        else:  # a framework starts it inside the loop's first next(), which next_done times
            record.started_at = now
        record.batch_size = int(self.epochs.options.batch_size)
        try:
            record.plan_records = int(epoch.records())
        except Exception:  # noqa: BLE001 - a figure never stops training
            record.plan_records = -1
        shards = epoch.shards
        record.snapshot_shards = len(shards)
        record.snapshot_records = sum(s.records for s in shards)
        nbytes = sum(s.nbytes for s in shards)
        record.bytes_per_record = nbytes / record.snapshot_records if record.snapshot_records else 0.0
        previous = self._previous_seqs
        if previous is None:
            record.new_shards = record.new_records = None
        else:
            new = [s for s in shards if s.seq not in previous]
            record.new_shards, record.new_records = len(new), sum(s.records for s in new)
        self._previous_seqs = frozenset(s.seq for s in shards)
        record.oldest_age = _age(shards[0].path) if shards else None
        record.newest_age = _age(shards[-1].path) if shards else None
        record.skipped_at_start = len(self.epochs.skipped)
        with self._lock:
            self._records[epoch.token] = record
            self.latest = record

    def timed(self, batches: Iterable[Mapping[str, Any]], epoch: Any) -> Iterator[Mapping[str, Any]]:
        """``batches`` of ``epoch`` (begun), each ``next()`` timed and its rows counted (the
        length of its first array: each batch is a dict of arrays); the epoch ends with them."""
        record = self._records.get(epoch.token)
        if record is None:  # not begun: nothing to time
            yield from batches
            return
        clock = _clock
        record.waits_measured = True
        finished = False
        try:
            t = clock()
            for batch in batches:
                now = clock()
                record.wait += now - t
                record.batches += 1
                record.loop_rows += len(next(iter(batch.values())))  # a dict of arrays: its first one's rows
                if record.first_at is None:
                    record.first_at = now
                yield batch
                t = clock()
            record.wait += clock() - t  # the last next(), which found the end
            finished = True
        finally:
            self.end(epoch.token, finished)

    def next_done(self, started: float, got_batch: bool) -> None:
        """The loop's ``next()`` that began at ``started`` returned a batch (``got_batch``) or
        found the end of the latest epoch, which then ends."""
        now = _clock()
        record = self.latest
        if record is None or record.ended_at is not None:
            return
        if not record.waits_measured:
            record.waits_measured = True
            # The epoch began inside this first next() (the framework starts it lazily).
            record.started_at, record.wait = min(started, record.started_at), 0.0
        record.wait += now - started
        if got_batch:
            record.batches += 1
            if record.first_at is None:
                record.first_at = now
        else:
            self.end(record.token, True)

    def left(self, token: int, finished: bool) -> None:
        """A reader of epoch ``token`` left it (``finished``: it read to the end). The epoch's
        figures end when the epoch did, unless the loop's ``next()`` is timed: then at the end
        the loop sees (the framework may still hold prefetched batches)."""
        with self._lock:
            record = self._records.get(int(token))
        if record is None:
            return
        record.any_finished |= finished
        if record.epoch.ended and not (record.waits_measured and finished):
            self.end(token, record.any_finished)

    # Several framework threads may run growcache's last stage at once: the stage counts as
    # busy (no batch ready) while any of them is in it.
    def stage_enter(self) -> None:
        """A framework thread asks growcache's last stage for a batch."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = _clock()
            self._in_flight += 1

    def stage_exit(self, rows: int) -> None:
        """The stage returned a batch of ``rows`` rows (``0``: a reader is read out)."""
        with self._lock:
            self._in_flight -= 1
            record = self.latest
            if record is None:
                return
            now = _clock()
            record.staged = True
            if self._in_flight == 0:
                record.stage_wait += now - self._busy_since
            if rows:
                record.rows += rows
                record.stage_batches += 1
                if record.stage_first_at is None:
                    record.stage_first_at = now

    def end(self, token: int, finished: bool) -> None:
        """The epoch of ``token`` ended (``finished``: read to its end); log its line. Once each."""
        with self._lock:
            record = self._records.pop(int(token), None)
        if record is None:
            return
        record.ended_at = _clock()
        record.finished = finished
        record.epoch = None  # the figures outlive the epoch; its snapshot and plan need not
        record.skipped = len(self.epochs.skipped) - record.skipped_at_start
        sample = self._sample_cache()
        record.cache = _cache_figures(self._cache_sample, sample)
        self._cache_sample = sample
        record.samplers = self._read_samplers()
        figures = self._figures(record)
        group = self.epochs.group
        ranks = group.world_size
        log = self.log
        if self.gather is not None and finished and ranks > 1 and getattr(self.epochs.options, "even_batches", False):
            try:
                shared = self.gather((figures.data_wait_s or 0.0, figures.wall_s, figures.records, figures.bytes))
            except Exception as exc:  # noqa: BLE001 - a figure never stops training
                logger.debug("could not gather the input figures of every rank: %s", exc)
            else:
                if len(shared) > 1:  # else no process group: every rank logs its own line
                    record.gathered = (max(w for w, _, _, _ in shared), max(t for _, t, _, _ in shared),
                                       sum(r for _, _, r, _ in shared), sum(b for _, _, _, b in shared),
                                       len(shared))
                    figures = self._figures(record)
                    log = log and group.world_rank == 0
        with self._lock:  # stats() sees the epoch either running or done, never both or neither
            record.figures = figures
            self._done.append(figures)
        if log:
            logger.info("%s", figures.line())

    # -- figures --------------------------------------------------------------------------------
    def stats(self) -> InputStats:
        """The latest epoch's figures (live while it runs) and the cumulative ones."""
        with self._lock:
            latest, done = self.latest, list(self._done)
            current = latest.figures if latest is not None else None
        if latest is None:
            return InputStats(None, _total(done))
        if current is None:  # still running
            current = self._figures(latest)
            done.append(current)
        return InputStats(current, _total(done))

    def _figures(self, r: _Record) -> InputFigures:
        end = r.ended_at if r.ended_at is not None else _clock()
        wall = max(end - r.started_at, 0.0)
        staged = not r.waits_measured
        first = r.stage_first_at if staged else r.first_at
        batches = r.stage_batches if staged else r.batches
        if r.loop_rows:  # counted at next()
            records = r.loop_rows
        elif r.rows and (staged or r.finished):  # made by the stage; once finished, every one was taken
            records = r.rows
        elif r.finished and r.plan_records >= 0 and r.skipped == 0:
            records = r.plan_records
        else:
            records = batches * r.batch_size
            if r.plan_records >= 0:
                records = min(records, r.plan_records)
        wait: float | None = r.wait if r.waits_measured else (r.stage_wait if r.staged else None)
        nbytes = int(records * r.bytes_per_record)
        ranks = 1
        if r.gathered is not None:
            wait, wall, records, nbytes, ranks = r.gathered
        return InputFigures(
            epoch=r.number, epochs=1, finished=r.finished, batches=batches, records=records, bytes=nbytes,
            wall_s=wall, data_wait_s=wait, data_wait_bound=staged and wait is not None,
            first_batch_s=(first - r.started_at) if first is not None else None,
            snapshot_shards=r.snapshot_shards, snapshot_records=r.snapshot_records, new_shards=r.new_shards,
            new_records=r.new_records, oldest_shard_age_s=r.oldest_age, newest_shard_age_s=r.newest_age,
            skipped_shards=r.skipped if r.ended_at is not None else len(self.epochs.skipped) - r.skipped_at_start,
            ranks=ranks, cache=r.cache, samplers=r.samplers)

    def _sample_cache(self) -> tuple[float, Any] | None:
        try:
            return _clock(), self.cache.stats()
        except Exception as exc:  # noqa: BLE001 - a figure never stops training
            logger.debug("no cache figures for %s: %s", self.cache.path, exc)
            return None

    def _read_samplers(self) -> Mapping[str, Any] | None:
        if self._samplers is None:
            return None
        try:
            return self._samplers()
        except Exception as exc:  # noqa: BLE001 - a figure never stops training
            logger.debug("no sampler figures for %s: %s", self.cache.path, exc)
            return None


class MeteredLoader:
    """``stats()`` for an adapter object that measures its epochs with an :class:`InputMeter`
    (``self._meter``); mixed into the PyTorch loader."""

    _meter: InputMeter

    def stats(self) -> InputStats:
        """Is training waiting on data? The latest epoch's :class:`InputFigures` (live while it
        runs: ``data_wait_s`` and its share of the wall time, rates, time to the first batch,
        freshness, corrupt shards skipped, the cache's state) and the cumulative figures."""
        return self._meter.stats()


def _age(path: str) -> float | None:
    try:
        return max(time.time() - os.stat(path).st_mtime, 0.0)
    except OSError:  # evicted since the snapshot's listing (before its lease)
        return None


def _cache_figures(before: tuple[float, Any] | None, after: tuple[float, Any] | None) -> CacheFigures | None:
    if after is None:
        return None
    t1, s = after
    t0, b = before if before is not None else (t1, s)
    return CacheFigures(bytes=s.bytes, shards=s.shards, capacity=s.capacity,
                        published=_since(s.published, b.published),
                        published_bytes=_since(s.published_bytes, b.published_bytes),
                        evicted=_since(s.evicted, b.evicted), evicted_bytes=_since(s.evicted_bytes, b.evicted_bytes),
                        interval_s=t1 - t0, leases=s.leases, leased_bytes=s.leased_bytes)


def _since(now: int, then: int) -> int:
    # A counter below its earlier value started again (state.json was rebuilt from the listing):
    # all of it counts, from that new start, never a negative figure.
    return now - then if now >= then else now


def _total(done: list[InputFigures]) -> InputFigures:
    if not done:
        return InputFigures(epoch=None, epochs=0, finished=True, data_wait_s=None)
    waits = [f.data_wait_s for f in done]
    news = [f for f in done if f.new_records is not None]
    last = done[-1]
    return replace(
        last, epoch=None, epochs=len(done), finished=all(f.finished for f in done),
        batches=sum(f.batches for f in done), records=sum(f.records for f in done),
        bytes=sum(f.bytes for f in done), wall_s=sum(f.wall_s for f in done),
        data_wait_s=None if any(w is None for w in waits) else sum(waits),
        data_wait_bound=any(f.data_wait_bound for f in done), first_batch_s=done[0].first_batch_s,
        snapshot_records=sum(f.snapshot_records for f in news) if news else 0,
        snapshot_shards=sum(f.snapshot_shards for f in news) if news else 0,
        new_shards=sum(f.new_shards for f in news) if news else None,
        new_records=sum(f.new_records for f in news) if news else None,
        skipped_shards=sum(f.skipped_shards for f in done), ranks=max(f.ranks for f in done))


def input_stats(cache: Any, run_id: str | None = None) -> InputStats:
    """The input figures of the loader or dataset over ``cache`` in this process.

    The TensorFlow accessor: a dataset from :func:`growcache.make_tf_dataset` is another
    object after ``ds.map()``, and Keras never hands it back, but the cache stays the same.
    With several loaders or datasets over one cache, the one whose epoch started last.

    Args:
        cache: a :class:`~growcache.Cache` or its directory.
        run_id: only a loader or dataset built with this ``run_id``. Default: ``None`` (any).

    Raises:
        LookupError: no loader or dataset over ``cache`` (with ``run_id``) lives in this process.
    """
    path = os.path.realpath(os.fspath(getattr(cache, "path", cache)))
    meters = [m for m in live_meters() if os.path.realpath(m.cache.path) == path
              and (run_id is None or m.epochs.options.run_id == run_id)]
    if not meters:
        raise LookupError(f"no growcache loader or dataset over cache {path}"
                          f"{'' if run_id is None else f' with run_id={run_id!r}'} lives in this process: build "
                          "one with make_torch_loader or make_tf_dataset first")
    return _latest(meters).stats()


def _latest(meters: list[InputMeter]) -> InputMeter:
    started = [m for m in meters if m.latest is not None]
    return max(started, key=lambda m: m.latest.started_at) if started else meters[-1]


def stats_source(source: Any) -> Callable[[], InputStats]:
    """How to read the figures of ``source``: a loader or dataset with ``stats()``, or a cache
    or its directory (:func:`input_stats`)."""
    if isinstance(source, (Cache, str, os.PathLike)):
        return lambda: input_stats(source)
    if not callable(getattr(source, "stats", None)):
        raise TypeError(f"expected a growcache loader or dataset, a Cache or a cache directory, got {source!r}")
    return source.stats


class TrainerSource:
    """Which figures a trainer callback reports each epoch.

    Args:
        source: see :func:`stats_source`. Default: ``None``: the first growcache loader or
            dataset of this process whose epoch started after the trainer's epoch began
            (:meth:`epoch_begins`): the training data, since validation starts later.
    """

    def __init__(self, source: Any = None) -> None:
        self._read = stats_source(source) if source is not None else None
        self._since: float | None = None

    def epoch_begins(self) -> None:
        """The trainer's epoch begins now."""
        self._since = _clock()

    def figures(self) -> InputFigures | None:
        """The figures of the trainer's epoch; ``None`` when no growcache epoch ran in it."""
        if self._read is not None:
            return self._read().epoch
        since = self._since if self._since is not None else float("-inf")
        started = [m for m in live_meters() if m.latest is not None and m.latest.started_at >= since]
        return min(started, key=lambda m: m.latest.started_at).stats().epoch if started else None


def live_meters() -> list[InputMeter]:
    """Every :class:`InputMeter` alive in this process, oldest first."""
    with _METERS_LOCK:
        return [m for m in (ref() for ref in _METERS) if m is not None]


def sampler_reader(cache: Any) -> Callable[[], Mapping[str, Any] | None] | None:
    """A function that reads the figures of the sampler pools running on ``cache`` from their
    stats files (summed, the slowest pool's latencies; ``None`` when none runs); ``None`` if
    this growcache has no such files."""
    try:
        from ._sampler_stats import read_sampler_stats
    except ImportError:
        return None
    return lambda: read_sampler_stats(cache)


def sampler_summary(figures: Mapping[str, Any] | None) -> str:
    """The samplers' figures in a few words: rate, requests in flight, latency percentiles,
    throttling; ``""`` when no sampler publishes them."""
    if not figures:
        return ""
    text = (f"samplers {figures.get('mb_per_s', 0.0):.1f} MB/s, {figures.get('requests_in_flight', 0)} requests in "
            f"flight, latency p50 {_millis(figures.get('latency_p50', 0.0))} p95 "
            f"{_millis(figures.get('latency_p95', 0.0))} p99 {_millis(figures.get('latency_p99', 0.0))}")
    if figures.get("throttle_events"):
        text += f", {figures['throttle_events']} throttled"
    return text


def _millis(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms"
