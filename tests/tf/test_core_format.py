"""TensorFlow's own reader and writer agree with growcache's shard format."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ID_SCHEMA, id_sample, write_shards

tf = pytest.importorskip("tensorflow")


def test_tf_data_reads_growcache_shards(id_cache):
    ids = write_shards(id_cache, [5, 4])
    features = {"id": tf.io.FixedLenFeature([], tf.string), "x": tf.io.FixedLenFeature([], tf.string)}
    ds = tf.data.TFRecordDataset([s.path for s in id_cache.list_shards()]).batch(3)
    got = []
    for batch in ds.map(lambda r: tf.io.parse_example(r, features)):
        record_ids = tf.io.decode_raw(batch["id"], tf.int64)[:, 0].numpy()
        xs = tf.reshape(tf.io.decode_raw(batch["x"], tf.float32), (-1, 4, 8)).numpy()
        for record_id, x in zip(record_ids, xs):
            assert np.array_equal(x, id_sample(int(record_id))["x"])
        got.extend(int(i) for i in record_ids)
    assert got == ids


def test_tf_written_shard_is_added_and_read_by_core(id_cache, tmp_path):
    from growcache.example import ExampleCodec
    from growcache.records import iter_records

    path = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(7):
            sample = id_sample(100 + i)
            feature = {k: tf.train.Feature(bytes_list=tf.train.BytesList(value=[np.asarray(v).tobytes()]))
                       for k, v in sample.items()}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    info = id_cache.add_shard(path)
    assert info.records == 7
    codec = ExampleCodec(ID_SCHEMA)
    decoded = [codec.decode(r) for _, r in iter_records(info.path)]
    assert [int(d["id"]) for d in decoded] == list(range(100, 107))
    assert all(np.array_equal(d["x"], id_sample(int(d["id"]))["x"]) for d in decoded)


def test_tf_rejects_a_corrupted_growcache_shard_too(id_cache):
    write_shards(id_cache, [3])
    shard = id_cache.list_shards()[0]
    with open(shard.path, "r+b") as f:
        f.seek(60)
        f.write(b"\xff\xff")
    with pytest.raises(tf.errors.DataLossError):
        list(tf.data.TFRecordDataset([shard.path]))
