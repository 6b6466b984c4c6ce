"""A Lightning run stopped mid-epoch resumes from ``last.ckpt`` batch by batch (issue 30): Lightning
restores the loader's state from a mid-epoch checkpoint, and ``ResumeCallback`` makes that state
count the batches the trainer stepped on, not the one Lightning's fetcher read ahead."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402
from growcache.adapters.lightning import ResumeCallback  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, stop: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.seen: list[list[int]] = []
        self.stop = stop

    def training_step(self, batch, index):
        self.seen.append(batch["id"].tolist())
        if len(self.seen) == self.stop:
            raise RuntimeError("planted crash")  # mid-epoch: Lightning saves nothing on it
        return self.layer(batch["x"].reshape(len(batch["x"]), -1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|does not have many workers).*")
    return L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0, **kwargs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_stopped_mid_epoch_resumes_from_last_ckpt_batch_by_batch(id_cache, tmp_path, workers):
    write_shards(id_cache, [37, 50, 23, 41, 60, 13, 29])

    def loader():
        return growcache.make_torch_loader(id_cache, 8, num_workers=workers, shuffle_buffer=20, seed=3)

    whole = Model()
    _trainer(tmp_path).fit(whole, loader())
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, save_last=True,
                                                      save_top_k=0)
    first = Model(stop=11)
    with pytest.raises(RuntimeError, match="planted crash"):
        _trainer(tmp_path, callbacks=[checkpoints, ResumeCallback()]).fit(first, loader())
    resumed = Model()
    _trainer(tmp_path, callbacks=[ResumeCallback()]).fit(resumed, loader(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert first.seen[:9] + resumed.seen == whole.seen  # the checkpoint after step 9, then the rest
