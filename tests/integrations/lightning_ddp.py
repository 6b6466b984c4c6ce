"""Run by tests/integrations/test_lightning.py under torchrun (2 CPU ranks, gloo): Lightning DDP
on a growing cache for 2 epochs, then a resume from the checkpoint with a new loader (as a new
process would build it) for a third; writes each rank's ids per epoch.

Usage: torchrun --nproc_per_node 2 lightning_ddp.py CACHE_DIR OUT_DIR CHECKPOINT SHARD_RECORDS
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402


class Data(L.LightningDataModule):
    """docs/pytorch.md's recipe: ``train_dataloader()`` sets the epoch the trainer is about to run,
    so that a resumed run's first epoch reads its own order (Lightning announces every later epoch
    itself, through the loader's sampler). Not ``trainer.current_epoch``: resumed from an
    end-of-epoch checkpoint it still names the finished epoch here. test_lightning.py,
    test_lightning_resume.py and lightning_kill.py use it too."""

    def __init__(self, loader) -> None:
        super().__init__()
        self.loader = loader

    def train_dataloader(self):
        self.loader.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)
        return self.loader


class Model(L.LightningModule):
    def __init__(self, cache, loader, shard: int, epochs: dict) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.cache = cache
        self.loader = loader
        self.shard = shard
        self.epochs = epochs

    def on_train_epoch_start(self) -> None:
        self.epochs[self.current_epoch] = {"ids": [], "batches": 0, "planned_epoch": None}

    def training_step(self, batch, batch_idx):
        record = self.epochs[self.current_epoch]
        if batch_idx == 0:
            record["planned_epoch"] = self.loader.last_epoch.number
        record["ids"] += batch["id"].tolist()
        record["batches"] += 1
        return self.layer(batch["x"].reshape(len(batch["x"]), -1)).pow(2).mean()

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0:
            write_shards(self.cache, [self.shard], first_id=1000 * (self.current_epoch + 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(cache, shard: int, epochs: int, records: dict, checkpoint: str | None) -> L.Trainer:
    # Built before the trainer (and, the first time, before the process group exists), as most
    # scripts do: the loader learns its rank when its first epoch starts.
    loader = growcache.make_torch_loader(cache, 4, num_workers=1, seed=2)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0)
    trainer.fit(Model(cache, loader, shard, records), datamodule=Data(loader), ckpt_path=checkpoint)
    return trainer


def main() -> None:
    cache_dir, out, checkpoint, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    warnings.filterwarnings("ignore")
    cache = growcache.Cache(cache_dir)
    records: dict[int, dict] = {}
    trainer = _fit(cache, shard, 2, records, None)
    trainer.save_checkpoint(checkpoint)
    trainer = _fit(cache, shard, 3, records, checkpoint)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
