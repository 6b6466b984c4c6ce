"""``make_tf_dataset``: a ``tf.data`` pipeline that reads a growing cache, one snapshot per epoch.

Every new iterator over the dataset is one epoch. Its first stage,
``Dataset.range(1).map(numpy_function)``, runs once per iterator: it takes a fresh
:meth:`Cache.snapshot`, plans the epoch (:func:`growcache.planning.plan_epoch`) and returns
this pipeline's shard paths as one string tensor. Everything after that runs in
TensorFlow's C++ runtime: an interleave of ``TFRecordDataset`` over the paths, a record
shuffle buffer, ``batch``, batched ``tf.io.parse_example``, ``tf.io.decode_raw`` and
``reshape``, ``prefetch``.

The epoch's lease ends at the first of: the last record of the epoch leaving the read
stages (an empty dataset concatenated after them makes one Python call when it is
pulled), or the deletion of the iterator (a hook on ``iter()``). So eviction can never
remove a shard the epoch still has to read, and a finished epoch never pins shards.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops

from growcache.cache import Cache
from growcache.errors import CorruptShardError, EmptyCacheError, SchemaError, SchemaMismatchError
from growcache.planning import plan_epoch, reader_seed
from growcache.records import iter_records
from growcache.schema import Schema
from growcache.snapshot import Snapshot

__all__ = ["make_tf_dataset"]

logger = logging.getLogger(__name__)

_ON_CORRUPT = ("raise", "skip")
# Records held by the default shuffle buffer: about this many bytes, within these counts.
_SHUFFLE_BYTES = 256 << 20
_SHUFFLE_RECORDS = (16, 8192)
_POLL_S = 0.05
# decode_raw has no unsigned 32/64-bit outputs: decode as the signed type, then bitcast.
_RAW_AS = {tf.uint32: tf.int32, tf.uint64: tf.int64}


def make_tf_dataset(
    cache: Cache | str | os.PathLike,
    batch_size: int,
    *,
    shuffle_buffer: int | None = None,
    seed: int | None = None,
    cycle_length: int | None = None,
    block_length: int = 1,
    drop_remainder: bool = False,
    input_context: tf.distribute.InputContext | None = None,
    label: str | None = None,
    features: Schema | Mapping[str, Any] | None = None,
    verify: bool = False,
    on_corrupt: str = "raise",
    wait_for_shards: float = 0.0,
    deterministic: bool | None = None,
    read_buffer: int = 8 << 20,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` over a growcache cache; each iterator reads a fresh snapshot.

    Each ``iter(ds)`` (each ``for batch in ds:``, each Keras epoch) is one epoch over the
    shards that exist when it starts, every record exactly once, in an order fixed by
    ``(seed, epoch)``. Plain ``model.fit(ds, epochs=N)`` cuts later epochs at the first
    epoch's length (Keras 3 with datasets of unknown cardinality); train with
    :func:`growcache.fit_growing` to follow the growth.

    Args:
        cache: a :class:`Cache` or the path of a cache directory.
        batch_size: records per batch of this input pipeline (under ``tf.distribute``,
            the per-replica batch size, e.g. ``input_context.get_per_replica_batch_size(B)``).
        shuffle_buffer: records in the shuffle buffer; ``0`` turns record shuffling off.
            Default: about 256 MiB of records (16 to 8192 records).
        seed: seed of the shard order and the record shuffle. Epoch ``e`` shuffles with
            ``(seed, e)``, where ``e`` counts this dataset's iterators. Default: ``None``
            (a random seed per dataset).
        cycle_length: shards read at once. Default: the CPU count, at least 4 and at most
            16, and at most the epoch's shards.
        block_length: consecutive records taken from one shard. Default: ``1``.
        drop_remainder: drop the final partial batch. Default: ``False``.
        input_context: from ``strategy.distribute_datasets_from_function``. Pipelines of
            one process share one snapshot per epoch; each reads disjoint whole shards of it,
            and all yield the same number of batches. Default: ``None`` (one pipeline).
        label: a feature to return apart: elements become ``(features, label)``.
            Default: ``None`` (elements are a dict of tensors).
        features: the schema, for a cache that has none stored; must equal the stored one
            otherwise. Default: ``None`` (the cache's schema).
        verify: check every CRC of each shard with growcache's reader before TensorFlow
            reads it, so that a corrupt shard is named (file and offset) before any of its
            records is used. Costs one extra pass over the data. Default: ``False``
            (TensorFlow's reader still checks every CRC).
        on_corrupt: ``"raise"``: a corrupt shard stops the epoch with
            ``tf.errors.DataLossError``. ``"skip"``: corrupt shards are verified first,
            skipped whole, logged and appended to the dataset's ``corrupt_shards`` list
            (implies ``verify=True``). Default: ``"raise"``.
        wait_for_shards: seconds an epoch waits for a first shard when the cache is empty,
            then raises :class:`EmptyCacheError`. ``0`` raises at construction if the cache
            is empty now. Default: ``0.0``.
        deterministic: keep the interleave and parse order deterministic. Default: ``None``
            (deterministic when ``seed`` is given).
        read_buffer: read buffer of each ``TFRecordDataset``, in bytes; ``cycle_length``
            of them are live at once. Default: 8 MiB (TensorFlow's own 256 KiB cost about
            25% more CPU per GB here, for 1 MiB records).

    Returns:
        The dataset. Its elements hold the schema's dtypes with shapes ``(batch, *shape)``.
        It carries ``corrupt_shards``, a list of the :class:`CorruptShardError` skipped.

    Raises:
        SchemaError: the cache has no schema and ``features`` is not given, or ``label``
            is not a feature.
        SchemaMismatchError: ``features`` differs from the cache's schema.
        EmptyCacheError: the cache is empty and ``wait_for_shards`` is ``0``.
        ValueError: an argument is out of range.
    """
    if not isinstance(cache, Cache):
        cache = Cache(cache)
    schema = _resolve_schema(cache, features)
    if label is not None and label not in schema:
        raise SchemaError(f"label={label!r} is not a feature of the cache's schema {list(schema)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if on_corrupt not in _ON_CORRUPT:
        raise ValueError(f"on_corrupt must be one of {_ON_CORRUPT}, got {on_corrupt!r}")
    if wait_for_shards < 0:
        raise ValueError(f"wait_for_shards must be >= 0 seconds, got {wait_for_shards!r}")
    if wait_for_shards == 0 and not cache.list_shards():
        raise EmptyCacheError(
            f"cache {cache.path} holds no shard yet: start a SamplerPool (and pool.wait_for(records=...)) "
            "or write shards first, or pass wait_for_shards=SECONDS to wait for the first one"
        )
    if shuffle_buffer is None:
        shuffle_buffer = int(np.clip(_SHUFFLE_BYTES // max(schema.record_payload_bytes, 1), *_SHUFFLE_RECORDS))
    if shuffle_buffer < 0 or block_length < 1 or (cycle_length is not None and cycle_length < 1):
        raise ValueError("shuffle_buffer must be >= 0, block_length and cycle_length >= 1")
    if deterministic is None:
        deterministic = seed is not None

    source = _EpochSource(
        cache=cache,
        batch_size=batch_size,
        drop_remainder=drop_remainder,
        seed=seed,
        pipelines=input_context.num_input_pipelines if input_context else 1,
        pipeline=input_context.input_pipeline_id if input_context else 0,
        verify=verify or on_corrupt == "skip",
        on_corrupt=on_corrupt,
        wait_for_shards=wait_for_shards,
    )
    plans = tf.data.Dataset.range(1).map(source.start_epoch_op)  # runs once per iterator
    read = tf.data.TFRecordDataset
    cycle = cycle_length or _default_cycle()

    def shard_files(paths):
        files = tf.data.Dataset.from_tensor_slices(paths)
        if source.verify:
            # One Python call per shard (never per record): verify, then hand the path on.
            files = files.map(source.verified_path_op).filter(lambda path: tf.strings.length(path) > 0)
        return files

    def read_epoch(token, paths, top_up, quota, shuffle_seed):
        records = shard_files(paths).interleave(
            lambda path: read(path, buffer_size=read_buffer),
            cycle_length=cycle,
            block_length=block_length,
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=deterministic,
        )
        if source.pipelines > 1:
            # Equal batch counts: a long pipeline stops at its quota, a short one re-reads
            # its own shards (planning's "top up"). The quota is counted after verification,
            # so a pipeline that skips a corrupt shard tops up too, from verified shards.
            # One pipeline always reads everything, and skips these stages (each costs a
            # call per record).
            top_up_records = shard_files(top_up).flat_map(lambda path: read(path, buffer_size=read_buffer))
            records = records.concatenate(top_up_records.repeat()).take(quota)
        if shuffle_buffer:
            records = records.shuffle(shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=False)
        # Batched here, so the stages after flat_map cost a call per batch, not per record.
        batches = records.batch(batch_size, drop_remainder=drop_remainder)
        # Pulled only once every record of the epoch has left the stages above: the lease ends here.
        return batches.concatenate(source.end_of_epoch(token))

    # With drop_remainder every batch is full: keep that static, as Dataset.batch would.
    parse = _batch_parser(schema, label, batch_size if drop_remainder else -1)
    ds = plans.flat_map(read_epoch)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    ds = _IteratorTrackingDataset(ds, source)
    ds.corrupt_shards = source.corrupt_shards
    return ds


def _default_cycle() -> int:
    # Enough shards in flight to keep every core parsing, few enough to keep reads sequential.
    return min(max(4, os.cpu_count() or 4), 16)


def _resolve_schema(cache: Cache, features: Schema | Mapping[str, Any] | None) -> Schema:
    if features is not None:
        schema = Schema(features)
        if cache.schema is not None and cache.schema != schema:
            raise SchemaMismatchError(
                f"features={schema!r} differs from the schema stored in cache {cache.path}, {cache.schema!r}. "
                "Leave features= out to read the stored schema."
            )
        return schema
    if cache.schema is None:
        raise SchemaError(
            f"cache {cache.path} stores no schema, so its records cannot be decoded: pass "
            "features=Schema({...}) with the dtype and shape of every feature"
        )
    return cache.schema


def _batch_parser(schema: Schema, label: str | None, rows: int = -1):
    """The batched ``parse_example`` + ``decode_raw`` + ``reshape`` map function."""
    spec = {name: tf.io.FixedLenFeature([], tf.string) for name in schema}

    def parse(serialized: tf.Tensor):
        raw = tf.io.parse_example(serialized, spec)
        out = {}
        for name, feature in schema.items():
            dtype = tf.as_dtype(feature.dtype.name)
            values = tf.io.decode_raw(raw[name], _RAW_AS.get(dtype, dtype), little_endian=True)
            if dtype in _RAW_AS:
                values = tf.bitcast(values, dtype)
            out[name] = tf.reshape(values, [rows, *feature.shape])
        if label is None:
            return out
        target = out.pop(label)
        return out, target

    return parse


class _EpochSource:
    """The Python side of the pipeline: one call when an epoch starts, one when it ends,
    and one per shard when verifying; never one per record.

    An epoch's snapshot is leased from its start until the last of its records has left
    the read stages (an in-graph call at the end of the epoch's records), or until the
    iterator reading it is deleted, whichever comes first.

    Why no ``from_generator``: a ``GeneratorDataset`` anywhere in a pipeline (even one that
    yields a single element, even with pure-TensorFlow functions) cost 2-3x the CPU per
    record and 0.3x the throughput of the same interleave + parse pipeline on TensorFlow
    2.21. ``Dataset.range(1).map(numpy_function)`` runs the same Python once per iterator
    at no such cost, but gives no hook when the iterator is deleted early; that hook comes
    from :class:`_IteratorTrackingDataset` instead.
    """

    def __init__(
        self,
        *,
        cache: Cache,
        batch_size: int,
        drop_remainder: bool,
        seed: int | None,
        pipelines: int,
        pipeline: int,
        verify: bool,
        on_corrupt: str,
        wait_for_shards: float,
    ) -> None:
        self.cache = cache
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder
        # Every pipeline of a group must draw the same shard order: a random seed is drawn
        # once per group (see _SharedSnapshots), never per pipeline.
        self.seed = seed
        self.pipelines = pipelines
        self.pipeline = pipeline
        self.verify = verify
        self.on_corrupt = on_corrupt
        self.wait_for_shards = wait_for_shards
        self.corrupt_shards: list[CorruptShardError] = []
        self._epochs = itertools.count()
        # The pipelines of one distributed dataset share each epoch's snapshot. Which datasets
        # belong together is not visible from here, so they pair by construction order:
        # distribute_datasets_from_function builds pipelines 0..n-1 of one dataset before
        # the next dataset's, and the k-th built for each pipeline id form group k.
        key = (cache.path, seed, batch_size, drop_remainder, pipelines)
        self._group = (*key, id(self) if pipelines == 1 else _construction_ordinal(key, pipeline))
        self._lock = threading.Lock()
        self._open: dict[int, _Entry] = {}  # epochs started and not yet ended, oldest first
        self._live_iterators = 0
        # Set once a dataset is built on ours (or anything else reads its graph): from then on
        # iterators may exist that track() never saw.
        self.derived = False

    # -- in-graph hooks ---------------------------------------------------------------------
    def start_epoch_op(self, _unused: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """The ``map`` function that starts an epoch: a token and this pipeline's plan."""
        token, paths, top_up, quota, shuffle_seed = tf.numpy_function(
            self.start_epoch, [], [tf.int64, tf.string, tf.string, tf.int64, tf.int64], stateful=True
        )
        return (tf.reshape(token, []), tf.reshape(paths, [-1]), tf.reshape(top_up, [-1]),
                tf.reshape(quota, []), tf.reshape(shuffle_seed, []))

    def end_of_epoch(self, token: tf.Tensor) -> tf.data.Dataset:
        """An empty dataset of batches whose first pull ends epoch ``token``'s lease."""
        done = tf.data.Dataset.from_tensors(token).map(
            lambda t: tf.reshape(tf.numpy_function(self.finish_epoch, [t], tf.string, stateful=True), [-1])
        )
        return done.filter(lambda _: False)

    def verified_path_op(self, path: tf.Tensor) -> tf.Tensor:
        """The ``map`` function that verifies one shard: its path, or ``""`` to skip it."""
        return tf.reshape(tf.numpy_function(self.verified_path, [path], tf.string, stateful=True), [])

    # -- Python side --------------------------------------------------------------------------
    def start_epoch(self) -> tuple[np.ndarray, ...]:
        """Take (or share) this epoch's snapshot, lease it, and plan this pipeline's part."""
        epoch = next(self._epochs)
        entry = _SHARED.claim(self._group, epoch, self.pipelines, self._take_snapshot)
        try:
            snapshot, seed = entry.snapshot, entry.seed
            plan = plan_epoch(
                [s.records for s in snapshot.shards],
                epoch=epoch,
                seed=seed,
                world_size=self.pipelines,
                batch_size=self.batch_size,
                drop_last=self.drop_remainder,
            )
            reader = plan.reader(self.pipeline, 0)
            shards = plan.shards[reader]
            paths = np.array([os.fsencode(snapshot.shards[i].path) for i in shards], dtype=bytes)
            quota = int(plan.quotas[reader])
            top_up = np.array([os.fsencode(snapshot.shards[i].path) for i in plan.cycle[reader]], dtype=bytes)
            logger.debug(
                "epoch %d pipeline %d/%d: %d of %d shards, %d records of %d",
                epoch, self.pipeline, self.pipelines, len(paths), len(snapshot), quota, snapshot.records,
            )
            record_seed = reader_seed(seed, epoch, self.pipeline)
        except BaseException:
            _SHARED.release(entry)
            raise
        token = next(_TOKENS)
        with self._lock:
            self._open[token] = entry
            # Epochs that were started and never ended: some were abandoned by an iterator that
            # is gone, but which ones cannot be told from here, since an epoch starts inside
            # TensorFlow without saying which iterator asked. So none is ended early unless
            # more than _MAX_OPEN_EPOCHS are open at once: then the oldest goes, which bounds
            # the disk that abandoned epochs of untracked iterators can pin.
            abandoned = list(self._open)[:-_MAX_OPEN_EPOCHS] if len(self._open) > _MAX_OPEN_EPOCHS else []
        for old in abandoned:
            logger.warning(
                "more than %d epochs of the dataset over cache %s are open at once; ending the lease of the "
                "oldest, taken as abandoned. Keep at most %d iterators of one dataset alive at a time.",
                _MAX_OPEN_EPOCHS, self.cache.path, _MAX_OPEN_EPOCHS)
            self.finish_epoch(old)
        return (
            np.int64(token),
            paths,
            top_up,  # read only once this pipeline's own verified records fall short of its quota
            np.int64(quota),
            np.int64(record_seed),
        )

    def finish_epoch(self, token: np.int64 | int) -> np.ndarray:
        """End the lease of epoch ``token``; idempotent. Returns no batch (an empty array)."""
        with self._lock:
            entry = self._open.pop(int(token), None)
        if entry is not None:
            _SHARED.release(entry)
        return np.empty(0, dtype=bytes)

    def track(self, iterator: Any) -> None:
        """End abandoned epochs' leases when ``iterator`` is deleted, if it was the only reader."""
        with self._lock:
            self._live_iterators += 1
        weakref.finalize(iterator, self._iterator_deleted)

    def _iterator_deleted(self) -> None:
        with self._lock:
            self._live_iterators -= 1
            # With no iterator of ours alive and no dataset derived from ours (whose iterators
            # we cannot see), every open epoch was abandoned: nobody can still be reading it.
            abandoned = list(self._open) if self._live_iterators == 0 and not self.derived else []
        for token in abandoned:
            self.finish_epoch(token)

    def _take_snapshot(self) -> Snapshot:
        deadline = time.monotonic() + self.wait_for_shards
        while True:
            snapshot = self.cache.snapshot(holder=f"tf pipeline {self.pipeline}/{self.pipelines}")
            if len(snapshot) or time.monotonic() >= deadline:
                break
            snapshot.close()
            time.sleep(_POLL_S)
        if not len(snapshot):
            raise EmptyCacheError(
                f"cache {self.cache.path} held no shard after waiting {self.wait_for_shards} s: are the "
                "samplers running? Raise wait_for_shards= to wait longer."
            )
        return snapshot

    def verified_path(self, raw: bytes) -> bytes:
        """``raw`` after checking all its CRCs with growcache's reader; ``b""`` to skip it."""
        path = raw.decode()
        try:
            for _ in iter_records(path, verify=True):
                pass
        except CorruptShardError as exc:
            if self.on_corrupt == "skip":
                self.corrupt_shards.append(exc)
                logger.warning("skipping corrupt shard %s (byte offset %d: %s); %d skipped so far",
                               exc.path, exc.offset, exc.reason, len(self.corrupt_shards))
                return b""
            # TensorFlow's reader raises the DataLossError on this shard; name the file first.
            logger.error("%s", exc)
        return raw


_TOKENS = itertools.count(1)
_MAX_OPEN_EPOCHS = 4
_CONSTRUCTED: dict[tuple, int] = {}
_CONSTRUCTED_LOCK = threading.Lock()


def _construction_ordinal(key: tuple, pipeline: int) -> int:
    """How many datasets with ``key`` were built for ``pipeline`` before this one."""
    with _CONSTRUCTED_LOCK:
        ordinal = _CONSTRUCTED.get((key, pipeline), 0)
        _CONSTRUCTED[(key, pipeline)] = ordinal + 1
        return ordinal


class _IteratorTrackingDataset(dataset_ops.UnaryUnchangedStructureDataset):
    """The finished pipeline, unchanged, plus a hook on every ``iter()`` over it.

    The hook lets the last iterator, deleted mid-epoch, end its epoch's lease at once.
    Iterators made without ``iter()`` on this object (over a dataset derived from it, by
    ``tf.distribute`` or a graph-mode loop) cannot be seen; reading this dataset's graph
    for anything but our own ``iter()`` marks the source as derived, which turns the hook's
    early release off. Their abandoned epochs end when too many are open (see
    ``_MAX_OPEN_EPOCHS``) or when the dataset is garbage-collected.
    """

    def __init__(self, dataset: tf.data.Dataset, source: _EpochSource) -> None:
        self._source = source
        self._own_iter = threading.local()
        super().__init__(dataset, dataset._variant_tensor)  # noqa: SLF001 - the same graph, re-wrapped

    @property
    def _variant_tensor(self):
        if not getattr(self._own_iter, "active", False):
            self._source.derived = True
        return self._variant_tensor_attr

    @_variant_tensor.setter
    def _variant_tensor(self, _):
        raise ValueError("The `_variant_tensor` property cannot be modified.")

    def __iter__(self):
        self._own_iter.active = True
        try:
            iterator = super().__iter__()
        finally:
            self._own_iter.active = False
        self._source.track(iterator)
        return iterator


class _Entry:
    __slots__ = ("snapshot", "seed", "claims", "users", "listed")

    def __init__(self, snapshot: Snapshot | None, seed: int) -> None:
        self.snapshot = snapshot  # None while the pipeline that takes it waits for shards
        self.seed = seed
        self.claims = 0
        self.users = 0
        self.listed = True


class _SharedSnapshots:
    """One snapshot per (group, epoch), shared by the input pipelines of one process.

    ``distribute_datasets_from_function`` builds one dataset per input pipeline; each
    must read disjoint whole shards of the *same* snapshot, so the first pipeline to
    start an epoch takes it and the others reuse it. The lease ends when every pipeline
    that claimed it is done. An entry leaves the table once all pipelines claimed it, or
    when a later epoch of its group starts (pipelines of other processes never claim).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = threading.Condition(self._lock)
        self._entries: dict[tuple, tuple[int, _Entry]] = {}

    def claim(self, group: tuple, epoch: int, expected: int, take) -> _Entry:
        with self._lock:
            while True:
                current = self._entries.get(group)
                if current is None or current[0] != epoch:
                    break
                entry = current[1]
                if entry.snapshot is not None:
                    return self._claimed(group, entry, expected)
                self._taken.wait()  # another pipeline of this group is taking the snapshot
            if current is not None:
                self._unlist(group, current[1])
            seed = np.random.SeedSequence().entropy if group[1] is None else group[1]
            entry = _Entry(None, int(seed) % 2**63)
            self._entries[group] = (epoch, entry)
        # Outside the lock: taking a snapshot may wait for a first shard (wait_for_shards),
        # and other groups' epochs must not wait with it.
        try:
            snapshot = take()
        except BaseException:
            with self._lock:
                if self._entries.get(group, (None, None))[1] is entry:
                    del self._entries[group]
                self._taken.notify_all()
            raise
        with self._lock:
            entry.snapshot = snapshot
            self._taken.notify_all()
            return self._claimed(group, entry, expected)

    def _claimed(self, group: tuple, entry: _Entry, expected: int) -> _Entry:
        """Count one pipeline's claim on ``entry``. Assumes you hold the lock."""
        entry.claims += 1
        entry.users += 1
        if entry.claims >= expected:
            self._unlist(group, entry)
        return entry

    def release(self, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            if entry.users == 0 and not entry.listed and entry.snapshot is not None:
                entry.snapshot.close()

    def _unlist(self, group: tuple, entry: _Entry) -> None:
        """Drop ``entry`` from the table. Assumes you hold the lock."""
        if self._entries.get(group, (None, None))[1] is entry:
            del self._entries[group]
        entry.listed = False
        if entry.users == 0 and entry.snapshot is not None:
            entry.snapshot.close()


_SHARED = _SharedSnapshots()
