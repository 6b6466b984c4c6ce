"""Epochs read by a framework that pulls: one call per iterator start, per batch, per leave.

For an adapter whose framework runs the input pipeline in its own threads and calls back
into Python (TensorFlow's ``tf.data`` through ``numpy_function``), framework-neutral: every
value crosses as numpy. Each framework iterator of the dataset is one reader of an epoch,
named by a *token* (its epoch's :attr:`~growcache.epoch.Epoch.token` in the high 32 bits,
its own number in the low):

* :class:`IteratorEpochs` starts (or joins) the epoch for a new iterator, hands its share
  over, lets the iterator leave at the first of its second pull (the epoch was read out) and
  its teardown, checks a shard before a reader growcache does not control opens it, and
  keeps the growcache errors raised inside the framework so the adapter can raise them as
  themselves.
* :class:`SlabFeed` reads an iterator's shares with growcache's own readers, one batch per
  call, into slots of slabs it reuses across epochs: a batch costs no copy beyond the
  reader's own.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .batching import Skipped
from .epoch import Epoch, Epochs
from .errors import GrowcacheError
from .metrics import InputMeter
from .readers import slab_batches
from .transport import COPY_BELOW, BatchLayout, Slab

__all__ = ["IteratorEpochs", "SlabFeed"]

logger = logging.getLogger(__name__)

#: Slots per reader beyond its shuffle window: batches in the framework's buffers and the one
#: the training step holds. When every slot is held, a batch gets fresh memory instead.
SPARE_SLOTS = 4
_ITERATORS = itertools.count(1)


class IteratorEpochs:
    """The epochs of one input pipeline, as its framework iterators start, pull and leave them.

    Args:
        epochs: the pipeline's :class:`~growcache.epoch.Epochs`.

    Attributes:
        on_leave: called with an iterator's token once it left its epoch. Default: ``None``.
        meter: the pipeline's :class:`~growcache.metrics.InputMeter` (its stall and freshness figures).
    """

    def __init__(self, epochs: Epochs) -> None:
        self.epochs = epochs
        self.on_leave: Callable[[int], None] | None = None
        self.meter = InputMeter(epochs)
        self._lock = threading.Lock()
        self._emitted: set[int] = set()
        self._finished: set[int] = set()
        self._errors: list[GrowcacheError] = []  # raised inside the framework, to raise as themselves

    def begin(self) -> tuple[Epoch, np.int64]:
        """Start (or join) an epoch for a new iterator; return it and the iterator's token."""
        try:
            epoch = self.epochs.start()
        except GrowcacheError as exc:
            self.note(exc)
            raise
        self.meter.begin(epoch)
        return epoch, np.int64(epoch.token << 32 | next(_ITERATORS))

    def start_share(self) -> tuple[np.ndarray, ...]:
        """Begin an iterator's epoch and hand over its share: ``(token, shard paths, top-up
        paths, quota, shuffle seed)``. The top-up paths are read only once the checked
        records fall short of the quota; a lone pipeline's quota is all its records."""
        epoch, token = self.begin()
        share = epoch.share(0)
        logger.debug("epoch %d pipeline %d/%d: %d of %d shards", epoch.number, self.epochs.group.world_rank,
                     self.epochs.group.world_size, len(share.shards), len(epoch.shards))
        quota = share.quota if share.quota >= 0 else share.records_owned()
        return token, share.shard_paths(), share.cycle_paths(), np.int64(quota), np.int64(share.shuffle_seed)

    def first_pull(self, token: int) -> bool:
        """Whether this is the iterator's first pull of its epoch's start: its second comes
        once every record of the epoch has left the read stages."""
        with self._lock:
            if int(token) not in self._emitted:
                self._emitted.add(int(token))
                return True
            self._finished.add(int(token))
        return False

    def leave(self, token: int) -> np.int64:
        """The iterator of ``token`` is done with its epoch, read to the end or torn down; once each."""
        with self._lock:
            self._emitted.discard(int(token))
            finished = int(token) in self._finished
            self._finished.discard(int(token))
        if self.on_leave is not None:
            self.on_leave(int(token))
        self.epochs.leave(int(token) >> 32, finished)
        self.meter.left(int(token) >> 32, finished)
        return np.int64(0)

    def checked_path(self, raw: bytes) -> bytes:
        """``raw`` once growcache has checked the shard, ``b""`` to skip it; raises if corrupt
        (see :meth:`~growcache.epoch.Epochs.check_shard`)."""
        try:
            return raw if self.epochs.check_shard(os.fsdecode(raw)) else b""
        except GrowcacheError as exc:
            self.note(exc)
            raise

    def note(self, error: GrowcacheError) -> None:
        """Keep an error raised inside the framework, for :meth:`error_for`."""
        with self._lock:
            self._errors[:] = [*self._errors[-15:], error]  # errors inside derived datasets are never claimed

    def error_for(self, message: str) -> GrowcacheError | None:
        """The growcache error behind a framework error with this ``message``, if one of ours
        raised it (taken off the list: raised again it holds the iterator's frames, which must
        not outlive the caller's)."""
        with self._lock:
            for i in range(len(self._errors) - 1, -1, -1):
                if str(self._errors[i]) in message:
                    return self._errors.pop(i).with_traceback(None)
        return None


