"""``make_tf_dataset``: a ``tf.data`` pipeline that reads a growing cache, one snapshot per epoch.

Every new iterator over the dataset is one epoch. Its first element comes from a Python
generator that runs once per iterator: it takes a fresh :meth:`Cache.snapshot`, plans the
epoch (:func:`growcache.planning.plan_epoch`) and yields this pipeline's shard paths as
one string tensor. Everything after that runs in TensorFlow's C++ runtime: an interleave
of ``TFRecordDataset`` over the paths, a record shuffle buffer, ``batch``, batched
``tf.io.parse_example``, ``tf.io.decode_raw`` and ``reshape``, ``prefetch``.

The lease of the epoch's snapshot lives in that generator's frame. ``flat_map`` asks the
generator for its next element only when the epoch's records are exhausted, and that
request ends the generator (its ``finally`` closes the snapshot); deleting the iterator
early finalizes the generator too. So eviction can never remove a shard the epoch still
has to read, and a finished epoch never pins shards.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from growcache.cache import Cache
from growcache.errors import CorruptShardError, EmptyCacheError, SchemaError, SchemaMismatchError
from growcache.planning import plan_epoch
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
    read_buffer: int = 256 << 10,
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
        read_buffer: read buffer of each ``TFRecordDataset``, in bytes. Default: 256 KiB.

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
        cycle_length=cycle_length,
    )
    plan_spec = (
        tf.TensorSpec([None], tf.string),  # this pipeline's shards, in reading order
        tf.TensorSpec([None], tf.string),  # shards to re-read to top up to the quota
        tf.TensorSpec([], tf.int64),  # records to take from the shards (-1: all)
        tf.TensorSpec([], tf.int64),  # records to add from the top-up shards
        tf.TensorSpec([], tf.int64),  # record shuffle seed of this epoch
        tf.TensorSpec([], tf.int64),  # cycle length
    )
    plans = tf.data.Dataset.from_generator(source.epochs, output_signature=plan_spec)
    read = tf.data.TFRecordDataset

    def read_epoch(paths, top_up, take, extra, shuffle_seed, cycle):
        files = tf.data.Dataset.from_tensor_slices(paths)
        if source.verify:
            # One Python call per shard (never per record): verify, then hand the path on.
            files = tf.data.Dataset.from_generator(
                source.verified_paths, args=(paths,), output_signature=tf.TensorSpec([], tf.string)
            )
        records = files.interleave(
            lambda path: read(path, buffer_size=read_buffer),
            cycle_length=cycle,
            block_length=block_length,
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=deterministic,
        )
        if source.pipelines > 1:
            # Equal batch counts: a long pipeline stops at its quota, a short one re-reads
            # its own shards (planning's "top up"). One pipeline always reads everything,
            # and skips these stages (each costs a call per record).
            records = records.take(take)
            records = records.concatenate(read(top_up, buffer_size=read_buffer).repeat().take(extra))
        if shuffle_buffer:
            records = records.shuffle(shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=False)
        return records

    parse = _batch_parser(schema, label)
    ds = plans.flat_map(read_epoch)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    ds = ds.prefetch(tf.data.AUTOTUNE)
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


def _batch_parser(schema: Schema, label: str | None):
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
            out[name] = tf.reshape(values, [-1, *feature.shape])
        if label is None:
            return out
        target = out.pop(label)
        return out, target

    return parse


class _EpochSource:
    """The Python side of the pipeline: one call per epoch, and one per shard when verifying."""

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
        cycle_length: int | None,
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
        self.cycle_length = cycle_length
        self.corrupt_shards: list[CorruptShardError] = []
        self._epochs = itertools.count()
        self._group = (cache.path, seed, batch_size, drop_remainder, pipelines, id(self) if pipelines == 1 else None)

    def epochs(self) -> Iterator[tuple]:
        """Yield one epoch plan; the snapshot's lease lives until this generator ends."""
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
            paths = np.array([snapshot.shards[i].path for i in shards], dtype=object)
            total = sum(snapshot.shards[i].records for i in shards)
            quota = int(plan.quotas[reader])
            top_up = np.array([snapshot.shards[i].path for i in plan.cycle[reader]], dtype=object)
            logger.debug(
                "epoch %d pipeline %d/%d: %d of %d shards, %d records of %d",
                epoch, self.pipeline, self.pipelines, len(paths), len(snapshot), quota, snapshot.records,
            )
            record_seed = int(np.random.default_rng([seed, epoch, self.pipeline]).integers(2**62))
            cycle = max(1, min(self.cycle_length or _default_cycle(), len(paths)))
            yield (
                paths.astype(bytes),
                (top_up if quota > total else top_up[:0]).astype(bytes),
                np.int64(min(quota, total)),
                np.int64(max(quota - total, 0)),
                np.int64(record_seed),
                np.int64(cycle),
            )
        finally:
            _SHARED.release(entry)

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

    def verified_paths(self, paths: np.ndarray) -> Iterator[bytes]:
        """Yield each shard path after checking all its CRCs with growcache's reader."""
        for raw in paths:
            path = raw.decode()
            try:
                for _ in iter_records(path, verify=True):
                    pass
            except CorruptShardError as exc:
                if self.on_corrupt == "skip":
                    self.corrupt_shards.append(exc)
                    logger.warning("skipping %s (%d corrupt shards skipped so far)", exc, len(self.corrupt_shards))
                    continue
                # TensorFlow's reader raises the DataLossError on this shard; name the file first.
                logger.error("%s", exc)
            yield raw


class _Entry:
    __slots__ = ("snapshot", "seed", "claims", "users", "listed")

    def __init__(self, snapshot: Snapshot, seed: int) -> None:
        self.snapshot = snapshot
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
        self._entries: dict[tuple, tuple[int, _Entry]] = {}

    def claim(self, group: tuple, epoch: int, expected: int, take) -> _Entry:
        with self._lock:
            current = self._entries.get(group)
            if current is not None and current[0] == epoch:
                entry = current[1]
            else:
                if current is not None:
                    self._unlist(group, current[1])
                seed = np.random.SeedSequence().entropy if group[1] is None else group[1]
                entry = _Entry(take(), int(seed) % 2**63)
                self._entries[group] = (epoch, entry)
            entry.claims += 1
            entry.users += 1
            if entry.claims >= expected:
                self._unlist(group, entry)
            return entry

    def release(self, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            if entry.users == 0 and not entry.listed:
                entry.snapshot.close()

    def _unlist(self, group: tuple, entry: _Entry) -> None:
        """Drop ``entry`` from the table. Assumes you hold the lock."""
        if self._entries.get(group, (None, None))[1] is entry:
            del self._entries[group]
        entry.listed = False
        if entry.users == 0:
            entry.snapshot.close()


_SHARED = _SharedSnapshots()
