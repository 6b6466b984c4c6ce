"""Epoch files between ranks without a process group (growcache.rendezvous.FileRendezvous), each
rank a real FileRendezvous over a real cache directory: a retried epoch never answers, nor reads,
an earlier attempt's files, and a rank that refuses the first rank's epoch tells it so."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import write_shards
from growcache import EpochSyncError
from growcache.rendezvous import EpochShards, FileRendezvous, disagreement


def _shards(cache, epoch: int = 0, note: str = "") -> EpochShards:
    shard = cache.list_shards()[0]
    return EpochShards(epoch, 0, (shard.seq,), (os.path.basename(shard.path),), note=note)


def _note(progress: int) -> str:
    """A resume note as growcache.resume.Resume.note writes it: epoch 1 at batch ``progress``."""
    return json.dumps({"epoch": 1, "seed": 3, "progress": progress, "layout": {"batch_size": 8}, "group": "shared",
                       "cache": "c", "snapshot": "abc"}, sort_keys=True)


def _until(condition, limit: float = 30.0) -> bool:
    end = time.monotonic() + limit
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def _failed(epoch: int = 0) -> EpochShards:
    return EpochShards(epoch, 0, (), (), "no shard arrived", "EmptyCacheError")


# -- a retried epoch -----------------------------------------------------------------------------
def test_a_rank_retrying_first_waits_for_the_first_ranks_retry_not_its_failed_attempt(id_cache):
    # The first rank's attempt failed (no shard): both ranks raised, and both retry. Rank 1 came
    # back first and read the failed attempt's error file again, still there (its writer lives):
    # it raised the old error once more, while the first rank's retry found shards.
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2)
    other = FileRendezvous(id_cache.path, ("run",), 1, 2, timeout=60)
    first.share(0, _failed)
    assert other.share(0, lambda: None).shards.error == "no shard arrived"  # both raise it
    got: dict = {}
    retry = threading.Thread(target=lambda: got.update(agreement=other.share(0, lambda: None)))
    retry.start()
    retry.join(1.0)  # rank 1 retries before the first rank does
    first.share(0, lambda: _shards(id_cache))
    retry.join(60)
    assert got["agreement"].shards.error == "" and got["agreement"].shards.seqs == _shards(id_cache).seqs


def test_a_rank_whose_first_rank_never_retries_a_failed_epoch_says_so(id_cache):
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2)
    other = FileRendezvous(id_cache.path, ("run",), 1, 2, timeout=0.3)
    first.share(0, _failed)
    assert other.share(0, lambda: None).shards.error == "no shard arrived"
    with pytest.raises(EpochSyncError, match="no shard arrived") as info:
        other.share(0, lambda: None)  # the only file there is the attempt this rank raised already
    assert first.path(0) in str(info.value) and "has not tried again" in str(info.value)
    first.share(0, lambda: _shards(id_cache))
    assert other.share(0, lambda: None).shards.seqs == _shards(id_cache).seqs


def test_an_acknowledgement_of_an_earlier_attempt_never_lets_the_retry_go(id_cache):
    # The first rank published epoch 0, then failed before its release and took the epoch again.
    # Rank 1, still leasing the first attempt's shards, acknowledged it while the first rank took
    # the second: the first rank took that for an answer to its new file, and let it go at once.
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2)
    other = FileRendezvous(id_cache.path, ("run",), 1, 2)
    first.share(0, lambda: _shards(id_cache))
    slow = other.share(0, lambda: None)

    def take_again() -> EpochShards:
        # Lands between the first rank's sweep of old answers and its new file (a final answer: one
        # that leased would wait for the first attempt's confirmation, and raise at its withdrawal).
        slow.confirm(False, 0)
        return _shards(id_cache)

    agreement = first.share(0, take_again)
    closed = threading.Event()
    agreement.confirm(True, 1)
    agreement.release(closed.set)
    assert not closed.is_set() and os.path.exists(first.path(0)), "no rank answered this attempt yet"
    other.share(0, lambda: None).confirm(True, 1)
    assert _until(closed.is_set) and not os.path.exists(first.path(0))


# -- a rank that refuses the first rank's epoch ---------------------------------------------------
def test_the_first_rank_hears_that_another_rank_refused_its_resume(id_cache):
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 3, timeout=30)
    mine, theirs = _note(7), _note(5)
    agreement = first.share(1, lambda: _shards(id_cache, 1, mine), mine)

    def refuse() -> None:
        follower = FileRendezvous(id_cache.path, ("run",), 1, 3).share(1, lambda: None, theirs)
        assert disagreement([follower.shards.note, theirs], SimpleNamespace(world_rank=1), collective=False)
        time.sleep(0.2)  # a late answer: the first rank waits for it
        follower.give_up()

    refuser = threading.Thread(target=refuse)
    refuser.start()
    with pytest.raises(EpochSyncError, match="cannot resume together") as info:
        agreement.confirm(True, 3)
    refuser.join(30)
    message = str(info.value)
    assert "at batch 7" in message and "at batch 5" in message and first.path(1) in message, message
    # A rank that reads the epoch file only now raises too, rather than read on with the first rank gone.
    late = FileRendezvous(id_cache.path, ("run",), 2, 3).share(1, lambda: None, mine)
    assert "cannot resume together" in late.shards.error and late.shards.error_type == "EpochSyncError"


def test_the_first_rank_hears_that_a_rank_starting_afresh_refused_its_resume(id_cache):
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2, timeout=30)
    agreement = first.share(1, lambda: _shards(id_cache, 1, _note(7)), _note(7))
    FileRendezvous(id_cache.path, ("run",), 1, 2).share(1, lambda: None).give_up()
    with pytest.raises(EpochSyncError, match="starts its epoch afresh") as info:
        agreement.confirm(True, 3)
    assert "at batch 7" in str(info.value)


def test_a_resuming_first_rank_reads_on_once_every_rank_leased(id_cache):
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2, timeout=30)
    agreement = first.share(1, lambda: _shards(id_cache, 1, _note(7)), _note(7))
    follower = FileRendezvous(id_cache.path, ("run",), 1, 2).share(1, lambda: None, _note(7))
    threading.Timer(0.2, follower.confirm, (True, 3)).start()
    assert agreement.confirm(True, 3) is None
    closed = threading.Event()
    agreement.release(closed.set)  # once rank 1 saw the confirmation, and started
    assert _until(closed.is_set) and not os.path.exists(first.path(1))


def test_a_resuming_first_rank_that_hears_from_no_rank_fails_naming_it(id_cache):
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 3, timeout=0.3)
    agreement = first.share(1, lambda: _shards(id_cache, 1, _note(7)), _note(7))
    os.symlink(first.path(1), first.ack_path(1, 1))  # hostile: never followed, and no answer
    with pytest.raises(EpochSyncError, match="did not answer") as info:
        agreement.confirm(True, 3)
    message = str(info.value)
    assert first.ack_path(1, 2) in message and "symbolic link" in message and first.ack_path(1, 1) in message
    late = FileRendezvous(id_cache.path, ("run",), 1, 3).share(1, lambda: None, _note(7))
    assert "did not answer" in late.shards.error


@pytest.mark.parametrize("answer", [
    "{", "[]", {"attempt": 5, "leased": False, "refused": True, "note": ""},
    {"leased": False, "refused": True, "note": ["x"]}, {"leased": "no", "refused": False, "note": ""},
])
def test_a_damaged_answer_is_no_answer(id_cache, answer):
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2, timeout=0.3)
    agreement = first.share(1, lambda: _shards(id_cache, 1, _note(7)), _note(7))
    if isinstance(answer, dict):
        attempt = json.loads(open(first.path(1)).read())["attempt"]
        answer = json.dumps({"attempt": attempt, **answer})
    with open(first.ack_path(1, 1), "w") as f:
        f.write(answer)
    with pytest.raises(EpochSyncError, match="did not answer") as info:
        agreement.confirm(True, 3)
    assert "damaged" in str(info.value) and first.ack_path(1, 1) in str(info.value)


def test_a_first_rank_starting_afresh_hears_of_a_refusal_at_its_next_epoch(id_cache):
    # It does not wait for the others (it may end its epoch before they start): it reads on, and
    # raises at its next epoch's start instead of reading on alone for good.
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2)
    agreement = first.share(1, lambda: _shards(id_cache, 1))
    assert agreement.confirm(True, 3) is None
    FileRendezvous(id_cache.path, ("run",), 1, 2).share(1, lambda: None, _note(7)).give_up()
    closed = threading.Event()
    agreement.release(closed.set)
    assert _until(closed.is_set)
    with pytest.raises(EpochSyncError, match="starts its epoch afresh") as info:
        first.share(2, lambda: pytest.fail("no epoch is taken"))
    assert "at batch 7" in str(info.value) and "epoch 1" in str(info.value)
    assert first.share(2, lambda: _shards(id_cache, 2)).shards.epoch == 2  # said once: a retry goes on


# -- a first rank that takes an epoch again, or fails after it published it ------------------------
def test_a_late_answer_to_a_released_attempt_leaves_the_retaken_epochs_file(id_cache):
    # The first rank's epoch 0 ended (failed mid-read, say) and its release waits for rank 1; the
    # first rank then took epoch 0 again. Rank 1's late answer to the first attempt let that
    # attempt's release go, and it deleted the epoch file of the same name: the retaken attempt's,
    # which no rank had read yet (and stopped its heartbeat).
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2, timeout=60)
    other = FileRendezvous(id_cache.path, ("run",), 1, 2, timeout=60)
    earlier = first.share(0, lambda: _shards(id_cache))
    slow = other.share(0, lambda: None)  # rank 1 read the first attempt, and is leasing its shards
    closed = threading.Event()
    earlier.release(closed.set)
    retaken = first.share(0, lambda: _shards(id_cache))
    slow.confirm(False, 0)  # its answer to the first attempt (could not lease: it waits for nothing)
    assert _until(closed.is_set), "the first attempt's lease goes at its answer"
    time.sleep(0.2)
    assert os.path.exists(first.path(0)), "the retaken attempt's file stays until its own ranks answered"
    again = other.share(0, lambda: None)
    assert again.shards.error == ""
    done = threading.Event()
    retaken.release(done.set)
    threading.Timer(0.1, retaken.confirm, (True, 1)).start()
    again.confirm(True, 1)
    assert _until(done.is_set) and os.listdir(first.dir) == []


def _confirm_apart(agreement) -> tuple[threading.Thread, dict]:
    """A rank that leased confirms on a thread of its own; ``got["error"]``: what it raised, or ``None``."""
    got: dict = {}

    def confirm() -> None:
        try:
            agreement.confirm(True, 3)
        except EpochSyncError as exc:
            got["error"] = str(exc)
        else:
            got["error"] = None

    thread = threading.Thread(target=confirm)
    thread.start()
    return thread, got


def _abort(agreement, error: Exception) -> None:
    """The first rank's start fails after it published its epoch, as Epochs.start and Resume.start
    tell it: confirm(False, 0) while the error is handled."""
    try:
        raise error
    except type(error):
        agreement.confirm(False, 0)


def test_every_rank_hears_that_the_first_rank_failed_after_it_published(id_cache):
    # Left by the retry fix: the first rank's start failed after its epoch file was out (a shard
    # of the resumed epoch gone as it leased), and it raised; its file stayed live, and the other
    # ranks leased and read on alone.
    from growcache import MissingShardsError

    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 3, timeout=30)
    agreement = first.share(1, lambda: _shards(id_cache, 1, _note(7)), _note(7))
    leased = FileRendezvous(id_cache.path, ("run",), 1, 3).share(1, lambda: None, _note(7))
    waiting, got = _confirm_apart(leased)  # rank 1 leased: it reads once the first rank confirmed, not before
    assert _until(lambda: os.path.exists(first.ack_path(1, 1)))
    _abort(agreement, MissingShardsError("shards of the saved epoch 1 went (shard-7)", ("shard-7",), 4))
    waiting.join(30)
    assert got["error"] is not None and "shard-7" in got["error"], got  # rank 1 does not read on alone
    late = FileRendezvous(id_cache.path, ("run",), 2, 3).share(1, lambda: None, _note(7))
    assert "shard-7" in late.shards.error and late.shards.error_type == "EpochSyncError"
    assert not os.path.exists(first.ack_path(1, 1)), "rank 1 took back its answer to the failed attempt"


def test_ranks_that_agreed_hear_that_another_rank_refused(id_cache):
    # Left by the back-channel fix: in a group of three, rank 1 resumed what the first rank
    # resumes and read on, while the first rank raised for rank 2's refusal.
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 3, timeout=30)
    agreement = first.share(1, lambda: _shards(id_cache, 1, _note(7)), _note(7))
    agreed = FileRendezvous(id_cache.path, ("run",), 1, 3).share(1, lambda: None, _note(7))
    FileRendezvous(id_cache.path, ("run",), 2, 3).share(1, lambda: None, _note(5)).give_up()
    waiting, got = _confirm_apart(agreed)
    with pytest.raises(EpochSyncError, match="cannot resume together"):
        agreement.confirm(True, 3)
    waiting.join(30)
    assert got["error"] is not None and "at batch 5" in got["error"] and "at batch 7" in got["error"], got


def test_a_rank_of_epochs_does_not_read_an_epoch_its_first_rank_failed(id_cache):
    # Epochs.start on a rank that is not the first: it leased and planned the first rank's epoch,
    # then hears of the first rank's failure, raises naming it, and holds no lease.
    from growcache.epoch import EpochOptions, Epochs

    write_shards(id_cache, [4, 6])
    options = EpochOptions(2, run_id="abort")
    leader = Epochs(id_cache, options, world=(0, 2))
    leader.group  # noqa: B018 - resolves its rendezvous: epoch files (rank 1 is not built yet)
    follower = Epochs(id_cache, options, world=(1, 2))
    shards = [s for s in id_cache.list_shards()]
    published = EpochShards(0, int(options.seed), tuple(s.seq for s in shards),
                            tuple(os.path.basename(s.path) for s in shards))
    agreement = leader._rendezvous.share(0, lambda: published)
    got: dict = {}

    def start() -> None:
        try:
            got["epoch"] = follower.start()
        except EpochSyncError as exc:
            got["error"] = str(exc)

    starting = threading.Thread(target=start)
    starting.start()
    assert _until(lambda: os.path.exists(leader._rendezvous.ack_path(0, 1)))
    _abort(agreement, OSError(28, "No space left on device"))
    starting.join(30)
    assert "No space left on device" in got.get("error", ""), got
    assert id_cache.stats().leases == 0


@pytest.mark.parametrize("field", [{"error": ["x"]}, {"error_type": 7}, {"confirmed": "yes"}])
def test_an_epoch_file_with_a_field_of_another_type_is_damaged(id_cache, field):
    # Checked field by field: an error that is no string was raised, stringified, by every rank.
    write_shards(id_cache, [4])
    first = FileRendezvous(id_cache.path, ("run",), 0, 2)
    first.share(0, lambda: _shards(id_cache))
    with open(first.path(0)) as f:
        body = json.load(f)
    with open(first.path(0), "w") as f:
        json.dump({**body, **field}, f)
    with pytest.raises(EpochSyncError, match="waited") as info:  # a damaged file is a dead writer's: no epoch
        FileRendezvous(id_cache.path, ("run",), 1, 2, timeout=0.3).share(0, lambda: None)
    assert "['x']" not in str(info.value)
