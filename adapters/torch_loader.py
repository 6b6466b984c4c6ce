"""PyTorch adapter: ``make_torch_loader`` turns a growing cache into a ``DataLoader``.

Everything framework-neutral lives in the core: epoch planning (:mod:`growcache.planning`),
reading and batching into numpy (:mod:`growcache.batching`) and the shared-memory slabs
(:mod:`growcache.transport`). This module only translates them into DataLoader terms:

* ``iter(loader)`` takes the epoch's snapshot in the training process, plans the epoch,
  and sends each worker its share (numpy arrays) through that worker's queue. Workers,
  persistent or not, block on their queue at the start of each epoch; a shared generation
  number tells a persistent worker which message belongs to the epoch it was reset for.
* Workers frame records with the ``tfrecord`` package, verify CRC32Cs, copy payloads into
  a slot of their slab and yield a :class:`~growcache.transport.SlotHandle`. The training
  process turns it into tensors over the slab without a copy (``torch.from_numpy``); the
  slot is freed when the batch's tensors are garbage collected.
* The snapshot's lease is released when the last worker has finished the epoch.
"""

from __future__ import annotations

import logging
import os
import queue as queue_module
import socket
import struct
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from growcache.batching import BatchReader, ReaderShare, Skipped, default_shuffle_buffer, growcache_frames
from growcache.cache import Cache
from growcache.errors import CorruptShardError, EmptyCacheError, GrowcacheError, SchemaError
from growcache.planning import plan_epoch, reader_seed
from growcache.records import masked_crc32c
from growcache.transport import BatchLayout, Slab, SlotHandle

__all__ = ["make_torch_loader", "tfrecord_frames"]

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("<QI")
_PLAN_TIMEOUT_S = 300.0
# Features of at most this many bytes per batch (labels, ids) are copied out of the slab:
# users keep those (metrics, logging), and a kept view would pin a whole slot.
_COPY_BELOW = 256 << 10


def tfrecord_frames(path: str, verify: bool) -> Iterator[tuple[int, memoryview]]:
    """Frame records with the ``tfrecord`` package's reader; growcache checks the CRCs.

    That reader never exposes the CRC bytes, so growcache reads them itself (``pread``
    of the 12-byte header *before* the package reads a record, which also stops a
    corrupt length from making it allocate a huge buffer; and of the 4-byte footer after).
    """
    from tfrecord.reader import tfrecord_iterator

    fd = os.open(path, os.O_RDONLY)
    records = tfrecord_iterator(path)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset < size:
            header = os.pread(fd, 12, offset)
            if len(header) < 12:
                raise CorruptShardError(path, offset, f"truncated record header ({len(header)} of 12 bytes)")
            length, length_crc = _HEADER.unpack(header)
            if masked_crc32c(header[:8]) != length_crc:
                raise CorruptShardError(path, offset, "length CRC32C mismatch (corrupt record header)")
            if offset + length + 16 > size:
                raise CorruptShardError(path, offset, f"truncated record: needs {length + 16} bytes, "
                                                      f"file has {size - offset} left")
            try:
                data = next(records)
            except (RuntimeError, StopIteration) as exc:
                raise CorruptShardError(path, offset, f"tfrecord reader failed: {exc}") from None
            if verify and masked_crc32c(data) != struct.unpack("<I", os.pread(fd, 4, offset + 12 + length))[0]:
                raise CorruptShardError(path, offset, "data CRC32C mismatch (corrupt record payload)")
            yield offset, data
            offset += length + 16
    finally:
        records.close()
        os.close(fd)


_FRAMES = {"tfrecord": tfrecord_frames, "growcache": growcache_frames}


@dataclass
class _EpochMessage:
    generation: int
    share: ReaderShare
    held: list[tuple[int, int]]


@dataclass
class _Failure:
    """An error raised in a worker, carried as data so its type survives the trip
    (DataLoader re-creates worker errors from a message, which loses ``path``/``offset``)."""

    error: BaseException


