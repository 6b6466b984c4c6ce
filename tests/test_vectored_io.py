"""growcache._vectored_io: the one owner of vectored reads and writes that go on where the
kernel stopped (more buffers than one call takes, a transfer that ends inside a buffer)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from growcache._vectored_io import IOV_MAX, _rest, pread_into, write_all


def _pieces(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Bytes and float32 rows alike: writers hand over numpy payloads of any dtype.
    return [rng.integers(0, 256, n, dtype=np.uint8) if i % 2 else
            rng.standard_normal(n // 4 + 1).astype(np.float32) for i, n in enumerate(sizes)]


def _joined(buffers: list) -> bytes:
    return b"".join(memoryview(b).tobytes() for b in buffers)


def _written_and_read_back(tmp_path, pieces: list[np.ndarray]) -> list[np.ndarray]:
    """Write ``pieces`` to a file with write_all, check its bytes, and read them back with pread_into."""
    nbytes = sum(p.nbytes for p in pieces)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_all(fd, pieces, nbytes)
    finally:
        os.close(fd)
    assert path.read_bytes() == _joined(pieces)
    targets = [np.empty_like(p) for p in pieces]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_into(fd, targets, 0, nbytes) == nbytes
    finally:
        os.close(fd)
    return targets


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=8).filter(sum), data=st.data())
def test_what_is_left_after_a_short_transfer_is_exactly_the_untransferred_bytes(sizes, data):
    # Transfers that end inside a buffer, on a boundary, or before empty buffers.
    buffers = [bytes(range(7 * i, 7 * i + n)) for i, n in enumerate(sizes)]
    done = data.draw(st.integers(1, sum(sizes) - 1)) if sum(sizes) > 1 else 0
    rest = _rest(buffers, done)
    assert b"".join(bytes(r) for r in rest) == b"".join(buffers)[done:]


def test_more_buffers_than_one_call_takes_are_written_and_read_back_in_order(tmp_path):
    pieces = _pieces([3 + i % 17 for i in range(2 * IOV_MAX + 5)])
    for piece, target in zip(pieces, _written_and_read_back(tmp_path, pieces)):
        np.testing.assert_array_equal(piece, target)


@pytest.mark.parametrize("ends_at", [0, 5, IOV_MAX * 4 + 2, IOV_MAX * 8 - 1])
def test_a_read_past_the_end_of_the_file_fills_what_exists_and_says_how_much(tmp_path, ends_at):
    # A file cut since it was opened: the caller learns where it ends, not an exception.
    content = bytes(i % 251 for i in range(ends_at))
    path = tmp_path / "f"
    path.write_bytes(content)
    targets = [bytearray(8) for _ in range(IOV_MAX + 3)]  # past IOV_MAX: the cut may be in the second call
    fd = os.open(path, os.O_RDONLY)
    try:
        got = pread_into(fd, targets, 0, 8 * len(targets))
    finally:
        os.close(fd)
    assert got == ends_at
    assert b"".join(targets)[:got] == content


def test_a_read_starts_at_its_offset(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    first, second = bytearray(3), bytearray(4)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_into(fd, [first, second], 40, 7) == 7
    finally:
        os.close(fd)
    assert bytes(first + second) == bytes(range(40, 47))


@pytest.mark.timeout(30)  # a loop that takes an empty call for no progress spins
def test_more_empty_buffers_than_one_call_takes_are_stepped_over(tmp_path):
    # A call over only empty buffers moves nothing; that is neither the end of the file nor a
    # write to retry forever (a schema of many zero-size features makes such runs).
    pieces = [np.empty(0, np.uint8), np.empty((0, 4), np.float32)] * (IOV_MAX // 2 + 4) + _pieces([5, 9])
    assert _joined(_written_and_read_back(tmp_path, pieces)) == _joined(pieces)
