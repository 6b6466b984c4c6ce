"""Several processes publish, evict and snapshot one cache at once."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from growcache import Cache
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.shard import TMP_PREFIX

from conftest import ID_SCHEMA, id_sample

RECORDS_PER_SHARD = 5
WRITERS = 3
# Every process works until all have done their minimum (writers: shards published; then the
# evictor's rounds; then the snapshotter's snapshots), so that each overlaps all the others by
# at least that much work however slowly any of them starts: counts, not seconds.
MINIMUM = (8,) * WRITERS + (20, 10)
EVICTOR, SNAPSHOTTER = WRITERS, WRITERS + 1


def _racing(progress, stop) -> bool:
    return not stop.is_set() and any(progress[i] < n for i, n in enumerate(MINIMUM))


def _shard_bytes() -> int:
    return RECORDS_PER_SHARD * (ExampleCodec(ID_SCHEMA).record_nbytes + 16)


def _writer(path: str, index: int, results, progress, stop) -> None:
    cache = Cache(path)
    published = 0
    while _racing(progress, stop):
        with cache.writer() as writer:
            for i in range(RECORDS_PER_SHARD):
                writer.write(id_sample(index * 1_000_000 + published * RECORDS_PER_SHARD + i))
        published += 1
        progress[index] = published
    results.put(("writer", published))


def _evictor(path: str, results, progress, stop) -> None:
    cache = Cache(path)
    rounds = 0
    while _racing(progress, stop):
        cache.evict(to=cache.capacity // 2)
        rounds += 1
        progress[EVICTOR] = rounds
    results.put(("evictor", rounds))


def _snapshotter(path: str, results, progress, stop) -> None:
    cache = Cache(path)
    codec = ExampleCodec(ID_SCHEMA)
    problems: list[str] = []
    snapshots = max_overshoot = 0
    while _racing(progress, stop):
        with cache.snapshot() as snapshot:
            snapshots += 1
            progress[SNAPSHOTTER] = snapshots
            time.sleep(0.01)  # let evictions and publishes race the lease
            for shard in snapshot:
                if not os.path.exists(shard.path):
                    problems.append(f"leased shard vanished: {shard.path}")
                    continue
                count = 0
                for _, record in iter_records(shard.path):
                    sample = codec.decode(record)
                    if not (sample["x"] == id_sample(int(sample["id"]))["x"]).all():
                        problems.append(f"payload mismatch in {shard.path}")
                    count += 1
                if count != shard.records:
                    problems.append(f"{shard.path}: {count} records, listed {shard.records}")
            # Budget: published bytes within capacity plus leased shards; temporaries at most one per writer.
            names = os.listdir(cache.shards_dir)
            tmp = sum(os.path.getsize(os.path.join(cache.shards_dir, n)) for n in names
                      if n.startswith(TMP_PREFIX) and os.path.exists(os.path.join(cache.shards_dir, n)))
            published = sum(s.nbytes for s in cache.list_shards())
            max_overshoot = max(max_overshoot, published - cache.capacity - snapshot.nbytes)
            if tmp > WRITERS * _shard_bytes():
                problems.append(f"{tmp} bytes of temporaries, more than one shard per writer")
    results.put(("snapshotter", (snapshots, max_overshoot, problems)))


def test_writers_evictor_and_snapshotter_race_safely(tmp_path):
    path = str(tmp_path / "cache")
    Cache(path, capacity=_shard_bytes() * 8, schema=ID_SCHEMA)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    progress, stop = ctx.Array("i", len(MINIMUM), lock=False), ctx.Event()
    procs = [ctx.Process(target=_writer, args=(path, i, results, progress, stop)) for i in range(WRITERS)]
    procs += [ctx.Process(target=target, args=(path, results, progress, stop)) for target in (_evictor, _snapshotter)]
    for p in procs:
        p.start()
    outcome: dict[str, list] = {}
    try:
        for _ in procs:
            kind, value = results.get(timeout=120)
            outcome.setdefault(kind, []).append(value)
    finally:
        stop.set()  # a process that died must not leave the others racing forever
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    snapshots, max_overshoot, problems = outcome["snapshotter"][0]
    assert problems == []
    assert len(outcome["writer"]) == WRITERS and min(outcome["writer"]) >= MINIMUM[0]
    assert outcome["evictor"][0] >= MINIMUM[EVICTOR] and snapshots >= MINIMUM[SNAPSHOTTER]
    assert max_overshoot <= 0
    cache = Cache(path)
    cache.snapshot().close()  # an epoch start trims what was published under the last lease
    assert cache.stats().bytes <= cache.capacity
    assert cache.verify().ok
    assert [n for n in os.listdir(cache.shards_dir) if n.startswith(TMP_PREFIX)] == []
    stats = cache.stats()
    assert stats.published == sum(outcome["writer"])
    assert stats.published - stats.evicted == stats.shards
    assert stats.evicted > 0, "evictions raced the writers and the snapshots"


# -- a publisher killed at an exact step (the GROWCACHE_FAULT test hook) ---------------------
_PUBLISHER = """
import sys
import numpy as np
from growcache import Cache
cache = Cache(sys.argv[1])
with cache.writer() as writer:
    for i in range(5):
        writer.write({"id": np.int64(10_000 + i), "x": np.zeros((4, 8), np.float32)})
    print(writer.path, flush=True)
