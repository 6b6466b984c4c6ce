"""Exact mid-epoch resume of make_tf_dataset (issue 30): an eager training process killed with
SIGKILL at a random batch resumes from its last saved state batch by batch as the uninterrupted
epoch, while the cache grew and evicted during the downtime (the pin kept the shards it needs);
Keras with growcache's BackupAndRestore and fit_growing, stopped mid-epoch, trains the rest of the
epoch, each record once, in the uninterrupted order; reader="tensorflow" re-reads and skips; a
hostile state is refused naming its field."""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ID_SCHEMA, grow_while_down, write_shards

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from growcache import Cache, MissingShardsError  # noqa: E402
from growcache.adapters.keras import BackupAndRestore, fit_growing  # noqa: E402
from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402

TRAINER = os.path.join(os.path.dirname(__file__), "tf_resume_trainer.py")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # conftest, for the child
SHARDS = [37, 50, 23, 41, 60, 13, 29]  # 253 records, 32-33 batches of 8


def _dataset(cache, batch_size=8, **kwargs):
    kwargs = {"shuffle_buffer": 20, "seed": 3, "cycle_length": 3, **kwargs}
    return make_tf_dataset(cache, batch_size, **kwargs)


def _ids(ds) -> list[list[int]]:
    return [batch["id"].numpy().tolist() for batch in ds]


def _reference(cache, epoch=1, **kwargs) -> list[list[int]]:
    ds = _dataset(cache, resume_ttl=0, **kwargs)
    ds.epochs.set_epoch(epoch)
    return _ids(ds)


@pytest.fixture
def grown(id_cache):
    write_shards(id_cache, SHARDS)
    return id_cache


