"""Streaming an existing remote TFRecord dataset through a cache, whole shards at a time.

:class:`ShardSource` is the second source protocol of :class:`~growcache.SamplerPool`.
A sample source (``sample(rng) -> dict``) gives samples that the pool encodes into new
shards; a shard source gives whole shard files:

* ``fetch(job)`` yields :class:`FetchedShard` objects, each a verified temporary file in
  the cache's shard directory. The pool publishes each one (evicting the oldest
  unleased shards to stay in the budget), calling its ``commit`` hook under the cache
  lock just before the shard appears, then asks for the next. A ``fetch`` that yields
  nothing means there is nothing to fetch now; the pool asks again a moment later.
* The pool closes the iterator when it stops or fails; a shard source releases what it
  claimed there. A worker killed mid-copy leaves a temporary file, which the pool
  removes; its claim dies with it.

:class:`TFRecordShardSource` copies the shards of a dataset (``gs://bucket/train-*``)
unchanged, every record's CRCs and schema checked on the way (GZIP and ZLIB files are
inflated). Its shards go in *passes*: a pass is a permutation, drawn from the pool's
seed, of every remote shard the cache does not hold when the pass starts; workers claim
the next shard of the pass through a state file in the cache directory (under the cache
lock), so no shard is fetched twice in a pass, by several workers or by restarted ones.
When every shard of a pass has been fetched, the next pass starts with the shards that
were evicted since. The state file records which published shards hold which byte ranges
of which remote shard, so the cache knows what it holds across restarts, and a shard cut
into pieces (``max_shard_records``, ``max_shard_bytes``, or the pool's ``shard_size``)
that was partly evicted is fetched again only for its missing pieces.

The bucket is live, and the state file is untrusted:

* Each pass starts from a fresh listing of the store, and only paths of the current
  listing are ever claimed (a tampered ``order`` cannot name a file outside the glob).
* A remote shard is known by its version (size and the store's etag, generation or
  modification time). Pieces held of an older version never steer a resume: a shard
  rewritten between passes is fetched whole again.
* A shard deleted or rewritten during a pass, or a corrupt one, is passed over with one
  warning and counted in the pass progress (``vanished``, ``changed``, ``corrupt``); a
  corrupt one is not fetched again until it changes (or an hour has passed: a planted
  entry pins nothing for good). The source never stops for one file.
  Its version is read again after each piece is copied (one metadata request), so no
  piece publishes bytes of two versions of a shard rewritten while it was read.
* A claim carries a heartbeat: while its copy runs (or waits for room to publish), a thread
  refreshes its time every :func:`~growcache._proc.heartbeat_interval` seconds, and a claim
  whose time is older than the owner expiry its owner stored in it
  (:func:`~growcache._proc.beat_expiry`; never the judging job's own setting) is dead, wherever
  its owner runs. Before each piece is published, the claim is checked under the cache lock: a copy
  whose claim was taken over (a process frozen past the expiry) publishes nothing.
* Every field of the state is checked before use; a damaged claim counts as expired, any
  other damage starts the state afresh, with a warning.

One large remote shard fills at line rate: a worker reads it as ranged parts of
``chunk_bytes``, up to the pool's ``concurrency`` in flight (fewer while the store throttles)
and at most its ``max_bytes_in_flight`` held, whatever the shard's size. The parts are handed
on in order to the same checks and cuts as a serial read; a part that fails transiently is
retried alone under the source's :class:`~growcache.RetryPolicy`. A shard rewritten while
its parts were read is caught by the version check above; one that shrank gives a short
part, which fails the read. ``concurrency=1`` reads one request at a time, as before.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _proc
from ._concurrent import _TICKET, DEFAULT_CONCURRENCY, DEFAULT_MAX_BYTES_IN_FLIGHT, DaemonThreads, Flow, Ticket
from ._retry import RetryPolicy
from .errors import CacheFormatError, CompressedFileError, CorruptShardError, GrowcacheError, SchemaError, SourceError
from .example import ExampleCodec, RecordChecker
from .importer import CHUNK_BYTES, TFRecordFiles, _infer, _inflate, _record_limit, _skip, copy_records, iter_frames
from .records import detect_compression
from .store import _sized, glob_listing, object_version
from .writer import discard_temporary

if TYPE_CHECKING:
    from .cache import Cache
    from .schema import Schema
    from .shard import ShardInfo

__all__ = ["ClaimLostError", "FetchJob", "FetchedShard", "PassProgress", "ShardSource", "TFRecordShardSource",
           "pass_progress"]

logger = logging.getLogger(__name__)

_HISTORY = 16  # passes whose fetches the state file keeps
_RELIST_S = 10.0  # between passes, seconds between listings of the store
_RELIST = object()
_PROBE_FILES = 3  # shards a probe reads before one bad shard counts as a bad source
_BAD_RETRY_S = 3600.0  # a corrupt remote shard that does not change is tried again this often
_CLOCK_SKEW_S = 300.0  # how far another machine's clock may run ahead of ours


@dataclass(frozen=True)
class FetchJob:
    """What a sampler worker hands :meth:`ShardSource.fetch`.

    Attributes:
        cache: the cache to fill; temporary files go in its shard directory.
        seed: the pool's seed (shard sources draw their order from it, the same in every worker).
        worker: the worker's index.
        should_stop: returns ``True`` once the pool is stopping.
        max_bytes: the pool's ``shard_size``: a fetched shard is cut at a record boundary
            before it grows past it. ``None``: no limit.
        progress: called with the bytes of each record copied (the pool's live counters).
        concurrency: requests the worker keeps in flight (the pool's ``concurrency``): a
            remote shard is read as that many ranged parts at once; ``1`` reads it one request
            at a time. ``None``: the pool's default.
        max_bytes_in_flight: bytes of parts fetched and not yet copied, at most (the pool's
            ``max_bytes_in_flight``), whatever the shard's size. ``None``: the pool's default.
        flow: the worker's :class:`~growcache._concurrent.Flow`, which every fetch of the job
            shares: its in-flight limit (cut while the store throttles) carries over from one
            shard to the next, and the pool reads its figures (``pool.stats()``: requests in
            flight, latency percentiles, throttle events). ``None``: each read has its own.
    """

    cache: Cache
    seed: int
    worker: int
    should_stop: Callable[[], bool]
    max_bytes: int | None = None
    progress: Callable[[int], None] | None = None
    concurrency: int | None = None
    max_bytes_in_flight: int | None = None
    flow: Flow | None = None


@dataclass(frozen=True)
class FetchedShard:
    """A verified temporary shard file, for the pool to publish.

    Attributes:
        path: the temporary file, in the cache's shard directory.
        records: records it holds.
        nbytes: its size.
        commit: called with the published shard under the cache lock, just before it
            appears; ``None`` for none.
    """

    path: str
    records: int
    nbytes: int
    commit: Callable[[ShardInfo], None] | None = None


class ShardSource:
    """Base class of sources that give whole shard files (see the module docstring).

    Subclasses implement :meth:`fetch`. A shard source must pickle: the sampler pool
    sends it to spawned worker processes.
    """

    def fetch(self, job: FetchJob) -> Iterator[FetchedShard]:
        """Yield verified temporary shards in ``job.cache``; yield none when there is nothing to do now."""
        raise NotImplementedError

    def redact(self, text: str) -> str:
        """``text`` with any credential this source holds replaced by ``***``."""
        return text

    def check(self) -> None:
        """Contact the store once and raise now if the source cannot work (optional)."""


@dataclass(frozen=True)
class _Claim:
    path: str
    segments: tuple[tuple[int, int | None], ...]  # stream byte ranges to copy; None: to the end
    token: str  # whose claim it is: a random token, compared before every publish
    version: str  # the remote shard's version in the listing the claim was made from


@dataclass(frozen=True)
class PassProgress:
    """Where a shard source stands in a cache (``growcache status`` shows it).

    Attributes:
        source: the source's URL(s), credentials removed.
        pass_number: the pass in progress (1 for the first; 0 before any).
        fetched: remote shards fetched in this pass.
        total: remote shards this pass fetches (those the cache did not hold when it began).
        in_flight: remote shards being fetched now.
        held: remote shards the cache holds whole.
        known: remote shards the source has seen.
        vanished: remote shards of this pass that were deleted before they were fetched.
        changed: remote shards rewritten while this pass ran (passed over; the next pass
            fetches the new version) or since they were fetched (fetched whole again).
        corrupt: remote shards passed over as corrupt or off-schema; each is fetched again
            only once it changes.
    """

    source: str
    pass_number: int
    fetched: int
    total: int
    in_flight: int
    held: int
    known: int
    vanished: int = 0
    changed: int = 0
    corrupt: int = 0


class TFRecordShardSource(TFRecordFiles, ShardSource):
    """Whole shards of a remote TFRecord dataset, copied into a cache in per-pass shuffled order.

    Give it to a :class:`~growcache.SamplerPool` in place of a sample source::

        source = TFRecordShardSource("gs://bucket/train-*", storage_options={"token": "anon"})
        with SamplerPool(cache, source, workers=2, seed=0) as pool:
            ...

    Records are copied byte for byte, never re-encoded; every record's CRCs and its
    schema (the cache's) are checked first. See the module docstring for passes.

    Args:
        url: a URL or glob of the shards, or a list of them (local paths work too).
        storage_options: passed to fsspec (credentials, endpoints). Never logged.
        retry: retry policy of transient store errors. Default: ``RetryPolicy()``.
        max_shard_records: cut remote shards into cache shards of at most this many
            records. Default: ``None`` (no limit).
        max_shard_bytes: cut remote shards into cache shards of at most this many bytes
            (an int or ``"64MB"``); the pool's ``shard_size`` applies too. Default: ``None``.
        chunk_bytes: bytes per read request: a remote shard is read as ranged parts of this
            size, up to the pool's ``concurrency`` of them in flight and at most its
            ``max_bytes_in_flight`` held (one request at a time with ``concurrency=1``).
            Default: 4 MiB.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        max_shard_records: int | None = None,
        max_shard_bytes: int | str | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        from ._size import parse_size

        super().__init__(url, storage_options=storage_options, retry=retry, chunk_bytes=chunk_bytes)
        if max_shard_records is not None and (isinstance(max_shard_records, bool) or int(max_shard_records) < 1):
            raise ValueError(f"max_shard_records must be a positive int or None, got {max_shard_records!r}")
        self.max_shard_records = None if max_shard_records is None else int(max_shard_records)
        self.max_shard_bytes = None if max_shard_bytes is None else parse_size(max_shard_bytes, name="max_shard_bytes")
        # The cache keeps this source's state under a key of its URLs: the same dataset
        # given again (another pool, a restart) continues where it was.
        self.key = hashlib.sha256(json.dumps(sorted(self.urls)).encode()).hexdigest()[:32]
        self._listing: dict[str, str] | None = None  # path -> version, as this process last listed the store
        self._listed_at = 0.0  # time.monotonic() of that listing
        self._listed_for = 0  # the pass it serves
        #: The most bytes of ranged parts this process held at once (fetched or in flight, not yet copied).
        self.peak_bytes_in_flight = 0
        # (requests, bytes, should_stop, the job's flow) of the fetch reading now (see _reading);
        # None: serial reads.
        self._window: tuple[int, int, Callable[[], bool], Flow | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(peak_bytes_in_flight=0, _window=None)
        return state

    def _repr_extra(self) -> str:
        return f", max_shard_records={self.max_shard_records}, max_shard_bytes={self.max_shard_bytes}"

    def probe(self, schema: Schema | None = None, *, records: int = 16,
              max_record_bytes: int | str | None = None) -> Schema:
        """Read the first records of the first shards, before any worker starts.

        A glob that matches nothing, a store that cannot be reached, files that are not
        TFRecord files and records of another schema are then one error, at once. One bad
        file is no such error: a shard that fails is passed over with a warning and the next
        one is read, up to ``_PROBE_FILES`` shards.

        Args:
            schema: the schema the records must follow (the cache's). ``None``: infer it
                (see :func:`~growcache.importer.infer_schema`).
            records: records to read. Default: ``16``.
            max_record_bytes: without ``schema``, refuse longer records before reading them.
                Default: 64 MiB.

        Returns:
            ``schema``, or the inferred one.

        Raises:
            SourceError: the store failed, or the glob matches nothing.
            CorruptShardError: the first shards are not TFRecord files, or are damaged there
                (the first one's error).
            SchemaError: their records do not follow ``schema``, or hold no fixed-shape schema.
        """
        first: Exception | None = None
        for path in self.paths()[:_PROBE_FILES]:
            try:
                return self._probe_one(path, schema, records, max_record_bytes)
            except (CorruptShardError, SchemaError, CompressedFileError) as exc:
                first = first or exc
                logger.warning("%s: %s cannot be read (%s); probing the next shard", self._redact(", ".join(self.urls)),
                               self._url(path), exc)
        raise first  # type: ignore[misc]

    def _probe_one(self, path: str, schema: Schema | None, records: int, max_record_bytes: int | str | None) -> Schema:
        if schema is None:
            return _infer(self, path, records, max_record_bytes=_record_limit(max_record_bytes))
        url = self._url(path)
        codec = ExampleCodec(schema)
        checker = RecordChecker(codec, url)
        chunks, _ = self.stream(path)
        for count, (offset, _, _, _, record) in enumerate(
                iter_frames(chunks, url, max_record_bytes=codec.max_record_bytes), 1):
            checker.check(record, offset)
            if count >= records:
                break
        checker.flush()
        return schema

    # -- the protocol -----------------------------------------------------------------------
    def fetch(self, job: FetchJob) -> Iterator[FetchedShard]:
        """Claim the next remote shard of the pass and yield its pieces as verified temporary shards.

        Yields nothing when every shard of the pass is fetched or being fetched by another
        worker, or when the cache holds the whole dataset. A remote shard that vanished,
        changed or is corrupt is passed over with a warning (see the module docstring).

        Raises:
            SchemaError: the cache has no schema.
            SourceError: the store failed (after retries for transient errors).
        """
        cache = job.cache
        if cache.schema is None:
            raise SchemaError(f"cache {cache.path} has no schema: give it the dataset's schema "
                              "(growcache schema URL prints it)")
        concurrency, _ = _in_flight(job)
        if concurrency > 1 and self._pool_connections is None:
            self.set_concurrency(concurrency)  # before the listing below makes the filesystem
        claim = self._claim(job)
        if claim is None:
            return
        url = self._url(claim.path)
        limits = [x for x in (self.max_shard_bytes, job.max_bytes) if x is not None]
        codec = ExampleCodec(cache.schema)
        done = False
        keeper = _ClaimKeeper(self, cache, claim)
        try:
            info = self._info_now(claim.path)
            now = None if info is None else object_version(info)
            if now != claim.version:
                done = self._pass_over(cache, claim, "vanished" if now is None else "changed")
                return
            size = info.get("size") if info is not None else None  # of the version claimed: no second request
            end = None
            for start, stop in claim.segments:
                with self._reading(claim.path, start, stop, job, size if _is_int(size) else None) as chunks:
                    frames = _Until(iter_frames(chunks, url, start, max_record_bytes=codec.max_record_bytes), start,
                                    stop, job.should_stop)
                    pieces = copy_records(frames, cache, RecordChecker(codec, url),
                                          max_records=self.max_shard_records,
                                          max_bytes=min(limits) if limits else None, start=start,
                                          progress=job.progress)
                    last_segment = (start, stop) == claim.segments[-1]
                    with contextlib.closing(pieces):
                        for piece in pieces:
                            now = self._version_now(claim.path)
                            if now != claim.version:
                                # Rewritten (or deleted) while it was read: this piece may hold bytes of two
                                # versions. A piece whose reads all came before the change is kept.
                                _discard(piece.path)
                                done = self._pass_over(cache, claim, "vanished" if now is None else "changed")
                                return
                            if keeper.lost:
                                logger.warning("%s: the claim on %s was taken over while it was copied (this process "
                                               "stalled for longer than %g s?); the copy is dropped",
                                               self._redact(", ".join(self.urls)), url, _proc.owner_expiry())
                                done = True  # the claim is not ours to release
                                _discard(piece.path)
                                return
                            # The last piece's commit also ends the fetch: one state write, not two.
                            finish = last_segment and piece.last
                            commit = _Commit(self, cache, claim, piece.start, piece.end, finish)
                            yield FetchedShard(piece.path, piece.records, piece.nbytes, commit)
                            if finish:
                                done = True
                            elif job.should_stop():
                                return
                end = frames.end
            if not done:  # no records in the last segment (an empty file): end the fetch here
                self._finish(cache, claim, end)
                done = True
            logger.debug("fetched %s", url)
        except _Stopping:
            logger.debug("stopped fetching %s", url)
        except (CorruptShardError, SchemaError, CompressedFileError, SourceError) as exc:
            done = self._pass_over_failed(cache, claim, exc)
        finally:
            keeper.stop()
            if not done:
                self._release(cache, claim)

    def chunks(self, path: str, start: int = 0, size: int | None = None) -> Iterator[bytes]:
        """The raw bytes of ``path`` from ``start`` to ``size``.

        Inside a fetch of a pool with ``concurrency`` above 1 they come as ranged parts of
        ``chunk_bytes``, many in flight, in order; otherwise one request at a time.
        """
        window = self._window
        if window is None:
            yield from super().chunks(path, start, size)
            return
        concurrency, max_bytes, should_stop, flow = window
        size = self.size(path) if size is None else size
        yield from _Parts(self, path, start, size, part=self.chunk_bytes, concurrency=concurrency,
                          max_bytes=max_bytes, should_stop=should_stop, flow=flow)

    @contextlib.contextmanager
    def _reading(self, path: str, start: int, stop: int | None, job: FetchJob,
                 size: int | None = None) -> Iterator[Iterator[bytes]]:
        """The uncompressed stream of ``path`` from offset ``start``, read for the records up to ``stop``.

        With ``job.concurrency`` 1, one request at a time (:meth:`stream`). Otherwise the raw
        bytes come in ranged parts, many in flight (:meth:`chunks`): a plain file's from
        ``start`` to ``stop``, a compressed one's whole (it inflates from its beginning). The
        parts in flight are cancelled when the block ends. ``size``: the object's size, if known.
        """
        concurrency, max_bytes = _in_flight(job)
        if concurrency <= 1:
            yield self.stream(path, start)[0]
            return
        size = self.size(path) if size is None else size
        known = not (start == 0 and stop is None)  # else the first part tells the compression
        compression = detect_compression(self._fetch(path, 0, min(size, 64))) if known and size else None
        plain = known and compression is None
        end = size if stop is None or not plain else min(stop, size)
        self._window = (concurrency, max_bytes, job.should_stop, job.flow)
        parts = self.chunks(path, start if plain else 0, end)
        try:
            raw: Iterator[bytes] = parts
            if not known:
                first = next(raw, b"")
                compression = detect_compression(first[:64]) if first else None
                raw = itertools.chain([first] if first else [], raw)
            if end < size:
                # Pieces end at record boundaries, so the frames stop at ``stop`` and never read
                # on; a state that says otherwise (tampered) reads on one request at a time.
                raw = itertools.chain(raw, TFRecordFiles.chunks(self, path, end, size))
            yield raw if compression is None else _skip(_inflate(raw, compression, self._url(path)), start)
        finally:
            self._window = None
            parts.close()  # cancels the parts in flight

    def _pass_over_failed(self, cache: Cache, claim: _Claim, exc: BaseException) -> bool:
        """Pass over a remote shard whose fetch failed, if it vanished, changed or is corrupt;
        re-raise a store failure (an unreachable store, a denied access)."""
        if isinstance(exc, SourceError):
            now = self._version_now(claim.path)
            if now == claim.version:
                raise exc
            return self._pass_over(cache, claim, "vanished" if now is None else "changed")
        now = self._version_now(claim.path)
        if now != claim.version:  # a rewrite under the reader misframes it: not corrupt, changed
            return self._pass_over(cache, claim, "vanished" if now is None else "changed")
        detail = (f"{exc.reason} at byte offset {exc.offset}" if isinstance(exc, CorruptShardError)
                  else self._redact(str(exc)))
        return self._pass_over(cache, claim, "corrupt", detail)

    # -- the store's listing ------------------------------------------------------------------
    def _list_versions(self) -> dict[str, str]:
        """Every remote shard the URLs name now, with its version. Never cached by fsspec: a
        listing cache would hide files added, deleted or rewritten since."""
        from .store import _GLOB_CHARS

        fs = self.fs
        with contextlib.suppress(Exception):
            fs.invalidate_cache()
        found: dict[str, str] = {}
        for url in self.urls:
            path = fs._strip_protocol(url)
            if _GLOB_CHARS & set(path):
                listing = self._io("listing", self._redact(url), lambda p=path: glob_listing(fs, p))
                found.update((p, object_version(info)) for p, info in listing.items()
                             if isinstance(info, dict) and info.get("type", "file") != "directory")
            else:
                version = self._version_now(path)
                if version is not None:
                    found[path] = version
        return found

    def _version_now(self, path: str) -> str | None:
        """The version of ``path`` in the store now; ``None`` if it is gone."""
        info = self._info_now(path)
        return None if info is None else object_version(info)

    def _info_now(self, path: str) -> dict[str, Any] | None:
        """The store's details of ``path`` now (never fsspec's cached ones); ``None`` if it is gone."""
        fs = self.fs
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        try:
            info = self._io("reading the details of", self._url(path), lambda: _sized(lambda: fs.info(path)))
        except SourceError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise
        return info if isinstance(info, dict) else {}

    def _current_listing(self, cache: Cache) -> tuple[dict[str, str], bool]:
        """This process's listing, and whether it was just made: listed again when a pass began
        after it, or between passes every ``_RELIST_S`` (see :meth:`_claim`)."""
        try:
            state = cache._manifest.read_source_state(self.key) or {}
        except CacheFormatError:
            state = {}
        order, done = state.get("order"), state.get("done")
        number = state.get("pass") if _is_int(state.get("pass")) else 0
        complete = not (isinstance(order, list) and isinstance(done, list)) or set(map(str, order)) <= set(map(str, done))
        # A pass in progress: the listing it began with (or a later one). Between passes, one
        # at most every _RELIST_S: a cache that holds everything polls, the store is not listed as often.
        if (self._listing is None or (not complete and self._listed_for < number)
                or (complete and time.monotonic() - self._listed_at > _RELIST_S)):
            self._listing = self._list_versions()
            self._listed_at = time.monotonic()
            self._listed_for = number
            return self._listing, True
        return self._listing, False

    # -- the state file ----------------------------------------------------------------------
    def _read(self, cache: Cache) -> dict[str, Any]:
        """This source's state in ``cache``, every field checked. Assumes you hold the lock."""
        _refuse_linked_sources(cache)
        try:
            state = cache._manifest.read_source_state(self.key)
            problem = None if state is None else _damage(state)
        except CacheFormatError as exc:
            state, problem = None, str(exc)
        if problem is not None:
            logger.warning("the state of shard source %s in %s is damaged (%s); it starts afresh, so shards the "
                           "cache holds may be fetched again", self._redact(", ".join(self.urls)), cache.path, problem)
            state = None
        state = state or {}
        state.setdefault("pass", 0)
        state.setdefault("order", [])
        state.setdefault("done", [])
        state.setdefault("claims", {})
        state.setdefault("held", {})
        state.setdefault("history", [])
        state.setdefault("skipped", {})
        state.setdefault("bad", {})
        state.setdefault("rewritten", 0)
        state["source"] = self._redact(", ".join(self.urls))
        for path, claim in list(state["claims"].items()):
            problem = _claim_damage(claim)
            if problem is not None:
                logger.warning("%s: the claim on %s in %s is damaged (%s): it counts as expired", state["source"],
                               self._url(path), cache.path, problem)
                del state["claims"][path]
        return state

    def _write(self, cache: Cache, state: dict[str, Any], *, durable: bool = True) -> None:
        """Assumes you hold the lock. Claims need no fsync (they die with their processes);
        what the cache holds does."""
        _refuse_linked_sources(cache)
        cache._manifest.write_source_state(self.key, state, durable=durable)

    def _claim(self, job: FetchJob) -> _Claim | None:
        for _ in range(2):
            claim = self._claim_listed(job)
            if claim is not _RELIST:
                return claim  # type: ignore[return-value]
            self._listing = None
        return None

    def _claim_listed(self, job: FetchJob) -> _Claim | None | object:
        """Claim the next shard; ``_RELIST`` when a pass should start from an older listing
        than this call made (a pass starts from a fresh one; a poll with nothing to do does not list)."""
        cache = job.cache
        listing, fresh = self._current_listing(cache)
        with cache._locked():
            state = self._read(cache)
            unchanged = json.dumps(state, sort_keys=True)  # workers poll: write only what changes
            state["known"] = len(listing)
            _prune(state, {s.seq for s in cache.list_shards()})
            rewritten = self._reconcile(state, listing)
            done = set(state["done"])
            if all(p in done for p in state["order"]):
                # A pass ends when every shard of it has been fetched or passed over once; the
                # next one takes the shards the cache no longer holds, in a new order.
                todo = sorted(p for p in listing if not _holds(state, p) and p not in state["bad"])
                if not todo:
                    if json.dumps(state, sort_keys=True) != unchanged:
                        self._write(cache, state, durable=False)
                    return None
                if not fresh:
                    return _RELIST
                number = state["pass"] + 1
                rng = np.random.default_rng(np.random.SeedSequence(job.seed, spawn_key=(number,)))
                state.update({"pass": number, "order": [todo[i] for i in rng.permutation(len(todo))], "done": [],
                              "started": time.time(), "skipped": {}, "rewritten": 0})
                state["history"] = (state["history"] + [{"pass": number, "total": len(todo), "started": time.time(),
                                                         "fetched": []}])[-_HISTORY:]
                done = set()
                self._listed_for = number
                logger.info("%s: pass %d fetches %d of %d shards", state["source"], number, len(todo), len(listing))
            state["rewritten"] += rewritten
            claims = state["claims"]
            for path in state["order"]:
                if path in done or path in claims:
                    continue
                held = state["held"].get(path)
                if held is not None and held.get("end") is not None and not _missing(state, path):
                    done.add(path)  # every record of it is in the cache (a tampered or unsaved done)
                    _mark_fetched(state, path, held["end"])
                    continue
                if path not in listing:
                    # Deleted since the pass began, or never listed (a tampered order): never fetched.
                    logger.warning("%s: %s is not in the store's listing (deleted?); pass %d passes over it",
                                   state["source"], self._url(path), state["pass"])
                    _mark_passed_over(state, path, "vanished")
                    done.add(path)
                    continue
                pid, start_time = _proc.this_process()
                token = os.urandom(8).hex()
                claims[path] = {"pid": pid, "start_time": start_time, "host": _proc.this_host(), "time": time.time(),
                                "expiry": _proc.beat_expiry(), "worker": job.worker, "token": token}
                self._write(cache, state, durable=False)
                return _Claim(path, _missing(state, path), token, listing[path])
            if json.dumps(state, sort_keys=True) != unchanged:
                self._write(cache, state, durable=False)
            return None  # the rest of the pass is being fetched by other workers

    def _reconcile(self, state: dict[str, Any], listing: dict[str, str]) -> int:
        """Forget what is known of older versions of the listed shards: held pieces of a
        rewritten shard never steer a resume, and a corrupt one is tried again once it changes.
        Returns the number of rewritten shards found."""
        rewritten = 0
        for path, version in listing.items():
            entry = state["held"].get(path)
            if entry is not None and entry.get("version") not in (None, version):
                logger.warning("%s: %s changed since it was fetched; it is fetched whole again (the cache keeps the "
                               "records of the old version until they are evicted)", state["source"], self._url(path))
                del state["held"][path]
                rewritten += 1
            bad = state["bad"].get(path)
            age = time.time() - bad.get("time", 0) if bad is not None else 0.0
            if bad is not None and (bad["version"] != version or not -_CLOCK_SKEW_S <= age <= _BAD_RETRY_S):
                # Changed, or tried again now and then (a time to come is a planted one): it pins nothing.
                del state["bad"][path]
        return rewritten

    def _pass_over(self, cache: Cache, claim: _Claim, why: str, detail: str = "") -> bool:
        """Pass over the claimed shard in this pass (``vanished``, ``changed`` or ``corrupt``),
        with one warning. Returns ``True``: the claim is settled."""
        url = self._url(claim.path)
        if why == "corrupt":
            logger.warning("%s: %s is corrupt or off the cache's schema (%s); passed over until it changes",
                           self._redact(", ".join(self.urls)), url, detail)
        elif why == "changed":
            logger.warning("%s: %s changed while this pass ran; passed over (the next pass fetches the new version)",
                           self._redact(", ".join(self.urls)), url)
        else:
            logger.warning("%s: %s was deleted before it was fetched; passed over", self._redact(", ".join(self.urls)),
                           url)
        with cache._locked():
            state = self._read(cache)
            if _owns(state, claim):
                del state["claims"][claim.path]
            if why == "corrupt":
                state["bad"][claim.path] = {"version": claim.version, "why": detail[:500], "time": time.time()}
            _mark_passed_over(state, claim.path, why)
            self._write(cache, state)
        return True

    def _check_claim(self, state: dict[str, Any], claim: _Claim, start: int, end: int) -> None:
        """Raise :class:`ClaimLostError` unless ``claim`` still holds (or may be taken back:
        nobody else took it and nothing of ``start:end`` is held). Assumes you hold the lock."""
        if _owns(state, claim):
            return
        entry = state["held"].get(claim.path, {"pieces": []})
        overlap = any(s < end and start < e for _, s, e in entry["pieces"])
        if claim.path not in state["claims"] and claim.path not in state["done"] and not overlap:
            pid, start_time = _proc.this_process()
            state["claims"][claim.path] = {"pid": pid, "start_time": start_time, "host": _proc.this_host(),
                                           "time": time.time(), "expiry": _proc.beat_expiry(), "worker": -1,
                                           "token": claim.token}
            return
        raise ClaimLostError(
            f"the claim on {self._url(claim.path)} in {state['source']} was taken over by another process while this "
            f"one copied it (it stalled for longer than the owner expiry, {_proc.owner_expiry():g} s): the copy is "
            "dropped, so its records are not published twice")

    def _commit(self, cache: Cache, claim: _Claim, start: int, end: int, finish: bool, info: ShardInfo) -> None:
        """Record that ``info`` holds bytes ``start:end`` of the claimed shard; with ``finish``,
        that it ends the stream and the fetch. Called under the lock, just before ``info`` is
        published: a claim lost meanwhile raises :class:`ClaimLostError`, and nothing is published."""
        state = self._read(cache)
        self._check_claim(state, claim, start, end)
        held = state["held"].get(claim.path)
        if held is None or held.get("version") not in (None, claim.version):
            held = state["held"][claim.path] = {"end": None, "pieces": []}
        held["version"] = claim.version
        held["pieces"].append([info.seq, start, end])
        state["claims"][claim.path]["time"] = time.time()
        if finish:
            _mark_fetched(state, claim.path, end)
        self._write(cache, state)

    def _finish(self, cache: Cache, claim: _Claim, end: int) -> None:
        with cache._locked():
            state = self._read(cache)
            held = state["held"].setdefault(claim.path, {"end": None, "pieces": []})
            held["version"] = claim.version
            _mark_fetched(state, claim.path, end)
            self._write(cache, state)

    def _heartbeat(self, cache: Cache, claim: _Claim) -> bool:
        """Refresh the time of ``claim``; ``False`` once it is no longer ours."""
        with cache._locked():
            state = self._read(cache)
            if not _owns(state, claim):
                return False
            state["claims"][claim.path]["time"] = time.time()
            self._write(cache, state, durable=False)
            return True

    def _release(self, cache: Cache, claim: _Claim) -> None:
        """Give a claim back (the fetch stopped or failed); its published pieces stay held."""
        try:
            with cache._locked():
                state = self._read(cache)
                if _owns(state, claim):
                    del state["claims"][claim.path]
                    self._write(cache, state, durable=False)
        except OSError as exc:  # a dead claim is taken over anyway, once its process is gone
            logger.warning("could not release the claim on %s in %s: %s", self._url(claim.path), cache.path, exc)


class ClaimLostError(GrowcacheError, RuntimeError):
    """A shard source's claim on a remote shard was taken over while its copy ran; raised by
    the publish hook, so the copy is never published next to the new owner's."""


class _ClaimKeeper:
    """The heartbeat of one claim: a daemon thread refreshes its time every
    :func:`~growcache._proc.heartbeat_interval` seconds until :meth:`stop`, and sets
    ``lost`` once the claim is no longer ours. A thread, not the copy loop: a copy also
    waits in store retries and for room to publish, and must not lose its claim there."""

    def __init__(self, source: TFRecordShardSource, cache: Cache, claim: _Claim) -> None:
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, cache, claim), daemon=True,
                                        name="growcache-claim-heartbeat")
        self._thread.start()

    def _run(self, source: TFRecordShardSource, cache: Cache, claim: _Claim) -> None:
        while not self._stop.wait(_proc.heartbeat_interval()):
            try:
                if not source._heartbeat(cache, claim):
                    self.lost = True
                    return
            except Exception as exc:  # a missed beat is retried at the next; the expiry allows five
                logger.debug("heartbeat of the claim on %s failed: %s", claim.path, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _owns(state: dict[str, Any], claim: _Claim) -> bool:
    held = state["claims"].get(claim.path)
    return held is not None and held.get("token") == claim.token


def _discard(path: str) -> None:
    discard_temporary(path)


def _refuse_linked_sources(cache: Cache) -> None:
    """growcache writes and deletes in ``sources/``: never through a link to elsewhere (the
    manifest's layout check, run here because a source's state is read and written often)."""
    cache._manifest.check_layout()


def _mark_fetched(state: dict[str, Any], path: str, end: int) -> None:
    """``path`` is fetched in this pass, and its stream ends at ``end``."""
    state["claims"].pop(path, None)
    entry = state["held"].setdefault(path, {"end": None, "pieces": []})
    entry["end"] = end if entry.get("end") is None else max(entry["end"], end)  # a last gap may end early
    if path not in state["done"]:
        state["done"].append(path)
        if state["history"]:
            state["history"][-1]["fetched"].append(path)


def _mark_passed_over(state: dict[str, Any], path: str, why: str) -> None:
    state["skipped"][path] = why
    if path not in state["done"]:
        state["done"].append(path)


@dataclass(frozen=True)
class _Commit:
    """The publish hook of one fetched piece."""

    source: TFRecordShardSource
    cache: Cache
    claim: _Claim
    start: int
    end: int
    finish: bool

    def __call__(self, info: ShardInfo) -> None:
        self.source._commit(self.cache, self.claim, self.start, self.end, self.finish, info)


class _Stopping(Exception):
    """The pool stops while a shard is being copied: the copy is dropped, its claim released."""


class _Until:
    """The frames of a stream from offset ``start`` up to ``stop`` (``None``: its end).

    ``end`` is where the last frame ended: the stream's end once a ``stop=None`` run is over.
    Raises :class:`_Stopping` once ``should_stop()`` says so (checked every 64 frames), so a
    stopping pool does not wait for the rest of a large shard.
    """

    def __init__(self, frames: Iterator[tuple], start: int, stop: int | None,
                 should_stop: Callable[[], bool]) -> None:
        self.frames = frames
        self.stop = stop
        self.end = start
        self.should_stop = should_stop

    def __iter__(self) -> Iterator[tuple]:
        stop = self.stop
        if stop is not None and self.end >= stop:
            return
        for count, frame in enumerate(self.frames):
            offset, _, start, end, _ = frame
            if stop is not None and offset >= stop:  # a stop inside a record (a tampered state)
                return
            if not count % 64 and self.should_stop():
                raise _Stopping
            self.end = offset + end - start
            yield frame
            # Ends here, before the next frame is asked for: reading it would cost a request past
            # the gap, and a damaged record there would pass the good gap over as corrupt.
            if stop is not None and self.end >= stop:
                return


def _in_flight(job: FetchJob) -> tuple[int, int]:
    """``(requests, bytes)`` a fetch keeps in flight at most: the job's, else the pool's defaults."""
    concurrency = DEFAULT_CONCURRENCY if job.concurrency is None else max(1, int(job.concurrency))
    max_bytes = DEFAULT_MAX_BYTES_IN_FLIGHT if job.max_bytes_in_flight is None else max(1, int(job.max_bytes_in_flight))
    return concurrency, max_bytes


class _Parts:
    """Bytes ``start:end`` of a remote shard, in order, fetched as ranged parts with many in flight.

    One request per part of ``part`` bytes, each under the source's retry policy on its own
    (:meth:`~growcache.store.StoreSource._afetch` on an async filesystem, in fsspec's event
    loop; :meth:`~growcache.store.StoreSource._fetch` in threads on a sync one): a part that
    fails transiently is retried alone, the others go on. Parts are handed on in stream
    order whatever order they arrive in. Bounds:

    * requests in flight: ``concurrency``, less while the store throttles (a
      :class:`~growcache._concurrent.Flow`: halved on 429/503, grown back as answers come);
    * bytes of parts in flight or fetched and not yet handed on: ``max_bytes`` (one part
      larger than that still goes, alone), whatever the shard's size.

    The whole window is asked for at once (no slow start): a fetch reads the shard to its end,
    and each round trip of a slow start would cost a 100 MB shard a tenth of its time at 50 ms.

    A part shorter than asked means the object shrank under the reader: a :class:`SourceError`
    naming the URL and offset (the fetch then finds the new version and passes the shard
    over). Waiting for a part, ``should_stop()`` is asked every 0.2 s; once it says so,
    :class:`_Stopping` is raised and the parts in flight are cancelled, not waited for.
    """

    def __init__(self, source: TFRecordShardSource, path: str, start: int, end: int, *, part: int, concurrency: int,
                 max_bytes: int, should_stop: Callable[[], bool], flow: Flow | None = None) -> None:
        self.source, self.path, self.start, self.end = source, path, start, end
        self.part = max(1, part)
        self.should_stop = should_stop
        self.flow = Flow(concurrency, max_bytes) if flow is None else flow
        self._ticket = Ticket(self.flow)  # routes each request's timing and throttling to this flow
        fs = source.fs
        self._loop = fs.loop if getattr(fs, "async_impl", False) else None
        self._threads = None if self._loop is not None else DaemonThreads(concurrency, "growcache-part")
        self._pending: collections.deque[tuple[int, int, concurrent.futures.Future[bytes]]] = collections.deque()
        self._claimed = 0  # bytes taken from the flow's budget and not given back

    def __iter__(self) -> Iterator[bytes]:
        flow, position = self.flow, self.start
        try:
            while self._pending or position < self.end:
                while position < self.end and len(self._pending) < flow.allowed():
                    stop = min(position + self.part, self.end)
                    if not flow._fits(stop - position):
                        break
                    flow.acquire(stop - position)  # it fits: never waits
                    self._claimed += stop - position
                    self._pending.append((position, stop, self._submit(position, stop)))
                    position = stop
                begin, stop, future = self._pending[0]
                data = self._wait(future)
                self._pending.popleft()
                if len(data) != stop - begin:
                    raise SourceError(
                        f"{self.source._url(self.path)} gave {len(data)} bytes for bytes {begin}-{stop}: it was "
                        "replaced or truncated while it was read")
                yield data
                flow.release(stop - begin)  # the reader has taken the part on
                self._claimed -= stop - begin
        finally:
            self.close()

    def _submit(self, begin: int, stop: int) -> concurrent.futures.Future[bytes]:
        if self._loop is not None:
            return asyncio.run_coroutine_threadsafe(self._afetch(begin, stop), self._loop)
        assert self._threads is not None
        return self._threads.submit(self._fetch, begin, stop)

    async def _afetch(self, begin: int, stop: int) -> bytes:
        _TICKET.set(self._ticket)  # this task's own context
        return await self.source._afetch(self.path, begin, stop)

    def _fetch(self, begin: int, stop: int) -> bytes:
        _TICKET.set(self._ticket)
        try:
            return self.source._fetch(self.path, begin, stop)
        finally:
            _TICKET.set(None)

    def _wait(self, future: concurrent.futures.Future[bytes]) -> bytes:
        while not concurrent.futures.wait([future], timeout=0.2).done:
            if self.should_stop():
                raise _Stopping
        return future.result()

    def close(self) -> None:
        """Cancel the parts in flight (never waits for them); idempotent."""
        pending, self._pending = self._pending, collections.deque()
        for _, _, future in pending:
            future.cancel()
        if self._threads is not None:
            self._threads.shutdown()  # the parts not started were cancelled above
        if self._claimed:  # parts cancelled or left unread: the job's next read (same flow) has the budget
            self.flow.release(self._claimed)
            self._claimed = 0
        self.source.peak_bytes_in_flight = max(self.source.peak_bytes_in_flight, self.flow.peak_bytes)


# -- checking the state ----------------------------------------------------------------------------
def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _strings(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, str) for v in values)


def _held_entry_ok(entry: Any) -> bool:
    return (isinstance(entry, dict) and (entry.get("end") is None or _is_int(entry.get("end")))
            and isinstance(entry.get("version", ""), str) and isinstance(entry.get("pieces"), list)
            and all(isinstance(p, list) and len(p) == 3 and all(_is_int(v) for v in p) and p[1] <= p[2]
                    for p in entry["pieces"]))


def _damage(state: dict[str, Any]) -> str | None:
    """What is wrong with a state file's content, or ``None``: every value is checked before use.

    Claims are checked one by one apart (:func:`_claim_damage`): a damaged claim is dropped
    as expired, and the rest of the state stays.
    """
    def mapping(name: str, check: Callable[[Any], bool]) -> bool:
        value = state.get(name, {})
        return isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())

    checks = [
        (_is_int(state.get("pass", 0)), "pass"),
        (_is_number(state.get("started", 0)), "started"),
        (_is_int(state.get("known", 0)), "known"),
        (_is_int(state.get("rewritten", 0)), "rewritten"),
        (_strings(state.get("order", [])), "order"),
        (_strings(state.get("done", [])), "done"),
        (mapping("claims", lambda c: isinstance(c, dict)), "claims"),
        (mapping("held", _held_entry_ok), "held"),
        (mapping("skipped", lambda why: why in ("vanished", "changed", "corrupt")), "skipped"),
        (mapping("bad", lambda b: isinstance(b, dict) and isinstance(b.get("version"), str)
                 and isinstance(b.get("why", ""), str) and _is_number(b.get("time", 0))), "bad"),
        (isinstance(state.get("history", []), list) and all(
            isinstance(h, dict) and _strings(h.get("fetched")) and _is_int(h.get("total", 0))
            and _is_int(h.get("pass", 0)) and _is_number(h.get("started", 0)) for h in state.get("history", [])),
         "history"),
    ]
    bad = [name for ok, name in checks if not ok]
    return f"bad {', '.join(bad)}" if bad else None


def _claim_damage(claim: dict[str, Any]) -> str | None:
    """What is wrong with one claim, or ``None``."""
    if not _is_int(claim.get("pid"), 1):
        return f"pid {claim.get('pid')!r}"
    if claim.get("start_time") is not None and not _is_int(claim.get("start_time")):
        return f"start_time {claim.get('start_time')!r}"
    if claim.get("host") is not None and not isinstance(claim.get("host"), str):
        return f"host {claim.get('host')!r}"
    if "expiry" in claim and _proc.stored_expiry(claim["expiry"]) is None:
        return f"expiry {claim['expiry']!r}"
    moment = claim.get("time")
    if not _is_number(moment) or moment > time.time() + _claim_expiry(claim):  # a time to come pins it too
        return f"time {moment!r}"
    if not isinstance(claim.get("token", ""), str) or not isinstance(claim.get("worker", 0), int):
        return "token or worker"
    return None


def _claim_expiry(claim: dict[str, Any]) -> float:
    """The owner expiry a claim's owner beats for, as it stored it: one job's setting never
    judges another job's claims (a claim of older growcache, with none, gets this process's)."""
    return _proc.stored_expiry(claim.get("expiry")) or _proc.owner_expiry()


def _prune(state: dict[str, Any], live: set[int]) -> None:
    """Forget held pieces whose shard was evicted, and claims whose owner is gone: its process
    ended, or its heartbeat is older than the expiry it stored (wherever it runs)."""
    for path in list(state["held"]):
        entry = state["held"][path]
        entry["pieces"] = [p for p in entry["pieces"] if p[0] in live]
        if not entry["pieces"] and entry.get("end") != 0:
            del state["held"][path]
    now = time.time()
    for path, claim in list(state["claims"].items()):
        expiry = _claim_expiry(claim)
        stale = now - claim["time"] > expiry
        if stale or not _proc.is_alive(claim["pid"], claim.get("start_time"), claim.get("host"), claim["time"],
                                       expiry):
            logger.info("%s: the fetch of %s by pid %s ended without finishing%s; it is fetched again (only its "
                        "missing pieces)", state["source"], path, claim["pid"],
                        " (no heartbeat for longer than the owner expiry)" if stale else "")
            del state["claims"][path]


def _holds(state: dict[str, Any], path: str) -> bool:
    entry = state["held"].get(path)
    if entry is None or entry.get("end") is None:
        return False
    return not any(True for _ in _gaps(entry))


def _gaps(entry: dict[str, Any]) -> Iterator[tuple[int, int | None]]:
    """Byte ranges of a remote shard that no held piece covers."""
    position = 0
    for _, start, end in sorted(entry["pieces"], key=lambda p: p[1]):
        if start > position:
            yield position, start
        position = max(position, end)
    if entry.get("end") is None:
        yield position, None
    elif position < entry["end"]:
        yield position, entry["end"]


def _missing(state: dict[str, Any], path: str) -> tuple[tuple[int, int | None], ...]:
    entry = state["held"].get(path)
    return ((0, None),) if entry is None else tuple(_gaps(entry))


def pass_progress(cache: Cache) -> list[PassProgress]:
    """Where each shard source that filled ``cache`` stands: its pass, shards fetched and passed over in it."""
    live = {s.seq for s in cache.list_shards()}
    out = []
    for state in cache._manifest.source_states():
        if _damage(state) is not None:
            continue  # a damaged state file: status shows the rest
        order, done = state.get("order", []), set(state.get("done", []))
        held, skipped = state.get("held", {}), state.get("skipped", {})
        whole = 0
        for entry in held.values():
            pieces = [p for p in entry["pieces"] if p[0] in live]
            if entry.get("end") is not None and not any(True for _ in _gaps({"pieces": pieces, "end": entry["end"]})):
                whole += 1
        why = list(skipped.values())
        out.append(PassProgress(
            source=str(state.get("source", "?")), pass_number=state.get("pass", 0),
            fetched=sum(1 for p in order if p in done and p not in skipped), total=len(order),
            in_flight=sum(1 for c in state.get("claims", {}).values() if _claim_damage(c) is None),
            held=whole, known=state.get("known", len(set(order) | set(held))),
            vanished=why.count("vanished"), changed=why.count("changed") + state.get("rewritten", 0),
            corrupt=len(state.get("bad", {})),
        ))
    return out
