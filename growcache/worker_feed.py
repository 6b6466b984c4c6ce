"""Epochs read by reader processes: each epoch's shares go out, batches come back in slab slots.

For an adapter whose readers are processes its framework starts (PyTorch's DataLoader
workers), framework-neutral; the adapter wraps the numpy arrays in its own tensors.

* The training process starts the epoch (:meth:`growcache.epoch.Epochs.start`) and calls
  :meth:`WorkerFeed.announce`: a new *generation* number, and per reader process an
  :class:`EpochMessage` (its share, and the slots of its slab the trainer still holds) sent
  down that process's pipe.
* A reader process fixes the generation when its framework asks it for the epoch's
  iterator (:attr:`WorkerFeed.generation`), then :meth:`WorkerFeed.read` waits up to
  :data:`PLAN_TIMEOUT_S` for that epoch's message (older ones belong to abandoned epochs)
  and reads the share into slots of its slab (:func:`growcache.readers.slab_batches`). It
  yields :class:`~growcache.transport.SlotHandle`\\ s, dicts of numpy arrays (no free slot),
  :class:`~growcache.batching.Skipped` notes and :class:`WorkerFailure`\\ s.
* The training process passes what arrives through :meth:`WorkerFeed.received`, which
  notes the skipped shards and raises the readers' errors as themselves.

No named semaphores. A ``multiprocessing.Queue`` creates three and a locked ``Value`` one;
under ``spawn`` and ``forkserver`` they live in ``/dev/shm`` until the resource tracker
removes them, and a kill of the whole process group takes the tracker along. Here each
reader process has a one-way pipe (one writer, one reader: no lock), written by a thread of
the training process so that a large message never blocks it, and the counters are
unlocked shared integers with one writer each.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._proc import exit_with, this_process
from .batching import BatchReader, ReaderShare, Skipped
from .device_release import remap_in_worker
from .epoch import Epoch, Epochs
from .errors import ForeignLoaderError, GrowcacheError
from .readers import slab_batches
from .transport import BatchLayout, Slab, SlotHandle, make_slabs

__all__ = ["PLAN_TIMEOUT_S", "EpochMessage", "Unslotted", "WorkerFailure", "WorkerFeed"]

#: Seconds a reader process waits for its epoch's message before it fails.
PLAN_TIMEOUT_S = 300.0


@dataclass
class EpochMessage:
    """One reader process's part of one epoch."""

    generation: int
    share: ReaderShare
    held: list[tuple[int, int]]  # (slot, token) of the batches the trainer still holds


class Unslotted(NamedTuple):
    """A reader process's batch that found no free slot: its arrays, sent the framework's way,
    with the reader that read it (the slot handle of every other batch names it)."""

    reader: int
    arrays: Any


@dataclass
class WorkerFailure:
    """An error raised in a reader process, carried as data so its type survives the trip
    (DataLoader re-creates worker errors from a message, which loses ``path``/``offset``)."""

    error: BaseException


