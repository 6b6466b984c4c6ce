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
DURATION = 3.0


def _shard_bytes() -> int:
    return RECORDS_PER_SHARD * (ExampleCodec(ID_SCHEMA).record_nbytes + 16)


def _writer(path: str, index: int, results) -> None:
    cache = Cache(path)
    deadline = time.monotonic() + DURATION
    published = 0
    while time.monotonic() < deadline:
        with cache.writer() as writer:
            for i in range(RECORDS_PER_SHARD):
                writer.write(id_sample(index * 1_000_000 + published * RECORDS_PER_SHARD + i))
        published += 1
    results.put(("writer", published))


def _evictor(path: str, results) -> None:
    cache = Cache(path)
    deadline = time.monotonic() + DURATION
    rounds = 0
    while time.monotonic() < deadline:
        cache.evict(to=cache.capacity // 2)
        rounds += 1
    results.put(("evictor", rounds))


def _snapshotter(path: str, results) -> None:
    cache = Cache(path)
    codec = ExampleCodec(ID_SCHEMA)
    deadline = time.monotonic() + DURATION
    problems: list[str] = []
    snapshots = max_overshoot = 0
    while time.monotonic() < deadline:
        with cache.snapshot() as snapshot:
            snapshots += 1
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
    procs = [ctx.Process(target=_writer, args=(path, i, results)) for i in range(WRITERS)]
    procs += [ctx.Process(target=_evictor, args=(path, results)), ctx.Process(target=_snapshotter, args=(path, results))]
    for p in procs:
        p.start()
    outcome: dict[str, list] = {}
    for _ in procs:
        kind, value = results.get(timeout=120)
        outcome.setdefault(kind, []).append(value)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    snapshots, max_overshoot, problems = outcome["snapshotter"][0]
    assert problems == []
    assert snapshots > 5 and sum(outcome["writer"]) > 10 and outcome["evictor"][0] > 5
    assert max_overshoot <= 0
    cache = Cache(path)
    cache.snapshot().close()  # an epoch start trims what was published under the last lease
    assert cache.stats().bytes <= cache.capacity
    assert cache.verify().ok
    assert [n for n in os.listdir(cache.shards_dir) if n.startswith(TMP_PREFIX)] == []
    stats = cache.stats()
    assert stats.published == sum(outcome["writer"])
    assert stats.published - stats.evicted == stats.shards
