"""Count and shape flags of ``growcache sample`` and ``growcache demo``: absurd values are usage errors
(exit 2) that say the limit and why, before anything is created or started."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from growcache.cli import main


def _store(tmp_path) -> str:
    remote = tmp_path / "remote"
    remote.mkdir(exist_ok=True)
    np.save(remote / "a.npy", np.arange(400 * 3, dtype=np.int32).reshape(400, 3))
    return f"file://{remote}/*.npy"


def _limit() -> int:
    return max(64, 8 * (os.cpu_count() or 1))


def test_workers_past_what_the_machine_runs_are_a_usage_error_that_says_the_limit(tmp_path, capsys):
    # --workers 100000 was taken: the pool spawned processes that never got going, and Ctrl-C took
    # about two minutes. The command now refuses at once, says the bound and why, and creates nothing.
    cache_dir = tmp_path / "c"
    started = time.monotonic()
    assert main(["sample", _store(tmp_path), str(cache_dir), "--window", "4", "--records", "10", "-q",
                 "--workers", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--workers 100000" in err and f"at most {_limit()}" in err and "per CPU" in err, err
    assert "--concurrency" in err, "says how to get more requests in flight instead"
    assert time.monotonic() - started < 10 and not cache_dir.exists()
    for argv in (["demo", "--workdir", str(tmp_path / "w"), "--workers", "100000"],
                 ["demo", "--workdir", str(tmp_path / "w"), "--loader-workers", "100000"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"at most {_limit()}" in err and argv[-2] in err, err
    assert not (tmp_path / "w").exists()
    # A count within the bound runs.
    assert main(["sample", _store(tmp_path), str(cache_dir), "--window", "4", "--records", "10", "-q",
                 "--workers", "2"]) == 0


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "5000"], "--concurrency must be from 1 to 4096"),
    (["--concurrency", "0"], "--concurrency must be from 1 to 4096"),
    # A count past 64 bits wrapped around in the pool's shared counters: 2**64 + 10 sampled 10.
    (["--records", str(2**64 + 10)], "--records must be from 1 to"),
    (["--records", str(2**64)], "--records must be from 1 to"),
])
def test_counts_without_a_sane_bound_are_usage_errors_before_the_cache_is_made(tmp_path, capsys, flags, message):
    cache_dir = tmp_path / "c"
    assert main(["sample", _store(tmp_path), str(cache_dir), "--window", "4", "-q", *flags]) == 2, flags
    err = capsys.readouterr().err
    assert message in err and flags[1] in err, err
    assert not cache_dir.exists()


@pytest.mark.parametrize("shape, part", [
    ("3,x", "'x'"),  # read as (3,): "x" was taken for a separator, the empty parts dropped
    ("3,,4", "part 2 of 3"),  # read as (3, 4)
    ("3,", "part 2 of 2"),  # read as (3,)
    (",4", "part 1 of 2"),
    ("256x", "part 2 of 2"),
    ("-2", "'-2'"),
    ("0,4", "'0'"),
    ("1.5", "'1.5'"),
    ("3,a", "'a'"),
    ("", "is empty"),
])
def test_a_shape_with_a_bad_or_empty_part_is_a_usage_error_naming_it(tmp_path, capsys, shape, part):
    cache_dir = tmp_path / "c"
    assert _sample_raw(tmp_path, shape) == 2, shape
    err = capsys.readouterr().err
    assert f"--shape {shape!r}" in err and part in err and "e.g. --shape 256,256" in err, err
    assert not cache_dir.exists()


@pytest.mark.parametrize("shape, expected", [("3,4", (3, 4)), ("3x4", (3, 4)), (" 12 ", (12,)), ("2, 6", (2, 6))])
def test_good_shapes_are_read_whole(tmp_path, shape, expected):
    from growcache import Cache

    assert _sample_raw(tmp_path, shape) == 0, shape
    assert Cache(tmp_path / "c").schema["x"].shape == expected


def _sample_raw(tmp_path, shape: str) -> int:
    """``growcache sample`` of one raw 12-byte object as uint8 of ``shape`` into ``tmp_path/c``."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.bin").write_bytes(bytes(12))
    return main(["sample", f"file://{raw}/*.bin", str(tmp_path / "c"), "--dtype", "uint8", "--shape", shape,
                 "--records", "1", "-q"])
