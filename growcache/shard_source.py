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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _proc
from .errors import CacheFormatError, SchemaError
from .example import ExampleCodec, RecordChecker
from .importer import CHUNK_BYTES, TFRecordFiles, _infer, copy_records, iter_frames
from ._retry import RetryPolicy

if TYPE_CHECKING:
    from .cache import Cache
    from .schema import Schema
    from .shard import ShardInfo

__all__ = ["FetchJob", "FetchedShard", "PassProgress", "ShardSource", "TFRecordShardSource", "pass_progress"]

logger = logging.getLogger(__name__)

_HISTORY = 16  # passes whose fetches the state file keeps


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
    """

    cache: Cache
    seed: int
    worker: int
    should_stop: Callable[[], bool]
    max_bytes: int | None = None
    progress: Callable[[int], None] | None = None


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
    """

    source: str
    pass_number: int
    fetched: int
    total: int
    in_flight: int
    held: int
    known: int


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
        chunk_bytes: bytes per read request. Default: 8 MiB.
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

    def _repr_extra(self) -> str:
        return f", max_shard_records={self.max_shard_records}, max_shard_bytes={self.max_shard_bytes}"

    def probe(self, schema: Schema | None = None, *, records: int = 16) -> Schema:
        """Read the first records of the first shard, before any worker starts.

        A glob that matches nothing, a store that cannot be reached, files that are not
        TFRecord files and records of another schema are then one error, at once.

        Args:
            schema: the schema the records must follow (the cache's). ``None``: infer it
                (see :func:`~growcache.importer.infer_schema`).
            records: records to read. Default: ``16``.

        Returns:
            ``schema``, or the inferred one.

        Raises:
            SourceError: the store failed, or the glob matches nothing.
            CorruptShardError: the first shard is not a TFRecord file, or is damaged there.
            SchemaError: its records do not follow ``schema``, or hold no fixed-shape schema.
        """
        path = self.paths()[0]
        if schema is None:
            return _infer(self, path, records)
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
        worker, or when the cache holds the whole dataset.

        Raises:
            SchemaError: a record does not follow the cache's schema (the remote file and offset).
            CorruptShardError: a CRC mismatch or truncation in the remote file.
            SourceError: the store failed (after retries for transient errors).
        """
        cache = job.cache
        if cache.schema is None:
            raise SchemaError(f"cache {cache.path} has no schema: give it the dataset's schema "
                              "(growcache schema URL prints it)")
        claim = self._claim(job)
        if claim is None:
            return
        url = self._url(claim.path)
        limits = [x for x in (self.max_shard_bytes, job.max_bytes) if x is not None]
        codec = ExampleCodec(cache.schema)
        done = False
        try:
            end = None
            for start, stop in claim.segments:
                chunks, _ = self.stream(claim.path, start)
                frames = _Until(iter_frames(chunks, url, start), start, stop, job.should_stop)
                pieces = copy_records(frames, cache, RecordChecker(codec, url), max_records=self.max_shard_records,
                                      max_bytes=min(limits) if limits else None, start=start, progress=job.progress)
                last_segment = (start, stop) == claim.segments[-1]
                with contextlib.closing(pieces):
                    for piece in pieces:
                        # The last piece's commit also ends the fetch: one state write, not two.
                        finish = last_segment and piece.last
                        commit = _Commit(self, cache, claim.path, piece.start, piece.end, finish)
                        yield FetchedShard(piece.path, piece.records, piece.nbytes, commit)
                        if finish:
                            done = True
                        elif job.should_stop():
                            return
                end = frames.end
            if not done:  # no records in the last segment (an empty file): end the fetch here
                self._finish(cache, claim.path, end)
                done = True
            logger.debug("fetched %s", url)
        except _Stopping:
            logger.debug("stopped fetching %s", url)
        finally:
            if not done:
                self._release(cache, claim.path)

    # -- the state file ----------------------------------------------------------------------
    def _read(self, cache: Cache) -> dict[str, Any]:
        """This source's state in ``cache``. Assumes you hold the lock."""
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
        state["source"] = self._redact(", ".join(self.urls))
        return state

    def _write(self, cache: Cache, state: dict[str, Any], *, durable: bool = True) -> None:
        """Assumes you hold the lock. Claims need no fsync (they die with their processes);
        what the cache holds does."""
        cache._manifest.write_source_state(self.key, state, durable=durable)

    def _claim(self, job: FetchJob) -> _Claim | None:
        cache = job.cache
        paths = self.paths()
        with cache._locked():
            state = self._read(cache)
            unchanged = json.dumps(state, sort_keys=True)  # workers poll: write only what changes
            state["known"] = len(paths)
            _prune(state, {s.seq for s in cache.list_shards()})
            done = set(state["done"])
            if all(p in done for p in state["order"]):
                # A pass ends when every shard of it has been fetched once; the next one
                # takes the shards the cache no longer holds, in a new order.
                todo = sorted(p for p in paths if not _holds(state, p))
                if not todo:
                    if json.dumps(state, sort_keys=True) != unchanged:
                        self._write(cache, state, durable=False)
                    return None
                number = state["pass"] + 1
                rng = np.random.default_rng(np.random.SeedSequence(job.seed, spawn_key=(number,)))
                state.update({"pass": number, "order": [todo[i] for i in rng.permutation(len(todo))], "done": [],
                              "started": time.time()})
                state["history"] = (state["history"] + [{"pass": number, "total": len(todo), "started": time.time(),
                                                         "fetched": []}])[-_HISTORY:]
                done = set()
                logger.info("%s: pass %d fetches %d of %d shards", state["source"], number, len(todo), len(paths))
            claims = state["claims"]
            for path in state["order"]:
                if path in done or path in claims:
                    continue
                pid, start_time = _proc.this_process()
                claims[path] = {"pid": pid, "start_time": start_time, "host": _proc.this_host(), "time": time.time(),
                                "worker": job.worker}
                self._write(cache, state, durable=False)
                return _Claim(path, _missing(state, path))
            if json.dumps(state, sort_keys=True) != unchanged:
                self._write(cache, state, durable=False)
            return None  # the rest of the pass is being fetched by other workers

    def _commit(self, cache: Cache, path: str, start: int, end: int, finish: bool, info: ShardInfo) -> None:
        """Record that ``info`` holds bytes ``start:end`` of ``path``; with ``finish``, that it
        ends the stream and the fetch. Called under the lock."""
        state = self._read(cache)
        held = state["held"].setdefault(path, {"end": None, "pieces": []})
        held["pieces"].append([info.seq, start, end])
        claim = state["claims"].get(path)
        if claim is not None:
            claim["time"] = time.time()
        if finish:
            _mark_fetched(state, path, end)
        self._write(cache, state)

    def _finish(self, cache: Cache, path: str, end: int) -> None:
        with cache._locked():
            state = self._read(cache)
            _mark_fetched(state, path, end)
            self._write(cache, state)

    def _release(self, cache: Cache, path: str) -> None:
        """Give a claim back (the fetch stopped or failed); its published pieces stay held."""
        try:
            with cache._locked():
                state = self._read(cache)
                state["claims"].pop(path, None)
                self._write(cache, state, durable=False)
        except OSError as exc:  # a dead claim is taken over anyway, once its process is gone
            logger.warning("could not release the claim on %s in %s: %s", self._url(path), cache.path, exc)


