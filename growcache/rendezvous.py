"""How the ranks of a group agree on one epoch: the shards, seed and epoch number of its first rank.

The first rank of a group (the one that *takes* the epoch) takes the snapshot and publishes
an :class:`EpochShards`; every other rank leases exactly those shards, so no rank ever plans
on a subset of what another one leased, however fast the cache turns over. The taker keeps
its lease until every rank of the group has leased the same shards (at most
:data:`AGREE_TIMEOUT_S` after its own epoch ended), so none of them can be evicted in between.

A :class:`Rendezvous` carries the agreement. The core has three:

* :class:`CollectiveRendezvous`: ranks with a process group (``torch.distributed``) agree
  through two gathers per epoch, which also let groups agree on one batch count.
* :class:`LocalRendezvous`: ranks in one process (TensorFlow input pipelines built by one
  ``distribute_datasets_from_function``). The first to start an epoch takes it.
* :class:`FileRendezvous`: ranks in different processes without a process group (TensorFlow
  multi-worker, or processes told their rank by ``RANK``/``WORLD_SIZE``). The group's first
  rank writes a small epoch file into the cache's ``epochs/`` directory, atomically, under a
  name keyed by run id, group and epoch; the others wait for it, lease, and say so with an
  acknowledgement file (or refuse it there: see :class:`FileRendezvous`). A rank that waits
  longer than its bound fails with :class:`~growcache.errors.EpochSyncError`.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from . import _proc
from .errors import CacheFormatError, EpochSyncError
from .manifest import Manifest, _is_int, atomic_write_bytes, read_state_file
from .shard import MAX_SEQ

__all__ = [
    "AGREE_TIMEOUT_S",
    "Agreement",
    "CollectiveRendezvous",
    "EpochShards",
    "FileRendezvous",
    "LocalRendezvous",
    "Rendezvous",
    "disagreement",
    "remove_stale_epoch_files",
]

logger = logging.getLogger(__name__)

#: Seconds a rank waits for its group's first rank to publish an epoch (beyond the first
#: rank's own ``wait_for_shards``), and the longest a first rank keeps its lease after its
#: epoch ended for a rank that never leases.
AGREE_TIMEOUT_S = 300.0
EPOCHS_DIR = "epochs"
_POLL_S = 0.02
_EPOCH_FILE = re.compile(r"^([0-9a-f]{16})-([0-9]{10})\.json$")
_ACK_FILE = re.compile(r"^([0-9a-f]{16})-([0-9]{10})\.ack-([0-9]+)$")
_ATTEMPT = re.compile(r"[0-9a-f]{16}")  # an epoch file's attempt, matched whole
_EXIT_WAIT_S = 60.0
_TEMP_MAX_AGE_S = 3600.0  # epoch files are written without the cache lock: only old temporaries are surely dead


@dataclass(frozen=True)
class EpochShards:
    """What the first rank of a group publishes for one epoch.

    Attributes:
        epoch: the epoch number every rank plans with.
        seed: the shuffle seed every rank plans with.
        seqs: sequence numbers of the leased shards, oldest first.
        names: the shards' file names (which also state records and bytes), so that a rank
            given another cache directory is caught instead of leasing other shards that
            happen to carry the same sequence numbers.
        error: why the first rank could not take the snapshot (every rank raises it);
            ``""`` when it could.
        error_type: the class name of that error. Default: ``""``.
        note: what the first rank resumes (:func:`growcache.resume.resume_note`), which every
            rank must resume too; ``""``: a fresh epoch. Default: ``""``.
    """

    epoch: int
    seed: int
    seqs: tuple[int, ...]
    names: tuple[str, ...] = ()
    error: str = ""
    error_type: str = ""
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "seqs": list(self.seqs), "names": list(self.names),
                "error": self.error, "error_type": self.error_type, "note": self.note}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> EpochShards:
        try:
            seqs = tuple(int(s) for s in data["seqs"])
            names = tuple(str(n) for n in data.get("names", ()))
            return cls(int(data["epoch"]), int(data["seed"]), seqs, names, str(data.get("error") or ""),
                       str(data.get("error_type") or ""), str(data.get("note") or ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise EpochSyncError(f"epoch file {where} is damaged ({exc!r}); delete it, the first rank writes "
                                 "it again at its next epoch") from None


class Agreement(Protocol):
    """One rank's side of one agreed epoch."""

    shards: EpochShards
    took: bool  # this rank took the snapshot (it is the group's first rank for this epoch)
    #: Every world rank's ``note`` (what it resumes), in rank order, where the rendezvous is
    #: collective; ``None`` otherwise (only the first rank's is known, in ``shards.note``).
    notes: list[str] | None

    def confirm(self, leased: bool, batches: int) -> list[tuple[bool, int]] | None:
        """Say that this rank leased the shards (or failed to) and yields ``batches`` batches.

        Called once per agreement, before the rank reads: ``leased=False`` also where the rank's
        start failed after the agreement (its error is being handled), so that no other rank
        reads on without it. Over epoch files a first rank's failure is told to the others
        (naming the error it handles), and a rank that leased returns only once the first rank
        confirmed the epoch too.

        Returns every rank's ``(leased, batches)``, in rank order, where the rendezvous is
        collective (so that groups can agree on one batch count); ``None`` otherwise.
        """

    def release(self, close: Callable[[], None]) -> None:
        """The taker's epoch ended: call ``close`` (its lease) once every rank leased."""

    def give_up(self) -> None:
        """This rank refuses the epoch: what it resumes (the ``note`` it shared) disagrees with
        the first rank's, and it raises before it leases. The taker need not hold its lease, nor
        its process's exit, waiting for this rank; over epoch files it raises too, naming both
        notes. A collective rendezvous needs nothing: there every rank raises together."""


