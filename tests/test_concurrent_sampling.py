"""Samplers with many samples in flight (issue 27): same records at any concurrency, retries,
throttling, stalls, kills, declared concurrency of user sources, bytes in flight.

The stores are real: local files, moto's S3 server, and an aiohttp range server with faults
on demand (tests/http_store.py). Expected records are computed in the test process from the
per-sample RNGs, so every comparison is against what the seed says, not against another run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest
from http_store import FaultyHTTPStore, wait_until as _wait
from stores import SilentServer, s3, s3_server  # noqa: F401

from growcache import Cache, Schema
from growcache._concurrent import BatchEngine, Flow, Task, Ticket, current_ticket
from growcache.errors import SamplerError
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.sampler import SamplerPool, sample_rng
from growcache.shard import TMP_PREFIX
from growcache.sources import FunctionSource, NpyWindowSource, ObjectSource, RetryPolicy, Source

WINDOW = 2
SCHEMA = Schema({"x": ("int64", (WINDOW, 4))})
QUICK = RetryPolicy(attempts=4, initial_delay=0.05, max_delay=0.2, deadline=10, stall_timeout=5)


def _arrays(put, count: int = 3, rows: int = 2000) -> list[str]:
    """``count`` .npy arrays of distinct values, stored with ``put(name, data)``; their URLs."""
    import io

    urls = []
    for i in range(count):
        buf = io.BytesIO()
        np.save(buf, np.arange(i * rows * 4, (i + 1) * rows * 4, dtype=np.int64).reshape(rows, 4))
        urls.append(put(f"a{i}.npy", buf.getvalue()))
    return urls


def _expected(source, seed: int, count: int) -> list[bytes]:
    """The records a fresh cache sampled with ``seed`` and ``stop_after=count`` must hold."""
    return sorted(source(sample_rng(seed, i, 0))["x"].tobytes() for i in range(count))


def _records(cache: Cache) -> list[bytes]:
    codec = ExampleCodec(cache.schema)
    return sorted(codec.decode(r)["x"].tobytes() for s in cache.list_shards() for _, r in iter_records(s.path))


def _temporaries(cache: Cache) -> list[str]:
    return [n for n in os.listdir(cache.shards_dir) if n.startswith(TMP_PREFIX)]


def _sample_all(tmp_path, name, source, *, workers, concurrency, count, seed=11, **kwargs) -> tuple[Cache, object]:
    cache = Cache(tmp_path / name, capacity="64MB", schema=SCHEMA)
    with SamplerPool(cache, source, workers=workers, concurrency=concurrency, stop_after=count, seed=seed,
                     shard_size="4KB", max_shard_age=0.5, **kwargs) as pool:
        stats = pool.join(timeout=120)
    return cache, stats


def _local_arrays(tmp_path):
    """The test's arrays in a local folder (``tmp_path / "store"``), which it returns."""
    store = tmp_path / "store"
    store.mkdir()

    def put(name, data):
        (store / name).write_bytes(data)
        return str(store / name)

    _arrays(put)
    return store


@pytest.mark.parametrize("concurrency,workers", [(1, 1), (8, 1), (32, 1), (1, 2), (8, 2), (32, 2)])
def test_same_records_at_any_concurrency_and_worker_count_on_local_files(tmp_path, concurrency, workers):
    store = _local_arrays(tmp_path)
    source = NpyWindowSource(str(store / "*.npy"), WINDOW)
    # Enough samples that both workers of a pair draw some (the second starts a little later).
    cache, stats = _sample_all(tmp_path, "c", source, workers=workers, concurrency=concurrency, count=1500)
    got = _records(cache)
    # Compared as sorted lists: a lost or a twice-drawn sample index shows (two indices may
    # draw the same window by chance, so a set would not do).
    assert got == _expected(source, 11, 1500), "the seed, not the concurrency or worker count, decides the records"


@pytest.mark.parametrize("concurrency,workers", [(1, 1), (8, 2), (32, 2)])
def test_same_records_at_any_concurrency_on_s3(tmp_path, s3, concurrency, workers):  # noqa: F811
    # moto reads a whole object per ranged GET: small arrays only.
    _arrays(s3.put, rows=100)  # moto reads the whole object per ranged GET
    source = NpyWindowSource(f"{s3.url}/a*.npy", WINDOW, storage_options=s3.storage_options, retry=QUICK)
    cache, stats = _sample_all(tmp_path, "c", source, workers=workers, concurrency=concurrency, count=80)
    assert _records(cache) == _expected(source, 11, 80)
    if concurrency > 1:
        assert stats.latency_p50 > 0 and stats.latency_p99 >= stats.latency_p50


