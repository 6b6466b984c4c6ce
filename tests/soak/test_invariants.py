"""Focused checks of the promise that the soak exercises at random moments: a full disk at each
step of a publish, on a real size-limited filesystem, and readers whose epochs overlap."""

from __future__ import annotations

import hashlib
import os

import pytest

from _fullfs import fill, size_limited_fs
from conftest import ID_SCHEMA, id_sample, write_shards
from growcache import Cache, CacheFullError
from growcache.records import iter_records
from growcache.shard import TMP_PREFIX


def _digests(cache: Cache) -> dict[str, str]:
    return {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()}


def _leftovers(cache: Cache) -> list[str]:
    return [n for d in (cache.shards_dir, cache.path, os.path.join(cache.path, "leases"))
            for n in os.listdir(d) if n.startswith(TMP_PREFIX) or n.endswith(".tmp")]


@pytest.fixture
def small_fs(tmp_path):
    with size_limited_fs(str(tmp_path / "fs"), 1 << 20) as (path, reason):
        if path is None:
            pytest.skip(f"no size-limited filesystem here: {reason}")
        yield path


def test_disk_full_mid_shard_discards_it_and_harms_nothing(small_fs):
    cache = Cache(os.path.join(small_fs, "cache"), capacity="512KB", schema=ID_SCHEMA)
    ids = write_shards(cache, [20, 20])
    before = _digests(cache)
    ballast = os.path.join(small_fs, "ballast")
    fill(small_fs, ballast, leave=16 << 10)
    writer = cache.writer()
    with pytest.raises(CacheFullError, match=r"disk holding .* is full.*partial shard was removed") as info:
        for i in range(2000):  # ~400 KB: flushed in several writes, the disk fills mid-shard
            writer.write(id_sample(10_000 + i))
        writer.close()
    assert isinstance(info.value.__cause__, OSError) and "Free disk space" in str(info.value)
    assert writer.closed and not os.path.exists(writer.path)
    assert _digests(cache) == before and _leftovers(cache) == []
    assert cache.verify().ok and cache.stats().published == 2
    os.unlink(ballast)
    write_shards(cache, [5], first_id=100)  # the cache works again once there is room
    assert cache.verify().ok and sum(1 for s in cache.list_shards() for _ in iter_records(s.path)) == len(ids) + 5


def test_full_disk_while_publishing_publishes_nothing(tmp_path):
    # An exhausted inode table lets the shard's own data in, then refuses the new files that
    # publishing and leasing create: a full disk at the last step of a publish.
    with size_limited_fs(str(tmp_path / "fs"), 4 << 20, inodes=64) as (fs, reason):
        if fs is None:
            pytest.skip(f"no size-limited filesystem here: {reason}")
        cache = Cache(os.path.join(fs, "cache"), schema=ID_SCHEMA)
        write_shards(cache, [10])
        before = _digests(cache)
        writer = cache.writer()
        for i in range(10):
            writer.write(id_sample(100 + i))
        filler = os.path.join(fs, "filler")
        os.mkdir(filler)

        def exhaust_inodes() -> None:
            for n in range(10_000):
                try:
                    open(os.path.join(filler, f"{len(os.listdir(filler))}-{n}"), "x").close()
                except OSError:
                    return

        exhaust_inodes()
        with pytest.raises(CacheFullError, match=r"is full .* publishing .*nothing was published"):
            writer.close()
        assert not os.path.exists(writer.path)
        exhaust_inodes()  # the removed temporary freed one
        with pytest.raises(CacheFullError, match="snapshot's lease"):
            cache.snapshot()
        assert _digests(cache) == before and cache.stats().published == 1
        for name in os.listdir(filler)[:8]:
            os.unlink(os.path.join(filler, name))
        # The next shard gets a fresh sequence number: a shard of the same size published under
        # the refused one's number would have replaced the first shard.
        write_shards(cache, [10], first_id=100)
        assert [s.seq for s in cache.list_shards()] == [1, 2]
        assert _digests(cache).items() >= before.items() and cache.verify().ok
        assert _leftovers(cache) == []
        del cache


def test_overlapping_readers_keep_the_cache_bounded(id_cache, tmp_path):
    # Two readers (a TF and a torch process, or two DDP ranks) whose epochs always overlap:
    # each new snapshot must not re-lease the old shards the other one holds, or they would
    # stay leased forever and the cache would grow without bound.
    write_shards(id_cache, [10])
    shard = id_cache.list_shards()[0].nbytes
    cache = Cache(tmp_path / "bounded", capacity=shard * 4, schema=ID_SCHEMA)
    first, second = cache.snapshot(), cache.snapshot()
    peak = 0
    for epoch in range(30):
        write_shards(cache, [10, 10], first_id=1000 * epoch)
        first.close()
        first = cache.snapshot()
        write_shards(cache, [10, 10], first_id=1000 * epoch + 500)
        second.close()
        second = cache.snapshot()
        for snapshot in (first, second):
            assert snapshot.nbytes <= cache.capacity
            assert all(os.path.exists(p) for p in snapshot.paths), "a leased shard was evicted"
        peak = max(peak, cache.stats().bytes)
    assert peak <= 2 * cache.capacity, "capacity, plus the other reader's leased snapshot"
    first.close()
    second.close()
    cache.snapshot().close()
    assert cache.stats().bytes <= cache.capacity
