"""docs/pytorch.md's Lightning recipe for step-based LR schedules (issue 32): a growcache loader has
no length, so Lightning's ``estimated_stepping_batches`` has no epoch length to count; the
schedule's length is ``max_steps``, read from the trainer. Run with a resume from a mid-epoch
checkpoint through the real trainer: the schedule ends exactly at ``max_steps``, and the resumed
epoch reads the trainer's epoch (reading the length through ``estimated_stepping_batches`` with
``max_epochs`` set would load the train loader before the checkpoint is restored, Lightning
issue #20550, and the resumed run would read epoch 0's order again).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")
L = pytest.importorskip("lightning")

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402
from lightning_ddp import Data  # noqa: E402 - the docs' DataModule recipe

OPTIONS = dict(num_workers=0, seed=4, shuffle_buffer=0)  # ids in shard order: each epoch's order is visible


class OneCycle(L.LightningModule):
    """The docs' recipe: OneCycleLR over the trainer's max_steps, stepped every batch."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.interrupt_at = interrupt_at  # the run ends here, as a preempted job's would
        self.ids: dict[int, list[int]] = {}
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        self.ids.setdefault(self.current_epoch, []).extend(batch["id"].tolist())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return self.layer(batch["x"].reshape(len(batch["x"]), -1)).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == self.interrupt_at:
            self.trainer.should_stop = True

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        # Not estimated_stepping_batches: with max_epochs set it loads the train loader now, before
        # a checkpoint is restored (Lightning #20550), and the loader's saved state is dropped.
        total = self.trainer.max_steps
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0, **kwargs)


@pytest.mark.timeout(180)
def test_one_cycle_over_max_steps_with_a_mid_epoch_resume(id_cache, tmp_path):
    write_shards(id_cache, [5, 7, 6, 4, 8, 3])
    reference = growcache.make_torch_loader(id_cache, 4, **OPTIONS)
    expected, per_epoch = {}, set()
    for epoch in range(4):
        reference.set_epoch(epoch)
        expected[epoch] = [i for b in reference for i in b["id"].tolist()]
        per_epoch.add(reference.last_epoch.batches())
    (per_epoch,) = per_epoch
    assert len({tuple(v) for v in expected.values()}) == 4, "epochs must differ in order for this test to mean much"
    stop, total = per_epoch + 3, 3 * per_epoch  # stop in epoch 1; the schedule spans 3 epochs' steps
    warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|does not have many workers).*")

    # The schedule spans max_steps; this first run is cut short mid-epoch 1, after a checkpoint.
    first = OneCycle(interrupt_at=stop)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path), filename="mid", every_n_train_steps=stop,
                                                     save_top_k=-1)
    trainer = _trainer(tmp_path, max_steps=total, max_epochs=10, callbacks=[checkpoint])
    loader = growcache.make_torch_loader(id_cache, 4, **OPTIONS)
    trainer.fit(first, datamodule=Data(loader))
    assert trainer.global_step == stop and first.ids[0] == expected[0]
    assert first.ids[1] == expected[1][:3 * 4], "stopped mid-epoch 1"

    # A new process: a new loader and model, resumed mid-epoch 1, run to the schedule's end.
    resumed = OneCycle()
    trainer = _trainer(tmp_path, max_steps=total, max_epochs=10)
    loader = growcache.make_torch_loader(id_cache, 4, **OPTIONS)
    trainer.fit(resumed, datamodule=Data(loader), ckpt_path=str(tmp_path / "mid.ckpt"))
    assert trainer.global_step == total
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == total and scheduler.total_steps == total, "the schedule ends at max_steps"
    assert resumed.lrs[-1] < first.lrs[0] < max(first.lrs + resumed.lrs), "one cycle: warm up, then anneal"
    # The resumed epoch is the trainer's epoch 1 (read again from its start, or its rest), never epoch 0's order.
    first_resumed = min(resumed.ids)
    assert first_resumed == 1 and resumed.ids[1] == expected[1][-len(resumed.ids[1]):], resumed.ids[1]
    later = [e for e in resumed.ids if e > 1]
    assert later and all(resumed.ids[e] == expected[e][:len(resumed.ids[e])] for e in later), "later epochs: their order"
