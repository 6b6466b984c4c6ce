"""TFRecordShardSource reads one remote shard as parallel ranged parts (issue 27).

A pool's ``concurrency`` and ``max_bytes_in_flight`` reach the fetch through its FetchJob:
the shard's bytes come as ranged GETs of ``chunk_bytes``, many in flight, handed on in
order to the same checking and publishing as a serial read. The stores are real: the HTTP
range server of tests/http_store.py (with a hook that fails or rewrites at one part's
offset) and moto's S3 server (small objects: it reads the whole object per ranged GET).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
from http_store import FaultyHTTPStore
from stores import s3, s3_server  # noqa: F401
from test_shard_source import SCHEMA, state_of
from tfrecords import compress, framed, labelled

from growcache import Cache, SamplerPool, SourceError, TFRecordShardSource
from growcache import shard_source
from growcache._concurrent import Flow
from growcache.records import iter_records
from growcache.shard import TMP_PREFIX
from growcache.sources import RetryPolicy
from growcache.shard_source import FetchJob, pass_progress

PART = 4096  # bytes per ranged GET
RECORDS = 600  # ~70 KB: 17 parts
FAST_RETRY = RetryPolicy(initial_delay=0.01, max_delay=0.05, deadline=10.0)


class HookedStore(FaultyHTTPStore):
    """The test HTTP store, plus faults keyed by the offset a ranged GET starts at.

    ``fail_at``: offset -> statuses the GETs starting there get, one each.
    ``rewrite_at``: ``(offset, name, data)``: the GET starting at ``offset`` is served, then
    the file is replaced by ``data`` (a new file: the GETs after it read the new version).
    """

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.fail_at: dict[int, list[int]] = {}
        self.rewrite_at: tuple[int, str, bytes] | None = None
        self.range_starts: list[int] = []

    async def _serve(self, request):
        from aiohttp import web

        header = request.headers.get("Range", "")
        offset = int(header[6:].partition("-")[0]) if header.startswith("bytes=") and header[6:7].isdigit() else None
        if request.method == "GET" and offset is not None:
            with self._lock:
                self.range_starts.append(offset)
                statuses = self.fail_at.get(offset)
                status = statuses.pop(0) if statuses else None
            if status is not None:
                self._count(status)
                return web.Response(status=status, text=f"failed on purpose with {status}")
        response = await super()._serve(request)
        rewrite = self.rewrite_at
        if rewrite is not None and offset == rewrite[0]:
            self.rewrite_at = None
            await response.prepare(request)  # this part is read from the old version
            await response.write_eof()
            _, name, data = rewrite
            staged = os.path.join(self.root, f".{name}.new")
            with open(staged, "wb") as f:
                f.write(data)
            os.replace(staged, os.path.join(self.root, name))
        return response


@pytest.fixture
def http_store(tmp_path):
    os.makedirs(tmp_path / "store")
    with HookedStore(str(tmp_path / "store")) as store:
        yield store


def _records(shard: int, count: int = RECORDS) -> list[bytes]:
    return [labelled(shard, i) for i in range(count)]


def _fetch(source: TFRecordShardSource, cache: Cache, *, concurrency: int = 8, max_bytes_in_flight: int | None = None,
           should_stop=lambda: False, flow=None) -> list:
    """One fetch call, published as a sampler worker publishes it; returns the published shards."""
    published = []
    job = FetchJob(cache, 0, 0, should_stop, concurrency=concurrency, max_bytes_in_flight=max_bytes_in_flight,
                   flow=flow)
    with contextlib.closing(source.fetch(job)) as shards:
        for shard in shards:
            published.append(cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit))
    return published


def _cached(cache: Cache) -> list[bytes]:
    return [bytes(r) for s in cache.list_shards() for _, r in iter_records(s.path)]


def _parts(size: int) -> int:
    return -(-size // PART)


@pytest.mark.parametrize("concurrency", [1, 8])
def test_a_large_shard_arrives_byte_identical_in_parallel_parts_over_http(tmp_path, http_store, concurrency):
    data = framed(_records(0))
    url = http_store.put("shard-0", data)
    http_store.latency = 0.02  # parts overlap only if they are in flight together
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(url, chunk_bytes=PART)
    (shard,) = _fetch(source, cache, concurrency=concurrency)
    with open(shard.path, "rb") as f:
        assert f.read() == data  # one piece, copied unchanged: the remote file byte for byte
    assert state_of(cache, source)["done"] == [source.fs._strip_protocol(url)]
    assert sorted(http_store.range_starts) == list(range(0, len(data), PART))  # each part once, no more
    if concurrency == 1:
        assert http_store.peak_in_flight == 1
    else:
        assert 4 <= http_store.peak_in_flight <= concurrency


def test_shards_over_s3_arrive_whole_plain_compressed_and_cut(tmp_path, s3):
    expected = {}
    for shard, compression in enumerate([None, "ZLIB", None]):
        expected[shard] = _records(shard, 40)
        s3.put(f"data/train-{shard}", compress(framed(expected[shard]), compression))
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(f"{s3.url}/data/train-*", storage_options=s3.storage_options, chunk_bytes=512,
                                 max_shard_records=15)
    by_remote = []
    for _ in range(3):
        published = _fetch(source, cache, concurrency=8)
        assert [s.records for s in published] == [15, 15, 10]  # cut at record boundaries, in stream order
        by_remote.append([bytes(r) for s in published for _, r in iter_records(s.path)])
    assert sorted(by_remote) == sorted(expected.values())  # each remote shard whole, in order, once
    assert source.requests > 3 * 2  # several ranged GETs per shard


def test_a_shard_folder_whose_listing_fails_for_a_while_is_listed_again_not_left_out(s3_server, s3):
    # fsspec's glob leaves out a folder whose listing fails: its shards went missing from the pass.
    for folder in "abc":
        s3.put(f"data/{folder}/train-0", framed(_records(0, 3)))
    s3_server.fail_listings["data/b/"] = [500, "InternalError", 2]  # botocore's own retry included
    source = TFRecordShardSource(f"{s3.url}/data/*/train-*", storage_options=s3.storage_options, retry=FAST_RETRY)
    assert sorted(p.rsplit("/", 2)[-2] for p in source._list_versions()) == ["a", "b", "c"]
    assert s3_server.fail_listings["data/b/"][2] == 0, "the failed listing was asked again"


def test_a_part_that_fails_transiently_once_is_retried_alone(tmp_path, http_store):
    data = framed(_records(0))
    url = http_store.put("shard-0", data)
    middle = 8 * PART
    http_store.fail_at = {middle: [500]}
    http_store.latency = 0.01
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(url, chunk_bytes=PART, retry=FAST_RETRY)
    (shard,) = _fetch(source, cache, concurrency=8)
    assert [bytes(r) for _, r in iter_records(shard.path)] == _records(0)  # complete, each record once
    assert http_store.statuses.get(500) == 1 and source.retries == 1
    starts = sorted(http_store.range_starts)
    assert starts == sorted([*range(0, len(data), PART), middle])  # the failed part alone was asked again


def test_a_part_that_fails_permanently_names_the_url_and_offset(tmp_path, http_store):
    url = http_store.put("shard-0", framed(_records(0)))
    http_store.fail_at = {5 * PART: [403] * 10}
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(url, chunk_bytes=PART, retry=FAST_RETRY)
    with pytest.raises(SourceError, match=rf"bytes {5 * PART}-{6 * PART} of {url} failed"):
        _fetch(source, cache, concurrency=8)
    assert cache.list_shards() == [] and state_of(cache, source)["claims"] == {}  # nothing published, claim released
    assert not [n for n in os.listdir(cache.shards_dir) if n.startswith(TMP_PREFIX)], "a temporary file was left"


def test_a_shard_rewritten_mid_fetch_is_not_published_mixed(tmp_path, http_store, caplog, monkeypatch):
    monkeypatch.setattr(shard_source, "_RELIST_S", 0.0)
    # Records of one length, and parts of whole records: a mix of the two versions frames cleanly
    # and passes every CRC, so only the version check can keep it out.
    old, new = framed(_records(1)), framed(_records(2))
    frame = len(framed(_records(1, 1)))
    assert len(old) == len(new) == RECORDS * frame
    part = 32 * frame
    url = http_store.put("shard-0", old)
    http_store.rewrite_at = (6 * part, "shard-0", new)
    http_store.latency = 0.02
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(url, chunk_bytes=part)
    flow = Flow(4, 64 << 20)  # a worker's, shared by its fetches as a sampler worker shares it
    with caplog.at_level("WARNING", logger="growcache"):
        assert _fetch(source, cache, concurrency=4, flow=flow) == []
    assert http_store.rewrite_at is None, "the store was not rewritten mid-fetch"
    assert "changed while this pass ran; passed over" in caplog.text
    assert pass_progress(cache)[0].changed == 1
    assert flow.bytes == 0  # the abandoned read gave its parts' budget back for the next one
    (shard,) = _fetch(source, cache, concurrency=4, flow=flow)  # the next pass: the new version, whole
    assert _cached(cache) == _records(2) and flow.bytes == 0


def test_bytes_in_flight_stay_within_max_bytes_in_flight(tmp_path, http_store):
    data = framed(_records(0))
    url = http_store.put("shard-0", data)
    http_store.latency = 0.03
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(url, chunk_bytes=PART)
    (shard,) = _fetch(source, cache, concurrency=32, max_bytes_in_flight=3 * PART)
    assert [bytes(r) for _, r in iter_records(shard.path)] == _records(0)
    assert source.peak_bytes_in_flight == 3 * PART  # the bound is reached, never passed
    assert 2 * PART <= http_store.peak_bytes_in_flight <= 3 * PART
    assert http_store.peak_in_flight <= 3


def test_stopping_cancels_the_parts_in_flight(tmp_path, http_store):
    url = http_store.put("shard-0", framed(_records(0)))
    http_store.latency = 30.0  # no part comes back before the test ends
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(url, chunk_bytes=PART)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    began = time.monotonic()
    flow = Flow(8, 64 << 20)
    assert _fetch(source, cache, concurrency=8, should_stop=stop.is_set, flow=flow) == []
    assert time.monotonic() - began < 10.0  # it did not wait for the parts (30 s each)
    assert flow.bytes == 0  # the cancelled parts' budget is given back to the worker's flow
    assert state_of(cache, source)["claims"] == {}  # released: the next fetch takes it again


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_sampler_pool_fetches_a_shard_in_parts_in_its_worker_process(tmp_path, http_store, concurrency):
    """The pool's ``concurrency`` reaches the worker's fetch: 1 is the serial read of old."""
    data = framed(_records(0))
    url = http_store.put("shard-0", data)
    http_store.latency = 0.02
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    http_store.fail_at = {3 * PART: [503]}  # one part throttled once: retried alone
    source = TFRecordShardSource(url, chunk_bytes=PART, retry=FAST_RETRY)
    with SamplerPool(cache, source, workers=1, seed=0, concurrency=concurrency) as pool:
        pool.wait_for(records=RECORDS, timeout=60)  # raises if the worker failed
        deadline = time.monotonic() + 10
        while (stats := pool.stats()).latency_p50 == 0 and concurrency > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _cached(cache) == _records(0)  # whole, in order, once
    if concurrency > 1:  # the parts' requests show in pool.stats(), as a sample pool's do
        assert stats.latency_p50 >= 0.02 and stats.latency_p99 >= stats.latency_p50
        assert stats.throttle_events == 1 and 0 < stats.peak_bytes_in_flight <= pool.max_bytes_in_flight
    # Parts in flight together, never more than the pool allows (the version check's HEAD adds none).
    assert (http_store.peak_in_flight > 1) == (concurrency > 1) and http_store.peak_in_flight <= concurrency
    assert sorted(set(http_store.range_starts)) == list(range(0, len(data), PART))


def test_the_shard_fetch_benchmark_runs(tmp_path):
    """benchmarks/shard_fetch.py end to end on a 4 MiB shard (no speed asserted)."""
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import shard_fetch
    finally:
        sys.path.pop(0)
    out = tmp_path / "shard_fetch.json"
    results = shard_fetch.main(shard_fetch.parse_args(["--quick", "--latency-ms", "5", "--json", str(out)]))
    assert json.loads(out.read_text()) == results
    contenders = results["contenders"]
    assert set(contenders) == {"serial", "parts_8x1MiB", "plain_8x1MiB"}
    assert all(c["MBps"] > 0 and c["bytes"] >= 4 << 20 for c in contenders.values())
    assert contenders["serial"]["peak_bytes_in_flight"] == 0 < contenders["parts_8x1MiB"]["peak_bytes_in_flight"]
    assert "`parts_8x1MiB`" in shard_fetch.markdown(results)


_HUNG_READ = """
import sys, threading, time
from growcache.shard_source import TFRecordShardSource, _Parts, _Stopping

