"""Host memory that a device reads on its own schedule: when it may be given back.

A device copy (a DMA) reads host memory *after* the call that enqueued it has returned. A
slot of a :class:`~growcache.transport.Slab` therefore may go back to its worker only when
every device copy that reads it has completed; a worker that refilled it earlier would
change the data under the copy, silently. This module owns that rule for every adapter.
It knows a device only through a *completion event*: anything with ``query()`` (has
everything enqueued before it finished?) and ``synchronize()`` (wait until it has), as a
CUDA event recorded on a stream after the copies has.

Two ways host memory is handed to a device, one protocol each:

* **The loader copies** (``make_torch_loader(device=...)``). :func:`deliver` runs a
  :class:`CopyEngine` one batch ahead: the copy of batch k+1 is in flight while the consumer
  works on batch k. Each batch's host memory (its ``keep`` object: the slot's views) goes to
  :meth:`ReleaseQueue.hold` with the event recorded after its copy, and is dropped, which
  frees the slot, only once that event has completed.
* **The consumer copies** (``pin_memory=True``: the consumer calls
  ``.to(device, non_blocking=True)`` itself). The loader cannot see those copies, so the
  consumer's arrays are made by :meth:`ReleaseQueue.guard`: when the last of them is
  garbage collected the batch is *retired*, not freed. Each time the consumer asks for the
  next batch, :meth:`ReleaseQueue.fence` records one event on the consumer's stream and ties
  every batch retired so far to it. A slot is freed only after (a) the consumer dropped every
  array of it and (b) an event recorded *after* that on the consumer's stream completed, so
  any copy the consumer enqueued on that stream before letting go has finished.

Memory that a forked process inherits is the other hazard: a driver may mark registered
memory do-not-fork, and a forked worker would then find its slab unmapped. Workers of a
loader that registers its slabs therefore map their slab again by name
(:func:`remap_in_worker`) instead of trusting the inherited mapping.
"""

from __future__ import annotations

import collections
import os
import pickle
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np

__all__ = ["CompletionEvent", "CopyEngine", "InFlight", "ReleaseQueue", "deliver", "remap_in_worker"]


class CompletionEvent(Protocol):
    """A point in a device's queue of work (a CUDA event recorded on a stream, say)."""

    def query(self) -> bool:
        """Whether all work enqueued before the event has completed; never blocks."""

    def synchronize(self) -> None:
        """Block until all work enqueued before the event has completed."""


class InFlight(NamedTuple):
    """One batch whose copy to the device has been enqueued.

    Attributes:
        batch: the device batch, not yet ordered on the consumer's stream.
        event: completes when the copy has finished reading host memory.
        keep: the host memory the copy reads (``None`` when the engine staged the batch
            through memory whose lifetime it tracks itself).
    """

    batch: Any
    event: CompletionEvent
    keep: Any


class CopyEngine(Protocol):
    """Enqueues host-to-device copies; :func:`deliver` decides when host memory is freed."""

    def start(self, host: Any) -> InFlight:
        """Enqueue the copy of one host batch and record the event after it."""

    def hand_over(self, flight: InFlight) -> Any:
        """Make the consumer's stream wait for ``flight``'s copy; return the batch to yield."""


class _Retirement:
    """Shared by every guard of one batch: when the last guard dies, the batch is retired."""

    __slots__ = ("_keep", "_queue")

    def __init__(self, keep: Any, queue: ReleaseQueue) -> None:
        self._keep = keep
        self._queue = weakref.ref(queue)

    def __del__(self) -> None:
        queue = self._queue()
        # After close (or with the queue gone) the memory is no longer page-locked, so no
        # copy from it can still be in flight: dropping `keep` frees it now. Garbage
        # collection may run this in any thread: a deque append is atomic.
        if queue is not None and not queue.closed:
            queue._retired.append(self._keep)


class _Guard:
    """Base object of one consumer array: the memory of a host array, tied to its batch."""

    __slots__ = ("__array_interface__", "_retirement")

    def __init__(self, array: np.ndarray, retirement: _Retirement) -> None:
        if not array.flags.c_contiguous:
            raise ValueError("only C-contiguous host arrays can be guarded")
        self.__array_interface__ = {
            "data": (array.ctypes.data, False), "shape": (array.nbytes,), "typestr": "|u1", "version": 3,
        }
        self._retirement = retirement


