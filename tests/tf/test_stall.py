"""Is training waiting on data, under TensorFlow: eager iteration times next() exactly; inside
Keras (a compiled tf.function) growcache's last stage gives an upper bound. The Keras callback
writes the figures into each epoch's logs through the real trainer (fit_growing, CSVLogger)."""

from __future__ import annotations

import csv
import logging
import time

import pytest

from conftest import write_shards

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import growcache.pull_feed  # noqa: E402
from growcache.adapters.keras import InputStatsCallback, fit_growing  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402
from growcache.metrics import input_stats  # noqa: E402

DELAY_S = 0.05


def _slow_reader(monkeypatch):
    # Every batch growcache's reader yields comes DELAY_S late: the producer is the bottleneck.
    real = growcache.pull_feed.slab_batches

    def slab_batches(*args, **kwargs):
        for item in real(*args, **kwargs):
            time.sleep(DELAY_S)
            yield item

    monkeypatch.setattr(growcache.pull_feed, "slab_batches", slab_batches)


def test_eager_a_slow_consumer_waits_on_nothing(id_cache):
    write_shards(id_cache, [40] * 3)  # 30 batches of 4
    ds = make_tf_dataset(id_cache, 4, shuffle_buffer=0)
    for _ in ds:  # the pipeline's first epoch builds its threads; the figures come from the next
        pass
    batches = 0
    for _ in ds:
        # The training step. Eager next() costs a few ms on a loaded 2-core host (TensorFlow's
        # threads wake late), so the step is long enough to keep that well under 5%.
        time.sleep(4 * DELAY_S)
        batches += 1
    figures = ds.stats().epoch
    assert figures.epoch == 1 and figures.finished and figures.batches == batches == 30
    assert not figures.data_wait_bound and figures.wall_s >= batches * 4 * DELAY_S
    print(f"waited {figures.data_wait_s:.3f} s of {figures.wall_s:.3f} s")
    assert figures.data_wait_share < 0.05, figures


def test_eager_a_slow_producer_shows_as_waiting(id_cache, monkeypatch):
    write_shards(id_cache, [40] * 2)  # 20 batches of 4
    _slow_reader(monkeypatch)
    ds = make_tf_dataset(id_cache, 4, shuffle_buffer=0, cycle_length=1)
    batches = sum(1 for _ in ds)
    figures = ds.stats().epoch
    assert batches == 20 and figures.finished and not figures.data_wait_bound
    assert figures.data_wait_s >= 0.8 * batches * DELAY_S, figures
    assert figures.data_wait_s <= figures.wall_s


def test_after_map_the_cache_finds_the_figures(id_cache):
    write_shards(id_cache, [6, 6])
    ds = make_tf_dataset(id_cache, 4).map(lambda batch: batch["x"])
    assert sum(int(x.shape[0]) for x in ds) == 12
    figures = input_stats(id_cache).epoch
    # A mapped dataset's iterator is TensorFlow's own: the stage's bound stands in for next().
    assert figures.epoch == 0 and figures.records == 12 and figures.data_wait_bound
    assert input_stats(id_cache.path).epoch == figures


def _model() -> keras.Model:
    inputs = keras.Input((4, 8), name="x")
    model = keras.Model({"x": inputs}, keras.layers.Dense(1)(keras.layers.Flatten()(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    return model


class _Grow(keras.callbacks.Callback):
    def __init__(self, cache) -> None:
        super().__init__()
        self.cache = cache

    def on_epoch_end(self, epoch, logs=None):
        write_shards(self.cache, [8], first_id=1000 * (epoch + 1))


def test_keras_callback_logs_each_epoch_with_fit_growing(id_cache, tmp_path, caplog):
    write_shards(id_cache, [8, 8])
    caplog.set_level(logging.INFO, logger="growcache.metrics")
    ds = make_tf_dataset(id_cache, 4, label="id").map(lambda f, y: ({"x": f["x"]}, tf.cast(y, tf.float32)))
    log = tmp_path / "log.csv"
    history = fit_growing(_model(), ds, epochs=3, verbose=0,
                          callbacks=[_Grow(id_cache), InputStatsCallback(), keras.callbacks.CSVLogger(str(log))])
    logged = history.history
    assert len(logged["growcache/data_wait_s"]) == 3
    assert all(0 <= share <= 1 for share in logged["growcache/data_wait_share"])
    assert all(rate > 0 for rate in logged["growcache/records_per_s"])
    # 16 records, then 24 with 8 new, then 32 with 8 new; the first epoch has no "new".
    assert logged["growcache/new_share"] == [pytest.approx(8 / 24), pytest.approx(8 / 32)]
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["growcache/cache_bytes"]) > 0 for r in rows] == [True] * 3
    lines = [r.getMessage() for r in caplog.records if r.name == "growcache.metrics"]
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1", "epoch 2"]
    assert all("waited at most" in line for line in lines), lines  # inside tf.function: the stage's bound


def test_keras_a_slow_producer_shows_in_the_stage_bound(id_cache, monkeypatch):
    write_shards(id_cache, [40])  # 10 batches of 4
    _slow_reader(monkeypatch)
    ds = make_tf_dataset(id_cache, 4, label="id", shuffle_buffer=0, cycle_length=1)
    ds = ds.map(lambda f, y: ({"x": f["x"]}, tf.cast(y, tf.float32)))
    history = fit_growing(_model(), ds, epochs=1, verbose=0, callbacks=[InputStatsCallback(id_cache)])
    figures = input_stats(id_cache).epoch
    assert figures.data_wait_bound and figures.batches == 10
    assert history.history["growcache/data_wait_s"] == [figures.data_wait_s]
    assert figures.data_wait_s >= 0.8 * 10 * DELAY_S, figures


def test_keras_callback_reports_the_training_data_beside_validation_on_the_same_cache(id_cache):
    write_shards(id_cache, [8, 8])

    def pipeline(batch_size):
        ds = make_tf_dataset(id_cache, batch_size, label="id")
        return ds.map(lambda f, y: ({"x": f["x"]}, tf.cast(y, tf.float32)))

    history = fit_growing(_model(), pipeline(4), epochs=2, verbose=0, validation_data=pipeline(8),
                          callbacks=[InputStatsCallback(figures=("batches", "records"))])
    # 16 records: 4 training batches, 2 validation batches; validation reads after training.
    assert history.history["growcache/batches"] == [4.0, 4.0]
    assert history.history["growcache/records"] == [16.0, 16.0]
