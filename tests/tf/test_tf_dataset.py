"""make_tf_dataset against real TensorFlow: epochs, leases, planning across pipelines, errors."""

from __future__ import annotations

import gc
import logging
import threading
import time

import numpy as np
import pytest

from conftest import ID_SCHEMA, LookCountingCache, id_sample, write_shards

tf = pytest.importorskip("tensorflow")

from growcache import Cache, CorruptShardError, EmptyCacheError, Schema, SchemaError, SchemaMismatchError  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402

# MirroredStrategy over two replicas needs two logical CPUs, configured before TensorFlow
# initializes its devices. pytest imports every test module before running any test.
try:
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
except RuntimeError:  # devices already initialized by an earlier import
    pass


def read_epoch(ds, check_arrays: bool = True) -> list[list[int]]:
    """Iterate one epoch; return the ids of each batch, checking every array against its id."""
    batches = []
    for batch in ds:
        ids = batch["id"].numpy()
        if check_arrays:
            for record_id, x in zip(ids, batch["x"].numpy()):
                assert np.array_equal(x, id_sample(int(record_id))["x"])
        batches.append([int(i) for i in ids])
    return batches


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def corrupt(path: str, offset: int = 60) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff\xff\xff")


def test_an_epoch_yields_every_record_once_decoded_exactly(id_cache):
    ids = write_shards(id_cache, [5, 7, 3, 9])
    ds = make_tf_dataset(id_cache, 4, seed=1)
    assert ds.element_spec["x"].shape.as_list() == [None, 4, 8]
    assert ds.element_spec["x"].dtype == tf.float32 and ds.element_spec["id"].dtype == tf.int64
    batches = read_epoch(ds)
    assert sorted(flat(batches)) == ids
    assert [len(b) for b in batches] == [4] * 6
    # The shuffle buffer mixes shards: records do not come out in write order.
    assert flat(batches) != ids


def test_drop_remainder_keeps_a_static_batch_dimension(id_cache):
    write_shards(id_cache, [5, 6])
    ds = make_tf_dataset(id_cache, 4, seed=0, drop_remainder=True)
    assert ds.element_spec["x"].shape.as_list() == [4, 4, 8]
    assert [len(b) for b in read_epoch(ds)] == [4, 4]


def test_every_iterator_takes_a_fresh_snapshot(id_cache):
    first = write_shards(id_cache, [6])
    ds = make_tf_dataset(id_cache, 4, seed=0, drop_remainder=True)
    assert len(read_epoch(ds)) == 1  # 6 records, drop_remainder
    more = write_shards(id_cache, [6, 6], first_id=100)
    batches = read_epoch(ds)
    assert len(batches) == 4
    assert set(flat(batches)) <= set(first + more) and len(set(flat(batches))) == 16


def test_shard_and_record_order_follow_seed_and_epoch(id_cache):
    write_shards(id_cache, [4] * 6)
    a = make_tf_dataset(id_cache, 4, seed=7)
    b = make_tf_dataset(id_cache, 4, seed=7)
    c = make_tf_dataset(id_cache, 4, seed=8)
    a0, a1 = flat(read_epoch(a, False)), flat(read_epoch(a, False))
    assert flat(read_epoch(b, False)) == a0  # same seed, same epoch: same order
    assert a1 != a0  # next epoch: another order
    assert flat(read_epoch(c, False)) != a0


def test_lease_lives_until_the_iterator_is_exhausted_or_deleted(id_cache):
    # Enough batches that tf.data cannot have read the epoch ahead by the first next(): once
    # every record is read into memory, the lease may end.
    write_shards(id_cache, [400, 400])
    ds = make_tf_dataset(id_cache, 2, seed=0, shuffle_buffer=0)
    iterator = iter(ds)
    next(iterator)
    assert id_cache.stats().leases == 1
    for _ in iterator:
        pass
    assert id_cache.stats().leases == 0
    iterator = iter(ds)
    next(iterator)
    assert id_cache.stats().leases == 1
    del iterator
    gc.collect()
    assert id_cache.stats().leases == 0


def _drain(iterator, got):
    got.extend(int(i) for batch in iterator for i in batch["id"].numpy())
    return got


