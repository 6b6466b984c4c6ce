"""Protobuf wire-format primitives: varints, field scanning, and varints by the array.

The core reads and writes ``tf.train.Example`` and ``TensorProto`` without protobuf (see
:mod:`growcache.example`). Scalar helpers serve the per-record structure; the vectorized
ones serve ``int64_list`` payloads, a whole batch of records per numpy call.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

__all__ = ["decode_varint_rows", "encode_varints", "iter_fields", "read_varint", "varint", "varint_count",
           "wide_varint_rows_ok"]

LEN = 2  # wire type of length-delimited fields (bytes, messages, packed repeated scalars)
VARINT = 0
FIXED64 = 1
FIXED32 = 5
MAX_VARINT_BYTES = 10

_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, MAX_VARINT_BYTES)], dtype=np.uint64)
_SHIFTS = np.arange(MAX_VARINT_BYTES, dtype=np.uint64) * np.uint64(7)
_WIDE_SMALL: dict[int, bytes] = {}  # 10-byte varints of small values (labels), built as met
_CONTINUATION = bytes(range(0x80, 0x100))
_TOO_LONG = re.compile(b"[\\x80-\\xff]{%d}" % MAX_VARINT_BYTES)  # a varint of more than 10 bytes


def varint(value: int) -> bytes:
    """The varint of a non-negative ``value`` (negative int64s: pass ``value & (2**64 - 1)``)."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field: int, wire: int) -> bytes:
    """The key of ``field`` with wire type ``wire``."""
    return varint(field << 3 | wire)


def read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """``(value, position after it)`` of the varint at ``pos``.

    Raises:
        ValueError: the varint runs past ``end`` or past 10 bytes.
    """
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or oversized varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7