def _to_transport(item: Any) -> Any:
    # Runs in the worker (collate_fn): a fallback batch of numpy arrays becomes tensors,
    # which DataLoader sends through torch's own shared memory.
    if isinstance(item, dict):
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in item.items()}
    return item


class _CacheStream(IterableDataset):
    """The dataset every worker iterates: one epoch share per ``__iter__``."""

    def __init__(self, schema: Any, batch_size: int, drop_last: bool, verify: bool, on_corrupt: str,
                 reader: str, slabs: list[Slab], channels: list[Any], generation: Any, shuffle_buffer: int) -> None:
        self.schema = schema
        self.shuffle_buffer = shuffle_buffer
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.verify = verify
        self.on_corrupt = on_corrupt
        self.reader = reader
        self.slabs = slabs
        self.channels = channels
        self.generation = generation
        self.local: _EpochMessage | None = None  # num_workers=0: set directly by the loader

    def _receive(self, worker: int, expected: int) -> _EpochMessage:
        deadline = time.monotonic() + _PLAN_TIMEOUT_S
        while True:
            try:
                message = self.channels[worker].get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue_module.Empty:
                raise RuntimeError(f"growcache worker {worker} got no epoch plan in {_PLAN_TIMEOUT_S} s") from None
            if message.generation >= expected:  # older ones belong to abandoned epochs
                return message

    def __iter__(self) -> Iterator[Any]:
        # The epoch is fixed here, when DataLoader asks for the iterator, not when the first
        # batch is pulled: a persistent worker may pull a leftover request of an abandoned
        # epoch after the next epoch was announced, and that stale pull must not take the
        # next epoch's plan (the real next epoch would then wait for a plan that never comes).
        return self._batches(self.generation.value)

    def _batches(self, generation: int) -> Iterator[Any]:
        info = get_worker_info()
        reader = BatchReader(self.schema, self.batch_size, frames=_FRAMES[self.reader], verify=self.verify,
                             on_corrupt=self.on_corrupt, drop_last=self.drop_last,
                             shuffle_buffer=self.shuffle_buffer)
        if info is None:
            message = self.local
            slab = None
        else:
            message = self._receive(info.id, generation)
            slab = self.slabs[info.id]
            slab.prefault()
            slab.start_generation(message.generation, message.held)

        def allocate(rows: int) -> tuple[Any, dict[str, np.ndarray]]:
            claimed = slab.acquire(rows) if slab is not None else None
            if claimed is None:  # no workers, or the trainer holds every slot
                return None, {n: np.empty((rows, *s.shape), s.dtype) for n, s in self.schema.items()}
            return claimed

        def release(key: Any) -> None:
            if key is not None:
                slab.give_back(key)

        try:
            for item in reader.batches(message.share, allocate, release):
                if isinstance(item, Skipped):
                    yield item
                    continue
                key, arrays, rows = item
                if key is None:
                    batch = {n: a[:rows] for n, a in arrays.items()}
                    yield batch if info is not None else {n: torch.from_numpy(a) for n, a in batch.items()}
                else:
                    yield key._replace(records=rows)
        except GrowcacheError as exc:
            if info is None:
                raise
            yield _Failure(exc)


