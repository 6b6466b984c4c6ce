"""make_torch_loader options through the public API only: copy=True, set_epoch, drop_last on one
rank, and DDP (real gloo ranks) with two DataLoader workers per rank, even_batches on and off."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

import growcache  # noqa: E402
from growcache import Cache, Schema  # noqa: E402
from conftest import write_shards  # noqa: E402
from stores import free_port  # noqa: E402

make_torch_loader = growcache.make_torch_loader

# 64 KiB records: a batch of 8 is far above the size under which the loader copies a batch
# anyway, so without copy=True the trainer gets views of shared memory.
BIG = Schema({"id": ("int64", ()), "x": ("float32", (128, 128))})


def _big_sample(record_id: int) -> dict[str, np.ndarray]:
    return {"id": np.int64(record_id), "x": np.full((128, 128), record_id, np.float32)}


def _mapping_of(address: int) -> str:
    """The permissions of the memory mapping holding ``address`` (``rw-s`` shared, ``rw-p`` private)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(part, 16) for part in span.split("-"))
            if low <= address < high:
                return perms
    raise AssertionError(f"address {address:#x} is in no mapping")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_copy_true_batches_own_private_memory_and_outlive_their_epoch(tmp_path):
    cache = Cache(tmp_path / "big", capacity="1GB", schema=BIG)
    for shard in range(4):
        with cache.writer() as writer:
            for i in range(8):
                writer.write(_big_sample(shard * 8 + i))
    # Control: without copy=True the batch is a view of shared memory, so the check below can tell.
    shared = make_torch_loader(cache, 8, num_workers=2, shuffle_buffer=0)
    first = next(iter(shared))
    assert _mapping_of(first["x"].data_ptr())[3] == "s", "zero-copy batches live in the shared slabs"
    del first, shared

    loader = make_torch_loader(cache, 8, num_workers=2, shuffle_buffer=0, copy=True, prefetch_factor=1)
    kept = []
    for epoch in range(2):  # the second epoch reuses every slot the first one used
        batches = list(loader)  # all held at once: more batches than the loader's slots
        assert all(_mapping_of(b["x"].data_ptr())[3] == "p" for b in batches), "copy=True: private memory"
        kept.append(batches)
    for batches in kept:
        ids = [i for b in batches for i in b["id"].tolist()]
        assert sorted(ids) == list(range(32))
        for b in batches:
            for i, x in zip(b["id"].tolist(), b["x"]):
                assert bool((x == i).all()), f"record {i} changed after its epoch"


def _order(loader) -> list[int]:
    return [i for batch in loader for i in batch["id"].tolist()]


def test_set_epoch_chooses_the_epochs_order_reproducibly(id_cache):
    written = write_shards(id_cache, [5, 7, 3, 9, 6, 4])
    natural = make_torch_loader(id_cache, 4, num_workers=2, seed=11)
    epochs = [_order(natural) for _ in range(3)]  # epochs 0, 1, 2 without set_epoch
    assert all(sorted(ids) == written for ids in epochs)
    assert len({tuple(ids) for ids in epochs}) == 3, "each epoch has its own order"

    resumed = make_torch_loader(id_cache, 4, num_workers=2, seed=11)
    resumed.set_epoch(2)  # a job restarted at epoch 2 reads what epoch 2 read the first time
    assert _order(resumed) == epochs[2]
    resumed.set_epoch(0)
    assert _order(resumed) == epochs[0]
    resumed.set_epoch(2)
    again = _order(resumed)
    assert again == epochs[2], "set_epoch to the same epoch repeats its order"
    other_seed = make_torch_loader(id_cache, 4, num_workers=2, seed=12)
    other_seed.set_epoch(2)
    assert _order(other_seed) != epochs[2], "the order depends on the seed too"