def iter_fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(field, wire type, start, stop)`` of each field of the message in ``buf[pos:end]``.

    For length-delimited fields ``start:stop`` is the content; for varints ``start`` is
    the value itself and ``stop`` the position after it; fixed-width fields give their bytes.

    Raises:
        ValueError: a field runs past ``end``, or the wire type is unknown (groups included).
    """
    while pos < end:
        key, pos = read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == LEN:
            length, pos = read_varint(buf, pos, end)
            if pos + length > end:
                raise ValueError(f"field {field} runs past the end of its message")
            yield field, wire, pos, pos + length
            pos += length
        elif wire == VARINT:
            value, after = read_varint(buf, pos, end)
            yield field, wire, value, after
            pos = after
        elif wire in (FIXED64, FIXED32):
            width = 8 if wire == FIXED64 else 4
            if pos + width > end:
                raise ValueError(f"field {field} runs past the end of its message")
            yield field, wire, pos, pos + width
            pos += width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {field})")


def wide_varint(value: int) -> bytes:
    """The varint of a non-negative ``value`` written in 10 bytes (high groups zero, continued).

    Protobuf parsers read varints of up to 10 bytes whatever their value (TensorFlow's,
    protobuf's C++, upb, Java and Go ones do), so a value written this way reads back
    unchanged, and every record of a schema keeps one length.
    """
    cached = _WIDE_SMALL.get(value)
    if cached is None:
        cached = bytes(((value >> (7 * k)) & 0x7F) | (0x80 if k < MAX_VARINT_BYTES - 1 else 0)
                       for k in range(MAX_VARINT_BYTES))
        if value < 1 << 16:
            _WIDE_SMALL[value] = cached
    return cached


def encode_varints(values: np.ndarray, *, wide: bool = False) -> bytes:
    """Packed varints of int64 ``values``: the shortest form, or 10 bytes each with ``wide``.

    Negative values take 10 bytes either way, as protobuf writes them.
    """
    flat = np.ascontiguousarray(values, dtype=np.int64).reshape(-1).view(np.uint64)
    if wide:
        if flat.size <= 4:
            return b"".join(wide_varint(int(v)) for v in flat)
        groups = ((flat[:, None] >> _SHIFTS) & np.uint64(0x7F)).astype(np.uint8)
        groups[:, :-1] |= 0x80
        return groups.tobytes()
    if flat.size <= 8:  # a label or a short vector: Python beats numpy's per-call cost
        return b"".join(varint(int(v)) for v in flat)
    nbytes = 1 + (flat[:, None] >= _VARINT_LIMITS).sum(axis=1)
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.empty(int(ends[-1]), np.uint8)
    for k in range(MAX_VARINT_BYTES):
        has = nbytes > k
        if not has.any():
            break
        group = ((flat[has] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        group |= np.where(nbytes[has] > k + 1, 0x80, 0).astype(np.uint8)
        out[starts[has] + k] = group
    return out.tobytes()


def varint_count(payload: bytes) -> int:
    """The number of values in the packed varints ``payload``, checked the way a protobuf
    parser checks them, at C speed per record (readers check each record as they place it).

    Raises:
        ValueError: the last varint does not end, or a varint runs past 10 bytes.
    """
    if not payload:
        return 0
    if payload[-1] & 0x80:
        raise ValueError("an int64_list varint does not end")
    values = len(payload.translate(None, _CONTINUATION))  # one byte per varint has no continuation bit
    if len(payload) - values >= MAX_VARINT_BYTES and _TOO_LONG.search(payload):
        raise ValueError("an int64_list varint runs past 10 bytes")
    return values


def wide_varint_rows_ok(rows: np.ndarray) -> np.ndarray:
    """Per row of ``rows`` (uint8, ``(records, 10 * values)``), whether it holds only 10-byte
    varints (:func:`wide_varint`), as a fixed-layout record's ``int64_list`` payload must."""
    groups = rows.reshape(rows.shape[0], -1, MAX_VARINT_BYTES)
    return (groups[:, :, :-1] >= 0x80).all(axis=(1, 2)) & (groups[:, :, -1] < 0x80).all(axis=1)


def decode_varint_rows(rows: np.ndarray, lengths: np.ndarray, count: int) -> np.ndarray:
    """Decode packed varints row by row: ``count`` int64 values from each row's first ``lengths`` bytes.

    One batch of records per call: every record's payload bytes sit in one row of
    ``rows`` (uint8, ``(records, width)``), the rest of the row is ignored.

    Returns:
        An int64 array ``(records, count)``.

    Raises:
        ValueError: a row holds another number of values, a varint longer than 10 bytes,
            or a last varint that does not end; the message names the row.
    """
    records = rows.shape[0]
    if records == 0 or count == 0:
        if count == 0 and records and np.any(lengths[:records]):
            raise ValueError(f"row {int(np.flatnonzero(lengths[:records])[0])} holds values, 0 expected")
        return np.zeros((records, count), np.int64)
    width = rows.shape[1]
    lengths = np.asarray(lengths[:records], dtype=np.int64)
    if width and bool(np.all(lengths == count)) and not np.any(rows[:, :count] & 0x80):
        return rows[:, :count].astype(np.int64)  # every value below 128: the usual label
    wide = count * MAX_VARINT_BYTES
    if width >= wide and bool(np.all(lengths == wide)):  # growcache's 10-byte varints
        groups = rows[:, :wide].reshape(records, count, MAX_VARINT_BYTES)
        if np.all(groups[:, :, :-1] & 0x80) and not np.any(groups[:, :, -1] & 0x80):
            parts = (groups & 0x7F).astype(np.uint64) << _SHIFTS
            return np.bitwise_or.reduce(parts, axis=2).view(np.int64)
    columns = np.arange(width)
    valid = columns < lengths[:, None]
    ends = valid & (rows < 0x80)
    per_row = ends.sum(axis=1)
    last_ends = lengths > 0
    last_ends[last_ends] = ends[last_ends.nonzero()[0], lengths[last_ends] - 1]
    bad = (per_row != count) | ~last_ends
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"row {row} holds {int(per_row[row])} varint values"
                         f"{'' if last_ends[row] else ' and an unterminated one'}, {count} expected")
    # Position of each byte inside its varint: distance from the end of the previous varint.
    previous_end = np.where(ends, columns, -1)
    previous_end = np.maximum.accumulate(np.concatenate([np.full((records, 1), -1), previous_end[:, :-1]], axis=1),
                                         axis=1)
    position = columns - previous_end - 1
    if np.any(valid & (position >= MAX_VARINT_BYTES)):
        raise ValueError("a varint runs past 10 bytes")
    flat_bytes = rows[valid].astype(np.uint64)
    shifts = (position[valid] * 7).astype(np.uint64)
    parts = (flat_bytes & np.uint64(0x7F)) << shifts
    firsts = np.flatnonzero(position[valid] == 0)
    values = np.bitwise_or.reduceat(parts, firsts)
    return values.view(np.int64).reshape(records, count)
