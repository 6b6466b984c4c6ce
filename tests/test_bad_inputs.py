"""Bad input gets a clear error, and nothing already in the cache is harmed.

Each row names an action on a populated cache, the error class, and words the message must
contain (what is wrong and how to fix it). After every row, the shards published before it are
byte-identical and still listed. Bad stores and bad arrays (an unreachable store, a missing
bucket, an empty glob, a Fortran-ordered or object ``.npy``, a window larger than the array)
are met by a ``SamplerPool`` growing the populated cache, as in real use.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores import Store, refused_port, s3, s3_server  # noqa: F401

from growcache import (
    Cache,
    CacheFormatError,
    CacheFullError,
    CorruptShardError,
    SamplerError,
    SchemaError,
    SchemaMismatchError,
    SourceError,
    TransientSourceError,
)
from growcache.records import iter_records
from growcache.sampler import SamplerPool
from growcache.sources import NpyWindowSource, ObjectSource, RetryPolicy, Source

from conftest import ID_SCHEMA, id_sample, write_shards


def _wrong_schema(cache, tmp_path):
    Cache(cache.path, schema={"id": ("int64", ()), "x": ("float64", (4, 8))})


def _wrong_dtype(cache, tmp_path):
    with cache.writer() as writer:
        writer.write({"id": np.int64(1), "x": np.zeros((4, 8), np.float64)})


def _wrong_shape(cache, tmp_path):
    with cache.writer() as writer:
        writer.write({"id": np.int64(1), "x": np.zeros((8, 4), np.float32)})


def _missing_feature(cache, tmp_path):
    with cache.writer() as writer:
        writer.write({"x": np.zeros((4, 8), np.float32)})


def _garbage_shard_added(cache, tmp_path):
    garbage = tmp_path / "garbage.tfrecord"
    garbage.write_bytes(os.urandom(5000))
    cache.add_shard(garbage)


def _truncated_shard_added(cache, tmp_path):
    source = cache.list_shards()[0].path
    truncated = tmp_path / "truncated.tfrecord"
    truncated.write_bytes(open(source, "rb").read()[:-100])
    cache.add_shard(truncated)


def _random_file_in_cache(cache, tmp_path):
    with open(os.path.join(cache.shards_dir, "000000000099-5r-5000b.tfrecord"), "wb") as f:
        f.write(os.urandom(5000))
    report = cache.verify()
    os.unlink(os.path.join(cache.shards_dir, "000000000099-5r-5000b.tfrecord"))
    raise report.corrupt[0]


@pytest.mark.parametrize("capacity", [0, -1, "0MB", "-5GB"])
def test_zero_or_negative_budget(tmp_path, capacity):
    with pytest.raises(ValueError, match="capacity must be positive|not a size"):
        Cache(tmp_path / "c", capacity=capacity, schema=ID_SCHEMA)


def _budget_smaller_than_shard(cache, tmp_path):
    small = Cache(tmp_path / "small", capacity=1000, schema=ID_SCHEMA)
    write_shards(small, [20])


def _newer_format(cache, tmp_path):
    other = tmp_path / "newer"
    Cache(other, schema=ID_SCHEMA)
    meta = json.loads((other / "growcache.json").read_text())
    meta["format_version"] += 1
    (other / "growcache.json").write_text(json.dumps(meta))
    Cache(other)


def _path_is_file(cache, tmp_path):
    Cache(os.path.join(cache.path, "growcache.json"))


CASES = [
    (_wrong_schema, SchemaMismatchError, ["float64", "float32", "without schema="]),
    (_wrong_dtype, SchemaError, ["'x'", "float32", "float64", "astype"]),
    (_wrong_shape, SchemaError, ["'x'", "(4, 8)", "(8, 4)"]),
    (_missing_feature, SchemaError, ["missing ['id']"]),
    (_garbage_shard_added, CorruptShardError, ["garbage.tfrecord", "offset 0"]),
    (_truncated_shard_added, CorruptShardError, ["truncated.tfrecord", "truncated record"]),
    (_random_file_in_cache, CorruptShardError, ["000000000099", "offset 0", "growcache verify --remove-corrupt"]),
    (_budget_smaller_than_shard, CacheFullError, ["capacity of 1000 bytes", "Raise the capacity"]),
    (_newer_format, CacheFormatError, ["newer", "Upgrade growcache"]),
    (_path_is_file, NotADirectoryError, ["is a file", "directory"]),
]


@pytest.mark.parametrize("action, error, fragments", CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_bad_input_is_a_clear_error_and_harms_nothing(tmp_path, action, error, fragments):
    _check(tmp_path, lambda cache: action(cache, tmp_path), error, fragments)


# -- bad stores and bad arrays, met by a SamplerPool growing a populated cache ---------------
FAST = RetryPolicy(attempts=2, initial_delay=0.01, max_delay=0.02)


def _npy(array: np.ndarray, **kwargs) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, **kwargs)
    return buf.getvalue()


def _unreachable_store(store: Store) -> Source:
    options = dict(store.storage_options, client_kwargs={"endpoint_url": f"http://127.0.0.1:{refused_port()}"})
    return NpyWindowSource(f"{store.url}/a.npy", 2, storage_options=options, retry=FAST)


def _missing_bucket(store: Store) -> Source:
    return ObjectSource("s3://no-such-bucket-growcache/*.npy", storage_options=store.storage_options, retry=FAST)


def _empty_glob(store: Store) -> Source:
    store.put("data/a.txt", b"not an array")
    return ObjectSource(f"{store.url}/data/*.npy", storage_options=store.storage_options)


def _fortran_order(store: Store) -> Source:
    store.put("f.npy", _npy(np.asfortranarray(np.ones((20, 6), np.float32))))
    return NpyWindowSource(f"{store.url}/f.npy", 4, storage_options=store.storage_options)


def _object_dtype(store: Store) -> Source:
    store.put("o.npy", _npy(np.array([{"a": 1}] * 20, dtype=object), allow_pickle=True))
    return NpyWindowSource(f"{store.url}/o.npy", 4, storage_options=store.storage_options)


def _window_larger_than_array(store: Store) -> Source:
    store.put("small.npy", _npy(np.ones((10, 6), np.float32)))
    return NpyWindowSource(f"{store.url}/small.npy", 20, storage_options=store.storage_options)


STORE_CASES = [
    (_unreachable_store, "s3", TransientSourceError, ["s3://growcache-test/a.npy", "kept failing after 2 attempts",
                                                      "check the endpoint"]),
    (_missing_bucket, "s3", SourceError, ["s3://no-such-bucket-growcache/*.npy", "check the bucket"]),
    (_empty_glob, "file_store", SourceError, ["no objects match", "data/*.npy"]),
    (_fortran_order, "s3", SourceError, ["s3://growcache-test/f.npy", "Fortran-ordered", "ascontiguousarray"]),
    (_object_dtype, "file_store", SourceError, ["o.npy", "holds Python objects"]),
    (_window_larger_than_array, "s3", SourceError, ["small.npy", "10 rows, fewer than window=20", "Lower the window"]),
]


@pytest.fixture
def file_store(tmp_path):
    (tmp_path / "remote").mkdir()
    return Store(f"file://{tmp_path / 'remote'}")


@pytest.mark.parametrize("make_source, store_name, cause, fragments", STORE_CASES,
                         ids=[c[0].__name__.strip("_") for c in STORE_CASES])
def test_bad_store_or_array_fails_the_pool_clearly_and_harms_nothing(tmp_path, request, make_source, store_name,
                                                                     cause, fragments):
    source = make_source(request.getfixturevalue(store_name))
    pools: list[SamplerPool] = []

    def sample(cache: Cache) -> None:
        # A pool still retrying when the wait runs out raises TimeoutError, not SamplerError: the
        # error itself shows that the bad source failed the pool before the wait's deadline.
        with SamplerPool(cache, source, workers=1, max_restarts=0) as pool:
            pools.append(pool)
            pool.wait_for(records=1, timeout=60)

    info = _check(tmp_path, sample, SamplerError, fragments)
    assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
    stats = pools[0].stats()
    assert (stats.records, stats.restarts) == (0, 0), "the first error must fail the pool, with no retry round"


def _check(tmp_path, action, error, fragments) -> pytest.ExceptionInfo:
    """Run ``action`` on a populated cache: ``error`` with every fragment, and the cache as it was."""
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    ids = write_shards(cache, [5, 5])
    before = {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()}
    with pytest.raises(error) as info:
        action(cache)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    after = Cache(cache.path)
    assert {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in after.list_shards()} == before
    assert [n for n in os.listdir(after.shards_dir) if n.startswith(".tmp")] == []
    from growcache.example import ExampleCodec

    codec = ExampleCodec(ID_SCHEMA)
    read = [int(codec.decode(r)["id"]) for s in after.list_shards() for _, r in iter_records(s.path)]
    assert read == ids
    assert all(np.array_equal(codec.decode(r)["x"], id_sample(int(codec.decode(r)["id"]))["x"])
               for s in after.list_shards() for _, r in iter_records(s.path))
    return info


# -- damaged metadata: checked on read, never a reason to delete (issue 17) -------------------
def _populated(tmp_path) -> tuple[Cache, dict[str, str]]:
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [5, 5])
    return cache, {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()}


def _set_metadata(cache: Cache, field: str, value) -> None:
    path = os.path.join(cache.path, "growcache.json")
    meta = json.loads(open(path).read())
    if value is _MISSING:
        del meta[field]
    else:
        meta[field] = value
    with open(path, "w") as f:
        json.dump(meta, f)


_MISSING = object()
METADATA_DAMAGE = [
    ("capacity", 0), ("capacity", -4096), ("capacity", "1GB"), ("capacity", 2.5), ("capacity", True),
    ("capacity", None), ("capacity", _MISSING), ("format_version", "1"), ("format_version", 0),
    ("format_version", _MISSING), ("schema", 5), ("schema", {"x": "float32"}), ("schema", {"x": ["float32", "z"]}),
    ("schema", {"x": ["complex256", [2]]}), ("schema", {"x": {"dtype": "float32"}}), ("schema", {"x": []}),
    ("schema", {"x": [["float32"]]}), ("created", "yesterday"),
]


@pytest.mark.parametrize("field, value", METADATA_DAMAGE,
                         ids=[f"{f}={'missing' if v is _MISSING else v!r}" for f, v in METADATA_DAMAGE])
def test_a_damaged_metadata_value_is_a_clear_error_and_deletes_nothing(tmp_path, field, value):
    cache, before = _populated(tmp_path)
    _set_metadata(cache, field, value)
    for action in (lambda: Cache(cache.path).snapshot(), lambda: Cache(cache.path, schema=ID_SCHEMA),
                   cache.snapshot, cache.stats, cache.prune, lambda: write_shards(cache, [5], first_id=100)):
        with pytest.raises(CacheFormatError) as info:
            action()
        message = str(info.value)
        assert "growcache.json" in message and f"'{field}'" in message, message
        assert any(fix in message for fix in ("Cache(path, capacity=", "Restore the file", "Upgrade")), message
    assert {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()} == before


def test_a_damaged_capacity_is_repaired_by_storing_a_new_one(tmp_path):
    cache, before = _populated(tmp_path)
    _set_metadata(cache, "capacity", 0)
    repaired = Cache(cache.path, capacity="1GB")
    assert repaired.capacity == 10**9 and len(repaired.snapshot()) == 2
    assert {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()} == before


@pytest.mark.parametrize("damage", [b"\x00garbage{", b"[1, 2]", b'{"next_seq": "7", "published": -1}',
                                    b'{"next_seq": 0, "published": 2, "published_bytes": 1, "evicted": 0, '
                                    b'"evicted_bytes": 0, "sampler_runs": 1.5}', None],
                         ids=["garbage", "not-an-object", "wrong-types", "out-of-range", "lost"])
def test_damaged_counters_are_rebuilt_from_the_listing_and_block_nothing(tmp_path, caplog, damage):
    cache, before = _populated(tmp_path)
    state = os.path.join(cache.path, "state.json")
    if damage is None:
        os.unlink(state)
    else:
        with open(state, "wb") as f:
            f.write(damage)
    with caplog.at_level("WARNING", logger="growcache"), cache.snapshot():
        write_shards(cache, [5], first_id=100)  # a publish while both shards are leased
    assert "state.json" in caplog.text and "rebuilt" in caplog.text
    assert [s.seq for s in cache.list_shards()] == [1, 2, 3], "no sequence number is reused"
    assert {p: d for p, d in before.items()} == {
        s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()[:2]}
    stats = cache.stats()
    assert (stats.published, stats.published_bytes) == (3, sum(s.nbytes for s in cache.list_shards()))
    assert json.loads(open(state).read())["next_seq"] == 4
    caplog.clear()
    Cache(cache.path).stats()
    assert "rebuilt" not in caplog.text, "the rebuilt counters were written back"


def test_counters_that_stay_damaged_are_warned_of_once_per_process(tmp_path, caplog):
    # A cache this process does not repair (opened before the damage, or read-only) is read again
    # at every stats() call: `growcache status --watch` repeated the warning every interval.
    cache, _ = _populated(tmp_path)
    with open(os.path.join(cache.path, "state.json"), "wb") as f:
        f.write(b"\x00garbage{")
    with caplog.at_level("WARNING", logger="growcache"):
        figures = [cache.stats().published for _ in range(3)]
    assert figures == [2, 2, 2]
    assert len([r for r in caplog.records if "rebuilt" in r.getMessage()]) == 1, caplog.text


# -- the command line on a damaged cache: exit 1, saying what is wrong (issue 18) --------------
def _cli(*argv) -> tuple[int, str]:
    import contextlib

    from growcache.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


def _damage_capacity(cache: Cache) -> str:
    _set_metadata(cache, "capacity", 0)
    return "'capacity'"


def _damage_schema(cache: Cache) -> str:
    _set_metadata(cache, "schema", {"x": "float32"})
    return "'schema'"


def _nest_metadata(cache: Cache) -> str:
    with open(os.path.join(cache.path, "growcache.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)  # 200 KB: json.loads raises RecursionError, not ValueError
    return "nests its JSON too deep"


def _link_leases(cache: Cache) -> str:
    leases = os.path.join(cache.path, "leases")
    os.rename(leases, leases + "-moved")
    os.symlink(leases + "-moved", leases)
    return "symbolic link"


@pytest.mark.parametrize("damage", [_damage_capacity, _damage_schema, _nest_metadata, _link_leases],
                         ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("command", ["status", "verify", "prune"])
def test_status_verify_and_prune_exit_1_on_a_damaged_cache(tmp_path, command, damage):
    cache, before = _populated(tmp_path)
    fragment = damage(cache)
    code, output = _cli(command, *(["-q"] if command == "verify" else []), cache.path)
    assert code == 1 and fragment in output and "Traceback" not in output, output
    assert {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()} == before


def test_verify_exits_1_on_a_corrupt_or_short_shard_and_status_and_prune_still_work(tmp_path):
    cache, _ = _populated(tmp_path)
    first, second = cache.list_shards()
    os.truncate(first.path, first.nbytes - first.nbytes // first.records)  # a cut at a record boundary
    with open(second.path, "r+b") as f:
        f.seek(40)
        f.write(b"\xff")
    code, output = _cli("verify", "-q", cache.path)
    assert code == 1 and f"CORRUPT {first.path}" in output and "holds 4 records, its name says 5" in output
    assert f"CORRUPT {second.path}" in output
    assert _cli("status", cache.path)[0] == 0 and _cli("prune", cache.path)[0] == 0


# -- random damage to random shards (issue 17's property test; the epoch parts are in
# tests/torch/test_hostile_shards.py and tests/tf/test_hostile_shards.py) ------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_bytes_over_random_shards_are_reported_by_file_and_never_crash_verify(tmp_path_factory, data):
    from growcache.example import ExampleCodec

    from hostile import damaged_cache

    cache, damaged, ids = damaged_cache(str(tmp_path_factory.mktemp("c") / "cache"), data)
    report = cache.verify()
    assert {c.path for c in report.corrupt} == damaged
    for error in report.corrupt:
        assert error.path in str(error) and f"offset {error.offset}" in str(error)
    codec = ExampleCodec(ID_SCHEMA)
    for shard in cache.list_shards():
        if shard.path in damaged:
            continue
        decoded = [codec.decode(r) for _, r in iter_records(shard.path)]
        assert [int(d["id"]) for d in decoded] == ids[shard.path]
        assert all(np.array_equal(d["x"], id_sample(int(d["id"]))["x"]) for d in decoded)
    code, output = _cli("verify", "-q", cache.path)
    assert code == (1 if damaged else 0) and all(f"CORRUPT {p}" in output for p in damaged)
