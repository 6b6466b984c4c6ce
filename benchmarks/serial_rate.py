"""The rate of one sampler process drawing one sample at a time: ``SamplerPool(concurrency=1)``.

Issue 27's target: ``concurrency=1`` keeps at least 0.95x the rate of the code before
concurrency, measured where per-sample overhead shows: ``file://``, no latency, 16 KiB
windows of ``.npy`` arrays read with ``NpyWindowSource``, one worker. The script runs the same
way on code without a ``concurrency`` argument, so the old code can be measured from a git
worktree and compared in alternating runs on the same host::

    git worktree add /tmp/old <commit before concurrency>   # and copy the built _frames*.so into it
    for i in 1 2 3 4 5 6; do
        PYTHONPATH=/tmp/old .venv/bin/python benchmarks/serial_rate.py   # run from outside the repo root
        .venv/bin/python benchmarks/serial_rate.py
    done
    git worktree remove /tmp/old

Reported (JSON on stdout): the mean samples/s over the measured seconds and the best rate over
any window of at least 0.7 s (the host is shared: the best window is the least disturbed).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import tempfile
import time

import numpy as np

ROW_BYTES = 16 << 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds (default 4)")
    p.add_argument("--arrays", type=int, default=4)
    p.add_argument("--array-bytes", type=int, default=64 << 20)
    p.add_argument("--dir", default=None, help="keep the arrays here and reuse them")
    p.add_argument("--quick", action="store_true", help="tiny and short: checks that it works")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.arrays, args.array_bytes = 0.8, 2, 1 << 20
    return args


def main(args: argparse.Namespace) -> dict:
    import growcache
    from growcache import Cache, SamplerPool, Schema
    from growcache.sources import NpyWindowSource

    tmp = tempfile.mkdtemp(prefix="growcache-serial-")
    try:
        data = args.dir or os.path.join(tmp, "data")
        os.makedirs(data, exist_ok=True)
        rng = np.random.default_rng(0)
        for i in range(args.arrays):
            path = os.path.join(data, f"arr{i}.npy")
            if not os.path.exists(path):
                np.save(path, rng.integers(0, 255, (max(1, args.array_bytes // ROW_BYTES), ROW_BYTES), np.uint8))
        urls = [f"file://{data}/arr{i}.npy" for i in range(args.arrays)]
        cache = Cache(os.path.join(tmp, "cache"), capacity="8GiB", schema=Schema({"x": ("uint8", (1, ROW_BYTES))}))
        # The code before concurrency has no such argument and draws one sample at a time anyway.
        serial = {"concurrency": 1} if "concurrency" in inspect.signature(SamplerPool).parameters else {}
        pool = SamplerPool(cache, NpyWindowSource(urls, 1), workers=1, shard_size="64MiB", seed=1, **serial)
        with pool:
            deadline = time.monotonic() + 60
            while pool.stats().records_written < 100 and time.monotonic() < deadline:
                time.sleep(0.01)
            points = []
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                points.append((time.monotonic(), pool.stats().records_written))
                time.sleep(0.05)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (t0, n0), (t1, n1) = points[0], points[-1]
    windows = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points) for b in points[i:]
               if b[0] - a[0] >= min(0.7, (t1 - t0) / 2)]
    return {"code": os.path.dirname(os.path.dirname(os.path.abspath(growcache.__file__))),
            "samples_per_s": (n1 - n0) / (t1 - t0), "best_window_samples_per_s": max(windows),
            "load_average": os.getloadavg()[0]}


if __name__ == "__main__":
    print(json.dumps(main(parse_args())))
