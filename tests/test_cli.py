from __future__ import annotations

import os
import subprocess
import sys

from growcache import Cache
from growcache.cli import main
from growcache.example import ExampleCodec
from growcache.records import iter_records

from conftest import write_shards


def test_status_verify_prune(id_cache, capsys):
    write_shards(id_cache, [3, 3, 3])
    assert main(["status", id_cache.path]) == 0
    out = capsys.readouterr().out
    assert "shards       3" in out and "records      9" in out and "% of budget" in out

    assert main(["verify", "-q", id_cache.path]) == 0
    assert "0 corrupt" in capsys.readouterr().out

    bad = id_cache.list_shards()[1]
    with open(bad.path, "r+b") as f:
        f.seek(30)
        f.write(b"\x00\x01\x02")
    assert main(["verify", "-q", id_cache.path]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT {bad.path} at byte offset 0" in out and "1 corrupt" in out

    assert main(["verify", "-q", "--remove-corrupt", id_cache.path]) == 1
    assert f"REMOVED {bad.path}" in capsys.readouterr().out
    assert len(Cache(id_cache.path).list_shards()) == 2

    assert main(["prune", id_cache.path, "--to", "1"]) == 0
    assert "evicted 2 shards" in capsys.readouterr().out
    assert Cache(id_cache.path).list_shards() == []


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main([]) == 2
    assert main(["status"]) == 2
    assert main(["prune", str(tmp_path), "--to", "lots"]) == 2
    assert main(["status", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["status", str(tmp_path)]) == 2


def test_demo_refuses_a_cache_directory_it_did_not_make(tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("my data")
    assert main(["demo", "--workdir", str(tmp_path / "w"), "--cache", str(precious), "--quick"]) == 2
    assert "not a growcache cache" in capsys.readouterr().err
    assert (precious / "thesis.txt").read_text() == "my data"
    assert main(["demo", "--workdir", str(tmp_path / "w"), "--capacity", "bogus", "--quick"]) == 2
    assert main(["demo", "--workdir", str(tmp_path / "w"), "--storage-option", "novalue", "--quick"]) == 2


def test_console_script_is_installed(id_cache):
    exe = os.path.join(os.path.dirname(sys.executable), "growcache")
    result = subprocess.run([exe, "status", id_cache.path], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "budget" in result.stdout


def test_sample_grows_a_cache_from_a_store_url(tmp_path):
    import numpy as np

    remote = tmp_path / "remote"
    remote.mkdir()
    rows = np.arange(40 * 3, dtype=np.int32).reshape(40, 3)
    np.save(remote / "a.npy", rows)
    cache_dir = tmp_path / "cli-cache"
    exe = os.path.join(os.path.dirname(sys.executable), "growcache")
    result = subprocess.run(
        [exe, "sample", f"file://{remote}/*.npy", str(cache_dir), "--capacity", "10MB", "--workers", "2",
         "--window", "4", "--records", "40", "--shard-size", "1KB", "--max-shard-age", "0.5", "-q"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    cache = Cache(cache_dir)
    assert cache.schema is not None and cache.schema["x"].shape == (4, 3)
    assert cache.stats().records >= 40 and cache.stats().temporaries == 0, "--records 40 reached"
    codec = ExampleCodec(cache.schema)
    windows = [codec.decode(record)["x"] for shard in cache.list_shards() for _, record in iter_records(shard.path)]
    assert len(windows) == cache.stats().records
    for x in windows:  # each record is 4 consecutive rows of the remote array
        first = int(x[0, 0]) // 3
        assert np.array_equal(x, rows[first:first + 4]), x


def test_sample_usage_and_store_errors(tmp_path, capsys):
    assert main(["sample", str(tmp_path)]) == 2  # no cache path
    assert main(["sample", "file:///x/*.npy", str(tmp_path / "c"), "--storage-option", "novalue"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    store = f"file://{tmp_path}/none/*.npy"
    for extra, message in [(["--workers", "0"], "--workers"), (["--dtype", "float32"], "--dtype and --shape"),
                           (["--seed", "-1"], "--seed"), (["--capacity", "1MB", "--shard-size", "2MB"], "--shard-size")]:
        assert main(["sample", store, str(tmp_path / "c3"), *extra]) == 2, extra
        assert message in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["sample", f"file://{empty}/*.npy", str(tmp_path / "c2"), "--records", "1", "-q"]) == 1
    assert str(empty) in capsys.readouterr().err
