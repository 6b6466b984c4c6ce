"""TFRecord files written by TensorFlow itself, and the values TensorFlow parses from them.

Every kind of feature growcache reads: int64_list and float_list values (scalars and fixed
shapes, several dtypes), raw bytes_list arrays and tf.io.serialize_tensor values, written
with ``tf.io.TFRecordWriter`` (plain and GZIP). The values are then read back with
``tf.io.parse_example`` (+ ``decode_raw`` / ``parse_tensor``): TensorFlow is the oracle.

Used in a TensorFlow process (tests/tf/test_interop.py imports it), and run as a script by
tests that cannot import TensorFlow (the ``tfrecord`` package's process)::

    python tests/tf/tf_files.py OUTDIR
"""

from __future__ import annotations

import os
import sys

import numpy as np

# name -> the growcache schema entry. Importing this module needs no TensorFlow.
SCHEMA = {
    "id": ("int64", (), "int64_list"),
    "label": ("uint8", (), "int64_list"),
    "vec": ("int32", (3,), "int64_list"),
    "flags": ("bool", (2,), "int64_list"),
    "big": ("int64", (2,), "int64_list"),
    "score": ("float32", (), "float_list"),
    "mat": ("float32", (2, 2), "float_list"),
    "raw": ("float32", (4, 8)),
    "raw16": ("uint16", (3,)),
    "t16": ("int16", (2, 3), "tensor"),
    "t64": ("float64", (), "tensor"),
    "tu8": ("uint8", (5,), "tensor"),
}
FILES = {"plain-0.tfrecord": None, "plain-1.tfrecord": None, "gzip-2.tfrecord.gz": "GZIP"}
RECORDS_PER_FILE = 7


def values(record_id: int) -> dict[str, np.ndarray]:
    """The arrays of record ``record_id``."""
    rng = np.random.default_rng(record_id)
    return {
        "id": np.int64(record_id),
        "label": np.uint8(rng.integers(0, 256)),
        "vec": rng.integers(-(2**31), 2**31, 3).astype(np.int32),
        "flags": rng.integers(0, 2, 2).astype(bool),
        "big": np.array([-(2**62) - record_id, 2**40 + record_id], np.int64),
        "score": np.float32(rng.standard_normal()),
        "mat": rng.standard_normal((2, 2)).astype(np.float32),
        "raw": rng.standard_normal((4, 8)).astype(np.float32),
        "raw16": rng.integers(0, 2**16, 3).astype(np.uint16),
        "t16": rng.integers(-(2**15), 2**15, (2, 3)).astype(np.int16),
        "t64": np.float64(rng.standard_normal()),
        "tu8": rng.integers(0, 256, 5).astype(np.uint8),
    }


def write(outdir: str) -> dict[str, np.ndarray]:
    """Write :data:`FILES` into ``outdir`` and ``oracle.npz``: every feature of every record as
    TensorFlow parses it, in file order. Returns the oracle."""
    import tensorflow as tf

    os.makedirs(outdir, exist_ok=True)
    record_id = 0
    for name, compression in FILES.items():
        options = tf.io.TFRecordOptions(compression_type=compression or "")
        with tf.io.TFRecordWriter(os.path.join(outdir, name), options) as writer:
            for _ in range(RECORDS_PER_FILE):
                writer.write(_example(tf, values(record_id)).SerializeToString())
                record_id += 1
    oracle = {key: [] for key in SCHEMA}
    for name, compression in FILES.items():
        ds = tf.data.TFRecordDataset(os.path.join(outdir, name), compression_type=compression or "")
        for batch in ds.batch(64):
            for key, array in parse(tf, batch).items():
                oracle[key].extend(array)
    stacked = {key: np.stack(arrays) for key, arrays in oracle.items()}
    np.savez(os.path.join(outdir, "oracle.npz"), **stacked)
    return stacked


def _example(tf, sample: dict[str, np.ndarray]):
    feature = {}
    for key, (_, _, *encoding) in SCHEMA.items():
        array = np.asarray(sample[key])
        kind = encoding[0] if encoding else "bytes"
        if kind == "int64_list":
            feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=array.reshape(-1).astype(np.int64)))
        elif kind == "float_list":
            feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=array.reshape(-1)))
        elif kind == "tensor":
            value = tf.io.serialize_tensor(tf.constant(array)).numpy()
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        else:
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[array.tobytes()]))
    return tf.train.Example(features=tf.train.Features(feature=feature))


def parse(tf, serialized) -> dict[str, np.ndarray]:
    """TensorFlow's own reading of a batch of records: the oracle."""
    spec = {}
    for key, (dtype, shape, *encoding) in SCHEMA.items():
        kind = encoding[0] if encoding else "bytes"
        if kind == "int64_list":
            spec[key] = tf.io.FixedLenFeature(shape, tf.int64)
        elif kind == "float_list":
            spec[key] = tf.io.FixedLenFeature(shape, tf.float32)
        else:
            spec[key] = tf.io.FixedLenFeature([], tf.string)
    parsed = tf.io.parse_example(serialized, spec)
    out = {}
    for key, (dtype, shape, *encoding) in SCHEMA.items():
        kind = encoding[0] if encoding else "bytes"
        value = parsed[key]
        if kind == "tensor":
            out[key] = np.stack([tf.io.parse_tensor(v, tf.as_dtype(dtype)).numpy() for v in value])
        elif kind == "bytes":
            raw = tf.io.decode_raw(value, tf.as_dtype(dtype))
            out[key] = tf.reshape(raw, [-1, *shape]).numpy()
        else:
            out[key] = value.numpy().astype(dtype)
    return out


if __name__ == "__main__":
    write(sys.argv[1])
