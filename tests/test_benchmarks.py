"""The benchmark scripts run end to end on tiny data. No speed is asserted here."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))


def test_shard_io_quick(tmp_path):
    import shard_io

    out = tmp_path / "shard_io.json"
    results = shard_io.main(shard_io.parse_args(["--quick", "--json", str(out)]))
    assert json.loads(out.read_text())["sizes"].keys() == {"1MiB", "16KiB"}
    for size in results["sizes"].values():
        for name in ("plain_write", "shard_writer", "plain_readinto", "verifying_reader"):
            assert size[name]["MBps"] > 0, name
        # Writers are compared round by round with the plain write, and their CPU is measured.
        assert size["plain_write"]["vs_plain_paired"] == 1.0
        assert size["shard_writer"]["vs_plain_paired"] > 0 and size["shard_writer"]["cpu_s_per_GB"] > 0
        assert size["records"] * (1 << 20 if size is results["sizes"]["1MiB"] else 16 << 10) == size["payload_bytes"]
    assert set(results["targets"]) >= {"writer_vs_plain_write", "reader_1MiB_GBps"}
    writer_target = results["targets"]["writer_vs_plain_write"]
    assert writer_target["measured"] == results["sizes"]["1MiB"]["shard_writer"]["vs_plain_paired"]
