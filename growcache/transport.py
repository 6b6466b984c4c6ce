"""Shared-memory batch transport: reusable slabs, zero-copy views, a safe release protocol.

Passing a batch between processes the ordinary way (a new shared-memory segment per
batch, or a pickle) costs an allocation, page faults and a file-descriptor pass per batch,
which caps a 2-core machine far below its memory bandwidth. Here each reader process
owns one :class:`Slab`, created and pre-faulted once, split into a ring of fixed-size
*slots*; a batch is written into a free slot and only a tiny :class:`SlotHandle` crosses
the process boundary. Framework-neutral (numpy and ``multiprocessing.shared_memory``), so
any adapter can use it: the consumer turns the handle into numpy views with
:meth:`Slab.open` and wraps them in its framework's zero-copy constructor.

Release protocol
----------------
Each slot has one 64-bit state word in the slab's header page: ``0`` = free, otherwise
the *token* of the batch in it. Only two transitions exist, and each has one writer:

* the producer, in :meth:`Slab.acquire`, turns a free slot into ``token`` (tokens are
  unique per slab: ``generation << 32 | counter``, with a fresh generation per epoch);
* the consumer turns ``token`` back into ``0`` when the batch is released, and only if
  the word still holds *its* token (a stale release cannot free a reused slot).

The consumer's arrays are views whose base is a :class:`_SlotLease` object; the slot is
released when the last view of the batch (and any tensor built on one) is garbage
collected, so a slot is never overwritten while the consumer still holds data on it.
``copy=True`` instead copies the batch out at memcpy speed and releases at once.

A consumer that *keeps* batches (appends them to a list) would starve the producer, so
:meth:`Slab.acquire` never blocks for long: with every slot held it returns ``None`` and
the producer sends that batch by ordinary means (slower, never a deadlock). A ring of
``prefetch + 2`` slots suffices for the usual ``for batch in loader`` loop: ``prefetch``
batches in flight, one in the consumer's hands and one spare while the loop variable is
rebound.

Batches that were sent but never opened (an epoch abandoned mid-way, whose in-flight
batches the loader discards) leave their slots marked. At the next epoch the consumer
sends :meth:`Slab.held_tokens` (the batches it really holds) and the producer frees every
other slot with :meth:`Slab.reclaim` before producing.

Cleanup
-------
``anonymous=True`` (for ``fork``-started readers) maps ``MAP_SHARED | MAP_ANONYMOUS``
memory: it has no name, so nothing can leak whoever is killed; the kernel frees it with
the last mapping. Named slabs (for ``spawn``/``forkserver`` readers) are created by the
consumer process with :class:`multiprocessing.shared_memory.SharedMemory`, so a reader
killed by SIGKILL leaks nothing (it owns no name); the consumer unlinks them in
:meth:`Slab.unlink` (called by its owner's finalizer), and Python's resource tracker
unlinks them if the consumer itself is killed.

A kill of the whole process group (``scancel``, ``docker kill``, an OOM kill of the
cgroup) takes the resource tracker with the consumer. So the next growcache process to
create a slab, open a cache or prune one removes every growcache segment that no process
maps (:func:`remove_dead_segments`). The evidence is a lock, never an age: every process
that maps a named slab holds a shared ``flock`` on it for as long as it does (the kernel
drops it when the process exits, however it dies), and a segment is removed only under an
exclusive, non-blocking ``flock``. Locks live in the segment's inode, so they hold across
jobs with different settings and across containers that share ``/dev/shm`` with pid
namespaces of their own. The name, ``growcache-v2-<pid>-<start time>-<process table>-<token>``,
still names the owner, for the instant between its creation and its first lock.

Space
-----
A named slab is reserved with ``posix_fallocate`` before it is touched. ``/dev/shm`` is a
tmpfs, often of 64 MB in a container, and a page of a segment that does not fit there is
not refused at creation: the first touch of it kills the process with ``SIGBUS``.
:func:`make_slabs` gives readers fewer slots when all of them do not fit, and raises
:class:`~growcache.errors.SharedMemoryFullError` only when one batch per reader does not.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, NamedTuple

import numpy as np

from . import _proc
from ._size import format_size
from .errors import SharedMemoryFullError

__all__ = ["BatchLayout", "COPY_BELOW", "SharedMemorySpace", "Slab", "SlotHandle", "aligned_empty", "make_slabs",
           "remove_dead_segments"]

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "growcache-"
# v2: every process that maps the segment holds a shared flock on it. Sweepers of older versions
# match only the legacy names, so they never judge a v2 segment by its age.
_SEGMENT_NAME = re.compile(r"^growcache-v2-([0-9]+)-([0-9]+)-([0-9a-f]+)-[0-9a-f]+$")
_LEGACY_NAME = re.compile(r"^growcache-([0-9]+)-([0-9]+)-([0-9a-f]+)-[0-9a-f]+$")
_SHM_DIR = "/dev/shm"


def segment_name() -> str:
    """A new name for a shared-memory segment that says which process of which machine owns it."""
    pid, start = _proc.this_process()
    return f"{SEGMENT_PREFIX}v2-{pid}-{start or 0}-{_proc.this_host()}-{os.urandom(6).hex()}"


def remove_dead_segments(shm_dir: str = _SHM_DIR) -> list[str]:
    """Remove growcache's shared-memory segments that no process maps; return their names.

    A segment is live while any process holds the shared ``flock`` that every process mapping
    it takes, whatever its age, its owner's process table or this job's settings; it is
    removed under an exclusive ``flock``. Segments of other programs, and of
    ``multiprocessing`` or torch under random names, are never touched. Segments of older
    growcache versions (which take no lock) are removed only when their owner is in this
    process table and dead.
    """
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:  # no /dev/shm on this platform
        return []
    removed = []
    for entry in entries:
        match = _SEGMENT_NAME.match(entry.name)
        if match is not None:
            pid, start, host = int(match[1]), int(match[2]) or None, match[3]
            if _remove_unmapped(entry.path, pid, start, host):
                removed.append(entry.name)
            continue
        match = _LEGACY_NAME.match(entry.name)
        # Another table's legacy segment has no evidence of its owner's death but an age: leave it.
        if match is None or match[3] != _proc.this_host() or _proc.is_alive(int(match[1]), int(match[2]) or None):
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            pass
    if removed:
        logger.info("removed %d shared-memory segments that no process maps: %s", len(removed), ", ".join(removed))
    return removed


def _remove_unmapped(path: str, pid: int, start: int | None, host: str) -> bool:
    """Unlink the segment at ``path`` if no process holds its lock; whether it did."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone, a link, or another user's
        return False
    try:
        held = os.fstat(fd)
        if not stat.S_ISREG(held.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # some process maps it
        # Unlocked, yet its owner in this table lives: created an instant ago, not locked yet.
        # (An owner in another table checks that its name survived its first lock.)
        if host == _proc.this_host() and _proc.is_alive(pid, start):
            return False
        if os.stat(path, follow_symlinks=False).st_ino != held.st_ino:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the exclusive lock


class SharedMemorySpace:
    """Where named slabs take their memory (``/dev/shm``): its size, and reservations in it.

    The one interface between slabs and the space they need, so that a test can stand in a
    smaller ``/dev/shm``.
    """

    path = _SHM_DIR

    def reserve(self, fd: int, nbytes: int) -> None:
        """Allocate the first ``nbytes`` of the segment open on ``fd`` now.

        Raises:
            OSError: ``ENOSPC`` when they do not fit. tmpfs undoes a partial allocation.
        """
        if hasattr(os, "posix_fallocate"):  # not on macOS, which has no /dev/shm to fill either
            os.posix_fallocate(fd, 0, nbytes)

    def usage(self) -> tuple[int, int]:
        """``(size, free bytes)``; ``(0, 0)`` where they cannot be read."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return 0, 0
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


#: The ``/dev/shm`` that named slabs are made in, unless a caller passes another space.
SHARED_MEMORY = SharedMemorySpace()
_SPACE_FIXES = (
    "give the container more shared memory (docker run --shm-size=2g; Kubernetes: an emptyDir volume with "
    "medium: Memory and a sizeLimit, mounted at /dev/shm), lower batch_size, or use fork-started workers "
    "(multiprocessing_context=\"fork\"), whose batches take nothing from /dev/shm")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def make_slabs(layout: BatchLayout, slots: int, count: int, *, anonymous: bool,
               space: SharedMemorySpace | None = None) -> list[Slab]:
    """``count`` slabs (one per reader, indexed in order) of ``slots`` slots each, or fewer
    slots if that many named slabs do not fit in ``/dev/shm``.

    With fewer slots it logs one warning; each slab keeps at least one. The reservation decides
    what fits (free space is only a first guess: other processes take and free it meanwhile).
    A consumer should then ask for fewer batches in flight: a reader sends a batch by other
    means when every slot of its slab is taken, and those means may need ``/dev/shm`` too.

    Raises:
        SharedMemoryFullError: one slot per reader does not fit.
    """
    space = space or SHARED_MEMORY
    want = int(slots)
    while True:
        made: list[Slab] = []
        try:
            for index in range(count):
                made.append(Slab(layout, want, anonymous=anonymous, index=index, space=space))
        except SharedMemoryFullError as exc:
            while made:  # each goes at once, memory too: no view of it exists yet
                made.pop().unlink()
            size, free = space.usage()
            if want == 1:
                need = count * Slab.bytes_for(layout, 1)
                raise SharedMemoryFullError(
                    errno.ENOSPC,
                    f"{space.path} (size {_mib(size)}, {_mib(free)} free) has no room for one batch per reader: "
                    f"{count} readers need {_mib(need)} ({_mib(layout.slot_nbytes)} per batch, slabs of shared "
                    f"memory that spawn- and forkserver-started workers write batches into). To fix it, "
                    f"use fewer workers (num_workers), or {_SPACE_FIXES}") from exc
            fit = 1
            while fit < want - 1 and count * Slab.bytes_for(layout, fit + 1) <= free:
                fit += 1
            want = fit
            continue
        if want < slots:
            size, free = space.usage()
            logger.warning(
                "%s (size %s, %s free after this) holds %d of the %d batch slots wanted for each of %d readers "
                "(%s per slot): readers prefetch fewer batches, and send the rest by slower means. For all of "
                "them, lower prefetch_factor, or %s", space.path, _mib(size), _mib(free), want, slots, count,
                _mib(layout.slot_nbytes), _SPACE_FIXES)
        return made


PAGE = mmap.PAGESIZE
_ALIGN = 64  # cache line: every feature's array starts aligned
#: Features of at most this many bytes per batch (labels, ids) are copied out of their slot by
#: every adapter (``Slab.open``'s ``copy_below``): users keep those, and a kept view pins a slot.
COPY_BELOW = 256 << 10


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A fresh array whose data starts on a cache line, as a slot's arrays do (TensorFlow takes
    such an array without a copy); the batch memory of a reader that has no free slot."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@dataclass(frozen=True)
class BatchLayout:
    """Where each feature of a batch of ``batch_size`` records lies inside one slot.

    Args:
        features: ``(name, dtype, shape)`` per feature (the per-record shape).
        batch_size: records per batch.

    Attributes:
        offsets: ``{name: byte offset in the slot}``.
        slot_nbytes: bytes of one slot, a multiple of the page size.
    """

    features: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]
    batch_size: int
    offsets: Mapping[str, int]
    slot_nbytes: int

    @classmethod
    def build(cls, features: Iterable[tuple[str, Any, tuple[int, ...]]], batch_size: int) -> BatchLayout:
        """Lay ``features`` out one after another, each aligned to a cache line."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        feats = tuple((name, np.dtype(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in features)
        offsets: dict[str, int] = {}
        pos = 0
        for name, dtype, shape in feats:
            offsets[name] = pos
            pos = _round_up(pos + batch_size * dtype.itemsize * int(np.prod(shape, dtype=np.int64)), _ALIGN)
        return cls(feats, int(batch_size), offsets, max(_round_up(pos, PAGE), PAGE))

    @classmethod
    def from_schema(cls, schema: Any, batch_size: int) -> BatchLayout:
        """Layout for a :class:`growcache.schema.Schema` (duck-typed: name -> spec)."""
        return cls.build(((name, spec.dtype, spec.shape) for name, spec in schema.items()), batch_size)

    def arrays(self, buffer: np.ndarray, records: int) -> dict[str, np.ndarray]:
        """Views of the first ``records`` rows of each feature inside one slot's bytes."""
        out = {}
        for name, dtype, shape in self.features:
            start = self.offsets[name]
            out[name] = buffer[start:start + _nbytes(dtype, shape, records)].view(dtype).reshape((records, *shape))
        return out

    def small(self, records: int, at_most: int) -> set[str]:
        """The features whose first ``records`` rows hold at most ``at_most`` bytes."""
        return {name for name, dtype, shape in self.features if _nbytes(dtype, shape, records) <= at_most}


def _nbytes(dtype: np.dtype, shape: tuple[int, ...], records: int) -> int:
    return records * dtype.itemsize * math.prod(shape)  # np.prod costs 10x on a tuple, per batch


class SlotHandle(NamedTuple):
    """What crosses the process boundary for one batch: a few integers."""

    slab: int  # which slab (reader) the batch is in
    slot: int
    token: int
    records: int


class _SlotLease:
    """Base object of a batch's consumer-side arrays; frees the slot when collected.

    numpy keeps the first non-array base of every view, so every array (and every tensor
    made from one with a zero-copy constructor) keeps this object alive.
    """

    __slots__ = ("__array_interface__", "_slab", "_slot", "_token", "__weakref__")

    def __init__(self, slab: Slab, slot: int, token: int, address: int, nbytes: int) -> None:
        self.__array_interface__ = {
            "data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3,
        }
        self._slab = slab  # keeps the mapping alive as long as any view of the batch
        self._slot = slot
        self._token = token

    def __del__(self) -> None:
        self._slab._release(self._slot, self._token)


class Slab:
    """One reader's ring of batch slots in one shared-memory region.

    Create it in the consumer process, before the reader starts; the reader gets it by
    ``fork`` (``anonymous=True``) or by pickle (named, which attaches by name).

    Args:
        layout: the batch layout every slot holds.
        slots: slots in the ring. Default: ``4``.
        anonymous: use nameless ``MAP_SHARED`` memory, which only ``fork`` can share but
            which can never leak. Default: ``True``.
        index: the slab's number, carried in its handles. Default: ``0``.
        space: where a named slab takes its memory. Default: ``None``:
            :data:`SHARED_MEMORY` (``/dev/shm``).

    Raises:
        SharedMemoryFullError: a named slab does not fit in ``/dev/shm``
            (:func:`make_slabs` then tries fewer slots).
    """

    def __init__(self, layout: BatchLayout, slots: int = 4, *, anonymous: bool = True, index: int = 0,
                 space: SharedMemorySpace | None = None) -> None:
        if slots < 1:
            raise ValueError(f"a slab needs at least one slot, got {slots}")
        self.layout = layout
        self.slots = int(slots)
        self.index = int(index)
        self.anonymous = anonymous
        self.header_nbytes = _round_up(8 * self.slots, PAGE)
        self.nbytes = self.bytes_for(layout, self.slots)
        self._owner_pid = os.getpid()
        self._shm: shared_memory.SharedMemory | None = None
        self._lock_fd: int | None = None
        self._unlinked = False
        if anonymous:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_POPULATE", 0)
            self._map: Any = mmap.mmap(-1, self.nbytes, flags=flags)
            self.name = None
        else:
            remove_dead_segments()  # a loader starts: what killed process groups left goes now
            self._shm, self._lock_fd = _create_segment(self.nbytes, space or SHARED_MEMORY)
            self._map = self._shm.buf
            self.name = self._shm.name
        self._attach()
        self.prefault()
        self._counter = 0
        self._generation = 0
        self._live: dict[int, int] = {}  # consumer side: slot -> token of batches handed out

    @staticmethod
    def bytes_for(layout: BatchLayout, slots: int) -> int:
        """Bytes of a slab of ``slots`` slots of ``layout``: its header page(s) and its slots."""
        return _round_up(8 * slots, PAGE) + slots * layout.slot_nbytes

    def _attach(self) -> None:
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._state = self._bytes[:8 * self.slots].view(np.int64)
        self._address = self._bytes.ctypes.data
        self._prefaulted_in = -1

    # -- pickling (named slabs only) ------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        if self.anonymous:
            raise TypeError(
                "an anonymous Slab can only reach another process by fork; "
                "create it with anonymous=False for spawn or forkserver readers"
            )
        skip = ("_map", "_bytes", "_state", "_shm", "_live", "_lock_fd")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._live = {}
        # Attach without SharedMemory: in Python < 3.13 attaching registers the segment with
        # the resource tracker, which would unlink it when this reader exits.
        fd = _shm_open(self.name)
        try:
            self._map = mmap.mmap(fd, self.nbytes)
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while this process maps it: no sweep removes it
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        self._shm = None
        self._attach()

    # -- both sides -----------------------------------------------------------------------
    def prefault(self) -> None:
        """Touch every slot page once in this process, so no batch ever page-faults.

        Idempotent per process. A forked reader inherits the mapping but not its page
        table entries, so each reader calls this once when it starts.
        """
        if self._prefaulted_in == os.getpid():
            return
        body = self._bytes[self.header_nbytes:]
        # Read, never write: a reader of a later epoch (non-persistent workers) starts while the
        # trainer may still hold batches of the last one in their slots. A read fault on shared
        # memory allocates the page and maps it writable, which is all the hot loop needs.
        int(body[::PAGE].sum(dtype=np.uint64))
        self._prefaulted_in = os.getpid()

    def slot_bytes(self, slot: int) -> np.ndarray:
        """The raw bytes of ``slot``."""
        start = self.header_nbytes + slot * self.layout.slot_nbytes
        return self._bytes[start:start + self.layout.slot_nbytes]

    # -- producer side --------------------------------------------------------------------
    def start_generation(self, generation: int, held: Iterable[tuple[int, int]] = ()) -> None:
        """Begin an epoch: free every slot the consumer does not hold (see :meth:`reclaim`)."""
        self._generation = int(generation) & 0x7FFFFFFF
        self._counter = 0
        self.reclaim(held)

    def reclaim(self, held: Iterable[tuple[int, int]]) -> int:
        """Free every marked slot not in ``held`` (``(slot, token)`` pairs); return how many.

        Only call this while no batch of this slab is in flight, i.e. at an epoch start.
        """
        keep = {int(s): int(t) for s, t in held}
        freed = 0
        for slot in range(self.slots):
            token = int(self._state[slot])
            if token and keep.get(slot) != token:
                self._state[slot] = 0
                freed += 1
        return freed

    def acquire(self, records: int, timeout: float = 0.0) -> tuple[SlotHandle, dict[str, np.ndarray]] | None:
        """Claim a free slot for a batch of ``records`` rows.

        Args:
            records: rows in the batch (at most ``layout.batch_size``).
            timeout: seconds to wait for a slot. Default: ``0.0``.

        Returns:
            ``(handle, arrays to fill)``, or ``None`` when every slot is held: send that
            batch another way rather than wait on a consumer that may never let go.
        """
        if records > self.layout.batch_size:
            raise ValueError(f"{records} records do not fit a slot of {self.layout.batch_size}")
        deadline = None
        while True:
            free = np.flatnonzero(self._state == 0)
            if free.size:
                slot = int(free[0])
                self._counter += 1
                token = (self._generation << 32) | (self._counter & 0xFFFFFFFF)
                self._state[slot] = token
                handle = SlotHandle(self.index, slot, token, int(records))
                return handle, self.layout.arrays(self.slot_bytes(slot), records)
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout
            if now >= deadline:
                return None
            time.sleep(0.0002)

    def give_back(self, handle: SlotHandle) -> None:
        """Free a slot this producer acquired but will not send (it ended up holding no row)."""
        self._release(handle.slot, handle.token)

    # -- consumer side --------------------------------------------------------------------
    def open(self, handle: SlotHandle, *, copy: bool = False, copy_below: int = 0) -> dict[str, np.ndarray]:
        """The batch of ``handle`` as numpy arrays.

        Args:
            handle: from the producer's :meth:`acquire`.
            copy: copy the batch out and free the slot now. Default: ``False``: zero-copy
                views that free the slot when the last of them is garbage collected.
            copy_below: copy out every feature of at most this many bytes in the batch,
                even when ``copy`` is false. Consumers keep small features (labels, ids)
                far more often than large ones, and a kept view pins its whole slot; a
                small copy costs next to nothing. Default: ``0``.
        """
        if int(self._state[handle.slot]) != handle.token:
            raise RuntimeError(
                f"slab {self.index} slot {handle.slot} no longer holds batch {handle.token:#x}: "
                "a batch handle was opened twice or after its epoch ended"
            )
        layout = self.layout
        small = {name for name, _, _ in layout.features} if copy else layout.small(handle.records, copy_below)
        if len(small) == len(layout.features):  # all copied: the slot is free at once
            views = layout.arrays(self.slot_bytes(handle.slot), handle.records)
            out = {k: v.copy() for k, v in views.items()}
            del views
            self._release(handle.slot, handle.token)
            return out
        start = self.header_nbytes + handle.slot * layout.slot_nbytes
        self._live[handle.slot] = handle.token
        lease = _SlotLease(self, handle.slot, handle.token, self._address + start, layout.slot_nbytes)
        shared = layout.arrays(np.asarray(lease), handle.records)
        return {k: v.copy() if k in small else v for k, v in shared.items()}

    def held_tokens(self) -> list[tuple[int, int]]:
        """``(slot, token)`` of the batches this consumer still holds views of."""
        return list(self._live.items())

    def _release(self, slot: int, token: int) -> None:
        # Compare-then-clear: the producer never writes a marked slot, so no lock is needed.
        if self._live.get(slot) == token:
            del self._live[slot]
        if int(self._state[slot]) == token:
            self._state[slot] = 0

    def unlink(self) -> None:
        """Remove a named slab's name (the memory lives on while mapped); idempotent."""
        if self._shm is not None and not self._unlinked and os.getpid() == self._owner_pid:
            self._unlinked = True
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def __del__(self) -> None:
        # No lease is alive (each holds the slab), so no view of the memory is either:
        # drop our own arrays before closing, or SharedMemory.close() sees exported buffers.
        try:
            self.unlink()
            self._state = self._bytes = self._map = None
            if self._shm is not None:
                self._shm.close()
            if self._lock_fd is not None:  # unmapped above: the lock may go
                os.close(self._lock_fd)
                self._lock_fd = None
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass


def _create_segment(nbytes: int, space: SharedMemorySpace) -> tuple[shared_memory.SharedMemory, int]:
    """A new named segment of ``nbytes``, reserved in ``space``; and an fd holding its shared lock.

    Raises:
        SharedMemoryFullError: the segment does not fit (nothing of it is left behind).
    """
    for _ in range(3):
        # Created by SharedMemory, so that the resource tracker unlinks it if this process dies.
        shm = shared_memory.SharedMemory(name=segment_name(), create=True, size=nbytes)
        path = os.path.join(_SHM_DIR, shm.name)
        fd = None
        try:
            fd = _shm_open(shm.name)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a sweeper's exclusive lock: an instant
            # Another table's sweeper judges by the lock alone: between the creation and the lock
            # it may have removed the name. Then the segment is lost; make another.
            kept = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            kept = False
        except BaseException:
            _discard(shm, fd, unlink=True)
            raise
        if not kept:
            _discard(shm, fd, unlink=False)
            continue
        try:
            space.reserve(fd, nbytes)  # ENOSPC here, rather than SIGBUS at the first touch
        except OSError as exc:
            _discard(shm, fd, unlink=True)
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            size, free = space.usage()
            raise SharedMemoryFullError(
                errno.ENOSPC, f"{space.path} (size {_mib(size)}, {_mib(free)} free) has no room for a slab of "
                f"{_mib(nbytes)}: {_SPACE_FIXES}") from exc
        return shm, fd
    raise RuntimeError(f"three shared-memory segments in a row were removed from {_SHM_DIR} as they were made: "
                       "is another program removing growcache's segments?")


def _discard(shm: shared_memory.SharedMemory, fd: int | None, *, unlink: bool) -> None:
    if fd is not None:
        os.close(fd)
    shm.close()
    if unlink:
        shm.unlink()
    else:  # the name is gone already: only the tracker's note of it remains
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def _shm_open(name: str) -> int:
    """Open an existing POSIX shared-memory segment by name; return its fd."""
    import _posixshmem  # the module multiprocessing.shared_memory itself uses

    return _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
