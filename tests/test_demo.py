"""`growcache demo --quick`, the README's main job, end to end in its own processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROW = re.compile(r"^(torch|tf)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s")
# framework epoch shards new evicted records MB/s CPU% sampler-MB/s cache(size unit) loss
ROW_WHOLE = re.compile(r"^(torch|tf) +(\d+ +){5}[\d.]+ +\d+ +[\d.]+ +[\d.]+ [KMG]?B +(-?[\d.]+|nan)$")


@pytest.mark.timeout(240)
def test_demo_quick_grows_the_cache_for_both_frameworks(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "growcache")
    # stderr into the same pipe, as under nohup or SLURM: nothing may land inside the table.
    result = subprocess.run(
        [exe, "demo", "--quick", "--framework", "both", "--workdir", str(tmp_path / "demo")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=220,
    )
    assert result.returncode == 0, result.stdout
    assert "\r" not in result.stdout and "rec/s" not in result.stdout, "no progress bar without a terminal"
    # The advice to declare a user's source thread-safe is for users' sources, not the demo's own.
    assert "thread_safe" not in result.stdout, result.stdout
    rows: dict[str, list[tuple[int, ...]]] = {"torch": [], "tf": []}
    for line in result.stdout.splitlines():
        match = ROW.match(line)
        if match:
            assert ROW_WHOLE.match(line), f"a table row with something else in it: {line!r}"
            rows[match.group(1)].append(tuple(int(g) for g in match.groups()[1:]))
    for framework, epochs in rows.items():
        assert len(epochs) == 3, f"{framework}: {epochs}\n{result.stdout}"
        for epoch, shards, new, evicted, records in epochs:
            assert shards > 0 and records > 0
    torch_shards = [e[1] for e in rows["torch"]]
    assert torch_shards[-1] > torch_shards[0], f"the cache did not grow between epochs: {torch_shards}"
    # The sampler kept publishing while both frameworks read the same cache.
    assert rows["tf"][-1][1] >= torch_shards[0]
    summary = result.stdout.strip().splitlines()[-1]
    assert "growcache status" in summary and os.path.isdir(tmp_path / "demo" / "cache")


@pytest.mark.timeout(120)
def test_demo_ends_at_once_when_its_samplers_fail(tmp_path):
    # The trainer waits up to 60 s for a first shard; a failed pool must end it, not wait it out.
    exe = os.path.join(os.path.dirname(sys.executable), "growcache")
    result = subprocess.run(
        [exe, "demo", "--quick", "--framework", "torch", "--workdir", str(tmp_path / "demo"),
         "--source", f"file://{tmp_path}/nothere/*.npy"],
        capture_output=True, text=True, timeout=50,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nothere" in result.stderr
