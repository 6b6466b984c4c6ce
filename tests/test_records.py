"""TFRecord framing and the Example codec: round trips, corruption, and fuzzing."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from growcache import CorruptShardError, Schema, SchemaError
from growcache.example import ExampleCodec
from growcache.records import (
    check_records,
    count_checked,
    crc32c,
    frame_header,
    frame_pieces,
    iter_records,
    masked_crc32c,
    unmask_crc32c,
)
from growcache.shard import ShardInfo

from conftest import ID_SCHEMA, id_sample, write_shards


def _write_frames(path, records):
    with open(path, "wb") as f:
        for record in records:
            buffers, _ = frame_pieces([record])
            for buffer in buffers:
                f.write(buffer)


# Independent references. CRC32C's standard check value (RFC 3720 B.4; every CRC catalogue):
# crc32c(b"123456789") == 0xE3069283. The masked values were computed by TensorFlow 2.21
# (tf.io.TFRecordWriter; the 4 bytes after each record's data, and the 4 after its length),
# so a wrong mask rotation or delta fails here even where the TF tests cannot run.
TF_MASKED_DATA_CRC = {
    b"": 0xA282EAD8,
    b"a": 0x28E46E78,
    b"123456789": 0xC78AB0E5,
    b"growcache": 0x95ACA9BF,
    bytes(range(256)): 0xD31A2360,
}
TF_MASKED_LENGTH_CRC = {0: 0x07980329, 1: 0x41DE7501, 9: 0x3971F937, 256: 0xDF08B32F}


def test_crc32c_check_value_and_masked_crcs_match_tensorflow():
    assert crc32c(b"123456789") == 0xE3069283
    for data, masked in TF_MASKED_DATA_CRC.items():
        assert masked_crc32c(data) == masked, data[:12]
        assert unmask_crc32c(masked) == crc32c(data)
        buffers, _ = frame_pieces([data])
        assert bytes(buffers[-1]) == masked.to_bytes(4, "little")
    for length, masked in TF_MASKED_LENGTH_CRC.items():
        assert frame_header(length)[8:] == masked.to_bytes(4, "little")


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
def test_fuzz_every_changed_shard_raises_and_yields_only_intact_records(tmp_path, data):
    codec = ExampleCodec(ID_SCHEMA)
    records = [codec.encode(id_sample(i)) for i in range(6)]
    original = bytearray()
    for record in records:
        buffers, _ = frame_pieces([record])
        original += b"".join(bytes(b) for b in buffers)
    blob = bytearray(original)
    mutation = data.draw(st.sampled_from(["flip", "truncate", "both", "append"]))
    if mutation in ("flip", "both"):
        for _ in range(data.draw(st.integers(1, 3))):
            index = data.draw(st.integers(0, len(blob) - 1))
            blob[index] ^= 1 << data.draw(st.integers(0, 7))
    if mutation in ("truncate", "both"):
        del blob[data.draw(st.integers(0, len(blob))):]
    if mutation == "append":  # a whole well-framed record too many, or stray bytes
        blob += data.draw(st.sampled_from([original[: len(original) // 6], b"\0", bytes(20)]))
    # Named as the shard it was: its name states 6 records and the original size.
    path = tmp_path / ShardInfo.file_name(1, len(records), len(original))
    path.write_bytes(blob)
    for read in (lambda: [bytes(v) for _, v in iter_records(path)], lambda: check_records(path)):
        got = []
        try:
            got = read()
        except CorruptShardError as exc:
            assert exc.path == str(path)
            raised = True
        else:
            raised = False
        # Any change of the bytes is an error (a cut at a record boundary included); an
        # unchanged file (two flips of one bit) reads whole.
        assert raised == (blob != original), (mutation, len(blob), len(original))
        if isinstance(got, list):
            assert got == records[: len(got)]
    # Whatever came out before an error is exactly the original records, in order.
    got = []
    try:
        for _, view in iter_records(path):
            got.append(bytes(view))
    except CorruptShardError:
        pass
    assert got == records[: len(got)]


@pytest.mark.parametrize("change", ["cut at a record boundary", "one record appended"])
def test_a_shard_whose_record_count_differs_from_its_name_is_corrupt(id_cache, change):
    write_shards(id_cache, [8])
    shard = id_cache.list_shards()[0]
    frame = shard.nbytes // 8
    if change == "cut at a record boundary":
        os.truncate(shard.path, 7 * frame)  # 7 whole, well-framed records: framing alone sees nothing wrong
        fragment, offset = "holds 7 records, its name says 8", 7 * frame
    else:
        with open(shard.path, "ab") as f:
            f.write(open(shard.path, "rb").read(frame))
        fragment, offset = "more records than the 8", 8 * frame
    unnamed = os.path.join(os.path.dirname(id_cache.path), "unnamed.tfrecord")  # framing without a count check
    with open(unnamed, "wb") as f:
        f.write(open(shard.path, "rb").read())
    assert len(list(iter_records(unnamed))) == (7 if change == "cut at a record boundary" else 9)
    for read in (lambda: list(iter_records(shard.path)), lambda: check_records(shard.path),
                 lambda: list(count_checked(shard.path, iter_records(unnamed)))):
        with pytest.raises(CorruptShardError, match=fragment) as info:
            read()
        assert info.value.path == shard.path
    with pytest.raises(CorruptShardError) as info:
        list(iter_records(shard.path))
    assert info.value.offset == offset
    report = id_cache.verify()
    assert [c.path for c in report.corrupt] == [shard.path] and fragment in report.corrupt[0].reason


def test_count_checked_catches_another_readers_short_shard(id_cache):
    # A reader with its own framing (the tfrecord package's) gets the same count check.
    write_shards(id_cache, [4])
    shard = id_cache.list_shards()[0]
    frames = [(i, b"") for i in range(3)]
    with pytest.raises(CorruptShardError, match="holds 3 records, its name says 4"):
        list(count_checked(shard.path, frames))
    assert len(list(count_checked(shard.path, [(i, b"") for i in range(4)]))) == 4
    assert len(list(count_checked("/elsewhere/any.tfrecord", frames))) == 3  # not a shard name: no count


def test_a_length_past_the_files_end_is_refused_before_any_allocation(tmp_path):
    # 112 bytes whose first length field has a valid CRC and claims 2**40 bytes.
    path = tmp_path / ShardInfo.file_name(1, 1, 112)
    path.write_bytes(frame_header(2**40) + bytes(100))
    for read in (lambda: list(iter_records(path)), lambda: check_records(path)):
        with pytest.raises(CorruptShardError, match="truncated record: needs 1099511627792 bytes") as info:
            read()
        assert info.value.offset == 0 and info.value.path == str(path)
    with pytest.raises(CorruptShardError, match="more than the 100 bytes"):
        _write_frames(tmp_path / "big.tfrecord", [bytes(101)])
        list(iter_records(tmp_path / "big.tfrecord", max_record_bytes=100))
