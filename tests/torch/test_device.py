"""make_torch_loader(device=...) and pin_memory=True: batches reach a CUDA device by DMA from
registered slabs.

The slot-release protocol itself is tested without a device in ``tests/test_device_release.py``.
Here, the tests of argument handling and of the CPU path run everywhere; every test that needs
a GPU skips with the reason when ``torch.cuda`` has none (set ``GROWCACHE_REQUIRE_CUDA=1`` on a
GPU runner to turn those skips into failures).
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

import growcache  # noqa: E402
from growcache import Cache, DeviceError  # noqa: E402
from growcache.adapters import cuda as cuda_adapter  # noqa: E402
from growcache.device_release import InFlight, ReleaseQueue, deliver  # noqa: E402
from conftest import id_sample, write_shards  # noqa: E402

make_torch_loader = growcache.make_torch_loader
HAS_CUDA = torch.cuda.is_available()
# 256 KiB per record: with batch size 2, "x" is a zero-copy view of its slot (above the 256 KiB
# copy-out threshold), "id" is small and copied out, as users' labels are.
BIG_SCHEMA = {"x": ("uint8", (64, 4096)), "id": ("int64", ())}


@pytest.fixture
def cuda():
    """The current CUDA device, or a skip that says why there is none."""
    if not HAS_CUDA:
        reason = f"needs a CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"
        if os.environ.get("GROWCACHE_REQUIRE_CUDA"):
            pytest.fail(f"GROWCACHE_REQUIRE_CUDA is set but this test {reason}")
        pytest.skip(reason)
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def big_cache(tmp_path):
    cache = Cache(tmp_path / "big", capacity="200MB", schema=BIG_SCHEMA)
    ids = []
    for shard in range(4):
        with cache.writer() as writer:
            for i in range(shard * 12, shard * 12 + 12):
                writer.write(_big_sample(i))
                ids.append(i)
    cache.written = ids
    return cache


def _big_sample(i: int) -> dict[str, np.ndarray]:
    x = (np.arange(64 * 4096, dtype=np.int64).reshape(64, 4096) * 7 + i * 13) % 251
    return {"x": x.astype(np.uint8), "id": np.int64(i)}


def _expected(ids: list[int], big: bool) -> np.ndarray:
    return np.stack([(_big_sample(i) if big else id_sample(i))["x"] for i in ids])


def _check_batch(batch, device, big: bool) -> list[int]:
    """The batch's data, on the device, against what its record ids say it must be."""
    assert batch["x"].device == device and batch["id"].device == device
    ids = batch["id"].tolist()  # a copy to the host, ordered on the current stream
    expected = torch.from_numpy(_expected(ids, big)).to(device)
    assert torch.equal(batch["x"], expected), f"batch with ids {ids} holds other data on the device"
    return ids


# ----------------------------------------------------------------------- everywhere
@pytest.mark.parametrize("spec", [None, "cpu", torch.device("cpu")])
def test_cpu_or_no_device_means_no_device_copy(spec):
    assert cuda_adapter.resolve_device(spec) is None


@pytest.mark.parametrize("spec,match", [("gpu", "not a device"), ("mps", "CUDA devices only"),
                                        (3.5, "not a device")])
def test_a_device_that_is_not_cuda_is_refused_with_the_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        cuda_adapter.resolve_device(spec)


def test_device_cuda_without_cuda_is_a_clear_error_at_construction(id_cache):
    if HAS_CUDA:
        count = torch.cuda.device_count()
        with pytest.raises(DeviceError, match=f"sees {count} CUDA device"):
            make_torch_loader(id_cache, 2, device=f"cuda:{count}")
        return
    write_shards(id_cache, [4])
    with pytest.raises(DeviceError, match="CUDA is not available") as info:
        make_torch_loader(id_cache, 2, device="cuda")
    assert "device=None" in str(info.value)
    with pytest.raises(DeviceError, match="CUDA is not available"):
        make_torch_loader(id_cache, 2, device="cuda:1")
    # An index (a LOCAL_RANK) is a CUDA device too: it was a ValueError that called it no device.
    with pytest.raises(DeviceError, match="CUDA is not available"):
        make_torch_loader(id_cache, 2, device=0)


def test_device_cpu_is_the_plain_path(id_cache):
    written = write_shards(id_cache, [5, 7])
    loader = make_torch_loader(id_cache, 3, num_workers=2, device="cpu")
    ids = []
    for batch in loader:
        assert batch["x"].device.type == "cpu"
        np.testing.assert_array_equal(batch["x"].numpy(), _expected(batch["id"].tolist(), big=False))
        ids += batch["id"].tolist()
    assert sorted(ids) == written


