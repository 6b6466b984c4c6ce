"""The schema of a cache: each feature's dtype and fixed shape.

Every feature is stored as one raw little-endian ``bytes`` feature of a
``tf.train.Example``, so ``tf.io.decode_raw`` or ``np.frombuffer`` restores it
without going through Python lists.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import SchemaError

__all__ = ["FeatureSpec", "Schema"]

# Dtypes that tf.io.decode_raw understands too, so both adapters read every schema.
_SUPPORTED_DTYPES = frozenset(
    ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
     "float16", "float32", "float64", "complex64", "complex128"]
)


@dataclass(frozen=True)
class FeatureSpec:
    """One feature: its name, dtype (little-endian) and fixed shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one sample's array of this feature."""
        return int(math.prod(self.shape)) * self.dtype.itemsize


class Schema(Mapping[str, FeatureSpec]):
    """Feature name -> dtype and fixed shape.

    Args:
        features: a mapping such as ``{"x": ("float32", (256, 256)), "label": ("int64", ())}``.
            Dtypes are anything ``numpy.dtype`` accepts; shapes are tuples of non-negative ints.

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
        return hash(tuple((n, s.dtype.str, s.shape) for n, s in self._features.items()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{n!r}: ({s.dtype.name!r}, {s.shape})" for n, s in self._features.items())
        return f"Schema({{{inner}}})"

    @property
    def record_payload_bytes(self) -> int:
        """Bytes of array payload in one record (all features)."""
        return sum(spec.nbytes for spec in self._features.values())

    def to_dict(self) -> dict[str, list]:
        """A JSON-ready form: ``{name: [dtype_name, [dims...]]}``."""
        return {n: [s.dtype.name, list(s.shape)] for n, s in self._features.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schema:
        """Inverse of :meth:`to_dict`."""
        return cls({name: (dtype, tuple(shape)) for name, (dtype, shape) in data.items()})

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
    try:
        dtype_like, shape = value
        dtype = np.dtype(dtype_like)
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"feature {name!r}: expected (dtype, shape) such as ('float32', (256, 256)), got {value!r}"
        ) from exc
    if dtype.name not in _SUPPORTED_DTYPES:
        raise SchemaError(
            f"feature {name!r}: dtype {dtype} is not supported; use one of {sorted(_SUPPORTED_DTYPES)}"
        )
    if any(d < 0 for d in shape):
        raise SchemaError(f"feature {name!r}: shape {shape} has a negative dimension")
    return FeatureSpec(name, dtype.newbyteorder("<"), shape)
