"""Files TensorFlow writes, read by growcache; shards growcache writes, read by plain TensorFlow code.

TensorFlow is the oracle: every value growcache delivers is compared with what
``tf.io.parse_example`` (+ ``decode_raw`` / ``parse_tensor``) reads from the same file.
tests/test_interop_torch.py checks the PyTorch side against the same oracle.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import tf_files  # noqa: E402

from growcache import Cache, CompressedFileError, Schema, SchemaError  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402
from growcache.example import ExampleCodec  # noqa: E402
from growcache.cli import main  # noqa: E402
from growcache.importer import infer_schema  # noqa: E402
from growcache.records import iter_records  # noqa: E402

SCHEMA = Schema(tf_files.SCHEMA)
# make_tf_dataset reads with TensorFlow's parse_example, or with growcache's reader where it has one.
READERS = (["growcache", "tensorflow"] if "reader" in inspect.signature(make_tf_dataset).parameters
           else [None])


def _dataset(cache, batch_size: int, reader: str | None, **kwargs):
    return make_tf_dataset(cache, batch_size, **kwargs, **({"reader": reader} if reader else {}))


@pytest.fixture(scope="module")
def tf_written(tmp_path_factory):
    """TensorFlow's files, and a cache holding them: plain ones added, the GZIP one imported."""
    root = tmp_path_factory.mktemp("tf-files")
    oracle = tf_files.write(str(root))
    cache = Cache(root / "cache", capacity="10MB", schema=SCHEMA)
    for name, compression in tf_files.FILES.items():
        if compression is None:
            cache.add_shard(root / name)
        else:
            with pytest.raises(CompressedFileError, match="growcache import"):
                cache.add_shard(root / name)
            assert main(["import", "-q", str(root / name), cache.path]) == 0  # `growcache import`
    return root, cache, oracle


