"""``/dev/shm`` as containers really have it: small (64 MB unless told otherwise), and shared.

* A named slab is reserved before it is touched, so a ``/dev/shm`` too small for it gives
  fewer slots with one warning, or a :class:`~growcache.SharedMemoryFullError` that names the
  fixes, never a ``SIGBUS`` in the trainer (issue 28, High 1). The logic runs everywhere
  through a smaller stand-in :class:`~growcache.transport.SharedMemorySpace`, and for real
  where this machine can mount a 64 MiB tmpfs on ``/dev/shm`` in a private mount namespace.
* A sweep of ``/dev/shm`` never removes a segment that some process maps, whatever its age,
  its owner's pid namespace or the sweeper's ``GROWCACHE_OWNER_EXPIRY``; it removes one that no
  process maps (issue 28, High 3).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import _fullfs
from growcache import Cache, Schema, SharedMemoryFullError
from growcache import transport
from growcache.transport import BatchLayout, SharedMemorySpace, make_slabs, remove_dead_segments

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory lives in /dev/shm on Linux")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
LAYOUT = BatchLayout.build([("x", "uint8", (MiB,))], batch_size=4)  # 4 MiB slots


class SmallShm(SharedMemorySpace):
    """``/dev/shm`` as if it held only ``size`` bytes: reservations past them fail with ``ENOSPC``,
    as ``posix_fallocate`` does on a full tmpfs. A segment's bytes count until its name goes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.reserved: dict[int, int] = {}  # inode -> bytes
        self.inodes: set[int] = set()  # every segment ever reserved or refused

    def _used(self) -> int:
        alive = {entry.inode() for entry in os.scandir(self.path)}
        self.reserved = {inode: n for inode, n in self.reserved.items() if inode in alive}
        return sum(self.reserved.values())

    def reserve(self, fd: int, nbytes: int) -> None:
        inode = os.fstat(fd).st_ino
        self.inodes.add(inode)
        if self._used() + nbytes > self.size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().reserve(fd, nbytes)
        self.reserved[inode] = nbytes

    def usage(self) -> tuple[int, int]:
        return self.size, self.size - self._used()


def _left_behind(space: SmallShm) -> set[int]:
    return space.inodes & {entry.inode() for entry in os.scandir("/dev/shm")}


def test_slabs_that_do_not_fit_get_fewer_slots_with_one_warning(caplog):
    space = SmallShm(30 * MiB)  # 2 slabs of 3 slots (12 MiB + a page each), not of 6
    with caplog.at_level(logging.WARNING, logger="growcache.transport"):
        slabs = make_slabs(LAYOUT, 6, 2, anonymous=False, space=space)
    try:
        assert [slab.slots for slab in slabs] == [3, 3] and [slab.index for slab in slabs] == [0, 1]
        assert sum(space.reserved.values()) <= space.size
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "/dev/shm" in warnings[0] and "3 of the 6" in warnings[0] and "prefetch_factor" in warnings[0]
        # The slots are real: a batch goes in and comes out.
        handle, arrays = slabs[1].acquire(4)
        arrays["x"][:] = 7
        assert int(slabs[1].open(handle, copy=True)["x"].sum()) == 7 * 4 * MiB
    finally:
        for slab in slabs:
            slab.unlink()
    assert not _left_behind(space), "the slabs of the attempts that did not fit must be gone"


def test_one_batch_per_reader_that_does_not_fit_is_a_clear_error():
    space = SmallShm(6 * MiB)  # one 4 MiB batch fits, two do not
    with pytest.raises(SharedMemoryFullError) as caught:
        make_slabs(LAYOUT, 4, 2, anonymous=False, space=space)
    error = caught.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    message = str(error)
    for needed in ("/dev/shm (size 6.0 MiB", "free", "2 readers need 8.0 MiB", "4.0 MiB per batch", "--shm-size",
                   "emptyDir", "medium: Memory", "batch_size", "num_workers", '"fork"'):
        assert needed in message, (needed, message)
    assert not _left_behind(space), "a refused slab must leave nothing in /dev/shm"


