"""Shared fixtures: small caches whose every record can be recomputed from its id."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from growcache import Cache, Schema  # noqa: E402

ID_SCHEMA = Schema({"id": ("int64", ()), "x": ("float32", (4, 8))})


def id_sample(record_id: int) -> dict[str, np.ndarray]:
    """The sample for ``record_id``: its payload is derived from the id, so readers can check it."""
    rng = np.random.default_rng(record_id)
    return {"id": np.int64(record_id), "x": rng.standard_normal((4, 8)).astype(np.float32)}


def write_shards(cache: Cache, shard_records: list[int], first_id: int = 0) -> list[int]:
    """Publish one shard per entry of ``shard_records``; return every id written."""
    ids = []
    next_id = first_id
    for count in shard_records:
        with cache.writer() as writer:
            for _ in range(count):
                writer.write(id_sample(next_id))
                ids.append(next_id)
                next_id += 1
    return ids


@pytest.fixture
def id_cache(tmp_path):
    """An empty cache with :data:`ID_SCHEMA` and a roomy budget."""
    return Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
