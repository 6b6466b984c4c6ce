"""TensorFlow input pipelines on a cache that grows and evicts (issue 13's growth scenario).

Two pipelines under ``input_context`` read 20 epochs of a cache of at most 16 shards while a
``SamplerPool`` publishes many shards per epoch: as two worker processes (the multi-worker
case, agreeing through epoch files), and as two pipelines of one process (agreeing in memory).
With ``split="node"``, two processes pose as two machines, each with its own growing cache and
two pipelines that agree on it. See ``tests/contract/growth.py`` for what is checked and
``growth_rank.py`` for each worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

tf = pytest.importorskip("tensorflow")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "contract"))
sys.path.insert(0, HERE)

import growth  # noqa: E402
import growth_rank  # noqa: E402


def _grow(directory, run) -> list:
    with growth.growing_caches([directory / "cache"]) as (cache,):
        return run(cache)


def _records(out, pipelines: range) -> list:
    return [json.loads((out / f"rank{p}.json").read_text()) for p in pipelines]


def _workers(caches: list[str], out, pipelines: int, split: str, epochs: int) -> None:
    """Run one growth_rank.py process per cache (process m reads caches[m])."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", GROWCACHE_RUN_ID=f"growth-{os.getpid()}")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "growth_rank.py"), cache, str(out), str(rank),
                               str(len(caches)), str(pipelines), split, str(epochs)],
                              env={**env, "GROWCACHE_NODE": f"machine-{rank}"}) for rank, cache in enumerate(caches)]
    assert [proc.wait(timeout=500) for proc in procs] == [0] * len(caches)


@pytest.mark.timeout(600)
def test_two_worker_processes_agree_on_every_epoch_of_a_growing_cache(tmp_path):
    def run(cache):
        _workers([cache.path] * 2, tmp_path, 1, "shared", growth.EPOCHS)
        return _records(tmp_path, range(2))

    growth.check(_grow(tmp_path, run), groups=[[0, 1]])


@pytest.mark.timeout(600)
def test_two_pipelines_of_one_process_agree_on_every_epoch_of_a_growing_cache(tmp_path):
    def run(cache):
        growth_rank.main(cache.path, str(tmp_path), 0, 1, pipelines=2)
        return _records(tmp_path, range(2))

    growth.check(_grow(tmp_path, run), groups=[[0, 1]])


# As the torch test of split="node": 8 epochs of caches that are full and turning over from the first.
@pytest.mark.timeout(600)
def test_two_machines_with_split_node_agree_per_machine_on_their_own_caches(tmp_path):
    with growth.growing_caches([tmp_path / f"machine-{m}" for m in range(2)]) as caches:
        _workers([c.path for c in caches], tmp_path, 2, "node", 8)
    for machine in range(2):
        # Each machine's pipelines read its own cache: equal batch counts within it, not across.
        growth.check(_records(tmp_path, range(2 * machine, 2 * machine + 2)), groups=[[0, 1]], epochs=8)