def test_a_spawn_loader_on_a_small_shm_prefetches_what_fits(tmp_path, monkeypatch, caplog):
    pytest.importorskip("torch")
    from growcache.adapters.torch_loader import make_torch_loader

    cache = Cache(tmp_path / "c", schema=Schema({"id": ("int64", ()), "x": ("uint8", (256 << 10,))}))
    with cache.writer() as writer:
        for i in range(24):
            writer.write({"id": np.int64(i), "x": np.full(256 << 10, i, np.uint8)})
    # Batches of 4 MiB; the default ring of prefetch_factor + 1 + 1 = 6 slots is 24 MiB per worker.
    monkeypatch.setattr(transport, "SHARED_MEMORY", SmallShm(34 * MiB))
    loader = make_torch_loader(cache, 16, num_workers=2, multiprocessing_context="spawn", shuffle_buffer=0,
                               prefetch_factor=4)
    with caplog.at_level(logging.WARNING, logger="growcache.transport"), loader:
        ids = [int(i) for batch in loader for i in batch["id"]]
        assert loader._stream.feed.slots == 4  # 2 x (4 x 4 MiB + a page) fit in 34 MiB, 2 x 5 slots do not
        assert loader.prefetch_factor == 2, "prefetch shrinks with the ring: 4 slots hold 2 in flight"
    assert sorted(ids) == list(range(24))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


# -- a real 64 MiB /dev/shm ---------------------------------------------------------------------
_SMALL_SHM_RUN = """
import json, logging, sys
from growcache import Cache, SharedMemoryFullError
from growcache.adapters.torch_loader import make_torch_loader

def main():
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cache = Cache(sys.argv[1])
    out = {}
    # 64 MiB batches: not one per worker fits.
    loader = make_torch_loader(cache, 256, num_workers=2, multiprocessing_context="spawn", shuffle_buffer=0)
    try:
        next(iter(loader))
    except SharedMemoryFullError as exc:
        out["error"] = str(exc)
    loader.close()
    # 12 MiB batches: 2 x 4 slots (96 MiB) do not fit, 2 x 2 do.
    loader = make_torch_loader(cache, 48, num_workers=2, multiprocessing_context="spawn", shuffle_buffer=0)
    with loader:
        out["ids"] = sorted(int(i) for batch in loader for i in batch["id"])
        out["slots"], out["wanted"] = loader._stream.feed.slots, loader._slots
    print(json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


def _private_shm_prefix(size: str) -> tuple[list[str], str]:
    """A command prefix that runs a command with a tmpfs of ``size`` on ``/dev/shm`` of its own
    (a private mount namespace), and how; or ``([], why not)``."""
    mount = f"mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm"
    ways = []
    if os.geteuid() == 0:
        ways.append(("root", ["unshare", "--mount"], f'{mount} && exec "$@"'))
    ways.append(("a user namespace", ["unshare", "--user", "--map-root-user", "--mount"], f'{mount} && exec "$@"'))
    if os.geteuid() != 0 and shutil.which("sudo"):
        # A CI runner's user: mount as root, then run the command as this user again, so that
        # the files it makes under tmp_path stay this user's.
        back = f"setpriv --reuid={os.getuid()} --regid={os.getgid()} --clear-groups --"
        ways.append(("sudo", ["sudo", "-n", "--preserve-env", "unshare", "--mount"], f'{mount} && exec {back} "$@"'))
    reasons = []
    for how, prefix, script in ways:
        if shutil.which(prefix[0]) is None:
            reasons.append(f"{how}: no {prefix[0]}")
            continue
        probe = subprocess.run([*prefix, "sh", "-c", script, "sh", "true"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return [*prefix, "sh", "-c", script, "sh"], how
        reasons.append(f"{how}: {probe.stderr.strip() or probe.returncode}")
    return [], "; ".join(reasons)


def _run_in_a_64mib_shm(tmp_path, script: str, cache: Cache) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``script`` on ``cache`` in a private mount namespace whose /dev/shm is a 64 MiB tmpfs
    (a container's default); skipped where none can be mounted, a failure under CI=true."""
    prefix, how = _private_shm_prefix("64m")
    if not prefix:
        if _fullfs.in_ci():
            pytest.fail(f"CI=true requires a private 64 MiB /dev/shm, and none could be mounted here ({how}). Run "
                        "the tests as root, give the CI user passwordless sudo, or allow unprivileged user "
                        "namespaces.", pytrace=False)
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a private mount namespace here ({how})")
    path = tmp_path / "run.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([*prefix, sys.executable, str(path), cache.path], capture_output=True, text=True,
                          env=env, timeout=240), how


