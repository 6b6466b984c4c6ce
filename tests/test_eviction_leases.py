"""How leases and the byte budget meet in Cache (the owner of both mechanisms):

* a snapshot leases at most the capacity: shards that only another live lease keeps beyond
  the budget stay out of it, so overlapping epochs (two frameworks, DDP ranks) never re-lease
  each other's oldest shards and the cache shrinks back to its budget when they end;
* eviction toward a target that leases put out of reach deletes every unleased shard and
  never a leased one.
"""

from __future__ import annotations

import pytest

from conftest import ID_SCHEMA, write_shards
from growcache import Cache
from growcache.example import ExampleCodec

PER_SHARD = 4
SHARD_BYTES = PER_SHARD * (ExampleCodec(ID_SCHEMA).record_nbytes + 16)


def _cache(tmp_path, shards_in_budget: int) -> Cache:
    return Cache(tmp_path / "cache", capacity=shards_in_budget * SHARD_BYTES, schema=ID_SCHEMA)


def _seqs(shards) -> list[int]:
    return [s.seq for s in shards]


def test_a_snapshot_leaves_out_shards_only_another_lease_keeps_beyond_the_budget(tmp_path):
    cache = _cache(tmp_path, 4)
    write_shards(cache, [PER_SHARD] * 4)
    assert [s.nbytes for s in cache.list_shards()] == [SHARD_BYTES] * 4
    first = cache.snapshot(holder="epoch 1")
    write_shards(cache, [PER_SHARD] * 4, first_id=100)  # the leased four stay, over the budget
    on_disk = cache.list_shards()
    assert len(on_disk) == 8
    second = cache.snapshot(holder="epoch 2")
    assert _seqs(second) == _seqs(on_disk[4:]), "the shards only epoch 1 keeps are not leased again"
    first.close()
    # Nothing but epoch 2's lease holds the disk over the budget now: eviction reaches it.
    assert _seqs(cache.evict()) == _seqs(on_disk[:4]), "once epoch 1 ends, what only it kept is evictable"
    assert _seqs(cache.list_shards()) == _seqs(second) and cache.stats().bytes <= cache.capacity
    second.close()


def test_overlapping_epochs_never_grow_the_cache_past_one_budget_per_live_lease(tmp_path):
    # Each epoch starts before the last one ends, as two readers of one cache do. Leased shards
    # may hold the disk over the budget by their own bytes, but no more: at most twice the
    # capacity here, round after round, instead of every shard ever published.
    cache = _cache(tmp_path, 3)
    write_shards(cache, [PER_SHARD] * 3)
    live = cache.snapshot()
    for round_ in range(5):
        write_shards(cache, [PER_SHARD] * 3, first_id=100 * (round_ + 1))
        newer = cache.snapshot()
        assert newer.nbytes <= cache.capacity, f"round {round_}: a snapshot leases at most the capacity"
        live.close()
        live = newer
        assert cache.stats().bytes <= cache.capacity + newer.nbytes, f"round {round_}: the cache grew past its bound"
    live.close()
    cache.evict()
    assert cache.stats().bytes <= cache.capacity


@pytest.mark.parametrize("target", [0, SHARD_BYTES])
def test_eviction_toward_an_unreachable_target_deletes_every_unleased_shard_and_no_leased_one(tmp_path, target):
    cache = _cache(tmp_path, 10)
    write_shards(cache, [PER_SHARD] * 5)
    shards = cache.list_shards()
    with cache.lease(_seqs(shards[1:4:2])) as leased:  # shards 2 and 4 of 5: the target is out of reach
        evicted = cache.evict(to=target)
        assert _seqs(evicted) == _seqs(shards[0::2]), "every unleased shard goes, oldest first"
        assert _seqs(cache.list_shards()) == _seqs(leased), "no leased shard is deleted"
        assert cache.prune(to=0) == [] and _seqs(cache.list_shards()) == _seqs(leased)
    assert _seqs(cache.evict(to=0)) == _seqs(leased), "once the lease ends they go too"


def test_eviction_toward_a_reachable_target_deletes_only_what_it_needs(tmp_path):
    cache = _cache(tmp_path, 10)
    write_shards(cache, [PER_SHARD] * 5)
    shards = cache.list_shards()
    with cache.lease([shards[0].seq]):  # the oldest is leased: the next oldest go in its place
        assert _seqs(cache.evict(to=3 * SHARD_BYTES)) == _seqs(shards[1:3])
    assert _seqs(cache.list_shards()) == [shards[0].seq, *_seqs(shards[3:])]
