"""make_tf_dataset against corruption of every part of a record's frame, not only its payload:
the length, the length's CRC, the payload's CRC, and a length rewritten with a valid CRC."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

from conftest import ID_SCHEMA, id_sample, leases_after_teardown, write_shards

tf = pytest.importorskip("tensorflow")

from growcache import CorruptShardError  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402
from growcache.example import ExampleCodec  # noqa: E402
from growcache.records import frame_header  # noqa: E402

PAYLOAD = ExampleCodec(ID_SCHEMA).record_nbytes
FRAME = PAYLOAD + 16  # 8-byte length, 4-byte length CRC, payload, 4-byte payload CRC
BAD_RECORD = 2  # of the 4 in the damaged shard: records before it and after it exist


def _flip(offset: int):
    def damage(path: str, record_start: int) -> None:
        with open(path, "r+b") as f:
            f.seek(record_start + offset)
            byte = f.read(1)[0]
            f.seek(record_start + offset)
            f.write(bytes([byte ^ 0x5A]))
    return damage


def _length_with_valid_crc(path: str, record_start: int) -> None:
    # A header that passes its own CRC but frames the record 5 bytes too long: only the
    # payload CRC (over the wrong bytes) can catch it.
    with open(path, "r+b") as f:
        f.seek(record_start)
        f.write(frame_header(PAYLOAD + 5))


DAMAGE = {
    "length": (_flip(1), "length CRC32C"),
    "length CRC": (_flip(9), "length CRC32C"),
    "payload CRC": (_flip(12 + PAYLOAD + 2), "data CRC32C"),
    "length with a valid CRC": (_length_with_valid_crc, "data CRC32C"),
}


def _damaged_cache(cache, how: str) -> tuple[list[int], str, list[int]]:
    """Three shards of 4 records; the middle one's record BAD_RECORD damaged as ``how`` says."""
    ids = write_shards(cache, [4, 4, 4])
    bad = cache.list_shards()[1]
    assert os.path.getsize(bad.path) == 4 * FRAME
    damage, _ = DAMAGE[how]
    damage(bad.path, BAD_RECORD * FRAME)
    return ids, bad.path, ids[4:8]


def _read(ds) -> list[int]:
    got = []
    for batch in ds:
        for record_id, x in zip(batch["id"].numpy(), batch["x"].numpy()):
            assert np.array_equal(x, id_sample(int(record_id))["x"]), "a damaged record was delivered"
            got.append(int(record_id))
    return got


@pytest.mark.parametrize("how", list(DAMAGE))
def test_on_corrupt_raise_names_the_shard_and_the_damaged_record(id_cache, how):
    _, bad, _ = _damaged_cache(id_cache, how)
    with pytest.raises(CorruptShardError, match=DAMAGE[how][1]) as info:
        _read(make_tf_dataset(id_cache, 2, seed=0))
    assert info.value.path == bad and info.value.offset == BAD_RECORD * FRAME, str(info.value)
    del info  # its traceback holds the failed iterator, whose deletion ends the epoch
    assert leases_after_teardown(id_cache) == 0


@pytest.mark.parametrize("how", list(DAMAGE))
def test_on_corrupt_skip_passes_over_the_damage_and_reports_it(id_cache, how):
    ids, bad, bad_ids = _damaged_cache(id_cache, how)
    ds = make_tf_dataset(id_cache, 2, seed=0, on_corrupt="skip")
    for epoch in range(2):  # the damage is found again in every epoch, never delivered
        got = _read(ds)
        assert len(got) == len(set(got)), f"epoch {epoch}: a record delivered twice"
        good = [i for i in ids if i not in bad_ids]
        assert sorted(i for i in got if i not in bad_ids) == good, f"epoch {epoch}: a good shard lost records"
        # Records of the damaged shard from the damaged one on are never delivered (the
        # ones before it may be, once).
        assert not set(got) & set(bad_ids[BAD_RECORD:]), f"epoch {epoch}: records from the damaged one on"
    assert [(e.path, e.offset) for e in ds.corrupt_shards] == [(bad, BAD_RECORD * FRAME)] * 2


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("reader", ["growcache", "tensorflow"])
def test_a_shard_cut_at_a_record_boundary_is_corrupt_with_either_reader_and_either_verify(id_cache, reader, verify):
    # Its name says 4 records, its file holds 3 whole ones: no frame is damaged, so only the
    # name tells. TensorFlow's own reader would deliver the 3 and say nothing.
    ids = write_shards(id_cache, [4, 4, 4])
    bad = id_cache.list_shards()[1].path
    os.truncate(bad, 3 * FRAME)
    with pytest.raises(CorruptShardError, match="its name says") as info:
        _read(make_tf_dataset(id_cache, 2, seed=0, reader=reader, verify=verify))
    assert info.value.path == bad
    del info
    ds = make_tf_dataset(id_cache, 2, seed=0, reader=reader, verify=verify, on_corrupt="skip")
    got = _read(ds)
    assert set(ids[:4] + ids[8:]) <= set(got) <= set(ids[:7] + ids[8:]) and len(got) == len(set(got))
    assert [e.path for e in ds.skipped] == [bad]


@pytest.mark.parametrize("reader", ["growcache", "tensorflow"])
def test_an_epoch_that_raised_ends_its_lease_once_the_error_is_handled_without_garbage_collection(id_cache, reader):
    # `except CorruptShardError` around the loop, then `growcache verify --remove-corrupt` and a
    # new epoch: the failed epoch must not keep its shards leased until a garbage collection.
    # The error raised out of the iterator's frame was held by that frame (a cycle through its
    # traceback), which kept the iterator, and so the epoch, alive.
    _damaged_cache(id_cache, "payload CRC")
    gc.disable()
    try:
        try:
            _read(make_tf_dataset(id_cache, 2, seed=0, reader=reader))
        except CorruptShardError:
            pass
        deadline = time.monotonic() + 10  # a pipeline thread may hold the C++ iterator a moment
        while id_cache.stats().leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert id_cache.stats().leases == 0, "the failed epoch's lease outlived its iterator and its error"
    finally:
        gc.enable()
