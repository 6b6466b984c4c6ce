"""The adapter contract (``scenarios.py``) against ``make_torch_loader``.

Its TensorFlow twin is ``tests/tf/test_tf_contract.py``: TensorFlow and the ``tfrecord``
package cannot share a process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("tfrecord")

from conftest import write_shards  # noqa: E402
from drivers import TorchDriver  # noqa: E402
from scenarios import SCENARIOS  # noqa: E402


@pytest.fixture(scope="module")
def driver():
    return TorchDriver()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario,args", SCENARIOS)
def test_contract(scenario, args, driver, tmp_path):
    scenario(driver, tmp_path, *args)


_TF_ORDER = """
import json, sys
import growcache
ds = growcache.make_tf_dataset(sys.argv[1], 3, seed=int(sys.argv[2]), shuffle_buffer=0, cycle_length=1)
print(json.dumps([[int(i) for batch in ds for i in batch["id"].numpy()] for _ in range(2)]))
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow (pip install 'growcache[tf]')")
def test_tf_and_torch_read_the_same_shard_order_for_the_same_seed_and_epoch(id_cache, driver):
    # Side by side, not only each against the core's plan: TensorFlow runs in a process of its
    # own (it cannot share one with the tfrecord package).
    write_shards(id_cache, [5, 3, 8, 2, 6, 4, 7])
    for seed in (0, 5):
        loader = driver.make(id_cache, 3, readers=0, shuffle_buffer=0, seed=seed)
        torch_order = [[i for batch in driver.epoch(loader) for i in batch] for _ in range(2)]
        result = subprocess.run([sys.executable, "-c", _TF_ORDER, id_cache.path, str(seed)], capture_output=True,
                                text=True, timeout=240, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout.strip().splitlines()[-1]) == torch_order
        assert torch_order[0] != torch_order[1]  # the epoch changes the order
