"""PyTorch Lightning: growcache's input figures of each epoch in the trainer's own logger.

:class:`InputStatsCallback` logs, at the end of every training epoch, whether training waited
on data and how fresh the epoch's data was (:class:`growcache.metrics.InputFigures`), through
``LightningModule.log_dict``: to TensorBoard, CSV, W&B, whichever logger the trainer has,
and to ``trainer.callback_metrics`` (so ``ModelCheckpoint`` or ``EarlyStopping`` can watch
them). Under DDP every rank logs the same figures: the loader gathers the most any rank
waited at the end of each epoch.

It subclasses the ``Callback`` of the ``lightning`` package, or of ``pytorch_lightning``
when only that is installed; this module imports it, and ``import growcache`` never does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from growcache.epoch import EpochBookkeeping
from growcache.errors import MissingExtraError
from growcache.metrics import DEFAULT_LOGGED, MeteredLoader, TrainerSource
from growcache.planning import _take_from_fullest
from growcache.resume import ResumableLoader

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as exc:
        raise MissingExtraError("growcache.adapters.lightning needs PyTorch Lightning: pip install lightning") from exc

__all__ = ["InputStatsCallback", "ResumeCallback"]

log = logging.getLogger(__name__)


class InputStatsCallback(Callback):
    """Logs growcache's input figures of each training epoch through the trainer's logger.

    Adopt it in one line::

        trainer = lightning.Trainer(..., callbacks=[InputStatsCallback()])

    Args:
        loader: the loader from :func:`growcache.make_torch_loader`, its cache, or the cache's
            directory. Default: ``None``: the trainer's training loader when it is a growcache
            loader, else the first growcache loader of this process whose epoch started in the
            trainer's epoch (the training data: validation starts after it).
        figures: the names of :class:`~growcache.metrics.InputFigures` to log (``as_dict``
            names without the prefix). Default: data wait seconds and share, records and
            bytes per second, time to the first batch, the share of new records, cache bytes.
        prefix: put before every name. Default: ``"growcache/"``.
    """

    def __init__(self, loader: Any = None, *, figures: Sequence[str] = DEFAULT_LOGGED,
                 prefix: str = "growcache/") -> None:
        super().__init__()
        self._source = TrainerSource(loader) if loader is not None else None
        self._names = tuple(figures)
        self._prefix = prefix

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Find the training loader (at the first epoch) and note when the epoch begins."""
        if self._source is None:
            loader = getattr(trainer, "train_dataloader", None)
            self._source = TrainerSource(loader if isinstance(loader, MeteredLoader) else None)
        self._source.epoch_begins()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Log the epoch's figures with ``pl_module.log_dict`` (nothing when no growcache epoch ran)."""
        figures = self._source.figures() if self._source is not None else None
        if figures is None:
            return
        values = figures.as_dict(self._prefix)
        chosen = {self._prefix + n: values[self._prefix + n] for n in self._names if self._prefix + n in values}
        if chosen:
            # The loader's figures are already the same on every rank (it gathered them).
            pl_module.log_dict(chosen, on_step=False, on_epoch=True, sync_dist=False)


def _cut_back(delivered: list[int], ahead: int) -> tuple[list[int], int]:
    """Each reader's batches of a state saved out of order, ``ahead`` batches fetched ahead of the
    steps taken back, and their sum. Which readers' they were is unknown, and any may have been:
    each goes back by ``ahead``. Every rank goes back by as many in all (readers at 0 leave theirs
    to the fullest), so that DDP ranks still resume the same progress, and yield as many batches."""
    delivered = [int(d) for d in delivered]
    target = max(sum(delivered) - ahead * len(delivered), 0)
    cut = [max(d - ahead, 0) for d in delivered]
    return _take_from_fullest(cut, sum(cut) - target), target


class ResumeCallback(Callback):
    """Makes a resumed Lightning run read a growcache loader where and in the order it stopped.

    Lightning saves ``loader.state_dict()`` in every checkpoint and restores it from one taken
    mid-epoch, but its fetcher reads one batch ahead of the step it checkpoints (Lightning issue
    #18135): the state would count a batch the model never trained on, and the resumed run would
    skip it. This callback sets the saved progress to the batches the epoch's steps processed::

        trainer = lightning.Trainer(..., callbacks=[ModelCheckpoint(every_n_train_steps=500, save_last=True),
                                                    ResumeCallback()])
        trainer.fit(model, datamodule=data, ckpt_path="last.ckpt")  # the resumed epoch goes on batch by batch

    The first epoch of a run resumed from an end-of-epoch checkpoint starts before Lightning
    announces its number, so ``train_dataloader()`` must set it (docs/pytorch.md's recipe:
    ``loader.set_epoch(trainer.fit_loop.epoch_progress.current.processed)``). At every epoch's
    first step this callback logs a WARNING when the loader reads another epoch's order
    than the trainer's epoch.
    """

    def __init__(self) -> None:
        super().__init__()
        self._checked: int | None = None  # the trainer epoch whose loader epoch was checked

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")
        processed = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        # The loaders whose states Lightning listed, in its order (CombinedLoader._state_dicts).
        flattened = getattr(getattr(trainer.fit_loop, "_combined_loader", None), "flattened", None) or []
        stateful = [loader for loader in flattened if callable(getattr(loader, "state_dict", None))
                    and callable(getattr(loader, "load_state_dict", None))]
        if isinstance(states, list) and len(states) == len(stateful):
            # Asked again for the steps' count: a checkpoint one step before the epoch's end, its
            # last batch already fetched, is mid-epoch (the loader alone would name the next epoch).
            for i, loader in enumerate(stateful):
                if isinstance(loader, ResumableLoader):
                    states[i] = loader.state_dict(consumed=processed)
            return
        for state in states or ():  # another Lightning's layout: the progress at least
            if isinstance(state, dict) and state.get("format") == "growcache-loader" and state.get("snapshot"):
                ahead = int(state["progress"]) - processed
                if ahead > 0 and isinstance(state.get("delivered"), list):
                    state["delivered"], state["progress"] = _cut_back(state["delivered"], ahead)
                else:
                    state["progress"] = min(int(state["progress"]), processed)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Warn when a growcache loader's epoch is not the trainer's (an epoch's order would repeat)."""
        # At the epoch's first step, not its start: Lightning makes a later epoch's iterator after
        # on_train_epoch_start.
        if self._checked == trainer.current_epoch:
            return
        self._checked = trainer.current_epoch
        loaders = trainer.train_dataloader
        if isinstance(loaders, Mapping):
            loaders = list(loaders.values())
        elif not isinstance(loaders, Sequence):
            loaders = [loaders]
        for loader in loaders:
            epoch = loader.last_epoch if isinstance(loader, EpochBookkeeping) else None
            if epoch is not None and epoch.number != trainer.current_epoch:
                log.warning(
                    "trainer epoch %d reads the growcache loader's epoch %d, in that epoch's shard order: the "
                    "loader's iterator was made before Lightning announced the epoch (a run resumed from an "
                    "end-of-epoch checkpoint, or a reloaded loader). Set the epoch where train_dataloader() "
                    "returns the loader: loader.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)"
                    " (docs/pytorch.md, PyTorch Lightning)", trainer.current_epoch, epoch.number)
