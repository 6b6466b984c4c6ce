"""Epoch planning: exactly once, balanced, deterministic, and even batch counts across ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from growcache.planning import plan_epoch, reader_seed


def _rank_records(plan, records, rank):
    """Record (shard, index) pairs rank reads: its shards, then a top-up cycle, cut at the quota."""
    out = []
    for w in range(plan.workers):
        r = plan.reader(rank, w)
        order = list(plan.shards[r])
        quota = int(plan.quotas[r])
        cyc = list(plan.cycle[r])
        mine = [(s, i) for s in order for i in range(records[s])]
        k = 0
        while len(mine) < quota:
            s = cyc[k % len(cyc)]
            mine += [(s, i) for i in range(records[s])]
            k += 1
        out += mine[:quota]
    return out


@pytest.mark.parametrize("world,workers", [(1, 0), (1, 1), (1, 4), (2, 2), (3, 1), (4, 3)])
def test_every_shard_has_exactly_one_reader(world, workers):
    records = np.random.default_rng(1).integers(1, 50, size=23)
    plan = plan_epoch(records, epoch=3, seed=7, world_size=world, num_workers=workers, even_batches=False)
    assigned = np.concatenate(plan.shards)
    assert sorted(assigned.tolist()) == list(range(23))
    assert all(s.dtype == np.int64 for s in plan.shards)
    assert len(plan.shards) == world * max(workers, 1)


def test_balanced_by_record_count():
    records = np.random.default_rng(2).integers(10, 100, size=40)
    plan = plan_epoch(records, epoch=0, seed=0, world_size=2, num_workers=2, even_batches=False)
    loads = [int(records[s].sum()) for s in plan.shards]
    # greedy longest-first: no reader exceeds the mean by more than the largest shard
    assert max(loads) - min(loads) <= records.max()
    assert max(loads) <= records.sum() / 4 + records.max()


def test_shuffled_per_seed_and_epoch_and_same_on_every_rank():
    records = [5] * 30
    a = plan_epoch(records, epoch=1, seed=3, world_size=1, num_workers=1)
    b = plan_epoch(records, epoch=1, seed=3, world_size=1, num_workers=1)
    c = plan_epoch(records, epoch=2, seed=3, world_size=1, num_workers=1)
    d = plan_epoch(records, epoch=1, seed=4, world_size=1, num_workers=1)
    assert a.shards[0].tolist() == b.shards[0].tolist()
    assert a.shards[0].tolist() != c.shards[0].tolist()
    assert a.shards[0].tolist() != d.shards[0].tolist()
    ranks = [plan_epoch(records, epoch=5, seed=1, world_size=3, num_workers=2) for _ in range(3)]
    assert all([s.tolist() for s in p.shards] == [s.tolist() for s in ranks[0].shards] for p in ranks)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("records", [[7, 3, 12, 1, 9], [100, 1, 1], [5], [4, 4, 4, 4, 4, 4, 4], [1, 2, 3, 40, 50, 7, 9, 11]])
@pytest.mark.parametrize("world,workers,batch", [(2, 1, 4), (2, 2, 3), (3, 2, 5), (4, 0, 2)])
def test_even_batches_across_ranks(records, world, workers, batch, drop_last):
    records = np.asarray(records)
    plan = plan_epoch(records, epoch=0, seed=0, world_size=world, num_workers=workers,
                      batch_size=batch, drop_last=drop_last, even_batches=True)
    counts = {plan.rank_batches(r) for r in range(world)}
    assert len(counts) == 1, counts
    seen = [_rank_records(plan, records, r) for r in range(world)]
    everything = {(s, i) for s in range(len(records)) for i in range(records[s])}
    if drop_last:
        # drop: nothing repeats anywhere, and every rank yields only full batches
        flat = [x for rank in seen for x in rank]
        assert len(flat) == len(set(flat))
        assert all(plan.quotas[r] % batch == 0 for r in range(len(plan.quotas)))
    else:
        # top up: every record is read; ranks that own shards stay disjoint
        assert set().union(*map(set, seen)) == everything
        owners = [set(rank) for rank, r in zip(seen, range(world)) if any(
            plan.shards[plan.reader(r, w)].size for w in range(plan.workers))]
        for i in range(len(owners)):
            for j in range(i + 1, len(owners)):
                assert not owners[i] & owners[j]


def test_one_rank_reads_everything_once():
    records = [3, 8, 1, 6]
    plan = plan_epoch(records, epoch=0, seed=0, world_size=1, num_workers=3, batch_size=4, even_batches=True)
    assert sorted(_rank_records(plan, records, 0)) == sorted((s, i) for s in range(4) for i in range(records[s]))


def test_empty_snapshot_and_bad_arguments():
    plan = plan_epoch([], epoch=0, seed=0, world_size=2, num_workers=2, batch_size=4)
    assert all(s.size == 0 for s in plan.shards) and plan.rank_batches(0) == plan.rank_batches(1) == 0
    with pytest.raises(ValueError):
        plan_epoch([1], epoch=0, seed=0, world_size=0)
    with pytest.raises(ValueError):
        plan_epoch([-1], epoch=0, seed=0)


@pytest.mark.parametrize("drop_last", [False, True])
def test_target_batches_sets_every_ranks_count(drop_last):
    records = [7, 3, 12, 1, 9]
    base = plan_epoch(records, epoch=0, seed=1, world_size=2, num_workers=2, batch_size=3, drop_last=drop_last)
    counts = [base.rank_batches(r) for r in range(2)]
    target = min(counts) - 1 if drop_last else max(counts) + 2  # as another node might demand
    plan = plan_epoch(records, epoch=0, seed=1, world_size=2, num_workers=2, batch_size=3, drop_last=drop_last,
                      target_batches=target)
    assert [plan.rank_batches(r) for r in range(2)] == [target, target]
    # One rank alone (one rank per node) is evened to the target too.
    own = plan_epoch(records, epoch=0, seed=1, world_size=1, num_workers=1, batch_size=3, drop_last=drop_last)
    wanted = own.rank_batches(0) + (-1 if drop_last else 2)
    alone = plan_epoch(records, epoch=0, seed=1, world_size=1, num_workers=1, batch_size=3, drop_last=drop_last,
                       target_batches=wanted)
    assert alone.rank_batches(0) == wanted
    impossible = max(counts) + 1 if drop_last else min(counts) - 1
    with pytest.raises(ValueError, match="target_batches"):
        plan_epoch(records, epoch=0, seed=1, world_size=2, num_workers=2, batch_size=3, drop_last=drop_last,
                   target_batches=impossible)


def test_reader_seeds_accept_any_integer_seed_and_differ_per_reader():
    seeds = {reader_seed(seed, 3, reader) for seed in (-1, 0, 12345) for reader in range(4)}
    assert len(seeds) == 12
    assert all(isinstance(s, int) and 0 <= s < 2**62 for s in seeds), "a valid numpy seed for every reader"
    # Every DataLoader worker and rank computes its seed in its own process: a fresh interpreter
    # (another hash seed, nothing imported before) must get the same values.
    script = "from growcache.planning import reader_seed; print(reader_seed(-1, 3, 0), reader_seed(2**70, 3, 1))"
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "random"}).stdout.split()
    assert [int(v) for v in fresh] == [reader_seed(-1, 3, 0), reader_seed(2**70, 3, 1)]
