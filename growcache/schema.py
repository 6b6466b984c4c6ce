"""The schema of a cache: each feature's dtype, fixed shape and encoding.

A feature's encoding says how it is stored in a ``tf.train.Example``:

* ``"bytes"`` (the default): one raw little-endian ``bytes_list`` value, restored by
  ``tf.io.decode_raw`` or ``np.frombuffer`` without going through Python lists; any dtype;
* ``"int64_list"``: an ``int64_list`` of the array's values, what ``tf.train.Int64List``
  writes and ``FixedLenFeature(shape, tf.int64)`` reads; any integer dtype (or bool),
  range-checked on read;
* ``"float_list"``: a ``float_list``, ``tf.train.FloatList``'s; float32 only;
* ``"tensor"``: one ``bytes_list`` value holding ``tf.io.serialize_tensor`` output;
  its dtype and shape must equal the schema's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import SchemaError

__all__ = ["ENCODINGS", "FeatureSpec", "Schema"]

# Dtypes that tf.io.decode_raw understands too, so both adapters read every schema.
_SUPPORTED_DTYPES = frozenset(
    ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
     "float16", "float32", "float64", "complex64", "complex128"]
)

#: Encodings a feature may name, the default first.
ENCODINGS = ("bytes", "int64_list", "float_list", "tensor")
_INTEGER_DTYPES = frozenset(["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"])


@dataclass(frozen=True)
class FeatureSpec:
    """One feature: its name, dtype (little-endian), fixed shape and encoding.

    Attributes:
        name: the feature's key in each record.
        dtype: the array's dtype, little-endian.
        shape: the array's fixed shape.
        encoding: how it is stored: one of :data:`ENCODINGS`. Default: ``"bytes"``.
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    encoding: str = "bytes"

    @property
    def size(self) -> int:
        """Elements of one sample's array of this feature."""
        return int(math.prod(self.shape))

    def as_tuple(self) -> tuple:
        """``(dtype name, shape)``, with the encoding appended unless it is the default."""
        head = (self.dtype.name, self.shape)
        return head if self.encoding == "bytes" else (*head, self.encoding)

    @property
    def nbytes(self) -> int:
        """Bytes of one sample's array of this feature."""
        return int(math.prod(self.shape)) * self.dtype.itemsize