def test_deleting_one_of_two_iterators_never_ends_the_other_ones_lease(id_cache):
    written = write_shards(id_cache, [8, 8])
    ds = make_tf_dataset(id_cache, 2, seed=0, shuffle_buffer=0, cycle_length=1)
    first, second = iter(ds), iter(ds)
    got = [int(i) for i in next(second)["id"].numpy()]  # the epoch starts in the second one
    del first
    gc.collect()
    assert id_cache.stats().leases == 1
    id_cache.evict(to=0)  # takes every unleased shard
    assert sorted(_drain(second, got)) == written


def test_an_untracked_iterator_starting_never_ends_another_ones_live_epoch(id_cache):
    # Iterators over a dataset derived from ours (as tf.distribute and Keras make) cannot be
    # watched; a second one starting while the first is mid-epoch must leave its lease alone.
    written = write_shards(id_cache, [8, 8])
    derived = make_tf_dataset(id_cache, 2, seed=0, shuffle_buffer=0, cycle_length=1).map(lambda b: b)
    first = iter(derived)
    got = [int(i) for i in next(first)["id"].numpy()]
    second = iter(derived)
    next(second)
    assert id_cache.stats().leases == 2
    id_cache.evict(to=0)
    assert sorted(_drain(first, got)) == written
    del second


def test_abandoned_epochs_of_untracked_iterators_end_with_them_and_live_ones_hold_at_most_four_leases(
        id_cache, caplog):
    write_shards(id_cache, [8, 8])
    derived = make_tf_dataset(id_cache, 2, seed=0, shuffle_buffer=0).map(lambda b: b)
    for _ in range(6):  # each iterator abandons its epoch after one batch, and goes
        next(iter(derived))
        assert id_cache.stats().leases == 0  # its teardown ended the epoch (issue 19)
    live = [iter(derived) for _ in range(6)]  # kept, each one batch into its epoch
    for iterator in live:
        next(iterator)
    assert id_cache.stats().leases == 4
    assert "ending the lease of the oldest" in caplog.text and "Keep at most that many iterators" in caplog.text
    del live, iterator
    assert id_cache.stats().leases == 0
    whole = iter(derived)
    assert sorted(_drain(whole, [])) == list(range(16))
    assert id_cache.stats().leases == 0  # a finished epoch ends its own lease at once


def test_eviction_during_an_epoch_spares_leased_shards(tmp_path):
    shard_bytes_probe = Cache(tmp_path / "probe", capacity="1GB", schema=ID_SCHEMA)
    write_shards(shard_bytes_probe, [10])
    shard_bytes = shard_bytes_probe.list_shards()[0].nbytes
    # Room for three shards: the epoch's three, then newer ones push the budget.
    cache = Cache(tmp_path / "cache", capacity=3 * shard_bytes, schema=ID_SCHEMA)
    ids = write_shards(cache, [10, 10, 10])
    leased = [s.path for s in cache.list_shards()]
    ds = make_tf_dataset(cache, 2, seed=0, shuffle_buffer=0, cycle_length=1)
    iterator = iter(ds)
    got = [int(i) for i in next(iterator)["id"].numpy()]
    write_shards(cache, [10, 10, 10], first_id=1000)  # each publish evicts what it may
    assert cache.stats().bytes > cache.capacity  # leased shards hold the disk over budget
    evicted = {s.path for s in cache.evict(to=0)}  # takes every unleased shard
    assert evicted and not evicted & set(leased)
    assert all(tf.io.gfile.exists(p) for p in leased)
    for batch in iterator:
        got.extend(int(i) for i in batch["id"].numpy())
    assert sorted(got) == ids
    assert cache.stats().leases == 0
    assert sorted(s.path for s in cache.evict(to=0)) == sorted(leased)


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_input_pipelines_read_disjoint_whole_shards_with_equal_batch_counts(id_cache, drop_remainder):
    ids = write_shards(id_cache, [5, 7, 3, 9, 4])
    shard_of = {}
    for shard, start in zip(id_cache.list_shards(), np.cumsum([0, 5, 7, 3, 9])):
        for i in range(shard.records):
            shard_of[int(start) + i] = shard.seq
    per_pipeline = []
    for pipeline in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline, num_replicas_in_sync=2)
        per_pipeline.append(read_epoch(make_tf_dataset(id_cache, 4, seed=3, input_context=ctx,
                                                       drop_remainder=drop_remainder)))
    counts = [len(b) for b in per_pipeline]
    assert counts[0] == counts[1] > 0
    seen = [flat(b) for b in per_pipeline]
    shards = [{shard_of[i] for i in s} for s in seen]
    assert not shards[0] & shards[1]  # whole shards, each in one pipeline
    if drop_remainder:
        assert all(len(b) == 4 for p in per_pipeline for b in p)
        assert len(set(seen[0] + seen[1])) == len(seen[0] + seen[1])  # nothing read twice
    else:
        # Every record read; a short pipeline tops up from its own shards.
        assert set(seen[0]) | set(seen[1]) == set(ids)
        assert not set(seen[0]) & set(seen[1])


