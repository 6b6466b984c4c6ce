"""growcache's InputStatsCallback inside a real Lightning Trainer: the figures of every epoch
reach the trainer's logger (a CSVLogger here), and freshness follows the cache's growth."""

from __future__ import annotations

import csv
import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")
L = pytest.importorskip("lightning")

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_ddp import Data  # noqa: E402 - the docs' DataModule recipe
from growcache.adapters.lightning import InputStatsCallback  # noqa: E402


class Grower(L.LightningModule):
    """A one-layer model; the cache grows by one shard of 8 records after each epoch."""

    def __init__(self, cache) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.cache = cache

    def training_step(self, batch, batch_idx):
        return self.layer(batch["x"].reshape(len(batch["x"]), -1)).pow(2).mean()

    def on_train_epoch_end(self) -> None:
        write_shards(self.cache, [8], first_id=1000 * (self.current_epoch + 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("explicit", [False, True])
def test_the_callback_logs_each_epoch_through_the_trainers_logger(id_cache, tmp_path, explicit):
    write_shards(id_cache, [8, 8])
    loader = growcache.make_torch_loader(id_cache, 4, num_workers=0)
    warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|does not have many workers).*")
    logger = L.pytorch.loggers.CSVLogger(str(tmp_path), name="run")
    callback = InputStatsCallback(loader if explicit else None)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=logger, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                        num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(Grower(id_cache), datamodule=Data(loader))
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("growcache/data_wait_s")]
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    for row in rows:
        assert 0 <= float(row["growcache/data_wait_s"]) and 0 <= float(row["growcache/data_wait_share"]) <= 1
        assert float(row["growcache/records_per_s"]) > 0 and float(row["growcache/cache_bytes"]) > 0
    # 16 records, then 24 with 8 new, then 32 with 8 new; the first epoch has no "new".
    assert rows[0]["growcache/new_share"] == ""
    assert [float(r["growcache/new_share"]) for r in rows[1:]] == [pytest.approx(8 / 24), pytest.approx(8 / 32)]
    assert trainer.callback_metrics["growcache/new_share"] == pytest.approx(8 / 32)
    loader.close()
