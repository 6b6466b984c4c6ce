"""loader.stats(): is training waiting on data? Real DataLoader workers, a slow consumer against
a slow producer, freshness counted exactly on a cache that grows and evicts between epochs."""

from __future__ import annotations

import logging
import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

import growcache  # noqa: E402
import growcache.worker_feed  # noqa: E402
from growcache.metrics import input_stats  # noqa: E402
from conftest import write_shards  # noqa: E402

make_torch_loader = growcache.make_torch_loader
DELAY_S = 0.05


def _slowed(real):
    # Every batch a reader yields comes DELAY_S late: the producer is the bottleneck.
    def slab_batches(*args, **kwargs):
        for item in real(*args, **kwargs):
            time.sleep(DELAY_S)
            yield item

    return slab_batches


def test_a_slow_consumer_waits_on_nothing(id_cache):
    write_shards(id_cache, [40] * 4)  # 40 batches of 4
    with make_torch_loader(id_cache, 4, num_workers=1, persistent_workers=True, shuffle_buffer=0) as loader:
        for _ in loader:  # the workers start in this epoch; the figures come from the next
            pass
        batches = 0
        for _ in loader:
            time.sleep(2 * DELAY_S)  # the training step; next() costs about a ms on a loaded 2-core host
            batches += 1
        figures = loader.stats().epoch
    assert figures.epoch == 1 and figures.finished and figures.batches == batches == 40
    assert not figures.data_wait_bound
    assert figures.wall_s >= batches * 2 * DELAY_S
    print(f"waited {figures.data_wait_s:.3f} s of {figures.wall_s:.3f} s")
    assert figures.data_wait_share < 0.05, figures


def test_a_slow_producer_shows_as_waiting(id_cache, monkeypatch):
    write_shards(id_cache, [40] * 2)  # 20 batches of 4
    # The worker is forked from this process, so it reads through the slowed function.
    monkeypatch.setattr(growcache.worker_feed, "slab_batches", _slowed(growcache.worker_feed.slab_batches))
    with make_torch_loader(id_cache, 4, num_workers=1, multiprocessing_context="fork", shuffle_buffer=0) as loader:
        batches = sum(1 for _ in loader)
        figures = loader.stats().epoch
    injected = batches * DELAY_S
    assert batches == 20 and figures.finished
    assert figures.data_wait_s >= 0.8 * injected, figures
    assert figures.data_wait_s <= figures.wall_s
    assert figures.first_batch_s >= DELAY_S


def test_freshness_and_cache_figures_count_exactly(id_cache, caplog):
    first = write_shards(id_cache, [5, 7])
    loader = make_torch_loader(id_cache, 3, num_workers=0)
    caplog.set_level(logging.INFO, logger="growcache.metrics")

    def epoch():
        ids = [i for batch in loader for i in batch["id"].tolist()]
        return ids, loader.stats().epoch

    ids, f0 = epoch()
    assert sorted(ids) == first
    assert (f0.epoch, f0.records, f0.snapshot_shards, f0.snapshot_records) == (0, 12, 2, 12)
    assert f0.new_shards is None and f0.new_records is None and f0.new_share is None
    assert f0.oldest_shard_age_s >= f0.newest_shard_age_s >= 0

    write_shards(id_cache, [3, 4, 6], first_id=100)
    _, f1 = epoch()
    assert (f1.epoch, f1.records, f1.snapshot_shards, f1.new_shards, f1.new_records) == (1, 25, 5, 3, 13)
    assert f1.new_share == pytest.approx(13 / 25)
    shards = id_cache.list_shards()
    assert f1.cache.published == 3 and f1.cache.published_bytes == sum(s.nbytes for s in shards[2:])
    assert (f1.cache.evicted, f1.cache.shards, f1.cache.bytes) == (0, 5, sum(s.nbytes for s in shards))

    # Evict the oldest shard (5 records) and publish one of 2: 1 new shard of 22 records.
    id_cache.evict(to=sum(s.nbytes for s in shards) - shards[0].nbytes)
    write_shards(id_cache, [2], first_id=200)
    _, f2 = epoch()
    assert (f2.epoch, f2.records, f2.snapshot_shards, f2.new_shards, f2.new_records) == (2, 22, 5, 1, 2)
    assert (f2.cache.published, f2.cache.evicted, f2.cache.evicted_bytes) == (1, 1, shards[0].nbytes)

    total = loader.stats().total
    assert (total.epochs, total.records, total.new_records) == (3, 59, 15)
    assert input_stats(id_cache).epoch == f2  # the accessor keyed on the cache finds this loader

    lines = [r.getMessage() for r in caplog.records if r.name == "growcache.metrics"]
    assert len(lines) == 3, lines
    assert lines[0].startswith("epoch 0: 12 records,") and "first epoch" in lines[0]
    assert lines[1].startswith("epoch 1: 25 records,") and "52% new since epoch 0" in lines[1]
    assert "38% new" not in lines[2] and "9% new since epoch 1" in lines[2]
    loader.close()


