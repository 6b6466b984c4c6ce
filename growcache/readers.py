"""Which reader reads an epoch's shares: one picklable description, built in each reader process.

Every adapter that reads records in Python (the PyTorch workers, TensorFlow's
``reader="growcache"``) gets its readers from :class:`ReaderSpec`, so a faster reader plugs in
at one place:
:meth:`ReaderSpec.build` gives the vectorized :class:`~growcache.vector_reader.VectorReader` for
growcache's own framing and the record-by-record :class:`~growcache.batching.BatchReader` for any
other framing function, and :func:`slab_batches` reads a share into the slots of a
:class:`~growcache.transport.Slab`, whichever process the reader runs in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .batching import BatchReader, Frames, ReaderShare, Skipped, growcache_frames, window_batches
from .schema import Schema
from .transport import Slab, SlotHandle, aligned_empty
from .vector_reader import VectorReader

__all__ = ["ReaderSpec", "slab_batches"]


@dataclass(frozen=True)
class ReaderSpec:
    """How every reader of an epoch reads: picklable, so it crosses into worker processes.

    :meth:`build` makes the reader; a faster reader for some shards plugs in there, and every
    adapter that reads records in Python gets it.

    Attributes:
        schema: the records' schema.
        batch_size: rows per batch.
        verify: check every record's CRC32C. Default: ``True``.
        on_corrupt: ``"raise"`` or ``"skip"``. Default: ``"raise"``.
        drop_last: drop each reader's final partial batch. Default: ``False``.
        shuffle_buffer: records shuffled together (see :class:`~growcache.batching.BatchReader`).
            Default: ``0``.
    """

    schema: Schema
    batch_size: int
    verify: bool = True
    on_corrupt: str = "raise"
    drop_last: bool = False
    shuffle_buffer: int = 0

    def build(self, frames: Frames | None = None) -> BatchReader:
        """The reader. With growcache's framing (the default) it is the vectorized
        :class:`~growcache.vector_reader.VectorReader`, which reads fixed-layout shards a piece
        at a time and everything else record by record; another framing function ``frames``
        gets the record-by-record reader."""
        kind = VectorReader if frames is None or frames is growcache_frames else BatchReader
        return kind(self.schema, self.batch_size, frames=frames or growcache_frames, verify=self.verify,
                    on_corrupt=self.on_corrupt, drop_last=self.drop_last, shuffle_buffer=self.shuffle_buffer)

    @property
    def window_batches(self) -> int:
        """Batches of one shuffle window (the slots a reader fills at once)."""
        return window_batches(self.shuffle_buffer, self.batch_size)


def slab_batches(reader: BatchReader, share: ReaderShare, slab: Slab | None
                 ) -> Iterator[Skipped | tuple[SlotHandle | None, dict[str, np.ndarray]]]:
    """``reader``'s batches of ``share``, each read into a free slot of ``slab``.

    Yields:
        ``(handle, arrays)`` per batch: the slot's :class:`~growcache.transport.SlotHandle`
        (its ``records`` are the batch's rows) and the slot's arrays; or ``(None, arrays)``
        with fresh, cache-line aligned arrays of the batch's rows when there is no slab or
        the consumer holds every slot (it keeps batches), so a reader never waits on it.
        A :class:`~growcache.batching.Skipped` note per corrupt shard skipped.
    """
    schema = reader.schema

    def allocate(rows: int) -> tuple[Any, dict[str, np.ndarray]]:
        claimed = slab.acquire(rows) if slab is not None else None
        if claimed is None:
            return None, {name: aligned_empty((rows, *spec.shape), spec.dtype) for name, spec in schema.items()}
        return claimed

    def release(handle: Any) -> None:
        if handle is not None:  # a slot that ended up holding no row
            slab.give_back(handle)

    parts = (share, *share.then)  # a resume re-planned over fewer or more readers: several streams
    for item in (item for part in parts for item in reader.batches(part, allocate, release)):
        if isinstance(item, Skipped):
            yield item
            continue
        handle, arrays, rows = item
        if handle is None:
            yield None, {name: array[:rows] for name, array in arrays.items()}
        else:
            yield handle._replace(records=rows), arrays