@pytest.mark.parametrize("workers", [0, 2])
def test_drop_last_on_one_rank_drops_only_each_readers_last_partial_batch(id_cache, workers):
    written = write_shards(id_cache, [5, 5, 5, 5])  # 20 records, batches of 3
    readers = max(workers, 1)
    full = make_torch_loader(id_cache, 3, num_workers=workers, seed=2)
    dropped = make_torch_loader(id_cache, 3, num_workers=workers, seed=2, drop_last=True)
    assert sorted(_order(full)) == written
    sizes, ids = [], []
    for batch in dropped:
        sizes.append(len(batch["id"]))
        ids += batch["id"].tolist()
    assert sizes and set(sizes) == {3}, f"drop_last=True yields only full batches: {sizes}"
    assert len(set(ids)) == len(ids) and set(ids) <= set(written), "nothing read twice or invented"
    # Each reader drops less than one batch, and only what does not fill one.
    assert len(written) - readers * 2 <= len(ids) <= len(written)
    if readers == 1:
        assert len(ids) == len(written) - len(written) % 3 == 18


# -- DDP: two gloo ranks, two DataLoader workers each ----------------------------------------
# One shard of 30 records and five of 2: whatever whole-shard split the plan makes, the rank
# reading the big shard has at least 15 batches of 2 and the other at most 5, so evening the
# batch counts needs a top up (or a drop), and not evening them leaves the counts unequal.
DDP_SHARDS = [2, 2, 30, 2, 2, 2]
DDP_CASES = {"even": {}, "uneven": {"even_batches": False}, "even_drop": {"drop_last": True}}


def _ddp_rank(rank: int, world: int, cache_dir: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # growcache names the run by these
    # The ranks meet through a file, not on the port: bound by rank 0 seconds after free_port() found it
    # free (once the spawned ranks imported torch), it could be taken by another pytest worker's test.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/gloo-rendezvous", rank=rank, world_size=world)
    results = {}
    for name, options in DDP_CASES.items():
        # Forked workers, as under torchrun (mp.spawn leaves "spawn" as this process's default,
        # and four spawned workers importing torch would cost more than the test itself).
        loader = growcache.make_torch_loader(cache_dir, 2, num_workers=2, seed=4, multiprocessing_context="fork",
                                             **options)
        batches = []
        for batch in loader:
            batches.append(batch["id"].tolist())
        results[name] = batches
        del loader
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_ddp_with_two_workers_per_rank_even_and_uneven_batches(id_cache, tmp_path):
    import torch.multiprocessing as mp

    written = write_shards(id_cache, DDP_SHARDS)
    mp.spawn(_ddp_rank, args=(2, id_cache.path, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    def ids(rank: int, case: str) -> list[int]:
        return [i for batch in ranks[rank][case] for i in batch]

    for case in DDP_CASES:
        assert not set(ids(0, case)) & set(ids(1, case)), f"{case}: ranks overlap"

    # even_batches=False: every record exactly once across the world, no top up, so the ranks'
    # batch counts differ.
    assert sorted(ids(0, "uneven") + ids(1, "uneven")) == written
    assert len(ranks[0]["uneven"]) != len(ranks[1]["uneven"])

    # Default: equal batch counts, every record read, the short rank topped up with repeats
    # of its own records.
    assert len(ranks[0]["even"]) == len(ranks[1]["even"]) >= 15
    assert set(ids(0, "even")) | set(ids(1, "even")) == set(written)
    repeats = sum(len(ids(r, "even")) - len(set(ids(r, "even"))) for r in range(2))
    assert repeats > 0, "the short rank is topped up"

    # drop_last=True: equal counts by dropping, full batches, nothing read twice.
    assert len(ranks[0]["even_drop"]) == len(ranks[1]["even_drop"]) > 0
    assert all(len(batch) == 2 for r in range(2) for batch in ranks[r]["even_drop"])
    dropped = ids(0, "even_drop") + ids(1, "even_drop")
    assert len(set(dropped)) == len(dropped) and set(dropped) < set(written)
