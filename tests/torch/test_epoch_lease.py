"""A running epoch's lease shrinks to what the rest of the epoch reads (issue 30): in a full cache,
a publish evicts the shards the epoch already read whole rather than keep them over the budget,
and no shard still to be read is ever let go (evicting everything unleased after every batch,
the epoch still delivers every record once), with 0 and 2 DataLoader workers and under a top up."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from conftest import ID_SCHEMA, write_shards  # noqa: E402
from growcache import Cache, make_torch_loader  # noqa: E402
from growcache.planning import plan_epoch, read_points  # noqa: E402

SHARDS = [37, 50, 23, 41, 60, 13, 29]  # 253 records


def _id_ranges(cache) -> dict[str, set[int]]:
    starts = [sum(SHARDS[:i]) for i in range(len(SHARDS))]
    return {s.path: set(range(starts[s.seq - 1], starts[s.seq - 1] + s.records)) for s in cache.list_shards()}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_full_cache_evicts_what_the_running_epoch_read_and_never_what_it_still_reads(tmp_path, workers):
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, SHARDS)
    ranges = _id_ranges(cache)
    cache = Cache(tmp_path / "cache", capacity=cache.stats().bytes)  # full
    got: list[int] = []
    with make_torch_loader(cache, 8, num_workers=workers, shuffle_buffer=20, seed=3, resume_ttl=0) as loader:
        iterator = iter(loader)
        epoch = loader.last_epoch
        half = epoch.batches() // 2
        for _ in range(half):
            got.extend(next(iterator)["id"].tolist())
        time.sleep(0.3)  # trims are spaced by their cost: the next batch trims
        got.extend(next(iterator)["id"].tolist())
        before = {s.path for s in cache.list_shards()}
        # A sampler publishes a cache's worth into the full cache. The budget applies to unleased
        # shards (a lease may hold the disk over it by its own bytes): the oldest unleased go first.
        write_shards(cache, [36] * 7, first_id=10_000)
        evicted = before - {s.path for s in cache.list_shards()}
        assert evicted & set(ranges), "the shards read whole are evicted, not kept over the budget"
        assert all(ranges[path] <= set(got) for path in evicted & set(ranges)), "only shards read whole"
        held = sum(s.nbytes for s in cache.list_shards() if s.seq in epoch.held)
        assert cache.stats().bytes <= cache.capacity + held
        for batch in iterator:  # everything unleased goes after every batch: the rest is still read
            got.extend(batch["id"].tolist())
            cache.evict(to=0)
        assert epoch.ended and cache.stats().leased_shards == 0
    assert sorted(got) == list(range(sum(SHARDS))), "every record of the snapshot once"


def test_a_top_up_keeps_the_start_of_its_cycle_to_the_end_and_lets_the_rest_go():
    # Two ranks, one reader each, batches of 8: rank 1's shards hold fewer records, it tops up
    # by re-reading the start of its own shards at the epoch's end.
    records = [37, 50, 23, 41, 60, 13, 29]
    plan = plan_epoch(records, epoch=1, seed=3, world_size=2, num_workers=0, batch_size=8)
    short = min(range(2), key=lambda r: sum(records[i] for i in plan.shards[r]))
    own = sum(records[i] for i in plan.shards[short])
    assert plan.quotas[short] > own
    points = read_points(plan, short, records, 3, tops_up=True)
    first = int(plan.cycle[short][0])
    assert first in points.kept and points.kept < set(int(i) for i in plan.cycle[short])
    end = plan.batches(short)
    assert points.kept <= points.left(end)  # to the end, the top up's shards stay
    assert points.left(0) == {int(i) for i in plan.shards[short]}  # never another rank's
    # Eviction-safe: a reader whose shard is corrupt (on_corrupt="skip") reads on into its cycle.
    assert read_points(plan, short, records, 3, tops_up=True, exact=False).kept == set(int(i) for i in plan.cycle[short])


def test_ranks_release_each_others_shards_at_once_and_their_own_as_they_read(tmp_path):
    records = [37, 50, 23, 41, 60, 13, 29]
    plan = plan_epoch(records, epoch=1, seed=3, world_size=2, num_workers=2, batch_size=8)
    for rank in range(2):
        points = read_points(plan, rank, records, 3, tops_up=True)
        mine = {int(i) for w in range(2) for i in plan.shards[plan.reader(rank, w)]}
        assert points.left(0) == mine
        last = plan.rank_batches(rank)
        # Each change comes at a batch where some shard is passed, and left() only shrinks.
        consumed, seen = 0, [points.left(0)]
        while (consumed := points.next_change(consumed)) <= last:
            seen.append(points.left(consumed))
            assert seen[-1] < seen[-2]
        # At the end: the top up's shards, and at most each reader's last (a resume re-reads its
        # last, partial shuffle window to drop what it delivered).
        assert seen[-1] >= points.kept and len(seen[-1] - points.kept) <= plan.workers
        assert len(seen) >= 2  # it let go of some as it read


def test_the_pin_keeps_what_a_resume_one_batch_earlier_reads(id_cache):
    # Lightning's fetcher runs a batch ahead: its ResumeCallback saves one batch less than the loader
    # counted. Saved right where a shard is passed, that state must still find the shard after the
    # process is gone and the cache evicted everything unpinned.
    write_shards(id_cache, SHARDS)
    with make_torch_loader(id_cache, 8, num_workers=0, shuffle_buffer=20, seed=3, resume_ttl=0) as loader:
        loader.set_epoch(1)
        whole = [b["id"].tolist() for b in loader]
    loader = make_torch_loader(id_cache, 8, num_workers=0, shuffle_buffer=20, seed=3)
    loader.set_epoch(1)
    iterator = iter(loader)
    points = loader.last_epoch.read_points()
    boundary = points.next_change(points.next_change(0))  # the second shard passed: the first can go
    got = [next(iterator)["id"].tolist() for _ in range(boundary)]
    state = loader.state_dict()
    state["progress"] -= 1  # what the callback saves
    del iterator
    loader.close()
    assert id_cache.evict(to=0)  # everything neither pinned nor leased goes
    with make_torch_loader(id_cache, 8, num_workers=0, shuffle_buffer=20, seed=3) as resumed:
        resumed.load_state_dict(state)
        assert got[:-1] + [b["id"].tolist() for b in resumed] == whole