class GrowcacheLoader(DataLoader):
    """A ``DataLoader`` whose every ``iter()`` is one epoch on a fresh cache snapshot.

    Build it with :func:`make_torch_loader`. Extra attributes:

    Attributes:
        epoch: the epoch the next ``iter()`` reads (``set_epoch`` changes it).
        skipped: :class:`~growcache.batching.Skipped` notes of corrupt shards passed over.
        last_plan: the :class:`~growcache.planning.EpochPlan` of the latest epoch.
    """

    def __init__(self, cache: Cache, stream: _CacheStream, *, seed: int, even_batches: bool,
                 wait_for_shards: float, copy: bool, user_pin_memory: bool, slots: int, split: str,
                 **kwargs: Any) -> None:
        super().__init__(stream, batch_size=None, collate_fn=_to_transport, **kwargs)
        self._cache = cache
        self._split = split
        self._stream = stream
        self._seed = seed
        self._even = even_batches
        self._wait = wait_for_shards
        self._copy = copy
        self._pin = user_pin_memory
        self._slots = slots
        self._pending_lease: Any = None
        self.epoch = 0
        self.skipped: list[Skipped] = []
        self.last_plan = None

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next (the shard order depends on ``(seed, epoch)``)."""
        self.epoch = int(epoch)

    def _snapshot(self) -> Any:
        deadline = time.monotonic() + self._wait
        while True:
            snapshot = self._cache.snapshot(holder=f"torch loader pid {os.getpid()}")
            if len(snapshot) or time.monotonic() >= deadline:
                break
            snapshot.close()
            time.sleep(0.05)
        if not len(snapshot):
            raise EmptyCacheError(
                f"cache {self._cache.path} holds no shards after waiting {self._wait} s: start a SamplerPool "
                "or write shards first, or pass make_torch_loader(..., wait_for_shards=SECONDS)"
            )
        return snapshot

    def _make_slabs(self) -> None:
        # Slabs are created here, in the training process, before the workers start: a
        # worker killed by any signal then owns nothing that could leak.
        context = self.multiprocessing_context
        method = context.get_start_method() if context is not None else torch.multiprocessing.get_start_method()
        layout = BatchLayout.from_schema(self._stream.schema, self._stream.batch_size)
        self._stream.slabs[:] = [Slab(layout, self._slots, anonymous=(method == "fork"), index=i)
                                 for i in range(self.num_workers)]
        for slab in self._stream.slabs:  # named ones: the memory lives on in every mapping
            if method == "fork":
                slab.unlink()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:  # type: ignore[override]
        return self._run_epoch()

    def _run_epoch(self) -> Iterator[dict[str, torch.Tensor]]:
        stream = self._stream
        snapshot = self._snapshot()
        shards = list(snapshot.shards)
        rank, world = 0, 1
        target = None
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            # Ranks snapshot at slightly different moments; all ranks that share a cache plan
            # on the shards every one of them leased, or their plans would disagree. With
            # split="node", each (host, cache path) is its own group with its own plan.
            group_key = (socket.gethostname(), self._cache.path) if self._split == "node" else None
            infos: list[Any] = [None] * world
            dist.all_gather_object(infos, (group_key, [s.seq for s in shards]))
            group = [r for r, (key, _) in enumerate(infos) if key == group_key]
            common = set.intersection(*(set(infos[r][1]) for r in group))
            shards = [s for s in shards if s.seq in common]
            plan_rank, plan_world = group.index(rank), len(group)
            if self._split == "node":
                # Every rank of every node must yield the same batch count: agree on it (an
                # empty group is reported by every rank, so no rank waits in a collective).
                own = plan_epoch([s.records for s in shards], epoch=self.epoch, seed=self._seed,
                                 world_size=plan_world, num_workers=self.num_workers, batch_size=stream.batch_size,
                                 drop_last=stream.drop_last, even_batches=self._even)
                counts: list[Any] = [None] * world
                dist.all_gather_object(counts, own.rank_batches(plan_rank) if shards else -1)
                if min(counts) >= 0 and self._even:
                    target = min(counts) if stream.drop_last else max(counts)
                empty = min(counts) < 0
            else:
                empty = not shards  # every rank sees the same intersection, so every rank raises
            if empty:
                snapshot.close()
                raise EmptyCacheError(
                    f"ranks sharing cache {self._cache.path} leased no shard in common (or a node's cache is empty): "
                    "it turned over completely between their snapshots (each rank takes its own when its epoch "
                    "starts). Raise the capacity so that it holds several shards, or start epochs on all ranks "
                    "together; with node-local caches, wait until every node's cache holds shards."
                )
        else:
            plan_rank, plan_world = 0, 1
        plan = plan_epoch([s.records for s in shards], epoch=self.epoch, seed=self._seed, world_size=plan_world,
                          num_workers=self.num_workers, batch_size=stream.batch_size,
                          drop_last=stream.drop_last, even_batches=self._even, target_batches=target)
        self.last_plan = plan
        if plan.rank_batches(plan_rank) == 0:
            logger.warning(
                "epoch %d yields no batch on rank %d: %d records over %d ranks x %d readers with batch_size=%d%s",
                plan.epoch, rank, sum(s.records for s in shards), plan_world, max(self.num_workers, 1),
                stream.batch_size, " and drop_last=True" if stream.drop_last else "",
            )
        paths = np.array([os.fsencode(s.path) for s in shards], dtype=np.bytes_)
        records = np.array([s.records for s in shards], dtype=np.int64)
        top_up = self._even and (plan_world > 1 or target is not None)
        generation = (stream.generation.value + 1) & 0x7FFFFFFF
        if self.num_workers and not stream.slabs:
            self._make_slabs()
        stream.generation.value = generation
        for worker in range(max(self.num_workers, 1)):
            r = plan.reader(plan_rank, worker)
            share = ReaderShare(paths, records, plan.shards[r], int(plan.quotas[r]) if top_up or plan_world > 1 else -1,
                                plan.cycle[r] if top_up else np.empty(0, np.int64),
                                shuffle_seed=reader_seed(self._seed, plan.epoch, r))
            held = stream.slabs[worker].held_tokens() if self.num_workers else []
            message = _EpochMessage(generation, share, held)
            if self.num_workers:
                stream.channels[worker].put(message)
            else:
                stream.local = message
        self.epoch += 1
        iterator = super().__iter__()
        if self._pending_lease is not None:  # the abandoned epoch's workers were reset by now
            self._pending_lease.close()
            self._pending_lease = None
        finished = False
        try:
            for item in iterator:
                if isinstance(item, SlotHandle):
                    arrays = stream.slabs[item.slab].open(item, copy=self._copy, copy_below=_COPY_BELOW)
                    batch = {n: torch.from_numpy(a) for n, a in arrays.items()}
                elif isinstance(item, dict):
                    batch = item
                elif isinstance(item, Skipped):
                    self.skipped.append(item)
                    continue
                elif isinstance(item, _Failure):
                    raise item.error
                else:
                    raise TypeError(f"unexpected item from a growcache worker: {type(item).__name__}")
                if self._pin:
                    batch = {n: t.pin_memory() for n, t in batch.items()}
                yield batch
            finished = True
        finally:
            if finished or not (self.persistent_workers and self.num_workers):
                del iterator  # non-persistent workers shut down with their iterator
                snapshot.close()
            else:
                # Persistent workers keep reading the abandoned epoch until the next
                # iter() resets them, so its shards stay leased until then.
                self._pending_lease = snapshot


def make_torch_loader(
    cache: Cache | str | os.PathLike,
    batch_size: int,
    *,
    num_workers: int = 2,
    shuffle_buffer: int | None = None,
    seed: int | None = None,
    drop_last: bool = False,
    pin_memory: bool = False,
    persistent_workers: bool | None = None,
    prefetch_factor: int = 2,
    even_batches: bool = True,
    verify: bool = True,
    on_corrupt: str = "raise",
    wait_for_shards: float = 0.0,
    reader: str = "tfrecord",
    copy: bool = False,
    multiprocessing_context: Any = None,
    split: str = "shared",
) -> GrowcacheLoader:
    """A ``DataLoader`` over a growing cache: each ``iter()`` is one epoch on a fresh snapshot.

    Batches are dicts of ``torch.Tensor`` with the schema's dtypes and shapes (a leading
    batch dimension). Each epoch reads every record of its snapshot exactly once, split
    as whole shards over ``rank x worker``; see :mod:`growcache.planning` for DDP.

    Args:
        cache: a :class:`~growcache.Cache` or its directory (which must hold a schema).
        batch_size: records per batch.
        num_workers: DataLoader worker processes; ``0`` reads in the training process.
            Default: ``2``.
        shuffle_buffer: records shuffled together in each reader (see
            :class:`~growcache.batching.BatchReader`): each window of this many records,
            rounded up to whole batches and at least two, is scattered over its batches at
            random, so batches mix neighbouring shards and differ from epoch to epoch. No
            extra copy: each record still goes straight into its slot in shared memory.
            ``0``: batches hold consecutive records of a shard (shards are still shuffled
            per epoch). Default: about 32 MiB of records and at least two batches, at most
            8192 records.
        seed: shard shuffle seed; the same on every rank. Default: ``None`` = ``0``.
        drop_last: drop each reader's last partial batch. Default: ``False``.
        pin_memory: copy every batch to pinned memory (for GPU training). Default: ``False``.
        persistent_workers: keep workers between epochs. Default: ``num_workers > 0``.
        prefetch_factor: batches in flight per worker. Default: ``2``.
        even_batches: every rank yields the same number of batches (top up, or drop with
            ``drop_last``). Default: ``True``.
        verify: check every record's CRC32C. Default: ``True``.
        on_corrupt: ``"raise"`` :class:`~growcache.CorruptShardError` in the training
            process, or ``"skip"`` the shard's remaining records, noted in
            ``loader.skipped``. Default: ``"raise"``.
        wait_for_shards: seconds an epoch waits for a first shard before raising
            :class:`~growcache.EmptyCacheError`. Default: ``0.0``.
        reader: ``"tfrecord"`` (the package's reader for framing) or ``"growcache"``
            (the core's buffered reader). Default: ``"tfrecord"``.
        copy: copy each batch out of shared memory instead of zero-copy views (frees the
            slot at once; costs a memcpy in the training process). Default: ``False``.
        multiprocessing_context: passed to ``DataLoader``. Default: ``None``.
        split: how DDP ranks share records. ``"shared"``: all ranks read one cache (one
            machine, or a shared filesystem) and split its shards, each record once per
            epoch across the world. ``"node"``: each machine has its own cache (its own
            samplers, on local disk); the ranks of one machine split that machine's cache,
            and all ranks still yield the same number of batches. Default: ``"shared"``.

    Raises:
        SchemaError: the cache has no schema.
        ValueError: a bad argument.
    """
    if isinstance(cache, (str, os.PathLike)):
        cache = Cache(cache)
    if cache.schema is None:
        raise SchemaError(f"cache {cache.path} has no schema: open it with Cache(path, schema=...) first")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if shuffle_buffer is None:
        shuffle_buffer = default_shuffle_buffer(cache.schema, batch_size)
    # The workers' reader, built here once so that bad arguments fail at construction.
    probe = BatchReader(cache.schema, batch_size, on_corrupt=on_corrupt, shuffle_buffer=shuffle_buffer)
    if split not in ("shared", "node"):
        raise ValueError(f"split must be 'shared' or 'node', got {split!r}")
    if reader not in _FRAMES:
        raise ValueError(f"reader must be one of {sorted(_FRAMES)}, got {reader!r}")
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    if pin_memory and not torch.cuda.is_available():
        # As DataLoader does: pinning needs an accelerator; without one it is a no-op, not an error.
        warnings.warn("make_torch_loader(pin_memory=True) but no CUDA device is available: batches are not pinned",
                      stacklevel=2)
        pin_memory = False
    context = multiprocessing_context
    if isinstance(context, str):
        context = torch.multiprocessing.get_context(context)
    mp = context if context is not None else torch.multiprocessing
    channels = [mp.Queue() for _ in range(num_workers)]
    generation = mp.Value("q", 0, lock=False)
    stream = _CacheStream(cache.schema, batch_size, drop_last, verify, on_corrupt, reader, [], channels, generation,
                          shuffle_buffer)
    extra: dict[str, Any] = {"prefetch_factor": prefetch_factor} if num_workers else {}
    return GrowcacheLoader(
        cache, stream, seed=0 if seed is None else int(seed), even_batches=even_batches,
        wait_for_shards=float(wait_for_shards), copy=copy, user_pin_memory=pin_memory, split=split,
        # In flight to the trainer, one held by it, and one shuffle window being filled.
        slots=prefetch_factor + 1 + probe.window_batches,
        num_workers=num_workers, persistent_workers=persistent_workers,
        multiprocessing_context=context, **extra,
    )
