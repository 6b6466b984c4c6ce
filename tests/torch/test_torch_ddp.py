"""Two gloo ranks train a tiny DDP model for 2 epochs on one cache: no hang, disjoint records,
equal batch counts (uneven shards force the top up). Each launch of ranks checks both
``drop_last`` settings, one loader after the other, so that the ranks start (and import torch) once."""

from __future__ import annotations

import json
import os
import socket

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

from conftest import ID_SCHEMA, write_shards  # noqa: E402


def _free_port() -> int:
    """A port number that was free a moment ago, for MASTER_PORT: growcache names the run by it.
    The ranks never listen on it; they meet through a file in the test's directory. Bound by
    rank 0 seconds later, once the spawned ranks have imported torch, the port could be taken
    meanwhile by a test that another pytest worker runs (its servers, its own ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_ddp(rank: int, world: int, port: int, out_dir: str, make_loaders: dict) -> None:
    """Train a tiny DDP model for 2 epochs on each ``make_loaders[name]()`` in turn, in one process
    group (one launch checks every variant); write each variant's epochs: ids and batch count."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # growcache names the run by these
    # The ranks meet through a file, not on the port (see _free_port).
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/gloo-rendezvous", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    results = {}
    for name, make_loader in make_loaders.items():
        loader = make_loader()
        epochs = []
        for _ in range(2):
            ids, batches, noted = [], 0, len(loader.skipped)
            for batch in loader:
                loss = model(batch["x"].reshape(len(batch["x"]), -1)).pow(2).mean()
                opt.zero_grad()
                loss.backward()  # an all-reduce: a rank with fewer batches would hang the others
                opt.step()
                ids += batch["id"].tolist()
                batches += 1
            epochs.append({"ids": ids, "batches": batches,
                           "skipped": [[n.path, n.offset, n.reason] for n in loader.skipped[noted:]]})
        results[name] = epochs
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _drop_last_variants(cache_dir: str, **options) -> dict:
    import functools

    import growcache

    return {str(drop_last): functools.partial(growcache.make_torch_loader, cache_dir, 4, num_workers=1, seed=5,
                                              drop_last=drop_last, **options) for drop_last in (False, True)}


def _rank(rank: int, world: int, cache_dir: str, damaged_dir: str, port: int, out_dir: str) -> None:
    import functools

    import growcache

    variants = _drop_last_variants(cache_dir)
    # One shard per worker, one of them corrupt: its worker skips it and makes up its quota
    # (2 batches of 6 records per worker: 4 per rank).
    variants["skip"] = functools.partial(growcache.make_torch_loader, damaged_dir, 4, num_workers=2,
                                         on_corrupt="skip")
    # Three shards of four corrupt: a rank whose own shards are all corrupt tops up from the
    # whole snapshot, so both of its workers may pass over the same corrupt shard.
    variants["skip_most"] = functools.partial(growcache.make_torch_loader, damaged_dir + "-most", 4, num_workers=2,
                                              on_corrupt="skip")
    _train_ddp(rank, world, port, out_dir, variants)


