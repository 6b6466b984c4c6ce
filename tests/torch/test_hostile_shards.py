"""Random damage to random shards, read by make_torch_loader with on_corrupt="skip" (issue 17's
property test; the verify part is in test_bad_inputs.py, the TensorFlow part in tests/tf/).

Every epoch ends normally, every skipped shard is one that was damaged and is named by its file,
every delivered record is intact and delivered once, and every record of an undamaged shard is
delivered.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

from conftest import ID_SCHEMA, id_sample, write_shards  # noqa: E402
from growcache import Cache, CorruptShardError, make_torch_loader  # noqa: E402
from growcache.adapters.torch_loader import tfrecord_frames  # noqa: E402
from growcache.batching import ReaderShare  # noqa: E402
from growcache.vector_reader import VectorReader  # noqa: E402
from hostile import check_failing_examples_leave_nothing_behind, damaged_cache  # noqa: E402


def _check_epoch(cache: Cache, damaged: set[str], ids: dict[str, list[int]], reader: str, workers: int, *,
                 planted_failure: bool = False) -> None:
    loader = make_torch_loader(cache, 4, num_workers=workers, on_corrupt="skip", reader=reader,
                               multiprocessing_context="fork" if workers else None)
    batches = iter(loader)
    # A failing example must stop its workers here: hypothesis keeps each failure's traceback
    # (and with it this frame) while it shrinks, and one run reached ~330 live workers that way.
    try:
        delivered = collections.Counter()
        for batch in batches:
            if planted_failure:
                raise AssertionError("planted failure, with the loader's workers running")
            for record_id, x in zip(batch["id"].tolist(), batch["x"].numpy()):
                np.testing.assert_array_equal(x, id_sample(record_id)["x"])
                delivered[record_id] += 1
        if planted_failure:
            raise AssertionError("planted failure, after the epoch (persistent workers still up)")
        assert max(delivered.values(), default=1) == 1, "a record was delivered twice"
        skipped = {note.path for note in loader.skipped}
        assert skipped <= damaged, "only damaged shards are skipped"
        for note in loader.skipped:
            assert os.path.basename(note.path).endswith(".tfrecord") and note.reason
        for path, shard_ids in ids.items():
            if path not in damaged:
                assert all(delivered[i] == 1 for i in shard_ids), f"an intact shard lost records: {path}"
            elif path not in skipped:
                # Damage that framing cannot see is impossible: every changed shard is found.
                raise AssertionError(f"damaged shard {path} was read without an error")
        assert set(delivered) <= {i for shard_ids in ids.values() for i in shard_ids}
    finally:
        batches.close()
        loader.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), reader=st.sampled_from(["tfrecord", "growcache"]), workers=st.sampled_from([0, 2]))
def test_a_torch_epoch_over_random_damage_skips_only_damaged_shards_and_delivers_intact_records(
        tmp_path_factory, data, reader, workers):
    _check_epoch(*damaged_cache(str(tmp_path_factory.mktemp("c") / "cache"), data), reader, workers)


def test_a_failing_example_of_the_property_test_leaves_no_worker_behind(tmp_path_factory):
    check_failing_examples_leave_nothing_behind(
        tmp_path_factory, lambda cache: _check_epoch(cache, set(), {}, "growcache", 2, planted_failure=True))


def test_the_vectorized_reader_checks_the_count_with_any_framing(tmp_path):
    # A shard cut at a record boundary: the vectorized path hands it to the record-by-record
    # framing, which must still find it short (the tfrecord package's framing cannot know).
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [8, 8])
    shards = cache.list_shards()
    os.truncate(shards[0].path, 7 * (shards[0].nbytes // 8))
    share = ReaderShare(paths=np.array([s.path.encode() for s in shards]),
                        records=np.array([s.records for s in shards]), shards=np.arange(2), quota=-1)
    for frames in (tfrecord_frames, None):
        reader = VectorReader(ID_SCHEMA, 4, **({"frames": frames} if frames else {}))
        with pytest.raises(CorruptShardError, match="holds 7 records, its name says 8"):
            for _ in reader.batches(share, lambda rows: (object(), {
                    n: np.empty((4, *s.shape), s.dtype) for n, s in ID_SCHEMA.items()})):
                pass


@pytest.mark.parametrize("reader", ["tfrecord", "growcache"])
def test_a_shard_cut_at_a_record_boundary_is_corrupt_in_a_torch_epoch(tmp_path, reader):
    # Issue 18: 7 whole records in a shard whose name says 8 were delivered as a complete epoch.
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [8, 8])
    short = cache.list_shards()[0]
    os.truncate(short.path, 7 * (short.nbytes // 8))
    with pytest.raises(CorruptShardError, match="holds 7 records, its name says 8") as info:
        for _ in make_torch_loader(cache, 4, num_workers=0, reader=reader):
            pass
    assert info.value.path == short.path
    loader = make_torch_loader(cache, 4, num_workers=0, reader=reader, on_corrupt="skip")
    ids = sorted(i for batch in loader for i in batch["id"].tolist())
    assert ids[-8:] == list(range(8, 16)) and len(ids) <= 15
    assert [(s.path, s.records) for s in loader.skipped] == [(short.path, 8 - (len(ids) - 8))]


@pytest.mark.parametrize("reader", ["growcache", "tfrecord"])
def test_a_shard_deleted_under_its_epoch_is_a_corrupt_shard_that_skip_passes_over(tmp_path, reader):
    # The epoch's lease keeps eviction off its shards; one deleted by hand (or by another machine's
    # cleanup) raised a bare FileNotFoundError, with no fix, that on_corrupt="skip" did not skip.
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [6, 6, 6])
    loader = make_torch_loader(cache, 4, num_workers=0, reader=reader, shuffle_buffer=0)
    batches = iter(loader)  # the epoch's snapshot: read from the first next() on
    gone = loader.last_epoch.shards[1].path
    os.unlink(gone)
    with pytest.raises(CorruptShardError, match="deleted or replaced while this epoch's lease held it") as info:
        for _ in batches:
            pass
    assert (info.value.path, info.value.offset) == (gone, 0)
    loader.close()
    loader = make_torch_loader(cache, 4, num_workers=0, reader=reader, shuffle_buffer=0, on_corrupt="skip")
    batches = iter(loader)
    write_shards(cache, [6], first_id=100)  # not in this epoch
    os.unlink(loader.last_epoch.shards[0].path)
    ids = sorted(i for batch in batches for i in batch["id"].tolist())
    assert ids == list(range(12, 18)) and [s.records for s in loader.skipped] == [6]
    loader.close()


@pytest.mark.parametrize("reader", ["tfrecord", "growcache"])
@pytest.mark.parametrize("damage", [b"\x0f", b"\x0a\x7f"])  # wire type 7; a field running past its message
def test_a_malformed_example_under_a_valid_crc_is_a_corrupt_shard_named_at_its_record(tmp_path, reader, damage):
    # Both readers raised a bare ValueError, without file or offset, and on_corrupt="skip" did
    # not skip: only a frame's CRC was taken for damage.
    from growcache.records import crc32c, frame_footer, frame_header

    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [6, 6])
    bad = cache.list_shards()[0]
    frame = bad.nbytes // 6
    with open(bad.path, "r+b") as f:
        record = bytearray(f.read()[2 * frame + 12:3 * frame - 4])
        record[:len(damage)] = damage
        f.seek(2 * frame)
        f.write(frame_header(len(record)) + record + frame_footer(crc32c(bytes(record))))
    with pytest.raises(CorruptShardError, match="not a well-formed tf.train.Example") as info:
        for _ in make_torch_loader(cache, 4, num_workers=0, reader=reader, shuffle_buffer=0):
            pass
    assert (info.value.path, info.value.offset) == (bad.path, 2 * frame)
    loader = make_torch_loader(cache, 4, num_workers=2, reader=reader, shuffle_buffer=0, on_corrupt="skip",
                               multiprocessing_context="fork")
    ids = sorted(i for batch in loader for i in batch["id"].tolist())
    assert ids == [0, 1, *range(6, 12)]
    assert [(s.path, s.offset, s.records) for s in loader.skipped] == [(bad.path, 2 * frame, 4)]
    loader.close()