def test_a_spawn_loader_in_a_real_64mib_shm_never_dies_of_sigbus(tmp_path):
    pytest.importorskip("torch")
    cache = Cache(tmp_path / "c", schema=Schema({"id": ("int64", ()), "x": ("uint8", (256 << 10,))}))
    with cache.writer() as writer:
        for i in range(96):
            writer.write({"id": np.int64(i), "x": np.full(256 << 10, i, np.uint8)})
    run, how = _run_in_a_64mib_shm(tmp_path, _SMALL_SHM_RUN, cache)
    assert run.returncode == 0, f"exit {run.returncode} (-7 or 135 is SIGBUS) under {how}:\n{run.stderr[-3000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "/dev/shm (size 64.0 MiB" in out["error"] and "--shm-size" in out["error"], out["error"]
    assert out["ids"] == list(range(96))
    assert 1 <= out["slots"] < out["wanted"], out
    assert run.stderr.count("batch slots wanted") == 1, run.stderr[-3000:]


_NO_SLOT_RUN = """
import faulthandler, json, sys
from growcache import Cache
from growcache.adapters.torch_loader import make_torch_loader

def epoch(loader, keep):
    ids = []
    for batch in loader:
        assert all((x == i % 256).all() for i, x in zip(batch["id"].tolist(), batch["x"].numpy()))
        ids += batch["id"].tolist()
        keep.append(batch) if keep is not None else None
    return sorted(ids)

def main():
    faulthandler.dump_traceback_later(150, exit=True)  # a hang shows its stacks, not only the test's timeout
    cache = Cache(sys.argv[1])
    out = {}
    # The default shuffle window wants 19 slots of 2 MiB per worker; the slabs take what 64 MiB holds,
    # and the window's other batches find no slot.
    with make_torch_loader(cache, 8, num_workers=2, multiprocessing_context="spawn") as loader:
        out["spawn"] = epoch(loader, None)
    # Forked workers' slabs take no /dev/shm, but a loop that keeps its batches (96 MiB) holds every slot.
    kept = []
    with make_torch_loader(cache, 8, num_workers=2, multiprocessing_context="fork", shuffle_buffer=0) as loader:
        out["fork, kept"] = epoch(loader, kept)
    print(json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


def test_batches_without_a_slot_reach_the_trainer_when_shm_is_full(tmp_path):
    # A batch without a free slot went through torch's shared memory, allocated in the worker's
    # result-queue feeder thread: in a full /dev/shm that thread printed ENOSPC and dropped the
    # batch, and the trainer waited for it for good. Both cases below hung.
    pytest.importorskip("torch")
    cache = Cache(tmp_path / "c", schema=Schema({"id": ("int64", ()), "x": ("uint8", (256 << 10,))}))
    for shard in range(6):
        with cache.writer() as writer:
            for i in range(shard * 64, (shard + 1) * 64):
                writer.write({"id": np.int64(i), "x": np.full(256 << 10, i % 256, np.uint8)})
    run, how = _run_in_a_64mib_shm(tmp_path, _NO_SLOT_RUN, cache)
    assert run.returncode == 0, f"exit {run.returncode} under {how}:\n{run.stderr[-3000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"spawn": list(range(384)), "fork, kept": list(range(384))}


# -- sweeps -------------------------------------------------------------------------------------
_SLAB_OWNER = """
import base64, pickle, sys, time
from growcache.transport import BatchLayout, Slab
slab = Slab(BatchLayout.build([("x", "uint8", (4096,))], 1), slots=2, anonymous=False)
print(slab.name, base64.b64encode(pickle.dumps(slab)).decode(), flush=True)
time.sleep(120)
"""

_SLAB_ATTACHER = """
import base64, pickle, sys, time
slab = pickle.loads(base64.b64decode(sys.argv[1]))  # as a spawn-started worker attaches
print("attached", flush=True)
time.sleep(120)
"""


def _other_process_table() -> tuple[list[str], dict[str, str]]:
    for prefix in (["unshare", "--pid", "--fork", "--mount-proc"],
                   ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix, {}
    return [], {"GROWCACHE_NODE": "another-machine"}  # growcache's documented override of the table's identity


def _start(code: str, *args: str, prefix: list[str] = (), env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})), start_new_session=True)


def _kill_group(child: subprocess.Popen) -> None:
    # The whole group, its resource tracker with it: nothing unlinks its segments but a sweep.
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()
    child.stdout.close()


def _swept(name: str) -> bool:
    """Whether a sweep removes ``name`` within 10 s: a killed process's descriptors (and locks)
    go a moment after its parent saw it die, when it is a pid namespace's init.

    The sweep may be another process's: every cache open and named slab of a test that another
    pytest worker runs meanwhile sweeps ``/dev/shm`` too, and whichever sweep comes first after
    the last lock goes removes the segment. Nothing else unlinks it (the owner's resource tracker
    died in its process group), so a segment gone is a segment swept.
    """
    deadline = time.monotonic() + 10
    while name not in remove_dead_segments():
        if not os.path.exists(f"/dev/shm/{name}"):
            return True  # swept by another process between its last lock going and this sweep
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _age(path: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_sweep_never_removes_a_live_slab_of_a_job_in_another_pid_namespace(monkeypatch):
    prefix, env = _other_process_table()
    owner = _start(_SLAB_OWNER, prefix=prefix, env=env)
    try:
        name = owner.stdout.readline().split()[0]
        path = f"/dev/shm/{name}"
        assert os.path.exists(path)
        # An old modification time, and a sweeping job with a short expiry of its own: neither is
        # evidence that another job's slab is dead.
        _age(path, 3600)
        monkeypatch.setenv("GROWCACHE_OWNER_EXPIRY", "1")
        assert name not in remove_dead_segments()
        assert os.path.exists(path), "a sweep removed a slab that a live process maps"
    finally:
        _kill_group(owner)
    assert _swept(name), "a slab that no process maps any more must go"
    assert not os.path.exists(path)


def test_a_slab_still_mapped_by_a_reader_outlives_its_dead_owner():
    owner = _start(_SLAB_OWNER)
    reader = None
    try:
        name, pickled = owner.stdout.readline().split()
        reader = _start(_SLAB_ATTACHER, pickled)
        assert reader.stdout.readline().strip() == "attached"
        _kill_group(owner)
        assert name not in remove_dead_segments()
        assert os.path.exists(f"/dev/shm/{name}"), "a sweep removed a slab that a reader still maps"
    finally:
        _kill_group(owner)
        if reader is not None:
            _kill_group(reader)
    assert _swept(name)


def test_a_sweep_leaves_an_old_versions_segment_of_another_process_table_alone(monkeypatch):
    # Older versions take no lock: another table's segment has no evidence of death but its age,
    # and an age judged against this job's setting is none.
    path = f"/dev/shm/growcache-1-1-{'0' * 8}-{os.urandom(6).hex()}"
    with open(path, "wb"):
        pass
    try:
        _age(path, 3600)
        monkeypatch.setenv("GROWCACHE_OWNER_EXPIRY", "1")
        remove_dead_segments()
        assert os.path.exists(path)
    finally:
        os.unlink(path)



def test_an_unlocked_segment_goes_unless_its_owner_here_lives_and_is_about_to_lock_it():
    # Between a segment's creation and its first lock, only its name speaks for it: an owner alive
    # in this process table keeps it; a dead one does not.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = transport._proc.this_host()
    pid, start = transport._proc.this_process()
    names = {"alive": f"growcache-v2-{pid}-{start}-{host}-{os.urandom(6).hex()}",
             "dead": f"growcache-v2-{dead.pid}-1-{host}-{os.urandom(6).hex()}"}
    for name in names.values():
        with open(f"/dev/shm/{name}", "wb"):
            pass
    try:
        removed = remove_dead_segments()
        # Gone: removed by this sweep, or by a loader's in a test another pytest worker runs.
        assert not os.path.exists(f"/dev/shm/{names['dead']}")
        assert names["alive"] not in removed and os.path.exists(f"/dev/shm/{names['alive']}")
    finally:
        for name in names.values():
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
