"""Schema encodings in the core codec: int64_list, float_list, raw bytes and serialized tensors.

Records here are built by hand from the protobuf wire format (the way other writers lay
them out: entries in any order, packed or unpacked lists, typed tensor values), so the
core's reading is checked without TensorFlow; tests/tf/test_interop.py checks it against
TensorFlow itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from tfrecords import bytes_feature, example, float_feature, int64_feature, tensor_proto

from growcache import Schema, SchemaError
from growcache._protowire import decode_varint_rows, encode_varints
from growcache.example import BatchDecoder, ExampleCodec, scan_example, tf_parse_plan

INTS = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"]


# -- schema ---------------------------------------------------------------------------------
def test_schema_encodings_roundtrip_through_repr_and_json():
    schema = Schema({"x": ("float32", (2, 3)), "label": ("int64", (), "int64_list"), "f": ("float32", 4, "float_list"),
                     "t": ("float16", (2,), "tensor")})
    assert schema["label"].encoding == "int64_list" and schema["x"].encoding == "bytes"
    assert schema["f"].shape == (4,)
    assert Schema.from_dict(schema.to_dict()) == schema
    assert eval(repr(schema), {"Schema": Schema}) == schema  # noqa: S307 - repr is the documented input form
    assert schema.to_dict()["x"] == ["float32", [2, 3]]  # default encoding: the stored form of older caches
    assert schema != Schema({"x": ("float32", (2, 3)), "label": ("int64", ()), "f": ("float32", 4, "float_list"),
                             "t": ("float16", (2,), "tensor")})
    assert Schema.from_dict({"a": ["int64", []]}) == Schema({"a": ("int64", ())})


@pytest.mark.parametrize("features, fragment", [
    ({"x": ("float32", (), "int64_list")}, "int64_list holds integers"),
    ({"x": ("float64", (2,), "float_list")}, "float_list holds float32"),
    ({"x": ("int64", (), "varlen")}, "encoding 'varlen' is unknown"),
    ({"x": ("int64", (), "int64_list", "more")}, "(dtype, shape, encoding)"),
])
def test_schema_refuses_encodings_that_cannot_hold_the_dtype(features, fragment):
    with pytest.raises(SchemaError) as info:
        Schema(features)
    assert fragment in str(info.value)


# -- codec ----------------------------------------------------------------------------------
def _random(dtype: str, shape: tuple[int, ...], rng: np.random.Generator, encoding: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        high = min(int(info.max), 2**63 - 1) if encoding == "int64_list" else int(info.max)
        return rng.integers(int(info.min), high, shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


CASES = [(d, "int64_list") for d in INTS] + [("float32", "float_list")] + [
    (d, e) for d in ["uint8", "int32", "uint64", "float16", "float64", "complex64", "bool"] for e in ("bytes", "tensor")]


@pytest.mark.parametrize("dtype, encoding", CASES)
@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (0, 2)])
def test_every_encoding_roundtrips_through_decode_and_batches(dtype, encoding, shape):
    schema = Schema({"v": (dtype, shape, encoding), "x": ("uint8", (5,))})
    codec = ExampleCodec(schema)
    rng = np.random.default_rng(hash((dtype, encoding, shape)) & 0xFFFF)
    samples = [{"v": _random(dtype, shape, rng, encoding), "x": rng.integers(0, 255, 5, dtype=np.uint8)}
               for _ in range(12)]
    records = [codec.encode(s) for s in samples]
    for sample, record in zip(samples, records):
        out = codec.decode(record)
        assert out["v"].dtype == np.dtype(dtype) and out["v"].shape == shape
        assert np.array_equal(out["v"], sample["v"]) and np.array_equal(out["x"], sample["x"])
    decoder = BatchDecoder(codec)
    arrays = {n: np.full((12, *s.shape), 7, s.dtype) for n, s in schema.items()}
    rows = decoder.rows(arrays)
    for row, record in enumerate(records):
        decoder.put(record, rows, row)
    decoder.finish(arrays, rows, 12)
    assert np.array_equal(arrays["v"], np.stack([s["v"] for s in samples]))
    assert np.array_equal(arrays["x"], np.stack([s["x"] for s in samples]))


def test_int64_list_extremes_and_uint64_refused_past_int64():
    schema = Schema({"a": ("int64", (4,), "int64_list")})
    codec = ExampleCodec(schema)
    values = np.array([-(2**63), -1, 0, 2**63 - 1], np.int64)
    assert np.array_equal(codec.decode(codec.encode({"a": values}))["a"], values)
    big = ExampleCodec(Schema({"a": ("uint64", (), "int64_list")}))
    with pytest.raises(SchemaError, match="does not fit int64_list"):
        big.encode({"a": np.uint64(2**63)})


def test_map_entries_in_any_order_and_unpacked_lists_are_read():
    schema = Schema({"i": ("int32", (3,), "int64_list"), "f": ("float32", (2,), "float_list"), "b": ("int16", (2,))})
    codec = ExampleCodec(schema)
    i, f, b = np.array([5, -7, 300], np.int32), np.array([1.5, -2.0], np.float32), np.array([1, -2], np.int16)
    entries = [("f", float_feature(f)), ("b", bytes_feature(b.tobytes())), ("i", int64_feature(i))]
    unpacked = [("i", int64_feature(i, packed=False)), ("f", float_feature(f, packed=False)),
                ("b", bytes_feature(b.tobytes()))]
    records = [example(entries), example(entries[::-1]), example(unpacked), codec.encode({"i": i, "f": f, "b": b})]
    decoder = BatchDecoder(codec)
    arrays = {n: np.zeros((4, *s.shape), s.dtype) for n, s in schema.items()}
    rows = decoder.rows(arrays)
    for row, record in enumerate(records):
        out = codec.decode(record)
        assert np.array_equal(out["i"], i) and np.array_equal(out["f"], f) and np.array_equal(out["b"], b)
        decoder.put(record, rows, row)
    decoder.finish(arrays, rows, 4)
    assert all(np.array_equal(arrays["i"][r], i) and np.array_equal(arrays["f"][r], f) for r in range(4))
    with pytest.raises(SchemaError, match="unpacked"):
        codec.payload_spans(records[2])


def test_a_new_record_structure_is_learned_and_then_checked_byte_for_byte():
    schema = Schema({"a": ("uint8", (2,)), "b": ("uint8", (2,))})
    codec = ExampleCodec(schema)
    reordered = example([("b", bytes_feature(b"\x03\x04")), ("a", bytes_feature(b"\x01\x02"))])
    assert not codec.has_layout(reordered)
    assert codec.decode(reordered)["a"].tolist() == [1, 2]
    learned = codec._layout_count
    # Same length, same structure, other payloads: no new layout.
    assert codec.decode(example([("b", bytes_feature(b"\x09\x09")), ("a", bytes_feature(b"\x08\x08"))]))["a"].tolist() \
        == [8, 8]
    assert codec._layout_count == learned
    # Same length, other keys: structure bytes differ, so it is parsed (and refused), not sliced.
    with pytest.raises(SchemaError, match="unexpected"):
        codec.decode(example([("c", bytes_feature(b"\x03\x04")), ("a", bytes_feature(b"\x01\x02"))]))


def test_serialized_tensors_with_typed_values_and_empty_content():
    schema = Schema({"t": ("float32", (2, 2), "tensor"), "s": ("float32", (), "tensor"), "z": ("int32", (0, 3), "tensor")})
    codec = ExampleCodec(schema)
    t = np.arange(4, dtype=np.float32).reshape(2, 2)
    record = example([("t", bytes_feature(tensor_proto(t, typed_field=5))),
                      ("s", bytes_feature(tensor_proto(np.array([2.5], np.float32).reshape(()), typed_field=5))),
                      ("z", bytes_feature(tensor_proto(np.zeros((0, 3), np.int32))))])
    out = codec.decode(record)
    assert np.array_equal(out["t"], t) and out["s"] == np.float32(2.5) and out["z"].shape == (0, 3)
    # One typed value fills the whole shape, as TensorFlow reads it.
    filled = example([("t", bytes_feature(tensor_proto(np.array([7.0], np.float32), typed_field=5))),
                      ("s", bytes_feature(tensor_proto(np.float32(1.0).reshape(())))),
                      ("z", bytes_feature(tensor_proto(np.zeros((0, 3), np.int32))))])
    with pytest.raises(SchemaError, match=r"shape \(1,\)"):
        codec.decode(filled)  # its shape says (1,), the schema (2, 2)


@pytest.mark.parametrize("feature, fragments", [
    (int64_feature([1, 2]), ["'v'", "float32 shape (3,)", "bytes_list with 1 value", "int64_list with 2 values",
                             "('int64', (2,), 'int64_list')"]),
    (float_feature([1.0, 2.0, 3.0]), ["float_list with 3 values", "('float32', (3,), 'float_list')"]),
    (bytes_feature(tensor_proto(np.zeros(3, np.float32))), ["expected 12 bytes", "holds 22 bytes",
                                                                   "serialize_tensor output of dtype float32 shape (3,)",
                                                                   "('float32', (3,), 'tensor')"]),
    (bytes_feature(b"a", b"b"), ["bytes_list with 2 values", "VarLenFeature"]),
])
def test_mismatch_names_feature_expected_found_and_fix(feature, fragments):
    codec = ExampleCodec(Schema({"v": ("float32", (3,))}))
    with pytest.raises(SchemaError) as info:
        codec.decode(example([("v", feature)]))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_tensor_of_another_dtype_or_shape_is_refused_with_the_schema_that_fits():
    codec = ExampleCodec(Schema({"t": ("float32", (3,), "tensor")}))
    with pytest.raises(SchemaError) as info:
        codec.decode(example([("t", bytes_feature(tensor_proto(np.zeros((2, 2), np.int16))))]))
    assert "found dtype int16 shape (2, 2)" in str(info.value) and "('int16', (2, 2), 'tensor')" in str(info.value)


def test_int64_values_out_of_the_dtype_range_are_refused_on_read():
    codec = ExampleCodec(Schema({"label": ("uint8", (), "int64_list")}))
    bad = example([("label", int64_feature([300]))])
    with pytest.raises(SchemaError, match=r"value 300 is out of range for dtype uint8"):
        codec.decode(bad)
    decoder = BatchDecoder(codec)
    arrays = {"label": np.zeros(2, np.uint8)}
    rows = decoder.rows(arrays)
    decoder.put(example([("label", int64_feature([3]))]), rows, 0)
    decoder.put(bad, rows, 1)
    with pytest.raises(SchemaError, match="out of range"):
        decoder.finish(arrays, rows, 2)
    negative = ExampleCodec(Schema({"flag": ("bool", (), "int64_list")}))
    with pytest.raises(SchemaError, match="-1 is out of range for dtype bool"):
        negative.decode(example([("flag", int64_feature([-1]))]))


def test_batch_rows_move_between_batches_with_their_lengths():
    codec = ExampleCodec(Schema({"label": ("int64", (), "int64_list")}))
    decoder = BatchDecoder(codec)
    first, second = {"label": np.zeros(2, np.int64)}, {"label": np.zeros(2, np.int64)}
    rows_a, rows_b = decoder.rows(first), decoder.rows(second)
    decoder.put(codec.encode({"label": np.int64(5)}), rows_a, 0)
    decoder.put(codec.encode({"label": np.int64(-(10**15))}), rows_b, 1)
    for dst, src in zip(rows_a, rows_b):  # how a shuffle window compacts its last batch
        dst[1] = src[1]
    decoder.finish(first, rows_a, 2)
    assert first["label"].tolist() == [5, -(10**15)]


def test_varint_rows_decode_random_values_and_refuse_bad_payloads():
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.integers(-(2**63), 2**63 - 1, (40, 3), dtype=np.int64, endpoint=True),
                             rng.integers(0, 300, (40, 3))])
    payloads = [np.frombuffer(encode_varints(v), np.uint8) for v in values]
    rows = np.zeros((80, 30), np.uint8)
    lengths = np.array([p.size for p in payloads])
    for row, payload in enumerate(payloads):
        rows[row, :payload.size] = payload
    assert np.array_equal(decode_varint_rows(rows, lengths, 3), values)
    with pytest.raises(ValueError, match="row 0 holds 2 varint values"):
        decode_varint_rows(rows[:1], _two_values(payloads[0]), 3)
    rows[0, lengths[0] - 1] |= 0x80
    with pytest.raises(ValueError, match="unterminated"):
        decode_varint_rows(rows[:1], lengths[:1], 3)


def test_wide_varints_read_back_and_keep_one_length():
    values = np.array([0, 1, 127, 128, 2**62, -1, -(2**63)], np.int64)
    for chunk in (values[:3], values):  # the Python path for short lists and the numpy one
        wide = np.frombuffer(encode_varints(chunk, wide=True), np.uint8)
        assert wide.size == 10 * chunk.size
        assert np.array_equal(decode_varint_rows(wide[None], np.array([wide.size]), chunk.size)[0], chunk)
        short = np.frombuffer(encode_varints(chunk), np.uint8)
        assert np.array_equal(decode_varint_rows(short[None], np.array([short.size]), chunk.size)[0], chunk)


def _two_values(payload: np.ndarray) -> np.ndarray:
    """The byte length of the first two varints of ``payload``."""
    ends = np.flatnonzero(payload < 0x80)
    return np.array([ends[1] + 1])


def test_scan_example_reports_kinds_and_counts():
    record = example([("a", int64_feature([1, 2, 3])), ("b", float_feature([1.0])), ("c", bytes_feature(b"xy")),
                      ("d", b"")])
    view = memoryview(record)
    found = scan_example(record)
    assert {k: (v.kind, v.count(view)) for k, v in found.items()} == {
        "a": ("int64_list", 3), "b": ("float_list", 1), "c": ("bytes_list", 1), "d": ("empty", 0)}


def test_tf_parse_plan_names_the_native_parse_of_each_encoding():
    plan = tf_parse_plan(Schema({"x": ("float32", (2,)), "label": ("uint8", (), "int64_list"),
                                 "i": ("int64", (3,), "int64_list"), "f": ("float32", (4,), "float_list"),
                                 "t": ("int16", (2, 2), "tensor")}))
    assert (plan["x"].parse_dtype, plan["x"].parse_shape, plan["x"].then) == ("string", (), "decode_raw")
    assert (plan["label"].parse_dtype, plan["label"].then, plan["label"].value_range) == ("int64", "cast", (0, 255))
    assert (plan["i"].parse_shape, plan["i"].then) == ((3,), "none")
    assert (plan["f"].parse_dtype, plan["f"].parse_shape, plan["f"].then) == ("float32", (4,), "none")
    assert (plan["t"].parse_dtype, plan["t"].then, plan["t"].dtype, plan["t"].shape) == \
        ("string", "parse_tensor", "int16", (2, 2))


def test_shard_writer_writes_int64_list_records_of_varying_length(tmp_path):
    from growcache import Cache
    from growcache.records import iter_records

    schema = Schema({"label": ("int64", (), "int64_list"), "x": ("float32", (2,))})
    cache = Cache(tmp_path / "c", capacity="1MB", schema=schema)
    labels = [0, 127, 128, -1, 2**40]
    with cache.writer() as writer:
        for label in labels:
            writer.write({"label": np.int64(label), "x": np.full(2, label, np.float32)})
    codec = ExampleCodec(schema)
    (shard,) = cache.list_shards()
    decoded = [codec.decode(record) for _, record in iter_records(shard.path)]
    assert [int(d["label"]) for d in decoded] == labels
    # int64_list values are written as 10-byte varints: every record of a schema has one layout.
    assert shard.nbytes == len(labels) * (16 + codec.record_nbytes)
    assert codec._layout_count == 1


def test_int64_staging_rows_filled_by_block_copy_decode_with_preset_lengths():
    """A reader that copies growcache's fixed layout by the block fills only the staging rows."""
    schema = Schema({"label": ("int16", (2,), "int64_list"), "x": ("uint8", (3,))})
    codec = ExampleCodec(schema)
    samples = [{"label": np.array([i, -i], np.int16), "x": np.full(3, i, np.uint8)} for i in range(5)]
    records = np.frombuffer(b"".join(codec.encode(s) for s in samples), np.uint8).reshape(5, codec.record_nbytes)
    decoder = BatchDecoder(codec)
    arrays = {n: np.zeros((5, *s.shape), s.dtype) for n, s in schema.items()}
    rows = decoder.rows(arrays)
    for dst, (_, offset, nbytes) in zip(rows, codec.layout):  # what growcache.vector_reader does
        dst[:, :nbytes] = records[:, offset:offset + nbytes]
    decoder.finish(arrays, rows, 5)
    assert arrays["label"].tolist() == [[i, -i] for i in range(5)]
