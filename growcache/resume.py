"""Exact mid-epoch resume: the state a loader saves, its checks, and the pin that keeps its snapshot.

A growing cache changes by design, so a checkpoint names the epoch's snapshot itself (shard
names, sizes, record counts), not only counters, and keeps that snapshot readable until the
resume:

* **The state** (:func:`loader_state`) is a small, versioned, JSON-serializable dict: the epoch
  and seed, the cache's id (``growcache.json``'s ``cache_id``), the epoch's snapshot and the
  shards skipped as corrupt, the plan's parameters, the batches the training loop consumed
  (batches prefetched by readers do not count), and the epoch's pin; where the batches were
  taken out of order (``DataLoader(in_order=False)``), also each reader's (``delivered``,
  version 2), after which each reader resumes.
* **The pin.** The first ``state_dict()`` of an epoch pins its snapshot (:func:`pin_epoch`): a
  lease file in ``leases/`` that no process keeps alive, with an absolute expiry
  (``resume_ttl``, default :data:`DEFAULT_RESUME_TTL`). Until then the epoch's own lease holds
  every shard of the snapshot, so a state can only name shards that are there; a loader whose
  state is never asked for pins nothing, and a killed or abandoned epoch of it leaves no pin to
  hold a full cache's shards for hours. The pin outlives a killed process, so the
  shards the state names are still there at the resume; eviction respects it like any
  lease, ``growcache status`` shows it and ``growcache prune --pins`` drops expired or named
  ones. The epoch's end releases it, and so does the end of the resumed epoch that adopted it.
* **The resume** (:func:`load_state`, then the next :meth:`~growcache.epoch.Epochs.start` of
  the saved epoch): the saved snapshot is leased again and planned with the saved parameters,
  which gives the same plan; each reader skips the batches it had delivered (whole shuffle
  windows by record counts, without reading their payloads; it re-reads at most the one
  window the save fell in), and readers are rotated so that a round-robin consumer (a
  ``DataLoader``'s workers) delivers the rest in the uninterrupted run's order. It is the one
  start that takes no fresh snapshot; the next epoch takes one as usual.

Every field of a loaded state is checked (type, range, the cache's id); a damaged or hostile
dict gets a ``ValueError`` naming the field. The state of older growcache, ``{"epoch": N}``,
still loads (it resumes at the start of epoch ``N``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .batching import ReaderShare, delivered_records, window_batches
from .cache import Cache
from .epoch import SPLITS, Epoch, EpochBookkeeping, Epochs, _error_class, run_id
from .errors import EpochSyncError, MissingShardsError
from .manifest import CACHE_ID, PIN_NAME
from .planning import EpochPlan, ReadPoints, _batches, plan_epoch, read_points, reader_seed, round_robin_progress
from .rendezvous import CollectiveRendezvous, EpochShards, FileRendezvous, disagreement
from .shard import ShardInfo

__all__ = [
    "DEFAULT_RESUME_TTL",
    "ON_MISSING",
    "READERS",
    "STATE_VERSION",
    "Pin",
    "Resume",
    "ResumableLoader",
    "check_state",
    "end_epochs",
    "end_when_dropped",
    "keep_pin",
    "load_state",
    "loader_state",
    "needed_shards",
    "pin_epoch",
    "release_kept_pins",
    "split_progress",
]

logger = logging.getLogger(__name__)

#: The newest version of the state dict :func:`loader_state` writes: 2 where it names each
#: reader's batches (``delivered``: taken out of order), else 1, which older growcache reads.
STATE_VERSION = 2
#: Seconds an epoch's pin keeps its snapshot after the epoch's start when nobody releases it
#: (a killed run): 12 hours, long enough for a preempted job to be rescheduled overnight,
#: short enough that an abandoned run's shards do not hold the disk for days.
DEFAULT_RESUME_TTL = 12 * 3600.0
ON_MISSING = ("raise", "skip")
#: The kinds of reader a state's ``plan.reader`` names: growcache's own readers (the PyTorch
#: loader, TensorFlow's ``reader="growcache"``), which pass over delivered windows, or
#: TensorFlow's ``TFRecordDataset`` replay, which reads the epoch again and drops the consumed
#: batches. Each delivers another order, so a state resumes only in a reader of its kind.
READERS = ("growcache", "tensorflow")
_FORMAT = "growcache-loader"
_KEYS = {"format", "version", "epoch", "seed", "cache_id", "plan", "snapshot", "progress", "pin"}
_KEYS_SINCE = {"delivered": 2}  # optional fields, and the version that brought each
_PLAN_KEYS = {"world_size": 1, "rank": 0, "group_size": 1, "group_rank": 0, "workers": 1, "batch_size": 1,
              "shuffle_buffer": 0}
_PLAN_FLAGS = ("even_batches", "drop_last")
_REPLANNABLE = ("batch_size", "shuffle_buffer", "drop_last", "world_size", "rank", "group_size", "group_rank")
_WORLD = ("world_size", "rank", "group_size", "group_rank")
_MAX_INT = 2**62
_MAX_READERS = 2**17  # ranks x workers of one group: planning an epoch takes about 1 s per 10**5
_PLAN_LIMITS = {"workers": 4096, "world_size": _MAX_READERS, "group_size": _MAX_READERS}
_MAX_SHARDS = 10**7


# -- the pin ------------------------------------------------------------------------------------
@dataclass
class Pin:
    """An epoch's durable lease: a pin of its snapshot in ``cache``, named ``name``, until ``until``."""

    cache: Cache
    name: str
    until: float
    seqs: frozenset[int] = frozenset()
    holder: str = ""
    run: str = ""

    def shrink(self, seqs: set[int]) -> None:
        """Hold only ``seqs`` from now on (the shards the rest of the epoch reads), if that is fewer:
        a cache that is full then evicts shards already read, even after a kill. Logged, never raised."""
        seqs = frozenset(seqs) & self.seqs
        if seqs == self.seqs:
            return
        try:
            self.cache.pin(sorted(seqs), until=self.until, holder=self.holder, run=self.run, name=self.name)
        except OSError as exc:
            logger.warning("could not shrink resume pin %s of cache %s (%s); it keeps %d shards", self.name,
                           self.cache.path, exc, len(self.seqs))
            return
        self.seqs = seqs

    def release(self) -> None:
        """Release the pin (idempotent); a failure to is logged, never raised (the pin expires)."""
        try:
            self.cache.unpin(self.name)
        except OSError as exc:
            logger.warning("could not release resume pin %s of cache %s (%s); it expires at %s", self.name,
                           self.cache.path, exc, time.ctime(self.until))


