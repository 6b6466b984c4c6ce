"""The growth scenario shared by the PyTorch (gloo ranks) and TensorFlow (input pipelines) tests.

A ``SamplerPool`` publishes small shards into a cache that holds at most 16 of them, many
shards per epoch, while several ranks train for 20 epochs. At its first batch of every epoch,
each rank records the shards its own lease holds (read from the cache's ``leases/``, the
documented layout) and the ids those shards contain; at the end, the ids it was given.
:func:`check` then asserts what issue 13 asks, using nothing but public behaviour:

* every rank of a group leased the same shard set;
* every record of that set was delivered, no record by two ranks (a rank's top up repeats
  records of its own shards only);
* every rank yielded the same number of batches, and none failed (no ``EmptyCacheError``);
* the cache grew: at least two new shards reached every epoch. Each rank waits for them before
  it starts the epoch (:meth:`Recorder.wait_for_growth`), so the promise holds on a slow or busy
  machine too, where a sampler on a timer would fall behind the epochs.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from growcache import Cache, SamplerPool, Schema
from growcache.example import ExampleCodec
from growcache.records import iter_records

SCHEMA = Schema({"id": ("int64", ()), "x": ("float32", (2,))})
EPOCHS = 20
BATCH = 8
SHARD_SIZE = 1500  # bytes: about 20 records
MAX_SHARDS = 16


def sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A record with a random 62-bit id (unique in practice), made slowly enough to leave CPU to the ranks."""
    time.sleep(0.002)
    return {"id": np.int64(rng.integers(2**62)), "x": rng.random(2, dtype=np.float32)}


def capacity() -> int:
    """Bytes of the cache's budget: 16 shards."""
    return MAX_SHARDS * SHARD_SIZE


@contextlib.contextmanager
def growing_caches(directories: list[Any]) -> Iterator[list[Cache]]:
    """One cache of the scenario per directory (a machine's), each filled by its own
    ``SamplerPool`` (seeded by its index) until full and turning over while the block runs."""
    caches = [Cache(d, capacity=capacity(), schema=SCHEMA) for d in directories]
    pools = [SamplerPool(cache, sample, workers=1, shard_size=SHARD_SIZE, max_shard_age=None, seed=n)
             for n, cache in enumerate(caches)]
    for pool in pools:
        pool.start()
    try:
        for pool in pools:
            pool.wait_for(shards=MAX_SHARDS, timeout=120)
        yield caches
        for pool in pools:
            pool.raise_if_failed()
    finally:
        for pool in pools:
            pool.stop()


def own_lease(cache_path: str, holder: str | None = None) -> list[int]:
    """The shards the newest lease of this process (and ``holder``, if given) holds."""
    leases = []
    for path in glob.glob(os.path.join(cache_path, "leases", "*.json")):
        try:
            with open(path) as f:
                lease = json.load(f)
        except (OSError, ValueError):
            continue
        if lease.get("pid") == os.getpid() and (holder is None or lease.get("holder") == holder):
            leases.append((lease["created"], lease["seqs"]))
    assert leases, "no lease of this process while its epoch runs"
    return sorted(leases)[-1][1]


def published(cache_path: str) -> list[int]:
    """The sequence numbers of the shards in the cache now."""
    return [int(os.path.basename(path).split("-")[0])
            for path in glob.glob(os.path.join(cache_path, "shards", "*.tfrecord"))]


def ids_of(cache_path: str, seqs: list[int]) -> list[int]:
    """Every record id in the shards ``seqs`` (leased, so they exist)."""
    codec = ExampleCodec(SCHEMA)
    wanted = set(seqs)
    ids = []
    for path in sorted(glob.glob(os.path.join(cache_path, "shards", "*.tfrecord"))):
        if int(os.path.basename(path).split("-")[0]) in wanted:
            for _, record in iter_records(path):
                ids.append(int(np.frombuffer(codec.payload_views(record)["id"], np.int64)[0]))
    return ids


