"""A Lightning trainer process for tests/integrations/test_lightning_resume.py: fits a tiny model
on a growcache loader through docs/pytorch.md's recipe (the DataModule, ``ModelCheckpoint`` with
``save_last=True``, ``ResumeCallback``), logs each step's epoch and ids, and SIGKILLs its whole
process group (itself and its loader workers: a preempted machine, no cleanup runs) at a given
step. Run again with ``"resume": true``, it fits from ``last.ckpt`` in a new process.

Usage: python lightning_kill.py '{"cache": DIR, "out": DIR, "workers": N, "epochs": N,
    "checkpoint": "mid"|"end", "every": STEPS, "kill_at": STEP, "resume": BOOL}'
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

import lightning as L
import torch

import growcache
from growcache.adapters.lightning import ResumeCallback
from lightning_ddp import Data


class Model(L.LightningModule):
    def __init__(self, log, kill_at: int | None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.log_file = log
        self.kill_at = kill_at
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.log_file.write(json.dumps([self.current_epoch, batch["id"].tolist()]) + "\n")
        self.log_file.flush()
        self.steps += 1
        if self.steps == self.kill_at:  # before this step's checkpoint: the last is an earlier one
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return self.layer(batch["x"].reshape(len(batch["x"]), -1)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(args: dict) -> None:
    warnings.filterwarnings("ignore")
    loader = growcache.make_torch_loader(args["cache"], 8, num_workers=args["workers"], shuffle_buffer=20, seed=3)
    callbacks: list = [ResumeCallback()]
    if not args["resume"]:
        if args["checkpoint"] == "mid":
            callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
                dirpath=args["out"], every_n_train_steps=args["every"], save_last=True, save_top_k=0))
        else:  # ModelCheckpoint's default: at each epoch's end
            callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args["out"], save_last=True))
    trainer = L.Trainer(max_epochs=args["epochs"], accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=args["out"],
                        num_sanity_val_steps=0, callbacks=callbacks)
    name = "resume" if args["resume"] else "kill"
    with open(os.path.join(args["out"], f"{name}.log"), "w") as log:
        trainer.fit(Model(log, None if args["resume"] else args["kill_at"]), datamodule=Data(loader),
                    ckpt_path=os.path.join(args["out"], "last.ckpt") if args["resume"] else None)
    loader.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