def test_a_killed_eager_loop_resumes_batch_by_batch_while_the_cache_grows_and_evicts(tmp_path):
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, SHARDS)
    first = {s.path for s in cache.list_shards()}
    expected = _reference(cache)  # 3 readers round-robin, the last rounds uneven
    rng = random.Random(time.time_ns())
    kill_at, save_every = rng.randrange(5, len(expected) - 1), rng.choice([2, 3])
    args = {"cache": str(tmp_path / "cache"), "out": str(tmp_path), "cycle_length": 3, "kill_at": kill_at,
            "save_every": save_every}
    killed = subprocess.run([sys.executable, TRAINER, json.dumps(args)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": TESTS})
    assert killed.returncode == -9, killed.stderr
    saved = json.loads((tmp_path / "state.json").read_text())
    before = [json.loads(line) for line in (tmp_path / "kill.log").read_text().splitlines()]
    print(f"kill at batch {kill_at}, saved at {saved['progress']} of {len(expected)}")
    assert len(before) == kill_at and saved["progress"] == kill_at // save_every * save_every
    # The downtime: the cache grows past its budget and evicts; the killed run's pin keeps the
    # shards the rest of the epoch reads.
    cache, _ = grow_while_down(tmp_path / "cache", first)
    ds = _dataset(cache)
    ds.load_state_dict(saved)
    assert before[:saved["progress"]] + _ids(ds) == expected
    assert ds.epochs.latest.number == 1 and cache.stats().pins == 0  # the resumed epoch's end released the pin
    assert ds.state_dict()["epoch"] == 2 and ds.state_dict()["snapshot"] is None


def test_a_state_saved_while_prefetch_holds_the_epochs_last_batches_resumes_them(grown):
    # The pipeline reads an epoch out before the loop takes its last batches (prefetch): a state
    # saved then names the epoch, its progress and its pin, and the resume delivers the tail.
    expected = _reference(grown)
    ds = _dataset(grown)
    ds.epochs.set_epoch(1)
    iterator = iter(ds)
    got = [next(iterator)["id"].numpy().tolist() for _ in range(len(expected) - 1)]
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["epoch"] == 1 and state["progress"] == len(expected) - 1 and grown.stats().pins == 1
    del iterator
    assert grown.stats().pins == 1  # kept for the resume
    resumed = _dataset(grown)
    resumed.load_state_dict(state)
    assert got + _ids(resumed) == expected



def test_a_state_saved_out_of_order_resumes_here_and_saves_again_exactly(grown):
    # A torch loader's DataLoader(in_order=False) names each reader's batches (version 2); resumed
    # here, the batches come in turn but name no reader, so every later state fell back to the
    # resume's point (records read twice) and the lease held the whole snapshot.
    from growcache.planning import round_robin_progress
    from growcache.resume import loader_state

    expected = _reference(grown)  # 3 readers in turn: batch n is reader following(n)'s
    saver = _dataset(grown)
    saver.epochs.set_epoch(1)
    epoch = saver.epochs.start()
    counts = list(epoch.read_points().counts)
    streams: list[list[list[int]]] = [[], [], []]
    for n, batch in enumerate(expected):
        streams[round_robin_progress(counts, n)[1]].append(batch)
    taken, at = [], [0, 0, 0]
    for reader in (2, 2, 2, 2, 1, 2, 2, 0):  # reader 2 fast, reader 0 slow
        taken.append(streams[reader][at[reader]])
        at[reader] += 1
        epoch.consume(round_robin=False, reader=reader)
    state = json.loads(json.dumps(loader_state(saver.epochs, epoch)))
    assert state["version"] == 2 and state["delivered"] == [1, 1, 6]
    epoch.end()
    resumed = _dataset(grown)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    middle = [next(iterator)["id"].numpy().tolist() for _ in range(5)]
    again = json.loads(json.dumps(resumed.state_dict()))
    assert again["progress"] == state["progress"] + 5 and again["delivered"] == [3, 3, 7]
    del iterator
    rest = _dataset(grown)
    rest.load_state_dict(again)
    ids = sorted(i for batch in taken + middle + _ids(rest) for i in batch)
    assert ids == sorted(i for batch in expected for i in batch), "every record once"

def test_reader_tensorflow_reads_the_epoch_again_and_skips_what_was_consumed(grown):
    expected = _reference(grown, reader="tensorflow")
    ds = _dataset(grown, reader="tensorflow")
    ds.epochs.set_epoch(1)
    iterator = iter(ds)
    got = [next(iterator)["id"].numpy().tolist() for _ in range(20)]
    state = json.loads(json.dumps(ds.state_dict()))
    [pin] = grown.pins()
    assert len(pin["seqs"]) == len(SHARDS)  # never shrunk: the resume reads every shard again
    del iterator
    resumed = _dataset(grown, reader="tensorflow")
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    got += [next(iterator)["id"].numpy().tolist() for _ in range(3)]
    # A caller's count (Keras's steps) starts after the saved progress.
    assert resumed.state_dict(consumed=3)["progress"] == 23
    assert got + [batch["id"].numpy().tolist() for batch in iterator] == expected
    del iterator
    # The state of growcache's 2 readers would be re-read in another order: refused, naming the field.
    two = _dataset(grown, cycle_length=2)
    two_iterator = iter(two)
    next(two_iterator)
    with pytest.raises(ValueError, match=r"'plan.reader' is 'growcache'.*make_tf_dataset\(reader="):
        _dataset(grown, reader="tensorflow").load_state_dict(two.state_dict())
    # Any shard gone: the re-read cannot keep the order, on_missing="skip" or not.
    os.unlink(grown.list_shards()[-1].path)
    for on_missing in ("raise", "skip"):
        with pytest.raises(MissingShardsError, match=r"reads a resumed epoch again from its start"):
            _dataset(grown, reader="tensorflow").load_state_dict(state, on_missing=on_missing)


def test_a_state_resumes_only_in_the_kind_of_reader_that_saved_it(grown):
    # One reader each: the plans look alike, but the TFRecordDataset replay and growcache's reader
    # deliver other orders, so a state loaded into the other kind would finish the epoch wrongly.
    states = {}
    for reader in ("tensorflow", "growcache"):
        ds = _dataset(grown, reader=reader, cycle_length=1)
        ds.epochs.set_epoch(1)
        iterator = iter(ds)
        next(iterator)
        states[reader] = json.loads(json.dumps(ds.state_dict()))
        assert states[reader]["plan"]["reader"] == reader and states[reader]["plan"]["workers"] == 1
        del iterator
    for saved, other in (("tensorflow", "growcache"), ("growcache", "tensorflow")):
        with pytest.raises(ValueError, match=f"'plan.reader' is '{saved}', but this pipeline reads with '{other}'"):
            _dataset(grown, reader=other, cycle_length=1).load_state_dict(states[saved])
    ds = _dataset(grown, reader="tensorflow", cycle_length=1)
    ds.load_state_dict(states["tensorflow"])  # its own kind resumes
    assert ds.epochs.resume is not None


def test_replan_true_finishes_the_epoch_over_another_batch_size_each_record_once(grown):
    # The layout error tells the user to pass replan=True (a TensorFlow user who moves to more
    # replicas changes the per-replica batch size): ds.load_state_dict took no replan= at all.
    ds = _dataset(grown)
    iterator = iter(ds)
    before = [i for _ in range(5) for i in next(iterator)["id"].numpy().tolist()]
    state = json.loads(json.dumps(ds.state_dict()))
    del iterator
    with pytest.raises(ValueError, match=r"batch_size 8 -> 16.*dataset \(make_tf_dataset\) with the saved.*pass replan=True"):
        _dataset(grown, batch_size=16).load_state_dict(state)
    resumed = _dataset(grown, batch_size=16)
    resumed.load_state_dict(state, replan=True)
    after = [i for batch in _ids(resumed) for i in batch]
    assert sorted(before + after) == list(range(sum(SHARDS))), "a record lost or read twice over the re-plan"
    assert all(len(batch) <= 16 for batch in _ids(resumed))  # the next epoch: the new batch size, whole
    # Several input pipelines cannot even out their batch counts over a re-plan: refused, said so.
    pipeline = _dataset(grown, batch_size=4, input_context=tf.distribute.InputContext(2, 0, 2))
    with pytest.raises(ValueError, match="make_tf_dataset's input pipelines cannot"):
        pipeline.load_state_dict(state, replan=True)
    # TFRecordDataset re-reads a resumed epoch and skips whole saved batches: it cannot re-plan.
    tf_state = _dataset(grown, reader="tensorflow")
    iterator = iter(tf_state)
    next(iterator)
    state = tf_state.state_dict()
    del iterator
    with pytest.raises(ValueError, match=r"replan=True .*reader='tensorflow'"):
        _dataset(grown, reader="tensorflow", batch_size=16).load_state_dict(state, replan=True)


def test_the_running_epochs_lease_lets_go_of_what_it_read_and_never_of_what_it_still_reads(grown):
    # 3 readers delivered round-robin, as the plan's read points assume: a full cache may evict
    # the shards read whole, never one a reader still reads (all unleased evicted at every batch).
    ds = _dataset(grown)
    got: list[int] = []
    iterator = iter(ds)
    got.extend(next(iterator)["id"].numpy().tolist())
    for batch in iterator:
        got.extend(batch["id"].numpy().tolist())
        grown.evict(to=0)
        if len(grown.list_shards()) == len(SHARDS):
            time.sleep(0.05)  # trims are spaced by their own cost: a later batch trims
    assert sorted(got) == list(range(sum(SHARDS)))
    assert len(grown.list_shards()) < len(SHARDS), "shards read whole were let go during the epoch"


class Recording(keras.Model):
    """A tiny model whose training step logs the ids of the batch it trains on (Keras prefetches, so
    a dataset map would log batches that were never trained on)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.record = log.append  # Keras would track (copy) a list attribute
        self.dense = keras.layers.Dense(1)

    def call(self, features):
        return self.dense(keras.ops.reshape(features["x"], (-1, 32)))

    def train_step(self, data):
        features, ids = data
        logged = tf.numpy_function(lambda i: np.int64(self.record(i.tolist()) or 0), [ids], tf.int64)
        with tf.control_dependencies([logged]):
            target = tf.cast(ids, tf.float32)
        return super().train_step(({"x": features["x"]}, target))


def _model(log: list) -> keras.Model:
    model = Recording(log)
    model.compile(optimizer="sgd", loss="mse")
    model({"x": np.zeros((1, 4, 8), np.float32)})
    return model


class _Epochs(keras.callbacks.Callback):
    """Splits the training step's log by Keras epoch; raises after batch ``stop_at`` of epoch ``stop_epoch``."""

    def __init__(self, log: list, stop_epoch: int = -1, stop_at: int = -1) -> None:
        super().__init__()
        self.log, self.stop_epoch, self.stop_at = log, stop_epoch, stop_at
        self.by_epoch: dict[int, list[list[int]]] = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.log.clear()
        self.by_epoch[epoch] = self.log

    def on_epoch_end(self, epoch, logs=None):
        self.by_epoch[epoch] = list(self.log)

    def on_train_batch_end(self, batch, logs=None):
        if self.by_epoch.get(self.stop_epoch) is self.log and batch == self.stop_at:
            raise RuntimeError("preempted")


def test_keras_backup_and_restore_resumes_the_epoch_where_it_stopped(grown, tmp_path):
    log: list = []
    reference = _Epochs(log)
    fit_growing(_model(log), _dataset(grown, label="id"), epochs=2, verbose=0, callbacks=[reference])
    expected = reference.by_epoch[1]
    # The resumed epoch's third step is not its last: that save waits for the epoch's end (below).
    stop_at, save_freq = random.Random(time.time_ns()).randrange(4, len(expected) - 4), 3
    backup = tmp_path / "backup"

    stopped = _Epochs(log, stop_epoch=1, stop_at=stop_at)
    ds = _dataset(grown, label="id")
    with pytest.raises(RuntimeError, match="preempted"):
        fit_growing(_model(log), ds, epochs=2, verbose=0,
                    callbacks=[BackupAndRestore(backup, ds, save_freq=save_freq), stopped])
    before = list(stopped.by_epoch[1])  # the live log: the next run clears it
    assert before == expected[:stop_at + 1]
    metadata = json.loads((backup / "training_metadata.json").read_text())
    saved = (stop_at + 1) // save_freq * save_freq
    assert metadata["epoch"] == 1 and metadata["growcache"]["progress"] == saved

    write_shards(grown, [30], first_id=50_000)  # grown while down: the resumed epoch reads its own snapshot
    resumed = _Epochs(log)
    ds = _dataset(grown, label="id")
    peeked = []  # the backup after the resumed epoch's third step: Keras's names epoch 0 there
    peek = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: peeked.append(
        json.loads((backup / "training_metadata.json").read_text())) if batch == 2 and not peeked else None)
    history = fit_growing(_model(log), ds, epochs=3, verbose=0,
                          callbacks=[BackupAndRestore(backup, ds, save_freq=save_freq), resumed, peek])
    assert history.epoch == [1, 2]
    assert peeked[0]["epoch"] == 1 and peeked[0]["growcache"]["progress"] == saved + 3
    assert before[:saved] + resumed.by_epoch[1] == expected  # batch by batch, each record once
    assert 50_000 in {i for batch in resumed.by_epoch[2] for i in batch}  # then a fresh snapshot
    assert not backup.exists() and grown.stats().pins == 0


@pytest.mark.parametrize("killed", ["after the last batch", "at the epoch's end"])
def test_a_save_on_the_epochs_last_batch_restores_that_epoch_whole_not_again(grown, tmp_path, killed):
    # On the last batch the dataset's state is the next epoch's start while Keras's epoch is not
    # over: the backup names the last save before it until the epoch's end, then the next epoch.
    log: list = []
    reference = _Epochs(log)
    fit_growing(_model(log), _dataset(grown, label="id"), epochs=3, verbose=0, callbacks=[reference])
    expected = reference.by_epoch[1]
    backup = tmp_path / "backup"
    stopped = _Epochs(log, stop_epoch=1, stop_at=len(expected) - 1 if killed == "after the last batch" else -1)

    def end(epoch, logs):
        if epoch == 1:
            raise RuntimeError("preempted")

    ds = _dataset(grown, label="id")
    with pytest.raises(RuntimeError, match="preempted"):
        fit_growing(_model(log), ds, epochs=3, verbose=0, callbacks=[
            BackupAndRestore(backup, ds, save_freq=1), stopped, keras.callbacks.LambdaCallback(on_epoch_end=end)])
    assert list(stopped.by_epoch[1]) == expected
    metadata = json.loads((backup / "training_metadata.json").read_text())
    state = metadata["growcache"]
    if killed == "after the last batch":
        assert (metadata["epoch"], state["epoch"], state["progress"]) == (1, 1, len(expected) - 1)
    else:
        assert (metadata["epoch"], state["epoch"], state["progress"], state["snapshot"]) == (2, 2, 0, None)

    resumed = _Epochs(log)
    ds = _dataset(grown, label="id")
    history = fit_growing(_model(log), ds, epochs=3, verbose=0,
                          callbacks=[BackupAndRestore(backup, ds, save_freq=1), resumed])
    if killed == "after the last batch":
        assert history.epoch == [1, 2] and resumed.by_epoch[1] == expected[-1:]  # the one batch not saved
    else:
        assert history.epoch == [2]
    assert resumed.by_epoch[2] == reference.by_epoch[2]
    assert not backup.exists() and grown.stats().pins == 0


def test_an_epoch_keras_cuts_short_is_over_in_the_backup_and_pins_nothing(grown, tmp_path):
    # steps_per_epoch under fit_growing: Keras drops each epoch's iterator after 10 of its 33
    # batches, and the next epoch reads a fresh snapshot. The backup at an epoch's end named the
    # unfinished epoch (a resume warned it abandoned it) and pinned its shards for 12 hours, also
    # after the run had ended and deleted the backup.
    log: list = []
    reference = _Epochs(log)
    fit_growing(_model(log), _dataset(grown, label="id"), epochs=3, verbose=0, steps_per_epoch=10,
                callbacks=[reference])

    def preempt(epoch, logs):
        if epoch == 2:
            raise RuntimeError("preempted")

    backup, ds = tmp_path / "backup", _dataset(grown, label="id")
    with pytest.raises(RuntimeError, match="preempted"):
        fit_growing(_model(log), ds, epochs=3, verbose=0, steps_per_epoch=10, callbacks=[
            BackupAndRestore(backup, ds), keras.callbacks.LambdaCallback(on_epoch_begin=preempt)])
    metadata = json.loads((backup / "training_metadata.json").read_text())
    assert (metadata["epoch"], metadata["growcache"]["epoch"], metadata["growcache"]["snapshot"]) == (2, 2, None)
    assert grown.stats().pins == 0

    resumed, ds = _Epochs(log), _dataset(grown, label="id")
    history = fit_growing(_model(log), ds, epochs=3, verbose=0, steps_per_epoch=10,
                          callbacks=[BackupAndRestore(backup, ds), resumed])
    assert history.epoch == [2] and resumed.by_epoch[2] == reference.by_epoch[2]
    assert not backup.exists() and grown.stats().pins == 0
    # Saves every 3 batches: the run's end leaves no pin either.
    ds = _dataset(grown, label="id")
    fit_growing(_model(log), ds, epochs=2, verbose=0, steps_per_epoch=10,
                callbacks=[BackupAndRestore(backup, ds, save_freq=3)])
    assert not backup.exists() and grown.stats().pins == 0


# Keras's save counter runs on across epochs: save_freq=3 saves at epoch 1's steps 2, 5 and 8;
# save_freq=5 at its steps 5 and 10, Keras's last of the epoch.
@pytest.mark.parametrize("save_freq,stop_at", [(3, 7), (5, 9)])
def test_a_restored_epoch_trains_only_the_rest_of_fit_growings_steps_per_epoch(grown, tmp_path, save_freq, stop_at):
    # Keras counts steps_per_epoch again from a restore: the restored epoch trained 10 more steps
    # after the 8 it had, where the uninterrupted run trains 10 in all. A save on Keras's last
    # step named the epoch at its 10th batch: restored, it trained a step more than the run.
    log: list = []
    reference = _Epochs(log)
    fit_growing(_model(log), _dataset(grown, label="id"), epochs=3, verbose=0, steps_per_epoch=10,
                callbacks=[reference])
    assert [len(reference.by_epoch[e]) for e in range(3)] == [10, 10, 10]
    backup, ds = tmp_path / "backup", _dataset(grown, label="id")
    stopped = _Epochs(log, stop_epoch=1, stop_at=stop_at)
    with pytest.raises(RuntimeError, match="preempted"):
        fit_growing(_model(log), ds, epochs=3, verbose=0, steps_per_epoch=10,
                    callbacks=[BackupAndRestore(backup, ds, save_freq=save_freq), stopped])
    before = list(stopped.by_epoch[1])
    metadata = json.loads((backup / "training_metadata.json").read_text())
    saved = metadata["growcache"]["progress"]
    assert metadata["epoch"] == 1 and saved == {3: 8, 5: 5}[save_freq], metadata  # never step 10: the last
    resumed, ds = _Epochs(log), _dataset(grown, label="id")
    history = fit_growing(_model(log), ds, epochs=3, verbose=0, steps_per_epoch=10,
                          callbacks=[BackupAndRestore(backup, ds, save_freq=save_freq), resumed])
    assert history.epoch == [1, 2]
    assert before[:saved] + resumed.by_epoch[1] == reference.by_epoch[1]  # the rest of epoch 1, batch by batch
    assert resumed.by_epoch[2] == reference.by_epoch[2]  # then epoch 2, as the uninterrupted run
    assert not backup.exists() and grown.stats().pins == 0


def test_a_backup_never_names_an_epoch_that_has_ended(grown, tmp_path):
    # save_freq=5 over 33 steps: the last save of epoch 1 is at a step before its end, and the
    # epoch's pin ends with the epoch. A preemption before epoch 2's first save restored from
    # that backup, whose shards a full cache had evicted meanwhile: MissingShardsError.
    log: list = []
    backup, ds = tmp_path / "backup", _dataset(grown, label="id")
    try:
        fit_growing(_model(log), ds, epochs=3, verbose=0,
                    callbacks=[BackupAndRestore(backup, ds, save_freq=5), _Epochs(log, stop_epoch=2, stop_at=0)])
    except RuntimeError as exc:  # not pytest.raises: its traceback would keep epoch 2's iterator (and lease)
        assert "preempted" in str(exc)
    else:
        raise AssertionError("the run was not stopped")
    metadata = json.loads((backup / "training_metadata.json").read_text())
    assert (metadata["epoch"], metadata["growcache"]["epoch"], metadata["growcache"]["snapshot"]) == (2, 2, None)
    # The downtime: the samplers of a full cache evict everything not pinned, and publish anew.
    gc.collect()  # the stopped run's Keras objects (the iterator, its lease) may sit in cycles
    deadline = time.monotonic() + 10
    while (grown.evict(to=0) or grown.list_shards()) and time.monotonic() < deadline:
        time.sleep(0.05)  # TensorFlow tears the dropped iterator down on its own threads
    assert not grown.list_shards(), f"the stopped run still holds {grown.stats()}"
    write_shards(grown, [30], first_id=50_000)
    resumed, ds = _Epochs(log), _dataset(grown, label="id")
    history = fit_growing(_model(log), ds, epochs=3, verbose=0,
                          callbacks=[BackupAndRestore(backup, ds, save_freq=5), resumed])
    assert history.epoch == [2] and sorted(i for batch in resumed.by_epoch[2] for i in batch) == \
        list(range(50_000, 50_030))


class KilledWhileSaving(Recording):
    """Its second weights save is cut short (half a file), as by a kill in the middle of it."""

    saves = 0

    def save_weights(self, filepath, overwrite=True):
        type(self).saves += 1
        if type(self).saves == 2:
            with open(filepath, "wb") as f:
                f.write(b"half an h5 file")
            raise RuntimeError("killed while saving")
        super().save_weights(filepath, overwrite=overwrite)


def test_a_kill_while_saving_restores_the_previous_backup_whole(grown, tmp_path):
    log: list = []
    model = KilledWhileSaving(log)
    model.compile(optimizer="sgd", loss="mse")
    model({"x": np.zeros((1, 4, 8), np.float32)})
    weights = []  # after the third step, when the first backup is written
    keep = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: weights.append(model.get_weights()) if batch == 2 else None)
    ds = _dataset(grown, label="id")
    with pytest.raises(RuntimeError, match="killed while saving"):
        fit_growing(model, ds, epochs=1, verbose=0,
                    callbacks=[keep, BackupAndRestore(tmp_path / "backup", ds, save_freq=3)])
    restored, ds = _model([]), _dataset(grown, label="id")
    backup = BackupAndRestore(tmp_path / "backup", ds)
    backup.set_model(restored)
    backup.on_train_begin()
    assert all(np.array_equal(a, b) for a, b in zip(restored.get_weights(), weights[0]))
    assert restored._initial_epoch == 0
    assert ds.state_dict()["progress"] == 3  # the position saved with those weights


