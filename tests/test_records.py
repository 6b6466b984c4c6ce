"""TFRecord framing and the Example codec: round trips, corruption, and fuzzing."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from growcache import CorruptShardError, Schema, SchemaError
from growcache.example import ExampleCodec
from growcache.records import frame_pieces, iter_records, masked_crc32c, unmask_crc32c

from conftest import ID_SCHEMA, id_sample, write_shards


def _write_frames(path, records):
    with open(path, "wb") as f:
        for record in records:
            buffers, _ = frame_pieces([record])
            for buffer in buffers:
                f.write(buffer)


def test_masked_crc_matches_tensorflow_reference_value():
    # TensorFlow's masked CRC32C of b"" (from its own test vectors: crc32c("") == 0).
    assert unmask_crc32c(masked_crc32c(b"abc")) == 0x364B3FB7
    assert masked_crc32c(b"") == 0xA282EAD8


def test_frames_round_trip_across_buffer_boundaries(tmp_path):
    records = [os.urandom(n) for n in (0, 1, 17, 5000, (8 << 20) + 3, 2, 1 << 20)]
    path = tmp_path / "r.tfrecord"
    _write_frames(path, records)
    out = [(offset, bytes(view)) for offset, view in iter_records(path)]
    assert [r for _, r in out] == records
    expected_offsets = np.cumsum([0] + [len(r) + 16 for r in records[:-1]]).tolist()
    assert [o for o, _ in out] == expected_offsets


def test_codec_round_trip_and_fixed_layout():
    codec = ExampleCodec(ID_SCHEMA)
    record = codec.encode(id_sample(7))
    assert len(record) == codec.record_nbytes and codec.has_layout(record)
    decoded = codec.decode(record)
    assert decoded["id"] == 7 and np.array_equal(decoded["x"], id_sample(7)["x"])


def test_codec_general_path_reads_other_field_orders():
    codec = ExampleCodec(Schema({"a": ("uint8", (3,)), "b": ("int16", (2,))}))
    # Hand-built Example with the map entries in reverse order, as other writers may emit.
    def entry(key: bytes, payload: bytes) -> bytes:
        bl = b"\x0a" + bytes([len(payload)]) + payload
        feature = b"\x0a" + bytes([len(bl)]) + bl
        body = b"\x0a" + bytes([len(key)]) + key + b"\x12" + bytes([len(feature)]) + feature
        return b"\x0a" + bytes([len(body)]) + body
    features = entry(b"b", np.array([1, -2], "<i2").tobytes()) + entry(b"a", b"\x01\x02\x03")
    record = b"\x0a" + bytes([len(features)]) + features
    assert not codec.has_layout(record)
    out = codec.decode(record)
    assert out["a"].tolist() == [1, 2, 3] and out["b"].tolist() == [1, -2]
    with pytest.raises(SchemaError, match="do not match"):
        ExampleCodec(Schema({"a": ("uint8", (3,))})).decode(record)
    with pytest.raises(SchemaError, match="expected 6 bytes.*holds 4 bytes"):
        ExampleCodec(Schema({"a": ("uint8", (3,)), "b": ("int16", (3,))})).decode(record)


@pytest.mark.parametrize("where", ["header", "length_crc", "payload", "footer"])
def test_flipped_byte_names_file_and_offset(id_cache, where):
    write_shards(id_cache, [5])
    shard = id_cache.list_shards()[0]
    frame = id_cache.list_shards()[0].nbytes // 5
    position = 2 * frame + {"header": 0, "length_crc": 9, "payload": 40, "footer": frame - 1}[where]
    with open(shard.path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptShardError) as info:
        list(iter_records(shard.path))
    assert info.value.path == shard.path
    assert info.value.offset == 2 * frame
    assert shard.path in str(info.value) and f"offset {2 * frame}" in str(info.value)


def test_truncated_shard_names_offset(id_cache):
    write_shards(id_cache, [4])
    shard = id_cache.list_shards()[0]
    frame = shard.nbytes // 4
    os.truncate(shard.path, 3 * frame + 20)
    with pytest.raises(CorruptShardError, match="truncated") as info:
        list(iter_records(shard.path))
    assert info.value.offset == 3 * frame


def test_unverified_read_still_catches_misframing(id_cache):
    write_shards(id_cache, [3])
    shard = id_cache.list_shards()[0]
    with open(shard.path, "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(CorruptShardError, match="length CRC32C"):
        list(iter_records(shard.path, verify=False))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_reader_returns_correct_records_or_raises(tmp_path, data):
    codec = ExampleCodec(ID_SCHEMA)
    records = [codec.encode(id_sample(i)) for i in range(6)]
    blob = bytearray()
    for record in records:
        buffers, _ = frame_pieces([record])
        blob += b"".join(bytes(b) for b in buffers)
    mutation = data.draw(st.sampled_from(["flip", "truncate", "both"]))
    if mutation in ("flip", "both"):
        for _ in range(data.draw(st.integers(1, 3))):
            index = data.draw(st.integers(0, len(blob) - 1))
            blob[index] ^= 1 << data.draw(st.integers(0, 7))
    if mutation in ("truncate", "both"):
        del blob[data.draw(st.integers(0, len(blob))):]
    path = tmp_path / "fuzz.tfrecord"
    path.write_bytes(blob)
    got = []
    try:
        for _, view in iter_records(path):
            got.append(bytes(view))
    except CorruptShardError:
        pass
    # Whatever came out before an error must be exactly the original records, in order.
    assert got == records[: len(got)]
