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


@pytest.mark.parametrize("value", [0, -1, "10", True])
def test_relist_every_must_be_a_positive_number(tmp_path, value):
    with pytest.raises(ValueError, match="relist_every must be a positive number of seconds"):
        ObjectSource(f"file://{tmp_path}/*.npy", relist_every=value)


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