def _by_id(oracle: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    return {int(i): {k: v[row] for k, v in oracle.items()} for row, i in enumerate(oracle["id"])}


def _assert_exact(got: dict[str, np.ndarray], oracle: dict[str, np.ndarray]) -> None:
    """Every record of the oracle exactly once, every value equal (bit for bit) in the schema's dtype."""
    expected = _by_id(oracle)
    ids = [int(i) for i in got["id"]]
    assert sorted(ids) == sorted(expected)
    for row, record_id in enumerate(ids):
        for key, spec in SCHEMA.items():
            value = np.asarray(got[key][row])
            assert value.dtype == spec.dtype and value.shape == spec.shape, key
            assert value.tobytes() == np.asarray(expected[record_id][key], spec.dtype).tobytes(), (key, record_id)


def test_the_oracle_holds_what_was_written(tf_written):
    _, _, oracle = tf_written
    for row, record_id in enumerate(oracle["id"]):
        written = tf_files.values(int(record_id))
        for key in SCHEMA:
            assert np.array_equal(oracle[key][row], written[key]), key


def test_schema_is_inferred_from_a_tf_file(tf_written):
    root, _, _ = tf_written
    inferred = infer_schema(str(root / "gzip-2.tfrecord.gz"))
    for key, (dtype, shape, *encoding) in tf_files.SCHEMA.items():
        kind = encoding[0] if encoding else "bytes"
        if kind == "tensor":  # a serialized tensor says its dtype and shape
            assert inferred[key].as_tuple() == (dtype, shape, "tensor")
        elif kind == "int64_list":
            assert inferred[key].encoding == "int64_list" and inferred[key].size == int(np.prod(shape))
        elif kind == "float_list":
            assert inferred[key].as_tuple()[1:] == ((int(np.prod(shape)),) if np.prod(shape) > 1 else (), "float_list")
        else:  # raw bytes carry no dtype
            assert inferred[key].as_tuple() == ("uint8", (int(np.prod(shape)) * np.dtype(dtype).itemsize,))


def test_the_core_reads_tf_files_exactly(tf_written):
    _, cache, oracle = tf_written
    codec = ExampleCodec(SCHEMA)
    rows = [codec.decode(r) for s in cache.list_shards() for _, r in iter_records(s.path)]
    _assert_exact({k: np.stack([r[k] for r in rows]) for k in SCHEMA}, oracle)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("batch_size", [1, 5])
def test_make_tf_dataset_reads_tf_files_exactly(tf_written, batch_size, reader):
    _, cache, oracle = tf_written
    batches = list(_dataset(cache, batch_size, reader, seed=1))
    got = {k: np.concatenate([b[k].numpy() for b in batches]) for k in SCHEMA}
    _assert_exact(got, oracle)
    for key, spec in SCHEMA.items():
        assert batches[0][key].dtype == tf.as_dtype(spec.dtype.name)


@pytest.mark.parametrize("reader", READERS)
def test_growcache_written_int64_list_labels_are_read_by_plain_parse_example(tmp_path, reader):
    schema = Schema({"image": ("float32", (4, 4)), "label": ("int64", (), "int64_list"),
                     "small": ("uint8", (2,), "int64_list"), "score": ("float32", (), "float_list"),
                     "t": ("int16", (3,), "tensor")})
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=schema)
    rng = np.random.default_rng(0)
    samples = [{"image": rng.standard_normal((4, 4)).astype(np.float32), "label": np.int64(label),
                "small": np.array([label % 256, 255], np.uint8), "score": np.float32(label / 3),
                "t": np.array([label % 1000, -(label % 1000), 7], np.int16)} for label in [0, 1, 127, 128, 1000, 2**40, -5]]
    with cache.writer() as writer:
        for sample in samples:
            writer.write(sample)
    # The user's existing tf.data code, unchanged: no growcache import involved in reading.
    features = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64),
                "small": tf.io.FixedLenFeature([2], tf.int64), "score": tf.io.FixedLenFeature([], tf.float32),
                "t": tf.io.FixedLenFeature([], tf.string)}
    ds = tf.data.TFRecordDataset([s.path for s in cache.list_shards()]).batch(16)
    parsed = next(iter(ds.map(lambda r: tf.io.parse_example(r, features))))
    assert parsed["label"].numpy().tolist() == [int(s["label"]) for s in samples]
    assert parsed["small"].numpy().tolist() == [s["small"].tolist() for s in samples]
    assert parsed["score"].numpy().tolist() == [float(s["score"]) for s in samples]
    images = tf.reshape(tf.io.decode_raw(parsed["image"], tf.float32), [-1, 4, 4]).numpy()
    assert np.array_equal(images, np.stack([s["image"] for s in samples]))
    for value, sample in zip(parsed["t"], samples):
        assert np.array_equal(tf.io.parse_tensor(value, tf.int16).numpy(), sample["t"])
        assert value.numpy() == tf.io.serialize_tensor(tf.constant(sample["t"])).numpy()  # byte for byte
    # And growcache's own reading of them.
    got = {k: np.concatenate([b[k].numpy() for b in _dataset(cache, 16, reader, shuffle_buffer=0)]) for k in schema}
    assert got["label"].tolist() == [int(s["label"]) for s in samples]
    assert np.array_equal(got["t"], np.stack([s["t"] for s in samples]))


@pytest.mark.parametrize("reader", READERS)
def test_an_int64_value_out_of_the_schema_range_fails_the_tf_pipeline(tmp_path, reader):
    path = str(tmp_path / "a.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for value in (3, 300):
            feature = {"label": tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    wide = Cache(tmp_path / "wide", capacity="1MB", schema={"label": ("int64", (), "int64_list")})
    wide.add_shard(path)
    narrow_dir = tmp_path / "narrow"
    os.makedirs(narrow_dir / "shards")
    # A cache that claims uint8 for the same shard (written elsewhere): reading must not wrap 300 to 44.
    narrow = Cache(narrow_dir, capacity="1MB", schema={"label": ("uint8", (), "int64_list")})
    os.link(wide.list_shards()[0].path, os.path.join(narrow.shards_dir, os.path.basename(wide.list_shards()[0].path)))
    with pytest.raises((tf.errors.InvalidArgumentError, SchemaError), match="label"):  # never wrapped to 44
        list(_dataset(narrow, 2, reader))
