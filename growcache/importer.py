"""Bringing existing TFRecord files into a cache: ``growcache import``, ``growcache schema``.

Files are read as a stream of chunks from any fsspec URL (local paths and globs
included), with the retries and credential redaction of :mod:`growcache.sources`.
GZIP and ZLIB files (``TFRecordOptions(compression_type=...)``) are detected from their
first bytes and decompressed on the way. Every record's framing and both CRC32Cs are
checked, every record is checked against the schema, and the verified frames are
written unchanged, never re-encoded, into temporary shards of the cache, cut at record
boundaries when ``max_shard_records`` or ``max_shard_bytes`` says so.

:class:`TFRecordFiles` is that reader; :class:`~growcache.shard_source.TFRecordShardSource`
builds on it to stream a remote dataset through a cache.
"""

from __future__ import annotations

import ast
import collections
import errno
import itertools
import logging
import math
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _proc
from ._retry import RetryPolicy
from ._size import parse_size
from ._vectored_io import IOV_MAX, write_all
from .errors import (
    CacheFullError,
    CompressedFileError,
    CorruptShardError,
    RefusedFileError,
    SchemaError,
    SchemaMismatchError,
    SourceError,
    TransientSourceError,
)
from .example import AmbiguousRecordError, ExampleCodec, RecordChecker, scan_example
from .manifest import create_file
from .records import (
    FOOTER_BYTES,
    HEADER_BYTES,
    INFLATE_WBITS,
    compressed_file_message,
    detect_compression,
    masked_crc32c,
)
from .schema import Schema
from .store import StoreSource, _sized
from .tensor_proto import parse_tensor
from .writer import discard_temporary, temp_shard_name

if TYPE_CHECKING:
    from .cache import Cache
    from .cache_claim import CacheClaim
    from .shard import ShardInfo

__all__ = [
    "CopiedShard",
    "ImportReport",
    "TFRecordFiles",
    "detect_compression",
    "import_files",
    "infer_schema",
    "parse_schema",
]

logger = logging.getLogger(__name__)

# Memory of a copy: the chunk being framed, the next one, the frames waiting to be written
# and the record checker's staging stay within 16 MiB (plus the records themselves).
CHUNK_BYTES = 4 << 20  # bytes per read request
_WRITE_BYTES = 2 << 20  # verified frames gathered per write
INFLATE_PIECE = 1 << 20  # bytes of inflated data per inflater call
#: Without a schema (``growcache schema``, a first probe), records longer than this are refused
#: before they are read: no schema says how long a record may be, and memory stays bounded.
DEFAULT_MAX_RECORD_BYTES = 64 << 20
_LENGTH_AND_CRC = struct.Struct("<QI")
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class CopiedShard:
    """A verified temporary shard in a cache's shard directory, ready to publish.

    Attributes:
        path: the temporary file.
        records: records it holds.
        nbytes: its size.
        start: stream offset of its first record in the source (uncompressed bytes).
        end: stream offset after its last record.
        last: the stream ended with it.
    """

    path: str
    records: int
    nbytes: int
    start: int
    end: int
    last: bool = False


