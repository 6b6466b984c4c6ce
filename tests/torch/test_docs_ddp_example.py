"""The torchrun DDP example of docs/pytorch.md runs as shown (issue 15, finding 9).

The script is taken from the page as it stands and run under ``torch.distributed.run`` with 2
gloo ranks. Only its constants are shrunk to this machine, which is the situation in which the
example once dropped shards between ranks and crashed with ``EmptyCacheError``: a 2 MB cache
that its samplers turn over, a ``file://`` store in place of S3, smaller windows and rows,
fewer workers and epochs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("tfrecord")

DOC = Path(__file__).resolve().parents[2] / "docs" / "pytorch.md"
SHRINK = [  # (what the page says, what this machine runs)
    ('WINDOW, ROW, BATCH, LOADER_WORKERS = 64, 512, 64, 4', 'WINDOW, ROW, BATCH, LOADER_WORKERS = 8, 32, 16, 1'),
    ('SOURCE = "s3://my-bucket/simulations/**/*.npy"', 'SOURCE = os.environ["DOC_TEST_STORE"]'),
    ('STORAGE_OPTIONS = {"client_kwargs": {"region_name": "us-east-1"}}', 'STORAGE_OPTIONS = {}'),
    ('capacity="500GB"', 'capacity="2MB"'),
    ('workers=8, seed=0)', 'workers=2, seed=0, shard_size="256KB")'),
    ('for epoch in range(10):', 'for epoch in range(6):'),
]


def _example() -> str:
    blocks = re.findall(r"```python\n(# train_ddp\.py\n.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/pytorch.md must hold one train_ddp.py example"
    code = blocks[0]
    for shown, run in SHRINK:
        assert shown in code, f"the example no longer says {shown!r}: update this test with it"
        code = code.replace(shown, run)
    return code


@pytest.mark.timeout(300)
def test_the_documented_torchrun_example_runs_on_a_small_turning_cache(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    for part in range(2):
        np.save(store / f"part-{part}.npy", np.random.default_rng(part).random((4096, 32), dtype=np.float32))
    script = tmp_path / "train_ddp.py"
    script.write_text(_example())
    env = dict(os.environ, DOC_TEST_STORE=f"file://{store}/*.npy", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script), str(tmp_path / "cache")], capture_output=True, text=True, timeout=280,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    epochs = re.findall(r"epoch (\d+): (\d+) steps per rank, (\d+) records on rank 0", result.stdout)
    assert [int(e) for e, _, _ in epochs] == list(range(6)), result.stdout
    assert all(int(steps) > 0 for _, steps, _ in epochs)
