"""Vectored reads and writes that finish however the kernel splits them.

``os.preadv``/``os.writev`` take at most ``IOV_MAX`` buffers per call and may return short (a
signal, a file that ended): each caller would otherwise loop over the remainder its own way.
One owner here keeps the resume-inside-a-buffer arithmetic in one place.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

#: Buffers per ``preadv``/``writev`` call: Linux's UIO_MAXIOV (POSIX guarantees only 16, but no
#: platform growcache runs on has fewer than 1024).
IOV_MAX = 1024


def _bytes(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B") if view.nbytes else memoryview(b"")  # cast() refuses zeros in the shape


def _rest(buffers: Sequence[Any], done: int) -> list[Any]:
    """What is left of ``buffers`` after their first ``done`` bytes, from the first buffer
    with a byte left (empty buffers before it are dropped, so a call that moved nothing
    because its buffers were all empty still makes progress). Only the buffers ``done``
    reaches are measured; the rest are passed on as they are."""
    index = 0
    while index < len(buffers) and done >= (size := _bytes(buffers[index]).nbytes):
        done -= size
        index += 1
    rest = list(buffers[index:])
    if done:  # a short transfer ended inside this buffer: go on from there
        rest[0] = _bytes(rest[0])[done:]
    return rest


def write_all(fd: int, buffers: Sequence[Any], nbytes: int) -> None:
    """Write ``buffers`` (``nbytes`` in all), in order, at ``fd``'s position."""
    while nbytes:
        written = os.writev(fd, buffers[:IOV_MAX])
        nbytes -= written
        if nbytes:  # rare for regular files: more than IOV_MAX buffers, or a short write
            buffers = _rest(buffers, written)


def pread_into(fd: int, buffers: Sequence[Any], offset: int, nbytes: int) -> int:
    """Fill ``buffers`` (``nbytes`` in all) from byte ``offset`` of ``fd`` on; return the bytes
    read, fewer than ``nbytes`` only where the file ends (it may have shrunk since it was opened)."""
    total = 0
    while total < nbytes:
        got = os.preadv(fd, buffers[:IOV_MAX], offset + total)
        if not got and any(_bytes(b).nbytes for b in buffers[:IOV_MAX]):
            break  # the end of the file
        total += got
        if total < nbytes:
            buffers = _rest(buffers, got)
    return total
