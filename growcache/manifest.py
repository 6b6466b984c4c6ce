"""All reading and writing of a cache's state files is performed by this class.

Layout of a cache directory::

    growcache.json   format version, schema, capacity   (rewritten atomically)
    state.json       publish/evict counters, next seq    (rewritten atomically)
    .lock            the file lock around every change
    shards/          published shards, and .tmp-* files being written
    leases/          one JSON file per live snapshot

State files are JSON: nothing read from a cache is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable
from typing import Any

from . import _proc
from .errors import CacheFormatError

__all__ = ["FORMAT_VERSION", "Manifest", "atomic_write_bytes", "fsync_dir"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA_FILE = "growcache.json"
STATE_FILE = "state.json"
LOCK_FILE = ".lock"
SHARDS_DIR = "shards"
LEASES_DIR = "leases"


def fsync_dir(path: str) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_WRITE_TEMP = re.compile(r"\.[0-9a-f]{32}\.tmp$")  # the temporaries atomic_write_bytes names


def atomic_write_bytes(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a mix."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
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

    def remove_write_temporaries(self) -> None:
        """Delete temporaries of metadata, state and lease writes that a killed process left.

        Assumes you hold the lock: every such write happens under it, so none is in progress.
        """
        for directory in (self.root, self.leases_dir):
            for name in _listdir(directory):
                if _WRITE_TEMP.search(name):
                    _unlink_quiet(os.path.join(directory, name))

    # -- metadata ---------------------------------------------------------------------------
    def read_metadata(self) -> dict[str, Any] | None:
        """The metadata, or ``None`` for a directory that is not a cache yet."""
        data = self._read_json(self.metadata_path)
        if data is None:
            return None
        version = data.get("format_version")
        if not isinstance(version, int):
            raise CacheFormatError(
                f"{self.metadata_path} has no integer 'format_version'; this is not a growcache "
                "cache, or its metadata is damaged. Point Cache() at another directory."
            )
        if version > FORMAT_VERSION:
            raise CacheFormatError(
                f"{self.metadata_path} is format version {version}, newer than the version {FORMAT_VERSION} "
                "this growcache understands. Upgrade growcache to read it; it is refused rather than misread."
            )
        return data

    def write_metadata(self, data: dict[str, Any]) -> None:
        """Replace the metadata. Assumes you hold the lock."""
        atomic_write_bytes(self.metadata_path, _dumps(data), self.file_mode)

    # -- counters ---------------------------------------------------------------------------
    def read_state(self) -> dict[str, int]:
        """Publish and eviction counters."""
        state = {"next_seq": 1, "published": 0, "published_bytes": 0, "evicted": 0, "evicted_bytes": 0}
        state.update(self._read_json(self.state_path) or {})
        return state

    def write_state(self, state: dict[str, int]) -> None:
        """Replace the counters. Assumes you hold the lock."""
        atomic_write_bytes(self.state_path, _dumps(state), self.file_mode)

    # -- leases -----------------------------------------------------------------------------
    def write_lease(self, seqs: Iterable[int], holder: str = "") -> str:
        """Record a lease on ``seqs`` for this process and return its file path."""
        pid, start = _proc.this_process()
        path = os.path.join(self.leases_dir, f"{pid}-{uuid.uuid4().hex}.json")
        body = {"pid": pid, "start_time": start, "host": _proc.this_host(), "created": time.time(),
                "holder": holder, "seqs": sorted(seqs)}
        atomic_write_bytes(path, _dumps(body), self.file_mode)
        return path

    def live_leases(self, *, remove_dead: bool = False) -> list[dict[str, Any]]:
        """Every lease whose holder process is alive. Dead holders' leases expire here.

        Args:
            remove_dead: delete expired lease files; only with the lock held. Default: ``False``.
        """
        leases = []
        for name in _listdir(self.leases_dir):
            if not name.endswith(".json") or name.endswith(".tmp"):
                continue
            path = os.path.join(self.leases_dir, name)
            try:
                lease = self._read_json(path)
                if lease is not None:
                    _check_lease(lease, path)
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
            if _proc.is_alive(lease["pid"], lease.get("start_time"), lease.get("host")):
                lease["path"] = path
                leases.append(lease)
                if lease.get("host") not in (None, _proc.this_host()) and path not in _FOREIGN_WARNED:
                    _FOREIGN_WARNED.add(path)
                    logger.warning(
                        "lease %s (holder %r) was taken on another machine: its shards stay until that process "
                        "closes it, since no process check reaches another machine. If that trainer is gone, "
                        "delete the file. A cache directory is meant for the processes of one machine.",
                        path, lease.get("holder", ""))
            elif remove_dead:
                _unlink_quiet(path)
        return leases

    def _read_json(self, path: str) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise CacheFormatError(
                f"{path} is not valid JSON ({exc}); the file is damaged. Restore it or remove the cache directory."
            ) from exc
        if not isinstance(data, dict):
            raise CacheFormatError(f"{path} does not hold a JSON object; the file is damaged.")
        return data


_FOREIGN_WARNED: set[str] = set()  # leases of other machines already warned about, per process


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_lease(lease: dict[str, Any], path: str) -> None:
    """Raise :class:`CacheFormatError` unless ``lease`` has the fields a lease is written with."""
    start_time = lease.get("start_time")
    seqs = lease.get("seqs")
    if not (_is_int(lease.get("pid")) and lease["pid"] > 0):
        problem = f"its pid is {lease.get('pid')!r}, not a positive integer"
    elif start_time is not None and not _is_int(start_time):
        problem = f"its start_time is {start_time!r}, not an integer"
    elif not isinstance(lease.get("host") or "", str):
        problem = f"its host is {lease['host']!r}, not a string"
    elif not (isinstance(seqs, list) and all(_is_int(seq) for seq in seqs)):
        problem = "its seqs are not a list of integers"
    else:
        return
    raise CacheFormatError(f"lease {path} is damaged: {problem}")


def _dumps(data: dict[str, Any]) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode()


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
