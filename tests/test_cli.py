from __future__ import annotations

import os
import subprocess
import sys
import time

from growcache import Cache
from growcache.cli import main
from growcache.example import ExampleCodec
from growcache.records import iter_records

from conftest import ctrl_c_on_exit_or_kill, write_shards


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


def test_a_cache_this_user_may_not_read_is_a_failure_that_says_so(id_cache, tmp_path):
    # os.path.exists said False on EACCES: "not a growcache cache (no growcache.json)", exit 2.
    import growcache.cache  # noqa: F401 - imported before the child drops root (the stdlib may be root's only)

    os.chmod(id_cache.path, 0)
    err = tmp_path / "err"
    pid = os.fork()
    if pid == 0:  # a child, so that dropping root (the only way it is refused) ends with it
        code = 3
        try:
            with open(err, "w") as out:
                if os.geteuid() == 0:
                    os.setgroups([])
                    os.setgid(4242)
                    os.setuid(4242)
                sys.stderr = out
                code = main(["status", id_cache.path])
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    os.chmod(id_cache.path, 0o700)
    assert os.waitstatus_to_exitcode(status) == 1, err.read_text()
    assert "Permission denied" in err.read_text() and "may read it" in err.read_text()


def test_seconds_past_what_a_wait_can_take_are_usage_errors(id_cache, capsys):
    # inf or 1e300 passed the check: status --watch died of an OverflowError traceback in
    # time.sleep, and verify's progress thread died of one while the command exited 0.
    for argv in (["status", id_cache.path, "--watch", "--count", "1", "--interval"],
                 ["verify", id_cache.path, "--status-interval"]):
        for seconds in ("inf", "1e300", "nan", "-1"):
            assert main([*argv, seconds]) == 2, (argv, seconds)
            assert "positive number of seconds" in capsys.readouterr().err
    assert main(["verify", id_cache.path, "--status-interval", "3600"]) == 0


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


def _exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "growcache")


def _store(tmp_path, rows: int = 400, cols: int = 3):
    import numpy as np

    remote = tmp_path / "remote"
    remote.mkdir(exist_ok=True)
    np.save(remote / "a.npy", np.arange(rows * cols, dtype=np.int32).reshape(rows, cols))
    return f"file://{remote}/*.npy"


def test_sample_records_stops_at_the_count_with_default_flags(tmp_path):
    # Default shard size (a quarter of the default 500GB budget, capped at 256 MB): the records
    # are published by the stop, in partial shards, instead of sampling on until a shard fills.
    cache_dir = tmp_path / "fresh"
    result = subprocess.run([_exe(), "sample", _store(tmp_path), str(cache_dir), "--window", "4", "--records", "100",
                             "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    stats = Cache(cache_dir).stats()
    assert stats.records <= 102 and stats.temporaries == 0
    assert f"sampled {stats.records} records in {stats.shards} shards" in result.stdout


def test_version_bare_command_and_help_texts(capsys):
    import growcache

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"growcache {growcache.__version__}"
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: growcache" in err and all(name in err for name in ("status", "verify", "sample", "demo", "bench"))
    assert main(["status", "--help"]) == 0
    assert "the cache directory" in capsys.readouterr().out


def test_bench_runs_the_checkout_script_in_its_own_process(tmp_path):
    result = subprocess.run([_exe(), "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: growcache bench") and "throughput.py" not in result.stdout.split("\n")[0]
    # An installed growcache has no benchmarks/ beside it: the command says how to get them.
    import shutil

    import growcache

    shutil.copytree(os.path.dirname(growcache.__file__), tmp_path / "site" / "growcache")
    code = "import sys; from growcache.cli import main; sys.exit(main(['bench']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")))
    assert result.returncode == 2, result.stderr
    assert "source checkout" in result.stderr and "Clone the growcache repository" in result.stderr


