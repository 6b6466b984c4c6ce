"""Shared-memory slabs: zero-copy round trip, the release protocol, and no leaked segments."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest

from growcache.transport import BatchLayout, Slab

LAYOUT = BatchLayout.build([("id", "int64", ()), ("x", "float32", (3, 5))], batch_size=4)


def _shm_names() -> set[str]:
    try:
        # This process's growcache segments only: multiprocessing's own semaphores live there
        # too, and so do the segments of tests another pytest worker runs meanwhile.
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"growcache-v2-{os.getpid()}-")}
    except FileNotFoundError:
        return set()


def _produce(slab: Slab, start: int, count: int, out) -> None:
    slab.prefault()
    slab.start_generation(7)
    for b in range(count):
        claimed = slab.acquire(4, timeout=10)
        handle, arrays = claimed
        arrays["id"][:] = np.arange(4) + start + 4 * b
        arrays["x"][:] = (np.arange(4) + start + 4 * b)[:, None, None]
        out.put(handle)


@pytest.mark.parametrize("anonymous,method", [(True, "fork"), (False, "spawn")])
def test_round_trip_across_processes(anonymous, method):
    ctx = mp.get_context(method)
    slab = Slab(LAYOUT, slots=3, anonymous=anonymous)
    out = ctx.Queue()
    proc = ctx.Process(target=_produce, args=(slab, 100, 6, out))
    proc.start()
    seen = []
    for _ in range(6):
        handle = out.get(timeout=60)
        batch = slab.open(handle)
        assert batch["x"].shape == (4, 3, 5) and batch["x"].dtype == np.float32
        assert np.array_equal(batch["x"][:, 0, 0], batch["id"].astype(np.float32))
        seen += batch["id"].tolist()
        del batch  # releases the slot: the producer needs it (3 slots, 6 batches)
    proc.join(30)
    assert proc.exitcode == 0
    assert seen == list(range(100, 124))


def test_held_view_is_never_overwritten():
    slab = Slab(LAYOUT, slots=2)
    slab.start_generation(1)
    handle, arrays = slab.acquire(4)
    arrays["id"][:] = 42
    held = slab.open(handle)["id"]  # a view that outlives its batch dict
    other, _ = slab.acquire(4)
    assert other.slot != handle.slot
    assert slab.acquire(4, timeout=0.01) is None  # both slots taken: producer must not wait forever
    assert slab.open(other)  # opened and dropped at once: its slot is free again
    gc.collect()
    again, arrays2 = slab.acquire(4)
    assert again.slot == other.slot
    arrays2["id"][:] = -1
    assert held.tolist() == [42] * 4
    del held
    gc.collect()
    assert slab.acquire(4) is not None  # the held slot came back when its view died


def test_stale_release_cannot_free_a_reused_slot():
    slab = Slab(LAYOUT, slots=1)
    slab.start_generation(1)
    first, _ = slab.acquire(4)
    view = slab.open(first)
    # an epoch boundary where the consumer claims it still holds nothing (a lost handle)
    slab.start_generation(2, held=[])
    second, _ = slab.acquire(4)
    assert second.token != first.token
    del view  # the first batch's lease dies after its slot was reused
    gc.collect()
    assert slab.acquire(4, timeout=0.01) is None  # still owned by the second batch


def test_reclaim_frees_only_slots_the_consumer_does_not_hold():
    slab = Slab(LAYOUT, slots=3)
    slab.start_generation(1)
    handles = [slab.acquire(4)[0] for _ in range(3)]
    kept = slab.open(handles[0])
    assert slab.reclaim(slab.held_tokens()) == 2
    assert slab.acquire(4) is not None and slab.acquire(4) is not None
    assert slab.acquire(4, timeout=0.01) is None
    del kept


def test_copy_and_copy_below_release_at_once():
    slab = Slab(LAYOUT, slots=1)
    slab.start_generation(1)
    handle, arrays = slab.acquire(4)
    arrays["id"][:] = 5
    batch = slab.open(handle, copy_below=LAYOUT.batch_size * 8)  # ids copied, x shared
    assert batch["id"].base is None or not isinstance(batch["id"].base, np.ndarray) or batch["id"].flags.owndata
    ids = batch.pop("id")
    del batch
    gc.collect()
    handle, arrays = slab.acquire(4)  # x died, the kept ids did not pin the slot
    arrays["id"][:] = 9
    assert ids.tolist() == [5] * 4
    batch = slab.open(handle, copy=True)
    assert slab.acquire(4) is not None  # copy=True released before returning
    assert batch["id"].tolist() == [9] * 4


def _attach_and_hang(slab: Slab, ready) -> None:
    slab.prefault()
    ready.set()
    signal.pause()


def test_killed_reader_leaks_no_segment():
    before = _shm_names()
    ctx = mp.get_context("spawn")
    slab = Slab(LAYOUT, slots=2, anonymous=False)
    assert slab.name in _shm_names()
    ready = ctx.Event()
    proc = ctx.Process(target=_attach_and_hang, args=(slab, ready))
    proc.start()
    assert ready.wait(60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    del slab
    gc.collect()
    assert _shm_names() - before == set()
    anon = Slab(LAYOUT, slots=2)
    assert anon.name is None and _shm_names() - before == set()
    with pytest.raises(TypeError, match="fork"):
        import pickle

        pickle.dumps(anon)


@pytest.mark.parametrize("anonymous", [True, False])
def test_a_new_reader_does_not_touch_a_batch_the_consumer_still_holds(anonymous):
    # Non-persistent DataLoader workers start a new reader process every epoch, while the
    # training process may still hold last epoch's zero-copy batches.
    layout = BatchLayout.build([("x", "uint8", (4096,))], batch_size=4)
    slab = Slab(layout, slots=2, anonymous=anonymous)
    try:
        handle, arrays = slab.acquire(4)
        arrays["x"][:] = 7
        kept = slab.open(handle)["x"]
        pid = os.fork()
        if pid == 0:
            code = 1  # a reader that fails must fail the test, not exit 0
            try:
                slab._prefaulted_in = -1  # as in a freshly started reader
                slab.prefault()
                slab.start_generation(2, [(handle.slot, handle.token)])
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the new reader failed to start its generation"
        assert (kept == 7).all()
    finally:
        del kept, arrays
        gc.collect()
        slab.unlink()
