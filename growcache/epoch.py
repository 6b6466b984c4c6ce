"""One epoch, from snapshot to lease release, for every framework adapter.

An adapter (``make_tf_dataset``, ``make_torch_loader``, or a third one) builds one
:class:`Epochs` and calls :meth:`Epochs.start` at the start of each epoch. Everything that
is not framework wiring happens here:

1. **The snapshot.** The group's first rank takes :meth:`Cache.snapshot`, waiting up to
   ``wait_for_shards`` seconds for a first shard, then raises :class:`EmptyCacheError`.
2. **Agreement.** The ranks of a group (every rank with ``split="shared"``, one machine's
   ranks with ``split="node"``) read exactly the shards the first rank leased, with its
   seed and epoch number (see :mod:`growcache.rendezvous`). The others lease the same
   shards, and the first rank keeps its lease until they have.
3. **The plan** (:func:`growcache.planning.plan_epoch`) and each reader's share
   (:class:`~growcache.batching.ReaderShare`): whole shards, a quota and a top-up cycle,
   one meaning in every adapter. With ``split="node"`` and a collective rendezvous, the
   groups also agree on one batch count.
4. **The lease lifetime.** :meth:`Epoch.end` releases the epoch's lease; adapters call it
   when every reader of the epoch is done, or will never read again (:meth:`Epochs.leave`
   counts readers for an adapter with several per epoch). An :class:`Epochs` bounds the
   epochs left open by abandoned iterators. Inside :func:`trainer_epoch`, every start reads
   the trainer's epoch, and readers that start it again join it.
5. **The corrupt-shard report.** :attr:`Epochs.skipped` lists every shard passed over
   with ``on_corrupt="skip"``, and :meth:`Epochs.check_shard` verifies a shard before a
   reader that growcache does not control (TensorFlow's) opens it.
6. **The defaults** both adapters share: :data:`DEFAULT_SEED`, :data:`DEFAULT_VERIFY`,
   :data:`DEFAULT_ON_CORRUPT`, :data:`DEFAULT_SPLIT`, and a shuffle buffer of about 32 MiB
   (:func:`growcache.batching.default_shuffle_buffer`).

What trainers ask of a loader about its epochs (``set_epoch``) is :class:`EpochBookkeeping`; its
``state_dict`` and exact mid-epoch resume, :mod:`growcache.resume`. How each epoch's shares reach the readers is
:mod:`growcache.worker_feed` (reader processes) and :mod:`growcache.pull_feed` (a framework
that pulls from its own threads).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import errors as _errors
from .batching import ReaderShare, Skipped, default_shuffle_buffer
from .cache import Cache, check_schema_of
from .errors import (
    CorruptShardError,
    EmptyCacheError,
    EpochSyncError,
    GrowcacheError,
    SchemaError,
    SchemaMismatchError,
)
from .manifest import METADATA_FILE
from .planning import (EpochPlan, ReadPoints, plan_epoch, read_points, reader_seed,
                       round_robin_progress)
from .readers import ReaderSpec
from .records import check_named_size, check_records
from .schema import Schema
from .rendezvous import (
    CollectiveRendezvous,
    EpochShards,
    FileRendezvous,
    LocalRendezvous,
    Rendezvous,
    disagreement,
)
from .shard import ShardInfo
from .snapshot import Snapshot

__all__ = [
    "DEFAULT_ON_CORRUPT",
    "DEFAULT_SEED",
    "DEFAULT_SPLIT",
    "DEFAULT_VERIFY",
    "Epoch",
    "EpochBookkeeping",
    "EpochOptions",
    "Epochs",
    "Group",
    "node_name",
    "reader_cache",
    "require_shards",
    "resolve_schema",
    "run_id",
    "trainer_epoch",
]

logger = logging.getLogger(__name__)

#: Shard and record shuffle seed of both adapters. A fixed seed, not a random one: every rank
#: of a group must draw the same shard order, and a run must be repeatable.
DEFAULT_SEED = 0
#: Both adapters check every record's CRC32C, and TensorFlow's reader never sees a shard
#: growcache has not checked.
DEFAULT_VERIFY = True
DEFAULT_ON_CORRUPT = "raise"
DEFAULT_SPLIT = "shared"
SPLITS = ("shared", "node")
ON_CORRUPT = ("raise", "skip")
_POLL_S = 0.05
#: Epochs of one :class:`Epochs` open at once before the oldest is taken as abandoned.
DEFAULT_MAX_OPEN = 4
#: A lease trim (Epoch.consume) is followed by at least this many times its own duration without one.
_TRIM_SPACING = 50.0
#: Batches taken out of order whose readers an epoch remembers (see Epoch.delivered).
_RECENT = 16


def node_name() -> str:
    """The name of this machine for ``split="node"``: ``$GROWCACHE_NODE``, else the hostname.

    Containers often share one hostname; set ``GROWCACHE_NODE`` to tell machines apart (or
    to make processes of one machine pose as several, in tests).
    """
    return os.environ.get("GROWCACHE_NODE") or socket.gethostname()


def run_id(explicit: str | None = None) -> str:
    """The id that keeps one training run's epoch files apart from another's.

    ``explicit``, else ``$GROWCACHE_RUN_ID``, else the launcher's: torchrun's
    ``$TORCHELASTIC_RUN_ID``, SLURM's job and step ids, a PMIx namespace (Open MPI's
    ``mpirun``), else what no two live jobs share: ``$MASTER_ADDR:$MASTER_PORT`` (torch's
    ``env://`` rendezvous) or ``$TF_CONFIG``'s cluster (its addresses). ``""`` when none is
    known: two such jobs on one cache would read each other's epoch files (the loaders warn).
    """
    if explicit:
        return str(explicit)
    env = os.environ
    if env.get("GROWCACHE_RUN_ID"):
        return env["GROWCACHE_RUN_ID"]
    if env.get("TORCHELASTIC_RUN_ID"):
        return env["TORCHELASTIC_RUN_ID"]
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"
    if env.get("PMIX_NAMESPACE"):
        return f"pmix-{env['PMIX_NAMESPACE']}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"master-{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    cluster = _tf_cluster(env.get("TF_CONFIG"))
    if cluster:
        return "tf-" + hashlib.sha256(cluster.encode()).hexdigest()[:16]
    return ""


def _tf_cluster(config: str | None) -> str:
    """``TF_CONFIG``'s cluster spec in one canonical form, or ``""`` (none, or not JSON)."""
    if not config:
        return ""
    try:
        cluster = json.loads(config).get("cluster")
        return json.dumps(cluster, sort_keys=True) if cluster else ""
    except (ValueError, AttributeError, TypeError):
        return ""  # TensorFlow itself refuses a malformed TF_CONFIG


@dataclass(frozen=True)
class Group:
    """The ranks that read one snapshot together, and this process's place among them.

    Attributes:
        rank: this rank's index in the group; ``0`` takes each epoch's snapshot.
        size: ranks in the group.
        name: the group's name: ``"shared"``, or ``"node:<name>"`` with ``split="node"``.
        world_rank: this rank among all ranks. Default: ``0``.
        world_size: all ranks. Default: ``1``.
        first_world_rank: the world rank of the group's first rank. Default: ``0``.
        groups: how many groups the world holds. Default: ``1``.
    """

    rank: int
    size: int
    name: str = DEFAULT_SPLIT
    world_rank: int = 0
    world_size: int = 1
    first_world_rank: int = 0
    groups: int = 1

    @classmethod
    def of(cls, split: str, world_rank: int, world_size: int, nodes: Sequence[str] | None = None) -> Group:
        """The group of ``world_rank``; with ``split="node"``, ``nodes`` names each world rank's machine."""
        if split == "shared" or world_size == 1:
            return cls(world_rank, world_size, "shared", world_rank, world_size, 0, 1)
        if nodes is None or len(nodes) != world_size:
            raise ValueError(f"split='node' needs the node of each of the {world_size} ranks")
        mine = [r for r in range(world_size) if nodes[r] == nodes[world_rank]]
        return cls(mine.index(world_rank), len(mine), f"node:{nodes[world_rank]}", world_rank, world_size, mine[0],
                   len(set(nodes)))

    @classmethod
    def from_env(cls, split: str) -> Group:
        """The group from ``RANK``/``WORLD_SIZE`` (and ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` for
        ``split="node"``), as torchrun and most launchers set them; one rank when unset."""
        env = os.environ
        try:
            rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
            local_rank = int(env.get("LOCAL_RANK", 0))
            local_world = int(env.get("LOCAL_WORLD_SIZE", 1 if "LOCAL_RANK" not in env else world))
        except ValueError as exc:
            raise ValueError(f"RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers: {exc}") from None
        if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
            raise ValueError(f"RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local_rank}, "
                             f"LOCAL_WORLD_SIZE={local_world} do not describe a rank")
        if split == "shared" or world == 1:
            return cls(rank, world, "shared", rank, world, 0, 1)
        return cls(local_rank, local_world, f"node:{node_name()}", rank, world, rank - local_rank,
                   max(world // local_world, 1))


@dataclass(frozen=True)
class EpochOptions:
    """The epoch arguments both adapters share: one meaning, one default, checked here.

    ``make_torch_loader`` and ``make_tf_dataset`` take them as keyword arguments of the same
    names and defaults (``make_tf_dataset`` names ``drop_last`` ``drop_remainder``, as
    ``Dataset.batch`` does) and refer here.

    Attributes:
        batch_size: records per batch of one reader (a DataLoader worker, a TensorFlow pipeline).
        seed: the shard order of epoch ``e`` is drawn from ``(seed, e)``, and each reader's
            record shuffle from ``(seed, e, reader)``. The first rank's seed and epoch number
            are used by every rank of its group. ``None`` means the default. Default: ``0``.
        shuffle_buffer: records shuffled together in each reader; ``0`` turns the record
            shuffle off (shards are still shuffled per epoch). growcache's readers (PyTorch's,
            and TensorFlow's ``reader="growcache"``) scatter each window of this many records
            (rounded up to whole batches, at least two) over its batches, at no extra copy;
            TensorFlow's ``reader="tensorflow"`` uses a ``Dataset.shuffle`` buffer. Default: ``None``,
            about 32 MiB of records, at least two batches and at most 8192 records
            (:func:`~growcache.batching.default_shuffle_buffer`).
        drop_last: drop each reader's final partial batch; with ``even_batches`` and several
            ranks it also picks *drop* over *top up* (see :mod:`growcache.planning`).
            Default: ``False``.
        even_batches: every rank yields the same number of batches, so that no DDP rank or
            synchronized replica waits on one that ran out. Default: ``True``.
        verify: check every record's CRC32C before it is used; lengths, framing and record
            counts are checked anyway. TensorFlow's reader gets a shard only once growcache
            has checked it whole (with ``verify=False``, once its size matches its name).
            Default: ``True``.
        on_corrupt: ``"raise"`` a :class:`~growcache.CorruptShardError` naming the file and
            offset, after the batches completed before the bad record, or ``"skip"`` the shard
            from the bad record on (TensorFlow's ``reader="tensorflow"``: the whole shard),
            noted in ``skipped`` and logged. Default: ``"raise"``.
        wait_for_shards: seconds an epoch waits for a first shard in an empty cache before
            :class:`~growcache.EmptyCacheError`; with ``0``, ``make_tf_dataset`` raises it at
            once (outside TensorFlow's error wrapping), ``iter(loader)`` at the epoch's start.
            Default: ``0.0``.
        split: the ranks that read one snapshot per epoch: ``"shared"``, all of them (one
            cache); ``"node"``, those of one machine (a cache per machine, named by
            ``$GROWCACHE_NODE`` or its hostname). Default: ``"shared"``.
        run_id: keeps one run's epoch files apart from another's, for ranks that agree without
            a process group. Default: ``None`` (see :func:`run_id`).
    """

    batch_size: int
    seed: int = DEFAULT_SEED
    shuffle_buffer: int | None = None
    drop_last: bool = False
    even_batches: bool = True
    verify: bool = DEFAULT_VERIFY
    on_corrupt: str = DEFAULT_ON_CORRUPT
    wait_for_shards: float = 0.0
    split: str = DEFAULT_SPLIT
    run_id: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, (int, np.integer)) \
                or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.seed is None:  # accepted for "the default", as before
            object.__setattr__(self, "seed", DEFAULT_SEED)
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an int (the same on every rank), got {self.seed!r}")
        buffer = self.shuffle_buffer
        if buffer is not None and (isinstance(buffer, bool) or not isinstance(buffer, (int, np.integer))
                                   or buffer < 0):
            raise ValueError(f"shuffle_buffer must be an int >= 0 (records), got {buffer!r}")
        if self.on_corrupt not in ON_CORRUPT:
            raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, got {self.on_corrupt!r}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if not isinstance(self.wait_for_shards, (int, float)) or self.wait_for_shards < 0:
            raise ValueError(f"wait_for_shards must be >= 0 seconds, got {self.wait_for_shards!r}")


def reader_cache(cache: Cache | str | os.PathLike, wait_for_shards: float = 0.0, *,
                 features: Schema | Mapping[str, Any] | None = None) -> Cache:
    """The cache a reader reads: ``cache`` itself, or the cache at that path.

    A path where no cache is yet (no ``growcache.json``) is waited for up to ``wait_for_shards``
    seconds, as an empty cache is: a trainer may start before the samplers that create its cache.
    Nothing is created meanwhile: opened, a mistyped path became an empty cache with no schema, and
    the error said so instead of naming the path. With ``features`` (a reader that brings the
    schema) the path is opened, and created, at once.

    Raises:
        EmptyCacheError: no cache at the path, after the wait.
    """
    if isinstance(cache, Cache):
        return cache
    if features is not None:
        return Cache(cache)
    path = os.path.abspath(os.fspath(cache))
    deadline = time.monotonic() + wait_for_shards
    while not os.path.exists(os.path.join(path, METADATA_FILE)):
        if time.monotonic() >= deadline:
            where = "no such directory" if not os.path.exists(path) else f"it holds no {METADATA_FILE}"
            waited = f" after waiting {wait_for_shards:g} s" if wait_for_shards else ""
            raise EmptyCacheError(
                f"there is no cache at {path} ({where}){waited}, and a reader creates none: check the path, or "
                "start the samplers that fill it (SamplerPool, growcache sample) first, or pass "
                "wait_for_shards=SECONDS to wait for them")
        time.sleep(_POLL_S * 4)
    return Cache(path)


def resolve_schema(cache: Cache, features: Schema | Mapping[str, Any] | None = None) -> Schema:
    """The schema to read ``cache`` with: ``features``, which must equal a stored schema, else the stored one.

    Raises:
        SchemaMismatchError: ``features`` differs from the schema stored in the cache.
        SchemaError: neither is there.
    """
    if features is not None:
        schema = Schema(features)
        if cache.schema is not None and cache.schema != schema:
            raise SchemaMismatchError(
                f"features={schema!r} differs from the schema stored in cache {cache.path}, {cache.schema!r}. "
                "Leave features= out to read the stored schema.")
        return schema
    if cache.schema is None:
        raise SchemaError(
            f"cache {cache.path} stores no schema, so its records cannot be decoded: open it with "
            "Cache(path, schema=Schema({...})) first, giving the dtype and shape of every feature "
            "(make_tf_dataset also takes them as features=)")
    return cache.schema


def require_shards(cache: Cache, wait_for_shards: float) -> None:
    """Fail at once, at an adapter's construction, on an empty cache that no epoch may wait for.

    Raises:
        EmptyCacheError: ``cache`` holds no shard and ``wait_for_shards`` is ``0``.
    """
    if wait_for_shards == 0 and not cache.list_shards():
        raise EmptyCacheError(
            f"cache {cache.path} holds no shard yet: start a SamplerPool (and pool.wait_for(records=...)) "
            "or write shards first, or pass wait_for_shards=SECONDS to wait for the first one"
        )


_PIN_LOCK = threading.Lock()
_pinned: int | None = None
_waiting: set[Epoch] = set()  # pinned epochs that every reader left before their end


@contextlib.contextmanager
def trainer_epoch(number: int) -> Iterator[None]:
    """Every epoch started inside the block reads epoch ``number``, the trainer's.

    Keras under ``tf.distribute`` opens a fresh iterator at every ``fit()`` and reads one
    batch from it before the epoch's own iterator starts. Inside this block the two are one
    epoch: the second start joins the first (one snapshot, one lease, one agreement among
    the ranks), so the extra batch neither shifts the ``(seed, epoch)`` order nor holds a
    lease of its own. An epoch that all its readers left before its end stays open for the
    next one until the block exits, then ends. :func:`growcache.fit_growing` wraps each
    epoch in it, so that a resumed run (``initial_epoch``) reads the order of its epoch; a
    custom training loop can too. One block at a time per process.

    Args:
        number: the trainer's epoch.
    """
    global _pinned
    with _PIN_LOCK:
        if _pinned is not None:
            raise RuntimeError(f"trainer_epoch({number}) inside trainer_epoch({_pinned}): one at a time per process")
        _pinned = int(number)
    try:
        yield
    finally:
        with _PIN_LOCK:
            _pinned = None
            waiting = [epoch for epoch in _waiting if epoch._readers == 0]
            _waiting.clear()
        for epoch in waiting:
            epoch.end()


_ORDINALS: dict[tuple, int] = {}
_MEMBERS: dict[tuple, set[int]] = {}
_MODES: dict[tuple, str] = {}
_WARNED_NO_RUN_ID: set[str] = set()  # caches whose ranks were told to set a run id
_ORDINALS_LOCK = threading.Lock()


def _warn_no_run_id_once(cache: str) -> None:
    if cache in _WARNED_NO_RUN_ID:
        return
    _WARNED_NO_RUN_ID.add(cache)
    logger.warning("ranks agree on each epoch through files in %s/epochs without a run id (no run_id=, "
                   "GROWCACHE_RUN_ID, torchrun, SLURM, MASTER_ADDR/MASTER_PORT or TF_CONFIG): another job "
                   "on this cache without one would read this job's epoch files. Set GROWCACHE_RUN_ID to "
                   "an id of this run in every rank", cache)


class Epochs:
    """The epochs of one adapter object (a loader, or one input pipeline of a dataset).

    Args:
        cache: the cache; it must hold a schema.
        options: the shared epoch arguments.
        readers: readers per rank (DataLoader workers; ``1`` for a TensorFlow pipeline).
            Default: ``1``.
        world: ``(rank, world size)``, or a function that returns it at the first epoch (a
            process group's; ``None`` when there is none). Default: ``None``: from
            ``RANK``/``WORLD_SIZE``, and ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` for the node.
        all_gather: with a ``world`` function, the process group's gather of one picklable
            object from every rank: ranks then agree through it
            (:class:`~growcache.rendezvous.CollectiveRendezvous`), and learn each other's
            node. Default: ``None``: ranks in one process agree in memory, others through
            epoch files; with ``split="node"`` the ranks of this process form the node.
        holder: lease label, shown by ``growcache status``. Default: ``""``.
        max_open: epochs open at once before the oldest is ended as abandoned.
            Default: :data:`DEFAULT_MAX_OPEN`.
        schema: the records' schema, for a cache that stores none (see :func:`resolve_schema`).
            Default: ``None``: the cache's.
        abandon_hint: what the user can change, appended to the warning that ends an
            abandoned epoch. Default: ``""``.

    Attributes:
        epoch: the epoch the next :meth:`start` reads.
        skipped: every :class:`~growcache.batching.Skipped` shard, oldest first: one note per
            shard and epoch, however many readers passed over it.
        reader: the :class:`~growcache.readers.ReaderSpec` every reader of these epochs uses.
        latest: the :class:`Epoch` the newest :meth:`start` began or joined; ``None`` before
            the first. It stays set after the epoch ends (its ``shards`` say what it read).
    """

    def __init__(
        self,
        cache: Cache,
        options: EpochOptions,
        *,
        readers: int = 1,
        world: tuple[int, int] | Callable[[], tuple[int, int] | None] | None = None,
        all_gather: Callable[[Any], list[Any]] | None = None,
        holder: str = "",
        max_open: int = DEFAULT_MAX_OPEN,
        schema: Schema | Mapping[str, Any] | None = None,
        abandon_hint: str = "",
    ) -> None:
        schema = resolve_schema(cache, schema)
        if readers < 1:
            raise ValueError(f"readers must be >= 1, got {readers}")
        self.cache = cache
        self.options = options
        self.readers = int(readers)
        shuffle = options.shuffle_buffer
        if shuffle is None:
            shuffle = default_shuffle_buffer(schema, options.batch_size)
        self.reader = ReaderSpec(schema, int(options.batch_size), verify=options.verify,
                                 on_corrupt=options.on_corrupt, drop_last=options.drop_last,
                                 shuffle_buffer=int(shuffle))
        self.epoch = 0
        self.skipped: list[Skipped] = []
        self.latest: Epoch | None = None
        #: A :class:`growcache.resume.Resume` the next :meth:`start` of its epoch finishes.
        self.resume: Any = None
        self._noted_epoch: int | None = None  # the epoch whose notes _noted holds
        self._noted: set[tuple[str, int, str]] = set()
        self._world = world
        self._all_gather = all_gather
        self._holder = holder
        self._max_open = max_open
        self._abandon_hint = abandon_hint
        self._group: Group | None = None
        self._collective = False
        self._rendezvous: Rendezvous | None = None
        self._lock = threading.Lock()
        self._open: dict[int, Epoch] = {}
        self._tokens = itertools.count(1)
        rank, size = world if isinstance(world, tuple) else (None, None)
        # Readers pair with their peers of other ranks by construction order: the k-th Epochs
        # built for a cache and rank in one process meets the k-th of every other rank.
        self._pairing = (cache.path, options.split, size)
        with _ORDINALS_LOCK:
            key = (*self._pairing, rank)
            self._ordinal = _ORDINALS.get(key, 0)
            _ORDINALS[key] = self._ordinal + 1
            _MEMBERS.setdefault((*self._pairing, self._ordinal), set()).add(rank)

    # -- the group ----------------------------------------------------------------------------
    @property
    def group(self) -> Group:
        """This rank's :class:`Group`, resolved at the first epoch."""
        if self._group is None:
            self._group, self._rendezvous = self._resolve()
        return self._group

    def _resolve(self) -> tuple[Group, Rendezvous | None]:
        split = self.options.split
        local = _MEMBERS.get((*self._pairing, self._ordinal), set())
        gather = None
        if callable(self._world):
            self._world = self._world()
            gather = self._all_gather if self._world is not None else None
        if self._world is None:
            group = Group.from_env(split)
        elif gather is not None:
            # Ranks of one machine reading different caches are different groups: their shards differ.
            nodes = gather(f"{node_name()} (cache {self.cache.path})") if split == "node" else None
            group = Group.of(split, *self._world, nodes)
        else:
            rank, size = self._world
            if split == "node":
                # Without a process group, the ranks built in this process form the node.
                mine = sorted(r for r in local if r is not None)
                group = Group(mine.index(rank), len(mine), f"node:{node_name()}", rank, size, mine[0],
                              max(size // len(mine), 1))
            else:
                group = Group.of(split, rank, size)
        if gather is not None and group.world_size > 1:
            self._collective = True
            return group, CollectiveRendezvous(group, gather)
        if group.size == 1:
            return group, None
        key = (run_id(self.options.run_id), group.name, group.first_world_rank, self._ordinal, group.size)
        members = range(group.first_world_rank, group.first_world_rank + group.size)
        with _ORDINALS_LOCK:
            # The first rank of this process to start decides for all of them: ranks built
            # later (after an epoch already ran) must meet it the same way.
            mode = _MODES.setdefault((*self._pairing, self._ordinal, group.name),
                                     "local" if all(r in local for r in members) else "file")
        if mode == "local":
            return group, LocalRendezvous((self.cache.path, *key), group.size)
        if not key[0]:
            _warn_no_run_id_once(self.cache.path)
        return group, FileRendezvous(self.cache.path, key, group.rank, group.size,
                                     wait_for_shards=self.options.wait_for_shards,
                                     file_mode=self.cache.file_mode, dir_mode=self.cache.dir_mode)

    @property
    def tops_up(self) -> bool:
        """Whether readers may re-read their shards to even out batch counts (fixed for all epochs).

        Within a group when it has several ranks; across groups only when a collective
        rendezvous lets the groups agree on one batch count.
        """
        group = self.group
        across = group.groups > 1 and self._collective
        return self.options.even_batches and (group.size > 1 or across)

    # -- one epoch ------------------------------------------------------------------------------
    def start(self) -> Epoch:
        """Start epoch :attr:`epoch`: snapshot (or lease the first rank's), agree, plan.

        Raises:
            EmptyCacheError: no shard arrived within ``wait_for_shards`` (on every rank of the
                world, when the first rank of any group found none).
            EpochSyncError: the ranks could not agree (see :mod:`growcache.rendezvous`).
        """
        group = self.group
        number = _pinned if _pinned is not None else self.epoch
        resume, self.resume = self.resume, None
        # Inside trainer_epoch (fit_growing runs every epoch in one) the saved epoch's first start
        # is the resume too; a later start of that number joins the resumed epoch below.
        if resume is not None and resume.epoch == number and (
                _pinned is None or not any(e.number == number for e in self.open_epochs())):
            return resume.start(self)  # the one start that takes no fresh snapshot (growcache.resume)
        if resume is not None:
            resume.abandon()
        if _pinned is not None:
            with self._lock:
                joined = next((e for e in self._open.values() if e.number == number), None)
                if joined is not None:
                    joined._readers += 1
                    self.latest = joined
                    return joined
        options = self.options
        agreement = None
        if self._rendezvous is None:
            snapshot = self._take_snapshot()
            shards = _published(number, int(options.seed), snapshot)
        else:
            taken: dict[str, Any] = {}

            def take() -> EpochShards:
                try:
                    taken["snapshot"] = self._take_snapshot()
                except (GrowcacheError, OSError) as exc:  # reported to every rank, so that none waits
                    taken["error"] = exc
                    return EpochShards(number, int(options.seed), (), (), f"{exc}", type(exc).__name__)
                return _published(number, int(options.seed), taken["snapshot"])

            agreement = self._rendezvous.share(number, take)
            shards = agreement.shards
            resumers = [r for r, note in enumerate(agreement.notes or [shards.note]) if note]
            if shards.error or resumers:
                if "error" in taken:
                    raise taken["error"]
                if "snapshot" in taken:
                    taken["snapshot"].close()
                if resumers:  # every rank sees it where the rendezvous is collective: none reads on alone
                    agreement.give_up()
                    raise EpochSyncError(disagreement(agreement.notes or [shards.note, ""], group,
                                                      collective=agreement.notes is not None))
                raise _error_class(shards.error_type)(
                    f"{shards.error} (reported by the first rank of a group of ranks sharing an epoch)")
            if agreement.took:
                snapshot = taken["snapshot"]
            else:
                try:
                    snapshot = self._lease(shards)
                except BaseException:
                    agreement.confirm(False, 0)  # a collective rendezvous must hear from every rank
                    raise
        if shards.epoch != number:
            logger.warning("epoch %d on this rank, but the group's first rank is at epoch %d: using %d (call "
                           "set_epoch with the same value on every rank)", number, shards.epoch, shards.epoch)
        if shards.seed != options.seed:
            logger.warning("seed %d on this rank, but the group's first rank uses %d: using %d (pass the same seed "
                           "on every rank)", options.seed, shards.seed, shards.seed)
        confirming = False
        try:
            plan = self._plan(snapshot.shards, shards, group, None)
            if agreement is not None:
                confirming = True  # once: a collective confirmation is a gather every rank makes alike
                reports = agreement.confirm(True, plan.rank_batches(group.rank))
                failed = [rank for rank, (leased, _) in enumerate(reports or ()) if not leased]
                if failed:
                    raise EpochSyncError(f"ranks {failed} could not lease epoch {shards.epoch}'s shards (see their "
                                         "errors); every rank stops rather than read different data")
                if reports is not None and group.groups == 1 and self.options.even_batches \
                        and len({batches for _, batches in reports}) > 1:
                    # Same shards, same plan: only ranks configured differently (num_workers)
                    # count differently, and DDP's all-reduce would hang on the rank with more.
                    raise EpochSyncError(
                        f"the ranks plan different batch counts for epoch {shards.epoch}: "
                        f"{[batches for _, batches in reports]} by rank. Give every rank the same num_workers, "
                        "batch_size and drop_last")
                if reports is not None and group.groups > 1 and self.options.even_batches:
                    counts = [batches for _, batches in reports]
                    target = min(counts) if options.drop_last else max(counts)
                    plan = self._plan(snapshot.shards, shards, group, target)
        except BaseException:
            snapshot.close()
            if agreement is not None and not confirming:
                # The other ranks must not read on without this one (over epoch files, a first
                # rank's failure is told to the others, naming the error handled here).
                agreement.confirm(False, 0)
            raise
        epoch = Epoch(self, next(self._tokens), shards, snapshot, plan, agreement)
        with self._lock:
            self.latest = epoch
            self.epoch = shards.epoch + 1
            self._open[epoch.token] = epoch
            abandoned = list(self._open.values())[:-self._max_open] if len(self._open) > self._max_open else []
        for old in abandoned:
            logger.warning(
                "more than %d epochs over cache %s are open at once: ending the lease of the oldest (epoch %d), "
                "taken as abandoned. An epoch stays open until it is read to the end or its reader is gone%s",
                self._max_open, self.cache.path, old.number, self._abandon_hint)
            old.end()
        if plan.rank_batches(group.rank) == 0:
            logger.warning(
                "epoch %d yields no batch on rank %d: %d records over %d ranks x %d readers with batch_size=%d%s",
                plan.epoch, group.world_rank, snapshot.records, group.size, self.readers, options.batch_size,
                " and drop_last=True" if options.drop_last else "")
        return epoch

    def set_epoch(self, number: int) -> None:
        """Read epoch ``number`` next; if it is the epoch being read now (the latest started, still
        open), go on with ``number + 1``. Trainers (Lightning) announce an epoch after its
        iterator was made, so that announcement must not make the next epoch repeat it."""
        with self._lock:
            latest = next(reversed(self._open.values()), None)
            self.epoch = int(number) + 1 if latest is not None and latest.number == int(number) else int(number)

    def open_epochs(self) -> list[Epoch]:
        """Epochs started and not yet ended, oldest first."""
        with self._lock:
            return list(self._open.values())

    def end_all(self) -> None:
        """End every open epoch (none of their readers will read again)."""
        for epoch in self.open_epochs():
            epoch.end()

    def check_shard(self, path: str) -> bool:
        """Verify a shard before a reader growcache does not control opens it.

        Every CRC, every length against the file's size and the record count against the
        shard's name are checked with bounded memory, so a crafted shard can never reach
        that reader. With ``verify=False`` only the file's size is checked against the
        shard's name (one ``stat``), so that a shard cut short, even at a record boundary,
        still fails rather than lose records silently.

        Returns:
            ``True`` to read the shard; ``False`` to skip it (``on_corrupt="skip"``; the
            shard is added to :attr:`skipped` and logged).

        Raises:
            CorruptShardError: the shard is corrupt and ``on_corrupt="raise"``.
        """
        epochs = self
        try:
            if epochs.options.verify:
                check_records(path)
                check_schema_of(path, epochs.reader.schema)  # valid CRCs, another schema: corrupt too
            else:
                check_named_size(path)
        except CorruptShardError as exc:
            if epochs.options.on_corrupt == "raise":
                raise
            info = ShardInfo.from_path(path)
            note = Skipped(exc.path, exc.offset, exc.reason, info.records if info else 0)
            if epochs.note_skipped(note):  # once per shard and epoch, as the note
                logger.warning("skipping corrupt shard %s (byte offset %d: %s); %d skipped so far", exc.path,
                               exc.offset, exc.reason, len(epochs.skipped))
            return False
        return True

    def end(self, token: int) -> None:
        """End the open epoch whose :attr:`Epoch.token` is ``token``; nothing if it ended already."""
        with self._lock:
            epoch = self._open.get(int(token))
        if epoch is not None:
            epoch.end()

    def leave(self, token: int, finished: bool) -> None:
        """One reader of epoch ``token`` is done: it read to the end (``finished``), or it is gone.

        The epoch ends when its last reader leaves, unless none finished it and it is the
        epoch of the enclosing :func:`trainer_epoch`: then it waits for the trainer's next
        reader, or the end of the block.
        """
        with self._lock:
            epoch = self._open.get(int(token))
            if epoch is None:
                return
            epoch._readers -= 1
            epoch._finished |= finished
            if epoch._readers > 0:
                return
        with _PIN_LOCK:
            hold = not epoch._finished and _pinned == epoch.number
            if hold:
                _waiting.add(epoch)
        if not hold:
            epoch.end()

    def note_skipped(self, note: Skipped) -> bool:
        """Add a reader's :class:`~growcache.batching.Skipped` note to :attr:`skipped`, once per
        epoch and shard: where a rank's readers top up, several of them may pass over the same
        corrupt shard, and the user is owed one note for it. Returns whether it was added."""
        number = self.latest.number if self.latest is not None else None
        key = (note.path, note.offset, note.reason)
        with self._lock:
            if number != self._noted_epoch:
                self._noted_epoch, self._noted = number, set()
            if key in self._noted:
                return False
            self._noted.add(key)
            self.skipped.append(note)
            return True

    def _take_snapshot(self) -> Snapshot:
        wait = float(self.options.wait_for_shards)
        deadline = time.monotonic() + wait
        holder = self._holder or f"rank {self.group.world_rank}"
        while True:
            snapshot = self.cache.snapshot(holder=holder)
            if len(snapshot) or time.monotonic() >= deadline:
                break
            snapshot.close()
            time.sleep(_POLL_S)
        if not len(snapshot):
            raise EmptyCacheError(
                f"cache {self.cache.path} holds no shard after waiting {wait:g} s for one: start a SamplerPool "
                "(and pool.wait_for(records=...)) or write shards first, or pass wait_for_shards=SECONDS")
        return snapshot

    def _lease(self, shards: EpochShards) -> Snapshot:
        hint = ("Every rank of a group must read the same cache directory: split='shared' for one cache for all "
                "ranks, split='node' for one cache per machine.")
        try:
            snapshot = self.cache.lease(shards.seqs, holder=self._holder)
        except EpochSyncError as exc:
            raise EpochSyncError(f"{exc} {hint}") from None
        if tuple(os.path.basename(s.path) for s in snapshot.shards) != shards.names:
            snapshot.close()
            raise EpochSyncError(f"the shards of cache {self.cache.path} with the sequence numbers the first rank "
                                 f"leased are other shards than its own: the ranks read different caches. {hint}")
        if not len(snapshot):
            raise EpochSyncError(f"the first rank's epoch {shards.epoch} lists no shard")
        return snapshot

    def _plan(self, infos: Sequence[ShardInfo], shards: EpochShards, group: Group, target: int | None) -> EpochPlan:
        options = self.options
        return plan_epoch([s.records for s in infos], epoch=shards.epoch, seed=shards.seed, world_size=group.size,
                          num_workers=self.readers, batch_size=int(options.batch_size), drop_last=options.drop_last,
                          even_batches=options.even_batches, target_batches=target)


def _published(epoch: int, seed: int, snapshot: Snapshot) -> EpochShards:
    return EpochShards(epoch, seed, tuple(s.seq for s in snapshot.shards),
                       tuple(os.path.basename(s.path) for s in snapshot.shards))


def _error_class(name: str) -> type[Exception]:
    cls = getattr(_errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, GrowcacheError) else EpochSyncError


@dataclass(eq=False)
class Epoch:
    """One started epoch: its snapshot (leased), plan and readers' shares.

    Attributes:
        epochs: the :class:`Epochs` it belongs to.
        token: its number among its :class:`Epochs`' epochs, unique per process run.
        agreed: the shards, seed and epoch number every rank of the group reads.
        snapshot: the leased snapshot.
        plan: the :class:`~growcache.planning.EpochPlan` (this rank plans as rank
            ``group.rank`` of ``group.size``).
    """

    epochs: Epochs
    token: int
    agreed: EpochShards
    snapshot: Snapshot
    plan: EpochPlan
    _agreement: Any = None
    #: Batches the training loop took from this epoch since its start (a resumed epoch starts
    #: at the saved count); adapters count them as they hand them over.
    consumed: int = 0
    #: The epoch's :class:`growcache.resume.Pin` (durable lease), released at its end.
    pin: Any = None
    _ended: bool = field(default=False, repr=False)
    _readers: int = field(default=1, repr=False)  # see Epochs.leave
    _finished: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        shards = self.snapshot.shards
        self._paths = np.array([os.fsencode(s.path) for s in shards], dtype=np.bytes_)
        self._records = np.array([s.records for s in shards], dtype=np.int64)
        self._held: Snapshot | None = None  # the smaller lease that replaced the snapshot's (hold_only)
        self._held_seqs = frozenset(s.seq for s in shards)
        self._snapshot_gone = False  # the snapshot's own lease was handed to its release
        self._points: ReadPoints | None = None
        self._next_trim = 0  # consumed count at which the lease may next hold fewer shards
        self._trim_after = 0.0  # time.monotonic() before which no trim runs (see consume)
        # Counted per reader (taken out of order, DataLoader(in_order=False), or resumed from a
        # state saved so): the batches each reader of the plan had delivered, and the readers of
        # the last few taken, for what a resume skips (see delivered). Empty: a reader unknown.
        self._delivered: list[int] | None = None
        self._known = 0  # batches consumed when the count per reader began
        self._known_delivered: list[int] = []  # each reader's batches then
        self._order_noted = False  # a state saved out of order was warned about (once per epoch)
        self._recent: collections.deque[int] = collections.deque(maxlen=_RECENT)

    @property
    def number(self) -> int:
        """The epoch number."""
        return self.agreed.epoch

    @property
    def seed(self) -> int:
        """The seed every rank uses."""
        return self.agreed.seed

    @property
    def shards(self) -> tuple[ShardInfo, ...]:
        """The epoch's shards (the same on every rank of the group), oldest first."""
        return self.snapshot.shards

    @property
    def ended(self) -> bool:
        return self._ended

    def share(self, reader: int = 0) -> ReaderShare:
        """What reader ``reader`` of this rank reads (``0 <= reader < readers``)."""
        plan, group = self.plan, self.epochs.group
        index = plan.reader(group.rank, reader)
        tops_up = self.epochs.tops_up
        return ReaderShare(
            self._paths, self._records, plan.shards[index],
            quota=int(plan.quotas[index]) if tops_up else -1,
            cycle=plan.cycle[index] if tops_up else np.empty(0, np.int64),
            shuffle_seed=reader_seed(self.seed, plan.epoch, index),
        )

    def batches(self) -> int:
        """Batches this rank yields in this epoch (all its readers together)."""
        return self.plan.rank_batches(self.epochs.group.rank)

    def records(self) -> int:
        """Records this rank yields in this epoch (top-up records included)."""
        return self.plan.rank_records(self.epochs.group.rank)

    def read_points(self) -> ReadPoints:
        """When this rank reads each shard of the epoch for the last time
        (:func:`~growcache.planning.read_points`; computed once)."""
        if self._points is None:
            epochs = self.epochs
            self._points = read_points(self.plan, epochs.group.rank, self._records, epochs.reader.window_batches,
                                       tops_up=epochs.tops_up, exact=self._exact())
        return self._points

    def _exact(self) -> bool:
        # A reader that skips a corrupt shard reads on past its quota's point, into its cycle.
        return self.epochs.options.on_corrupt == "raise"

    def left(self, consumed: int | None = None) -> frozenset[int]:
        """Sequence numbers of the shards the rest of the epoch reads after ``consumed`` batches
        (default :attr:`consumed`), on this rank: what a resume from there reads too."""
        seqs = self.agreed.seqs
        return frozenset(seqs[i] for i in self._left_indices(self.consumed if consumed is None else consumed))

    def consume(self, batches: int = 1, *, round_robin: bool = True, reader: int | None = None) -> None:
        """Count ``batches`` handed to the training loop in :attr:`consumed`.

        Once readers pass the last read of shards, the epoch's lease lets go of them
        (:meth:`hold_only`), so that a full cache evicts them rather than stall its samplers.
        Readers prefetch ahead of the loop, never behind, so the lease always covers what they
        still read. A trim takes a few milliseconds (a lease file and a listing of the cache);
        they are spaced to cost at most about 2% of the loop's time.

        Args:
            round_robin: ``False``: taken in another order (``DataLoader(in_order=False)``): the
                batches are counted per reader, and a state saved in the epoch names each
                reader's (:meth:`delivered`). Default: ``True``.
            reader: the reader process that delivered the batches; ``None`` with ``round_robin``:
                each reader in turn.
        """
        if not round_robin and self._delivered is None:  # from the epoch's (or the resume's) round-robin start
            self._count_per_reader(round_robin_progress(self.read_points().counts, self.consumed)[0])
        if self._delivered:
            if reader is None and round_robin:
                known = self._count_in_turn(batches)
            else:
                reader = self.planned_reader(reader)
                known = reader is not None and 0 <= reader < len(self._delivered)
                if known:
                    self._delivered[reader] += batches
                    self._recent.extend([reader] * min(batches, _RECENT))
            if not known:  # a reader unknown: a resume re-reads from the last point known
                self._delivered, self._recent = [], collections.deque(maxlen=_RECENT)
        self.consumed += batches
        if self.consumed >= self._next_trim and (round_robin if self._delivered is None else bool(self._delivered)):
            now = time.monotonic()
            if now < self._trim_after:
                self._next_trim = self.consumed + 1
                return
            self.hold_only(self.left())
            self._next_trim = self._next_change()
            self._trim_after = now + _TRIM_SPACING * (time.monotonic() - now)

    def take_back(self, consumed: int) -> None:
        """The training loop took only ``consumed`` batches of those counted (its framework counted
        batches it had prefetched): the count goes back, and so do the readers' counts, by the
        readers of the batches given back (beyond the last few known, the counts per reader are
        where they began, and a state saved later reads the batches since again)."""
        consumed = max(int(consumed), 0)
        if consumed >= self.consumed:
            return
        if self._delivered:
            if self.consumed - consumed <= len(self._recent) and consumed >= self._known:
                self._delivered = self.delivered(consumed)
                for _ in range(self.consumed - consumed):
                    self._recent.pop()
            else:
                self._delivered, self._recent = [], collections.deque(maxlen=_RECENT)
        self.consumed = consumed

    def _count_per_reader(self, delivered: list[int]) -> None:
        """Count batches per reader from here on, each reader having delivered ``delivered``."""
        self._delivered, self._known, self._known_delivered = list(delivered), self.consumed, list(delivered)

    def _count_in_turn(self, batches: int) -> bool:
        """Count ``batches`` taken in turn from the reader processes, process 0 first since the count
        per reader began (a resume from a state saved out of order, read on by an adapter whose
        batches name no reader: TensorFlow's interleave). ``False``: the counts so far are not that
        order's, or the readers have no more batches, so the readers of these are unknown."""
        order = [self.planned_reader(process) for process in range(len(self._delivered))]
        if sorted(q for q in order if q is not None) != list(range(len(order))):
            return False
        counts = self.read_points().counts
        rest = [max(counts[q] - self._known_delivered[q], 0) for q in order]
        since = self.consumed - self._known
        before, _ = round_robin_progress(rest, since)
        after, _ = round_robin_progress(rest, since + batches)
        if before != [self._delivered[q] - self._known_delivered[q] for q in order] \
                or sum(after) - sum(before) != batches:
            return False
        for process, q in enumerate(order):
            self._delivered[q] += after[process] - before[process]
        for taken in range(since + batches - min(batches, _RECENT), since + batches):
            self._recent.append(order[round_robin_progress(rest, taken)[1]])
        return True

    def planned_reader(self, reader: int | None) -> int | None:
        """The reader of the epoch's plan (of :meth:`read_points`) that reader process ``reader``
        reads (``None``: unknown); a resumed epoch rotates them."""
        return reader

    def delivered(self, consumed: int | None = None) -> list[int] | None:
        """The batches each reader of the plan had delivered after ``consumed`` batches taken
        (default and most: :attr:`consumed`), where they are counted per reader; ``None`` where
        they were taken round-robin (:func:`~growcache.planning.round_robin_progress` of the
        count tells them).

        ``consumed`` below :attr:`consumed` takes back the readers of the batches after it (a
        trainer that fetched ahead of its steps), up to the last few; further back, or after a
        batch of an unknown reader, it is where the count per reader began, which a resume
        reads on from (the batches taken since are read again).
        """
        if self._delivered is None:
            return None
        taken = self.consumed if consumed is None else min(int(consumed), self.consumed)
        back = self.consumed - taken
        if taken < self._known:  # before the count began
            counts = self.read_points().counts
            if self._known_delivered == round_robin_progress(counts, self._known)[0]:
                return round_robin_progress(counts, taken)[0]  # taken in turn up to there: exact
            # Resumed from a state saved out of order: which readers' batches the ones taken back
            # were is not known, so each reader may have given any of them back (none skipped).
            back = self._known - taken
            return [max(known - back, 0) for known in self._known_delivered]
        if not self._delivered or back > len(self._recent):
            return list(self._known_delivered)
        delivered = list(self._delivered)
        for reader in list(self._recent)[len(self._recent) - back:]:
            delivered[reader] -= 1
        return delivered

    def _left_indices(self, consumed: int) -> set[int]:
        delivered = self.delivered(consumed)
        if delivered is None:
            return self.read_points().left(consumed)
        return self.read_points().left_after(delivered)

    def _next_change(self) -> int:
        delivered = self.delivered()
        if delivered is None:
            return self.read_points().next_change(self.consumed)
        if not self._delivered:  # a reader unknown: the lease holds what it holds to the end
            return 2**62
        return self.consumed + self.read_points().batches_to_change(delivered)

    @property
    def held(self) -> frozenset[int]:
        """Sequence numbers of the shards the epoch's lease holds now (all of its snapshot until
        :meth:`hold_only` lets go of some)."""
        return self._held_seqs

    def hold_only(self, seqs: Iterable[int]) -> None:
        """From now on, lease only the shards ``seqs`` of the snapshot, if that is fewer (the rest
        of the epoch reads no other). The snapshot's own lease is handed to its release: under a
        rendezvous, the first rank's ends once every rank leased. Logged, never raised: a lease
        that cannot be rewritten holds what it held."""
        seqs = frozenset(seqs) & self._held_seqs
        if seqs == self._held_seqs or self._ended:
            return
        epochs = self.epochs
        try:
            smaller = epochs.cache.lease(sorted(seqs), holder=epochs._holder) if seqs else None
        except (EpochSyncError, OSError) as exc:
            logger.warning("could not let epoch %d's lease go of the shards it read (%s); it keeps %d shards",
                           self.number, exc, len(self._held_seqs))
            return
        with epochs._lock:
            ended = self._ended
            if not ended:
                held, self._held, self._held_seqs = self._held, smaller, seqs
                let_go, self._snapshot_gone = not self._snapshot_gone, True
        if ended:  # ended meanwhile: end() released the rest
            if smaller is not None:
                smaller.close()
            return
        if held is not None:
            held.close()
        if let_go:
            self._release_snapshot()

    def _release_snapshot(self) -> None:
        agreement = self._agreement
        if agreement is not None and agreement.took:
            agreement.release(self.snapshot.close)
        else:
            self.snapshot.close()

    def end(self) -> None:
        """End the epoch: release its lease (the first rank's once every rank leased). Idempotent."""
        with self.epochs._lock:
            if self._ended:
                return
            self._ended = True
            self.epochs._open.pop(self.token, None)
            held, self._held = self._held, None
            let_go, self._snapshot_gone = not self._snapshot_gone, True
        if self.pin is not None:
            self.pin.release()
        if held is not None:
            held.close()
        if let_go:
            self._release_snapshot()


class EpochBookkeeping:
    """What a trainer asks of an adapter object about its epochs, for one that reads through
    ``self.epochs`` (an :class:`Epochs`) and sets ``self.last_epoch`` at each start.

    Mixed into the PyTorch loader, whose trainers (Lightning, torchdata's ``Stateful``) call
    ``set_epoch`` and ``state_dict``/``load_state_dict`` on it; framework-neutral, so another
    adapter's loader object can take it too.

    Attributes:
        epochs: the :class:`Epochs` behind the object.
        last_epoch: the :class:`Epoch` the latest start began; ``None`` before the first.
    """

    epochs: Epochs
    last_epoch: Epoch | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next start reads (``set_epoch`` changes it)."""
        return self.epochs.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next (the shard order depends on ``(seed, epoch)``); if ``epoch`` is
        the one being read now, the next is ``epoch + 1``. Lightning calls it through
        ``loader.sampler`` at the start of every epoch."""
        self.epochs.set_epoch(epoch)

    @property
    def skipped(self) -> list[Skipped]:
        """:class:`~growcache.batching.Skipped` notes of corrupt shards passed over, all epochs."""
        return self.epochs.skipped

    @property
    def last_plan(self) -> EpochPlan | None:
        """The :class:`~growcache.planning.EpochPlan` of the latest epoch."""
        return self.last_epoch.plan if self.last_epoch is not None else None
