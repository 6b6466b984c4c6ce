"""An owner whose pid now belongs to another process is dead: every owner record goes by
``(pid, start time)``, never by the pid alone.

Each test writes an owner record by hand (a lease, a shard source's claim, a shared-memory
slab, a temporary shard) naming a live process -- a child started by the test, so started
after the "owner" it stands in for -- but another start time: the kernel reused the dead
owner's pid. That owner is judged dead and what it held is freed. The same record with the
child's true start time is a live owner, and keeps what it holds (the control, which also
shows that the record is read at all).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
from tfrecords import framed, labelled

from conftest import ID_SCHEMA, write_shards
from growcache import Cache, Schema, TFRecordShardSource
from growcache import _proc
from growcache.shard import TMP_PREFIX
from growcache.shard_source import FetchJob
from growcache.transport import SEGMENT_PREFIX, remove_dead_segments
from growcache.writer import remove_abandoned_temporaries


@pytest.fixture
def reused_pid():
    """``(pid, its true start time, another start time)`` of a live process started now."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        start = _proc.process_start_time(child.pid)
        assert start is not None and _proc.is_alive(child.pid, start)
        yield child.pid, start, start - 1 if start > 1 else start + 1
    finally:
        child.kill()
        child.wait()


OWNERS = pytest.mark.parametrize("reused", [True, False], ids=["pid-reused", "same-process"])


@OWNERS
def test_a_lease_whose_pid_was_reused_is_dead_and_its_shards_are_evicted(tmp_path, reused_pid, reused):
    pid, start, other = reused_pid
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [4, 4])
    seqs = [s.seq for s in cache.list_shards()]
    lease = os.path.join(cache.path, "leases", f"{pid}-handmade.json")
    with open(lease, "w") as f:
        json.dump({"pid": pid, "start_time": other if reused else start, "host": _proc.this_host(),
                   "created": time.time(), "holder": "a reader that died", "seqs": seqs}, f)
    assert [bool(x) for x in cache._manifest.live_leases()] == ([] if reused else [True])
    evicted = cache.evict(to=0)
    if reused:
        assert [s.seq for s in evicted] == seqs and not os.path.exists(lease), "the dead owner's lease is gone"
    else:
        assert evicted == [] and os.path.exists(lease), "a live owner's lease keeps its shards"


@OWNERS
def test_a_claim_whose_pid_was_reused_is_dead_and_its_file_is_fetched(tmp_path, reused_pid, reused):
    pid, start, other = reused_pid
    os.makedirs(tmp_path / "remote")
    remote = str(tmp_path / "remote" / "train-00000")
    with open(remote, "wb") as f:
        f.write(framed([labelled(0, i) for i in range(3)]))
    cache = Cache(tmp_path / "cache", capacity="1MB",
                  schema=Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (64,))}))
    source = TFRecordShardSource(str(tmp_path / "remote" / "train-*"))
    claim = {"pid": pid, "start_time": other if reused else start, "host": _proc.this_host(), "time": time.time(),
             "worker": 0}
    with cache._locked():  # pass 1 is under way, and its only file is claimed by the handmade owner
        cache._manifest.write_source_state(source.key, {"pass": 1, "order": [remote], "done": [],
                                                        "claims": {remote: claim}, "held": {}, "history": []})
    with contextlib.closing(source.fetch(FetchJob(cache, 0, 0, lambda: False))) as shards:
        fetched = [cache._publish(s.path, s.records, s.nbytes, before_publish=s.commit) for s in shards]
    if reused:
        assert [s.records for s in fetched] == [3], "the dead owner's claim is dropped and its file fetched"
    else:
        assert fetched == [], "a live owner's claim is left to it"


@OWNERS
def test_a_slab_whose_pid_was_reused_is_dead_and_removed(tmp_path, reused_pid, reused):
    pid, start, other = reused_pid
    name = f"{SEGMENT_PREFIX}{pid}-{other if reused else start}-{_proc.this_host()}-0123456789ab"
    (tmp_path / name).write_bytes(b"\0" * 4096)  # a slab as the owner left it in /dev/shm
    removed = remove_dead_segments(str(tmp_path))
    assert removed == ([name] if reused else []) and (tmp_path / name).exists() is not reused


