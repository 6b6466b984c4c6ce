"""The live-bucket soak: a SamplerPool streams a remote TFRecord dataset (moto S3 on 127.0.0.1)
through a cache that evicts continuously, while files are added, deleted and rewritten in the
bucket during the passes (issue 29).

Every record names its file and the file's version (``label = version * 100_000 + file * 100
+ index``). A ledger reads each shard once as it is published. Checked:

* no shard ever mixes two files or two versions of one file (a stale-offset resume, or a
  piece read across a rewrite, would), and each shard holds a contiguous run of its file;
* the cache never holds a record twice, and the pool never fails;
* nothing is lost: once the bucket stops changing and the capacity holds the whole dataset,
  the cache holds every record of every file's final version;
* the passes counted what they passed over.

``GROWCACHE_SOAK_SECONDS`` sets the length of the mutation phase (default 6 s; CI-cheap).
"""

from __future__ import annotations

import os
import random
import threading
import time

from stores import s3, s3_server  # noqa: F401
from tfrecords import bytes_feature, example, framed, int64_feature

from growcache import Cache, SamplerPool, Schema, TFRecordShardSource
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.shard_source import pass_progress

SECONDS = float(os.environ.get("GROWCACHE_SOAK_SECONDS", "6"))
SCHEMA = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (32,))})
FILES, RECORDS = 10, 6


def _records(file: int, version: int) -> list[bytes]:
    return [example([("label", int64_feature([version * 100_000 + file * 100 + i])),
                     ("x", bytes_feature(bytes([file % 256, version % 256]) * 16))]) for i in range(RECORDS)]


class Ledger(threading.Thread):
    """Reads every published shard once, as it appears: its labels, in order."""

    def __init__(self, cache: Cache) -> None:
        super().__init__(name="live-bucket-ledger", daemon=True)
        self.cache = cache
        self.codec = ExampleCodec(SCHEMA)
        self.shards: dict[int, list[int]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.poll()

    def poll(self) -> None:
        for info in self.cache.list_shards():
            if info.seq in self.shards:
                continue
            try:
                self.shards[info.seq] = [int(self.codec.decode(r)["label"]) for _, r in iter_records(info.path)]
            except FileNotFoundError:
                self.shards[info.seq] = []  # evicted before it was read: nothing to check


def test_a_live_bucket_loses_and_duplicates_nothing(s3, tmp_path):
    versions = {f: 0 for f in range(FILES)}  # file -> its current version in the bucket
    for f in range(FILES):
        s3.put(f"data/train-{f:03d}", framed(_records(f, 0)))
    size = len(framed(_records(0, 0)))
    cache = Cache(tmp_path / "cache", capacity=4 * size, schema=SCHEMA)
    source = TFRecordShardSource(f"{s3.url}/data/train-*", storage_options=s3.storage_options,
                                 max_shard_records=4)
    ledger = Ledger(cache)
    ledger.start()
    rng = random.Random(29)
    events = {"added": 0, "deleted": 0, "rewritten": 0}
    fs = s3.fs()
    with SamplerPool(cache, source, workers=2, seed=3) as pool:
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            time.sleep(0.15)
            present = sorted(versions)
            kind = rng.choice(["add", "delete", "rewrite", "rewrite"])
            if kind == "add" or len(present) < 4:
                f = max(versions) + 1
                versions[f] = 0
                s3.put(f"data/train-{f:03d}", framed(_records(f, 0)))
                events["added"] += 1
            elif kind == "delete":
                f = rng.choice(present)
                fs.rm(f"{s3.url}/data/train-{f:03d}".removeprefix("s3://"))
                del versions[f]
                events["deleted"] += 1
            else:
                f = rng.choice(present)
                versions[f] += 1
                s3.put(f"data/train-{f:03d}", framed(_records(f, versions[f])))
                events["rewritten"] += 1
            assert pool.stats() is not None
        # The bucket stops changing; the cache now holds the whole dataset.
        Cache(cache.path, capacity=4 * size * (len(versions) + 4))
        final = {v * 100_000 + f * 100 + i for f, v in versions.items() for i in range(RECORDS)}
        wait = time.monotonic() + 60
        while time.monotonic() < wait:
            ledger.poll()
            live = [label for s in cache.list_shards() for label in ledger.shards.get(s.seq, [])]
            if final <= set(live):
                break
            time.sleep(0.1)
        pool.wait_for(records=1, timeout=5)  # raises if a worker failed
    ledger.stop.set()
    ledger.join()
    ledger.poll()
    live = [label for s in cache.list_shards() for label in ledger.shards[s.seq]]
    assert final <= set(live), f"lost: {sorted(final - set(live))[:10]}"
    assert len(live) == len(set(live)), "the cache holds a record twice"
    for seq, labels in ledger.shards.items():
        if labels:
            origins = {label // 100 for label in labels}  # version and file
            assert len(origins) == 1, f"shard {seq} mixes files or versions: {sorted(origins)}"
            indices = [label % 100 for label in labels]
            assert indices == list(range(indices[0], indices[0] + len(indices))), f"shard {seq}: {indices}"
    assert min(events.values()) > 0, events
    progress, = pass_progress(cache)
    assert progress.pass_number > 1 and progress.corrupt == 0
