"""The soak: the whole pipeline under injected faults, checked record by record.

A :class:`SamplerPool` (2 workers) samples objects from a moto S3 server on 127.0.0.1 into a
cache whose budget forces continuous eviction, while a PyTorch reader (``make_torch_loader``,
2 spawned DataLoader workers) and a TensorFlow reader (``make_tf_dataset``) run epochs in
processes of their own. During the run the test injects, in turn:

1. SIGKILL of a sampler worker in the middle of a shard;
2. the S3 server stopped and restarted;
3. one published shard corrupted (both readers read with ``on_corrupt="skip"``);
4. SIGKILL of a DataLoader worker, which must raise in the training process, not hang;
5. a full disk, on a real size-limited tmpfs where the machine allows mounting one: the
   pool must fail cleanly, with no shard truncated and no published shard changed;
6. SIGKILL of the PyTorch trainer's whole process group (as ``scancel``, ``docker kill`` or an
   OOM kill do: its DataLoader workers and its resource tracker die with it), then a restart
   of the trainer under a new hostname (``unshare --uts``). The dead trainer's lease must not pin
   the cache, and growcache's shared-memory slabs it leaves behind must be gone once the new
   trainer has started. This runs early, while faults 2 and 3 proceed, so it costs the soak
   little time.

Every record carries a unique id and a checksum of its payload (``soak_common``). A ledger
thread reads each shard once as it is published, so every epoch's delivery is compared with
exactly the snapshot that epoch leased: nothing lost or duplicated beyond counted skips, and
no payload mismatched. A monitor thread checks the byte budget ten times a second. At the
end: no temporary file, no lease, no child process and no shared-memory segment is left, and
each process's memory stayed flat across epochs.

``GROWCACHE_SOAK_SECONDS`` sets the shortest length of the fault phase (default 10 s: the faults
themselves take longer on 2 cores, and the whole test about a minute).
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import psutil
import pytest
from soak_common import (
    KILL_LOADER_WORKER,
    OBJECTS,
    SCHEMA,
    STOP,
    SoakSource,
    children,
    expected_sum,
    object_name,
    payload,
    rss,
    shm_inodes,
    shm_mappings,
    start_time,
)
from _fullfs import fill, size_limited_fs
from stores import s3, s3_server  # noqa: F401

from growcache import Cache, CacheFullError, CorruptShardError, SamplerError, Schema
from growcache.eviction import choose_evictions_fifo
from growcache.example import ExampleCodec
from growcache.records import crc32c, iter_records
from growcache.sampler import SamplerPool
from growcache.shard import TMP_PREFIX, ShardInfo
from growcache.writer import _STAGE_BYTES, temp_owner

SECONDS = float(os.environ.get("GROWCACHE_SOAK_SECONDS", "10"))
HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = 2
READERS = 2
RECORD = ExampleCodec(Schema(SCHEMA)).record_nbytes + 16
# A shard holds a dozen records more than the writer's staging buffer, which it writes out when
# full: every shard has bytes on disk before it is finished, so a kill can find some (fault 1).
SHARD = (_STAGE_BYTES // RECORD + 12) * RECORD
CAPACITY = 6 * SHARD
FS_SIZE = 48 << 20
RESERVE = 64 << 10  # what the full disk leaves free: less than a shard, room for leases
RSS_SLACK = 24 << 20  # growth from mid-run to the end beyond this (or 10%) is a leak
MEMORY_EPOCHS = 12  # epochs (or monitor seconds, for samplers) of a process to judge its memory by
LEASE_GRACE_S = 10.0  # a released lease's shards go at the next publish or epoch start
STARTUP_TIMEOUT_S = 150.0
WAIT_S = 60.0


# -- the ledger: every published shard's record ids, read once as it appears -----------------
@dataclass
class Entry:
    path: str
    records: int
    nbytes: int
    uids: frozenset


class Ledger(threading.Thread):
    def __init__(self, cache: Cache) -> None:
        super().__init__(name="soak-ledger", daemon=True)
        self.cache = cache
        self.codec = ExampleCodec(cache.schema)
        self.shards: dict[int, Entry] = {}
        self.missed: set[int] = set()
        self.problems: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.poll()

    def poll(self) -> None:
        for info in self.cache.list_shards():
            if info.seq not in self.shards and info.seq not in self.missed:
                self.read(info)

    def read(self, info: ShardInfo) -> None:
        uids = []
        try:
            for _, record in iter_records(info.path, verify=True):
                r = self.codec.decode(record)
                uids.append(int(r["uid"]))
                if crc32c(r["x"].tobytes()) != int(r["sum"]) or int(r["sum"]) != expected_sum(int(r["obj"])):
                    self.problems.append(f"payload mismatch in published shard {info.path}")
        except FileNotFoundError:
            self.missed.add(info.seq)  # evicted before we looked: no epoch can have leased it
            return
        except CorruptShardError as exc:
            self.problems.append(f"a published shard is torn or corrupt: {exc}")
            return
        if len(uids) != info.records or os.path.getsize(info.path) != info.nbytes:
            self.problems.append(f"{info.path}: {len(uids)} records, {os.path.getsize(info.path)} bytes on disk")
        self.shards[info.seq] = Entry(info.path, info.records, info.nbytes, frozenset(uids))


# -- the monitor: byte budget, temporaries, process memory ----------------------------------
class Monitor(threading.Thread):
    def __init__(self, cache: Cache) -> None:
        super().__init__(name="soak-monitor", daemon=True)
        self.cache = cache
        self.pools: list[SamplerPool] = []
        self.peak = 0
        self.peak_bound = 0
        self.problems: list[str] = []
        self.recent_leases: dict[int, float] = {}  # seq -> last time seen leased
        self.sampler_rss: dict[int, list[int]] = collections.defaultdict(list)
        self.sampler_pids: set[int] = set()
        self.samplers: set[tuple[int, int]] = set()  # (pid, start time) of every sampler seen
        # What this soak's processes (this one's descendants) are and have mapped in /dev/shm:
        # another pytest worker's tests use the same /dev/shm meanwhile, and only entries these
        # processes own or mapped can be this soak's leaks (see shm_leaks).
        self.tree_pids: set[int] = set()
        self.tree_inodes: set[int] = set()
        self._tree_lock = threading.Lock()
        self.stop = threading.Event()

    def run(self) -> None:
        ticks = 0
        while not self.stop.wait(0.1):
            try:
                self.check()
                if ticks % 5 == 0:
                    self.watch_tree()
            except Exception as exc:  # noqa: BLE001 - a broken monitor must fail the test, not die silently
                self.problems.append(f"monitor error: {type(exc).__name__}: {exc}")
            ticks += 1
            if ticks % 10 == 0:
                for pool in self.pools:
                    for pid in pool.pids:
                        self.sampler_rss[pid].append(rss(pid))

    def watch_tree(self) -> None:
        """Note this process's descendants and the /dev/shm inodes they map now (twice a second,
        and at once before the trainer's process group is killed)."""
        pids = [os.getpid(), *children(os.getpid())]
        inodes = shm_inodes(pids)
        with self._tree_lock:
            self.tree_pids.update(pids)
            self.tree_inodes |= inodes

    def check(self) -> None:
        now = time.monotonic()
        for pool in self.pools:
            for pid in pool.pids:
                if pid not in self.sampler_pids and (start := start_time(pid)) is not None:
                    self.samplers.add((pid, start))
                self.sampler_pids.add(pid)
        with self.cache._locked():
            leases = self.cache._manifest.live_leases()
            published, temps = 0, {}
            shards = {}
            for name in os.listdir(self.cache.shards_dir):
                try:
                    size = os.stat(os.path.join(self.cache.shards_dir, name)).st_size
                except FileNotFoundError:
                    continue
                info = ShardInfo.from_path(name)
                if info is not None:
                    published += size
                    shards[info.seq] = size
                elif name.startswith(TMP_PREFIX):
                    temps[name] = size
        for lease in leases:
            for seq in lease.get("seqs", ()):
                self.recent_leases[seq] = now
        leased = sum(size for seq, size in shards.items() if now - self.recent_leases.get(seq, -1e9) < LEASE_GRACE_S)
        live_temps = {n: s for n, s in temps.items() if psutil.pid_exists(temp_owner(n)[0])}
        bound = CAPACITY + leased
        self.peak = max(self.peak, published + sum(live_temps.values()))
        self.peak_bound = max(self.peak_bound, bound + WORKERS * SHARD)
        if published > bound:
            self.problems.append(f"published {published} bytes > capacity {CAPACITY} + leased {leased}")
        if published > CAPACITY * (1 + READERS):
            self.problems.append(f"published {published} bytes > capacity x (1 + {READERS} readers)")
        if len(live_temps) > WORKERS or any(s > SHARD for s in live_temps.values()):
            self.problems.append(f"in-progress shards beyond one per sampler: {live_temps}")


