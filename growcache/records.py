"""TFRecord framing: ``uint64 length | masked crc32c(length) | data | masked crc32c(data)``.

This is the exact framing of TensorFlow's ``TFRecordWriter``, so every shard growcache
writes is read by ``tf.data.TFRecordDataset`` and by the ``tfrecord`` package, and shards
written by TensorFlow are read here. Unlike the ``tfrecord`` package, the reader checks
both CRCs of every record.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import crc32c as _crc32c

from .errors import CorruptShardError
from .shard import ShardInfo

__all__ = [
    "check_records",
    "compressed_file_message",
    "count_checked",
    "detect_compression",
    "frame_footer",
    "frame_header",
    "iter_records",
    "masked_crc32c",
    "starts_tfrecord",
    "unmask_crc32c",
]

_MASK_DELTA = 0xA282EAD8
HEADER_BYTES = 12
FOOTER_BYTES = 4
_LENGTH = struct.Struct("<Q")
_LENGTH_AND_CRC = struct.Struct("<QI")
_CRC = struct.Struct("<I")
_READ_CHUNK = 8 << 20


# The C function itself, not a wrapper: the writer calls it per piece of every record.
crc32c = _crc32c.crc32c
"""CRC32C of ``data`` (any buffer), continuing from ``value``; hardware-accelerated."""


def masked_crc32c(data: Any, value: int = 0) -> int:
    """TFRecord's masked CRC32C of ``data``."""
    return _mask(crc32c(data, value))