class ReleaseQueue:
    """Keeps host memory alive until the device copies that read it have completed.

    The queue holds references; dropping the last one is what frees the memory (a slab slot
    is freed when its lease is garbage collected), so the queue never needs to know what it
    holds. Not thread-safe apart from retirement: use one queue from one thread.

    Args:
        limit: pending holders beyond which :meth:`hold` waits for the oldest event, so a
            device far behind cannot make the queue hold every slot. Default: ``8``.
    """

    def __init__(self, limit: int = 8) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = int(limit)
        self._pending: collections.deque[tuple[CompletionEvent, Any]] = collections.deque()
        self._retired: collections.deque[Any] = collections.deque()
        self.closed = False

    @property
    def pending(self) -> int:
        """Holders waiting for their event."""
        return len(self._pending)

    @property
    def retired(self) -> int:
        """Holders the consumer let go of that no fence covers yet."""
        return len(self._retired)

    def hold(self, keep: Any, event: CompletionEvent) -> None:
        """Keep ``keep`` alive until ``event`` has completed.

        Every copy that reads ``keep`` must have been enqueued before ``event`` was recorded,
        on the stream ``event`` was recorded on.
        """
        if keep is not None:
            self._pending.append((event, keep))
        while len(self._pending) > self.limit:
            oldest, _ = self._pending[0]
            oldest.synchronize()
            self._pending.popleft()

    def guard(self, arrays: Mapping[str, np.ndarray], keep: Any) -> dict[str, np.ndarray]:
        """Views of ``arrays`` for a consumer that copies to the device by itself.

        When the last view (and everything built on one) is garbage collected, ``keep`` is
        retired: it stays alive until the next :meth:`fence`'s event has completed.

        Args:
            arrays: host arrays inside the memory that ``keep`` keeps alive.
            keep: the object whose lifetime is the memory's (the slot's views).
        """
        retirement = _Retirement(keep, self)
        return {name: np.asarray(_Guard(a, retirement)).view(a.dtype).reshape(a.shape)
                for name, a in arrays.items()}

    def fence(self, make_event: Callable[[], CompletionEvent]) -> None:
        """Tie every batch retired so far to a new event.

        Call it when the consumer asks for its next batch, with a function that records an
        event on the consumer's stream: any copy the consumer enqueued on that stream from a
        batch before letting go of it completes before that event.
        """
        if not self._retired:
            return  # no event needed: nothing was let go since the last fence
        event = make_event()
        while self._retired:
            self._pending.append((event, self._retired.popleft()))

    def poll(self) -> int:
        """Drop every holder whose event has completed; return how many were dropped."""
        if not self._pending:
            return 0
        waiting: collections.deque[tuple[CompletionEvent, Any]] = collections.deque()
        done = 0
        # Events may come from several streams, so one that has not completed does not
        # hide a later one that has; the queue is a few entries long.
        try:
            while self._pending:
                if self._pending[0][0].query():
                    done += 1
                else:
                    waiting.append(self._pending[0])
                self._pending.popleft()
        finally:
            # A query that raised (a CUDA error) completed nothing: every holder not seen
            # done stays, or its slot would be refilled under a copy that may still read it.
            waiting.extend(self._pending)
            self._pending = waiting
        return done

    def drain(self, make_event: Callable[[], CompletionEvent] | None = None) -> None:
        """Wait for every pending event and drop every holder (an epoch's end, a close).

        Args:
            make_event: as for :meth:`fence`; retired holders are fenced first. Default:
                ``None``: retired holders stay retired.
        """
        if make_event is not None:
            self.fence(make_event)
        while self._pending:
            event, _ = self._pending[0]
            event.synchronize()
            self._pending.popleft()


    def close(self, make_event: Callable[[], CompletionEvent] | None = None) -> None:
        """:meth:`drain`, then free each guarded batch as soon as the consumer drops it.

        Call it when the memory stops being page-locked: from then on a copy from it is
        synchronous, so none can be in flight when the consumer lets go.
        """
        self.drain(make_event)
        self.closed = True
        self._retired.clear()


def deliver(host_batches: Iterable[Any], engine: CopyEngine, release: ReleaseQueue) -> Iterator[Any]:
    """Device batches, one copy ahead of the consumer.

    Before batch k is yielded, the copy of batch k+1 is already enqueued, so the device
    copies k+1 while the consumer computes on k. Each batch's host memory is held in
    ``release`` until its copy's event has completed; whatever ends the iteration (the last
    batch, a ``break``, an error), every pending copy is waited for before this returns.

    Args:
        host_batches: host batches, each as :meth:`CopyEngine.start` takes it.
        engine: enqueues the copies and orders them on the consumer's stream.
        release: the queue that frees host memory.
    """
    ahead: InFlight | None = None
    try:
        for host in host_batches:
            release.poll()  # before waiting on the workers: they may need those slots
            batch, event, keep = engine.start(host)
            del host
            release.hold(keep, event)
            del keep  # the queue's reference must be the last one
            if ahead is not None:
                out, ahead = engine.hand_over(ahead), None
                yield out
                del out
            ahead = InFlight(batch, event, None)
            del batch
        if ahead is not None:
            out, ahead = engine.hand_over(ahead), None
            yield out
    finally:
        ahead = None
        release.drain()


_REMAPPED: dict[tuple[int, str], Any] = {}


def remap_in_worker(slab: Any) -> Any:
    """``slab`` mapped afresh by name in this process, once per process.

    A forked worker inherits the training process's mapping of a slab, but a driver that
    pins host memory (CUDA does for registered memory, on some versions) may mark it
    do-not-fork, so the child would find the range unmapped. Mapping the named segment again
    cannot depend on that. The inherited object is kept alive, unused: closing it could
    unmap a range the new mapping now occupies.

    Args:
        slab: a named (``anonymous=False``) :class:`~growcache.transport.Slab`.
    """
    if slab.name is None:
        raise ValueError("only a named slab (anonymous=False) can be mapped again in a worker")
    key = (os.getpid(), slab.name)
    fresh = _REMAPPED.get(key)
    if fresh is None:
        # A named slab's pickle attaches by name: the same path spawn-started workers take.
        fresh = _REMAPPED[key] = pickle.loads(pickle.dumps(slab))
        _REMAPPED[(os.getpid(), "inherited:" + slab.name)] = slab
    return fresh