def _mark_fetched(state: dict[str, Any], path: str, end: int) -> None:
    """``path`` is fetched in this pass, and its stream ends at ``end``."""
    state["claims"].pop(path, None)
    entry = state["held"].setdefault(path, {"end": None, "pieces": []})
    entry["end"] = end if entry.get("end") is None else max(entry["end"], end)  # a last gap may end early
    if path not in state["done"]:
        state["done"].append(path)
        if state["history"]:
            state["history"][-1]["fetched"].append(path)


@dataclass(frozen=True)
class _Commit:
    """The publish hook of one fetched piece."""

    source: TFRecordShardSource
    cache: Cache
    path: str
    start: int
    end: int
    finish: bool

    def __call__(self, info: ShardInfo) -> None:
        self.source._commit(self.cache, self.path, self.start, self.end, self.finish, info)


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
        for count, frame in enumerate(self.frames):
            offset, _, start, end, _ = frame
            if self.stop is not None and offset >= self.stop:
                return
            if not count % 64 and self.should_stop():
                raise _Stopping
            self.end = offset + end - start
            yield frame


def _damage(state: dict[str, Any]) -> str | None:
    """What is wrong with a state file's content, or ``None``: every value is checked before use."""
    def ints(values: Any, count: int) -> bool:
        return isinstance(values, list) and len(values) == count and all(
            isinstance(v, int) and not isinstance(v, bool) for v in values)

    def strings(values: Any) -> bool:
        return isinstance(values, list) and all(isinstance(v, str) for v in values)

    checks = [
        (isinstance(state.get("pass", 0), int), "pass"),
        (strings(state.get("order", [])), "order"),
        (strings(state.get("done", [])), "done"),
        (isinstance(state.get("claims", {}), dict) and all(isinstance(c, dict) for c in state.get("claims", {}).values()),
         "claims"),
        (isinstance(state.get("held", {}), dict) and all(
            isinstance(e, dict) and (e.get("end") is None or isinstance(e.get("end"), int))
            and isinstance(e.get("pieces"), list) and all(ints(p, 3) for p in e["pieces"])
            for e in state.get("held", {}).values()), "held"),
        (isinstance(state.get("history", []), list) and all(
            isinstance(h, dict) and strings(h.get("fetched", [])) for h in state.get("history", [])), "history"),
    ]
    bad = [name for ok, name in checks if not ok]
    return f"bad {', '.join(bad)}" if bad else None