@OWNERS
def test_a_temporary_shard_whose_pid_was_reused_is_dead_and_removed(tmp_path, reused_pid, reused):
    pid, start, other = reused_pid
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=ID_SCHEMA)
    name = f"{TMP_PREFIX}{pid}-{other if reused else start}-{_proc.this_host()}-0123456789ab"
    with open(os.path.join(cache.shards_dir, name), "wb") as f:
        f.write(b"half a shard")
    assert remove_abandoned_temporaries(cache.shards_dir) == ([name] if reused else [])


_PROBE_AS_ANOTHER_USER = """
import os
from growcache import _proc
start = int(open("/proc/1/stat").read().rsplit(")", 1)[1].split()[19])
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)  # nobody: pid 1 is another user's process, so os.kill(1, 0) raises PermissionError
print(_proc.is_alive(1, start), _proc.is_alive(1, start + 1))
"""


def test_an_owner_whose_pid_went_to_another_users_process_is_dead():
    # os.kill(pid, 0) raises PermissionError for another user's process; it was taken as the
    # owner alive, without the start-time check, so such a lease pinned its shards for good.
    done = subprocess.run([sys.executable, "-c", _PROBE_AS_ANOTHER_USER], capture_output=True, text=True, timeout=60,
                          cwd="/")
    assert done.stdout.split() == ["True", "False"], done.stderr


_EXITS_WITH = """
import os, sys, time
if sys.argv[3] == "probe":
    del os.pidfd_open  # as on a system without pidfds: the pid is probed every second
elif sys.argv[3] == "fd-past-1024":  # a forked worker that inherited many descriptors: select() fails
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    kept = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
elif sys.argv[3] in ("ENOSYS", "EPERM", "EMFILE"):  # a kernel before 5.3, a seccomp filter, no fd left
    import errno

    def pidfd_open(pid, flags=0):
        raise OSError(getattr(errno, sys.argv[3]), "refused")

    os.pidfd_open = pidfd_open
from growcache._proc import exit_with
exit_with(int(sys.argv[1]), int(sys.argv[2]) if sys.argv[2] != "None" else None)
print("watching", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["pidfd", "probe", "fd-past-1024", "ENOSYS", "EPERM", "EMFILE"])
def test_exit_with_ends_the_process_once_the_watched_one_ends(how):
    # What a DataLoader worker does with its trainer (tests/torch/test_trainer_killed.py).
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = subprocess.Popen([sys.executable, "-c", _EXITS_WITH, str(watched.pid),
                                str(_proc.process_start_time(watched.pid)), how], stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        time.sleep(1.5)
        assert watcher.poll() is None, "exited while the watched process lives"
        watched.kill()
        watched.wait()
        assert watcher.wait(timeout=10) == 0
    finally:
        for process in (watched, watcher):
            process.kill()
            process.wait()
        watcher.stdout.close()


def test_exit_with_a_pid_that_went_to_another_process_ends_at_once():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wrong_start = _proc.process_start_time(other.pid) - 1  # the trainer that had this pid is gone
        watcher = subprocess.run([sys.executable, "-c", _EXITS_WITH, str(other.pid), str(wrong_start), "pidfd"],
                                 capture_output=True, text=True, timeout=30)
        assert watcher.returncode == 0 and "watching" not in watcher.stdout
    finally:
        other.kill()
        other.wait()


_NO_PROC = """
import os, sys
import numpy as np
import growcache._proc as proc
proc.process_start_time = lambda pid: None  # a platform without /proc (macOS, some sandboxes)
from growcache import Cache
cache = Cache(sys.argv[1], capacity=3000, schema={"x": ("uint8", (100,))})

def shard():
    with cache.writer() as writer:
        for _ in range(5):
            writer.write({"x": np.zeros(100, np.uint8)})

shard()
first = cache.list_shards()[0]
snapshot = cache.snapshot()  # a live reader's lease, written with start_time null
for _ in range(6):  # samplers publish past the budget
    shard()
print(os.path.exists(first.path), os.path.exists(snapshot._lease_path))
"""


def test_a_live_lease_without_start_time_holds_where_the_platform_tells_none(tmp_path):
    # Leases of such a platform store start_time null; they were read as damaged, removed at the
    # next publish, and eviction deleted the shards their reader was reading.
    run = subprocess.run([sys.executable, "-c", _NO_PROC, str(tmp_path / "c")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True"]
