"""The slot-release protocol for device copies, with real slabs and an event interface.

The device is reached only through :class:`growcache.device_release.CompletionEvent`
(``query()``/``synchronize()``), so these tests run everywhere: the events here are plain
objects completed by the test, and the copy engine is a host "device" whose copies run
late, when their event is waited for, as a DMA engine's may. The CUDA implementation of the
same interface is tested in ``tests/torch/test_device.py`` where a GPU exists.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp

import numpy as np
import pytest

from growcache.device_release import InFlight, ReleaseQueue, deliver, remap_in_worker
from growcache.transport import BatchLayout, Slab

ROWS = 4
LAYOUT = BatchLayout.build([("id", "int64", ()), ("x", "float32", (3,))], batch_size=ROWS)


class Event:
    """A completion event the test completes by hand."""

    def __init__(self) -> None:
        self.done = False
        self.waits = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def _fill(slab: Slab, first_id: int):
    claimed = slab.acquire(ROWS)
    if claimed is None:
        return None
    handle, arrays = claimed
    arrays["id"][:] = np.arange(first_id, first_id + ROWS)
    arrays["x"][:] = arrays["id"][:, None]
    return handle


def _free_slots(slab: Slab) -> int:
    """How many slots the producer could take now (each taken one is given back)."""
    handles = []
    while (claimed := slab.acquire(ROWS)) is not None:
        handles.append(claimed[0])
    for handle in handles:
        slab.give_back(handle)
    return len(handles)


def test_held_slot_returns_only_after_its_copy_event_completes():
    slab = Slab(LAYOUT, slots=1)
    release = ReleaseQueue()
    views = slab.open(_fill(slab, 0))
    event = Event()
    release.hold(views, event)
    del views
    gc.collect()
    assert _free_slots(slab) == 0  # the consumer dropped it, but a copy may still read it
    assert release.poll() == 0
    event.done = True
    assert _free_slots(slab) == 0  # completed, but nobody looked yet
    assert release.poll() == 1
    assert _free_slots(slab) == 1 and release.pending == 0


def test_guarded_batch_needs_release_by_the_consumer_and_a_later_fence():
    slab = Slab(LAYOUT, slots=1)
    release = ReleaseQueue()
    events: list[Event] = []

    def record() -> Event:
        events.append(Event())
        return events[-1]

    views = slab.open(_fill(slab, 8))
    batch = release.guard(views, views)
    del views
    assert batch["id"].tolist() == [8, 9, 10, 11] and batch["x"][:, 0].tolist() == [8, 9, 10, 11]
    release.fence(record)  # the consumer asks for another batch while it still holds this one
    assert events == [] and release.pending == 0  # nothing let go: no event is recorded
    ids = batch["id"]
    del batch
    gc.collect()
    assert release.retired == 0  # a single array still lives: the batch is not let go
    del ids
    gc.collect()
    assert release.retired == 1 and _free_slots(slab) == 0
    assert release.poll() == 0  # retired, but no event covers it yet
    release.fence(record)
    assert len(events) == 1 and release.retired == 0 and release.pending == 1
    assert _free_slots(slab) == 0
    events[0].done = True
    assert release.poll() == 1
    assert _free_slots(slab) == 1


def test_an_event_recorded_before_the_consumer_let_go_does_not_free():
    slab = Slab(LAYOUT, slots=1)
    release = ReleaseQueue()
    early = Event()
    views = slab.open(_fill(slab, 0))
    batch = release.guard(views, views)
    del views
    release.hold(None, early)  # an unrelated copy's event, recorded while the batch is held
    early.done = True
    del batch
    gc.collect()
    release.poll()
    assert _free_slots(slab) == 0  # only a fence after the release may free it
    release.drain(Event)
    assert _free_slots(slab) == 1


def test_guard_views_alias_the_slot_and_refuse_strided_arrays():
    slab = Slab(LAYOUT, slots=1)
    release = ReleaseQueue()
    views = slab.open(_fill(slab, 0))
    batch = release.guard(views, views)
    batch["x"][1, 2] = -5.0
    assert views["x"][1, 2] == -5.0
    with pytest.raises(ValueError, match="C-contiguous"):
        release.guard({"x": views["x"][:, ::2]}, views)


def test_hold_waits_for_the_oldest_event_beyond_its_limit():
    release = ReleaseQueue(limit=2)
    events = [Event() for _ in range(3)]
    for i, event in enumerate(events):
        release.hold(object(), event)
    assert [e.waits for e in events] == [1, 0, 0]
    assert release.pending == 2
    with pytest.raises(ValueError):
        ReleaseQueue(limit=0)


def test_poll_frees_completed_events_behind_a_pending_one():
    release = ReleaseQueue()
    events = [Event() for _ in range(3)]
    for event in events:
        release.hold(object(), event)
    events[2].done = True  # another stream's event may complete first
    assert release.poll() == 1 and release.pending == 2
    events[0].done = True
    assert release.poll() == 1 and release.pending == 1


def test_a_query_that_raises_frees_no_slot_whose_copy_is_not_done():
    # A CUDA error surfaces from cudaEventQuery: the queue must not have dropped the holders it
    # had looked at (or not yet) when the error came, and their slots stay held.
    class Failing(Event):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    slab = Slab(LAYOUT, slots=3)
    release = ReleaseQueue()
    events = [Event(), Failing(), Event()]
    for k, event in enumerate(events):
        views = slab.open(_fill(slab, ROWS * k))
        release.hold(views, event)
        del views
    with pytest.raises(RuntimeError, match="illegal memory access"):
        release.poll()
    gc.collect()
    assert release.pending == 3 and _free_slots(slab) == 0
    events[0].done = events[2].done = True
    events[1].query = lambda: True  # the error was taken out; its copy completes
    assert release.poll() == 3 and _free_slots(slab) == 3


def test_drain_waits_for_every_event():
    release = ReleaseQueue()
    events = [Event() for _ in range(3)]
    for event in events:
        release.hold(object(), event)
    release.drain()
    assert [e.waits for e in events] == [1, 1, 1] and release.pending == 0


def test_close_fences_what_was_let_go_then_frees_the_rest_on_release():
    slab = Slab(LAYOUT, slots=2)
    release = ReleaseQueue()
    batches = []
    for first in (0, 4):
        views = slab.open(_fill(slab, first))
        batches.append(release.guard(views, views))
        del views
    del batches[0]
    gc.collect()
    closing = Event()
    release.close(lambda: closing)
    assert closing.waits == 1 and _free_slots(slab) == 1  # the batch let go before close
    del batches[0]  # after close no copy can be in flight: freed at once
    gc.collect()
    assert release.retired == 0 and _free_slots(slab) == 2


# ------------------------------------------------------------------- the copy pipeline
class LateCopyEvent(Event):
    """Completes the copy it stands for only when asked twice, or waited for: a DMA that
    runs some time after it was enqueued."""

    def __init__(self, copy) -> None:
        super().__init__()
        self._copy = copy
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        if self.queries >= 2:
            self.synchronize()
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self._copy()
        super().synchronize()


class LateCopyEngine:
    """A host "device": each copy reads the source when its event completes, not before."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def start(self, host) -> InFlight:
        label, arrays = host
        self.log.append(f"start {label}")
        if isinstance(arrays, dict):
            dst = {k: np.empty_like(v) for k, v in arrays.items()}
            # Like a DMA engine, the copy knows addresses, not objects: it keeps nothing alive.
            sources = [(dst[k].ctypes.data, v.ctypes.data, v.nbytes) for k, v in arrays.items()]

            def copy() -> None:
                for to, frm, nbytes in sources:
                    ctypes.memmove(to, frm, nbytes)
            return InFlight(dst, LateCopyEvent(copy), arrays)
        return InFlight(arrays, Event(), None)  # a batch that was already a private copy

    def hand_over(self, flight: InFlight):
        flight.event.synchronize()  # the consumer's stream waits for the copy
        self.log.append("hand over")
        return flight.batch


