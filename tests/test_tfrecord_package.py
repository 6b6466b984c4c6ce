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
