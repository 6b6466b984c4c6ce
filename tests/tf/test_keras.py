"""Keras on a growing cache: plain fit truncates later epochs; fit_growing trains on each whole snapshot."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from conftest import id_sample, write_shards

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from growcache.adapters.keras import fit_growing  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402

BATCH = 4
SHARD = 8  # records per shard; every epoch end publishes one more


class Recorder(keras.callbacks.Callback):
    """Counts steps per epoch, remembers each epoch's snapshot size, and grows the cache."""

    def __init__(self, cache, grow: bool = True, stop_after: int | None = None) -> None:
        super().__init__()
        self.cache = cache
        self.grow = grow
        self.stop_after = stop_after
        self.steps: list[int] = []
        self.snapshot_records: list[int] = []
        self.epochs: list[int] = []
        self.ids: dict[int, list[int]] = {}
        self.current = -1
        self.train_begins = 0
        self.train_ends = 0

    def on_train_begin(self, logs=None):
        self.train_begins += 1

    def on_train_end(self, logs=None):
        self.train_ends += 1

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch
        self.ids[epoch] = []
        self.epochs.append(epoch)
        self.steps.append(0)
        self.snapshot_records.append(sum(s.records for s in self.cache.list_shards()))

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1

    def on_epoch_end(self, epoch, logs=None):
        if self.grow:
            next_id = 1000 * (epoch + 1)
            write_shards(self.cache, [SHARD], first_id=next_id)
        if self.stop_after is not None and epoch >= self.stop_after:
            self.model.stop_training = True

    def tap(self, features, label):
        """A dataset map that records the ids (and checks the arrays) Keras trains on."""

        def record(ids, xs):
            for record_id, x in zip(ids, xs):
                assert np.array_equal(x, id_sample(int(record_id))["x"]), record_id
                self.ids[self.current].append(int(record_id))
            return ids

        ids = tf.numpy_function(record, [label, features["x"]], tf.int64, stateful=True)
        ids.set_shape(label.shape)
        return {"x": features["x"]}, tf.cast(ids, tf.float32)


def tiny_model() -> keras.Model:
    inputs = keras.Input((4, 8), name="x")
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(inputs))
    model = keras.Model({"x": inputs}, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def dataset(cache, recorder):
    return make_tf_dataset(cache, BATCH, seed=0, label="id").map(recorder.tap)


def test_plain_fit_truncates_later_epochs_of_a_growing_cache(id_cache):
    """The pitfall the docs warn about (tensorflow#41571, keras#15708), shown on real Keras."""
    write_shards(id_cache, [SHARD], first_id=0)
    recorder = Recorder(id_cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model().fit(dataset(id_cache, recorder), epochs=3, verbose=0, callbacks=[recorder])
    full = [math.ceil(r / BATCH) for r in recorder.snapshot_records]
    assert full == [2, 4, 6]
    assert recorder.steps[0] == full[0]
    # Later epochs stop near the first epoch's length, far short of their snapshot.
    assert recorder.steps[2] < full[2]
    assert len(recorder.ids[2]) < recorder.snapshot_records[2]
    assert any("ran out of data" in str(w.message) for w in caught)


def test_fit_growing_trains_each_epoch_on_its_whole_snapshot(id_cache, tmp_path):
    write_shards(id_cache, [SHARD], first_id=0)
    recorder = Recorder(id_cache)
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ck-{epoch}.keras"))
    model = tiny_model()
    history = fit_growing(model, dataset(id_cache, recorder), epochs=3, verbose=0,
                          callbacks=[recorder, checkpoint])
    assert recorder.snapshot_records == [8, 16, 24]
    assert recorder.steps == [2, 4, 6]
    written = list(range(SHARD)) + list(range(1000, 1000 + SHARD)) + list(range(2000, 2000 + SHARD))
    for epoch, records in enumerate(recorder.snapshot_records):
        assert sorted(recorder.ids[epoch]) == written[:records]  # each record once, arrays checked in tap
    assert history is model.history
    assert history.epoch == [0, 1, 2] and len(history.history["loss"]) == 3
    assert recorder.train_begins == recorder.train_ends == 1
    assert sorted(p.name for p in tmp_path.glob("ck-*.keras")) == ["ck-1.keras", "ck-2.keras", "ck-3.keras"]
    assert id_cache.stats().leases == 0

    # Resuming continues the epoch numbers and still follows growth.
    resumed = Recorder(id_cache)
    history = fit_growing(model, dataset(id_cache, resumed), epochs=5, initial_epoch=3, verbose=0,
                          callbacks=[resumed, checkpoint])
    assert resumed.epochs == [3, 4] and history.epoch == [3, 4]
    assert resumed.steps == [8, 10]
    assert (tmp_path / "ck-5.keras").exists()


def test_fit_growing_honours_stop_training_and_validation(id_cache):
    write_shards(id_cache, [SHARD], first_id=0)
    recorder = Recorder(id_cache, stop_after=1)
    validation = make_tf_dataset(id_cache, BATCH, seed=1, label="id").map(
        lambda f, y: ({"x": f["x"]}, tf.cast(y, tf.float32)))
    history = fit_growing(tiny_model(), dataset(id_cache, recorder), epochs=5, verbose=0,
                          callbacks=[recorder], validation_data=validation)
    assert recorder.epochs == [0, 1]
    assert history.epoch == [0, 1] and len(history.history["val_loss"]) == 2
    with pytest.raises(TypeError, match="epochs"):
        fit_growing(tiny_model(), validation, epochs=1, x=validation)
