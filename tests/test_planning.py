"""Epoch planning: exactly once, balanced, deterministic, and even batch counts across ranks.

The batch-count promises are checked on what the real readers (``BatchReader`` and
``VectorReader``) deliver when they read the plan's shares of real shards, not on a model.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ID_SCHEMA, id_sample, write_shards
from growcache.batching import BatchReader, ReaderShare, Skipped
from growcache.planning import plan_epoch, reader_seed
from growcache.vector_reader import VectorReader

READERS = [BatchReader, VectorReader]


def _read_rank(cache, plan, rank, reader_class, on_corrupt="raise") -> tuple[list[int], int, list[str]]:
    """Read ``rank``'s shares of ``plan`` over ``cache``'s shards with real readers, as its
    workers would: ``(record ids delivered, batches, paths noted as skipped)``. Every delivered
    record's payload is checked against its id."""
    shards = cache.list_shards()
    paths = np.array([os.fsencode(s.path) for s in shards], dtype=np.bytes_)
    records = np.array([s.records for s in shards], dtype=np.int64)
    ids, batches, skipped = [], 0, []

    def allocate(rows):
        return None, {n: np.empty((rows, *f.shape), f.dtype) for n, f in ID_SCHEMA.items()}

    for worker in range(plan.workers):
        index = plan.reader(rank, worker)
        share = ReaderShare(paths, records, plan.shards[index], quota=int(plan.quotas[index]),
                            cycle=plan.cycle[index], shuffle_seed=index)
        reader = reader_class(ID_SCHEMA, plan.batch_size, drop_last=plan.drop_last, on_corrupt=on_corrupt)
        for item in reader.batches(share, allocate):
            if isinstance(item, Skipped):
                skipped.append(item.path)
                continue
            _, arrays, rows = item
            assert 0 < rows <= plan.batch_size and (rows == plan.batch_size or not plan.drop_last)
            batches += 1
            for record_id, x in zip(arrays["id"][:rows], arrays["x"][:rows]):
                assert np.array_equal(x, id_sample(int(record_id))["x"])
                ids.append(int(record_id))
    return ids, batches, skipped


def _shard_ids(records) -> list[set[int]]:
    """The ids ``write_shards`` gives each shard."""
    ends = np.cumsum(records)
    return [set(range(int(end) - int(n), int(end))) for n, end in zip(records, ends)]


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


@pytest.mark.parametrize("reader_class", READERS)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("records", [[7, 3, 12, 1, 9], [100, 1, 1], [5], [4, 4, 4, 4, 4, 4, 4], [1, 2, 3, 40, 50, 7, 9, 11]])
@pytest.mark.parametrize("world,workers,batch", [(2, 1, 4), (2, 2, 3), (3, 2, 5), (4, 0, 2)])
def test_even_batches_across_ranks(id_cache, records, world, workers, batch, drop_last, reader_class):
    write_shards(id_cache, records)
    plan = plan_epoch(records, epoch=0, seed=0, world_size=world, num_workers=workers,
                      batch_size=batch, drop_last=drop_last, even_batches=True)
    counts = {plan.rank_batches(r) for r in range(world)}
    assert len(counts) == 1, counts
    seen = [_read_rank(id_cache, plan, r, reader_class) for r in range(world)]
    assert [batches for _, batches, _ in seen] == [plan.rank_batches(r) for r in range(world)]
    ids = [rank_ids for rank_ids, _, _ in seen]
    if drop_last:
        # drop: nothing repeats anywhere, and every rank yields only full batches (checked in _read_rank)
        flat = [x for rank_ids in ids for x in rank_ids]
        assert len(flat) == len(set(flat))
    else:
        # top up: every record is read; ranks that own shards stay disjoint
        assert set().union(*map(set, ids)) == set(range(sum(records)))
        owners = [set(rank_ids) for rank_ids, r in zip(ids, range(world)) if any(
            plan.shards[plan.reader(r, w)].size for w in range(plan.workers))]
        for i in range(len(owners)):
            for j in range(i + 1, len(owners)):
                assert not owners[i] & owners[j]


@pytest.mark.parametrize("reader_class", READERS)
def test_one_rank_reads_everything_once(id_cache, reader_class):
    records = [3, 8, 1, 6]
    write_shards(id_cache, records)
    plan = plan_epoch(records, epoch=0, seed=0, world_size=1, num_workers=3, batch_size=4, even_batches=True)
    ids, _, _ = _read_rank(id_cache, plan, 0, reader_class)
    assert sorted(ids) == list(range(sum(records)))


def _corrupt_record(path: str, records: int, number: int) -> None:
    """Flip a payload byte of record ``number``, so that its CRC fails."""
    frame = os.path.getsize(path) // records
    with open(path, "r+b") as f:
        f.seek(number * frame + frame // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("reader_class", READERS)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("bad_record", [0, 3])
def test_a_reader_whose_only_shard_is_corrupt_keeps_its_ranks_batch_count(id_cache, reader_class, drop_last,
                                                                         bad_record):
    # 2 ranks x 2 workers, one shard each. Under "skip", the reader of the corrupt shard makes
    # up its quota from its rank's other shard: a short rank would hang the others in DDP.
    records = [6, 6, 6, 6]
    write_shards(id_cache, records)
    plan = plan_epoch(records, epoch=0, seed=0, world_size=2, num_workers=2, batch_size=4, drop_last=drop_last)
    shards, of_shard = id_cache.list_shards(), _shard_ids(records)
    bad = int(plan.shards[plan.reader(0, 0)][0])
    _corrupt_record(shards[bad].path, 6, bad_record)
    rank_ids = [set().union(*(of_shard[int(i)] for w in range(2) for i in plan.shards[plan.reader(r, w)]))
                for r in range(2)]
    lost = {min(of_shard[bad]) + n for n in range(bad_record, 6)}
    for rank in range(2):
        ids, batches, skipped = _read_rank(id_cache, plan, rank, reader_class, on_corrupt="skip")
        assert batches == plan.rank_batches(rank), f"rank {rank}: {batches} batches, {plan.rank_batches(rank)} planned"
        assert set(ids) <= rank_ids[rank] - lost, "a rank repeats only its own intact records"
        assert skipped == ([shards[bad].path] if rank == 0 else []), "each corrupt shard is noted once"
        if rank == 1:
            assert sorted(ids) == sorted(rank_ids[1]) or drop_last


@pytest.mark.parametrize("reader_class", READERS)
def test_a_rank_whose_every_shard_is_corrupt_keeps_its_batch_count_from_the_whole_snapshot(id_cache, reader_class):
    records = [6, 6]
    write_shards(id_cache, records)
    plan = plan_epoch(records, epoch=0, seed=0, world_size=2, num_workers=1, batch_size=4)
    shards, of_shard = id_cache.list_shards(), _shard_ids(records)
    bad = int(plan.shards[plan.reader(0, 0)][0])
    _corrupt_record(shards[bad].path, 6, 0)
    ids, batches, skipped = _read_rank(id_cache, plan, 0, reader_class, on_corrupt="skip")
    assert batches == plan.rank_batches(0) == plan.rank_batches(1) == 2
    assert set(ids) <= of_shard[1 - bad] and skipped == [shards[bad].path]


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
