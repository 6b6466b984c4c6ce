"""The ``tf.train.Example`` wire format, encoded and decoded without TensorFlow or protobuf.

``tensorflow`` and the ``tfrecord`` package both register ``tensorflow.BytesList`` in
protobuf's default descriptor pool and cannot share a process, so the core carries this
small codec instead of importing either. Only the subset growcache needs is handled:
``Example{features{feature{key: bytes_list{value: <raw array>}}}}``.

Because every feature has a fixed dtype and shape, every record a schema encodes has the
same layout: the same protobuf prefix bytes before each payload, at the same offsets.
:class:`ExampleCodec` precomputes that layout once, so encoding is a list of buffers with
no copy of the payload, and decoding a growcache record is a prefix check plus slicing.
Records written by other tools (TensorFlow's own writer orders map entries its own way)
take the general parsing path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import SchemaError
from .schema import Schema

__all__ = ["ExampleCodec"]

_LEN = 2  # protobuf wire type of length-delimited fields
_TAG_1 = bytes([1 << 3 | _LEN])  # field 1, length-delimited
_TAG_2 = bytes([2 << 3 | _LEN])  # field 2, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or oversized varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _iter_fields(buf: memoryview, pos: int, end: int):
    """Yield ``(field_number, start, stop)`` of each length-delimited field; skip scalar ones."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if pos + length > end:
                raise ValueError("field runs past the end of the record")
            yield field, pos, pos + length
            pos += length
        elif wire == 0:
            _, pos = _read_varint(buf, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    if pos != end:
        raise ValueError("field runs past the end of the record")


class ExampleCodec:
    """Encodes samples of a :class:`Schema` as serialized ``tf.train.Example`` and back.

    Args:
        schema: the schema every record follows.

    Attributes:
        layout: ``(name, payload_offset, payload_nbytes)`` per feature, in schema order,
            for records this codec writes.
        prefixes: per feature, in schema order, the constant bytes that come before its
            payload in every record this codec writes.
        record_nbytes: serialized size of every record this codec writes.
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.prefixes: list[bytes] = []
        self.layout: list[tuple[str, int, int]] = []
        features_body_len = 0
        entries = []
        for name, spec in schema.items():
            key = name.encode("utf-8")
            n = spec.nbytes
            bytes_list_len = 1 + len(_varint(n)) + n
            feature_len = 1 + len(_varint(bytes_list_len)) + bytes_list_len
            entry_head = (
                _TAG_1 + _varint(len(key)) + key + _TAG_2 + _varint(feature_len)
                + _TAG_1 + _varint(bytes_list_len) + _TAG_1 + _varint(n)
            )
            entry_len = len(entry_head) + n
            item_head = _TAG_1 + _varint(entry_len)
            entries.append((name, item_head + entry_head, n))
            features_body_len += len(item_head) + entry_len
        example_head = _TAG_1 + _varint(features_body_len)
        offset = 0
        for index, (name, head, n) in enumerate(entries):
            prefix = (example_head if index == 0 else b"") + head
            offset += len(prefix)
            self.prefixes.append(prefix)
            self.layout.append((name, offset, n))
            offset += n
        self.record_nbytes = offset

    def encode_pieces(self, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        """Return the serialized record as a list of buffers (prefixes and raw payloads).

        ``arrays`` must come from :meth:`Schema.validate` (C-contiguous, little-endian).
        The payloads are not copied: write the pieces out before changing the arrays.
        """
        pieces: list[Any] = []
        for prefix, (name, _, _) in zip(self.prefixes, self.layout):
            pieces.append(prefix)
            pieces.append(memoryview(arrays[name]).cast("B"))
        return pieces

    def encode(self, sample: Mapping[str, Any]) -> bytes:
        """Validate ``sample`` and return it as one serialized ``tf.train.Example``."""
        return b"".join(self.encode_pieces(self.schema.validate(sample)))

    def has_layout(self, record: Any) -> bool:
        """True when ``record`` has exactly the fixed layout this codec writes."""
        view = memoryview(record)
        if len(view) != self.record_nbytes:
            return False
        for prefix, (_, offset, _) in zip(self.prefixes, self.layout):
            if view[offset - len(prefix):offset] != prefix:
                return False
        return True

    def payload_views(self, record: Any) -> dict[str, memoryview]:
        """Return each feature's raw payload inside ``record`` (zero-copy).

        Raises:
            ValueError: the record is not a well-formed Example.
            SchemaError: a feature is missing, extra, not a single bytes value, or has the
                wrong byte count for the schema.
        """
        view = memoryview(record).cast("B")
        if self.has_layout(view):
            return {name: view[offset:offset + n] for name, offset, n in self.layout}
        return self._parse_general(view)

    def decode(self, record: Any, *, copy: bool = True) -> dict[str, np.ndarray]:
        """Return the sample in ``record`` as arrays of the schema's dtypes and shapes.

        Args:
            record: one serialized Example (bytes, bytearray or memoryview).
            copy: copy the arrays out of ``record``. Pass ``False`` only when ``record``
                outlives the arrays. Default: ``True``.
        """
        out = {}
        for name, payload in self.payload_views(record).items():
            spec = self.schema[name]
            array = np.frombuffer(payload, dtype=spec.dtype).reshape(spec.shape)
            out[name] = array.copy() if copy else array
        return out

    def _parse_general(self, view: memoryview) -> dict[str, memoryview]:
        payloads: dict[str, memoryview] = {}
        for field, start, stop in _iter_fields(view, 0, len(view)):
            if field != 1:
                continue
            for entry_field, es, ee in _iter_fields(view, start, stop):
                if entry_field != 1:
                    continue
                key = value = None
                for f, s, e in _iter_fields(view, es, ee):
                    if f == 1:
                        key = bytes(view[s:e]).decode("utf-8", "replace")
                    elif f == 2:
                        value = (s, e)
                if key is None:
                    raise ValueError("feature map entry without a key")
                payloads[key] = self._bytes_value(view, key, value)
        expected = list(self.schema)
        if sorted(payloads) != sorted(expected):
            raise SchemaError(
                f"record features {sorted(payloads)} do not match the schema's {expected}. "
                "Open the cache with the schema the shards were written with."
            )
        for name, payload in payloads.items():
            spec = self.schema[name]
            if len(payload) != spec.nbytes:
                raise SchemaError(
                    f"feature {name!r}: expected {spec.nbytes} bytes for dtype {spec.dtype.name} "
                    f"shape {spec.shape}, the record holds {len(payload)} bytes"
                )
        return payloads

    @staticmethod
    def _bytes_value(view: memoryview, key: str, span: tuple[int, int] | None) -> memoryview:
        values = []
        kinds = []
        if span is not None:
            for kind, ks, ke in _iter_fields(view, *span):
                kinds.append(kind)
                if kind == 1:
                    values.extend(view[s:e] for f, s, e in _iter_fields(view, ks, ke) if f == 1)
        if kinds != [1] or len(values) != 1:
            kind_names = {1: "bytes_list", 2: "float_list", 3: "int64_list"}
            found = ", ".join(kind_names.get(k, f"field {k}") for k in kinds) or "nothing"
            raise SchemaError(
                f"feature {key!r}: growcache stores each array as one raw bytes value "
                f"(bytes_list with 1 value), found {found} with {len(values)} bytes values. "
                "Write it with tf.train.BytesList(value=[array.tobytes()])."
            )
        return values[0]
