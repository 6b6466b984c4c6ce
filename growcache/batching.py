"""Record reading and batching into numpy, shared by every framework adapter.

A reader follows its :class:`~growcache.planning.EpochPlan` share: it walks its shards,
frames records (with any framing function: growcache's own :func:`iter_records` or an
adapter's), and copies each record's payloads into the rows of a preallocated batch.
The codec's :class:`~growcache.example.BatchDecoder` does the per-record work: a record
of a layout seen before (every record growcache wrote for a schema shares one) is checked
by its structure bytes and its payloads sliced at known offsets; a new layout (other
writers order map entries their own way) is parsed once. ``int64_list`` payloads are
decoded a batch at a time, when the batch is complete.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .errors import CorruptShardError, SchemaError
from .example import BatchDecoder, ExampleCodec
from .records import count_checked, iter_records
from .schema import Schema

__all__ = [
    "BatchReader",
    "Frames",
    "ReaderShare",
    "Skipped",
    "default_shuffle_buffer",
    "delivered_records",
    "growcache_frames",
    "past_gone",
    "window_batches",
]

logger = logging.getLogger(__name__)

#: A framing function: ``(path, verify) -> iterator of (byte offset, record view)``.
Frames = Callable[[str, bool], Iterator[tuple[int, memoryview]]]

#: Allocates a batch: ``(batch_size) -> (key, {name: array of batch_size rows})``.
Allocate = Callable[[int], tuple[object, dict[str, np.ndarray]]]


_SHUFFLE_BYTES = 32 << 20
_SHUFFLE_MAX_RECORDS = 8192


def default_shuffle_buffer(schema: Schema, batch_size: int) -> int:
    """Records in a reader's default shuffle buffer: about 32 MiB, at least two batches, at most 8192.

    Small enough that a worker refills it in milliseconds at an epoch's start, large
    enough that no two epochs share a batch.
    """
    by_bytes = _SHUFFLE_BYTES // max(schema.record_payload_bytes, 1)
    return int(min(max(by_bytes, 2 * batch_size), max(_SHUFFLE_MAX_RECORDS, 2 * batch_size)))


def growcache_frames(path: str, verify: bool) -> Iterator[tuple[int, memoryview]]:
    """growcache's own framing (:func:`growcache.records.iter_records`)."""
    return iter_records(path, verify=verify)


@dataclass(frozen=True)
class Skipped:
    """A corrupt shard passed over with ``on_corrupt="skip"``: where, and how many records."""

    path: str
    offset: int
    reason: str
    records: int


@dataclass
class ReaderShare:
    """One reader's part of an epoch, as plain arrays (cheap to send to a worker process).

    Attributes:
        paths: shard paths of the whole snapshot, ``np.bytes_`` (fixed width, no
            per-element Python objects to touch in a forked worker).
        records: records per snapshot shard.
        shards: indices into ``paths`` this reader reads, in order.
        quota: records this reader yields; ``-1`` for "all of its shards".
        cycle: indices to cycle through if the shards run out before ``quota``
            (a top up); empty for none.
        shuffle_seed: seed of the record shuffle buffer for this reader and epoch.
        skip_batches: batches of this share already delivered before a resume
            (:mod:`growcache.resume`): the whole shuffle windows they fill are passed over
            without reading their payloads (whole shards not even opened), the window they end
            in is read again and its delivered batches dropped. Default: ``0``.
        gone: indices of snapshot shards no longer in the cache (a resume with
            ``on_missing="skip"``): passed over like a corrupt shard. Default: none.
        then: shares read after this one, each as its own stream (a resume over another
            number of readers: each reader finishes the streams of one or more saved readers).
            Default: none.
        skip_records: records of the share's stream delivered before a resume re-planned over
            another batch size or shuffle buffer (:func:`delivered_records`): passed over like
            ``skip_batches``' whole windows, with no shuffle draws. Default: ``0``.
        exclude: stream positions past ``skip_records`` delivered before that resume (the
            window the save fell in): framed, never delivered again. Default: none.
    """

    paths: np.ndarray
    records: np.ndarray
    shards: np.ndarray
    quota: int = -1
    cycle: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    shuffle_seed: int = 0
    skip_batches: int = 0
    gone: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    then: tuple[ReaderShare, ...] = ()
    skip_records: int = 0
    exclude: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def shard_paths(self) -> np.ndarray:
        """Paths of the shards this reader reads, in order (``np.bytes_``)."""
        return self.paths[self.shards]

    def cycle_paths(self) -> np.ndarray:
        """Paths of the shards a top up cycles through (``np.bytes_``; empty for none)."""
        return self.paths[self.cycle]

    def records_owned(self) -> int:
        """Records in this reader's own shards."""
        return int(self.records[self.shards].sum())


