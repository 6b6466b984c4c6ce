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
  themselves. It saves and loads the pipeline's exact mid-epoch position
  (:meth:`~IteratorEpochs.state_dict`, :mod:`growcache.resume`'s state).
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
from .errors import GrowcacheError, MissingShardsError
from .metrics import InputMeter
from .readers import slab_batches
from .resume import (DEFAULT_RESUME_TTL, check_consumed, check_state, keep_pin, load_state, loader_state, pin_epoch,
                     release_kept_pins)
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
        replays: the pipeline's reader cannot pass over what an epoch delivered before a save
            (``reader="tensorflow"``): a resumed epoch is read again from its start and the
            consumed batches dropped (:meth:`start_share`'s skip), so its pin keeps every shard
            of the epoch. Default: ``False``.
        resume_ttl: seconds an epoch's snapshot stays pinned from its first :meth:`state_dict`
            (``0``: no pin). Default: :data:`~growcache.resume.DEFAULT_RESUME_TTL`.

    Raises:
        ValueError: ``resume_ttl`` is not seconds >= 0.

    Attributes:
        on_leave: called with an iterator's token once it left its epoch. Default: ``None``.
        meter: the pipeline's :class:`~growcache.metrics.InputMeter` (its stall and freshness figures).
    """

    def __init__(self, epochs: Epochs, *, replays: bool = False, resume_ttl: float = DEFAULT_RESUME_TTL) -> None:
        if isinstance(resume_ttl, bool) or not isinstance(resume_ttl, (int, float)) or not 0 <= resume_ttl <= 10**9:
            raise ValueError(f"resume_ttl must be seconds >= 0, got {resume_ttl!r}")
        self.epochs = epochs
        self.replays = replays
        self.resume_ttl = float(resume_ttl)
        self.on_leave: Callable[[int], None] | None = None
        self.meter = InputMeter(epochs)
        self._lock = threading.Lock()
        self._emitted: set[int] = set()
        self._finished: set[int] = set()
        self._errors: list[GrowcacheError] = []  # raised inside the framework, to raise as themselves
        # Once a state is asked for or loaded, or an eager loop counts its batches, an epoch read
        # out ends when its consumer is done with it, not when its last batch leaves the read
        # stages: the framework's prefetch still holds batches a state saved then must count as
        # unread, whose shards it keeps.
        self._follow = False
        self._held: dict[int, Epoch] = {}  # epoch token -> epoch read out, its consumer behind
        # Epoch tokens whose consumer was done before their iterator left: TensorFlow tears the
        # C++ iterator down (and so calls leave) after the Python iterator is gone, so done()
        # may come first, and such an epoch must not wait for a consumer that is gone.
        self._consumer_gone: set[int] = set()
        self._base: dict[int, int] = {}  # epoch token -> Epoch.consumed at its start (a resume's progress)

    def begin(self) -> tuple[Epoch, np.int64]:
        """Start (or join) an epoch for a new iterator; return it and the iterator's token."""
        self._end_held()  # a new iterator: the consumer is done with the earlier ones
        try:
            epoch = self.epochs.start()
        except GrowcacheError as exc:
            self.note(exc)
            raise
        release_kept_pins(epoch)  # the run went on: states of its earlier epochs are stale
        with self._lock:
            self._base.setdefault(epoch.token, epoch.consumed)
        self.meter.begin(epoch)
        return epoch, np.int64(epoch.token << 32 | next(_ITERATORS))

    @property
    def reader(self) -> str:
        """The kind of reader a state of this pipeline names (:data:`growcache.resume.READERS`)."""
        return "tensorflow" if self.replays else "growcache"

    def start_share(self) -> tuple[np.ndarray, ...]:
        """Begin an iterator's epoch and hand over its share: ``(token, shard paths, top-up
        paths, quota, shuffle seed, batches to skip)``. The top-up paths are read only once the
        checked records fall short of the quota; a lone pipeline's quota is all its records. The
        skip is the progress of a resumed epoch of a pipeline that :attr:`replays`, else ``0``."""
        epoch, token = self.begin()
        share = epoch.share(0)
        logger.debug("epoch %d pipeline %d/%d: %d of %d shards", epoch.number, self.epochs.group.world_rank,
                     self.epochs.group.world_size, len(share.shards), len(epoch.shards))
        quota = share.quota if share.quota >= 0 else share.records_owned()
        skip = share.skip_batches if self.replays else 0
        return (token, share.shard_paths(), share.cycle_paths(), np.int64(quota), np.int64(share.shuffle_seed),
                np.int64(skip))

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
        """The iterator of ``token`` is done with its epoch, read to the end or torn down; once each.

        An epoch read out before the training loop took all its batches (they wait in the
        framework's buffers) stays open, once states are in use, until :meth:`done`.
        """
        with self._lock:
            self._emitted.discard(int(token))
            finished = int(token) in self._finished
            self._finished.discard(int(token))
        if self.on_leave is not None:
            self.on_leave(int(token))
        number = int(token) >> 32
        epoch = next((e for e in self.epochs.open_epochs() if e.token == number), None)
        behind = epoch is not None and epoch.consumed < epoch.batches()
        with self._lock:
            gone = number in self._consumer_gone
            self._consumer_gone.discard(number)
            hold = finished and behind and self._follow and not gone
            if hold:
                self._held[number] = epoch
        if not hold:
            if behind and (gone or not finished):
                keep_pin(epoch)  # dropped mid-epoch: a state saved in it may be resumed
            self.epochs.leave(number, finished)
            if epoch is not None and epoch.ended:
                with self._lock:
                    self._base.pop(number, None)
        self.meter.left(number, finished)
        return np.int64(0)

    def took(self, epoch: Epoch | None = None) -> Epoch | None:
        """The training loop took a batch of ``epoch`` (default: the latest started), counted in
        :attr:`~growcache.epoch.Epoch.consumed` (:meth:`~growcache.epoch.Epoch.consume`: the
        epoch's lease lets go of shards read whole): where the framework's iterator hands batches
        to Python one by one (eager TensorFlow). Returns the epoch."""
        self._follow = True  # the loop's progress is known from now on: epochs end with it
        epoch = epoch if epoch is not None else self.epochs.latest
        if epoch is not None:
            self._count(epoch, epoch.consumed + 1)
        return epoch

    def _count(self, epoch: Epoch, consumed: int) -> None:
        if consumed < epoch.consumed:  # counted ahead of the loop (batches it had prefetched)
            epoch.take_back(consumed)
        elif self.replays:
            # TensorFlow's interleave does not read in the plan's order: the lease holds everything.
            epoch.consumed = consumed
        elif consumed > epoch.consumed:  # the readers deliver round-robin: the lease lets go of shards read
            epoch.consume(consumed - epoch.consumed)

    def done(self, epoch: Epoch | None) -> None:
        """The training loop is done with ``epoch`` (read its iterator to the end, or dropped it):
        if the epoch was held open for it, it ends now (its pin kept if batches were left)."""
        if epoch is None:
            return
        with self._lock:
            held = self._held.pop(epoch.token, None)
            if held is None and not epoch.ended:
                self._consumer_gone.add(epoch.token)
        if held is not None:
            self._end(held)

    def _end_held(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for epoch in held:
            self._end(epoch)

    def _end(self, epoch: Epoch) -> None:
        if epoch.consumed < epoch.batches():
            keep_pin(epoch)  # its iterator dropped in the epoch's tail: a state saved in it may be resumed
        with self._lock:
            self._base.pop(epoch.token, None)
        self.epochs.leave(epoch.token, True)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The state to resume this pipeline at: :func:`growcache.resume.loader_state`, the same
        JSON-serializable dict as a torch loader's ``state_dict()``. The first call in an epoch
        pins its snapshot for :attr:`resume_ttl` seconds.

        Args:
            consumed: batches the training loop took from the current iterator (Keras: the
                epoch's steps so far), where the framework pulls them in compiled code; the
                count of a resumed epoch starts after the saved progress. Default: ``None``:
                the batches counted by :meth:`took` (an eager loop).

        Raises:
            ValueError: ``consumed`` is not an integer >= 0.
        """
        epochs, latest = self.epochs, self.epochs.latest
        self._follow = True
        check_consumed(consumed)
        if consumed is not None:
            if latest is not None:
                with self._lock:
                    base = self._base.get(latest.token, 0)
                self._count(latest, base + int(consumed))
        done = latest is None or latest.consumed >= latest.batches()
        loaded = epochs.resume is not None  # a state loaded, not yet resumed: given back as loaded
        if not done and not loaded:
            pin_epoch(latest, self.resume_ttl)
        # A replaying pipeline reads the resumed epoch from its start: its pin must not shrink.
        pin = latest.pin if self.replays and not loaded and latest is not None else None
        if pin is not None:
            latest.pin = None
        try:
            state = loader_state(epochs, latest, reader=self.reader)
        finally:
            if pin is not None:
                latest.pin = pin
        if pin is not None and state["snapshot"] is not None:
            state["pin"] = {"name": pin.name, "until": pin.until}
        if done and latest is not None:
            self.done(latest)
        return state

    def load_state_dict(self, state: Any, *, on_missing: str = "raise", replan: bool = False) -> None:
        """Resume from ``state`` (from a growcache dataset's or loader's ``state_dict()``): the
        next iterator finishes the saved epoch, batch by batch as the uninterrupted run would
        have; ``{"epoch": N}`` starts epoch ``N``. ``replan=True`` finishes it over another batch
        size, shuffle buffer or ``drop_last``, each record the loop had not consumed once. See
        :func:`growcache.resume.load_state`.

        Raises:
            ValueError: a damaged field (named), another cache's state, another layout, a
                mid-epoch state of another kind of reader (:attr:`reader`); for a pipeline that
                :attr:`replays`, a state of another number of readers, or ``replan=True``.
            MissingShardsError: shards the rest of the epoch reads are gone (``on_missing="raise"``);
                for a pipeline that replays, any shard of the saved epoch, whatever ``on_missing``.
        """
        if self.replays:
            checked = check_state(state)
            if replan:
                raise ValueError("replan=True re-plans the rest of an epoch record by record, but reader='tensorflow' "
                                 "(or a schema without a fixed layout) reads a resumed epoch again from its start and "
                                 "skips the saved batches whole: build the dataset as the saved run did (batch_size, "
                                 f"shuffle_buffer, drop_remainder), or load {{'epoch': {checked['epoch']}}} to read "
                                 "that epoch afresh")
            if checked["snapshot"] is not None and checked["plan"]["reader"] == self.reader:
                self._check_replay(checked)
        load_state(self.epochs, state, on_missing=on_missing, replan=replan, reader=self.reader)
        self._follow = True

    def _check_replay(self, state: dict[str, Any]) -> None:
        workers = state["plan"]["workers"]
        if workers != self.epochs.readers:
            raise ValueError(
                f"resume state field 'plan.workers' is {workers}, but this dataset reads with "
                f"{self.epochs.readers} reader(s) (reader='tensorflow', or a schema without a fixed layout): "
                "it re-reads a resumed epoch from its start, which only keeps the saved order with the saved "
                "readers. Build the dataset as the saved run did (reader=, cycle_length=)")
        present = {os.path.basename(s.path) for s in self.epochs.cache.list_shards()}
        skipped = set(state["snapshot"]["skipped"])
        lost = [(name, records) for name, _, records in state["snapshot"]["shards"]
                if name not in present and name not in skipped]
        if lost:
            names = ", ".join(name for name, _ in lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
            raise MissingShardsError(
                f"{len(lost)} shards of the saved epoch {state['epoch']} ({sum(r for _, r in lost)} records) are gone "
                f"from cache {self.epochs.cache.path}: {names}. reader='tensorflow' reads a resumed epoch again from "
                "its start, so it needs every shard of it (on_missing='skip' cannot keep its order): load "
                f"{{'epoch': {state['epoch']}}} to read that epoch afresh, or reader='growcache'",
                tuple(name for name, _ in lost), sum(r for _, r in lost))

    def checked_path(self, raw: bytes) -> bytes:
        """``raw`` once growcache has checked the shard, ``b""`` to skip it; raises if corrupt
        (see :meth:`~growcache.epoch.Epochs.check_shard`)."""
        try:
            return raw if self.epochs.check_shard(os.fsdecode(raw)) else b""
        except GrowcacheError as exc:
            self.note(exc)
            raise

    def note(self, error: GrowcacheError) -> None:
        """Keep an error raised inside the framework, for :meth:`raise_error_for`."""
        with self._lock:
            self._errors[:] = [*self._errors[-15:], error]  # errors inside derived datasets are never claimed

    def raise_error_for(self, message: str) -> None:
        """Raise the growcache error behind a framework error with this ``message``, if one of
        ours raised it; return otherwise.

        Raises:
            GrowcacheError: the error, taken off the list, without the frames it was first raised
                from, which must not outlive the caller's.
        """
        with self._lock:
            i = next((i for i in range(len(self._errors) - 1, -1, -1) if str(self._errors[i]) in message), None)
            error = None if i is None else self._errors.pop(i).with_traceback(None)
        if error is None:
            return
        try:
            raise error from None
        finally:
            # This frame is in the error's traceback: holding the error too would make a cycle that
            # keeps the caller's frames (a TensorFlow iterator, its epoch's lease) until a collection.
            error = None


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
