"""The soak's PyTorch reader: epochs of ``make_torch_loader`` (2 spawned workers) until told to stop.

Usage: ``python torch_reader.py CACHE CONTROL_DIR OUT.jsonl``. When ``CONTROL_DIR/kill-loader-worker``
appears, it SIGKILLs one of its DataLoader workers in the middle of an epoch, records how long
the training process took to get an error and what it said, and carries on with a new loader.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import torch

from growcache import CacheFullError, make_torch_loader
from soak_common import KILL_LOADER_WORKER, Abandon, RecordingCache, Reader

BATCH = 8
WORKERS, PREFETCH = 2, 2  # DataLoader workers, and batches each has in flight (prefetch_factor)


def main(cache_path: str, control: str, out: str) -> None:
    torch.set_num_threads(1)
    cache = RecordingCache(cache_path)
    reader = Reader("torch", cache, control, out)
    state: dict = {"loader": None, "skips": 0, "killed": None}

    def loader():
        if state["loader"] is None:
            state["loader"] = make_torch_loader(cache, BATCH, num_workers=WORKERS, prefetch_factor=PREFETCH,
                                                on_corrupt="skip", wait_for_shards=120, multiprocessing_context="spawn")
            state["skips"] = 0
        return state["loader"]

    def epoch():
        after_kill = 0  # batches delivered after the kill: the error must come within those in flight
        try:
            for batch in loader():
                if state["killed"] is not None:
                    after_kill += 1
                yield {k: v.numpy() for k, v in batch.items()}
        except RuntimeError as exc:
            if state["killed"] is None:
                raise
            pid, killed_at = state["killed"]
            reader.emit(event="loader_worker_killed", pid=pid, error=f"{type(exc).__name__}: {exc}",
                        batches_after_kill=after_kill, in_flight=PREFETCH * WORKERS,
                        seconds=time.monotonic() - killed_at)
            state.update(loader=None, killed=None)
            gc.collect()
            reader.done(KILL_LOADER_WORKER)
            raise Abandon() from None

    def new_skips():
        skipped = loader().skipped[state["skips"]:]
        state["skips"] += len(skipped)
        return [(s.path, s.offset, s.records) for s in skipped]

    def kill_a_worker(batch: int) -> None:
        # Mid-epoch: the victim still has batches to send. The epoch must end in an error,
        # this one or (if the victim had sent its last batch already) the next.
        if batch == 2 and state["killed"] is None and reader.flag(KILL_LOADER_WORKER) \
                and not reader.flag(KILL_LOADER_WORKER + ".done"):
            victim = state["loader"]._iterator._workers[0].pid
            os.kill(victim, signal.SIGKILL)
            state["killed"] = (victim, time.monotonic())

    reader.run(epoch, new_skips, refused=(CacheFullError,), inject=kill_a_worker)
    state["loader"] = None
    gc.collect()


if __name__ == "__main__":
    main(*sys.argv[1:4])
