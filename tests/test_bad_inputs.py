"""Bad input gets a clear error, and nothing already in the cache is harmed.

Each row names an action on a populated cache, the error class, and words the message must
contain (what is wrong and how to fix it). After every row, the shards published before it are
byte-identical and still listed.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from growcache import Cache, CacheFormatError, CacheFullError, CorruptShardError, SchemaError, SchemaMismatchError
from growcache.records import iter_records

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
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    ids = write_shards(cache, [5, 5])
    before = {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()}
    with pytest.raises(error) as info:
        action(cache, tmp_path)
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
