"""growcache inside PyTorch Lightning: ``Trainer.fit`` on a growing cache with 0 and 2 workers,
the loader's length as Lightning reads it, resuming from a checkpoint (the shard order follows
the trainer's epoch), and DDP with two gloo ranks under torchrun, resumed too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")
L = pytest.importorskip("lightning")

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402
from lightning_ddp import Data  # noqa: E402 - the DDP script's DataModule: the docs' recipe, once

SHARD = 8  # records per shard; every epoch end publishes one more
HERE = os.path.dirname(os.path.abspath(__file__))


class Recorder(L.LightningModule):
    """A one-layer model that records the ids it trains on, and grows the cache after each epoch."""

    def __init__(self, cache=None, grow: bool = True, loader=None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.cache = cache
        self.grow = grow
        self.loader = loader
        self.ids: dict[int, list[int]] = {}
        self.batches: dict[int, int] = {}
        self.lengths: dict[int, object] = {}
        self.planned: dict[int, tuple[int, int]] = {}

    def on_train_epoch_start(self) -> None:
        self.ids[self.current_epoch] = []
        self.batches[self.current_epoch] = 0

    def training_step(self, batch, batch_idx):
        if batch_idx == 0 and self.loader is not None:
            self.planned[self.current_epoch] = (self.loader.last_epoch.number, self.loader.last_epoch.batches())
            try:
                self.lengths[self.current_epoch] = len(self.loader)
            except TypeError as exc:
                self.lengths[self.current_epoch] = str(exc)
        self.ids[self.current_epoch] += batch["id"].tolist()
        self.batches[self.current_epoch] += 1
        return self.layer(batch["x"].reshape(len(batch["x"]), -1)).pow(2).mean()

    def on_train_epoch_end(self) -> None:
        if self.grow and self.global_rank == 0:
            write_shards(self.cache, [SHARD], first_id=1000 * (self.current_epoch + 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(tmp_path, epochs: int, **kwargs) -> L.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0, **kwargs)


def _quiet():
    # Lightning's advice on worker counts and log intervals is beside the point here.
    warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|does not have many workers).*")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [0, 2])
def test_fit_reads_every_grown_snapshot_once(id_cache, tmp_path, workers):
    written = write_shards(id_cache, [SHARD, SHARD - 3])
    loader = growcache.make_torch_loader(id_cache, 4, num_workers=workers, seed=1)
    model = Recorder(id_cache, loader=loader)
    _quiet()
    trainer = _trainer(tmp_path, 3)
    trainer.fit(model, datamodule=Data(loader))
    for epoch in range(3):
        expected = written + [i for e in range(epoch) for i in range(1000 * (e + 1), 1000 * (e + 1) + SHARD)]
        assert sorted(model.ids[epoch]) == sorted(expected), f"epoch {epoch}: not every record exactly once"
    # Lightning reads a loader's length once, at the first epoch, and would stop every later
    # epoch there: the loader has none (a clear TypeError, which Lightning reads as unknown).
    assert trainer.num_training_batches == float("inf")
    assert all("growcache loader has no len()" in str(m) for m in model.lengths.values()), model.lengths
    # Each epoch's planned length is there to read, and Lightning's epoch is the loader's.
    assert model.planned == {e: (e, model.batches[e]) for e in range(3)}


def test_len_is_a_clear_type_error_before_during_and_after_an_epoch(id_cache):
    write_shards(id_cache, [SHARD])
    loader = growcache.make_torch_loader(id_cache, 4, num_workers=0)
    with pytest.raises(TypeError, match="growcache loader has no len") as info:
        len(loader)
    assert "last_epoch.batches()" in str(info.value)
    batches = 0
    for _batch in loader:
        with pytest.raises(TypeError, match="growcache loader has no len"):
            len(loader)
        batches += 1
    assert loader.last_epoch.batches() == batches == 2
    with pytest.raises(TypeError, match="growcache loader has no len"):
        len(loader)


@pytest.mark.timeout(240)
def test_resume_reads_the_trainers_epoch_order(id_cache, tmp_path):
    """A run resumed from an end-of-epoch checkpoint, with a new loader (a new process's), reads
    epochs 2 and 3 in their own order, not in the order of the loader's epochs 0 and 1 again."""
    write_shards(id_cache, [5, 7, 6, 4, 8, 3])
    options = dict(num_workers=0, seed=4, shuffle_buffer=0)  # ids in shard order: the order is visible
    reference = growcache.make_torch_loader(id_cache, 4, **options)
    expected = {}
    for epoch in range(4):
        reference.set_epoch(epoch)
        expected[epoch] = [i for b in reference for i in b["id"].tolist()]
    assert len({tuple(v) for v in expected.values()}) == 4, "epochs must differ in order for this test to mean much"

    _quiet()
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)  # at each epoch end
    loader = growcache.make_torch_loader(id_cache, 4, **options)
    first = Recorder(id_cache, grow=False, loader=loader)
    _trainer(tmp_path, 2, enable_checkpointing=True, callbacks=[checkpoints]).fit(first, datamodule=Data(loader))
    assert first.ids == {0: expected[0], 1: expected[1]}

    # The docs' recipe: train_dataloader() sets the trainer's epoch (the resumed first epoch).
    loader = growcache.make_torch_loader(id_cache, 4, **options)
    resumed = Recorder(id_cache, grow=False, loader=loader)
    _trainer(tmp_path, 4).fit(resumed, datamodule=Data(loader), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.ids == {2: expected[2], 3: expected[3]}, "the resumed epochs did not read their own order"

    # The loader passed to fit() directly: Lightning announces every later epoch through the
    # loader's sampler, so epoch 3 reads epoch 3's order (the first resumed epoch starts before
    # Lightning announces it: the recipe above covers it).
    direct = Recorder(id_cache, grow=False)
    _trainer(tmp_path, 4).fit(direct, growcache.make_torch_loader(id_cache, 4, **options),
                              ckpt_path=str(tmp_path / "last.ckpt"))
    assert direct.ids[3] == expected[3]


@pytest.mark.timeout(240)
def test_ddp_two_ranks_disjoint_equal_growing_and_resumed(id_cache, tmp_path):
    """torchrun starts 2 CPU ranks (gloo); Lightning's DDP trains 2 epochs, then resumes for a third."""
    written = write_shards(id_cache, [SHARD, 5, 7, 3])
    # --standalone: torchrun's own store takes a free port as it binds it (port 0), and the ranks
    # meet there. A port found free here and bound seconds later, once torchrun has imported
    # torch, could be taken meanwhile by a test that another pytest worker runs.
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
            "--nproc_per_node", "2", os.path.join(HERE, "lightning_ddp.py"), id_cache.path, str(tmp_path),
            str(tmp_path / "ddp.ckpt"), str(SHARD)]
    result = subprocess.run(args, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=220, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(3):
        a, b = (ranks[r][str(epoch)] for r in range(2))
        assert a["batches"] == b["batches"] > 0, (epoch, a["batches"], b["batches"])
        assert not set(a["ids"]) & set(b["ids"]), f"epoch {epoch}: ranks overlap"
        grown = [i for e in range(epoch) for i in range(1000 * (e + 1), 1000 * (e + 1) + SHARD)]
        assert set(a["ids"]) | set(b["ids"]) == set(written + grown), f"epoch {epoch}: records missing"
        # Epoch 2 runs in a new Trainer with a new loader, resumed from the checkpoint.
        assert a["planned_epoch"] == b["planned_epoch"] == epoch, (epoch, a["planned_epoch"], b["planned_epoch"])
