"""make_torch_loader throughput beside a plain read and the naive ``tfrecord``-package loader.

Writes one cache per record size (1 MiB and 16 KiB payloads) into a temporary directory with
the public API, warms the page cache, then runs each contender in a process of its own:

* ``plain_readinto``: sequential ``readinto`` of the shard files (the physical limit);
* ``tfrecord_indexed``: ``tfrecord.torch.TFRecordDataset`` per shard with index files,
  chained, ``DataLoader(batch_size, num_workers=2)`` (the package's README usage);
* ``growcache_1w`` / ``growcache_2w``: ``growcache.make_torch_loader(reader="tfrecord")``,
  the ``tfrecord`` package framing each record in the workers;
* ``growcache_2w_core_reader``: the same with the default ``reader="growcache"``, the core's
  vectorized reader (``benchmarks/throughput.py`` measures only this default).

Per contender: unique payload MB/s and records/s (median of timed epochs), the training
process's CPU seconds per GB, peak RSS of the training process and of its workers, and the
time to the first batch of the first and of later epochs. Output: JSON on stdout (and
``--json``). Everything is written under a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = {"1MiB": 1 << 20, "16KiB": 16 << 10}
CONTENDERS = ("plain_readinto", "tfrecord_indexed", "growcache_1w", "growcache_2w", "growcache_2w_core_reader")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mib", type=int, default=1024, help="payload MiB per record size (default 1024)")
    parser.add_argument("--shard-mib", type=int, default=128, help="payload MiB per shard (default 128)")
    parser.add_argument("--batch-mib", type=int, default=16, help="payload MiB per batch (default 16)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after one warm-up (default 3)")
    parser.add_argument("--sizes", default="1MiB,16KiB")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny data, one epoch: checks that it runs")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.total_mib, args.shard_mib, args.batch_mib, args.epochs = 8, 2, 1, 1
    return args


def _schema(record_bytes: int) -> dict:
    return {"id": ("int64", ()), "x": ("float32", (record_bytes // 4,))}


def build_cache(root: str, label: str, record_bytes: int, args: argparse.Namespace) -> dict:
    import growcache

    cache = growcache.Cache(os.path.join(root, label), capacity="1TB", schema=_schema(record_bytes))
    payload = np.random.default_rng(0).standard_normal(record_bytes // 4).astype(np.float32)
    total = (args.total_mib << 20) // record_bytes
    per_shard = max(1, (args.shard_mib << 20) // record_bytes)
    written = 0
    while written < total:
        with cache.writer(durable=False) as w:
            for _ in range(min(per_shard, total - written)):
                w.write({"id": np.int64(written), "x": payload})
                written += 1
    paths = [s.path for s in cache.list_shards()]
    index_paths = []
    from growcache.records import iter_records  # offsets for the tfrecord package's index files

    for p in paths:
        ip = p + ".index"
        with open(ip, "w") as f:
            for offset, rec in iter_records(p, verify=False):
                f.write(f"{offset} {len(rec) + 16}\n")
        index_paths.append(ip)
    return {"cache": cache.path, "paths": paths, "index_paths": index_paths, "records": written,
            "record_bytes": record_bytes, "batch_size": max(1, (args.batch_mib << 20) // record_bytes)}


def _epochs(make_iter, count, epochs: int, record_bytes: int) -> dict:
    """One warm-up epoch and ``epochs`` timed ones, in this (the training) process."""
    runs = []
    for e in range(epochs + 1):
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        first = None
        seen = []
        for batch in make_iter():
            if first is None:
                first = time.perf_counter() - t0
            seen.append(count(batch))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        ids = np.concatenate(seen) if seen else np.empty(0)
        unique = int(np.unique(ids).size)
        runs.append({"wall_s": wall, "first_batch_s": first or wall, "records": int(ids.size), "unique": unique,
                     "MBps": unique * record_bytes / wall / 1e6, "train_cpu_s_per_GB": cpu / (unique * record_bytes / 1e9)})
    timed = runs[1:] if len(runs) > 1 else runs
    return {
        "MBps": statistics.median(r["MBps"] for r in timed),
        "records_per_s": statistics.median(r["unique"] / r["wall_s"] for r in timed),
        "train_cpu_s_per_GB": statistics.median(r["train_cpu_s_per_GB"] for r in timed),
        "first_batch_s_epoch1": runs[0]["first_batch_s"],
        "first_batch_s_later": statistics.median(r["first_batch_s"] for r in timed),
        "duplicates": max(r["records"] - r["unique"] for r in runs),
        "epochs": runs,
    }


def run_child(spec: dict) -> dict:
    """Run one contender on one record size; return its figures."""
    name, size = spec["contender"], spec["size"]
    rb, bs = size["record_bytes"], size["batch_size"]
    if name == "plain_readinto":
        buf = bytearray(8 << 20)

        def plain():
            for p in size["paths"]:
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass
            # one "batch" carrying every id: a plain read knows nothing of records
            yield np.arange(size["records"])

        result = _epochs(plain, lambda b: b, spec["epochs"], rb)
    else:
        import torch

        if name == "tfrecord_indexed":
            from tfrecord.torch.dataset import TFRecordDataset

            def decode(ex):
                return {"id": np.frombuffer(ex["id"], np.int64)[0], "x": np.frombuffer(ex["x"], np.float32)}

            desc = {"id": "byte", "x": "byte"}
            ds = torch.utils.data.ChainDataset([TFRecordDataset(p, i, desc, transform=decode)
                                                for p, i in zip(size["paths"], size["index_paths"])])
            loader = torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=2)
        else:
            import growcache

            workers = 1 if name == "growcache_1w" else 2
            reader = "growcache" if name.endswith("core_reader") else "tfrecord"
            loader = growcache.make_torch_loader(size["cache"], bs, num_workers=workers, reader=reader)
        result = _epochs(lambda: iter(loader), lambda b: b["id"].numpy().copy(), spec["epochs"], rb)
    batches_per_epoch = max(1, -(-size["records"] // bs))
    result["steady_batch_s"] = statistics.median(r["wall_s"] for r in result["epochs"][1:] or result["epochs"]) / batches_per_epoch
    result["peak_rss_train_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["peak_rss_worker_MiB"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return result


def main(args: argparse.Namespace) -> dict:
    if args._child:
        with open(args._child) as f:
            spec = json.load(f)
        out = run_child(spec)
        with open(args._child + ".out", "w") as f:
            json.dump(out, f)
        return out
    results: dict = {"sizes": {}, "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}}
    with tempfile.TemporaryDirectory(prefix="growcache-torch-bench-") as root:
        for label in args.sizes.split(","):
            size = build_cache(root, label, SIZES[label], args)
            for p in size["paths"]:  # warm the page cache
                with open(p, "rb") as f:
                    while f.read(64 << 20):
                        pass
            figures = {}
            for name in args.contenders.split(","):
                spec_path = os.path.join(root, f"{label}-{name}.json")
                with open(spec_path, "w") as f:
                    json.dump({"contender": name, "size": size, "epochs": args.epochs}, f)
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", spec_path],
                                      capture_output=True, text=True, timeout=1800)
                if proc.returncode:
                    figures[name] = {"error": proc.stderr[-2000:]}
                    continue
                with open(spec_path + ".out") as f:
                    figures[name] = json.load(f)
                figures[name].pop("epochs", None)
            plain = figures.get("plain_readinto", {}).get("MBps")
            for fig in figures.values():
                if plain and "MBps" in fig:
                    fig["x_plain"] = fig["MBps"] / plain
            results["sizes"][label] = {"records": size["records"], "batch_size": size["batch_size"], **figures}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return results


if __name__ == "__main__":
    main(parse_args())