class SlabFeed:
    """Each iterator's readers, pulled one batch per call, batches in reused slab slots.

    Batches reach the framework as zero-copy views of a slot (a tensor keeps its slot until
    it is collected); features of at most :data:`~growcache.transport.COPY_BELOW` bytes are
    copied out. Each reader reads into a slab of its own, taken from a pool when it starts
    and given back when it ends; an iterator's readers go when it leaves its epoch.

    Args:
        iterators: the pipeline's :class:`IteratorEpochs`; its ``on_leave`` is taken.
    """

    def __init__(self, iterators: IteratorEpochs) -> None:
        self.iterators = iterators
        self.spec = iterators.epochs.reader
        self.names = list(self.spec.schema)
        self._layout = BatchLayout.from_schema(self.spec.schema, self.spec.batch_size)
        self._lock = threading.Lock()
        self._open: dict[int, tuple[Epoch, dict[int, Any]]] = {}  # token -> (epoch, reader -> batches)
        self._slabs: list[Slab] = []  # free slabs
        iterators.on_leave = self._drop

    def start(self) -> tuple[np.int64]:
        """Start (or join) an epoch for a new iterator; its token keys the iterator's readers."""
        epoch, token = self.iterators.begin()
        with self._lock:
            self._open[int(token)] = (epoch, {})
        return (token,)

    def pull(self, token: int, index: int) -> list[np.ndarray]:
        """The next batch of reader ``index`` of iterator ``token``: ``[rows, *arrays]`` in
        schema order; 0 rows once the reader is read out."""
        with self._lock:
            epoch, readers = self._open.get(int(token), (None, None))
        if epoch is None or epoch.ended:
            return self._empty()
        batches = readers.get(int(index))
        if batches is None:
            batches = readers[int(index)] = self._read(epoch, int(index))
        meter, item = self.iterators.meter, None
        meter.stage_enter()  # inside a tf.function this is the only place a stall shows
        try:
            item = next(batches, None)
        except GrowcacheError as exc:
            self.iterators.note(exc)
            raise
        finally:
            meter.stage_exit(0 if item is None else int(item[0]))
        return self._empty() if item is None else item

    def _read(self, epoch: Epoch, index: int):
        slab = self._take_slab()
        try:
            for item in slab_batches(self.spec.build(), epoch.share(index), slab):
                if isinstance(item, Skipped):
                    self.iterators.epochs.note_skipped(item)
                    continue
                handle, arrays = item
                if handle is not None:
                    arrays = slab.open(handle, copy_below=COPY_BELOW)
                yield [np.int64(len(arrays[self.names[0]])), *(arrays[name] for name in self.names)]
        finally:
            with self._lock:
                self._slabs.append(slab)

    def _take_slab(self) -> Slab:
        with self._lock:
            slab = self._slabs.pop() if self._slabs else None
        if slab is None:
            return Slab(self._layout, self.spec.window_batches + SPARE_SLOTS)
        slab.reclaim(slab.held_tokens())  # slots an abandoned reader claimed and never handed out
        return slab

    def _empty(self) -> list[np.ndarray]:
        return [np.int64(0), *(np.empty((0, *s.shape), s.dtype) for s in self.spec.schema.values())]

    def _drop(self, token: int) -> None:
        with self._lock:
            _, readers = self._open.pop(token, (None, {}))
        for batches in readers.values():
            try:
                batches.close()  # gives its slab back
            except ValueError:  # still running in a framework thread: it stops at its next pull
                pass
