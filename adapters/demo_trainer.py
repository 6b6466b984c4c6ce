"""The trainer of ``growcache demo``: a tiny model trained with one adapter, in a process of its own.

The demo's parent process (``growcache.demo``) stays framework-free; it starts :func:`train`
in a spawned child per framework and prints the rows the child reports.
"""

from __future__ import annotations

import logging
import os
import resource
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["train"]

_PROGRESS_EVERY_S = 0.2


def _epoch_shards(epochs: Any) -> set[int]:
    """The shards of the epoch the input pipeline started last (``Epochs.latest``). Not the
    live lease: a TF pipeline may read a small epoch to its end, and end its lease, before
    the first batch reaches Python."""
    latest = epochs.latest
    return {shard.seq for shard in latest.shards} if latest is not None else set()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process only, not its workers
    return usage.ru_utime + usage.ru_stime


def _torch_epochs(cache: Any, options: dict[str, Any], features: int, lr: float) -> tuple[Callable[[], Iterator], Any]:
    import torch

    import growcache

    torch.set_num_threads(1)
    loader = growcache.make_torch_loader(cache, options["batch_size"], num_workers=options["loader_workers"],
                                         seed=0, persistent_workers=options["loader_workers"] > 0,
                                         wait_for_shards=60)
    model = torch.nn.Linear(features, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def epoch_batches() -> Iterator[tuple[int, float]]:
        for batch in loader:
            x = batch["x"].reshape(-1, features)
            loss = torch.nn.functional.mse_loss(model(x)[:, 0], batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            yield len(x), loss.item()

    return epoch_batches, loader.epochs


def _tf_epochs(cache: Any, options: dict[str, Any], features: int, lr: float) -> tuple[Callable[[], Iterator], Any]:
    import tensorflow as tf

    import growcache

    dataset = growcache.make_tf_dataset(cache, options["batch_size"], seed=0, wait_for_shards=60)
    weights = tf.Variable(tf.zeros([features, 1]))
    bias = tf.Variable(0.0)
    optimizer = tf.keras.optimizers.SGD(lr)

    @tf.function
    def step(x, y):
        x = tf.reshape(x, [-1, features])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(x, weights)[:, 0] + bias - y) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, [weights, bias]), [weights, bias]))
        return loss

    def epoch_batches() -> Iterator[tuple[int, float]]:
        for batch in dataset:
            yield int(batch["y"].shape[0]), float(step(batch["x"], batch["y"]))

    return epoch_batches, dataset.epochs


def train(framework: str, options: dict[str, Any], results: Any) -> None:
    """Train a tiny linear model for ``options["epochs"]`` epochs; put one dict per epoch on ``results``.

    Args:
        framework: ``"torch"`` or ``"tf"``.
        options: ``cache`` (directory), ``epochs``, ``batch_size``, ``loader_workers``,
            ``epoch_seconds`` (minimum seconds per epoch), ``features`` (values per record)
            and ``learning_rate``.
        results: anything with ``put(dict)`` (the demo passes a one-way pipe); it gets
            ``{"ready": True}`` once the input pipeline is built, ``{"progress": records}``
            now and then, one row per epoch, then ``{"done": True}`` or ``{"error": text}``.
    """
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from growcache.cache import Cache

    cache = Cache(options["cache"])
    try:
        build = _torch_epochs if framework == "torch" else _tf_epochs
        epoch_batches, epochs = build(cache, options, options["features"], options["learning_rate"])
        results.put({"framework": framework, "ready": True})
        previous: set[int] = set()
        evicted_before = cache.stats().evicted
        for epoch in range(options["epochs"]):
            started, cpu_started = time.perf_counter(), _cpu_seconds()
            records = 0
            loss = float("nan")
            first_batch = None
            shards: set[int] = set()
            reported = started
            for count, loss in epoch_batches():
                if first_batch is None:
                    first_batch = time.perf_counter() - started
                    shards = _epoch_shards(epochs)
                records += count
                if time.perf_counter() - reported > _PROGRESS_EVERY_S:  # the parent shows progress
                    results.put({"framework": framework, "epoch": epoch + 1, "progress": records})
                    reported = time.perf_counter()
            # The model is tiny; pacing the epoch lets the samplers grow the cache in between,
            # as a real model's training time would.
            time.sleep(max(0.0, options["epoch_seconds"] - (time.perf_counter() - started)))
            seconds = time.perf_counter() - started
            evicted_now = cache.stats().evicted
            results.put({
                "framework": framework, "epoch": epoch + 1, "shards": len(shards),
                "new": len(shards - previous), "evicted": evicted_now - evicted_before, "records": records,
                "mbps": records * cache.schema.record_payload_bytes / seconds / 1e6,
                "cpu_pct": 100 * (_cpu_seconds() - cpu_started) / seconds, "loss": loss,
                "first_batch_s": first_batch or 0.0, "seconds": seconds,
            })
            previous, evicted_before = shards, evicted_now
        results.put({"framework": framework, "done": True})
    except BaseException as exc:  # the parent prints it; a child traceback alone is easy to miss
        results.put({"framework": framework, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
