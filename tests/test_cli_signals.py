"""Ctrl-C during ``growcache sample``: the real console script, interrupted as a terminal does it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
from conftest import ctrl_c_on_exit_or_kill

from growcache import Cache
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.shard import TMP_PREFIX

WORKERS = 2
ROWS = np.arange(1000 * 3, dtype=np.int32).reshape(1000, 3)


def _temporaries(cache_dir: str) -> dict[str, int]:
    """Temporary shard files of the cache and their sizes."""
    shards = os.path.join(cache_dir, "shards")
    found = {}
    for directory in (cache_dir, shards):
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        for name in names:
            if name.startswith(TMP_PREFIX) or name.endswith(".tmp"):
                try:
                    found[os.path.join(directory, name)] = os.path.getsize(os.path.join(directory, name))
                except FileNotFoundError:
                    pass
    return found


def _wait_for(what: str, condition, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"growcache sample exited ({proc.returncode}) while waiting for {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"timed out waiting for {what}:\n{out}\n{err}")
        time.sleep(0.05)


def test_ctrl_c_publishes_the_shards_in_progress_and_exits_0(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    np.save(remote / "a.npy", ROWS)
    cache_dir = str(tmp_path / "cache")
    exe = os.path.join(os.path.dirname(sys.executable), "growcache")
    # Shards far larger than what is sampled before the Ctrl-C, and no rotation by age: every
    # shard the cache ends up with is a shard that was in progress when Ctrl-C came.
    proc = subprocess.Popen(
        [exe, "sample", f"file://{remote}/*.npy", cache_dir, "--capacity", "1GB", "--workers", str(WORKERS),
         "--window", "4", "--shard-size", "256MB", "--max-shard-age", "3600", "-q"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    with ctrl_c_on_exit_or_kill(proc) as ctrl_c:
        # Each worker has flushed records of its shard in progress to its temporary file.
        _wait_for("both samplers' shards in progress on disk",
                  lambda: sum(1 for size in _temporaries(cache_dir).values() if size > 0) >= WORKERS, proc)
        assert Cache(cache_dir).list_shards() == [], "nothing published before the Ctrl-C"
        # A terminal's Ctrl-C goes to the whole foreground process group, samplers included.
        out, err = ctrl_c()
    assert proc.returncode == 0, f"exit code {proc.returncode} after Ctrl-C:\n{out}\n{err}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err

    cache = Cache(cache_dir)
    shards = cache.list_shards()
    assert len(shards) == WORKERS, "each sampler published its shard in progress"
    assert _temporaries(cache_dir) == {}, "no temporary left"
    assert cache.verify().ok
    stats = cache.stats()
    assert stats.temporaries == 0 and stats.published == WORKERS and stats.records == sum(s.records for s in shards)
    codec = ExampleCodec(cache.schema)
    seen = 0
    for shard in shards:
        for _, record in iter_records(shard.path):
            x = codec.decode(record)["x"]
            first = int(x[0, 0]) // 3
            assert np.array_equal(x, ROWS[first:first + 4]), "every record is a window of the store's array"
            seen += 1
    assert seen == stats.records > 0
    with cache.snapshot() as snapshot:  # no sampler lease or lock outlived the run
        assert len(snapshot) == WORKERS
