"""Several processes publish, evict and snapshot one cache at once."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

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
