"""Cache: a directory of immutable TFRecord shards with a byte budget, leases and eviction."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from filelock import FileLock

from ._size import parse_size
from .errors import CacheFullError, CorruptShardError, SchemaError, SchemaMismatchError
from .eviction import EvictionPolicy, choose_evictions_fifo
from .example import ExampleCodec
from .manifest import FORMAT_VERSION, Manifest, _listdir, _unlink_quiet, fsync_dir
from .records import iter_records
from .schema import Schema
from .shard import TMP_PREFIX, ShardInfo
from .snapshot import Snapshot
from .writer import ShardWriter, raise_if_disk_full, remove_abandoned_temporaries, temp_shard_name

__all__ = ["Cache", "CacheStats", "VerifyReport"]

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = "500GB"
_WAIT_MIN, _WAIT_MAX = 0.02, 0.5


@dataclass(frozen=True)
class CacheStats:
    """Figures of a cache at one moment (see :meth:`Cache.stats`)."""

    path: str
    capacity: int
    shards: int
    bytes: int
    records: int
    published: int
    published_bytes: int
    evicted: int
    evicted_bytes: int
    leases: int
    leased_shards: int
    leased_bytes: int
    temporaries: int
    oldest_publish_time: float | None
    newest_publish_time: float | None

    @property
    def budget_use(self) -> float:
        """Fraction of the capacity taken by published shards."""
        return self.bytes / self.capacity


@dataclass
class VerifyReport:
    """Outcome of :meth:`Cache.verify`.

    Attributes:
        shards: shards checked.
        records: records checked.
        corrupt: one :class:`CorruptShardError` per bad shard (file, offset, reason).
        foreign: files in the shard directory that growcache did not write.
        removed: corrupt shards deleted (with ``remove_corrupt=True``).
    """

    shards: int = 0
    records: int = 0
    corrupt: list[CorruptShardError] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every shard verified."""
        return not self.corrupt


