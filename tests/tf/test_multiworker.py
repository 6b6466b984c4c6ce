"""A 2-worker ``MultiWorkerMirroredStrategy`` run (two processes, TF_CONFIG on 127.0.0.1) on one
cache both workers share, split with ``input_context``, growing while the workers start their
epochs: every record of each epoch's snapshot is read exactly once across the workers, with
equal batch counts.

Keras' own ``fit`` cannot take a distributed dataset under this strategy in Keras 3.15 (it
fails in its first-batch peek with "Attempt to convert a value ({'x': PerReplica:...}) with an
unsupported type", growcache's dataset or not), so the run is a custom training loop, as
docs/tensorflow.md shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from stores import hold_port

from conftest import write_shards

pytest.importorskip("tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
SHARD = 8


@pytest.mark.timeout(300)
def test_two_workers_split_a_shared_growing_cache_exactly_once(id_cache, tmp_path):
    written = write_shards(id_cache, [SHARD, 5, 7, 3, 6])
    epochs = 3
    # TF_CONFIG names the workers' ports before their gRPC servers bind them, seconds later (after
    # importing TensorFlow). Sockets bound to them and never listening hold them meanwhile: the
    # kernel hands no process that asks for a free port one of these (a test that another pytest
    # worker runs would otherwise take them), and the servers still bind them (SO_REUSEADDR on
    # both sides; only a listening socket excludes another).
    held = [hold_port() for _ in range(2)]
    workers = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in held]
    procs = []
    for index in range(2):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
               "TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})}
        log = open(tmp_path / f"worker{index}.log", "w")
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "multiworker_train.py"), id_cache.path,
                                        str(tmp_path), str(epochs), str(SHARD)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=str(tmp_path)), log))
    try:
        codes = [proc.wait(timeout=280) for proc, _ in procs]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        for sock in held:
            sock.close()
    logs = "\n".join((tmp_path / f"worker{i}.log").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], logs
    runs = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
    for epoch in range(epochs):
        a, b = (runs[w][epoch] for w in range(2))
        assert a["batches"] == b["batches"] > 0, (epoch, a["batches"], b["batches"])
        grown = [i for e in range(1, epoch + 1) for i in range(1000 * e, 1000 * e + SHARD)]
        assert not set(a["ids"]) & set(b["ids"]), f"epoch {epoch}: both workers read {set(a['ids']) & set(b['ids'])}"
        assert set(a["ids"]) | set(b["ids"]) == set(written + grown), f"epoch {epoch}: records missed"
    assert id_cache.stats().leases == 0
