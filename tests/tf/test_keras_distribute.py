"""Keras under ``tf.distribute.MirroredStrategy`` (2 logical CPUs) on a growing, evicting cache.

Keras 3 pulls one batch from a fresh iterator at the start of every ``fit()`` under a strategy,
then drops that iterator; ``fit_growing`` calls ``fit()`` once per epoch. These tests hold
growcache to: every abandoned epoch's lease released at once, whatever holds the dataset and
without garbage collection; at most two leases at any epoch end and the disk within twice the
capacity over 50 epochs, in each form ``fit_growing`` accepts; each epoch training on its whole
snapshot exactly once; and the shard order of epoch ``e`` being ``(seed, e)``, also when resumed.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

from conftest import ID_SCHEMA, write_shards

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from growcache import Cache  # noqa: E402
from growcache.adapters.keras import fit_growing  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402

# MirroredStrategy over two replicas needs two logical CPUs, configured before TensorFlow
# initializes its devices. pytest imports every test module before running any test.
try:
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
except RuntimeError:  # devices already initialized by an earlier import
    pass

SHARD = 8  # records per shard
BATCH = 8  # global batch: 4 per replica
CAPACITY_SHARDS = 6  # the budget holds 6 shards; every epoch end publishes 2 more


def _strategy() -> tf.distribute.MirroredStrategy:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    return strategy


def _released(cache: Cache, seconds: float = 10.0) -> int:
    """Leases left once TensorFlow has torn down the dropped iterators (it does so on its own
    threads, right after the last reference goes), polling for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while cache.stats().leases and time.monotonic() < deadline:
        time.sleep(0.02)
    return cache.stats().leases


class _Sink:
    """Collects, per Keras epoch, the ids each replica trains on at each step."""

    def __init__(self) -> None:
        self.epoch = -1
        self.seen: dict[int, list[tuple[int, int, list[int]]]] = {}

    def __call__(self, step, replica, ids):
        # Each replica's steps run in order, but its read of the optimizer's step counter races
        # with the other replica's increment; so a step is this replica's count of calls.
        del step
        seen = self.seen.setdefault(self.epoch, [])
        index = sum(1 for _, r, _ in seen if r == int(replica))
        seen.append((index, int(replica), [int(i) for i in ids]))
        return np.int64(0)

    def ids(self, epoch: int) -> list[int]:
        return [i for _, _, ids in self.seen.get(epoch, []) for i in ids]

    def order(self, epoch: int) -> list[int]:
        """The ids of ``epoch`` in the order the input pipeline produced them."""
        return [i for _, _, ids in sorted(self.seen.get(epoch, []), key=lambda s: s[:2]) for i in ids]


class IdModel(keras.Model):
    """A one-layer model whose train step reports the ids of its batch to a :class:`_Sink`."""

    def __init__(self, sink: _Sink) -> None:
        super().__init__()
        self.flat = keras.layers.Flatten()
        self.dense = keras.layers.Dense(1)
        self.sink = sink

    def call(self, inputs):
        return self.dense(self.flat(inputs["x"]))

    def train_step(self, data):
        features, ids = data
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        tf.numpy_function(self.sink, [self.optimizer.iterations, replica, ids], tf.int64, stateful=True)
        return super().train_step(({"x": features["x"]}, tf.cast(ids, tf.float32) * 0.0))


def _model(strategy, sink: _Sink) -> keras.Model:
    with strategy.scope():
        model = IdModel(sink)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    return model


class _Watch(keras.callbacks.Callback):
    """At each epoch: what the cache holds at its start, leases and disk at its end; then grows
    the cache by two shards, evicting the oldest beyond the budget."""

    def __init__(self, cache: Cache, sink: _Sink, ids_of: dict[str, list[int]]) -> None:
        super().__init__()
        self.cache = cache
        self.sink = sink
        self.ids_of = ids_of  # shard path -> its ids
        self.expected: dict[int, list[int]] = {}
        self.leases: list[int] = []
        self.disk: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.sink.epoch = epoch
        self.expected[epoch] = sorted(i for s in self.cache.list_shards() for i in self.ids_of[s.path])

    def on_epoch_end(self, epoch, logs=None):
        self.leases.append(self.cache.stats().leases)
        _grow(self.cache, self.ids_of, 2, first_id=100 * (epoch + 1))
        self.disk.append(self.cache.stats().bytes)


def _grow(cache: Cache, ids_of: dict[str, list[int]], shards: int, first_id: int) -> None:
    before = {s.path for s in cache.list_shards()}
    ids = write_shards(cache, [SHARD] * shards, first_id=first_id)
    new = [s for s in cache.list_shards() if s.path not in before]
    assert len(new) == shards
    for k, shard in enumerate(new):
        ids_of[shard.path] = ids[k * SHARD:(k + 1) * SHARD]


def _small_cache(tmp_path) -> tuple[Cache, dict[str, list[int]]]:
    probe = Cache(tmp_path / "probe", schema=ID_SCHEMA)
    write_shards(probe, [SHARD])
    shard_bytes = probe.list_shards()[0].nbytes
    cache = Cache(tmp_path / "cache", capacity=CAPACITY_SHARDS * shard_bytes, schema=ID_SCHEMA)
    ids_of: dict[str, list[int]] = {}
    _grow(cache, ids_of, 3, first_id=0)
    return cache, ids_of


