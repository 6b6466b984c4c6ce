"""The outage soak (issue 29): the store goes down for ``GROWCACHE_SOAK_SECONDS`` (default 30 s)
while training reads the cache; the samplers ride it out, and once the store is back they finish
their ``stop_after`` records: nothing lost, nothing duplicated, the pool never failed.

Training here is the reader every adapter builds on: an epoch on a snapshot, every shard's
records read and counted. Each epoch during the outage must read the whole snapshot.
"""

from __future__ import annotations

import io
import os
import time

import numpy as np
from http_store import FaultyHTTPStore

from growcache import Cache, SamplerPool, Schema
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.sampler import sample_rng
from growcache.sources import NpyWindowSource, RetryPolicy

SECONDS = float(os.environ.get("GROWCACHE_SOAK_SECONDS", "30"))
SCHEMA = Schema({"x": ("int64", (2, 4))})


def _epoch(cache: Cache, codec: ExampleCodec) -> list[bytes]:
    with cache.snapshot() as snap:
        return [codec.decode(r)["x"].tobytes() for path in snap.paths for _, r in iter_records(path)]


def test_training_goes_on_through_a_store_outage(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    with FaultyHTTPStore(str(root)) as http:
        urls = []
        for i in range(3):
            buf = io.BytesIO()
            np.save(buf, np.arange(i * 4000, (i + 1) * 4000, dtype=np.int64).reshape(1000, 4))
            urls.append(http.put(f"a{i}.npy", buf.getvalue()))
        retry = RetryPolicy(attempts=3, initial_delay=0.05, max_delay=1.0, deadline=2.0, stall_timeout=2.0,
                            outage_budget=SECONDS + 60)
        source = NpyWindowSource(urls, 2, retry=retry)
        count = 3000
        want = sorted(source(sample_rng(5, i, 0))["x"].tobytes() for i in range(count))
        http.latency = 0.02
        cache = Cache(tmp_path / "cache", capacity="64MB", schema=SCHEMA)
        codec = ExampleCodec(SCHEMA)
        with SamplerPool(cache, source, workers=2, concurrency=8, stop_after=count, seed=5, shard_size="8KB",
                         max_shard_age=0.5) as pool:
            pool.wait_for(records=200, timeout=60)
            http.go_down()
            epochs = 0
            down_until = time.monotonic() + SECONDS
            while time.monotonic() < down_until:
                with cache.snapshot() as snap:
                    expected = snap.records
                assert len(_epoch(cache, codec)) >= expected > 0, "an epoch reads its whole snapshot"
                assert not pool.stats().failed
                epochs += 1
                time.sleep(0.2)
            http.come_back()
            final = pool.join(timeout=120)
        assert epochs >= 3 and not final.failed and final.records == count
        assert sorted(_epoch(cache, codec)) == want, "nothing lost, nothing duplicated across the outage"
