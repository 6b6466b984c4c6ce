"""``tf.io.serialize_tensor`` output (a ``TensorProto``), written and read without TensorFlow.

``serialize_tensor`` writes ``dtype``, ``tensor_shape`` and the array's raw bytes as
``tensor_content``. For one dtype and shape everything before the content is the same
bytes in every record, so :func:`tensor_header` lets a fixed record layout treat it as a
prefix and the content as a plain payload. :func:`parse_tensor` reads any ``TensorProto``
of a numeric dtype, including the typed value fields (``float_val``, ``int64_val``, ...)
that ``tf.make_tensor_proto`` writes for small tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._protowire import FIXED32, FIXED64, LEN, VARINT, iter_fields, read_varint, tag, varint

__all__ = ["TensorField", "parse_tensor", "tensor_header", "tf_dtype_enum"]

# tensorflow/core/framework/types.proto DataType numbers.
_DTYPE_ENUM = {
    "float32": 1, "float64": 2, "int32": 3, "uint8": 4, "int16": 5, "int8": 6, "complex64": 8,
    "int64": 9, "bool": 10, "uint16": 17, "complex128": 18, "float16": 19, "uint32": 22, "uint64": 23,
}
_ENUM_DTYPE = {number: name for name, number in _DTYPE_ENUM.items()}
_ENUM_NAMES = {7: "string", 14: "bfloat16", 20: "resource", 21: "variant", 11: "qint8", 12: "quint8", 13: "qint32",
               15: "qint16", 16: "quint16"}

# TensorProto field numbers.
_DTYPE, _SHAPE, _VERSION, _CONTENT = 1, 2, 3, 4
# Typed value fields -> (dtypes they hold, how each value is stored).
_TYPED = {
    5: ("float32", "f4"), 6: ("float64", "f8"), 13: ("float16", "half"),
    7: ("int32 int16 int8 uint8 uint16", "varint"), 10: ("int64", "varint"), 11: ("bool", "varint"),
    16: ("uint32", "varint"), 17: ("uint64", "varint"), 9: ("complex64", "f4"), 12: ("complex128", "f8"),
}


def tf_dtype_enum(dtype: np.dtype) -> int:
    """TensorFlow's ``DataType`` number of a numpy dtype.

    Raises:
        KeyError: TensorFlow has no such dtype.
    """
    return _DTYPE_ENUM[np.dtype(dtype).name]


def tensor_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The bytes ``serialize_tensor`` writes before the content of a tensor of ``dtype`` and ``shape``.

    The content field's tag and length are included; the content itself follows. A tensor
    with no elements has no content field, so its header is the whole serialized tensor.
    """
    dims = b"".join(tag(_SHAPE, LEN) + varint(len(body)) + body
                    for body in ((tag(1, VARINT) + varint(d)) if d else b"" for d in shape))
    head = tag(_DTYPE, VARINT) + varint(tf_dtype_enum(dtype)) + tag(_SHAPE, LEN) + varint(len(dims)) + dims
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    return head + (tag(_CONTENT, LEN) + varint(nbytes) if nbytes else b"")


@dataclass(frozen=True)
class TensorField:
    """Where a serialized tensor's values are: ``content`` (a span of raw bytes) or typed value
    fields, decoded by :meth:`values` only when asked.

    Typed values are never decoded by :func:`parse_tensor` itself: one value may fill a shape
    of any size, so a few bytes could claim gigabytes. Compare ``dtype`` and ``shape`` with
    what is expected first, then call :meth:`values`.
    """

    dtype: str
    shape: tuple[int, ...]
    content: tuple[int, int] | None = None
    typed: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...] | None = None

    def values(self, buf: memoryview) -> np.ndarray:
        """The typed values of the tensor in ``buf``, as an array of its dtype and shape.

        Raises:
            ValueError: they do not fill the shape, or a value does not fit the dtype.
        """
        if self.typed is None:
            raise ValueError("the tensor holds tensor_content, not typed values")
        return _typed_values(buf, self.dtype, self.shape, dict(self.typed))


