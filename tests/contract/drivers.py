"""One small driver per adapter, so that every contract scenario runs unchanged against both.

A driver builds a reader with the adapter's public function and runs its epochs. TensorFlow
and the ``tfrecord`` package cannot share a process, so each driver imports its framework
only when built: the PyTorch half of the contract runs in the main pytest process
(``tests/contract/test_torch_contract.py``), the TensorFlow half in the TF one
(``tests/tf/test_tf_contract.py``).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import sys
import threading
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


class TorchDriver:
    """``make_torch_loader``; readers are DataLoader workers, ranks are processes."""

    name = "torch"

    def __init__(self) -> None:
        import torch  # noqa: F401 - the framework this driver runs

        import growcache

        self.make_loader = growcache.make_torch_loader

    def make(self, cache: Any, batch_size: int, *, readers: int = 0, **options: Any) -> Any:
        options.setdefault("persistent_workers", readers > 0)
        return self.make_loader(cache, batch_size, num_workers=readers, **options)

    def epoch(self, reader: Any) -> list[list[int]]:
        return [batch["id"].tolist() for batch in reader]

    def abandon(self, reader: Any) -> bool:
        """Start an epoch, take one batch, break out. Returns whether readers may still read it."""
        for _ in reader:
            break
        return bool(reader.num_workers and reader.persistent_workers)

    def skipped(self, reader: Any) -> list[Any]:
        return reader.skipped

    def ranks(self, cache_path: str, batch_size: int, world: int, epochs: int, **options: Any) -> list[Any]:
        """Each rank a process of its own that knows its rank from ``RANK``/``WORLD_SIZE`` (no process
        group): ranks agree through the cache's epoch files. Per rank, per epoch: batches of ids."""
        return _run_rank_processes("torch", cache_path, batch_size, world, epochs, options)


class TFDriver:
    """``make_tf_dataset``; readers are shards read at once (``cycle_length``), ranks are input pipelines."""

    name = "tf"

    def __init__(self) -> None:
        import tensorflow as tf

        import growcache

        self.tf = tf
        self.make_dataset = growcache.make_tf_dataset

    def make(self, cache: Any, batch_size: int, *, readers: int = 0, rank: tuple[int, int] | None = None,
             **options: Any) -> Any:
        if rank is not None:
            options["input_context"] = self.tf.distribute.InputContext(
                num_input_pipelines=rank[1], input_pipeline_id=rank[0], num_replicas_in_sync=rank[1])
        return self.make_dataset(cache, batch_size, cycle_length=max(readers, 1), **options)

    def epoch(self, reader: Any) -> list[list[int]]:
        return [[int(i) for i in batch["id"].numpy()] for batch in reader]

    def abandon(self, reader: Any) -> bool:
        iterator = iter(reader)
        next(iterator)
        del iterator
        gc.collect()
        return False

    def skipped(self, reader: Any) -> list[Any]:
        return reader.skipped

    def ranks(self, cache_path: str, batch_size: int, world: int, epochs: int, **options: Any) -> list[Any]:
        """Each rank an input pipeline of this process, all running at once (in threads)."""
        import growcache

        datasets = [self.make(growcache.Cache(cache_path), batch_size, rank=(r, world), **options)
                    for r in range(world)]
        results: list[Any] = [[] for _ in range(world)]
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                for _ in range(epochs):
                    results[rank].append(self.epoch(datasets[rank]))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        if errors:
            raise errors[0]
        return results


def _run_rank_processes(adapter: str, cache_path: str, batch_size: int, world: int, epochs: int,
                        options: dict[str, Any]) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    run = uuid.uuid4().hex
    out = os.path.join(cache_path, f"ranks-{run}")
    os.makedirs(out)
    procs = [context.Process(target=_rank_main, args=(adapter, cache_path, batch_size, r, world, epochs, options,
                                                      run, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
    results = []
    for rank, proc in enumerate(procs):
        path = os.path.join(out, f"{rank}.json")
        if proc.exitcode != 0 or not os.path.exists(path):
            raise AssertionError(f"rank {rank} exited with {proc.exitcode}; see its stderr above")
        with open(path) as f:
            results.append(json.load(f))
    return results


def _rank_main(adapter: str, cache_path: str, batch_size: int, rank: int, world: int, epochs: int,
               options: dict[str, Any], run: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), GROWCACHE_RUN_ID=run)
    sys.path.insert(0, HERE)
    import growcache

    driver = TorchDriver() if adapter == "torch" else TFDriver()
    reader = driver.make(growcache.Cache(cache_path), batch_size, **options)
    result = [driver.epoch(reader) for _ in range(epochs)]
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
