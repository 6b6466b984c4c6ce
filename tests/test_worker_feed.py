"""growcache.worker_feed: the epoch protocol between a training process and its reader processes.

End to end it runs under every torch loader test (tests/torch/); here are the properties a
loader test cannot isolate: no named semaphore, a bounded wait with a clear error, and a
trainer that never blocks on a message larger than a pipe holds.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

from conftest import ID_SCHEMA, named_semaphores, write_shards
from growcache import Cache, worker_feed
from growcache.epoch import EpochOptions, Epochs
from growcache.batching import ReaderShare
from growcache.readers import ReaderSpec
from growcache.worker_feed import EpochMessage, WorkerFeed


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="named POSIX semaphores live in /dev/shm on Linux only")
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_feed_creates_no_named_semaphore(method):
    context = multiprocessing.get_context(method)
    before = named_semaphores()
    queue = context.Queue()  # what the loader used before: three named semaphores
    assert len(named_semaphores() - before) == 3
    del queue
    before = named_semaphores()
    feed = WorkerFeed(context, 4)
    assert named_semaphores() - before == set()
    feed.close()


def test_a_reader_without_its_plan_fails_in_bounded_time_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(worker_feed, "PLAN_TIMEOUT_S", 0.2)
    feed = WorkerFeed(multiprocessing.get_context("fork"), 1)
    with pytest.raises(RuntimeError, match="worker 0 got no epoch plan in 0.2 s"):
        next(feed.read(0, 1, ReaderSpec(ID_SCHEMA, 4).build()))
    feed.close()


@pytest.mark.timeout(60)
def test_a_plan_larger_than_a_pipe_holds_never_blocks_the_trainer():
    # A snapshot of many shards: its share is megabytes, far beyond a pipe's 64 KiB buffer, and
    # it is sent before the worker reads (a non-persistent worker starts only afterwards).
    paths = np.array([f"/cache/shards/{i:012d}-000016.tfrecord".encode() for i in range(50_000)], np.bytes_)
    share = ReaderShare(paths, np.full(len(paths), 16, np.int64), np.arange(0, len(paths), 2))
    feed = WorkerFeed(multiprocessing.get_context("fork"), 1)
    for generation in (1, 2, 3):  # an abandoned epoch's message waits ahead of the next ones
        feed._send(0, EpochMessage(generation, share, []))
    message = feed._receive(0, 3)
    assert message.generation == 3 and np.array_equal(message.share.shard_paths(), paths[::2])
    feed.close()


def test_an_abandoned_epoch_keeps_its_shards_until_the_readers_are_reset(tmp_path):
    # Persistent readers read on in an abandoned epoch until the next epoch's reset reaches
    # them; its lease must last until then, or eviction could take shards they still read.
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [4, 4])
    epochs = Epochs(cache, EpochOptions(batch_size=4), readers=1)
    feed = WorkerFeed(multiprocessing.get_context("fork"), 1)
    try:
        abandoned, _ = feed.start_epoch(epochs, lambda: None, slots=4, start_method="fork")
        open_at_reset = []
        current, _ = feed.start_epoch(epochs, lambda: open_at_reset.extend(epochs.open_epochs()), slots=4,
                                      start_method="fork")
        assert abandoned in open_at_reset and current in open_at_reset
        assert epochs.open_epochs() == [current]  # ended once the readers were reset
    finally:
        epochs.end_all()
        feed.close()


def test_the_feed_knows_the_reader_of_every_batch_it_hands_over(id_cache):
    # What Epoch.consume counts per reader where batches are taken out of order: a slot batch
    # names its slab, a batch that found no free slot carries its reader, one read in the
    # training process is reader 0's; a skipped shard's note is no batch.
    from growcache.batching import Skipped
    from growcache.transport import SlotHandle
    from growcache.worker_feed import Unslotted

    feed = WorkerFeed(multiprocessing.get_context("spawn"), 2)
    epochs = Epochs(id_cache, EpochOptions(4), readers=2)
    arrays = {"id": np.zeros(4, np.int64)}
    items = [SlotHandle(1, 0, 7, 4), Skipped("x.tfrecord", 0, "bad", 3), Unslotted(0, arrays), arrays]
    got = list(feed.received(items, epochs))
    assert got == [items[0], arrays, arrays]
    assert [feed.handed_over() for _ in range(4)] == [1, 0, 0, None]
