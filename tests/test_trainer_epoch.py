"""The core's side of trainers (growcache.epoch, no framework): readers that join the trainer's
epoch inside trainer_epoch, the lease kept for the trainer's next reader and ended with the block,
and set_epoch announced after an epoch's iterator was made."""

from __future__ import annotations

import pytest

from conftest import write_shards
from growcache import epoch as epoch_module
from growcache.epoch import EpochOptions, Epochs


def trainer_epoch(number: int):
    return epoch_module.trainer_epoch(number)  # looked up at run time, so that the module collects without it


def _epochs(cache) -> Epochs:
    return Epochs(cache, EpochOptions(4, seed=3), world=(0, 1))


def test_inside_trainer_epoch_every_start_reads_that_epoch_and_joins_the_open_one(id_cache):
    write_shards(id_cache, [5, 5, 5])
    epochs = _epochs(id_cache)
    with trainer_epoch(7):
        peek = epochs.start()  # Keras's extra batch: an iterator read once, then dropped
        assert peek.number == 7 and id_cache.stats().leases == 1
        epochs.leave(peek.token, finished=False)
        assert not peek.ended, "the trainer's next reader of epoch 7 must find it open"
        real = epochs.start()
        assert real is peek and id_cache.stats().leases == 1  # one snapshot, one lease
        epochs.leave(real.token, finished=True)
        assert real.ended and id_cache.stats().leases == 0
    assert epochs.epoch == 8


def test_an_epoch_left_unread_ends_with_the_trainers_epoch(id_cache):
    write_shards(id_cache, [5, 5])
    epochs = _epochs(id_cache)
    with trainer_epoch(0):
        epoch = epochs.start()
        epochs.leave(epoch.token, finished=False)
        assert id_cache.stats().leases == 1
    assert epoch.ended and id_cache.stats().leases == 0
    # Outside a trainer's epoch, a reader that goes ends its epoch at once, finished or not.
    epoch = epochs.start()
    assert epoch.number == 1
    epochs.leave(epoch.token, finished=False)
    assert epoch.ended and id_cache.stats().leases == 0


def test_an_epoch_read_by_two_iterators_ends_with_the_last(id_cache):
    write_shards(id_cache, [5, 5])
    epochs = _epochs(id_cache)
    with trainer_epoch(2):
        first, second = epochs.start(), epochs.start()
        assert first is second
        epochs.leave(first.token, finished=True)
        assert not first.ended, "another iterator still reads it"
        epochs.leave(first.token, finished=False)
        assert first.ended


def test_trainer_epochs_do_not_nest():
    with trainer_epoch(1):
        with pytest.raises(RuntimeError, match="one at a time"):
            with trainer_epoch(2):
                pass
    with trainer_epoch(2):  # the first block's exit released it
        pass


def test_set_epoch_naming_the_epoch_being_read_moves_on_to_the_next(id_cache):
    write_shards(id_cache, [5])
    epochs = _epochs(id_cache)
    epoch = epochs.start()
    epochs.set_epoch(0)  # announced after its iterator was made (Lightning does so)
    assert epochs.epoch == 1
    epoch.end()
    epochs.set_epoch(0)  # an ended epoch is read again if asked for
    assert epochs.epoch == 0
    epochs.set_epoch(5)
    assert epochs.start().number == 5
