"""Cache-directory state is untrusted input (issue 28): links, values, bounded work, liveness.

Each class of problem has a test, and each damaged or hostile item of the issue one more:
a directory with shards and no metadata, crafted shard names and counters, a shard of another
schema, epoch files and leases without evidence of a live owner, environment values out of
range, a self-import, a read-only cache and a lock file that is not a file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import ID_SCHEMA, _fullfs, write_shards
from growcache import Cache, CacheFormatError, CorruptShardError, EpochSyncError
from growcache import rendezvous as rendezvous_module
from growcache.epoch import EpochOptions, Epochs
from growcache.planning import _take_from_fullest, plan_epoch
from growcache.readers import ReaderSpec, slab_batches
from growcache.rendezvous import EPOCHS_DIR, FileRendezvous, remove_stale_epoch_files
from growcache.shard import ShardInfo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTHER_TABLE = "0badc0de"  # a process-table tag that is not this one's


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, **(env or {})))


# -- no links -------------------------------------------------------------------------------------
@pytest.mark.parametrize("directory", ["shards", "leases", "epochs", "sources"])
def test_no_directory_growcache_writes_or_deletes_in_may_be_a_link(id_cache, tmp_path, directory):
    outside = tmp_path / "outside"
    outside.mkdir()
    bait = ["x.0123456789abcdef0123456789abcdef.tmp", "0123456789abcdef-0000000001.json",
            "0123456789abcdef-0000000001.ack-1", ".tmp-1-1-deadbeef-00.tfrecord"]
    for name in bait:
        (outside / name).write_text("{}")
        os.utime(outside / name, (0, 0))  # old enough for every sweep
    target = os.path.join(id_cache.path, directory)
    if os.path.isdir(target):
        shutil.rmtree(target)
    os.symlink(outside, target)
    with pytest.raises(CacheFormatError, match=f"{directory} is a symbolic link"):
        Cache(id_cache.path)
    with pytest.raises(CacheFormatError, match="symbolic link"):
        id_cache.prune()
    if directory == "epochs":
        with pytest.raises(CacheFormatError, match="symbolic link"):
            FileRendezvous(id_cache.path, ("run",), 0, 2)
        with pytest.raises(CacheFormatError, match="symbolic link"):
            remove_stale_epoch_files(id_cache.path)
    if directory == "sources":
        with pytest.raises(CacheFormatError, match="symbolic link"):
            id_cache._manifest.write_source_state("0123456789abcdef", {})
    assert sorted(os.listdir(outside)) == sorted(bait)


@pytest.mark.parametrize("kind", ["directory", "link"])
def test_a_lock_that_is_a_directory_or_a_link_is_refused_with_a_hint(id_cache, tmp_path, kind):
    lock = os.path.join(id_cache.path, ".lock")
    os.unlink(lock)
    outside = tmp_path / "elsewhere.lock"
    if kind == "directory":
        os.mkdir(lock)
    else:
        os.symlink(outside, lock)
    with pytest.raises(CacheFormatError, match=r"\.lock is a .*remove it .* re-creates it"):
        Cache(id_cache.path)
    with pytest.raises(CacheFormatError, match=r"\.lock is a"):
        id_cache.snapshot()
    assert not outside.exists()  # nothing was created through the link


def test_state_files_are_never_read_through_a_link(id_cache, tmp_path):
    outside = tmp_path / "meta.json"
    shutil.copy(os.path.join(id_cache.path, "growcache.json"), outside)
    os.unlink(os.path.join(id_cache.path, "growcache.json"))
    os.symlink(outside, os.path.join(id_cache.path, "growcache.json"))
    with pytest.raises(CacheFormatError, match="growcache.json is a symbolic link"):
        Cache(id_cache.path)


# -- every value is checked ------------------------------------------------------------------------
def test_a_directory_with_shards_and_no_metadata_is_refused(id_cache):
    write_shards(id_cache, [3])
    os.unlink(os.path.join(id_cache.path, "growcache.json"))
    for schema in (None, {"x": ("int32", (4, 8)), "id": ("int64", ())}):
        with pytest.raises(CacheFormatError, match="no growcache.json.*growcache schema") as info:
            Cache(id_cache.path, schema=schema)
        assert "Restore" in str(info.value)
    assert not os.path.exists(os.path.join(id_cache.path, "growcache.json"))  # nothing guessed, nothing stored


def test_a_next_seq_past_twelve_digits_is_repaired_and_names_stay_listable(id_cache, caplog):
    write_shards(id_cache, [2])
    state_path = os.path.join(id_cache.path, "state.json")
    with open(state_path) as f:
        state = json.load(f)
    state["next_seq"] = 10**12
    with open(state_path, "w") as f:
        json.dump(state, f)
    write_shards(id_cache, [2])
    assert [s.seq for s in id_cache.list_shards()] == [1, 2]  # the new shard is listed: a 12-digit name
    assert "next_seq" in caplog.text
    assert all(len(name) < 40 for name in os.listdir(id_cache.shards_dir))


def test_a_lease_without_a_start_time_is_expired(id_cache):
    write_shards(id_cache, [2, 2])
    lease = {"pid": 1, "host": None, "created": time.time(), "holder": "old", "seqs": [1, 2]}  # pid 1 lives
    with open(os.path.join(id_cache.path, "leases", "1-old.json"), "w") as f:
        json.dump(lease, f)
    assert id_cache.stats().leases == 0
    assert [s.seq for s in id_cache.evict(to=0)] == [1, 2]


def test_pids_past_any_pid_max_are_dead_owners_not_an_overflow(id_cache):
    write_shards(id_cache, [2])
    with open(os.path.join(id_cache.path, "leases", "big.json"), "w") as f:
        json.dump({"pid": 2**40, "start_time": 1, "host": None, "created": 0, "holder": "", "seqs": [1]}, f)
    open(os.path.join(id_cache.shards_dir, ".tmp-99999999999-1-aa.tfrecord"), "wb").close()  # ours: by pid
    assert id_cache.stats().leases == 0
    Cache(id_cache.path)
    assert sorted(os.listdir(id_cache.shards_dir)) == [os.path.basename(id_cache.list_shards()[0].path)]
    assert os.listdir(os.path.join(id_cache.path, "leases")) == []


@pytest.mark.parametrize("field, value, match", [
    ("capacity", 2**70, "field 'capacity'"),
    ("schema", {"x": ["float32", [1 << 20, 1 << 20]]}, "more than the 2 GiB"),
])
def test_metadata_values_out_of_range_are_refused(id_cache, field, value, match):
    path = os.path.join(id_cache.path, "growcache.json")
    with open(path) as f:
        metadata = json.load(f)
    metadata[field] = value
    with open(path, "w") as f:
        json.dump(metadata, f)
    with pytest.raises(CacheFormatError, match=match):
        Cache(id_cache.path)


@pytest.mark.parametrize("name", ["growcache.json", "state.json"])
def test_a_directory_in_place_of_a_state_file_is_a_format_error_naming_it(id_cache, name, capsys):
    # os.fdopen refused the directory with a raw IsADirectoryError naming a file descriptor
    # (and leaked it); a directory state.json then failed every open on a rename of a temporary.
    from growcache.cli import main
    from growcache.manifest import read_state_file

    path = os.path.join(id_cache.path, name)
    os.unlink(path)
    os.mkdir(path)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(CacheFormatError, match=f"{name} is not a regular file"):
            read_state_file(path, path)
    assert len(os.listdir("/proc/self/fd")) == fds, "a refused directory leaves no descriptor open"
    with pytest.raises(CacheFormatError, match=f"{name} is (not a regular file|a directory)"):
        Cache(id_cache.path)
    assert main(["status", id_cache.path]) == 1
    assert f"{name} is " in capsys.readouterr().err


def test_a_directory_named_like_an_epoch_file_leaves_the_cache_usable(id_cache, capsys):
    # The sweep at every open unlinked it as a dead first rank's file: IsADirectoryError made
    # every Cache(), status and prune of the cache fail.
    from growcache.cli import main

    epochs = os.path.join(id_cache.path, EPOCHS_DIR)
    os.makedirs(epochs, exist_ok=True)
    planted = [os.path.join(epochs, n) for n in ("0123456789abcdef-0000000001.json", "0123456789abcdef-0000000001.ack-1",
                                                  "x.0123456789abcdef0123456789abcdef.tmp")]
    for path in planted:
        os.mkdir(path)
        os.utime(path, (0, 0))  # old enough for every sweep
    assert remove_stale_epoch_files(id_cache.path) == 0
    Cache(id_cache.path)
    assert main(["prune", id_cache.path]) == 0
    assert main(["status", id_cache.path]) == 0
    assert all(os.path.isdir(path) for path in planted), "growcache deletes no directory"
    write_shards(id_cache, [4])
    assert id_cache.snapshot().shards


def test_a_directory_at_the_first_ranks_epoch_file_is_an_error_naming_it(id_cache):
    # It raised a raw IsADirectoryError from unlinking an earlier attempt's file.
    write_shards(id_cache, [4])
    rendezvous = FileRendezvous(id_cache.path, ("run",), 0, 2, file_mode=id_cache.file_mode,
                                dir_mode=id_cache.dir_mode)
    os.mkdir(rendezvous.path(0))
    with pytest.raises(CacheFormatError, match="is a directory, where the first rank writes") as info:
        rendezvous.share(0, lambda: pytest.fail("no epoch is taken"))
    assert rendezvous.path(0) in str(info.value) and "Remove it" in str(info.value)
    assert os.path.isdir(rendezvous.path(0))


def test_an_oversized_state_file_is_refused_without_reading_it_whole(id_cache):
    with open(os.path.join(id_cache.path, "growcache.json"), "ab") as f:
        f.truncate(1 << 30)  # sparse: a 1 GiB metadata file
    with pytest.raises(CacheFormatError, match="larger than 16 MiB"):
        Cache(id_cache.path)


def test_a_stale_acknowledgement_of_a_killed_run_never_lets_the_new_epoch_file_go(id_cache, monkeypatch):
    # A run killed mid-epoch and restarted with the same run id within the sweep's grace left
    # rank 1's acknowledgement of that epoch: the new first rank took it for an answer to its own
    # file, deleted the file at once, and rank 1 waited for it until EpochSyncError.
    from growcache.rendezvous import EpochShards

    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2)
    with open(first.ack_path(0, 1), "w") as f:
        json.dump({"pid": 1, "start_time": 1, "host": None, "created": 0}, f)
    shard = id_cache.list_shards()[0]
    agreement = first.share(0, lambda: EpochShards(0, 0, (shard.seq,), (os.path.basename(shard.path),)))
    agreement.confirm(True, 1)  # the first rank leased and reads, as Epochs.start has it do
    closed = threading.Event()
    agreement.release(closed.set)  # the first rank ends its epoch: its file waits for rank 1
    time.sleep(0.5)
    assert os.path.exists(first.path(0)) and not closed.is_set(), "the file waits for this run's rank 1"
    follower = FileRendezvous(id_cache.path, ("run",), 1, 2).share(0, lambda: None)
    assert follower.shards.seqs == (shard.seq,)
    follower.confirm(True, 1)
    deadline = time.monotonic() + 10
    while not closed.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert closed.is_set() and not os.path.exists(first.path(0))


def test_a_damaged_epoch_file_is_a_dead_first_rank_s(id_cache, monkeypatch):
    write_shards(id_cache, [4])
    follower = FileRendezvous(id_cache.path, ("run",), 1, 2)
    pid, start = os.getpid(), int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
    with open(follower.path(0), "w") as f:  # a live writer, but seqs that no shard name can carry
        json.dump({"epoch": 0, "seed": 0, "seqs": [10**13], "names": [], "pid": pid, "start_time": start,
                   "host": None, "created": 0}, f)
    monkeypatch.setattr(rendezvous_module, "AGREE_TIMEOUT_S", 0.2)
    with pytest.raises(EpochSyncError, match="which is gone"):
        FileRendezvous(id_cache.path, ("run",), 1, 2).share(0, lambda: None)
    assert remove_stale_epoch_files(id_cache.path) == 1


_NO_PROC_RANKS = """
import sys
import growcache._proc as proc
proc.process_start_time = lambda pid: None  # a platform without /proc (macOS, some sandboxes)
from conftest import ID_SCHEMA, write_shards
from growcache import Cache
from growcache.rendezvous import EpochShards, FileRendezvous, remove_stale_epoch_files
cache = Cache(sys.argv[1], capacity="1GB", schema=ID_SCHEMA)
write_shards(cache, [4])
seq = cache.list_shards()[0].seq
FileRendezvous(cache.path, ("run",), 0, 2).share(0, lambda: EpochShards(0, 7, (seq,)))
print(remove_stale_epoch_files(cache.path))
print(FileRendezvous(cache.path, ("run",), 1, 2, timeout=2).share(0, lambda: None).shards.seqs == (seq,))
"""


def test_an_epoch_file_without_start_time_is_live_where_the_platform_tells_none(tmp_path):
    # Such a platform writes start_time null, as its leases: the other ranks read every epoch
    # file as damaged (a dead first rank's), each open swept it, and every rank waited it out.
    run = subprocess.run([sys.executable, "-c", _NO_PROC_RANKS, str(tmp_path / "c")], capture_output=True,
                         text=True, timeout=120, cwd=os.path.join(ROOT, "tests"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["0", "True"]


# -- the work any value causes is bounded ----------------------------------------------------------
def test_a_name_in_other_digits_is_no_shard_and_blocks_no_publish(id_cache):
    # re's \d and int() take any Unicode digit: one stray file named with Arabic-Indic digits for
    # sequence 999999999999 made every publish fail with "spent every sequence number".
    write_shards(id_cache, [3])
    stray = os.path.join(id_cache.shards_dir, "\u0669" * 12 + "-3r-48b.tfrecord")
    shutil.copy(id_cache.list_shards()[0].path, stray)
    assert len(id_cache.list_shards()) == 1
    write_shards(id_cache, [3], first_id=10)
    assert [s.seq for s in id_cache.list_shards()] == [1, 2]


def test_a_shard_name_claiming_more_records_than_its_bytes_frame_is_no_shard(id_cache):
    write_shards(id_cache, [3])
    shard = id_cache.list_shards()[0]
    crafted = os.path.join(id_cache.shards_dir, ShardInfo.file_name(7, 10**17, shard.nbytes))
    shutil.copy(shard.path, crafted)
    assert [s.seq for s in id_cache.list_shards()] == [shard.seq]
    report = id_cache.verify()
    assert [c.path for c in report.corrupt] == [crafted] and "a record takes at least 16 bytes" in \
        report.corrupt[0].reason and not report.ok


def test_a_shard_name_claiming_absurd_counts_cannot_hang_ddp_planning(id_cache, monkeypatch):
    monkeypatch.setattr(rendezvous_module, "AGREE_TIMEOUT_S", 0.2)  # rank 1 never comes: end the lease soon
    write_shards(id_cache, [3, 3])
    shard = id_cache.list_shards()[0]
    # Consistent claims (10**16 records in 16 * 10**16 bytes): only a stat tells the name lies.
    crafted = os.path.join(id_cache.shards_dir, ShardInfo.file_name(9, 10**16, 16 * 10**16))
    shutil.copy(shard.path, crafted)
    done: list = []

    def start() -> None:
        epoch = Epochs(id_cache, EpochOptions(1, run_id="absurd", on_corrupt="skip"), world=(0, 2)).start()
        done.append([epoch.plan.rank_records(r) for r in range(2)])
        epoch.end()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(60)
    assert done, "planning an epoch with a crafted shard name did not finish"
    assert max(done[0]) < 1000
    assert len(id_cache.list_shards()) == 3 and id_cache.evict() == []  # its claimed 160 PB evict nothing


def test_planning_takes_closed_form_steps_whatever_the_counts():
    plans: list = []

    def plan() -> None:
        plans.append(plan_epoch([10**15, 1, 1], epoch=0, seed=0, world_size=2, num_workers=2, batch_size=1))
        plans.append(plan_epoch([10**15, 10**15 - 7, 5], epoch=0, seed=0, world_size=2, num_workers=3,
                                batch_size=2, drop_last=True))

    thread = threading.Thread(target=plan, daemon=True)
    thread.start()
    thread.join(30)
    assert len(plans) == 2, "planning ran a loop per batch"
    assert plans[0].rank_batches(0) == plans[0].rank_batches(1) == 10**15
    assert plans[1].rank_batches(0) == plans[1].rank_batches(1) == (10**15 - 7) // 2 + 5 // 2


def test_taking_from_the_fullest_in_closed_form_equals_the_step_by_step_loop():
    def stepwise(counts: list[int], excess: int) -> list[int]:
        counts = list(counts)
        for _ in range(excess):
            i = max(range(len(counts)), key=lambda k: (counts[k], -k))
            counts[i] -= 1
        return counts

    rng = np.random.default_rng(0)
    for _ in range(3000):
        counts = [int(c) for c in rng.integers(0, 12, rng.integers(1, 7))]
        excess = int(rng.integers(0, sum(counts) + 1))
        assert _take_from_fullest(list(counts), excess) == stepwise(counts, excess), (counts, excess)


# -- liveness from evidence only --------------------------------------------------------------------
def test_an_epoch_file_of_another_process_table_expires_by_its_own_heartbeat(id_cache, monkeypatch):
    write_shards(id_cache, [4])
    follower = FileRendezvous(id_cache.path, ("run",), 1, 2)
    body = {"epoch": 0, "seed": 0, "seqs": [1], "names": [os.path.basename(id_cache.list_shards()[0].path)],
            "pid": 1, "start_time": 1, "host": OTHER_TABLE, "created": 0, "expiry": 5.0}
    with open(follower.path(0), "w") as f:
        json.dump(body, f)
    os.utime(follower.path(0), (time.time() - 30, time.time() - 30))  # no heartbeat for 30 s > its 5 s
    monkeypatch.setattr(rendezvous_module, "AGREE_TIMEOUT_S", 0.2)
    with pytest.raises(EpochSyncError, match="which is gone"):
        FileRendezvous(id_cache.path, ("run",), 1, 2).share(0, lambda: None)
    assert remove_stale_epoch_files(id_cache.path) == 1
    with open(follower.path(0), "w") as f:  # the same file with a fresh heartbeat is followed
        json.dump(body, f)
    assert FileRendezvous(id_cache.path, ("run",), 1, 2).share(0, lambda: None).shards.seqs == (1,)


def test_a_first_rank_keeps_its_epoch_file_alive_with_a_heartbeat(id_cache, monkeypatch):
    monkeypatch.setattr(rendezvous_module, "AGREE_TIMEOUT_S", 0.2)  # rank 1 never comes: end the lease soon
    write_shards(id_cache, [4])
    epoch = Epochs(id_cache, EpochOptions(1, run_id="beat"), world=(0, 2)).start()
    path = FileRendezvous(id_cache.path, ("x",), 0, 2).dir
    names = [n for n in os.listdir(path) if n.endswith(".json")]
    assert len(names) == 1
    with open(os.path.join(path, names[0])) as f:
        assert json.load(f)["expiry"] > 0
    from growcache import _proc

    assert os.path.join(path, names[0]) in _proc._HEARTBEAT.paths
    epoch.end()


def test_another_table_s_lease_lives_by_the_expiry_it_states_not_the_judge_s(id_cache, monkeypatch):
    write_shards(id_cache, [2, 2])
    lease = {"pid": 1, "start_time": 1, "host": OTHER_TABLE, "created": 0, "holder": "far", "seqs": [1, 2],
             "expiry": 600.0}
    path = os.path.join(id_cache.path, "leases", "1-far.json")
    with open(path, "w") as f:
        json.dump(lease, f)
    os.utime(path, (time.time() - 120, time.time() - 120))  # older than the judge's 60 s, not its own 600 s
    assert id_cache.evict(to=0) == [] and id_cache.stats().leases == 1
    lease["expiry"] = 60.0
    with open(path, "w") as f:
        json.dump(lease, f)
    os.utime(path, (time.time() - 120, time.time() - 120))
    assert len(id_cache.evict(to=0)) == 2


def test_a_temporary_of_another_table_lives_by_the_expiry_its_name_states(id_cache):
    shards = id_cache.shards_dir
    names = {600: f".tmp-1-1-{OTHER_TABLE}-aa-600.tfrecord", 30: f".tmp-1-1-{OTHER_TABLE}-bb-30.tfrecord"}
    for name in names.values():
        open(os.path.join(shards, name), "wb").close()
        os.utime(os.path.join(shards, name), (time.time() - 120, time.time() - 120))
    Cache(id_cache.path)  # opening removes dead writers' temporaries
    assert os.listdir(shards) == [names[600]]


class _SweptWhileChecking(Cache):
    """A cache whose add_shard check is interrupted by another process table opening the cache
    (which sweeps temporaries whose owner it cannot see alive)."""

    def _check_added(self, tmp, source):
        swept = _run(f"from growcache import Cache; Cache({self.path!r})", env={"GROWCACHE_NODE": "elsewhere"})
        assert swept.returncode == 0, swept.stderr
        return super()._check_added(tmp, source)


def test_a_file_moved_in_by_add_shard_is_kept_alive_while_it_is_checked(id_cache, tmp_path):
    other = Cache(tmp_path / "other", capacity="1GB", schema=ID_SCHEMA)
    write_shards(other, [4])
    given = tmp_path / "given.tfrecord"
    shutil.move(other.list_shards()[0].path, given)
    os.utime(given, (1e9, 1e9))  # written long ago: a moved file keeps that time
    cache = _SweptWhileChecking(id_cache.path)
    assert cache.add_shard(given, move=True).records == 4
    assert not given.exists() and cache.stats().records == 4
    broken = tmp_path / "broken.tfrecord"
    broken.write_bytes(b"\0" * 40)
    os.utime(broken, (1e9, 1e9))
    with pytest.raises(CorruptShardError):
        cache.add_shard(broken, move=True)
    assert os.stat(broken).st_mtime == 1e9  # a refused file goes back as it was


@pytest.mark.parametrize("value", ["inf", "1e-9", "nan", "-5", "soon"])
def test_an_owner_expiry_out_of_range_is_a_clear_error(id_cache, value):
    write_shards(id_cache, [2])
    result = _run(f"from growcache import Cache; Cache({id_cache.path!r}).snapshot()",
                  env={"GROWCACHE_OWNER_EXPIRY": value}, timeout=60)
    assert result.returncode == 1
    assert f"SettingError: GROWCACHE_OWNER_EXPIRY={value!r} is not a number of seconds between" in result.stderr


# -- a shard of another schema ----------------------------------------------------------------------
def _plant_other_schema_shard(cache: Cache, tmp_path) -> str:
    other = Cache(tmp_path / "other", capacity="1GB", schema={"y": ("int64", (3,))})
    with other.writer() as writer:
        for i in range(5):
            writer.write({"y": np.arange(3) + i})
    shard = other.list_shards()[0]
    planted = os.path.join(cache.shards_dir, ShardInfo.file_name(50, shard.records, shard.nbytes))
    shutil.copy(shard.path, planted)
    return planted


def test_a_shard_of_another_schema_is_a_corrupt_shard(id_cache, tmp_path):
    write_shards(id_cache, [5, 5])
    planted = _plant_other_schema_shard(id_cache, tmp_path)
    report = id_cache.verify()
    assert [c.path for c in report.corrupt] == [planted] and "another schema" in report.corrupt[0].reason
    for on_corrupt in ("raise", "skip"):
        epochs = Epochs(id_cache, EpochOptions(4, on_corrupt=on_corrupt), readers=1, world=(0, 1))
        epoch = epochs.start()
        reader = ReaderSpec(ID_SCHEMA, 4, on_corrupt=on_corrupt).build()
        try:
            if on_corrupt == "raise":
                with pytest.raises(CorruptShardError, match="another schema") as info:
                    list(slab_batches(reader, epoch.share(0), None))
                assert info.value.path == planted
            else:
                items = list(slab_batches(reader, epoch.share(0), None))
                skipped = [i for i in items if not isinstance(i, tuple)]
                assert [s.path for s in skipped] == [planted]
                assert sum(len(arrays["id"]) for _, arrays in (i for i in items if isinstance(i, tuple))) == 10
            with pytest.raises(CorruptShardError, match="another schema"):
                Epochs(id_cache, EpochOptions(4, on_corrupt="raise"), world=(0, 1)).check_shard(planted)
        finally:
            epoch.end()


# -- growcache import of the cache's own shards -----------------------------------------------------
def test_importing_a_cache_s_own_shards_into_it_is_refused(id_cache, capsys):
    from growcache.cli import main

    write_shards(id_cache, [3, 4])
    before = id_cache.stats().records
    paths = [s.path for s in id_cache.list_shards()]
    assert main(["import", "--quiet", *paths, id_cache.path]) == 1
    out = capsys.readouterr().out
    assert out.count("REFUSED") == 2 and "would duplicate its records" in out
    assert Cache(id_cache.path).stats().records == before


# -- a read-only cache -------------------------------------------------------------------------------
_STATUS_VERIFY_PRUNE = (
    "import sys; from growcache.cli import main\n"
    "path = sys.argv[1]\n"
    "codes = [main(['status', path]), main(['verify', '--quiet', path]), main(['prune', path])]\n"
    "print('CODES', codes)\n"
)


def _check_read_only_run(result: subprocess.CompletedProcess, why: str) -> None:
    assert "CODES [0, 0, 1]" in result.stdout, result.stdout + result.stderr
    assert f"access       read-only ({why}" in result.stdout
    assert "1 shards, 3 records checked, 0 corrupt" in result.stdout
    assert f"growcache prune: [Errno" in result.stderr and why in result.stderr
    assert "needs write access" in result.stderr


def test_a_cache_on_a_read_only_mount_serves_status_and_verify(tmp_path):
    cache = Cache(tmp_path / "ro", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [3])
    script = ('mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" && shift && exec "$@"')
    reasons = []
    for prefix in (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"]):
        if shutil.which("unshare") is None:
            reasons.append("no unshare command")
            break
        if prefix[1] == "--mount" and os.geteuid() != 0:
            continue
        result = subprocess.run([*prefix, "sh", "-c", script, "sh", cache.path, sys.executable, "-c",
                                 _STATUS_VERIFY_PRUNE, cache.path], capture_output=True, text=True, timeout=120,
                                cwd=ROOT)
        if "CODES" not in result.stdout and ("mount" in result.stderr or "unshare" in result.stderr):
            reasons.append(f"{' '.join(prefix)}: {result.stderr.strip()[:200]}")
            continue
        _check_read_only_run(result, "Read-only file system")
        return
    if _fullfs.in_ci():
        pytest.fail(f"CI=true requires a read-only bind mount in a private mount namespace: {reasons}")
    pytest.skip(f"no read-only mount can be made here: {reasons}")


def test_a_cache_whose_lock_this_user_may_not_create_serves_status_and_verify(tmp_path):
    cache = Cache(tmp_path / "noperm", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [3])
    os.chmod(cache._manifest.lock_path, 0o444)
    os.chmod(cache.path, 0o555)
    # Root ignores permission bits: there the commands run in a user namespace of their own,
    # as root without its power over this namespace's files (the owner's bits then apply).
    prefix = ["unshare", "--user"] if os.geteuid() == 0 else []
    try:
        result = subprocess.run([*prefix, sys.executable, "-c", _STATUS_VERIFY_PRUNE, cache.path],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        if prefix and "CODES" not in result.stdout and "unshare" in result.stderr:
            if _fullfs.in_ci():
                pytest.fail(f"CI=true: running as root needs unshare --user for this test: {result.stderr}")
            pytest.skip(f"as root, and unshare --user fails here: {result.stderr.strip()[:200]}")
        _check_read_only_run(result, "Permission denied")
    finally:
        os.chmod(cache.path, 0o755)
