"""Vectorized reading of fixed-layout shards: numpy works on pieces of records, not on one at a time.

Every record growcache writes for one schema has the same length and the same layout
(``int64_list`` values are written as 10-byte varints), so in a shard of such records,
record ``i`` starts at byte ``i * frame`` and each feature's payload sits at a fixed offset
inside it. An ``int64_list`` payload lands in its :class:`~growcache.example.BatchDecoder`
staging row like any other and is decoded when the batch is complete. :class:`VectorReader`
reads a shard in pieces of about 4 MiB of frames (16 MiB when read in place) and, per piece:

* compares every frame's 12-byte header and the Example's structure bytes with the
  constants the schema implies: one numpy comparison for the whole piece;
* checks each record's data CRC32C: one C call per record (per payload and structure run
  when payloads are read in place, below), and one numpy comparison of all of them with
  the stored CRCs;
* puts each feature's payloads into their batch rows. Small records are read into one
  page-aligned buffer and copied out with one numpy copy per feature (a scattered index
  when a shuffle window spreads them over its batches, so the shuffle costs no extra
  copy). Large records are read straight into their batch rows by one ``preadv`` whose
  buffers are the rows themselves: the kernel's copy out of the page cache is the only
  copy of their payload.

Where ``growcache._frames`` is built and the CPU is an x86-64 with SSE 4.2 (:data:`FUSED`), one C
call per piece does all of that instead: it reads the piece through a 1 MiB scratch buffer
and, per frame, checks the constant bytes, computes the CRC32C while copying each payload to
its row (streaming stores past the CPU cache), and checks the stored CRC, with the GIL
released. Each byte is then read from the page cache once and from the CPU cache once, where
the numpy paths read it a second time for the CRC, and no Python runs per record at all.

No Python runs per record beyond the CRC calls. Whatever differs from the fixed layout is
read by the record-by-record path of :class:`~growcache.batching.BatchReader`, so the
outcome (batches, their order, errors with their file and offset, ``Skipped`` notes) is
exactly that reader's:

* a shard whose size is not its named record count times the frame size (cut short, or
  written by another tool with records of other lengths), or that is not a regular file,
  is read record by record from its start;
* from the first frame whose header differs (another length, a corrupt header), the rest
  of the shard is read record by record;
* a record whose structure bytes differ (another writer's order of features) is parsed
  alone by the codec's general path.
"""

from __future__ import annotations

import functools
import mmap
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._protowire import MAX_VARINT_BYTES, wide_varint_rows_ok
from ._vectored_io import pread_into
from .batching import (GONE, Allocate, BatchReader, ReaderShare, Skipped, malformed, other_schema, past_gone,
                       vanished)
from .errors import CorruptShardError, SchemaError
from .example import BatchDecoder, ExampleCodec
from .records import FOOTER_BYTES, HEADER_BYTES, count_checked, crc32c, frame_header
from .shard import ShardInfo

try:
    from . import _frames
except ImportError:  # built without a C compiler: numpy does the work
    _frames = None

__all__ = ["FUSED", "VectorReader"]

#: Whether :class:`VectorReader` reads, checks and copies in one pass of C (the
#: ``growcache._frames`` extension, on x86-64 CPUs with SSE 4.2) rather than with numpy.
FUSED = bool(_frames is not None and _frames.ACCELERATED)


# Frames checked and placed per step: the CRC pass leaves a piece in the CPU cache for the
# copy that follows it, so the page cache is read from memory once. 4 MiB: a quarter of the
# numpy calls per record of 1 MiB pieces, still in the last-level cache. Measured on the
# 2-core VM (32 MiB L3), 16 KiB records: 1 MiB pieces cost a DataLoader worker about 0.50 CPU
# s/GB, 4 MiB 0.43, 8 MiB and 16 MiB more than 1 MiB.
_PIECE_BYTES = 4 << 20
# Records whose payloads average at least this much per feature are read straight into
# their batch rows (a buffer per payload in one preadv); smaller ones are read into one
# buffer and copied, which costs less than the Python work of a buffer per payload.
_DIRECT_BYTES = 64 << 10
# Features at least this large are copied row by row when no window-wide view exists (a
# numpy call per row costs nothing beside the copy); smaller ones by a fancy index.
_ROW_COPY_BYTES = 64 << 10
# The fused loop's scratch buffer, where each read lands and the CRC and the copy out find it:
# within a core's L2 on current server cores (1-2 MiB), in L3 elsewhere. Larger reads spread
# each read's fixed cost in the kernel over more bytes: on a Zen 4 EPYC (1 MiB L2) the workers
# spent 0.16-0.17 CPU s/GB with 1 MiB against 0.18-0.19 with 256 KiB, at 16 KiB and at 1 MiB
# records alike; 2 and 4 MiB were no better.
_SCRATCH_BYTES = 1 << 20
# Frames per call of the fused loop: the Python work per call is then negligible per byte.
_FUSED_PIECE_BYTES = 16 << 20
# Why the fused loop stopped (growcache/_frames.c).
_PLACED, _BAD_HEADER, _BAD_CRC, _OTHER_LAYOUT, _SHRANK = range(5)
_MASK_DELTA = np.uint32(0xA282EAD8)
_DATA_CRC = "data CRC32C mismatch (corrupt record payload)"
_SHRANK_REASON = "file shrank while it was read"

