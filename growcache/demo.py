"""``growcache demo``: the whole product on an embedded default, in under two minutes.

1. On first run it creates an embedded "remote store": a local directory of synthetic large
   ``.npy`` arrays, read through fsspec's ``file://`` (the same code path as ``s3://``).
2. A :class:`~growcache.SamplerPool` draws random windows of those arrays by byte range,
   throttled to a remote store's bandwidth, into a cache with a small byte budget.
3. A tiny model trains for several epochs with ``make_torch_loader`` (default) or
   ``make_tf_dataset``, each framework in its own process. One table row per epoch shows the
   cache growing, then evicting once it reaches the budget.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue as queue_module
import resource
import shutil
import sys
import time
from typing import Any

import numpy as np

from ._size import format_size, parse_size

__all__ = ["DemoSample", "add_demo_arguments", "ensure_store", "run_demo"]

logger = logging.getLogger(__name__)

ROWS, HEIGHT, WIDTH = 1024, 64, 64  # one store array: 1024 rows of 64x64 float32 (16 MiB)
WINDOW = 4  # rows per sample: 64 KiB
STORE_ARRAYS = 6
FEATURES = {"x": ("float32", (WINDOW, HEIGHT, WIDTH)), "y": ("float32", ())}


class DemoSample:
    """A picklable sample function: a window of the store plus its label, at a capped rate.

    Args:
        source: a :class:`~growcache.sources.NpyWindowSource` of the store.
        mbps_per_worker: bandwidth one worker may draw, like a remote store's per-connection
            throughput; ``0`` means unthrottled.
    """

    def __init__(self, source: Any, mbps_per_worker: float) -> None:
        self.source = source
        self.mbps = mbps_per_worker
        self._next = 0.0

    def __call__(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        x = self.source(rng)["x"]
        if self.mbps > 0:
            now = time.monotonic()
            self._next = max(self._next, now) + x.nbytes / (self.mbps * 1e6)
            time.sleep(max(0.0, self._next - now))
        return {"x": np.ascontiguousarray(x, dtype=np.float32), "y": np.float32(x.mean())}


def ensure_store(directory: str) -> str:
    """Create the embedded store of synthetic ``.npy`` arrays once; return its glob URL."""
    from tqdm import tqdm

    os.makedirs(directory, exist_ok=True)
    missing = [i for i in range(STORE_ARRAYS) if not os.path.exists(os.path.join(directory, f"array-{i}.npy"))]
    rng = np.random.default_rng(2026)
    for i in tqdm(missing, desc="creating demo store", unit="array", disable=not missing):
        # Each row has its own level, so a window's mean is a learnable target.
        levels = rng.standard_normal(ROWS).astype(np.float32)
        array = rng.standard_normal((ROWS, HEIGHT, WIDTH), dtype=np.float32) * 0.5 + levels[:, None, None]
        tmp = os.path.join(directory, f".array-{i}.npy.tmp")
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, os.path.join(directory, f"array-{i}.npy"))
    return "file://" + os.path.abspath(directory) + "/*.npy"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``growcache demo`` flags."""
    parser.add_argument("--framework", choices=["torch", "tf", "both"], default="torch",
                        help="which adapter trains (default torch; 'both' runs each in turn on the same cache)")
    parser.add_argument("--source", default=None,
                        help="fsspec URL/glob of .npy arrays (default: an embedded local store, created on first run)")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option for --source (repeatable)")
    parser.add_argument("--workdir", default=".growcache-demo", help="where the embedded store and cache live")
    parser.add_argument("--cache", default=None, help="cache directory (default: WORKDIR/cache)")
    parser.add_argument("--capacity", default="24MB", help="cache byte budget (default 24MB)")
    parser.add_argument("--shard-size", default="2MB", help="bytes per shard (default 2MB)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per framework (default 8)")
    parser.add_argument("--workers", type=int, default=2, help="sampler processes (default 2)")
    parser.add_argument("--loader-workers", type=int, default=1, help="DataLoader workers (default 1)")
    parser.add_argument("--batch-size", type=int, default=32)
    # 2 workers x 2 MB/s fill the 24 MB default budget in about four 1.5 s epochs: the table
    # shows the cache growing, then evicting.
    parser.add_argument("--store-mbps", type=float, default=2.0,
                        help="bandwidth per sampler worker, to act like a remote store (default 2; 0 = unthrottled)")
    parser.add_argument("--epoch-seconds", type=float, default=1.5,
                        help="minimum seconds per epoch: the tiny model trains fast, this lets the cache grow")
    parser.add_argument("--quick", action="store_true", help="3 short epochs (for tests)")


