"""Run by tests/tf/test_multiworker.py: one worker of a 2-worker MultiWorkerMirroredStrategy
(TF_CONFIG on 127.0.0.1), trained with a custom loop on a cache both workers share, split with
``input_context``. Worker 0 grows the cache at the start of epochs 1, 2, ..., after worker 1
started its epoch (or 1 s, whichever comes first): a worker that took its own snapshot would
then read a different shard set. Writes this worker's ids per epoch.

Usage: multiworker_train.py CACHE_DIR OUT_DIR EPOCHS SHARD_RECORDS   (TF_CONFIG set by the caller)
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402
from growcache.epoch import trainer_epoch  # noqa: E402

GLOBAL_BATCH = 8


def main() -> None:
    cache_dir, out, epochs, shard = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    cache = growcache.Cache(cache_dir)

    def pipeline(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        # The default seed, as most scripts leave it: every worker must still draw the same order.
        return make_tf_dataset(cache, ctx.get_per_replica_batch_size(GLOBAL_BATCH), input_context=ctx, label="id")

    dist = strategy.distribute_datasets_from_function(pipeline)
    with strategy.scope():
        dense = tf.keras.layers.Dense(1)
        dense.build((None, 32))
        optimizer = tf.keras.optimizers.SGD(learning_rate=0.01)

    @tf.function
    def step(batch):
        def replica_step(features, ids):
            with tf.GradientTape() as tape:
                x = tf.reshape(features["x"], (-1, 32))
                loss = tf.reduce_sum(tf.square(dense(x))) / GLOBAL_BATCH
            grads = tape.gradient(loss, dense.trainable_variables)
            optimizer.apply_gradients(zip(grads, dense.trainable_variables))  # an all-reduce across workers
            return ids

        return strategy.run(replica_step, args=batch)

    record = []
    for epoch in range(epochs):
        started = os.path.join(out, f"worker1-started-{epoch}")
        if worker == 0 and epoch:
            deadline = time.monotonic() + 1.0
            while not os.path.exists(started) and time.monotonic() < deadline:
                time.sleep(0.01)
            write_shards(cache, [shard], first_id=1000 * epoch)
        ids, batches = [], 0
        with trainer_epoch(epoch):  # as docs/tensorflow.md shows: the order of epoch `epoch`
            iterator = iter(dist)
            batch = next(iterator)
            if worker == 1:
                open(started, "w").close()
            while True:
                for local in strategy.experimental_local_results(step(batch)):
                    ids += [int(i) for i in np.asarray(local)]
                batches += 1
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
            del iterator
        record.append({"ids": ids, "batches": batches})
    with open(os.path.join(out, f"worker{worker}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
