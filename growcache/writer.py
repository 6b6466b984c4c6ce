"""ShardWriter: writes records to a temporary file and publishes it atomically."""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable, Container, Mapping
from typing import Any, Protocol

from . import _proc
from ._vectored_io import write_all
from .errors import CacheFullError, SchemaError
from .example import ExampleCodec
from .manifest import create_file
from .records import FOOTER_BYTES, HEADER_BYTES, crc32c, frame_footer, frame_header, frame_pieces
from .schema import Schema
from .shard import SHARD_SUFFIX, TMP_PREFIX, ShardInfo, scan_shards

__all__ = ["Publish", "ShardWriter"]

logger = logging.getLogger(__name__)

# Records smaller than this are copied into a staging buffer that is written out
# _STAGE_BYTES at a time; larger ones go from the caller's arrays to the kernel in one
# writev. Either way write() keeps no reference to the caller's arrays once it returns,
# so a sample function may refill one array in place. The copy costs about 1 us per
# 16 KiB record, a fraction of the syscall it saves.
_DIRECT_FRAME_BYTES = 256 << 10
_STAGE_BYTES = _DIRECT_FRAME_BYTES  # so every record that is staged fits
_FALLOC_FL_KEEP_SIZE = 1  # linux/falloc.h


def _linux_fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's ``fallocate(fd, mode, offset, len)`` (Linux only; Python has only ``posix_fallocate``,
    which grows the file), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


_fallocate: Any = None  # looked up on first use


def temp_shard_name(token: str) -> str:
    """A temporary name that tells which process of which machine writes it, and the heartbeat
    expiry it is kept alive for, so stale ones can be found by evidence alone."""
    pid, start = _proc.this_process()
    return f"{TMP_PREFIX}{pid}-{start or 0}-{_proc.this_host()}-{token}-{_proc.beat_expiry():g}{SHARD_SUFFIX}"


def temp_owner(name: str) -> tuple[int, int | None, str | None] | None:
    """``(pid, start time, host tag)`` of the writer of a temporary, or ``None`` if it is not one.

    Names written before the host tag existed have three parts and give ``None`` as the host.
    """
    owner = _temp_fields(name)
    return None if owner is None else owner[:3]


def temp_token(name: str) -> int | None:
    """The random token of a temporary's name (12 hex digits; see :func:`temp_shard_name`), or ``None``
    if ``name`` is not a temporary with one."""
    if not name.startswith(TMP_PREFIX) or len(name) > 255:
        return None
    parts = name[len(TMP_PREFIX):].removesuffix(SHARD_SUFFIX).split("-")
    # pid-start-token (before the host tag), pid-start-host-token, pid-start-host-token-expiry
    field = parts[2] if len(parts) == 3 else parts[3] if len(parts) in (4, 5) else ""
    try:
        return int(field, 16) if len(field) == 12 else None
    except ValueError:
        return None


def _temp_fields(name: str) -> tuple[int, int | None, str | None, float | None] | None:
    """:func:`temp_owner` and the expiry the name states (``None``: older names, or a bad value)."""
    if not name.startswith(TMP_PREFIX) or len(name) > 255:
        return None
    parts = name[len(TMP_PREFIX):].removesuffix(SHARD_SUFFIX).split("-")
    try:
        pid, start = int(parts[0]), int(parts[1]) or None
    except (IndexError, ValueError):
        return None
    try:
        expiry = _proc.stored_expiry(float(parts[4])) if len(parts) >= 5 else None
    except ValueError:
        expiry = None
    return pid, start, parts[2] if len(parts) >= 4 else None, expiry


def remove_abandoned_temporaries(shards_dir: str, owners: Container[int] | None = None) -> list[str]:
    """Delete the temporary shards whose writer is gone; return their names.

    A writer on this machine is judged by the pid and start time its temporary's name
    carries, so a recycled pid never costs a live writer its shard; a writer on another
    machine (or under an earlier hostname) by the temporary's heartbeat (its modification
    time, see :mod:`growcache._proc`), against the expiry its name states: the writer's own,
    never the judge's. Only regular files are ever removed.

    Args:
        shards_dir: the cache's shard directory.
        owners: only temporaries written by these pids (a pool cleaning up after its own
            workers). Default: ``None``, any writer's.
    """
    removed = []
    for name in scan_shards(shards_dir).temporaries:
        owner = _temp_fields(name)
        if owner is None or (owners is not None and owner[0] not in owners):
            continue
        path = os.path.join(shards_dir, name)
        try:
            heartbeat = os.lstat(path).st_mtime
        except FileNotFoundError:
            continue
        if _proc.is_alive(*owner[:3], heartbeat, owner[3]):
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


class Publish(Protocol):
    """Publishes a finished temporary shard (``Cache`` gives its writers one).

    Called with the temporary's path, its records and bytes, and keywords ``timeout``
    (seconds to wait for room, ``None``: no limit) and ``should_stop``; returns the
    published shard, or raises (the caller then removes the temporary).
    """

    def __call__(self, tmp_path: str, records: int, nbytes: int, *, timeout: float | None,
                 should_stop: Callable[[], bool] | None) -> ShardInfo: ...