def _produce(slab: Slab, batches: int):
    """Batches of ids ``4k..4k+3`` in a slot, or in private arrays when every slot is held
    (what a worker does rather than wait)."""
    for k in range(batches):
        handle = _fill(slab, ROWS * k)
        if handle is None:
            ids = np.arange(ROWS * k, ROWS * (k + 1))
            yield "fallback", {"id": ids, "x": ids[:, None].astype(np.float32).repeat(3, 1)}
        else:
            yield str(k), slab.open(handle)  # no reference stays here: only the consumer's


def _run(release: ReleaseQueue, slots: int, batches: int = 12) -> tuple[list[bool], LateCopyEngine]:
    slab = Slab(LAYOUT, slots=slots)
    engine = LateCopyEngine()
    correct = []
    for k, batch in enumerate(deliver(_produce(slab, batches), engine, release)):
        expected = np.arange(ROWS * k, ROWS * (k + 1))
        correct.append(bool(np.array_equal(batch["id"], expected) and np.array_equal(batch["x"][:, 1], expected)))
    return correct, engine


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_no_slot_is_refilled_under_an_in_flight_copy(slots):
    correct, engine = _run(ReleaseQueue(), slots)
    assert correct == [True] * 12


def test_the_copy_check_catches_a_release_that_does_not_wait():
    """The test above has teeth: a queue that frees at once lets the producer refill a slot
    whose copy has not run, and the delivered data is then another batch's."""

    class Immediate(ReleaseQueue):
        def hold(self, keep, event) -> None:  # the bug: no wait for the copy
            pass

    correct, _ = _run(Immediate(), slots=2)
    assert not all(correct)


def test_deliver_enqueues_batch_k_plus_1_before_handing_over_batch_k():
    engine = LateCopyEngine()
    sources = [(str(k), {"id": np.full(2, k)}) for k in range(3)]
    out = []
    for batch in deliver(iter(sources), engine, ReleaseQueue()):
        out.append(int(batch["id"][0]))
        engine.log.append(f"consumer has {out[-1]}")
    assert out == [0, 1, 2]
    assert engine.log == ["start 0", "start 1", "hand over", "consumer has 0", "start 2", "hand over",
                          "consumer has 1", "hand over", "consumer has 2"]


def test_an_abandoned_delivery_waits_for_its_copies_and_frees_every_slot():
    slab = Slab(LAYOUT, slots=3)
    release = ReleaseQueue()
    host = _produce(slab, 10)
    delivered = deliver(host, LateCopyEngine(), release)
    first = next(delivered)
    assert first["id"].tolist() == [0, 1, 2, 3]
    delivered.close()  # the consumer breaks out of its loop
    del host
    gc.collect()
    assert release.pending == 0 and _free_slots(slab) == 3


# -------------------------------------------------------------------- forked workers
def _child_writes(slab: Slab, out) -> None:
    fresh = remap_in_worker(slab)
    assert remap_in_worker(slab) is fresh and fresh is not slab
    handle = _fill(fresh, 40)
    out.put(handle)


def test_a_forked_worker_maps_its_named_slab_afresh():
    slab = Slab(LAYOUT, slots=2, anonymous=False)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_writes, args=(slab, out))
    child.start()
    handle = out.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0
    assert slab.open(handle)["id"].tolist() == [40, 41, 42, 43]
    with pytest.raises(ValueError, match="named slab"):
        remap_in_worker(Slab(LAYOUT, slots=1))