def release_kept_pins(epoch: Epoch) -> None:
    """``epoch`` of a loader starts: the pins its earlier, unfinished epochs kept are released
    (the run went on, so states naming them are stale)."""
    own = None if epoch.pin is None else epoch.pin.name
    for kept in epoch.epochs.__dict__.pop("_kept_pins", []):
        # By name: a resume adopts the pin its state names as a new object, and the kept one of
        # the same name is that very file, which the resumed epoch still reads from.
        if kept.name != own:
            kept.release()


def pin_epoch(epoch: Epoch, ttl: float) -> None:
    """Pin ``epoch``'s snapshot for ``ttl`` seconds from now (``0``: no pin), as :attr:`Epoch.pin`,
    unless it is pinned already or has ended. Called by the epoch's first ``state_dict()``, while
    the epoch's own lease still holds every shard of its snapshot.

    A failure to write the pin (a full disk, a read-only cache) is logged: the epoch reads on,
    only its resume after a kill is not protected from eviction.
    """
    epochs = epoch.epochs
    if ttl <= 0 or epoch.pin is not None or epoch.ended or not len(epoch.snapshot):
        return
    until = time.time() + ttl
    seqs = frozenset(s.seq for s in epoch.snapshot.shards)
    holder, run = f"{epochs._holder or 'loader'} epoch {epoch.number}", run_id(epochs.options.run_id)
    try:
        name = epochs.cache.pin(sorted(seqs), until=until, holder=holder, run=run)
    except OSError as exc:
        logger.warning("could not pin epoch %d's snapshot in cache %s for a resume (%s): a resume after a kill "
                       "may find shards evicted", epoch.number, epochs.cache.path, exc)
        return
    epoch.pin = Pin(epochs.cache, name, until, seqs, holder, run)


def keep_pin(epoch: Epoch) -> None:
    """``epoch`` ends unfinished (its iterator abandoned, its loader closed, its process leaving):
    its pin outlives it, for a resume from a state saved in it, until the next epoch of the same
    loader starts (:func:`release_kept_pins`), an adopting resume ends, or its expiry."""
    if epoch.pin is not None:
        epoch.epochs.__dict__.setdefault("_kept_pins", []).append(epoch.pin)
        epoch.pin = None


def end_epochs(epochs: Epochs, last: Epoch | None = None) -> None:
    """End every open epoch of ``epochs`` (a loader closed or dropped: none of its readers will read
    again); ``last`` (default: the latest), if unfinished, keeps its pin (:func:`keep_pin`): a state
    saved in it may be resumed."""
    last = epochs.latest if last is None else last
    if last is not None and not last.ended:
        keep_pin(last)
    epochs.end_all()


def end_when_dropped(loader: Any, epochs: Epochs) -> None:
    """:func:`end_epochs` when ``loader`` is collected without ``close()``. An epoch's lease is held
    through a cycle (the epoch and its ``Epochs``) that only a garbage collection frees: a loader
    dropped with an epoch open (left by ``break`` with persistent workers) kept its shards on disk
    past the budget until then."""
    weakref.finalize(loader, end_epochs, epochs)


# -- the state ----------------------------------------------------------------------------------
def _plan_params(epochs: Epochs) -> dict[str, Any]:
    group, options = epochs.group, epochs.options
    return {"world_size": group.world_size, "rank": group.world_rank, "group_size": group.size,
            "group_rank": group.rank, "split": options.split, "even_batches": bool(options.even_batches),
            "workers": epochs.readers, "batch_size": int(options.batch_size),
            "shuffle_buffer": int(epochs.reader.shuffle_buffer), "drop_last": bool(options.drop_last)}


def check_consumed(consumed: Any) -> None:
    """Raise ``ValueError`` unless ``consumed`` (a ``state_dict`` argument) is ``None`` or an integer >= 0."""
    if consumed is not None and (isinstance(consumed, bool) or not isinstance(consumed, (int, np.integer))
                                 or consumed < 0):
        raise ValueError(f"consumed is the batches the training loop took in the current epoch, an integer >= 0, "
                         f"not {consumed!r}")


def loader_state(epochs: Epochs, latest: Epoch | None, *, reader: str = "growcache",
                 consumed: int | None = None) -> dict[str, Any]:
    """The state to resume ``epochs`` from, ``latest`` being the epoch the adapter started last,
    read by a ``reader`` of :data:`READERS` (``plan.reader``), after ``consumed`` of its batches
    (default and most: the batches the adapter handed over, ``latest.consumed``).

    Mid-epoch, it names that epoch's snapshot and progress; between epochs (or once every batch of
    the epoch was consumed), the next epoch, with ``snapshot`` and ``pin`` ``None``. A state
    loaded and not yet resumed is given back as it was loaded.
    """
    if epochs.resume is not None:
        return epochs.resume.state
    if getattr(latest, "assignment", None) is not None and not latest.ended:
        logger.warning("epoch %d was re-planned over another worker count: progress in it is not saved, so a resume "
                       "from this state reads again what was read since the previous resume", latest.number)
        return latest.loaded_state
    # Version 1 unless the state names each reader's batches: older growcache resumes from it.
    state: dict[str, Any] = {"format": _FORMAT, "version": 1, "epoch": int(epochs.epoch),
                             "seed": int(epochs.options.seed), "cache_id": epochs.cache.cache_id,
                             # Before a first epoch the group is unknown, and resolving it here would fix it
                             # before the process group exists: a state between epochs needs no plan.
                             "plan": {**_plan_params(epochs), "reader": reader} if epochs._group is not None else None,
                             "snapshot": None, "progress": 0, "pin": None}
    asked = 0 if latest is None else latest.consumed if consumed is None else min(int(consumed), latest.consumed)
    # Counted per reader, a resume takes what the readers' counts add up to (less than asked only
    # where a reader was unknown): each reader resumes after its own batches.
    delivered = None if latest is None else latest.delivered(asked)
    taken = asked if delivered is None else sum(delivered)
    if taken < asked and not latest.ended and not latest._order_noted:
        latest._order_noted = True  # once per epoch: a trainer saves often
        logger.warning("epoch %d: batches taken out of order (DataLoader in_order=False) whose readers are not all "
                       "known: a resume from a state saved in it starts where the count per reader began (batch %d "
                       "of %d now), and reads those taken since again", latest.number, taken, asked)
    if latest is None or latest.ended or taken >= latest.batches():
        if latest is not None and not latest.ended:
            state["epoch"] = latest.number + 1
        return state
    saved = getattr(latest, "saved_shards", None)
    shards = saved if saved is not None else [[os.path.basename(s.path), s.nbytes, s.records]
                                               for s in latest.shards]
    names = {name for name, _, _ in shards}
    noted = epochs._noted if epochs._noted_epoch == latest.number else set()
    skipped = sorted({os.path.basename(path) for path, _, _ in noted} & names)
    if latest.pin is not None and getattr(latest, "assignment", None) is None:
        # What a resume one batch earlier reads too: a trainer that fetches a batch ahead saves
        # the batches its steps processed (Lightning's ResumeCallback, Lightning issue #18135).
        latest.pin.shrink(set(latest.left(max(taken - 1, 0))))
    state.update(epoch=latest.number, seed=latest.seed, progress=int(taken),
                 snapshot={"shards": [list(s) for s in shards], "skipped": skipped},
                 pin=None if latest.pin is None else {"name": latest.pin.name, "until": latest.pin.until})
    if delivered is not None and delivered != round_robin_progress(latest.read_points().counts, taken)[0]:
        # Taken out of order: each reader resumes after its own batches (version 1 cannot say so).
        state.update(version=2, delivered=[int(d) for d in delivered])
    return state


