"""Sampler write throughput: SamplerPool from a file:// source of .npy arrays into a cache.

Measured in one run, on the same payload bytes:

* ``plain_write``: sequential ``write`` of 1 MiB buffers into shard-sized files, each
  fsynced, as ShardWriter does: the write limit of this disk;
* ``sampler_<N>w``: a :class:`growcache.SamplerPool` with N workers drawing 1 MiB windows
  (one row of a float32 ``.npy`` array) from ``file://`` by byte range, validating,
  encoding, CRC-ing and publishing shards durably;
* ``shard_source_<N>w`` (with ``--shard-source``): a pool of N workers copying whole
  TFRecord shards of 1 MiB records from ``file://`` with
  :class:`growcache.TFRecordShardSource`, checking every record's CRCs and schema.

Reported per run: aggregate payload MB/s (from the first record to the target, and
including process start-up), each worker's peak RSS, and its RSS sampled over time (to
show it stays flat). Everything is written under a temporary directory, removed at exit.

Usage::

    python benchmarks/sampler_throughput.py [--total 1GiB] [--workers 1 2] [--shard-source] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from growcache import Cache, Schema, parse_size
from growcache.sampler import SamplerPool, SamplerStats
from growcache.sources import NpyWindowSource

TARGETS = {"sampler_vs_plain_write": 0.7}
SHARD_SOURCE_TARGETS = {"shard_source_vs_plain_write": 0.7}
ROW_BYTES = 1 << 20  # one sample: a 1 MiB row of float32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", default="1GiB", help="payload bytes each contender writes (default 1GiB)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    parser.add_argument("--shard-size", default="256MB", help="shard size (default 256MB, the pool's default)")
    parser.add_argument("--source-rows", type=int, default=256, help="1 MiB rows in the source arrays (default 256)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--shard-source", action="store_true",
                        help="also measure TFRecordShardSource copying whole TFRecord shards from file://")
    args = parser.parse_args(argv)
    if args.quick:
        args.total, args.shard_size, args.source_rows = "24MiB", "8MiB", 16
    return args


def _make_source(root: str, rows: int) -> str:
    """Four .npy files of ``rows / 4`` rows of 1 MiB each; returns their glob."""
    os.makedirs(root)
    rng = np.random.default_rng(0)
    per_file = max(1, rows // 4)
    for i in range(4):
        array = rng.integers(0, 2**32, (per_file, ROW_BYTES // 4), dtype=np.uint32).view(np.float32)
        np.save(os.path.join(root, f"part-{i}.npy"), array)
    return f"file://{root}/part-*.npy"


def _plain_write(directory: str, total: int, shard_size: int) -> dict[str, float]:
    """Sequential 1 MiB writes into shard-sized files, each fsynced: the disk's limit here."""
    os.makedirs(directory)
    buffers = [np.random.default_rng(i).bytes(ROW_BYTES) for i in range(8)]
    start = time.perf_counter()
    written = 0
    index = 0
    while written < total:
        path = os.path.join(directory, f"plain-{index}.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            in_file = 0
            while in_file + ROW_BYTES <= shard_size and written < total:
                os.write(fd, buffers[(written // ROW_BYTES) % len(buffers)])
                in_file += ROW_BYTES
                written += ROW_BYTES
            os.fsync(fd)
        finally:
            os.close(fd)
        index += 1
    seconds = time.perf_counter() - start
    shutil.rmtree(directory)
    return {"seconds": seconds, "bytes": written, "MBps": written / seconds / 1e6}


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _sampler(directory: str, source_url: str, workers: int, total: int, shard_size: int) -> dict[str, object]:
    records = total // ROW_BYTES
    schema = Schema({"x": ("float32", (1, ROW_BYTES // 4))})  # a window of one row
    # Room for everything written, so eviction never runs: this measures writing.
    cache = Cache(directory, capacity=total + 2 * workers * shard_size + (64 << 20), schema=schema)
    source = NpyWindowSource(source_url, 1, header_bytes=4096)
    # stop_after: exactly the target, the last shards partial (no worker samples on to fill one).
    pool = SamplerPool(cache, source, workers=workers, shard_size=shard_size, max_shard_age=None, seed=0,
                       stop_after=records)
    result = _measure(pool, workers, lambda stats: stats.finished)
    shutil.rmtree(directory)
    return result


def _measure(pool: SamplerPool, workers: int, finished: Callable[[SamplerStats], bool]) -> dict[str, object]:
    """Run ``pool`` until ``finished(stats)``; its payload MB/s, shards and workers' memory."""
    rss_trace: dict[int, list[tuple[float, int]]] = {}
    t0 = time.perf_counter()
    first = None
    with pool:
        while True:
            stats = pool.stats()
            now = time.perf_counter()
            if first is None and stats.records_written > 0:
                first = (now, stats.records_written)
            for index, pid in enumerate(pool.pids):
                rss = _rss(pid)
                if rss is not None:
                    rss_trace.setdefault(index, []).append((round(now - t0, 2), rss))
            pool.raise_if_failed()
            if finished(stats):
                break
            time.sleep(0.02)
        end = time.perf_counter()
    final = pool.stats()  # after stop: every worker has recorded its peak RSS
    payload = final.records * ROW_BYTES
    # Steady state: from the first record seen to the target (spawn and imports left out).
    steady_bytes = (final.records - (first[1] if first else 0)) * ROW_BYTES
    return {
        "workers": workers,
        "records": final.records,
        "payload_bytes": payload,
        "shards": final.shards,
        "seconds_with_startup": end - t0,
        "MBps_with_startup": payload / (end - t0) / 1e6,
        # Too short a run to tell start-up from steady state: report the whole run.
        "MBps": (steady_bytes / (end - first[0]) / 1e6 if first and end - first[0] > 0.2 and steady_bytes > 0
                 else payload / (end - t0) / 1e6),
        "worker_peak_rss_MB": [round(r / 1e6, 1) for r in final.worker_peak_rss],
        "worker_rss_MB_first_last_quarter": {
            str(i): _quarters(trace) for i, trace in rss_trace.items()
        },
    }


def _make_tfrecord_source(root: str, total: int, shard_size: int) -> str:
    """TFRecord files of 1 MiB records, ``total`` payload bytes in shard-sized files; returns their glob."""
    from growcache.example import ExampleCodec
    from growcache.records import frame_pieces

    os.makedirs(root)
    codec = ExampleCodec(Schema({"x": ("float32", (1, ROW_BYTES // 4))}))
    rows = [np.random.default_rng(i).integers(0, 2**32, (1, ROW_BYTES // 4), dtype=np.uint32).view(np.float32)
            for i in range(8)]
    per_file = max(1, shard_size // (ROW_BYTES + 1024))
    written = index = 0
    while written < total:
        with open(os.path.join(root, f"train-{index:05d}.tfrecord"), "wb") as f:
            for _ in range(per_file):
                if written >= total:
                    break
                pieces, _ = frame_pieces(codec.encode_pieces({"x": rows[(written // ROW_BYTES) % len(rows)]}))
                f.writelines(pieces)
                written += ROW_BYTES
        index += 1
    return f"file://{root}/train-*.tfrecord"


def _shard_source(directory: str, source_url: str, workers: int, total: int, shard_size: int) -> dict[str, object]:
    """A pool copying every remote shard once (one pass) into a cache with room for all of them."""
    from growcache import TFRecordShardSource

    records = total // ROW_BYTES
    schema = Schema({"x": ("float32", (1, ROW_BYTES // 4))})
    cache = Cache(directory, capacity=2 * total + 2 * workers * shard_size + (64 << 20), schema=schema)
    pool = SamplerPool(cache, TFRecordShardSource(source_url), workers=workers, shard_size=2 * shard_size, seed=0)
    result = _measure(pool, workers, lambda stats: stats.records >= records)
    shutil.rmtree(directory)
    return result


def _quarters(trace: list[tuple[float, int]]) -> list[float]:
    """Max RSS (MB) in the first and the last quarter of the run: equal when RSS is flat."""
    n = max(1, len(trace) // 4)
    return [round(max(r for _, r in trace[:n]) / 1e6, 1), round(max(r for _, r in trace[-n:]) / 1e6, 1)]


def main(args: argparse.Namespace) -> dict[str, object]:
    total = parse_size(args.total, name="total")
    shard_size = parse_size(args.shard_size, name="shard_size")
    scratch = args.dir or tempfile.mkdtemp(prefix="growcache-sampler-bench-")
    try:
        source_url = _make_source(os.path.join(scratch, "source"), args.source_rows)
        tfrecord_url = None
        if args.shard_source:
            tfrecord_url = _make_tfrecord_source(os.path.join(scratch, "tfrecords"), total, shard_size)
            os.sync()  # its writeback must not slow what is measured next
        results: dict[str, object] = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
            "total_bytes": total,
            "sample_bytes": ROW_BYTES,
            "shard_size": shard_size,
            "plain_write": _plain_write(os.path.join(scratch, "plain"), total, shard_size),
        }
        for workers in args.workers:
            results[f"sampler_{workers}w"] = _sampler(os.path.join(scratch, f"cache-{workers}"), source_url,
                                                      workers, total, shard_size)
        plain = results["plain_write"]["MBps"]  # type: ignore[index]
        results["targets"] = {
            name: {"target": target, **{
                f"{w}w": round(results[f"sampler_{w}w"]["MBps"] / plain, 3)  # type: ignore[index]
                for w in args.workers}}
            for name, target in TARGETS.items()
        }
        if tfrecord_url is not None:
            for workers in args.workers:
                results[f"shard_source_{workers}w"] = _shard_source(
                    os.path.join(scratch, f"shard-cache-{workers}"), tfrecord_url, workers, total, shard_size)
            results["targets"].update({  # type: ignore[union-attr]
                name: {"target": target, **{
                    f"{w}w": round(results[f"shard_source_{w}w"]["MBps"] / plain, 3)  # type: ignore[index]
                    for w in args.workers}}
                for name, target in SHARD_SOURCE_TARGETS.items()
            })
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
