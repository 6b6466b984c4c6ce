"""growcache with Hugging Face Accelerate, in one process and in two (torchrun, gloo).

``accelerator.prepare(model, optimizer)`` with growcache's own loader is the recipe: it keeps
every guarantee (each record once per epoch across ranks, equal batch counts, growth).
``accelerator.prepare(..., loader)`` rebuilds a plain DataLoader around ``loader.dataset``,
which skips growcache's epoch start: it must fail at once, naming that fix, never stall. Under
torchrun, the docs' two-process checkpoint recipe (each rank's loader state beside
``accelerator.save_state``) resumes each rank mid-epoch batch by batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")
accelerate = pytest.importorskip("accelerate")

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = r"prepare\(model, optimizer\)"
SHARD = 8


def _accelerator(**config):
    from accelerate.utils import DataLoaderConfiguration

    warnings.filterwarnings("ignore", module="accelerate")
    return accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))


# A stall would show as this test's timeout (the loader used to wait 300 s for a plan).
@pytest.mark.timeout(90)
@pytest.mark.parametrize("dispatch", [None, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_prepare_with_the_loader_fails_at_once_naming_the_fix(id_cache, workers, dispatch):
    write_shards(id_cache, [SHARD, SHARD])
    accelerator = _accelerator(dispatch_batches=dispatch)
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = growcache.make_torch_loader(id_cache, 4, num_workers=workers)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    with pytest.raises(RuntimeError, match=FIX):
        next(iter(prepared))
    # growcache's own loader is untouched and still reads whole epochs.
    assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(2 * SHARD))


@pytest.mark.timeout(120)
def test_prepare_model_and_optimizer_only_keeps_every_guarantee(id_cache):
    written = write_shards(id_cache, [SHARD, 5])
    accelerator = _accelerator()
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = growcache.make_torch_loader(id_cache, 4, num_workers=2, seed=3, device=accelerator.device)
    for epoch in range(3):
        ids = []
        for batch in loader:
            loss = model(batch["x"].reshape(len(batch["x"]), -1)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            ids += batch["id"].tolist()
        assert sorted(ids) == sorted(written), f"epoch {epoch}"
        written += write_shards(id_cache, [SHARD], first_id=1000 * (epoch + 1))


@pytest.mark.timeout(240)
def test_two_processes_under_torchrun(id_cache, tmp_path):
    """2 ranks (gloo on 127.0.0.1): the recipe trains 3 growing epochs, disjoint and even; each
    rank resumes a mid-epoch checkpoint batch by batch; a prepared loader fails at once on every
    rank that iterates it, and the run ends, not hangs."""
    written = write_shards(id_cache, [SHARD, 5, 7, 3])
    # --standalone: torchrun's own store takes a free port as it binds it (port 0), and the ranks
    # meet there. A port found free here and bound seconds later, once torchrun has imported
    # torch, could be taken meanwhile by a test that another pytest worker runs.
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
            "--nproc_per_node", "2", os.path.join(HERE, "accelerate_ddp.py"), id_cache.path, str(tmp_path), str(SHARD)]
    result = subprocess.run(args, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=220, cwd=str(tmp_path))
    output = result.stdout[-4000:] + result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(3):
        a, b = (ranks[r]["epochs"][epoch] for r in range(2))
        assert a["batches"] == b["batches"] > 0, (epoch, a["batches"], b["batches"])
        assert not set(a["ids"]) & set(b["ids"]), f"epoch {epoch}: ranks overlap"
        grown = [i for e in range(epoch) for i in range(1000 * (e + 1), 1000 * (e + 1) + SHARD)]
        assert set(a["ids"]) | set(b["ids"]) == set(written + grown), f"epoch {epoch}: records missing"
    # A mid-epoch checkpoint, each rank's loader state saved beside accelerator.save_state: each
    # rank's resumed loader finishes its own share of the epoch batch by batch.
    for rank in ranks:
        resume = rank["resume"]
        assert resume["before"] + resume["after"] == resume["whole"] and len(resume["before"]) == 3, resume
    assert not set(sum(ranks[0]["resume"]["whole"], [])) & set(sum(ranks[1]["resume"]["whole"], []))
    # register_for_checkpointing saves the main process's loader state only: rank 1 refuses it.
    assert ranks[0]["resume"]["registered_load"] is None
    assert "rank 0 -> 1" in (ranks[1]["resume"]["registered_load"] or ""), ranks[1]["resume"]["registered_load"]
    # dispatch_batches=False: every rank iterates its own copy of the dataset, and each fails.
    for rank in ranks:
        assert rank["undispatched"] is not None and "prepare(model, optimizer)" in rank["undispatched"], rank
    # Accelerate's default for iterable datasets: rank 0 reads and sends batches to the others.
    # Its error ends the run, so the rank waiting for its batches is ended too.
    assert result.returncode != 0, output
    assert "prepare(model, optimizer)" in output, output
