"""Cache: a directory of immutable TFRecord shards with a byte budget, leases and eviction."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

from filelock import FileLock

from . import _proc, _sampler_stats
from ._size import parse_size
from .errors import (
    CacheFormatError,
    CacheFullError,
    CompressedFileError,
    CorruptShardError,
    EpochSyncError,
    RefusedFileError,
    SchemaError,
    SchemaMismatchError,
)
from .batching import other_schema
from .eviction import EvictionPolicy, choose_evictions_fifo
from .example import ExampleCodec, RecordChecker
from .manifest import (FORMAT_VERSION, METADATA_FILE, PIN_NAME, SHARDS_DIR, Manifest, _unlink_quiet, create_file,
                       fsync_dir)
from .records import check_records, compressed_file_message, detect_compression, iter_records
from .rendezvous import remove_stale_epoch_files
from .schema import Schema
from .shard import MIN_RECORD_BYTES, ShardInfo, impossible_name, scan_shards
from .snapshot import Snapshot
from .transport import remove_dead_segments
from .writer import ShardWriter, raise_if_disk_full, remove_abandoned_temporaries, temp_shard_name

__all__ = ["Cache", "CacheStats", "VerifyReport"]

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = "500GB"
# A cache whose lock cannot be created for these reasons opens read-only (status, verify).
_CANNOT_WRITE = (errno.EROFS, errno.EACCES, errno.EPERM)
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
    irregular: tuple[str, ...] = ()
    """Entries of ``shards/`` and ``leases/`` that are not regular files; ignored, to be removed by hand."""
    pins: int = 0
    """Live resume pins (:meth:`Cache.pin`); ``leases``, ``leased_shards`` and ``leased_bytes`` count
    the leases of running processes only."""
    pinned_shards: int = 0
    pinned_bytes: int = 0
    """Shards and bytes the live pins hold (whether or not a running lease holds them too)."""

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
        kept_leased: corrupt shards not deleted because a live lease holds them (an epoch
            reading them meets the corruption as its ``on_corrupt`` says); run verify again
            once it ends.
        irregular: entries of ``shards/`` and ``leases/`` that are not regular files
            (directories, symbolic links, devices). Readers and eviction ignore them and
            growcache never deletes them: remove them by hand.
    """

    shards: int = 0
    records: int = 0
    corrupt: list[CorruptShardError] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    kept_leased: list[str] = field(default_factory=list)
    irregular: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every shard verified and no entry is irregular."""
        return not self.corrupt and not self.irregular


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

    A cache whose lock cannot be created (a read-only filesystem, or a user without write
    permission) opens read-only: listing, :meth:`stats` and :meth:`verify` work, and anything
    that would change it raises an ``OSError`` that says why.

    Raises:
        SchemaMismatchError: ``schema`` differs from the stored one.
        CacheFormatError: the directory holds metadata of a newer format, or a damaged value
            (naming the file, the field and the fix); it holds shards but no metadata; its
            ``shards/``, ``leases/``, ``epochs/`` or ``sources/`` is a symbolic link or not a
            directory, or its ``.lock`` is not a regular file.
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
        self._lock: FileLock | None = None
        # Why this process cannot change the cache ("" when it can): set for a cache on a
        # read-only filesystem, or one whose lock this user may not create. Reading works.
        self._read_only = ""
        requested_schema = Schema(schema) if schema is not None else None
        requested_capacity = parse_size(capacity, name="capacity") if capacity is not None else None
        try:
            self._manifest.make_layout(mode)
            self._manifest.check_lock()
            self._locked().acquire()
        except OSError as exc:
            if isinstance(exc, CacheFormatError) or exc.errno not in _CANNOT_WRITE or not os.path.isdir(self.path):
                raise
            self._read_only = f"{exc.strerror} ({exc.filename or self.path})"
            self._manifest.check_layout()
            self._open(requested_schema, requested_capacity)
            logger.debug("cache %s is opened read-only: %s", self.path, self._read_only)
            return
        try:
            self._open(requested_schema, requested_capacity)
        finally:
            self._locked().release()

    def _open(self, requested_schema: Schema | None, requested_capacity: int | None) -> None:
        """Read (and, where allowed, store) the metadata; remove what dead processes left.
        Assumes you hold the lock, unless the cache is read-only."""
        metadata = self._manifest.read_metadata(replacing=() if requested_capacity is None else ("capacity",))
        if metadata is None:
            self._refuse_shards_without_metadata()
            metadata = {"format_version": FORMAT_VERSION, "created": time.time(), "schema": None,
                        "capacity": parse_size(DEFAULT_CAPACITY)}
        stored_schema = Schema.from_dict(metadata["schema"]) if metadata.get("schema") else None
        if requested_schema is not None and stored_schema is not None and requested_schema != stored_schema:
            raise SchemaMismatchError(
                f"cache {self.path} holds records of schema {stored_schema!r}, but {requested_schema!r} was "
                "given. Open it without schema= to use the stored one, or use another cache directory."
            )
        new = dict(metadata)
        if "cache_id" not in new and not self._read_only:
            # A resume state names its cache by this id: a cache re-created at the same path
            # reuses shard names and sizes. Caches made before ids get one at their first writable open.
            new["cache_id"] = uuid.uuid4().hex
        if requested_schema is not None:
            new["schema"] = requested_schema.to_dict()
        if requested_capacity is not None:
            new["capacity"] = requested_capacity
        if new != metadata or not os.path.exists(self._manifest.metadata_path):
            self._check_writable("storing its metadata (a new cache, schema or capacity)")
            self._manifest.write_metadata(new)
        self.schema: Schema | None = requested_schema or stored_schema
        self.capacity: int = int(new["capacity"])
        #: The id stored in ``growcache.json`` (``None``: an old cache opened read-only).
        self.cache_id: str | None = new.get("cache_id")
        if not self._read_only:
            self._remove_stale()

    def _refuse_shards_without_metadata(self) -> None:
        """A directory with shards but no ``growcache.json`` lost its metadata: it is no new cache.

        Opened as one, it would take any schema (a float32 0.5 read back as int32 1056964608)
        and the default budget.
        """
        listing = scan_shards(self.shards_dir)
        if listing.shards or listing.temporaries:
            raise CacheFormatError(
                f"{self.path} holds {len(listing.shards)} shards but no {METADATA_FILE}: the metadata that "
                "stores their schema and the byte budget is lost, and growcache will not guess the schema. "
                f"Restore {self._manifest.metadata_path} from a backup, or move the shards out and re-create "
                "the cache with their real schema: `growcache schema SHARD` infers it from a shard, then "
                "Cache(path, schema=...) and `growcache import SHARDS... CACHE --schema ...` bring them back in."
            )

    def _check_writable(self, doing: str) -> None:
        """Raise a clear error if this process opened the cache read-only."""
        if self._read_only:
            raise OSError(
                errno.EROFS if "read-only" in self._read_only.lower() else errno.EACCES,
                f"cache {self.path} cannot be changed by this process: {self._read_only}. Reading it works "
                f"(growcache status and verify, stats(), list_shards()), but {doing} needs write access: remount "
                "the filesystem read-write, or run as a user that may write in the cache directory.")
    # -- pickling: the lock is created lazily in each process ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __repr__(self) -> str:
        return f"Cache({self.path!r}, capacity={self.capacity}, schema={self.schema!r})"

    def _locked(self) -> FileLock:
        self._check_writable("changing it (a snapshot, publish, eviction or prune)")
        self._manifest.check_lock()
        if self._lock is None:
            self._lock = FileLock(self._manifest.lock_path, mode=self.file_mode)
        return self._lock

    @property
    def shards_dir(self) -> str:
        """Directory holding the shard files."""
        return self._manifest.shards_dir

    # -- listing ----------------------------------------------------------------------------
    def list_shards(self) -> list[ShardInfo]:
        """The published shards, oldest first.

        Takes no lock, never lists a temporary, and lists only regular files: a directory or
        a symbolic link named like a shard is left out (``verify`` and ``status`` report it).
        """
        return scan_shards(self.shards_dir).shards

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
            shards = _sized(self.list_shards(), warn=True)
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

    def lease(self, seqs: Iterable[int], *, holder: str = "") -> Snapshot:
        """A snapshot of exactly the shards ``seqs``: another rank's snapshot, leased here too.

        Args:
            seqs: sequence numbers of the shards (a live snapshot's, so none can be evicted).
            holder: a label stored in the lease. Default: ``""``.

        Raises:
            EpochSyncError: a shard of ``seqs`` is no longer in the cache.
        """
        wanted = set(seqs)
        with self._locked():
            shards = _sized([s for s in self.list_shards() if s.seq in wanted], warn=True)
            missing = sorted(wanted - {s.seq for s in shards})
            if missing:
                raise EpochSyncError(
                    f"shards {missing[:5]} of the epoch another rank leased are gone from cache {self.path}: "
                    "its lease ended early (the rank died) or the shards were deleted by hand. Restart the epoch.")
            try:
                lease = self._manifest.write_lease(sorted(wanted), holder) if shards else None
            except OSError as exc:
                raise_if_disk_full(exc, self.path, "writing a snapshot's lease; no shard was leased")
                raise
        return Snapshot(shards, lease, on_close=self._trim_after_lease)

    def pin(self, seqs: Iterable[int], *, until: float, holder: str = "", run: str = "", name: str | None = None) -> str:
        """Pin shards ``seqs`` until the absolute time ``until`` (seconds since 1970), beyond this
        process's life: a resume pin (:mod:`growcache.resume`). Eviction respects it like a lease.

        Args:
            name: a pin of this cache to rewrite (to hold fewer shards). Default: a new pin.

        Returns:
            The pin's name (a file in ``leases/``).
        """
        with self._locked():
            return self._manifest.write_pin(seqs, holder=holder, run=run, until=until, name=name)

    def unpin(self, name: str) -> bool:
        """Release the pin ``name`` (shards only it kept beyond the budget go now); whether it was there."""
        with self._locked():
            if not PIN_NAME.match(name) and name in {pin["name"] for pin in self.pins()}:
                # A lease with an ``until`` under another name (growcache writes none) pins its shards as a
                # pin does, so it is dropped as one. Only names the listing gave are used: no path escapes.
                self._manifest.check_layout()
                gone = _unlink_quiet(os.path.join(self._manifest.leases_dir, name))
            else:
                gone = self._manifest.release_pin(name)
        self._trim_after_lease()
        return gone

    def pins(self) -> list[dict[str, Any]]:
        """Live resume pins: each lease file's fields (``holder``, ``run``, ``until``, ``seqs``), and
        its ``name``."""
        return [dict(lease, name=os.path.basename(lease["path"])) for lease in self._manifest.live_leases()
                if "until" in lease]

    def read_pin(self, name: str) -> dict[str, Any] | None:
        """The pin ``name`` if it is there and unexpired, else ``None``."""
        pin = self._manifest.read_pin(name)
        return pin if pin is not None and pin["until"] > time.time() else None

    def _trim_after_lease(self) -> None:
        """A lease just ended: shards it kept beyond the budget go now, not at the next publish.

        Without this, a cache whose samplers have finished stays over its budget after the
        last epoch until something publishes or snapshots again.
        """
        try:
            with self._locked():
                self._trim_to_budget()
        except (OSError, CacheFormatError) as exc:
            # Ending an epoch must not fail on a full disk, a lock problem or damaged metadata: the
            # next publish or snapshot meets the same problem and raises it, naming the file.
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
        self._manifest.check_layout()  # its temporary must not land outside the cache
        return ShardWriter(self.schema, self.shards_dir, self._publish, max_bytes=self.capacity,
                           file_mode=self.file_mode, **kwargs)

    def add_shard(self, path: str | os.PathLike, *, move: bool = False) -> ShardInfo:
        """Add a TFRecord file written elsewhere (e.g. by ``tf.io.TFRecordWriter``).

        The file's content is copied to a temporary name in the cache (or the file is moved
        there, see ``move``), every record is checked against the CRCs and the schema, and it
        is published like any other shard. A symbolic link is followed for reading only: its
        target's content is copied, and the target is never moved or changed.

        Args:
            path: the TFRecord file; each record a ``tf.train.Example`` that follows the
                schema (in its encodings; entries in any order). Compressed files are
                refused: ``growcache import`` decompresses them.
            move: move the file in rather than copy it, where that is safe (a regular file
                on the same filesystem with no other hard link, owned by this user); otherwise
                its content is copied. The path given is removed once the shard is published
                (for a symbolic link, the link itself); a file that is refused stays where it
                was. Default: ``False``.

        Raises:
            CorruptShardError: a CRC mismatch or truncation (file, offset).
            CompressedFileError: the file is GZIP- or ZLIB-compressed.
            SchemaError: a record does not follow the cache's schema.
            CacheFullError: the file is larger than the whole capacity.
            RefusedFileError: ``path`` is not a regular file (a directory, device, FIFO or
                socket), is a shard of this cache, or is a shard that a live lease of
                another cache still holds.
        """
        if self.schema is None:
            raise SchemaError(f"cache {self.path} has no schema: open it with Cache(path, schema=...) to add shards")
        source = os.fspath(path)
        self._manifest.check_layout()
        tmp = os.path.join(self.shards_dir, temp_shard_name(os.urandom(6).hex()))
        moved = self._take_in(source, tmp, move)
        _proc.fault_point("add_shard:taken")
        # A moved file keeps its old modification time: without a fresh heartbeat, a process of
        # another process table would judge the temporary dead at once and delete the user's file.
        _proc.keep_alive(tmp)
        times = os.stat(tmp)
        try:
            os.utime(tmp)
            size = os.path.getsize(tmp)
            if size > self.capacity:
                raise CacheFullError(
                    f"{source} has {size} bytes, more than the whole capacity of cache {self.path} ({self.capacity} "
                    "bytes). Raise the capacity, or split the file into smaller shards."
                )
            records = self._check_added(tmp, source)
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, self.file_mode)  # a moved file becomes the cache's only once it is accepted
                os.fsync(fd)
            finally:
                os.close(fd)
            info = self._publish(tmp, records, size)
        except CorruptShardError as exc:
            _give_back(tmp, source if moved else None, times)
            raise CorruptShardError(source, exc.offset, exc.reason) from None
        except BaseException:
            _give_back(tmp, source if moved else None, times)
            raise
        finally:
            _proc.let_go(tmp)
        if move:
            _unlink_quiet(source)  # the user's link to a moved file, a copied file, or a link (never its target)
        return info

    def _take_in(self, source: str, tmp: str, move: bool) -> bool:
        """Put ``source``'s content at ``tmp`` (our own regular file); return True if it was moved.

        Every check runs on what was really opened or moved, so a file swapped for a link or a
        device between a check and its use is refused, never followed.
        """
        self._refuse_if_leased(source)
        info = os.lstat(source)
        if move and stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and info.st_uid == os.geteuid():
            # A second hard link, not a rename: until the shard is published the user's path still
            # holds the file, so a crash (whose temporary the next open removes) loses nothing.
            try:
                os.link(source, tmp, follow_symlinks=False)
            except OSError:
                pass  # another filesystem, or one without hard links: copy below
            else:
                moved = os.lstat(tmp)
                if stat.S_ISREG(moved.st_mode) and (moved.st_dev, moved.st_ino) == (info.st_dev, info.st_ino):
                    return True
                _unlink_quiet(tmp)  # it changed under us: the user's path is untouched; refuse
                raise RefusedFileError(f"{source} changed while it was being added; nothing was added. Try again.")
        # O_NONBLOCK: opening a FIFO must not hang; its type is checked right after.
        src = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            opened = os.fstat(src)
            if not stat.S_ISREG(opened.st_mode):
                raise RefusedFileError(
                    f"{source} is {_file_kind(opened.st_mode)}, not a regular file: add_shard reads TFRecord files "
                    "only. Give the path of a regular file."
                )
            dst = create_file(tmp, self.file_mode)
            try:
                with open(src, "rb", closefd=False) as fin, open(dst, "wb", closefd=False) as fout:
                    shutil.copyfileobj(fin, fout, 8 << 20)
            except BaseException:
                _unlink_quiet(tmp)
                raise
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return False

    def _refuse_if_leased(self, source: str) -> None:
        """Refuse a shard of this cache, or a shard of another cache that a live lease holds."""
        real = os.path.realpath(source)
        shards_dir = os.path.dirname(real)
        info = ShardInfo.from_path(real)
        if info is None or os.path.basename(shards_dir) != SHARDS_DIR:
            return
        root = os.path.dirname(shards_dir)
        if not os.path.exists(os.path.join(root, METADATA_FILE)):
            return
        if os.path.realpath(self.shards_dir) == shards_dir:
            raise RefusedFileError(f"{source} is already a shard of cache {self.path}: adding it again would "
                                   "duplicate its records. Nothing was added.")
        holders = [lease for lease in Manifest(root).live_leases() if info.seq in lease.get("seqs", ())]
        if holders:
            raise RefusedFileError(
                f"{source} is a shard of cache {root} that a live lease still holds (holder "
                f"{holders[0].get('holder', '')!r}): a reader may be reading it now. Wait for its epoch to end, "
                "or copy the file elsewhere first and add the copy."
            )

    def _check_added(self, tmp: str, source: str) -> int:
        """Check an added file's framing, CRCs and schema; return its record count.

        The one place that decides what ``add_shard`` accepts: a check for another kind of
        file goes here.
        """
        with open(tmp, "rb") as f:
            compression = detect_compression(f.read(64))
        if compression is not None:  # not corrupt: `growcache import` reads it
            raise CompressedFileError(compressed_file_message(source, compression, self.path))
        checker = RecordChecker(ExampleCodec(self.schema), source)  # type: ignore[arg-type]
        records = 0
        for offset, record in iter_records(tmp, verify=True):
            checker.check(record, offset)
            records += 1
        checker.flush()
        if records == 0:
            raise CorruptShardError(source, 0, "the file holds no records")
        return records

    def _publish(
        self,
        tmp_path: str,
        records: int,
        nbytes: int,
        *,
        timeout: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        before_publish: Callable[[ShardInfo], None] | None = None,
    ) -> ShardInfo:
        """Make room within the budget, then rename ``tmp_path`` to its published name.

        ``before_publish(info)`` runs under the lock just before the rename: what it records
        about the shard (a shard source's progress) can never miss a published shard.
        """
        self._refuse_larger_than_capacity(tmp_path, nbytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = _WAIT_MIN
        warned = False
        while True:
            with self._locked():
                _proc.fault_point("publish:locked")
                shards = self.list_shards()
                victims = self._choose_victims(incoming=nbytes, shards=shards)
                if victims is None:
                    # Another process may have lowered the capacity below this shard: no lease
                    # ending would make room, so the writer must not wait for one.
                    self._refuse_larger_than_capacity(tmp_path, nbytes)
                if victims is not None:
                    try:
                        self._delete(victims)
                        seq = self._manifest.count_publish(max((s.seq for s in shards), default=0), nbytes)
                    except OSError as exc:
                        raise_if_disk_full(exc, self.path, f"publishing {tmp_path}; nothing was published")
                        raise
                    info = ShardInfo(seq, os.path.join(self.shards_dir, ShardInfo.file_name(seq, records, nbytes)),
                                     records, nbytes)
                    _proc.fault_point("publish:counted")
                    try:
                        if before_publish is not None:
                            before_publish(info)
                        os.replace(tmp_path, info.path)
                    except BaseException:  # a refusing hook (ClaimLostError) too: nothing was published
                        with contextlib.suppress(OSError):
                            self._manifest.uncount_publish(nbytes)
                        raise
                    _proc.let_go(tmp_path)  # published: no temporary to keep alive
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
        shards = _sized(self.list_shards())
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
        shards = _sized(self.list_shards() if shards is None else shards)
        leased = self._leased_seqs()
        leased_bytes = sum(s.nbytes for s in shards if s.seq in leased)
        return self.eviction_policy(shards, leased, self.capacity + leased_bytes, incoming, time.time())

    def _trim_to_budget(self) -> None:
        """Delete what the budget lets go now, with nothing incoming. Assumes you hold the lock."""
        self._delete(self._choose_victims(incoming=0) or [])

    def _next_sampler_run(self) -> int:
        """Count one more sampler pool started on this cache; return how many started before."""
        with self._locked():
            return self._manifest.count_sampler_run()

    def _refuse_larger_than_capacity(self, tmp_path: str, nbytes: int) -> None:
        if nbytes > self.capacity:
            raise CacheFullError(
                f"shard {tmp_path} has {nbytes} bytes, more than the cache's whole capacity of {self.capacity} "
                "bytes. Raise the capacity or write smaller shards."
            )

    def _refresh_capacity(self) -> None:
        """Take up a capacity stored since this process opened the cache.

        ``Cache(path, capacity=...)`` in any process changes the budget of every process
        using the cache (running samplers included) from their next publish, snapshot or
        eviction on; otherwise each would keep enforcing the budget it opened with. A damaged
        stored capacity is a :class:`CacheFormatError` here, never a budget of 0.
        """
        metadata = self._manifest.read_metadata()
        if metadata is not None:
            self.capacity = metadata["capacity"]

    def _leased_seqs(self) -> set[int]:
        """Assumes you hold the lock (dead holders' leases are removed)."""
        leased: set[int] = set()
        for lease in self._manifest.live_leases(remove_dead=True):
            leased.update(lease.get("seqs", ()))
        return leased

    def _withdraw(self, shards: list[ShardInfo]) -> list[ShardInfo]:
        """Remove ``shards``, just published by a caller whose larger step failed; return those a
        reader leased meanwhile (they stay)."""
        if not shards:
            return []
        with self._locked():
            leased = self._leased_seqs()
            self._delete([s for s in shards if s.seq not in leased])
        return [s for s in shards if s.seq in leased]

    def _delete(self, victims: list[ShardInfo]) -> None:
        """Assumes you hold the lock."""
        if not victims:
            return
        self._manifest.check_layout()  # never delete through a shards/ replaced by a link
        deleted = []
        for victim in victims:
            try:
                if _unlink_quiet(victim.path):
                    deleted.append(victim)
            except OSError as exc:  # replaced by a directory since it was listed: not ours to remove
                logger.warning("could not evict %s (%s); it is left in place", victim.path, exc)
        self._manifest.count_evictions(len(deleted), sum(v.nbytes for v in deleted))
        logger.debug("evicted %d shards from %s", len(deleted), self.path)

    def prune(self, to: int | str | None = None) -> list[ShardInfo]:
        """Remove what dead processes left (temporaries, leases, shared memory), then :meth:`evict` to ``to``."""
        with self._locked():
            self._remove_stale()
            return self._evict(to)

    def _remove_stale(self) -> int:
        """Delete what dead processes left, and rebuild damaged counters. Assumes you hold the lock."""
        self._manifest.check_layout()  # never delete through a directory replaced by a link
        removed = len(remove_abandoned_temporaries(self.shards_dir))
        if removed:
            logger.info("removed %d abandoned temporary shards from %s", removed, self.path)
        self._manifest.remove_write_temporaries()
        self._manifest.live_leases(remove_dead=True)
        self._manifest.repair_state()
        remove_dead_segments()
        remove_stale_epoch_files(self.path)
        _sampler_stats.remove_stale(self.path)
        return removed

    # -- inspection -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """Shards, bytes, records, counters, leases and budget use, right now."""
        self._refresh_capacity()
        listing = scan_shards(self.shards_dir)
        shards = listing.shards
        state = self._manifest.read_state()
        everything = self._manifest.live_leases()
        leases = [lease for lease in everything if "until" not in lease]
        leased = {seq for lease in leases for seq in lease.get("seqs", ())}
        held = [s for s in shards if s.seq in leased]
        pinned = {seq for lease in everything if "until" in lease for seq in lease["seqs"]}
        kept = [s for s in shards if s.seq in pinned]
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
            temporaries=len(listing.temporaries),
            oldest_publish_time=times[0] if times else None,
            newest_publish_time=times[-1] if times else None,
            irregular=tuple(listing.irregular + self._manifest.irregular_leases()),
            pins=len(everything) - len(leases),
            pinned_shards=len(kept),
            pinned_bytes=sum(s.nbytes for s in kept),
        )

    def verify(self, *, remove_corrupt: bool = False, progress: Callable[[ShardInfo], None] | None = None) -> VerifyReport:
        """Check every CRC of every published shard, and each shard's record count and size.

        Memory stays bounded whatever a damaged length field claims: a record is checked in
        chunks, and no length beyond the file's end is ever trusted.

        Args:
            remove_corrupt: delete corrupt shards that no lease holds. Default: ``False``.
            progress: called after each shard (the CLI drives a progress bar with it).

        Returns:
            A :class:`VerifyReport` naming each corrupt shard with its byte offset, and every
            entry that is not a regular file.
        """
        listing = scan_shards(self.shards_dir)
        report = VerifyReport(irregular=listing.irregular + self._manifest.irregular_leases())
        for path in listing.foreign:
            impossible = impossible_name(path)
            if impossible:  # named like a shard, but no shard: readers leave it out, verify names it
                report.corrupt.append(CorruptShardError(path, 0, f"its name is no shard's: {impossible}"))
            else:
                report.foreign.append(path)
        for shard in listing.shards:
            count = 0
            try:
                file = _open_listed(shard.path)
                if file is None:  # swapped for a link, a FIFO or a directory since the listing
                    report.irregular.append(shard.path)
                    continue
                with file:
                    count = check_records(shard.path, expected=shard.records, file=file)
                    if self.schema is not None:
                        check_schema_of(shard.path, self.schema, file=file)
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
                present = _sized([s for s in self.list_shards() if s.path in bad])
                victims = [s for s in present if s.seq not in leased]
                self._delete(victims)
                report.removed = [v.path for v in victims]
                report.kept_leased = [s.path for s in present if s.seq in leased]
        return report


def check_schema_of(path: str, schema: Schema, *, file: BinaryIO | None = None) -> None:
    """Check that the first record of shard ``path`` (read from ``file`` if given) follows ``schema``.

    A shard of another schema (copied into ``shards/`` by hand, say) has valid CRCs, so only
    its records tell: it is a corrupt shard of this cache, named with the offset and the
    difference. The first record suffices, since growcache writes a shard with one schema;
    it is read only up to a bound the schema sets, so a crafted length allocates nothing.

    Raises:
        CorruptShardError: the record does not follow ``schema``.
    """
    # Encoded, a feature takes at most its payload plus a varint per int64_list value (10
    # bytes for 8) and a little framing: a record four times that long is of another schema.
    bound = 4 * schema.record_payload_bytes + (1 << 20)
    checker = RecordChecker(ExampleCodec(schema), "the record")
    for offset, record in iter_records(path, verify=False, max_record_bytes=bound, file=file):
        try:
            checker.check(record, offset)
            checker.flush()
        except SchemaError as exc:
            raise other_schema(path, exc) from None
        break


# How many bytes of records a shard whose file differs from its name may still claim.
_CLAIM_SLACK = 8 << 10  # 512 records at the 16-byte minimum frame


def _sized(shards: list[ShardInfo], *, warn: bool = False) -> list[ShardInfo]:
    """``shards``, each checked against its file's size (one ``stat`` per shard).

    A shard's name is untrusted. One whose file holds other bytes than it claims keeps its
    place (its reader meets the corruption as ``on_corrupt`` says), but counts with its real
    size, and with no more records than that size (or ``_CLAIM_SLACK``) can frame: a name claiming 10**16 records
    in 160 PB can neither make an epoch's plan or top up run for ever, nor make the budget
    evict every other shard. A shard gone since the listing is dropped. Used wherever a
    decision rests on the counts (snapshots, leases, eviction), not for plain listings.
    """
    sized = []
    for shard in shards:
        try:
            size = os.stat(shard.path).st_size
        except FileNotFoundError:
            continue
        if size != shard.nbytes:
            # The name's count stands up to what a file of its size, or of _CLAIM_SLACK, could
            # frame: a shard cut to nothing is still planned, so its reader notes the records it
            # lost, while a count no file here could hold stays bounded.
            records = min(shard.records, max(size, _CLAIM_SLACK) // MIN_RECORD_BYTES)
            (logger.warning if warn else logger.debug)(
                "shard %s has %d bytes, its name says %d: it is corrupt (growcache verify reports it); it counts "
                "with its real size and at most %d records", shard.path, size, shard.nbytes, records)
            shard = replace(shard, records=records, nbytes=size)
        sized.append(shard)
    return sized


def _open_listed(path: str) -> BinaryIO | None:
    """The listed shard ``path`` opened for reading (unbuffered); ``None`` if it is no longer a
    regular file.

    Every check of the shard then reads what was opened here: an entry swapped for a link or a
    FIFO after the listing is neither followed out of the cache nor waited on forever.

    Raises:
        FileNotFoundError: the shard is gone (evicted since the listing).
    """
    try:
        # O_NONBLOCK: opening a FIFO must not hang; its type is checked right after.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link
            return None
        raise
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:  # a FIFO, a device, a directory
        os.close(fd)
        return None
    return os.fdopen(fd, "rb", buffering=0)


def _give_back(tmp: str, moved_from: str | None, times: os.stat_result) -> None:
    """Undo a failed :meth:`Cache.add_shard`: a moved file (still at the user's path too, as a second
    hard link) gets its own times and mode back, and the cache's link or copy is removed.

    The caller's file is never lost to a file that was refused (corrupt, wrong schema, no room).
    """
    if moved_from is not None:
        with contextlib.suppress(OSError):
            os.utime(tmp, ns=(times.st_atime_ns, times.st_mtime_ns))
            os.chmod(tmp, stat.S_IMODE(times.st_mode))
    _unlink_quiet(tmp)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"
