"""TensorFlow workers of the growth scenario: ``python growth_rank.py CACHE OUT RANK WORLD [PIPELINES SPLIT]``.

Process RANK of WORLD runs PIPELINES input pipelines (default 1), each in a thread:
``tf.distribute.InputContext`` pipeline ``RANK * PIPELINES + i`` of ``WORLD * PIPELINES``, as
``MultiWorkerMirroredStrategy`` gives each worker its pipelines. With ``split="shared"`` (the
default) every pipeline of every process reads one snapshot per epoch: the pipelines of one
process agree in memory, those of different processes through the cache's epoch files. With
``split="node"`` the pipelines of one process form the group (a process posing as a machine
with its own cache). Each pipeline's record goes to ``OUT/rank<pipeline>.json``.
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contract"))

import growth  # noqa: E402
import tensorflow as tf  # noqa: E402

import growcache  # noqa: E402


def main(cache: str, out: str, rank: int, world: int, pipelines: int = 1, split: str = "shared",
         epochs: int = growth.EPOCHS) -> None:
    total = world * pipelines
    errors: list[BaseException] = []

    def pipeline(index: int) -> None:
        try:
            ctx = tf.distribute.InputContext(num_input_pipelines=total, input_pipeline_id=index,
                                             num_replicas_in_sync=total)
            ds = growcache.make_tf_dataset(cache, growth.BATCH, input_context=ctx, shuffle_buffer=0, split=split)
            recorder = growth.Recorder(cache, lambda: ds.epochs.latest.shards, holder=f"tf pipeline {index}/{total}")
            for epoch in range(epochs):
                recorder.wait_for_growth()
                recorder.epoch(batch["id"].numpy() for batch in ds)
                growth.barrier(out, f"epoch-{epoch}", index, total)
            recorder.save(os.path.join(out, f"rank{index}.json"))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=pipeline, args=(rank * pipelines + i,)) for i in range(pipelines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *(
        [int(sys.argv[5]), sys.argv[6], int(sys.argv[7])] if len(sys.argv) > 5 else []))
