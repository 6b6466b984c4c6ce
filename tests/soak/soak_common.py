"""What the soak's processes share: the records, their source, and the reader loop.

Every record carries a unique id (``uid``, drawn from the sampler's RNG), the id of the S3
object it came from (``obj``), the object's payload ``x`` and a checksum ``sum`` (CRC32C of
``x``, computed by the sampler). Payloads are derived from object ids, so a reader checks
every record against :func:`expected_sum` without any second channel.

This module is imported by the pytest process, by spawned sampler workers (to unpickle
:class:`SoakSource`), and by both reader processes; it imports neither torch, nor
TensorFlow, nor the ``tfrecord`` package.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from growcache.cache import Cache
from growcache.records import crc32c
from growcache.snapshot import Snapshot
from growcache.sources import ObjectSource, RetryPolicy, Source

SCHEMA = {"uid": ("int64", ()), "obj": ("int64", ()), "sum": ("int64", ()), "x": ("float32", (16, 64))}
OBJECTS = 256
PREFIX = "soak"
STOP, KILL_LOADER_WORKER = "stop", "kill-loader-worker"


def payload(obj: int) -> np.ndarray:
    """The content of S3 object ``obj``."""
    return np.random.default_rng(obj).standard_normal((16, 64)).astype(np.float32)


def object_name(obj: int) -> str:
    return f"{PREFIX}/{obj:06d}.bin"


_SUMS: dict[int, int] = {}


def expected_sum(obj: int) -> int:
    if obj not in _SUMS:
        _SUMS[obj] = crc32c(payload(obj).tobytes())
    return _SUMS[obj]


def decode_object(data: bytes, path: str) -> dict[str, np.ndarray]:
    """ObjectSource decoder: the object id comes from its name, the payload from its bytes."""
    obj = int(os.path.basename(path).split(".")[0])
    x = np.frombuffer(data, dtype="<f4").reshape(16, 64)
    return {"obj": np.int64(obj), "x": x}


class SoakSource(Source):
    """Random whole objects from the S3 server, each given a fresh unique id and a checksum."""

    def __init__(self, bucket_url: str, storage_options: dict[str, Any]) -> None:
        # Patient retries: the store is stopped for seconds during the run.
        retry = RetryPolicy(attempts=60, initial_delay=0.05, max_delay=0.5)
        self.objects = ObjectSource(f"{bucket_url}/{PREFIX}/*.bin", decoder=decode_object,
                                    storage_options=storage_options, retry=retry)

    def sample(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        sample = self.objects.sample(rng)
        sample["uid"] = np.int64(rng.integers(2**62))
        sample["sum"] = np.int64(crc32c(sample["x"].tobytes()))
        return sample

    def redact(self, text: str) -> str:
        return self.objects.redact(text)


def payload_mismatches(uid: np.ndarray, obj: np.ndarray, sums: np.ndarray, x: np.ndarray) -> int:
    """Records of a batch whose payload does not match its checksum or its object."""
    bad = 0
    for o, s, row in zip(obj.tolist(), sums.tolist(), x):
        if crc32c(np.ascontiguousarray(row).tobytes()) != s or s != expected_sum(o):
            bad += 1
    return bad + int(len(uid) != len(obj))


# -- process bookkeeping ----------------------------------------------------------------------
def shm_mappings(pids: Iterable[int]) -> set[str]:
    """Names under /dev/shm that the processes ``pids`` have mapped now."""
    names = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        names.add(line.split("/dev/shm/", 1)[1].split()[0])
        except OSError:
            pass
    return names


def shm_inodes(pids: Iterable[int]) -> set[int]:
    """Inodes of the /dev/shm files that the processes ``pids`` have mapped now. By inode: a
    named semaphore is mapped under the temporary name glibc created it by."""
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                inodes.update(int(line.split()[4]) for line in f if "/dev/shm/" in line)
        except (OSError, ValueError, IndexError):
            pass
    return inodes


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``None`` once it is gone): with the pid,
    it names one process, never a later one that the kernel gave the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def rss(pid: int) -> int:
    """Resident bytes of ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def children(pid: int) -> list[int]:
    """Live descendants of ``pid``."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


class RecordingCache(Cache):
    """A cache that remembers every snapshot it hands out: the adapters take their epochs'
    snapshots through it, so a reader knows exactly what each epoch had to deliver."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.taken: list[list[int]] = []

    def snapshot(self, **kwargs: Any) -> Snapshot:
        snapshot = super().snapshot(**kwargs)
        self.taken.append([s.seq for s in snapshot])
        return snapshot