def test_progress_without_a_terminal_is_a_status_line_every_interval(tmp_path, id_cache):
    result = subprocess.run([_exe(), "sample", _store(tmp_path, rows=4000), str(tmp_path / "c"), "--window", "4",
                             "--records", "3000", "--status-interval", "0.1", "--shard-size", "4KB"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("sample: ")]
    assert len(lines) >= 2 and "\r" not in result.stderr, result.stderr
    assert lines[-1].startswith("sample: 3000 of 3000 rec (100%)")
    assert any(not line.split(", ")[1].startswith("0 rec/s") for line in lines), "the rate is measured, not 0"
    write_shards(id_cache, [3, 3])
    result = subprocess.run([_exe(), "verify", id_cache.path], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr.startswith("verify: "), result.stderr


def test_progress_on_a_terminal_routes_log_lines_through_the_bar():
    import io
    import logging

    from growcache._progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)
    root.addHandler(console)
    try:
        with Progress("work", total=10, unit="rec", stream=Terminal()) as progress:
            progress.update(5, "half")
            assert console not in root.handlers, "log lines go through tqdm.write while the bar is up"
        assert console in root.handlers
    finally:
        root.removeHandler(console)


SECRET = "PLANTED-cli-s3cr3t-77aa"


def test_a_malformed_storage_option_never_echoes_its_value(tmp_path, capsys):
    store = f"file://{tmp_path}/none/*.npy"
    for options in ([SECRET], [f"secret:{SECRET}"], [f'client_kwargs={{"aws_secret_access_key": "{SECRET}"'],
                    [f'secret={{"x": {SECRET}'], [f"secret={SECRET}", "secret.inner=1"],
                    ["client_kwargs.x=1", f"client_kwargs={SECRET}"]):
        flags = [f"--storage-option={o}" for o in options]
        assert main(["sample", store, str(tmp_path / "c"), *flags]) == 2, options
        err = capsys.readouterr().err
        assert "--storage-option" in err and SECRET not in err, err
        assert main(["demo", "--workdir", str(tmp_path / "w"), *flags]) == 2, options
        assert SECRET not in capsys.readouterr().err


def test_a_refused_store_fails_the_command_within_the_deadline_with_one_error(tmp_path):
    import re

    from stores import refused_port

    result = subprocess.run(
        [_exe(), "sample", "s3://growcache-test/a.npy", str(tmp_path / "c"), "--window", "2", "--retry-deadline", "3",
         "--retries", "50", f"--storage-option=client_kwargs.endpoint_url=http://127.0.0.1:{refused_port()}",
         "--storage-option=key=anykey", f"--storage-option=secret={SECRET}"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, AWS_EC2_METADATA_DISABLED="true"))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("growcache sample: reading"), result.stderr
    assert "s3://growcache-test/a.npy" in lines[0] and SECRET not in result.stderr
    # Counted, not timed: the 3 s deadline, not the 50 tries (--retries counts the first), ended them.
    attempts = re.search(r"kept failing after (\d+) attempts", lines[0])
    assert attempts is not None and 1 < int(attempts.group(1)) < 50, lines[0]


def test_a_source_of_another_shape_is_one_error_with_a_cli_hint(tmp_path):
    store = _store(tmp_path)
    cache_dir = str(tmp_path / "c")
    assert main(["sample", store, cache_dir, "--window", "4", "--records", "10", "-q"]) == 0
    result = subprocess.run([_exe(), "sample", store, cache_dir, "--window", "8", "--records", "10", "--workers", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "feature 'x': the cache stores dtype int32 shape (4, 3), the source gives dtype int32 shape (8, 3)" in lines[0]
    assert "--window 4" in lines[0] and "astype" not in lines[0]


def test_a_dtype_numpy_does_not_know_is_a_usage_error_not_a_traceback(tmp_path, capsys):
    # np.dtype("floot32") raised a TypeError, which main() let through: a traceback, exit 1.
    remote = tmp_path / "raw"
    remote.mkdir()
    (remote / "a.bin").write_bytes(bytes(32))
    assert main(["sample", f"file://{remote}/*.bin", str(tmp_path / "c"), "--dtype", "floot32", "--shape", "8",
                 "--records", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "'floot32'" in err and "float32" in err and "Traceback" not in err, err
    for shape in ("3,a", "0", ",", "-2"):
        assert main(["sample", f"file://{remote}/*.bin", str(tmp_path / "c"), "--dtype", "uint8", "--shape", shape,
                     "--records", "1", "-q"]) == 2, shape
        assert "--shape" in capsys.readouterr().err


def test_a_budget_too_small_for_one_record_names_the_capacity_flag(tmp_path, capsys):
    # A record of 64 rows x 3 int32 is about 0.8 kB; a 1KB budget gives default shards of a quarter
    # of it. The error said "shard_size=250 B is smaller than one record: raise shard_size", a flag
    # the user never gave, and the budget it came from, stored by that first run, kept failing
    # later runs without --capacity the same way.
    # The first run, into a new directory, leaves no cache behind (and no budget stored); a cache
    # made with that budget before fails the same way without --capacity.
    store = _store(tmp_path)
    cache_dir = str(tmp_path / "c")
    for flags in (["--capacity", "1KB"], []):
        if not flags:
            assert not os.path.exists(cache_dir), "the failed first run removed the cache it created"
            Cache(cache_dir, capacity="1KB")
        assert main(["sample", store, cache_dir, "--window", "64", "--records", "1", "-q", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert "--capacity" in err and "1.0 KB" in err and "raise shard_size" not in err, err
    assert main(["sample", store, cache_dir, "--window", "64", "--records", "1", "-q", "--shard-size", "100"]) == 2
    err = capsys.readouterr().err
    assert "--shard-size 100" in err and "smaller than one record" in err, err
    assert main(["sample", store, cache_dir, "--window", "64", "--records", "1", "-q", "--capacity", "1MB"]) == 0


def test_a_failed_first_sample_leaves_no_cache_directory_behind(tmp_path, capsys):
    # A first `growcache sample` into a new directory that failed (a window longer than the arrays, a
    # budget too small for one record) left the directory behind, holding the budget it stored: the
    # next run without --capacity failed on it again. What the command created goes again, the
    # directories it made above the cache too; a directory that was there before stays.
    store = _store(tmp_path)
    top = tmp_path / "new"
    cache_dir = top / "a" / "cache"
    for flags, code in ((["--window", "1000"], 1), (["--window", "64", "--capacity", "1KB"], 2)):
        assert main(["sample", store, str(cache_dir), "--records", "1", "-q", *flags]) == code, flags
        err = capsys.readouterr().err
        assert "stays" not in err and "Traceback" not in err, err
        assert not top.exists(), os.listdir(top)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["sample", store, str(mine), "--records", "1", "-q", "--window", "1000"]) == 1
    assert (mine / "notes.txt").read_text() == "mine"
    # The run that works makes the cache with the default budget, not the failed run's 1KB.
    assert main(["sample", store, str(cache_dir), "--records", "1", "-q", "--window", "64"]) == 0
    assert Cache(cache_dir).capacity == 500 * 10**9


def test_sample_relist_every_samples_objects_added_while_it_runs(tmp_path):
    import numpy as np

    remote = tmp_path / "remote"
    remote.mkdir()
    np.save(remote / "a.npy", np.zeros((8, 2), dtype=np.int64))
    cache_dir = tmp_path / "live"
    proc = subprocess.Popen([_exe(), "sample", f"file://{remote}/*.npy", str(cache_dir), "--capacity", "10MB",
                             "--window", "1", "--relist-every", "0.2", "--shard-size", "1KB", "--max-shard-age", "0.2",
                             "--concurrency", "1", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with ctrl_c_on_exit_or_kill(proc) as ctrl_c:
        def values() -> set[int]:
            if not (cache_dir / "growcache.json").exists() or Cache(cache_dir).schema is None:
                return set()
            cache = Cache(cache_dir)
            codec = ExampleCodec(cache.schema)
            return {int(codec.decode(r)["x"].flat[0]) for s in cache.list_shards() for _, r in iter_records(s.path)}

        deadline = time.monotonic() + 60
        while values() != {0} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert values() == {0}, "the first object sampled"
        np.save(remote / "b.npy", np.ones((8, 2), dtype=np.int64))
        while 1 not in values() and time.monotonic() < deadline + 60:
            time.sleep(0.1)
        assert 1 in values(), "the object added while the command ran is sampled"
        _, err = ctrl_c()
    assert proc.returncode == 0, err


def test_relist_every_is_for_array_sources(tmp_path, capsys):
    assert main(["sample", f"file://{tmp_path}/*.tfrecord", str(tmp_path / "c"), "--tfrecord",
                 "--relist-every", "5"]) == 2
    assert "--relist-every is for sampling arrays" in capsys.readouterr().err
    assert main(["sample", f"file://{tmp_path}/*.npy", str(tmp_path / "c"), "--relist-every", "0"]) == 2
    assert "--relist-every" in capsys.readouterr().err
