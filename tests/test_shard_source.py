"""TFRecordShardSource: whole remote shards through a cache, in passes, claimed through the cache directory.

The fetch protocol is driven here the way a sampler worker drives it (fetch, publish with
the commit hook); tests/test_shard_pool.py runs it in real sampler pools.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest
from stores import gcs, gcs_server, s3, s3_server  # noqa: F401
from tfrecords import bytes_feature, compress, example, framed, labelled

from growcache import Cache, Schema, SchemaError, TFRecordShardSource
from growcache.records import iter_records
from growcache.shard_source import FetchJob, pass_progress

SCHEMA = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (64,))})
RECORDS = 10


def make_remote(root, shards: int, compression: str | None = None, records: int = RECORDS) -> dict[str, list[bytes]]:
    """``shards`` remote TFRecord files under ``root``; returns their records by file name."""
    os.makedirs(root, exist_ok=True)
    out = {}
    for shard in range(shards):
        name = f"train-{shard:05d}-of-{shards:05d}"
        out[name] = [labelled(shard, i) for i in range(records)]
        with open(os.path.join(root, name), "wb") as f:
            f.write(compress(framed(out[name]), compression))
    return out


def fetch_once(source: TFRecordShardSource, cache: Cache, *, seed: int = 0, max_bytes: int | None = None) -> list:
    """One fetch call, published as a sampler worker publishes it; returns the published shards."""
    published = []
    job = FetchJob(cache, seed, 0, lambda: False, max_bytes=max_bytes)
    with contextlib.closing(source.fetch(job)) as shards:
        for shard in shards:
            published.append(cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit))
    return published


def state_of(cache: Cache, source: TFRecordShardSource) -> dict:
    with open(os.path.join(cache.path, "sources", f"{source.key}.json")) as f:
        return json.load(f)


def origin(record: bytes, remote: dict[str, list[bytes]]) -> str:
    return next(name for name, records in remote.items() if record in records)


def test_passes_fetch_each_shard_once_and_then_only_what_was_evicted(tmp_path):
    remote = make_remote(tmp_path / "remote", 8)
    size = os.path.getsize(tmp_path / "remote" / "train-00003-of-00008")
    cache = Cache(tmp_path / "cache", capacity=3 * size, schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "train-*"))
    fetched = []
    for _ in range(8):
        (shard,) = fetch_once(source, cache)
        records = [bytes(r) for _, r in iter_records(shard.path)]
        name = origin(records[0], remote)
        assert records == remote[name]  # byte for byte, never re-encoded
        fetched.append(name)
    assert sorted(fetched) == sorted(remote) and fetched != sorted(remote)  # each once, shuffled
    progress, = pass_progress(cache)
    assert (progress.pass_number, progress.fetched, progress.total, progress.held, progress.known) == (1, 8, 8, 3, 8)
    # The cache holds the last three: pass 2 fetches the other five, in a new order.
    second = []
    for _ in range(5):
        (shard,) = fetch_once(source, cache)
        second.append(origin(bytes(next(iter_records(shard.path))[1]), remote))
    assert sorted(second) == sorted(set(remote) - set(fetched[-3:]))
    assert pass_progress(cache)[0].pass_number == 2
    history = state_of(cache, source)["history"]
    assert [h["fetched"] for h in history] == [
        [str(tmp_path / "remote" / n) for n in fetched], [str(tmp_path / "remote" / n) for n in second]]


def test_the_pass_order_comes_from_the_seed(tmp_path):
    make_remote(tmp_path / "remote", 6)
    orders = []
    for seed, name in [(1, "a"), (1, "b"), (2, "c")]:
        cache = Cache(tmp_path / name, capacity="1MB", schema=SCHEMA)
        source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
        fetch_once(source, cache, seed=seed)
        orders.append(state_of(cache, source)["order"])
    assert orders[0] == orders[1] != orders[2]


def test_a_cache_that_holds_the_dataset_fetches_nothing_more(tmp_path):
    make_remote(tmp_path / "remote", 3)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    for _ in range(3):
        assert len(fetch_once(source, cache)) == 1
    assert fetch_once(source, cache) == [] and fetch_once(source, cache) == []
    assert pass_progress(cache)[0].pass_number == 1  # no empty passes counted


def test_shards_cut_into_pieces_and_a_partly_evicted_one_fetches_only_its_missing_pieces(tmp_path):
    remote = make_remote(tmp_path / "remote", 2, records=9)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"), max_shard_records=4)
    first = fetch_once(source, cache)
    assert [s.records for s in first] == [4, 4, 1]
    name = origin(bytes(next(iter_records(first[0].path))[1]), remote)
    assert [bytes(r) for s in first for _, r in iter_records(s.path)] == remote[name]
    fetch_once(source, cache)
    os.unlink(first[0].path)  # the oldest piece is evicted (by hand here)
    again = fetch_once(source, cache)  # pass 2: only that shard, only its first 4 records
    assert [s.records for s in again] == [4]
    assert [bytes(r) for _, r in iter_records(again[0].path)] == remote[name][:4]


@pytest.mark.parametrize("concurrency", [1, 8])
def test_a_gap_is_read_up_to_its_end_and_not_one_record_past_it(tmp_path, concurrency):
    # The evicted first piece is fetched again; the record after it (held in the cache already) is
    # damaged on the store since (same size and mtime, so the same version). Reading one frame past
    # the gap found that damage and passed the whole shard over as corrupt, the good gap with it.
    remote = make_remote(tmp_path / "remote", 1, records=9)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"), max_shard_records=4, chunk_bytes=64)
    first = fetch_once(source, cache)
    assert [s.records for s in first] == [4, 4, 1]
    os.unlink(first[0].path)
    path = tmp_path / "remote" / "train-00000-of-00001"
    records = remote[path.name]
    data, stat = bytearray(path.read_bytes()), path.stat()
    data[len(framed(records[:4])) + 20] ^= 0xFF  # inside record 4's payload: its CRC fails
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    job = FetchJob(cache, 0, 0, lambda: False, concurrency=concurrency)
    again = []
    with contextlib.closing(source.fetch(job)) as shards:
        for shard in shards:
            again.append(cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit))
    assert [bytes(r) for s in again for _, r in iter_records(s.path)] == records[:4]
    assert pass_progress(cache)[0].corrupt == 0 and pass_progress(cache)[0].held == 1


def test_a_fetch_cut_by_the_pools_shard_size(tmp_path):
    remote = make_remote(tmp_path / "remote", 1, records=10)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    frame = len(framed(remote["train-00000-of-00001"][:1]))
    shards = fetch_once(TFRecordShardSource(str(tmp_path / "remote" / "*")), cache, max_bytes=3 * frame)
    assert [s.records for s in shards] == [3, 3, 3, 1]


def test_gzip_remote_shards_are_copied_decompressed(tmp_path):
    remote = make_remote(tmp_path / "remote", 2, compression="GZIP")
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"), max_shard_records=3)
    got = [bytes(r) for _ in range(2) for s in fetch_once(source, cache) for _, r in iter_records(s.path)]
    assert sorted(got) == sorted(r for records in remote.values() for r in records)


def test_a_record_off_schema_is_passed_over_with_a_warning_naming_file_and_offset(tmp_path, caplog):
    records = [labelled(0, i) for i in range(3)] + [example([("label", bytes_feature(b"x")), ("x", bytes_feature(bytes(64)))])]
    os.makedirs(tmp_path / "remote")
    (tmp_path / "remote" / "bad").write_bytes(framed(records))
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    with caplog.at_level("WARNING", logger="growcache"):
        assert fetch_once(source, cache) == []
    assert str(tmp_path / "remote" / "bad") in caplog.text and "passed over until it changes" in caplog.text
    assert f"at byte offset {len(framed(records[:3]))}" in caplog.text and "'label'" in caplog.text
    assert state_of(cache, source)["claims"] == {} and not cache.list_shards()
    assert not [n for n in os.listdir(cache.shards_dir) if n.startswith(".tmp")]
    assert pass_progress(cache)[0].corrupt == 1


def _fetch_until_killed(remote: str, cache_path: str, ready) -> None:
    """A worker that starts a fetch and stops at its first piece (the parent kills it there)."""
    source = TFRecordShardSource(remote, max_shard_records=2, chunk_bytes=64)
    cache = Cache(cache_path)
    job = FetchJob(cache, 0, 0, lambda: False)
    for shard in source.fetch(job):
        cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit)
        ready.set()
        time.sleep(60)


def test_a_killed_fetch_is_taken_over_and_resumed_after_its_published_pieces(tmp_path):
    remote = make_remote(tmp_path / "remote", 1, records=7)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_fetch_until_killed, args=(str(tmp_path / "remote" / "*"), cache.path, ready))
    proc.start()
    assert ready.wait(60)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"), max_shard_records=2)
    assert fetch_once(source, cache) == []  # claimed by a live worker: not fetched twice
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    resumed = fetch_once(pickle.loads(pickle.dumps(source)), cache)  # a restarted worker's copy
    assert [s.records for s in resumed] == [2, 2, 1]
    records = [bytes(r) for s in cache.list_shards() for _, r in iter_records(s.path)]
    assert records == remote["train-00000-of-00001"]  # each record once, the first piece kept
    assert state_of(cache, source)["done"] == [str(tmp_path / "remote" / "train-00000-of-00001")]


@pytest.mark.parametrize("store_name", ["s3", "gcs"])
def test_fetch_from_object_stores(request, tmp_path, store_name):
    store = request.getfixturevalue(store_name)
    expected = []
    for shard in range(3):
        records = [labelled(shard, i) for i in range(5)]
        expected.extend(records)
        store.put(f"data/train-{shard}", compress(framed(records), "ZLIB" if shard == 1 else None))
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(f"{store.url}/data/train-*", storage_options=store.storage_options,
                                 max_shard_records=3, chunk_bytes=100)
    got = [bytes(r) for _ in range(3) for s in fetch_once(source, cache) for _, r in iter_records(s.path)]
    assert sorted(got) == sorted(expected)
    assert "growcache-test-secret" not in repr(source)  # the S3 server's credentials


def test_a_stopping_pool_drops_the_copy_in_progress_and_the_next_fetch_resumes(tmp_path):
    remote = make_remote(tmp_path / "remote", 1, records=500)
    cache = Cache(tmp_path / "cache", capacity="10MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"), max_shard_records=100, chunk_bytes=4096)
    copied = [0]

    def progress(nbytes: int) -> None:
        copied[0] += 1

    job = FetchJob(cache, 0, 0, lambda: copied[0] > 150, progress=progress)  # stop() mid-way through piece 2
    published = []
    with contextlib.closing(source.fetch(job)) as shards:
        for shard in shards:
            published.append(cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit))
    assert [s.records for s in published] == [100]
    assert state_of(cache, source)["claims"] == {} and state_of(cache, source)["done"] == []
    assert not [n for n in os.listdir(cache.shards_dir) if n.startswith(".tmp")]
    rest = fetch_once(source, cache)  # resumes after the published piece
    assert [s.records for s in rest] == [100, 100, 100, 100]
    records = [bytes(r) for s in cache.list_shards() for _, r in iter_records(s.path)]
    assert records == remote["train-00000-of-00001"]


@pytest.mark.parametrize("damage", ["not json", '{"held": {"a": {"end": 1, "pieces": [["x", 0, 1]]}}}', "[1, 2]"])
def test_a_damaged_state_file_starts_afresh_with_a_warning(tmp_path, caplog, damage):
    remote = make_remote(tmp_path / "remote", 2)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    fetch_once(source, cache)
    with open(os.path.join(cache.path, "sources", f"{source.key}.json"), "w") as f:
        f.write(damage)
    with caplog.at_level("WARNING", logger="growcache"):
        (shard,) = fetch_once(source, cache)
    assert "starts afresh" in caplog.text
    assert [bytes(r) for _, r in iter_records(shard.path)] in list(remote.values())
    assert state_of(cache, source)["pass"] == 1
