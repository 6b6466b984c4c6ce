"""Framing of TFRecord shards by the ``tfrecord`` package's reader, with growcache checking the CRCs.

``make_torch_loader(reader="tfrecord")`` reads with it. It lives apart from the loader's
DataLoader wiring because it is a record reader, not PyTorch: it imports only the ``tfrecord``
package (which cannot share a process with TensorFlow).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

from growcache.errors import CorruptShardError
from growcache.records import masked_crc32c

__all__ = ["tfrecord_frames"]

_HEADER = struct.Struct("<QI")


def tfrecord_frames(path: str, verify: bool) -> Iterator[tuple[int, memoryview]]:
    """Frame records with the ``tfrecord`` package's reader; growcache checks the CRCs.

    That reader never exposes the CRC bytes, so growcache reads them itself (``pread``
    of the 12-byte header *before* the package reads a record, which also stops a
    corrupt length from making it allocate a huge buffer; and of the 4-byte footer after).
    """
    from tfrecord.reader import tfrecord_iterator

    fd = os.open(path, os.O_RDONLY)
    records = tfrecord_iterator(path)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset < size:
            header = os.pread(fd, 12, offset)
            if len(header) < 12:
                raise CorruptShardError(path, offset, f"truncated record header ({len(header)} of 12 bytes)")
            length, length_crc = _HEADER.unpack(header)
            if masked_crc32c(header[:8]) != length_crc:
                raise CorruptShardError(path, offset, "length CRC32C mismatch (corrupt record header)")
            if offset + length + 16 > size:
                raise CorruptShardError(path, offset, f"truncated record: needs {length + 16} bytes, "
                                                      f"file has {size - offset} left")
            try:
                data = next(records)
            except (RuntimeError, StopIteration) as exc:
                raise CorruptShardError(path, offset, f"tfrecord reader failed: {exc}") from None
            if verify and masked_crc32c(data) != struct.unpack("<I", os.pread(fd, 4, offset + 12 + length))[0]:
                raise CorruptShardError(path, offset, "data CRC32C mismatch (corrupt record payload)")
            yield offset, data
            offset += length + 16
    finally:
        # The package closes its file only when its generator runs to the end; one stopped
        # early (a quota, an error) would leave it to the garbage collector, with a ResourceWarning.
        frame = records.gi_frame
        file = frame.f_locals.get("file") if frame is not None else None
        records.close()
        if file is not None:
            file.close()
        os.close(fd)
