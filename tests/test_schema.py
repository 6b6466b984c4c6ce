from __future__ import annotations

import numpy as np
import pytest

from growcache import Schema, SchemaError, format_size, parse_size


def test_schema_sorted_and_roundtrips_through_json_form():
    schema = Schema({"x": ("float32", (2, 3)), "label": ("int64", ())})
    assert list(schema) == ["label", "x"]
    assert schema["x"].nbytes == 24
    assert schema.record_payload_bytes == 32
    assert Schema.from_dict(schema.to_dict()) == schema
    assert schema["x"].dtype == np.dtype("<f4")


@pytest.mark.parametrize(
    "features, fragment",
    [
        ({}, "at least one feature"),
        ({"x": "float32"}, "expected (dtype, shape)"),
        ({"x": ("object", ())}, "not supported"),
        ({"x": ("float32", (-1,))}, "negative"),
        ({"": ("float32", ())}, "non-empty"),
    ],
)
def test_bad_schemas_say_what_is_wrong(features, fragment):
    with pytest.raises(SchemaError, match=None) as info:
        Schema(features)
    assert fragment in str(info.value)


def test_validate_names_feature_expected_and_actual():
    schema = Schema({"x": ("float32", (2, 3))})
    with pytest.raises(SchemaError) as info:
        schema.validate({"x": np.zeros((2, 3), np.float64)})
    message = str(info.value)
    assert "'x'" in message and "float32" in message and "float64" in message and "(2, 3)" in message
    with pytest.raises(SchemaError, match=r"shape \(3, 2\)"):
        schema.validate({"x": np.zeros((3, 2), np.float32)})
    with pytest.raises(SchemaError, match="missing"):
        schema.validate({})
    with pytest.raises(SchemaError, match="unexpected"):
        schema.validate({"x": np.zeros((2, 3), np.float32), "y": 1})


def test_validate_converts_big_endian_and_noncontiguous_input():
    schema = Schema({"x": ("int32", (2, 2))})
    big = np.arange(4, dtype=">i4").reshape(2, 2)
    out = schema.validate({"x": big})["x"]
    assert out.dtype == np.dtype("<i4") and np.array_equal(out, big)
    strided = np.arange(8, dtype="<i4").reshape(2, 4)[:, ::2]
    out = schema.validate({"x": strided})["x"]
    assert out.flags.c_contiguous and np.array_equal(out, strided)


@pytest.mark.parametrize(
    "text, expected",
    [("500GB", 500 * 10**9), ("64MiB", 64 * 2**20), ("1.5 kb", 1500), (4096, 4096), ("10", 10),
     ("9007199254740993", 9007199254740993), ("9007199254740993kb", 9007199254740993000)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "ten", "5 parsecs", 0, -3, "-1GB", True, 1.5,
                                 "1" + "0" * 400 + ".5", "10000PB", 2**63])  # past what a cache can store
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="capacity"):
        parse_size(bad, name="capacity")


def test_format_size():
    assert format_size(1_500_000_000) == "1.5 GB"
    assert format_size(12) == "12 B"