@pytest.mark.parametrize("damage", ["{\"epoch\": 1", "[" * 100_000 + "]" * 100_000, "[]"])
def test_a_damaged_backup_is_a_clear_error(grown, tmp_path, damage):
    model, ds = _model([]), _dataset(grown, label="id")
    backup = BackupAndRestore(tmp_path / "backup", ds)
    os.makedirs(tmp_path / "backup", exist_ok=True)
    (tmp_path / "backup" / BackupAndRestore._METADATA).write_text(damage)
    backup.set_model(model)
    with pytest.raises(ValueError, match="is not a backup of growcache's BackupAndRestore: delete"):
        backup.on_train_begin()


@pytest.mark.parametrize("field, value, match", [
    (None, {}, "'format'"),
    (None, {"epoch": -1}, "'epoch' is -1"),
    (None, {"epoch": True}, "'epoch' is True"),
    ("progress", "3", "'progress'"),
    ("seed", 3.5, "'seed'"),
    ("plan", {"world_size": 1}, "'plan'"),
    ("snapshot", {"shards": [["x", 1, 2]], "skipped": []}, r"'snapshot.shards\[0\]'"),
    ("pin", {"name": "../../etc/passwd", "until": 1.0}, "'pin'"),
])
def test_a_hostile_state_is_refused_naming_the_field(grown, field, value, match):
    ds = _dataset(grown)
    ds.epochs.set_epoch(1)
    iterator = iter(ds)
    next(iterator)
    state = json.loads(json.dumps(ds.state_dict()))
    if field is not None:
        state[field] = value
    with pytest.raises(ValueError, match=match):
        _dataset(grown).load_state_dict(state if field is not None else value)
    for consumed in (-1, True, 2.0):
        with pytest.raises(ValueError, match="consumed"):
            ds.state_dict(consumed=consumed)