class TFRecordFiles(StoreSource):
    """TFRecord files at a URL, glob or list of them, read as verified record streams.

    Args:
        url: a path, glob or URL (``"gs://bucket/train-*"``), or a list of them.
        storage_options: passed to fsspec (credentials, endpoints).
        retry: retry policy of transient store errors. Default: ``RetryPolicy()``.
        chunk_bytes: bytes per read request. Default: 4 MiB.
    """

    def __init__(self, url: str | Sequence[str], *, storage_options: Mapping[str, Any] | None = None,
                 retry: RetryPolicy | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(url, storage_options=storage_options, retry=retry)
        self.chunk_bytes = int(chunk_bytes)

    def sample(self, rng: Any) -> Any:
        raise TypeError(f"{type(self).__name__} reads whole TFRecord files; it draws no samples")

    def size(self, path: str) -> int:
        """The size of ``path`` in the store."""
        fs = self.fs
        return int(self._io("reading the size of", self._url(path), lambda: _sized(lambda: fs.size(path))))

    def chunks(self, path: str, start: int = 0, size: int | None = None) -> Iterator[bytes]:
        """The raw bytes of ``path`` from ``start`` on, one read request (with retries) per chunk."""
        size = self.size(path) if size is None else size
        position = start
        while position < size:
            end = min(position + self.chunk_bytes, size)
            data = self._fetch(path, position, end)
            if not data:
                raise SourceError(f"{self._url(path)} ended at byte {position}, its size says {size}: it was "
                                  "replaced or truncated while it was read")
            position += len(data)
            yield data

    def stream(self, path: str, start: int = 0, *, on_read: Callable[[int], None] | None = None
               ) -> tuple[Iterator[bytes], str | None]:
        """``(chunks of the uncompressed stream from offset start, compression)`` of ``path``.

        A compressed file is inflated from its beginning and the first ``start`` bytes are
        dropped; a plain one is read from ``start`` by byte range. The compression is told
        by the first chunk (read once), or by its first bytes when ``start`` is past it.
        ``on_read`` is called with the size of each chunk of the file as it is read (bytes of
        the file, compressed ones for a compressed file: what a progress bar of files counts).
        """
        size = self.size(path)
        if start > 0:
            head = self._fetch(path, 0, min(size, 64))
            if detect_compression(head) is None:
                return _counted(self.chunks(path, start, size), on_read), None
        head_end = min(size, self.chunk_bytes)
        head = self._fetch(path, 0, head_end) if size else b""
        compression = detect_compression(head[:64]) if head else None
        raw = _counted(itertools.chain([head] if head else [], self.chunks(path, head_end, size)), on_read)
        if compression is None:
            return raw, None
        return _skip(_inflate(raw, compression, self._url(path)), start), compression

    def known_size(self, path: str) -> int | None:
        """The size of ``path`` where it is known without a request: from the listing of a glob,
        or from the filesystem for a local file (a directory counts 0). ``None`` for a named
        remote object: only a request per object would tell it."""
        size = self._sizes.get(path)
        if size is not None and size >= 0:
            return size
        if not _is_local(self):
            return None
        try:
            info = os.stat(path)
        except OSError:  # gone, or unreadable: its import says so
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else 0

    def total_size(self, paths: Sequence[str]) -> int | None:
        """The bytes of ``paths`` together (see :meth:`known_size`), or ``None`` if one's size is unknown."""
        total = 0
        for path in paths:
            size = self.known_size(path)
            if size is None:
                return None
            total += size
        return total


def _counted(chunks: Iterator[bytes], on_read: Callable[[int], None] | None) -> Iterator[bytes]:
    return chunks if on_read is None else _counting(chunks, on_read)


def _counting(chunks: Iterator[bytes], on_read: Callable[[int], None]) -> Iterator[bytes]:
    for chunk in chunks:
        on_read(len(chunk))
        yield chunk


def _inflate(chunks: Iterator[bytes], compression: str, source: str) -> Iterator[bytes]:
    """The inflated stream in pieces of at most ``INFLATE_PIECE`` bytes.

    Every call to the inflater is capped (``max_length``): a small file that inflates a
    thousandfold (a GZIP bomb) never lands in memory whole, and the reader downstream
    refuses an oversized record before it asks for the rest of it.
    """
    inflater = zlib.decompressobj(INFLATE_WBITS[compression])
    read = inflated = 0  # compressed bytes fed, inflated bytes given: where a damaged stream stops
    try:
        for chunk in chunks:
            read += len(chunk)
            pending = chunk
            while pending:
                data = inflater.decompress(pending, INFLATE_PIECE)
                pending = inflater.unconsumed_tail
                if data:
                    inflated += len(data)
                    yield data
                if inflater.eof and inflater.unused_data:
                    if compression != "GZIP":
                        break  # bytes after a ZLIB stream's end: ignored, as TensorFlow's reader does
                    # Concatenated gzip members: the next member starts in the unused bytes.
                    pending = inflater.unused_data + pending
                    inflater = zlib.decompressobj(INFLATE_WBITS[compression])
        while not inflater.eof:  # output zlib still holds back after the last input
            tail = inflater.decompress(b"", INFLATE_PIECE)
            if not tail:
                break
            inflated += len(tail)
            yield tail
        tail = inflater.flush()
        if tail:
            inflated += len(tail)
            yield tail
    except zlib.error as exc:
        raise CorruptShardError(source, inflated, f"{compression} data is damaged ({exc}) within the first {read} "
                                                  f"bytes of the file, after {inflated} inflated bytes (offsets count "
                                                  "inflated bytes)") from None
    if not inflater.eof:
        raise CorruptShardError(source, inflated, f"the {compression} stream is truncated (a copy cut short?): the "
                                                  f"file's {read} bytes inflate to {inflated} bytes and end "
                                                  "mid-stream (offsets count inflated bytes)")


def _skip(chunks: Iterator[bytes], count: int) -> Iterator[bytes]:
    for chunk in chunks:
        if count >= len(chunk):
            count -= len(chunk)
            continue
        yield chunk[count:] if count else chunk
        count = 0


class _Cursor:
    """Bytes of a stream of chunks, taken in runs without copying the chunks.

    A run that lies inside one chunk is a slice of it; only a run that straddles chunks
    is joined, a copy of that run alone (one frame per chunk boundary).
    """

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.buffer = b""
        self.position = 0
        self.ahead: collections.deque[bytes] = collections.deque()

    def available(self, need: int) -> int:
        """Bytes left, counted up to ``need`` (pulls chunks until there are that many, or none are left)."""
        have = len(self.buffer) - self.position + sum(len(c) for c in self.ahead)
        while have < need:
            chunk = next(self.chunks, None)
            if chunk is None:
                break
            if chunk:
                self.ahead.append(chunk)
                have += len(chunk)
        return have

    def peek(self, count: int) -> bytes:
        """The next ``count`` bytes (or fewer at the end), not consumed."""
        head = self.buffer[self.position:self.position + count]
        for chunk in self.ahead:
            if len(head) >= count:
                break
            head += chunk[:count - len(head)]
        return head

    def take(self, count: int) -> tuple[bytes, int, int]:
        """Consume ``count`` bytes (``available(count)`` said they exist): ``(buffer, start, end)``."""
        left = len(self.buffer) - self.position
        if left >= count:
            start = self.position
            self.position += count
            return self.buffer, start, start + count
        parts = [memoryview(self.buffer)[self.position:]] if left else []
        need = count - left
        self.buffer, self.position = b"", 0
        while need:
            chunk = self.ahead.popleft()
            if len(chunk) <= need:
                parts.append(chunk)
                need -= len(chunk)
            else:
                parts.append(memoryview(chunk)[:need])
                self.buffer, self.position = chunk, need
                need = 0
        joined = b"".join(parts)
        return joined, 0, count


def iter_frames(chunks: Iterator[bytes], source: str, start: int = 0, *,
                max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES
                ) -> Iterator[tuple[int, bytes, int, int, memoryview]]:
    """Frame a TFRecord byte stream, checking the length CRC, the data CRC and truncation.

    Yields ``(offset, buffer, frame start, frame end, record)``: the frame is
    ``buffer[frame start:frame end]`` (an immutable bytes object, so it may be kept;
    frames of one chunk share it) and ``record`` a view of its data. ``offset`` counts from
    the stream's ``start``.

    Args:
        chunks: the stream's bytes.
        source: the file or URL, for messages.
        start: stream offset of the first byte.
        max_record_bytes: a longer record is refused once its length is read, before any
            of it is buffered (pass the schema's :attr:`~growcache.example.ExampleCodec.max_record_bytes`).
            ``None``: no limit. Default: 64 MiB.

    Raises:
        CorruptShardError: a CRC mismatch, a truncated record, or one longer than
            ``max_record_bytes`` (source and offset).
        CompressedFileError: the stream is a compressed file's raw bytes.
    """
    cursor = _Cursor(chunks)
    offset = start
    while True:
        left = cursor.available(HEADER_BYTES)
        if left < HEADER_BYTES:
            if left:
                raise CorruptShardError(source, offset, f"truncated record header ({left} of 12 bytes)")
            return
        header = cursor.peek(HEADER_BYTES)
        length, length_crc = _LENGTH_AND_CRC.unpack(header)
        if masked_crc32c(header[:8]) != length_crc:
            if offset == 0:
                compression = detect_compression(cursor.peek(64))
                if compression is not None:
                    raise CompressedFileError(compressed_file_message(source, compression))
            raise CorruptShardError(source, offset, "length CRC32C mismatch (corrupt record header)")
        if max_record_bytes is not None and length > max_record_bytes:
            raise CorruptShardError(source, offset, f"a record of {length} bytes, longer than the {max_record_bytes} "
                                                    f"bytes {_limit_reason(max_record_bytes)}")
        frame = HEADER_BYTES + length + FOOTER_BYTES
        left = cursor.available(frame)
        if left < frame:
            raise CorruptShardError(source, offset, f"truncated record: needs {frame} bytes, the stream has "
                                                    f"{left} left")
        buffer, begin, end = cursor.take(frame)
        record = memoryview(buffer)[begin + HEADER_BYTES:end - FOOTER_BYTES]
        if masked_crc32c(record) != _CRC.unpack_from(buffer, end - FOOTER_BYTES)[0]:
            raise CorruptShardError(source, offset, "data CRC32C mismatch (corrupt record payload)")
        yield offset, buffer, begin, end, record
        offset += frame


def _limit_reason(limit: int) -> str:
    if limit == DEFAULT_MAX_RECORD_BYTES:
        return ("a record may have without a schema; if the file really holds such records, raise the limit "
                "(growcache schema/import --max-record, max_record_bytes=)")
    return "a record of this schema can have (or the limit given)"


class _TempShard:
    """A temporary shard file in a cache, written by whole runs of verified frames."""

    def __init__(self, cache: Cache, start: int) -> None:
        self.path = os.path.join(cache.shards_dir, temp_shard_name(os.urandom(6).hex()))
        self.fd = create_file(self.path, cache.file_mode)
        # A piece may wait long for its publish (the rest of the file, room in a full cache): its
        # heartbeat keeps another machine's cleanup from judging it abandoned meanwhile.
        _proc.keep_alive(self.path)
        self.records = 0
        self.nbytes = 0
        self.start = start
        self.end = start
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._run: tuple[bytes, int, int] | None = None  # frames that lie one after another in one buffer

    def add(self, buffer: bytes, start: int, end: int, offset: int) -> None:
        run = self._run
        if run is not None and run[0] is buffer and run[2] == start:
            self._run = (buffer, run[1], end)
        else:
            self._close_run()
            self._run = (buffer, start, end)
        self.records += 1
        self.nbytes += end - start
        self.end = offset + end - start
        if self._pending_bytes + (self._run[2] - self._run[1]) >= _WRITE_BYTES:
            self._close_run()
            self.flush()

    def _close_run(self) -> None:
        if self._run is not None:
            buffer, start, end = self._run
            self._pending.append(memoryview(buffer)[start:end])
            self._pending_bytes += end - start
            self._run = None
            if len(self._pending) >= IOV_MAX:
                self.flush()

    def flush(self) -> None:
        self._close_run()
        write_all(self.fd, self._pending, self._pending_bytes)
        self._pending, self._pending_bytes = [], 0

    def finish(self, last: bool = False) -> CopiedShard:
        self.flush()
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        return CopiedShard(self.path, self.records, self.nbytes, self.start, self.end, last)

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        discard_temporary(self.path)


def copy_records(
    frames: Iterator[tuple[int, bytes, int, int, memoryview]],
    cache: Cache,
    checker: RecordChecker | None,
    *,
    max_records: int | None = None,
    max_bytes: int | None = None,
    start: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Iterator[CopiedShard]:
    """Write verified frames unchanged into temporary shards of ``cache``, cut at record boundaries.

    Yields each temporary shard when it is complete (fsynced); the caller publishes or
    deletes it. A shard in progress when the frames fail, or when the caller stops
    early, is deleted.

    Args:
        frames: from :func:`iter_frames`.
        cache: the cache whose shard directory receives the files.
        checker: checks each record against the schema; ``None``: no schema check.
        max_records: records per shard at most. Default: ``None``, no limit.
        max_bytes: bytes per shard at most (a record larger than this gets a shard of its
            own). Default: ``None``, no limit.
        start: stream offset of the first frame.
        progress: called with the bytes of each frame written.
    """
    current: _TempShard | None = None
    try:
        for offset, buffer, frame_start, frame_end, record in frames:
            if checker is not None:
                checker.check(record, offset)
            size = frame_end - frame_start
            if current is not None and (
                    (max_records is not None and current.records >= max_records)
                    or (max_bytes is not None and current.nbytes + size > max_bytes)):
                if checker is not None:
                    checker.flush()
                done, current = current.finish(), None
                yield done
            if current is None:
                current = _TempShard(cache, offset)
            current.add(buffer, frame_start, frame_end, offset)
            if progress is not None:
                progress(size)
        if checker is not None:
            checker.flush()
        if current is not None:
            done, current = current.finish(last=True), None
            yield done
    finally:
        if current is not None:
            current.discard()


# -- schema inference ------------------------------------------------------------------------
def infer_schema(url: str, *, records: int = 16, storage_options: Mapping[str, Any] | None = None,
                 max_record_bytes: int | str | None = None) -> Schema:
    """The schema of a TFRecord file of ``tf.train.Example`` records, from its first records.

    ``int64_list`` and ``float_list`` features become ``("int64", shape, "int64_list")`` and
    ``("float32", shape, "float_list")`` (shape ``()`` for one value, else ``(N,)``: give the
    array's own shape if it has several axes); ``tf.io.serialize_tensor`` values become
    ``(dtype, shape, "tensor")``. Raw bytes carry no dtype: they are inferred as
    ``("uint8", (nbytes,))`` with a warning; give the real dtype and shape in the schema.

    Args:
        url: a local path or fsspec URL (the first file of a glob).
        records: records to read. Default: ``16``.
        storage_options: passed to fsspec.
        max_record_bytes: refuse longer records (and tensors) before reading them: nothing
            says yet how long a record may be. An int or ``"256MB"``. Default: 64 MiB.

    Raises:
        SchemaError: a feature varies between records (``VarLenFeature``), or holds several
            byte strings or none; the message names the feature and the record.
        CorruptShardError: the file is damaged, or a record is longer than ``max_record_bytes``.
    """
    files = TFRecordFiles(url, storage_options=storage_options)
    path = files.paths()[0]
    if _local_directory(files, path):
        raise _directory_error(files._url(path))
    return _infer(files, path, records, max_record_bytes=_record_limit(max_record_bytes))


def _infer(files: TFRecordFiles, path: str, records: int = 16, *,
           max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Schema:
    chunks, _ = files.stream(path)
    source = files._url(path)
    seen: dict[str, tuple] = {}
    first: dict[str, int] = {}
    count = 0
    for offset, _, _, _, record in iter_frames(chunks, source, max_record_bytes=max_record_bytes):
        try:
            found = scan_example(record)
        except AmbiguousRecordError as exc:
            raise CorruptShardError(source, offset, str(exc)) from None
        except ValueError as exc:
            raise SchemaError(f"{source} at byte offset {offset}: not a tf.train.Example ({exc})") from None
        if count and found.keys() != seen.keys():
            raise SchemaError(f"{source} at byte offset {offset}: features {sorted(found)} differ from the first "
                              f"record's {sorted(seen)}. growcache needs every record to hold the same features.")
        for name, feature in found.items():
            spec = _feature_of(name, feature, record, source, offset, max_record_bytes)
            if name in seen and seen[name] != spec:
                raise SchemaError(
                    f"{source}: feature {name!r} is {_describe(seen[name])} in the record at byte offset "
                    f"{first[name]} but {_describe(spec)} at byte offset {offset}. growcache reads fixed-shape "
                    "features only: VarLenFeature, SequenceExample and ragged features are not supported."
                )
            seen[name], first[name] = spec, first.get(name, offset)
        count += 1
        if count >= records:
            break
    if not count:
        raise CorruptShardError(source, 0, "the file holds no records")
    for name, spec in sorted(seen.items()):
        if spec[2] == "bytes":
            logger.warning("feature %r of %s holds %d raw bytes per record: inferred as ('uint8', (%d,)). Raw bytes "
                           "carry no dtype: give its real dtype and shape in the schema, e.g. ('float32', (%d,))",
                           name, source, spec[1][0], spec[1][0], spec[1][0] // 4)
    return Schema({name: spec for name, spec in seen.items()})


def _feature_of(name: str, feature: Any, record: memoryview, source: str, offset: int, max_bytes: int) -> tuple:
    count = feature.count(record)
    shape = () if count == 1 else (count,)
    if feature.kind == "int64_list":
        return ("int64", shape, "int64_list")
    if feature.kind == "float_list":
        return ("float32", shape, "float_list")
    if feature.kind != "bytes_list" or count != 1:
        raise SchemaError(
            f"{source} at byte offset {offset}: feature {name!r} is {feature.kind} with {count} values; growcache "
            "reads fixed-shape arrays: one bytes value (raw or tf.io.serialize_tensor), or int64/float lists. "
            "VarLenFeature, SequenceExample and ragged features are not supported."
        )
    start, stop = feature.values[0]
    try:
        tensor = parse_tensor(record, start, stop)
    except ValueError:
        return ("uint8", (stop - start,), "bytes")
    nbytes = math.prod(tensor.shape) * np.dtype(tensor.dtype).itemsize
    if nbytes > max_bytes:  # typed values: one value may claim any shape
        raise SchemaError(
            f"{source} at byte offset {offset}: feature {name!r} is a tensor of dtype {tensor.dtype} shape "
            f"{tensor.shape} ({nbytes} bytes), more than the {max_bytes} bytes a record may have without a "
            "schema. If that is right, give the schema (or raise --max-record / max_record_bytes)."
        )
    return (tensor.dtype, tensor.shape, "tensor")


def _describe(spec: tuple) -> str:
    dtype, shape, encoding = spec
    return f"{encoding} {dtype} shape {shape}"


def parse_schema(text: str) -> Schema:
    """A schema from text: ``Schema({...})`` as ``growcache schema`` prints it, a dict literal, or JSON.

    Raises:
        SchemaError: the text is none of these.
    """
    body = text.strip()
    if body.startswith("Schema(") and body.endswith(")"):
        body = body[len("Schema("):-1]
    try:
        value = ast.literal_eval(body)
    except (ValueError, SyntaxError):
        import json

        try:
            value = json.loads(body)
        except ValueError:
            raise SchemaError(f"cannot read a schema from {text!r}: write it as growcache schema prints it, e.g. "
                              "\"{'x': ('float32', (256,)), 'label': ('int64', (), 'int64_list')}\"") from None
    return Schema(value)


# -- import ----------------------------------------------------------------------------------
@dataclass
class ImportReport:
    """Outcome of :func:`import_files`.

    Attributes:
        files: files imported.
        records: records published.
        shards: shards published.
        bytes: bytes published.
        refused: ``(file, reason)`` of each file skipped; nothing of it was published.
        schema: the cache's schema (inferred from the first readable file if the cache had none).
        stopped: why the import stopped before its last file (the disk is full, the store
            is unreachable), or ``None``: files after that point were not tried.
        left: files neither imported nor refused: those after the point where it stopped,
            or was interrupted. Importing them, and only them, finishes the import.
        evicted: shards the cache evicted while the import ran, to stay within its budget
            (files imported earlier in the same run among them).
        evicted_records: the records of those shards.
    """

    files: int = 0
    records: int = 0
    shards: int = 0
    bytes: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)
    schema: Schema | None = None
    stopped: str | None = None
    evicted: int = 0
    evicted_records: int = 0
    _left: dict[str, None] = field(default_factory=dict, repr=False)  # ordered; a file leaves it in O(1)

    @property
    def left(self) -> list[str]:
        return list(self._left)


def import_files(
    sources: str | Sequence[str] | TFRecordFiles,
    cache: Cache | str | os.PathLike,
    *,
    schema: Schema | Mapping[str, Any] | None = None,
    capacity: int | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    max_shard_records: int | None = None,
    max_shard_bytes: int | str | None = None,
    max_record_bytes: int | str | None = None,
    progress: Callable[[int], None] | None = None,
    on_file: Callable[[str, int], None] | None = None,
    report: ImportReport | None = None,
    claim: CacheClaim | None = None,
) -> ImportReport:
    """Import TFRecord files (plain, GZIP or ZLIB) into a cache, each record checked.

    Each file's records are copied unchanged into shards of the cache (several per file
    with ``max_shard_records`` or ``max_shard_bytes``). A file is published only when
    every record of it verified, so a refused file leaves nothing behind: it is skipped
    with a warning, and the others are still imported. A full disk or an unreachable store
    stops the import; what was published stays, and the report says where it stopped.

    Args:
        sources: local paths, globs or fsspec URLs, or a list of them; or a
            :class:`TFRecordFiles` of them (already listed, e.g. to size a progress bar with
            :meth:`TFRecordFiles.total_size`; ``storage_options`` is then its own).
        cache: a :class:`~growcache.Cache` or its directory (created if missing).
        schema: the records' schema. Default: the cache's; for a cache without one, the
            schema inferred from the first file that holds one (see :func:`infer_schema`),
            then stored.
        capacity: the cache's capacity, for a new cache or to change it. Default: as stored.
        storage_options: passed to fsspec.
        max_shard_records: records per shard at most. Default: ``None`` (one shard per file).
        max_shard_bytes: bytes per shard at most. Default: ``None`` (one shard per file).
        max_record_bytes: while the schema is inferred, records longer than this are refused
            before they are read. Default: 64 MiB. With a schema, the longest record it
            allows is the limit.
        progress: called with the bytes of the files as they are read (compressed bytes for a
            compressed file); a file imported or refused counts whole, so the calls add up to
            :meth:`TFRecordFiles.total_size` once every file is done (for a progress bar).
        on_file: called with ``(file, records)`` as each file is published.
        report: the :class:`ImportReport` to fill in as the import goes. Default: a new one.
            A caller interrupted (``KeyboardInterrupt``) still reads in it what was imported,
            and which files are ``left``.
        claim: the caller's :class:`~growcache.cache_claim.CacheClaim` on the cache directory, told of each time this
            call opens the cache to store its schema or capacity (the schema another process
            stored meanwhile is not this call's: the claim then keeps the directory). Default:
            ``None``.

    Returns:
        An :class:`ImportReport`: what was imported, each file skipped and why, and why the
        import stopped early, if it did.

    Raises:
        SourceError: a source matches nothing.
        SchemaMismatchError: ``schema`` differs from the cache's stored schema.
    """
    from .cache import Cache

    files = sources if isinstance(sources, TFRecordFiles) else TFRecordFiles(sources, storage_options=storage_options)
    paths = files.paths()
    if not isinstance(cache, Cache):
        cache = Cache(cache, capacity=capacity, schema=schema)
    elif schema is not None or capacity is not None:
        cache = Cache(cache.path, capacity=capacity, schema=schema)
    if claim is not None:
        claim.opened(cache)
    report = ImportReport() if report is None else report
    report.schema = cache.schema
    report._left = dict.fromkeys(files._url(path) for path in paths)
    known = {shard.seq: shard.records for shard in cache.list_shards()}  # and every shard this import publishes
    try:
        return _import_paths(files, paths, cache, report, known, max_shard_records=max_shard_records,
                             max_shard_bytes=max_shard_bytes, max_record_bytes=max_record_bytes,
                             read=_ReadProgress(files, progress), on_file=on_file, claim=claim)
    finally:
        held = {shard.seq for shard in cache.list_shards()}
        gone = [records for seq, records in known.items() if seq not in held]
        report.evicted, report.evicted_records = len(gone), sum(gone)


def _import_paths(files: TFRecordFiles, paths: list[str], cache: Cache, report: ImportReport, known: dict[int, int],
                  *, max_shard_records: int | None, max_shard_bytes: int | str | None,
                  max_record_bytes: int | str | None, read: _ReadProgress,
                  on_file: Callable[[str, int], None] | None, claim: CacheClaim | None) -> ImportReport:
    """:func:`import_files` once the files are listed and the cache is open; adds the shards it
    publishes to ``known`` (sequence number -> records)."""
    from .cache import Cache

    infer_limit = _record_limit(max_record_bytes)
    skipped: set[str] = set()
    for path in paths:
        if _local_directory(files, path):
            _skip_file(report, files._url(path), _directory_error(files._url(path)))
            skipped.add(path)
            read.done(path)
    if cache.schema is None:
        for path in paths:
            if path in skipped:
                continue
            url = files._url(path)
            try:
                inferred = _infer(files, path, max_record_bytes=infer_limit)
            except _HANDLED as exc:
                if _stops(exc):
                    report.stopped = _stop_reason(exc, url)
                    logger.error("import stopped at %s: %s", url, report.stopped)
                    return report
                _skip_file(report, url, exc)
                skipped.add(path)
                read.done(path)
                continue
            try:
                cache = Cache(cache.path, schema=inferred)
            except SchemaMismatchError:  # another import (or sampler) gave the new cache its schema meanwhile
                cache = Cache(cache.path)  # not this call's schema: the claim is not told of it
                logger.info("cache %s got the schema %r from another process meanwhile: the files are checked "
                            "against it", cache.path, cache.schema)
            else:
                if claim is not None:
                    claim.opened(cache)
                logger.info("cache %s: schema %r inferred from %s", cache.path, inferred, url)
            break
        else:
            report.stopped = "no file holds records growcache can read, so no schema could be inferred"
            return report
        report.schema = cache.schema
    codec = ExampleCodec(cache.schema)  # type: ignore[arg-type]
    limit = parse_size(max_shard_bytes, name="max_shard_bytes") if max_shard_bytes is not None else None
    for path in paths:
        if path in skipped:
            continue
        url = files._url(path)
        if _in_cache(files, path, cache):
            _skip_file(report, url, RefusedFileError(
                f"{url} is in cache {cache.path} itself: importing it would duplicate its records."))
            read.done(path)
            continue
        pieces: list[CopiedShard] = []
        try:
            chunks, _ = files.stream(path, on_read=read.start())
            checker = RecordChecker(codec, url)
            frames = iter_frames(chunks, url, max_record_bytes=codec.max_record_bytes)
            for piece in copy_records(frames, cache, checker, max_records=max_shard_records, max_bytes=limit):
                pieces.append(piece)
            if not pieces:
                raise CorruptShardError(url, 0, "the file holds no records")
            for piece in pieces:
                if piece.nbytes > cache.capacity:
                    raise SchemaError(
                        f"{url}: a shard of {piece.nbytes} bytes is larger than the capacity of cache {cache.path} "
                        f"({cache.capacity} bytes). Raise the capacity, or cut files with max_shard_bytes "
                        "(growcache import --max-shard-size)."
                    )
            published = _publish_all(cache, pieces)
        except _HANDLED as exc:
            _discard(pieces)
            if _stops(exc):
                report.stopped = _stop_reason(exc, url)
                logger.error("import stopped at %s: %s", url, report.stopped)
                return report
            _skip_file(report, url, exc)
            read.done(path)
            continue
        except BaseException:  # Ctrl-C: nothing of this file stays behind
            _discard(pieces)
            raise
        read.done(path)
        report._left.pop(url, None)
        known.update((p.seq, p.records) for p in published)
        report.files += 1
        report.shards += len(published)
        report.records += sum(p.records for p in published)
        report.bytes += sum(p.nbytes for p in published)
        if on_file is not None:
            on_file(url, sum(p.records for p in published))
    return report


class _ReadProgress:
    """``import_files``' progress: the bytes of the files read, a file done (imported or refused) counted whole."""

    def __init__(self, files: TFRecordFiles, progress: Callable[[int], None] | None) -> None:
        self.files = files
        self.progress = progress
        self.read = 0  # of the file being read

    def start(self) -> Callable[[int], None] | None:
        """The ``on_read`` of the next file's stream."""
        self.read = 0
        return self._add if self.progress is not None else None

    def _add(self, nbytes: int) -> None:
        self.read += nbytes
        self.progress(nbytes)  # type: ignore[misc]

    def done(self, path: str) -> None:
        """``path`` is imported or refused: what of it was not read counts too."""
        if self.progress is None:
            return
        size = self.files.known_size(path)
        if size is not None and size > self.read:
            self.progress(size - self.read)
        self.read = 0


_HANDLED = (SchemaError, CorruptShardError, CompressedFileError, CacheFullError, OSError)


def _stops(exc: BaseException) -> bool:
    """Whether ``exc`` ends the import: the disk or the store failed, so every later file
    would fail the same way. Otherwise the file alone is at fault (damaged, off-schema, gone
    from the store, unreadable) and is skipped."""
    if isinstance(exc, (CacheFullError, TransientSourceError)):
        return True
    if isinstance(exc, SourceError):
        return False
    return isinstance(exc, OSError)


def _record_limit(value: int | str | None) -> int:
    return DEFAULT_MAX_RECORD_BYTES if value is None else parse_size(value, name="max_record_bytes")


def _in_cache(files: TFRecordFiles, path: str, cache: Any) -> bool:
    """Whether ``path`` is a local file in ``cache``'s own shard directory (as ``add_shard`` refuses)."""
    if not _is_local(files):
        return False
    return os.path.dirname(os.path.realpath(path)) == os.path.realpath(cache.shards_dir)


def _local_directory(files: TFRecordFiles, path: str) -> bool:
    """Whether ``path`` is a local directory (a store's prefix is no object: its size request says so)."""
    return _is_local(files) and os.path.isdir(path)


def _is_local(files: TFRecordFiles) -> bool:
    protocols = files.fs.protocol if isinstance(files.fs.protocol, tuple) else (files.fs.protocol,)
    return bool({"file", "local"} & set(protocols))


def _directory_error(url: str) -> RefusedFileError:
    return RefusedFileError(f"{url} is a directory, not a TFRecord file: give the files in it, e.g. "
                            f"'{url.rstrip('/')}/*' (quoted, growcache expands it), or '{url.rstrip('/')}/*.tfrecord*'.")


def _skip_file(report: ImportReport, url: str, exc: BaseException) -> None:
    reason = _file_problem(exc)
    report._left.pop(url, None)
    report.refused.append((url, reason))
    logger.warning("skipped %s: %s", url, reason)


def damaged_file(exc: CorruptShardError) -> str:
    """What is wrong with a file given to ``import`` or ``schema``: ``CorruptShardError``'s own
    message advises on a cache's shards (``verify --remove-corrupt``), not on a user's file."""
    return f"not a TFRecord file, or damaged: {exc.reason} at byte offset {exc.offset}"


def _file_problem(exc: BaseException) -> str:
    """Why a file given to import was refused, with advice for a file (not for a cache shard)."""
    if isinstance(exc, CorruptShardError):
        return (f"{damaged_file(exc)}. Nothing of it was imported; check the file (or how it was copied), then import "
                "it again")
    return f"{exc} Nothing of it was imported."


def _stop_reason(exc: BaseException, url: str) -> str:
    if isinstance(exc, CacheFullError) or getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return (f"the disk of the cache is full ({exc}) while importing {url}; nothing of that file was kept. "
                "Free disk space (or lower the cache's capacity), then import the files not imported yet (a file "
                "imported twice has its records twice)")
    return f"{type(exc).__name__}: {exc} (while importing {url}; nothing of that file was kept)"


def _discard(pieces: list[CopiedShard]) -> None:
    for piece in pieces:
        discard_temporary(piece.path)


def _publish_all(cache: Cache, pieces: list[CopiedShard]) -> list[ShardInfo]:
    published: list[ShardInfo] = []
    try:
        for piece in pieces:
            published.append(cache._publish(piece.path, piece.records, piece.nbytes))
    except BaseException:
        # A file is imported whole or not at all: the pieces of it published before the failure
        # go too, or importing it again, as the report advises, would hold them twice.
        kept = cache._withdraw(published)
        if kept:
            logger.warning("%d shards (%d records) of a file whose import failed stay in cache %s, leased by a "
                           "reader since they were published: %s; importing the file again repeats them", len(kept),
                           sum(s.records for s in kept), cache.path, ", ".join(os.path.basename(s.path) for s in kept))
        raise
    finally:
        for piece in pieces[len(published):]:
            discard_temporary(piece.path)
    return published
