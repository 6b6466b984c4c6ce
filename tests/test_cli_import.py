"""``growcache import`` as a user runs it: the real console script on TFRecord files, local and on a
store, and what it tells when the budget, a Ctrl-C or a second command gets in the way."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ctrl_c_on_exit_or_kill
from http_store import FaultyHTTPStore, wait_until
from tfrecords import framed, labelled

from growcache import Cache
from growcache.cli import main
from growcache.shard import TMP_PREFIX

SCHEMA = "{'label': ('int64', (), 'int64_list'), 'x': ('uint8', (64,))}"


def _exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "growcache")


def _files(directory, count: int, records: int = 5) -> list[str]:
    directory.mkdir(exist_ok=True)
    paths = []
    for k in range(count):
        path = directory / f"train-{k}.tfrecord"
        path.write_bytes(framed([labelled(k, i) for i in range(records)]))
        paths.append(str(path))
    return paths


def _shards(cache_dir: str) -> int:
    return len(Cache(cache_dir).list_shards()) if os.path.exists(os.path.join(cache_dir, "growcache.json")) else 0


def test_an_import_past_the_budget_says_what_the_cache_still_holds(tmp_path, capsys, caplog):
    # Three 520-byte files into a 1200-byte budget: publishing the third evicts the first. The summary
    # said "imported 3 files: 15 records" and nothing else, and the cache held 10.
    files = _files(tmp_path / "data", 3)
    size = os.path.getsize(files[0])
    cache_dir = str(tmp_path / "cache")
    assert main(["import", "-q", *files, cache_dir, "--capacity", str(2 * size + size // 2)]) == 0
    out = capsys.readouterr().out
    assert "imported 3 files: 15 records in 3 shards" in out, out
    assert "1 shards (5 records) evicted to keep the budget" in out and "the cache holds 10 records in 2 shards" in out
    assert "evicted 1 shards" in caplog.text and "--capacity" in caplog.text, caplog.text
    assert Cache(cache_dir).stats().records == 10
    assert main(["import", "-q", files[0], cache_dir, "--capacity", "10KB"]) == 0  # room: nothing evicted or said
    out = capsys.readouterr().out
    assert "evicted" not in out and "the cache holds 15 records in 3 shards" in out, out


def test_ctrl_c_during_an_import_says_what_was_imported_and_what_was_not(tmp_path):
    # The command exited 1 without a word: which files were in the cache, and which to import again
    # (a file imported twice has its records twice), the user could not tell.
    root = tmp_path / "store"
    root.mkdir()
    cache_dir = str(tmp_path / "cache")
    with FaultyHTTPStore(str(root)) as store:
        urls = [store.put(f"train-{k}.tfrecord", framed([labelled(k, i) for i in range(5)])) for k in range(3)]
        store.hang_paths = {"/train-1.tfrecord"}  # the second file never comes
        proc = subprocess.Popen([_exe(), "import", *urls, cache_dir, "--schema", SCHEMA, "--status-interval", "0.2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        with ctrl_c_on_exit_or_kill(proc) as ctrl_c:
            wait_until(lambda: _shards(cache_dir) == 1 and store.in_flight == 1, timeout=60,
                       what="the first file imported and the second one's request hanging")
            out, err = ctrl_c(timeout=60)
    assert proc.returncode == 1, err
    assert "Traceback" not in err, err
    assert "interrupted (Ctrl-C): imported 1 files: 5 records in 1 shards" in out, out
    assert f"NOT IMPORTED {urls[1]}" in out and f"NOT IMPORTED {urls[2]}" in out and urls[0] not in out, out
    assert _shards(cache_dir) == 1
    assert not [n for n in os.listdir(os.path.join(cache_dir, "shards")) if n.startswith(TMP_PREFIX)]


def test_a_truncated_gzip_file_is_refused_with_where_it_ends(tmp_path, capsys):
    # A .gz file cut short (a copy that died) was refused "at byte offset 0": as if nothing of it
    # were readable, with no hint of where the data stopped.
    import gzip
    import re

    data = framed([labelled(0, i) for i in range(200)])
    packed = gzip.compress(data)
    (tmp_path / "cut.tfrecord.gz").write_bytes(packed[:len(packed) // 2])
    assert main(["import", "-q", str(tmp_path / "cut.tfrecord.gz"), str(tmp_path / "cache"), "--schema", SCHEMA]) == 1
    out = capsys.readouterr().out
    line, = [line for line in out.splitlines() if line.startswith("REFUSED")]
    offset = re.search(r"at byte offset (\d+)", line)
    assert offset is not None and 0 < int(offset.group(1)) < len(data), line
    assert f"{len(packed) // 2} bytes" in line and "truncated" in line, line


def test_a_directory_given_as_a_file_says_to_give_its_files(tmp_path, capsys):
    # `growcache import data/ CACHE` was refused with "IsADirectoryError ... This error is not
    # retryable; fix its cause and start again", and `growcache schema data/` failed the same way.
    files = _files(tmp_path / "data", 2)
    data = str(tmp_path / "data")
    assert main(["import", "-q", data, files[0], str(tmp_path / "cache")]) == 1
    out = capsys.readouterr().out
    assert f"REFUSED {data}: {data} is a directory" in out and f"'{data}/*'" in out, out
    assert "imported 1 files: 5 records" in out and "IsADirectoryError" not in out, out
    assert main(["schema", data]) == 1
    err = capsys.readouterr().err
    assert f"{data} is a directory" in err and f"'{data}/*'" in err and "IsADirectoryError" not in err, err


def test_a_file_given_as_the_cache_is_a_usage_error(tmp_path, capsys):
    # import and sample said "pass a directory path to Cache()", an API hint, and exited 1; a path
    # that is not a cache is a usage error (exit 2), as for status, verify and prune.
    files = _files(tmp_path / "data", 1)
    npy = tmp_path / "a.npy"
    import numpy as np

    np.save(npy, np.zeros((8, 2), np.float32))
    for argv in (["import", "-q", files[0], files[0]], ["sample", "-q", f"file://{npy}", str(npy), "--records", "1"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "is a file, not a directory" in err and "Cache()" not in err and "cache directory" in err, err
    assert os.path.getsize(files[0]) > 0 and np.load(npy).shape == (8, 2), "neither file was touched"


def test_two_imports_into_a_new_cache_the_second_checks_its_files_against_the_first_ones_schema(tmp_path):
    # Two imports into one new cache both infer a schema; the second to store it failed as a whole
    # with "... but Schema(...) was given. Open it without schema= to use the stored one": an API
    # hint for a schema the user never gave. The file is refused against the stored schema instead.
    from growcache import Schema

    root = tmp_path / "store"
    root.mkdir()
    cache_dir = str(tmp_path / "cache")
    with FaultyHTTPStore(str(root)) as store:
        url = store.put("a.tfrecord", framed([labelled(0, i) for i in range(5)]))
        store.latency = 3.0  # the inference's read waits: the other import stores its schema meanwhile
        proc = subprocess.Popen([_exe(), "import", "-q", url, cache_dir], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        with ctrl_c_on_exit_or_kill(proc):
            wait_until(lambda: store.in_flight == 1, timeout=60, what="the inference's read")
            Cache(cache_dir, schema=Schema({"y": ("float32", (2,))}))
            out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert f"REFUSED {url}" in out and "missing ['y']" in out, out
    assert "schema=" not in err and "Traceback" not in err, err
    assert Cache(cache_dir).schema == Schema({"y": ("float32", (2,))})


def test_the_last_status_line_of_a_short_import_gives_its_rate(tmp_path):
    # An import shorter than its first 1 MiB updated the count once, at the end, and one update
    # gave no rate: the last line said "import: 2.6 KB, 0 B/s".
    files = _files(tmp_path / "data", 5)
    result = subprocess.run([_exe(), "import", *files, str(tmp_path / "cache")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    last, = [line for line in result.stderr.splitlines() if line.startswith("import: ")]
    assert last.startswith("import: 2.7 KB, ") and ", 0 B/s," not in last, last
