"""Store sources on a live bucket: ``relist_every`` lists the globs again in the background, so
objects added while a pool runs are drawn, objects gone are not, and a changed object is read
afresh. Without it, a process lists once (the listing a seed's records are drawn from)."""

from __future__ import annotations

import io
import logging
import time

import numpy as np
import pytest
from stores import s3, s3_server  # noqa: F401

from growcache import Cache, SamplerPool, Schema
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.sources import NpyWindowSource, ObjectSource, RetryPolicy

FAST = RetryPolicy(attempts=2, initial_delay=0.01, max_delay=0.05)


def _npy(value: int, rows: int = 4, dtype: str = "int64") -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.full((rows, 2), value, dtype=dtype))
    return buf.getvalue()


def _wait_for(check, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _values(source, draws: int = 200) -> set[int]:
    rng = np.random.default_rng(0)
    return {int(source(rng)["x"].flat[0]) for _ in range(draws)}


def test_without_relist_every_a_process_keeps_its_first_listing(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.npy").write_bytes(_npy(i))
    source = ObjectSource(f"file://{tmp_path}/*.npy")
    first = source.paths()
    (tmp_path / "3.npy").write_bytes(_npy(3))
    time.sleep(0.3)
    assert source.paths() == first and _values(source) == {0, 1, 2}


def test_objects_added_and_deleted_are_drawn_and_passed_over_after_the_next_listing(tmp_path, caplog):
    for i in range(3):
        (tmp_path / f"{i}.npy").write_bytes(_npy(i))
    source = ObjectSource(f"file://{tmp_path}/*.npy", relist_every=0.1)
    assert len(source.paths()) == 3 and _values(source) == {0, 1, 2}
    (tmp_path / "3.npy").write_bytes(_npy(3))
    (tmp_path / "0.npy").unlink()
    caplog.set_level(logging.INFO, logger="growcache.store")
    _wait_for(lambda: len(source.paths()) == 3 and source.paths()[-1].endswith("3.npy"), "the new listing")
    # Deleted: never drawn again (no 404 to ride over); added: drawn.
    assert _values(source) == {1, 2, 3}
    assert "(1 new, 1 gone, 0 changed)" in caplog.text


def test_a_changed_npy_file_has_its_header_read_again(tmp_path):
    # A rewrite with another dtype and more rows: the cached header would read the new bytes
    # as the old dtype and never reach the new rows.
    (tmp_path / "a.npy").write_bytes(_npy(5, rows=4, dtype="int64"))
    source = NpyWindowSource(f"file://{tmp_path}/*.npy", window=2, relist_every=0.1)
    rng = np.random.default_rng(0)
    first = source(rng)["x"]
    assert first.dtype == np.int64 and (first == 5).all()
    new = _npy(7, rows=64, dtype="int16")
    (tmp_path / "a.npy").write_bytes(new)
    _wait_for(lambda: source._sizes.get(source.paths()[0]) == len(new), "the new listing")
    window = source(rng)["x"]
    assert window.dtype == np.int16 and (window == 7).all()


def test_a_failing_relisting_keeps_the_last_listing_and_is_tried_again(s3_server, s3, caplog):
    for i in range(2):
        s3.put(f"data/{i}.npy", _npy(i))
    source = ObjectSource(f"{s3.url}/data/*.npy", storage_options=s3.storage_options, retry=FAST,
                          relist_every=0.1)
    assert len(source.paths()) == 2
    s3_server.fail_listings["data/"] = [403, "AccessDenied", 10 ** 6]
    s3.put("data/2.npy", _npy(2))
    caplog.set_level(logging.WARNING, logger="growcache.store")
    _wait_for(lambda: source.paths() and "a new listing (relist_every=0.1 s) failed" in caplog.text, "the failed listing")
    assert "AccessDenied" in caplog.text and "samples are still drawn from the last listing (2 objects)" in caplog.text
    assert _values(source, 50) <= {0, 1} and len(source.paths()) == 2
    # The store lists again once the fault is over: the added object is drawn.
    s3_server.fail_listings["data/"][2] = 0
    _wait_for(lambda: len(source.paths()) == 3, "a listing after the fault")
    assert _values(source) == {0, 1, 2}


def test_a_listing_that_matches_nothing_keeps_the_last_one(tmp_path, caplog):
    (tmp_path / "0.npy").write_bytes(_npy(0))
    source = ObjectSource(f"file://{tmp_path}/*.npy", relist_every=0.1)
    assert len(source.paths()) == 1
    (tmp_path / "0.npy").rename(tmp_path / "0.tmp")  # a dataset being replaced
    caplog.set_level(logging.WARNING, logger="growcache.store")
    _wait_for(lambda: source.paths() and "matched no objects" in caplog.text, "the empty listing")
    assert len(source.paths()) == 1


@pytest.mark.parametrize("value", [0, -1, "10", True, float("nan"), float("inf"), np.float64("nan"), np.bool_(True)])
def test_relist_every_must_be_a_positive_number(tmp_path, value):
    with pytest.raises(ValueError, match="relist_every must be a positive number of seconds"):
        ObjectSource(f"file://{tmp_path}/*.npy", relist_every=value)


@pytest.mark.parametrize("value", [np.int64(5), np.float32(0.5), 2])
def test_relist_every_takes_any_real_number(tmp_path, value):
    assert ObjectSource(f"file://{tmp_path}/*.npy", relist_every=value).relist_every == float(value)


def test_a_running_pool_samples_objects_added_to_the_bucket(s3_server, s3, tmp_path):
    """The user's case: a bucket that grows while the samplers run (a simulation writing its output)."""
    s3.put("data/0.npy", _npy(0, rows=1))
    schema = Schema({"x": ("int64", (1, 2))})
    cache = Cache(tmp_path / "cache", capacity="64MB", schema=schema)
    codec = ExampleCodec(cache.schema)

    def seen() -> set[int]:
        return {int(codec.decode(r)["x"].flat[0]) for s in cache.list_shards() for _, r in iter_records(s.path)}

    source = ObjectSource(f"{s3.url}/data/*.npy", storage_options=s3.storage_options, retry=FAST, relist_every=0.2)
    with SamplerPool(cache, source, workers=1, concurrency=4, shard_size="2KB", max_shard_age=0.2, seed=3) as pool:
        _wait_for(lambda: seen() == {0}, "records of the first object")
        s3.put("data/1.npy", _npy(1, rows=1))
        _wait_for(lambda: 1 in seen(), "records of the object added while the pool ran", timeout=60)
        assert pool.stats().records_written > 0


# -- review of relist_every (each test but the missing named path's failed before its fix) --------
def test_a_relisting_during_a_listing_outage_gives_up_after_its_tries_instead_of_riding_it_out(s3_server, s3, caplog):
    """The store answered (outage_budget applies to samples), then only listings fail (S3 throttles
    LIST apart from GET): the background listing must give up after the policy's tries and be tried
    again in relist_every s, not ride out a 600 s outage (no new objects for 10 minutes, an outage
    WARNING while every sample works, then 'the store has not answered for 600 s')."""
    for i in range(2):
        s3.put(f"data/{i}.npy", _npy(i))
    source = ObjectSource(f"{s3.url}/data/*.npy", storage_options=s3.storage_options, retry=FAST,
                          relist_every=0.1)
    assert len(source.paths()) == 2 and source.retry.outage_budget >= 600
    s3_server.fail_listings["data/"] = [503, "SlowDown", 10 ** 6]
    caplog.set_level(logging.WARNING, logger="growcache.store")
    _wait_for(lambda: source.paths() and "a new listing (relist_every=0.1 s) failed" in caplog.text,
              "the failed listing", timeout=10)
    assert "riding the outage out" not in caplog.text and "SlowDown" in caplog.text
    assert _values(source, 50) == {0, 1}
    s3.put("data/2.npy", _npy(2))
    s3_server.fail_listings["data/"][2] = 0
    _wait_for(lambda: len(source.paths()) == 3, "a listing after the throttling", timeout=10)


def test_a_persistently_failing_relisting_warns_once_and_says_when_it_works_again(s3_server, s3, caplog):
    """One WARNING per run of failed listings (not one every relist_every s in every sampler process),
    and one when a listing works again."""
    s3.put("data/0.npy", _npy(0))
    source = ObjectSource(f"{s3.url}/data/*.npy", storage_options=s3.storage_options, retry=FAST,
                          relist_every=0.05)
    assert len(source.paths()) == 1
    s3_server.fail_listings["data/"] = [403, "AccessDenied", 10 ** 6]
    caplog.set_level(logging.WARNING, logger="growcache.store")
    for _ in range(10):  # several periods of failed listings
        source.paths()
        time.sleep(0.1)
    failed = [r for r in caplog.records if "a new listing" in r.getMessage()]
    assert len(failed) == 1, [r.getMessage() for r in failed]
    s3_server.fail_listings["data/"][2] = 0
    _wait_for(lambda: source.paths() and "works again" in caplog.text, "the listing working again")


def test_a_header_read_in_flight_while_a_relisting_drops_it_is_not_cached(tmp_path):
    """A header read that began before the file was rewritten, and came back after the relisting
    dropped the file's header, must not cache the old header for good (the new rows never drawn,
    the new dtype read as the old)."""
    (tmp_path / "a.npy").write_bytes(_npy(5, rows=4, dtype="int64"))
    source = NpyWindowSource(f"file://{tmp_path}/*.npy", window=2, relist_every=3600)
    path = source.paths()[0]
    fetch = source._fetch

    def racing(p, start=None, end=None):
        data = fetch(p, start, end)
        if start == 0 and not racing.done:  # the old header is read; the file is rewritten and relisted
            racing.done = True
            time.sleep(0.02)  # a new mtime
            (tmp_path / "a.npy").write_bytes(_npy(7, rows=64, dtype="int16"))
            source._relist()
        return data

    racing.done = False
    source._fetch = racing
    rng = np.random.default_rng(0)
    assert source.header(path).dtype == np.int64  # the old header, read across the relisting
    assert racing.done
    window = source(rng)["x"]
    assert window.dtype == np.int16 and (window == 7).all()


def test_a_named_npy_file_rewritten_is_read_under_its_new_header_with_relist_every(tmp_path):
    """relist_every on a URL without a glob: its object's version is asked at each listing, so a
    rewritten file has its header read again (docs: 'an object whose size or version changed has
    what was cached of it dropped')."""
    (tmp_path / "a.npy").write_bytes(_npy(5, rows=4, dtype="int64"))
    source = NpyWindowSource(f"file://{tmp_path}/a.npy", window=2, relist_every=0.1)
    rng = np.random.default_rng(0)
    assert source(rng)["x"].dtype == np.int64
    time.sleep(0.02)
    (tmp_path / "a.npy").write_bytes(_npy(7, rows=64, dtype="int16"))
    _wait_for(lambda: source(rng)["x"].dtype == np.int16, "the new header", timeout=5)
    window = source(rng)["x"]
    assert (window == 7).all()


def test_a_missing_named_path_is_still_the_fetch_s_error_with_relist_every(tmp_path):
    (tmp_path / "a.npy").write_bytes(_npy(5))
    source = ObjectSource([f"file://{tmp_path}/*.npy", f"file://{tmp_path}/missing.npy"], relist_every=0.05)
    assert len(source.paths()) == 2  # its details are asked, and it is missing: listed all the same
    time.sleep(0.1)
    source.paths()
    _wait_for(lambda: source._relisting is not None and not source._relisting.is_alive(), "the relisting")
    assert len(source.paths()) == 2


def test_a_listing_carried_from_another_process_is_renewed_before_it_is_drawn_from(tmp_path, monkeypatch):
    """The documented pattern: ``source.check()`` in the training process, then the pool pickles the
    source, listing included, to each sampler process, and again to each restarted one. A process
    started more than relist_every s after that listing lists again before drawing from it (an hour
    later, deleted objects would each fail once and changed ones be read under the headers the
    training process cached)."""
    import pickle

    import growcache.store as store

    for i in range(3):
        (tmp_path / f"{i}.npy").write_bytes(_npy(i))
    source = ObjectSource(f"file://{tmp_path}/*.npy", relist_every=0.2)
    source.check()
    (tmp_path / "0.npy").unlink()
    (tmp_path / "3.npy").write_bytes(_npy(3))
    time.sleep(0.3)
    original = store.glob_listing

    def slow(fs, path):  # a large bucket's listing: a background one would not land at once
        time.sleep(0.5)
        return original(fs, path)

    monkeypatch.setattr(store, "glob_listing", slow)
    child = pickle.loads(pickle.dumps(source))
    assert [p.rsplit("/", 1)[1] for p in child.paths()] == ["1.npy", "2.npy", "3.npy"]
    assert _values(child, 50) == {1, 2, 3}
    # A listing made in this process is renewed in the background as before (samples never wait).
    time.sleep(0.3)
    (tmp_path / "4.npy").write_bytes(_npy(4))
    began = time.monotonic()
    assert len(child.paths()) == 3 and time.monotonic() - began < 0.3
    _wait_for(lambda: len(child.paths()) == 4, "the background listing")


def test_the_relisting_log_counts_against_the_last_listing(tmp_path, caplog):
    """A file left out by a sample (truncated while written) and listed again is not 'new' at every
    listing: the INFO line counts what changed in the store, and nothing is logged when nothing did."""
    (tmp_path / "a.npy").write_bytes(_npy(1, rows=8))
    (tmp_path / "b.npy").write_bytes(_npy(2, rows=8)[:-16])  # truncated: its last row is not there yet
    source = NpyWindowSource(f"file://{tmp_path}/*.npy", window=8, relist_every=0.05)
    rng = np.random.default_rng(0)
    caplog.set_level(logging.INFO, logger="growcache.store")
    while len(source.paths()) == 2:  # drawn until a sample leaves b.npy out
        assert (source(rng)["x"] == 1).all()
    assert "shorter than its .npy header says" in caplog.text
    for _ in range(6):
        time.sleep(0.06)
        source.paths()
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("listed ")]


def test_without_relist_every_no_versions_are_kept_or_sent_to_the_samplers(tmp_path):
    """The versions serve the relisting alone: kept without it they cost each process of a pool
    about 130 MB per million objects (and 100 MB more to pickle to each sampler)."""
    import pickle

    for i in range(3):
        (tmp_path / f"{i}.npy").write_bytes(_npy(i))
    source = ObjectSource(f"file://{tmp_path}/*.npy")
    source.check()
    assert source._versions == {} and b"mtime=" not in pickle.dumps(source)
    relisting = ObjectSource(f"file://{tmp_path}/*.npy", relist_every=60)
    relisting.check()
    assert len(relisting._versions) == 3


def test_a_relisting_holds_the_source_lock_only_to_swap_the_listing(tmp_path):
    """Concurrent samples take the source's lock (counters, headers, sizes): comparing and sorting a
    large listing under it stalled every sample of the process (2 s per relisting of a million objects)."""
    import threading

    (tmp_path / "0.npy").write_bytes(_npy(0))
    source = ObjectSource(f"file://{tmp_path}/*.npy", relist_every=3600)
    source.paths()
    n = 300_000
    names = [f"{tmp_path}/run{i % 997:03d}/chunk{i:07d}.npy" for i in range(n)]
    source._versions = {p: f"size=1;mtime={i}" for i, p in enumerate(names)}
    listing = ({*names}, {p: 1 for p in names}, {p: f"size=1;mtime={i + (i < 10)}" for i, p in enumerate(names)})
    source._list_now = lambda outage=True: listing
    waits, done = [], threading.Event()

    def relist():
        source._relist()
        done.set()

    began = time.monotonic()
    threading.Thread(target=relist).start()
    while not done.is_set():
        asked = time.monotonic()
        with source._lock:
            waits.append(time.monotonic() - asked)
        time.sleep(0.001)
    took = time.monotonic() - began
    assert len(source.paths()) == n
    assert max(waits) < took / 4, (max(waits), took)
