"""SamplerPool with real spawned processes, real signals and a real S3 server (moto)."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from stores import S3Server, SilentServer, refused_port, s3, s3_server  # noqa: F401

from growcache import Cache, Schema
from growcache.eviction import choose_evictions_fifo
from growcache.errors import CacheFullError, SamplerError, SchemaError, SourceError, TransientSourceError
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.cli import parse_storage_options
from growcache.sampler import SamplerPool, sample_rng
from growcache.shard import TMP_PREFIX
from growcache.sources import NpyWindowSource, RetryPolicy

SCHEMA = Schema({"v": ("int64", (4,)), "x": ("float32", (64,))})
RECORD = ExampleCodec(SCHEMA).record_nbytes + 16  # one framed record


# Sample functions live at module level: spawned workers import this module to unpickle them.
def stream_sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
    v = rng.integers(0, 2**62, 4)
    return {"v": v, "x": np.full(64, v[0] % 1000, np.float32)}


def slow_sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
    time.sleep(0.02)
    return stream_sample(rng)


def failing_sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
    raise ValueError("bad row 17 in the user's data")


def wrong_shape_sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"v": rng.integers(0, 9, 4), "x": np.zeros(63, np.float32)}


def strict_fifo(shards, leased, capacity, incoming=0, now=0.0):
    """A hard budget: leased shards count against it, so writers wait while leases pin it."""
    leased_bytes = sum(s.nbytes for s in shards if s.seq in leased)
    return choose_evictions_fifo(shards, leased, capacity - leased_bytes, incoming, now)


def read_records(cache: Cache) -> list[dict[str, np.ndarray]]:
    codec = ExampleCodec(cache.schema)
    return [codec.decode(rec) for shard in cache.list_shards() for _, rec in iter_records(shard.path)]


def temporaries(cache: Cache) -> list[str]:
    return [n for n in os.listdir(cache.shards_dir) if n.startswith(TMP_PREFIX)]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.fixture
def cache(tmp_path):
    return Cache(tmp_path / "cache", capacity="64MB", schema=SCHEMA)


def test_pool_writes_reproducible_distinct_streams_and_stops_clean(cache):
    # Slow samples, so that both workers are up long before 120 records are written.
    pool = SamplerPool(cache, slow_sample, workers=2, shard_size=20 * RECORD, seed=123)
    assert pool._ctx.get_start_method() == "spawn"
    with pool:
        stats = pool.wait_for(records=120, timeout=60)
        pids = pool.pids
        assert stats.records >= 120 and stats.workers == 2 and not stats.failed
    final = pool.stop()  # idempotent: a second stop returns the same final figures
    time.sleep(0.2)
    assert pool.stats() == final and final.mb_per_s == 0, "a stopped pool's figures are final"
    assert all(gone(pid) for pid in pids) and temporaries(cache) == []
    shards = cache.list_shards()
    assert final.records == sum(s.records for s in shards) and final.shards == len(shards)
    assert all(s.nbytes <= 20 * RECORD for s in shards), "shards rotate before they pass shard_size"
    records = read_records(cache)
    keys = [tuple(r["v"]) for r in records]
    assert len(set(keys)) == len(keys), "no two workers (or restarts) produce the same samples"
    # Reproducible: every record is the sample of its own (seed, index) RNG, each index drawn once.
    drawn = {tuple(stream_sample(sample_rng(123, i))["v"]): i for i in range(len(records) + 10)}
    assert all(k in drawn for k in keys), "every record comes from its sample index's RNG"
    for shard in shards:
        codec = ExampleCodec(SCHEMA)
        shard_keys = [tuple(codec.decode(r)["v"]) for _, r in iter_records(shard.path)]
        assert [drawn[k] for k in shard_keys] == sorted(drawn[k] for k in shard_keys), \
            "a worker drawing one sample at a time writes them in the order it claimed them"
    with pytest.raises(RuntimeError, match="create a new SamplerPool"):
        pool.start()


def test_a_second_pool_on_the_same_cache_draws_new_samples(cache):
    # A resumed `growcache sample` or a restarted training script must not fill the cache
    # with copies of what the last run already wrote.
    for _ in range(2):
        with SamplerPool(cache, stream_sample, workers=1, shard_size=10 * RECORD, max_shard_age=None, seed=7) as pool:
            pool.wait_for(records=20, timeout=60)
    keys = [tuple(r["v"]) for r in read_records(cache)]
    assert len(keys) >= 40 and len(set(keys)) == len(keys)
    first_run = sample_rng(7, 0, run=0)
    assert tuple(stream_sample(first_run)["v"]) == keys[0], "a fresh cache with the same seed gets the same records"


def test_shards_rotate_by_age_when_samples_are_slow(cache):
    with SamplerPool(cache, slow_sample, workers=1, shard_size="8MB", max_shard_age=0.3) as pool:
        stats = pool.wait_for(shards=2, timeout=30)
    assert stats.shards >= 2 and stats.records < 8 * 10**6 // RECORD, "published by age, long before the size"
    sizes = [s.records for s in cache.list_shards()]
    assert all(0 < n <= 40 for n in sizes), sizes  # ~0.3 s of 20 ms samples each


def test_budget_is_enforced_while_sampling(tmp_path):
    capacity = 30 * 20 * RECORD
    cache = Cache(tmp_path / "small", capacity=capacity, schema=SCHEMA)
    with SamplerPool(cache, stream_sample, workers=2, shard_size=20 * RECORD) as pool:
        pool.wait_for(records=6 * capacity // RECORD, timeout=60)
        mid = cache.stats()
    after = cache.stats()
    assert mid.bytes <= capacity and after.bytes <= capacity
    assert after.evicted > 0 and after.published == after.shards + after.evicted
    assert temporaries(cache) == []


def test_leased_shards_survive_while_the_pool_writes_on(tmp_path):
    capacity = 4 * 20 * RECORD
    cache = Cache(tmp_path / "leased", capacity=capacity, schema=SCHEMA)
    with SamplerPool(cache, stream_sample, workers=2, shard_size=20 * RECORD) as pool:
        pool.wait_for(shards=4, timeout=60)
        with cache.snapshot() as snap:
            held = [s.path for s in snap]
            published = pool.stats().shards
            pool.wait_for(shards=published + 20, timeout=60)  # the default budget binds unleased shards only
            assert all(os.path.exists(p) for p in held), "leased shards are never evicted"
            assert cache.stats().bytes <= capacity + snap.nbytes
    assert temporaries(cache) == []


def test_stop_interrupts_writers_waiting_for_leased_room(tmp_path, caplog):
    # A policy under which leases pin the whole budget, so writers wait in close().
    cache = Cache(tmp_path / "leased", capacity=4 * 20 * RECORD, schema=SCHEMA, eviction_policy=strict_fifo)
    pool = SamplerPool(cache, stream_sample, workers=2, shard_size=20 * RECORD, max_shard_age=None).start()
    try:
        pool.wait_for(shards=4, timeout=60)
        with cache.snapshot() as snap:  # pins the whole budget: writers must wait
            held = [s.path for s in snap]
            time.sleep(1.0)
            stalled = pool.stats().shards
            time.sleep(0.5)
            assert pool.stats().shards == stalled, "no publish while every shard is leased"
            caplog.set_level(logging.WARNING, logger="growcache")
            final = pool.stop(timeout=20)
            # Interrupted, not outwaited: no worker had to be terminated after the timeout.
            assert "did not stop within" not in caplog.text, "stop() interrupts the wait for room"
            assert all(os.path.exists(p) for p in held), "leased shards are never evicted"
        assert final.discarded >= 1 and temporaries(cache) == []
    finally:
        pool.stop()


def test_sample_function_exception_reaches_the_parent_with_traceback(cache):
    pool = SamplerPool(cache, failing_sample, workers=2).start()
    with pytest.raises(SamplerError) as info:  # not wait_for's TimeoutError: the failure ends the wait
        pool.wait_for(records=10, timeout=60)
    message = str(info.value)
    assert "ValueError: bad row 17 in the user's data" in message
    assert "Worker traceback" in message and "in failing_sample" in message
    assert isinstance(info.value.__cause__, ValueError)
    stats = pool.stats()
    assert stats.failed and stats.restarts == 0 and "bad row 17" in stats.last_error
    pool.stop()  # already reported: stop does not raise it again
    assert temporaries(cache) == []


def test_failure_surfaces_from_stop_and_with_block(cache):
    with pytest.raises(SamplerError, match="bad row 17"):
        with SamplerPool(cache, failing_sample) as pool:
            deadline = time.monotonic() + 30
            while not pool.stats().failed and time.monotonic() < deadline:
                time.sleep(0.05)
    # An exception inside the block wins over the sampler's failure.
    with pytest.raises(KeyError):
        with SamplerPool(cache, failing_sample):
            time.sleep(0.5)
            raise KeyError("the trainer's own error")


def test_schema_mismatch_is_reported_once_with_a_hint_that_fits(cache, caplog):
    caplog.set_level(logging.INFO, logger="growcache")
    with pytest.raises(SamplerError) as info:
        with SamplerPool(cache, wrong_shape_sample, workers=2) as pool:
            pool.wait_for(records=1, timeout=60)
    message = str(info.value)
    assert "feature 'x': the cache stores dtype float32 shape (64,), the source gives dtype float32 shape (63,)" in message
    assert "window=" in message and "astype" not in message, "a shape mismatch gets a shape hint"
    assert "Worker traceback" not in message, "growcache's own error says all; the traceback stays an attribute"
    assert "wrong_shape_sample" in info.value.worker_traceback
    assert isinstance(info.value.__cause__, SchemaError)
    assert not [r for r in caplog.records if "does not fit" in r.getMessage()], "raised, so not logged as well"
    assert cache.list_shards() == [] and temporaries(cache) == []


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_sigkill_mid_write_restarts_then_gives_up(cache):
    pool = SamplerPool(cache, slow_sample, workers=1, shard_size="8MB", max_shard_age=None, max_restarts=1).start()
    try:
        for round_ in range(2):
            _wait(lambda: len(pool.pids) == 1 and any(str(pool.pids[0]) in n for n in temporaries(cache)))
            victim = pool.pids[0]
            _wait(lambda: pool.stats().records_written > 3 * (round_ + 1))
            os.kill(victim, signal.SIGKILL)
            if round_ == 0:
                _wait(lambda: pool.stats().restarts == 1 and pool.pids and pool.pids[0] != victim)
                assert not any(f"{TMP_PREFIX}{victim}-" in n for n in temporaries(cache)), "its temporary is removed"
                assert "signal SIGKILL" in pool.stats().last_error
        _wait(lambda: pool.stats().failed)
        with pytest.raises(SamplerError, match=r"died with signal SIGKILL; it was restarted 1 times"):
            pool.raise_if_failed()
        assert cache.list_shards() == [], "a half-written shard is never published"
    finally:
        pool.stop(raise_on_failure=False)
    assert temporaries(cache) == []


def test_a_dead_workers_pid_reused_by_another_writer_keeps_that_writers_shard(cache):
    # The kernel may give a dead worker's pid to another writer of the same cache. Cleaning up
    # after the dead worker must go by (pid, start time), or it deletes the live writer's shard.
    pool = SamplerPool(cache, slow_sample, workers=1)
    pool._pids.add(os.getpid())  # this process plays the writer that got the recycled pid
    with cache.writer() as writer:
        writer.write(slow_sample(np.random.default_rng(0)))
        pool._remove_temporaries()
        assert os.path.exists(writer.path)
    assert len(cache.list_shards()) == 1


def test_restarts_far_apart_do_not_use_up_the_restart_allowance(cache, monkeypatch):
    # A pool that runs for days meets an outage now and then; only restarts close together
    # mean a worker that cannot run.
    import growcache.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "_RESTART_WINDOW_S", 0.5)
    pool = SamplerPool(cache, slow_sample, workers=1, max_restarts=1).start()
    try:
        for kills in (1, 2, 3):
            _wait(lambda: len(pool.pids) == 1)
            victim = pool.pids[0]
            os.kill(victim, signal.SIGKILL)
            _wait(lambda: pool.stats().restarts == kills and pool.pids and pool.pids[0] != victim)
            time.sleep(0.6)  # past the window: the next death is a fresh outage
        assert not pool.stats().failed
    finally:
        pool.stop()


def test_construction_errors(tmp_path, cache):
    with pytest.raises(CacheFullError, match="larger than the capacity"):
        SamplerPool(cache, stream_sample, shard_size="1GB")
    assert SamplerPool(cache, stream_sample).shard_size == 16 * 10**6, "default: a quarter of a small capacity"
    with pytest.raises(TypeError, match="must pickle"):
        SamplerPool(cache, lambda rng: {"v": np.zeros(4)})
    with pytest.raises(SchemaError, match="no schema"):
        SamplerPool(Cache(tmp_path / "bare"), stream_sample)
    with pytest.raises(ValueError, match="smaller than one record"):
        SamplerPool(cache, stream_sample, shard_size=100)
    with pytest.raises(ValueError, match="workers"):
        SamplerPool(cache, stream_sample, workers=0)


# -- a real S3 server ---------------------------------------------------------------------
WINDOW_SCHEMA = Schema({"x": ("float32", (8, 16))})


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_pool_survives_an_s3_server_restart(s3_server, s3, tmp_path):
    s3.put("arr/a.npy", _npy(np.arange(200 * 16, dtype=np.float32).reshape(200, 16)))
    patient = RetryPolicy(attempts=60, initial_delay=0.05, max_delay=0.25)
    source = NpyWindowSource(f"{s3.url}/arr/*.npy", 8, storage_options=s3.storage_options, retry=patient)
    cache = Cache(tmp_path / "c", capacity="16MB", schema=WINDOW_SCHEMA)
    with SamplerPool(cache, source, workers=1, shard_size="64KB", max_shard_age=0.2) as pool:
        pool.wait_for(records=50, timeout=60)
        s3_server.stop()
        time.sleep(1.5)
        during = pool.stats().records_written
        time.sleep(0.5)
        assert pool.stats().records_written == during, "no samples while the store is down"
        s3_server.start()
        pool.wait_for(records=during + 50, timeout=60)
        stats = pool.stats()
    assert stats.restarts == 0 and not stats.failed, "retries absorbed the outage"
    rows = np.arange(200 * 16, dtype=np.float32).reshape(200, 16)
    for record in read_records(cache)[:20]:
        first = int(record["x"][0, 0]) // 16
        assert np.array_equal(record["x"], rows[first:first + 8])


PLANTED = "PLANTED-pool-s3cr3t-4c4c"


def test_missing_bucket_fails_the_pool_at_once_without_secrets(s3_server, s3, tmp_path):
    options = s3_server.storage_options(secret=PLANTED)
    source = NpyWindowSource("s3://no-such-bucket-here/*.npy", 8, storage_options=options)
    cache = Cache(tmp_path / "c", capacity="16MB", schema=WINDOW_SCHEMA)
    with pytest.raises(SamplerError) as info:  # not wait_for's TimeoutError: the failure ends the wait
        with SamplerPool(cache, source, workers=2) as pool:
            pool.wait_for(records=1, timeout=60)
    assert "s3://no-such-bucket-here/*.npy" in str(info.value)
    assert PLANTED not in str(info.value) and PLANTED not in info.value.worker_traceback
    assert isinstance(info.value.__cause__, SourceError) and pool.stats().restarts == 0


def test_store_never_reached_fails_fast_without_restarts(s3_server, tmp_path):
    # Issue 29: the outage budget applies once the store has answered; a store that never did
    # (a wrong endpoint, a typo) fails after the retries of one try, with no restarts.
    options = s3_server.storage_options(client_kwargs={"endpoint_url": f"http://127.0.0.1:{refused_port()}"})
    source = NpyWindowSource("s3://growcache-test/a.npy", 8, storage_options=options,
                             retry=RetryPolicy(attempts=2, initial_delay=0.01, max_delay=0.02))
    cache = Cache(tmp_path / "c", capacity="16MB", schema=WINDOW_SCHEMA)
    pool = SamplerPool(cache, source, workers=1, max_restarts=1).start()
    started = time.monotonic()
    with pytest.raises(SamplerError, match="kept failing after 2 attempts.*has not answered once.*never answered "
                                           "this pool") as info:
        pool.wait_for(records=1, timeout=60)
    assert time.monotonic() - started < 20
    assert isinstance(info.value.__cause__, TransientSourceError) and pool.stats().restarts == 0
    pool.stop()


def test_storage_option_parsing():
    assert parse_storage_options(["anon=true", "client_kwargs.endpoint_url=http://h:9", "key=abc"]) == {
        "anon": True, "client_kwargs": {"endpoint_url": "http://h:9"}, "key": "abc"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_storage_options(["novalue"])


def test_throughput_benchmark_quick(tmp_path):
    """The benchmark runs end to end on tiny data (no speed asserted) and reports every figure."""
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import sampler_throughput

    out = tmp_path / "bench.json"
    results = sampler_throughput.main(sampler_throughput.parse_args(["--quick", "--json", str(out)]))
    assert json.loads(out.read_text())["total_bytes"] == results["total_bytes"]
    assert results["plain_write"]["MBps"] > 0
    for workers in (1, 2):
        run = results[f"sampler_{workers}w"]
        assert run["records"] * (1 << 20) == run["payload_bytes"] == results["total_bytes"], "no overshoot"
        assert run["MBps"] > 0 and len(run["worker_peak_rss_MB"]) == workers
        assert all(0 < rss < 1000 for rss in run["worker_peak_rss_MB"])
    assert set(results["targets"]["sampler_vs_plain_write"]) == {"target", "1w", "2w"}


def test_run_sample_command_takes_the_schema_from_the_source(tmp_path):
    import argparse

    from growcache.cli import run_sample_command

    remote = tmp_path / "remote"
    remote.mkdir()
    rows = np.arange(50 * 3, dtype=np.int32).reshape(50, 3)
    np.save(remote / "a.npy", rows)
    args = argparse.Namespace(source=f"file://{remote}/*.npy", cache=str(tmp_path / "cli-cache"), capacity="10MB",
                              workers=1, window=4, feature="x", dtype=None, shape=None, storage_option=[],
                              records=30, shard_size="1KB", max_shard_age=0.5, seed=0, quiet=True)
    assert run_sample_command(args) == 0
    cache = Cache(args.cache)
    assert cache.schema == Schema({"x": ("int32", (4, 3))})
    records = read_records(cache)
    assert len(records) >= 30 and temporaries(cache) == []
    for record in records:
        first = int(record["x"][0, 0]) // 3
        assert np.array_equal(record["x"], rows[first:first + 4])


# -- stop_after -----------------------------------------------------------------------------
def test_stop_after_samples_exactly_that_many_and_publishes_partial_shards(cache):
    # Shards far larger than the quota: the records are published by the stop, not by rotation.
    pool = SamplerPool(cache, stream_sample, workers=2, shard_size="8MB", max_shard_age=None, stop_after=37)
    with pool:
        final = pool.join(timeout=60)
        assert final.finished and final.records == 37 and final.records_written == 37
        with pytest.raises(RuntimeError, match="the pool finished"):
            pool.wait_for(records=38, timeout=10)
        time.sleep(0.3)
        assert pool.stats().restarts == 0 and pool.pids == [], "finished workers are not restarted"
    assert cache.stats().records == 37 and temporaries(cache) == []
    with pytest.raises(ValueError, match="stop_after"):
        SamplerPool(cache, stream_sample, stop_after=0)
    with pytest.raises(RuntimeError, match="stop_after"):
        SamplerPool(cache, stream_sample).join()


def test_stop_after_resamples_what_a_killed_worker_lost(cache):
    pool = SamplerPool(cache, slow_sample, workers=1, shard_size="8MB", max_shard_age=None, stop_after=30).start()
    try:
        _wait(lambda: pool.stats().records_written >= 5)
        victim = pool.pids[0]
        os.kill(victim, signal.SIGKILL)  # its shard in progress is lost
        final = pool.join(timeout=60)
    finally:
        pool.stop()
    assert final.restarts == 1 and final.records == 30 == cache.stats().records
    assert final.records_written > 30, "the lost records were sampled again"


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_worker_killed_while_publishing_gives_its_shard_back(tmp_path, monkeypatch, concurrency):
    # Killed inside its first publish, before the rename: the parent finds the temporary still
    # there, so that shard's indices go back to the pool and are drawn again (the parent read the
    # wrong field of the temporary's name once, took every such shard as published, and the pool
    # ended 10 records short).
    def records(folder: str, fault: str | None) -> list[bytes]:
        cache = Cache(tmp_path / folder, capacity="64MB", schema=SCHEMA)
        if fault:
            monkeypatch.setenv("GROWCACHE_FAULT", fault)  # only the first worker inherits it
        pool = SamplerPool(cache, stream_sample, workers=1, concurrency=concurrency, shard_size=10 * RECORD,
                           max_shard_age=None, stop_after=40, seed=7).start()
        monkeypatch.delenv("GROWCACHE_FAULT", raising=False)
        try:
            final = pool.join(timeout=60)
        finally:
            pool.stop()
        assert final.restarts == (1 if fault else 0) and final.records == 40 == cache.stats().records
        assert temporaries(cache) == []
        return sorted(r["v"].tobytes() for r in read_records(cache))

    assert records("killed", "publish:locked") == records("reference", None)

# -- nothing a process-group kill could leave behind -------------------------------------
def _semaphores_mapped(pid: int) -> set[str]:
    """The named POSIX semaphores (``/dev/shm/sem.*``) process ``pid`` has mapped now.

    A process that creates or opens one maps it, so this sees the pool's own semaphores,
    whatever other programs create in ``/dev/shm`` meanwhile.
    """
    with open(f"/proc/{pid}/maps") as f:
        return {line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/sem." in line}


def test_a_running_pool_creates_no_named_semaphore(cache):
    # A process-group kill takes multiprocessing's resource tracker with it, and every named
    # semaphore would stay in /dev/shm until reboot (issue 17). The quota of stop_after is on,
    # so its lock is in use too.
    before = _semaphores_mapped(os.getpid())
    with SamplerPool(cache, stream_sample, workers=2, shard_size=8 * RECORD, stop_after=10**9) as pool:
        pool.wait_for(shards=2, timeout=60)
        pids = pool.pids
        assert len(pids) == 2
        assert {pid: _semaphores_mapped(pid) for pid in pids} == {pid: set() for pid in pids}
        assert _semaphores_mapped(os.getpid()) - before == set()


def test_the_pools_process_lock_also_orders_the_threads_of_one_process():
    # fcntl record locks belong to a process: a worker's publishing thread and its main thread
    # both took the lock at once, and updated the index ledger together.
    import threading

    from growcache.sampler import _ProcessLock

    lock, count = _ProcessLock(), [0]

    def add():
        for _ in range(200):
            with lock:
                seen = count[0]
                time.sleep(0)  # hand the GIL over mid-update
                count[0] = seen + 1

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lock.close()
    assert count[0] == 800


# -- workers start without re-running the user's script ------------------------------------
_SCRIPT = """
import sys, time
{top}
import numpy as np
import growcache
from growcache.sampler import SamplerPool
from growcache.sources import NpyWindowSource