Batch = tuple[object, dict[str, np.ndarray], int]


class _FixedFrames:
    """Where the constant bytes and the payloads of one schema's frames are."""

    def __init__(self, codec: ExampleCodec) -> None:
        self.record = codec.record_nbytes
        self.frame = frame = self.record + HEADER_BYTES + FOOTER_BYTES
        #: (start in the frame, bytes) of each feature's payload, schema order
        self.payloads = [(HEADER_BYTES + offset, nbytes) for _, offset, nbytes in codec.layout]
        # The constant runs between non-empty payloads, the last one ending with the footer.
        self.runs: list[tuple[int, int]] = []
        run_start = 0
        for start, nbytes in self.payloads:
            if nbytes:
                self.runs.append((run_start, start))
                run_start = start + nbytes
        self.runs.append((run_start, frame))
        #: frame columns that hold the same bytes in every frame (all but payloads and
        #: footer), in order, and those bytes
        self.columns = np.concatenate([np.arange(a, b) for a, b in self.runs])[:-FOOTER_BYTES]
        frame_bytes = np.zeros(frame, np.uint8)
        frame_bytes[:HEADER_BYTES] = np.frombuffer(frame_header(self.record), np.uint8)
        for prefix, (start, _) in zip(codec.prefixes, self.payloads):
            frame_bytes[start - len(prefix):start] = np.frombuffer(prefix, np.uint8)
        self.values = frame_bytes[self.columns]
        #: bytes of a frame's constant runs (read into scratch when payloads go direct)
        self.scratch = int(sum(b - a for a, b in self.runs))
        payload_count = sum(1 for _, nbytes in self.payloads if nbytes)
        self.direct = payload_count > 0 and self.record >= _DIRECT_BYTES * payload_count
        # Read in place, a piece needs no buffer but its structure bytes: larger pieces cost
        # fewer numpy calls per record.
        self.piece = max(1, (_PIECE_BYTES * (4 if self.direct else 1)) // frame)
        # The fused loop's plan: the expected frame, and the record's segments in order as
        # (start, bytes, column of the destination table or -1 for constant bytes).
        self.template = frame_bytes.tobytes()
        segments, column, at = [], 0, HEADER_BYTES
        for start, nbytes in self.payloads:
            if nbytes:
                if start > at:
                    segments.append((at, start - at, -1))
                segments.append((start, nbytes, column))
                column, at = column + 1, start + nbytes
        if frame - FOOTER_BYTES > at:
            segments.append((at, frame - FOOTER_BYTES - at, -1))
        self.segments = np.array(segments, np.int64).reshape(-1, 3).tobytes()
        self.placed_columns = column
        self.fused_piece = max(1, _FUSED_PIECE_BYTES // frame)

    def records_in(self, path: str, size: int) -> int | None:
        """Frames a file of ``size`` bytes holds if it is all fixed frames, or ``None``.

        A published shard must hold exactly the records and bytes its name states; any
        other file is read to its end.
        """
        named = ShardInfo.from_path(path)
        if named is not None:
            return named.records if size == named.nbytes == named.records * self.frame else None
        return size // self.frame if size % self.frame == 0 else None

    def record_crc(self, release_gil: bool) -> Callable[[Any], int]:
        """The CRC32C of one record as :meth:`_Shard.read` (one buffer) or
        :meth:`_Shard.read_into` (a list of buffers, :attr:`direct`) gives it; ``release_gil``:
        let go of the GIL during every call."""
        if self.direct:
            return functools.partial(_crc_of, gil_release_mode=1 if release_gil else 0)
        return _crc_releasing if release_gil else crc32c

    def check(self, constant: np.ndarray, footers: np.ndarray, records: list[Any],
              crc: Callable[[Any], int] | None) -> tuple[int, str | None, np.ndarray]:
        """Check consecutive frames by their constant bytes and CRCs.

        Args:
            constant: ``(count, len(columns))`` bytes, each frame's constant bytes.
            footers: the stored masked CRCs.
            records: per frame, its record's bytes for the CRC: one buffer, or a list of
                buffers when payloads were read in place (:attr:`direct`).
            crc: :meth:`record_crc`'s function, to check the CRCs; ``None`` not to.

        Returns:
            ``(good, why, layout_ok)``: the first ``good`` frames may be used; ``why`` says
            what is wrong with the next one (``"header"``: read on record by record;
            ``"crc"``: corrupt), ``None`` if nothing is. ``layout_ok`` flags which of the
            good frames have the fixed layout.
        """
        same = constant == self.values
        headers_ok = same[:, :HEADER_BYTES].all(axis=1)
        good = len(constant)
        why = None
        if not headers_ok.all():
            good, why = int(np.argmin(headers_ok)), "header"
        if crc is not None and good:
            computed = np.fromiter(map(crc, records[:good]), np.uint32, good)
            masked = ((computed >> np.uint32(15)) | (computed << np.uint32(17))) + _MASK_DELTA
            mismatch = masked != footers[:good]
            if mismatch.any():
                good, why = int(np.argmax(mismatch)), "crc"
        return good, why, same[:good, HEADER_BYTES:].all(axis=1)


def _crc_of(pieces: list[Any], gil_release_mode: int) -> int:
    crc = 0
    for piece in pieces:
        crc = crc32c(piece, crc, gil_release_mode)
    return crc


# For every record, not only for the large ones that crc32c's default lets go for.
_crc_releasing = functools.partial(crc32c, gil_release_mode=1)


def _aligned(nbytes: int) -> tuple[np.ndarray, memoryview]:
    """A page-aligned buffer (anonymous memory): the kernel copies into an unaligned one
    at a fraction of the speed on some CPUs."""
    memory = mmap.mmap(-1, max(nbytes, 1))
    return np.frombuffer(memory, np.uint8)[:nbytes], memoryview(memory)[:nbytes]


class _Shard:
    """An open shard of fixed frames, read a piece at a time; :meth:`open` says whether it is one."""

    def __init__(self, path: str, fixed: _FixedFrames, records: int, fd: int,
                 buffer: tuple[np.ndarray, memoryview]) -> None:
        self.path = path
        self.fixed = fixed
        self.records = records
        self.fd = fd
        self.buffer, self.view = buffer
        #: where a read found the file ending before its last frame; ``None`` while it has not.
        self.cut: int | None = None

    @staticmethod
    def buffer(fixed: _FixedFrames) -> tuple[np.ndarray, memoryview]:
        """The read buffer for one piece; a reader reuses it for all its shards."""
        return _aligned(fixed.piece * (fixed.scratch if fixed.direct else fixed.frame))

    @classmethod
    def open(cls, path: str, fixed: _FixedFrames, buffer: tuple[np.ndarray, memoryview]) -> _Shard | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None  # the record-by-record reader raises what the user should see
        try:
            info = os.fstat(fd)
            records = fixed.records_in(path, info.st_size) if stat.S_ISREG(info.st_mode) else None
        except BaseException:
            os.close(fd)
            raise
        if records is None:
            os.close(fd)
            return None
        return cls(path, fixed, records, fd, buffer)

    def close(self) -> None:
        os.close(self.fd)

    def record(self, index: int) -> bytes:
        """Record ``index`` read whole (the bytes between its frame's header and footer), for the
        codec's general path; its frame starts at ``index * fixed.frame``."""
        frame = self.fixed.frame
        return os.pread(self.fd, frame, index * frame)[HEADER_BYTES:frame - FOOTER_BYTES]

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[memoryview]]:
        """Frames ``[start, start + count)`` into the buffer (valid until the next call).

        Returns:
            ``(frames, constant, footers, records)``: the ``(count, frame)`` bytes, their
            constant bytes, stored CRCs, and each record's bytes; fewer frames, and :attr:`cut`
            set, where the file now ends before the last of them.
        """
        fixed = self.fixed
        frame, length = fixed.frame, fixed.record
        got = pread_into(self.fd, [self.view[:count * frame]], start * frame, count * frame)
        count = self._whole_frames(start, got, count)
        frames = self.buffer[:count * frame].reshape(count, frame)
        view = self.view
        records = [view[o:o + length] for o in range(HEADER_BYTES, count * frame, frame)]
        return frames, frames[:, fixed.columns], frames[:, frame - FOOTER_BYTES:].view("<u4")[:, 0], records

    def read_into(self, start: int, rows: list[list[memoryview]]) -> tuple[np.ndarray, np.ndarray, list[list[Any]]]:
        """Frames ``[start, start + len(rows))``, each payload straight into its row.

        Args:
            rows: per frame, the destination of each non-empty payload.

        Returns:
            ``(constant, footers, records)``, as :meth:`read` (without the frames; the rows of
            frames past a :attr:`cut` hold whatever was read of them).
        """
        fixed = self.fixed
        scratch, view = fixed.scratch, self.view
        sizes = [b - a for a, b in fixed.runs]
        buffers: list[Any] = []
        records = []
        for index, destinations in enumerate(rows):
            at = index * scratch
            pieces = []
            for size, destination in zip(sizes, destinations):
                pieces.append(view[at:at + size])
                pieces.append(destination)
                at += size
            pieces.append(view[at:at + sizes[-1]])
            buffers.extend(pieces)
            pieces[0] = pieces[0][HEADER_BYTES:]  # the record's own bytes, for its CRC
            pieces[-1] = pieces[-1][:sizes[-1] - FOOTER_BYTES]
            records.append(pieces)
        got = pread_into(self.fd, buffers, start * fixed.frame, len(rows) * fixed.frame)
        count = self._whole_frames(start, got, len(rows))
        table = self.buffer[:count * scratch].reshape(count, scratch)
        return table[:, :scratch - FOOTER_BYTES], table[:, scratch - FOOTER_BYTES:].view("<u4")[:, 0], records[:count]

    def _whole_frames(self, start: int, got: int, count: int) -> int:
        """Of ``count`` frames from frame ``start``, those whole in the ``got`` bytes read;
        where that is not all of them, the file ended inside: :attr:`cut` says where."""
        frame = self.fixed.frame
        if got < count * frame:
            self.cut = start * frame + got
            return got // frame
        return count


def _root(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _spanning_view(batches: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(view, position)``: one ``(len(batches), rows, nbytes)`` view of the batches' byte rows,
    and each batch's index in it; ``None`` unless they are equally spaced in one buffer.

    A shared-memory slab holds its batches at equally spaced offsets (always, for the two
    batches of a default window), so a window's records reach every batch in one scatter.
    """
    first = batches[0]
    root = _root(first)
    if first.size == 0 or not root.flags.c_contiguous or not root.flags.writeable:
        return None
    origin = root.__array_interface__["data"][0]
    offsets = []
    for batch in batches:
        if _root(batch) is not root or batch.shape != first.shape or not batch.flags.c_contiguous:
            return None
        offsets.append(batch.__array_interface__["data"][0] - origin)
    order = np.argsort(offsets)
    starts = np.asarray(offsets)[order]
    steps = np.diff(starts)
    step = int(steps[0]) if steps.size else first.nbytes
    if step < first.nbytes or (steps != step).any():
        return None
    view = np.ndarray((len(batches), *first.shape), np.uint8, root, int(starts[0]), (step, first.shape[1], 1))
    position = np.empty(len(batches), np.intp)
    position[order] = np.arange(len(batches))
    return view, position


class _Window:
    """The batches one shuffle window fills, exactly as :class:`BatchReader` fills them.

    The window's permutation is drawn from the reader's generator when its first record
    arrives; record ``k`` of the window lands on row ``targets[k]``. Batches are allocated
    when their first record lands, and come out together when the window closes.
    """

    def __init__(self, reader: VectorReader, decoder: BatchDecoder, allocate: Allocate,
                 release: Callable[[object], None] | None, rng: np.random.Generator) -> None:
        self.batch_size = reader.batch_size
        self.batches = reader.window_batches
        self.rows = self.batches * self.batch_size
        self.drop_last = reader.drop_last
        self.decoder = decoder
        self.allocate = allocate
        self.release = release
        self.rng = rng
        self.entries: list[tuple[object, dict[str, np.ndarray], list[np.ndarray]] | None] = []
        self.targets: np.ndarray | None = None  # None: sequential
        self.placed = 0
        self.drop = 0  # batches of the next window delivered before a resume (released, not yielded)
        # Per feature, the window's batches as one (batches, batch_size, nbytes) array, when
        # their memory allows it, and where each batch sits in it: one scatter per feature.
        self.spans: list[tuple[np.ndarray, np.ndarray] | None] = []
        # Per batch, each non-empty payload's rows as one flat buffer (records read in place).
        self.direct = reader._fixed.direct
        self.flats: list[list[tuple[memoryview, int]] | None] = []
        # Per batch, the address of each non-empty payload's rows, and their row strides:
        # where the fused loop writes (built when first needed, per window).
        self.row_addresses: np.ndarray | None = None
        self.row_strides: np.ndarray | None = None
        # (feature, payload bytes) of each non-empty int64_list feature, whose 10-byte varints
        # bad_varint checks after every piece placed by the block.
        self.varints = [(f, decoder.specs[f].size * MAX_VARINT_BYTES) for f in decoder.varint_features
                        if decoder.specs[f].size]

    def open(self) -> None:
        """Start a window if none is open (once a record is known to land in it)."""
        if self.entries:
            return
        self.entries = [None] * self.batches
        self.flats = [None] * self.batches
        self.row_addresses = None
        self.placed = 0
        if self.batches == 1:
            self.targets = None
            return
        self.targets = self.rng.permutation(self.rows)
        # Records land in every batch of a window at once, so all are allocated now (the
        # record-by-record reader allocates them as they get their first record).
        rows = [self._rows_of(number) for number in range(self.batches)]
        features = len(self.decoder.specs)  # rows() ends with int64_list lengths: not payload rows
        self.spans = [_spanning_view(batches) for batches in zip(*(r[:features] for r in rows))]

    @property
    def room(self) -> int:
        return self.rows - self.placed

    def _rows_of(self, number: int) -> list[np.ndarray]:
        entry = self.entries[number]
        if entry is None:  # allocated when its first record lands
            key, arrays = self.allocate(self.batch_size)
            rows = self.decoder.rows(arrays)
            entry = self.entries[number] = (key, arrays, rows)
            if self.direct:
                self.flats[number] = [(memoryview(row).cast("B"), row.shape[1])
                                      for row in rows[:len(self.decoder.specs)] if row.size]
        return entry[2]

    def _target(self, position: int) -> int:
        return int(self.targets[position]) if self.targets is not None else position

    def put(self, record: Any, path: str, offset: int) -> None:
        """Place one record, found at byte ``offset`` of ``path`` (the record-by-record path).

        Raises:
            CorruptShardError: the record is not a well-formed Example (:func:`malformed`).
            SchemaError: it does not follow the schema.
        """
        target = self._target(self.placed)
        try:
            self.decoder.put(record, self._rows_of(target // self.batch_size), target % self.batch_size)
        except SchemaError:
            raise
        except ValueError as exc:
            raise malformed(path, offset, exc) from None
        self.placed += 1

    def destinations(self, count: int) -> list[list[memoryview]]:
        """Per record of the next ``count``, the row of each of its non-empty payloads."""
        positions = (range(self.placed, self.placed + count) if self.targets is None
                     else self.targets[self.placed:self.placed + count].tolist())
        size = self.batch_size
        out = []
        for target in positions:
            number, row = divmod(target, size)
            entry = self.flats[number]
            if entry is None:
                self._rows_of(number)
                entry = self.flats[number]
            out.append([flat[row * nbytes:(row + 1) * nbytes] for flat, nbytes in entry])
        return out

    def addresses(self, count: int) -> np.ndarray:
        """Per record of the next ``count``, the address of each non-empty payload's row:
        the fused loop's destination table, ``(count, columns)`` ``uint64``."""
        if self.row_addresses is None:
            features = len(self.decoder.specs)  # rows() ends with int64_list lengths
            tables = []
            for number in range(self.batches):
                rows = [row for row in self._rows_of(number)[:features] if row.size]
                if any(row.strides[1:] != (1,) for row in rows):
                    raise AssertionError("a payload's row is not contiguous")  # BatchDecoder never makes one
                tables.append([row.__array_interface__["data"][0] for row in rows])
            self.row_strides = np.array([row.strides[0] for row in rows], np.uint64)  # the same in every batch
            self.row_addresses = np.array(tables, np.uint64).reshape(self.batches, -1)
        first = self.placed
        if self.targets is None:
            numbers, at = np.zeros(count, np.intp), np.arange(first, first + count, dtype=np.uint64)
        else:
            numbers, at = np.divmod(self.targets[first:first + count], self.batch_size)
        return self.row_addresses[numbers] + at.astype(np.uint64)[:, None] * self.row_strides

    def bad_varint(self, first: int, count: int, layout_ok: np.ndarray | None = None) -> int | None:
        """The first of the ``count`` records placed by the block from window position ``first``
        whose ``int64_list`` payload is not 10-byte varints, as a fixed frame's must be; ``None``
        if none. Records of another layout (``~layout_ok``) are left out: :meth:`put` checks them.

        A CRC cannot tell a record that a writer framed with broken varints, and :meth:`close`
        decodes a whole window at once, too late to name the record or skip its shard.
        """
        if not self.varints or not count:
            return None
        positions = (np.arange(first, first + count) if self.targets is None
                     else self.targets[first:first + count])
        numbers, at = np.divmod(positions, self.batch_size)
        ok = np.ones(count, bool)
        for feature, wide in self.varints:
            span = self.spans[feature] if self.targets is not None else None
            if span is not None:  # one gather for the whole piece
                view, position = span
                ok &= wide_varint_rows_ok(view[position[numbers], at, :wide])
                continue
            for number in np.unique(numbers).tolist():
                picked = np.flatnonzero(numbers == number)
                ok[picked] &= wide_varint_rows_ok(self._rows_of(number)[feature][at[picked], :wide])
        if layout_ok is not None:
            ok |= ~layout_ok[:count]
        return None if ok.all() else int(np.argmin(ok))

    def refuse(self, record: Any, path: str, offset: int) -> None:
        """Raise for a fixed frame :meth:`bad_varint` found, at the next position, as the
        record-by-record reader raises for it: its general path tells a malformed varint
        (:class:`CorruptShardError`) from another count of values (:class:`SchemaError`)."""
        self.put(record, path, offset)
        # put() refuses every payload of 10 bytes per value that is not 10-byte varints.
        raise malformed(path, offset, ValueError("an int64_list payload that is not 10-byte varints"))

    def placed_direct(self, count: int, layout_ok: np.ndarray, shard: _Shard, start: int) -> None:
        """Count ``count`` records read in place by :meth:`_Shard.read_into` as placed."""
        first = self.placed
        bad = self.bad_varint(first, count, layout_ok)
        placed = count if bad is None else bad
        # Records of another layout (same length, other order of features) landed as if
        # they had ours; read them whole and put them through the codec's general path.
        for index in np.flatnonzero(~layout_ok[:placed]).tolist():
            self.placed = first + index
            self.put(shard.record(start + index), shard.path, (start + index) * shard.fixed.frame)
        self.placed = first + placed
        if bad is not None:
            self.refuse(shard.record(start + bad), shard.path, (start + bad) * shard.fixed.frame)

    def put_frames(self, frames: np.ndarray, payloads: list[tuple[int, int]], layout_ok: np.ndarray,
                   record_length: int, shard: _Shard, shard_record: int) -> None:
        """Place consecutive fixed frames (``frames``: ``(k, frame)`` bytes, from record
        ``shard_record`` of ``shard``) in the window's next rows."""
        count = len(frames)
        first = self.placed
        if self.targets is None:  # sequential: one window is one batch
            for dst, (start, nbytes) in zip(self._rows_of(0), payloads):
                if nbytes:
                    dst[first:first + count] = frames[:, start:start + nbytes]
        else:
            numbers, at = np.divmod(self.targets[first:first + count], self.batch_size)
            groups = None
            for feature, (span, (start, nbytes)) in enumerate(zip(self.spans, payloads)):
                if not nbytes:
                    continue
                source = frames[:, start:start + nbytes]
                if span is not None:  # one scatter, no temporary
                    view, position = span
                    view[position[numbers], at] = source
                    continue
                if groups is None:
                    groups = [(n, np.flatnonzero(numbers == n)) for n in np.unique(numbers).tolist()]
                for number, picked in groups:
                    dst = self._rows_of(number)[feature]
                    if nbytes >= _ROW_COPY_BYTES:
                        for index, row in zip(picked.tolist(), at[picked].tolist()):
                            dst[row] = source[index]
                    else:
                        dst[at[picked]] = source[picked]
        bad = self.bad_varint(first, count, layout_ok)
        placed = count if bad is None else bad
        # Records of another layout (same length, other order of features) were copied as
        # if they had ours; put them again through the codec's general path.
        for index in np.flatnonzero(~layout_ok[:placed]).tolist():
            self.placed = first + index
            self.put(frames[index, HEADER_BYTES:HEADER_BYTES + record_length].data, shard.path,
                     (shard_record + index) * shard.fixed.frame)
        self.placed = first + placed
        if bad is not None:
            self.refuse(frames[bad, HEADER_BYTES:HEADER_BYTES + record_length].data, shard.path,
                        (shard_record + bad) * shard.fixed.frame)

    def close(self) -> Iterator[Batch]:
        """Yield the window's batches (dense: a last partial window is compacted)."""
        filled, size = self.placed, self.batch_size
        if filled < self.rows and self.targets is not None:
            # Move the records that landed at or past ``filled`` into the holes below it,
            # pairing holes and movers in ascending order as the record-by-record reader does.
            used = np.zeros(self.rows, bool)
            used[self.targets[:filled]] = True
            holes = np.flatnonzero(~used[:filled])
            movers = np.flatnonzero(used[filled:]) + filled
            hole_batches, mover_batches = holes // size, movers // size
            for into in np.unique(hole_batches).tolist():
                for source in np.unique(mover_batches[hole_batches == into]).tolist():
                    pick = (hole_batches == into) & (mover_batches == source)
                    dst_rows, src_rows = holes[pick] % size, movers[pick] % size
                    for dst, src in zip(self._rows_of(into), self._rows_of(source)):
                        dst[dst_rows] = src[src_rows]
        for number, entry in enumerate(self.entries):
            if entry is None:
                continue
            rows = min(size, filled - number * size)
            if number >= self.drop and (rows == size or (rows > 0 and not self.drop_last)):
                self.decoder.finish(entry[1], entry[2], rows)
                yield entry[0], entry[1], rows
            elif self.release is not None:
                self.release(entry[0])  # emptied by the compaction or drop_last, or delivered before a resume
        self.drop = 0
        self.entries = []
        self.flats = []


class VectorReader(BatchReader):
    """A :class:`~growcache.batching.BatchReader` that reads fixed-layout shards a piece at a time.

    Same arguments, same batches, same errors and ``Skipped`` notes as the record-by-record
    reader; see the module docstring for what takes which path.

    Args:
        schema: the records' schema.
        batch_size: rows per batch.
        frames: framing function of the record-by-record path. Default:
            :func:`~growcache.batching.growcache_frames`.
        verify: check every record's CRC32C. Default: ``True``.
        on_corrupt: ``"raise"`` or ``"skip"`` (see :class:`BatchReader`). Default: ``"raise"``.
        drop_last: drop the final partial batch. Default: ``False``.
        shuffle_buffer: records shuffled together (see :class:`BatchReader`). Default: ``0``.
    """

    #: Read with the fused C loop (:data:`FUSED`) rather than numpy; a test sets it per reader.
    fused = FUSED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fixed = _FixedFrames(self.codec)
        self.records_fast = 0  # records read by the vectorized path (the rest went record by record)

    def batches(
        self, share: ReaderShare, allocate: Allocate, release: Callable[[object], None] | None = None
    ) -> Iterator[Batch | Skipped]:
        """Yield ``(key, arrays, rows)`` per batch and a :class:`Skipped` per skipped shard,
        exactly as :meth:`BatchReader.batches` does."""
        if share.skip_records or share.exclude.size:  # a resume re-planned record by record: the plain path
            yield from BatchReader.batches(self, share, allocate, release)
            return
        decoder = BatchDecoder(self.codec, self.window_batches)  # a window's staging rows in one block
        rng = np.random.default_rng([share.shuffle_seed & 0xFFFFFFFFFFFFFFFF, 0x73687566])
        window = _Window(self, decoder, allocate, release, rng)
        # The fused loop reads through a small scratch buffer; the numpy paths a piece at a time.
        buffer = _aligned(_SCRATCH_BYTES) if self.fused else _Shard.buffer(self._fixed)
        crc = self._fixed.record_crc(self.release_gil) if self.verify else None
        remaining = share.quota if share.quota >= 0 else int(share.records[share.shards].sum())
        to_skip, window.drop = self._resume_point(share, remaining, rng)
        gone = {int(i) for i in share.gone}
        corrupt: set[int] = set()
        for index in self._shard_order(share, corrupt):
            if remaining <= 0:
                break
            records = int(share.records[index])
            if to_skip >= records:  # delivered whole before a resume: not opened
                to_skip -= records
                remaining -= records
                continue
            if index in gone:
                remaining = past_gone(share, remaining, to_skip, window.drop, self.batch_size)
                window.drop, to_skip = 0, 0
                yield self._gone(share, index, corrupt)
                continue
            path = os.fsdecode(share.paths[index])
            got, start, to_skip = 0, to_skip, 0
            remaining -= start
            try:
                for item in self._read_shard(path, window, remaining, buffer, crc, start):
                    if isinstance(item, int):
                        got += item
                        remaining -= item
                    else:
                        yield item
            except CorruptShardError as exc:
                yield self._skip(exc, share, index, start + got, corrupt)
            except SchemaError as exc:  # a shard of another schema among the cache's: a corrupt one
                yield self._skip(other_schema(path, exc), share, index, start + got, corrupt)
            except GONE as exc:
                yield self._skip(vanished(path, exc), share, index, start + got, corrupt)
            self.records_read += got
        if window.entries:
            yield from window.close()

    def _place(self, shard: _Shard, start: int, count: int, window: _Window) -> tuple[int, str | None]:
        """Place frames ``[start, start + count)`` of ``shard`` with the fused loop: ``(good, why)``
        as :meth:`_FixedFrames.check` gives them, the ``good`` records placed (and
        :attr:`_Shard.cut` set where the file now ends before the last of them)."""
        fixed = self._fixed
        good = 0
        while good < count:
            placed, stop = _frames.place(shard.fd, (start + good) * fixed.frame, count - good, fixed.template,
                                         fixed.segments, fixed.placed_columns, window.addresses(count - good),
                                         shard.view, self.verify)
            bad = window.bad_varint(window.placed, placed)
            if bad is not None:
                window.placed += bad
                window.refuse(shard.record(start + good + bad), shard.path, (start + good + bad) * fixed.frame)
            good += placed
            window.placed += placed
            if stop == _OTHER_LAYOUT:  # same length, another order of features: the codec's general path
                window.put(shard.record(start + good), shard.path, (start + good) * fixed.frame)
                good += 1
            elif stop == _SHRANK:  # the loop does not say where in the frame: the file's end does
                at = (start + good) * fixed.frame
                shard.cut = min(max(os.fstat(shard.fd).st_size, at), at + fixed.frame)
                return good, None
            elif stop != _PLACED:
                return good, "header" if stop == _BAD_HEADER else "crc"
        return good, None

    def _read_shard(self, path: str, window: _Window, remaining: int, buffer: tuple[np.ndarray, memoryview],
                    crc: Callable[[Any], int] | None, start: int = 0) -> Iterator[int | Batch]:
        """Place up to ``remaining`` records of one shard from record ``start`` on (a resume: a
        fixed-layout shard seeks there, another frames the records before it without decoding them),
        checking CRCs with ``crc`` (``None``: not); yield the counts placed, and the batches of
        every window that fills. Raises
        :class:`CorruptShardError` where the record-by-record reader would, after placing the
        same records before it."""
        fixed = self._fixed
        piece = fixed.fused_piece if self.fused else fixed.piece
        shard = _Shard.open(path, fixed, buffer)
        done = start
        if shard is not None:
            try:
                while done < shard.records and remaining > 0:
                    room = window.room if window.entries else window.rows
                    count = min(piece, shard.records - done, room, remaining)
                    before = window.placed if window.entries else 0
                    try:
                        if self.fused:
                            window.open()  # before the first record is checked: see below
                            good, why = self._place(shard, done, count, window)
                        elif fixed.direct:
                            # The rows must be known before the read. Opening the window (drawing
                            # its permutation) before its first record is checked changes nothing:
                            # the next good record would draw the same permutation.
                            window.open()
                            constant, footers, records = shard.read_into(done, window.destinations(count))
                            good, why, layout_ok = fixed.check(constant, footers, records, crc)
                            window.placed_direct(good, layout_ok, shard, done)
                        else:
                            frames, constant, footers, records = shard.read(done, count)
                            good, why, layout_ok = fixed.check(constant, footers, records, crc)
                            if good:
                                window.open()
                                window.put_frames(frames[:good], fixed.payloads, layout_ok, fixed.record, shard, done)
                    except (CorruptShardError, SchemaError):
                        # A malformed record, or one of another schema, among the piece's: those
                        # placed before it count, as the record-by-record reader counts them.
                        if window.placed > before:
                            self.records_fast += window.placed - before
                            yield window.placed - before
                        raise
                    records = None
                    if good:
                        done += good
                        remaining -= good
                        self.records_fast += good
                        yield good
                        if window.room == 0:
                            yield from window.close()
                    if why == "crc":
                        raise CorruptShardError(path, done * fixed.frame, _DATA_CRC)
                    if why == "header":
                        break
                    if shard.cut is not None:  # the records before it are placed, as one by one
                        raise CorruptShardError(path, shard.cut, _SHRANK_REASON)
                else:
                    return
            finally:
                shard.close()
        # The record-by-record path, from the first record the vectorized one did not place
        # (its framing is checked again from the start: a frame cannot be found otherwise).
        for number, (at, record) in enumerate(count_checked(path, self._frames_of(path))):
            if number < done:
                continue
            window.open()
            window.put(record, path, at)
            remaining -= 1
            yield 1
            if window.room == 0:
                yield from window.close()
            if remaining <= 0:
                return  # before framing another record: the quota ends the shard here
