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

from collections.abc import Sequence
from typing import Any

from growcache.errors import MissingExtraError
from growcache.metrics import DEFAULT_LOGGED, MeteredLoader, TrainerSource

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as exc:
        raise MissingExtraError("growcache.adapters.lightning needs PyTorch Lightning: pip install lightning") from exc

__all__ = ["InputStatsCallback"]


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