class Rendezvous(Protocol):
    """Carries one group's agreement, epoch by epoch."""

    def share(self, epoch: int, take: Callable[[], EpochShards], note: str = "") -> Agreement:
        """Epoch ``epoch`` of the group: ``take()`` runs on the rank that takes the snapshot,
        and every rank gets what it returned. ``take`` reports failure as data
        (:attr:`EpochShards.error`), so that no rank is left waiting. ``note``: what this rank
        resumes (``""``: nothing), gathered from every rank where the rendezvous is collective."""


class _Keeper:
    """Closes leases once a condition holds or a deadline passes, on one daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._held: list[tuple[Callable[[], bool], Callable[[], None], float, bool]] = []
        self._pid = -1

    def hold(self, ready: Callable[[], bool], close: Callable[[], None], deadline: float, *,
             wait_at_exit: bool = True) -> None:
        """Call ``close`` once ``ready()`` holds or ``deadline`` passes.

        Args:
            wait_at_exit: the ranks ``ready`` waits for may live in other processes, so an
                exit waits for them (:meth:`drain`). ``False`` where they are ranks of this
                process, which cannot lease once it exits: waiting would only delay the exit.
        """
        if _safe(ready):
            close()
            return
        with self._lock:
            self._held.append((ready, close, deadline, wait_at_exit))
            if self._pid != os.getpid():  # first use, or a forked child (threads do not survive fork)
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="growcache-lease-keeper", daemon=True).start()
                atexit.register(self.drain)
            self._wake.notify()

    def drain(self, limit: float = _EXIT_WAIT_S) -> None:
        """At exit: wait (at most ``limit`` seconds) for the ranks in other processes that a
        held lease waits for.

        A first rank that exits first would otherwise end its lease (a dead process's lease
        expires) while another rank has yet to lease the same shards.
        """
        end = time.monotonic() + limit

        def waiting() -> bool:
            with self._lock:
                return self._pid == os.getpid() and any(held[3] for held in self._held)

        if waiting():
            logger.info("waiting up to %.0f s for the other ranks to lease the last epochs before exiting", limit)
        while waiting() and time.monotonic() < end:
            time.sleep(_POLL_S)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._held:
                    self._wake.wait()
                held = list(self._held)
            now = time.monotonic()
            due = [h for h in held if now >= h[2] or _safe(h[0])]
            for held_lease in due:
                ready, close, deadline, _ = held_lease
                if now >= deadline and not _safe(ready):
                    logger.warning("not every rank of the group leased its epoch within %.0f s; the first rank's "
                                   "lease ends anyway", AGREE_TIMEOUT_S)
                try:
                    close()
                except Exception:  # noqa: BLE001 - one failed release must not stop the others
                    logger.exception("ending a held epoch lease failed")
                with self._lock:  # only now: drain() must not let the process exit mid-close
                    self._held.remove(held_lease)
            time.sleep(_POLL_S)


def _safe(ready: Callable[[], bool]) -> bool:
    try:
        return bool(ready())
    except OSError:
        return False


_KEEPER = _Keeper()


_DAMAGED: dict[str, Any] = {}  # a note that is not what Resume.note writes
_NOTE_TYPES = {"epoch": int, "seed": (int, type(None)), "progress": int, "layout": dict, "group": str,
               "cache": (str, type(None)), "snapshot": str}


def _parsed_note(note: str) -> dict[str, Any]:
    """A rank's note, checked field by field (another rank wrote it, through an epoch file in the
    cache directory too): :data:`_DAMAGED` unless every field has its type."""
    try:
        parsed = json.loads(note)
    except (TypeError, ValueError, RecursionError):
        return _DAMAGED
    if not isinstance(parsed, dict) or any(
            not isinstance(parsed.get(k, ...), t) or isinstance(parsed.get(k), bool) for k, t in _NOTE_TYPES.items()):
        return _DAMAGED
    return parsed


def disagreement(notes: Sequence[str], group: Any, *, collective: bool, ranks: Sequence[str] | None = None) -> str:
    """Why ranks cannot resume together, from each rank's note (:meth:`growcache.resume.Resume.note`;
    ``""``: a rank that starts its epoch afresh); ``""`` when they agree. ``collective``: ``notes`` holds every world
    rank's, in rank order (epoch, seed, progress and layout must match world-wide, the snapshot
    within each group); else the group's first rank's, then this rank's. ``ranks``: what to call
    the ranks of ``notes`` instead (``None``: by that order); ``group`` may then be ``None``."""
    parsed = [_parsed_note(note) if note else None for note in notes]
    if all(note is None for note in parsed):
        return ""

    def key(note: dict | None) -> Any:
        if note is None or note is _DAMAGED:
            return None if note is None else object()  # a damaged note agrees with nothing
        shared = (note["epoch"], note["seed"], note["progress"], json.dumps(note["layout"], sort_keys=True))
        return shared if collective else (*shared, note["cache"], note["snapshot"])

    by_group: dict[Any, set] = {}
    for note in parsed:
        if note is not None and note is not _DAMAGED:
            by_group.setdefault(note["group"], set()).add((note["cache"], note["snapshot"]))
    if len({key(note) for note in parsed}) == 1 and all(len(seen) == 1 for seen in by_group.values()):
        return ""
    if ranks is None:
        ranks = list(range(len(parsed))) if collective else ["the group's first", "this"]
    seen: dict[str, list] = {}
    for rank, note in zip(ranks, parsed):
        what = ("starts its epoch afresh (no state loaded)" if note is None else
                "sent a damaged resume note (its epoch file was written by another version, or damaged)"
                if note is _DAMAGED else f"resumes epoch {note['epoch']} at batch {note['progress']} of snapshot {note['snapshot']} (seed "
                f"{note['seed']}, layout {note['layout']})")
        seen.setdefault(what, []).append(rank)
    told = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} {what}" for what, r in seen.items())
    this = "" if group is None else f" (rank {group.world_rank} is this one)"
    return (f"the ranks cannot resume together ({told}): every rank must load the state it saved at the same step "
            f"of the same run{this}, or none may")


# -- ranks with a process group ------------------------------------------------------------------
class CollectiveRendezvous:
    """Every rank of the world takes part in two gathers per epoch: one carries each group's
    first rank's :class:`EpochShards`, the other every rank's lease and batch count.

    Args:
        group: this rank's group (its ``first_world_rank`` and ``world_size`` are used).
        all_gather: the framework's gather of one picklable object from every rank, in
            rank order (``torch.distributed.all_gather_object``, for one).
    """

    def __init__(self, group: Any, all_gather: Callable[[Any], list[Any]]) -> None:
        self.group = group
        self.all_gather = all_gather

    def share(self, epoch: int, take: Callable[[], EpochShards], note: str = "") -> Agreement:
        gathered = self.all_gather((take() if self.group.rank == 0 else None, note))
        shards: EpochShards = gathered[self.group.first_world_rank][0]
        failed = next((s for s, _ in gathered if s is not None and s.error), None)
        if failed is not None and not shards.error:  # another group's: every rank stops together
            shards = replace(shards, error=f"another group: {failed.error}", error_type=failed.error_type)
        return _CollectiveAgreement(shards, self.group.rank == 0, self.all_gather, [n for _, n in gathered])


@dataclass
class _CollectiveAgreement:
    shards: EpochShards
    took: bool
    all_gather: Callable[[Any], list[Any]]
    notes: list[str] | None = None

    def confirm(self, leased: bool, batches: int) -> list[tuple[bool, int]]:
        return self.all_gather((leased, batches))

    def release(self, close: Callable[[], None]) -> None:
        close()  # every rank leased before the confirmation returned

    def give_up(self) -> None:
        pass


# -- ranks in one process ------------------------------------------------------------------------
class _LocalEpoch:
    __slots__ = ("shards", "acks", "failed")

    def __init__(self) -> None:
        self.shards: EpochShards | None = None
        self.acks = 0
        self.failed = False


class LocalRendezvous:
    """The ranks of a group live in this process: the first to start an epoch takes it.

    Args:
        key: the group's identity; ranks that pass equal keys share one rendezvous.
        size: ranks in the group.
        timeout: seconds a rank waits for the taker's snapshot, beyond the taker's own
            wait for a first shard. Default: :data:`AGREE_TIMEOUT_S`.
    """

    _registry: dict[Any, _LocalGroup] = {}
    _registry_lock = threading.Lock()

    def __init__(self, key: Any, size: int, timeout: float | None = None) -> None:
        with LocalRendezvous._registry_lock:
            group = LocalRendezvous._registry.get(key)
            if group is None:
                group = LocalRendezvous._registry[key] = _LocalGroup()
        self._group = group
        self.size = int(size)
        self.timeout = AGREE_TIMEOUT_S if timeout is None else float(timeout)

    def share(self, epoch: int, take: Callable[[], EpochShards], note: str = "") -> Agreement:
        group = self._group
        with group.cond:
            entry = group.epochs.get(epoch)
            took = entry is None
            if took:
                entry = group.epochs[epoch] = _LocalEpoch()
            else:
                deadline = time.monotonic() + self.timeout
                while entry.shards is None and not entry.failed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise EpochSyncError(
                            f"epoch {epoch}: the input pipeline of this process that took the snapshot did not "
                            f"publish it within {self.timeout:.0f} s")
                    group.cond.wait(min(left, 1.0))
                if entry.failed:
                    raise EpochSyncError(f"epoch {epoch}: the input pipeline that took the snapshot failed")
                return _LocalAgreement(self, epoch, entry, entry.shards, took=False)
        try:
            shards = take()
        except BaseException:
            with group.cond:
                entry.failed = True
                group.epochs.pop(epoch, None)
                group.cond.notify_all()
            raise
        with group.cond:
            entry.shards = shards
            if shards.error and group.epochs.get(epoch) is entry:
                del group.epochs[epoch]  # waiting ranks hold the entry; a retry takes the epoch anew
            group.cond.notify_all()
        return _LocalAgreement(self, epoch, entry, shards, took=True)


class _LocalGroup:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.epochs: dict[int, _LocalEpoch] = {}


class _LocalAgreement:
    notes = None

    def __init__(self, rendezvous: LocalRendezvous, epoch: int, entry: _LocalEpoch, shards: EpochShards,
                 took: bool) -> None:
        self._rendezvous = rendezvous
        self._epoch = epoch
        self._entry = entry
        self.shards = shards
        self.took = took

    def confirm(self, leased: bool, batches: int) -> None:
        if not self.took:
            with self._rendezvous._group.cond:
                self._entry.acks += 1
        return None

    def give_up(self) -> None:
        self.confirm(False, 0)

    def release(self, close: Callable[[], None]) -> None:
        rendezvous, entry = self._rendezvous, self._entry

        def done() -> None:
            with rendezvous._group.cond:
                if rendezvous._group.epochs.get(self._epoch) is entry:
                    del rendezvous._group.epochs[self._epoch]
            close()

        _KEEPER.hold(lambda: entry.acks >= rendezvous.size - 1, done, time.monotonic() + rendezvous.timeout,
                     wait_at_exit=False)


# -- ranks in several processes: epoch files -----------------------------------------------------
class FileRendezvous:
    """The ranks of a group agree through epoch files in the cache directory.

    Each epoch file names its *attempt* (random, new each time the first rank takes the epoch)
    and every answer names the attempt it answers, so that a retried epoch never meets an
    earlier attempt's files: a rank retrying after the first rank's error waits for the first
    rank's retry instead of raising the error it already raised, and the first rank never takes
    an answer to its earlier file for one to its new file.

    The other ranks answer in acknowledgement files: leased, could not lease, or *refused*
    (what the rank resumes disagrees with the first rank's note; the answer carries its own
    note). A first rank that resumes waits in :meth:`~Agreement.confirm` for every rank's answer,
    at most ``wait_for_shards`` + ``timeout`` seconds, and raises
    :class:`~growcache.errors.EpochSyncError` at a refusal (naming both notes), at a rank that
    could not lease, or at ranks that never answered; it then replaces its epoch file with that
    error, so that a rank that reads the file later raises too. A first rank that starts afresh
    does not wait (it may end its epoch before the others start theirs): a refusal already there
    at its ``confirm`` raises there, a later one at its next epoch's start.

    A rank that leased reads only once the first rank *confirmed* the epoch (it marks its file
    so at its own ``confirm``, after its plan and, resuming, every rank's answer), and then says
    it started: the first rank's epoch file goes only once every rank started, refused or could
    not lease. A first rank whose start fails after it published (``confirm(False, 0)``) replaces
    its file with that error, and every rank raises it: one waiting for the confirmation, one
    that has yet to read the file, one still leasing. So does a rank waiting for a first rank
    that takes the epoch again, removes the file, or dies. These waits are bounded too.

    Args:
        cache_dir: the cache directory the group reads (its ``epochs/`` holds the files).
        key: the group's identity (run id, group name, and which of the process's readers).
        rank: this process's rank within the group; rank 0 takes every epoch.
        size: ranks in the group.
        wait_for_shards: seconds the first rank may wait for a first shard; the others wait
            that long plus ``timeout``, and so does a resuming first rank for their answers.
        timeout: see :data:`AGREE_TIMEOUT_S`. Default: :data:`AGREE_TIMEOUT_S`.
        file_mode: permission bits of the files. Default: ``0o600``.
        dir_mode: permission bits of ``epochs/`` if it is created. Default: ``0o700``.
    """

    def __init__(self, cache_dir: str, key: Sequence[Any], rank: int, size: int, *, wait_for_shards: float = 0.0,
                 timeout: float | None = None, file_mode: int = 0o600, dir_mode: int = 0o700) -> None:
        self.dir = os.path.join(cache_dir, EPOCHS_DIR)
        self.digest = hashlib.sha1(json.dumps([str(k) for k in key]).encode()).hexdigest()[:16]
        self.key = tuple(key)
        self.rank = int(rank)
        self.size = int(size)
        self.timeout = AGREE_TIMEOUT_S if timeout is None else float(timeout)
        self.wait = float(wait_for_shards) + self.timeout
        self.file_mode = file_mode
        self._raised: dict[int, str] = {}  # epoch -> the attempt whose error this rank raised
        self._taken: list[_FileAgreement] = []  # the first rank's epochs whose answers it may yet raise for
        # The first rank's: the attempt of each epoch file it wrote and has not removed. Only that
        # attempt's agreement removes the files of its epoch: an earlier attempt's release (held
        # for a late rank) must not remove the files of the attempt that replaced it.
        self._current: dict[int, str] = {}
        self._lock = threading.RLock()
        Manifest(cache_dir).make_subdir(self.dir, dir_mode)  # never a link: epochs/ is written and swept

    def path(self, epoch: int) -> str:
        """The epoch file of epoch ``epoch``."""
        return os.path.join(self.dir, f"{self.digest}-{epoch:010d}.json")

    def ack_path(self, epoch: int, rank: int) -> str:
        return os.path.join(self.dir, f"{self.digest}-{epoch:010d}.ack-{rank}")

    def share(self, epoch: int, take: Callable[[], EpochShards], note: str = "") -> Agreement:
        path = self.path(epoch)
        if self.rank == 0:
            self._raise_refusals()
            remove_stale_epoch_files(os.path.dirname(self.dir))
            _proc.let_go(path)  # its heartbeat, if an earlier attempt of this process wrote it
            if _is_directory(path):  # the sweep leaves directories alone
                raise CacheFormatError(
                    f"{path} is a directory, where the first rank writes this run's epoch file, so the ranks cannot "
                    "agree on the epoch. Remove it (growcache deletes no directory) and start again.")
            with self._lock:  # an earlier attempt's files go below: its answers are no one's now
                self._taken = [agreement for agreement in self._taken if agreement._epoch != epoch]
                # A failed earlier attempt's error, which a retrying rank must not read, and
                # acknowledgements of this epoch left by a killed run (restarted with the same run id
                # within the sweep's grace) or by an earlier attempt: they answer another attempt,
                # and are no answer to this one, but go with it.
                self._withdraw(epoch, None)
            shards = take()
            agreement = _FileAgreement(self, epoch, shards, True, self._publish(epoch, shards), note)
            with self._lock:
                self._taken.append(agreement)
            return agreement
        shards, attempt = self._wait_for(epoch, path)
        return _FileAgreement(self, epoch, shards, False, attempt, note)

    def _publish(self, epoch: int, shards: EpochShards, attempt: str = "", confirmed: bool = False) -> str:
        """Write epoch ``epoch``'s file (the first rank); returns its attempt (``attempt``: the
        one it rewrites, marked ``confirmed``; ``""``: a new one)."""
        path = self.path(epoch)
        attempt = attempt or secrets.token_hex(8)
        pid, start = _proc.this_process()
        body = {**shards.to_json(), "key": [str(k) for k in self.key], "pid": pid, "start_time": start,
                "host": _proc.this_host(), "created": time.time(), "expiry": _proc.beat_expiry(), "attempt": attempt,
                "confirmed": confirmed}
        with self._lock:
            if confirmed and self._current.get(epoch) != attempt:
                return attempt  # a later attempt replaced it (or it failed): not confirmed
            atomic_write_bytes(path, json.dumps(body, sort_keys=True).encode(), self.file_mode)
            self._current[epoch] = attempt
            # Its heartbeat is the evidence that lets ranks in another process table (another
            # machine or container) tell this live file from a dead run's.
            _proc.keep_alive(path)
        return attempt

    def _withdraw(self, epoch: int, attempt: str | None) -> bool:
        """Remove epoch ``epoch``'s file and acknowledgements if its file is attempt ``attempt``'s
        (``None``: whichever); ``False`` where a later attempt replaced it (its files are its own)."""
        with self._lock:
            if attempt is not None and self._current.get(epoch) != attempt:
                return False
            self._current.pop(epoch, None)
            _proc.let_go(self.path(epoch))
            for name in [self.path(epoch), *(self.ack_path(epoch, rank) for rank in range(1, self.size))]:
                _unlink_quiet(name)
            return True

    def _raise_refusals(self) -> None:
        """The first rank: raise, once, for the refusals of its earlier epochs that it has not raised for."""
        with self._lock:
            taken = list(self._taken)
        told = []
        for agreement in taken:
            problem = agreement._untold_refusal()
            if problem:
                told.append(problem)
            if problem or agreement._finished:
                with self._lock:
                    if agreement in self._taken:
                        self._taken.remove(agreement)
        if told:
            raise EpochSyncError("; ".join(told) + ". The refusing rank raised at that epoch's start: start every "
                                 "rank again, each with the state it saved at the same step, or every rank with none.")

    def _wait_for(self, epoch: int, path: str) -> tuple[EpochShards, str]:
        deadline = time.monotonic() + self.wait
        dead_writer = None
        raised = self._raised.get(epoch)
        stale = None
        while True:
            body = _read_epoch_file(path)
            if body is not None:
                if not _writer_lives(body):
                    dead_writer = body.get("pid")  # a crashed run's file: wait for a live first rank to replace it
                elif raised is not None and body.get("attempt") == raised:
                    stale = body.get("error")  # the failed attempt this rank raised for: wait for the retry
                else:
                    shards = EpochShards.from_json(body, path)
                    attempt = body.get("attempt") or ""
                    if shards.error and attempt:
                        self._raised[epoch] = attempt
                    return shards, attempt
            if time.monotonic() >= deadline:
                why = (f"; the file there was written by pid {dead_writer}, which is gone" if dead_writer is not None
                       else "")
                if stale is not None:
                    why = (f"; the file there is the first rank's failed attempt ({stale}), which this rank raised "
                           "already: the first rank has not tried again")
                raise EpochSyncError(
                    f"rank {self.rank} of {self.size} waited {self.wait:.0f} s for epoch {epoch} of its group from the "
                    f"group's first rank (epoch file {path}){why}. Start every rank with the same cache, split and "
                    "run id (GROWCACHE_RUN_ID, or run_id=), and the same number of epochs; the first rank must be "
                    "running.")
            time.sleep(_POLL_S)


class _FileAgreement:
    notes = None

    def __init__(self, rendezvous: FileRendezvous, epoch: int, shards: EpochShards, took: bool, attempt: str,
                 note: str) -> None:
        self._rendezvous = rendezvous
        self._epoch = epoch
        self.shards = shards
        self.took = took
        self._attempt = attempt  # of the epoch file this agreement answers, or wrote
        self._note = note  # what this rank resumes, told with a refusal
        # The first rank's: each rank's answer to this attempt (final once it refused, could not
        # lease, or started), and why a rank's answer file is no answer.
        self._answers: dict[int, dict[str, Any]] = {}
        self._unread: dict[int, str] = {}
        self._told = False  # the first rank raised for a refusal of this epoch
        self._finished = False  # its files went (release)
        self._over = False  # confirmed, refused or failed: a later confirm (a caller's cleanup) does nothing
        self._lock = threading.Lock()

    def confirm(self, leased: bool, batches: int) -> None:
        if self._over:
            return None
        self._over = True
        if not self.took:
            # The acknowledgement lets the first rank drop its lease: this rank holds the shards
            # in a lease of its own now, or could not lease them and will not read them.
            self._answer(leased=leased, refused=False)
            if leased:
                self._await_confirmation()
        elif not leased:
            self._abort()
        else:
            self._hear(wait=bool(self.shards.note))
            self._rendezvous._publish(self._epoch, self.shards, self._attempt, confirmed=True)
        return None

    def give_up(self) -> None:
        if not self.took and not self._over:
            self._over = True
            self._answer(leased=False, refused=True)

    def _answer(self, *, leased: bool, refused: bool, started: bool = False) -> None:
        pid, start = _proc.this_process()
        body = {"pid": pid, "start_time": start, "host": _proc.this_host(), "created": time.time(),
                "attempt": self._attempt, "leased": leased, "refused": refused, "started": started,
                "note": self._note}
        atomic_write_bytes(self._rendezvous.ack_path(self._epoch, self._rendezvous.rank),
                           json.dumps(body).encode(), self._rendezvous.file_mode)

    def _await_confirmation(self) -> None:
        """A rank that leased: return once the first rank confirmed this attempt (then say this rank
        started); raise if it failed, took the epoch again, removed its file or died instead."""
        rendezvous, epoch = self._rendezvous, self._epoch
        path = rendezvous.path(epoch)
        deadline = time.monotonic() + rendezvous.wait
        while True:
            body = _read_epoch_file(path)
            if body is not None and _writer_lives(body) and body.get("attempt") == self._attempt:
                if body.get("confirmed") is True:
                    self._answer(leased=True, refused=False, started=True)
                    return
                why = "" if time.monotonic() < deadline else (
                    f"the group's first rank did not confirm it within {rendezvous.wait:.0f} s (it may be stuck)")
            elif body is not None and _writer_lives(body) and body.get("error"):
                if body.get("attempt"):
                    rendezvous._raised[epoch] = body["attempt"]  # a retry waits for the first rank's own
                why = str(body["error"])
            elif body is not None and _writer_lives(body):
                why = "the group's first rank took the epoch again before it confirmed the attempt this rank leased"
            elif body is None:
                why = ("the group's first rank removed its epoch file before it confirmed the epoch (it took the "
                       f"epoch again, or this rank answered more than {rendezvous.timeout:.0f} s late)")
            else:
                why = f"the group's first rank (pid {body.get('pid')}) is gone: it died before it confirmed the epoch"
            if why:
                _unlink_quiet(rendezvous.ack_path(epoch, rendezvous.rank))  # an answer to an attempt that is over
                raise EpochSyncError(
                    f"rank {rendezvous.rank} of {rendezvous.size} leased epoch {epoch} from the epoch file {path} but "
                    f"does not read it: {why}. Every rank stops rather than read without the group's first rank.")
            time.sleep(_POLL_S)

    def release(self, close: Callable[[], None]) -> None:
        rendezvous, epoch = self._rendezvous, self._epoch

        def done() -> None:
            try:
                close()
            finally:
                rendezvous._withdraw(epoch, self._attempt)  # none where a later attempt replaced this one
                self._finished = True
                refusal = self._refusal(self._answers_now())
                if refusal and not self._told:  # raised at the first rank's next epoch's start
                    logger.error("%s", refusal)

        _KEEPER.hold(self._all_final, done, time.monotonic() + rendezvous.timeout)

    # -- the first rank hears the others -------------------------------------------------------------------
    def _answers_now(self) -> dict[int, dict[str, Any]]:
        """Every rank's latest answer to this attempt so far, by rank (each file read until its answer is final)."""
        rendezvous = self._rendezvous
        with self._lock:
            for rank in range(1, rendezvous.size):
                if rank not in self._answers or not _final(self._answers[rank]):
                    answer, why = _read_answer(rendezvous.ack_path(self._epoch, rank), self._attempt)
                    if answer is not None:
                        self._answers[rank] = answer
                    if why:
                        self._unread[rank] = why
                    else:
                        self._unread.pop(rank, None)
            return dict(self._answers)

    def _all_final(self) -> bool:
        answers = self._answers_now()
        return len(answers) == self._rendezvous.size - 1 and all(map(_final, answers.values()))

    def _hear(self, wait: bool) -> None:
        """Raise if a rank refused the epoch; ``wait``: wait for every rank's answer, and raise
        too if one could not lease, or if a rank did not answer within the agreement's bound."""
        rendezvous = self._rendezvous
        deadline = time.monotonic() + rendezvous.wait
        while True:
            answers = self._answers_now()
            problem = self._refusal(answers)
            failed = sorted(rank for rank, answer in answers.items() if not answer["leased"])
            if not problem and wait and failed:
                problem = (f"epoch {self._epoch}: rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
                           f"of the group could not resume it (see their errors); every rank stops rather than read "
                           "different data")
            if not problem and wait and len(answers) < rendezvous.size - 1 and time.monotonic() >= deadline:
                silent = [rank for rank in range(1, rendezvous.size) if rank not in answers]
                with self._lock:
                    files = "; ".join(self._unread.get(rank) or
                                      f"no file at {rendezvous.ack_path(self._epoch, rank)}" for rank in silent)
                problem = (f"epoch {self._epoch}: rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
                           f"of {rendezvous.size} did not answer the first rank's epoch file "
                           f"{rendezvous.path(self._epoch)} within {rendezvous.wait:.0f} s ({files}), so this rank "
                           "cannot know that they resume what it resumes. Start every rank with the same cache, "
                           "split and run id (GROWCACHE_RUN_ID, or run_id=), each with the state it saved at the "
                           "same step; every rank must be running.")
            if problem:
                self._fail(problem)
                raise EpochSyncError(problem)
            if not wait or len(answers) == rendezvous.size - 1:
                return
            time.sleep(_POLL_S)

    def _refusal(self, answers: dict[int, dict[str, Any]]) -> str:
        refused = sorted(rank for rank, answer in answers.items() if answer["refused"])
        if not refused:
            return ""
        rendezvous = self._rendezvous
        names = [f"{rendezvous.rank} (this one, the group's first)", *map(str, refused)]
        problem = disagreement([self.shards.note, *(answers[rank]["note"] for rank in refused)], None,
                               collective=False, ranks=names) or (
            "they refused it, though they resume what this rank resumes (ranks of another growcache version?)")
        return (f"epoch {self._epoch}: rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))} of the "
                f"group refused the first rank's epoch file {rendezvous.path(self._epoch)}: {problem}")

    def _untold_refusal(self) -> str:
        """A refusal of this epoch that the first rank has yet to raise for; ``""`` if none (it is told once)."""
        problem = "" if self._told else self._refusal(self._answers_now())
        self._told = self._told or bool(problem)
        return problem

    def _abort(self) -> None:
        """The first rank's start failed after it published the epoch (the error being handled,
        if any, says why): the other ranks must not read it."""
        error = sys.exc_info()[1]
        why = f"{type(error).__name__}: {error}" if error is not None else "its start failed (see its error)"
        try:
            self._fail(f"epoch {self._epoch}: the group's first rank failed after it published the epoch, so no "
                       f"rank reads it: {why}")
        except OSError as exc:  # the first rank raises its own error; the others wait for their bound
            logger.error("could not tell the other ranks of epoch %d that this first rank failed (%s)", self._epoch,
                         exc)

    def _fail(self, problem: str) -> None:
        """The first rank will not read the epoch, for ``problem``. Its epoch file says so from now
        on, for the ranks that have yet to answer it and those that wait for its confirmation (it
        goes if every rank refused or could not lease: none reads it)."""
        rendezvous = self._rendezvous
        self._told = True
        with rendezvous._lock:
            if self in rendezvous._taken:
                rendezvous._taken.remove(self)
        answers = self._answers_now()
        waiting = len(answers) < rendezvous.size - 1 or any(answer["leased"] for answer in answers.values())
        with rendezvous._lock:
            if rendezvous._current.get(self._epoch) != self._attempt:
                return  # a later attempt replaced this one: its files are its own
            if not waiting:
                rendezvous._withdraw(self._epoch, self._attempt)
                return
            for rank in range(1, rendezvous.size):  # answers to this attempt, which is over
                _unlink_quiet(rendezvous.ack_path(self._epoch, rank))
            # Replaced in one rename: a rank waiting for the confirmation never finds the file gone.
            rendezvous._publish(self._epoch, replace(self.shards, error=problem, error_type="EpochSyncError"))