@pytest.fixture
def http(tmp_path):
    root = tmp_path / "http"
    root.mkdir()
    with FaultyHTTPStore(str(root)) as store:
        yield store


def _http_source(http, **kwargs) -> NpyWindowSource:
    urls = _arrays(http.put)
    return NpyWindowSource(urls, WINDOW, retry=kwargs.pop("retry", QUICK), **kwargs)


def test_a_worker_killed_with_requests_in_flight_is_restarted_without_loss_or_duplicate(tmp_path, http):
    source = _http_source(http)
    count = 400
    want = _expected(source, 11, count)
    http.latency = 0.05  # a far store: requests are always in flight
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with SamplerPool(cache, source, workers=2, concurrency=8, stop_after=count, seed=11, shard_size="4KB",
                     max_shard_age=0.3) as pool:
        _wait(lambda: pool.stats().records >= 60, what="60 records")
        assert http.in_flight > 0
        os.kill(pool.pids[0], signal.SIGKILL)
        stats = pool.join(timeout=120)
    assert stats.restarts == 1 and not stats.failed
    assert _temporaries(cache) == [], "no partial shard is left"
    assert _records(cache) == want, "the dead worker's unpublished samples were drawn again, once"


def test_one_failed_request_among_32_in_flight_is_retried_alone(tmp_path, http):
    source = _http_source(http)
    want = _expected(source, 11, 200)
    http.latency = 0.02
    http.fail_next = [500]
    cache, stats = _sample_all(tmp_path, "c", source, workers=1, concurrency=32, count=200)
    assert http.statuses.get(500) == 1, "the store failed one request"
    assert _records(cache) == want, "it was retried; nothing lost, nothing duplicated"
    assert stats.restarts == 0


def test_a_permanent_error_stops_the_pool_naming_the_url(tmp_path, http):
    source = _http_source(http)
    http.fail_paths = {"/a1.npy": 403}
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    pool = SamplerPool(cache, source, workers=1, concurrency=16, seed=11).start()
    try:
        with pytest.raises(SamplerError, match=r"a1\.npy.*403"):
            pool.wait_for(records=10**6, timeout=60)
    finally:
        pool.stop(raise_on_failure=False)


def test_throttling_cuts_the_requests_in_flight_then_they_grow_back(tmp_path, http):
    source = _http_source(http, retry=RetryPolicy(attempts=30, initial_delay=0.05, max_delay=0.2, deadline=20))
    http.latency = 0.02
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with SamplerPool(cache, source, workers=1, concurrency=32, seed=11, shard_size="4KB") as pool:
        pool.wait_for(records=50, timeout=60)
        _wait(lambda: pool.stats().in_flight_limit == 32, what="the full in-flight limit")
        http.throttle_until = time.monotonic() + 1.5
        limits = []
        while time.monotonic() < http.throttle_until:
            limits.append(pool.stats().in_flight_limit)
            time.sleep(0.05)
        low = min(limits)
        before = pool.stats().records
        _wait(lambda: pool.stats().in_flight_limit >= 16, what="the in-flight limit to grow back")
        _wait(lambda: pool.stats().records > before + 50, what="records after the throttling")
        stats = pool.stats()
    assert http.statuses.get(503, 0) > 0
    assert low <= 4, f"503 SlowDown cut the requests in flight (lowest limit {low})"
    assert stats.throttle_events > 0 and not stats.failed and stats.restarts == 0


def test_a_request_without_answer_is_cut_by_the_stall_timeout_and_issued_again(tmp_path, http):
    source = _http_source(http, retry=RetryPolicy(attempts=4, initial_delay=0.05, max_delay=0.1, stall_timeout=1.0))
    source.header(source.paths()[0])  # fetched here: the first sampler request is then a window
    http.hang_next = 1
    started = time.monotonic()
    cache, stats = _sample_all(tmp_path, "c", source, workers=1, concurrency=8, count=60)
    assert http.hang_next == 0, "one request got no answer"
    assert _records(cache) == _expected(source, 11, 60), "it was issued again after the stall timeout"
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
def test_stop_returns_within_seconds_while_requests_hang(tmp_path, http):
    source = _http_source(http, retry=RetryPolicy(stall_timeout=120, deadline=300))
    source.header(source.paths()[0])
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    pool = SamplerPool(cache, source, workers=1, concurrency=16, seed=11).start()
    try:
        _wait(lambda: pool.stats().records_written > 0, what="a first record")
        http.hang_next = 10**6
        _wait(lambda: http.in_flight >= 8, what="requests hanging")
    finally:
        started = time.monotonic()
        pool.stop(raise_on_failure=False)
    assert time.monotonic() - started < 10, "stop() cancels the requests in flight, never waits for them"
    assert _temporaries(cache) == []


