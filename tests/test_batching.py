"""BatchReader, the core's record-to-batch reader shared by the adapters: order, shuffle, quotas."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import id_sample, write_shards
from growcache.batching import BatchReader, ReaderShare, default_shuffle_buffer


def share_of(cache, quota: int = -1, seed: int = 0) -> ReaderShare:
    shards = cache.list_shards()
    return ReaderShare(
        paths=np.array([s.path.encode() for s in shards], dtype=np.bytes_),
        records=np.array([s.records for s in shards], dtype=np.int64),
        shards=np.arange(len(shards)),
        quota=quota,
        shuffle_seed=seed,
    )


def read(reader: BatchReader, share: ReaderShare) -> list[list[int]]:
    """Ids per batch, checking every payload against its id."""
    batches = []

    def allocate(rows):
        return None, {n: np.empty((rows, *s.shape), s.dtype) for n, s in reader.schema.items()}

    for _, arrays, rows in reader.batches(share, allocate):
        ids = [int(i) for i in arrays["id"][:rows]]
        for record_id, x in zip(ids, arrays["x"][:rows]):
            assert np.array_equal(x, id_sample(record_id)["x"])
        batches.append(ids)
    return batches


def test_without_shuffle_batches_follow_shard_order(id_cache):
    ids = write_shards(id_cache, [7, 5, 9])
    batches = read(BatchReader(id_cache.schema, 4), share_of(id_cache))
    assert [i for b in batches for i in b] == ids
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 1]


@pytest.mark.parametrize("buffer", [1, 3, 8, 21, 100])
def test_shuffle_buffer_keeps_every_record_exactly_once(id_cache, buffer):
    ids = write_shards(id_cache, [7, 5, 9])
    batches = read(BatchReader(id_cache.schema, 4, shuffle_buffer=buffer), share_of(id_cache, seed=3))
    got = [i for b in batches for i in b]
    assert sorted(got) == ids
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 1]
    if buffer > 1:
        assert got != ids


def test_shuffle_changes_batches_with_the_seed_and_repeats_with_it(id_cache):
    write_shards(id_cache, [16, 16])
    reader = BatchReader(id_cache.schema, 4, shuffle_buffer=8)
    first = read(reader, share_of(id_cache, seed=1))
    assert read(reader, share_of(id_cache, seed=1)) == first
    other = read(reader, share_of(id_cache, seed=2))
    assert {frozenset(b) for b in other} != {frozenset(b) for b in first}


def test_shuffle_respects_quota_and_drop_last(id_cache):
    write_shards(id_cache, [10, 10])
    batches = read(BatchReader(id_cache.schema, 4, shuffle_buffer=6, drop_last=True), share_of(id_cache, quota=15))
    assert [len(b) for b in batches] == [4, 4, 4]
    assert len({i for b in batches for i in b}) == 12


def test_bad_shuffle_buffer_is_refused(id_cache):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="shuffle_buffer"):
            BatchReader(id_cache.schema, 4, shuffle_buffer=bad)


def test_default_shuffle_buffer_is_about_32_mib_and_at_least_two_batches(id_cache):
    from growcache import Schema

    big = Schema({"x": ("float32", (262144,))})  # 1 MiB records
    assert default_shuffle_buffer(big, 4) == 32
    assert default_shuffle_buffer(big, 64) == 128
    small = Schema({"x": ("uint8", (16,))})
    assert default_shuffle_buffer(small, 4) == 8192


def test_shuffle_window_batches_come_out_dense_and_unused_ones_are_released(id_cache):
    write_shards(id_cache, [9, 6])  # 15 records, batches of 4, windows of 8: the last window is partial
    reader = BatchReader(id_cache.schema, 4, shuffle_buffer=6, drop_last=True)
    allocated, released, yielded = [], [], []

    def allocate(rows):
        key = len(allocated)
        allocated.append(key)
        return key, {n: np.empty((rows, *s.shape), s.dtype) for n, s in reader.schema.items()}

    ids = []
    for key, arrays, rows in reader.batches(share_of(id_cache, seed=9), allocate, released.append):
        assert rows == 4
        yielded.append(key)
        ids += [int(i) for i in arrays["id"][:rows]]
    assert len(ids) == len(set(ids)) == 12
    assert sorted(yielded + released) == allocated  # every slot either sent or given back
