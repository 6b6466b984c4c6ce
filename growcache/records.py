"""TFRecord framing: ``uint64 length | masked crc32c(length) | data | masked crc32c(data)``.

This is the exact framing of TensorFlow's ``TFRecordWriter``, so every shard growcache
writes is read by ``tf.data.TFRecordDataset`` and by the ``tfrecord`` package, and shards
written by TensorFlow are read here. Unlike the ``tfrecord`` package, the reader checks
both CRCs of every record.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import crc32c as _crc32c

from .errors import CorruptShardError

__all__ = ["frame_footer", "frame_header", "iter_records", "masked_crc32c", "unmask_crc32c"]

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


def iter_records(path: str | os.PathLike, *, verify: bool = True) -> Iterator[tuple[int, memoryview]]:
    """Yield ``(offset, record)`` for every record of a TFRecord file.

    The record is a view into a reused buffer, valid until the next iteration: copy it
    (``bytes(record)``) to keep it.

    Args:
        path: the shard file.
        verify: check both CRC32Cs of every record. The length CRC and truncation are
            always checked, since a corrupt length would misframe the rest. Default: ``True``.

    Raises:
        CorruptShardError: a CRC mismatch or a truncated record, with the file and offset.
    """
    path = os.fspath(path)
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        reader = _FrameReader(file, path, size)
        yield from reader.records(verify)


class _FrameReader:
    """Reads frames from an unbuffered file through one large reusable buffer.

    Records that fit in the buffer are returned as slices of it (no copy); larger ones are
    read into a dedicated buffer. One ``readinto`` serves many small records.
    """

    def __init__(self, file: Any, path: str, size: int) -> None:
        self.file = file
        self.path = path
        self.size = size
        self.buffer = bytearray(min(_READ_CHUNK, max(size, HEADER_BYTES)))
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

    def records(self, verify: bool) -> Iterator[tuple[int, memoryview]]:
        path, size, offset = self.path, self.size, 0
        capacity = len(self.buffer)
        while offset < size:
            if size - offset < HEADER_BYTES:
                raise CorruptShardError(path, offset, f"truncated record header ({size - offset} of 12 bytes)")
            header = self._fill(offset, HEADER_BYTES)
            length, length_crc = _LENGTH_AND_CRC.unpack(header)
            if masked_crc32c(header[:8]) != length_crc:
                raise CorruptShardError(path, offset, "length CRC32C mismatch (corrupt record header)")
            end = offset + HEADER_BYTES + length + FOOTER_BYTES
            if end > size:
                raise CorruptShardError(
                    path, offset, f"truncated record: needs {length + 16} bytes, file has {size - offset} left"
                )
            frame_bytes = length + HEADER_BYTES + FOOTER_BYTES
            if frame_bytes <= capacity:
                frame = self._fill(offset, frame_bytes)
                data = frame[HEADER_BYTES:HEADER_BYTES + length]
                footer = frame[HEADER_BYTES + length:]
            else:
                if len(self.big) < length + FOOTER_BYTES:
                    self.big = bytearray(length + FOOTER_BYTES)
                big = memoryview(self.big)[:length + FOOTER_BYTES]
                self.file.seek(offset + HEADER_BYTES)
                got = 0
                while got < len(big):
                    n = self.file.readinto(big[got:])
                    if not n:
                        raise CorruptShardError(path, offset, "file shrank while it was read")
                    got += n
                self.filled = 0
                data, footer = big[:length], big[length:]
            if verify and masked_crc32c(data) != _CRC.unpack(footer)[0]:
                raise CorruptShardError(path, offset, "data CRC32C mismatch (corrupt record payload)")
            yield offset, data
            offset = end