@pytest.mark.timeout(90)
def test_stop_interrupts_a_concurrent_worker_still_listing_a_silent_store(tmp_path, caplog):
    # A concurrent worker lists the glob before its first sample (a big bucket's listing takes
    # minutes); stop() once waited out its whole timeout there, then terminated the worker.
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with SilentServer() as silent:
        source = NpyWindowSource(f"{silent.endpoint}/data/*.npy", WINDOW,
                                 retry=RetryPolicy(stall_timeout=120, deadline=300))
        pool = SamplerPool(cache, source, workers=1, concurrency=8).start()
        try:
            _wait(lambda: silent.connections >= 1, what="the listing request")
            time.sleep(0.3)
        finally:
            with caplog.at_level("WARNING", logger="growcache"):
                final = pool.stop(timeout=30, raise_on_failure=False)
    assert "did not stop within" not in caplog.text, "the listing was waited for, then the worker terminated"
    assert not final.failed and _temporaries(cache) == []


# -- user sources: concurrent only when they say so ------------------------------------------------
_busy = [0, 0]  # calls inside now, most seen at once
_busy_lock = threading.Lock()


@contextlib.contextmanager
def _counted():
    """Counts a call as running for its duration (the most seen at once: ``_busy[1]``)."""
    with _busy_lock:
        _busy[0] += 1
        _busy[1] = max(_busy[1], _busy[0])
    try:
        yield
    finally:
        with _busy_lock:
            _busy[0] -= 1


def counting_sample(rng):
    """Records in each sample how many calls ran at once (per process)."""
    with _counted():
        time.sleep(0.005)
        x = rng.integers(0, 1000, size=(WINDOW, 4))
        x[0, 0] = _busy[1]
        return {"x": x}


@pytest.mark.parametrize("thread_safe", [False, True])
def test_a_user_source_runs_concurrently_only_when_declared(tmp_path, thread_safe, caplog):
    source = FunctionSource(counting_sample, thread_safe=thread_safe) if thread_safe else counting_sample
    cache, _ = _sample_all(tmp_path, "c", source, workers=1, concurrency=16, count=150)
    most = max(np.frombuffer(r, dtype=np.int64)[0] for r in _records(cache))
    if thread_safe:
        assert most > 1, "a thread-safe source gets calls in flight together"
    else:
        assert most == 1, "a source that did not declare itself thread-safe is never called concurrently"


def counting_decode(data: bytes, path: str) -> np.ndarray:
    """An ObjectSource decoder marking each sample with how many of its calls ran at once."""
    return counting_sample(np.random.default_rng(len(data)))["x"]


class SafeCountingDecode:
    thread_safe = True  # declared: a sampler may call it from several threads at once

    def __call__(self, data: bytes, path: str) -> np.ndarray:
        return counting_decode(data, path)


@pytest.mark.parametrize("thread_safe", [False, True])
def test_a_user_decoder_of_an_object_source_runs_concurrently_only_when_declared(tmp_path, thread_safe):
    # Local files are read by a pool of threads, and each ran the user's decoder: one written for
    # a sampler that called it once at a time could break silently on upgrade.
    store = tmp_path / "objects"
    store.mkdir()
    for i in range(20):
        (store / f"{i}.bin").write_bytes(bytes(64 + i))
    source = ObjectSource(str(store / "*.bin"), decoder=SafeCountingDecode() if thread_safe else counting_decode)
    cache, _ = _sample_all(tmp_path, "c", source, workers=1, concurrency=16, count=150)
    most = max(np.frombuffer(r, dtype=np.int64)[0] for r in _records(cache))
    assert (most > 1) if thread_safe else (most == 1), most


class MarkedWindows(NpyWindowSource):
    """A user's subclass of a store source that overrides ``sample`` (and declares nothing): it
    marks each window with how many of its calls ran at once (most seen, this process)."""

    def sample(self, rng):
        with _counted():
            time.sleep(0.002)
            x = super().sample(rng)["x"].copy()
            x[0, 0] = -_busy[1]
            return {"x": x}