def _int(state: Mapping[str, Any], key: str, low: int, high: int, where: str = "") -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"resume state field '{where}{key}' is {value!r}, not an integer in [{low}, {high}]")
    return int(value)


def check_state(state: Any) -> dict[str, Any]:
    """A loader state, every field checked; ``{"epoch": N}`` (older growcache) is filled in.

    Returns:
        The state as :func:`loader_state` writes it (``cache_id``, ``plan`` ``None`` for an old one).

    Raises:
        ValueError: a field is missing, of the wrong type or out of range (naming it), or the
            state is of a newer version.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"a resume state is a dict (from loader.state_dict()), not a {type(state).__name__}")
    if set(state) == {"epoch"}:  # growcache before exact resume
        return {"format": _FORMAT, "version": STATE_VERSION, "epoch": _int(state, "epoch", 0, _MAX_INT),
                "seed": None, "cache_id": None, "plan": None, "snapshot": None, "progress": 0, "pin": None}
    unknown = sorted(str(k) for k in set(state) - _KEYS
                     if not (k in _KEYS_SINCE and isinstance(state.get("version"), int)
                             and state["version"] >= _KEYS_SINCE[k]))
    missing = sorted(_KEYS - set(state))
    if state.get("format") != _FORMAT:
        raise ValueError(f"resume state field 'format' is {state.get('format')!r}, not {_FORMAT!r}: this is not a "
                         "growcache loader's state")
    version = _int(state, "version", 1, _MAX_INT)
    if version > STATE_VERSION:
        raise ValueError(f"resume state field 'version' is {version}, newer than the version {STATE_VERSION} this "
                         "growcache reads: upgrade growcache to resume from it")
    if unknown or missing:
        raise ValueError(f"resume state has unknown fields {unknown} and lacks fields {missing}")
    out: dict[str, Any] = {"format": _FORMAT, "version": version, "epoch": _int(state, "epoch", 0, _MAX_INT),
                           "seed": _int(state, "seed", -2**63, 2**64 - 1)}
    cache_id = state["cache_id"]
    if cache_id is not None and not (isinstance(cache_id, str) and CACHE_ID.match(cache_id)):
        raise ValueError(f"resume state field 'cache_id' is {cache_id!r}, not a cache id (32 hexadecimal digits)")
    out["cache_id"] = cache_id
    plan = state["plan"]
    if plan is None and state["snapshot"] is None:
        out.update(cache_id=cache_id, plan=None, snapshot=None, progress=_int(state, "progress", 0, 0), pin=None)
        if state["pin"] is not None or state.get("delivered") is not None:
            raise ValueError(f"resume state field '{'pin' if state['pin'] is not None else 'delivered'}' is set "
                             "without a snapshot")
        return out
    keys = {*_PLAN_KEYS, *_PLAN_FLAGS, "split"}
    # 'reader' is optional: states saved before it named their reader are growcache's.
    if not isinstance(plan, Mapping) or set(plan) - {"reader"} != keys:
        raise ValueError(f"resume state field 'plan' is not a dict of {sorted(keys)} (and 'reader')")
    checked = {key: _int(plan, key, low, _MAX_INT, "plan.") for key, low in _PLAN_KEYS.items()}
    # A resume plans the saved epoch over every reader of the group, so their number bounds its work.
    for key, top in _PLAN_LIMITS.items():
        if checked[key] > top:
            raise ValueError(f"resume state field 'plan.{key}' is {checked[key]}, more than {top}: the state is "
                             "damaged or not a growcache loader's")
    if checked["group_size"] * checked["workers"] > _MAX_READERS:
        raise ValueError(f"resume state fields 'plan.group_size' x 'plan.workers' give "
                         f"{checked['group_size'] * checked['workers']} readers, more than {_MAX_READERS}: the state "
                         "is damaged or not a growcache loader's")
    for key in _PLAN_FLAGS:
        if not isinstance(plan[key], bool):
            raise ValueError(f"resume state field 'plan.{key}' is {plan[key]!r}, not a bool")
        checked[key] = plan[key]
    if plan["split"] not in SPLITS:
        raise ValueError(f"resume state field 'plan.split' is {plan['split']!r}, not one of {SPLITS}")
    checked["split"] = plan["split"]
    reader = plan.get("reader", "growcache")
    if reader not in READERS:
        raise ValueError(f"resume state field 'plan.reader' is {reader!r}, not one of {READERS}")
    checked["reader"] = reader
    if checked["rank"] >= checked["world_size"] or checked["group_rank"] >= checked["group_size"] \
            or checked["group_size"] > checked["world_size"]:
        raise ValueError(f"resume state field 'plan' names rank {checked['rank']} of {checked['world_size']} "
                         f"(group rank {checked['group_rank']} of {checked['group_size']}): no such rank")
    out["plan"] = checked
    out["snapshot"] = _check_snapshot(state["snapshot"])
    out["progress"] = _int(state, "progress", 0, _MAX_INT)
    if out["snapshot"] is None and out["progress"]:
        raise ValueError(f"resume state field 'progress' is {out['progress']} without a snapshot")
    pin = state["pin"]
    if pin is not None:
        if not (isinstance(pin, Mapping) and set(pin) == {"name", "until"} and isinstance(pin["name"], str)
                and PIN_NAME.match(pin["name"]) and isinstance(pin["until"], (int, float))
                and not isinstance(pin["until"], bool) and math.isfinite(pin["until"])):
            raise ValueError(f"resume state field 'pin' is {pin!r}, not {{'name': 'pin-<32 hex>.json', 'until': "
                             "seconds}")
        pin = {"name": pin["name"], "until": float(pin["until"])}
    out["pin"] = pin
    delivered = _check_delivered(state.get("delivered"), out)
    if delivered is not None:
        out["delivered"] = delivered
    return out


def _check_delivered(delivered: Any, state: dict[str, Any]) -> list[int] | None:
    """The batches each of the saved rank's readers had delivered (a state saved out of order), checked."""
    if delivered is None:
        return None
    workers = state["plan"]["workers"]
    if not (isinstance(delivered, list) and len(delivered) == workers
            and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and 0 <= d <= _MAX_INT
                    for d in delivered) and sum(delivered) == state["progress"] and state["snapshot"] is not None):
        raise ValueError(f"resume state field 'delivered' is {delivered!r}, not the batches each of the "
                         f"{workers} readers delivered, adding up to 'progress' ({state['progress']})")
    return [int(d) for d in delivered]