def _prune(state: dict[str, Any], live: set[int]) -> None:
    """Forget held pieces whose shard was evicted, and claims whose process is gone."""
    for path in list(state["held"]):
        entry = state["held"][path]
        entry["pieces"] = [p for p in entry["pieces"] if p[0] in live]
        if not entry["pieces"] and entry.get("end") != 0:
            del state["held"][path]
    for path, claim in list(state["claims"].items()):
        if not _proc.is_alive(claim.get("pid", 0), claim.get("start_time"), claim.get("host"), claim.get("time")):
            logger.info("%s: the fetch of %s by pid %s ended without finishing; it is fetched again (only its "
                        "missing pieces)", state["source"], path, claim.get("pid"))
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
    """Where each shard source that filled ``cache`` stands: its pass, and shards fetched in it."""
    live = {s.seq for s in cache.list_shards()}
    out = []
    for state in cache._manifest.source_states():
        if _damage(state) is not None:
            continue  # a damaged state file: status shows the rest
        try:
            order, done = state.get("order", []), set(state.get("done", []))
            held = state.get("held", {})
            whole = 0
            for path, entry in held.items():
                pieces = [p for p in entry.get("pieces", []) if p[0] in live]
                if entry.get("end") is not None and not any(True for _ in _gaps({"pieces": pieces, "end": entry["end"]})):
                    whole += 1
            out.append(PassProgress(
                source=str(state.get("source", "?")), pass_number=int(state.get("pass", 0)),
                fetched=sum(1 for p in order if p in done), total=len(order),
                in_flight=len(state.get("claims", {})), held=whole,
                known=int(state.get("known", len(set(order) | set(held)))),
            ))
        except (TypeError, ValueError, AttributeError, IndexError):
            continue  # a damaged state file: status shows the rest
    return out
