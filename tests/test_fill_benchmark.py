"""benchmarks/fill.py and benchmarks/serial_rate.py run end to end on tiny data (no speed asserted) and report every figure."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fill_benchmark_quick(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import fill
    finally:
        sys.path.pop(0)
    out = tmp_path / "fill.json"
    args = fill.parse_args(["--quick", "--concurrency", "8", "--json", str(out)])
    args.concurrency, args.seconds = [8], 0.3
    results = fill.main(args)
    assert json.loads(out.read_text())["runs"] == results["runs"]
    (run,) = results["runs"]
    pool, plain = run["contenders"]["pool_1w_c8"], run["contenders"]["plain_32_threads"]
    assert pool["MBps"] > 0 and pool["samples_per_s"] > 0 and plain["MBps"] > 0
    assert pool["first_shard_s"] is not None and 0 < pool["peak_rss_MB"] < 1000
    assert pool["first_batch_s"] >= pool["first_shard_s"]
    table = fill.markdown(results)
    assert "`pool_1w_c8`" in table and "`ideal_32`" in table
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    fill.update_docs(results, str(docs))
    fill.update_docs(results, str(docs))  # replaces its block, never adds a second
    assert docs.read_text().count(fill.BEGIN) == 1


def test_serial_rate_benchmark_quick():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serial_rate
    finally:
        sys.path.pop(0)
    result = serial_rate.main(serial_rate.parse_args(["--quick"]))
    assert result["best_window_samples_per_s"] >= result["samples_per_s"] > 0