def _check_snapshot(snapshot: Any) -> dict[str, Any] | None:
    if snapshot is None:
        return None
    if not (isinstance(snapshot, Mapping) and set(snapshot) == {"shards", "skipped"}
            and isinstance(snapshot["shards"], list) and isinstance(snapshot["skipped"], list)):
        raise ValueError("resume state field 'snapshot' is not a dict of a 'shards' and a 'skipped' list")
    shards = snapshot["shards"]
    if not 0 < len(shards) <= _MAX_SHARDS:
        raise ValueError(f"resume state field 'snapshot.shards' lists {len(shards)} shards, not 1 to {_MAX_SHARDS}")
    out, names = [], set()
    for i, entry in enumerate(shards):
        info = ShardInfo.from_path(entry[0]) if isinstance(entry, list) and len(entry) == 3 \
            and isinstance(entry[0], str) and os.path.basename(entry[0]) == entry[0] else None
        if info is None or entry[1:] != [info.nbytes, info.records] or entry[0] in names:
            raise ValueError(f"resume state field 'snapshot.shards[{i}]' is {entry!r}, not a distinct "
                             "[shard file name, bytes, records] of this name's counts")
        names.add(entry[0])
        out.append([entry[0], info.nbytes, info.records])
    skipped = snapshot["skipped"]
    if not all(isinstance(name, str) and name in names for name in skipped):
        raise ValueError("resume state field 'snapshot.skipped' names shards that are not in the snapshot")
    return {"shards": out, "skipped": sorted(set(skipped))}


# -- the resume ---------------------------------------------------------------------------------
#: Batches each reader had delivered after some consumed round-robin: see
#: :func:`growcache.planning.round_robin_progress`.
split_progress = round_robin_progress


def needed_shards(plan: EpochPlan, rank: int, consumed: int, window_rows: int, window_batches: int,
                  records: Sequence[int], tops_up: bool, *, exact: bool = True,
                  delivered: Sequence[int] | None = None) -> set[int]:
    """Indices of the snapshot shards that rank ``rank`` still reads after ``consumed`` batches
    (:meth:`growcache.planning.ReadPoints.left`; ``window_rows`` is ``window_batches`` batches),
    or, where given, once each of its readers delivered ``delivered`` (a state's ``delivered``:
    :meth:`~growcache.planning.ReadPoints.left_after`).

    A reader passes over the whole shuffle windows it delivered, and the shards wholly inside
    them are never opened again; a top up keeps the start of its cycle that it reads again.
    """
    points = read_points(plan, rank, records, window_batches, tops_up=tops_up, exact=exact)
    return points.left(consumed) if delivered is None else points.left_after(delivered)


@dataclass(eq=False)
class _ResumedEpoch(Epoch):
    """An epoch finished from a saved state: the saved snapshot's plan, readers rotated and skipping."""

    saved_shards: list | None = None
    loaded_state: dict | None = None
    skips: tuple[int, ...] = ()
    rotation: int = 0
    gone: np.ndarray | None = None
    assignment: tuple[tuple[int, ...], ...] | None = None  # re-planned: saved readers each reader finishes
    parts: dict | None = None  # re-planned record by record: Resume._record_parts
    saved_windows: int = 1  # batches of a shuffle window in the saved layout
    saved_tops_up: bool = False  # the saved plan's readers top up (its quotas and cycles hold)
    whole: bool = False  # re-planned over another world size: its lease holds the snapshot to the end

    def share(self, reader: int = 0) -> ReaderShare:
        if self.assignment is not None:
            parts = [self._saved_share(original) for original in self.assignment[reader]]
            if not parts:
                return ReaderShare(self._paths, self._records, np.empty(0, np.int64), quota=0)
            parts[0].then = tuple(parts[1:])
            return parts[0]
        return self._saved_share((reader + self.rotation) % self.plan.workers)

    def planned_reader(self, reader: int | None) -> int | None:
        if reader is None or self.assignment is not None:  # re-planned: its progress is not saved anyway
            return None
        return (reader + self.rotation) % self.plan.workers  # as share() reads them

    def _exact(self) -> bool:
        return super()._exact() and not (self.gone is not None and self.gone.size) and self.parts is None

    def read_points(self) -> ReadPoints:
        if self._points is None:  # in the saved layout's batches and windows
            epochs = self.epochs
            self._points = read_points(self.plan, epochs.group.rank, self._records, self.saved_windows,
                                       tops_up=epochs.tops_up, exact=self._exact())
        return self._points

    def batches(self) -> int:
        if self.parts is None:
            return super().batches()
        return int(self.loaded_state["progress"]) + _part_batches(self.epochs, self.parts)

    def _left_indices(self, consumed: int) -> set[int]:
        if self.whole:  # readers finish other saved ranks' streams
            return set(range(len(self._records)))
        if self.assignment is None:
            return super()._left_indices(consumed)
        # Re-planned: each reader reads saved readers' rests one after another, no longer
        # round-robin; what the rests read from the resume point on stays leased.
        points = self.read_points()
        return {shard for worker, mine in enumerate(points.points)
                for _, shard in mine[points.passed(worker, self.skips[worker]):]} | points.kept

    def _next_change(self) -> int:
        return super()._next_change() if self.assignment is None else 2**62

    def _saved_share(self, original: Any) -> ReaderShare:
        """The rest of saved reader ``original``'s share (a worker of this rank, or ``(rank, worker)``)."""
        if isinstance(original, tuple):  # another saved rank's reader: the saved plan's share of it
            index = self.plan.reader(*original)
            tops_up = self.saved_tops_up
            share = ReaderShare(self._paths, self._records, self.plan.shards[index],
                                quota=int(self.plan.quotas[index]) if tops_up else -1,
                                cycle=self.plan.cycle[index] if tops_up else np.empty(0, np.int64),
                                shuffle_seed=reader_seed(self.seed, self.plan.epoch, index))
        else:
            share = super().share(original)
        if self.parts is not None:
            share.skip_records, share.exclude, share.quota = self.parts[original][:3]
        else:
            share.skip_batches = self.skips[original]
        if self.gone is not None:
            share.gone = self.gone
        return share