class HungStore(TFRecordShardSource):
    def _fetch(self, path, start=None, end=None):
        threading.Event().wait(60)  # a read that does not come back: a silent NFS server, a stalled mount

path = sys.argv[1]
stop_at = time.monotonic() + 0.5
try:
    for _ in _Parts(HungStore(path), path, 0, 8192, part=1024, concurrency=4, max_bytes=1 << 20,
                    should_stop=lambda: time.monotonic() > stop_at):
        pass
except _Stopping:
    print("stopped", flush=True)
"""


def test_a_stopped_worker_exits_without_waiting_for_a_hung_read_of_a_local_shard(tmp_path):
    # Parts of a sync filesystem's shard are read in threads; the interpreter joined
    # concurrent.futures' threads at exit, so a stopped worker stayed until the read returned.
    import subprocess
    import sys

    shard = tmp_path / "shard-0"
    shard.write_bytes(framed(_records(0))[:8192])
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _HUNG_READ, str(shard)], capture_output=True, text=True,
                          timeout=40)
    assert done.stdout.strip() == "stopped", done.stderr
    assert time.monotonic() - began < 30, "the process waited for the hung reads to return"


def test_a_details_request_failing_for_a_passing_reason_is_retried_not_taken_for_a_gone_shard(tmp_path, http_store):
    # fsspec's http asks an object's details by HEAD, then by GET, and raises FileNotFoundError for
    # whatever made the GET fail: a 503 on both took a shard for deleted from the store, and the
    # fetch passed it over.
    url = http_store.put("shard-0", framed(_records(0)))
    cache = Cache(tmp_path / "cache", capacity="64MB", schema=SCHEMA)
    source = TFRecordShardSource(url, chunk_bytes=PART, retry=RetryPolicy(attempts=4, initial_delay=0.05,
                                                                        max_delay=0.2, deadline=10))
    source.check()  # the listing (the first HEAD answers)
    http_store.fail_heads, http_store.fail_next = [503], [503]  # the fetch's details request: HEAD, then GET
    (shard,) = _fetch(source, cache, concurrency=1)
    assert shard.records == RECORDS and _cached(cache) == _records(0)
    assert http_store.statuses.get(503) == 2


def test_a_size_request_of_an_import_failing_for_a_passing_reason_is_retried(tmp_path, http_store):
    data = framed(_records(0))
    url = http_store.put("shard-0", data)
    source = TFRecordShardSource(url, retry=RetryPolicy(attempts=4, initial_delay=0.05, max_delay=0.2, deadline=10))
    http_store.fail_heads, http_store.fail_next = [503], [503]
    assert source.size(source.paths()[0]) == len(data)  # `growcache import` sizes each file so
    assert http_store.statuses.get(503) == 2
