"""TFRecordShardSource shuffles every pass anew: consecutive passes over the same remote files
take different orders, and each pass still fetches every file exactly once.

The passes are driven the way a sampler worker drives them (claim, fetch, publish with the
commit hook); between passes the cache is emptied, so every pass has the whole dataset to fetch.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from stores import s3, s3_server  # noqa: F401
from tfrecords import framed, labelled

from growcache import Cache, Schema, TFRecordShardSource
from growcache.records import iter_records
from growcache.shard_source import FetchJob, pass_progress

SCHEMA = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (64,))})
FILES, RECORDS = 8, 3


def _one_pass(source: TFRecordShardSource, cache: Cache, remote: dict[bytes, str]) -> list[str]:
    """Fetch until the pass is done; return the remote files in the order their records came."""
    order: list[str] = []
    job = FetchJob(cache, 11, 0, lambda: False)
    while True:
        with contextlib.closing(source.fetch(job)) as shards:
            published = [cache._publish(s.path, s.records, s.nbytes, before_publish=s.commit) for s in shards]
        if not published:
            return order
        for shard in published:
            for _, record in iter_records(shard.path):
                name = remote[bytes(record)]
                if not order or order[-1] != name:
                    order.append(name)


@pytest.mark.parametrize("store_name", ["local", "s3"])
def test_consecutive_passes_take_new_orders_and_fetch_every_file_once(request, tmp_path, store_name):
    remote: dict[bytes, str] = {}
    if store_name == "s3":
        store = request.getfixturevalue("s3")
        url, options = f"{store.url}/data/train-*", store.storage_options
    else:
        os.makedirs(tmp_path / "remote")
        url, options = str(tmp_path / "remote" / "train-*"), None
    for index in range(FILES):
        name = f"train-{index:05d}"
        records = [labelled(index, i) for i in range(RECORDS)]
        remote.update((r, name) for r in records)
        if store_name == "s3":
            store.put(f"data/{name}", framed(records))
        else:
            with open(tmp_path / "remote" / name, "wb") as f:
                f.write(framed(records))
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=SCHEMA)
    source = TFRecordShardSource(url, storage_options=options)
    passes = []
    for number in (1, 2, 3):
        order = _one_pass(source, cache, remote)
        assert pass_progress(cache)[0].pass_number == number
        assert sorted(order) == sorted(set(remote.values())), f"pass {number} fetches every file exactly once"
        records = [bytes(r) for s in cache.list_shards() for _, r in iter_records(s.path)]
        assert sorted(records) == sorted(remote), f"pass {number} copies every record once"
        passes.append(order)
        cache.evict(to=0)  # the cache lets everything go: the next pass fetches the whole dataset
    assert passes[0] != passes[1] and passes[1] != passes[2], "each pass takes a new order"