# -- readers ------------------------------------------------------------------------------------
def hostname_prefix(name: str) -> tuple[list[str], dict[str, str], str]:
    """``(command prefix, environment, how)`` to run a process under hostname ``name``."""
    for prefix in (["unshare", "--uts"], ["unshare", "--user", "--map-root-user", "--uts"]):
        if subprocess.run([*prefix, "hostname", name], capture_output=True).returncode == 0:
            return [*prefix, "sh", "-c", f'hostname {name} && exec "$0" "$@"'], {}, " ".join(prefix)
    # No namespaces here: growcache's override names another process table, judged by heartbeat.
    return [], {"GROWCACHE_NODE": name}, "GROWCACHE_NODE"


class ReaderProcess:
    """A reader script (``torch_reader.py`` or ``tf_reader.py``) in a process group of its own."""

    def __init__(self, kind: str, cache_path: str, workdir: str, label: str | None = None,
                 prefix: list[str] = (), env: dict[str, str] | None = None) -> None:
        self.name = label or kind
        self.out = os.path.join(workdir, f"{self.name}.jsonl")
        self.log = os.path.join(workdir, f"{self.name}.log")
        self.control = os.path.join(workdir, "control")
        self.killed = False  # SIGKILLed on purpose: its exit status is no failure
        os.makedirs(self.control, exist_ok=True)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p), **(env or {}))
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*prefix, sys.executable, os.path.join(HERE, f"{kind}_reader.py"), cache_path,
                                          self.control, self.out], stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.start = start_time(self.proc.pid)
        self._offset = 0
        self.lines: list[dict] = []

    def poll(self) -> list[dict]:
        if os.path.exists(self.out):
            with open(self.out) as f:
                f.seek(self._offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self._offset += len(complete.encode())
            self.lines += [json.loads(line) for line in complete.splitlines()]
        if self.proc.poll() not in (None, 0) and not self.killed:
            raise AssertionError(f"{self.name} reader exited with {self.proc.returncode}:\n{self.tail()}")
        return self.lines

    def epochs(self) -> list[dict]:
        return [line for line in self.poll() if "epoch" in line]

    def events(self, kind: str) -> list[dict]:
        return [line for line in self.poll() if line.get("event") == kind]

    def tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-4000:]

    def finish(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise AssertionError(f"{self.name} reader did not stop within {timeout} s:\n{self.tail()}") from None
        assert self.proc.returncode == 0, f"{self.name} reader failed:\n{self.tail()}"
        self.poll()


def wait_until(what: str, predicate, timeout: float = WAIT_S, readers: list[ReaderProcess] = (),
               poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for reader in readers:
            reader.poll()  # a crashed reader fails the test now, not at the timeout
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


# -- per-epoch accounting -------------------------------------------------------------------
@dataclass
class Tally:
    epochs: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    foreign: int = 0
    skipped: int = 0
    mismatches: int = 0
    unknown_shards: int = 0
    oversized_snapshots: int = 0
    saw_corrupt: bool = False
    problems: list[str] = field(default_factory=list)


def account(epoch: dict, ledger: Ledger, corrupt: set[int], tally: Tally) -> None:
    """Compare one epoch's delivery with the snapshot it leased."""
    # Snapshots of an empty cache (a reader waiting for its first shard) lease nothing.
    taken = [seqs for seqs in epoch["snapshots"] if seqs]
    assert len(taken) == 1, f"one snapshot per epoch, got {len(taken)}"
    seqs = taken[0]
    counts = collections.Counter(epoch["uids"])
    skipped = {ShardInfo.from_path(path).seq: records for path, _, records in epoch["skipped"]}
    tally.epochs += 1
    tally.delivered += len(epoch["uids"])
    tally.duplicated += sum(c - 1 for c in counts.values())
    tally.mismatches += epoch["mismatches"]
    expected: set[int] = set()
    nbytes = 0
    for seq in seqs:
        entry = ledger.shards.get(seq)
        if entry is None:
            tally.unknown_shards += 1
            continue
        expected |= entry.uids
        nbytes += entry.nbytes
        got = sum(1 for uid in entry.uids if uid in counts)
        if seq in skipped:
            if seq not in corrupt:
                tally.problems.append(f"epoch {epoch['epoch']} skipped shard {seq}, which nobody corrupted")
            n = entry.records if skipped[seq] is None else skipped[seq]
            tally.skipped += n
            tally.saw_corrupt = True
            missing = entry.records - got - n
        else:
            missing = entry.records - got
        tally.lost += max(missing, 0)
        tally.duplicated += max(-missing, 0)
    tally.foreign += sum(1 for uid in counts if uid not in expected)
    if nbytes > CAPACITY:
        tally.oversized_snapshots += 1
    if set(skipped) - set(seqs):
        tally.problems.append(f"epoch {epoch['epoch']} skipped shards outside its snapshot")


def leased(epoch: dict) -> list[int]:
    """The shards an epoch leased (its one non-empty snapshot)."""
    return next((seqs for seqs in epoch["snapshots"] if seqs), [])


def memory_growth(series: list[int]) -> tuple[float, float]:
    """``(median RSS of the run's second quarter, of its last quarter)``: a leak shows as
    growth from the middle of the run to its end (the first quarter is warm-up)."""
    quarter = len(series) // 4
    return float(np.median(series[quarter: 2 * quarter])), float(np.median(series[-quarter:]))


def size_of(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def live(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not); given ``start``, whether the process that started
    then does. The pid alone may name another process by the end: on a 32768-pid host, the
    threads of this soak and of another pytest worker's tests cycle through the pids in minutes."""
    try:
        if start is not None and start_time(pid) != start:
            return False
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# The owner's pid in a name: growcache's segments (transport.segment_name, and before v2), torch's.
_OWNER = re.compile(r"^(?:growcache-(?:v2-)?|torch_)([0-9]+)[-_]")


def shm_leaks(before: set[str], ours: set[str], monitor: Monitor) -> list[str]:
    """/dev/shm entries of this soak that appeared since ``before`` and that no live process has
    mapped (orphans), plus the names in ``ours`` (segments the finished readers mapped) that
    still exist.

    Mappings are matched by inode: a named semaphore is mapped under a temporary name. An
    orphan is the soak's when its name says a soak process owns it, or when a soak process
    mapped it (``monitor``'s record). /dev/shm is the whole machine's: a test that another
    pytest worker runs meanwhile makes entries no process maps too (a killed process group's
    semaphores and segments, an unlocked segment made on purpose), and those are no leak of
    this soak's.
    """
    monitor.watch_tree()
    in_use = shm_inodes(proc.pid for proc in psutil.process_iter())
    with monitor._tree_lock:
        pids, mapped = set(monitor.tree_pids), set(monitor.tree_inodes)
    leaks = [n for n in ours if os.path.exists(f"/dev/shm/{n}")]
    for name in set(os.listdir("/dev/shm")) - before - set(leaks):
        try:
            inode = os.stat(f"/dev/shm/{name}").st_ino
        except FileNotFoundError:
            continue
        owner = _OWNER.match(name)
        if inode not in in_use and (inode in mapped or (owner is not None and int(owner[1]) in pids)):
            leaks.append(name)
    return sorted(leaks)


# -- the soak ---------------------------------------------------------------------------------
@pytest.mark.timeout(int(SECONDS) + 300)
def test_soak(s3_server, s3, tmp_path, capsys, monkeypatch):
    for obj in range(OBJECTS):
        s3.put(object_name(obj), payload(obj).tobytes())
    begun = time.monotonic()
    shm_before = set(os.listdir("/dev/shm"))
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    faults: list[str] = []
    notes: list[str] = []
    with size_limited_fs(str(tmp_path / "fs"), FS_SIZE) as (fs, no_fs_reason):
        root = fs or str(tmp_path / "plain")
        os.makedirs(root, exist_ok=True)
        cache = Cache(os.path.join(root, "cache"), capacity=CAPACITY, schema=SCHEMA)
        ledger, monitor = Ledger(cache), Monitor(cache)
        source = SoakSource(s3.url, s3.storage_options)
        readers: list[ReaderProcess] = []
        pools: list[SamplerPool] = []

        def new_pool(seed: int) -> SamplerPool:
            pool = SamplerPool(cache, source, workers=WORKERS, shard_size=SHARD, max_shard_age=5.0, seed=seed)
            pools.append(pool)
            monitor.pools.append(pool)
            return pool.start()

        try:
            readers = [ReaderProcess(name, cache.path, str(tmp_path)) for name in ("torch", "tf")]
            all_readers = list(readers)
            pool = new_pool(seed=1)
            ledger.start()
            monitor.start()
            wait_until("both readers' first epochs", lambda: all(r.epochs() for r in readers),
                       STARTUP_TIMEOUT_S, readers)
            started = time.monotonic()
            notes.append(f"readers' first epochs after {started - begun:.0f}s")

            # 1. SIGKILL of a sampler in the middle of a shard, with bytes of it on disk.
            victim = pool.pids[0]

            def victim_temp() -> list[str]:
                return [n for n in os.listdir(cache.shards_dir) if n.startswith(f"{TMP_PREFIX}{victim}-")]

            def mid_shard() -> bool:
                return any(size_of(os.path.join(cache.shards_dir, n)) > 0 for n in victim_temp())

            try:
                wait_until("a sampler with part of a shard on disk", mid_shard, 30.0, readers)
            except AssertionError:  # sampling this slow rotates shards by age before a flush
                wait_until("a sampler with a shard in progress", victim_temp, WAIT_S, readers)
                notes.append("sampler killed before its first flush")
            os.kill(victim, signal.SIGKILL)
            wait_until("the killed sampler's restart", lambda: pool.stats().restarts >= 1 and not victim_temp())
            faults.append(f"sampler SIGKILL (+{time.monotonic() - started:.0f}s)")

            # 6. The torch trainer's whole process group is SIGKILLed mid-epoch, and the trainer
            # restarts under a new hostname; faults 2 and 3 go on while it starts. First it runs
            # epochs enough to show its memory flat across them (checked at the end).
            wait_until(f"{MEMORY_EPOCHS} epochs of the torch trainer",
                       lambda: len(readers[0].epochs()) >= MEMORY_EPOCHS, WAIT_S, readers)
            dead = readers[0]
            dead_pids = [dead.proc.pid, *children(dead.proc.pid)]
            dead_procs = {(pid, start) for pid in dead_pids if (start := start_time(pid)) is not None}
            dead_shm = {n for n in shm_mappings(dead_pids) if n.startswith("growcache-")}
            assert dead_shm, "the trainer's DataLoader (spawn) maps named slabs"
            monitor.watch_tree()  # the trainer's semaphores, mapped until the kill
            # Across the kill this process holds the shared lock that every process mapping a
            # slab holds: the cache opens and loader starts of a test another pytest worker runs
            # meanwhile sweep /dev/shm, and would remove the dead slabs before the check below. A
            # lock stops no unlink: the check still shows that no resource tracker removed them.
            held = []
            try:
                for name in dead_shm:
                    try:
                        held.append(os.open(f"/dev/shm/{name}", os.O_RDONLY))
                    except FileNotFoundError:
                        continue
                    fcntl.flock(held[-1], fcntl.LOCK_SH)
                dead.killed = True
                os.killpg(dead.proc.pid, signal.SIGKILL)
                dead.proc.wait(30)
                left_by_kill = sorted(n for n in dead_shm if os.path.exists(f"/dev/shm/{n}"))
            finally:
                for fd in held:
                    os.close(fd)  # from here the restarted trainer's start must remove them
            assert left_by_kill, "the kill took the resource tracker too: the slabs stay until growcache removes them"
            orphaned_semaphores = {n for n in shm_leaks(shm_before, set(), monitor) if n.startswith("sem.")}
            prefix, env, how = hostname_prefix("soak-restarted")
            if env:  # another process table: the dead trainer's files expire by heartbeat
                monkeypatch.setenv("GROWCACHE_OWNER_EXPIRY", "4")
                env["GROWCACHE_OWNER_EXPIRY"] = "4"
            readers[0] = ReaderProcess("torch", cache.path, str(tmp_path), label="torch-restarted", prefix=prefix,
                                       env=env)
            all_readers.append(readers[0])
            notes.append(f"trainer process group killed ({len(dead_pids)} processes, {len(left_by_kill)} growcache "
                         f"slabs and {len(orphaned_semaphores)} semaphores left behind), restarted under a new "
                         f"hostname ({how})")

            # 2. The S3 server stops for a while, then comes back.
            s3_server.stop()
            time.sleep(3.0)
            s3_server.start()
            before = pool.stats().records
            wait_until("sampling after the S3 restart", lambda: pool.stats().records >= before + 2 * 60,
                       WAIT_S, readers)
            pool.raise_if_failed()
            faults.append(f"S3 restart (+{time.monotonic() - started:.0f}s)")

            # 3. A published shard is corrupted: one that no epoch has leased yet and the next
            # snapshots will hold (within the newest capacity's worth). Under the cache's lock,
            # so no snapshot can take it between the choice and the damage.
            corrupt: set[int] = set()

            def corrupt_one() -> bool:
                with cache._locked():
                    leased = {seq for lease in cache._manifest.live_leases() for seq in lease.get("seqs", ())}
                    shards = cache.list_shards()
                    old = {s.seq for s in choose_evictions_fifo(shards, (), CAPACITY) or ()}
                    candidates = [s for s in shards if s.seq not in leased and s.seq not in old]
                    if not candidates:
                        return False
                    shard = candidates[-1]
                    if shard.seq not in ledger.shards:
                        ledger.read(shard)  # the ledger reads it before it is damaged
                    offset = (shard.records // 2) * (shard.nbytes // shard.records) + 12 + 64
                    fd = os.open(shard.path, os.O_RDWR)
                    try:
                        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
                    finally:
                        os.close(fd)
                    corrupt.add(shard.seq)
                    return True

            wait_until("an unleased shard to corrupt", corrupt_one, WAIT_S, readers, poll=0.01)
            bad = next(iter(corrupt))
            wait_until("both readers past the corrupt shard",
                       lambda: all(any(bad in leased(e) or min(leased(e), default=-1) > bad
                                       for e in r.epochs()) for r in readers), WAIT_S, readers)
            faults.append(f"corrupt shard (+{time.monotonic() - started:.0f}s)")

            # 6, continued: the restarted trainer runs; the dead one pins nothing and its slabs are gone.
            def dead_trainer_gone() -> bool:
                if env:
                    Cache(cache.path)  # heartbeat expiry: any later start removes them
                leases = os.listdir(os.path.join(cache.path, "leases"))
                return not [n for n in dead_shm if os.path.exists(f"/dev/shm/{n}")] and not [
                    n for n in leases if n.split("-")[0] == str(dead.proc.pid)]

            wait_until("the restarted trainer's epochs", lambda: len(readers[0].epochs()) >= 2, STARTUP_TIMEOUT_S,
                       readers)
            wait_until("the killed trainer's slabs and leases removed", dead_trainer_gone, WAIT_S, readers)
            faults.append(f"trainer process-group SIGKILL + restart under a new hostname "
                          f"(+{time.monotonic() - started:.0f}s)")

            # 4. SIGKILL of a DataLoader worker: the training process gets an error, not a hang.
            open(os.path.join(readers[0].control, KILL_LOADER_WORKER), "w").close()
            wait_until("the torch reader's error for its killed worker",
                       lambda: readers[0].events("loader_worker_killed"), 120.0, readers)
            killed = readers[0].events("loader_worker_killed")[0]
            # Counted, not timed: the error comes in place of the dead worker's next batch, after at
            # most the batches in flight (each worker's prefetch) of an epoch of dozens of batches.
            assert "worker" in killed["error"].lower() and killed["batches_after_kill"] <= killed["in_flight"] * 2, \
                killed
            notes.append(f"loader_error_after={killed['seconds']:.2f}s and {killed['batches_after_kill']} batches")
            faults.append(f"DataLoader worker SIGKILL (+{time.monotonic() - started:.0f}s)")

            # 5. A full disk: the pool fails cleanly, nothing published is harmed.
            if fs is None:
                notes.append(f"full_disk=skipped ({no_fs_reason})")
            else:
                digests = {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest()
                           for s in cache.list_shards() if s.seq not in corrupt}
                ballast = os.path.join(fs, "ballast")
                # Eviction keeps freeing room, so the ballast keeps topping the disk up.
                wait_until("the pool to fail on the full disk",
                           lambda: fill(fs, ballast, RESERVE) >= 0 and pool.stats().failed, WAIT_S, readers)
                with pytest.raises(SamplerError) as info:
                    pool.raise_if_failed()
                assert isinstance(info.value.__cause__, CacheFullError), info.value
                assert "is full" in str(info.value) and "Free disk space" in str(info.value)
                pool.stop(raise_on_failure=False)
                assert not [n for n in os.listdir(cache.shards_dir) if n.startswith(TMP_PREFIX)]
                for shard in cache.list_shards():
                    if shard.path in digests:
                        assert hashlib.sha256(open(shard.path, "rb").read()).hexdigest() == digests[shard.path]
                    assert os.path.getsize(shard.path) == shard.nbytes
                report = cache.verify()
                assert {c.path for c in report.corrupt} <= {ledger.shards[s].path for s in corrupt}, report.corrupt
                os.unlink(ballast)
                pool = new_pool(seed=2)
                faults.append(f"full disk (+{time.monotonic() - started:.0f}s)")

            remaining = started + SECONDS - time.monotonic()
            time.sleep(max(remaining, 0.0))
            wait_until("new shards after the faults", lambda: pool.stats().shards >= 2, WAIT_S, readers)
            epochs_now = {r.name: len(r.epochs()) for r in readers}
            wait_until("an epoch of each reader after the faults",
                       lambda: all(len(r.epochs()) > epochs_now[r.name] for r in readers), WAIT_S, readers)
            notes.append(f"an epoch of each reader on new shards after the faults (+{time.monotonic() - started:.0f}s)")
        finally:
            for reader in readers:
                open(os.path.join(reader.control, STOP), "w").close()
            stop_errors = []
            for reader in readers:
                try:
                    reader.finish(120.0)
                except AssertionError as exc:
                    stop_errors.append(str(exc))
            for p in pools:
                p.stop(raise_on_failure=False)
            monitor.stop.set()
            ledger.stop.set()
            monitor.join(10)
            ledger.join(10)
            if not s3_server._server:
                s3_server.start()
        assert not stop_errors, stop_errors
        assert pools[-1].stats().failed is False, pools[-1].stats().last_error

        # -- the figures ----------------------------------------------------------------------
        problems = ledger.problems + monitor.problems
        tallies = {}
        for reader in all_readers:
            tally = Tally()
            for epoch in reader.epochs():
                account(epoch, ledger, corrupt, tally)
            tallies[reader.name] = tally
            problems += tally.problems
        assert problems == [], problems[:20]
        for framework in ("torch", "tf"):
            epochs = sum(t.epochs for name, t in tallies.items() if name.startswith(framework))
            assert epochs >= 5, f"{framework}: only {epochs} epochs"
        for name, tally in tallies.items():
            assert tally.epochs >= (1 if name == "torch" else 2), f"{name}: only {tally.epochs} epochs"
            assert (tally.lost, tally.duplicated, tally.foreign, tally.mismatches, tally.unknown_shards) == (
                0, 0, 0, 0, 0), (name, tally)
            assert tally.oversized_snapshots == 0, f"{name}: a snapshot larger than the capacity"
        assert any(t.saw_corrupt for t in tallies.values()), "no reader met the corrupt shard"

        # -- leftovers ------------------------------------------------------------------------
        leftovers = [os.path.join(d, n) for d, _, names in os.walk(cache.path) for n in names
                     if n.startswith(TMP_PREFIX) or n.endswith(".tmp")]
        assert leftovers == []
        assert os.listdir(os.path.join(cache.path, "leases")) == [], "a lease outlived its reader"
        # Each process by its pid and start time: by the end its pid may name another process.
        seen = set(monitor.samplers) | {(r.proc.pid, r.start) for r in all_readers} | dead_procs
        for reader in readers:
            seen |= {tuple(child) for child in reader.events("done")[0]["children"]}
        deadline = time.monotonic() + 30
        while any(live(pid, start) for pid, start in seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(pid for pid, start in seen if live(pid, start)) == [], "leaked processes"
        extra = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before
                 and live(p.pid) and "resource_tracker" not in " ".join(p.cmdline())]
        assert extra == [], f"leaked child processes: {extra}"
        mapped = set().union(*(set(r.events("done")[0]["shm"]) for r in readers)) | dead_shm
        # The process-group kill orphans multiprocessing's and PyTorch's randomly named semaphores,
        # which are not growcache's to recognise (pitfalls.md); growcache's own slabs must be gone.
        assert [n for n in shm_leaks(shm_before, mapped, monitor) if n not in orphaned_semaphores] == [], \
            "leaked shared memory"

        # -- memory flat across epochs ------------------------------------------------------------
        series: dict[str, list[int]] = {f"sampler {pid}": values for pid, values in monitor.sampler_rss.items()}
        for reader in all_readers:
            for epoch in reader.epochs():
                for pid, value in epoch["rss"].items():
                    if value:
                        series.setdefault(f"{reader.name} {pid}", []).append(value)
        growth = {name: memory_growth(values) for name, values in series.items() if len(values) >= MEMORY_EPOCHS}
        assert len(growth) >= 4, f"too few processes measured over enough epochs: {sorted(series)}"
        assert {name.split()[0] for name in growth} >= {"sampler", "torch", "tf"}, sorted(growth)
        grown = {name: f"{a / 2**20:.0f} MiB -> {b / 2**20:.0f} MiB" for name, (a, b) in growth.items()
                 if b - a > max(RSS_SLACK, 0.1 * a)}
        assert grown == {}, grown
        worst = max(growth.items(), key=lambda kv: kv[1][1] - kv[1][0])

        total = Tally()
        for tally in tallies.values():
            for name in ("epochs", "delivered", "lost", "duplicated", "skipped", "mismatches"):
                setattr(total, name, getattr(total, name) + getattr(tally, name))
        summary = (
            f"soak: {time.monotonic() - started:.0f}s faults={len(faults)} ({', '.join(faults)}) "
            f"epochs=torch:{tallies['torch'].epochs}+{tallies['torch-restarted'].epochs},tf:{tallies['tf'].epochs} "
            f"records delivered={total.delivered} lost={total.lost} duplicated={total.duplicated} "
            f"corrupt_skipped={total.skipped} mismatches={total.mismatches} "
            f"published={sum(p.stats().shards for p in pools)} shards evicted={cache.stats().evicted} "
            f"peak_cache_bytes={monitor.peak} budget={CAPACITY} (bound {monitor.peak_bound} with leases "
            f"and in-progress shards) rss_growth_max={(worst[1][1] - worst[1][0]) / 2**20:+.1f}MiB ({worst[0]}) "
            f"{'; '.join(notes)}"
        )
        with capsys.disabled():
            print("\n" + summary)
