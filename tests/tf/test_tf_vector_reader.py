"""make_tf_dataset's default reader: growcache's vectorized reader, batches handed to tf.data without a copy.

Checked against ``reader="tensorflow"`` (TFRecordDataset + parse_example, TensorFlow's own
parse) on the same shards, and on its own for what only it does: batch memory reused once
the training step drops a batch, kept batches never overwritten, corrupt records reported
where the core reader finds them.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from conftest import ID_SCHEMA, id_sample, leases_after_teardown, write_shards

tf = pytest.importorskip("tensorflow")

from growcache import Cache, CorruptShardError, Schema  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402
from growcache.example import ExampleCodec  # noqa: E402

DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "float32", "float64", "complex64", "complex128"]


def _values(schema: Schema, record_id: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(record_id)
    out = {"id": np.int64(record_id)}
    for name, spec in schema.items():
        if name == "id":
            continue
        raw = rng.integers(0, 256, spec.nbytes, dtype=np.uint8)
        out[name] = (raw.astype(bool) if spec.dtype.kind == "b" else raw.view(spec.dtype)).reshape(spec.shape)
    return out


def _fill(cache: Cache, counts: list[int]) -> list[int]:
    ids, next_id = [], 0
    for count in counts:
        with cache.writer() as writer:
            for _ in range(count):
                writer.write(_values(cache.schema, next_id))
                ids.append(next_id)
                next_id += 1
    return ids


def _records(ds) -> dict[int, dict[str, bytes]]:
    out: dict[int, dict[str, bytes]] = {}
    for batch in ds:
        arrays = {name: tensor.numpy() for name, tensor in batch.items()}
        for row, record_id in enumerate(arrays["id"].tolist()):
            assert record_id not in out, f"record {record_id} delivered twice"
            out[record_id] = {name: array[row].tobytes() for name, array in arrays.items()}
    return out


SCHEMAS = {
    "dtypes": Schema({"id": ("int64", ())} | {f"f_{d}": (d, (3, 2)) for d in DTYPES}),
    "zero_dims": Schema({"id": ("int64", ()), "empty": ("float32", (0, 3)), "x": ("float32", (5,))}),
    "large": Schema({"id": ("int64", ()), "x": ("float32", (64, 1024))}),  # 256 KiB records: read in place
}


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("shuffle_buffer", [0, None])
def test_same_records_as_tensorflows_own_parse(tmp_path, name, shuffle_buffer):
    schema = SCHEMAS[name]
    cache = Cache(tmp_path / "c", capacity="1GB", schema=schema)
    ids = _fill(cache, [5, 9, 0, 4] if name == "large" else [7, 30, 1, 12])
    ds = make_tf_dataset(cache, 4, shuffle_buffer=shuffle_buffer)
    assert ds.element_spec["id"].shape.as_list() == [None]
    for feature, spec in schema.items():
        assert ds.element_spec[feature].dtype == tf.as_dtype(spec.dtype)
        assert ds.element_spec[feature].shape.as_list() == [None, *spec.shape]
    mine = _records(ds)
    theirs = _records(make_tf_dataset(cache, 4, shuffle_buffer=shuffle_buffer, reader="tensorflow"))
    assert sorted(mine) == ids
    assert mine == theirs
    for record_id in (ids[0], ids[-1]):
        for feature, value in _values(schema, record_id).items():
            assert mine[record_id][feature] == np.asarray(value).tobytes()


def test_batches_kept_by_the_user_are_never_overwritten(tmp_path):
    # 512 KiB per batch: every batch is a view of a reused slot, which must not be reused while
    # any tensor or .numpy() array of it lives.
    schema = Schema({"id": ("int64", ()), "x": ("float32", (32768,))})
    cache = Cache(tmp_path / "c", capacity="1GB", schema=schema)
    with cache.writer() as writer:
        for i in range(40):
            writer.write({"id": np.int64(i), "x": np.full(32768, i, np.float32)})
    ds = make_tf_dataset(cache, 4)
    kept = [(batch["x"], batch["x"].numpy(), batch["id"].numpy()) for batch in ds]
    addresses = set()
    for _ in range(3):  # more epochs, whose batches are dropped as they come
        for batch in ds:
            array = batch["x"].numpy()
            assert (array == batch["id"].numpy()[:, None]).all()
            addresses.add(array.__array_interface__["data"][0])
    for tensor, array, ids in kept:
        assert (array == ids[:, None]).all() and (tensor.numpy() == ids[:, None]).all()
    # Dropped batches give their memory back: a few slots serve every later batch (no copy,
    # no fresh allocation per batch).
    assert len(addresses) <= 12


@pytest.mark.parametrize("on_corrupt", ["raise", "skip"])
def test_a_corrupt_record_is_reported_where_the_reader_finds_it(id_cache, on_corrupt):
    ids = write_shards(id_cache, [6, 6, 6])
    bad = id_cache.list_shards()[1]
    frame = ExampleCodec(ID_SCHEMA).record_nbytes + 16
    with open(bad.path, "r+b") as f:  # record 2's payload
        f.seek(2 * frame + frame - 30)
        f.write(b"\xff")
    ds = make_tf_dataset(id_cache, 2, on_corrupt=on_corrupt, cycle_length=1, shuffle_buffer=0)
    if on_corrupt == "raise":
        with pytest.raises(CorruptShardError) as info:
            _records(ds)
        assert info.value.path == bad.path and info.value.offset == 2 * frame
        del info
    else:
        got = _records(ds)
        assert sorted(got) == ids[:8] + ids[12:]  # records before the bad one were delivered
        (note,) = ds.skipped
        assert (note.path, note.offset, note.records) == (bad.path, 2 * frame, 4)
        for record_id, record in got.items():
            assert record["x"] == id_sample(record_id)["x"].tobytes()
    assert leases_after_teardown(id_cache) == 0


def test_without_verify_nothing_checks_the_payload(id_cache):
    # verify=False means no CRC check in growcache's reader (as in the torch adapter); the
    # framing is still checked.
    ids = write_shards(id_cache, [4])
    path = id_cache.list_shards()[0].path
    frame = ExampleCodec(ID_SCHEMA).record_nbytes + 16
    with open(path, "r+b") as f:
        f.seek(frame - 30)
        f.write(b"\xff")
    assert sorted(_records(make_tf_dataset(id_cache, 2, verify=False))) == ids
    with pytest.raises(CorruptShardError):
        _records(make_tf_dataset(id_cache, 2))


def test_int64_list_features_are_parsed_by_tensorflow(tmp_path):
    schema = Schema({"label": ("int64", (), "int64_list"), "x": ("float32", (3,))})
    cache = Cache(tmp_path / "c", capacity="1GB", schema=schema)
    with cache.writer() as writer:
        for i in range(9):
            writer.write({"label": np.int64(i * 1000), "x": np.full(3, i, np.float32)})
    got = sorted(int(v) for batch in make_tf_dataset(cache, 4) for v in batch["label"].numpy())
    assert got == [i * 1000 for i in range(9)]


def test_readers_read_the_shards_in_parallel_and_cover_them_once(id_cache):
    ids = write_shards(id_cache, [5, 6, 7, 8, 9])
    for readers in (1, 3, 8):
        ds = make_tf_dataset(id_cache, 4, cycle_length=readers, drop_remainder=False)
        batches = [batch["id"].numpy().tolist() for batch in ds]
        assert sorted(i for b in batches for i in b) == ids
        # Each reader forms its own batches: at most one partial batch per reader.
        assert sum(len(b) < 4 for b in batches) <= readers


def test_an_unknown_reader_is_refused(id_cache):
    write_shards(id_cache, [2])
    with pytest.raises(ValueError, match="reader must be one of"):
        make_tf_dataset(id_cache, 2, reader="fast")


def test_an_abandoned_epoch_gives_its_memory_and_lease_back(id_cache):
    ids = write_shards(id_cache, [300, 300])
    ds = make_tf_dataset(id_cache, 2)
    iterator = iter(ds)
    next(iterator)
    del iterator
    gc.collect()
    assert id_cache.stats().leases == 0
    assert sorted(_records(ds)) == ids  # the next epoch starts clean
    assert os.path.exists(id_cache.list_shards()[0].path)