def test_mirrored_strategy_reads_each_record_exactly_once(id_cache):
    ids = write_shards(id_cache, [6, 6, 6, 6, 8])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return make_tf_dataset(id_cache, ctx.get_per_replica_batch_size(8), seed=5, input_context=ctx)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    for _epoch in range(2):
        got = []
        for batch in dist:
            for replica_ids in strategy.experimental_local_results(batch["id"]):
                got.extend(int(i) for i in replica_ids.numpy())
        assert sorted(got) == ids
    assert contexts and all(c.num_replicas_in_sync == 2 for c in contexts)
    assert id_cache.stats().leases == 0


def test_shards_written_by_tensorflow_and_added_read_correctly(id_cache, tmp_path):
    ids = []
    for shard in range(2):
        path = str(tmp_path / f"tf-{shard}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(shard * 100, shard * 100 + 7):
                feature = {k: tf.train.Feature(bytes_list=tf.train.BytesList(value=[np.asarray(v).tobytes()]))
                           for k, v in id_sample(i).items()}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
                ids.append(i)
        id_cache.add_shard(path)
    assert sorted(flat(read_epoch(make_tf_dataset(id_cache, 3, seed=0)))) == ids


def test_label_splits_features_and_every_dtype_decodes(tmp_path):
    schema = Schema({"b": ("bool", (3,)), "h": ("float16", (2, 2)), "c": ("complex64", (2,)),
                     "u": ("uint32", ()), "y": ("int64", ())})
    cache = Cache(tmp_path / "c", schema=schema)
    rng = np.random.default_rng(0)
    samples = [{"b": rng.random(3) > 0.5, "h": rng.random((2, 2)).astype(np.float16),
                "c": (rng.random(2) + 1j * rng.random(2)).astype(np.complex64),
                "u": np.uint32(rng.integers(2**32)), "y": np.int64(i)} for i in range(5)]
    with cache.writer() as writer:
        for sample in samples:
            writer.write(sample)
    ds = make_tf_dataset(cache, 5, label="y", shuffle_buffer=0, seed=0)
    features, labels = next(iter(ds))
    assert sorted(features) == ["b", "c", "h", "u"]
    assert labels.numpy().tolist() == [0, 1, 2, 3, 4]
    for name in features:
        expected = np.stack([s[name] for s in samples])
        assert features[name].dtype.as_numpy_dtype == expected.dtype
        assert np.array_equal(features[name].numpy(), expected)


def test_construction_errors_are_clear(tmp_path, id_cache):
    bare = Cache(tmp_path / "bare")
    with pytest.raises(SchemaError, match="features="):
        make_tf_dataset(bare, 4)
    write_shards(id_cache, [2])
    with pytest.raises(SchemaMismatchError):
        make_tf_dataset(id_cache, 4, features={"id": ("int32", ())})
    with pytest.raises(SchemaError, match="label="):
        make_tf_dataset(id_cache, 4, label="nope")
    with pytest.raises(ValueError, match="on_corrupt"):
        make_tf_dataset(id_cache, 4, on_corrupt="ignore")
    with pytest.raises(EmptyCacheError, match="wait_for_shards"):
        make_tf_dataset(Cache(tmp_path / "empty", schema=ID_SCHEMA), 4)
    # A path works too, and features= reads a cache that stores no schema.
    assert make_tf_dataset(str(id_cache.path), 4, features=ID_SCHEMA) is not None
    # A path where no cache is: waited for, never created (a typo became an empty cache without schema).
    typo = tmp_path / "cahce"
    with pytest.raises(EmptyCacheError, match="no cache at .*cahce .*after waiting 0.2 s"):
        make_tf_dataset(typo, 4, wait_for_shards=0.2)
    assert not typo.exists()


def test_a_schema_in_tensorflow_dtypes_reads_as_the_numpy_one(tmp_path, id_cache):
    # What a TensorFlow user writes beside tf.io.FixedLenFeature: tf.float32, tf.TensorShape. It was
    # refused as "expected (dtype, shape) ..., got (tf.int64, ())", which names no fault.
    write_shards(id_cache, [3])
    tf_spec = {"id": (tf.int64, ()), "x": (tf.float32, tf.TensorShape([4, 8]))}
    ds = make_tf_dataset(id_cache, 4, features=tf_spec)
    assert sorted(i for batch in read_epoch(ds) for i in batch) == [0, 1, 2]
    with pytest.raises(SchemaMismatchError):
        make_tf_dataset(id_cache, 4, features={"id": (tf.int32, ()), "x": (tf.float32, (4, 8))})
    assert Schema(tf_spec) == ID_SCHEMA
    with pytest.raises(SchemaError, match="dtype object is not supported"):
        Schema({"s": (tf.string, ())})


def test_empty_cache_waits_for_the_first_shard_then_gives_up(tmp_path):
    # Counted, not timed: the epoch looks at the empty cache again and again, and reads the shard
    # published while it waits (just before its third look).
    cache = LookCountingCache(tmp_path / "c", publish_at=3)
    ds = make_tf_dataset(cache, 4, wait_for_shards=30, seed=0)
    assert sorted(flat(read_epoch(ds))) == [0, 1, 2]
    assert cache.looks >= 3

    empty = LookCountingCache(tmp_path / "d")
    impatient = make_tf_dataset(empty, 4, wait_for_shards=1.0)
    before = empty.looks
    with pytest.raises(EmptyCacheError, match="no shard after waiting 1 s"):  # growcache's class, not TF's
        read_epoch(impatient)
    assert empty.looks - before >= 2, "the epoch gave up at its first look instead of waiting"
    # Where growcache cannot see the iterator (a derived dataset, Keras), TensorFlow's error names it.
    with pytest.raises(tf.errors.OpError, match="EmptyCacheError"):
        read_epoch(impatient.map(lambda b: b))


def test_corrupt_shard_raises_growcache_error_before_tensorflow_reads_it(id_cache):
    write_shards(id_cache, [4, 4, 4])
    bad = id_cache.list_shards()[1].path
    corrupt(bad)
    with pytest.raises(CorruptShardError) as info:  # verify=True by default: checked before TF opens it
        read_epoch(make_tf_dataset(id_cache, 2, seed=0))
    assert info.value.path == bad and info.value.offset == 0
    with pytest.raises(tf.errors.DataLossError):  # without verify, TensorFlow's own reader finds it
        read_epoch(make_tf_dataset(id_cache, 2, seed=0, verify=False, reader="tensorflow"))
    del info  # its traceback holds the failed iterator, whose deletion ends the epoch
    gc.collect()
    assert id_cache.stats().leases == 0


def test_corrupt_shard_is_skipped_and_counted_on_request(id_cache, caplog):
    ids = write_shards(id_cache, [4, 4, 4])
    bad = id_cache.list_shards()[1]
    corrupt(bad.path)
    ds = make_tf_dataset(id_cache, 2, seed=0, on_corrupt="skip")
    with caplog.at_level(logging.WARNING, logger="growcache.adapters.tf_dataset"):
        got = flat(read_epoch(ds))
    assert sorted(got) == ids[:4] + ids[8:]
    assert [e.path for e in ds.corrupt_shards] == [bad.path]
    assert bad.path in caplog.text


def test_pipelines_stay_even_when_one_skips_a_corrupt_shard(id_cache):
    # Synced replicas hang if one input pipeline yields fewer batches than another.
    write_shards(id_cache, [10, 4, 4])
    with open(id_cache.list_shards()[1].path, "r+b") as f:
        f.seek(60)
        f.write(b"\xff\xff\xff")
    per_pipeline = []
    for pipeline in range(2):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline, num_replicas_in_sync=2)
        ds = make_tf_dataset(id_cache, 2, seed=0, on_corrupt="skip", shuffle_buffer=0, input_context=ctx)
        per_pipeline.append([b["id"].numpy().tolist() for b in ds])
    assert len(per_pipeline[0]) == len(per_pipeline[1]) > 0
    corrupt_ids = set(range(10, 14))
    assert not corrupt_ids & {i for batches in per_pipeline for b in batches for i in b}


