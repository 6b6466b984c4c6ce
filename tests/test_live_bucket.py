"""TFRecordShardSource on a live bucket and an untrusted state file (issue 29).

Files come and go while passes run; the state under ``sources/`` may be tampered with;
claims of other machines live by their heartbeat. The fetch protocol is driven the way a
sampler worker drives it (tests/test_shard_source.py's helpers); two tests run real
processes as two machines (``GROWCACHE_NODE``), one a real SamplerPool.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from stores import gcs, gcs_server, s3, s3_server  # noqa: F401
from test_shard_source import SCHEMA, fetch_once, make_remote, state_of
from tfrecords import framed, labelled

from growcache import Cache, CacheFormatError, CorruptShardError, SamplerPool, TFRecordShardSource
from growcache.records import iter_records
from growcache import shard_source
from growcache.shard_source import pass_progress


def _records(cache: Cache) -> list[bytes]:
    return [bytes(r) for s in cache.list_shards() for _, r in iter_records(s.path)]


def _plant(cache: Cache, source: TFRecordShardSource, **changes) -> None:
    state = state_of(cache, source)
    state.update(changes)
    with open(os.path.join(cache.path, "sources", f"{source.key}.json"), "w") as f:
        json.dump(state, f)


def _drain(source: TFRecordShardSource, cache: Cache, limit: int = 50) -> list:
    """Fetch until the pass has nothing more to give (a shard passed over gives nothing either);
    return what was published."""
    published = []
    for _ in range(limit):
        got = fetch_once(source, cache)
        published += got
        state = state_of(cache, source)
        if not got and set(state["order"]) <= set(state["done"]):
            return published
    raise AssertionError("the source never ran dry")


# -- state under sources/ is untrusted -----------------------------------------------------------
def test_a_tampered_pass_order_never_fetches_a_file_outside_the_glob(tmp_path, caplog):
    remote = make_remote(tmp_path / "remote", 2)
    outside = tmp_path / "remote" / "secret"
    outside.write_bytes(framed([labelled(99, i) for i in range(3)]))  # valid records, not in the glob
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "train-*"))
    fetch_once(source, cache)
    state = state_of(cache, source)
    _plant(cache, source, order=[str(outside), *state["order"]], done=state["done"])
    with caplog.at_level("WARNING", logger="growcache"):
        _drain(source, cache)
    assert sorted(_records(cache)) == sorted(r for records in remote.values() for r in records)
    assert "secret is not in the store's listing" in caplog.text


def _one_of_two_fetched(tmp_path) -> tuple[dict, Cache, TFRecordShardSource, str]:
    """A pass over two remote files with one fetched: ``(remote, cache, source, the other's path)``."""
    remote = make_remote(tmp_path / "remote", 2)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    fetch_once(source, cache)
    state = state_of(cache, source)
    (rest,) = [p for p in state["order"] if p not in state["done"]]
    return remote, cache, source, rest


@pytest.mark.parametrize("claim", [
    {"time": None, "host": "another-machine"},  # pinned the shard forever
    {"time": "yesterday", "host": "another-machine"},  # a raw TypeError ended the pool
    {"time": 1e18, "host": "another-machine"},  # a time to come
    {"pid": "1"},
    {"pid": 1, "start_time": None, "time": 0},  # pid 1 lives forever; its heartbeat is decades old
])
def test_a_damaged_claim_counts_as_expired_with_a_warning(tmp_path, caplog, claim):
    remote, cache, source, rest = _one_of_two_fetched(tmp_path)
    planted = {"pid": os.getpid(), "start_time": None, "host": None, "time": time.time(), "worker": 0}
    _plant(cache, source, claims={rest: {**planted, **claim}})
    with caplog.at_level("INFO", logger="growcache"):
        assert len(fetch_once(source, cache)) == 1  # the planted claim does not hold the shard
    assert "counts as expired" in caplog.text or "no heartbeat for longer than the owner expiry" in caplog.text
    assert sorted(_records(cache)) == sorted(r for records in remote.values() for r in records)


@pytest.mark.parametrize("when", [-7200, 10**6])  # two hours ago; a time to come never aged
def test_a_planted_corrupt_mark_pins_a_good_shard_for_an_hour_at_most(tmp_path, monkeypatch, when):
    remote = make_remote(tmp_path / "remote", 1)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    fetch_once(source, cache)
    cache.evict(to=0)
    ((path, held),) = state_of(cache, source)["held"].items()
    _plant(cache, source, bad={path: {"version": held["version"], "why": "planted", "time": time.time() + when}})
    monkeypatch.setattr(shard_source, "_RELIST_S", 0.0)
    assert len(fetch_once(source, cache)) == 1
    assert _records(cache) == remote["train-00000-of-00001"]


def test_a_held_shard_missing_from_done_is_taken_as_fetched_not_claimed_again(tmp_path):
    # An order naming a shard whose every record is held, not in done (tampered, or a done list
    # not saved): it was claimed with nothing to fetch, and fetch() raised a raw TypeError.
    remote = make_remote(tmp_path / "remote", 2)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    _drain(source, cache)
    state = state_of(cache, source)
    _plant(cache, source, done=state["done"][:1])
    assert fetch_once(source, cache) == []
    assert sorted(state_of(cache, source)["done"]) == sorted(state["order"])
    assert sorted(_records(cache)) == sorted(r for records in remote.values() for r in records)


def test_a_history_entry_without_its_fetched_list_is_damage_not_a_failing_publish(tmp_path, caplog):
    remote = make_remote(tmp_path / "remote", 2)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    fetch_once(source, cache)
    state = state_of(cache, source)
    _plant(cache, source, history=[{key: value for key, value in entry.items() if key != "fetched"}
                                   for entry in state["history"]])
    with caplog.at_level("WARNING", logger="growcache"):
        _drain(source, cache)  # a KeyError in the publish hook failed every finishing publish
    assert "starts afresh" in caplog.text
    assert set(_records(cache)) == {r for records in remote.values() for r in records}


def test_a_linked_sources_directory_is_refused(tmp_path):
    make_remote(tmp_path / "remote", 1)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    os.makedirs(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(cache.path, "sources"))
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    with pytest.raises(CacheFormatError, match="sources is a symbolic link"):
        fetch_once(source, cache)
    assert os.listdir(tmp_path / "elsewhere") == []


# -- a live bucket ---------------------------------------------------------------------------------
@pytest.mark.parametrize("store_name", ["local", "s3", "gcs"])
def test_a_listing_and_a_metadata_request_give_one_version(request, tmp_path, store_name):
    # Else every shard would look rewritten the moment it is fetched, and never be fetched.
    if store_name == "local":
        make_remote(tmp_path / "remote", 2)
        source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    else:
        store = request.getfixturevalue(store_name)
        for name in ("train-0", "train-1"):
            store.put(f"data/{name}", framed([labelled(0, 0)]))
        source = TFRecordShardSource(f"{store.url}/data/train-*", storage_options=store.storage_options)
    listing = source._list_versions()
    assert len(listing) == 2 and all(source._version_now(path) == version for path, version in listing.items())
    first = sorted(listing)[0]
    source.fs.pipe_file(first, framed([labelled(1, 0)]))  # rewritten, the same size
    assert source._version_now(first) != listing[first]


def test_a_shard_deleted_during_a_pass_is_passed_over_and_counted(tmp_path, caplog, monkeypatch):
    remote = make_remote(tmp_path / "remote", 4)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    fetch_once(source, cache)
    state = state_of(cache, source)
    gone = os.path.basename([p for p in state["order"] if p not in state["done"]][0])
    os.unlink(tmp_path / "remote" / gone)
    with caplog.at_level("WARNING", logger="growcache"):
        _drain(source, cache)
    assert caplog.text.count(f"{gone} was deleted before it was fetched") == 1
    progress, = pass_progress(cache)
    assert (progress.fetched, progress.vanished, progress.total) == (3, 1, 4)
    expected = [r for name, records in remote.items() if name != gone for r in records]
    assert sorted(_records(cache)) == sorted(expected)
    make_remote(tmp_path / "new", 1)
    os.replace(tmp_path / "new" / "train-00000-of-00001", tmp_path / "remote" / "added")
    monkeypatch.setattr(shard_source, "_RELIST_S", 0.0)  # a source with nothing to do lists the store this often
    assert len(fetch_once(source, cache)) == 1  # pass 2 lists the store again: the added file
    assert pass_progress(cache)[0].pass_number == 2


def test_a_shard_rewritten_between_passes_is_fetched_whole_never_from_stale_offsets(tmp_path, caplog):
    make_remote(tmp_path / "remote", 1)
    path = tmp_path / "remote" / "train-00000-of-00001"
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"), max_shard_records=3)
    assert [s.records for s in fetch_once(source, cache)] == [3, 3, 3, 1]
    cache.evict(to=cache.stats().bytes - cache.list_shards()[0].nbytes)  # the first piece goes
    new = [labelled(50 + i % 2, i) for i in range(10)]  # the same size, other records
    path.write_bytes(framed(new))
    with caplog.at_level("WARNING", logger="growcache"):
        published = fetch_once(source, cache)
    assert [s.records for s in published] == [3, 3, 3, 1], "the new version is fetched whole"
    assert [bytes(r) for s in published for _, r in iter_records(s.path)] == new
    assert "changed since it was fetched" in caplog.text
    assert pass_progress(cache)[0].changed == 1


def test_a_corrupt_remote_shard_is_passed_over_once_until_it_changes(tmp_path, caplog):
    remote = make_remote(tmp_path / "remote", 3)
    bad = tmp_path / "remote" / "train-00001-of-00003"
    blob = bytearray(bad.read_bytes())
    blob[40] ^= 0xFF
    bad.write_bytes(blob)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    with caplog.at_level("WARNING", logger="growcache"):
        _drain(source, cache)
        cache.evict(to=0)
        _drain(source, cache)  # pass 2: the corrupt file is not tried again
    assert caplog.text.count("train-00001-of-00003 is corrupt or off the cache's schema") == 1
    assert "data CRC32C mismatch" in caplog.text
    assert pass_progress(cache)[0].corrupt == 1 and pass_progress(cache)[0].pass_number == 2
    bad.write_bytes(framed(remote["train-00001-of-00003"]))  # repaired: fetched in the next pass
    cache.evict(to=0)
    published = _drain(source, cache)
    assert len(published) == 3 and pass_progress(cache)[0].corrupt == 0


def test_a_pool_rides_over_deleted_and_corrupt_shards(tmp_path):
    remote = make_remote(tmp_path / "remote", 6, records=4)
    (tmp_path / "remote" / "train-00002-of-00006").write_bytes(b"not a tfrecord file" * 8)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    with SamplerPool(cache, source, workers=2, seed=0) as pool:
        os.unlink(tmp_path / "remote" / "train-00004-of-00006")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            progress = pass_progress(cache)
            if progress and progress[0].total and progress[0].fetched + progress[0].vanished + progress[0].corrupt \
                    == progress[0].total:
                break
            time.sleep(0.1)
        pool.wait_for(records=4 * 4, timeout=30)  # raises if a worker failed
    progress, = pass_progress(cache)
    assert progress.corrupt == 1 and progress.fetched + progress.vanished + 1 == progress.total
    expected = {r for name, records in remote.items() if name not in ("train-00002-of-00006",) for r in records}
    got = _records(cache)
    assert len(got) == len(set(got)) and set(got) <= expected and len(got) >= 4 * 4


# -- claims: a heartbeat, and a check before publishing ---------------------------------------------
_MACHINE = """
import contextlib, os, sys, time
from growcache import Cache, TFRecordShardSource
from growcache.shard_source import FetchJob

class Slow(TFRecordShardSource):
    def chunks(self, path, start=0, size=None):
        for chunk in super().chunks(path, start, size):
            print("READING", flush=True)
            time.sleep({delay})
            yield chunk

cache = Cache({cache!r})
source = Slow({url!r}, chunk_bytes=512)
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline:
    with contextlib.closing(source.fetch(FetchJob(cache, 0, 0, lambda: False))) as shards:
        for shard in shards:
            try:
                cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit)
                print("PUBLISHED", shard.records, flush=True)
            except Exception as exc:
                os.unlink(shard.path)
                print("REFUSED", type(exc).__name__, flush=True)
    time.sleep(0.05)
print("END", flush=True)
"""


EXPIRY = 2.0  # seconds; heartbeats every third of a second


def _machine(name: str, cache: Cache, url: str, *, delay: float, seconds: float) -> subprocess.Popen:
    code = _MACHINE.format(delay=delay, cache=cache.path, url=url, seconds=seconds)
    env = dict(os.environ, GROWCACHE_NODE=name, GROWCACHE_OWNER_EXPIRY=str(EXPIRY))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _remote_for_claims(tmp_path) -> tuple[Cache, str, list[bytes]]:
    remote = make_remote(tmp_path / "remote", 1, records=40)
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    return cache, str(tmp_path / "remote" / "*"), remote["train-00000-of-00001"]


def test_a_copy_that_outlasts_the_claim_expiry_keeps_its_claim_by_heartbeat(tmp_path):
    cache, url, records = _remote_for_claims(tmp_path)
    a = _machine("machine-a", cache, url, delay=0.7, seconds=0.1)  # ~6 s of copying: 3 expiries
    assert a.stdout.readline().strip() == "READING"
    b = _machine("machine-b", cache, url, delay=0.0, seconds=5.0)
    out_b, err_b = b.communicate(timeout=60)
    out_a, err_a = a.communicate(timeout=60)
    assert "PUBLISHED 40" in out_a, err_a
    assert "PUBLISHED" not in out_b, "machine b fetched a shard machine a was still copying"
    assert sorted(_records(cache)) == sorted(records)


def test_a_copy_whose_claim_was_taken_over_publishes_nothing(tmp_path):
    cache, url, records = _remote_for_claims(tmp_path)
    a = _machine("machine-a", cache, url, delay=0.2, seconds=0.1)
    assert a.stdout.readline().strip() == "READING"
    os.kill(a.pid, signal.SIGSTOP)  # frozen past the expiry: its heartbeat stops
    try:
        time.sleep(EXPIRY + 1.0)
        b = _machine("machine-b", cache, url, delay=0.0, seconds=2.0)
        out_b, err_b = b.communicate(timeout=60)
        assert "PUBLISHED 40" in out_b, err_b
    finally:
        os.kill(a.pid, signal.SIGCONT)
    out_a, err_a = a.communicate(timeout=60)
    assert "PUBLISHED" not in out_a and ("REFUSED ClaimLostError" in out_a or "taken over" in err_a), (out_a, err_a)
    assert sorted(_records(cache)) == sorted(records), "each record once"


def test_a_probe_passes_over_one_bad_first_shard(tmp_path, caplog):
    make_remote(tmp_path / "remote", 2)
    (tmp_path / "remote" / "train-00000-of-00002").write_bytes(b"damaged" * 20)  # the first in the listing
    source = TFRecordShardSource(str(tmp_path / "remote" / "*"))
    with caplog.at_level("WARNING", logger="growcache"):
        assert source.probe() == SCHEMA and source.probe(SCHEMA) == SCHEMA
    assert "train-00000-of-00002 cannot be read" in caplog.text
    (tmp_path / "remote" / "train-00001-of-00002").write_bytes(b"damaged" * 20)
    with pytest.raises(CorruptShardError, match="train-00000-of-00002"):
        source.probe(SCHEMA)  # every shard bad: the first one's error


def test_a_claim_is_judged_by_the_expiry_its_owner_stored_not_by_this_jobs_setting(tmp_path, monkeypatch):
    # Liveness from evidence in the file (issue 28): a job with a short GROWCACHE_OWNER_EXPIRY
    # took over the claims of another machine's job that beats for longer, and both copied.
    remote, cache, source, rest = _one_of_two_fetched(tmp_path)
    monkeypatch.setenv("GROWCACHE_OWNER_EXPIRY", "5")  # this job judges owners quickly
    beat = {"pid": 4242, "start_time": None, "host": "another-machine", "time": time.time() - 60, "worker": 0,
            "token": "theirs"}
    _plant(cache, source, claims={rest: {**beat, "expiry": 3600}})  # its owner beats for an hour: alive
    assert fetch_once(source, cache) == []
    assert rest in state_of(cache, source)["claims"]
    _plant(cache, source, claims={rest: beat})  # older growcache stored no expiry: this job's own 5 s
    assert len(fetch_once(source, cache)) == 1