class WorkerFeed:
    """Both ends of the epoch protocol between a training process and ``workers`` reader processes.

    Build it in the training process before the readers start; they get it by ``fork`` or
    pickle, with the reading ends of the pipes only.

    Args:
        context: a ``multiprocessing`` context (or module) whose ``Pipe`` and ``RawArray``
            the readers can share.
        workers: reader processes; ``0`` reads in the training process.
    """

    def __init__(self, context: Any, workers: int) -> None:
        pipes = [context.Pipe(duplex=False) for _ in range(workers)]
        self.workers = int(workers)
        self._inboxes = [inbox for inbox, _ in pipes]
        self._outboxes: list[Any] = [outbox for _, outbox in pipes]
        self._senders: list[queue.SimpleQueue | None] = [None] * workers
        self._stop = weakref.finalize(self, _stop_senders, self._senders)
        # [0]: the generation announced last; [1 + w]: the generation reader w took last.
        self._counters = context.RawArray("q", 1 + max(workers, 1))
        self.slabs: list[Slab] = []
        self.remap = False  # forked readers map their (registered) slab afresh by name
        self._local: EpochMessage | None = None  # workers=0: taken once by the training process
        self._readers: collections.deque[int] = collections.deque()  # of the batches received, not handed over
        self._trainer = this_process()  # readers end with it (see start_epoch)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_outboxes=[], _senders=[], _stop=None, _local=None, _readers=collections.deque())
        return state

    @property
    def slots(self) -> int:
        """Slots per slab (``0`` before the first epoch, or without reader processes)."""
        return self.slabs[0].slots if self.slabs else 0

    @property
    def generation(self) -> int:
        """The epoch announced last; a reader fixes it when its iterator is made."""
        return int(self._counters[0])

    # -- training process ---------------------------------------------------------------------
    def start_epoch(self, epochs: Epochs, start_readers: Callable[[], Any], *, slots: int, start_method: str,
                    registered: bool = False) -> tuple[Epoch, Any]:
        """Start the next epoch of ``epochs`` on the reader processes.

        Makes the slabs at the first epoch, announces the epoch, then calls
        ``start_readers()`` (the framework's epoch iterator, which starts or resets the
        readers). Persistent readers read on in an abandoned epoch until they are reset, so
        older open epochs end only after that.

        Args:
            epochs: the adapter's :class:`~growcache.epoch.Epochs`.
            start_readers: starts or resets the readers; its result is returned.
            slots: slots per slab; fewer, with a warning, where ``/dev/shm`` has no room for them
                (:func:`~growcache.transport.make_slabs`): :attr:`slots` says how many.
            start_method: how the readers start (``"fork"``, ``"spawn"``, ``"forkserver"``).
            registered: the slabs will be registered with a device driver, so they keep their
                names and forked readers map them afresh
                (:func:`~growcache.device_release.remap_in_worker`). Default: ``False``.

        Returns:
            The started :class:`~growcache.epoch.Epoch` and ``start_readers()``'s result.
        """
        epoch = epochs.start()
        self._trainer = this_process()  # the process that iterates, whoever made the feed
        self._readers.clear()
        try:
            if self.workers and not self.slabs:
                # Made here, before the readers start: a reader killed by any signal then owns
                # nothing that could leak.
                layout = BatchLayout.from_schema(epochs.reader.schema, epochs.reader.batch_size)
                self.remap = start_method == "fork" and registered
                self.slabs[:] = make_slabs(layout, slots, self.workers,
                                           anonymous=start_method == "fork" and not registered)
            self.announce(epoch)
            started = start_readers()
        except BaseException:
            epoch.end()
            raise
        for old in epochs.open_epochs():
            if old is not epoch:
                old.end()
        return epoch, started

    def announce(self, epoch: Epoch) -> None:
        """Send every reader its share of ``epoch``."""
        generation = (self.generation + 1) & 0x7FFFFFFF
        self._counters[0] = generation
        for worker in range(max(self.workers, 1)):
            held = self.slabs[worker].held_tokens() if self.workers else []
            message = EpochMessage(generation, epoch.share(worker), held)
            if self.workers:
                self._send(worker, message)
            else:
                self._local = message

    def _send(self, worker: int, message: EpochMessage) -> None:
        sender = self._senders[worker]
        if sender is None:
            sender = self._senders[worker] = queue.SimpleQueue()
            threading.Thread(target=_send_each, args=(sender, self._outboxes[worker]), daemon=True,
                             name=f"growcache epoch feed {worker}").start()
        sender.put(message)

    def received(self, items: Iterable[Any], epochs: Epochs) -> Iterator[SlotHandle | dict]:
        """The readers' batches, as they arrive: handles of slab slots, or dicts of arrays.

        Notes skipped shards in ``epochs`` (:meth:`~growcache.epoch.Epochs.note_skipped`)
        and raises a reader's error as itself.
        """
        readers = self._readers
        for item in items:
            if isinstance(item, SlotHandle):
                readers.append(item.slab)
                yield item
            elif isinstance(item, Unslotted):
                readers.append(item.reader)
                yield item.arrays
            elif isinstance(item, dict):  # read in the training process: its one reader
                readers.append(0)
                yield item
            elif isinstance(item, Skipped):
                epochs.note_skipped(item)
            elif isinstance(item, WorkerFailure):
                raise item.error
            else:
                raise TypeError(f"unexpected item from a growcache reader: {type(item).__name__}")

    def close(self) -> None:
        """Stop sending and remove the slabs' names (their memory lives on while mapped)."""
        self._stop()
        for slab in self.slabs:
            slab.unlink()

    def handed_over(self) -> int | None:
        """The reader of the oldest batch :meth:`received` gave and the adapter had not yet
        handed to the training loop (``None``: none), called once per batch handed over, in
        order: :meth:`growcache.epoch.Epoch.consume` counts it for that reader."""
        return self._readers.popleft() if self._readers else None

    # -- reader process -----------------------------------------------------------------------
    def read(self, worker: int | None, generation: int, reader: BatchReader) -> Iterator[Any]:
        """Reader ``worker``'s items of epoch ``generation``; ``worker=None`` reads in the
        training process (no readers). Errors come as :class:`WorkerFailure` from a reader
        process, raised in the training process.

        Raises:
            ForeignLoaderError: no epoch of this feed was announced to this reader (a loader
                growcache did not build iterates it).
        """
        if worker is None:
            message, slab, self._local = self._local, None, None
            if message is None:
                raise ForeignLoaderError()
        else:
            if generation == 0 or worker >= self.workers or self._counters[1 + worker] >= generation:
                raise ForeignLoaderError()
            exit_with(*self._trainer)  # torch's own watchdog misses a trainer killed under forkserver
            message = self._receive(worker, generation)
            self._counters[1 + worker] = message.generation
            slab = remap_in_worker(self.slabs[worker]) if self.remap else self.slabs[worker]
            reader.release_gil = False  # alone in its process: no other thread to let go of it for
            slab.prefault()
            slab.start_generation(message.generation, message.held)
        try:
            for item in slab_batches(reader, message.share, slab):
                if isinstance(item, Skipped):
                    yield item
                else:
                    handle, arrays = item
                    yield handle if handle is not None else arrays if worker is None else Unslotted(worker, arrays)
        except GrowcacheError as exc:
            if worker is None:
                raise
            yield WorkerFailure(exc)

    def _receive(self, worker: int, expected: int) -> EpochMessage:
        inbox = self._inboxes[worker]
        deadline = time.monotonic() + PLAN_TIMEOUT_S
        while True:
            if not inbox.poll(max(deadline - time.monotonic(), 0.0)):
                raise RuntimeError(f"growcache worker {worker} got no epoch plan in {PLAN_TIMEOUT_S} s")
            message = inbox.recv()
            if message.generation >= expected:  # older ones belong to abandoned epochs
                return message


def _send_each(messages: queue.SimpleQueue, outbox: Any) -> None:
    try:
        while (message := messages.get()) is not None:
            outbox.send(message)
    except OSError:  # every reading end is closed: the readers and the feed are gone
        pass
    finally:
        outbox.close()


def _stop_senders(senders: list[queue.SimpleQueue | None]) -> None:
    for sender in senders:
        if sender is not None:
            sender.put(None)
