"""``growcache demo``: the whole product on an embedded default, in under two minutes.

1. On first run it creates an embedded "remote store": a local directory of synthetic large
   ``.npy`` arrays, read through fsspec's ``file://`` (the same code path as ``s3://``).
2. A :class:`~growcache.SamplerPool` draws random windows of those arrays by byte range,
   throttled to a remote store's bandwidth, into a cache with a small byte budget.
3. A tiny model trains for several epochs with ``make_torch_loader`` (default) or
   ``make_tf_dataset``, each framework in a process of its own
   (``growcache.adapters.demo_trainer``: this module never imports a framework). One table
   row per epoch shows the cache growing, then evicting once it reaches the budget.

The command line (``growcache demo``) parses the flags; :func:`run_demo` takes them.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import sys
import time
from typing import Any, TextIO

import numpy as np

from ._size import format_size, parse_size

__all__ = ["DemoSample", "ensure_store", "run_demo"]

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
    os.makedirs(directory, exist_ok=True)
    missing = [i for i in range(STORE_ARRAYS) if not os.path.exists(os.path.join(directory, f"array-{i}.npy"))]
    if missing:
        logger.info("creating the demo store: %d arrays of %s in %s", len(missing),
                    format_size(ROWS * HEIGHT * WIDTH * 4), directory)
    rng = np.random.default_rng(2026)
    for i in missing:
        # Each row has its own level, so a window's mean is a learnable target.
        levels = rng.standard_normal(ROWS).astype(np.float32)
        array = rng.standard_normal((ROWS, HEIGHT, WIDTH), dtype=np.float32) * 0.5 + levels[:, None, None]
        tmp = os.path.join(directory, f".array-{i}.npy.tmp")
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, os.path.join(directory, f"array-{i}.npy"))
    return "file://" + os.path.abspath(directory) + "/*.npy"


# The model is linear in 16384 pixels that share each window's level, so the loss surface's
# steepest direction has curvature about 2 * pixels: plain SGD is stable below 1 / pixels.
_LEARNING_RATE = 0.25 / (WINDOW * HEIGHT * WIDTH)


class _Table:
    """The per-epoch table, written whole line by whole line to ``out`` (stdout)."""

    COLUMNS = (("framework", "<9", ""), ("epoch", ">5", ""), ("shards", ">6", ""), ("new", ">4", ""),
               ("evicted", ">7", ""), ("records", ">7", ""), ("MB/s", ">7", ".1f"), ("train CPU%", ">10", ".0f"),
               ("sampler MB/s", ">12", ".1f"), ("cache", ">9", ""), ("loss", ">8", ".4f"))

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def write(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def header(self) -> None:
        self.write(" ".join(f"{name:{align}}" for name, align, _ in self.COLUMNS))

    def row(self, *values: Any) -> None:
        self.write(" ".join(f"{value:{align}{fmt}}" for value, (_, align, fmt) in zip(values, self.COLUMNS)))


class _Rows:
    """The trainer's side of the table: rows over a one-way pipe.

    A ``multiprocessing`` queue would do, but its named semaphores outlive a demo killed with
    its process group (see docs/pitfalls.md).
    """

    def __init__(self, send: Any) -> None:
        self._send = send

    def put(self, row: dict[str, Any]) -> None:
        self._send.send(row)


def run_demo(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the demo with the flags of ``growcache demo``; return the exit code.

    Args:
        args: the parsed flags; ``args.storage_options`` holds the parsed ``--storage-option``
            values.
        out: where the table goes. Default: ``sys.stdout``.

    Raises:
        ValueError: ``--cache`` names a directory that is not a growcache cache.
    """
    from ._progress import DEFAULT_INTERVAL, Progress
    from .cache import Cache
    from .sampler import SamplerPool
    from .schema import Schema
    from .sources import NpyWindowSource

    table = _Table(out if out is not None else sys.stdout)
    if args.quick:
        args.epochs, args.epoch_seconds = 3, 1.0
    workdir = os.path.abspath(args.workdir)
    cache_dir = args.cache or os.path.join(workdir, "cache")
    if os.path.isdir(cache_dir) and os.listdir(cache_dir):
        if not os.path.exists(os.path.join(cache_dir, "growcache.json")):
            raise ValueError(
                f"--cache {cache_dir} is a directory that is not a growcache cache; the demo empties its cache "
                "before every run, so it will not touch it. Give a new directory, or leave --cache out."
            )
        shutil.rmtree(cache_dir)  # every demo run starts from an empty cache, to show the growth
    url = args.source or ensure_store(os.path.join(workdir, "store"))
    source = NpyWindowSource(url, WINDOW, storage_options=getattr(args, "storage_options", None))
    cache = Cache(cache_dir, capacity=args.capacity, schema=Schema(FEATURES))
    frameworks = ["torch", "tf"] if args.framework == "both" else [args.framework]
    table.write(f"store {source!r}\ncache {cache_dir} (budget {format_size(cache.capacity)}, "
                f"shards of {format_size(parse_size(args.shard_size))}), {args.workers} sampler processes\n")
    table.header()
    failed = False
    ctx = mp.get_context("spawn")
    from .adapters.demo_trainer import train

    # The pool starts once the first trainer is ready (framework imported, loader built), so
    # its first epoch sees the first shards and the table shows the cache growing from there.
    # concurrency=1: DemoSample stands for a store with a per-worker bandwidth cap, one draw at a
    # time by design (its rate clock is not thread-safe); the default would only log the advice
    # to declare it thread-safe, which is aimed at users' sources, not at the demo's own.
    pool = SamplerPool(cache, DemoSample(source, args.store_mbps), workers=args.workers, concurrency=1,
                       shard_size=args.shard_size, max_shard_age=1.0, seed=0)
    child = None
    try:
        for framework in frameworks:
            options = {"cache": cache_dir, "epochs": args.epochs, "batch_size": args.batch_size,
                       "loader_workers": args.loader_workers, "epoch_seconds": args.epoch_seconds,
                       "features": WINDOW * HEIGHT * WIDTH, "learning_rate": _LEARNING_RATE}
            results, send = ctx.Pipe(duplex=False)
            child = ctx.Process(target=train, args=(framework, options, _Rows(send)), name=f"demo-{framework}")
            try:
                child.start()
            finally:
                send.close()  # the trainer holds the only write end: its exit reads as the pipe's end
            last_bytes, last_time = pool.stats().bytes_written, time.monotonic()
            progress = None
            while True:
                try:
                    row = results.recv() if results.poll(1.0) else None
                except EOFError:  # the trainer exited without saying it was done
                    child.join(30)
                    row = None
                if row is None:
                    pool.raise_if_failed()
                    if not child.is_alive():
                        logger.error("the %s trainer exited with code %s", framework, child.exitcode)
                        failed = True
                        break
                    continue
                if row.get("ready"):
                    pool.start()  # a no-op for the second framework
                    continue
                if "progress" in row:
                    if progress is None:
                        progress = Progress(f"{framework} epoch {row['epoch']}", unit="rec",
                                            interval=getattr(args, "status_interval", DEFAULT_INTERVAL),
                                            quiet=getattr(args, "quiet", False), last_line=False).__enter__()
                    progress.update(row["progress"])
                    continue
                if progress is not None:
                    progress.close()
                    progress = None
                if row.get("done"):
                    break
                if "error" in row:
                    logger.error("the %s trainer failed: %s", framework, row["error"])
                    failed = True
                    break
                stats, now = pool.stats(), time.monotonic()
                sampler_mbps = (stats.bytes_written - last_bytes) / max(now - last_time, 1e-9) / 1e6
                last_bytes, last_time = stats.bytes_written, now
                table.row(framework, row["epoch"], row["shards"], row["new"], row["evicted"], row["records"],
                          row["mbps"], row["cpu_pct"], sampler_mbps, format_size(cache.stats().bytes), row["loss"])
            if progress is not None:
                progress.close()
            results.close()
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
    table.write(f"\ncache left at {cache_dir}: {stats.shards} shards, {format_size(stats.bytes)}; "
                f"{stats.published} published, {stats.evicted} evicted. Inspect it with: growcache status {cache_dir}")
    return 1 if failed else 0