class Schema(Mapping[str, FeatureSpec]):
    """Feature name -> dtype and fixed shape.

    Args:
        features: a mapping such as ``{"x": ("float32", (256, 256)), "label": ("int64", ())}``.
            Dtypes are anything ``numpy.dtype`` accepts; shapes are tuples of non-negative ints.
            A third item names the encoding (see the module docstring), e.g.
            ``{"label": ("int64", (), "int64_list")}``; default ``"bytes"``.

    Raises:
        SchemaError: a feature name, dtype or shape is invalid.
    """

    def __init__(self, features: Mapping[str, Any]) -> None:
        if isinstance(features, Schema):
            features = features.to_dict()
        if not isinstance(features, Mapping) or not features:
            raise SchemaError(
                "a schema needs at least one feature, e.g. "
                "Schema({'x': ('float32', (256, 256)), 'label': ('int64', ())})"
            )
        specs: dict[str, FeatureSpec] = {}
        for name in sorted(features):
            specs[name] = _parse_feature(name, features[name])
        self._features = specs

    # Mapping protocol: iteration order is sorted by name, the order records are encoded in.
    def __getitem__(self, name: str) -> FeatureSpec:
        return self._features[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._features)

    def __len__(self) -> int:
        return len(self._features)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Schema):
            return self.to_dict() == other.to_dict()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple((n, s.dtype.str, s.shape, s.encoding) for n, s in self._features.items()))

    def __repr__(self) -> str:
        """The Python expression that builds this schema (``growcache schema`` prints it)."""
        inner = ", ".join(f"{n!r}: {s.as_tuple()!r}" for n, s in self._features.items())
        return f"Schema({{{inner}}})"

    @property
    def record_payload_bytes(self) -> int:
        """Bytes of array payload in one record (all features)."""
        return sum(spec.nbytes for spec in self._features.values())

    def to_dict(self) -> dict[str, list]:
        """A JSON-ready form: ``{name: [dtype_name, [dims...]]}``, plus the encoding unless ``"bytes"``."""
        return {n: [s.dtype.name, list(s.shape), *s.as_tuple()[2:]] for n, s in self._features.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schema:
        """Inverse of :meth:`to_dict`."""
        return cls({name: (value[0], tuple(value[1]), *value[2:]) for name, value in data.items()})

    @property
    def encodings(self) -> frozenset[str]:
        """The encodings the features use."""
        return frozenset(s.encoding for s in self._features.values())

    def validate(self, sample: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check ``sample`` against the schema and return its arrays, C-contiguous little-endian.

        Raises:
            SchemaError: a feature is missing or extra, or has the wrong dtype or shape.
                The message names the feature, the expected and the actual dtype/shape.
        """
        if type(sample) is not dict and not isinstance(sample, Mapping):
            raise SchemaError(
                f"a sample must be a dict of arrays with keys {sorted(self)}, got {type(sample).__name__}"
            )
        if sample.keys() != self._features.keys():
            missing = [n for n in self._features if n not in sample]
            extra = [n for n in sample if n not in self._features]
            raise SchemaError(
                f"sample keys {sorted(map(str, sample))} do not match the schema's {list(self)}"
                + (f"; missing {missing}" if missing else "")
                + (f"; unexpected {extra}" if extra else "")
                + ". Return exactly the schema's features from the sample function."
            )
        arrays = {}
        for name, spec in self._features.items():
            array = sample[name]
            # The usual sample is already right; this check costs a fraction of the general one,
            # which matters at tens of thousands of small records per second.
            if (type(array) is np.ndarray and array.dtype == spec.dtype and array.shape == spec.shape
                    and array.flags.c_contiguous):
                arrays[name] = array
                continue
            array = np.asarray(array)
            if array.dtype.newbyteorder("=") != spec.dtype.newbyteorder("=") or array.shape != spec.shape:
                raise SchemaError(
                    f"feature {name!r}: expected dtype {spec.dtype.name} shape {spec.shape}, "
                    f"got dtype {array.dtype.name} shape {array.shape}. Convert it in the sample "
                    f"function (e.g. arr.astype('{spec.dtype.name}')) or fix the schema."
                )
            if array.dtype.byteorder == ">":
                array = array.astype(spec.dtype)
            arrays[name] = np.ascontiguousarray(array)
        return arrays


def _parse_feature(name: Any, value: Any) -> FeatureSpec:
    if not isinstance(name, str) or not name:
        raise SchemaError(f"feature names must be non-empty strings, got {name!r}")
    if isinstance(value, FeatureSpec):
        value = value.as_tuple()
    try:
        if isinstance(value, (str, bytes)) or len(value) not in (2, 3):
            raise ValueError(value)
        dtype_like, shape, *rest = value
        # A framework's dtype names its numpy one (tf.float32.as_numpy_dtype), without importing it here.
        dtype = np.dtype(getattr(dtype_like, "as_numpy_dtype", dtype_like))
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"feature {name!r}: expected (dtype, shape) or (dtype, shape, encoding) such as ('float32', (256, 256)) "
            f"or ('int64', (), 'int64_list'), got {value!r}"
        ) from exc
    encoding = rest[0] if rest else "bytes"
    if dtype.name not in _SUPPORTED_DTYPES:
        raise SchemaError(
            f"feature {name!r}: dtype {dtype} is not supported; use one of {sorted(_SUPPORTED_DTYPES)}"
        )
    if any(d < 0 for d in shape):
        raise SchemaError(f"feature {name!r}: shape {shape} has a negative dimension")
    if encoding not in ENCODINGS:
        raise SchemaError(f"feature {name!r}: encoding {encoding!r} is unknown; use one of {list(ENCODINGS)}")
    if encoding == "int64_list" and dtype.name not in _INTEGER_DTYPES:
        raise SchemaError(
            f"feature {name!r}: int64_list holds integers, but the dtype is {dtype.name}. Use an integer dtype "
            "(values are range-checked on read), or float_list for float32."
        )
    if encoding == "float_list" and dtype.name != "float32":
        raise SchemaError(
            f"feature {name!r}: float_list holds float32 values, but the dtype is {dtype.name}. Use 'float32', "
            "or the 'bytes' or 'tensor' encoding for other float dtypes."
        )
    return FeatureSpec(name, dtype.newbyteorder("<"), shape, encoding)