@pytest.mark.parametrize("store", ["file", "http"])
def test_a_subclass_that_overrides_sample_is_a_user_source(tmp_path, store, request):
    # On an async store the store's own concurrent path (sample_async) would bypass the override;
    # on local files its threads would call an override that never said it was thread-safe.
    put = request.getfixturevalue("http").put if store == "http" else None
    urls = _arrays(put) if put else [str(p) for p in sorted((_local_arrays(tmp_path)).glob("*.npy"))]
    source = MarkedWindows(urls, WINDOW, retry=QUICK)
    cache, _ = _sample_all(tmp_path, "c", source, workers=1, concurrency=16, count=120)
    got = [np.frombuffer(r, dtype=np.int64).reshape(WINDOW, 4) for r in _records(cache)]
    assert len(got) == 120 and all(x[0, 0] == -1 for x in got), \
        f"the override ran for every sample, one at a time: {sorted({int(x[0, 0]) for x in got})}"


class AsyncUserSource(Source):
    """A user source with a natively concurrent method (module level, so that it pickles)."""

    async def sample_async(self, rng):
        import asyncio

        await asyncio.sleep(0.01)
        return {"x": rng.integers(0, 1000, size=(WINDOW, 4))}


def test_a_user_source_with_sample_async_gets_the_same_records(tmp_path):
    import asyncio

    source = AsyncUserSource()
    cache, _ = _sample_all(tmp_path, "c", source, workers=2, concurrency=16, count=100)
    want = sorted(asyncio.run(source.sample_async(sample_rng(11, i, 0)))["x"].tobytes() for i in range(100))
    assert _records(cache) == want


class BatchUserSource(Source):
    """A user source with ``sample_many`` (module level, so that it pickles): each sample is marked
    with the size of the batch it came in and with the most calls seen running at once."""

    def sample_many(self, rngs):
        with _counted():
            time.sleep(0.01)
            out = []
            for rng in rngs:
                x = rng.integers(0, 1000, size=(WINDOW, 4))
                x[0, 0], x[0, 1] = len(rngs), _busy[1]
                out.append({"x": x})
            return out


class ShortBatchSource(Source):
    def sample_many(self, rngs):
        return [{"x": rng.integers(0, 1000, size=(WINDOW, 4))} for rng in rngs[1:]]


def test_a_user_source_with_sample_many_gets_batches_one_call_at_a_time_and_the_same_records(tmp_path):
    cache, _ = _sample_all(tmp_path, "c", BatchUserSource(), workers=2, concurrency=16, count=200)
    got = [np.frombuffer(r, dtype=np.int64).reshape(WINDOW, 4) for r in _records(cache)]
    assert len(got) == 200
    assert max(int(x[0, 0]) for x in got) > 1, "samples waiting together are handed over in one call"
    assert max(int(x[0, 1]) for x in got) == 1, "sample_many is never called while another call runs"
    # Which records: each RNG's own draws, whatever batch it came in.
    want = sorted(tuple(sample_rng(11, i, 0).integers(0, 1000, size=(WINDOW, 4)).ravel()[2:]) for i in range(200))
    assert sorted(tuple(x.ravel()[2:]) for x in got) == want


def test_a_sample_many_returning_too_few_samples_stops_the_pool_saying_so(tmp_path):
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with pytest.raises(SamplerError, match=r"sample_many was given (\d+) RNGs and returned \d+ samples; it must "
                                           "return one sample per RNG"):
        with SamplerPool(cache, ShortBatchSource(), workers=1, concurrency=4, stop_after=20, seed=1,
                         shard_size="4KB", max_shard_age=0.5) as pool:
            pool.join(timeout=60)


class ClaimingBatches:
    """A ``sample_many`` whose reads claim bytes on the ticket its thread's context names, as a store
    source's do; its first call (a gate) waits until the test lets it go."""

    def __init__(self):
        self.gate_entered, self.open_gate = threading.Event(), threading.Event()

    def sample_many(self, rngs):
        if not self.gate_entered.is_set():
            self.gate_entered.set()
            self.open_gate.wait(10)
            return [{"x": np.zeros(0, np.uint8)} for _ in rngs]
        current_ticket().acquire(100 * len(rngs))
        return [{"x": np.zeros(n + 1, np.uint8)} for n in range(len(rngs))]  # payloads of 1, 2, 3, 4 bytes