def test_abandoned_iterators_release_their_leases_without_garbage_collection(id_cache):
    write_shards(id_cache, [SHARD] * 4)
    ds = make_tf_dataset(id_cache, 4, seed=1)
    strategy = _strategy()

    def for_loop_break():
        for _batch in ds:
            break

    @tf.function
    def two_steps(iterator):
        return next(iterator)["id"][0] + next(iterator)["id"][0]

    gc.disable()  # the release must not wait for a garbage collection
    try:
        for _round in range(8):
            mapped = ds.map(lambda b: b)  # a dataset derived from growcache's: its iterators are not ours
            iterator = iter(mapped)
            next(iterator), next(iterator)
            del iterator, mapped
            assert _released(id_cache) == 0, "a derived dataset's abandoned iterator kept its lease"
        for_loop_break()
        assert _released(id_cache) == 0
        iterator = iter(ds)
        two_steps(iterator)
        del iterator
        assert _released(id_cache) == 0
        dist = strategy.experimental_distribute_dataset(ds)
        for _round in range(3):
            iterator = iter(dist)
            next(iterator)
            del iterator
            assert _released(id_cache) == 0, "a distributed iterator dropped mid-epoch kept its lease"
        dist = strategy.distribute_datasets_from_function(
            lambda ctx: make_tf_dataset(id_cache, 2, seed=1, input_context=ctx))
        iterator = iter(dist)
        next(iterator)
        del iterator
        assert _released(id_cache) == 0
    finally:
        gc.enable()


# The two forms fit_growing takes, 30 epochs each (the cache turns over from epoch 2 on: leases
# and disk stay bounded through 28 turnovers): one distributed dataset, and a function that builds
# a new one every epoch. A plain dataset (Keras distributes it itself) runs the same code path, so
# fewer epochs show it.
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("form", "epochs"), [("distributed", 30), ("function", 30), ("dataset", 10)])
def test_fit_growing_many_epochs_bounded_leases_and_disk(tmp_path, form, epochs):
    cache, ids_of = _small_cache(tmp_path)
    capacity = cache.capacity
    strategy = _strategy()
    sink = _Sink()
    model = _model(strategy, sink)

    def pipeline(ctx):
        return make_tf_dataset(cache, ctx.get_per_replica_batch_size(BATCH), seed=3, input_context=ctx, label="id")

    data = {
        "dataset": lambda: make_tf_dataset(cache, BATCH, seed=3, label="id"),
        "distributed": lambda: strategy.distribute_datasets_from_function(pipeline),
        "function": lambda: lambda epoch: strategy.distribute_datasets_from_function(pipeline),
    }[form]()
    watch = _Watch(cache, sink, ids_of)
    fit_growing(model, data, epochs=epochs, callbacks=[watch], verbose=0)
    assert len(watch.leases) == epochs
    assert max(watch.leases) <= 2, f"leases at epoch ends: {watch.leases}"
    assert max(watch.disk) <= 2 * capacity, f"disk/capacity at epoch ends: {[round(d / capacity, 2) for d in watch.disk]}"
    for epoch in range(epochs):
        assert sorted(sink.ids(epoch)) == watch.expected[epoch], f"epoch {epoch}: not its whole snapshot exactly once"
    # The cache grew at first, then turned over: late epochs train on records published late.
    assert len(watch.expected[0]) < len(watch.expected[2]) == CAPACITY_SHARDS * SHARD
    assert min(watch.expected[epochs - 1]) >= 100 * (epochs - 3)
    assert _released(cache) == 0


@pytest.mark.timeout(300)
def test_fit_growing_epoch_e_reads_seed_e_order_also_when_resumed(id_cache):
    """Keras's extra batch at each fit() does not shift the shard order: epoch e of training
    reads epoch e of the dataset, as a plain loop does; resuming at initial_epoch=e too."""
    write_shards(id_cache, [5, 7, 6, 4, 8, 3])
    strategy = _strategy()

    def pipeline(ctx):
        return make_tf_dataset(id_cache, ctx.get_per_replica_batch_size(BATCH), seed=9, shuffle_buffer=0,
                               input_context=ctx, label="id")

    reference = make_tf_dataset(id_cache, BATCH // 2, seed=9, shuffle_buffer=0, label="id")
    expected = [[int(i) for _, ids in reference for i in ids.numpy()] for _epoch in range(4)]
    assert len({tuple(e) for e in expected}) == 4, "epochs must differ in order for this test to mean much"

    sink = _Sink()
    model = _model(strategy, sink)
    watch = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: setattr(sink, "epoch", epoch))
    fit_growing(model, strategy.distribute_datasets_from_function(pipeline), epochs=3, callbacks=[watch], verbose=0)
    assert [sink.order(e) for e in range(3)] == expected[:3]

    # A new process resuming at epoch 3 builds a new dataset: it must read epoch 3's order.
    fit_growing(model, strategy.distribute_datasets_from_function(pipeline), epochs=4, initial_epoch=3,
                callbacks=[watch], verbose=0)
    assert sink.order(3) == expected[3]
    assert _released(id_cache) == 0
