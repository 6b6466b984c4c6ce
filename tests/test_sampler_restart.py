"""A sampler that is SIGKILLed and restarted draws new samples, never its predecessor's again.

Guards the property, not how the streams are keyed: every record carries the first draws of
the generator it was sampled with (so equal draws mean a replayed stream) and the pid of the
process that sampled it (so the records of the killed worker and of its successor are told
apart). Whatever keys the streams (per worker and restart, or per sample from a global index),
a successor that re-draws what its predecessor already published fails here.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from growcache import Cache, Schema
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.sampler import SamplerPool

SCHEMA = Schema({"draw": ("int64", (4,)), "pid": ("int64", ())})
RECORD = ExampleCodec(SCHEMA).record_nbytes + 16


def drawn_sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A sample that identifies its draw: the generator's first four numbers."""
    time.sleep(0.005)  # the predecessor publishes a few shards, not thousands, before the kill
    return {"draw": rng.integers(0, 2**62, 4), "pid": np.int64(os.getpid())}


def _wait(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _records_by_pid(cache: Cache) -> dict[int, list[tuple[int, ...]]]:
    codec = ExampleCodec(SCHEMA)
    by_pid: dict[int, list[tuple[int, ...]]] = {}
    for shard in cache.list_shards():
        for _, raw in iter_records(shard.path):
            record = codec.decode(raw)
            by_pid.setdefault(int(record["pid"]), []).append(tuple(record["draw"].tolist()))
    return by_pid


def test_a_restarted_sampler_publishes_no_record_its_killed_predecessor_published(tmp_path):
    cache = Cache(tmp_path / "cache", capacity="64MB", schema=SCHEMA)
    # Small shards: the predecessor publishes several before it is killed, mid-shard.
    pool = SamplerPool(cache, drawn_sample, workers=1, shard_size=8 * RECORD, max_shard_age=None, seed=5).start()
    try:
        _wait(lambda: len(pool.pids) == 1 and pool.stats().shards >= 3)
        victim = pool.pids[0]
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: pool.stats().restarts == 1 and pool.pids and pool.pids[0] != victim)
        successor = pool.pids[0]
        published = pool.stats().shards
        _wait(lambda: pool.stats().shards >= published + 3)  # the successor's own shards
    finally:
        pool.stop()
    by_pid = _records_by_pid(cache)
    assert set(by_pid) == {victim, successor}, "both the killed worker and its successor published"
    before, after = by_pid[victim], by_pid[successor]
    assert len(before) >= 24 and len(after) >= 24
    assert len(set(before)) == len(before) and len(set(after)) == len(after), "each stream draws anew"
    replayed = set(before) & set(after)
    assert not replayed, f"the restarted sampler re-drew {len(replayed)} samples its predecessor published"