def test_each_sample_of_a_sample_many_batch_holds_its_own_bytes_until_written():
    # A batch's reads claim their bytes on its first ticket: written first, that sample let go of
    # the whole batch's bytes while the others still waited for the writer, so new claims could
    # take the budget a second time over.
    flow, source = Flow(4, 10_000), ClaimingBatches()
    engine = BatchEngine(source, 4)
    engine.submit(Task(-1, sample_rng(0, 99, 0), 9, Ticket(flow)))
    assert source.gate_entered.wait(10)
    tasks = [Task(i, sample_rng(0, i, 0), i, Ticket(flow)) for i in range(4)]
    for task in tasks:  # queued while the gate's call runs: the next call takes all four at once
        engine.submit(task)
    source.open_gate.set()
    done = [engine.done.get(timeout=10) for _ in range(5)]
    engine.close()
    assert sorted(len(t.result["x"]) for t in done if t.index >= 0) == [1, 2, 3, 4]
    assert flow.bytes == 400
    assert [t.ticket.nbytes for t in tasks] == [40, 80, 120, 160], "each holds a part, by its payload's size"
    tasks[0].ticket.release()
    assert flow.bytes == 360, "the first sample written lets go of its own part only"
    for task in tasks[1:]:
        task.ticket.release()
    assert flow.bytes == 0 and not flow._holders


# -- memory: bytes in flight -----------------------------------------------------------------------
def first_word(data: bytes, path: str) -> np.ndarray:
    """Decodes an object of any size into its first 8 bytes, repeated to the schema's shape."""
    return np.full((WINDOW, 4), np.frombuffer(data[:8], dtype=np.int64)[0], dtype=np.int64)


def test_bytes_in_flight_stay_under_the_bound_with_objects_of_mixed_sizes(tmp_path, http):
    rng = np.random.default_rng(0)
    urls = []
    for i, size in enumerate([20_000, 60_000, 150_000, 250_000, 90_000, 35_000]):
        data = np.int64(i).tobytes() + rng.bytes(size - 8)
        urls.append(http.put(f"o{i}.bin", data))
    http.latency = 0.05
    bound = 400_000
    source = ObjectSource(urls, decoder=first_word, retry=QUICK)
    cache, stats = _sample_all(tmp_path, "c", source, workers=1, concurrency=32, count=150,
                               max_bytes_in_flight=bound)
    assert len(_records(cache)) == 150
    assert http.peak_in_flight > 2, "requests were in flight together"
    assert 0 < stats.peak_bytes_in_flight <= bound
    assert http.peak_bytes_in_flight <= bound, f"the store saw {http.peak_bytes_in_flight} bytes in flight"


def test_objects_whose_size_the_store_does_not_tell_stay_near_the_bound_and_come_many_at_a_time(tmp_path, http):
    # HEAD refused, bodies chunked: fsspec gives no size. Claimed as 0 bytes, such objects were all
    # fetched at once, whatever max_bytes_in_flight; claimed as the whole budget, each first fetch
    # came alone (about 9x slower over many objects). Each piece is now claimed as it streams in.
    rng = np.random.default_rng(1)
    sizes = [int(n) for n in rng.integers(10_000, 60_000, size=300)]
    urls = [http.put(f"u{i}.bin", np.int64(i).tobytes() + rng.bytes(size - 8)) for i, size in enumerate(sizes)]
    http.hide_sizes = True
    http.latency = 0.05
    bound = 200_000
    source = ObjectSource(urls, decoder=first_word, retry=QUICK)
    cache, stats = _sample_all(tmp_path, "c", source, workers=1, concurrency=32, count=120,
                               max_bytes_in_flight=bound)
    assert http.statuses.get(405), "the store was asked for sizes, and told none"
    # The oldest sample holding bytes may go over by the rest of its object, so that one finishes.
    assert 0 < stats.peak_bytes_in_flight <= bound + max(sizes)
    together = http.peak_served_at_once(bodies=True)
    assert together >= 12, f"only {together} objects of unknown size were fetched at once (32 in flight)"
    http.latency = 0
    assert _records(cache) == _expected(source, 11, 120)


