"""A remote TFRecord dataset streamed through a cache by a real SamplerPool, while a model trains.

40 shards on the S3 API server, a budget of 10 shards, 2 sampler workers, 6 epochs of
training with make_torch_loader. Every GET the samplers send goes through a logging relay,
so "no shard fetched twice in a pass" is checked on the requests the store really served.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
from stores import CountingProxy, s3, s3_server  # noqa: F401
from tfrecords import framed, labelled

from growcache import Cache, SamplerPool, Schema, TFRecordShardSource
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.shard import TMP_PREFIX
from growcache.writer import temp_owner

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

SHARDS, RECORDS, WIDTH = 40, 8, 64
SCHEMA = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (WIDTH,))})


class RequestLog(CountingProxy):
    """A relay that also records ``(time, method, path, first byte)`` of every request through it."""

    _REQUEST = re.compile(rb"^(GET|HEAD) (\S+) HTTP/1\.[01]\r\n(.*?)\r\n\r\n", re.S)
    _RANGE = re.compile(rb"(?im)^range: bytes=(\d+)-")

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.requests: list[tuple[float, str, str, int | None]] = []
        self._pending: dict[int, bytes] = {}

    def observe(self, direction: str, data: bytes) -> None:
        if direction != "sent":
            return
        # One relay thread per connection: requests of a connection arrive in order on it.
        key = threading.get_ident()
        pending = self._pending.get(key, b"") + data
        while True:
            match = self._REQUEST.match(pending)
            if match is None:
                break
            first = self._RANGE.search(match.group(3))
            self.requests.append((time.time(), match.group(1).decode(), match.group(2).decode(),
                                  int(first.group(1)) if first else None))
            pending = pending[match.end():]
        self._pending[key] = pending


def _watch_budget(cache: Cache, capacity: int, frame: int, stop: threading.Event, problems: list[str]) -> None:
    """Sample the cache's bytes the whole run (under its lock, so leases and listing agree).

    How-it-works' bounds: unleased shards within the capacity plus one shard in flight per
    worker; a snapshot (what one reader leases) within the capacity, so the disk below twice
    the capacity. A lease ends before the cache trims to the budget (the trim follows at once),
    so an unleased overshoot counts only if it outlasts two samples with no lease ending.
    """
    previous = None
    while not stop.wait(0.02):
        with cache._locked():
            stats = cache.stats()
        unleased = stats.bytes - stats.leased_bytes
        over = unleased > capacity + 2 * frame
        if over and previous is not None and previous[0] and previous[1] == stats.leased_bytes:
            problems.append(f"{unleased} unleased bytes, budget {capacity}")
        if stats.leased_bytes > capacity:
            problems.append(f"{stats.leased_bytes} leased bytes, budget {capacity}")
        if stats.bytes > 2 * capacity + 2 * frame:
            problems.append(f"{stats.bytes} bytes on disk, budget {capacity}")
        if stats.temporaries > 2:
            problems.append(f"{stats.temporaries} temporaries")
        previous = (over, stats.leased_bytes)


def test_remote_dataset_through_the_cache_while_training(s3_server, s3, tmp_path):
    remote = {}
    for shard in range(SHARDS):
        records = [labelled(shard, i, WIDTH) for i in range(RECORDS)]
        name = f"train-{shard:05d}-of-{SHARDS:05d}"
        remote[name] = records
        s3.put(f"imagenet/{name}", framed(records))
    by_label = {int(ExampleCodec(SCHEMA).decode(r)["label"]): r for records in remote.values() for r in records}
    shard_bytes = max(len(framed(records)) for records in remote.values())
    capacity = 10 * shard_bytes
    cache = Cache(tmp_path / "cache", capacity=capacity, schema=SCHEMA)
    relay = RequestLog(s3_server.port)
    # Small reads make each copy take a while, so the kill below lands mid-copy.
    source = TFRecordShardSource(f"{s3.url}/imagenet/train-*",
                                 storage_options=s3_server.storage_options(client_kwargs={"endpoint_url": relay.endpoint}),
                                 chunk_bytes=256)
    problems: list[str] = []
    stop = threading.Event()
    killed: list[str] = []
    epochs = []
    try:
        with SamplerPool(cache, source, workers=2, seed=7, max_restarts=2) as pool:
            watcher = threading.Thread(target=_watch_budget, args=(cache, capacity, shard_bytes, stop, problems))
            watcher.start()
            pool.wait_for(shards=3, timeout=120)
            loader = __import__("growcache").make_torch_loader(cache, 8, num_workers=0, seed=1)
            model = torch.nn.Linear(WIDTH, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for epoch in range(6):
                labels = []
                for batch in loader:
                    x = batch["x"].float() / 255
                    loss = (model(x).squeeze(1) - (batch["label"] % 2).float()).pow(2).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    for label, row in zip(batch["label"].tolist(), batch["x"].numpy()):
                        expected = ExampleCodec(SCHEMA).decode(by_label[label])  # a record of the dataset
                        assert np.array_equal(row, expected["x"]), label
                    labels += batch["label"].tolist()
                assert len(labels) == len(set(labels))  # each record of the snapshot once
                epochs.append(labels)
                if epoch == 2:  # SIGKILL a sampler in the middle of a copy
                    deadline = time.monotonic() + 60
                    while not killed and time.monotonic() < deadline:
                        for name in os.listdir(cache.shards_dir):
                            owner = temp_owner(name)
                            if owner is not None and owner[0] in pool.pids:
                                os.kill(owner[0], signal.SIGKILL)
                                killed.append(name)
                                break
                        time.sleep(0.001)
                    assert killed, "no copy in progress was seen to kill"
                    # The other sampler copies on meanwhile, so shards alone do not show the restart.
                    deadline = time.monotonic() + 60
                    while pool.stats().restarts < 1 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    assert pool.stats().restarts == 1
                    pool.wait_for(shards=pool.stats().shards + 2, timeout=120)  # restarted, copying again
            # Training may outrun the copies: let the dataset go round once, so the second pass
            # (only the shards the cache no longer holds) is observed too.
            pool.wait_for(shards=SHARDS + 2, timeout=240)
    finally:
        stop.set()
        relay.close()
    assert not problems, problems[:5]
    assert not [n for n in os.listdir(cache.shards_dir) if n.startswith(TMP_PREFIX)]  # the killed copy is gone
    assert killed[0] not in os.listdir(cache.shards_dir)
    # Every cached shard is a whole remote shard, byte for byte.
    wholes = {tuple(records) for records in remote.values()}
    for shard in cache.list_shards():
        assert tuple(bytes(r) for _, r in iter_records(shard.path)) in wholes
    assert sum(len(labels) for labels in epochs) > 6 * RECORDS
    # No remote shard fetched twice within a pass, by the store's own log: each copy starts with
    # a GET of its first bytes, and every GET of a pass lies between its start and the next's.
    with open(os.path.join(cache.path, "sources", f"{source.key}.json")) as f:
        history = json.load(f)["history"]
    starts = [(t, path.split("/")[-1]) for t, method, path, first in relay.requests if method == "GET" and first == 0]
    assert starts
    passes = [h["started"] for h in history] + [float("inf")]
    assert len(history) >= 2  # the cache turned over: the dataset went round more than once
    assert history[0]["total"] == SHARDS
    assert all(h["total"] < SHARDS for h in history[1:])  # later passes skip the shards still cached
    for number, (begin, end) in enumerate(zip(passes, passes[1:])):
        fetched = [name for t, name in starts if begin <= t < end]
        repeated = {name for name in fetched if fetched.count(name) > 1}
        assert len(repeated) <= (1 if killed else 0), (history[number]["pass"], repeated)
        listed = [p.split("/")[-1] for p in history[number]["fetched"]]
        assert len(listed) == len(set(listed))
        assert set(listed) <= set(fetched)  # every fetch the cache recorded, the store served
