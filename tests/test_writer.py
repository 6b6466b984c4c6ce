"""ShardWriter: what it writes is exactly the samples as they were when write() was called."""

from __future__ import annotations

import os

import numpy as np
import pytest

import growcache.writer as writer_module
from growcache import Cache, Schema
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.shard import TMP_PREFIX


def _read_back(cache: Cache) -> list[dict[str, np.ndarray]]:
    codec = ExampleCodec(cache.schema)
    return [codec.decode(record) for shard in cache.list_shards() for _, record in iter_records(shard.path)]


# 64 bytes per record goes through the staging copy; 1 MiB goes straight from the arrays.
@pytest.mark.parametrize("floats", [16, 1 << 18], ids=["staged", "direct"])
def test_a_sample_array_refilled_in_place_is_written_as_it_was(tmp_path, floats):
    cache = Cache(tmp_path / "c", capacity=1 << 30, schema=Schema({"x": ("float32", (floats,)), "y": ("int64", ())}))
    reused = np.empty(floats, np.float32)
    with cache.writer() as writer:
        for value in range(12):
            reused[:] = value
            writer.write({"x": reused, "y": np.int64(value)})
    assert cache.verify().corrupt == []
    got = _read_back(cache)
    assert [int(s["y"]) for s in got] == list(range(12))
    assert all((s["x"] == s["y"]).all() for s in got)


def test_a_serialized_record_buffer_refilled_in_place_is_written_as_it_was(tmp_path):
    schema = Schema({"x": ("uint8", (100,))})
    cache = Cache(tmp_path / "c", capacity=1 << 30, schema=schema)
    codec = ExampleCodec(schema)
    buffer = bytearray(codec.record_nbytes)
    with cache.writer() as writer:
        for value in range(5):
            buffer[:] = codec.encode({"x": np.full(100, value, np.uint8)})
            writer.write_serialized(buffer)
    assert cache.verify().corrupt == []
    assert [int(s["x"][0]) for s in _read_back(cache)] == list(range(5))


def test_staged_and_direct_records_interleave_in_order(tmp_path, monkeypatch):
    # The size threshold decides the path per record; moving it between records makes them
    # alternate, so the staged bytes must go out before each direct record.
    schema = Schema({"x": ("uint8", (100,))})
    cache = Cache(tmp_path / "c", capacity=1 << 30, schema=schema)
    with cache.writer() as writer:
        for value in range(20):
            monkeypatch.setattr(writer_module, "_DIRECT_FRAME_BYTES", 0 if value % 3 == 0 else 1 << 20)
            writer.write({"x": np.full(100, value, np.uint8)})
    assert [int(s["x"][0]) for s in _read_back(cache)] == list(range(20))


def test_a_record_of_more_pieces_than_one_writev_takes(tmp_path):
    # 700 features are 1401 buffers in one direct write: more than IOV_MAX, so it goes out in parts.
    features = {f"f{i:03d}": ("float32", (256,)) for i in range(700)}
    cache = Cache(tmp_path / "c", capacity=1 << 30, schema=Schema(features))
    samples = [{name: np.full(256, i * 1000 + k, np.float32) for k, name in enumerate(features)} for i in range(3)]
    with cache.writer() as writer:
        for sample in samples:
            writer.write(sample)
    assert cache.verify().corrupt == []
    got = _read_back(cache)
    assert len(got) == 3
    for want, have in zip(samples, got):
        assert all(np.array_equal(want[name], have[name]) for name in features)


def test_big_endian_and_strided_arrays_are_written_little_endian(tmp_path):
    cache = Cache(tmp_path / "c", capacity=1 << 30, schema=Schema({"x": ("int32", (4,))}))
    with cache.writer() as writer:
        writer.write({"x": np.arange(4, dtype=">i4")})
        writer.write({"x": np.arange(8, dtype=np.int32)[::2]})
    got = [s["x"].tolist() for s in _read_back(cache)]
    assert got == [[0, 1, 2, 3], [0, 2, 4, 6]]


@pytest.mark.parametrize("rows", [1, 1 << 17], ids=["staged", "direct"])
def test_a_feature_with_a_zero_dimension_is_written_and_read_back(tmp_path, rows):
    schema = Schema({"empty": ("float32", (0, 3)), "x": ("float32", (rows,))})
    cache = Cache(tmp_path / "c", capacity=1 << 30, schema=schema)
    with cache.writer() as writer:
        writer.write({"empty": np.zeros((0, 3), np.float32), "x": np.full(rows, 2, np.float32)})
    (sample,) = _read_back(cache)
    assert sample["empty"].shape == (0, 3) and (sample["x"] == 2).all()


@pytest.mark.parametrize("floats", [16, 1 << 18], ids=["staged", "direct"])
def test_space_reserved_for_a_shard_is_given_back_when_it_is_published(tmp_path, floats):
    cache = Cache(tmp_path / "c", capacity=1 << 30, schema=Schema({"x": ("float32", (floats,))}))
    reserve = 64 << 20
    with cache.writer() as writer:
        writer.reserve(reserve)
        if not writer._reserved:
            pytest.skip(f"the file system of {tmp_path} cannot reserve space (fallocate): nothing to give back")
        for value in range(3):
            writer.write({"x": np.full(floats, value, np.float32)})
        assert os.stat(writer.path).st_size < reserve  # the reservation does not show as size
    (shard,) = cache.list_shards()
    assert os.stat(shard.path).st_size == shard.nbytes
    assert os.stat(shard.path).st_blocks * 512 < shard.nbytes + (1 << 20), "the reserved blocks stayed allocated"
    assert [int(s["x"][0]) for s in _read_back(cache)] == [0, 1, 2]
    assert cache.verify().corrupt == []


def test_a_close_that_reports_a_failed_write_publishes_nothing_and_closes_no_other_file(tmp_path, monkeypatch):
    # NFS reports a write the server failed at close(2), after releasing the descriptor. The raw
    # OSError escaped, the temporary stayed, and the writer kept the released number: its abort
    # then closed whatever file had been given that number since.
    cache = Cache(tmp_path / "c", capacity=1 << 30, schema=Schema({"x": ("uint8", (100,))}))
    writer = cache.writer()
    writer.write({"x": np.zeros(100, np.uint8)})
    real_close = os.close

    def close_reporting_eio(fd):
        real_close(fd)
        monkeypatch.setattr(writer_module.os, "close", real_close)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer_module.os, "close", close_reporting_eio)
    with pytest.raises(OSError, match="closing shard .* failed .*not published"):
        writer.close()
    other = os.open(tmp_path / "other", os.O_CREAT | os.O_WRONLY)  # likely the released number
    try:
        writer.abort()
        writer.close()
        os.fstat(other)  # still open
    finally:
        os.close(other)
    assert cache.list_shards() == []
    assert [n for n in os.listdir(cache.shards_dir) if n.startswith(TMP_PREFIX)] == [], "the temporary stayed"
