"""The behaviour both adapters promise, as scenarios that run against either driver.

Each scenario takes a driver (see ``drivers.py``) and a fresh directory, and asserts. The
same list runs against ``make_torch_loader`` (``test_torch_contract.py``) and against
``make_tf_dataset`` (``tests/tf/test_tf_contract.py``), so the two cannot drift apart again.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conftest import ID_SCHEMA, write_shards
from growcache import Cache, CorruptShardError
from growcache.epoch import DEFAULT_ON_CORRUPT, DEFAULT_SEED, DEFAULT_SPLIT, DEFAULT_VERIFY
from growcache.planning import plan_epoch

SCENARIOS: list[Any] = []


def scenario(*params: Any) -> Callable:
    def register(fn: Callable) -> Callable:
        for value in params or [None]:
            args = () if value is None else (value,)
            SCENARIOS.append(pytest.param(fn, args, id=fn.__name__ + ("" if value is None else f"-{value}")))
        return fn
    return register


def _cache(tmp_path: Any, name: str = "cache", capacity: str = "1GB") -> Cache:
    return Cache(os.path.join(tmp_path, name), capacity=capacity, schema=ID_SCHEMA)


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@scenario(0, 2, 4)
def exactly_once_per_epoch(driver: Any, tmp_path: Any, readers: int) -> None:
    cache = _cache(tmp_path)
    written = write_shards(cache, [13, 5, 9, 1, 7, 11])
    reader = driver.make(cache, 4, readers=readers)
    orders = []
    for _ in range(2):
        ids = _flat(driver.epoch(reader))
        assert sorted(ids) == written, "duplicates or gaps"
        assert cache.stats().leases == 0, "a finished epoch keeps its lease"
        orders.append(ids)
    assert orders[0] != orders[1], "the order does not change between epochs"


@scenario()
def growth_between_epochs(driver: Any, tmp_path: Any) -> None:
    cache = _cache(tmp_path)
    written = write_shards(cache, [6, 6])
    reader = driver.make(cache, 5, readers=2)
    for round_ in range(3):
        assert sorted(_flat(driver.epoch(reader))) == written  # exactly the shards published before it
        written += write_shards(cache, [4, 3], first_id=100 * (round_ + 1))


@scenario()
def lease_released_at_epoch_end_and_at_abandonment(driver: Any, tmp_path: Any) -> None:
    cache = _cache(tmp_path)
    written = write_shards(cache, [20] * 4)
    reader = driver.make(cache, 2, readers=2, shuffle_buffer=0)
    assert sorted(_flat(driver.epoch(reader))) == written
    assert cache.stats().leases == 0
    still_read = driver.abandon(reader)
    if still_read:
        # Readers of the abandoned epoch may still read its shards: they must stay leased,
        # and eviction must spare them, until the next epoch has stopped those readers.
        assert cache.stats().leases == 1
        assert cache.evict(to=0) == []
    else:
        assert cache.stats().leases == 0, "an abandoned epoch that nobody reads keeps its lease"
    assert sorted(_flat(driver.epoch(reader))) == written
    assert cache.stats().leases == 0


@scenario("raise", "skip")
def corrupt_shard(driver: Any, tmp_path: Any, on_corrupt: str) -> None:
    cache = _cache(tmp_path)
    written = write_shards(cache, [4, 4, 4])
    bad = cache.list_shards()[1].path
    _flip(bad, 40)  # inside the first record's payload
    reader = driver.make(cache, 2, readers=2, on_corrupt=on_corrupt)
    if on_corrupt == "raise":
        with pytest.raises(CorruptShardError) as info:
            driver.epoch(reader)
        assert info.value.path == bad and info.value.offset == 0
        return
    for epoch in range(2):
        assert sorted(_flat(driver.epoch(reader))) == written[:4] + written[8:]
        notes = driver.skipped(reader)
        assert [n.path for n in notes] == [bad] * (epoch + 1) and notes[-1].offset == 0 and notes[-1].records == 4
    assert cache.stats().leases == 0


@scenario(2, 4)
def ranks_yield_equal_batch_counts(driver: Any, tmp_path: Any, world: int) -> None:
    cache = _cache(tmp_path)
    written = write_shards(cache, [7, 5, 9, 3, 11, 2, 8, 6])
    per_rank = driver.ranks(cache.path, 4, world, 2, shuffle_buffer=0)
    for epoch in range(2):
        runs = [per_rank[r][epoch] for r in range(world)]
        assert len({len(run) for run in runs}) == 1 and len(runs[0]) > 0, [len(run) for run in runs]
        seen = [set(_flat(run)) for run in runs]
        assert set().union(*seen) == set(written)  # every record; only top-up records repeat, within a rank
        for a in range(world):
            for b in range(a + 1, world):
                assert not seen[a] & seen[b], f"ranks {a} and {b} overlap"
    assert cache.stats().leases == 0


@scenario()
def seed_and_epoch_fix_the_order(driver: Any, tmp_path: Any) -> None:
    cache = _cache(tmp_path)
    sizes = [5, 3, 8, 2, 6, 4, 7]
    written = write_shards(cache, sizes)
    ids_of = np.split(np.asarray(written), np.cumsum(sizes)[:-1])
    for seed in (0, 11):
        reader = driver.make(cache, 3, readers=1, shuffle_buffer=0, seed=seed)
        for epoch in range(2):
            # The core's plan is the oracle: one reader reads its whole shards in plan order.
            plan = plan_epoch(sizes, epoch=epoch, seed=seed)
            expected = [int(i) for shard in plan.shards[0] for i in ids_of[shard]]
            assert _flat(driver.epoch(reader)) == expected, f"seed {seed}, epoch {epoch}"


@scenario()
def entries_that_are_not_regular_files_never_reach_a_reader(driver: Any, tmp_path: Any) -> None:
    cache = _cache(tmp_path)
    written = write_shards(cache, [4, 5])
    os.mkdir(os.path.join(cache.shards_dir, "000000000007-3r-300b.tfrecord"))  # named like a shard
    os.symlink(cache.list_shards()[0].path, os.path.join(cache.shards_dir, "000000000008-4r-728b.tfrecord"))
    reader = driver.make(cache, 2, readers=2, on_corrupt="raise")
    assert sorted(_flat(driver.epoch(reader))) == written
    assert driver.skipped(reader) == []


@scenario()
def shared_arguments_have_one_default(driver: Any, tmp_path: Any) -> None:
    make = driver.make_loader if driver.name == "torch" else driver.make_dataset
    params = inspect.signature(make).parameters
    assert params["seed"].default == DEFAULT_SEED
    assert params["verify"].default is DEFAULT_VERIFY
    assert params["on_corrupt"].default == DEFAULT_ON_CORRUPT
    assert params["split"].default == DEFAULT_SPLIT
    assert params["shuffle_buffer"].default is None  # about 32 MiB of records, from the core
    assert params["wait_for_shards"].default == 0.0
