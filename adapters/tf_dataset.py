"""``make_tf_dataset``: a ``tf.data`` pipeline that reads a growing cache, one snapshot per epoch.

The epoch (snapshot, agreement between input pipelines, plan, lease, corrupt-shard report,
defaults) is the core's :class:`growcache.epoch.Epochs`. This module bridges it to
``tf.data``. Every new iterator over the dataset is one epoch. Its first stage runs once per
iterator: it starts the epoch and returns this pipeline's share (shard paths, top-up paths,
quota, shuffle seed) as tensors.
Everything after that runs in TensorFlow's C++ runtime: an interleave of ``TFRecordDataset``
over the paths (each shard checked by growcache first, when verifying), a record shuffle
buffer, ``batch``, batched ``tf.io.parse_example``, ``tf.io.decode_raw`` and ``reshape``,
``prefetch``.

That first stage is a ``GeneratorDataset`` of one element, nested in a ``flat_map`` of
``Dataset.range(1)``. TensorFlow runs its finalizer when the C++ iterator holding it goes away,
whoever made that iterator (``iter()``, a derived ``ds.map(...)``, ``tf.distribute``, Keras, a
``tf.function`` loop) and whoever still holds the dataset. So the iterator's reader leaves the
epoch (:meth:`growcache.epoch.Epochs.leave`) at the first of: its second pull, which comes
once every record of the epoch has left the read stages, or the iterator's teardown. No lease
waits for Python's garbage collector. (At the top of a pipeline a ``GeneratorDataset`` would
turn off TensorFlow's rewrites of the whole pipeline, which cannot be serialized with it; inside
a ``flat_map`` function it costs nothing per record.)
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops, iterator_ops
from tensorflow.python.data.ops.from_generator_op import _GeneratorDataset
from tensorflow.python.framework import ops

from growcache.batching import Skipped
from growcache.cache import Cache
from growcache.epoch import Epoch, EpochOptions, Epochs, resolve_schema
from growcache.errors import EmptyCacheError, GrowcacheError, SchemaError
from growcache.example import ExampleCodec, tf_parse_plan
from growcache.schema import Schema
from growcache.transport import BatchLayout, Slab

__all__ = ["make_tf_dataset"]

logger = logging.getLogger(__name__)

_ABANDONED = (" (or deleted). Keep at most that many iterators of one dataset alive at a time: delete an "
              "iterator you stop reading (`del it`), or let it go out of scope.")
# decode_raw has no unsigned 32/64-bit outputs: decode as the signed type, then bitcast.
_RAW_AS = {tf.uint32: tf.int32, tf.uint64: tf.int64}
_READERS = ("growcache", "tensorflow")
# Features of at most this many bytes per batch (labels, ids) are copied out of their slot, as
# in the torch adapter: users keep those, and a kept view would pin the whole slot.
_COPY_BELOW = 256 << 10
# Slots per reader beyond its shuffle window: batches in tf.data's buffers and the one the
# training step holds. When every slot is held, a batch gets fresh memory instead.
_SPARE_SLOTS = 4


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
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` over a growcache cache; each iterator reads a fresh snapshot.

    Each ``iter(ds)`` (each ``for batch in ds:``, each Keras epoch) is one epoch over the
    shards that exist when it starts, every record exactly once, in an order fixed by
    ``(seed, epoch)``. Plain ``model.fit(ds, epochs=N)`` cuts later epochs at the first
    epoch's length (Keras 3 with datasets of unknown cardinality); train with
    :func:`growcache.fit_growing` to follow the growth.

    ``seed``, ``shuffle_buffer``, ``drop_remainder`` (``drop_last``), ``verify``,
    ``on_corrupt``, ``wait_for_shards``, ``split`` and ``run_id`` mean what they mean in
    ``make_torch_loader``, with the same defaults: see :class:`growcache.epoch.EpochOptions`.

    Args:
        cache: a :class:`Cache` or the path of a cache directory.
        batch_size: records per batch of this input pipeline (under ``tf.distribute``,
            the per-replica batch size, e.g. ``input_context.get_per_replica_batch_size(B)``).
        shuffle_buffer: records shuffled together; ``0`` turns record shuffling off. With
            ``reader="growcache"`` each reader scatters windows of this many records (rounded
            up to whole batches, at least two) over their batches, as the torch adapter does,
            at no extra copy; with ``reader="tensorflow"`` it is a ``Dataset.shuffle`` buffer.
            Default: about 32 MiB of records, at least two batches, at most 8192 records.
        seed: seed of the shard order and the record shuffle; the first pipeline's is used by
            every pipeline of its group. Epoch ``e`` shuffles with ``(seed, e)``, where ``e``
            counts this dataset's iterators. Default: ``0``.
        cycle_length: shards read at once. With ``reader="growcache"``, the readers of this
            pipeline, one thread each; each reads whole shards and forms its own batches, so
            an epoch may end with up to this many partial batches. Under ``input_context``
            with several pipelines, each pipeline has one reader. Default: half the CPU
            count, at least 1 and at most 4 (``reader="growcache"``: the other half runs
            TensorFlow and the training step); the CPU count, at least 4 and at most 16, and
            at most the epoch's shards (``reader="tensorflow"``).
        block_length: consecutive records taken from one shard (``reader="tensorflow"``).
            Default: ``1``.
        drop_remainder: drop the final partial batch. Default: ``False``.
        input_context: from ``strategy.distribute_datasets_from_function``. The pipelines of
            a group read one snapshot per epoch, the one their first pipeline took (in one
            process, or across processes through an epoch file in the cache directory); each
            reads disjoint whole shards of it, and all yield the same number of batches.
            Default: ``None`` (one pipeline).
        label: a feature to return apart: elements become ``(features, label)``.
            Default: ``None`` (elements are a dict of tensors).
        features: the schema, for a cache that has none stored; must equal the stored one
            otherwise. Default: ``None`` (the cache's schema).
        verify: check every record's CRC32Cs. Lengths, framing and each shard's record
            count against its name are checked in any case. With ``reader="growcache"`` the
            checks run as records are read, before the batch holding them is delivered;
            TensorFlow's reader is not used. With ``reader="tensorflow"`` each shard is
            checked whole by growcache before TensorFlow opens it, so a corrupt or crafted
            shard never reaches TensorFlow's reader (which checks the CRCs again). ``False``
            with ``reader="tensorflow"`` leaves the shards unchecked until TensorFlow's reader
            reads them. Default: ``True``.
        on_corrupt: ``"raise"``: a corrupt shard stops the epoch with
            :class:`~growcache.CorruptShardError` naming the file and offset (inside Keras,
            a ``tf.errors.OpError`` whose message carries it); with ``reader="growcache"``,
            after the batches completed before the bad record. ``"skip"``: with
            ``reader="growcache"`` the rest of the shard from the bad record on is skipped
            (its earlier records were delivered); with ``reader="tensorflow"`` the shard is
            skipped whole. Either way it is logged and noted in the dataset's ``skipped``
            list. Default: ``"raise"``.
        wait_for_shards: seconds an epoch waits for a first shard when the cache is empty,
            then raises :class:`EmptyCacheError`. ``0`` raises at construction if the cache
            is empty now. Default: ``0.0``.
        deterministic: keep the interleave and parse order deterministic, so that
            ``(seed, epoch)`` fixes the record order too. ``False`` lets a slow shard be
            overtaken. Default: ``True``.
        read_buffer: read buffer of each ``TFRecordDataset``, in bytes; ``cycle_length``
            of them are live at once (``reader="tensorflow"``). Default: 8 MiB (TensorFlow's
            own 256 KiB cost about 25% more CPU per GB here, for 1 MiB records).
        split: which input pipelines share one snapshot per epoch: ``"shared"``, all of
            them; ``"node"``, those of this process (one worker per machine, each with its own
            cache). Default: ``"shared"``.
        run_id: keeps this run's epoch files apart from another's. Default: ``None``
            (``$GROWCACHE_RUN_ID``, or none).
        reader: ``"growcache"``: growcache's vectorized reader
            (:class:`~growcache.vector_reader.VectorReader`) reads the shards into batches,
            one Python call per batch, and hands them to TensorFlow without a copy (large
            features are views of reused page-aligned slots; small ones are copied). A schema
            with ``int64_list`` features, whose records have no fixed layout, is read by
            TensorFlow instead. ``"tensorflow"``: an interleave of ``TFRecordDataset``, a
            ``Dataset.shuffle`` buffer and batched ``parse_example`` in TensorFlow's runtime.
            Default: ``"growcache"``.

    Returns:
        The dataset. Its elements hold the schema's dtypes with shapes ``(batch, *shape)``.
        It carries ``skipped``, a list of :class:`~growcache.batching.Skipped` notes of the
        shards skipped (``corrupt_shards`` is the same list, under its old name).

    Raises:
        SchemaError: the cache has no schema and ``features`` is not given, or ``label``
            is not a feature.
        SchemaMismatchError: ``features`` differs from the cache's schema.
        EmptyCacheError: the cache is empty and ``wait_for_shards`` is ``0``.
        ValueError: an argument is out of range.
    """
    if not isinstance(cache, Cache):
        cache = Cache(cache)
    schema = resolve_schema(cache, features)
    if label is not None and label not in schema:
        raise SchemaError(f"label={label!r} is not a feature of the cache's schema {list(schema)}")
    options = EpochOptions(batch_size, seed=seed, shuffle_buffer=shuffle_buffer, drop_last=drop_remainder,
                           verify=verify, on_corrupt=on_corrupt, wait_for_shards=wait_for_shards, split=split,
                           run_id=run_id)
    if block_length < 1 or (cycle_length is not None and cycle_length < 1):
        raise ValueError("block_length and cycle_length must be >= 1")
    if reader not in _READERS:
        raise ValueError(f"reader must be one of {_READERS}, got {reader!r}")
    if wait_for_shards == 0 and not cache.list_shards():
        raise EmptyCacheError(
            f"cache {cache.path} holds no shard yet: start a SamplerPool (and pool.wait_for(records=...)) "
            "or write shards first, or pass wait_for_shards=SECONDS to wait for the first one"
        )
    world = (input_context.input_pipeline_id, input_context.num_input_pipelines) if input_context else (0, 1)
    if reader == "growcache" and ExampleCodec(schema).fixed_layout:
        # Several pipelines: one reader each, whose top up covers all of the pipeline's shards,
        # so that a pipeline that skips a corrupt shard still yields its share of batches.
        readers = 1 if world[1] > 1 else cycle_length or min(max((os.cpu_count() or 1) // 2, 1), 4)
        return _vectorized(cache, schema, options, world, label, readers, deterministic)
    epochs = Epochs(cache, options, world=world, schema=schema, holder=f"tf pipeline {world[0]}/{world[1]}",
                    abandon_hint=_ABANDONED)
    pipeline = _Pipeline(epochs)
    records_shuffle = epochs.reader.shuffle_buffer
    read = tf.data.TFRecordDataset
    cycle = cycle_length or _default_cycle()

    def shard_files(paths):
        files = tf.data.Dataset.from_tensor_slices(paths)
        if verify:
            # One Python call per shard (never per record): check it, then hand the path on.
            files = files.map(pipeline.checked_path_op).filter(lambda path: tf.strings.length(path) > 0)
        return files

    def read_epoch(token, paths, top_up, quota, shuffle_seed):
        records = shard_files(paths).interleave(
            lambda path: read(path, buffer_size=read_buffer),
            cycle_length=cycle,
            block_length=block_length,
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=deterministic,
        )
        if world[1] > 1:
            # Equal batch counts (the core's quota and top up): a long pipeline stops at its
            # quota, a short one re-reads its own shards. The quota counts checked records, so
            # a pipeline that skips a corrupt shard tops up too. A lone pipeline reads
            # everything and skips these stages (each costs a call per record).
            top_up_records = shard_files(top_up).flat_map(lambda path: read(path, buffer_size=read_buffer))
            records = records.concatenate(top_up_records.repeat()).take(quota)
        if records_shuffle:
            records = records.shuffle(records_shuffle, seed=shuffle_seed, reshuffle_each_iteration=False)
        # Batched here, so the stages after flat_map cost a call per batch, not per record.
        return records.batch(batch_size, drop_remainder=drop_remainder)

    # With drop_remainder every batch is full: keep that static, as Dataset.batch would.
    parse = _batch_parser(schema, label, batch_size if drop_remainder else -1)
    ds = pipeline.epoch_reader(pipeline.start_epoch, _SHARE).flat_map(read_epoch)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    ds = _ErrorMappingDataset(ds, pipeline)
    ds.skipped = ds.corrupt_shards = epochs.skipped
    return ds


def _vectorized(cache: Cache, schema: Schema, options: EpochOptions, world: tuple[int, int], label: str | None,
                readers: int, deterministic: bool) -> tf.data.Dataset:
    """The pipeline of ``reader="growcache"``: ``readers`` readers per pipeline, each one a
    :class:`~growcache.batching.ReaderSpec` reader over its share, pulled a batch per call."""
    epochs = Epochs(cache, options, readers=readers, world=world, schema=schema,
                    holder=f"tf pipeline {world[0]}/{world[1]}", abandon_hint=_ABANDONED)
    pipeline = _Pipeline(epochs)
    feed = _Feed(epochs, pipeline)
    specs = [(name, tf.as_dtype(spec.dtype), spec.shape) for name, spec in schema.items()]
    rows = options.batch_size if options.drop_last else None

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

    ds = pipeline.epoch_reader(feed.start, (tf.TensorSpec([], tf.int64),)).flat_map(read_epoch)
    ds = ds.map(element).prefetch(tf.data.AUTOTUNE)
    ds = _ErrorMappingDataset(ds, pipeline)
    ds.skipped = ds.corrupt_shards = epochs.skipped
    return ds


class _Feed:
    """The Python side of ``reader="growcache"``: each epoch's readers, pulled one batch per call.

    A reader's batches land in slots of its own :class:`~growcache.transport.Slab` and reach
    TensorFlow as zero-copy views (a tensor keeps its slot until it is collected), so a batch
    costs no copy beyond the reader's own. Each iterator's readers go when it leaves its epoch
    (:meth:`_Pipeline.epoch_reader`).
    """

    def __init__(self, epochs: Epochs, pipeline: _Pipeline) -> None:
        self.epochs = epochs
        self.pipeline = pipeline
        self.names = list(epochs.reader.schema)
        self._layout = BatchLayout.from_schema(epochs.reader.schema, epochs.reader.batch_size)
        self._lock = threading.Lock()
        self._open: dict[int, _EpochReaders] = {}
        self._slabs: list[Slab] = []  # free slabs: each serves one reader at a time
        pipeline.on_leave = self._drop

    def start(self) -> tuple[np.int64]:
        """Start (or join) an epoch for a new iterator; its token keys the iterator's readers."""
        epoch, token = self.pipeline.begin()
        with self._lock:
            self._open[int(token)] = _EpochReaders(epoch)
        return (token,)

    def pull(self, token: np.int64, index: np.int64) -> list[np.ndarray]:
        """The next batch of reader ``index`` of epoch ``token``: ``[rows, *arrays]``; 0 rows at its end."""
        with self._lock:
            state = self._open.get(int(token))
        if state is None or state.epoch.ended:
            return self._empty()
        reader = int(index)
        batches = state.readers.get(reader)
        if batches is None:
            batches = state.readers[reader] = self._read(state.epoch, reader)
        try:
            item = next(batches, None)
        except GrowcacheError as exc:
            self.pipeline._note(exc)
            raise
        if item is None:  # the iterator leaves the epoch once all its readers are read out
            return self._empty()
        return item

    def _read(self, epoch: Epoch, index: int):
        slab = self._take_slab()
        schema = self.epochs.reader.schema

        def allocate(rows: int) -> tuple[Any, dict[str, np.ndarray]]:
            claimed = slab.acquire(rows)
            if claimed is None:  # the training step holds every slot (kept batches)
                return None, {name: _aligned_empty((rows, *spec.shape), spec.dtype) for name, spec in schema.items()}
            return claimed

        def release(key: Any) -> None:
            if key is not None:
                slab.give_back(key)

        try:
            for item in self.epochs.reader.build().batches(epoch.share(index), allocate, release):
                if isinstance(item, Skipped):
                    self.epochs.note_skipped(item)
                    continue
                key, arrays, rows = item
                if key is None:  # every slot is held: fresh memory
                    arrays = {name: array[:rows] for name, array in arrays.items()}
                else:
                    arrays = slab.open(key._replace(records=rows), copy_below=_COPY_BELOW)
                yield [np.int64(rows), *(arrays[name] for name in self.names)]
        finally:
            self._give_slab(slab)

    def _take_slab(self) -> Slab:
        with self._lock:
            slab = self._slabs.pop() if self._slabs else None
        if slab is None:
            return Slab(self._layout, self.epochs.reader.window_batches + _SPARE_SLOTS)
        slab.reclaim(slab.held_tokens())  # slots an abandoned reader claimed and never handed out
        return slab

    def _give_slab(self, slab: Slab) -> None:
        with self._lock:
            self._slabs.append(slab)

    def _empty(self) -> list[np.ndarray]:
        return [np.int64(0), *(np.empty((0, *s.shape), s.dtype) for s in self.epochs.reader.schema.values())]

    def _drop(self, token: int) -> None:
        """Forget the readers of iterator ``token``, which left its epoch; their slabs return."""
        with self._lock:
            state = self._open.pop(token, None)
        for batches in state.readers.values() if state is not None else ():
            try:
                batches.close()  # gives its slab back
            except ValueError:  # still running in a TensorFlow thread: it stops at its next pull
                pass


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array TensorFlow takes without a copy: its data 64-byte aligned."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class _EpochReaders:
    __slots__ = ("epoch", "readers")

    def __init__(self, epoch: Epoch) -> None:
        self.epoch = epoch
        self.readers: dict[int, Any] = {}


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


class _Pipeline:
    """The Python side of one input pipeline: one call when an iterator starts its epoch, two when
    it leaves, and one per shard when verifying; never one per record."""

    def __init__(self, epochs: Epochs) -> None:
        self.epochs = epochs
        self._lock = threading.Lock()
        self._emitted: set[int] = set()
        self._finished: set[int] = set()
        self.errors: list[GrowcacheError] = []  # raised inside TensorFlow, to re-raise as themselves
        self.on_leave: Any = None  # called with an iterator's token once it left its epoch

    # -- in-graph hooks ---------------------------------------------------------------------
    def epoch_reader(self, start: Any, spec: tuple[tf.TensorSpec, ...]) -> tf.data.Dataset:
        """One element per iterator, ``start()``'s tuple (whose first item is the iterator's
        token); the iterator leaves its epoch when it pulls again or is torn down."""

        def generator(_unused: tf.Tensor) -> tf.data.Dataset:
            def first(state):
                return (tf.reshape(tf.numpy_function(self.emit_once, [state[0]], tf.int64, stateful=True), []),
                        *state[1:])

            return _GeneratorDataset(
                (), lambda: [tf.ensure_shape(t, s.shape) for t, s in
                             zip(tf.numpy_function(start, [], [s.dtype for s in spec], stateful=True), spec)],
                lambda *state: first(state),
                lambda token, *_: tf.numpy_function(self.leave, [token], tf.int64, stateful=True), spec)

        return tf.data.Dataset.range(1).flat_map(generator)

    def checked_path_op(self, path: tf.Tensor) -> tf.Tensor:
        """The ``map`` function that checks one shard: its path, or ``""`` to skip it."""
        return tf.reshape(tf.numpy_function(self.checked_path, [path], tf.string, stateful=True), [])

    # -- Python side --------------------------------------------------------------------------
    def begin(self) -> tuple[Epoch, np.int64]:
        """Start (or join) an epoch for a new iterator, and that iterator's token: its epoch's
        token (iterators that join an open epoch share it) and its own number."""
        try:
            epoch = self.epochs.start()
        except GrowcacheError as exc:
            self._note(exc)
            raise
        return epoch, np.int64(epoch.token << 32 | next(_ITERATORS))

    def start_epoch(self) -> tuple[np.ndarray, ...]:
        epoch, token = self.begin()
        share = epoch.share(0)
        logger.debug("epoch %d pipeline %d/%d: %d of %d shards", epoch.number, self.epochs.group.world_rank,
                     self.epochs.group.world_size, len(share.shards), len(epoch.shards))
        quota = share.quota if share.quota >= 0 else share.records_owned()
        # top_up is read only once this pipeline's own checked records fall short of its quota.
        return token, share.shard_paths(), share.cycle_paths(), np.int64(quota), np.int64(share.shuffle_seed)

    def emit_once(self, token: np.int64) -> np.int64:
        """An iterator's first pull passes its share on; its second ends the generator: every
        record of the epoch has left the read stages."""
        with self._lock:
            if int(token) not in self._emitted:
                self._emitted.add(int(token))
                return token
            self._finished.add(int(token))
        raise StopIteration  # the generator's end of sequence

    def leave(self, token: np.int64) -> np.int64:
        """The iterator of ``token`` is done with its epoch, read to the end or torn down; once each."""
        with self._lock:
            self._emitted.discard(int(token))
            finished = int(token) in self._finished
            self._finished.discard(int(token))
        if self.on_leave is not None:
            self.on_leave(int(token))
        self.epochs.leave(int(token) >> 32, finished)
        return np.int64(0)

    def checked_path(self, raw: bytes) -> bytes:
        """``raw`` once growcache has checked the shard, ``b""`` to skip it; raises if corrupt."""
        try:
            return raw if self.epochs.check_shard(os.fsdecode(raw)) else b""
        except GrowcacheError as exc:
            self._note(exc)
            raise

    def error_for(self, exc: tf.errors.OpError) -> GrowcacheError | None:
        """The growcache error behind a TensorFlow error, if one of ours raised it (taken off the
        list: raised again it holds the iterator's frames, which must not outlive the caller's)."""
        with self._lock:
            for i in range(len(self.errors) - 1, -1, -1):
                if str(self.errors[i]) in exc.message:
                    return self.errors.pop(i).with_traceback(None)
        return None

    def _note(self, error: GrowcacheError) -> None:
        with self._lock:
            self.errors[:] = [*self.errors[-15:], error]  # errors inside derived datasets are never claimed



_ITERATORS = itertools.count(1)
_SHARE = (tf.TensorSpec([], tf.int64), tf.TensorSpec([None], tf.string), tf.TensorSpec([None], tf.string),
          tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64))  # token, paths, top up, quota, shuffle seed


class _Iterator(iterator_ops.OwnedIterator):
    """An eager iterator that raises growcache's own errors (``EmptyCacheError``,
    ``CorruptShardError``...) instead of the ``tf.errors.OpError`` TensorFlow wraps them in."""

    def __init__(self, dataset: tf.data.Dataset, pipeline: _Pipeline) -> None:
        self._growcache_pipeline = pipeline
        super().__init__(dataset)

    def _next_internal(self):
        try:
            return super()._next_internal()
        except tf.errors.OutOfRangeError:
            raise
        except tf.errors.OpError as exc:
            error = self._growcache_pipeline.error_for(exc)
            if error is None:
                raise
            raise error from None  # TensorFlow has logged its own copy of the traceback


class _ErrorMappingDataset(dataset_ops.UnaryUnchangedStructureDataset):
    """The finished pipeline, unchanged; its eager iterators raise growcache's own errors."""

    def __init__(self, dataset: tf.data.Dataset, pipeline: _Pipeline) -> None:
        self._pipeline = pipeline
        super().__init__(dataset, dataset._variant_tensor)  # noqa: SLF001 - the same graph, re-wrapped

    def __iter__(self):
        if not tf.executing_eagerly():
            return super().__iter__()
        with ops.colocate_with(self._variant_tensor):
            return _Iterator(self, self._pipeline)
