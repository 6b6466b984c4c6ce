"""The adapter contract (``tests/contract/scenarios.py``) against ``make_tf_dataset``.

Its PyTorch twin is ``tests/contract/test_torch_contract.py``: TensorFlow and the ``tfrecord``
package cannot share a process.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("tensorflow")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contract"))

from drivers import TFDriver  # noqa: E402
from scenarios import SCENARIOS  # noqa: E402


@pytest.fixture(scope="module")
def driver():
    return TFDriver()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario,args", SCENARIOS)
def test_contract(scenario, args, driver, tmp_path):
    scenario(driver, tmp_path, *args)
