"""The ``tf.train.Example`` wire format, encoded and decoded without TensorFlow or protobuf.

``tensorflow`` and the ``tfrecord`` package both register ``tensorflow.BytesList`` in
protobuf's default descriptor pool and cannot share a process, so the core carries this
small codec instead of importing either. It handles fixed-shape features in every
encoding a :class:`~growcache.schema.Schema` names: raw ``bytes_list`` values,
``int64_list``, ``float_list`` and ``tf.io.serialize_tensor`` output, with map entries
in any order (TensorFlow's writer orders them its own way).

Record layouts. Each feature's values sit in one contiguous *payload*: the raw array
bytes, the packed float32s of a ``float_list``, the ``tensor_content`` of a tensor, or
the packed varints of an ``int64_list``. Every byte outside the payloads (tags, lengths,
keys, tensor headers) is *structure*. Two records with the same length and the same
structure bytes parse the same way, so :class:`ExampleCodec` parses a record in full only
the first time its structure is seen; later records of that layout are checked by
comparing their structure bytes and then sliced. Every record growcache writes for a
schema has one layout (``int64_list`` values as 10-byte varints, which every protobuf
parser reads); records of other writers take one layout per structure they use
(TensorFlow writes the shortest varints, so a label below 128 is one layout, below
16384 another).

:class:`BatchDecoder` copies records into the rows of a batch (one memcpy per payload)
and decodes ``int64_list`` payloads once per batch, vectorized with numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._protowire import (
    FIXED32,
    LEN,
    MAX_VARINT_BYTES,
    VARINT,
    decode_varint_rows,
    encode_varints,
    iter_fields,
    tag,
    varint,
    varint_count,
)
from .errors import CorruptShardError, GrowcacheError, SchemaError
from .schema import FeatureSpec, Schema
from .tensor_proto import parse_tensor, tensor_header

__all__ = [
    "AmbiguousRecordError",
    "BatchDecoder",
    "ExampleCodec",
    "FoundFeature",
    "RecordChecker",
    "TFFeatureParse",
    "scan_example",
    "tf_parse_plan",
]

_TAG_1 = tag(1, LEN)
_TAG_2 = tag(2, LEN)
_KIND_FIELD = {"bytes": 1, "tensor": 1, "float_list": 2, "int64_list": 3}
_KIND_NAME = {1: "bytes_list", 2: "float_list", 3: "int64_list"}
_MAX_LAYOUTS = 64  # structures remembered per codec; beyond, records are parsed in full
_STAGING_BYTES = 2 << 20  # a RecordChecker's batch of staged int64_list values


_MAX_STRUCTURE = 128  # bytes of tags and lengths around one feature, with room to spare


def _max_value_bytes(spec: FeatureSpec) -> int:
    """The most bytes one feature's values take in any encoding a writer may choose: unpacked
    values with a tag each (1 byte) and varints of up to 10 bytes."""
    if spec.encoding == "int64_list":
        return spec.size * (1 + MAX_VARINT_BYTES)
    if spec.encoding == "float_list":
        return spec.size * 5
    if spec.encoding == "tensor":  # tensor_content, or typed values (varints, or 8-byte floats) with tags
        return max(spec.nbytes, spec.size * (1 + MAX_VARINT_BYTES)) + _MAX_STRUCTURE + 16 * len(spec.shape)
    return spec.nbytes


def _len_field(field_tag: bytes, body_len: int) -> bytes:
    return field_tag + varint(body_len)


def _int_range(dtype: np.dtype) -> tuple[int, int]:
    """The values an ``int64_list`` may hold for ``dtype``."""
    if dtype.kind == "b":
        return 0, 1
    info = np.iinfo(dtype)
    return max(int(info.min), -(1 << 63)), min(int(info.max), (1 << 63) - 1)


# -- scanning any Example ------------------------------------------------------------------
@dataclass(frozen=True)
class FoundFeature:
    """One feature of a scanned record: its kind and where its values are.

    Attributes:
        kind: ``"bytes_list"``, ``"float_list"``, ``"int64_list"``, or ``"empty"`` (a
            ``Feature`` that sets no kind).
        values: for ``bytes_list``, the ``(start, stop)`` of each value; for the numeric
            lists, each packed run ``(start, stop)`` (unpacked values are runs of one).
        packed: the numeric list is one packed run (``values`` has one span).
        entry: ``(start, stop)`` of the map entry in the record.
    """

    kind: str
    values: tuple[tuple[int, int], ...]
    packed: bool
    entry: tuple[int, int]

    def count(self, buf: memoryview) -> int:
        """Values the feature holds."""
        if self.kind == "bytes_list":
            return len(self.values)
        if self.kind == "float_list":
            return sum((e - s) // 4 for s, e in self.values)
        if self.kind == "int64_list":
            return sum(int(np.count_nonzero(np.frombuffer(buf[s:e], np.uint8) < 0x80)) for s, e in self.values)
        return 0


class AmbiguousRecordError(GrowcacheError, ValueError):
    """A record that protobuf parsers may read in more than one way: a feature key given
    twice, a ``Feature`` that carries its list twice (protobuf merges the two lists, a
    scanner that takes the last one does not), a map entry with two keys or values, or a key
    that is not UTF-8 (two such keys could decode to one name). Readers of one cache must
    agree on every value, so such a record is refused as corrupt, never read."""


def scan_example(record: Any) -> dict[str, FoundFeature]:
    """Every feature of a serialized ``tf.train.Example``, in any entry order.

    Raises:
        AmbiguousRecordError: the record has no single meaning (see that class).
        ValueError: the record is not a well-formed Example.
    """
    view = memoryview(record).cast("B")
    found: dict[str, FoundFeature] = {}
    for field, wire, start, stop in iter_fields(view, 0, len(view)):
        if field != 1 or wire != LEN:
            continue
        for entry_field, entry_wire, es, ee in iter_fields(view, start, stop):
            if entry_field != 1 or entry_wire != LEN:
                continue
            key = None
            value = None
            for f, w, s, e in iter_fields(view, es, ee):
                if f == 1 and w == LEN:
                    if key is not None:
                        raise AmbiguousRecordError("a feature map entry holds two keys")
                    try:
                        key = bytes(view[s:e]).decode("utf-8")
                    except UnicodeDecodeError:
                        raise AmbiguousRecordError(
                            f"feature key {bytes(view[s:e])!r} is not UTF-8 (protobuf map keys are strings)") from None
                elif f == 2 and w == LEN:
                    if value is not None:
                        raise AmbiguousRecordError("a feature map entry holds two values (protobuf would merge them)")
                    value = (s, e)
            if key is None:
                raise ValueError("feature map entry without a key")
            if key in found:
                raise AmbiguousRecordError(f"feature {key!r} occurs twice (protobuf keeps the last, other readers "
                                           "the first)")
            found[key] = _scan_feature(view, value or (ee, ee), (es, ee))
    return found


def _scan_feature(view: memoryview, span: tuple[int, int], entry: tuple[int, int]) -> FoundFeature:
    kind = 0
    spans: list[tuple[int, int]] = []
    for f, w, s, e in iter_fields(view, *span):
        if f in _KIND_NAME and w == LEN:
            if kind:  # protobuf merges a list given twice, and a oneof takes the last kind set
                raise AmbiguousRecordError(f"a Feature carries {_KIND_NAME[kind]} and then {_KIND_NAME[f]}: "
                                           "protobuf parsers merge or replace them, growcache would not")
            kind, spans = f, [(s, e)]
    if not kind:
        return FoundFeature("empty", (), True, entry)
    values: list[tuple[int, int]] = []
    runs = 0
    for f, w, s, e in iter_fields(view, *spans[0]):
        if f != 1:
            continue
        if kind == 1 and w == LEN:
            values.append((s, e))
        elif kind == 2 and w in (LEN, FIXED32):
            runs += w == LEN
            values.append((s, e))
        elif kind == 3 and w in (LEN, VARINT):
            runs += w == LEN
            # An unpacked varint: its bytes run from after the key to the next field.
            values.append((s, e) if w == LEN else _unpacked_varint_span(view, s, e))
        else:
            raise ValueError(f"{_KIND_NAME[kind]} value with wire type {w}")
    packed = kind == 1 or len(values) <= 1 and runs == len(values)
    return FoundFeature(_KIND_NAME[kind], tuple(values), packed, entry)


def _unpacked_varint_span(view: memoryview, value: int, after: int) -> tuple[int, int]:
    # iter_fields gives an unpacked varint as (value, position after it): find where it began.
    start = after - 1
    while start > 0 and view[start - 1] & 0x80:
        start -= 1
    return start, after


# -- the codec -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """A record structure: the structure bytes to compare, and each feature's payload span."""

    checks: tuple[tuple[int, bytes], ...]  # (offset, bytes) of every structure run
    spans: tuple[tuple[int, int], ...]  # (offset, nbytes) per feature, schema order