@pytest.mark.skipif(HAS_CUDA, reason="checks the warning given when there is no CUDA device")
def test_pin_memory_without_cuda_warns_once_and_reads_as_before(id_cache):
    written = write_shards(id_cache, [6, 6])
    with pytest.warns(UserWarning, match="no CUDA device"):
        loader = make_torch_loader(id_cache, 4, num_workers=2, pin_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing more per batch or per epoch
        for _ in range(2):
            ids = []
            for batch in loader:
                assert not batch["x"].is_pinned()
                ids += batch["id"].tolist()
            assert sorted(ids) == written


def test_close_and_context_manager_without_a_device(id_cache):
    written = write_shards(id_cache, [6])
    with make_torch_loader(id_cache, 4, num_workers=1) as loader:
        assert sorted(i for b in loader for i in b["id"].tolist()) == written
    loader.close()  # idempotent


def test_a_fence_is_complete_only_when_the_event_of_every_device_is():
    # pin_memory=True fences on the current stream of every device with a CUDA context: a copy
    # to cuda:1 while cuda:0 is current runs on cuda:1's stream, which cuda:0's event never sees.
    class Event:
        def __init__(self, done: bool) -> None:
            self.done = done

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    idle, busy = Event(True), Event(False)
    fence = cuda_adapter._AllOf([idle, busy])
    release = ReleaseQueue()
    release.hold(object(), fence)
    assert release.poll() == 0 and release.pending == 1  # one device's stream has not reached it
    release.drain()
    assert busy.done and release.pending == 0


class _LateEvent:
    """Completes its copy only when asked a second time or waited for, as a DMA may run late."""

    def __init__(self, copy) -> None:
        self._copy, self._queries, self.done = copy, 0, False

    def query(self) -> bool:
        self._queries += 1
        if self._queries >= 2:
            self.synchronize()
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self._copy()
            self.done = True


class _HostDelivery:
    """The loader's delivery interface with the host as the "device": real workers, named
    slabs mapped afresh in forked workers, the real release protocol and lookahead, and copies
    that read the slot only when their event completes (by address, as a DMA engine does)."""

    registered_bytes = 0
    pin = False  # device batches, as a real delivery with a device says (loader.pin_memory reads it)

    def __init__(self) -> None:
        self.release = ReleaseQueue()

    def start(self, host) -> InFlight:
        if isinstance(host, cuda_adapter.SlotBatch):
            keep = host.slab.open(host.handle)
            out = {k: torch.empty(v.shape, dtype=torch.from_numpy(v).dtype) for k, v in keep.items()}
            moves = [(out[k].data_ptr(), v.ctypes.data, v.nbytes) for k, v in keep.items()]
            return InFlight(out, _LateEvent(lambda: [ctypes.memmove(*m) for m in moves]), keep)
        return InFlight({k: t.clone() for k, t in host.items()}, _LateEvent(lambda: None), None)

    def hand_over(self, flight: InFlight):
        flight.event.synchronize()
        return flight.batch

    def batches(self, host_batches):
        return deliver(host_batches, self, self.release)

    def close(self) -> None:
        self.release.close()


@pytest.mark.parametrize("persistent", [True, False])
def test_registered_slab_wiring_delivers_every_record_intact_without_a_gpu(id_cache, persistent):
    written = write_shards(id_cache, [9, 14, 6, 11, 8])
    loader = make_torch_loader(id_cache, 3, num_workers=2, prefetch_factor=1, persistent_workers=persistent,
                               multiprocessing_context="fork")
    loader._delivery = _HostDelivery()  # what device= installs, with the host standing in for the GPU
    with loader:
        for _ in range(2):
            ids = []
            for batch in loader:
                np.testing.assert_array_equal(batch["x"].numpy(), _expected(batch["id"].tolist(), big=False))
                ids += batch["id"].tolist()
            assert sorted(ids) == written
            assert loader._delivery.release.pending == 0
        assert loader._stream.feed.remap and all(slab.name is not None for slab in loader._stream.feed.slabs)
        if persistent:  # each worker maps its slab a second time, by name, besides the inherited mapping
            for worker, slab in zip(loader._iterator._workers, loader._stream.feed.slabs):
                with open(f"/proc/{worker.pid}/maps") as maps:
                    assert sum(slab.name in line for line in maps) == 2, f"worker {worker.pid} did not remap"


# ------------------------------------------------------------------------- on a GPU
@pytest.mark.parametrize("workers", [0, 2, 4])
def test_exactly_once_on_the_device_with_the_data_checked_batch_by_batch(big_cache, cuda, workers):
    with make_torch_loader(big_cache, 2, num_workers=workers, device="cuda", seed=1) as loader:
        for epoch in range(3):
            ids = []
            for batch in loader:
                ids += _check_batch(batch, cuda, big=True)
            assert sorted(ids) == big_cache.written, f"epoch {epoch}: duplicates or gaps"
        if workers:
            slabs = workers * loader._slots * loader._stream.feed.slabs[0].layout.slot_nbytes
            assert loader.registered_bytes == slabs
    assert loader.registered_bytes == 0


def test_small_records_and_every_path_reach_the_device(id_cache, cuda):
    # 136-byte records: every feature is below the copy-out threshold, so on the CPU path all of
    # them would be copied out; on the device path they all come from the slot.
    written = write_shards(id_cache, [9, 4, 11])
    for kwargs in ({"num_workers": 2}, {"num_workers": 2, "copy": True}, {"num_workers": 0}):
        with make_torch_loader(id_cache, 3, device=cuda, **kwargs) as loader:
            ids = []
            for batch in loader:
                ids += _check_batch(batch, cuda, big=False)
            assert sorted(ids) == written, kwargs


def test_a_copy_delayed_on_its_stream_never_sees_its_slot_refilled(big_cache, cuda, monkeypatch):
    # Each copy waits behind ~10 ms of GPU sleep on the side stream, while the workers race
    # ahead: a slot given back before its copy's event would be refilled under the DMA.
    start = cuda_adapter._SideStreamCopies.start

    def late_start(self, host):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(10_000_000)
        return start(self, host)

    monkeypatch.setattr(cuda_adapter._SideStreamCopies, "start", late_start)
    with make_torch_loader(big_cache, 2, num_workers=2, prefetch_factor=1, device="cuda") as loader:
        for _ in range(2):
            assert sorted(i for b in loader for i in _check_batch(b, cuda, big=True)) == big_cache.written


def test_a_slow_consumer_keeps_every_batch_intact(big_cache, cuda):
    kept = []
    with make_torch_loader(big_cache, 2, num_workers=2, device="cuda") as loader:
        for batch in loader:
            torch.cuda._sleep(5_000_000)  # the consumer's kernels lag behind
            kept.append(batch)
        # kept batches live in the caching allocator's memory, not in slots: all still intact
        assert sorted(i for b in kept for i in _check_batch(b, cuda, big=True)) == big_cache.written


def test_an_abandoned_epoch_leaves_the_next_one_whole(big_cache, cuda):
    with make_torch_loader(big_cache, 2, num_workers=2, device="cuda") as loader:
        for epoch in range(3):
            for k, batch in enumerate(loader):
                _check_batch(batch, cuda, big=True)
                if k == 2:
                    break
            assert loader._delivery.release.pending == 0  # every copy of the abandoned epoch waited for
            assert sorted(i for b in loader for i in _check_batch(b, cuda, big=True)) == big_cache.written


def test_device_cuda_means_the_current_device_of_each_epoch(id_cache, cuda):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices to tell the current device from device 0")
    written = write_shards(id_cache, [8])
    with make_torch_loader(id_cache, 4, num_workers=1, device="cuda") as loader:
        for index in (1, 0):
            with torch.cuda.device(index):
                ids = [i for b in loader for i in _check_batch(b, torch.device("cuda", index), big=False)]
            assert sorted(ids) == written


def test_pin_memory_gives_pinned_zero_copy_views_safe_for_your_own_copies(big_cache, cuda):
    with make_torch_loader(big_cache, 2, num_workers=2, pin_memory=True) as loader:
        for _ in range(2):
            on_device = []
            for batch in loader:
                assert batch["x"].is_pinned() and batch["id"].is_pinned()
                slabs = [(s.slot_bytes(0).ctypes.data, s.slots * s.layout.slot_nbytes) for s in loader._stream.feed.slabs]
                address = batch["x"].data_ptr()
                assert any(lo <= address < lo + n for lo, n in slabs), "x must be a view of its slot, not a copy"
                torch.cuda._sleep(5_000_000)  # the copies below wait behind this on the current stream
                on_device.append((batch["id"].to(cuda, non_blocking=True), batch["x"].to(cuda, non_blocking=True)))
                del batch  # let go before the copies ran: the slot must wait for them
            _check_copies(on_device, cuda, big_cache.written)


def test_pin_memory_copies_to_a_device_that_is_not_current_stay_intact(big_cache, cuda):
    # A DDP rank that never called torch.cuda.set_device, or a job on cuda:1: the copies run on
    # the other device's stream, behind ~5 ms of its work, while cuda:0 (current) is idle.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices: a copy to a device that is not the current one")
    other = torch.device("cuda", 1 - cuda.index)
    with make_torch_loader(big_cache, 2, num_workers=2, prefetch_factor=1, pin_memory=True) as loader:
        on_device = []
        for batch in loader:
            with torch.cuda.device(other):
                torch.cuda._sleep(5_000_000)  # on `other`'s current stream, not the current device's
            on_device.append((batch["id"].to(other, non_blocking=True), batch["x"].to(other, non_blocking=True)))
            del batch
        _check_copies(on_device, other, big_cache.written)


def _check_copies(on_device, device, written) -> None:
    """Every batch copied to ``device`` (``(ids, x)`` pairs) holds its records' values, each record once."""
    ids = []
    for id_tensor, x in on_device:
        batch_ids = id_tensor.tolist()
        assert torch.equal(x, torch.from_numpy(_expected(batch_ids, big=True)).to(device)), batch_ids
        ids += batch_ids
    assert sorted(ids) == written


def test_pin_memory_copy_true_copies_into_pinned_memory(big_cache, cuda):
    with make_torch_loader(big_cache, 2, num_workers=1, pin_memory=True, copy=True) as loader:
        slab = loader._stream.feed.slabs
        for batch in loader:
            assert batch["x"].is_pinned()
            lo = slab[0].slot_bytes(0).ctypes.data
            assert not lo <= batch["x"].data_ptr() < lo + slab[0].slots * slab[0].layout.slot_nbytes
            np.testing.assert_array_equal(batch["x"].numpy(), _expected(batch["id"].tolist(), big=True))


def test_close_and_garbage_collection_unregister_every_slab(big_cache, cuda):
    cudart = torch.cuda.cudart()
    for ending in ("close", "gc"):
        loader = make_torch_loader(big_cache, 2, num_workers=2, device="cuda")
        for _ in loader:
            pass
        addresses = [s.slot_bytes(0).ctypes.data for s in loader._stream.feed.slabs]
        assert loader.registered_bytes > 0
        if ending == "close":
            loader.close()
            assert loader.registered_bytes == 0
        else:
            del loader
            gc.collect()
        torch.ones(1, device=cuda)  # no stale CUDA error left behind (a kernel launch would raise it)
        for address in addresses:  # unregistering again fails: it is no longer registered
            assert int(cudart.cudaHostUnregister(address)) != 0
        # Each failure above is this thread's last CUDA error now, raised by the next kernel launch.
        cuda_adapter._take_stale_error(cuda)


def test_a_failed_registration_warns_once_then_stages_correctly(big_cache, cuda):
    from growcache.transport import BatchLayout, Slab

    slab = Slab(BatchLayout.build([("x", "uint8", (4096,))], 4), slots=2)
    address = slab.slot_bytes(0).ctypes.data
    nbytes = slab.slots * slab.layout.slot_nbytes
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(address, nbytes, 0)) == 0  # someone registered it already
    try:
        registry = cuda_adapter._Registry()
        cuda_adapter._WARNED.discard("register")
        with pytest.warns(RuntimeWarning, match="could not register .* staged through pinned memory"):
            assert registry.pinned(slab, cuda) is False
        assert registry.pinned(slab, cuda) is False  # tried once only
        assert torch.equal(torch.ones(3, device=cuda) * 2, torch.full((3,), 2.0, device=cuda))  # no stale error
    finally:
        cudart.cudaHostUnregister(address)


