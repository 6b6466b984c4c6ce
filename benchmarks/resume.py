"""What an exact mid-epoch resume costs (issue 30): ``state_dict()`` per call, and the time from
``load_state_dict`` to the first resumed batch for states saved at 10%, 50% and 90% of an epoch.

A cache of ``--mib`` MiB of 64 KiB records (fixed layout, so resumed readers seek within a shard)
is read by ``make_torch_loader`` with ``--workers`` workers; for each point of the epoch a loader
reads up to it, saves its state and closes; a new loader loads the state and the time to its
first batch is taken (worker start included, as after a restart). The issue's target: the time at
90% is at most 1.5x the time at 10% (whole windows are passed over by record counts, not read).

Run::

    .venv/bin/python benchmarks/resume.py --mib 1024 --workers 2 --json resume.json

``--quick`` runs 64 MiB (it checks the benchmark works; its figures mean little).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--calls", type=int, default=200, help="state_dict() calls timed")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.mib = 64

    import growcache

    record = 64 << 10
    schema = {"x": ("uint8", (record,)), "id": ("int64", ())}
    directory = tempfile.mkdtemp(prefix="growcache-resume-")
    cache = growcache.Cache(os.path.join(directory, "cache"), capacity=f"{2 * args.mib + 64}MiB", schema=schema)
    records = (args.mib << 20) // record
    per_shard = (32 << 20) // record  # 32 MiB shards
    payload = np.random.default_rng(0).integers(0, 255, record, dtype=np.uint8)
    written = 0
    while written < records:
        with cache.writer() as w:
            for _ in range(min(per_shard, records - written)):
                w.write({"x": payload, "id": np.int64(written)})
                written += 1

    def loader():
        return growcache.make_torch_loader(cache, args.batch_size, num_workers=args.workers, seed=1)

    results = {"mib": args.mib, "workers": args.workers, "batch_size": args.batch_size, "shards": len(cache.list_shards())}
    with loader() as first:
        iterator = iter(first)
        next(iterator)
        started = time.perf_counter()
        for _ in range(args.calls):
            first.state_dict()
        results["state_dict_ms"] = (time.perf_counter() - started) / args.calls * 1e3
        results["state_bytes"] = len(json.dumps(first.state_dict()))
        total = first.last_epoch.batches()
        del iterator
    for share in (0.1, 0.5, 0.9):
        stop = max(1, int(total * share))
        with loader() as before:
            iterator = iter(before)
            for _ in range(stop):
                next(iterator)
            state = json.loads(json.dumps(before.state_dict()))
            del iterator
        started = time.perf_counter()
        with loader() as after:
            after.load_state_dict(state)
            next(iter(after))
            results[f"first_batch_ms_at_{int(share * 100)}"] = (time.perf_counter() - started) * 1e3
    results["ratio_90_to_10"] = results["first_batch_ms_at_90"] / results["first_batch_ms_at_10"]
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    growcache.Cache(os.path.join(directory, "cache")).evict(to=1)
    return None


if __name__ == "__main__":
    sys.exit(main())
