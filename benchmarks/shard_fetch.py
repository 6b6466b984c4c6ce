"""How fast one large remote TFRecord shard fills a cache: serial reads against parallel ranged parts.

The store is benchmarks/fill.py's: an aiohttp range server in a process of its own behind a
latency relay in another (``--latency-ms`` per request, as an object store takes about 50 ms
to answer a range GET). One remote shard of ``--size-mib`` MiB of 64 KiB records is fetched by
:class:`~growcache.TFRecordShardSource` into a fresh cache, driven as a sampler worker drives it
(fetch, check, publish with the commit hook), once per contender:

* ``serial``: ``concurrency=1``, one ``chunk_bytes`` request at a time (growcache before
  issue 27, and what ``concurrency=1`` still does);
* ``parts_<N>x<P>MiB``: ranged parts of ``P`` MiB, up to ``N`` in flight, bounded by the
  pool's default ``max_bytes_in_flight``;
* ``plain_<N>x<P>MiB``: the store's line rate here, for reference: the same parts as bare
  fsspec ``_cat_file`` tasks, ``N`` in flight, the bytes dropped (nothing checked or written).

Reported per contender: MB/s from the fetch's start to the last piece published, CPU seconds
per GB of this process (fetch, CRC and schema checks, writing, publishing), and the most bytes
of parts held at once.

Run::

    .venv/bin/python benchmarks/shard_fetch.py --latency-ms 50 --size-mib 256 --json shard_fetch.json

``--quick`` fetches a 4 MiB shard (it checks the benchmark works; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fill  # noqa: E402 - the store and its relay are fill.py's

from growcache import Cache, Schema, TFRecordShardSource  # noqa: E402
from growcache._concurrent import DEFAULT_MAX_BYTES_IN_FLIGHT  # noqa: E402
from growcache.example import ExampleCodec  # noqa: E402
from growcache.records import frame_pieces  # noqa: E402
from growcache.sampler import DEFAULT_SHARD_SIZE  # noqa: E402
from growcache.shard_source import FetchJob  # noqa: E402

RECORD_BYTES = 64 << 10
SCHEMA = Schema({"x": ("uint8", (RECORD_BYTES,))})


def make_shard(path: str, nbytes: int) -> int:
    """A TFRecord file of random 64 KiB records, about ``nbytes`` long; returns its size."""
    codec = ExampleCodec(SCHEMA)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        while f.tell() < nbytes:
            record = codec.encode({"x": rng.integers(0, 256, RECORD_BYTES, dtype=np.uint8)})
            for piece in frame_pieces([record])[0]:
                f.write(bytes(piece))
    return os.path.getsize(path)


def fetch_once(url: str, tmp: str, concurrency: int, part_bytes: int) -> dict:
    """Fetch the remote shard into a fresh cache as a sampler worker does; its figures."""
    root = tempfile.mkdtemp(dir=tmp)
    try:
        cache = Cache(os.path.join(root, "cache"), capacity="2GB", schema=SCHEMA)
        source = TFRecordShardSource(url, chunk_bytes=part_bytes)
        job = FetchJob(cache, 0, 0, lambda: False, max_bytes=DEFAULT_SHARD_SIZE, concurrency=concurrency,
                       max_bytes_in_flight=DEFAULT_MAX_BYTES_IN_FLIGHT)
        source.fs  # noqa: B018 - the client is made before the clock starts, as a running worker's is
        began, cpu = time.perf_counter(), time.process_time()
        nbytes = pieces = 0
        with contextlib.closing(source.fetch(job)) as shards:
            for shard in shards:
                info = cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit)
                nbytes += info.nbytes
                pieces += 1
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
        return {"MBps": nbytes / seconds / 1e6, "seconds": seconds, "bytes": nbytes, "pieces": pieces,
                "cpu_s_per_GB": cpu / (nbytes / 1e9), "requests": source.requests,
                "peak_bytes_in_flight": source.peak_bytes_in_flight}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def plain_once(url: str, size: int, in_flight: int, part_bytes: int) -> dict:
    """The store's line rate on this host: one process, ``in_flight`` ranged ``_cat_file`` tasks of
    fsspec's event loop over the whole shard, the bytes dropped (no checking, no writing)."""
    import asyncio

    import fsspec
    import fsspec.asyn

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    limit = asyncio.Semaphore(in_flight)

    async def part(start: int) -> int:
        async with limit:
            return len(await fs._cat_file(url, start=start, end=min(start + part_bytes, size)))

    async def whole() -> int:
        return sum(await asyncio.gather(*(part(s) for s in range(0, size, part_bytes))))

    began, cpu = time.perf_counter(), time.process_time()
    nbytes = fsspec.asyn.sync(fs.loop, whole)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    return {"MBps": nbytes / seconds / 1e6, "seconds": seconds, "bytes": nbytes, "pieces": 0,
            "cpu_s_per_GB": cpu / (nbytes / 1e9), "requests": -(-size // part_bytes),
            "peak_bytes_in_flight": in_flight * part_bytes}


def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "store")
        os.makedirs(data)
        size = make_shard(os.path.join(data, "train-00000"), args.size_mib << 20)
        store = fill.Store(data, args.latency_ms, 0.0)
        try:
            url = f"{store.url}/train-00000"
            contenders = {"serial": (1, 4 << 20)}
            contenders.update({f"parts_{n}x{p}MiB": (n, p << 20) for n in args.concurrency for p in args.part_mib})
            plain = f"plain_{args.concurrency[-1]}x{args.part_mib[0]}MiB"
            runs: dict[str, list[dict]] = {name: [] for name in [*contenders, plain]}
            for _ in range(args.repeat):  # interleaved: a drift of the host hits every contender alike
                for name, (concurrency, part) in contenders.items():
                    runs[name].append(fetch_once(url, tmp, concurrency, part))
                runs[plain].append(plain_once(url, size, args.concurrency[-1], args.part_mib[0] << 20))
        finally:
            store.close()
    results = {"size_bytes": size, "latency_ms": args.latency_ms, "repeat": args.repeat, "cpus": os.cpu_count(),
               "contenders": {name: {**max(rs, key=lambda r: r["MBps"]),
                                     "MBps_all": [round(r["MBps"], 1) for r in rs]} for name, rs in runs.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def markdown(results: dict) -> str:
    lines = ["| contender | MB/s (best) | MB/s (all runs) | CPU s/GB | peak bytes held |", "|---|---:|---|---:|---:|"]
    for name, r in results["contenders"].items():
        lines.append(f"| `{name}` | {r['MBps']:.0f} | {', '.join(f'{x:.0f}' for x in r['MBps_all'])} | "
                     f"{r['cpu_s_per_GB']:.2f} | {r['peak_bytes_in_flight'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256, help="the remote shard's size")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the relay's delay per request")
    parser.add_argument("--concurrency", type=_ints, default=[8, 32], help="parts in flight, e.g. 8,32")
    parser.add_argument("--part-mib", type=_ints, default=[4, 8], help="part sizes, e.g. 4,8")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each contender (the best is reported)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", action="store_true", help="print the table for docs/benchmarks.md")
    parser.add_argument("--quick", action="store_true", help="a 4 MiB shard, one run: checks the benchmark works")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.repeat, args.concurrency, args.part_mib = 4, 1, [8], [1]
    return args


if __name__ == "__main__":
    arguments = parse_args()
    out = main(arguments)
    print(markdown(out) if arguments.markdown else json.dumps(out, indent=2))