def test_a_stream_of_unknown_size_that_fails_is_retried_with_its_pieces_given_back(tmp_path, http):
    urls = [http.put(f"u{i}.bin", np.int64(i).tobytes() + bytes(40_000)) for i in range(3)]
    http.hide_sizes = True
    http.fail_next = [None, 503, 503]  # the size probe answers; the next two reads fail for a while
    source = ObjectSource(urls, decoder=first_word, retry=QUICK)
    cache, stats = _sample_all(tmp_path, "c", source, workers=1, concurrency=4, count=30, max_bytes_in_flight=50_000)
    assert http.statuses.get(503) == 2
    assert _records(cache) == _expected(source, 11, 30)
    assert stats.peak_bytes_in_flight <= 50_000 + 40_008, "the failed reads' pieces were given back"


@pytest.mark.parametrize("engine", ["event loop", "threads"])
def test_a_failed_size_request_of_a_store_that_tells_no_size_is_retried_not_taken_as_not_found(tmp_path, http,
                                                                                                engine):
    # fsspec's http asks a size by HEAD, then by GET, and raises FileNotFoundError for any failure of
    # the GET: one 503 (or a refused connection) failed the pool, or left a globbed object out as vanished.
    rng = np.random.default_rng(2)
    urls = [http.put(f"u{i}.bin", np.int64(i).tobytes() + rng.bytes(20_000)) for i in range(4)]
    http.hide_sizes = True
    http.fail_next = [503, 503]  # the first GETs are size requests: no fetch claims bytes before them
    source = ObjectSource(urls, decoder=first_word, retry=QUICK)
    if engine == "threads":  # a user source drawing from a store source in threads: sizes asked by sync calls
        source = FunctionSource(source, thread_safe=True)
    cache, stats = _sample_all(tmp_path, "c", source, workers=1, concurrency=8, count=40,
                               max_bytes_in_flight=100_000)
    assert http.statuses.get(503) == 2 and http.statuses.get(405)
    assert _records(cache) == _expected(source, 11, 40)


class PairOfWindows:
    """A thread-safe user source drawing two windows of a store source per sample (module level,
    so that it pickles): each sample holds its first window's bytes while it claims the second."""

    def __init__(self, urls):
        self.windows = NpyWindowSource(urls, WINDOW, retry=QUICK)

    def __call__(self, rng):
        return {"x": self.windows.sample(rng)["x"], "y": self.windows.sample(rng)["x"]}


def test_samples_of_several_reads_never_deadlock_on_the_byte_budget(tmp_path):
    # A full budget of first windows, every sample waiting for room for its second, once hung the
    # pool for good: the oldest sample that holds bytes now goes over, so one always finishes.
    store = _local_arrays(tmp_path)
    source = FunctionSource(PairOfWindows(sorted(str(p) for p in store.glob("*.npy"))), thread_safe=True)
    window = WINDOW * 4 * 8
    cache = Cache(tmp_path / "pairs", capacity="64MB", schema=Schema({"x": ("int64", (WINDOW, 4)),
                                                                       "y": ("int64", (WINDOW, 4))}))
    with SamplerPool(cache, source, workers=1, concurrency=8, max_bytes_in_flight=4 * window, stop_after=200,
                     seed=3, shard_size="4KB", max_shard_age=0.5) as pool:
        stats = pool.join(timeout=60)
    assert stats.records == 200
    assert stats.peak_bytes_in_flight <= 5 * window, "over the budget by at most one sample's second read"
    want = sorted(b"".join(s[k].tobytes() for k in "xy") for s in (source(sample_rng(3, i, 0)) for i in range(200)))
    codec = ExampleCodec(cache.schema)
    got = sorted(b"".join(d[k].tobytes() for k in "xy")
                 for d in (codec.decode(r) for s in cache.list_shards() for _, r in iter_records(s.path)))
    assert got == want


def test_byte_budget_waiters_do_not_pile_up_while_the_budget_stays_full():
    # Publishing can block a sampler's writer for minutes while leases pin the cache; each
    # waiting sample once added a waiter every 0.5 s until the next release.
    import asyncio

    from growcache._concurrent import Flow

    flow = Flow(16, 100)
    flow.acquire(100)

    async def main():
        tasks = [asyncio.create_task(flow.acquire_async(10)) for _ in range(16)]
        await asyncio.sleep(1.6)
        waiters = len(flow._waiters)
        deadline = time.monotonic() + 10
        while not all(t.done() for t in tasks) and time.monotonic() < deadline:
            flow.release(min(10, flow.bytes))  # a sample written: room for the next
            await asyncio.sleep(0.01)
        return waiters, sum(t.done() for t in tasks)

    waiters, done = asyncio.run(main())
    assert waiters <= 16, f"{waiters} waiters for 16 waiting samples"
    assert done == 16, "every waiting sample got its bytes once room was freed"


