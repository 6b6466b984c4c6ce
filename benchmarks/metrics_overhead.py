"""Per-batch cost of growcache's input figures (``growcache.metrics``) in the training process.

Issue 31's target: at most 5 µs per batch, nothing per record. The figures touch each batch
in one of three ways, each timed here over ``--batches`` batches against the same loop
without it, on a real :class:`~growcache.epoch.Epochs` over a small cache:

* ``timed``: the torch loader's ``yield from meter.timed(batches, epoch)`` against a plain
  ``yield from batches`` (one generator level, two clock reads and the batch's row count more);
* ``next_done``: the eager TensorFlow iterator's clock read and ``meter.next_done`` per ``next()``;
* ``stage``: ``stage_enter``/``stage_exit`` around each batch growcache's last TensorFlow stage
  makes (a lock, two clock reads).

Nothing is done per record: the counts come from the plan and the shards' sizes. The median
of ``--repeats`` runs is printed as JSON, in nanoseconds per batch; the command exits 1 when
one exceeds the target.

``--loader MIB`` adds end-to-end evidence: a torch loader (2 workers, 1 MiB records, 16 MiB
batches) reads a cache of that many MiB from the page cache, in epochs that alternate between
metrics on and off (the loader's meter bypassed), ``--repeats`` each; MB/s median and range.
Run-to-run noise here is several percent, so this is evidence, not the target.

    .venv/bin/python benchmarks/metrics_overhead.py [--batches 200000] [--repeats 7] [--loader 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from growcache import Cache
from growcache.epoch import EpochOptions, Epochs
from growcache.metrics import InputMeter

TARGET_NS = 5000


def _plain(batches):
    yield from batches


def _metered(meter, epoch, batches):
    yield from meter.timed(batches, epoch)


def _loop(iterator) -> float:
    start = time.perf_counter()
    for _ in iterator:
        pass
    return time.perf_counter() - start


def measure(batches: int = 200_000, repeats: int = 7) -> dict[str, float]:
    """Median nanoseconds per batch that each way of metering adds to its loop."""
    with tempfile.TemporaryDirectory() as root:
        cache = Cache(os.path.join(root, "c"), capacity="1GB", schema={"x": ("float32", (4,))})
        with cache.writer(durable=False) as writer:
            for i in range(64):
                writer.write({"x": np.full(4, i, np.float32)})
        epochs = Epochs(cache, EpochOptions(4))
        meter = InputMeter(epochs, log=False)
        items = [{"x": np.zeros((4, 4), np.float32)}] * batches
        added: dict[str, list[float]] = {"timed": [], "next_done": [], "stage": []}
        for _ in range(repeats):
            epoch = epochs.start()
            meter.begin(epoch)
            plain = _loop(_plain(iter(items)))
            metered = _loop(_metered(meter, epoch, iter(items)))
            epoch.end()
            added["timed"].append((metered - plain) / batches)

            epoch = epochs.start()
            meter.begin(epoch)
            clock, done = meter.clock, meter.next_done
            iterator = iter(items)
            start = time.perf_counter()
            for _ in range(batches):
                next(iterator)
            plain = time.perf_counter() - start
            iterator = iter(items)
            start = time.perf_counter()
            for _ in range(batches):
                started = clock()
                next(iterator)
                done(started, True)
            metered = time.perf_counter() - start
            added["next_done"].append((metered - plain) / batches)

            enter, leave = meter.stage_enter, meter.stage_exit
            start = time.perf_counter()
            for _ in range(batches):
                enter()
                leave(4)
            added["stage"].append((time.perf_counter() - start) / batches)
            meter.end(epoch.token, True)
            epoch.end()
    return {name: round(statistics.median(values) * 1e9, 1) for name, values in added.items()}


def loader_on_off(mib: int, repeats: int) -> dict[str, dict[str, float]]:
    """MB/s of a torch loader's epochs with the figures on and off, alternating."""
    import growcache

    record = 1 << 20
    with tempfile.TemporaryDirectory() as root:
        cache = Cache(os.path.join(root, "c"), capacity="100GB", schema={"x": ("uint8", (record,))})
        payload = np.random.default_rng(0).integers(0, 256, record, np.uint8)
        for _ in range(max(mib // 64, 1)):
            with cache.writer(durable=False) as writer:
                for _ in range(64):
                    writer.write({"x": payload})
        with growcache.make_torch_loader(cache, 16, num_workers=2) as loader:
            return alternate_on_off(loader, repeats, lambda batch: batch["x"].numel())


def alternate_on_off(loader, repeats: int, nbytes_of) -> dict[str, dict[str, float]]:
    """MB/s of ``loader``'s epochs (a growcache torch loader) with its input figures on and off:
    one warm-up epoch, then ``2 * repeats`` epochs alternating on, off (off: the loader's meter
    bypassed); median, min and max of each. ``nbytes_of(batch)`` counts a batch's bytes.
    Shared with ``benchmarks/throughput.py --metrics-ab``."""
    rates: dict[str, list[float]] = {"on": [], "off": []}
    meter = loader._meter
    on = (meter.begin, meter.timed)
    off = (lambda *args: None, lambda batches, epoch: batches)
    try:
        for _ in loader:  # warm-up: workers, page cache
            pass
        for i in range(2 * repeats):
            mode = "on" if i % 2 == 0 else "off"
            meter.begin, meter.timed = on if mode == "on" else off
            start, nbytes = time.perf_counter(), 0
            for batch in loader:
                nbytes += nbytes_of(batch)
            rates[mode].append(nbytes / (time.perf_counter() - start) / 1e6)
    finally:
        meter.begin, meter.timed = on
    return {mode: {"median": round(statistics.median(v), 1), "min": round(min(v), 1), "max": round(max(v), 1),
                   "repeats": len(v)} for mode, v in rates.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200_000, help="batches per run (default: 200000)")
    parser.add_argument("--repeats", type=int, default=7, help="runs; the median is reported (default: 7)")
    parser.add_argument("--loader", type=int, default=0, metavar="MIB",
                        help="also time a torch loader over a cache of MIB MiB, metrics on and off (needs torch)")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    result = measure(args.batches, args.repeats)
    over = {name: ns for name, ns in result.items() if ns > TARGET_NS}
    report: dict = {"ns_per_batch": result, "target_ns": TARGET_NS, "met": not over}
    if args.loader:
        report["loader_mb_per_s"] = loader_on_off(args.loader, args.repeats)
    print(json.dumps(report, indent=2))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
