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
        # Writers are compared round by round with the plain write, and their CPU is measured. Each
        # round's ratio is that round's plain time over the writer's, so the median ratio lies between
        # these bounds of the reported times (equal to them with --quick's single round): an inverted
        # ratio or a pairing with the wrong round or contender falls outside.
        plain = size["plain_write"]
        paired = [n for n, r in size.items() if isinstance(r, dict) and "vs_plain_paired" in r and n != "plain_write"]
        assert "shard_writer" in paired and size["shard_writer"]["cpu_s_per_GB"] > 0
        for name in paired:
            own = size[name]
            low, high = plain["min_s"] / own["max_s"], plain["max_s"] / own["min_s"]
            assert low * (1 - 1e-9) <= own["vs_plain_paired"] <= high * (1 + 1e-9), name
            assert own["vs_plain_paired_min"] <= own["vs_plain_paired"] <= own["vs_plain_paired_max"], name
        assert size["records"] * (1 << 20 if size is results["sizes"]["1MiB"] else 16 << 10) == size["payload_bytes"]
    assert set(results["targets"]) >= {"writer_vs_plain_write", "reader_1MiB_GBps"}
    writer_target = results["targets"]["writer_vs_plain_write"]
    assert writer_target["measured"] == results["sizes"]["1MiB"]["shard_writer"]["vs_plain_paired"]
    for name, target in results["targets"].items():
        assert target["met"] == (target["measured"] >= target["target"]), name


def test_fused_alignment_measures_every_distance_and_flags_a_cliff():
    import fused_alignment

    from growcache import vector_reader

    if not vector_reader.FUSED:
        from test_vector_reader import _fused_loop_unavailable
        _fused_loop_unavailable()
    results = fused_alignment.measure(mib=20, repeats=1)  # checks a row per distance itself
    assert list(results) == list(fused_alignment.DELTAS) and all(cost > 0 for cost in results.values())
    assert fused_alignment.cliffs({d: 0.13 for d in fused_alignment.DELTAS}) == []
    assert fused_alignment.cliffs({**{d: 0.13 for d in fused_alignment.DELTAS}, 0: 0.40}) == [0]
    assert fused_alignment.cliffs({**{d: 0.13 for d in fused_alignment.DELTAS}, 16: 0.19}) == []
