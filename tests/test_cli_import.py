"""``growcache import`` as a user runs it: the real console script on TFRecord files, local and on a
store, and what it tells when the budget, a Ctrl-C or a second command gets in the way."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ctrl_c_on_exit_or_kill, id_sample, write_shards
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
    assert last.startswith("import: 2.7 KB of 2.7 KB (100%), ") and ", 0 B/s," not in last, last


def test_an_import_that_imports_nothing_into_a_new_cache_leaves_no_cache_and_no_budget(tmp_path, capsys):
    # Every file refused: `growcache import --capacity 1KB` still made the cache and stored the 1KB
    # budget, and the next import into that path kept it (evicting all but the last file). Nothing
    # of the failed import stays: neither the directory, nor the directories it made above it.
    (tmp_path / "bad.tfrecord").write_bytes(b"not a tfrecord file")
    top = tmp_path / "new"
    cache_dir = str(top / "a" / "cache")
    assert main(["import", "-q", str(tmp_path / "bad.tfrecord"), cache_dir, "--capacity", "1KB"]) == 1
    out = capsys.readouterr().out
    assert f"REFUSED {tmp_path / 'bad.tfrecord'}" in out and f"the cache directory {cache_dir} that it created was " \
           "removed" in out, out
    assert not top.exists()
    files = _files(tmp_path / "data", 3)  # 545 bytes each: 1KB would hold one
    assert main(["import", "-q", str(tmp_path / "bad.tfrecord"), *files, cache_dir, "--schema", SCHEMA]) == 1
    assert Cache(cache_dir).capacity == 500 * 10**9 and Cache(cache_dir).stats().records == 15
    # An import that imported files does not remove the cache; nor one into a directory that was there.
    assert main(["import", "-q", str(tmp_path / "bad.tfrecord"), cache_dir]) == 1
    assert "removed" not in capsys.readouterr().out and Cache(cache_dir).stats().records == 15
    mine = tmp_path / "mine"
    mine.mkdir()
    assert main(["import", "-q", str(tmp_path / "bad.tfrecord"), str(mine)]) == 1
    assert mine.is_dir() and "removed" not in capsys.readouterr().out


def test_a_new_cache_another_command_uses_stays_and_the_summary_says_why(tmp_path):
    # Two first imports into one new directory: the one that fails must not remove the cache under
    # the other, which opened it meanwhile (its claim's shared lock on the directory says so).
    from growcache.cache_claim import CacheClaim

    root = tmp_path / "store"
    root.mkdir()
    cache_dir = str(tmp_path / "cache")
    with FaultyHTTPStore(str(root)) as store:
        url = store.put("bad.tfrecord", b"not a tfrecord file")
        store.latency = 3.0
        proc = subprocess.Popen([_exe(), "import", "-q", url, cache_dir], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        with ctrl_c_on_exit_or_kill(proc):
            wait_until(lambda: store.in_flight == 1, timeout=60, what="the inference's read")
            other = CacheClaim(cache_dir)
            other.opened(Cache(cache_dir))
            out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert f"nothing was imported into the cache directory {cache_dir} that it created, which stays: another " \
           "growcache command is using it" in out and f"rm -r {cache_dir}" in out, out
    assert other.release(failed=False) is None and os.path.isdir(cache_dir)


def _claimed_cache(path, **kwargs):
    from growcache.cache_claim import CacheClaim

    claim = CacheClaim(path)
    claim.opened(Cache(path, **kwargs))
    return claim


def test_a_claim_removes_only_a_new_cache_that_holds_nothing_but_what_its_command_stored(tmp_path, monkeypatch):
    import multiprocessing

    import growcache.cache_claim as cache_claim
    from growcache.cache_claim import CacheClaim
    from growcache.writer import temp_shard_name

    cache_dir = tmp_path / "made" / "cache"
    assert _claimed_cache(cache_dir, capacity="1MB").release(failed=False) is None
    assert cache_dir.is_dir(), "a command that did not fail keeps its cache"
    claim = _claimed_cache(tmp_path / "new" / "cache", capacity="1MB")
    assert claim.release(failed=True) is None and claim.removed and not (tmp_path / "new").exists()

    cases = {
        "a file of the user's": lambda p: (p / "notes.txt").write_text("mine"),
        "another process's schema": lambda p: Cache(p, schema={"x": ("float32", (2,))}),
        "another process's capacity": lambda p: Cache(p, capacity="2MB"),
        "a live writer's shard": lambda p: (p / "shards" / temp_shard_name("x")).write_bytes(b""),
        "another sampler run": lambda p: Cache(p)._next_sampler_run(),
    }
    reasons = {}
    for name, change in cases.items():
        path = tmp_path / name.replace(" ", "-").replace("'", "")
        claim = _claimed_cache(path, capacity="1MB")
        change(path)
        reasons[name] = claim.release(failed=True)
        assert reasons[name] and not claim.removed and (path / "growcache.json").exists(), (name, reasons[name])
    assert "notes.txt" in reasons["a file of the user's"]
    assert "stored a schema or capacity" in reasons["another process's schema"]
    assert "sampler pool" in reasons["another sampler run"]
    assert "writing shards" in reasons["a live writer's shard"]

    # Its own sampler pool's run counts as its own.
    claim = _claimed_cache(tmp_path / "sampled", capacity="1MB")
    claim.sampler_started()
    Cache(tmp_path / "sampled")._next_sampler_run()
    assert claim.release(failed=True) is None and claim.removed

    # Shards published: a cache in use, kept without a word.
    claim = _claimed_cache(tmp_path / "used", schema={k: (v.dtype.name, v.shape) for k, v in id_sample(0).items()})
    write_shards(Cache(tmp_path / "used"), [2])
    assert claim.release(failed=True) is None and not claim.removed and (tmp_path / "used").is_dir()

    # The cache's lock held past the wait: another process is at work in it.
    claim = _claimed_cache(tmp_path / "locked", capacity="1MB")
    context = multiprocessing.get_context("fork")
    ready, done = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(str(tmp_path / "locked"), ready, done))
    holder.start()
    monkeypatch.setattr(cache_claim, "CLAIM_LOCK_WAIT", 0.3)
    try:
        assert ready.wait(30)
        reason = claim.release(failed=True)
    finally:
        done.set()
        holder.join(30)
    assert reason and "held its lock" in reason and (tmp_path / "locked").is_dir(), reason

    # A directory that was there before the command is never removed, even empty.
    (tmp_path / "there").mkdir()
    claim = CacheClaim(tmp_path / "there")
    assert not claim.created and claim.release(failed=True) is None and (tmp_path / "there").is_dir()


def _hold_lock(path: str, ready, done) -> None:
    from filelock import FileLock

    with FileLock(os.path.join(path, ".lock")):
        ready.set()
        done.wait(30)


def test_the_import_progress_has_the_files_bytes_as_its_total(tmp_path, monkeypatch):
    # The bar (tqdm on a terminal, the status line without one) had no total: no percentage, no
    # time left. Its total is the files' bytes, from the listing; it counts the bytes of the files
    # read (compressed ones for a .gz file) and a refused file whole, so it ends at 100%.
    import gzip
    import io

    import growcache._progress

    files = _files(tmp_path / "data", 3)
    packed = tmp_path / "data" / "train-9.tfrecord.gz"
    packed.write_bytes(gzip.compress(framed([labelled(9, i) for i in range(200)])))
    (tmp_path / "data" / "train-bad.tfrecord").write_bytes(b"not a tfrecord file")
    total = sum(os.path.getsize(p) for p in (*files, packed, tmp_path / "data" / "train-bad.tfrecord"))
    result = subprocess.run([_exe(), "import", str(tmp_path / "data" / "train-*"), str(tmp_path / "cache")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "REFUSED" in result.stdout, result.stderr
    last, = [line for line in result.stderr.splitlines() if line.startswith("import: ")]
    from growcache._size import format_size

    assert last.startswith(f"import: {format_size(total)} of {format_size(total)} (100%), "), (last, total)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bars = []
    real = growcache._progress.Progress.__enter__

    def enter(self):
        bars.append(self)
        return real(self)

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(growcache._progress.Progress, "__enter__", enter)
    assert main(["import", *files, str(tmp_path / "cache2")]) == 0
    size = sum(os.path.getsize(p) for p in files)
    assert bars[0].total == size and bars[0].n == size
    assert "import: 100%|" in screen.getvalue() and f"{size / 1000:.2f}k/{size / 1000:.2f}k" in screen.getvalue(), \
        screen.getvalue()
    # A file named on a store has no size without a request of its own: the bar counts, open-ended.
    root = tmp_path / "store"
    root.mkdir()
    with FaultyHTTPStore(str(root)) as store:
        url = store.put("a.tfrecord", framed([labelled(0, i) for i in range(5)]))
        assert main(["import", url, str(tmp_path / "cache3")]) == 0
    assert bars[-1].total is None and bars[-1].n == os.path.getsize(files[0])


def test_a_failed_first_command_keeps_the_new_cache_a_second_command_opened_meanwhile(tmp_path):
    # Two commands start on a missing directory. The second's claim is made while it is missing; the
    # first creates the cache; the second opens it (Cache(), the step before it tells its claim of
    # the open); the first fails. The first removed the cache under the second, whose shards/ was
    # gone at its first write: a claim held nothing while its command's Cache() created or opened
    # the directory.
    from growcache.cache_claim import CacheClaim

    path = tmp_path / "cache"
    second = CacheClaim(path)
    first = CacheClaim(path)
    first.opened(Cache(path, schema={k: (v.dtype.name, v.shape) for k, v in id_sample(0).items()}))
    cache = Cache(path)
    first.release(failed=True)
    second.opened(cache)
    assert not first.removed and path.is_dir()
    write_shards(cache, [2])  # the second command's work goes on in it
    assert cache.stats().shards == 1 and second.release(failed=True) is None and path.is_dir()


def test_a_claim_made_while_a_failed_command_removes_the_directory_holds_the_one_it_makes_again(tmp_path):
    # A claim waits out a removal in progress (the failed command holds the directory exclusively),
    # then finds the directory gone: it makes it again and holds that one, so that the removal of
    # no other failed command takes it from under its command.
    import fcntl
    import threading
    import time

    from growcache.cache_claim import CacheClaim

    path = tmp_path / "new" / "cache"
    _claimed_cache(path, capacity="1MB").release(failed=False)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    made = []
    thread = threading.Thread(target=lambda: made.append(CacheClaim(path)))
    thread.start()
    time.sleep(0.3)  # it waits for the directory's lock (or, late, finds no directory: the same end)
    for name in os.listdir(path):
        full = path / name
        full.rmdir() if full.is_dir() else full.unlink()
    path.rmdir()
    (tmp_path / "new").rmdir()
    os.close(fd)
    thread.join(30)
    claim, = made
    assert claim.created and path.is_dir()
    other = CacheClaim(path)  # a second command's claim, which failed at once
    assert not other.created and other.release(failed=True) is None and path.is_dir()
    claim.opened(Cache(path, capacity="1MB"))
    assert claim.release(failed=True) is None and claim.removed and not (tmp_path / "new").exists()


def test_a_ctrl_c_during_the_removal_of_a_new_cache_waits_until_it_is_done(tmp_path, monkeypatch):
    # A Ctrl-C that landed inside the removal left a cache half removed (shards/ gone, its stored
    # capacity kept for the next command), without a word.
    import signal

    import pytest

    claim = _claimed_cache(tmp_path / "new" / "cache", capacity="1MB")
    rmdir, sent = os.rmdir, []

    def interrupted(*args, **kwargs):
        rmdir(*args, **kwargs)
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "rmdir", interrupted)
    with pytest.raises(KeyboardInterrupt):
        claim.release(failed=True)
    monkeypatch.undo()
    assert sent and claim.removed and not (tmp_path / "new").exists()


def test_a_path_swapped_for_a_link_to_another_cache_during_the_removal_leaves_that_cache_whole(tmp_path, monkeypatch):
    # The removal unlinks through the directory the claim made, never through the path: a path
    # swapped for a link to another cache after the last check had that cache's metadata, state
    # and lock file unlinked.
    from growcache.cache_claim import CacheClaim

    victim = Cache(tmp_path / "victim", capacity="1MB", schema={"x": ("int64", (2,))})
    before = sorted(os.listdir(victim.path))
    path = tmp_path / "new"
    claim = _claimed_cache(path, capacity="1MB")
    checked = CacheClaim._unused

    def swapped_after_the_check(self):
        result = checked(self)
        os.rename(path, tmp_path / "moved")
        os.symlink(victim.path, path)
        return result

    monkeypatch.setattr(CacheClaim, "_unused", swapped_after_the_check)
    claim.release(failed=True)
    assert sorted(os.listdir(victim.path)) == before
    assert Cache(victim.path).schema is not None and Cache(victim.path).capacity == 1_000_000
    assert os.path.islink(path) and not os.listdir(tmp_path / "moved"), "the claim's own directory was emptied"