class _NeedsDecode(Exception):
    """A record whose values are not one contiguous payload per feature (unpacked lists, typed tensors)."""


class ExampleCodec:
    """Encodes samples of a :class:`Schema` as serialized ``tf.train.Example`` and back.

    Args:
        schema: the schema every record follows.

    Every record this codec writes has the same layout, described by ``prefixes``,
    ``layout`` and ``record_nbytes``: ``int64_list`` values are written as 10-byte varints
    (see :func:`growcache._protowire.wide_varint`), so their length does not vary with
    the values. Records of other writers are read in any layout.

    Attributes:
        fixed_layout: every payload this codec writes is the raw bytes of its array (no
            ``int64_list`` feature), so a payload can be copied straight into an array.
        layout: ``(name, payload_offset, payload_nbytes)`` per feature, in schema order,
            for records this codec writes.
        prefixes: per feature, in schema order, the structure bytes before its payload in
            every record this codec writes.
        record_nbytes: serialized size of every record this codec writes.
        max_record_bytes: the longest record of this schema that any writer produces
            (unpacked lists, typed tensor values and the longest varints included). Readers
            of files written by others refuse longer records before reading them.
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.specs: list[FeatureSpec] = list(schema.values())
        self.fixed_layout = all(s.encoding != "int64_list" for s in self.specs)
        self._ranges = {s.name: _int_range(s.dtype) for s in self.specs if s.encoding == "int64_list"}
        self._tensor_heads = {s.name: tensor_header(s.dtype, s.shape) for s in self.specs if s.encoding == "tensor"}
        self._keys = {s.name: s.name.encode("utf-8") for s in self.specs}
        sizes = {s.name: s.size * MAX_VARINT_BYTES if s.encoding == "int64_list" else s.nbytes for s in self.specs}
        self.prefixes = []
        self.layout = []
        offset = 0
        heads = self._heads(sizes)
        for index, (spec, head) in enumerate(zip(self.specs, heads)):
            offset += len(head)
            self.prefixes.append(head)
            self.layout.append((spec.name, offset, sizes[spec.name]))
            offset += sizes[spec.name]
        self.record_nbytes = offset
        self.max_record_bytes = _MAX_STRUCTURE + sum(len(k) + _MAX_STRUCTURE + _max_value_bytes(s)
                                                     for s, k in zip(self.specs, self._keys.values()))
        self._layouts: dict[int, list[_Layout]] = {}
        self._layout_count = 0
        self._remember(_Layout(
            tuple((o - len(p), p) for p, (_, o, _) in zip(self.prefixes, self.layout) if p),
            tuple((o, n) for _, o, n in self.layout)), self.record_nbytes)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Learned layouts are learned again in each process; the written one always travels.
        state["_layouts"] = {self.record_nbytes: self._layouts[self.record_nbytes][:1]}
        state["_layout_count"] = 1
        return state

    # -- encoding -------------------------------------------------------------------------
    def _heads(self, payload_sizes: Mapping[str, int]) -> list[bytes]:
        """Structure bytes before each payload (the Example's own head goes before the first)."""
        entries = []
        body = 0
        for spec in self.specs:
            n = payload_sizes[spec.name]
            key = self._keys[spec.name]
            if spec.encoding == "tensor":
                inner = self._tensor_heads[spec.name]
                list_body = _len_field(_TAG_1, len(inner) + n) + inner
            else:  # a bytes value, or a packed list
                list_body = _len_field(_TAG_1, n)
            kind = _len_field(tag(_KIND_FIELD[spec.encoding], LEN), len(list_body) + n) + list_body
            feature = _len_field(_TAG_2, len(kind) + n) + kind
            entry = _len_field(_TAG_1, len(key)) + key + feature
            item = _len_field(_TAG_1, len(entry) + n) + entry
            entries.append(item)
            body += len(item) + n
        example = _len_field(_TAG_1, body)
        return [(example if i == 0 else b"") + item for i, item in enumerate(entries)]

    def encode_pieces(self, arrays: Mapping[str, np.ndarray]) -> list[Any]:
        """Return the serialized record as a list of buffers (structure and payloads).

        ``arrays`` must come from :meth:`Schema.validate` (C-contiguous, little-endian).
        Raw payloads are not copied: write the pieces out before changing the arrays.

        Raises:
            SchemaError: an ``int64_list`` value does not fit in an int64 (a uint64 above 2**63 - 1).
        """
        payloads: dict[str, Any] = {}
        if not self.fixed_layout:
            payloads = {s.name: self._int64_payload(s, arrays[s.name]) for s in self.specs
                        if s.encoding == "int64_list"}
        pieces: list[Any] = []
        for prefix, spec in zip(self.prefixes, self.specs):
            pieces.append(prefix)
            payload = payloads.get(spec.name)
            if payload is None:
                array = arrays[spec.name]
                payload = memoryview(array).cast("B") if array.nbytes else b""  # cast() refuses zero dims
            pieces.append(payload)
        return pieces

    def _int64_payload(self, spec: FeatureSpec, array: np.ndarray) -> bytes:
        if spec.dtype.name == "uint64" and array.size and int(array.max()) > (1 << 63) - 1:
            raise SchemaError(
                f"feature {spec.name!r}: uint64 value {int(array.max())} does not fit int64_list (int64 values). "
                "Store it with the 'bytes' or 'tensor' encoding."
            )
        return encode_varints(array.astype(np.int64, copy=False), wide=True)

    def encode(self, sample: Mapping[str, Any]) -> bytes:
        """Validate ``sample`` and return it as one serialized ``tf.train.Example``."""
        return b"".join(bytes(p) for p in self.encode_pieces(self.schema.validate(sample)))

    # -- layouts --------------------------------------------------------------------------
    def has_layout(self, record: Any) -> bool:
        """True when ``record`` has exactly the layout this codec writes."""
        view = memoryview(record)
        if len(view) != self.record_nbytes:
            return False
        return all(view[o:o + len(b)] == b for o, b in self._layouts[self.record_nbytes][0].checks)

    def payload_spans(self, record: Any) -> tuple[tuple[int, int], ...]:
        """``(offset, nbytes)`` of each feature's payload in ``record``, in schema order.

        A payload is the raw array bytes (``bytes``, ``float_list``, ``tensor``) or the
        packed varints of an ``int64_list``, whose count and range :meth:`decode` checks.

        Raises:
            ValueError: the record is not a well-formed Example.
            SchemaError: a feature is missing or extra, has another kind or size than the
                schema's, or its values are not one contiguous payload (unpacked lists,
                typed tensor values; :meth:`decode` reads those).
        """
        spans = self._spans(memoryview(record))
        if isinstance(spans, str):
            raise SchemaError(f"{spans}: read such records with decode()")
        return spans

    def _spans(self, view: memoryview) -> tuple[tuple[int, int], ...] | str:
        """Like :meth:`payload_spans`, but says why (a str) when the values need the general decode."""
        for layout in self._layouts.get(len(view), ()):
            for offset, expected in layout.checks:
                if view[offset:offset + len(expected)] != expected:
                    break
            else:
                return layout.spans
        view = view.cast("B") if view.format != "B" else view
        found = self._check(scan_example(view), view)
        try:
            return self._learn(found, view)
        except _NeedsDecode as exc:
            return str(exc)

    def _learn(self, found: dict[str, FoundFeature], view: memoryview) -> tuple[tuple[int, int], ...]:
        spans = tuple(self._payload_span(spec, found[spec.name], view) for spec in self.specs)
        if self._layout_count < _MAX_LAYOUTS:
            payload = sorted((o, o + n) for o, n in spans if n)
            checks = []
            position = 0
            for start, stop in [*payload, (len(view), len(view))]:
                if start > position:
                    checks.append((position, bytes(view[position:start])))
                position = stop
            self._remember(_Layout(tuple(checks), spans), len(view))
        return spans

    def _remember(self, layout: _Layout, size: int) -> None:
        self._layouts.setdefault(size, []).append(layout)
        self._layout_count += 1

    def _check(self, found: dict[str, FoundFeature], view: memoryview) -> dict[str, FoundFeature]:
        """Raise unless ``found`` holds exactly the schema's features, of the schema's kinds and counts."""
        missing = [n for n in self.schema if n not in found]
        extra = sorted(n for n in found if n not in self.schema)
        if missing or extra:
            raise SchemaError(
                f"record features {sorted(found)} do not match the schema's {list(self.schema)}"
                + (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else "")
                + ". Give the schema every feature of the records (growcache schema FILE prints it), "
                "or open the cache with the schema the shards were written with."
            )
        for spec in self.specs:
            feature = found[spec.name]
            want = "bytes_list" if spec.encoding in ("bytes", "tensor") else spec.encoding
            count = feature.count(view) if feature.kind != "empty" else 0
            want_count = 1 if want == "bytes_list" else spec.size
            if feature.kind == "empty" and want_count == 0:
                continue
            if feature.kind != want or count != want_count:
                raise SchemaError(_mismatch(spec, feature.kind, count, feature, view))
        return found

    def _payload_span(self, spec: FeatureSpec, feature: FoundFeature, view: memoryview) -> tuple[int, int]:
        if spec.encoding == "tensor":
            start, stop = feature.values[0]
            try:
                tensor = parse_tensor(view, start, stop)
            except ValueError as exc:
                raise SchemaError(
                    f"feature {spec.name!r}: the schema says encoding 'tensor' (tf.io.serialize_tensor output), but "
                    f"the value of {stop - start} bytes is not a tensor growcache reads ({exc}). Run "
                    "`growcache schema FILE` to see how the file stores each feature."
                ) from None
            if tensor.dtype != spec.dtype.name or tensor.shape != spec.shape:
                raise SchemaError(_tensor_mismatch(spec, tensor.dtype, tensor.shape))
            if tensor.content is None:
                raise _NeedsDecode(f"feature {spec.name!r}: tensor values in typed fields")
            return tensor.content[0], tensor.content[1] - tensor.content[0]
        if not feature.values:
            return 0, 0
        if not feature.packed:
            raise _NeedsDecode(f"feature {spec.name!r}: unpacked {feature.kind} values")
        start, stop = feature.values[0]
        if spec.encoding == "bytes" and stop - start != spec.nbytes:
            raise SchemaError(
                f"feature {spec.name!r}: expected {spec.nbytes} bytes for dtype {spec.dtype.name} shape "
                f"{spec.shape} (raw bytes), the record holds {stop - start} bytes. " + _bytes_hint(spec, view, start, stop)
            )
        return start, stop - start

    # -- decoding -------------------------------------------------------------------------
    def payload_views(self, record: Any) -> dict[str, memoryview]:
        """Each feature's payload inside ``record`` (zero-copy); see :meth:`payload_spans`."""
        view = memoryview(record).cast("B")
        return {s.name: view[o:o + n] for s, (o, n) in zip(self.specs, self.payload_spans(view))}

    def decode(self, record: Any, *, copy: bool = True) -> dict[str, np.ndarray]:
        """Return the sample in ``record`` as arrays of the schema's dtypes and shapes.

        Args:
            record: one serialized Example (bytes, bytearray or memoryview).
            copy: copy raw payloads out of ``record``. Pass ``False`` only when ``record``
                outlives the arrays. Default: ``True``.

        Raises:
            ValueError: the record is not a well-formed Example.
            SchemaError: it does not follow the schema (missing, extra or mismatched
                feature, an integer out of the dtype's range).
        """
        view = memoryview(record).cast("B")
        spans = self._spans(view)
        if isinstance(spans, str):
            found = self._check(scan_example(view), view)
            return {s.name: self._decode_feature(s, found[s.name], view) for s in self.specs}
        out = {}
        for spec, (offset, nbytes) in zip(self.specs, spans):
            payload = view[offset:offset + nbytes]
            if spec.encoding == "int64_list":
                values = decode_varint_rows(np.frombuffer(payload, np.uint8)[None], np.array([nbytes]), spec.size)
                out[spec.name] = self._narrow(spec, values[0]).reshape(spec.shape)
                continue
            array = np.frombuffer(payload, dtype=spec.dtype).reshape(spec.shape)
            out[spec.name] = array.copy() if copy else array
        return out

    def _decode_feature(self, spec: FeatureSpec, feature: FoundFeature, view: memoryview) -> np.ndarray:
        """The general path: any valid encoding of the feature, unpacked lists and typed tensors included."""
        if spec.encoding == "tensor":
            tensor = parse_tensor(view, *feature.values[0])
            if tensor.dtype != spec.dtype.name or tensor.shape != spec.shape:
                raise SchemaError(_tensor_mismatch(spec, tensor.dtype, tensor.shape))
            if tensor.typed is not None:  # decoded only now that its shape is the schema's
                return tensor.values(view).astype(spec.dtype)
            start, stop = tensor.content  # type: ignore[misc]
            return np.frombuffer(view[start:stop], spec.dtype).reshape(spec.shape).copy()
        if spec.encoding == "bytes":
            start, stop = feature.values[0]
            return np.frombuffer(view[start:stop], spec.dtype).reshape(spec.shape).copy()
        if spec.encoding == "float_list":
            data = b"".join(bytes(view[s:e]) for s, e in feature.values)
            return np.frombuffer(data, "<f4").reshape(spec.shape).copy()
        data = np.frombuffer(b"".join(bytes(view[s:e]) for s, e in feature.values), np.uint8)
        values = decode_varint_rows(data[None], np.array([data.size]), spec.size)[0]
        return self._narrow(spec, values).reshape(spec.shape)

    def _narrow(self, spec: FeatureSpec, values: np.ndarray) -> np.ndarray:
        """int64 values as ``spec.dtype``, after checking they fit it."""
        low, high = self._ranges[spec.name]
        if values.size and (values.min() < low or values.max() > high):
            bad = values[(values < low) | (values > high)][0]
            raise SchemaError(
                f"feature {spec.name!r}: int64_list value {int(bad)} is out of range for dtype {spec.dtype.name} "
                f"[{low}, {high}]. Use a wider integer dtype in the schema, e.g. {{{spec.name!r}: ('int64', "
                f"{spec.shape}, 'int64_list')}}."
            )
        return values.astype(spec.dtype)


def _tensor_mismatch(spec: FeatureSpec, dtype: str, shape: tuple[int, ...]) -> str:
    return (f"feature {spec.name!r}: expected a serialized tensor of dtype {spec.dtype.name} shape {spec.shape}, "
            f"found dtype {dtype} shape {shape}. Change the schema to {{{spec.name!r}: ({dtype!r}, {shape}, 'tensor')}}.")


def _bytes_hint(spec: FeatureSpec, view: memoryview, start: int, stop: int) -> str:
    try:
        tensor = parse_tensor(view, start, stop)
    except ValueError:
        return "Fix the dtype or shape in the schema (growcache schema FILE prints what the file holds)."
    return (f"The value is tf.io.serialize_tensor output of dtype {tensor.dtype} shape {tensor.shape}: say so in the "
            f"schema, {{{spec.name!r}: ({tensor.dtype!r}, {tensor.shape}, 'tensor')}}.")


def _mismatch(spec: FeatureSpec, kind: str, count: int, feature: FoundFeature, view: memoryview) -> str:
    expected_kind = "bytes_list with 1 value" if spec.encoding in ("bytes", "tensor") else (
        f"{spec.encoding} with {spec.size} value{'s' if spec.size != 1 else ''}")
    found = f"{kind} with {count} value{'s' if count != 1 else ''}"
    if kind == "bytes_list" and count == 1:
        start, stop = feature.values[0]
        found += f" of {stop - start} bytes"
    expected = (f"{spec.dtype.name} shape {spec.shape} stored as {expected_kind}")
    if kind == "int64_list":
        fix = f"{{{spec.name!r}: ('int64', {(count,) if count != 1 else ()}, 'int64_list')}}"
    elif kind == "float_list":
        fix = f"{{{spec.name!r}: ('float32', {(count,) if count != 1 else ()}, 'float_list')}}"
    elif kind == "bytes_list" and count == 1:
        fix = (f"{{{spec.name!r}: (dtype, shape)}} with the dtype and shape of its raw bytes, or "
               f"(dtype, shape, 'tensor') for tf.io.serialize_tensor output")
    else:
        fix = None
    message = f"feature {spec.name!r}: expected {expected}, found {found}."
    if fix:
        message += f" Fix the schema, e.g. {fix} (any shape with the same number of values works)."
    else:
        message += (" growcache reads fixed-shape features only: VarLenFeature, SequenceExample and ragged "
                    "features are not supported.")
    return message


class BatchDecoder:
    """Copies records into the rows of a batch and finishes encoded features once per batch.

    For ``bytes``, ``float_list`` and ``tensor`` features a record's payload is copied
    straight into its row of the batch array. ``int64_list`` payloads are copied into a
    staging row instead, with their length, and :meth:`finish` decodes the whole batch's
    varints at once with numpy and range-checks them.

    Usage: ``rows = decoder.rows(arrays)``; ``decoder.put(record, rows, row)`` per record
    (rows may be moved between batches as whole rows of every array in ``rows``);
    ``decoder.finish(arrays, rows, count)`` before the batch is used.

    Args:
        codec: the codec of the records' schema.
        window: batches a reader fills at once (its shuffle window). The staging rows of
            ``window`` consecutive :meth:`rows` calls are equally spaced slices of one block
            of memory, as a slab's batches are, so a reader can scatter a window's payloads
            into all of them with one numpy call. Default: ``1``.
    """

    def __init__(self, codec: ExampleCodec, window: int = 1) -> None:
        self.codec = codec
        self.specs = codec.specs
        self.window = max(int(window), 1)
        self._blocks: list[np.ndarray | None] = [None] * len(self.specs)  # per int64_list feature
        self._next = 0  # slot of the current blocks the next rows() takes
        self._varint = [i for i, s in enumerate(self.specs) if s.encoding == "int64_list"]
        # Per feature, the index in rows() of its payload lengths (int64_list), or -1.
        self._length_rows = [len(self.specs) + self._varint.index(i) if i in self._varint else -1
                             for i in range(len(self.specs))]

    @property
    def varint_features(self) -> list[int]:
        """Indices (schema order, as in :meth:`rows`) of the ``int64_list`` features."""
        return self._varint

    def rows(self, arrays: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Flat byte rows to fill for a batch of ``arrays`` (each ``(batch, *shape)``).

        One row array per feature, in schema order (an ``int64_list`` feature's is a staging
        area of 10 bytes per value), then one payload-length array per ``int64_list`` feature.
        """
        rows = []
        batch = next(iter(arrays.values())).shape[0]
        slot = self._next
        self._next = (slot + 1) % self.window
        for index, (spec, length_row) in enumerate(zip(self.specs, self._length_rows)):
            if length_row >= 0:
                width = max(spec.size * MAX_VARINT_BYTES, 1)
                block = self._blocks[index]
                if slot == 0 or block is None or block.shape[1:] != (batch, width):
                    # A new block (never reused: batches of the last one may still be filling).
                    block = self._blocks[index] = np.empty((self.window, batch, width), np.uint8)
                rows.append(block[slot])
            else:
                rows.append(arrays[spec.name].reshape(batch, spec.nbytes // spec.dtype.itemsize).view(np.uint8))
        # Payload lengths, preset to the wide form growcache writes: a reader that copies fixed
        # layouts by the block (growcache.vector_reader) fills the staging rows and nothing else.
        rows.extend(np.full(batch, self.specs[i].size * MAX_VARINT_BYTES, np.int32) for i in self._varint)
        return rows

    def put(self, record: Any, rows: list[np.ndarray], row: int) -> None:
        """Copy ``record``'s payloads into row ``row`` of ``rows``.

        Raises:
            ValueError: the record is not a well-formed Example.
            SchemaError: it does not follow the schema.
        """
        spans = self.codec._spans(record if type(record) is memoryview else memoryview(record))
        if isinstance(spans, str):
            self._put_decoded(self.codec.decode(record), rows, row)
            return
        for spec, dst, (offset, nbytes), length_row in zip(self.specs, rows, spans, self._length_rows):
            if length_row < 0:
                if nbytes:
                    dst[row] = np.frombuffer(record, np.uint8, nbytes, offset)
                continue
            if nbytes > dst.shape[1]:
                raise SchemaError(f"an int64_list payload of {nbytes} bytes holds more values than the schema's "
                                  f"{dst.shape[1] // MAX_VARINT_BYTES}")
            # Its varints are checked now, where the record's offset is known: finish() decodes a
            # whole window of records at once, too late to name the record or skip its shard.
            if nbytes == 1 and record[offset] < 0x80:
                values = 1  # one value below 128: a small label, the usual int64_list
            else:
                payload = record[offset:offset + nbytes]
                values = varint_count(payload if type(payload) is bytes else bytes(payload))  # ValueError: malformed
            if values != spec.size:
                raise SchemaError(f"feature {spec.name!r}: an int64_list of {values} values, where the schema's "
                                  f"shape {spec.shape} holds {spec.size}")
            dst[row, :nbytes] = np.frombuffer(record, np.uint8, nbytes, offset)
            rows[length_row][row] = nbytes

    def _put_decoded(self, sample: dict[str, np.ndarray], rows: list[np.ndarray], row: int) -> None:
        for index, (spec, length_row) in enumerate(zip(self.specs, self._length_rows)):
            array = sample[spec.name]
            if length_row >= 0:
                payload = np.frombuffer(encode_varints(array.astype(np.int64)), np.uint8)
                rows[index][row, :payload.size] = payload
                rows[length_row][row] = payload.size
            elif array.nbytes:
                rows[index][row] = np.ascontiguousarray(array, spec.dtype).reshape(-1).view(np.uint8)

    def finish(self, arrays: Mapping[str, np.ndarray], rows: list[np.ndarray], count: int) -> None:
        """Decode the ``int64_list`` features of the first ``count`` rows into ``arrays``.

        Raises:
            SchemaError: a value is out of its dtype's range, or a payload holds another
                number of values than the schema's shape.
        """
        for index in self._varint:
            spec = self.specs[index]
            try:
                values = decode_varint_rows(rows[index][:count], rows[self._length_rows[index]][:count], spec.size)
            except ValueError as exc:
                raise SchemaError(f"feature {spec.name!r}: bad int64_list payload ({exc})") from None
            arrays[spec.name][:count] = self.codec._narrow(spec, values).reshape(count, *spec.shape)


class RecordChecker:
    """Checks that records follow a schema, as files come into a cache.

    A record's structure is checked at once; ``int64_list`` values are decoded and
    range-checked a batch of records at a time (call :meth:`flush` after the last record).
    Errors name the file and the byte offset of the record at fault.

    Args:
        codec: the codec of the cache's schema.
        source: the file or URL the records come from, for messages.
        batch: records whose ``int64_list`` payloads are checked together, at most. Default: ``1024``
            (fewer when their staged values would pass 2 MiB).
    """

    def __init__(self, codec: ExampleCodec, source: str, batch: int = 1024) -> None:
        self.codec = codec
        self.source = source
        # The staging arrays stay within a few MiB, whatever the schema's int64_list sizes.
        per_record = sum(s.nbytes + (s.size * MAX_VARINT_BYTES if s.encoding == "int64_list" else 0)
                         for s in codec.specs)
        batch = max(1, min(batch, _STAGING_BYTES // max(per_record, 1)))
        self._decoder = BatchDecoder(codec)
        self._staged = 0
        self._offsets = np.zeros(batch, np.int64)
        self._rows: list[np.ndarray] | None = None
        self._arrays: dict[str, np.ndarray] = {}
        if self._decoder._varint:
            self._arrays = {s.name: np.empty((batch, *s.shape), s.dtype) for s in codec.specs}
            self._rows = self._decoder.rows(self._arrays)

    def check(self, record: Any, offset: int) -> None:
        """Check one record found at byte ``offset``.

        Raises:
            SchemaError: it does not follow the schema (the message names file and offset).
            CorruptShardError: it has no single meaning (:class:`AmbiguousRecordError`).
        """
        try:
            if self._rows is None:
                spans = self.codec._spans(record if type(record) is memoryview else memoryview(record))
                if isinstance(spans, str):
                    self.codec.decode(record)
                return
            self._decoder.put(record, self._rows, self._staged)
        except AmbiguousRecordError as exc:
            raise CorruptShardError(self.source, offset, str(exc)) from None
        except (SchemaError, ValueError) as exc:
            raise SchemaError(f"{self.source} at byte offset {offset}: {exc}") from None
        self._offsets[self._staged] = offset
        self._staged += 1
        if self._staged == len(self._offsets):
            self.flush()

    def flush(self) -> None:
        """Check the values of the records staged so far.

        Raises:
            SchemaError: a value is out of its dtype's range (file, offset, feature, value).
        """
        count, self._staged = self._staged, 0
        if not count or self._rows is None:
            return
        try:
            self._decoder.finish(self._arrays, self._rows, count)
        except SchemaError:
            for row in range(count):  # rare: find the record at fault
                single = [r[row:row + 1] for r in self._rows]
                try:
                    self._decoder.finish({n: a[row:row + 1] for n, a in self._arrays.items()}, single, 1)
                except SchemaError as exc:
                    raise SchemaError(f"{self.source} at byte offset {int(self._offsets[row])}: {exc}") from None
            raise


# -- TensorFlow's view, without TensorFlow -------------------------------------------------
@dataclass(frozen=True)
class TFFeatureParse:
    """How TensorFlow reads one feature: what ``FixedLenFeature`` parses, and what follows.

    Attributes:
        parse_dtype: ``FixedLenFeature`` dtype: ``"string"``, ``"int64"`` or ``"float32"``.
        parse_shape: ``FixedLenFeature`` shape: ``()`` for strings, the feature's shape for lists.
        then: ``"decode_raw"`` (raw bytes), ``"parse_tensor"`` (``tf.io.parse_tensor``),
            ``"cast"`` (an int64 list narrowed to ``dtype`` after a range check) or ``"none"``.
        dtype: the feature's dtype name.
        shape: the feature's shape.
        value_range: the ``(min, max)`` an int64 list may hold for ``dtype``; ``None`` otherwise.
    """

    parse_dtype: str
    parse_shape: tuple[int, ...]
    then: str
    dtype: str
    shape: tuple[int, ...]
    value_range: tuple[int, int] | None = None


def tf_parse_plan(schema: Schema) -> dict[str, TFFeatureParse]:
    """Per feature, how TensorFlow parses it natively (``tf.io.parse_example`` and what follows)."""
    plan = {}
    for name, spec in schema.items():
        dtype, shape = spec.dtype.name, spec.shape
        if spec.encoding == "bytes":
            plan[name] = TFFeatureParse("string", (), "decode_raw", dtype, shape)
        elif spec.encoding == "tensor":
            plan[name] = TFFeatureParse("string", (), "parse_tensor", dtype, shape)
        elif spec.encoding == "float_list":
            plan[name] = TFFeatureParse("float32", shape, "none", dtype, shape)
        else:
            plan[name] = TFFeatureParse("int64", shape, "none" if dtype == "int64" else "cast", dtype, shape,
                                        _int_range(spec.dtype))
    return plan

