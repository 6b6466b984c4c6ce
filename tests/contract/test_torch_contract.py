"""The adapter contract (``scenarios.py``) against ``make_torch_loader``.

Its TensorFlow twin is ``tests/tf/test_tf_contract.py``: TensorFlow and the ``tfrecord``
package cannot share a process.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("tfrecord")

from drivers import TorchDriver  # noqa: E402
from scenarios import SCENARIOS  # noqa: E402


@pytest.fixture(scope="module")
def driver():
    return TorchDriver()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario,args", SCENARIOS)
def test_contract(scenario, args, driver, tmp_path):
    scenario(driver, tmp_path, *args)
