"""TensorFlow input pipelines on a cache that grows and evicts (issue 13's growth scenario).

Two pipelines under ``input_context`` read 20 epochs of a cache of at most 16 shards while a
``SamplerPool`` publishes many shards per epoch: as two worker processes (the multi-worker
case, agreeing through epoch files), and as two pipelines of one process (agreeing in memory).
See ``tests/contract/growth.py`` for what is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

tf = pytest.importorskip("tensorflow")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "contract"))

import growth  # noqa: E402
from growcache import Cache, SamplerPool, make_tf_dataset  # noqa: E402


def _grow(tmp_path, run) -> list:
    cache = Cache(tmp_path / "cache", capacity=growth.capacity(), schema=growth.SCHEMA)
    with SamplerPool(cache, growth.sample, workers=1, shard_size=growth.SHARD_SIZE, max_shard_age=None) as pool:
        pool.wait_for(shards=growth.MAX_SHARDS, timeout=120)
        ranks = run(cache)
        pool.raise_if_failed()
    return ranks


@pytest.mark.timeout(600)
def test_two_worker_processes_agree_on_every_epoch_of_a_growing_cache(tmp_path):
    def run(cache):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", GROWCACHE_RUN_ID=f"growth-{os.getpid()}")
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "growth_rank.py"), cache.path, str(tmp_path),
                                   str(rank), "2"], env=env) for rank in range(2)]
        assert [proc.wait(timeout=500) for proc in procs] == [0, 0]
        return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    growth.check(_grow(tmp_path, run), groups=[[0, 1]])


@pytest.mark.timeout(600)
def test_two_pipelines_of_one_process_agree_on_every_epoch_of_a_growing_cache(tmp_path):
    def run(cache):
        recorders = [growth.Recorder(cache.path, holder=f"tf pipeline {rank}/2") for rank in range(2)]
        datasets = [make_tf_dataset(cache, growth.BATCH, shuffle_buffer=0, input_context=tf.distribute.InputContext(
            num_input_pipelines=2, input_pipeline_id=rank, num_replicas_in_sync=2)) for rank in range(2)]
        errors = []

        def pipeline(rank):
            try:
                for epoch in range(growth.EPOCHS):
                    recorders[rank].wait_for_growth()
                    recorders[rank].epoch(batch["id"].numpy() for batch in datasets[rank])
                    growth.barrier(str(tmp_path), f"epoch-{epoch}", rank, 2)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=pipeline, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(500)
        if errors:
            raise errors[0]
        return [recorder.epochs for recorder in recorders]

    growth.check(_grow(tmp_path, run), groups=[[0, 1]])