def test_growcache_sample_concurrency_flag(tmp_path):
    from growcache.cli import main

    store = _local_arrays(tmp_path)
    cache_dir = tmp_path / "cli"
    assert main(["sample", "-q", f"file://{store}/*.npy", str(cache_dir), "--capacity", "16MB", "--window",
                 str(WINDOW), "--records", "90", "--concurrency", "8", "--workers", "2", "--seed", "4"]) == 0
    source = NpyWindowSource(f"file://{store}/*.npy", WINDOW)
    assert _records(Cache(cache_dir)) == _expected(source, 4, 90)
    assert main(["sample", "-q", f"file://{store}/*.npy", str(tmp_path / "bad"), "--window", "2",
                 "--concurrency", "0"]) != 0


def test_samples_that_claim_no_bytes_leave_no_holder_behind():
    # An object whose size the store does not tell (an HTTP server answering HEAD without
    # Content-Length, or gzip-encoded) is claimed as 0 bytes. Each such sample once stayed a
    # holder of the budget for good: one number per sample all run long, and the oldest of them,
    # long written, barred the oldest real holder from going over, so samples of two reads hung.
    from growcache._concurrent import Flow, Ticket

    flow = Flow(8, 100)
    for _ in range(1000):
        ticket = Ticket(flow)
        ticket.acquire(0)
        ticket.release()
    assert not flow._holders, f"{len(flow._holders)} holders left by samples that hold nothing"

    first, second = Ticket(flow), Ticket(flow)
    first.acquire(60)
    second.acquire(40)  # the budget is full; each waits for room for its next read
    got = threading.Event()

    def second_read():
        first.acquire(10)  # the oldest holder goes over the budget, so that it finishes
        got.set()

    threading.Thread(target=second_read, daemon=True).start()
    assert got.wait(30), "the oldest sample holding bytes never got its second read"


@pytest.mark.parametrize("mode", ["threads", "event loop"])
def test_a_large_claim_is_served_before_smaller_claims_that_came_after_it(mode):
    # A sample larger than the bytes left free waited for good while smaller samples, arriving
    # later, fitted into every gap a written sample left: the large one must get its turn.
    import asyncio

    from growcache._concurrent import Flow, Ticket

    flow = Flow(16, 100)
    held = [Ticket(flow) for _ in range(4)]
    for ticket in held:
        ticket.acquire(20)  # 80 of 100 held: a claim of 60 waits, one of 20 would fit
    order: list[str] = []

    def claim(name, nbytes):
        ticket = Ticket(flow)
        if mode == "threads":
            ticket.acquire(nbytes)
        else:
            asyncio.run(ticket.acquire_async(nbytes))
        order.append(name)
        return ticket

    big = threading.Thread(target=lambda: claim("large", 60), daemon=True)
    big.start()
    wait_until_queued = time.monotonic() + 10
    while not flow._turns and time.monotonic() < wait_until_queued:
        time.sleep(0.01)
    assert flow._turns, "the large claim waits its turn"
    small = [threading.Thread(target=lambda i=i: claim(f"small{i}", 20), daemon=True) for i in range(3)]
    for thread in small:
        thread.start()
    time.sleep(0.3)
    assert order == [], f"{order} got bytes before the large claim that came first"
    for ticket in held[:3]:
        ticket.release()  # 20 held: the large claim fits (80), then one small one (100)
    big.join(10)
    for thread in small:
        thread.join(1)
    assert "large" in order and len(order) == 2 and flow.bytes == 100, (order, flow.bytes)
    held[3].release()  # room for one more small claim; the last one waits in the queue
    wait_until_served = time.monotonic() + 10
    while len(order) < 3 and time.monotonic() < wait_until_served:
        time.sleep(0.01)
    assert len(order) == 3 and len(flow._turns) == 1, (order, list(flow._turns))