if __name__ == "__main__":
    np.save(sys.argv[1] + "/a.npy", np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
    cache = growcache.Cache(sys.argv[1] + "/cache", capacity="16MB", schema={{"x": ("float32", (4, 16))}})
    source = {source}
    with SamplerPool(cache, source, workers={workers}, shard_size="64KB", stop_after=50) as pool:
        stats = pool.join(timeout=120)
    print("RSS", max(stats.worker_peak_rss) // 2**20, "RECORDS", stats.records)
"""


def _run_script(tmp_path, **fields) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(**fields))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))


def test_a_worker_does_not_import_what_the_script_imports(tmp_path):
    result = _run_script(tmp_path, top="import tensorflow as tf", workers=1,
                         source='NpyWindowSource(f"file://{sys.argv[1]}/a.npy", 4)')
    assert result.returncode == 0, result.stderr[-3000:]
    rss = int(result.stdout.split("RSS")[1].split()[0])
    assert "RECORDS 50" in result.stdout
    assert 0 < rss < 120, f"a sampler worker used {rss} MB: it imported the script's TensorFlow"
    assert "re-runs that script" not in result.stderr


def test_a_source_defined_in_the_script_still_works_and_warns_once(tmp_path):
    top = ("import numpy\n"
           "def sample(rng):\n"
           "    return {'x': numpy.full((4, 16), rng.integers(9), numpy.float32)}")
    result = _run_script(tmp_path, top=top, workers=2, source="sample")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RECORDS 50" in result.stdout
    assert result.stderr.count("re-runs that script") == 1 and "pitfalls.md" in result.stderr


# -- a store that accepts connections and never replies ------------------------------------
def test_a_silent_store_shows_in_last_error_and_fails_the_pool(tmp_path):
    cache = Cache(tmp_path / "c", capacity="16MB", schema=WINDOW_SCHEMA)
    policy = RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1, stall_timeout=0.5, deadline=5)
    with SilentServer() as silent:
        options = {"key": "silent-key", "secret": "silent-secret", "client_kwargs": {"endpoint_url": silent.endpoint}}
        source = NpyWindowSource("s3://growcache-test/a.npy", 8, storage_options=options, retry=policy)
        pool = SamplerPool(cache, source, workers=1, max_restarts=1).start()
        try:
            _wait(lambda: pool.stats().last_error is not None)
            assert "sent no bytes for 0.5 s" in pool.stats().last_error
            # Never answered: not an outage to ride out, so no restarts either (issue 29).
            with pytest.raises(SamplerError, match="sent no bytes.*never answered this pool") as info:
                pool.wait_for(records=1, timeout=60)
            assert isinstance(info.value.__cause__, TransientSourceError)
        finally:
            pool.stop(raise_on_failure=False)


# The stuck read would last its 120 s stall_timeout: a stop() that waited for it fails this
# test by its timeout, with no wall-time assertion.
@pytest.mark.timeout(60)
def test_stop_returns_soon_when_a_worker_is_stuck_in_a_silent_read(tmp_path):
    cache = Cache(tmp_path / "c", capacity="16MB", schema=WINDOW_SCHEMA)
    patient = RetryPolicy(stall_timeout=120, deadline=300)  # the read would hang for 2 minutes
    with SilentServer() as silent:
        source = NpyWindowSource(f"{silent.endpoint}/a.npy", 8, retry=patient)
        pool = SamplerPool(cache, source, workers=2).start()
        try:
            _wait(lambda: silent.connections >= 2 and len(pool.pids) == 2)
            pids = pool.pids
            time.sleep(0.3)
            final = pool.stop()
        finally:
            pool.stop(raise_on_failure=False)
    assert all(gone(pid) for pid in pids) and not final.failed and temporaries(cache) == []
