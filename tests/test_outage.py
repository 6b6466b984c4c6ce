"""Outages of a far store (issue 29): ridden out under a budget once the store has answered;
a store never reached fails fast. Also the samplers' stats file that ``growcache status`` reads.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from http_store import FaultyHTTPStore, wait_until as _wait

from growcache import Cache, Schema
from growcache._sampler_stats import read_all, stats_path
from growcache.errors import SamplerError
from growcache.sampler import SamplerPool, read_sampler_stats
from growcache.sources import NpyWindowSource, RetryPolicy

SCHEMA = Schema({"x": ("int64", (2, 4))})


@pytest.fixture
def http(tmp_path):
    root = tmp_path / "http"
    root.mkdir()
    with FaultyHTTPStore(str(root)) as store:
        for i in range(2):
            import io

            buf = io.BytesIO()
            np.save(buf, np.arange(i * 800, (i + 1) * 800, dtype=np.int64).reshape(200, 4))
            store.put(f"a{i}.npy", buf.getvalue())
        yield store


def _source(http, **policy) -> NpyWindowSource:
    retry = RetryPolicy(**{"attempts": 3, "initial_delay": 0.05, "max_delay": 0.5, "deadline": 1.0,
                           "stall_timeout": 2.0, **policy})
    return NpyWindowSource([f"{http.url}/a0.npy", f"{http.url}/a1.npy"], 2, retry=retry)


def test_an_outage_of_a_store_that_answered_is_ridden_out(tmp_path, http, capfd):
    http.latency = 0.01
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with SamplerPool(cache, _source(http, outage_budget=60), workers=1, concurrency=8, seed=1,
                     shard_size="4KB", max_shard_age=0.5) as pool:
        pool.wait_for(records=50, timeout=60)
        http.go_down()
        time.sleep(1.0)
        during = pool.stats().records
        down_until = time.monotonic() + 12  # issue 29: a 12-20 s outage ended sampling for good
        while time.monotonic() < down_until:
            assert not pool.stats().failed, "the pool rides the outage out"
            with cache.snapshot() as snap:  # training goes on reading the cache
                assert snap.records >= 50
            time.sleep(0.5)
        assert pool.stats().records - during < 10, "nothing came from a store that is down"
        http.come_back()
        pool.wait_for(records=during + 50, timeout=60)
        stats = pool.stats()
    assert not stats.failed and stats.restarts == 0
    # The worker logs (to its stderr) once when the outage begins and once when it ends.
    err = capfd.readouterr().err
    assert err.count("riding the outage out") == 1 and err.count("answers again") == 1, err


def test_an_outage_longer_than_the_budget_fails_the_pool(tmp_path, http):
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    pool = SamplerPool(cache, _source(http, outage_budget=2), workers=1, concurrency=4, seed=1,
                       shard_size="4KB").start()
    try:
        pool.wait_for(records=20, timeout=60)
        http.go_down()
        started = time.monotonic()
        with pytest.raises(SamplerError, match="longer than the outage budget of 2 s"):
            pool.wait_for(records=10**9, timeout=60)
        assert time.monotonic() - started < 30
    finally:
        pool.stop(raise_on_failure=False)
    assert pool.stats().restarts == 0, "a spent budget is not restarted into another one"


def test_a_store_never_reached_fails_fast(tmp_path, http):
    source = _source(http, outage_budget=600)
    http.go_down()
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    started = time.monotonic()
    pool = SamplerPool(cache, source, workers=2, concurrency=8).start()
    try:
        with pytest.raises(SamplerError, match="never answered this pool"):
            pool.wait_for(records=1, timeout=60)
    finally:
        pool.stop(raise_on_failure=False)
    assert time.monotonic() - started < 20, "no outage budget for a store that never answered"


def test_status_reads_the_samplers_stats_file(tmp_path, http, capsys):
    from growcache.cli import main

    http.latency = 0.02
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with SamplerPool(cache, _source(http), workers=1, concurrency=8, seed=1, shard_size="4KB") as pool:
        pool.wait_for(records=50, timeout=60)
        # The file is rewritten every interval: one written after the first answers and before the
        # first record was counted shows latencies and no records yet (seen under two pytest workers).
        _wait(lambda: (read_sampler_stats(cache) or {}).get("latency_p50", 0) > 0
              and (read_sampler_stats(cache) or {}).get("records", 0) > 0, what="the stats file")
        figures = read_sampler_stats(cache)
        assert figures["pools"] == 1 and figures["workers"] == 1 and figures["records"] > 0
        assert 0.01 < figures["latency_p50"] <= figures["latency_p99"] < 5
        assert main(["status", str(cache.path)]) == 0
        out = capsys.readouterr().out
        assert "samplers" in out and "latency p50/p95/p99" in out and "1 workers" in out
    assert read_sampler_stats(cache) is None, "a stopped pool removes its file"


def test_two_pools_of_one_process_keep_stats_files_of_their_own(tmp_path, http):
    # Named by host and pid alone, they overwrote each other's figures, and the first to stop
    # removed the file the other still ran under.
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with SamplerPool(cache, _source(http), workers=1, concurrency=2, seed=1, shard_size="4KB") as first:
        with SamplerPool(cache, _source(http), workers=2, concurrency=2, seed=2, shard_size="4KB") as second:
            second.wait_for(records=20, timeout=60)
            _wait(lambda: (read_sampler_stats(cache) or {}).get("pools") == 2, what="both stats files")
            assert read_sampler_stats(cache)["workers"] == 3
        _wait(lambda: (read_sampler_stats(cache) or {}).get("pools") == 1, what="the second file gone")
        assert read_sampler_stats(cache)["workers"] == 1 and first.stats().workers == 1
        time.sleep(1.5)  # the first pool rewrites its own file: still there, still its own
        assert read_sampler_stats(cache)["workers"] == 1
    assert read_sampler_stats(cache) is None


def test_a_damaged_or_linked_stats_file_is_passed_over(tmp_path):
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    folder = os.path.join(cache.path, "samplers")
    os.mkdir(folder)
    good = {"pid": 7, "host": "h", "workers": 1, "concurrency": 8, "records": 1, "bytes": 1, "shards": 1,
            "mb_per_s": 1.0, "requests_in_flight": 0, "in_flight_limit": 8, "latency_p50": 0.1,
            "latency_p95": 0.1, "latency_p99": 0.1, "throttle_events": 0, "restarts": 0, "failed": False}
    bad = [("h-1-0.json", {**good, "records": -1}), ("h-2-0.json", {**good, "latency_p99": float("nan")}),
           ("h-3-0.json", {**good, "failed": "no"}), ("h-4-0.json", {**good, "workers": True}),
           ("h-5-0.json", [1, 2])]
    for name, data in bad:
        with open(os.path.join(folder, name), "w") as f:
            f.write(json.dumps(data))  # NaN is written as NaN, which json reads back
    with open(os.path.join(folder, "h-7-0.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)  # RecursionError in json.loads, not ValueError
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps(good))
    os.symlink(secret, os.path.join(folder, "h-6-0.json"))
    assert read_all(cache.path) == [], "no damaged file is shown, no link is followed"
    with open(os.path.join(folder, "h-8-0.json"), "w") as f:
        json.dump(good, f)
    assert [p["pid"] for p in read_all(cache.path)] == [7]
    old = time.time() - 60
    os.utime(os.path.join(folder, "h-8-0.json"), (old, old))
    assert read_all(cache.path) == [], "a file its pool stopped rewriting belongs to a pool that is gone"
    assert os.path.basename(stats_path(cache.path, 3)).endswith(f"-{os.getpid()}-3.json")
