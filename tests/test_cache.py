"""Cache directory: publish, snapshot leases, budget and eviction, metadata, verify, add_shard."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from growcache import (
    Cache,
    CacheFormatError,
    CacheFullError,
    CorruptShardError,
    Schema,
    SchemaError,
    SchemaMismatchError,
)
from growcache import _proc
from growcache.eviction import choose_evictions_fifo
from growcache.records import iter_records
from growcache.shard import ShardInfo

from conftest import ID_SCHEMA, id_sample, write_shards

SHARD_OF_10 = None  # bytes of a 10-record shard of ID_SCHEMA, computed below


def _shard_bytes(records: int) -> int:
    from growcache.example import ExampleCodec

    return records * (ExampleCodec(ID_SCHEMA).record_nbytes + 16)


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)


def test_publish_lists_in_order_and_reads_back(id_cache):
    ids = write_shards(id_cache, [3, 4, 5])
    shards = id_cache.list_shards()
    assert [s.records for s in shards] == [3, 4, 5]
    assert [s.seq for s in shards] == sorted(s.seq for s in shards)
    assert all(os.path.getsize(s.path) == s.nbytes for s in shards)
    from growcache.example import ExampleCodec

    codec = ExampleCodec(ID_SCHEMA)
    got = [int(codec.decode(r)["id"]) for s in shards for _, r in iter_records(s.path)]
    assert got == ids


def test_shard_in_progress_is_never_listed(id_cache):
    writer = id_cache.writer()
    writer.write(id_sample(1))
    writer._flush()
    assert os.path.exists(writer.path)
    assert id_cache.list_shards() == [] and len(id_cache.snapshot()) == 0
    info = writer.close()
    assert id_cache.list_shards() == [info] and not os.path.exists(writer.path)


def test_writer_context_discards_on_exception_and_empty_writer_publishes_nothing(id_cache):
    with pytest.raises(RuntimeError):
        with id_cache.writer() as writer:
            writer.write(id_sample(1))
            raise RuntimeError("sampler failed")
    assert id_cache.list_shards() == [] and not os.path.exists(writer.path)
    assert id_cache.writer().close() is None
    assert os.listdir(id_cache.shards_dir) == []


def test_reopen_keeps_schema_and_capacity_and_refuses_other_schema(id_cache):
    write_shards(id_cache, [2])
    again = Cache(id_cache.path)
    assert again.schema == ID_SCHEMA and again.capacity == id_cache.capacity
    with pytest.raises(SchemaMismatchError, match="holds records of schema"):
        Cache(id_cache.path, schema={"id": ("int32", ())})
    assert Cache(id_cache.path, capacity="2GB").capacity == 2 * 10**9
    assert len(Cache(id_cache.path).list_shards()) == 1


def test_newer_format_and_damaged_metadata_are_refused(id_cache):
    meta_path = os.path.join(id_cache.path, "growcache.json")
    meta = json.load(open(meta_path))
    meta["format_version"] = 99
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(CacheFormatError, match="format version 99.*Upgrade growcache"):
        Cache(id_cache.path)
    open(meta_path, "w").write("{not json")
    with pytest.raises(CacheFormatError, match="not valid JSON"):
        Cache(id_cache.path)


def test_cache_path_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Cache(path)


@pytest.mark.parametrize("capacity", [0, -5, "0GB", "lots"])
def test_bad_capacity(tmp_path, capacity):
    with pytest.raises(ValueError, match="capacity"):
        Cache(tmp_path / "c", capacity=capacity, schema=ID_SCHEMA)


def test_writing_without_schema_says_how_to_fix(tmp_path):
    with pytest.raises(SchemaError, match="schema="):
        Cache(tmp_path / "c").writer()


def test_shard_larger_than_budget_is_a_clear_error_and_harms_nothing(tmp_path):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(3), schema=ID_SCHEMA)
    write_shards(cache, [2])
    before = {s.path: _digest(s.path) for s in cache.list_shards()}
    writer = cache.writer()
    with pytest.raises(CacheFullError, match="more than the cache's whole capacity.*Raise the capacity"):
        for i in range(10):
            writer.write(id_sample(i))
    assert not os.path.exists(writer.path)
    assert {s.path: _digest(s.path) for s in cache.list_shards()} == before


def test_fifo_eviction_keeps_budget(tmp_path):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 3, schema=ID_SCHEMA)
    write_shards(cache, [10] * 7)
    shards = cache.list_shards()
    assert [s.seq for s in shards] == [5, 6, 7]
    stats = cache.stats()
    assert stats.bytes <= cache.capacity and stats.evicted == 4 and stats.published == 7
    assert stats.evicted_bytes == 4 * _shard_bytes(10)


def test_a_capacity_stored_by_another_process_binds_every_process(tmp_path):
    path = tmp_path / "c"
    sampler_side = Cache(path, capacity=_shard_bytes(10) * 3, schema=ID_SCHEMA)
    write_shards(sampler_side, [10] * 3)
    child = subprocess.run([sys.executable, "-c", f"import growcache; growcache.Cache({str(path)!r}, capacity={_shard_bytes(10)})"])
    assert child.returncode == 0
    assert sampler_side.stats().capacity == _shard_bytes(10)
    write_shards(sampler_side, [10], first_id=100)  # the next publish enforces the new budget
    assert [s.seq for s in sampler_side.list_shards()] == [4]


def test_leased_shards_survive_and_closing_the_snapshot_trims_to_budget(tmp_path):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 2, schema=ID_SCHEMA)
    write_shards(cache, [10, 10])
    snapshot = cache.snapshot()
    assert snapshot.leased and len(snapshot) == 2
    # Writers keep publishing during the epoch: the budget applies to unleased shards, so the
    # directory may exceed the capacity by the leased bytes, never more.
    write_shards(cache, [10, 10, 10], first_id=100)
    assert all(os.path.exists(p) for p in snapshot.paths)
    assert [s.seq for s in cache.list_shards()] == [1, 2, 4, 5]
    assert cache.stats().bytes == cache.capacity + snapshot.nbytes
    # The writers are done; ending the epoch alone brings the cache back to its budget.
    snapshot.close()
    assert [s.seq for s in cache.list_shards()] == [4, 5]
    assert cache.stats().bytes <= cache.capacity
    assert not any(os.path.exists(p) for p in snapshot.paths)
    snapshot.close()  # idempotent


def test_closing_a_snapshot_over_damaged_metadata_warns_and_never_raises(tmp_path, caplog):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 2, schema=ID_SCHEMA)
    write_shards(cache, [10])
    snapshot = cache.snapshot()
    meta_path = os.path.join(cache.path, "growcache.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["capacity"] = "lots"  # damaged while the epoch ran
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    snapshot.close()
    assert not snapshot.leased and os.listdir(os.path.join(cache.path, "leases")) == []
    assert "could not trim cache" in caplog.text and "growcache.json" in caplog.text
    with pytest.raises(CacheFormatError, match="growcache.json"):
        cache.snapshot()  # the next use reports the damage


def test_a_garbage_collected_snapshot_is_trimmed_by_the_next_snapshot(tmp_path):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 2, schema=ID_SCHEMA)
    write_shards(cache, [10, 10])
    snapshot = cache.snapshot()
    write_shards(cache, [10, 10, 10], first_id=100)
    del snapshot  # released, not closed: no trim until the cache is used again
    assert cache.stats().leases == 0 and cache.stats().bytes == cache.capacity * 2
    with cache.snapshot() as next_epoch:
        assert [s.seq for s in next_epoch] == [4, 5]
    assert cache.stats().bytes <= cache.capacity


def test_closing_a_snapshot_keeps_shards_another_snapshot_leases(tmp_path):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 2, schema=ID_SCHEMA)
    write_shards(cache, [10, 10])
    first, second = cache.snapshot(), cache.snapshot()
    write_shards(cache, [10, 10], first_id=100)
    first.close()
    assert all(os.path.exists(p) for p in second.paths)
    second.close()
    assert [s.seq for s in cache.list_shards()] == [3, 4]


def _refuse_while_leased(shards, leased, capacity, incoming, now):
    return None if leased else choose_evictions_fifo(shards, leased, capacity, incoming, now)


def test_writer_waits_when_the_policy_refuses_and_resumes_after_release(tmp_path):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 2, schema=ID_SCHEMA,
                  eviction_policy=_refuse_while_leased)
    write_shards(cache, [10, 10])
    snapshot = cache.snapshot()
    published = []
    writer_thread = threading.Thread(target=lambda: published.append(write_shards(cache, [10], first_id=100)))
    writer_thread.start()
    time.sleep(0.5)
    assert writer_thread.is_alive() and not published
    snapshot.close()
    writer_thread.join(10)
    assert published and [s.seq for s in cache.list_shards()] == [2, 3]


def test_publish_timeout_raises_and_removes_temporary(tmp_path):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10), schema=ID_SCHEMA, eviction_policy=_refuse_while_leased)
    write_shards(cache, [10])
    with cache.snapshot():
        writer = cache.writer(publish_timeout=0.2)
        for i in range(10):
            writer.write(id_sample(i))
        with pytest.raises(CacheFullError, match="leased shards fill the budget"):
            writer.close()
        assert not os.path.exists(writer.path)
    assert len(cache.list_shards()) == 1


def test_snapshot_lease_released_on_close_gc_and_not_pickled(id_cache):
    write_shards(id_cache, [1, 1])
    leases = os.path.join(id_cache.path, "leases")
    snapshot = id_cache.snapshot()
    assert len(os.listdir(leases)) == 1
    view = pickle.loads(pickle.dumps(snapshot))
    assert view.shards == snapshot.shards and not view.leased
    del view
    assert len(os.listdir(leases)) == 1
    del snapshot
    assert os.listdir(leases) == []
    with id_cache.snapshot() as snap:
        assert id_cache.stats().leases == 1 and id_cache.stats().leased_shards == 2
    assert not snap.leased and id_cache.stats().leases == 0


def test_lease_of_a_dead_process_expires(tmp_path):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 2, schema=ID_SCHEMA)
    write_shards(cache, [10, 10])
    child = _child(
        f"""
        import time, growcache
        snap = growcache.Cache({cache.path!r}).snapshot()
        print(len(snap), flush=True)
        time.sleep(60)
        """
    )
    assert child.stdout.readline().strip() == "2"
    assert cache.stats().leases == 1
    child.send_signal(signal.SIGKILL)
    child.wait()
    write_shards(cache, [10])  # would wait forever if the dead child's lease still held
    assert [s.seq for s in cache.list_shards()] == [2, 3]
    assert os.listdir(os.path.join(cache.path, "leases")) == []


@pytest.mark.parametrize("lease", [
    {"start_time": None, "seqs": [1]},  # no pid: read as -1 it would look alive forever
    {"pid": None, "start_time": None, "seqs": [1]},
    {"pid": 0, "start_time": None, "seqs": [1]},
    {"pid": os.getpid(), "start_time": "x", "seqs": [1]},
    {"pid": os.getpid(), "start_time": None, "seqs": "1"},
    {"pid": os.getpid(), "start_time": None, "seqs": [0]},
    {"pid": os.getpid(), "start_time": None, "seqs": [1], "holder": 7},
    {"pid": os.getpid(), "start_time": None, "seqs": [1], "created": "today"},
], ids=["no-pid", "null-pid", "pid-0", "bad-start", "bad-seqs", "seq-0", "bad-holder", "bad-created"])
def test_a_damaged_lease_expires_instead_of_pinning_or_blocking(tmp_path, lease, caplog):
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 2, schema=ID_SCHEMA)
    write_shards(cache, [10, 10])
    lease_path = os.path.join(cache.path, "leases", "1-damaged.json")
    with open(lease_path, "w") as f:
        json.dump(lease, f)
    write_shards(cache, [10])  # evicts shard 1: the damaged lease neither pins it nor fails the publish
    assert [s.seq for s in cache.list_shards()] == [2, 3]
    assert not os.path.exists(lease_path)
    assert "1-damaged.json is damaged" in caplog.text


@pytest.mark.parametrize("start_time", [1, None])  # None: a machine without /proc wrote it
def test_another_machines_lease_lives_while_its_heartbeat_does(tmp_path, caplog, start_time):
    # On a filesystem several machines share, a remote holder's pid means nothing here: its
    # lease lives while its heartbeat (the file's mtime) is younger than the expiry.
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(10) * 2, schema=ID_SCHEMA)
    write_shards(cache, [10, 10])
    lease_path = os.path.join(cache.path, "leases", "999999-remote.json")
    with open(lease_path, "w") as f:
        json.dump({"pid": 999999, "start_time": start_time, "host": "0ther0ne", "seqs": [1, 2], "holder": "remote"},
                  f)
    write_shards(cache, [10], first_id=100)
    assert [s.seq for s in cache.list_shards()] == [1, 2, 3], "the remote lease keeps its shards"
    assert os.path.exists(lease_path)
    stale = time.time() - _proc.owner_expiry() - 5
    os.utime(lease_path, (stale, stale))  # its holder stopped beating: a crashed remote trainer
    write_shards(cache, [10], first_id=200)
    assert [s.seq for s in cache.list_shards()] == [3, 4]
    assert not os.path.exists(lease_path) and "no heartbeat" in caplog.text


def test_a_temporary_of_another_machine_is_kept_while_it_beats_and_a_dead_local_one_removed(id_cache):
    remote = os.path.join(id_cache.shards_dir, ".tmp-999999-1-0ther0ne-abcdef.tfrecord")
    stale_remote = os.path.join(id_cache.shards_dir, ".tmp-999998-1-0ther0ne-abcdef.tfrecord")
    local = os.path.join(id_cache.shards_dir, f".tmp-999999-1-{_proc.this_host()}-abcdef.tfrecord")
    older = os.path.join(id_cache.shards_dir, ".tmp-999999-1-abcdef.tfrecord")  # before the host tag
    for path in (remote, stale_remote, local, older):
        open(path, "wb").close()
    stale = time.time() - _proc.owner_expiry() - 5
    os.utime(stale_remote, (stale, stale))
    id_cache.prune()
    assert os.path.exists(remote)
    assert not any(os.path.exists(p) for p in (stale_remote, local, older))


def test_a_lost_state_file_never_lets_a_publish_replace_a_shard(id_cache):
    write_shards(id_cache, [2])
    first = id_cache.list_shards()[0]
    before = _digest(first.path)
    with id_cache.snapshot():
        os.unlink(os.path.join(id_cache.path, "state.json"))
        write_shards(id_cache, [2], first_id=100)
        assert _digest(first.path) == before
        assert [s.seq for s in id_cache.list_shards()] == [first.seq, first.seq + 1]


def test_stale_temporary_of_a_killed_writer_is_removed_on_open(id_cache):
    child = _child(
        f"""
        import time, growcache, numpy as np
        cache = growcache.Cache({id_cache.path!r})
        writer = cache.writer()
        writer.write({{"id": np.int64(1), "x": np.zeros((4, 8), np.float32)}})
        writer._flush()
        print(writer.path, flush=True)
        time.sleep(60)
        """
    )
    tmp = child.stdout.readline().strip()
    assert os.path.exists(tmp)
    Cache(id_cache.path)  # the writer is alive: its temporary stays
    assert os.path.exists(tmp)
    child.send_signal(signal.SIGKILL)
    child.wait()
    Cache(id_cache.path)
    assert not os.path.exists(tmp)
    assert id_cache.list_shards() == []


def test_metadata_temporaries_of_a_killed_process_are_removed_on_open(id_cache):
    # A process killed inside atomic_write_bytes leaves "<file>.<uuid hex>.tmp" behind.
    leftovers = [os.path.join(id_cache.path, "state.json." + "a" * 32 + ".tmp"),
                 os.path.join(id_cache.path, "leases", "123-" + "b" * 32 + ".json." + "c" * 32 + ".tmp")]
    for path in leftovers:
        with open(path, "w") as f:
            f.write("{")
    mine = os.path.join(id_cache.path, "notes.tmp")  # not a name growcache writes: left alone
    open(mine, "w").close()
    Cache(id_cache.path)
    assert not any(os.path.exists(p) for p in leftovers) and os.path.exists(mine)


def test_verify_reports_flip_and_truncation_and_touches_nothing_else(id_cache):
    write_shards(id_cache, [5, 5, 5, 5])
    shards = id_cache.list_shards()
    frame = shards[0].nbytes // 5
    with open(shards[1].path, "r+b") as f:
        f.seek(frame * 3 + 50)
        f.write(b"\x00\xff")
    os.truncate(shards[2].path, frame * 4 + 7)
    good = {s.path: _digest(s.path) for s in (shards[0], shards[3])}
    report = id_cache.verify()
    assert not report.ok and report.shards == 4
    found = {c.path: c.offset for c in report.corrupt}
    assert found == {shards[1].path: frame * 3, shards[2].path: frame * 4}
    with id_cache.snapshot():
        removed = id_cache.verify(remove_corrupt=True).removed
    assert removed == []  # leased shards are never deleted
    assert sorted(id_cache.verify(remove_corrupt=True).removed) == sorted(found)
    assert {s.path: _digest(s.path) for s in id_cache.list_shards()} == good
    assert id_cache.verify().ok


def test_verify_lists_foreign_files(id_cache):
    write_shards(id_cache, [2])
    junk = os.path.join(id_cache.shards_dir, "random.bin")
    with open(junk, "wb") as f:
        f.write(os.urandom(100))
    report = id_cache.verify()
    assert report.ok and report.foreign == [junk] and len(id_cache.list_shards()) == 1


def test_verify_remove_corrupt_counts_the_bytes_on_disk_not_the_names(id_cache):
    write_shards(id_cache, [5])
    cut = id_cache.list_shards()[0]
    os.truncate(cut.path, 10)
    liar = os.path.join(id_cache.shards_dir, f"{cut.seq + 1:012d}-1r-999999999999999999b.tfrecord")
    with open(liar, "wb") as f:
        f.write(b"junk" * 4)
    before = id_cache.stats()
    report = id_cache.verify(remove_corrupt=True)
    assert sorted(report.removed) == sorted([cut.path, liar])
    after = id_cache.stats()
    assert (after.evicted - before.evicted, after.evicted_bytes - before.evicted_bytes) == (2, 10 + 16)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_verify_never_follows_or_waits_on_a_shard_swapped_after_the_listing(id_cache, tmp_path, monkeypatch, kind):
    import growcache.cache

    write_shards(id_cache, [5])
    shard = id_cache.list_shards()[0]
    outside = str(tmp_path / "outside.tfrecord")
    os.rename(shard.path, outside)  # a valid shard: followed, it would verify as fine
    with open(shard.path, "wb") as f, open(outside, "rb") as g:
        f.write(g.read())
    listed = growcache.cache.scan_shards

    def listing_then_swap(path):  # the race with whoever may write shards/, made certain
        listing = listed(path)
        os.unlink(shard.path)
        {"symlink": lambda: os.symlink(outside, shard.path), "fifo": lambda: os.mkfifo(shard.path),
         "directory": lambda: os.mkdir(shard.path)}[kind]()
        return listing

    monkeypatch.setattr(growcache.cache, "scan_shards", listing_then_swap)
    descriptors = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    reports = []
    verifying = threading.Thread(target=lambda: reports.append(id_cache.verify()), daemon=True)
    verifying.start()
    verifying.join(10)
    if verifying.is_alive():  # blocked opening the FIFO: a writer end lets it go
        os.close(os.open(shard.path, os.O_WRONLY | os.O_NONBLOCK))
        verifying.join(10)
        pytest.fail("verify waited for a writer of a FIFO swapped in for a shard")
    report, = reports
    if kind == "directory":
        assert len(os.listdir(f"/proc/{os.getpid()}/fd")) == descriptors, "a descriptor was left open"
    assert report.irregular == [shard.path] and not report.ok
    assert report.shards == 0 and report.corrupt == []
    assert os.path.lexists(shard.path) and os.path.exists(outside)


def test_add_shard_checks_crc_and_schema_and_publishes(id_cache, tmp_path):
    other = Cache(tmp_path / "other", schema=ID_SCHEMA)
    ids = write_shards(other, [6])
    source = other.list_shards()[0].path
    info = id_cache.add_shard(source)
    assert info.records == 6 and os.path.exists(source)
    from growcache.example import ExampleCodec

    codec = ExampleCodec(ID_SCHEMA)
    assert [int(codec.decode(r)["id"]) for _, r in iter_records(info.path)] == ids

    wrong = Cache(tmp_path / "wrong", schema={"id": ("int64", ())})
    write_shards_wrong = wrong.writer()
    write_shards_wrong.write({"id": np.int64(3)})
    wrong_path = write_shards_wrong.close().path
    with pytest.raises(SchemaError, match="byte offset 0"):
        id_cache.add_shard(wrong_path)

    broken = tmp_path / "broken.tfrecord"
    broken.write_bytes(open(source, "rb").read()[:-3])
    with pytest.raises(CorruptShardError) as info_err:
        id_cache.add_shard(broken)
    assert info_err.value.path == str(broken)
    assert len(id_cache.list_shards()) == 1
    assert [n for n in os.listdir(id_cache.shards_dir) if n.startswith(".tmp")] == []


def test_add_shard_with_move_keeps_a_refused_file_where_it_was(id_cache, tmp_path):
    other = Cache(tmp_path / "other", schema={"id": ("int64", ())})
    with other.writer() as writer:
        writer.write({"id": np.int64(3)})
    wrong_schema = str(tmp_path / "wrong.tfrecord")
    os.replace(other.list_shards()[0].path, wrong_schema)
    before = _digest(wrong_schema)
    with pytest.raises(SchemaError):
        id_cache.add_shard(wrong_schema, move=True)
    assert os.path.exists(wrong_schema) and _digest(wrong_schema) == before

    good = Cache(tmp_path / "good", schema=ID_SCHEMA)
    write_shards(good, [4])
    truncated = str(tmp_path / "truncated.tfrecord")
    with open(truncated, "wb") as f:
        f.write(open(good.list_shards()[0].path, "rb").read()[:-3])
    with pytest.raises(CorruptShardError):
        id_cache.add_shard(truncated, move=True)
    assert os.path.getsize(truncated) > 0
    assert id_cache.list_shards() == [] and [n for n in os.listdir(id_cache.shards_dir) if n.startswith(".tmp")] == []

    source = good.list_shards()[0].path
    info = id_cache.add_shard(source, move=True)
    assert info.records == 4 and not os.path.exists(source)


def test_add_shard_with_move_killed_before_publishing_loses_nothing(id_cache, tmp_path):
    # The file was renamed into the cache before its check; a process killed there left a dead
    # writer's temporary, which the next open removed: the user's only copy was gone.
    good = Cache(tmp_path / "good", schema=ID_SCHEMA)
    write_shards(good, [4])
    source = str(tmp_path / "mine.tfrecord")
    os.replace(good.list_shards()[0].path, source)
    before = _digest(source)
    code = f"from growcache import Cache; Cache({id_cache.path!r}).add_shard({source!r}, move=True)"
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, GROWCACHE_FAULT="add_shard:taken"),
                          timeout=60)
    assert done.returncode == -signal.SIGKILL
    reopened = Cache(id_cache.path)  # removes the dead writer's temporaries
    assert os.path.exists(source) and _digest(source) == before, "the user's file is still there, whole"
    assert reopened.list_shards() == [] and [n for n in os.listdir(id_cache.shards_dir) if n.startswith(".tmp")] == []
    info = reopened.add_shard(source, move=True)
    assert info.records == 4 and not os.path.exists(source) and os.stat(info.path).st_nlink == 1


def test_a_capacity_lowered_below_a_pending_shard_fails_its_publish_at_once(tmp_path):
    # The budget of another process's Cache(path, capacity=...) is taken up at publish: a shard
    # larger than it waited for room no lease could make ("full of leased shards", none leased).
    cache = Cache(tmp_path / "c", capacity=_shard_bytes(50), schema=ID_SCHEMA)
    writer = cache.writer(publish_timeout=60)
    for i in range(20):
        writer.write(id_sample(i))
    Cache(cache.path, capacity=_shard_bytes(5))
    began = time.monotonic()
    with pytest.raises(CacheFullError, match="more than the cache's whole capacity"):
        writer.close()
    assert time.monotonic() - began < 10 and cache.list_shards() == []


def test_add_shard_larger_than_the_capacity_names_the_file_and_keeps_it(tmp_path):
    source_cache = Cache(tmp_path / "src", schema=ID_SCHEMA)
    write_shards(source_cache, [10])
    source = source_cache.list_shards()[0].path
    small = Cache(tmp_path / "small", capacity=_shard_bytes(3), schema=ID_SCHEMA)
    with pytest.raises(CacheFullError, match="more than the whole capacity") as err:
        small.add_shard(source, move=True)
    assert source in str(err.value) and os.path.exists(source)
    assert small.list_shards() == []


def test_new_cache_is_owner_only(tmp_path):
    cache = Cache(tmp_path / "c", schema=ID_SCHEMA)
    write_shards(cache, [1])
    for path in [cache.path, cache.shards_dir, cache.list_shards()[0].path,
                 os.path.join(cache.path, "growcache.json"), os.path.join(cache.path, "state.json")]:
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, path


def test_prune_to_size(id_cache):
    write_shards(id_cache, [10] * 4)
    removed = id_cache.prune(to=_shard_bytes(10) * 2 + 1)
    assert [s.seq for s in removed] == [1, 2]
    assert id_cache.prune(to=0) and id_cache.list_shards() == []


def _shard(seq, nbytes=10):
    return ShardInfo(seq, f"/c/{seq}", 1, nbytes)


def test_fifo_policy_is_pure_and_skips_leases():
    shards = [_shard(s) for s in (3, 1, 2, 4)]
    assert choose_evictions_fifo(shards, set(), 40) == []
    assert [s.seq for s in choose_evictions_fifo(shards, set(), 30, incoming=5)] == [1, 2]
    assert [s.seq for s in choose_evictions_fifo(shards, {1}, 30, incoming=5)] == [2, 3]
    assert choose_evictions_fifo(shards, {1, 2, 3, 4}, 30, incoming=15) is None
    assert choose_evictions_fifo(shards, {2, 3, 4}, 25, incoming=10) is None


def test_a_publish_its_hook_refuses_is_not_counted_as_published(id_cache):
    # A shard source's commit hook refuses a shard whose claim was taken over (ClaimLostError):
    # only an OSError took the count back, so stats() reported a shard that never appeared.
    import shutil

    from growcache.shard_source import ClaimLostError

    write_shards(id_cache, [3])
    shard = id_cache.list_shards()[0]
    temporary = os.path.join(id_cache.shards_dir, ".tmp-refused.tfrecord")
    shutil.copy(shard.path, temporary)
    before = id_cache.stats()

    def refuse(info):
        raise ClaimLostError("taken over by another machine")

    with pytest.raises(ClaimLostError):
        id_cache._publish(temporary, shard.records, shard.nbytes, before_publish=refuse)
    after = id_cache.stats()
    assert (after.shards, after.published, after.published_bytes) == (before.shards, before.published,
                                                                       before.published_bytes)
    os.unlink(temporary)
