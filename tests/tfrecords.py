"""Test helpers: tf.train.Example records and TFRecord files built from the wire format.

They lay records out the way other writers do (map entries in any order, packed or
unpacked lists, typed tensor values, shortest varints as protobuf writes them), without
TensorFlow, so core tests can read "foreign" files; tests/tf/ checks the same reading
against files TensorFlow itself writes.
"""

from __future__ import annotations

import gzip
import zlib

import numpy as np

from growcache._protowire import encode_varints, varint
from growcache.records import frame_pieces
from growcache.tensor_proto import tf_dtype_enum


def _ld(field: int, body: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(body)) + body


def bytes_feature(*values: bytes) -> bytes:
    return _ld(1, b"".join(_ld(1, v) for v in values))


def float_feature(values, packed: bool = True) -> bytes:
    data = np.asarray(values, "<f4").reshape(-1)
    if packed:
        return _ld(2, _ld(1, data.tobytes()))
    return _ld(2, b"".join(b"\x0d" + v.tobytes() for v in data))  # field 1, fixed32


def int64_feature(values, packed: bool = True) -> bytes:
    data = np.asarray(values, np.int64).reshape(-1)
    if packed:
        return _ld(3, _ld(1, encode_varints(data)))
    return _ld(3, b"".join(b"\x08" + varint(int(v) & (2**64 - 1)) for v in data))


def example(entries: list[tuple[str, bytes]]) -> bytes:
    """A serialized Example with these ``(key, feature)`` map entries, in this order."""
    body = b"".join(_ld(1, _ld(1, key.encode()) + _ld(2, feature)) for key, feature in entries)
    return _ld(1, body)


def tensor_proto(array: np.ndarray, typed_field: int | None = None) -> bytes:
    """A TensorProto as serialize_tensor writes it, or with float values in a typed field (make_tensor_proto)."""
    array = np.asarray(array)
    dims = b"".join(_ld(2, b"\x08" + varint(d) if d else b"") for d in array.shape)
    head = b"\x08" + varint(tf_dtype_enum(array.dtype)) + _ld(2, dims)
    if typed_field is None:
        return head + (_ld(4, array.astype(array.dtype.newbyteorder("<")).tobytes()) if array.size else b"")
    return head + _ld(typed_field, np.asarray(array, "<f4").reshape(-1).tobytes())


def framed(records: list[bytes]) -> bytes:
    """The records as one TFRecord file's bytes."""
    return b"".join(bytes(p) for record in records for p in frame_pieces([record])[0])


def compress(data: bytes, compression: str | None) -> bytes:
    """``data`` as TFRecordWriter writes it with ``compression_type`` ``None``, ``"GZIP"`` or ``"ZLIB"``."""
    if compression == "GZIP":
        return gzip.compress(data)
    if compression == "ZLIB":
        return zlib.compress(data)
    return data


def labelled(shard: int, index: int, width: int = 64) -> bytes:
    """Record ``index`` of remote shard ``shard``: an int64_list label and raw bytes derived from both,
    written the way TensorFlow does (label first, shortest varint)."""
    label = shard * 1000 + index
    x = np.random.default_rng(label).integers(0, 256, width, dtype=np.uint8)
    return example([("label", int64_feature([label])), ("x", bytes_feature(x.tobytes()))])
