"""``make_tf_dataset``: a ``tf.data`` pipeline over a growing cache, one snapshot per iterator.

The epoch is the core's :class:`growcache.epoch.Epochs`; each iterator's start, leave, shard
checks and batches are :mod:`growcache.pull_feed`'s. This module bridges them to ``tf.data``:
``reader="growcache"`` pulls the core's readers a batch per call into zero-copy tensors;
``reader="tensorflow"`` interleaves ``TFRecordDataset`` over shards growcache checked first,
then shuffles, batches and parses in TensorFlow's runtime.

Each iterator's first stage is a one-element ``GeneratorDataset`` nested in a ``flat_map``,
whose finalizer TensorFlow runs when the C++ iterator holding it goes, whoever made it (Keras,
``tf.distribute``, a ``tf.function`` loop): so an iterator leaves its epoch at its second pull
or its teardown, never by garbage collection. (At the top of a pipeline a ``GeneratorDataset``
would turn off TensorFlow's rewrites of the whole pipeline; in a ``flat_map`` it costs nothing.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops, iterator_ops
from tensorflow.python.data.ops.from_generator_op import _GeneratorDataset
from tensorflow.python.framework import ops

from growcache.cache import Cache
from growcache.epoch import EpochOptions, Epochs, reader_cache, require_shards, resolve_schema
from growcache.errors import SchemaError
from growcache.example import ExampleCodec, tf_parse_plan
from growcache.pull_feed import IteratorEpochs, SlabFeed
from growcache.resume import DEFAULT_RESUME_TTL
from growcache.schema import Schema

__all__ = ["make_tf_dataset"]

logger = logging.getLogger(__name__)

_ABANDONED = (" (or deleted). Keep at most that many iterators of one dataset alive at a time: delete an "
              "iterator you stop reading (`del it`), or let it go out of scope.")
# decode_raw has no unsigned 32/64-bit outputs: decode as the signed type, then bitcast.
_RAW_AS = {tf.uint32: tf.int32, tf.uint64: tf.int64}
_READERS = ("growcache", "tensorflow")


def make_tf_dataset(
    cache: Cache | str | os.PathLike,
    batch_size: int,
    *,
    shuffle_buffer: int | None = None,
    seed: int = 0,
    cycle_length: int | None = None,
    block_length: int = 1,
    drop_remainder: bool = False,
    input_context: tf.distribute.InputContext | None = None,
    label: str | None = None,
    features: Schema | Mapping[str, Any] | None = None,
    verify: bool = True,
    on_corrupt: str = "raise",
    wait_for_shards: float = 0.0,
    deterministic: bool = True,
    read_buffer: int = 8 << 20,
    split: str = "shared",
    run_id: str | None = None,
    reader: str = "growcache",
    resume_ttl: float = DEFAULT_RESUME_TTL,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` over a growcache cache; each iterator reads a fresh snapshot.

    Each ``iter(ds)`` (each ``for batch in ds:``, each Keras epoch) is one epoch over the
    shards that exist when it starts, every record exactly once, in an order fixed by
    ``(seed, epoch)``, where ``epoch`` counts this dataset's iterators. Plain
    ``model.fit(ds, epochs=N)`` cuts later epochs at the first epoch's length (Keras 3 with
    datasets of unknown cardinality); train with :func:`growcache.fit_growing` to follow the
    growth.

    Args:
        cache: a :class:`Cache` or the path of a cache directory.
        batch_size: records per batch of this input pipeline (under ``tf.distribute``,
            the per-replica batch size, e.g. ``input_context.get_per_replica_batch_size(B)``).
        cycle_length: shards read at once. ``reader="growcache"``: reader threads, each with
            its own last partial batch (one under ``input_context`` with several pipelines);
            default half the CPU count, 1 to 4. ``reader="tensorflow"``: the interleave's;
            default the CPU count, 4 to 16.
        block_length: consecutive records taken from one shard (``reader="tensorflow"``).
            Default: ``1``.
        input_context: from ``strategy.distribute_datasets_from_function``. A group's pipelines
            read the snapshot their first pipeline took (across processes through an epoch
            file), each disjoint whole shards, all the same number of batches. Default: ``None``.
        label: a feature to return apart: elements become ``(features, label)``.
            Default: ``None`` (elements are a dict of tensors).
        features: the schema, for a cache that has none stored; must equal the stored one
            otherwise. Default: ``None`` (the cache's schema).
        deterministic: keep the interleave and parse order deterministic, so that
            ``(seed, epoch)`` fixes the record order too; ``False`` lets a slow shard be
            overtaken. Default: ``True``.
        read_buffer: bytes of each ``TFRecordDataset``'s buffer (``reader="tensorflow"``;
            TensorFlow's 256 KiB cost 25% more CPU per GB at 1 MiB records). Default: 8 MiB.
        reader: ``"growcache"``: the core's :class:`~growcache.vector_reader.VectorReader`,
            a Python call per batch, handed over without a copy (a schema with ``int64_list``
            features has no fixed layout: TensorFlow reads it). ``"tensorflow"``:
            ``TFRecordDataset`` and batched ``parse_example``. Default: ``"growcache"``.
        resume_ttl: seconds each epoch's snapshot stays pinned in the cache from the epoch's
            first ``ds.state_dict()``, as in ``make_torch_loader``. Default: 12 hours.

    The epoch arguments (``shuffle_buffer``, ``seed``, ``drop_remainder`` as ``drop_last``,
    ``verify``, ``on_corrupt`` into ``skipped``, ``wait_for_shards``, ``split``, ``run_id``)
    mean what they mean in ``make_torch_loader``, with the same defaults: see
    :class:`growcache.epoch.EpochOptions`, in the API reference too. Inside
    Keras, a :class:`~growcache.CorruptShardError` reaches you in a ``tf.errors.OpError``.

    Returns:
        The dataset; elements hold the schema's dtypes with shapes ``(batch, *shape)``. Its
        ``skipped`` (alias ``corrupt_shards``) lists the :class:`~growcache.batching.Skipped`
        shards; its ``epochs`` (a :class:`~growcache.epoch.Epochs`) says what each epoch read:
        ``ds.epochs.latest.shards``, as a torch loader's ``loader.last_epoch.shards``; its
        ``stats()``, whether training waits on data, as ``loader.stats()`` (:func:`growcache.input_stats`).
        Its ``state_dict(consumed=None)`` and ``load_state_dict(state, *, on_missing="raise",
        replan=False)`` save and restore the exact position in an epoch, as a torch loader's do
        (``consumed``: the batches taken from the current iterator, unless an eager loop reads
        ``ds`` itself; see docs/tensorflow.md); under Keras, :class:`growcache.adapters.keras.BackupAndRestore`.

    Raises:
        SchemaError: no schema stored or given, or ``label`` is not a feature.
        SchemaMismatchError: ``features`` differs from the cache's schema.
        EmptyCacheError: the cache is empty and ``wait_for_shards`` is ``0``; no cache at the path after it.
        ValueError: an argument is out of range.
    """
    options = EpochOptions(batch_size, seed=seed, shuffle_buffer=shuffle_buffer, drop_last=drop_remainder,
                           verify=verify, on_corrupt=on_corrupt, wait_for_shards=wait_for_shards, split=split,
                           run_id=run_id)
    cache = reader_cache(cache, options.wait_for_shards, features=features)
    schema = resolve_schema(cache, features)
    if label is not None and label not in schema:
        raise SchemaError(f"label={label!r} is not a feature of the cache's schema {list(schema)}")
    if block_length < 1 or (cycle_length is not None and cycle_length < 1):
        raise ValueError("block_length and cycle_length must be >= 1")
    if reader not in _READERS:
        raise ValueError(f"reader must be one of {_READERS}, got {reader!r}")
    require_shards(cache, wait_for_shards)
    world = (input_context.input_pipeline_id, input_context.num_input_pipelines) if input_context else (0, 1)
    vectorized = reader == "growcache" and ExampleCodec(schema).fixed_layout
    # Several pipelines: one reader each, whose top up covers all of the pipeline's shards,
    # so that a pipeline that skips a corrupt shard still yields its share of batches.
    readers = 1 if world[1] > 1 or not vectorized else cycle_length or min(max((os.cpu_count() or 1) // 2, 1), 4)
    epochs = Epochs(cache, options, readers=readers, world=world, schema=schema,
                    holder=f"tf pipeline {world[0]}/{world[1]}", abandon_hint=_ABANDONED)
    iterators = IteratorEpochs(epochs, replays=not vectorized, resume_ttl=resume_ttl)
    if vectorized:
        ds = _vectorized(iterators, label, readers, deterministic)
    else:
        ds = _tensorflow(iterators, label, cycle_length or _default_cycle(), block_length, read_buffer,
                         deterministic, world[1] > 1)
    ds = _ErrorMappingDataset(ds.prefetch(tf.data.AUTOTUNE), iterators)
    ds.skipped = ds.corrupt_shards = epochs.skipped
    ds.epochs, ds.stats = epochs, iterators.meter.stats  # after ds.map(): growcache.input_stats(cache)
    ds.state_dict, ds.load_state_dict = iterators.state_dict, iterators.load_state_dict
    return ds


def _tensorflow(iterators: IteratorEpochs, label: str | None, cycle: int, block_length: int, read_buffer: int,
                deterministic: bool, top_up: bool) -> tf.data.Dataset:
    """The pipeline of ``reader="tensorflow"``: an interleave of ``TFRecordDataset`` over the
    share, each shard checked by growcache first (when verifying), a record shuffle buffer,
    ``batch`` and batched ``parse_example``."""
    spec, options = iterators.epochs.reader, iterators.epochs.options
    read = tf.data.TFRecordDataset

    def shard_files(paths):
        # One Python call per shard (never per record): check it (without verify, its size
        # against its name), then hand the path on.
        files = tf.data.Dataset.from_tensor_slices(paths).map(lambda path: tf.reshape(
            tf.numpy_function(iterators.checked_path, [path], tf.string, stateful=True), []))
        return files.filter(lambda path: tf.strings.length(path) > 0)

    def read_epoch(token, paths, top_up_paths, quota, shuffle_seed, skip):
        records = shard_files(paths).interleave(
            lambda path: read(path, buffer_size=read_buffer), cycle_length=cycle, block_length=block_length,
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
        if top_up:
            # Equal batch counts (the core's quota and top up): a long pipeline stops at its
            # quota, a short one re-reads its own shards. The quota counts checked records, so
            # a pipeline that skips a corrupt shard tops up too. A lone pipeline reads
            # everything and skips these stages (each costs a call per record).
            more = shard_files(top_up_paths).flat_map(lambda path: read(path, buffer_size=read_buffer))
            records = records.concatenate(more.repeat()).take(quota)
        if spec.shuffle_buffer:
            records = records.shuffle(spec.shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=False)
        # Batched here, so the stages after flat_map cost a call per batch, not per record. A resumed
        # epoch is read again (TFRecordDataset cannot seek): the consumed batches are dropped unparsed.
        return records.batch(spec.batch_size, drop_remainder=options.drop_last).skip(skip)

    # With drop_remainder every batch is full: keep that static, as Dataset.batch would.
    parse = _batch_parser(spec.schema, label, spec.batch_size if options.drop_last else -1)
    ds = _epoch_reader(iterators, iterators.start_share, _SHARE).flat_map(read_epoch)
    return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)


def _vectorized(iterators: IteratorEpochs, label: str | None, readers: int, deterministic: bool) -> tf.data.Dataset:
    """The pipeline of ``reader="growcache"``: ``readers`` readers per pipeline, each pulled a
    batch per call from the core's :class:`~growcache.pull_feed.SlabFeed`."""
    feed = SlabFeed(iterators)
    specs = [(name, tf.as_dtype(spec.dtype), spec.shape) for name, spec in feed.spec.schema.items()]
    rows = feed.spec.batch_size if iterators.epochs.options.drop_last else None

    def batches_of(token, index):
        def pull(_unused):
            out = tf.numpy_function(feed.pull, [token, index], [tf.int64] + [d for _, d, _ in specs], stateful=True)
            return out[0], tuple(out[1:])

        # One call per batch until the reader's share is read (a batch of 0 rows ends it).
        return tf.data.Dataset.range(2**62).map(pull).take_while(lambda count, _: count > 0)

    def read_epoch(token):
        return tf.data.Dataset.range(readers).interleave(
            lambda index: batches_of(token, index), cycle_length=readers, block_length=1,
            num_parallel_calls=readers, deterministic=deterministic)

    def element(_count, arrays):
        # With drop_remainder every batch is full: keep that static, as Dataset.batch would.
        out = {name: tf.ensure_shape(array, [rows, *shape]) for (name, _, shape), array in zip(specs, arrays)}
        return out if label is None else (out, out.pop(label))

    return _epoch_reader(iterators, feed.start, (tf.TensorSpec([], tf.int64),)).flat_map(read_epoch).map(element)


def _default_cycle() -> int:
    # Enough shards in flight to keep every core parsing, few enough to keep reads sequential.
    return min(max(4, os.cpu_count() or 4), 16)


def _batch_parser(schema: Schema, label: str | None, rows: int = -1):
    """The batched ``parse_example`` map function, then per feature what its encoding needs
    (``tf_parse_plan``): ``decode_raw`` + ``reshape``, ``parse_tensor``, or a range-checked cast."""
    plan = tf_parse_plan(schema)
    spec = {name: tf.io.FixedLenFeature(p.parse_shape, tf.as_dtype(p.parse_dtype)) for name, p in plan.items()}

    def parse(serialized: tf.Tensor):
        raw = tf.io.parse_example(serialized, spec)
        out = {}
        for name, p in plan.items():
            dtype, values = tf.as_dtype(p.dtype), raw[name]
            if p.then == "decode_raw":
                values = tf.io.decode_raw(values, _RAW_AS.get(dtype, dtype), little_endian=True)
                if dtype in _RAW_AS:
                    values = tf.bitcast(values, dtype)
            elif p.then == "parse_tensor":  # its dtype is checked by parse_tensor, its shape here
                values = tf.map_fn(lambda v, d=dtype, s=p.shape: tf.ensure_shape(tf.io.parse_tensor(v, d), s), values,
                                   fn_output_signature=tf.TensorSpec(p.shape, dtype))
            elif p.then == "cast":  # an int64_list into a narrower dtype: never wrapped
                low, high = p.value_range
                check = tf.debugging.Assert(
                    tf.reduce_all((values >= low) & (values <= high)),
                    [f"growcache: feature {name!r} holds int64_list values out of range for dtype {p.dtype} "
                     f"[{low}, {high}]; use a wider dtype in the schema. Values:", values], summarize=8)
                with tf.control_dependencies([check]):
                    values = tf.cast(values, dtype)
            # The batch's row count, not -1: -1 cannot be inferred for a feature of zero size.
            out[name] = tf.reshape(values, [rows if rows >= 0 else tf.shape(serialized)[0], *p.shape])
        if label is None:
            return out
        target = out.pop(label)
        return out, target

    return parse


def _epoch_reader(iterators: IteratorEpochs, start: Any, spec: tuple[tf.TensorSpec, ...]) -> tf.data.Dataset:
    """One element per iterator, ``start()``'s tuple (whose first item is the iterator's
    token); the iterator leaves its epoch when it pulls again or is torn down."""

    def emit_once(token: np.int64) -> np.int64:
        if iterators.first_pull(token):
            return token
        raise StopIteration  # the generator's end of sequence

    def generator(_unused: tf.Tensor) -> tf.data.Dataset:
        def first(state):
            return (tf.reshape(tf.numpy_function(emit_once, [state[0]], tf.int64, stateful=True), []), *state[1:])

        return _GeneratorDataset(
            (), lambda: [tf.ensure_shape(t, s.shape) for t, s in
                         zip(tf.numpy_function(start, [], [s.dtype for s in spec], stateful=True), spec)],
            lambda *state: first(state),
            lambda token, *_: tf.numpy_function(iterators.leave, [token], tf.int64, stateful=True), spec)

    return tf.data.Dataset.range(1).flat_map(generator)


_SHARE = (tf.TensorSpec([], tf.int64), tf.TensorSpec([None], tf.string), tf.TensorSpec([None], tf.string),
          tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64),
          tf.TensorSpec([], tf.int64))  # token, paths, top up, quota, shuffle seed, batches to skip


class _Iterator(iterator_ops.OwnedIterator):
    """An eager iterator that raises growcache's own errors (``EmptyCacheError``,
    ``CorruptShardError``...) instead of the ``tf.errors.OpError`` TensorFlow wraps them in,
    and counts the batches it hands over for ``state_dict()``."""

    def __init__(self, dataset: tf.data.Dataset, iterators: IteratorEpochs) -> None:
        self._growcache_iterators = iterators
        self._growcache_epoch = None  # the epoch this iterator reads, known at its first batch
        super().__init__(dataset)

    def _next_internal(self):
        iterators = self._growcache_iterators
        meter = iterators.meter  # eager: the wait is timed at next(), exactly
        started = meter.clock()
        try:
            batch = super()._next_internal()
        except tf.errors.OutOfRangeError:
            meter.next_done(started, False)
            iterators.done(self._growcache_epoch)
            raise
        except tf.errors.OpError as exc:
            iterators.raise_error_for(exc.message)  # TensorFlow has logged its own copy of the traceback
            raise
        meter.next_done(started, True)
        if tf.executing_eagerly():  # traced into a tf.function (Keras), it runs once: the caller counts
            self._growcache_epoch = iterators.took(self._growcache_epoch)  # handed to the loop, not prefetched
        return batch

    def __del__(self) -> None:
        self._growcache_iterators.done(self._growcache_epoch)  # dropped: an epoch held open for it ends


class _ErrorMappingDataset(dataset_ops.UnaryUnchangedStructureDataset):
    """The finished pipeline, unchanged; its eager iterators raise growcache's own errors."""

    def __init__(self, dataset: tf.data.Dataset, iterators: IteratorEpochs) -> None:
        self._iterators = iterators
        super().__init__(dataset, dataset._variant_tensor)  # noqa: SLF001 - the same graph, re-wrapped

    def __iter__(self):
        if not tf.executing_eagerly():
            return super().__iter__()
        with ops.colocate_with(self._variant_tensor):
            return _Iterator(self, self._iterators)
