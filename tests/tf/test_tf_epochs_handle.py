"""``ds.epochs``: what a TF pipeline's epochs read, after their leases ended (the demo's table)."""

from __future__ import annotations

import pytest
from conftest import write_shards

tf = pytest.importorskip("tensorflow")

from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402


def read_epoch(ds) -> list:
    return [batch["id"].numpy().tolist() for batch in ds]


def test_ds_epochs_latest_names_the_shards_an_epoch_read_after_its_lease_ended(id_cache):
    # The demo's table counts an epoch's shards; a one-shard epoch is read to its end (and its
    # lease ended) before the first batch reaches Python, so live leases cannot tell them.
    write_shards(id_cache, [3])
    ds = make_tf_dataset(id_cache, 4, seed=0)
    assert ds.epochs.latest is None
    read_epoch(ds)
    assert id_cache.stats().leases == 0
    assert [s.seq for s in ds.epochs.latest.shards] == [s.seq for s in id_cache.list_shards()]
    write_shards(id_cache, [3, 3], first_id=100)
    read_epoch(ds)
    assert [s.seq for s in ds.epochs.latest.shards] == sorted(s.seq for s in id_cache.list_shards())
    assert ds.epochs.latest.number == 1