def test_a_dataset_waiting_for_its_first_shard_does_not_hold_up_another(id_cache, tmp_path):
    write_shards(id_cache, [8, 8])
    empty = Cache(tmp_path / "empty", capacity="1GB", schema=ID_SCHEMA)
    waiting = make_tf_dataset(empty, 4, seed=0, wait_for_shards=120)
    ready = make_tf_dataset(id_cache, 4, seed=0)
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.extend(int(i) for i in next(iter(waiting))["id"].numpy()))
    thread.start()
    time.sleep(0.5)  # lets the waiting dataset reach its epoch start (no assertion depends on it)
    ids = [int(i) for b in ready for i in b["id"].numpy()]
    assert sorted(ids) == list(range(16))
    assert thread.is_alive(), "the other dataset is still waiting for its first shard"
    write_shards(empty, [4], first_id=100)
    thread.join(60)
    assert sorted(got) == [100, 101, 102, 103]


def test_two_distributed_datasets_on_one_cache_never_share_an_epoch(id_cache):
    written = write_shards(id_cache, [6] * 8)

    def pipeline(i, label=None):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i, num_replicas_in_sync=2)
        return make_tf_dataset(id_cache, 2, shuffle_buffer=0, label=label, input_context=ctx)

    a = [pipeline(0), pipeline(1)]
    b = [pipeline(0, "id"), pipeline(1, "id")]
    a0 = iter(a[0])
    got = [int(i) for i in next(a0)["id"].numpy()]
    next(iter(b[0]))  # b's epoch starts between a's two pipelines
    got += [int(i) for batch in a0 for i in batch["id"].numpy()]
    got += [int(i) for batch in a[1] for i in batch["id"].numpy()]
    assert sorted(got) == written


