"""All reading and writing of a cache's state files is performed by this class.

Layout of a cache directory::

    growcache.json   format version, schema, capacity   (rewritten atomically)
    state.json       publish/evict counters, next seq    (rewritten atomically)
    .lock            the file lock around every change
    shards/          published shards, and .tmp-* files being written
    leases/          one JSON file per live snapshot
    epochs/          epoch files of ranks that agree without a process group (rendezvous.py)
    sources/         one JSON file per shard source: its passes, claims, remote shards held

State files are JSON: nothing read from a cache is ever unpickled. Every value read is
checked for type and range before use, and every file is read with a bound on its size and
without following a link. growcache writes and deletes only in real directories: each of the
four above is refused as a :class:`CacheFormatError` if it is a symbolic link. Damaged metadata (``growcache.json``) is refused
with a :class:`CacheFormatError` naming the file, the field and the fix, since nothing
else knows the schema; damaged counters (``state.json``) are rebuilt from the shard
listing with a warning; a damaged lease expires.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Iterable
from typing import Any

from . import _proc
from .errors import CacheFormatError
from .shard import MAX_SEQ, scan_shards

__all__ = ["FORMAT_VERSION", "Manifest", "atomic_write_bytes", "fsync_dir"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA_FILE = "growcache.json"
STATE_FILE = "state.json"
LOCK_FILE = ".lock"
SHARDS_DIR = "shards"
LEASES_DIR = "leases"
SOURCES_DIR = "sources"
EPOCHS_DIR = "epochs"
#: The most bytes read from one state file (metadata, state, lease, epoch or source file): a
#: crafted huge file is a :class:`CacheFormatError`, never an allocation of its size.
MAX_STATE_FILE_BYTES = 16 << 20
_MAX_COUNTER = 2**63 - 1  # counters are shown and summed as int64
#: The largest record a stored schema may describe: protobuf's 2 GiB message limit.
MAX_RECORD_PAYLOAD_BYTES = 2 << 30
# Counters that only grow; their default is 0. ``next_seq`` (default 1) is kept apart.
_COUNTERS = ("published", "published_bytes", "evicted", "evicted_bytes", "sampler_runs")


def fsync_dir(path: str) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_REBUILDS_TOLD: set[tuple[str, str]] = set()  # (state file, damage) warned of in this process
_WRITE_TEMP = re.compile(r"\.[0-9a-f]{32}\.tmp$")  # the temporaries atomic_write_bytes names


def create_file(path: str, mode: int) -> int:
    """Create the new file ``path`` (never an existing one or a link) with exactly ``mode``,
    whatever the umask; return its descriptor, open for writing.

    The umask would strip the bits ``Cache(mode=0o770)`` asks for: under a strict one (077) a
    shard came out 0o600, and the group sharing the cache could not read it.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    with contextlib.suppress(OSError):  # a filesystem without modes keeps what it has
        os.fchmod(fd, mode)
    return fd


