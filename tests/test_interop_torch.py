"""Files TensorFlow writes, read through make_torch_loader, compared with what TensorFlow reads.

TensorFlow and the ``tfrecord`` package cannot share a process, so a TensorFlow subprocess
(tests/tf/tf_files.py) writes the files with ``tf.io.TFRecordWriter`` and the oracle: every
value as ``tf.io.parse_example`` (+ ``decode_raw`` / ``parse_tensor``) reads it.
tests/tf/test_interop.py checks make_tf_dataset against the same oracle.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tf"))
import tf_files  # noqa: E402  (its top level needs no TensorFlow)

import growcache  # noqa: E402
from growcache import Cache, CompressedFileError, Schema  # noqa: E402
from growcache.cli import main  # noqa: E402

SCHEMA = Schema(tf_files.SCHEMA)


@pytest.fixture(scope="module")
def tf_written(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf-files")
    # Not imported here: it cannot share this process with the tfrecord package.
    if importlib.util.find_spec("tensorflow") is None and os.environ.get("CI") != "true":
        pytest.skip("TensorFlow (the oracle) is not installed: pip install 'growcache[tf]'")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    script = os.path.join(os.path.dirname(__file__), "tf", "tf_files.py")
    result = subprocess.run([sys.executable, script, str(root)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    oracle = dict(np.load(root / "oracle.npz"))
    cache = Cache(root / "cache", capacity="10MB", schema=SCHEMA)
    for name, compression in tf_files.FILES.items():
        if compression is None:
            cache.add_shard(root / name)
        else:
            with pytest.raises(CompressedFileError):
                cache.add_shard(root / name)
            assert main(["import", "-q", str(root / name), cache.path]) == 0  # `growcache import`
    return cache, oracle


@pytest.mark.parametrize("workers", [0, 2])
def test_make_torch_loader_reads_tf_files_exactly(tf_written, workers):
    cache, oracle = tf_written
    expected = {int(i): row for row, i in enumerate(oracle["id"])}
    loader = growcache.make_torch_loader(cache, 4, num_workers=workers, seed=3)
    for _ in range(2):  # two epochs: the second reuses the workers and their learned layouts
        seen = []
        for batch in loader:
            for key, spec in SCHEMA.items():
                assert batch[key].dtype == getattr(torch, spec.dtype.name), key
                assert tuple(batch[key].shape[1:]) == spec.shape, key
            for position, record_id in enumerate(batch["id"].tolist()):
                row = expected[record_id]
                for key, spec in SCHEMA.items():
                    got = batch[key][position].numpy()
                    assert got.tobytes() == oracle[key][row].astype(spec.dtype).tobytes(), (key, record_id)
                seen.append(record_id)
        assert sorted(seen) == sorted(expected)  # every record, once


def test_growcache_written_encodings_through_the_torch_loader(tmp_path):
    schema = Schema({"label": ("int8", (), "int64_list"), "vec": ("uint16", (3,), "int64_list"),
                     "f": ("float32", (2,), "float_list"), "t": ("float64", (2, 2), "tensor"), "x": ("uint8", (5,))})
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=schema)
    samples = {}
    for shard in range(3):
        with cache.writer() as writer:
            for i in range(10):
                key = shard * 10 + i
                sample = {"label": np.int8(key - 15), "vec": np.array([key, 2**16 - 1, 0], np.uint16),
                          "f": np.array([key / 7, -key], np.float32), "t": np.full((2, 2), key / 3),
                          "x": np.full(5, key, np.uint8)}
                samples[key] = sample
                writer.write(sample)
    for workers in (0, 2):
        seen = []
        for batch in growcache.make_torch_loader(cache, 8, num_workers=workers):
            for position, key in enumerate(batch["x"][:, 0].tolist()):
                for name in schema:
                    assert np.array_equal(batch[name][position].numpy(), samples[key][name]), name
                seen.append(key)
        assert sorted(seen) == list(range(30))