_CRAFTED_READ = """
import json, sys
import growcache
from growcache import CorruptShardError
out = {}
for on_corrupt in ("raise", "skip"):
    ds = growcache.make_tf_dataset(sys.argv[1], 2, on_corrupt=on_corrupt)
    try:
        out[on_corrupt] = sorted(int(i) for batch in ds for i in batch["id"].numpy())
    except CorruptShardError as exc:
        out[on_corrupt] = {"path": exc.path, "offset": exc.offset}
    out[on_corrupt + "_notes"] = [note.path for note in ds.skipped]
print(json.dumps(out))
"""


def test_a_crafted_length_never_reaches_tensorflows_reader(id_cache):
    # A 112-byte shard whose first length has a valid CRC and claims 2**40 bytes: TensorFlow's
    # own reader dies on it with SIGSEGV, so the read runs in a process of its own.
    import json
    import os
    import struct
    import subprocess
    import sys

    from growcache.records import masked_crc32c

    written = write_shards(id_cache, [4, 4])
    length = struct.pack("<Q", 2**40)
    crafted = os.path.join(id_cache.shards_dir, "000000000003-1r-112b.tfrecord")
    with open(crafted, "wb") as f:
        f.write(length + struct.pack("<I", masked_crc32c(length)) + bytes(100))
    result = subprocess.run([sys.executable, "-c", _CRAFTED_READ, id_cache.path], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["raise"] == {"path": crafted, "offset": 0}
    assert out["skip"] == written and out["skip_notes"] == [crafted]
