"""What an encoding costs the PyTorch reader: an int64_list label beside a raw feature, against a raw label.

Two caches hold the same records, written by growcache: a raw ``x`` feature (16 KiB by
default) and a scalar int64 label, stored once as raw bytes (``("int64", ())``) and once as
an ``int64_list`` (``("int64", (), "int64_list")``, what TensorFlow users write). Epochs of
``make_torch_loader`` alternate between the two caches (A, B, A, B, ...), so drift of a
shared machine hits both alike. Per epoch: payload MB/s, and the CPU seconds per GB that
the training process and its DataLoader workers spent (steadier than MB/s on a busy
machine); the medians are compared.

Usage::

    python benchmarks/encodings.py [--size 256MiB] [--feature-bytes 16384] [--workers 2] [--epochs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from growcache import Cache, Schema, parse_size

TARGET = 0.9  # int64_list label throughput / raw label throughput


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="256MiB", help="payload bytes per cache (default 256MiB)")
    parser.add_argument("--feature-bytes", type=int, default=16384, help="bytes of the raw feature (default 16384)")
    parser.add_argument("--batch-size", type=int, default=256, help="records per batch (default 256)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs per cache (default 5)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.epochs = "8MiB", 1
    return args


def _fill(cache: Cache, records: int, feature_bytes: int, shard_records: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (64, feature_bytes), dtype=np.uint8)
    for first in range(0, records, shard_records):
        with cache.writer() as writer:
            for i in range(first, min(first + shard_records, records)):
                writer.write({"x": x[i % 64], "label": np.int64(i % 1000)})


def _cpu_seconds() -> float:
    """CPU time of this process and its live children (the DataLoader workers)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def _epoch(loader, feature_bytes: int) -> tuple[float, float, int]:
    """``(MB/s, CPU s/GB, records)`` of one epoch."""
    start, cpu = time.perf_counter(), _cpu_seconds()
    records = 0
    for batch in loader:
        records += len(batch["label"])
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    nbytes = records * feature_bytes
    return nbytes / seconds / 1e6, cpu / (nbytes / 1e9), records


def main(args: argparse.Namespace) -> dict[str, object]:
    import growcache

    total = parse_size(args.size, name="size")
    records = max(total // args.feature_bytes, args.batch_size)
    shard_records = max(1, (64 << 20) // (args.feature_bytes + 64))
    scratch = args.dir or tempfile.mkdtemp(prefix="growcache-encodings-bench-")
    schemas = {
        "raw_label": Schema({"x": ("uint8", (args.feature_bytes,)), "label": ("int64", ())}),
        "int64_list_label": Schema({"x": ("uint8", (args.feature_bytes,)), "label": ("int64", (), "int64_list")}),
    }
    try:
        loaders = {}
        for name, schema in schemas.items():
            cache = Cache(os.path.join(scratch, name), capacity=4 * total + (256 << 20), schema=schema)
            if cache.stats().records != records:
                _fill(cache, records, args.feature_bytes, shard_records)
            loaders[name] = growcache.make_torch_loader(cache, args.batch_size, num_workers=args.workers, seed=0,
                                                        shuffle_buffer=0)
        runs: dict[str, list[float]] = {name: [] for name in schemas}
        cpu: dict[str, list[float]] = {name: [] for name in schemas}
        for name, loader in loaders.items():  # warm up: workers started, pages cached
            _epoch(loader, args.feature_bytes)
        for _ in range(args.epochs):
            for name, loader in loaders.items():
                mbps, cpu_per_gb, seen = _epoch(loader, args.feature_bytes)
                assert seen == records, (name, seen, records)
                runs[name].append(mbps)
                cpu[name].append(cpu_per_gb)
        medians = {name: statistics.median(values) for name, values in runs.items()}
        cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
        ratio = medians["int64_list_label"] / medians["raw_label"]
        cpu_ratio = cpu_medians["raw_label"] / cpu_medians["int64_list_label"]
        results = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
            "records": records,
            "feature_bytes": args.feature_bytes,
            "workers": args.workers,
            "batch_size": args.batch_size,
            "MBps": {name: [round(v, 1) for v in values] for name, values in runs.items()},
            "median_MBps": {name: round(v, 1) for name, v in medians.items()},
            "cpu_s_per_GB": {name: [round(v, 2) for v in values] for name, values in cpu.items()},
            "median_cpu_s_per_GB": {name: round(v, 2) for name, v in cpu_medians.items()},
            # Throughput ratio, and the same by CPU cost (raw label's CPU/GB over int64_list's).
            "int64_list_vs_raw_label": {"ratio": round(ratio, 3), "cpu_ratio": round(cpu_ratio, 3), "target": TARGET,
                                        "met": ratio >= TARGET},
        }
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    text = json.dumps(results, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return results


if __name__ == "__main__":
    main(parse_args())