def _mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def unmask_crc32c(masked: int) -> int:
    """Inverse of the TFRecord mask: the plain CRC32C stored in a frame."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def frame_header(length: int) -> bytes:
    """The 12 bytes before a record of ``length`` bytes."""
    length_bytes = _LENGTH.pack(length)
    return length_bytes + _CRC.pack(masked_crc32c(length_bytes))


def frame_footer(data_crc: int) -> bytes:
    """The 4 bytes after a record whose plain CRC32C is ``data_crc``."""
    # The mask inlined: this runs once per record written.
    return _CRC.pack((((data_crc >> 15) | (data_crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF)


def frame_pieces(pieces: Iterable[Any]) -> tuple[list[Any], int]:
    """Frame one record given as buffers; return ``(buffers to write, total bytes)``."""
    pieces = list(pieces)
    length = sum(memoryview(p).nbytes for p in pieces)
    crc = 0
    for piece in pieces:
        crc = crc32c(piece, crc)
    return [frame_header(length), *pieces, frame_footer(crc)], length + HEADER_BYTES + FOOTER_BYTES


def iter_records(
    path: str | os.PathLike,
    *,
    verify: bool = True,
    expected: int | None = None,
    max_record_bytes: int | None = None,
    file: Any = None,
) -> Iterator[tuple[int, memoryview]]:
    """Yield ``(offset, record)`` for every record of a TFRecord file.

    The record is a view into a reused buffer, valid until the next iteration: copy it
    (``bytes(record)``) to keep it.

    Every length is checked against the file's size before anything is allocated for it,
    so a crafted length can neither misframe the file nor exhaust memory; with ``verify``, a
    record longer than the 8 MiB read buffer has its CRC checked in pieces before it is
    read whole, so a length that a sparse file backs costs no memory unless it is true. A file named like
    a published shard must hold exactly the records and bytes its name states: a shard cut
    at a record boundary is as corrupt as one cut mid-record, and never ends quietly short.

    Args:
        path: the shard file.
        verify: check both CRC32Cs of every record. The length CRC, truncation and the record
            count are always checked, since a wrong length would misframe the rest.
            Default: ``True``.
        expected: the number of records the file must hold. Default: the count a published
            shard's file name states; no count check for files named otherwise.
        max_record_bytes: refuse longer records as corrupt, before reading them. Default:
            ``None`` (any length the file can hold).
        file: the shard already opened (unbuffered, from its start), read instead of ``path``,
            which then only names it: a caller that checked what it opened reads just that.
            Default: ``None``: ``path`` is opened.

    Raises:
        CorruptShardError: a CRC mismatch, a truncated record, a record count or size that
            differs from the shard's name, or a record longer than ``max_record_bytes``;
            with the file and byte offset.
    """
    path = os.fspath(path)
    with _opened(path, file) as opened:
        reader = _FrameReader(opened, path, expected, max_record_bytes)
        yield from reader.frames(verify, whole=True)  # type: ignore[misc]


def _opened(path: str, file: Any) -> Any:
    return open(path, "rb", buffering=0) if file is None else contextlib.nullcontext(file)


def check_records(path: str | os.PathLike, *, expected: int | None = None, file: Any = None) -> int:
    """Check every CRC32C of a TFRecord file and return its record count.

    Like :func:`iter_records` (same checks, same errors), but records are never held
    whole: each payload's CRC is computed over chunks of at most 8 MiB, so memory stays
    bounded whatever length a record claims. ``Cache.verify`` uses it. ``file``: as in
    :func:`iter_records`.
    """
    path = os.fspath(path)
    with _opened(path, file) as opened:
        return sum(1 for _ in _FrameReader(opened, path, expected, None).frames(verify=True, whole=False))


def check_named_size(path: str | os.PathLike) -> None:
    """Check that a shard's file holds the bytes its name states (one ``stat``; no read).

    A shard cut short or grown, even at a record boundary, fails it. Files whose names
    state nothing pass.

    Raises:
        CorruptShardError: the size differs from the name's, at the first byte that differs.
    """
    path = os.fspath(path)
    named = ShardInfo.from_path(path)
    if named is not None:
        size = os.stat(path).st_size
        if size != named.nbytes:
            raise _named_size_error(path, size, named.nbytes)


def _named_size_error(path: str, size: int, named_bytes: int) -> CorruptShardError:
    return CorruptShardError(path, min(size, named_bytes), f"has {size} bytes, its name says {named_bytes}")


def count_checked(path: str | os.PathLike, frames: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    """Pass on another reader's ``(offset, record)`` frames of ``path``, checking their count.

    For readers that frame records without :func:`iter_records` (the ``tfrecord``
    package's, say): a file named like a published shard that yields fewer or more records
    than its name states raises :class:`CorruptShardError`, like :func:`iter_records`.
    """
    named = ShardInfo.from_path(os.fspath(path))
    if named is None:
        yield from frames
        return
    count = 0
    for offset, record in frames:
        if count >= named.records:
            raise CorruptShardError(path, offset, f"holds more records than the {named.records} its name says")
        count += 1
        yield offset, record
    if count != named.records:
        raise CorruptShardError(path, os.path.getsize(path), f"holds {count} records, its name says "
                                                             f"{named.records}: the shard was cut short")


class _FrameReader:
    """Reads frames from an unbuffered file through one large reusable buffer.

    Records that fit in the buffer are returned as slices of it (no copy); larger ones are
    read into a dedicated buffer, or (``whole=False``) only checked, chunk by chunk. One
    ``readinto`` serves many small records.
    """

    def __init__(self, file: Any, path: str, expected: int | None, max_record_bytes: int | None) -> None:
        self.file = file
        self.path = path
        self.size = os.fstat(file.fileno()).st_size
        named = ShardInfo.from_path(path)
        self.expected = expected if expected is not None else named.records if named is not None else None
        self.max_record_bytes = max_record_bytes
        if named is not None and self.size != named.nbytes:
            # Checked at the end, not here: a cut inside a record is reported at that record.
            self.named_bytes: int | None = named.nbytes
        else:
            self.named_bytes = None
        self.buffer = bytearray(min(_READ_CHUNK, max(self.size, HEADER_BYTES)))
        self.view = memoryview(self.buffer)
        self.start = 0  # file offset of buffer[0]
        self.filled = 0  # valid bytes in buffer
        self.big = bytearray()

    def _fill(self, offset: int, need: int) -> memoryview:
        """Return a view of ``need`` bytes at file ``offset`` (``need`` <= buffer size)."""
        begin = offset - self.start
        if begin < 0 or begin + need > self.filled:
            keep = max(self.filled - begin, 0) if begin >= 0 else 0
            if keep:
                self.view[:keep] = self.view[begin:begin + keep]
            self.start = offset
            self.filled = keep
            self.file.seek(offset + keep)
            while self.filled < need:
                got = self.file.readinto(self.view[self.filled:])
                if not got:
                    break
                self.filled += got
            begin = 0
            if self.filled < need:
                raise CorruptShardError(self.path, offset, "file shrank while it was read")
        return self.view[begin:begin + need]

    def _read_exactly(self, offset: int, into: memoryview) -> None:
        self.file.seek(offset)
        got = 0
        while got < len(into):
            n = self.file.readinto(into[got:])
            if not n:
                raise CorruptShardError(self.path, offset, "file shrank while it was read")
            got += n
        self.filled = 0  # the reusable buffer no longer mirrors the file position

    def _check_pieces(self, offset: int, length: int) -> None:
        """Check the data CRC of the record at ``offset`` chunk by chunk, never holding it whole."""
        crc, position, end = 0, offset + HEADER_BYTES, offset + HEADER_BYTES + length
        capacity = len(self.buffer)
        while position < end:
            chunk = self.view[:min(capacity, end - position)]
            self._read_exactly(position, chunk)
            crc = crc32c(chunk, crc)
            position += len(chunk)
        footer = self.view[:FOOTER_BYTES]
        self._read_exactly(end, footer)
        if _mask(crc) != _CRC.unpack(footer)[0]:
            raise CorruptShardError(self.path, offset, "data CRC32C mismatch (corrupt record payload)")

    def frames(self, verify: bool, whole: bool) -> Iterator[tuple[int, memoryview | None]]:
        """Yield ``(offset, data)``; ``whole=False`` never holds a record larger than the
        buffer (it yields ``None`` as the data of those, after checking their CRC)."""
        path, size, offset, count = self.path, self.size, 0, 0
        capacity = len(self.buffer)
        while offset < size:
            if size - offset < HEADER_BYTES:
                raise CorruptShardError(path, offset, f"truncated record header ({size - offset} of 12 bytes)")
            header = self._fill(offset, HEADER_BYTES)
            length, length_crc = _LENGTH_AND_CRC.unpack(header)
            if masked_crc32c(header[:8]) != length_crc:
                raise CorruptShardError(path, offset, "length CRC32C mismatch (corrupt record header)")
            # Before any allocation: a length the file cannot hold is never trusted.
            if length > size - offset - HEADER_BYTES - FOOTER_BYTES:
                raise CorruptShardError(
                    path, offset, f"truncated record: needs {length + 16} bytes, file has {size - offset} left"
                )
            if self.max_record_bytes is not None and length > self.max_record_bytes:
                raise CorruptShardError(path, offset, f"a record of {length} bytes, more than the "
                                                      f"{self.max_record_bytes} bytes a record may have here")
            if self.expected is not None and count >= self.expected:
                raise CorruptShardError(path, offset, f"holds more records than the {self.expected} its name says")
            frame_bytes = length + HEADER_BYTES + FOOTER_BYTES
            data: memoryview | None
            if frame_bytes <= capacity:
                frame = self._fill(offset, frame_bytes)
                data = frame[HEADER_BYTES:HEADER_BYTES + length]
                stored = _CRC.unpack(frame[HEADER_BYTES + length:])[0]
                if verify and masked_crc32c(data) != stored:
                    raise CorruptShardError(path, offset, "data CRC32C mismatch (corrupt record payload)")
            elif whole:
                if verify:
                    # Checked in bounded pieces before any of it is held: a length that a sparse
                    # or damaged file can back claims gigabytes the CRC then refuses.
                    self._check_pieces(offset, length)
                try:
                    if len(self.big) < length + FOOTER_BYTES:
                        self.big = bytearray(length + FOOTER_BYTES)
                except MemoryError:
                    self.big = bytearray()
                    raise CorruptShardError(path, offset, f"a record of {length} bytes does not fit in memory") from None
                big = memoryview(self.big)[:length + FOOTER_BYTES]
                self._read_exactly(offset + HEADER_BYTES, big)
                data = big[:length]
                if verify and masked_crc32c(data) != _CRC.unpack(big[length:])[0]:  # changed since its check
                    raise CorruptShardError(path, offset, "data CRC32C mismatch (corrupt record payload)")
            else:
                self._check_pieces(offset, length)
                data = None
            count += 1
            yield offset, data
            offset += frame_bytes
        if self.expected is not None and count != self.expected:
            raise CorruptShardError(path, offset, f"holds {count} records, its name says {self.expected}: "
                                                  "the shard was cut short")
        if self.named_bytes is not None:
            raise _named_size_error(path, size, self.named_bytes)


#: ``zlib.decompressobj``'s ``wbits`` for each compression :func:`detect_compression` names.
INFLATE_WBITS = {"GZIP": 16 + zlib.MAX_WBITS, "ZLIB": zlib.MAX_WBITS}


def _record_header_ok(head: bytes) -> bool:
    """Whether ``head`` starts with a record length whose CRC holds."""
    return len(head) >= HEADER_BYTES and masked_crc32c(head[:8]) == _CRC.unpack_from(head, 8)[0]


def detect_compression(head: bytes) -> str | None:
    """``"GZIP"``, ``"ZLIB"`` or ``None`` (a plain TFRecord file, or not a TFRecord file at all).

    A plain file's first 12 bytes are a record length and its CRC, which no compressed
    stream matches by chance; GZIP starts with ``1f 8b``; ZLIB with a 2-byte header whose
    check bits hold, and its first bytes must then inflate to a valid record header.
    """
    if _record_header_ok(head):
        return None
    if head[:2] == b"\x1f\x8b":
        return "GZIP"
    if len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0:
        try:
            inflated = zlib.decompressobj(zlib.MAX_WBITS).decompress(head, HEADER_BYTES)
        except zlib.error:
            return None
        if len(inflated) < HEADER_BYTES or _record_header_ok(inflated):
            return "ZLIB"
    return None


def starts_tfrecord(head: bytes) -> bool:
    """Whether a file's first bytes ``head`` start a TFRecord file: plain, GZIP or ZLIB."""
    compression = detect_compression(head)
    if compression is not None:
        try:
            head = zlib.decompressobj(INFLATE_WBITS[compression]).decompress(head)
        except zlib.error:
            return False
    return _record_header_ok(head)


def compressed_file_message(source: str, compression: str, cache_path: str | None = None) -> str:
    """What to tell a user who gave a compressed file where a plain one is needed."""
    target = cache_path or "CACHE_DIR"
    return (f"{source} is a {compression}-compressed TFRecord file, not a corrupt one: a cache holds uncompressed "
            f"shards. Run `growcache import {source} {target}`, which decompresses it (and checks every record), "
            "or decompress it first.")