class ShardWriter:
    """Writes samples as TFRecord-framed ``tf.train.Example`` records into one new shard.

    Records go to a temporary file in the cache's shard directory; :meth:`close` fsyncs
    it and hands it to ``publish``, which renames it into place with ``os.replace``, so no
    reader ever sees a partial shard. Get one from :meth:`Cache.writer`.

    Args:
        schema: the features of every record.
        shards_dir: the directory of the temporary file (the cache's shard directory).
        publish: publishes the finished temporary (see :class:`Publish`).
        max_bytes: the largest shard allowed (the cache's capacity); a larger one is a
            :class:`CacheFullError` as soon as it grows past it.
        file_mode: permission bits of the temporary file. Default: ``0o600``.
        publish_timeout: seconds :meth:`close` may wait for leases to free room in the
            budget; ``None`` waits as long as it takes. Default: ``None``.
        should_stop: called while waiting for room; returning ``True`` abandons the wait
            and discards the shard (a stopping sampler uses it). Default: ``None``.
        durable: fsync the shard and directory on publish. Default: ``True``.
    """

    def __init__(
        self,
        schema: Schema,
        shards_dir: str,
        publish: Publish,
        *,
        max_bytes: int,
        file_mode: int = 0o600,
        publish_timeout: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        durable: bool = True,
    ) -> None:
        if not isinstance(schema, Schema):
            raise SchemaError(f"ShardWriter needs a Schema, got {type(schema).__name__}: get one from cache.writer()")
        self.schema = schema
        self.codec = ExampleCodec(schema)
        self.max_bytes = max_bytes
        self.publish_timeout = publish_timeout
        self.should_stop = should_stop
        self.durable = durable
        self.records = 0
        self.nbytes = 0
        self._publish = publish
        self._cache_path = os.path.dirname(os.path.abspath(shards_dir))  # for messages
        self.path = os.path.join(shards_dir, temp_shard_name(os.urandom(6).hex()))
        self._owner_pid = os.getpid()
        self._fd: int | None = create_file(self.path, file_mode)
        # Another machine judges this temporary by its heartbeat; a slow sampler may not
        # write to it for longer than the expiry.
        _proc.keep_alive(self.path)
        self._stage: memoryview | None = None  # allocated on the first small record
        self._staged = 0
        self._reserved = 0  # bytes of disk set aside past the end of the file (see reserve)
        # Every record of a schema has the same length, so its frame header and the Example
        # bytes before the first payload are one constant piece, and that prefix's CRC is
        # computed once. Small records are written tens of thousands per second, and each
        # Python call saved per record shows in the throughput.
        first_prefix, *later_prefixes = self.codec.prefixes
        self._record_head = frame_header(self.codec.record_nbytes) + first_prefix
        self._record_head_crc = crc32c(first_prefix)
        self._record_frame_bytes = self.codec.record_nbytes + HEADER_BYTES + FOOTER_BYTES
        names = [name for name, _, _ in self.codec.layout]
        self._payload_then_prefix = list(zip(names, [*later_prefixes, b""]))

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        # A forked child's copy must not discard the parent's shard.
        if getattr(self, "_fd", None) is not None and os.getpid() == getattr(self, "_owner_pid", None):
            self.abort()

    @property
    def closed(self) -> bool:
        """True once the shard was published or discarded."""
        return self._fd is None

    def write(self, sample: Mapping[str, Any]) -> None:
        """Validate ``sample`` against the schema and append it as one record.

        The record is copied or written out before this returns, so the sample's arrays may
        be refilled in place for the next sample.

        Raises:
            SchemaError: the sample does not match the cache's schema.
            CacheFullError: the shard grew larger than the cache's whole budget, or the
                disk is full. The temporary file is removed; the cache is untouched.
        """
        arrays = self.schema.validate(sample)
        if not self.codec.fixed_layout:  # int64_list payloads vary in length with their values
            self._append_frame(*frame_pieces(self.codec.encode_pieces(arrays)))
            return
        pieces = [self._record_head]
        crc = self._record_head_crc
        for name, next_prefix in self._payload_then_prefix:
            payload = arrays[name]
            crc = crc32c(payload, crc)
            pieces.append(payload)
            if next_prefix:
                crc = crc32c(next_prefix, crc)
                pieces.append(next_prefix)
        pieces.append(frame_footer(crc))
        self._append_frame(pieces, self._record_frame_bytes)

    def reserve(self, nbytes: int) -> None:
        """Set aside disk space for the shard's next ``nbytes`` before they are written.

        The file system then allocates the shard's blocks in one call instead of a page at a
        time as writes arrive, which took about a third of the kernel's CPU time per GB
        written (ext4). The file's size does not change, so the shard reads as before; what is
        left unused is given back when the shard is published. Best effort: does nothing
        where the platform or file system cannot (not Linux, a full disk, tmpfs quotas).
        """
        global _fallocate
        if self._fd is None or nbytes <= 0:
            return
        if _fallocate is None:
            _fallocate = _linux_fallocate() or False
        if not _fallocate:
            return
        offset = self.nbytes
        if _fallocate(self._fd, _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0:
            self._reserved = max(self._reserved, offset + nbytes)

    def write_serialized(self, record: Any) -> None:
        """Append one already serialized record (it must follow the schema); the buffer may be reused after."""
        self._append_frame(*frame_pieces([record]))

    def _append_frame(self, pieces: list[Any], frame: int) -> None:
        if self._fd is None:
            raise ValueError(f"ShardWriter for {self.path} is closed; get a new one from cache.writer()")
        if self.nbytes + frame > self.max_bytes:
            self.abort()
            raise CacheFullError(
                f"shard {self.path} would grow to {self.nbytes + frame} bytes, more than the cache's whole "
                f"capacity of {self.max_bytes} bytes. Raise the capacity or write smaller shards "
                "(lower shard_size)."
            )
        if frame >= _DIRECT_FRAME_BYTES:
            staged = [self._stage[:self._staged]] if self._staged else []  # type: ignore[index]
            self._write_all([*staged, *pieces], self._staged + frame)
            self._staged = 0
        else:
            if self._stage is None:
                self._stage = memoryview(bytearray(_STAGE_BYTES))
            elif self._staged + frame > _STAGE_BYTES:
                self._flush()
            stage, position = self._stage, self._staged
            for piece in pieces:
                piece = memoryview(piece)
                if not piece.nbytes:  # an empty feature, e.g. shape (0, 3): cast() refuses zero dims
                    continue
                piece = piece.cast("B")
                end = position + piece.nbytes
                stage[position:end] = piece
                position = end
            self._staged = position
        self.records += 1
        self.nbytes += frame

    def _flush(self) -> None:
        if self._staged:
            self._write_all([self._stage[:self._staged]], self._staged)  # type: ignore[index]
            self._staged = 0

    def _write_all(self, buffers: list[Any], nbytes: int) -> None:
        try:
            write_all(self._fd, buffers, nbytes)  # type: ignore[arg-type]
        except OSError as exc:
            self.abort()
            raise_if_disk_full(exc, self._cache_path, f"writing {self.path}; the partial shard was removed")
            raise

    def close(self) -> ShardInfo | None:
        """Publish the shard and return it; an empty shard is discarded (returns ``None``).

        Waits while the budget is full of leased shards (see ``publish_timeout``).

        Raises:
            CacheFullError: ``publish_timeout`` passed before leases freed enough room.
        """
        if self._fd is None:
            return None
        if self.records == 0:
            self.abort()
            return None
        self._flush()
        if self._reserved > self.nbytes:
            # Give back the reserved blocks past the end. A truncation to the same size frees
            # nothing on some file systems (btrfs): grow by one byte, then cut.
            try:
                os.ftruncate(self._fd, self.nbytes + 1)
                os.ftruncate(self._fd, self.nbytes)
            except OSError as exc:
                self.abort()
                raise_if_disk_full(exc, self._cache_path, f"writing {self.path}; the partial shard was removed")
                raise
        if self.durable:
            try:
                os.fsync(self._fd)  # a filesystem that allocates late reports a full disk here
            except OSError as exc:
                self.abort()
                raise_if_disk_full(exc, self._cache_path, f"writing {self.path}; the partial shard was removed")
                raise
        fd, self._fd = self._fd, None
        try:
            # NFS reports a write that failed on the server at close; the descriptor is gone
            # either way, so it is never closed twice (its number may be another file's by then).
            os.close(fd)
        except OSError as exc:
            self.abort()
            raise_if_disk_full(exc, self._cache_path, f"writing {self.path}; the partial shard was removed")
            raise OSError(exc.errno, f"closing shard {self.path} failed ({exc.strerror}): the shard was not "
                          "published and its temporary file was removed. Check the cache's filesystem "
                          "(a network filesystem reports failed writes here)") from exc
        try:
            return self._publish(
                self.path, self.records, self.nbytes, timeout=self.publish_timeout, should_stop=self.should_stop
            )
        except BaseException:
            _unlink_quiet(self.path)
            raise
        finally:
            _proc.let_go(self.path)

    def abort(self) -> None:
        """Discard the shard and its temporary file; idempotent."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        self._stage, self._staged = None, 0
        _proc.let_go(self.path)
        _unlink_quiet(self.path)


def raise_if_disk_full(exc: OSError, path: str, doing: str) -> None:
    """Raise a :class:`CacheFullError` from ``exc`` if it says the disk is full (``ENOSPC``, ``EDQUOT``).

    Args:
        exc: the error an ``os`` call raised.
        path: the cache directory, for the message.
        doing: what failed, and what was cleaned up.
    """
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise CacheFullError(
            f"the disk holding cache {path} is full ({exc.strerror}) while {doing}. Published shards are "
            "untouched. Free disk space, or lower the cache capacity to leave room on the disk."
        ) from exc


def discard_temporary(path: str) -> None:
    """Remove a temporary shard this process wrote and kept alive, and stop its heartbeat."""
    _proc.let_go(path)
    _unlink_quiet(path)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
