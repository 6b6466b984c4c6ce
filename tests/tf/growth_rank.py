"""One TensorFlow worker of the growth scenario: ``python growth_rank.py CACHE OUT RANK WORLD``.

Its input pipeline is pipeline RANK of WORLD (``tf.distribute.InputContext``, as
``MultiWorkerMirroredStrategy`` gives each worker); the pipelines of different processes agree
on each epoch through the cache's epoch files.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contract"))

import growth  # noqa: E402
import tensorflow as tf  # noqa: E402

import growcache  # noqa: E402


def main(cache: str, out: str, rank: int, world: int) -> None:
    ctx = tf.distribute.InputContext(num_input_pipelines=world, input_pipeline_id=rank, num_replicas_in_sync=world)
    ds = growcache.make_tf_dataset(cache, growth.BATCH, input_context=ctx, shuffle_buffer=0)
    recorder = growth.Recorder(cache)
    for epoch in range(growth.EPOCHS):
        recorder.wait_for_growth()
        recorder.epoch(batch["id"].numpy() for batch in ds)
        growth.barrier(out, f"epoch-{epoch}", rank, world)
    recorder.save(os.path.join(out, f"rank{rank}.json"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