def _flip_a_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:  # a payload byte of the first record: the whole shard is lost
        f.seek(os.path.getsize(path) // 12)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.timeout(180)
def test_two_ranks_disjoint_equal_batches(id_cache, tmp_path):
    import torch.multiprocessing as mp

    from growcache import Cache

    written = write_shards(id_cache, [7, 5, 9, 3, 11, 2])
    damaged = Cache(tmp_path / "damaged", capacity="1GB", schema=ID_SCHEMA)
    damaged_ids = write_shards(damaged, [6, 6, 6, 6], first_id=100)
    bad = damaged.list_shards()[0].path
    _flip_a_payload_byte(bad)
    most = Cache(f"{damaged.path}-most", capacity="1GB", schema=ID_SCHEMA)
    most_ids = write_shards(most, [6, 6, 6, 6], first_id=200)
    most_bad = [shard.path for shard in most.list_shards()[:3]]
    for path in most_bad:
        _flip_a_payload_byte(path)
    mp.spawn(_rank, args=(2, id_cache.path, damaged.path, _free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        a, b = (results[r]["skip"][epoch] for r in range(2))
        assert a["batches"] == b["batches"] == 4, f"a worker's only shard was corrupt: {a['batches']}, {b['batches']}"
        assert not set(a["ids"]) & set(b["ids"]) and set(a["ids"]) | set(b["ids"]) <= set(damaged_ids[6:])
        assert [note[0] for note in a["skipped"] + b["skipped"]] == [bad]  # one worker of one rank met it
        runs = [results[r]["skip_most"][epoch] for r in range(2)]
        assert runs[0]["batches"] == runs[1]["batches"] > 0
        assert set(runs[0]["ids"]) | set(runs[1]["ids"]) <= set(most_ids[18:])  # only the intact shard's
        for run in runs:  # each corrupt shard a rank passed over is noted once per epoch, however many workers met it
            assert len({tuple(note) for note in run["skipped"]}) == len(run["skipped"]), run["skipped"]
        assert {note[0] for run in runs for note in run["skipped"]} == set(most_bad)
    for drop_last in (False, True):
        for epoch in range(2):
            a, b = (results[r][str(drop_last)][epoch] for r in range(2))
            assert a["batches"] == b["batches"] > 0, (drop_last, epoch)
            assert not set(a["ids"]) & set(b["ids"]), f"ranks overlap (drop_last={drop_last})"
            seen = set(a["ids"]) | set(b["ids"])
            if drop_last:
                assert len(a["ids"]) + len(b["ids"]) == len(seen)  # nothing read twice
                assert seen < set(written)
            else:
                assert seen == set(written)  # every record read; only top-up records repeat within a rank


def _first_batch_outcome(rank: int, world: int, port: int, out_dir: str, cache_dir: str, **loader_kwargs) -> None:
    """Take a first batch in a gloo group; write ``no error`` or the EpochSyncError's text."""
    import torch.distributed as dist

    import growcache

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # growcache names the run by these
    # The ranks meet through a file, not on the port (see _free_port).
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/gloo-rendezvous", rank=rank, world_size=world)
    loader = growcache.make_torch_loader(cache_dir, 4, **loader_kwargs)
    try:
        next(iter(loader))
        outcome = "no error"
    except growcache.EpochSyncError as exc:
        outcome = str(exc)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


def _rank_on_its_own_cache(rank: int, world: int, cache_dirs: list[str], port: int, out_dir: str) -> None:
    _first_batch_outcome(rank, world, port, out_dir, cache_dirs[rank], num_workers=0)


@pytest.mark.timeout(120)
def test_ranks_on_different_caches_with_split_shared_all_raise_instead_of_reading_different_data(tmp_path):
    import torch.multiprocessing as mp

    from growcache import Cache

    # split="shared" means one cache for all ranks; here each rank was given its own, so rank 1
    # cannot lease the shards rank 0 took. Every rank must stop, none may hang or read on.
    first = Cache(tmp_path / "a", capacity="1GB", schema=ID_SCHEMA)
    write_shards(first, [5, 5])
    other = Cache(tmp_path / "b", capacity="1GB", schema=ID_SCHEMA)
    write_shards(other, [5], first_id=10)
    mp.spawn(_rank_on_its_own_cache, args=(2, [first.path, other.path], _free_port(), str(tmp_path)),
             nprocs=2, join=True)
    outcomes = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert "ranks [1] could not lease" in outcomes[0]
    assert "gone from cache" in outcomes[1] and "split='node'" in outcomes[1]


def _rank_with_its_own_workers(rank: int, world: int, cache_dir: str, port: int, out_dir: str) -> None:
    _first_batch_outcome(rank, world, port, out_dir, cache_dir, num_workers=2 * rank, seed=0)  # 1 reader, then 2


@pytest.mark.timeout(180)
def test_ranks_with_different_num_workers_all_raise_instead_of_falling_out_of_step(id_cache, tmp_path):
    # Each rank plans with its own reader count: 1 and 2 readers gave 4 and 6 batches of one
    # snapshot, and DDP's all-reduce hung on the rank with more.
    import torch.multiprocessing as mp

    write_shards(id_cache, [5, 7, 3, 6, 2, 9])
    mp.spawn(_rank_with_its_own_workers, args=(2, id_cache.path, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert "plan different batch counts" in (tmp_path / f"rank{rank}.txt").read_text()


def _rank_on_a_node(rank: int, world: int, cache_dirs: list[str], port: int, out_dir: str) -> None:
    # Ranks 0-1 form one "node" with its own cache, ranks 2-3 another.
    _train_ddp(rank, world, port, out_dir, _drop_last_variants(cache_dirs[rank // 2], split="node"))


@pytest.mark.timeout(240)
def test_node_local_caches_split_per_node_with_equal_batches_everywhere(tmp_path):
    import torch.multiprocessing as mp

    from growcache import Cache

    node_a = Cache(tmp_path / "node-a", capacity="1GB", schema=ID_SCHEMA)
    written_a = write_shards(node_a, [7, 5, 9])
    node_b = Cache(tmp_path / "node-b", capacity="1GB", schema=ID_SCHEMA)
    written_b = write_shards(node_b, [3, 11, 2, 8, 6], first_id=1000)
    mp.spawn(_rank_on_a_node, args=(4, [node_a.path, node_b.path], _free_port(), str(tmp_path)), nprocs=4, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for drop_last in (False, True):
        for epoch in range(2):
            runs = [results[r][str(drop_last)][epoch] for r in range(4)]
            assert len({run["batches"] for run in runs}) == 1 and runs[0]["batches"] > 0, (
                drop_last, [r["batches"] for r in runs])
            for first, written in ((0, written_a), (2, written_b)):
                a, b = runs[first], runs[first + 1]
                assert not set(a["ids"]) & set(b["ids"]), f"ranks of one node overlap (drop_last={drop_last})"
                seen = set(a["ids"]) | set(b["ids"])
                assert seen <= set(written)
                if drop_last:
                    assert len(a["ids"]) + len(b["ids"]) == len(seen)
                else:
                    assert seen == set(written)  # the node's whole cache; only top-up records repeat
