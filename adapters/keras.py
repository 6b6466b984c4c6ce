"""``fit_growing``: Keras ``fit`` in which every epoch trains on its whole, grown snapshot.

Keras 3 (TensorFlow backend) learns an epoch's length from the first pass over a dataset
of unknown cardinality and stops every later epoch at that step count
(tensorflow#41571, keras#15708). A growcache dataset grows between epochs, so plain
``model.fit(ds, epochs=N)`` trains later epochs on a truncated prefix.

``fit_growing`` runs one ``model.fit`` per epoch, so each epoch gets a fresh epoch iterator
that reads to the end of its snapshot, and it drives the callbacks itself around those
calls so that they see one training run: ``on_train_begin``/``on_train_end`` once, one
``History`` across all epochs, epoch numbers that continue from ``initial_epoch``, and
``model.stop_training`` (``EarlyStopping``) honoured between epochs.

:class:`InputStatsCallback` adds growcache's figures of each epoch (is training waiting on
data? how fresh is what it trains on?) to the epoch's logs, so that ``History``,
``TensorBoard`` and ``CSVLogger`` record them.

:class:`BackupAndRestore` is Keras's ``BackupAndRestore`` that also saves the dataset's
position in the epoch, so that a run killed mid-epoch resumes at the batch it stopped at
(Keras's own restores only the epoch number).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from growcache.epoch import trainer_epoch
from growcache.manifest import atomic_write_bytes
from growcache.metrics import DEFAULT_LOGGED, TrainerSource

__all__ = ["BackupAndRestore", "InputStatsCallback", "fit_growing"]

logger = logging.getLogger(__name__)

# Keras warns at the end of every epoch of unknown length; here that end is expected.
_RAN_OUT = r"Your input ran out of data"
_NOT_PER_EPOCH = ("epochs", "initial_epoch", "callbacks", "verbose", "x", "y")


class _RunCallbacks(keras.callbacks.CallbackList):
    """The callbacks of one training run that spans several ``fit`` calls.

    ``fit`` calls ``on_train_begin``/``on_train_end`` on every call; here they fire only
    when :func:`fit_growing` starts and ends the run, so callbacks keep their state
    (``EarlyStopping``'s patience, ``History``, ``TensorBoard``'s writers) across epochs.
    """

    _run_open = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self._run_open:
            self._run_open = True
            super().on_train_begin(logs)

    def end_run(self, logs: dict | None = None) -> None:
        """End the run: the real ``on_train_end``."""
        if self._run_open:
            self._run_open = False
            super().on_train_end(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        pass

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        # ProgbarLogger keeps the previous epoch's step count as this epoch's length.
        if self._progbar is not None:
            self._progbar.target = None
        super().on_epoch_begin(epoch, logs)


def fit_growing(
    model: keras.Model,
    dataset: tf.data.Dataset | Callable[[int], tf.data.Dataset],
    *,
    epochs: int = 1,
    initial_epoch: int = 0,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose: str | int = "auto",
    **fit_kwargs: Any,
) -> keras.callbacks.History:
    """Train ``model`` like ``model.fit(dataset, epochs=...)``, each epoch on the whole grown cache.

    Use it in place of ``model.fit`` for datasets from :func:`growcache.make_tf_dataset`
    (or any dataset whose length changes between epochs). Callbacks behave as in one
    ``fit`` call: ``ModelCheckpoint``, ``EarlyStopping``, ``TensorBoard``,
    ``BackupAndRestore`` and ``History`` included.

    Args:
        model: a compiled Keras model.
        dataset: the training dataset, iterated once per epoch; or a function
            ``epoch -> dataset`` called at the start of each epoch.
        epochs: index of the last epoch plus one, as in ``fit``. Default: ``1``.
        initial_epoch: epoch to start at (resuming). Default: ``0``.
        callbacks: Keras callbacks. Default: ``None``.
        verbose: as in ``fit``. Default: ``"auto"``.
        **fit_kwargs: passed to every ``model.fit`` call (``validation_data``,
            ``validation_freq``, ``class_weight``, ``steps_per_epoch``, ...).

    Returns:
        The ``History`` of the whole run (also ``model.history``).

    Raises:
        TypeError: a keyword that ``fit_growing`` sets itself is in ``fit_kwargs``.
    """
    clash = [k for k in fit_kwargs if k in _NOT_PER_EPOCH]
    if clash:
        raise TypeError(f"fit_growing() sets {clash} itself; pass epochs=/initial_epoch=/callbacks=/verbose= directly")
    # The dataset shuffles itself; Keras would only warn that it ignores shuffle=True.
    fit_kwargs.setdefault("shuffle", False)
    run = _RunCallbacks(
        list(callbacks or []),
        add_history=True,
        add_progbar=verbose != 0,
        verbose=verbose,
        epochs=epochs,
        steps=None,  # unknown, and different every epoch
        model=model,
    )
    model.stop_training = False
    run.on_train_begin()
    # BackupAndRestore sets model._initial_epoch in on_train_begin; fit() would read it on
    # every call, so take it here once and clear it.
    start = getattr(model, "_initial_epoch", None) or initial_epoch
    if hasattr(model, "_initial_epoch"):
        model._initial_epoch = None
    logs: dict | None = None
    backups = [c for c in callbacks or () if isinstance(c, BackupAndRestore)]
    steps = fit_kwargs.get("steps_per_epoch")
    for epoch in range(start, epochs):
        data = dataset(epoch) if callable(dataset) and not isinstance(dataset, tf.data.Dataset) else dataset
        kwargs = fit_kwargs
        done = max((b._restored_steps for b in backups), default=0) if epoch == start else 0
        if steps and done:
            # Keras counts steps_per_epoch again from the restore: the restored epoch trains its rest.
            kwargs = {**fit_kwargs, "steps_per_epoch": max(int(steps) - done, 1)}
        for backup in backups:
            backup._epoch_steps = kwargs.get("steps_per_epoch")
        # Keras under tf.distribute reads a batch from a fresh iterator before each fit()'s epoch:
        # pinned to the trainer's epoch, both iterators read this one epoch of the dataset.
        with warnings.catch_warnings(), trainer_epoch(epoch):
            warnings.filterwarnings("ignore", message=_RAN_OUT)
            history = model.fit(
                data, epochs=epoch + 1, initial_epoch=epoch, callbacks=run, verbose=verbose, **kwargs
            )
        logs = {name: values[-1] for name, values in history.history.items() if values}
        # fit() resets stop_training when it starts, so an EarlyStopping request made at
        # the end of this epoch has to be read now.
        if model.stop_training:
            logger.info("training stopped by a callback after epoch %d", epoch)
            break
    run.end_run(logs)
    return model.history


class InputStatsCallback(keras.callbacks.Callback):
    """Adds growcache's input figures of each epoch to the epoch's ``logs``.

    Callbacks after it in the list, and Keras's own (``History``, the progress bar), see them:
    put ``TensorBoard`` or ``CSVLogger`` after it to record them. Works with ``model.fit``
    and :func:`fit_growing`::

        fit_growing(model, ds, epochs=10, callbacks=[InputStatsCallback(), keras.callbacks.TensorBoard(logs)])

    Inside ``fit``, Keras pulls batches in a compiled ``tf.function``, where no Python runs at
    ``next()``: ``data_wait_s`` is then the time growcache's last stage had no batch ready,
    an upper bound of the wait behind TensorFlow's prefetch (and it is not measured with
    ``reader="tensorflow"``); see :class:`growcache.metrics.InputFigures`.

    Args:
        source: the dataset :func:`growcache.make_tf_dataset` returned (before any
            ``map``), its :class:`~growcache.Cache`, or the cache's directory. Default:
            ``None``: the first growcache dataset of this process whose epoch started in the
            Keras epoch (the training data: validation starts after it).
        figures: the names of :class:`~growcache.metrics.InputFigures` to log (``as_dict``
            names without the prefix). Default: data wait seconds and share, records per
            second, the share of new records, time to the first batch, cache bytes.
        prefix: put before every name. Default: ``"growcache/"``.
    """

    def __init__(self, source: Any = None, *, figures: Sequence[str] = DEFAULT_LOGGED,
                 prefix: str = "growcache/") -> None:
        super().__init__()
        self._source = TrainerSource(source)
        self._names = tuple(figures)
        self._prefix = prefix

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Note when the Keras epoch begins (the training data's epoch starts after it)."""
        self._source.epoch_begins()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Add the epoch's figures to ``logs`` (nothing when no growcache epoch ran in it)."""
        if logs is None:
            return
        figures = self._source.figures()
        if figures is not None:
            values = figures.as_dict(self._prefix)
            logs.update({self._prefix + n: values[self._prefix + n] for n in self._names if self._prefix + n in values})


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` that also saves and restores the dataset's position.

    Keras's own saves the weights every ``save_freq`` batches, but restores only the epoch
    number: a run killed mid-epoch trains that epoch again from its start, on the batches it
    had trained on. This one saves the dataset's ``state_dict()`` with the weights, at the same
    moment, and on restore loads it, so the restored epoch goes on with the batch after the
    save, batch by batch as the uninterrupted run would have, on the saved snapshot::

        ds = growcache.make_tf_dataset(cache, 256, label="y")
        growcache.fit_growing(model, ds, epochs=50,
                              callbacks=[BackupAndRestore("/ckpt/backup", ds, save_freq=500)])

    Train with :func:`growcache.fit_growing` (plain ``fit`` cuts every epoch after the first at
    the first's step count, and the first is the short rest of the restored one).

    A backup is the weights (two files, written in turn) and ``training_metadata.json`` naming
    the current one, with the epoch and the dataset's state; the metadata is written whole
    and renamed into place, so a kill at any moment leaves the previous or the new backup,
    never weights of one and the position of another.

    With an integer ``save_freq``, an epoch in which a backup was saved also saves at its end,
    naming the next epoch: the snapshot of an epoch that has ended is no longer pinned, so a
    backup naming a batch of it could find its shards evicted on restore.

    Args:
        backup_dir: a local directory for this run's backup only, as Keras's.
        dataset: the dataset :func:`growcache.make_tf_dataset` returned (before any ``map``:
            the one whose ``state_dict`` it calls); what training reads may be mapped from it.
        save_freq: ``"epoch"`` or a number of batches, as Keras's. Default: ``"epoch"``.
        delete_checkpoint: delete the backup when training ends. Default: ``True``.
        on_missing: what loading the state does when shards of the saved epoch are gone:
            ``"raise"`` or ``"skip"`` (see ``load_state_dict``). Default: ``"raise"``.

    Raises:
        TypeError: ``dataset`` has no ``state_dict``/``load_state_dict``.
    """

    _METADATA = "training_metadata.json"
    _SLOTS = ("weights-a.weights.h5", "weights-b.weights.h5")

    def __init__(self, backup_dir: str | os.PathLike, dataset: Any, *, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, on_missing: str = "raise") -> None:
        if not callable(getattr(dataset, "state_dict", None)) or not callable(getattr(dataset, "load_state_dict", None)):
            raise TypeError("BackupAndRestore needs the dataset growcache.make_tf_dataset returned (it has state_dict "
                            f"and load_state_dict; a mapped dataset has not), got {type(dataset).__name__}")
        super().__init__(os.fspath(backup_dir), save_freq=save_freq, delete_checkpoint=delete_checkpoint)
        self.dataset = dataset
        self.on_missing = on_missing
        self._steps = 0  # batches taken in this epoch from its iterator
        self._slot: str | None = None  # the weights file the metadata names
        self._in_batch = False
        # The backup names a batch of the running epoch (or a save waits for its end): the epoch's
        # pin ends with the epoch, so the epoch's end saves again, naming the next epoch.
        self._behind = False
        # Batches of the restored epoch the backup had trained (0: none restored, or an epoch's start).
        self._restored_steps = 0
        # The running fit()'s steps_per_epoch under fit_growing (set by it), else None.
        self._epoch_steps: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Restore the weights, the epoch and the dataset's position from the backup, if any."""
        self.dataset.state_dict()  # from now on the dataset's epochs end when training is done with them
        self._load_model()

    def _load_model(self) -> None:
        path = os.path.join(self.backup_dir, self._METADATA)
        if not os.path.exists(path):
            return
        if not self.model.built:
            raise ValueError(f"to restore from {self.backup_dir}, build the model before fit() (call it on a batch)")
        try:
            with open(path) as f:
                metadata = json.load(f)
        except (ValueError, RecursionError):  # damaged on disk: the same fix as a wrong field
            metadata = None
        if not isinstance(metadata, dict) or metadata.get("weights") not in self._SLOTS \
                or not isinstance(metadata.get("epoch"), int) or "growcache" not in metadata:
            raise ValueError(f"{path} is not a backup of growcache's BackupAndRestore: delete {self.backup_dir} to "
                             "start afresh")
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)  # its variables exist before loading
        self.model.load_weights(os.path.join(self.backup_dir, metadata["weights"]))
        self.dataset.load_state_dict(metadata["growcache"], on_missing=self.on_missing)
        self._slot = metadata["weights"]
        self._behind = isinstance(metadata["growcache"], dict) and metadata["growcache"].get("snapshot") is not None
        self._restored_steps = int(metadata["growcache"].get("progress", 0)) if self._behind else 0
        self.model._initial_epoch = metadata["epoch"]
        logger.info("restored from %s: epoch %d, the dataset at batch %d of it", self.backup_dir, metadata["epoch"],
                    metadata["growcache"].get("progress", 0) if isinstance(metadata["growcache"], dict) else 0)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Saves from now on name epoch ``epoch`` (Keras's counts epochs only at their ends: a run
        started at ``initial_epoch`` saved epoch 0 until one ended)."""
        self._current_epoch = epoch
        self._steps = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Save every ``save_freq`` batches, the dataset's state at ``batch + 1`` steps of this
        iterator (Keras's steps restart at 0 in a restored epoch: the dataset adds the saved ones)."""
        self._steps = batch + 1
        self._in_batch = True
        try:
            super().on_train_batch_end(batch, logs)
        finally:
            self._in_batch = False

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Save with ``save_freq="epoch"``; either way, tell the dataset that training is done
        with the epoch (it ends the epoch's lease and pin)."""
        if not (self.params or {}).get("steps"):
            # Without a steps_per_epoch of plain fit(), which reads on from this iterator in the next
            # epoch, Keras drops the iterator now, with whatever it had left (fit_growing's
            # steps_per_epoch, a callback's stop_training): the uninterrupted run reads the next epoch
            # afresh, so the backup names that start, and this epoch's pin (12 hours) goes.
            latest = getattr(getattr(self.dataset, "epochs", None), "latest", None)
            if latest is not None and not latest.ended:
                self._steps = max(self._steps, latest.batches())
        super().on_epoch_end(epoch, logs)  # Keras's: saves from now on name the next epoch
        if self.save_freq == "epoch":
            return
        if self._behind:
            # A backup left naming a batch of this epoch, whose pin ends now, would fail its restore
            # with MissingShardsError once a full cache evicted the epoch's tail (a preemption
            # before the next epoch's first save).
            self._save_model()
        else:
            self.dataset.state_dict(consumed=self._steps)

    def _save_model(self) -> None:
        state = self.dataset.state_dict(consumed=self._steps)
        last = state.get("snapshot") is None or (self._epoch_steps is not None and self._steps >= self._epoch_steps)
        if self._in_batch and self._steps and last:
            # The epoch's last batch (the dataset's, or Keras's under fit_growing's steps_per_epoch):
            # the dataset's state is the next epoch's start already, or will be at the epoch's end,
            # and Keras's epoch number gets there only then, after validation and the other
            # callbacks. A backup of this epoch with that state would train it again (whole, or one
            # step more) on restore; the save waits for on_epoch_end, as save_freq="epoch" saves.
            self._behind = True
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        slot = self._SLOTS[1] if self._slot == self._SLOTS[0] else self._SLOTS[0]
        weights = os.path.join(self.backup_dir, slot)
        self.model.save_weights(weights, overwrite=True)
        with open(weights, "rb+") as f:
            os.fsync(f.fileno())  # on disk before the metadata names it
        metadata = {"epoch": self._current_epoch, "batch": self._last_batch_seen, "weights": slot,
                    "growcache": state}
        # The commit: the weights it names are written whole.
        atomic_write_bytes(os.path.join(self.backup_dir, self._METADATA), json.dumps(metadata).encode(), 0o644)
        self._slot = slot
        self._behind = state.get("snapshot") is not None