class Resume:
    """A checked state waiting for the start of its epoch (:attr:`Epochs.resume`).

    Attributes:
        state: the checked state, as loaded.
        epoch: the epoch it finishes.
    """

    def __init__(self, state: dict[str, Any], pin: Pin | None, gone: set[str], *, replan: bool = False) -> None:
        self.state = state
        self.replan = replan
        self.epoch = int(state["epoch"])
        self._pin = pin
        self._gone = gone

    def abandon(self, *, quiet: bool = False) -> None:
        """Another epoch starts instead (``set_epoch`` to another number): release the adopted pin.
        ``quiet``: the resume failed, and its pin stays (until its expiry) for a retry."""
        if self._pin is not None and not quiet:
            logger.warning("the resume of epoch %d is abandoned (another epoch starts): its pin is released",
                           self.epoch)
            self._pin.release()
        self._pin = None


    def note(self, epochs: Epochs) -> str:
        """What this rank resumes, for the other ranks to check (:attr:`EpochShards.note`): the
        epoch, seed, progress and layout every rank shares, and its group's cache and snapshot."""
        state = self.state
        layout = {key: value for key, value in state["plan"].items() if key not in ("rank", "group_rank", "workers")}
        names = json.dumps([name for name, _, _ in state["snapshot"]["shards"]]).encode()
        return json.dumps({"epoch": self.epoch, "seed": state["seed"], "progress": state["progress"],
                           "layout": layout, "group": epochs.group.name, "cache": state["cache_id"],
                           "snapshot": hashlib.sha1(names).hexdigest()[:16]}, sort_keys=True)

    def start(self, epochs: Epochs) -> Epoch:
        """Start the saved epoch again: lease its shards, plan it with the saved parameters.

        Ranks in several processes agree on it first, through their rendezvous: every rank
        must resume the same epoch, snapshot, progress and layout (each its own state, saved
        at the same step), or every rank raises :class:`~growcache.EpochSyncError` naming what
        each one resumes, rather than read on and hang in an all-reduce. Ranks in one process
        (TensorFlow's input pipelines) share one state.
        """
        rendezvous = epochs._rendezvous
        if not isinstance(rendezvous, (CollectiveRendezvous, FileRendezvous)):
            return self._start(epochs, None)
        note = self.note(epochs)
        saved = self._saved_shards(epochs)
        agreement = rendezvous.share(self.epoch, lambda: replace(saved, note=note), note)
        shards = agreement.shards
        if shards.error:  # a first rank that started afresh and found no snapshot
            raise _error_class(shards.error_type)(f"{shards.error} (reported by the first rank of a group)")
        notes = agreement.notes if agreement.notes is not None else [shards.note, note]
        problem = disagreement(notes, epochs.group, collective=agreement.notes is not None)
        if problem:
            self.abandon(quiet=True)
            agreement.give_up()
            raise EpochSyncError(problem)
        self._confirmed = False
        try:
            epoch = self._start(epochs, agreement)
        except BaseException:
            if not self._confirmed:
                agreement.confirm(False, 0)  # a collective rendezvous must hear from every rank
            raise
        if agreement.took:  # each rank's own lease and pin hold its shards: only the epoch file goes
            agreement.release(lambda: None)
        return epoch

    def _saved_shards(self, epochs: Epochs) -> EpochShards:
        infos = [ShardInfo.from_path(os.path.join(epochs.cache.shards_dir, name))
                 for name, _, _ in self.state["snapshot"]["shards"]]
        return EpochShards(self.epoch, self.state["seed"], tuple(i.seq for i in infos),
                           tuple(os.path.basename(i.path) for i in infos))

    def _start(self, epochs: Epochs, agreement: Any) -> Epoch:
        state, group = self.state, epochs.group
        kind = _check_layout(epochs, state["plan"], replan=self.replan)
        replanned = kind != "same"
        shards = state["snapshot"]["shards"]
        present_names = {os.path.basename(s.path) for s in epochs.cache.list_shards()}
        gone = self._gone | {name for name, _, _ in shards if name not in present_names}
        infos = [ShardInfo.from_path(os.path.join(epochs.cache.shards_dir, name)) for name, _, _ in shards]
        keep = [info for info in infos if os.path.basename(info.path) not in gone]
        try:
            snapshot = epochs.cache.lease([info.seq for info in keep], holder=epochs._holder)
        except EpochSyncError as exc:
            raise MissingShardsError(f"shards of the saved epoch {self.epoch} went between load_state_dict and the "
                                     f"resumed epoch's start: {exc}") from None
        plan_args = state["plan"]

        def plan_for(target: int | None) -> EpochPlan:
            return plan_epoch([info.records for info in infos], epoch=self.epoch, seed=state["seed"],
                              world_size=plan_args["group_size"], num_workers=plan_args["workers"],
                              batch_size=plan_args["batch_size"], drop_last=plan_args["drop_last"],
                              even_batches=plan_args["even_batches"], target_batches=target)

        try:
            plan = plan_for(None)
            parts = (self._record_parts(epochs, plan, infos) if kind == "records" else
                     self._world_parts(epochs, plan, infos) if kind == "world" else None)
            if agreement is not None:  # as at the epoch's start: groups of ranks agree on one batch count
                reports = agreement.confirm(True, plan.rank_batches(group.rank) if parts is None else
                                            _part_batches(epochs, parts))
                self._confirmed = True
                failed = [rank for rank, (leased, _) in enumerate(reports or ()) if not leased]
                if failed:
                    raise EpochSyncError(f"ranks {failed} could not resume epoch {self.epoch} (see their errors); "
                                         "every rank stops rather than read different data")
                if reports is not None and parts is not None and epochs.tops_up and len(reports) > 1:
                    _even_parts(epochs, parts, [batches for _, batches in reports])
                elif reports is not None and group.groups > 1 and plan_args["even_batches"]:
                    counts = [batches for _, batches in reports]
                    plan = plan_for(min(counts) if plan_args["drop_last"] else max(counts))
        except BaseException:
            snapshot.close()
            raise
        workers = plan.workers
        counts = [plan.batches(plan.reader(plan_args["group_rank"], w)) for w in range(workers)]
        skips, following = self._skips(counts)
        assignment = None
        if kind == "world":
            assignment = [[key for key in parts if parts[key][3] == reader] for reader in range(epochs.readers)]
        elif replanned:  # each saved reader's rest goes whole to one reader, the largest rests first
            rests = [int(plan.quotas[plan.reader(group.rank, w)]) - skips[w] * plan.batch_size if parts is None
                     else parts[w][2] - parts[w][0] - len(parts[w][1]) for w in range(workers)]
            loads, assignment = [0] * epochs.readers, [[] for _ in range(epochs.readers)]
            for w in sorted(range(workers), key=lambda w: -rests[w]):
                target = loads.index(min(loads))
                assignment[target].append(w)
                loads[target] += max(rests[w], 0)
        agreed = EpochShards(self.epoch, state["seed"], tuple(i.seq for i in infos),
                             tuple(os.path.basename(i.path) for i in infos))
        epoch = _ResumedEpoch(epochs, next(epochs._tokens), agreed, snapshot, plan, None,
                              consumed=min(state["progress"], sum(counts)), pin=self._pin, loaded_state=state,
                              saved_shards=[list(s) for s in shards], skips=tuple(skips),
                              rotation=0 if replanned else following,
                              assignment=None if assignment is None else tuple(map(tuple, assignment)),
                              parts=parts, saved_windows=window_batches(plan_args["shuffle_buffer"],
                                                                        plan_args["batch_size"]),
                              saved_tops_up=_saved_tops_up(plan_args), whole=kind == "world",
                              gone=np.array(sorted(i for i, info in enumerate(infos)
                                                   if os.path.basename(info.path) in gone), np.int64))
        epoch._paths = np.array([os.fsencode(info.path) for info in infos], dtype=np.bytes_)
        epoch._records = np.array([info.records for info in infos], dtype=np.int64)
        if state.get("delivered") is not None and assignment is None:
            epoch._count_per_reader(list(skips))  # a later save names each reader's batches again
        self._pin = None  # the epoch owns it now
        with epochs._lock:
            epochs.latest = epoch
            epochs.epoch = self.epoch + 1
            epochs._open[epoch.token] = epoch
        logger.info("resuming epoch %d of cache %s at batch %d of %d (%d shards)", self.epoch, epochs.cache.path,
                    epoch.consumed, sum(counts), len(infos))
        return epoch

    def _record_parts(self, epochs: Epochs, plan: EpochPlan, infos: list[ShardInfo],
                      rank: int | None = None) -> dict[Any, list]:
        """Per saved reader of ``rank`` (default: this one), re-planned over another batch size
        or shuffle buffer: ``[records passed over, positions delivered past them, quota]`` of its
        stream. Every rank consumed as many batches, so any rank's state tells every rank's."""
        state = self.state
        saved = state["plan"]
        mine = rank is None
        rank = epochs.group.rank if mine else rank
        tops_up = _saved_tops_up(saved)
        counts = [plan.batches(plan.reader(rank, w)) for w in range(plan.workers)]
        # Another rank's readers: as taken round-robin (a state names only its own rank's).
        skips, _ = self._skips(counts) if mine else split_progress(counts, state["progress"])
        parts: dict[Any, list] = {}
        for worker in range(plan.workers):
            index = plan.reader(rank, worker)
            quota = int(plan.quotas[index]) if tops_up else sum(infos[int(i)].records for i in plan.shards[index])
            skip, exclude = delivered_records(reader_seed(state["seed"], self.epoch, index), quota, skips[worker],
                                              saved["batch_size"], saved["shuffle_buffer"], saved["drop_last"])
            parts[worker if mine else (rank, worker)] = [skip, exclude, quota]
        return parts

    def _skips(self, counts: list[int]) -> tuple[list[int], int]:
        """The batches each saved reader of this rank delivered, with ``counts`` batches each, and the
        reader that delivers next: named in the state where they were taken out of order, else
        the state's progress taken round-robin."""
        delivered = self.state.get("delivered")
        if delivered is None:
            return split_progress(counts, self.state["progress"])
        return [min(int(d), c) for d, c in zip(delivered, counts)], 0

    def _world_parts(self, epochs: Epochs, plan: EpochPlan, infos: list[ShardInfo]) -> dict[Any, list]:
        """Re-planned over another world size: every saved reader's rest, of every saved rank, goes
        whole to one reader of the new world (the largest first, to the least loaded; the same on
        every rank); this rank's, each with the reader it goes to as a fourth item."""
        if self.state.get("delivered") is not None:
            logger.warning("epoch %d was saved with batches taken out of order: re-planned over another world size, "
                           "each rank's rest is taken as if its batches had been taken in turn (every rank must "
                           "plan the same rests, and a state names only its own rank's readers), so a few batches "
                           "may be read twice or not at all; resume over the saved world size to resume exactly",
                           self.epoch)
        streams: dict[Any, list] = {}
        for rank in range(self.state["plan"]["group_size"]):
            streams.update(self._record_parts(epochs, plan, infos, rank))
        group, readers = epochs.group, epochs.readers
        loads = [0] * (group.size * readers)
        parts = {}
        for key in sorted(streams, key=lambda k: (-(streams[k][2] - streams[k][0] - len(streams[k][1])), k)):
            target = loads.index(min(loads))
            loads[target] += streams[key][2] - streams[key][0] - len(streams[key][1])
            if target // readers == group.rank:
                parts[key] = [*streams[key], target % readers]
        return parts