def _final(answer: dict[str, Any]) -> bool:
    """Whether a rank's answer is its last to its attempt: it refused, could not lease, or started reading."""
    return answer["refused"] or not answer["leased"] or answer["started"]


def remove_stale_epoch_files(cache_dir: str) -> int:
    """Delete epoch files whose first rank is gone, and acknowledgements nobody waits for.

    Called by every first rank before it publishes, and when a cache is opened or pruned,
    like the other temporaries. Returns how many files went.
    """
    directory = os.path.join(cache_dir, EPOCHS_DIR)
    if os.path.islink(directory):
        raise CacheFormatError(
            f"{directory} is a symbolic link. growcache deletes files inside it, so it refuses anything but a real "
            "directory there (a link could point outside the cache). Move it away, then open the cache again.")
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    removed = 0
    live = set()
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        if _is_directory(path):
            if _EPOCH_FILE.match(name) or _ACK_FILE.match(name):
                logger.warning("%s is a directory, named like an epoch file; it is ignored: remove it by hand", path)
            continue
        if _EPOCH_FILE.match(name):
            body = _read_epoch_file(path)
            if body is not None and not _writer_lives(body):
                if "damaged" in body:
                    logger.warning("%s; it is removed as a dead first rank's", body["damaged"])
                removed += _sweep(path)
            else:
                live.add(name[:-len(".json")])
    for name in names:
        path = os.path.join(directory, name)
        ack = _ACK_FILE.match(name)
        stale_ack = ack is not None and f"{ack.group(1)}-{ack.group(2)}" not in live and _older(path, now, AGREE_TIMEOUT_S)
        stale_temp = name.endswith(".tmp") and _older(path, now, _TEMP_MAX_AGE_S)
        if stale_ack or stale_temp:
            removed += _sweep(path)
    return removed


