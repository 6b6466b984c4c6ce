"""Shards growcache writes are read by the `tfrecord` package (the PyTorch ecosystem's reader)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import id_sample, write_shards

tfrecord = pytest.importorskip("tfrecord")


def test_tfrecord_package_reads_growcache_shards(id_cache):
    ids = write_shards(id_cache, [4, 3])
    got = []
    for shard in id_cache.list_shards():
        loader = tfrecord.tfrecord_loader(shard.path, None, {"id": "byte", "x": "byte"})
        for example in loader:
            record_id = int(np.frombuffer(example["id"], "<i8")[0])
            x = np.frombuffer(example["x"], "<f4").reshape(4, 8)
            assert np.array_equal(x, id_sample(record_id)["x"])
            got.append(record_id)
    assert got == ids


def test_tfrecord_package_reads_growcache_int64_and_float_lists(tmp_path):
    from growcache import Cache, Schema

    cache = Cache(tmp_path / "cache", schema=Schema({"label": ("int64", (), "int64_list"),
                                                      "f": ("float32", (2,), "float_list")}))
    labels = [0, 300, -7, 2**40]
    with cache.writer() as writer:
        for label in labels:
            writer.write({"label": np.int64(label), "f": np.array([label, 0.5], np.float32)})
    (shard,) = cache.list_shards()
    got = list(tfrecord.tfrecord_loader(shard.path, None, {"label": "int", "f": "float"}))
    assert [int(e["label"][0]) for e in got] == labels  # 10-byte varints read as the values
    assert [e["f"].tolist() for e in got] == [[float(np.float32(v)), 0.5] for v in labels]
