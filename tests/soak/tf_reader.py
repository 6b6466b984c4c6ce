"""The soak's TensorFlow reader: epochs of ``make_tf_dataset`` until told to stop.

Usage: ``python tf_reader.py CACHE CONTROL_DIR OUT.jsonl``. It imports TensorFlow and never the
``tfrecord`` package or the PyTorch adapter (the two cannot share a process).
"""

from __future__ import annotations

import sys

import tensorflow as tf

from growcache import make_tf_dataset
from soak_common import RecordingCache, Reader

BATCH = 16


def main(cache_path: str, control: str, out: str) -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    cache = RecordingCache(cache_path)
    reader = Reader("tf", cache, control, out)
    ds = make_tf_dataset(cache, BATCH, on_corrupt="skip", wait_for_shards=120, cycle_length=2)
    state = {"skips": 0}

    def epoch():
        for batch in ds:
            yield {k: v.numpy() for k, v in batch.items()}

    def new_skips():
        skipped = ds.corrupt_shards[state["skips"]:]
        state["skips"] += len(skipped)
        return [(e.path, e.offset, e.records) for e in skipped]  # records not delivered

    # A snapshot refused for a full disk reaches the loop as the generator's error.
    reader.run(epoch, new_skips, refused=(tf.errors.OpError,))
    assert "tfrecord" not in sys.modules, "the tfrecord package must never share a process with TensorFlow"


if __name__ == "__main__":
    main(*sys.argv[1:4])