def atomic_write_bytes(path: str, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a mix.

    ``durable=False`` skips the fsyncs: still atomic for every process, but a power failure
    may bring back the old file (for state that dies with its processes anyway).
    """
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = create_file(tmp, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


class Manifest:
    """Reads and writes ``growcache.json``, ``state.json`` and the lease files of one cache.

    Methods that change state assume the caller holds the cache's lock; reads are
    lock-free because every file is replaced atomically.

    Args:
        root: the cache directory.
        file_mode: permission bits of files it creates. Default: ``0o600``.
    """

    def __init__(self, root: str, file_mode: int = 0o600) -> None:
        self.root = root
        self.file_mode = file_mode
        self.metadata_path = os.path.join(root, METADATA_FILE)
        self.state_path = os.path.join(root, STATE_FILE)
        self.lock_path = os.path.join(root, LOCK_FILE)
        self.shards_dir = os.path.join(root, SHARDS_DIR)
        self.leases_dir = os.path.join(root, LEASES_DIR)
        self.sources_dir = os.path.join(root, SOURCES_DIR)
        self.epochs_dir = os.path.join(root, EPOCHS_DIR)

    # -- layout -----------------------------------------------------------------------------
    def make_layout(self, mode: int) -> None:
        """Create the cache directory and its ``shards/`` and ``leases/``; refuse linked ones."""
        parent = os.path.dirname(self.root)
        if parent:
            os.makedirs(parent, exist_ok=True)
        for directory in (self.root, self.shards_dir, self.leases_dir):
            make_dir(directory, mode)
        self.check_layout()

    def check_layout(self) -> None:
        """Raise :class:`CacheFormatError` unless every directory growcache writes or deletes in
        is a real directory: ``shards/`` and ``leases/`` (which must exist), ``epochs/`` and
        ``sources/`` (where they exist).

        Through a symbolic link growcache would write and delete files of whatever directory
        the link points to, outside the cache.
        """
        for directory in (self.shards_dir, self.leases_dir, self.epochs_dir, self.sources_dir):
            try:
                mode = os.lstat(directory).st_mode
            except FileNotFoundError:
                if directory in (self.epochs_dir, self.sources_dir):
                    continue  # made on first use, through make_subdir
                raise CacheFormatError(
                    f"{directory} is missing: the cache directory {self.root} was damaged. Open it with "
                    "Cache() again to recreate it (published shards in it are kept)."
                ) from None
            if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
                raise CacheFormatError(
                    f"{directory} is {kind}. growcache deletes files inside it, so it refuses anything but a "
                    f"real directory there (a link could point outside the cache). Replace it with a directory: "
                    f"move it away, then open the cache again."
                )

    def make_subdir(self, directory: str, mode: int) -> None:
        """Create ``directory`` (``epochs/`` or ``sources/``) if missing; refuse a link there."""
        make_dir(directory, mode)
        self.check_layout()

    def check_lock(self) -> None:
        """Raise :class:`CacheFormatError` if ``.lock`` is anything but a regular file (or absent).

        The lock is opened for writing and created if missing: through a link it would lock,
        or create, a file outside the cache; a directory there cannot be locked at all.
        """
        try:
            mode = os.lstat(self.lock_path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else \
                "not a regular file"
            raise CacheFormatError(
                f"{self.lock_path} is {kind}, where growcache keeps the lock file of cache {self.root}. It holds "
                "no data: remove it (rm -r, or unlink the link) and open the cache again; growcache re-creates it."
            )

    def remove_write_temporaries(self) -> None:
        """Delete temporaries of metadata, state and lease writes that a killed process left.

        Assumes you hold the lock: every such write happens under it, so none is in progress.
        """
        self.check_layout()
        for directory in (self.root, self.leases_dir, self.sources_dir):
            for entry in _scandir(directory):
                if _WRITE_TEMP.search(entry.name) and _is_regular(entry):
                    _unlink_quiet(entry.path)

    # -- shard sources ----------------------------------------------------------------------
    def read_source_state(self, key: str) -> dict[str, Any] | None:
        """The state of the shard source ``key`` (a hex digest), or ``None`` if it has none yet.

        Raises:
            CacheFormatError: the file is damaged.
        """
        return self._read_json(self._source_path(key))

    def write_source_state(self, key: str, data: dict[str, Any], *, durable: bool = True) -> None:
        """Replace the state of the shard source ``key``. Assumes you hold the lock.

        ``durable=False`` for changes only live processes care about (claims).
        """
        self.make_subdir(self.sources_dir, self.file_mode | (self.file_mode & 0o444) >> 2)
        self._replace(self._source_path(key), data, durable=durable)

    def source_states(self) -> list[dict[str, Any]]:
        """The state of every shard source that has used this cache (damaged ones left out)."""
        states = []
        for entry in sorted(_scandir(self.sources_dir), key=lambda e: e.name):
            if entry.name.endswith(".json") and _is_regular(entry):
                state = self._read_json_quiet(entry.path)
                if state is not None:
                    states.append(state)
        return states

    def _source_path(self, key: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{8,64}", key):
            raise ValueError(f"a shard source key is a hex digest, got {key!r}")
        return os.path.join(self.sources_dir, f"{key}.json")

    # -- metadata ---------------------------------------------------------------------------
    def read_metadata(self, *, replacing: Iterable[str] = ()) -> dict[str, Any] | None:
        """The metadata, every field checked; ``None`` for a directory that is not a cache yet.

        Args:
            replacing: fields the caller is about to store new values for; a damaged value
                of one of them is no error (``Cache(path, capacity=...)`` repairs a bad capacity).

        Raises:
            CacheFormatError: a field is missing, of the wrong type or out of range, naming
                the file, the field and the fix; or the format is newer than this growcache.
        """
        data = self._read_json(self.metadata_path)
        if data is None:
            return None
        path = self.metadata_path
        version = data.get("format_version")
        if not _is_int(version) or version < 1:
            raise CacheFormatError(
                f"{path}: field 'format_version' is {version!r}, not a positive integer; this is not a growcache "
                "cache, or its metadata is damaged. Restore the file from a backup, or point Cache() at another "
                "directory."
            )
        if version > FORMAT_VERSION:
            raise CacheFormatError(
                f"{path} is format version {version}, newer than the version {FORMAT_VERSION} "
                "this growcache understands. Upgrade growcache to read it; it is refused rather than misread."
            )
        replacing = set(replacing)
        capacity = data.get("capacity")
        if "capacity" not in replacing and not (_is_int(capacity) and 0 < capacity <= _MAX_COUNTER):
            raise CacheFormatError(
                f"{path}: field 'capacity' is {capacity!r}, not a positive number of bytes. Nothing was deleted. "
                "Store a valid budget by opening the cache with Cache(path, capacity='500GB') (any size)."
            )
        created = data.get("created")
        if created is not None and not (isinstance(created, (int, float)) and not isinstance(created, bool)):
            raise CacheFormatError(
                f"{path}: field 'created' is {created!r}, not a time. Restore the file, or set the field to a number "
                "of seconds since 1970 (it is only informative)."
            )
        cache_id = data.get("cache_id")
        if cache_id is not None and not (isinstance(cache_id, str) and CACHE_ID.match(cache_id)):
            raise CacheFormatError(
                f"{path}: field 'cache_id' is {cache_id!r}, not 32 hexadecimal digits. Restore the file, or delete the "
                "field: the next writable open stores a new id (resume states saved before then are refused).")
        schema = data.get("schema")
        if schema is not None:
            from .schema import Schema  # the schema module validates its own dicts

            try:
                if not isinstance(schema, dict):
                    raise TypeError(f"a {type(schema).__name__}, not an object")
                payload = Schema.from_dict(schema).record_payload_bytes
                if payload > MAX_RECORD_PAYLOAD_BYTES:  # readers allocate whole batches of records
                    raise ValueError(f"a record of {payload} bytes, more than the "
                                     f"{MAX_RECORD_PAYLOAD_BYTES >> 30} GiB a TFRecord Example can hold")
            except (ValueError, TypeError, LookupError) as exc:  # LookupError: a feature of the wrong JSON shape
                why = f"a feature is not [dtype, shape, ...]: {exc!r}" if isinstance(exc, LookupError) else exc
                raise CacheFormatError(
                    f"{path}: field 'schema' is damaged ({why}). Restore the file from a backup: the schema is "
                    "stored nowhere else, so growcache cannot rebuild it."
                ) from None
        return data

    def write_metadata(self, data: dict[str, Any]) -> None:
        """Replace the metadata. Assumes you hold the lock."""
        self._replace(self.metadata_path, data)

    # -- counters ---------------------------------------------------------------------------
    def read_state(self, *, locked: bool = False) -> dict[str, int]:
        """Publish and eviction counters, each checked.

        Damaged or missing counters are rebuilt from the shard listing, with a warning:
        the next sequence number and the published shards and bytes from the shards
        present; the eviction counters restart at 0; the count of sampler pool starts
        restarts from the clock, so no later pool repeats an earlier pool's random streams.

        Args:
            locked: the caller holds the lock, so the counters must also agree with the
                listing (every listed shard was counted as published). Without the lock a
                publish may land between the two reads. Default: ``False``.
        """
        try:
            stored = self._read_json(self.state_path)
            damage = None
        except CacheFormatError as exc:
            stored, damage = {}, str(exc)
        state: dict[str, int] = {}
        bad: list[str] = []
        for name, default in (("next_seq", 1), *((c, 0) for c in _COUNTERS)):
            value = (stored or {}).get(name, default if name == "sampler_runs" else None)
            # A next_seq past the last twelve-digit one would name shards that no listing sees.
            most = MAX_SEQ if name == "next_seq" else _MAX_COUNTER
            if _is_int(value) and default <= value <= most:
                state[name] = value
            else:
                bad.append(name)
        shards = scan_shards(self.shards_dir).shards if bad or locked else []
        if locked:
            listed = {"next_seq": max((s.seq for s in shards), default=0) + 1, "published": len(shards),
                      "published_bytes": sum(s.nbytes for s in shards)}
            bad += [name for name, least in listed.items() if name not in bad and state[name] < least]
        if not bad:
            return state
        if stored is None and damage is None and not shards:
            return {"next_seq": 1, **dict.fromkeys(_COUNTERS, 0)}  # a new cache
        rebuilt = {
            "next_seq": max((s.seq for s in shards), default=0) + 1,
            "published": len(shards),
            "published_bytes": sum(s.nbytes for s in shards),
            "evicted": 0,
            "evicted_bytes": 0,
            "sampler_runs": int(time.time()),
        }
        for name in bad:
            state[name] = rebuilt[name]
        what = damage or (f"{self.state_path} is missing" if stored is None
                          else f"{self.state_path}: field(s) {', '.join(bad)} missing, out of range or behind the "
                               "shards present")
        # Once per damage: a cache this process cannot repair (read-only) is read again at every
        # stats() call, and `growcache status --watch` repeated the warning every interval.
        level = logging.DEBUG if (self.state_path, what) in _REBUILDS_TOLD else logging.WARNING
        _REBUILDS_TOLD.add((self.state_path, what))
        logger.log(level, "%s; rebuilt %s from the %d shards present (shards published and evicted before now "
                   "are no longer counted)", what, ", ".join(bad), len(shards))
        return state

    def write_state(self, state: dict[str, int]) -> None:
        """Replace the counters. Assumes you hold the lock."""
        self._replace(self.state_path, state)

    def _replace(self, path: str, data: dict[str, Any], *, durable: bool = True) -> None:
        """Atomically replace the state file ``path``; a directory put in its place is a
        :class:`CacheFormatError` that names it, not a rename error naming a temporary."""
        try:
            atomic_write_bytes(path, _dumps(data), self.file_mode, durable=durable)
        except IsADirectoryError:
            raise CacheFormatError(
                f"{path} is a directory, where growcache keeps a state file of cache {self.root}, so it cannot be "
                "rewritten. Move the directory away (growcache.json holds the schema: restore it from a backup; "
                "any other state file is rebuilt) and open the cache again.") from None

    def repair_state(self) -> None:
        """Write the counters back if they had to be rebuilt. Assumes you hold the lock."""
        state = self.read_state(locked=True)
        if self._read_json_quiet(self.state_path) != state:
            self.write_state(state)

    def count_publish(self, newest: int, nbytes: int) -> int:
        """Spend the next sequence number on a shard of ``nbytes``; return it.

        The counters are written before the shard is renamed: if they cannot be (a full disk),
        nothing is published, and a sequence number is never handed out twice (a second shard
        of the same size would replace a published one). Assumes you hold the lock.

        Args:
            newest: the largest sequence number listed now. The counter is never behind it:
                a stale (restored) state file must not make a publish overwrite a shard.
        """
        state = self.read_state(locked=True)
        seq = max(state["next_seq"], newest + 1)
        if seq > MAX_SEQ:
            raise CacheFormatError(
                f"cache {self.root} has spent every twelve-digit sequence number (the newest shard is {newest}): "
                "a longer shard name would be invisible to every listing. Copy the shards you need into a new "
                "cache with `growcache import`.")
        state["next_seq"] = seq + 1
        state["published"] += 1
        state["published_bytes"] += nbytes
        self.write_state(state)
        return seq

    def uncount_publish(self, nbytes: int) -> None:
        """A counted shard could not be renamed: undo its counts; its sequence number stays spent."""
        state = self.read_state(locked=True)
        state["published"] = max(state["published"] - 1, 0)
        state["published_bytes"] = max(state["published_bytes"] - nbytes, 0)
        self.write_state(state)

    def count_evictions(self, shards: int, nbytes: int) -> None:
        """Add deleted shards to the eviction counters. Assumes you hold the lock."""
        state = self.read_state(locked=True)
        state["evicted"] += shards
        state["evicted_bytes"] += nbytes
        self.write_state(state)

    def count_sampler_run(self) -> int:
        """Count one more sampler pool start; return how many started before. Assumes you hold the lock."""
        state = self.read_state(locked=True)
        run = state["sampler_runs"]
        state["sampler_runs"] = run + 1
        self.write_state(state)
        return run

    # -- leases -----------------------------------------------------------------------------
    def write_lease(self, seqs: Iterable[int], holder: str = "") -> str:
        """Record a lease on ``seqs`` for this process and return its file path.

        The lease's modification time is its heartbeat, refreshed by this process until the
        lease is released (see :mod:`growcache._proc`).
        """
        self.check_layout()
        pid, start = _proc.this_process()
        path = os.path.join(self.leases_dir, f"{pid}-{uuid.uuid4().hex}.json")
        body = {"pid": pid, "start_time": start, "host": _proc.this_host(), "created": time.time(),
                "holder": holder, "seqs": sorted(seqs), "expiry": _proc.beat_expiry()}
        atomic_write_bytes(path, _dumps(body), self.file_mode)
        _proc.keep_alive(path)
        return path

    def live_leases(self, *, remove_dead: bool = False) -> list[dict[str, Any]]:
        """Every lease whose holder lives. Dead holders' leases expire here.

        A holder on this machine lives while its process does; one on another machine (by the
        lease's machine tag) while its heartbeat is recent (:func:`growcache._proc.is_alive`).

        Args:
            remove_dead: delete expired lease files; only with the lock held. Default: ``False``.
        """
        if remove_dead:
            self.check_layout()  # never delete through a leases/ that was replaced by a link
        leases = []
        for entry in _scandir(self.leases_dir):
            name = entry.name
            if not name.endswith(".json") or not _is_regular(entry):
                continue  # write temporaries, and non-regular entries (reported by irregular_leases)
            path = entry.path
            try:
                lease, heartbeat = self._read_lease(path)
            except CacheFormatError as exc:
                # Leases are replaced atomically, so a damaged one was not written by a live
                # growcache reader: it expires, rather than pinning its shards forever or
                # stopping every publish and snapshot.
                logger.warning("%s; the lease is treated as expired%s", exc, " and removed" if remove_dead else "")
                if remove_dead:
                    _unlink_quiet(path)
                continue
            if lease is None:
                continue
            host = lease.get("host")
            if "until" in lease:  # a resume pin outlives its writer, up to its absolute expiry
                alive = time.time() < lease["until"]
            else:
                alive = _proc.is_alive(lease["pid"], lease["start_time"], host, heartbeat, lease.get("expiry"))
            if alive:
                lease["path"] = path
                leases.append(lease)
            elif remove_dead:
                if "until" in lease:
                    logger.info("resume pin %s (holder %r, run %r) expired: its shards may be evicted", path,
                                lease.get("holder", ""), lease.get("run", ""))
                elif host not in (None, _proc.this_host()):
                    logger.warning("lease %s (holder %r) of another machine or an earlier hostname had no heartbeat "
                                   "for %.0f s (expiry %g s): its holder is judged dead and the lease removed",
                                   path, lease.get("holder", ""), time.time() - heartbeat,
                                   lease.get("expiry") or _proc.owner_expiry())
                _unlink_quiet(path)
        return leases

    def write_pin(self, seqs: Iterable[int], *, holder: str, run: str, until: float, name: str | None = None) -> str:
        """Record a resume pin on ``seqs`` (see :mod:`growcache.resume`) and return its file name.

        A pin is a lease that no process keeps alive: it lives until the absolute time ``until``
        (seconds since 1970), or until :meth:`release_pin`. ``name`` rewrites an existing pin
        (its shards shrink as an epoch goes on); assumes you hold the lock.
        """
        self.check_layout()
        if name is None:
            name = f"pin-{uuid.uuid4().hex}.json"
        elif not PIN_NAME.match(name):
            raise ValueError(f"{name!r} is not the name of a resume pin")
        pid, start = _proc.this_process()
        body = {"pid": pid, "start_time": start, "host": _proc.this_host(), "created": time.time(),
                "holder": holder, "run": run, "seqs": sorted(seqs), "until": float(until)}
        atomic_write_bytes(os.path.join(self.leases_dir, name), _dumps(body), self.file_mode)
        return name

    def read_pin(self, name: str) -> dict[str, Any] | None:
        """The pin named ``name``, checked as every lease is; ``None`` if it is gone or damaged."""
        if not PIN_NAME.match(name):
            raise ValueError(f"{name!r} is not the name of a resume pin")
        try:
            lease, _ = self._read_lease(os.path.join(self.leases_dir, name))
        except CacheFormatError as exc:
            logger.warning("%s; the pin is treated as expired", exc)
            return None
        return lease if lease is not None and "until" in lease else None

    def release_pin(self, name: str) -> bool:
        """Delete the pin named ``name``; whether it was there. Never through a linked ``leases/``."""
        if not PIN_NAME.match(name):
            raise ValueError(f"{name!r} is not the name of a resume pin")
        self.check_layout()
        return _unlink_quiet(os.path.join(self.leases_dir, name))

    def irregular_leases(self) -> list[str]:
        """Entries of ``leases/`` that are not regular files (directories, links): ignored, reported."""
        return sorted(e.path for e in _scandir(self.leases_dir) if not _is_regular(e))

    def _read_lease(self, path: str) -> tuple[dict[str, Any] | None, float]:
        read = read_state_file(path, f"lease {path}")
        if read is None:
            return None, 0.0
        lease, heartbeat = read
        _check_lease(lease, path)
        return lease, heartbeat

    def _read_json(self, path: str) -> dict[str, Any] | None:
        read = read_state_file(path, path)
        return None if read is None else read[0]

    def _read_json_quiet(self, path: str) -> dict[str, Any] | None:
        try:
            return self._read_json(path)
        except CacheFormatError:
            return None


#: A cache's id in ``growcache.json`` (a uuid4's hex digits).
CACHE_ID = re.compile(r"^[0-9a-f]{32}$")
#: File names of resume pins in ``leases/`` (:meth:`Manifest.write_pin`).
PIN_NAME = re.compile(r"^pin-[0-9a-f]{32}\.json$")


def read_state_file(path: str, label: str) -> tuple[dict[str, Any], float] | None:
    """A JSON object from a state file of the cache, and the file's modification time (its
    heartbeat); ``None`` if the file is absent.

    The file is never followed through a link, and at most :data:`MAX_STATE_FILE_BYTES` are
    read: what a cache directory holds is untrusted.

    Raises:
        CacheFormatError: a link, a directory or a device there, an unreadable or oversized
            file, or one that does not hold a JSON object.
    """
    try:
        # O_NONBLOCK: a FIFO put there must not hang the open; its type is checked right after.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
        raise CacheFormatError(f"{label} is {what}, not a file growcache wrote; the cache is damaged. Move it "
                               "away and restore the file.") from None
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        # Checked on the bare fd: os.fdopen refuses a directory with a raw IsADirectoryError,
        # and leaves the descriptor open.
        os.close(fd)
        raise CacheFormatError(f"{label} is not a regular file (a directory or a device); the cache is "
                               "damaged. Move it away and restore the file.")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_STATE_FILE_BYTES + 1)
    if len(raw) > MAX_STATE_FILE_BYTES:
        raise CacheFormatError(f"{label} is larger than {MAX_STATE_FILE_BYTES >> 20} MiB, far more than growcache "
                               "writes; the file is damaged. Move it away and restore it.")
    return _parse_json(raw, label), info.st_mtime


def _parse_json(raw: bytes, label: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise CacheFormatError(f"{label} is not valid JSON ({exc}); the file is damaged") from None
    except RecursionError:  # arrays nested thousands deep: no file growcache writes
        raise CacheFormatError(f"{label} nests its JSON too deep for any file growcache writes; the file is "
                               "damaged") from None
    if not isinstance(data, dict):
        raise CacheFormatError(f"{label} does not hold a JSON object; the file is damaged")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_lease(lease: dict[str, Any], path: str) -> None:
    """Raise :class:`CacheFormatError` unless ``lease`` has the fields a lease is written with."""
    start_time = lease.get("start_time")
    seqs = lease.get("seqs")
    expiry = lease.get("expiry")
    if not (_is_int(lease.get("pid")) and lease["pid"] > 0):
        problem = f"its pid is {lease.get('pid')!r}, not a positive integer"
    elif not ((_is_int(start_time) and start_time >= 0) or (start_time is None and (
            not _proc.start_times_known() or lease.get("host") not in (None, _proc.this_host())))):
        # Without a start time any process here that got the pid would keep the lease alive
        # forever. Only a platform that tells none (no /proc) writes leases without one, and
        # another machine's lease lives by its heartbeat, whatever its pid.
        problem = f"its start_time is {start_time!r}, not an integer"
    elif not isinstance(lease.get("host") or "", str):
        problem = f"its host is {lease['host']!r}, not a string"
    elif not (isinstance(seqs, list) and all(_is_int(seq) and 0 < seq <= MAX_SEQ for seq in seqs)):
        problem = "its seqs are not a list of positive integers"
    elif not isinstance(lease.get("holder", ""), str):
        problem = f"its holder is {lease['holder']!r}, not a string"
    elif not isinstance(lease.get("created", 0), (int, float)) or isinstance(lease.get("created"), bool):
        problem = f"its created is {lease['created']!r}, not a time"
    elif "until" in lease and not (isinstance(lease["until"], (int, float)) and not isinstance(lease["until"], bool)
                                   and 0 < lease["until"] < 1e11):
        problem = f"its until is {lease['until']!r}, not a time"
    elif not isinstance(lease.get("run", ""), str) or len(lease.get("run", "")) > 1024:
        problem = "its run is not a string of at most 1024 characters"
    elif expiry is not None and _proc.stored_expiry(expiry) is None:
        problem = (f"its expiry is {expiry!r}, not a number of seconds between {_proc.MIN_OWNER_EXPIRY_S:g} and "
                   f"{_proc.MAX_OWNER_EXPIRY_S:g}")
    else:
        return
    raise CacheFormatError(f"lease {path} is damaged: {problem}")


def _dumps(data: dict[str, Any]) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode()


def make_dir(path: str, mode: int, *, dir_fd: int | None = None) -> None:
    """Create the directory ``path`` with exactly ``mode``; leave one that exists as it is.

    The umask would strip the bits ``Cache(mode=0o770)`` asks for (to 0o750 under the usual
    022): the group sharing the cache could then write no lease, shard or epoch file in it.
    ``dir_fd``: ``path`` is relative to that directory (see :func:`os.mkdir`).
    """
    try:
        os.mkdir(path, mode, dir_fd=dir_fd)
    except FileExistsError:
        return
    try:
        # Through a descriptor, never the name: a link swapped in meanwhile is not followed.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return  # replaced since: check_layout refuses what is there now
    try:
        os.fchmod(fd, mode)
    except OSError as exc:  # a filesystem without modes (vfat, some FUSE mounts): the cache still works
        logger.debug("cannot set mode %o on %s: %s", mode, path, exc)
    finally:
        os.close(fd)


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except FileNotFoundError:
        return []


def _is_regular(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