# -- the reader loop, shared by the torch and TF readers -------------------------------------
class Abandon(Exception):
    """Raised by a reader's ``inject`` to drop the current epoch from the figures."""


class Reader:
    """Runs epochs until told to stop, and writes one JSON line per epoch and per event.

    Args:
        name: ``"torch"`` or ``"tf"``.
        cache: the cache, whose snapshots tell what each epoch had to deliver.
        control: directory of control files written by the soak test.
        out: file to append JSON lines to.
    """

    def __init__(self, name: str, cache: RecordingCache, control: str, out: str) -> None:
        self.name = name
        self.cache = cache
        self.control = control
        self.out = open(out, "a", buffering=1)
        self.parent = os.getppid()
        self.seen_children: set[tuple[int, int]] = set()  # (pid, start time)
        self.seen_shm: set[str] = set()

    def emit(self, **fields: Any) -> None:
        self.out.write(json.dumps({"reader": self.name, **fields}) + "\n")

    def flag(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.control, name))

    def done(self, name: str) -> None:
        open(os.path.join(self.control, f"{name}.done"), "w").close()

    def stopping(self) -> bool:
        return self.flag(STOP) or os.getppid() != self.parent

    def _watch(self) -> dict[str, int]:
        kids = children(os.getpid())
        self.seen_children.update((pid, start) for pid in kids if (start := start_time(pid)) is not None)
        self.seen_shm |= shm_mappings([os.getpid(), *kids])
        return {str(pid): rss(pid) for pid in [os.getpid(), *kids]}

    def run(self, epoch: Callable[[], Iterator[dict[str, np.ndarray]]], new_skips: Callable[[], list],
            refused: tuple[type[BaseException], ...], inject: Callable[[int], None] | None = None) -> None:
        """Read epochs with ``epoch()`` (batches as dicts of numpy arrays) until stopped.

        ``new_skips()`` returns ``(path, offset, records skipped)`` of corrupt shards skipped
        since the last call; an error of a type in ``refused`` whose message says the disk
        is full ends an epoch before it read anything, and is retried; ``inject(batch)``
        runs after every batch, and may raise :class:`Abandon`.
        """
        number = 0
        while not self.stopping():
            t0 = time.monotonic()
            taken = len(self.cache.taken)
            uids: list[np.ndarray] = []
            mismatches = 0
            try:
                for i, batch in enumerate(epoch()):
                    uids.append(np.asarray(batch["uid"]).copy())
                    mismatches += payload_mismatches(batch["uid"], batch["obj"], batch["sum"], batch["x"])
                    if inject is not None:
                        inject(i)
            except Abandon:
                continue  # ``inject`` broke this epoch on purpose: it is not counted
            except refused as exc:
                if "is full" not in str(exc) or uids:
                    raise
                self.emit(event="snapshot_refused", error=str(exc)[:300])
                time.sleep(0.2)
                continue
            self.emit(epoch=number, snapshots=self.cache.taken[taken:],
                      uids=np.concatenate(uids).tolist() if uids else [], skipped=new_skips(),
                      mismatches=mismatches, rss=self._watch(), seconds=time.monotonic() - t0)
            number += 1
        self._watch()
        self.emit(event="done", epochs=number, children=sorted(self.seen_children), shm=sorted(self.seen_shm))
        self.out.close()
