"""Which reader reads an epoch's shares: one picklable description, built in each reader process.

Every adapter that reads records in Python (the PyTorch workers, TensorFlow's
``reader="growcache"``) gets its readers from :class:`ReaderSpec`, so a faster reader plugs in
at one place:
:meth:`ReaderSpec.build` gives the vectorized :class:`~growcache.vector_reader.VectorReader` for
growcache's own framing and the record-by-record :class:`~growcache.batching.BatchReader` for any
other framing function.
"""

from __future__ import annotations

from dataclasses import dataclass

from .batching import BatchReader, Frames, growcache_frames, window_batches
from .schema import Schema
from .vector_reader import VectorReader

__all__ = ["ReaderSpec"]


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
