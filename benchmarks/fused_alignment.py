"""CPU cost of the fused read-check-copy loop (``growcache._frames``) by row alignment.

The loop copies each payload from its read buffer to its batch row. Where the row's address
and the payload's, modulo 4 KiB, are close, a forward copy stalls on 4K aliasing, and the
loop takes two passes instead (``aliases_forward`` in ``growcache/_frames.c``). Which
distances stall differs between CPUs; this measures them on the machine at hand.

For each distance ``delta`` (row address minus payload address, modulo 4096), one shard of
1 MiB payloads in the page cache is placed into rows at that distance, ``--repeats`` times;
the median CPU seconds per GB is printed, with the path the loop takes. Target: no distance
costs more than 1.5x the median over all of them (a cliff means the rule in
``aliases_forward`` is wrong for this CPU); the command exits 1 when one does.

    .venv/bin/python benchmarks/fused_alignment.py [--mib 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from growcache import Cache
from growcache.example import ExampleCodec
from growcache.vector_reader import _PLACED, FUSED, _aligned, _frames, _FixedFrames

DELTAS = (0, 16, 64, 128, 256, 512, 1024, 2047, 2048, 2560, 3072, 3584, 4080)
PAYLOAD = 1 << 20


def measure(mib: int = 512, repeats: int = 5) -> dict[int, float]:
    """Median CPU seconds per GB of the fused loop for each distance in :data:`DELTAS`."""
    with tempfile.TemporaryDirectory() as root:
        cache = Cache(os.path.join(root, "c"), capacity="100GB", schema={"x": ("uint8", (PAYLOAD,))})
        payload = np.random.default_rng(0).integers(0, 256, PAYLOAD, np.uint8)
        with cache.writer(durable=False) as writer:
            for _ in range(mib):
                writer.write({"x": payload})
        path = cache.list_shards()[0].path
        fixed = _FixedFrames(ExampleCodec(cache.schema))
        count = os.path.getsize(path) // fixed.frame
        with open(path, "rb") as f:  # into the page cache
            while f.read(8 << 20):
                pass
        _, scratch = _aligned(1 << 20)
        scratch_address = np.frombuffer(scratch, np.uint8).ctypes.data
        rows = np.empty(16 * (PAYLOAD + 8192), np.uint8)
        rows[:] = 0  # faulted in before timing
        # Where each payload lies in the scratch buffer (reads start at the frames' offset 0,
        # a scratch buffer apart) and which row it goes to: 16 rows, reused. A payload that
        # spans two reads continues at the start of the scratch buffer, at the same distance
        # from its row: the buffer is a whole number of 4 KiB pages.
        offsets = (np.arange(count, dtype=np.int64) * fixed.frame + fixed.payloads[0][0]) % len(scratch)
        bases = rows.ctypes.data + (np.arange(count) % 16) * (PAYLOAD + 8192)
        results = {}
        fd = os.open(path, os.O_RDONLY)
        try:
            for delta in DELTAS:
                addresses = (bases + (scratch_address + offsets + delta - bases) % 4096).astype(np.uint64)
                assert np.all((addresses - scratch_address - offsets.astype(np.uint64)) % 4096 == delta)
                costs = []
                for _ in range(repeats):
                    started = time.process_time()
                    placed, why = _frames.place(fd, 0, count, fixed.template, fixed.segments, 1,
                                                addresses.tobytes(), scratch, True)
                    costs.append((time.process_time() - started) / (count * PAYLOAD / 1e9))
                    if (placed, why) != (count, _PLACED):
                        raise RuntimeError(f"placed {placed} of {count} frames, stop reason {why}")
                last = int(addresses[-1]) - rows.ctypes.data  # no later record overwrote it
                if not np.array_equal(rows[last:last + PAYLOAD], payload):
                    raise RuntimeError(f"delta {delta}: the last record's row does not hold its payload")
                results[delta] = statistics.median(costs)
        finally:
            os.close(fd)
    return results


def cliffs(results: dict[int, float]) -> list[int]:
    """The distances that cost more than 1.5x the median over all of them."""
    typical = statistics.median(results.values())
    return [delta for delta, cost in results.items() if cost > 1.5 * typical]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="payload MiB in the shard (default 512)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not FUSED:
        print("the fused loop is not built here (growcache.vector_reader.FUSED is False)", file=sys.stderr)
        return 2
    results = measure(args.mib, args.repeats)
    failed = cliffs(results)
    for delta, cost in results.items():
        rule = "two passes" if delta < 2048 else "fused"  # the rule of aliases_forward in _frames.c
        flag = "  <-- over 1.5x the median" if delta in failed else ""
        print(f"delta {delta:5d}: {cost:.3f} CPU s/GB ({rule}){flag}")
    verdict = ("FAILED: a cliff at " + ", ".join(map(str, failed)) if failed
               else "passed: no distance costs over 1.5x the median")
    print(f"median {statistics.median(results.values()):.3f} CPU s/GB; {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