class Cache:
    """A local cache directory of immutable TFRecord shards with a byte budget.

    Several processes may open the same cache at once: writers publish, trainers take
    snapshots, and eviction runs, all coordinated by one file lock around state changes.
    Listing the shards takes no lock.

    Args:
        path: the cache directory; created if missing.
        capacity: the byte budget, as an int or a string like ``"500GB"`` or ``"64MiB"``.
            Default: the capacity stored in the cache, or ``"500GB"`` for a new cache.
            Giving one stores it: every process using the cache, running samplers
            included, enforces it from its next publish, snapshot or eviction on.
        schema: the features of every record (a :class:`Schema` or a mapping for one).
            Default: the schema stored in the cache. Required to write.
        eviction_policy: chooses shards to delete; see :mod:`growcache.eviction`.
            Default: oldest unleased first (FIFO).
        mode: permission bits of directories it creates; files get the same bits without
            execute. Default: ``0o700`` (owner only).

    Raises:
        SchemaMismatchError: ``schema`` differs from the stored one.
        CacheFormatError: the directory holds metadata of a newer format, or damaged metadata.
        NotADirectoryError: ``path`` is a file.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        capacity: int | str | None = None,
        schema: Schema | Mapping[str, Any] | None = None,
        *,
        eviction_policy: EvictionPolicy = choose_evictions_fifo,
        mode: int = 0o700,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(
                f"cache path {self.path} is a file, not a directory: pass a directory path to Cache()"
            )
        self.dir_mode = mode
        self.file_mode = mode & 0o666
        self.eviction_policy = eviction_policy
        self._manifest = Manifest(self.path, self.file_mode)
        for directory in (self.path, self._manifest.shards_dir, self._manifest.leases_dir):
            os.makedirs(directory, mode=mode, exist_ok=True)
        self._lock: FileLock | None = None
        requested_schema = Schema(schema) if schema is not None else None
        requested_capacity = parse_size(capacity, name="capacity") if capacity is not None else None
        with self._locked():
            metadata = self._manifest.read_metadata()
            if metadata is None:
                metadata = {"format_version": FORMAT_VERSION, "created": time.time(), "schema": None,
                            "capacity": parse_size(DEFAULT_CAPACITY)}
            stored_schema = Schema.from_dict(metadata["schema"]) if metadata.get("schema") else None
            if requested_schema is not None and stored_schema is not None and requested_schema != stored_schema:
                raise SchemaMismatchError(
                    f"cache {self.path} holds records of schema {stored_schema!r}, but {requested_schema!r} was "
                    "given. Open it without schema= to use the stored one, or use another cache directory."
                )
            new = dict(metadata)
            if requested_schema is not None:
                new["schema"] = requested_schema.to_dict()
            if requested_capacity is not None:
                new["capacity"] = requested_capacity
            if new != metadata or not os.path.exists(self._manifest.metadata_path):
                self._manifest.write_metadata(new)
            self.schema: Schema | None = requested_schema or stored_schema
            self.capacity: int = int(new["capacity"])
            self._remove_stale()

    # -- pickling: the lock is created lazily in each process ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __repr__(self) -> str:
        return f"Cache({self.path!r}, capacity={self.capacity}, schema={self.schema!r})"

    def _locked(self) -> FileLock:
        if self._lock is None:
            self._lock = FileLock(self._manifest.lock_path, mode=self.file_mode)
        return self._lock

    @property
    def shards_dir(self) -> str:
        """Directory holding the shard files."""
        return self._manifest.shards_dir

    # -- listing ----------------------------------------------------------------------------
    def list_shards(self) -> list[ShardInfo]:
        """The published shards, oldest first. Takes no lock and never lists a temporary."""
        shards = []
        for name in _listdir(self.shards_dir):
            info = ShardInfo.from_path(os.path.join(self.shards_dir, name))
            if info is not None:
                shards.append(info)
        shards.sort()
        return shards

    def snapshot(self, *, holder: str = "") -> Snapshot:
        """The shards that exist now, leased so eviction keeps them until the snapshot closes.

        A snapshot holds at most the capacity: older shards that only another live snapshot
        keeps on disk (beyond what the budget allows) are left out, so they go when it ends.

        Args:
            holder: a label stored in the lease, shown by ``growcache status``. Default: ``""``.
        """
        # Listing and leasing happen under the lock: an eviction between them could
        # delete a listed shard before the lease protects it. Shards published while the
        # previous epoch held its lease are trimmed to the budget first, so a snapshot
        # never holds more than the capacity (unless other live snapshots pin more).
        with self._locked():
            self._trim_to_budget()
            shards = self.list_shards()
            # Shards the budget would evict but for another snapshot's lease stay out of this
            # one. Readers whose epochs overlap (two frameworks, DDP ranks) would otherwise
            # re-lease each other's oldest shards forever, and the cache would never shrink.
            beyond = self.eviction_policy(shards, (), self.capacity, 0, time.time())
            if beyond:
                dropped = {s.seq for s in beyond}
                shards = [s for s in shards if s.seq not in dropped]
            try:
                lease = self._manifest.write_lease([s.seq for s in shards], holder) if shards else None
            except OSError as exc:
                raise_if_disk_full(exc, self.path, "writing a snapshot's lease; no shard was leased")
                raise
        return Snapshot(shards, lease, on_close=self._trim_after_lease)

    def _trim_after_lease(self) -> None:
        """A lease just ended: shards it kept beyond the budget go now, not at the next publish.

        Without this, a cache whose samplers have finished stays over its budget after the
        last epoch until something publishes or snapshots again.
        """
        try:
            with self._locked():
                self._trim_to_budget()
        except OSError as exc:  # ending an epoch must not fail on a full disk or a lock problem
            logger.warning("could not trim cache %s to its budget after a snapshot closed (%s); "
                           "the next publish or snapshot will", self.path, exc)

    # -- writing ----------------------------------------------------------------------------
    def writer(self, **kwargs: Any) -> ShardWriter:
        """A :class:`ShardWriter` that publishes one new shard into this cache on close.

        Keyword arguments go to :class:`ShardWriter` (``publish_timeout``, ``should_stop``,
        ``durable``).
        """
        if self.schema is None:
            raise SchemaError(
                f"cache {self.path} has no schema, so records cannot be written: open it with "
                "Cache(path, schema=Schema({...}))"
            )
        return ShardWriter(self, **kwargs)

    def add_shard(self, path: str | os.PathLike, *, move: bool = False) -> ShardInfo:
        """Add a TFRecord file written elsewhere (e.g. by ``tf.io.TFRecordWriter``).

        The file is copied (or moved, if on the same filesystem) to a temporary name,
        every record is checked against the CRCs and the schema, and it is published
        like any other shard.

        Args:
            path: the TFRecord file; each record a ``tf.train.Example`` with one raw
                bytes feature per schema feature.
            move: move instead of copy (the file is removed once it is published; a file that
                is refused stays where it was). Default: ``False``.

        Raises:
            CorruptShardError: a CRC mismatch or truncation (file, offset).
            SchemaError: a record does not follow the cache's schema.
            CacheFullError: the file is larger than the whole capacity.
        """
        if self.schema is None:
            raise SchemaError(f"cache {self.path} has no schema: open it with Cache(path, schema=...) to add shards")
        source = os.fspath(path)
        size = os.path.getsize(source)
        if size > self.capacity:
            raise CacheFullError(
                f"{source} has {size} bytes, more than the whole capacity of cache {self.path} ({self.capacity} "
                "bytes). Raise the capacity, or split the file into smaller shards."
            )
        tmp = os.path.join(self.shards_dir, temp_shard_name(os.urandom(6).hex()))
        moved = False
        try:
            if move:
                try:
                    os.replace(source, tmp)
                    moved = True
                except OSError:  # another filesystem: copy now, remove the source once published
                    shutil.copyfile(source, tmp)
            else:
                shutil.copyfile(source, tmp)
            os.chmod(tmp, self.file_mode)
            codec = ExampleCodec(self.schema)
            records = 0
            for offset, record in iter_records(tmp, verify=True):
                try:
                    codec.payload_views(record)
                except (SchemaError, ValueError) as exc:
                    raise SchemaError(f"{source} at byte offset {offset}: {exc}") from exc
                records += 1
            if records == 0:
                raise CorruptShardError(source, 0, "the file holds no records")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            info = self._publish(tmp, records, size)
        except CorruptShardError as exc:
            _give_back(tmp, source if moved else None)
            raise CorruptShardError(source, exc.offset, exc.reason) from None
        except BaseException:
            _give_back(tmp, source if moved else None)
            raise
        if move and not moved:
            _unlink_quiet(source)
        return info

    def _publish(
        self,
        tmp_path: str,
        records: int,
        nbytes: int,
        *,
        timeout: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> ShardInfo:
        """Make room within the budget, then rename ``tmp_path`` to its published name."""
        if nbytes > self.capacity:
            raise CacheFullError(
                f"shard {tmp_path} has {nbytes} bytes, more than the cache's whole capacity of {self.capacity} "
                "bytes. Raise the capacity or write smaller shards."
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = _WAIT_MIN
        warned = False
        while True:
            with self._locked():
                shards = self.list_shards()
                victims = self._choose_victims(incoming=nbytes, shards=shards)
                if victims is not None:
                    try:
                        self._delete(victims)
                        state = self._manifest.read_state()
                        # Never behind the listing: with a lost or restored state file, a stale
                        # counter would make os.replace overwrite a published, maybe leased, shard.
                        newest = max((s.seq for s in shards), default=0)
                        seq = max(state["next_seq"], newest + 1)
                        info = ShardInfo(seq, os.path.join(self.shards_dir, ShardInfo.file_name(seq, records, nbytes)),
                                         records, nbytes)
                        # The counters go first: if they cannot be written (a full disk), nothing is
                        # published, and a sequence number is never handed out twice (a second shard
                        # of the same size would replace a published one).
                        state["next_seq"] = seq + 1
                        state["published"] += 1
                        state["published_bytes"] += nbytes
                        self._manifest.write_state(state)
                    except OSError as exc:
                        raise_if_disk_full(exc, self.path, f"publishing {tmp_path}; nothing was published")
                        raise
                    try:
                        os.replace(tmp_path, info.path)
                    except OSError:
                        # The sequence number stays spent; only the counts of what exists are undone.
                        state["published"] -= 1
                        state["published_bytes"] -= nbytes
                        with contextlib.suppress(OSError):
                            self._manifest.write_state(state)
                        raise
                    fsync_dir(self.shards_dir)
                    logger.debug("published %s (%d records, %d bytes)", info.path, records, nbytes)
                    return info
            # Every shard that could go is leased: the writer waits, the trainer never does.
            if not warned:
                logger.info("cache %s is full of leased shards; writer waits for a lease to end", self.path)
                warned = True
            if should_stop is not None and should_stop():
                raise CacheFullError(f"writer stopped while waiting for room in cache {self.path}")
            if deadline is not None and time.monotonic() >= deadline:
                raise CacheFullError(
                    f"no room for a {nbytes}-byte shard in cache {self.path} after {timeout} s: leased shards fill "
                    "the budget. Close finished snapshots (end epochs) sooner, or raise the capacity."
                )
            time.sleep(wait)
            wait = min(wait * 2, _WAIT_MAX)

    # -- eviction ---------------------------------------------------------------------------
    def evict(self, to: int | str | None = None) -> list[ShardInfo]:
        """Delete the oldest unleased shards until published bytes fit ``to``.

        Args:
            to: target size; default the capacity. Leased shards are never deleted, so the
                target may stay out of reach until their leases end.

        Returns:
            The deleted shards.
        """
        with self._locked():
            return self._evict(to)

    def _evict(self, to: int | str | None = None) -> list[ShardInfo]:
        """Like :meth:`evict`. Assumes you hold the lock."""
        self._refresh_capacity()
        target = self.capacity if to is None else parse_size(to, name="to") if to != 0 else 0
        shards = self.list_shards()
        leased = self._leased_seqs()
        victims = self.eviction_policy(shards, leased, target, 0, time.time())
        if victims is None:  # cannot reach the target: take everything unleased
            victims = [s for s in shards if s.seq not in leased]
        self._delete(victims)
        return victims

    def _choose_victims(self, incoming: int, shards: list[ShardInfo] | None = None) -> list[ShardInfo] | None:
        """Shards to delete so ``incoming`` bytes fit, out of ``shards`` (default: a fresh
        listing). Assumes you hold the lock.

        The budget applies to unleased shards: leased ones may push the directory over the
        capacity by their own size until their epoch ends. This keeps writers from stalling
        for a whole epoch once the cache is full (the trainer leases everything at each
        epoch start), and bounds the disk at capacity + leased bytes.
        """
        self._refresh_capacity()
        shards = self.list_shards() if shards is None else shards
        leased = self._leased_seqs()
        leased_bytes = sum(s.nbytes for s in shards if s.seq in leased)
        return self.eviction_policy(shards, leased, self.capacity + leased_bytes, incoming, time.time())

    def _trim_to_budget(self) -> None:
        """Delete what the budget lets go now, with nothing incoming. Assumes you hold the lock."""
        self._delete(self._choose_victims(incoming=0) or [])

    def _next_sampler_run(self) -> int:
        """Count one more sampler pool started on this cache; return how many started before."""
        with self._locked():
            state = self._manifest.read_state()
            run = int(state.get("sampler_runs", 0))
            state["sampler_runs"] = run + 1
            self._manifest.write_state(state)
        return run

    def _refresh_capacity(self) -> None:
        """Take up a capacity stored since this process opened the cache.

        ``Cache(path, capacity=...)`` in any process changes the budget of every process
        using the cache (running samplers included) from their next publish, snapshot or
        eviction on; otherwise each would keep enforcing the budget it opened with.
        """
        metadata = self._manifest.read_metadata()
        if metadata is not None and isinstance(metadata.get("capacity"), int) and metadata["capacity"] > 0:
            self.capacity = metadata["capacity"]

    def _leased_seqs(self) -> set[int]:
        """Assumes you hold the lock (dead holders' leases are removed)."""
        leased: set[int] = set()
        for lease in self._manifest.live_leases(remove_dead=True):
            leased.update(lease.get("seqs", ()))
        return leased

    def _delete(self, victims: list[ShardInfo]) -> None:
        """Assumes you hold the lock."""
        if not victims:
            return
        deleted = [v for v in victims if _unlink_quiet(v.path)]
        state = self._manifest.read_state()
        state["evicted"] += len(deleted)
        state["evicted_bytes"] += sum(v.nbytes for v in deleted)
        self._manifest.write_state(state)
        logger.debug("evicted %d shards from %s", len(deleted), self.path)

    def prune(self, to: int | str | None = None) -> list[ShardInfo]:
        """Remove temporaries of dead writers and expired leases, then :meth:`evict` to ``to``."""
        with self._locked():
            self._remove_stale()
            return self._evict(to)

    def _remove_stale(self) -> int:
        """Delete temporaries whose writer process is gone. Assumes you hold the lock."""
        removed = len(remove_abandoned_temporaries(self.shards_dir))
        if removed:
            logger.info("removed %d abandoned temporary shards from %s", removed, self.path)
        self._manifest.remove_write_temporaries()
        self._manifest.live_leases(remove_dead=True)
        return removed

    # -- inspection -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """Shards, bytes, records, counters, leases and budget use, right now."""
        self._refresh_capacity()
        shards = self.list_shards()
        state = self._manifest.read_state()
        leases = self._manifest.live_leases()
        leased = {seq for lease in leases for seq in lease.get("seqs", ())}
        held = [s for s in shards if s.seq in leased]
        times = []
        for shard in (shards[:1] + shards[-1:]) if shards else []:
            try:
                times.append(os.stat(shard.path).st_mtime)
            except FileNotFoundError:
                times.append(None)
        return CacheStats(
            path=self.path,
            capacity=self.capacity,
            shards=len(shards),
            bytes=sum(s.nbytes for s in shards),
            records=sum(s.records for s in shards),
            published=state["published"],
            published_bytes=state["published_bytes"],
            evicted=state["evicted"],
            evicted_bytes=state["evicted_bytes"],
            leases=len(leases),
            leased_shards=len(held),
            leased_bytes=sum(s.nbytes for s in held),
            temporaries=sum(1 for n in _listdir(self.shards_dir) if n.startswith(TMP_PREFIX)),
            oldest_publish_time=times[0] if times else None,
            newest_publish_time=times[-1] if times else None,
        )

    def verify(self, *, remove_corrupt: bool = False, progress: Callable[[ShardInfo], None] | None = None) -> VerifyReport:
        """Check every CRC of every published shard, and each shard's record count.

        Args:
            remove_corrupt: delete corrupt shards that no lease holds. Default: ``False``.
            progress: called after each shard (the CLI drives a progress bar with it).

        Returns:
            A :class:`VerifyReport` naming each corrupt shard with its byte offset.
        """
        report = VerifyReport()
        for name in sorted(_listdir(self.shards_dir)):
            if not name.startswith(TMP_PREFIX) and ShardInfo.from_path(name) is None:
                report.foreign.append(os.path.join(self.shards_dir, name))
        for shard in self.list_shards():
            count = offset = 0
            try:
                for offset, _ in iter_records(shard.path, verify=True):
                    count += 1
                if count != shard.records:
                    raise CorruptShardError(
                        shard.path, os.path.getsize(shard.path),
                        f"holds {count} records, its name says {shard.records}",
                    )
            except FileNotFoundError:
                continue  # evicted while we read: not corrupt
            except CorruptShardError as exc:
                report.corrupt.append(exc)
            report.shards += 1
            report.records += count
            if progress is not None:
                progress(shard)
        if remove_corrupt and report.corrupt:
            with self._locked():
                leased = self._leased_seqs()
                bad = {c.path for c in report.corrupt}
                victims = [s for s in self.list_shards() if s.path in bad and s.seq not in leased]
                self._delete(victims)
                report.removed = [v.path for v in victims]
        return report


def _give_back(tmp: str, moved_from: str | None) -> None:
    """Undo a failed :meth:`Cache.add_shard`: a moved file goes back where it was, a copy is removed.

    The caller's file is never lost to a file that was refused (corrupt, wrong schema, no room).
    """
    if moved_from is None:
        _unlink_quiet(tmp)
        return
    try:
        os.replace(tmp, moved_from)
    except FileNotFoundError:
        pass  # it was published after all
    except OSError as exc:
        logger.error("could not move %s back to %s (%s). Move it out by hand before the cache is opened "
                     "again, which removes temporaries of writers that are gone", tmp, moved_from, exc)


def _is_owner_only(path: str) -> bool:
    return stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
