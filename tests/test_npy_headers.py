"""Odd ``.npy`` headers give NpyWindowSource a SourceError that names the file and the fix,
never a bare ValueError from numpy or the store (issue 32)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from growcache import SourceError
from growcache.sources import NpyWindowSource


def write_npy(path, header: str, data: bytes = bytes(64)) -> str:
    """A version 1.0 ``.npy`` file with exactly this header text, as a damaged or hostile writer leaves it."""
    text = header.encode("latin-1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data)
    return str(path)


def _header(descr: str, shape: str) -> str:
    return f"{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}"


@pytest.mark.parametrize(("descr", "shape", "message"), [
    # Shapes whose byte count wraps numpy's int64 product (to 0, or negative).
    ("'<f4'", f"(4, {2**62}, {2**62})", r"describes more bytes than any file can hold"),
    ("'<f4'", f"(4, {2**40}, {2**30})", r"describes more bytes than any file can hold"),
    ("'<f8'", f"(4, {2**61})", r"describes more bytes than any file can hold"),
    ("'<f4'", f"({2**70}, 3)", r"describes more bytes than any file can hold"),
    ("'<f4'", f"(0, {2**62}, 8)", r"describes more bytes than any file can hold"),
    # Shapes that are not a tuple of non-negative integers.
    ("'<f4'", "(4, -3)", r"damaged \.npy header: its shape \(4, -3\) is not a tuple of non-negative integers"),
    ("'<f4'", "(8.5, 2)", r"its shape \(8\.5, 2\) is not a tuple"),
    ("'<f4'", "(True, 2)", r"its shape \(True, 2\) is not a tuple"),
    ("'<f4'", "'8'", r"its shape '8' is not a tuple"),
    # Dtypes a cache cannot store.
    ("'|V8'", "(8,)", r"holds dtype \|V8, which a cache cannot store .*use one of"),
    ("'|V0'", "(8,)", r"holds dtype \|V0, which a cache cannot store"),
    ("[('a', '<f4'), ('b', '|V4')]", "(8,)", r"holds dtype \[\('a', '<f4'\), \('b', 'V4'\)\], which a cache cannot"),
    ("'<U4'", "(8, 2)", r"holds dtype <U4, which a cache cannot store"),
    ("'<M8[s]'", "(8, 2)", r"holds dtype datetime64\[s\], which a cache cannot store"),
])
def test_an_odd_npy_header_names_the_file_and_the_fix(tmp_path, descr, shape, message):
    path = write_npy(tmp_path / "odd.npy", _header(descr, shape))
    source = NpyWindowSource(path, 2)
    with pytest.raises(SourceError, match=message) as info:
        source.sample(np.random.default_rng(0))
    assert path in str(info.value) and "Re-save the array" in str(info.value)
    assert info.value.__cause__ is None or isinstance(info.value.__cause__, (ValueError, SyntaxError, TypeError))


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "|b1", "<c8", "|u1"])
def test_ordinary_npy_files_still_sample(tmp_path, dtype):
    array = (np.arange(10 * 3) % 2).astype(dtype).reshape(10, 3)
    np.save(tmp_path / "a.npy", array)
    window = NpyWindowSource(str(tmp_path / "a.npy"), 4).sample(np.random.default_rng(1))["x"]
    first = next(i for i in range(7) if np.array_equal(array[i:i + 4], window))
    assert window.shape == (4, 3) and np.array_equal(window, array[first:first + 4])
    empty_rows = np.zeros((5, 0), np.float32)
    np.save(tmp_path / "b.npy", empty_rows)
    assert NpyWindowSource(str(tmp_path / "b.npy"), 2).sample(np.random.default_rng(1))["x"].shape == (2, 0)