class Recorder:
    """What one rank saw, epoch by epoch."""

    def __init__(self, cache_path: str, snapshot: Any, holder: str | None = None) -> None:
        self.cache_path = cache_path
        self.snapshot = snapshot  # () -> the running epoch's shards (loader.last_epoch.shards)
        self.holder = holder
        self.epochs: list[dict[str, Any]] = []

    def epoch(self, batches: Any) -> None:
        """Consume one epoch's batches of ids (numpy arrays), observing the snapshot and lease at the first.

        The lease lets go of shards the epoch has read whole as it goes on, so at the first batch
        it holds the rest of the snapshot: a subset of it, never a shard outside it.
        """
        entry: dict[str, Any] = {"delivered": [], "batches": 0}
        for ids in batches:
            if entry["batches"] == 0:
                entry["leased"] = sorted(shard.seq for shard in self.snapshot())
                held = own_lease(self.cache_path, self.holder)
                assert held and set(held) <= set(entry["leased"]), f"lease {held} outside snapshot {entry['leased']}"
                entry["shard_ids"] = ids_of(self.cache_path, entry["leased"])
            entry["delivered"] += [int(i) for i in ids]
            entry["batches"] += 1
        self.epochs.append(entry)

    def wait_for_growth(self, shards: int = 2, timeout: float = 120.0) -> None:
        """Return once ``shards`` shards newer than the last epoch's lease are in the cache (at once before the first)."""
        if not self.epochs:
            return
        newest = max(self.epochs[-1]["leased"])
        deadline = time.monotonic() + timeout
        while sum(seq > newest for seq in published(self.cache_path)) < shards:
            assert time.monotonic() < deadline, f"the sampler published fewer than {shards} shards in {timeout} s"
            time.sleep(0.01)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.epochs, f)


def barrier(directory: str, name: str, rank: int, world: int, timeout: float = 120.0) -> None:
    """Wait until every rank reached ``name`` (training ranks move in step through their all-reduces)."""
    open(os.path.join(directory, f"{name}.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(directory, f"{name}.{r}")) for r in range(world)):
        assert time.monotonic() < deadline, f"barrier {name}: a rank never arrived"
        time.sleep(0.01)


def check(ranks: list[list[dict[str, Any]]], groups: list[list[int]], epochs: int = EPOCHS) -> None:
    """Assert the scenario's promises over every rank's record (``groups``: ranks sharing a cache)
    over ``epochs`` epochs (the scenario's 20 unless a variant runs fewer)."""
    assert all(len(r) == epochs for r in ranks), [len(r) for r in ranks]
    grew = 0
    for epoch in range(epochs):
        runs = [r[epoch] for r in ranks]
        assert len({run["batches"] for run in runs}) == 1 and runs[0]["batches"] > 0, \
            f"epoch {epoch}: batch counts {[run['batches'] for run in runs]}"
        for group in groups:
            leased = [runs[r]["leased"] for r in group]
            assert len(leased[0]) <= MAX_SHARDS, f"epoch {epoch}: {len(leased[0])} shards in a cache meant to hold 16"
            assert all(seqs == leased[0] for seqs in leased), f"epoch {epoch}: ranks {group} leased {leased}"
            records = set(runs[group[0]]["shard_ids"])
            delivered = [set(runs[r]["delivered"]) for r in group]
            assert set().union(*delivered) == records, (
                f"epoch {epoch}: {len(records - set().union(*delivered))} records of the leased shards not delivered, "
                f"{len(set().union(*delivered) - records)} delivered from outside them")
            for i, a in enumerate(group):
                for b in group[i + 1:]:
                    assert not delivered[i] & delivered[group.index(b)], f"epoch {epoch}: ranks {a}, {b} overlap"
        if epoch:
            grew += len(set(ranks[0][epoch]["leased"]) - set(ranks[0][epoch - 1]["leased"]))
    assert grew >= 2 * (epochs - 1), f"only {grew} new shards reached {epochs} epochs: the scenario did not grow"