def _saved_tops_up(saved: dict[str, Any]) -> bool:
    """Whether the saved plan's readers topped up (several ranks with even batches; one group)."""
    return bool(saved["even_batches"]) and saved["group_size"] > 1


def _part_batches(epochs: Epochs, parts: dict[int, list]) -> int:
    """Batches this rank yields from re-planned ``parts`` in its own batch size."""
    options = epochs.options
    return sum(_batches(max(part[2] - part[0] - len(part[1]), 0), int(options.batch_size), options.drop_last)
               for part in parts.values())


def _even_parts(epochs: Epochs, parts: dict[int, list], counts: list[int]) -> None:
    """Even out re-planned ``parts`` to one batch count over the ranks (``counts``, each rank's):
    the most (a top up from each reader's cycle, as planned epochs do), or with ``drop_last`` the
    fewest, one batch per saved reader in turn."""
    options = epochs.options
    target = min(counts) if options.drop_last else max(counts)
    step = int(options.batch_size) * (1 if target > _part_batches(epochs, parts) else -1)
    turn, streams = 0, list(parts.values())
    while streams and _part_batches(epochs, parts) != target and turn < 4 * (abs(target) + len(parts) + 1):
        part = streams[turn % len(streams)]
        if part[2] + step - part[0] - len(part[1]) >= 0:
            part[2] += step
        turn += 1