def parse_tensor(buf: memoryview, start: int, stop: int) -> TensorField:
    """Read the ``TensorProto`` in ``buf[start:stop]``.

    Typed value fields are located, not decoded (see :class:`TensorField`).

    Raises:
        ValueError: not a ``TensorProto`` of a numeric dtype with a known shape, a field that
            occurs twice where protobuf would merge or replace it (two readers could then
            disagree on the tensor), or content that does not fill its shape.
    """
    dtype_enum = 0
    shape: list[int] | None = None
    unknown_rank = False
    content: tuple[int, int] | None = None
    typed: dict[int, list[tuple[int, int, int]]] = {}
    seen: set[int] = set()
    for field, wire, s, e in iter_fields(buf, start, stop):
        if field in (_DTYPE, _SHAPE, _CONTENT):
            if field in seen:
                raise ValueError(f"TensorProto field {field} occurs twice (protobuf would merge or replace it)")
            seen.add(field)
        if field == _DTYPE and wire == VARINT:
            dtype_enum = s
        elif field == _SHAPE and wire == LEN:
            shape, unknown_rank = _parse_shape(buf, s, e)
        elif field == _CONTENT and wire == LEN:
            content = (s, e)
        elif field in _TYPED:
            typed.setdefault(field, []).append((wire, s, e))
        elif field == _VERSION:
            continue
        else:
            raise ValueError(f"TensorProto field {field} is not supported (string, resource or variant tensors)")
    dtype = _ENUM_DTYPE.get(dtype_enum)
    if dtype is None:
        name = _ENUM_NAMES.get(dtype_enum, f"DataType {dtype_enum}")
        raise ValueError(f"tensor of dtype {name}: growcache reads numeric tensors only")
    if shape is None or unknown_rank:
        raise ValueError("tensor without a known shape")
    dims = tuple(shape)
    count = math.prod(dims)
    itemsize = np.dtype(dtype).itemsize
    if content is not None or not typed:
        got = 0 if content is None else content[1] - content[0]
        if got != count * itemsize:
            raise ValueError(f"tensor content of {got} bytes, dtype {dtype} shape {dims} needs {count * itemsize}")
        return TensorField(dtype, dims, content=content or (stop, stop))
    field = next((f for f in typed if dtype in _TYPED[f][0].split()), None)
    if field is None or len(typed) > 1:
        raise ValueError(f"tensor of dtype {dtype} holds values of another dtype's field")
    return TensorField(dtype, dims, typed=tuple((f, tuple(spans)) for f, spans in typed.items()))


def _parse_shape(buf: memoryview, start: int, stop: int) -> tuple[list[int], bool]:
    dims: list[int] = []
    unknown = False
    for field, wire, s, e in iter_fields(buf, start, stop):
        if field == 2 and wire == LEN:
            size = 0
            for f, w, ds, _ in iter_fields(buf, s, e):
                if f == 1 and w == VARINT:
                    size = ds
            if size >= 1 << 63:
                raise ValueError("tensor with an unknown dimension (-1)")
            dims.append(size)
        elif field == 3 and wire == VARINT:
            unknown = bool(s)
    return dims, unknown


def _typed_values(buf: memoryview, dtype: str, shape: tuple[int, ...],
                  typed: dict[int, list[tuple[int, int, int]]]) -> np.ndarray:
    """Values of the typed fields; one value fills the whole shape, as TensorFlow reads it."""
    (field,) = typed
    storage = _TYPED[field][1]
    values: list = []
    raw = bytearray()
    for wire, s, e in typed[field]:
        if storage == "varint" or storage == "half":
            if wire == VARINT:
                values.append(s)
            else:
                pos = s
                while pos < e:
                    value, pos = read_varint(buf, pos, e)
                    values.append(value)
        else:
            raw += buf[s:e] if wire in (LEN, FIXED32, FIXED64) else b""
    count = math.prod(shape)
    if len(values) > max(count, 1) or len(raw) > max(count, 1) * np.dtype(dtype).itemsize:
        raise ValueError(f"tensor holds more values than its shape {shape} has room for")
    if storage == "half":
        # half_val holds each float16's bits in an int32 field: anything above 16 bits is no float16.
        if any(v > 0xFFFF for v in values):
            raise ValueError(f"half_val value {max(values)} is not the bits of a float16 (0..65535)")
        array = np.array(values, np.uint16).view(np.float16)
    elif storage == "varint":
        array = np.array(values, np.uint64).view(np.int64)
        low, high = (0, 1) if dtype == "bool" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
        if dtype in ("uint32", "uint64"):
            # uint32_val and uint64_val are unsigned fields: their varints are the values' bits.
            array = np.array(values, np.uint64)
        bad = [int(v) for v in array if not low <= int(v) <= high]
        if bad:
            raise ValueError(f"typed value {bad[0]} is out of range for dtype {dtype} [{low}, {high}]")
        array = array.astype(dtype)
    else:  # float and complex values are little-endian IEEE numbers, pairs for complex
        array = np.frombuffer(bytes(raw), np.dtype(dtype).newbyteorder("<")).astype(dtype)
    if array.size == count:
        return array.reshape(shape)
    if array.size == 1:
        return np.full(shape, array[0], dtype)
    raise ValueError(f"tensor holds {array.size} values, shape {shape} needs {count}")