print("PUBLISHED", flush=True)
"""


@pytest.mark.parametrize("point", ["publish:locked", "publish:counted"])
def test_a_publisher_killed_mid_publish_with_the_lock_held_harms_nothing(tmp_path, point):
    from filelock import FileLock

    cache = Cache(tmp_path / "cache", capacity=_shard_bytes() * 3, schema=ID_SCHEMA)
    for i in range(3):
        with cache.writer() as writer:
            for j in range(RECORDS_PER_SHARD):
                writer.write(id_sample(i * RECORDS_PER_SHARD + j))
    before = {s.path: open(s.path, "rb").read() for s in cache.list_shards()}
    with cache.snapshot():  # eviction must wait for no one: the victim publishes into a full cache
        pass
    child = subprocess.run([sys.executable, "-c", _PUBLISHER, cache.path], capture_output=True, text=True,
                           env=dict(os.environ, GROWCACHE_FAULT=point), timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    temporary = child.stdout.split()[0]
    assert "PUBLISHED" not in child.stdout and os.path.exists(temporary)
    lock = FileLock(cache._manifest.lock_path, timeout=10)
    with lock:  # the kernel released the dead holder's lock
        pass
    reopened = Cache(cache.path)  # removes the dead writer's temporary
    assert not os.path.exists(temporary)
    left = reopened.list_shards()
    # Killed after acquiring the lock: nothing changed. After the counters: one eviction
    # made room, one sequence number is spent, and no shard appeared under it.
    assert [s.seq for s in left] == ([1, 2, 3] if point == "publish:locked" else [2, 3])
    assert all(open(s.path, "rb").read() == before[s.path] for s in left)
    with reopened.writer() as writer:
        writer.write(id_sample(99))
    newest = reopened.list_shards()[-1]
    assert newest.seq == (4 if point == "publish:locked" else 5), "a spent sequence number is never reused"
    assert reopened.verify().ok
    assert [int(ExampleCodec(ID_SCHEMA).decode(r)["id"]) for _, r in iter_records(newest.path)] == [99]


# -- maintenance under a live lease -------------------------------------------------------------
def test_prune_and_verify_remove_corrupt_never_touch_a_leased_shard(tmp_path, capsys):
    from growcache.cli import main

    cache = Cache(tmp_path / "cache", capacity="1MB", schema=ID_SCHEMA)
    for i in range(2):
        with cache.writer() as writer:
            for j in range(RECORDS_PER_SHARD):
                writer.write(id_sample(i * RECORDS_PER_SHARD + j))
    first, second = cache.list_shards()
    with open(first.path, "r+b") as f:
        f.seek(60)
        f.write(b"\xee")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, growcache; "
                               "s = growcache.Cache(sys.argv[1]).snapshot(holder='trainer'); "
                               "print(len(s), flush=True); time.sleep(120)", cache.path],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "2"
        capsys.readouterr()
        assert main(["verify", "-q", "--remove-corrupt", cache.path]) == 1
        out = capsys.readouterr().out
        assert f"CORRUPT {first.path}" in out and f"KEPT {first.path}" in out and "REMOVED" not in out
        assert main(["prune", "--to", "1B", cache.path]) == 0
        assert [s.path for s in cache.list_shards()] == [first.path, second.path]
        report = cache.verify(remove_corrupt=True)
        assert report.kept_leased == [first.path] and report.removed == []
    finally:
        holder.kill()
        holder.wait()
    assert main(["verify", "-q", "--remove-corrupt", cache.path]) == 1  # reports what it removed
    assert f"REMOVED {first.path}" in capsys.readouterr().out
    assert [s.path for s in cache.list_shards()] == [second.path]
    assert main(["prune", "--to", "1B", cache.path]) == 0 and cache.list_shards() == []