def test_a_claim_whose_event_loop_closed_while_it_waited_holds_up_no_later_claim():
    # A claim waiting in an event loop closed without cancelling it (a user's sample_many that runs a
    # loop of its own and closes it) never left the queue: every later claim waited for good behind
    # it, and the next release raised "Event loop is closed" waking it.
    import asyncio

    from growcache._concurrent import Flow, Ticket

    flow = Flow(16, 100)
    held = Ticket(flow)
    held.acquire(90)
    loop = asyncio.new_event_loop()
    waiting = loop.create_task(Ticket(flow).acquire_async(50))
    loop.run_until_complete(asyncio.sleep(0.1))
    loop.close()
    assert not waiting.done() and len(flow._turns) == 1
    held.release()
    got = threading.Event()
    threading.Thread(target=lambda: (Ticket(flow).acquire(50), got.set()), daemon=True).start()
    assert got.wait(10), "a later claim got its bytes"
    assert flow.bytes == 50 and not flow._turns


# -- a live bucket: objects deleted or rewritten while the pool samples ---------------------------
@pytest.mark.parametrize("kind", ["object", "window"])
def test_an_object_deleted_from_s3_mid_run_is_passed_over_not_the_end_of_the_pool(tmp_path, s3, kind, capfd):
    # One object of the glob deleted while the pool ran once failed the whole pool (a permanent
    # "not found"), though the others were there and a live bucket loses objects all the time.
    urls = _arrays(s3.put, count=4, rows=20)  # moto reads the whole object per ranged GET
    glob = f"{s3.url}/a*.npy"
    if kind == "object":
        source = ObjectSource(glob, decoder=first_word, storage_options=s3.storage_options, retry=QUICK)
    else:
        source = NpyWindowSource(glob, WINDOW, storage_options=s3.storage_options, retry=QUICK)
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with SamplerPool(cache, source, workers=1, concurrency=8, shard_size="4KB", max_shard_age=0.3) as pool:
        pool.wait_for(records=40, timeout=60)
        s3.fs().rm(s3.fs()._strip_protocol(urls[1]))
        before = pool.stats().records
        pool.wait_for(records=before + 200, timeout=60)  # raises SamplerError had the pool failed
    err = capfd.readouterr().err  # the workers' log
    assert f"{urls[1]} vanished from the store" in err
    assert "growcache-test-secret" not in err


def test_an_object_rewritten_larger_is_claimed_at_its_new_size_once_fetched(tmp_path):
    # The size the listing gave was claimed at every draw of an object rewritten larger since: each
    # fetch of it held its real size over max_bytes_in_flight, for the life of the sampler.
    from growcache._concurrent import Flow, Task, Ticket, make_engine

    store = tmp_path / "store"
    store.mkdir()
    (store / "o.bin").write_bytes(np.int64(1).tobytes() * 1_000)  # 8 kB when listed
    source = ObjectSource(str(store / "*.bin"), decoder=first_word)
    source.paths()
    (store / "o.bin").write_bytes(np.int64(2).tobytes() * 25_000)  # 200 kB now
    flow = Flow(4, 300_000)
    engine = make_engine(source, 4)  # local files: the threads engine

    def draw(index):
        task = Task(index, sample_rng(1, index, 0), 0, Ticket(flow))
        engine.submit(task)
        return task

    try:
        first = draw(0)
        assert engine.done.get(timeout=30) is first and first.error is None
        first.ticket.release()
        held = Ticket(flow)
        held.acquire(150_000)
        second = draw(1)
        time.sleep(0.5)
        assert engine.done.empty() and flow.bytes == 150_000, "200 kB do not fit beside 150 kB: the draw waits"
        held.release()
        assert engine.done.get(timeout=30) is second and second.error is None
        assert flow.peak_bytes <= 300_000, f"{flow.peak_bytes} bytes held at once"
    finally:
        engine.close()


def test_a_npy_rewritten_shorter_mid_run_is_read_with_its_new_header(tmp_path):
    store = _local_arrays(tmp_path)  # a0, a1, a2: 2000 rows each
    source = NpyWindowSource(str(store / "*.npy"), WINDOW)
    cache = Cache(tmp_path / "c", capacity="64MB", schema=SCHEMA)
    with SamplerPool(cache, source, workers=1, concurrency=8, shard_size="4KB", max_shard_age=0.3) as pool:
        pool.wait_for(records=100, timeout=60)
        shorter = np.full((50, 4), -7, dtype=np.int64)  # a window past row 50 would come back short
        np.save(store / "tmp.npy", shorter)
        os.replace(store / "tmp.npy", store / "a1.npy")
        before = pool.stats().records
        pool.wait_for(records=before + 1500, timeout=60)
    assert any(np.frombuffer(r, dtype=np.int64)[0] == -7 for r in _records(cache)), "the new a1.npy is sampled"
