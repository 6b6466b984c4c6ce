"""make_torch_loader with real DataLoader worker processes: exactly once, growth, decoding,
leases under eviction, corrupt shards, dead workers, empty caches, and no parsing in the trainer."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

import growcache  # noqa: E402
from growcache import Cache, CorruptShardError, EmptyCacheError  # noqa: E402
from conftest import ID_SCHEMA, LookCountingCache, id_sample, write_shards  # noqa: E402

make_torch_loader = growcache.make_torch_loader


def _epoch(loader, check_values: bool = False) -> list[int]:
    ids = []
    for batch in loader:
        assert set(batch) == {"id", "x"}
        assert batch["x"].dtype == torch.float32 and batch["x"].shape[1:] == (4, 8)
        assert batch["id"].dtype == torch.int64 and batch["id"].dim() == 1
        if check_values:
            for i, x in zip(batch["id"].tolist(), batch["x"]):
                np.testing.assert_array_equal(x.numpy(), id_sample(i)["x"])
        ids += batch["id"].tolist()
    return ids


# Persistent workers need workers: (0, True) is no combination to skip, it is not one.
@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (1, False), (1, True), (2, False), (2, True),
                                                     (4, False), (4, True)])
def test_exactly_once_and_exact_values(id_cache, workers, persistent):
    written = write_shards(id_cache, [13, 5, 9, 1, 7, 11])
    loader = make_torch_loader(id_cache, 4, num_workers=workers, persistent_workers=persistent, seed=3)
    orders = []
    for epoch in range(2):
        ids = _epoch(loader, check_values=True)
        assert sorted(ids) == written, f"epoch {epoch}: duplicates or gaps"
        orders.append(ids)
    assert orders[0] != orders[1]  # shards are reshuffled per epoch


def test_growth_across_epochs_with_a_writer(id_cache):
    write_shards(id_cache, [6, 6])
    loader = make_torch_loader(id_cache, 5, num_workers=2, persistent_workers=True)
    expected = sorted(s for s in range(12))
    next_id = 12
    for epoch in range(3):
        stop, published_before, epoch_started = threading.Event(), threading.Event(), threading.Event()
        before: list[int] = []
        during: list[int] = []

        def writer(first: int = next_id) -> None:
            # Two shards before the epoch's iter(), then more while the epoch runs.
            before.extend(write_shards(id_cache, [4, 4], first_id=first))
            published_before.set()
            epoch_started.wait(60)
            nid = first + 8
            while not stop.is_set() and nid < first + 28:
                during.extend(write_shards(id_cache, [4], first_id=nid))
                nid += 4
                time.sleep(0.01)

        thread = threading.Thread(target=writer)
        thread.start()
        assert published_before.wait(60)
        iterator = iter(loader)  # the epoch's snapshot: everything published until now
        epoch_started.set()
        ids = [i for batch in iterator for i in batch["id"].tolist()]
        stop.set()
        thread.join()
        # Exactly its snapshot: every earlier record once, the writer's shards published before
        # iter(), and none of those it published during the epoch (they wait for the next).
        assert sorted(ids) == sorted(expected + before), f"epoch {epoch}"
        expected = sorted(expected + before + during)
        next_id += 100


def test_epoch_reads_whole_snapshot_while_eviction_runs(tmp_path):
    # capacity holds ~3 shards; writes during the epoch must evict, never a leased shard
    cache = Cache(tmp_path / "c", capacity=3 * 12 * 250, schema=ID_SCHEMA)
    write_shards(cache, [12, 12, 12])
    loader = make_torch_loader(cache, 3, num_workers=2, persistent_workers=False)
    before = sorted(s.path for s in cache.list_shards())
    ids = []
    it = iter(loader)
    ids += next(it)["id"].tolist()
    write_shards(cache, [12, 12, 12], first_id=1000)  # each publish evicts the oldest unleased
    assert set(before) <= {s.path for s in cache.list_shards()}  # leased: all still there
    for batch in it:
        ids += batch["id"].tolist()
    assert sorted(ids) == list(range(36))
    write_shards(cache, [12], first_id=2000)  # lease released: now the old shards can go
    assert not set(before) <= {s.path for s in cache.list_shards()}


def test_foreign_layout_records_take_the_general_path(id_cache, tmp_path):
    # the tfrecord package's writer serializes Examples with protobuf: not growcache's layout
    from tfrecord.writer import TFRecordWriter

    path = str(tmp_path / "foreign.tfrecord")
    writer = TFRecordWriter(path)
    for i in (500, 501, 502):
        s = id_sample(i)
        writer.write({"x": (s["x"].tobytes(), "byte"), "id": (s["id"].tobytes(), "byte")})
    writer.close()
    id_cache.add_shard(path)
    write_shards(id_cache, [2])
    loader = make_torch_loader(id_cache, 2, num_workers=1)
    assert sorted(_epoch(loader, check_values=True)) == [0, 1, 500, 501, 502]


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("reader", ["tfrecord", "growcache"])
@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_shard_raises_with_file_and_offset(id_cache, workers, reader):
    write_shards(id_cache, [4, 4])
    bad = id_cache.list_shards()[1].path
    record = os.path.getsize(bad) // 4
    _flip_byte(bad, record * 2 + 40)  # inside the third record's payload
    loader = make_torch_loader(id_cache, 2, num_workers=workers, reader=reader)
    with pytest.raises(CorruptShardError) as info:
        _epoch(loader)
    assert info.value.path == bad and info.value.offset == record * 2


def test_corrupt_shard_skipped_and_counted(id_cache):
    write_shards(id_cache, [4, 4, 4])
    bad = id_cache.list_shards()[0].path
    _flip_byte(bad, os.path.getsize(bad) // 4 + 30)  # second record
    loader = make_torch_loader(id_cache, 2, num_workers=2, on_corrupt="skip")
    ids = _epoch(loader)
    assert sorted(ids) == [0] + list(range(4, 12))
    assert len(loader.skipped) == 1 and loader.skipped[0].path == bad and loader.skipped[0].records == 3


def test_corrupt_length_never_reaches_the_package_reader(id_cache):
    # a flipped high byte of the length would make the tfrecord reader allocate petabytes
    write_shards(id_cache, [3])
    bad = id_cache.list_shards()[0].path
    _flip_byte(bad, 7)
    with pytest.raises(CorruptShardError, match="length CRC32C"):
        _epoch(make_torch_loader(id_cache, 2, num_workers=1))


def test_dead_worker_is_an_error_not_a_hang(id_cache):
    write_shards(id_cache, [50] * 8)
    loader = make_torch_loader(id_cache, 1, num_workers=2, persistent_workers=True, prefetch_factor=1)
    delivered, killed_at = 0, None
    with pytest.raises(RuntimeError, match="(?i)worker"):
        for delivered, _ in enumerate(loader, 1):
            if delivered == 4:
                # this loader's own worker (other children, e.g. a resource tracker, may exist)
                os.kill(loader._iterator._workers[0].pid, signal.SIGKILL)
                killed_at = delivered
    # Counted, not timed: the error comes in place of the dead worker's next batch, after at
    # most the batches already in flight (prefetch_factor=1: one per worker), not at the epoch's
    # end after the other worker's 200 batches (a hang shows as this test's timeout).
    assert killed_at == 4 and delivered - killed_at <= 2, f"{delivered - killed_at} batches after the kill"


def test_a_dead_persistent_worker_is_replaced_at_the_next_epoch(id_cache):
    # torch resets persistent workers for every epoch, a dead one too: after one worker was killed
    # (the OOM killer), every later iter() failed again, and a loop that caught the error and
    # went on could never read another epoch from this loader.
    written = write_shards(id_cache, [20] * 6)
    loader = make_torch_loader(id_cache, 2, num_workers=2, persistent_workers=True, prefetch_factor=1)
    with pytest.raises(RuntimeError, match="(?i)worker"):
        for delivered, _ in enumerate(loader, 1):
            if delivered == 3:
                os.kill(loader._iterator._workers[0].pid, signal.SIGKILL)
    for epoch in range(2):
        assert sorted(_epoch(loader)) == written, f"epoch {epoch} after the kill: duplicates or gaps"
    assert all(w.is_alive() for w in loader._iterator._workers), "the fresh workers persist"
    loader.close()


def _leases(cache) -> list:
    return [lease for lease in cache._manifest.live_leases() if "until" not in lease]  # not resume pins


@pytest.mark.parametrize("failure", ["dead worker", "corrupt shard"])
def test_an_epoch_that_fails_ends_with_its_lease_at_once(id_cache, failure):
    # A persistent loader left a failed epoch open for the next iter() to end: a loop that caught
    # the error and built a new loader (the soak's reader) kept the old epoch's lease, and its
    # shards on disk past the budget, until a garbage collection found the old loader's cycles.
    written = write_shards(id_cache, [20] * 6)
    if failure == "corrupt shard":
        _flip_byte(id_cache.list_shards()[3].path, 7)
    loader = make_torch_loader(id_cache, 2, num_workers=2, persistent_workers=True, prefetch_factor=1,
                               shuffle_buffer=0)
    batches = iter(loader)
    workers = list(loader._iterator._workers)
    with pytest.raises((RuntimeError, CorruptShardError)):
        for delivered, _ in enumerate(batches, 1):
            if delivered == 3 and failure == "dead worker":
                os.kill(workers[0].pid, signal.SIGKILL)
    assert loader.last_epoch.ended and _leases(id_cache) == [], "the failed epoch still holds its lease"
    # Its lease gone, no worker may read on in it: eviction may take its shards now.
    assert not [w for w in workers if w.is_alive()], "a worker reads on in the ended epoch"
    if failure == "dead worker":
        assert sorted(_epoch(loader)) == written, "the next epoch reads with fresh workers"
        assert _leases(id_cache) == []
    loader.close()


def test_a_loader_dropped_mid_epoch_lets_its_lease_go_without_a_garbage_collection(id_cache):
    # Persistent workers leave an epoch left by `break` open for the next iter(); a loader dropped
    # instead (a trainer's loop ending at max_steps) kept it, and its shards on disk past the budget,
    # until a garbage collection freed the cycle that holds an epoch's lease.
    import gc

    write_shards(id_cache, [20] * 6)
    gc.disable()
    try:
        loader = make_torch_loader(id_cache, 2, num_workers=2, persistent_workers=True)
        for _ in loader:
            break
        assert _leases(id_cache), "the epoch left by break is leased while its loader lives"
        del loader, _
        assert _leases(id_cache) == [], "a dropped loader's epoch still holds its lease"
    finally:
        gc.enable()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_close_mid_epoch_stops_non_persistent_workers_and_their_reading(id_cache, context):
    # close() said it stopped the workers, yet non-persistent ones (owned by the epoch's
    # iterator, which `it` still held) read on after it had released the epoch's lease, and
    # `it` went on handing out batches of shards that eviction could now take.
    import multiprocessing

    write_shards(id_cache, [20] * 6)
    loader = make_torch_loader(id_cache, 2, num_workers=2, persistent_workers=False,
                               multiprocessing_context=context)
    before = set(multiprocessing.active_children())
    it = iter(loader)
    next(it)
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2
    loader.close()
    assert not [w for w in workers if w.is_alive()], "workers still run after close()"
    with pytest.raises(StopIteration):
        next(it)


def test_empty_cache_waits_then_raises(tmp_path):
    # Counted, not timed: an epoch looks at the empty cache again until wait_for_shards runs out.
    empty = LookCountingCache(tmp_path / "empty")
    loader = make_torch_loader(empty, 2, num_workers=1, wait_for_shards=1.0)
    before = empty.looks
    with pytest.raises(EmptyCacheError, match="after waiting 1 s.*wait_for_shards"):
        iter(loader).__next__()
    assert empty.looks - before >= 2, "the epoch gave up at its first look instead of waiting"
    # A shard published while it waits (just before its third look) is what the epoch reads.
    growing = LookCountingCache(tmp_path / "growing", publish_at=3)
    assert sorted(_epoch(make_torch_loader(growing, 2, num_workers=1, wait_for_shards=30))) == [0, 1, 2]
    assert growing.looks >= 3


def test_a_path_without_a_cache_is_waited_for_and_never_created(tmp_path):
    # A mistyped path became an empty cache with no schema, and the error said "stores no schema";
    # a trainer started before its samplers failed the same way, whatever wait_for_shards said.
    typo = tmp_path / "cahce"
    with pytest.raises(EmptyCacheError, match=f"no cache at {typo} \\(no such directory\\).*check the path"):
        make_torch_loader(typo, 2, num_workers=0)
    assert not typo.exists(), "a reader created a cache at a path it was only to read"
    later = tmp_path / "later"
    maker = threading.Timer(0.5, lambda: write_shards(Cache(later, capacity="1MB", schema=ID_SCHEMA), [3, 3]))
    maker.start()
    try:
        assert sorted(_epoch(make_torch_loader(later, 2, num_workers=0, wait_for_shards=60))) == list(range(6))
    finally:
        maker.join()


def test_shard_lists_reach_workers_as_arrays(id_cache, tmp_path, monkeypatch):
    # What each DataLoader worker's reader is handed, recorded in the worker itself: forked
    # workers inherit this patch (the context is forced to fork so that they do).
    import json

    from growcache.vector_reader import VectorReader  # the loader's default reader

    write_shards(id_cache, [3, 3, 3, 3])
    received = tmp_path / "received.jsonl"
    original = VectorReader.batches
    trainer = os.getpid()

    def recording(self, share, *args, **kwargs):
        fields = {name: getattr(share, name) for name in ("paths", "records", "shards", "cycle")}
        line = json.dumps({"pid": os.getpid(),
                           "types": {n: [type(v).__name__, v.dtype.kind if isinstance(v, np.ndarray) else None]
                                     for n, v in fields.items()},
                           "paths": [os.fsdecode(p) for p in share.shard_paths()]})
        with open(received, "a") as f:
            f.write(line + "\n")
        return original(self, share, *args, **kwargs)

    monkeypatch.setattr(VectorReader, "batches", recording)
    loader = make_torch_loader(id_cache, 2, num_workers=2, multiprocessing_context="fork")
    assert sorted(_epoch(loader)) == list(range(12))
    shares = [json.loads(line) for line in received.read_text().splitlines()]
    assert len(shares) == 2 and trainer not in {s["pid"] for s in shares}, "one share per worker, in the workers"
    for share in shares:
        # No Python list of str: numpy arrays of fixed-width bytes and int64 indices.
        assert share["types"] == {"paths": ["ndarray", "S"], "records": ["ndarray", "i"],
                                  "shards": ["ndarray", "i"], "cycle": ["ndarray", "i"]}, share["types"]
    assert sorted(p for s in shares for p in s["paths"]) == sorted(s.path for s in id_cache.list_shards())


@pytest.fixture
def parsing_forbidden_in_parent(monkeypatch):
    """Make every record parser raise, but only in this (the training) process."""
    from tfrecord import example_pb2
    from tfrecord import reader as tf_reader

    from growcache import batching, example, records, vector_reader

    parent = os.getpid()

    def forbid(original):
        def guarded(*args, **kwargs):
            if os.getpid() == parent:
                raise AssertionError(f"{original.__qualname__} ran in the training process")
            return original(*args, **kwargs)
        return guarded

    for owner, name in [(example.ExampleCodec, "payload_views"), (example.ExampleCodec, "decode"),
                        (example.ExampleCodec, "has_layout"), (records, "iter_records"),
                        (batching, "iter_records"), (tf_reader, "tfrecord_iterator"),
                        (batching.BatchReader, "batches"), (vector_reader.VectorReader, "batches")]:
        monkeypatch.setattr(owner, name, forbid(getattr(owner, name)))
    monkeypatch.setattr(example_pb2.Example, "FromString", forbid(example_pb2.Example.FromString))


@pytest.mark.parametrize("workers", [1, 2])
def test_training_process_never_parses(id_cache, parsing_forbidden_in_parent, workers):
    written = write_shards(id_cache, [6, 5, 7])
    loader = make_torch_loader(id_cache, 4, num_workers=workers)
    for _ in range(2):
        assert sorted(_epoch(loader, check_values=False)) == written


def test_parsing_guard_bites_without_workers(id_cache, parsing_forbidden_in_parent):
    # the control: the same guard fails when the training process does read
    write_shards(id_cache, [3])
    with pytest.raises(AssertionError, match="training process"):
        _epoch(make_torch_loader(id_cache, 2, num_workers=0))


def test_batch_tensor_outlives_the_loop_intact(id_cache):
    written = write_shards(id_cache, [8] * 6)
    loader = make_torch_loader(id_cache, 2, num_workers=1, prefetch_factor=1)
    kept = [batch for batch in loader]  # keeps every batch: slots must not be overwritten
    ids = [i for b in kept for i in b["id"].tolist()]
    assert sorted(ids) == written
    for b in kept:
        for i, x in zip(b["id"].tolist(), b["x"]):
            np.testing.assert_array_equal(x.numpy(), id_sample(i)["x"])


def test_zero_copy_batches_kept_across_epochs_survive_new_workers(tmp_path):
    # 256 KiB per record: each batch's feature is a zero-copy view of a shared-memory slot, and
    # without persistent workers every epoch starts new worker processes on the same slabs.
    cache = Cache(tmp_path / "big", capacity="100MB", schema={"x": ("uint8", (64, 4096)), "id": ("int64", ())})
    with cache.writer() as writer:
        for i in range(8):
            writer.write({"x": np.full((64, 4096), i + 1, np.uint8), "id": np.int64(i)})
    loader = make_torch_loader(cache, 2, num_workers=1, persistent_workers=False, shuffle_buffer=0)
    kept = [batch for batch in loader]
    for _ in loader:
        pass
    for batch in kept:
        for i, x in zip(batch["id"].tolist(), batch["x"]):
            assert bool((x == i + 1).all()), f"record {i} changed after the next epoch"


def test_a_slow_worker_abandoned_before_its_first_batch_leaves_the_next_epoch_whole(id_cache, monkeypatch):
    # Worker 1 reaches its first pull of epoch 1 only after the loop broke out and epoch 2 was
    # announced. That stale pull belongs to epoch 1 and must not take epoch 2's plan.
    import growcache.worker_feed as worker_feed

    written = write_shards(id_cache, [40] * 4)
    monkeypatch.setattr(worker_feed, "PLAN_TIMEOUT_S", 8.0)
    receive = worker_feed.WorkerFeed._receive
    slowed = []

    def slow_first_receive(self, worker, *args):
        if worker == 1 and not slowed:  # forked workers inherit the flag unset: each slows once
            slowed.append(worker)
            time.sleep(1.5)
        return receive(self, worker, *args)

    monkeypatch.setattr(worker_feed.WorkerFeed, "_receive", slow_first_receive)
    loader = make_torch_loader(id_cache, 4, num_workers=2, seed=0, persistent_workers=True,
                               multiprocessing_context="fork")
    for _ in loader:
        break
    assert sorted(_epoch(loader)) == written


def test_a_new_iter_while_the_last_epoch_still_reads_stops_its_workers_first(id_cache, monkeypatch):
    # ``it = iter(loader)`` runs iter() while ``it`` still holds the last epoch, whose worker
    # (non-persistent) read on into the slots the new epoch's worker reclaimed: two processes
    # wrote one slot, and a batch of the new epoch held records of the old. The slowed slot
    # claim of the first epoch (a slow disk, a big shuffle window) makes the overlap certain.
    from growcache import Schema, transport

    cache = Cache(id_cache.path + "-wide", schema=Schema({"id": ("int64", ()), "x": ("float32", (16, 1024))}))
    for shard in range(4):  # records of 64 KiB: a slot holds one batch
        with cache.writer() as writer:
            for i in range(shard * 64, (shard + 1) * 64):
                writer.write({"id": np.int64(i), "x": np.full((16, 1024), i, np.float32)})
    acquire = transport.Slab.acquire

    def slow_in_the_first_epoch(self, *args, **kwargs):
        got = acquire(self, *args, **kwargs)
        if got is not None and self._generation == 1:
            time.sleep(0.4)
        return got

    monkeypatch.setattr(transport.Slab, "acquire", slow_in_the_first_epoch)  # forked workers inherit it
    loader = make_torch_loader(cache, 8, num_workers=1, persistent_workers=False, multiprocessing_context="fork",
                               shuffle_buffer=0, prefetch_factor=2)
    it = iter(loader)
    next(it)
    it = iter(loader)
    ids = []
    for batch in it:
        time.sleep(0.05)  # a training step: an old worker would write meanwhile
        for i, x in zip(batch["id"].tolist(), batch["x"].numpy()):
            assert (x == i).all(), f"record {i} was overwritten in its batch"
            ids.append(i)
    assert sorted(ids) == list(range(256)), "every record of the new epoch once"
    del it, batch
    loader.close()


def test_abandoned_epoch_then_next_epoch_is_complete(id_cache):
    written = write_shards(id_cache, [10] * 4)
    loader = make_torch_loader(id_cache, 2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    next(it)
    del it
    assert sorted(_epoch(loader)) == written
    assert sorted(_epoch(loader)) == written


def _batches(loader) -> list[frozenset[int]]:
    return [frozenset(batch["id"].tolist()) for batch in loader]


def test_record_shuffle_changes_batch_members_between_epochs(id_cache):
    written = write_shards(id_cache, [16, 16, 16])
    loader = make_torch_loader(id_cache, 4, num_workers=2, seed=5)  # default shuffle buffer
    first, second = _batches(loader), _batches(loader)
    assert sorted(i for b in first for i in b) == written and sorted(i for b in second for i in b) == written
    assert set(first) != set(second)
    # Without it, a shard read from its start always yields the same groups of 4.
    plain = make_torch_loader(id_cache, 4, num_workers=0, shuffle_buffer=0, seed=5)
    assert {b for b in _batches(plain) if len(b) == 4} & {b for b in _batches(plain) if len(b) == 4}


def test_loader_arguments_are_checked_at_construction(id_cache):
    write_shards(id_cache, [4])
    with pytest.raises(ValueError, match="on_corrupt"):
        make_torch_loader(id_cache, 4, on_corrupt="ignore")
    with pytest.raises(ValueError, match="shuffle_buffer"):
        make_torch_loader(id_cache, 4, shuffle_buffer=-3)


def test_plan_is_known_from_iter_and_the_loader_has_no_length(id_cache):
    write_shards(id_cache, [6, 5, 7])
    loader = make_torch_loader(id_cache, 4, num_workers=2)
    assert loader.last_plan is None
    it = iter(loader)  # plans the epoch before any batch is pulled
    assert loader.last_plan is not None and loader.last_epoch.batches() == loader.last_plan.rank_batches(0)
    # No len(), even during an epoch: a trainer reads it once and cuts later, grown epochs
    # there (tests/integrations/test_lightning.py); a TypeError reads as unknown length.
    with pytest.raises(TypeError, match="growcache loader has no len"):
        len(loader)
    batches = list(it)
    assert len(batches) == loader.last_plan.rank_batches(0) == 5  # 6+5+7 records over 2 workers in batches of 4
    with pytest.raises(TypeError, match="growcache loader has no len"):
        len(loader)


def test_dataloader_arguments_the_loader_sets_itself_are_refused_with_a_hint(id_cache):
    write_shards(id_cache, [4])
    with pytest.raises(TypeError, match="shuffle_buffer"):
        make_torch_loader(id_cache, 4, shuffle=True)
    with pytest.raises(TypeError, match="sampler="):
        make_torch_loader(id_cache, 4, sampler=object())


@pytest.mark.parametrize("reader", ["tfrecord", "growcache"])
def test_no_file_is_left_open_in_the_training_process(id_cache, reader):
    import gc
    import warnings

    write_shards(id_cache, [5, 3, 4])
    loader = make_torch_loader(id_cache, 4, num_workers=0, reader=reader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert sorted(_epoch(loader)) == list(range(12))
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
