"""Random damage to a cache's shards, shared by the property tests of every reader
(``test_bad_inputs.py``, ``torch/test_hostile_shards.py``, ``tf/test_hostile_shards.py``).

Imports neither torch, nor TensorFlow, nor the ``tfrecord`` package.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ID_SCHEMA, write_shards
from growcache import Cache
from growcache.transport import SEGMENT_PREFIX


def leftovers() -> set[str]:
    """What a reader of this process can leave behind: its live child processes (DataLoader
    workers) and its shared-memory slabs (``/dev/shm/growcache-<pid>-*``)."""
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == me and fields[0] not in (b"Z", b"X"):
            found.add(f"child process {entry}")
    mine = (f"{SEGMENT_PREFIX}v2-{me}-", f"{SEGMENT_PREFIX}{me}-")  # transport.segment_name, and before v2
    found.update(f"slab {n}" for n in os.listdir("/dev/shm") if n.startswith(mine))
    return found


def left_behind(before: set[str], timeout: float = 10.0) -> set[str]:
    """What appeared since ``before`` and is still there after ``timeout`` s (exits take a moment)."""
    deadline = time.monotonic() + timeout
    while (extra := leftovers() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return extra


def check_failing_examples_leave_nothing_behind(root_factory, read_failing) -> None:
    """Run a property test whose every example fails while ``read_failing(cache)`` reads, and
    check that it leaves no process, slab or lease behind.

    Hypothesis shrinks (a few steps over one integer) and replays the smallest example, as it
    would on a real regression, keeping each failure's traceback meanwhile.
    """
    before, caches = leftovers(), []

    @settings(max_examples=3, deadline=None, database=None)
    @given(shards=st.integers(1, 4))
    def failing(shards):
        cache = Cache(root_factory.mktemp("c") / "cache", capacity="1GB", schema=ID_SCHEMA)
        caches.append(cache)
        write_shards(cache, [6] * shards)
        read_failing(cache)

    with pytest.raises(AssertionError, match="planted failure"):
        failing()
    assert len(caches) > 1, "hypothesis shrank: several examples failed"
    assert not left_behind(before), "a failing example left its reader's processes or slabs behind"
    # A resume pin outlives a failed epoch by design (growcache.resume: a crashed run restarts from
    # its checkpoint); the leases of running readers must not.
    kept = [c.path for c in caches if [lease for lease in c._manifest.live_leases() if "until" not in lease]]
    assert kept == [], "a failing example kept its epoch's lease"


def damage_shards(cache: Cache, data) -> set[str]:
    """Write random bytes over random regions of random shards (some cut short or grown);
    return the paths whose bytes changed."""
    shards = cache.list_shards()
    chosen = data.draw(st.lists(st.sampled_from(shards), min_size=1, max_size=len(shards), unique=True))
    changed = set()
    for shard in chosen:
        original = open(shard.path, "rb").read()
        blob = bytearray(original)
        for _ in range(data.draw(st.integers(1, 3))):
            start = data.draw(st.integers(0, len(blob) - 1))
            patch = data.draw(st.binary(min_size=1, max_size=48))
            blob[start:start + len(patch)] = patch
        ending = data.draw(st.sampled_from(["keep", "cut", "grow"]))
        if ending == "cut":
            del blob[data.draw(st.integers(0, len(blob) - 1)):]
        elif ending == "grow":
            blob += data.draw(st.binary(min_size=1, max_size=64))
        with open(shard.path, "wb") as f:
            f.write(blob)
        if bytes(blob) != original:
            changed.add(shard.path)
    return changed


def damaged_cache(root: str, data) -> tuple[Cache, set[str], dict[str, list[int]]]:
    """A cache of 4 shards of 6 records whose ids say their payload, randomly damaged:
    ``(cache, damaged paths, record ids of every shard)``."""
    cache = Cache(root, capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [6] * 4)
    ids = {s.path: list(range(6 * i, 6 * i + 6)) for i, s in enumerate(cache.list_shards())}
    return cache, damage_shards(cache, data), ids
