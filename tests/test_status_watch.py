"""``growcache status --watch``: one line per interval without a terminal, a view redrawn in
place on one (a real pseudo-terminal), the fill rate, evictions and leases from the cache's
counters while another process publishes and evicts, and the samplers' figures of a real pool."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import id_sample, write_shards
from growcache.cli import main

INTERVAL = "0.5"


def _exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "growcache")


def test_without_a_terminal_one_line_per_interval_follows_publishes_evictions_and_leases(id_cache):
    write_shards(id_cache, [5, 5])
    held = id_cache.snapshot(holder="test")  # pins the two shards there now
    watch = subprocess.Popen([_exe(), "status", id_cache.path, "--watch", "--interval", INTERVAL, "--count", "4"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = watch.stdout.readline()
        write_shards(id_cache, [5, 5], first_id=10)
        shards = id_cache.list_shards()
        id_cache.evict(to=sum(s.nbytes for s in shards) - shards[2].nbytes)  # the oldest unleased
        rest = [watch.stdout.readline() for _ in range(3)]
        assert watch.wait(60) == 0, watch.stderr.read()
    finally:
        held.close()
        watch.kill()
    assert "shards 2," in first and "fill -" in first and "leases 1 pinning" in first
    lines = [first, *rest]
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d shards \d+, ", line) for line in lines), lines
    assert not any("\x1b" in line for line in lines)
    # Over the three intervals: the two shards published and the one evicted, counted once each.
    assert sum(int(n) for line in rest for n in re.findall(r"\(\+(\d+) shards", line)) == 2, rest
    assert sum(int(n) for line in rest for n in re.findall(r"evicted (\d+) shards", line)) == 1, rest
    assert "shards 3," in rest[-1]


def test_on_a_terminal_the_view_is_redrawn_in_place(id_cache):
    write_shards(id_cache, [5, 5])
    held = id_cache.snapshot(holder="test")
    primary, secondary = pty.openpty()
    watch = subprocess.Popen([_exe(), "status", id_cache.path, "--watch", "--interval", "0.2", "--count", "3"],
                             stdout=secondary, stderr=secondary)
    os.close(secondary)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the terminal's other side closed: the command ended
                break
            if not chunk:
                break
            out += chunk
        assert watch.wait(60) == 0
    finally:
        held.close()
        os.close(primary)
        watch.kill()
    text = out.decode()
    views = text.split("\x1b[7F\x1b[J")  # up to the previous view's first line, clear below
    assert len(views) == 3, text
    for view in views:
        assert view.startswith("cache ") and view.count("\n") == 7, view
        assert "leases     1 live, pinning 2 shards" in view and "samplers " in view
    assert "fill rate  -" in views[0] and "fill rate  0 B/s (+0 shards" in views[2]


def test_watch_arguments_are_checked(id_cache, capsys):
    write_shards(id_cache, [5])
    assert main(["status", id_cache.path, "--watch", "--count", "0"]) == 2
    assert "--count must be at least 1" in capsys.readouterr().err
    assert main(["status", id_cache.path, "--watch", "--interval", "0"]) == 2
    assert main(["status", id_cache.path, "--watch", "--interval", "0.01", "--count", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


# Spawned sampler processes import this module to unpickle it.
def paced_sample(rng: np.random.Generator) -> dict[str, np.ndarray]:
    time.sleep(0.01)
    return id_sample(int(rng.integers(0, 2**31)))


def test_the_samplers_figures_show_in_the_watch_and_the_epoch_line(id_cache):
    pytest.importorskip("growcache._sampler_stats", reason="the samplers' stats files (issue 27) are not here")
    from growcache.epoch import EpochOptions, Epochs
    from growcache.metrics import InputMeter, sampler_reader
    from growcache.sampler import SamplerPool

    with SamplerPool(id_cache, paced_sample, workers=1, shard_size="4KB", max_shard_age=0.2) as pool:
        pool.wait_for(records=10, timeout=60)
        read = sampler_reader(id_cache)
        deadline = time.monotonic() + 30
        while read() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        figures = read()
        assert figures is not None and figures["workers"] == 1
        result = subprocess.run([_exe(), "status", id_cache.path, "--watch", "--count", "1"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and "samplers " in result.stdout and "requests in flight" in result.stdout
        # An epoch's figures carry them too (the core's meter, as every adapter uses it).
        epochs = Epochs(id_cache, EpochOptions(4))
        meter = InputMeter(epochs)
        epoch = epochs.start()
        meter.begin(epoch)
        meter.end(epoch.token, True)
        epoch.end()
    epoch_figures = meter.stats().epoch
    assert epoch_figures.samplers["workers"] == 1
    assert "requests in flight" in epoch_figures.line()