def _sweep(path: str) -> int:
    """Delete one stale entry of ``epochs/``; 1 if it went.

    The sweep runs at every cache open and epoch start, so an entry it cannot delete (a
    directory put there, a file another user owns under a sticky bit) is left with a warning:
    it must not make the cache unusable.
    """
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0
    except OSError as exc:
        logger.warning("cannot remove %s from the epoch files (%s); it is ignored: remove it by hand", path,
                       exc.strerror)
        return 0


def _is_directory(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _older(path: str, now: float, seconds: float) -> bool:
    try:
        return now - os.stat(path).st_mtime > seconds
    except FileNotFoundError:
        return False


def _read_epoch_file(path: str) -> dict[str, Any] | None:
    """An epoch file's body with its heartbeat (``"mtime"``); ``None`` if absent.

    Every field is checked: a damaged file (never written by a live first rank, since writes
    are atomic) comes back with ``"damaged"`` set, and counts as a dead writer's.
    """
    try:
        read = read_state_file(path, f"epoch file {path}")
    except CacheFormatError as exc:
        return {"damaged": str(exc)}
    if read is None:
        return None
    body, mtime = read
    problem = _epoch_file_problem(body)
    if problem:
        return {"damaged": f"epoch file {path} is damaged: {problem}", "pid": body.get("pid")}
    return {**body, "mtime": mtime}


def _epoch_file_problem(body: dict[str, Any]) -> str:
    seqs, names = body.get("seqs"), body.get("names", [])
    if not (_is_int(body.get("pid")) and body["pid"] > 0):
        return f"its pid is {body.get('pid')!r}, not a positive integer"
    start_time = body.get("start_time")
    # As for leases: a platform that tells no start times (no /proc) writes none, and another
    # machine's file lives by its heartbeat; here, where start times are known, one is required.
    if not ((_is_int(start_time) and start_time >= 0) or (start_time is None and (
            not _proc.start_times_known() or body.get("host") not in (None, _proc.this_host())))):
        return f"its start_time is {start_time!r}, not an integer"
    if not isinstance(body.get("host") or "", str):
        return f"its host is {body.get('host')!r}, not a string"
    if "expiry" in body and _proc.stored_expiry(body["expiry"]) is None:
        return f"its expiry is {body['expiry']!r}, not a number of seconds in range"
    if not (_is_int(body.get("epoch")) and body["epoch"] >= 0 and _is_int(body.get("seed"))):
        return "its epoch or seed is not an integer"
    if not (isinstance(seqs, list) and all(_is_int(q) and 0 < q <= MAX_SEQ for q in seqs)):
        return "its seqs are not a list of sequence numbers"
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return "its names are not a list of strings"
    if not isinstance(body.get("note") or "", str):
        return "its note is not a string"
    if not isinstance(body.get("error") or "", str) or not isinstance(body.get("error_type") or "", str):
        return "its error or error_type is not a string"
    if not isinstance(body.get("confirmed", False), bool):
        return f"its confirmed is {body['confirmed']!r}, not true or false"
    if "attempt" in body and not (isinstance(body["attempt"], str) and _ATTEMPT.fullmatch(body["attempt"])):
        return f"its attempt is {body['attempt']!r}, not 16 hexadecimal digits"
    return ""


def _read_answer(path: str, attempt: str) -> tuple[dict[str, Any] | None, str]:
    """A rank's answer to the epoch file of attempt ``attempt`` (its acknowledgement file), and
    why the file there is none (``""``: no file). Another process wrote it: every field is
    checked, and a link is never followed."""
    try:
        read = read_state_file(path, f"acknowledgement file {path}")
    except CacheFormatError as exc:
        return None, str(exc)
    if read is None:
        return None, ""
    body = read[0]
    if not (isinstance(body.get("attempt"), str) and _ATTEMPT.fullmatch(body["attempt"])):
        problem = f"its attempt is {body.get('attempt')!r}, not 16 hexadecimal digits"
    elif not all(isinstance(body.get(field), bool) for field in ("leased", "refused", "started")):
        problem = (f"its leased, refused and started are {body.get('leased')!r}, {body.get('refused')!r} and "
                   f"{body.get('started')!r}, not true or false")
    elif not isinstance(body.get("note"), str):
        problem = f"its note is {type(body.get('note')).__name__}, not a string"
    elif body["attempt"] != attempt:
        return None, f"acknowledgement file {path} answers another epoch file (an earlier attempt's, or a killed run's)"
    else:
        return body, ""
    return None, f"acknowledgement file {path} is damaged: {problem}"


def _writer_lives(body: dict[str, Any]) -> bool:
    """Whether the first rank that wrote an epoch file lives, by evidence only: its process
    in our process table, else its heartbeat against the expiry it stated itself."""
    if "damaged" in body:
        return False
    return _proc.is_alive(body["pid"], body["start_time"], body.get("host"), body["mtime"], body.get("expiry"))


def _unlink_quiet(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0