def _check_layout(epochs: Epochs, saved: dict[str, Any], *, warn: bool = False, replan: bool = False) -> str:
    """How the saved epoch is finished: ``"same"`` layout, re-planned over another number of
    readers (``"workers"``), or, with ``replan``, record by record over another batch size,
    shuffle buffer or ``drop_last`` (``"records"``), or another world size (``"world"``).

    Raises:
        ValueError: another change of the layout, naming each (and what ``replan=True`` allows).
    """
    now = _plan_params(epochs)
    changed = [key for key in saved if key not in ("workers", "reader") and saved[key] != now[key]]
    named = ", ".join(f"{key} {saved[key]!r} -> {now[key]!r}" for key in changed)
    fixed = [key for key in changed if key not in _REPLANNABLE]
    if changed and (not replan or fixed):
        hint = (" replan=True re-plans another world size, batch size, shuffle buffer, drop_last or worker count; "
                f"not another {', '.join(fixed)}." if replan else
                " Or pass replan=True to re-plan it over another world size, batch size, shuffle buffer or drop_last.")
        raise ValueError(
            f"the saved epoch was planned with another layout ({named}): the rest of it cannot be re-planned over "
            "this one. Build the loader (make_torch_loader) or dataset (make_tf_dataset) with the saved world size, "
            "rank, even_batches and split to finish it, or "
            f"load a state saved between epochs.{hint if not fixed or replan else ''}")
    if changed:
        group = epochs.group
        if group.groups > 1 or (group.size > 1 and epochs.tops_up and not epochs._collective):
            raise ValueError(f"replan=True over another {', '.join(changed)} needs the ranks' batch counts evened "
                             "out through torch.distributed, with split='shared' (make_tf_dataset's input pipelines "
                             "cannot: re-plan only a lone pipeline); finish the epoch with the saved layout instead")
        if warn:
            logger.warning("the saved epoch was planned with another layout (%s): replan=True re-plans the rest of "
                           "it (each saved reader's undelivered records once, in this batch size and shuffle; ranks "
                           "evened out by a top up), so its batches differ from the uninterrupted run's", named)
        world = saved["world_size"] != now["world_size"] or saved["group_size"] != now["group_size"]
        return "world" if world else "records"
    if saved["workers"] == now["workers"]:
        return "same"
    if warn:
        logger.warning("the saved epoch was read by %d readers per rank, this loader has %d: the rest of the epoch "
                       "is re-planned (each saved reader's stream is finished by one reader, every record once), "
                       "so its batches come in another order than the uninterrupted run's", saved["workers"],
                       now["workers"])
    return "workers"