def test_slabs_that_cannot_be_registered_are_staged_with_the_same_results(big_cache, cuda, monkeypatch):
    monkeypatch.setattr(cuda_adapter._Registry, "pinned", lambda self, slab, device: False)
    with make_torch_loader(big_cache, 2, num_workers=2, device="cuda") as loader:
        assert sorted(i for b in loader for i in _check_batch(b, cuda, big=True)) == big_cache.written
    with make_torch_loader(big_cache, 2, num_workers=2, pin_memory=True) as loader:
        for batch in loader:
            assert batch["x"].is_pinned()
            np.testing.assert_array_equal(batch["x"].numpy(), _expected(batch["id"].tolist(), big=True))


def test_a_low_locked_memory_limit_still_delivers_correct_batches(big_cache, cuda):
    # What `ulimit -l` does to registration depends on the driver: either registration works
    # (the NVIDIA driver pins pages without counting them against RLIMIT_MEMLOCK) or it fails
    # and batches are staged. Both must deliver the right data; the output says which it was.
    script = textwrap.dedent(f"""
        import resource, warnings
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
        import numpy as np, torch, growcache
        ids = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with growcache.make_torch_loader({str(big_cache.path)!r}, 2, num_workers=2, device="cuda") as loader:
                for batch in loader:
                    batch_ids = batch["id"].tolist()
                    x = (np.arange(64 * 4096).reshape(64, 4096) * 7 + np.array(batch_ids)[:, None, None] * 13) % 251
                    assert torch.equal(batch["x"], torch.from_numpy(x.astype(np.uint8)).cuda()), batch_ids
                    ids += batch_ids
                registered = loader.registered_bytes
        assert sorted(ids) == {big_cache.written!r}, ids
        print("registered", registered, "warnings", [str(w.message)[:80] for w in caught])
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
