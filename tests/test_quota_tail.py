"""A reader's quota that ends at or inside its last shard: what the unread tail may and may not hide.

A reader stops framing records once its quota is met, so the end-of-file checks of its last
shard (record count against the name, trailing bytes) run only when it reads to that end.
That is enough for exact epochs: a shard holding fewer records than its name claims is
reported by any reader that needs the missing records, and records past the quota are never
delivered, checked or not. ``growcache verify`` and the check before TensorFlow's reader
read every shard whole.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import id_sample, write_shards
from growcache.batching import BatchReader, ReaderShare, Skipped
from growcache.errors import CorruptShardError
from growcache.example import ExampleCodec
from growcache.records import frame_pieces
from growcache.vector_reader import VectorReader

READERS = [BatchReader, VectorReader]


def _share(shards, quota: int = -1) -> ReaderShare:
    return ReaderShare(paths=np.array([s.path.encode() for s in shards], dtype=np.bytes_),
                       records=np.array([s.records for s in shards], dtype=np.int64),
                       shards=np.arange(len(shards)), quota=quota, shuffle_seed=0)


def _read(reader, share) -> tuple[list[int], list[Skipped]]:
    ids, skipped = [], []

    def allocate(rows):
        return None, {n: np.empty((rows, *s.shape), s.dtype) for n, s in reader.schema.items()}

    for item in reader.batches(share, allocate):
        if isinstance(item, Skipped):
            skipped.append(item)
            continue
        _, arrays, rows = item
        for record_id, x in zip(arrays["id"][:rows], arrays["x"][:rows]):
            assert np.array_equal(x, id_sample(int(record_id))["x"])  # every delivered record intact
            ids.append(int(record_id))
    return ids, skipped


def _frame(record_id: int, schema) -> bytes:
    return b"".join(bytes(p) for p in frame_pieces([ExampleCodec(schema).encode(id_sample(record_id))])[0])


@pytest.mark.parametrize("reader_class", READERS)
def test_a_last_shard_cut_short_fails_every_reader_that_needs_its_missing_records(id_cache, reader_class):
    write_shards(id_cache, [5, 4])
    first, last = id_cache.list_shards()
    frame = os.path.getsize(last.path) // last.records
    os.truncate(last.path, 2 * frame)  # its name still says 4 records
    with pytest.raises(CorruptShardError, match="holds 2 records, its name says 4") as caught:
        _read(reader_class(id_cache.schema, 3), _share([first, last]))
    assert caught.value.path == last.path
    ids, skipped = _read(reader_class(id_cache.schema, 3, on_corrupt="skip"), _share([first, last]))
    assert ids == list(range(7)) and [(s.path, s.records) for s in skipped] == [(last.path, 2)]
    # A quota met before the cut: every record it needs is there, checked; the epoch is exact.
    ids, skipped = _read(reader_class(id_cache.schema, 3), _share([first, last], quota=6))
    assert ids == list(range(6)) and skipped == []


@pytest.mark.parametrize("reader_class", READERS)
def test_bytes_past_the_named_records_of_a_last_shard_are_never_delivered(id_cache, reader_class):
    write_shards(id_cache, [5, 4])
    first, last = id_cache.list_shards()
    with open(last.path, "ab") as f:
        f.write(_frame(99, id_cache.schema))  # a valid fifth record its name does not count
    # The quota (the named 9 records) ends at the last named record: the extra one is not read.
    ids, skipped = _read(reader_class(id_cache.schema, 4), _share([first, last]))
    assert ids == list(range(9)) and skipped == []
    # A reader that reads past the named records (the shard first, then more) reports it.
    with pytest.raises(CorruptShardError) as caught:
        _read(reader_class(id_cache.schema, 4), _share([last, first]))
    assert caught.value.path == last.path