def test_an_epoch_left_early_says_so(id_cache, caplog):
    write_shards(id_cache, [8, 8])
    caplog.set_level(logging.INFO, logger="growcache.metrics")
    with make_torch_loader(id_cache, 2, num_workers=0) as loader:
        iterator = iter(loader)
        next(iterator), next(iterator)
        del iterator
        figures = loader.stats().epoch
    assert not figures.finished and figures.batches == 2 and figures.records == 4
    assert any("stopped early" in r.getMessage() for r in caplog.records)


def _free_port() -> int:
    """A port number that was free a moment ago, for MASTER_PORT: growcache names the run by it.
    The ranks never listen on it; they meet through a file in the test's directory. Bound by
    rank 0 seconds later, once the spawned ranks have imported torch, the port could be taken
    meanwhile by a test that another pytest worker runs (its servers, its own ranks)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_stall(rank: int, world: int, cache_dir: str, port: int, out_dir: str) -> None:
    """One gloo rank reads one epoch; rank 1's reader is slowed by DELAY_S per batch."""
    import json
    import os

    import torch.distributed as dist

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    lines = Lines()
    logging.getLogger("growcache.metrics").addHandler(lines)
    logging.getLogger("growcache.metrics").setLevel(logging.INFO)
    if rank == 1:  # num_workers=0: the reader runs in this process
        growcache.worker_feed.slab_batches = _slowed(growcache.worker_feed.slab_batches)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # growcache names the run by these
    # The ranks meet through a file, not on the port (see _free_port).
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/gloo-rendezvous", rank=rank, world_size=world)
    with make_torch_loader(cache_dir, 4, num_workers=0, shuffle_buffer=0) as loader:
        batches = sum(1 for _ in loader)
        f = loader.stats().epoch
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump({"batches": batches, "wait": f.data_wait_s, "ranks": f.ranks, "records": f.records,
                   "lines": lines.lines}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_under_ddp_rank_0_logs_the_most_any_rank_waited(id_cache, tmp_path):
    import json

    import torch.multiprocessing as mp

    write_shards(id_cache, [40, 40])  # 10 batches of 4 per rank
    mp.spawn(_rank_stall, args=(2, id_cache.path, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["batches"] for r in ranks] == [10, 10]
    # Both ranks hold the gathered figures: the slow rank's wait, the records of both.
    assert ranks[0]["wait"] == ranks[1]["wait"] >= 0.8 * 10 * DELAY_S
    assert [r["ranks"] for r in ranks] == [2, 2] and [r["records"] for r in ranks] == [80, 80]
    assert len(ranks[0]["lines"]) == 1 and "most of 2 ranks" in ranks[0]["lines"][0], ranks[0]["lines"]
    assert ranks[0]["lines"][0].startswith("epoch 0: 80 records,")
    assert ranks[1]["lines"] == []  # rank 0 logs for the group


def test_corrupt_shards_skipped_are_counted_per_epoch(id_cache, caplog):
    write_shards(id_cache, [8, 8, 8])
    bad = id_cache.list_shards()[1].path
    with open(bad, "r+b") as f:  # a payload byte of the first record: the whole shard is skipped
        f.seek(os.path.getsize(bad) // 12)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    caplog.set_level(logging.INFO, logger="growcache.metrics")
    with make_torch_loader(id_cache, 3, num_workers=1, on_corrupt="skip") as loader:
        first = [sum(1 for _ in loader), loader.stats().epoch]
        second = [sum(1 for _ in loader), loader.stats()]
    assert first[1].skipped_shards == 1 and first[1].records == 16, first
    assert second[1].epoch.skipped_shards == 1 and second[1].total.skipped_shards == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "growcache.metrics"]
    assert all("1 corrupt shards skipped" in line for line in lines) and len(lines) == 2, lines