def past_gone(share: ReaderShare, remaining: int, to_skip: int, drop: int, batch_size: int) -> int:
    """The records a resumed ``share`` still yields once it meets a shard gone from the cache
    (see :meth:`BatchReader._gone`), ``to_skip`` records short of its resume point, ``drop``
    batches of the window it re-reads delivered before the save. A quota is a promise of
    batches to DDP: those delivered batches still count against it, so the rank yields its
    planned batch count (and as many of its last records are not read this epoch)."""
    return remaining - to_skip - (drop * batch_size if share.quota >= 0 else 0)


def delivered_records(shuffle_seed: int, quota: int, delivered: int, batch_size: int, shuffle_buffer: int,
                      drop_last: bool) -> tuple[int, np.ndarray]:
    """Which records of a reader's stream its first ``delivered`` batches held, for a resume
    re-planned over another batch size or shuffle buffer: ``(whole records, positions)``, the
    stream's first records (whole windows) and the positions past them that the window the
    save fell in had delivered. It replays :meth:`BatchReader.batches`' shuffle draws and its
    last window's compaction, reading nothing; a reader without skipped shards only."""
    windows = window_batches(shuffle_buffer, batch_size)
    rows = windows * batch_size
    skip_windows, drop = divmod(max(int(delivered), 0), windows)
    skip = min(skip_windows * rows, max(int(quota), 0))
    if not drop:
        return skip, np.empty(0, np.int64)
    filled = min(rows, int(quota) - skip)
    targets = np.arange(rows)
    if windows > 1:
        rng = np.random.default_rng([shuffle_seed & 0xFFFFFFFFFFFFFFFF, 0x73687566])
        for _ in range(skip_windows):
            rng.permutation(rows)
        targets = rng.permutation(rows)
    final = targets[:filled].copy()
    if filled < rows and windows > 1:  # the last, partial window: compacted into the holes below `filled`
        used = np.zeros(rows, bool)
        used[final] = True
        holes = np.flatnonzero(~used[:filled])
        movers = np.flatnonzero(used[filled:]) + filled
        moved = dict(zip(movers.tolist(), holes.tolist()))
        final = np.array([moved.get(int(t), int(t)) for t in final], np.int64)
    return skip, skip + np.flatnonzero(final // batch_size < drop).astype(np.int64)


def window_batches(shuffle_buffer: int, batch_size: int) -> int:
    """Batches of one shuffle window of ``shuffle_buffer`` records (``1``: no shuffle)."""
    return max(2, -(-shuffle_buffer // batch_size)) if shuffle_buffer else 1


def other_schema(path: str, exc: SchemaError) -> CorruptShardError:
    """A shard whose records do not follow the cache's schema is corrupt: named, and skipped
    under ``on_corrupt="skip"``, like any other (its CRCs are valid, so only decoding tells)."""
    return CorruptShardError(path, 0, f"its records follow another schema than the cache's: {str(exc).split('. ')[0]}")


#: What a shard that cannot be opened any more raises in a reader (a ``FileNotFoundError``...).
GONE = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


def vanished(path: str, exc: OSError) -> CorruptShardError:
    """A shard of the epoch that is gone (or a directory now) when its reader opens it: the
    epoch's lease keeps growcache's own eviction off it, so a person or a process deleted it, or
    another machine's cleanup judged the lease dead. Named, and passed over under
    ``on_corrupt="skip"`` like a corrupt one (its records are lost to this epoch)."""
    return CorruptShardError(
        path, 0, f"it cannot be read ({exc.strerror or type(exc).__name__}): deleted or replaced while this "
                 "epoch's lease held it",
        "Nothing else in the cache is affected and the next epoch reads the shards present; read with "
        "on_corrupt='skip' to go on past it. If nobody deleted it, another process judged this one's lease "
        "dead: containers that share a hostname need GROWCACHE_NODE set to a name of their own, and a "
        "process paused for longer than GROWCACHE_OWNER_EXPIRY loses its lease")


def malformed(path: str, offset: int, exc: ValueError) -> CorruptShardError:
    """A record with valid framing and CRCs that is not one well-formed ``tf.train.Example``
    (a bad wire type, a field past its message's end, an ambiguous one) is corrupt: named with
    its offset, and skipped under ``on_corrupt="skip"``, like a CRC failure."""
    return CorruptShardError(path, offset, f"the record is not a well-formed tf.train.Example ({exc})")


class BatchReader:
    """Reads a :class:`ReaderShare` into batches of numpy rows.

    Args:
        schema: the records' schema.
        batch_size: rows per batch.
        frames: framing function. Default: :func:`growcache_frames`.
        verify: check every record's CRC32C. Default: ``True``.
        on_corrupt: ``"raise"`` a :class:`CorruptShardError`, or ``"skip"`` the rest of the
            shard from the bad record on (framing cannot be trusted past it) and yield a
            :class:`Skipped` note. Default: ``"raise"``.
        drop_last: drop the final partial batch. Default: ``False``.
        shuffle_buffer: records shuffled together. Records are read in windows of
            ``shuffle_buffer`` records, rounded up to whole batches and at least two, and
            each window's records are scattered over its batches' rows at random: batches
            mix neighbouring shards and change members from epoch to epoch, and every record
            is still copied once, straight into its batch. ``0``: batches hold consecutive
            records in shard order. Default: ``0``.
    """

    #: Let go of the GIL during each record's CRC (the vectorized reader), so that readers in
    #: threads (the TensorFlow adapter's) check records in parallel. A reader alone in its
    #: process (a DataLoader worker) keeps it: letting go and taking it back costs 0.8 us, as
    #: much as the CRC of a 16 KiB record.
    release_gil = True

    def __init__(
        self,
        schema: Schema,
        batch_size: int,
        *,
        frames: Frames = growcache_frames,
        verify: bool = True,
        on_corrupt: str = "raise",
        drop_last: bool = False,
        shuffle_buffer: int = 0,
    ) -> None:
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, (int, np.integer)) or shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be an int >= 0 (records), got {shuffle_buffer!r}")
        self.schema = schema
        self.codec = ExampleCodec(schema)
        self.decoder = BatchDecoder(self.codec)
        self.batch_size = int(batch_size)
        self.frames = frames
        self.verify = verify
        self.on_corrupt = on_corrupt
        self.drop_last = drop_last
        self.shuffle_buffer = int(shuffle_buffer)
        #: batches of one shuffle window (1: no shuffle).
        self.window_batches = window_batches(self.shuffle_buffer, self.batch_size)
        self.records_read = 0
        self.records_skipped = 0

    def _frames_of(self, path: str) -> Iterator[tuple[int, memoryview]]:
        """The frames of shard ``path``; growcache's own framing refuses a record longer than any
        of the schema's before allocating it (a crafted length in a sparse file claimed gigabytes)."""
        if self.frames is growcache_frames:
            return iter_records(path, verify=self.verify, max_record_bytes=self.codec.max_record_bytes)
        return self.frames(path, self.verify)

    def _shard_order(self, share: ReaderShare, corrupt: set[int]) -> Iterator[int]:
        """The share's shards, then (with a quota) its cycle until the quota stops the caller.

        Shards found ``corrupt`` (the caller adds them) are not read again. If every shard of
        the cycle is corrupt, the quota is still a promise of batches to DDP: the reader goes
        on through the whole snapshot, repeating other ranks' records rather than hanging them.
        """
        yield from (int(i) for i in share.shards)
        if share.quota < 0:
            return
        cycle = [int(i) for i in share.cycle if share.records[i]]
        whole_snapshot = False
        while True:  # a top up cycles until the quota stops it
            cycle = [i for i in cycle if i not in corrupt]
            if not cycle and not whole_snapshot:
                whole_snapshot = True
                cycle = [i for i in range(share.records.size) if share.records[i] and i not in corrupt]
            if not cycle:
                return
            yield from cycle

    def _resume_point(self, share: ReaderShare, quota: int, rng: np.random.Generator) -> tuple[int, int]:
        """Where a resumed share starts: ``(records to pass over, batches of the next window to drop)``.

        Whole windows already delivered are passed over by their record counts, with the
        shuffle's draws for them, so the windows after come out as in the uninterrupted run.
        """
        if share.skip_records:  # re-planned: the saved reader's windows are not this reader's
            return int(share.skip_records), 0
        skip_windows, drop = divmod(max(int(share.skip_batches), 0), self.window_batches)
        rows = self.window_batches * self.batch_size
        if self.window_batches > 1:
            for _ in range(min(skip_windows, -(-quota // rows))):  # bounded: a state is untrusted
                rng.permutation(rows)
        return skip_windows * rows, drop

    def _gone(self, share: ReaderShare, index: int, corrupt: set[int]) -> Skipped:
        """Pass over shard ``index``, gone from the cache before a resume, as a corrupt one.

        If the window a resume re-reads is still open, it cannot be rebuilt as it was without the
        shard's records: the caller delivers it whole (at most one window of records again)
        rather than drop batches that would now hold records never delivered; with a quota, its
        batch count stays the planned one (:func:`past_gone`)."""
        corrupt.add(index)
        records = int(share.records[index])
        self.records_skipped += records
        return Skipped(os.fsdecode(share.paths[index]), 0, "gone from the cache before the resume", records)

    def _skip(self, exc: CorruptShardError, share: ReaderShare, index: int, got: int, corrupt: set[int]) -> Skipped:
        """Handle ``on_corrupt`` for shard ``index`` after ``got`` of its records: raise, or
        note it as never to be read again by this share and return its :class:`Skipped`."""
        if self.on_corrupt == "raise":
            raise exc
        corrupt.add(index)
        lost = max(int(share.records[index]) - got, 0)
        self.records_skipped += lost
        logger.warning("skipping the rest of corrupt shard %s from byte %d: %s", exc.path, exc.offset, exc.reason)
        return Skipped(exc.path, exc.offset, exc.reason, lost)

    def batches(
        self, share: ReaderShare, allocate: Allocate, release: Callable[[object], None] | None = None
    ) -> Iterator[tuple[object, dict[str, np.ndarray], int] | Skipped]:
        """Yield ``(key, arrays, rows)`` per batch (``allocate``'s key and arrays, rows
        filled), and a :class:`Skipped` per skipped shard.

        With a shuffle window, a window's batches are allocated as its records land in them,
        and come out together when it is full. ``release(key)`` takes back a batch that was
        allocated but ended up empty (the last window's compaction, ``drop_last``).

        The arrays are only valid until the next item is requested if ``allocate``
        reuses memory; that is the allocator's contract with its consumer.
        """
        batch_size = self.batch_size
        put = self.decoder.put
        quota = share.quota if share.quota >= 0 else int(share.records[share.shards].sum())
        remaining = quota
        corrupt: set[int] = set()
        # The shuffle scatters each window's records over the rows of its whole batches at
        # random: every record is still copied once, straight into its batch.
        window_batches = self.window_batches
        window_rows = window_batches * batch_size
        rng = np.random.default_rng([share.shuffle_seed & 0xFFFFFFFFFFFFFFFF, 0x73687566])
        sequential = list(range(window_rows))  # per-record lookups: a list beats numpy scalars
        targets = sequential
        window: list[tuple[object, dict[str, np.ndarray], list[np.ndarray]] | None] = []
        placed = 0
        to_skip, drop = self._resume_point(share, quota, rng)
        gone = {int(i) for i in share.gone}
        excluded = {int(i) for i in share.exclude}
        position = 0  # in the share's stream, for `excluded`

        def rows_of(number: int) -> list[np.ndarray]:
            entry = window[number]
            if entry is None:  # allocated when its first record lands
                key, arrays = allocate(batch_size)
                # Flat byte rows per feature: one memcpy per payload, no dtype work (int64_list
                # payloads go to staging rows, decoded a batch at a time by finish()).
                entry = window[number] = (key, arrays, self.decoder.rows(arrays))
            return entry[2]

        def close_window(filled: int) -> Iterator[tuple[object, dict[str, np.ndarray], int]]:
            nonlocal drop
            if filled < window_rows and targets is not sequential:
                # A last, partial window: move the records that landed at or past ``filled``
                # into the holes below it, so the batches come out dense.
                used = np.zeros(window_rows, bool)
                used[targets[:filled]] = True
                holes = np.flatnonzero(~used[:filled])
                movers = np.flatnonzero(used[filled:]) + filled
                for hole, mover in zip(holes.tolist(), movers.tolist()):
                    src, dst = rows_of(mover // batch_size), rows_of(hole // batch_size)
                    for d, s in zip(dst, src):
                        d[hole % batch_size] = s[mover % batch_size]
            for number, entry in enumerate(window):
                if entry is None:
                    continue
                rows = min(batch_size, filled - number * batch_size)
                if number < drop:  # delivered before a resume: read again only to place the rest
                    if release is not None:
                        release(entry[0])
                elif rows == batch_size or (rows > 0 and not self.drop_last):
                    self.decoder.finish(entry[1], entry[2], rows)
                    yield entry[0], entry[1], rows
                elif release is not None:
                    release(entry[0])  # allocated, then emptied by the compaction or drop_last
            window.clear()
            drop = 0

        for index in self._shard_order(share, corrupt):
            if remaining <= 0:
                break
            if to_skip and int(share.records[index]) <= to_skip:  # delivered whole before a resume
                to_skip -= int(share.records[index])
                remaining -= int(share.records[index])
                position += int(share.records[index])
                continue
            if index in gone:
                drop, remaining, to_skip = 0, past_gone(share, remaining, to_skip, drop, batch_size), 0
                yield self._gone(share, index, corrupt)
                continue
            path = os.fsdecode(share.paths[index])
            got = 0
            try:
                for at, record in count_checked(path, self._frames_of(path)):
                    position += 1
                    if to_skip or (excluded and position - 1 in excluded):  # delivered before a resume
                        to_skip = max(to_skip - 1, 0)
                        remaining -= 1
                        continue
                    if not window:
                        window.extend([None] * window_batches)
                        targets = rng.permutation(window_rows).tolist() if window_batches > 1 else sequential
                        placed = 0
                    target = targets[placed]
                    try:
                        put(record, rows_of(target // batch_size), target % batch_size)
                    except SchemaError:
                        raise
                    except ValueError as exc:
                        raise malformed(path, at, exc) from None
                    # Counted once placed: a record the schema refuses is one of the shard's lost ones.
                    got += 1
                    remaining -= 1
                    placed += 1
                    if placed == window_rows:
                        yield from close_window(placed)
                    if remaining <= 0:
                        break
            except CorruptShardError as exc:
                yield self._skip(exc, share, index, got, corrupt)
            except SchemaError as exc:  # a shard of another schema among the cache's: a corrupt one
                yield self._skip(other_schema(path, exc), share, index, got, corrupt)
            except GONE as exc:
                yield self._skip(vanished(path, exc), share, index, got, corrupt)
            self.records_read += got
        if window:
            yield from close_window(placed)
