"""make_tf_dataset against the best hand-written tf.data pipeline on the same shards, same run.

Writes a cache of incompressible records per record size into a temporary directory,
then times full epochs of:

* ``growcache``: ``make_tf_dataset(cache, B, shuffle_buffer=0)`` (the same work as the
  hand-written pipelines: no record shuffle);
* ``growcache_shuffled``: ``make_tf_dataset`` with its default shuffle buffer;
* ``growcache_verify``: ``verify=True`` (growcache's CRC pass before TensorFlow reads);
* ``hand_*``: ``from_tensor_slices(paths).interleave(TFRecordDataset) -> batch ->
  parse_example -> decode_raw -> prefetch``, in a few settings; the best counts.

Each contender runs ``--epochs`` epochs after one warm-up epoch; the median epoch is
reported. Output: JSON on stdout (and in ``--out`` if given). Usage::

    python benchmarks/tf_dataset.py --mib 512 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="payload MiB per record size (default 512)")
    parser.add_argument("--shard-mib", type=int, default=32, help="MiB per shard (default 32)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per contender (default 3)")
    parser.add_argument("--sizes", default="1MiB:32,16KiB:256",
                        help="record payload sizes and batch sizes, e.g. '1MiB:32,16KiB:256'")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def _write_cache(root: str, payload: int, total: int, shard_bytes: int):
    from growcache import Cache, Schema

    floats = payload // 4
    cache = Cache(os.path.join(root, f"cache-{payload}"), capacity=total * 4,
                  schema=Schema({"id": ("int64", ()), "x": ("float32", (floats,))}))
    rng = np.random.default_rng(0)
    per_shard = max(1, shard_bytes // payload)
    records = total // payload
    written = 0
    while written < records:
        with cache.writer(durable=False) as writer:
            for _ in range(min(per_shard, records - written)):
                x = rng.integers(0, 2**32, floats, dtype=np.uint32).view(np.float32)
                writer.write({"id": np.int64(written), "x": x})
                written += 1
    return cache


def _hand_written(paths: list[str], batch: int, floats: int, cycle: int, buffer: int):
    import tensorflow as tf

    spec = {"id": tf.io.FixedLenFeature([], tf.string), "x": tf.io.FixedLenFeature([], tf.string)}

    def parse(serialized):
        raw = tf.io.parse_example(serialized, spec)
        return {"id": tf.reshape(tf.io.decode_raw(raw["id"], tf.int64), [-1]),
                "x": tf.reshape(tf.io.decode_raw(raw["x"], tf.float32), [-1, floats])}

    return (tf.data.Dataset.from_tensor_slices(paths)
            .interleave(lambda p: tf.data.TFRecordDataset(p, buffer_size=buffer), cycle_length=cycle,
                        num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
            .batch(batch)
            .map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
            .prefetch(tf.data.AUTOTUNE))


def _epoch(ds) -> tuple[int, float]:
    start = time.perf_counter()
    records = 0
    for batch in ds:
        records += int(batch["id"].shape[0])
    return records, time.perf_counter() - start


def _time_round_robin(contenders: dict[str, Any], epochs: int, payload: int) -> dict[str, dict[str, Any]]:
    """Median epoch of each contender; epochs alternate between contenders so that load
    drift on a shared machine hits all of them alike. One warm-up epoch each first."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    records: dict[str, int] = {}
    for round_ in range(epochs + 1):
        for name, ds in contenders.items():
            records[name], seconds = _epoch(ds)
            if round_:
                times[name].append(seconds)
    out = {}
    for name, ts in times.items():
        seconds = statistics.median(ts)
        out[name] = {"records": records[name], "epoch_s": round(seconds, 4),
                     "epoch_s_all": [round(t, 4) for t in ts],
                     "payload_MBps": round(records[name] * payload / seconds / 1e6, 1),
                     "records_per_s": round(records[name] / seconds, 1)}
    return out


def _parse_size(text: str) -> int:
    from growcache import parse_size

    return parse_size(text)


def main(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import growcache

    results: dict[str, Any] = {"cpus": os.cpu_count(), "tensorflow": tf.__version__, "sizes": []}
    with tempfile.TemporaryDirectory(prefix="growcache-tfbench-") as root:
        for item in args.sizes.split(","):
            size_text, batch_text = item.split(":")
            payload, batch = _parse_size(size_text), int(batch_text)
            cache = _write_cache(root, payload, args.mib << 20, args.shard_mib << 20)
            paths = [s.path for s in cache.list_shards()]
            floats = payload // 4
            contenders = {
                "growcache": growcache.make_tf_dataset(cache, batch, shuffle_buffer=0),
                "growcache_shuffled": growcache.make_tf_dataset(cache, batch),
                "growcache_verify": growcache.make_tf_dataset(cache, batch, shuffle_buffer=0, verify=True),
                "growcache_c8": growcache.make_tf_dataset(cache, batch, shuffle_buffer=0, cycle_length=8),
            }
            for cycle in (4, 8):
                for buffer in (256 << 10, 1 << 20):
                    contenders[f"hand_c{cycle}_b{buffer >> 10}k"] = _hand_written(paths, batch, floats, cycle, buffer)
            row: dict[str, Any] = {"record": size_text, "batch": batch, "shards": len(paths),
                                   "payload_MiB": args.mib, "contenders": {}}
            row["contenders"] = _time_round_robin(contenders, args.epochs, payload)
            for name, figures in row["contenders"].items():
                print(f"{size_text} {name}: {figures['payload_MBps']} MB/s", file=sys.stderr)
            hand = {k: v for k, v in row["contenders"].items() if k.startswith("hand_")}
            best = max(hand, key=lambda k: hand[k]["payload_MBps"])
            row["best_hand_written"] = best
            for name in ("growcache", "growcache_shuffled", "growcache_verify", "growcache_c8"):
                row[f"{name}_vs_best_hand"] = round(
                    row["contenders"][name]["payload_MBps"] / hand[best]["payload_MBps"], 3)
            results["sizes"].append(row)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return results


if __name__ == "__main__":
    main(parse_args())
