"""growcache.metrics without a framework: the core meter over real Epochs, the log line read
part by part, the flat names for loggers, the cumulative figures, and finding a meter by cache."""

from __future__ import annotations

import os
import time

import pytest

from conftest import write_shards
from growcache import InputFigures, input_stats
from growcache.epoch import EpochOptions, Epochs
from growcache.metrics import CacheFigures, InputMeter, TrainerSource, sampler_summary, stats_source


def _epoch(meter: InputMeter, epochs: Epochs, batches: int, wait_s: float = 0.0, finish: bool = True):
    """One epoch timed at next(): each of ``batches`` full batches arrives ``wait_s`` late."""
    epoch = epochs.start()
    meter.begin(epoch, meter.clock())

    def produce():
        for _ in range(batches):
            time.sleep(wait_s)
            yield {"x": [0] * epochs.options.batch_size}

    timed = meter.timed(produce(), epoch)
    for i, _ in enumerate(timed):
        if not finish and i == 0:
            timed.close()
            break
    epoch.end()
    return meter.stats()


def test_the_core_meter_over_real_epochs(id_cache):
    write_shards(id_cache, [8, 8])
    epochs = Epochs(id_cache, EpochOptions(4))
    meter = InputMeter(epochs, log=False)
    assert meter.stats().epoch is None and meter.stats().total.epochs == 0
    first = _epoch(meter, epochs, 4, wait_s=0.02).epoch
    assert (first.epoch, first.batches, first.records, first.finished) == (0, 4, 16, True)
    assert first.data_wait_s >= 4 * 0.02 and not first.data_wait_bound and first.new_records is None
    assert first.bytes == sum(s.nbytes for s in id_cache.list_shards())
    write_shards(id_cache, [4], first_id=100)
    stats = _epoch(meter, epochs, 5, finish=False)
    second = stats.epoch
    assert (second.epoch, second.batches, second.records, second.finished) == (1, 1, 4, False)
    assert (second.new_shards, second.new_records, second.snapshot_records) == (1, 4, 20)
    assert second.cache.published == 1 and second.cache.shards == 3
    total = stats.total
    assert (total.epochs, total.batches, total.records, total.finished) == (2, 5, 20, False)
    assert total.data_wait_s == pytest.approx(first.data_wait_s + second.data_wait_s)
    assert total.first_batch_s == first.first_batch_s and total.new_records == 4


def test_the_line_reads_part_by_part():
    cache = CacheFigures(bytes=412_000_000_000, shards=400, capacity=500_000_000_000, published=31,
                         published_bytes=31_000_000_000, evicted=29, evicted_bytes=29_000_000_000, interval_s=60.0,
                         leases=2, leased_bytes=1)
    figures = InputFigures(epoch=7, finished=True, batches=100, records=1_200_000, bytes=51_000_000_000, wall_s=10.0,
                           data_wait_s=0.12, first_batch_s=0.25, snapshot_records=1000, new_records=380, cache=cache)
    assert figures.line() == ("epoch 7: 1.2M records, 5.1 GB/s, waited 0.12 s (1.2%), first batch 0.25 s, "
                              "38% new since epoch 6, cache 412.0 GB (+31.0 GB, -29.0 GB)")
    bound = InputFigures(epoch=0, wall_s=2.0, data_wait_s=1.0, data_wait_bound=True, ranks=1, skipped_shards=2)
    assert "waited at most 1.00 s (50.0%)" in bound.line() and "first epoch" in bound.line()
    assert "2 corrupt shards skipped" in bound.line() and "stopped early" in bound.line()
    ranks = InputFigures(epoch=3, finished=True, wall_s=4.0, data_wait_s=0.4, ranks=4)
    assert "waited 0.40 s (10.0%, most of 4 ranks)" in ranks.line()
    assert "wait not measured" in InputFigures(epoch=1, finished=True, data_wait_s=None).line()
    samplers = {"mb_per_s": 30.9, "requests_in_flight": 16, "latency_p50": 0.041, "latency_p95": 0.12,
                "latency_p99": 0.31, "throttle_events": 3}
    text = sampler_summary(samplers)
    assert text == ("samplers 30.9 MB/s, 16 requests in flight, latency p50 41 ms p95 120 ms p99 310 ms, "
                    "3 throttled")
    assert text in InputFigures(epoch=1, finished=True, samplers=samplers).line()
    assert sampler_summary(None) == ""