def load_state(epochs: Epochs, state: Any, *, on_missing: str = "raise", replan: bool = False,
               reader: str = "growcache") -> None:
    """Check ``state`` and set ``epochs`` to resume from it (see the module docstring).

    ``replan``: finish the saved epoch over another world size, batch size, shuffle buffer or
    ``drop_last`` (with a warning): each record the loop had not consumed comes once, plus a top
    up that evens out the ranks under DDP. Over another world size, any rank's state serves (every
    rank consumed as many batches): each saved reader's rest, of every saved rank, goes whole to
    one reader of the new world. Default: ``False`` (such a change raises).

    ``reader``: the kind of reader that finishes the epoch (:data:`READERS`); a mid-epoch state
    saved by another kind raises, since that kind delivered another order. Default: ``"growcache"``.

    Raises:
        ValueError: a damaged field (named), another cache's state, another layout, or a
            mid-epoch state of another kind of reader.
        MissingShardsError: shards of the saved snapshot are gone from the cache, with
            ``on_missing="raise"``: their names and record count.
    """
    if on_missing not in ON_MISSING:
        raise ValueError(f"on_missing must be one of {ON_MISSING}, got {on_missing!r}")
    checked = check_state(state)
    cache = epochs.cache
    previous, epochs.resume = epochs.resume, None
    if previous is not None:
        # The same state loaded again (a trainer's restore, then the user's) adopts the same pin:
        # releasing it would leave the resumed epoch's shards to eviction.
        kept = previous._pin.name if previous._pin is not None else None
        previous.abandon(quiet=checked["pin"] is not None and kept == checked["pin"]["name"])
    if checked["cache_id"] is not None and cache.cache_id is not None and checked["cache_id"] != cache.cache_id:
        raise ValueError(f"resume state field 'cache_id' is {checked['cache_id']}, but cache {cache.path} is "
                         f"{cache.cache_id}: the state was saved on another cache (or one re-created at this "
                         "path, whose shard names mean other records)")
    if checked["seed"] is not None and checked["seed"] != int(epochs.options.seed):
        raise ValueError(f"resume state field 'seed' is {checked['seed']}, but this loader's seed is "
                         f"{epochs.options.seed}: build it with seed={checked['seed']}")
    if checked["snapshot"] is None:
        epochs.epoch = checked["epoch"]
        return
    saved_reader = checked["plan"]["reader"]
    if saved_reader != reader:
        raise ValueError(
            f"resume state field 'plan.reader' is {saved_reader!r}, but this pipeline reads with {reader!r}: the "
            f"saved epoch was delivered in the order of a {saved_reader!r} reader, so a {reader!r} reader cannot "
            "finish it. Resume with the saved kind of reader (TensorFlow: make_tf_dataset(reader=...), the schema "
            "with a fixed layout for 'growcache'; 'growcache' is also the PyTorch loader's), or load "
            f"{{'epoch': {checked['epoch']}}} to read that epoch afresh")
    if checked["cache_id"] is None or cache.cache_id is None:
        logger.warning("resume state or cache %s has no cache id: the saved shards are matched by name only",
                       cache.path)
    kind = _check_layout(epochs, checked["plan"], warn=True, replan=replan)
    shards = checked["snapshot"]["shards"]
    # A shard larger than the whole budget is never published, and a resume replays the shuffle
    # of every window before its point: a damaged name of 10**13 records would stall it for good.
    for index, (name, nbytes, _) in enumerate(shards):
        if nbytes > cache.capacity:
            raise ValueError(f"resume state field 'snapshot.shards[{index}]' names {name}, {nbytes} bytes: more than "
                             f"the whole capacity of cache {cache.path} ({cache.capacity} bytes), so never one of its "
                             "shards. The state is damaged, or the capacity was lowered since the save: raise it back "
                             f"for the resume, or load {{'epoch': {checked['epoch']}}} to read that epoch afresh")
    present = {os.path.basename(s.path) for s in cache.list_shards()}
    skipped = set(checked["snapshot"]["skipped"])
    params = checked["plan"]
    records_of = [records for _, _, records in shards]
    plan = plan_epoch(records_of, epoch=checked["epoch"], seed=checked["seed"], world_size=params["group_size"],
                      num_workers=params["workers"], batch_size=params["batch_size"], drop_last=params["drop_last"],
                      even_batches=params["even_batches"])
    delivered = checked.get("delivered")
    # Where no other group's batch count re-plans the saved rank's (quotas evened out over groups
    # of ranks), its readers' batches are known: a damaged count past them would have the resumed
    # epoch count batches its readers never give, and a DDP rank run out before the others.
    if delivered is not None and kind != "world" and not (params["even_batches"] and epochs.group.groups > 1):
        counts = [plan.batches(plan.reader(params["group_rank"], w)) for w in range(params["workers"])]
        if any(d > c for d, c in zip(delivered, counts)):
            raise ValueError(f"resume state field 'delivered' is {delivered}, more batches than the saved rank's "
                             f"readers yield ({counts}): the state is damaged")
    batches = window_batches(params["shuffle_buffer"], params["batch_size"])
    # Shards the rest of the epoch does not read (the pin let them go as the epoch went on) may be gone.
    needed: set[int] = set()
    # Each saved reader resumes after its own batches where the state names them, and the pin kept
    # only what that reads; re-planned over another world size, every rank's are taken in turn.
    for rank in range(params["group_size"]) if kind == "world" else [params["group_rank"]]:  # re-planned: all ranks'
        needed |= needed_shards(plan, rank, checked["progress"], batches * params["batch_size"], batches, records_of,
                                _saved_tops_up(params), exact=epochs.options.on_corrupt == "raise",
                                delivered=delivered if kind != "world" else None)
    lost = [(name, records) for i, (name, _, records) in enumerate(shards)
            if i in needed and name not in present and name not in skipped]
    if lost:
        records = sum(r for _, r in lost)
        names = ", ".join(name for name, _ in lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
        message = (f"{len(lost)} shards of the saved epoch {checked['epoch']} ({records} records) are gone from cache "
                   f"{cache.path}: {names}")
        if on_missing == "raise":
            raise MissingShardsError(f"{message}. Their pin expired or they were deleted (another machine's cache, a "
                                     "wiped disk). Pass on_missing='skip' to finish the epoch without them.",
                                     tuple(name for name, _ in lost), records)
        logger.warning("%s: finishing the epoch without them", message)
    pin = None
    if checked["pin"] is not None:
        adopted = cache.read_pin(checked["pin"]["name"])
        if adopted is None:
            logger.warning("resume pin %s is gone or expired; the saved epoch's shards are leased when it starts",
                           checked["pin"]["name"])
        else:
            pin = Pin(cache, checked["pin"]["name"], float(adopted["until"]), frozenset(adopted["seqs"]),
                      adopted.get("holder", ""), adopted.get("run", ""))
    epochs.epoch = checked["epoch"]
    epochs.resume = Resume(checked, pin, skipped | {name for name, _ in lost}, replan=replan)


class ResumableLoader(EpochBookkeeping):
    """:class:`~growcache.epoch.EpochBookkeeping` with an exact mid-epoch resume, for an adapter
    object that counts the batches it hands over in :attr:`Epoch.consumed` (the PyTorch loader).

    It follows the ``Stateful`` protocol of torchdata and Lightning (``state_dict`` /
    ``load_state_dict``).
    """

    #: Seconds an epoch's snapshot stays pinned from its first ``state_dict()`` (``0``: no pin).
    resume_ttl: float = DEFAULT_RESUME_TTL

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The state to resume at: see :func:`loader_state`. JSON-serializable, no pickles; cheap
        enough to call every few batches (a list of the epoch's shard names). The first call in
        an epoch pins its snapshot for :attr:`resume_ttl` seconds (:func:`pin_epoch`).

        Args:
            consumed: the batches of the current epoch the training loop processed, where it
                reads ahead of its steps (Lightning's fetcher: :class:`ResumeCallback` passes
                it); at most those handed over. Default: ``None``: every batch handed over.

        Raises:
            ValueError: ``consumed`` is not an integer >= 0.
        """
        check_consumed(consumed)
        latest = self.last_epoch
        if latest is not None and self.epochs.resume is None:
            pin_epoch(latest, self.resume_ttl)
        return loader_state(self.epochs, latest, consumed=consumed)

    def load_state_dict(self, state: Mapping[str, Any], *, on_missing: str = "raise", replan: bool = False) -> None:
        """Resume from ``state``: the next ``iter()`` finishes the saved epoch, batch by batch as
        the uninterrupted run would have; ``{"epoch": N}`` starts epoch ``N``. See :func:`load_state`.

        Args:
            state: from :meth:`state_dict`.
            on_missing: ``"raise"`` a :class:`~growcache.MissingShardsError` when saved shards are
                gone, or ``"skip"`` them (logged, noted in ``skipped``). Default: ``"raise"``.
            replan: finish the saved epoch over this loader's world size, batch size, shuffle
                buffer or ``drop_last`` where they changed (a warning; every record not yet
                consumed once, plus DDP's top up). Another ``split`` or ``even_batches`` still
                raises. Default: ``False``: any change but the worker count raises.
        """
        load_state(self.epochs, state, on_missing=on_missing, replan=replan)
