"""A Lightning run resumes from ``last.ckpt`` where it stopped (issue 30). Mid-epoch, Lightning
restores the loader's state, and ``ResumeCallback`` makes that state count the batches the trainer
stepped on, not the one Lightning's fetcher read ahead. From an end-of-epoch checkpoint (what
``ModelCheckpoint`` writes by default), the docs' ``train_dataloader()`` recipe sets the epoch the
trainer is about to run, so the resumed epoch reads its own order, not the finished epoch's. And a
trainer process killed with SIGKILL at a random batch resumes in a new process batch by batch,
from a mid-epoch and from an end-of-epoch checkpoint (``lightning_kill.py``)."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402
from growcache.adapters.lightning import ResumeCallback  # noqa: E402
from lightning_ddp import Data  # noqa: E402 - the docs' DataModule recipe

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHARDS = [37, 50, 23, 41, 60, 13, 29]  # 253 records, 32-33 batches of 8


class Model(L.LightningModule):
    def __init__(self, stop: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.seen: list[list[int]] = []
        self.epochs: list[int] = []  # the trainer's epoch of each batch in seen
        self.stop = stop

    def training_step(self, batch, index):
        self.seen.append(batch["id"].tolist())
        self.epochs.append(self.current_epoch)
        if len(self.seen) == self.stop:
            raise RuntimeError("planted crash")  # mid-epoch: Lightning saves nothing on it
        return self.layer(batch["x"].reshape(len(batch["x"]), -1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|does not have many workers).*")
    kwargs.setdefault("max_epochs", 1)
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0, **kwargs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("before_end", [False, True])
def test_a_run_stopped_mid_epoch_resumes_from_last_ckpt_batch_by_batch(id_cache, tmp_path, workers, before_end):
    # before_end: a checkpoint one step before the epoch's end. Lightning's fetcher has read the
    # epoch's last batch: the loader has handed over every batch, yet the trainer's epoch goes on.
    write_shards(id_cache, SHARDS)

    def loader():
        return growcache.make_torch_loader(id_cache, 8, num_workers=workers, shuffle_buffer=20, seed=3)

    whole = Model()
    _trainer(tmp_path, max_epochs=2).fit(whole, loader())
    batches = whole.epochs.count(0)
    saved, every, stop = (batches - 1, batches - 1, batches) if before_end else (9, 3, 11)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=every,
                                                      save_last=True, save_top_k=0)
    first = Model(stop=stop)
    with pytest.raises(RuntimeError, match="planted crash"):
        _trainer(tmp_path, max_epochs=2, callbacks=[checkpoints, ResumeCallback()]).fit(first, loader())
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["loops"]["fit_loop"]["state_dict"]
    assert [(s["epoch"], s["progress"], bool(s["snapshot"])) for s in state["combined_loader"]] == [(0, saved, True)]
    resumed = Model()
    _trainer(tmp_path, max_epochs=2, callbacks=[ResumeCallback()]).fit(resumed, loader(),
                                                                        ckpt_path=str(tmp_path / "last.ckpt"))
    assert first.seen[:saved] + resumed.seen == whole.seen  # the checkpoint's step, then the rest, epoch 1 too
    assert resumed.epochs == whole.epochs[saved:]


def _reference(cache, epochs: int, **options) -> list[tuple[int, list[int]]]:
    """Each batch of ``epochs`` uninterrupted epochs, with its epoch, read without a trainer."""
    with growcache.make_torch_loader(cache, 8, resume_ttl=0, **options) as loader:
        return [(epoch, batch["id"].tolist()) for epoch in range(epochs) for batch in loader]


class Validated(Model):
    def validation_step(self, batch, index):
        pass


class ValidatedData(Data):
    def val_dataloader(self):
        return torch.utils.data.DataLoader([{"x": torch.zeros(32)}] * 4, batch_size=4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("validate", [False, True])  # with validation, ModelCheckpoint saves after it
def test_an_end_of_epoch_checkpoint_resumes_in_the_next_epochs_order(id_cache, tmp_path, caplog, validate):
    model, data = (Validated, ValidatedData) if validate else (Model, Data)
    write_shards(id_cache, SHARDS)
    options = dict(num_workers=0, shuffle_buffer=20, seed=3)
    whole = _reference(id_cache, 3, **options)
    orders = {e: [ids for epoch, ids in whole if epoch == e] for e in range(3)}
    assert orders[1] != orders[2], "epochs must differ in order for this test to mean much"

    # ModelCheckpoint's default: a checkpoint at each epoch's end, through the docs' recipe.
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    first = model()
    _trainer(tmp_path, max_epochs=2, callbacks=[checkpoints, ResumeCallback()]).fit(
        first, datamodule=data(growcache.make_torch_loader(id_cache, 8, **options)))
    assert list(zip(first.epochs, first.seen)) == whole[:len(first.seen)] == [b for b in whole if b[0] < 2]
    progress = torch.load(tmp_path / "last.ckpt", weights_only=False)["loops"]["fit_loop"]["epoch_progress"]
    # Written at epoch 1's end: trainer.current_epoch still names epoch 1 when the resumed run
    # asks for its train loader; the epochs processed (2) name the next.
    assert (progress["current"]["completed"], progress["current"]["processed"]) == (1, 2)

    resumed = model()
    with caplog.at_level(logging.WARNING, logger="growcache.adapters.lightning"):
        _trainer(tmp_path, max_epochs=3, callbacks=[ResumeCallback()]).fit(
            resumed, datamodule=data(growcache.make_torch_loader(id_cache, 8, **options)),
            ckpt_path=str(tmp_path / "last.ckpt"))
    assert set(resumed.epochs) == {2} and resumed.seen == orders[2], "the resumed epoch read another epoch's order"
    assert not [r for r in caplog.records if r.name == "growcache.adapters.lightning"], caplog.text

    # The loader given to fit() directly: nothing sets the first resumed epoch before its iterator
    # is made, and ResumeCallback says so, naming the recipe.
    with caplog.at_level(logging.WARNING, logger="growcache.adapters.lightning"):
        _trainer(tmp_path, max_epochs=3, callbacks=[ResumeCallback()]).fit(
            model(), growcache.make_torch_loader(id_cache, 8, **options), ckpt_path=str(tmp_path / "last.ckpt"))
    warned = [r.getMessage() for r in caplog.records if r.name == "growcache.adapters.lightning"]
    assert len(warned) == 1 and "trainer epoch 2 reads the growcache loader's epoch 0" in warned[0], caplog.text
    assert "set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)" in warned[0]


def test_the_docs_recipe_is_the_one_tested():
    with open(os.path.join(ROOT, "docs", "pytorch.md")) as f:
        docs = f.read()
    assert "self.loader.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)" in docs
    assert "set_epoch(self.trainer.current_epoch)" not in docs


def _trainer_process(tmp_path, **args) -> subprocess.CompletedProcess:
    args = {"cache": str(tmp_path / "cache"), "out": str(tmp_path), **args}
    # A session of its own: the kill takes the trainer's whole process group, workers included.
    return subprocess.run([sys.executable, os.path.join(HERE, "lightning_kill.py"), json.dumps(args)],
                          capture_output=True, text=True, timeout=150, start_new_session=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)]),
                               "OMP_NUM_THREADS": "1"})


def _steps(tmp_path, name: str) -> list[tuple[int, list[int]]]:
    return [tuple(json.loads(line)) for line in (tmp_path / f"{name}.log").read_text().splitlines()]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("checkpoint", ["mid", "end"])
def test_a_trainer_killed_at_a_random_batch_resumes_from_last_ckpt_batch_by_batch(id_cache, tmp_path, checkpoint):
    """SIGKILL mid-epoch 1 after checkpoints every few steps ("mid"), or mid-epoch 2 after the
    checkpoint at epoch 1's end ("end"); a new process resumes from last.ckpt and runs to the end
    of epoch 2. The steps up to the checkpoint plus the resumed ones are the uninterrupted run's."""
    write_shards(id_cache, SHARDS)
    whole = _reference(id_cache, 3, num_workers=2, shuffle_buffer=20, seed=3)
    per_epoch = [sum(1 for e, _ in whole if e == epoch) for epoch in range(3)]
    rng = random.Random(f"{checkpoint}-{time.time_ns()}")
    every = rng.choice([3, 4, 5])
    killed_epoch = 1 if checkpoint == "mid" else 2
    first_step = sum(per_epoch[:killed_epoch]) + 1
    kill_at = rng.randrange(first_step, first_step + per_epoch[killed_epoch])  # a step of that epoch
    killed = _trainer_process(tmp_path, workers=2, epochs=3, checkpoint=checkpoint, every=every, kill_at=kill_at,
                              resume=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    before = _steps(tmp_path, "kill")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"]
    expected_save = (kill_at - 1) // every * every if checkpoint == "mid" else first_step - 1
    assert len(before) == kill_at and saved == expected_save, (kill_at, every, saved)
    resumed = _trainer_process(tmp_path, workers=2, epochs=3, checkpoint=checkpoint, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rest = _steps(tmp_path, "resume")
    print(f"{checkpoint}: killed at step {kill_at}, checkpoint at {saved} (every {every}) of {len(whole)}")
    assert before[:saved] + rest == whole, f"killed at step {kill_at}, resumed from step {saved}"
    assert "reads the growcache loader's epoch" not in killed.stderr + resumed.stderr  # ResumeCallback's warning


def _slow_first_worker(worker_id: int) -> None:
    if worker_id == 0:
        time.sleep(2)  # the other worker's batches overtake its own: a state names each worker's


@pytest.mark.timeout(120)
def test_a_state_saved_out_of_order_cut_back_in_another_lightnings_layout_still_loads(id_cache, tmp_path):
    # Where Lightning lays its checkpoint out otherwise, the callback cuts the saved progress back to
    # the steps processed; a state naming each reader's batches then no longer added up, and its
    # resume raised. Which reader's batches were fetched ahead is unknown: each reader goes back.
    write_shards(id_cache, SHARDS)
    options = dict(num_workers=2, shuffle_buffer=20, seed=3, in_order=False, persistent_workers=False)
    with growcache.make_torch_loader(id_cache, 8, worker_init_fn=_slow_first_worker, **options) as cut:
        iterator = iter(cut)
        fetched = [next(iterator)["id"].tolist() for _ in range(6)]  # the trainer stepped on 5
        state = json.loads(json.dumps(cut.state_dict()))
        del iterator
    assert state["progress"] == 6 and state["delivered"][0] < state["delivered"][1]
    trainer = _trainer(tmp_path)  # never fitted: no combined loader to match the states to
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 5
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [state]}}}}
    ResumeCallback().on_save_checkpoint(trainer, None, checkpoint)
    # Two readers back by one each, the slow one's taken from the fast one: every rank of a DDP run
    # resumes the same progress whatever its readers' counts.
    assert state["progress"] == 4 and state["delivered"] == [0, 4]
    with growcache.make_torch_loader(id_cache, 8, **options) as resumed:
        resumed.load_state_dict(state)
        rest = [i for batch in resumed for i in batch["id"].tolist()]
    trained = [i for batch in fetched[:5] for i in batch]
    assert sorted(set(trained) | set(rest)) == list(range(sum(SHARDS))), "none of the epoch lost"
    assert not set(fetched[5]) - set(rest), "the batch fetched ahead is read again"