def test_flat_names_for_loggers_leave_out_what_is_unknown():
    cache = CacheFigures(bytes=10, shards=1, capacity=100, published=1, published_bytes=10, evicted=0,
                         evicted_bytes=0, interval_s=2.0, leases=0, leased_bytes=0)
    flat = InputFigures(epoch=0, records=8, wall_s=2.0, data_wait_s=0.5, cache=cache,
                        samplers={"requests_in_flight": 3, "host": "a", "failed": False}).as_dict("p/")
    assert flat["p/data_wait_share"] == 0.25 and flat["p/records_per_s"] == 4.0 and flat["p/batches_per_s"] == 0.0
    assert flat["p/cache_fill_rate"] == 5.0 and flat["p/sampler_requests_in_flight"] == 3.0
    assert "p/new_share" not in flat and "p/sampler_host" not in flat and "p/sampler_failed" not in flat
    assert all(isinstance(v, float) for v in flat.values())


def test_input_stats_finds_a_meter_by_cache_and_run(id_cache, tmp_path):
    write_shards(id_cache, [4])
    epochs = Epochs(id_cache, EpochOptions(2, run_id="run-a"))
    meter = InputMeter(epochs, log=False)
    _epoch(meter, epochs, 2)
    assert input_stats(id_cache).epoch.records == 4
    assert input_stats(str(id_cache.path) + "/").epoch.records == 4  # the same directory, spelled otherwise
    assert input_stats(id_cache, run_id="run-a").epoch.records == 4
    with pytest.raises(LookupError, match="run_id='run-b'"):
        input_stats(id_cache, run_id="run-b")
    with pytest.raises(LookupError, match="make_torch_loader or make_tf_dataset"):
        input_stats(tmp_path / "elsewhere")
    assert stats_source(id_cache)().epoch.records == 4 and stats_source(meter)().epoch.records == 4
    with pytest.raises(TypeError, match="a Cache or a cache directory"):
        stats_source(42)


def test_a_callback_without_a_source_reports_the_first_epoch_started_in_its_epoch(id_cache):
    write_shards(id_cache, [4, 4])
    train_epochs, val_epochs = Epochs(id_cache, EpochOptions(2)), Epochs(id_cache, EpochOptions(8))
    train, val = InputMeter(train_epochs, log=False), InputMeter(val_epochs, log=False)
    source = TrainerSource()
    for _ in range(2):
        source.epoch_begins()
        assert source.figures() is None  # no growcache epoch started in this one yet
        _epoch(train, train_epochs, 4)  # the training data, then validation over the same cache
        _epoch(val, val_epochs, 1)
        assert source.figures().batches == 4
    assert TrainerSource(val).figures().batches == 1


def test_the_overhead_benchmark_runs():
    # Its figures are speed, for benchmarks/ and docs/benchmarks.md; here only that it runs.
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import metrics_overhead

    result = metrics_overhead.measure(batches=200, repeats=1)
    assert set(result) == {"timed", "next_done", "stage"} and all(isinstance(v, float) for v in result.values())


def test_the_cache_figures_never_go_negative_when_its_counters_are_rebuilt(id_cache):
    # A damaged or lost state.json is rebuilt from the listing (evictions from 0, publishes from
    # the shards present): the figures of the epoch across it read -3 evicted and -2 published.
    write_shards(id_cache, [8, 8, 8])
    epochs = Epochs(id_cache, EpochOptions(4))
    meter = InputMeter(epochs, log=False)
    _epoch(meter, epochs, 2)
    id_cache.evict(to=0)
    os.remove(os.path.join(id_cache.path, "state.json"))
    write_shards(id_cache, [8], first_id=100)
    second = _epoch(meter, epochs, 2).epoch
    assert (second.cache.published, second.cache.evicted, second.cache.shards) == (1, 0, 1)
    assert second.cache.published_bytes == id_cache.list_shards()[0].nbytes and second.cache.evicted_bytes == 0
