"""Shard write and read throughput: ShardWriter and the verifying reader beside plain file I/O.

Everything is measured in one run on the same bytes:

* plain sequential ``write`` of the payload bytes (+ fsync per shard): the write limit here;
* :class:`growcache.ShardWriter` (TFRecord framing, CRC32C, Example encoding, fsync, publish);
* the ``tfrecord`` package's writer, and TensorFlow's ``tf.io.TFRecordWriter`` (in a
  subprocess, since TensorFlow and ``tfrecord`` cannot share a process), when installed;
  each file is fsynced after its writer closes, so every contender is measured durable;
* plain sequential ``readinto`` of the shard files: the read limit here;
* :func:`growcache.records.iter_records` with both CRCs verified.

Usage::

    python benchmarks/shard_io.py [--total 1GiB] [--repeats 5] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import growcache
from growcache.records import iter_records

RECORD_SIZES = {"1MiB": 1 << 20, "16KiB": 16 << 10}
TARGETS = {"writer_vs_plain_write": 0.8, "writer_vs_tfrecord_writer": 2.0, "reader_1MiB_GBps": 2.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", default="1GiB", help="payload bytes per record size (default 1GiB)")
    parser.add_argument("--shard-size", default="256MiB", help="bytes per shard (default 256MiB)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds per contender (default 5); medians are reported")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks that it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.total, args.shard_size, args.repeats = "8MiB", "4MiB", 1
    return args


def _payloads(record_bytes: int, count: int = 32) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 2**32, record_bytes // 4, dtype=np.uint32).view(np.float32) for _ in range(count)]


def _fsync(path: str) -> None:
    # Every writer is measured durable, as ShardWriter and the plain write are.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _summary(seconds: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


def _timed(fn, repeats: int) -> dict[str, float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return _summary(seconds)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed_in_turn(contenders: dict[str, tuple[str, object]], repeats: int) -> dict[str, dict[str, float]]:
    """Time writers in turn, round after round, each from a synced disk and an empty directory.

    On a VM disk the first writer after a quiet spell gets the whole dirty-page budget and the
    next ones pay for its writeback: timing one writer's repeats back to back measured that
    order, not the writers (the same bytes ran at 250-1140 MB/s). So the order flips every
    round, and each writer is also compared with the plain write of its own round
    (``vs_plain_paired``), which cancels the drift of the disk's speed between rounds. The
    process's CPU seconds (user + system, the kernel's copy included) are steadier than wall
    time on a noisy disk and show what each writer itself costs.
    """
    names = list(contenders)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else names[::-1]:
            directory, fn = contenders[name]
            shutil.rmtree(directory, ignore_errors=True)
            os.sync()
            cpu_start, start = _cpu_seconds(), time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
            cpu[name].append(_cpu_seconds() - cpu_start)
    results = {}
    for name in names:
        paired = [plain / own for plain, own in zip(seconds["plain_write"], seconds[name])]
        results[name] = {**_summary(seconds[name]), "cpu_s": statistics.median(cpu[name]),
                         "vs_plain_paired": statistics.median(paired),
                         "vs_plain_paired_min": min(paired), "vs_plain_paired_max": max(paired)}
    return results


def _rate(result: dict[str, float], nbytes: int) -> dict[str, float]:
    if "cpu_s" in result:
        result = {**result, "cpu_s_per_GB": result["cpu_s"] / (nbytes / 1e9)}
    return {**result, "MBps": nbytes / result["median_s"] / 1e6,
            "MBps_min": nbytes / result["max_s"] / 1e6, "MBps_max": nbytes / result["min_s"] / 1e6}


def _plan(total: int, shard: int, record_bytes: int) -> list[int]:
    per_shard = max(1, shard // record_bytes)
    records = max(1, total // record_bytes)
    return [min(per_shard, records - i) for i in range(0, records, per_shard)]


def bench_size(label: str, record_bytes: int, args: argparse.Namespace, scratch: str) -> dict:
    total = growcache.parse_size(args.total)
    plan = _plan(total, growcache.parse_size(args.shard_size), record_bytes)
    payloads = _payloads(record_bytes)
    nbytes = sum(plan) * record_bytes
    out: dict = {"records": sum(plan), "payload_bytes": nbytes, "shards": len(plan)}

    plain_dir = os.path.join(scratch, f"plain-{label}")

    def plain_write() -> None:
        os.makedirs(plain_dir)
        k = 0
        for i, count in enumerate(plan):
            with open(os.path.join(plain_dir, f"{i}.bin"), "wb") as f:
                for _ in range(count):
                    f.write(payloads[k % len(payloads)])
                    k += 1
                f.flush()
                os.fsync(f.fileno())

    schema = growcache.Schema({"x": ("float32", (record_bytes // 4,))})
    cache_dir = os.path.join(scratch, f"cache-{label}")

    def growcache_write() -> None:
        cache = growcache.Cache(cache_dir, capacity=nbytes * 2, schema=schema)
        k = 0
        for count in plan:
            with cache.writer() as writer:
                for _ in range(count):
                    writer.write({"x": payloads[k % len(payloads)]})
                    k += 1

    writers = {"plain_write": (plain_dir, plain_write), "shard_writer": (cache_dir, growcache_write)}
    try:
        import tfrecord

        tfr_dir = os.path.join(scratch, f"tfrecord-{label}")

        def tfrecord_write() -> None:
            os.makedirs(tfr_dir)
            k = 0
            for i, count in enumerate(plan):
                writer = tfrecord.TFRecordWriter(os.path.join(tfr_dir, f"{i}.tfrecord"))
                for _ in range(count):
                    writer.write({"x": (payloads[k % len(payloads)].tobytes(), "byte")})
                    k += 1
                writer.close()
                _fsync(os.path.join(tfr_dir, f"{i}.tfrecord"))

        writers["tfrecord_package_writer"] = (tfr_dir, tfrecord_write)
    except ImportError:
        out["tfrecord_package_writer"] = None
    for name, timing in _timed_in_turn(writers, args.repeats).items():
        out[name] = _rate(timing, nbytes)
    if "tfrecord_package_writer" in writers:
        shutil.rmtree(tfr_dir, ignore_errors=True)

    out["tf_writer"] = _tf_writer(record_bytes, plan, args.repeats, os.path.join(scratch, f"tf-{label}"), nbytes)

    shard_paths = [s.path for s in growcache.Cache(cache_dir).list_shards()]
    file_bytes = sum(os.path.getsize(p) for p in shard_paths)
    buffer = bytearray(8 << 20)

    def plain_read() -> None:
        for path in shard_paths:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass

    def verified_read() -> None:
        for path in shard_paths:
            for _ in iter_records(path, verify=True):
                pass

    plain_read()  # warm the page cache: both readers see the same warm files
    out["plain_readinto"] = _rate(_timed(plain_read, args.repeats), file_bytes)
    out["verifying_reader"] = _rate(_timed(verified_read, args.repeats), file_bytes)
    shutil.rmtree(cache_dir, ignore_errors=True)
    shutil.rmtree(plain_dir, ignore_errors=True)
    return out


_TF_WRITER = r"""
import os, sys, time, json, numpy as np
import tensorflow as tf
record_bytes, plan, repeats, directory = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = np.random.default_rng(0)
payloads = [rng.integers(0, 2**32, record_bytes // 4, dtype=np.uint32).tobytes() for _ in range(32)]
times = []
for _ in range(repeats):
    os.makedirs(directory, exist_ok=True)
    start = time.perf_counter(); k = 0
    for i, count in enumerate(plan):
        with tf.io.TFRecordWriter(os.path.join(directory, f"{i}.tfrecord")) as w:
            for _ in range(count):
                ex = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[payloads[k % 32]]))}))
                w.write(ex.SerializeToString()); k += 1
        fd = os.open(os.path.join(directory, f"{i}.tfrecord"), os.O_RDONLY); os.fsync(fd); os.close(fd)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def _tf_writer(record_bytes: int, plan: list[int], repeats: int, directory: str, nbytes: int) -> dict | None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    try:
        result = subprocess.run([sys.executable, "-c", _TF_WRITER, str(record_bytes), json.dumps(plan), str(repeats),
                                 directory], capture_output=True, text=True, timeout=1800, env=env)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if result.returncode != 0:
        return None
    seconds = json.loads(result.stdout.strip().splitlines()[-1])
    return _rate({"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}, nbytes)


def _table(results: dict) -> str:
    lines = ["| records | contender | MB/s (median) | min-max | vs plain (medians) | vs plain (paired rounds) "
             "| CPU s/GB |", "|---|---|---:|---:|---:|---:|---:|"]
    for label, res in results["sizes"].items():
        for name, base in [("plain_write", "plain_write"), ("shard_writer", "plain_write"),
                           ("tfrecord_package_writer", "plain_write"), ("tf_writer", "plain_write"),
                           ("plain_readinto", "plain_readinto"), ("verifying_reader", "plain_readinto")]:
            r = res.get(name)
            if r:
                paired = (f"{r['vs_plain_paired']:.2f}x ({r['vs_plain_paired_min']:.2f}-{r['vs_plain_paired_max']:.2f})"
                          if "vs_plain_paired" in r else "")
                cpu = f"{r['cpu_s_per_GB']:.2f}" if "cpu_s_per_GB" in r else ""
                lines.append(f"| {label} | {name} | {r['MBps']:.0f} | {r['MBps_min']:.0f}-{r['MBps_max']:.0f} | "
                             f"{r['MBps'] / res[base]['MBps']:.2f}x | {paired} | {cpu} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict:
    scratch = args.dir or tempfile.mkdtemp(prefix="growcache-bench-")
    try:
        results = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                        "growcache": growcache.__version__, "numpy": np.__version__},
            "args": vars(args),
            "sizes": {label: bench_size(label, n, args, scratch) for label, n in RECORD_SIZES.items()},
        }
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    one = results["sizes"]["1MiB"]
    results["targets"] = {
        # Judged on the paired rounds: each round's writer against that round's plain write.
        "writer_vs_plain_write": {"target": TARGETS["writer_vs_plain_write"],
                                  "measured": one["shard_writer"]["vs_plain_paired"]},
        "reader_1MiB_GBps": {"target": TARGETS["reader_1MiB_GBps"], "measured": one["verifying_reader"]["MBps"] / 1e3},
    }
    if one.get("tfrecord_package_writer"):
        results["targets"]["writer_vs_tfrecord_writer"] = {
            "target": TARGETS["writer_vs_tfrecord_writer"],
            "measured": one["tfrecord_package_writer"]["median_s"] / one["shard_writer"]["median_s"]}
    for target in results["targets"].values():
        target["met"] = target["measured"] >= target["target"]
    results["table"] = _table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.write(results["table"] + "\n")
    for name, target in results["targets"].items():
        sys.stdout.write(f"{name}: {target['measured']:.2f} (target >= {target['target']}) "
                         f"{'met' if target['met'] else 'MISSED'}\n")
    return results


if __name__ == "__main__":
    main(parse_args())