def _epoch_shards(cache: Any) -> set[int]:
    """The shards this process's newest lease holds: exactly the epoch's snapshot."""
    leases = [lease for lease in cache._manifest.live_leases() if lease.get("pid") == os.getpid()]
    if not leases:
        return set()
    return set(max(leases, key=lambda lease: lease.get("created", 0)).get("seqs", ()))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process only, not its workers
    return usage.ru_utime + usage.ru_stime


# The model is linear in 16384 pixels that share each window's level, so the loss surface's
# steepest direction has curvature about 2 * pixels: plain SGD is stable below 1 / pixels.
_LEARNING_RATE = 0.25 / (WINDOW * HEIGHT * WIDTH)
_PROGRESS_EVERY_S = 0.2


def _train(framework: str, options: dict[str, Any], results: Any) -> None:
    """Child process: train a tiny linear model, report one dict per epoch to ``results``."""
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from .cache import Cache

    cache = Cache(options["cache"])
    features = WINDOW * HEIGHT * WIDTH
    try:
        if framework == "torch":
            import torch

            import growcache

            torch.set_num_threads(1)
            loader = growcache.make_torch_loader(cache, options["batch_size"], num_workers=options["loader_workers"],
                                                 seed=0, persistent_workers=options["loader_workers"] > 0,
                                                 wait_for_shards=60)
            model = torch.nn.Linear(features, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=_LEARNING_RATE)

            def epoch_batches():
                for batch in loader:
                    x = batch["x"].reshape(-1, features)
                    loss = torch.nn.functional.mse_loss(model(x)[:, 0], batch["y"])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    yield len(x), loss.item()
        else:
            import tensorflow as tf

            import growcache

            dataset = growcache.make_tf_dataset(cache, options["batch_size"], seed=0, wait_for_shards=60)
            weights = tf.Variable(tf.zeros([features, 1]))
            bias = tf.Variable(0.0)
            optimizer = tf.keras.optimizers.SGD(_LEARNING_RATE)

            @tf.function
            def step(x, y):
                x = tf.reshape(x, [-1, features])
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((tf.matmul(x, weights)[:, 0] + bias - y) ** 2)
                optimizer.apply_gradients(zip(tape.gradient(loss, [weights, bias]), [weights, bias]))
                return loss

            def epoch_batches():
                for batch in dataset:
                    yield int(batch["y"].shape[0]), float(step(batch["x"], batch["y"]))

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
                    shards = _epoch_shards(cache)
                records += count
                if time.perf_counter() - reported > _PROGRESS_EVERY_S:  # the parent draws the bar
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
        import traceback

        results.put({"framework": framework, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


_HEADER = (f"{'framework':<9} {'epoch':>5} {'shards':>6} {'new':>4} {'evicted':>7} {'records':>7} "
           f"{'MB/s':>7} {'train CPU%':>10} {'sampler MB/s':>12} {'cache':>9} {'loss':>8}")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; return the exit code."""
    from .cache import Cache
    from .sampler import SamplerPool, _parse_storage_options
    from .schema import Schema
    from .sources import NpyWindowSource

    if args.quick:
        args.epochs, args.epoch_seconds = 3, 1.0
    workdir = os.path.abspath(args.workdir)
    cache_dir = args.cache or os.path.join(workdir, "cache")
    # Bad arguments are ValueErrors, which the CLI reports as usage errors (exit 2).
    storage_options = _parse_storage_options(args.storage_option)
    parse_size(args.capacity, name="--capacity")
    parse_size(args.shard_size, name="--shard-size")
    if os.path.isdir(cache_dir) and os.listdir(cache_dir):
        if not os.path.exists(os.path.join(cache_dir, "growcache.json")):
            raise ValueError(
                f"--cache {cache_dir} is a directory that is not a growcache cache; the demo empties its cache "
                "before every run, so it will not touch it. Give a new directory, or leave --cache out."
            )
        shutil.rmtree(cache_dir)  # every demo run starts from an empty cache, to show the growth
    url = args.source or ensure_store(os.path.join(workdir, "store"))
    source = NpyWindowSource(url, WINDOW, storage_options=storage_options)
    cache = Cache(cache_dir, capacity=args.capacity, schema=Schema(FEATURES))
    frameworks = ["torch", "tf"] if args.framework == "both" else [args.framework]
    print(f"store {source!r}\ncache {cache_dir} (budget {format_size(cache.capacity)}, "
          f"shards of {format_size(parse_size(args.shard_size))}), {args.workers} sampler processes\n")
    print(_HEADER)
    failed = False
    ctx = mp.get_context("spawn")
    from tqdm import tqdm

    # The pool starts once the first trainer is ready (framework imported, loader built), so
    # its first epoch sees the first shards and the table shows the cache growing from there.
    pool = SamplerPool(cache, DemoSample(source, args.store_mbps), workers=args.workers,
                       shard_size=args.shard_size, max_shard_age=1.0, seed=0)
    child = None
    try:
        for framework in frameworks:
            options = {"cache": cache_dir, "epochs": args.epochs, "batch_size": args.batch_size,
                       "loader_workers": args.loader_workers, "epoch_seconds": args.epoch_seconds}
            results = ctx.Queue()
            child = ctx.Process(target=_train, args=(framework, options, results), name=f"demo-{framework}")
            child.start()
            last_bytes, last_time = pool.stats().bytes_written, time.monotonic()
            bar = None
            while True:
                try:
                    row = results.get(timeout=1.0)
                except queue_module.Empty:
                    pool.raise_if_failed()
                    if not child.is_alive():
                        print(f"{framework} trainer exited with code {child.exitcode}", file=sys.stderr)
                        failed = True
                        break
                    continue
                if row.get("ready"):
                    pool.start()  # a no-op for the second framework
                    continue
                if "progress" in row:
                    if bar is None:
                        bar = tqdm(desc=f"{framework} epoch {row['epoch']}", unit="rec", leave=False, file=sys.stderr)
                    bar.update(row["progress"] - bar.n)
                    continue
                if bar is not None:
                    bar.close()
                    bar = None
                if row.get("done"):
                    break
                if "error" in row:
                    print(f"{framework} trainer failed: {row['error']}", file=sys.stderr)
                    failed = True
                    break
                stats, now = pool.stats(), time.monotonic()
                sampler_mbps = (stats.bytes_written - last_bytes) / max(now - last_time, 1e-9) / 1e6
                last_bytes, last_time = stats.bytes_written, now
                print(f"{framework:<9} {row['epoch']:>5} {row['shards']:>6} {row['new']:>4} {row['evicted']:>7} "
                      f"{row['records']:>7} {row['mbps']:>7.1f} {row['cpu_pct']:>10.0f} {sampler_mbps:>12.1f} "
                      f"{format_size(cache.stats().bytes):>9} {row['loss']:>8.4f}", flush=True)
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
    finally:
        # A failed pool ends the loop by raising: the trainer must not be left waiting for shards.
        if child is not None and child.is_alive():
            child.kill()
            child.join()
        pool.stop(raise_on_failure=not failed)
    stats = cache.stats()
    print(f"\ncache left at {cache_dir}: {stats.shards} shards, {format_size(stats.bytes)}; "
          f"{stats.published} published, {stats.evicted} evicted. Inspect it with: growcache status {cache_dir}")
    return 1 if failed else 0
