"""Record reading and batching into numpy, shared by every framework adapter.

A reader follows its :class:`~growcache.planning.EpochPlan` share: it walks its shards,
frames records (with any framing function: growcache's own :func:`iter_records` or an
adapter's), and copies each record's payloads into the rows of a preallocated batch.
Records growcache wrote share one fixed layout (:attr:`ExampleCodec.layout`), so a
payload is a slice at a known offset; other records (TensorFlow's writer orders map
entries its own way) go through :meth:`ExampleCodec.payload_views`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .errors import CorruptShardError
from .example import ExampleCodec
from .records import iter_records
from .schema import Schema

__all__ = ["BatchReader", "Frames", "ReaderShare", "Skipped", "growcache_frames"]

logger = logging.getLogger(__name__)

#: A framing function: ``(path, verify) -> iterator of (byte offset, record view)``.
Frames = Callable[[str, bool], Iterator[tuple[int, memoryview]]]

#: Allocates a batch: ``(batch_size) -> (key, {name: array of batch_size rows})``.
Allocate = Callable[[int], tuple[object, dict[str, np.ndarray]]]


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
    """

    paths: np.ndarray
    records: np.ndarray
    shards: np.ndarray
    quota: int = -1
    cycle: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


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
    """

    def __init__(
        self,
        schema: Schema,
        batch_size: int,
        *,
        frames: Frames = growcache_frames,
        verify: bool = True,
        on_corrupt: str = "raise",
        drop_last: bool = False,
    ) -> None:
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        self.schema = schema
        self.codec = ExampleCodec(schema)
        self.batch_size = int(batch_size)
        self.frames = frames
        self.verify = verify
        self.on_corrupt = on_corrupt
        self.drop_last = drop_last
        self.records_read = 0
        self.records_skipped = 0

    def _shard_order(self, share: ReaderShare) -> Iterator[int]:
        yield from (int(i) for i in share.shards)
        if share.quota < 0 or share.cycle.size == 0 or share.records[share.cycle].sum() == 0:
            return
        while True:  # a top up cycles until the quota stops it
            yield from (int(i) for i in share.cycle)

    def batches(self, share: ReaderShare, allocate: Allocate) -> Iterator[tuple[object, dict[str, np.ndarray], int] | Skipped]:
        """Yield ``(key, arrays, rows)`` per batch (``allocate``'s key and arrays, rows
        filled), and a :class:`Skipped` per skipped shard.

        The arrays are only valid until the next item is requested if ``allocate``
        reuses memory; that is the allocator's contract with its consumer.
        """
        batch_size = self.batch_size
        layout = self.codec.layout
        names = [name for name, _, _ in layout]
        quota = share.quota if share.quota >= 0 else int(share.records[share.shards].sum())
        remaining = quota
        key, arrays, rows = None, None, None
        filled = 0
        passes_without_records = 0
        for index in self._shard_order(share):
            if remaining <= 0:
                break
            path = os.fsdecode(share.paths[index])
            got = 0
            try:
                for _, record in self.frames(path, self.verify):
                    if arrays is None:
                        key, arrays = allocate(batch_size)
                        # Flat byte rows per feature: one memcpy per payload, no dtype work.
                        rows = [arrays[n].reshape(batch_size, -1).view(np.uint8) for n in names]
                        filled = 0
                    if self.codec.has_layout(record):
                        for dst, (_, offset, nbytes) in zip(rows, layout):
                            dst[filled] = np.frombuffer(record, np.uint8, nbytes, offset)
                    else:
                        views = self.codec.payload_views(record)
                        for dst, name in zip(rows, names):
                            dst[filled] = np.frombuffer(views[name], np.uint8)
                    filled += 1
                    got += 1
                    remaining -= 1
                    if filled == batch_size:
                        yield key, arrays, filled
                        arrays = None
                    if remaining <= 0:
                        break
            except CorruptShardError as exc:
                if self.on_corrupt == "raise":
                    raise
                lost = max(int(share.records[index]) - got, 0)
                self.records_skipped += lost
                logger.warning("skipping the rest of corrupt shard %s from byte %d: %s", path, exc.offset, exc.reason)
                yield Skipped(exc.path, exc.offset, exc.reason, lost)
            self.records_read += got
            # A top up over shards that all turn out corrupt must end, not spin.
            passes_without_records = 0 if got else passes_without_records + 1
            if passes_without_records > len(share.shards) + len(share.cycle):
                break
        if arrays is not None and filled and not self.drop_last:
            yield key, arrays, filled
