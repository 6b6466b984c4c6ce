"""PyTorch adapter: ``make_torch_loader`` turns a growing cache into a ``DataLoader``.

The epoch is the core's :class:`growcache.epoch.Epochs`; the trip of its shares to the workers
and of their batches back through shared-memory slabs is :class:`growcache.worker_feed.WorkerFeed`.
This module wires them into DataLoader terms, and wraps each slot's arrays in tensors without a
copy (``torch.from_numpy``). Ranks agree on each epoch through ``all_gather_object``.
"""

from __future__ import annotations

import inspect
import itertools
import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

from growcache.adapters.cuda import EXTRA_SLOTS, CudaDelivery, SlotBatch, delivery_for
from growcache.adapters.tfrecord_frames import tfrecord_frames
from growcache.batching import growcache_frames
from growcache.cache import Cache
from growcache.epoch import Epoch, EpochOptions, Epochs, reader_cache
from growcache.errors import ForeignLoaderError
from growcache.metrics import InputMeter, MeteredLoader
from growcache.readers import ReaderSpec
from growcache.resume import (DEFAULT_RESUME_TTL, ResumableLoader, end_epochs, end_when_dropped, keep_pin,
                              release_kept_pins)
from growcache.transport import COPY_BELOW, SlotHandle
from growcache.worker_feed import Unslotted, WorkerFeed

__all__ = ["make_torch_loader", "tfrecord_frames"]

_REFUSED = {
    "shuffle": "shards are reshuffled every epoch by (seed, epoch) and records within each reader's shuffle_buffer: "
               "pass shuffle_buffer=RECORDS (0 turns the record shuffle off)",
    "sampler": "the loader plans each epoch itself (whole shards per rank and worker)",
    "batch_sampler": "batches are formed in the workers: pass batch_size",
    "collate_fn": "batches are formed in the workers from the cache's schema",
}


_FRAMES = {"tfrecord": tfrecord_frames, "growcache": growcache_frames}


def _to_transport(item: Any) -> Any:
    # collate_fn, in the worker: a batch of numpy arrays (no free slot) moves into torch's shared memory
    # here, not in the result queue's feeder thread, where a full /dev/shm lost the batch (a printed
    # ENOSPC) and the trainer waited for it for good. Without room it goes pickled, as numpy.
    if isinstance(item, Unslotted):
        try:
            return item._replace(arrays={k: torch.from_numpy(v).share_memory_() for k, v in item.arrays.items()})
        except RuntimeError:
            return item
    if isinstance(item, dict):  # read in the training process, or an unslotted batch that came pickled
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in item.items()}
    return item


class _CacheStream(IterableDataset):
    """The dataset every worker iterates: one epoch share per ``__iter__``."""

    def __init__(self, spec: ReaderSpec, reader: str, feed: WorkerFeed) -> None:
        self.spec = spec
        self.reader = reader
        self.feed = feed

    def set_epoch(self, epoch: int) -> None:
        """Called only by wrappers that rebuilt the DataLoader around this dataset (Accelerate, at
        every ``iter()``): :class:`~growcache.ForeignLoaderError` names the fix at once."""
        raise ForeignLoaderError()

    def __iter__(self) -> Iterator[Any]:
        # The epoch is fixed here, when DataLoader asks for the iterator, not when the first
        # batch is pulled: a persistent worker may pull a leftover request of an abandoned
        # epoch after the next epoch was announced, and that stale pull must not take the
        # next epoch's plan (the real next epoch would then wait for a plan that never comes).
        info = get_worker_info()
        return self.feed.read(None if info is None else info.id, self.feed.generation,
                              self.spec.build(_FRAMES[self.reader]))


class _EpochSampler(Sampler):
    """See :attr:`GrowcacheLoader.sampler`."""

    def __init__(self, loader: GrowcacheLoader) -> None:
        self._loader = weakref.ref(loader)

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)

    def set_epoch(self, epoch: int) -> None:
        loader = self._loader()
        if loader is not None:
            loader.set_epoch(epoch)


def _world() -> tuple[int, int] | None:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else None


def _all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


class GrowcacheLoader(ResumableLoader, MeteredLoader, DataLoader):
    """A ``DataLoader`` whose every ``iter()`` is one epoch on a fresh cache snapshot.

    Build it with :func:`make_torch_loader`. Its ``epochs``, ``last_epoch`` (set by each
    ``iter()``), ``epoch``, ``set_epoch``, ``state_dict``/``load_state_dict``, ``skipped`` and
    ``last_plan`` are the core's :class:`~growcache.resume.ResumableLoader`; ``stats()``, the core's
    :class:`~growcache.metrics.MeteredLoader`.
    """

    def __init__(self, epochs: Epochs, stream: _CacheStream, *, copy: bool, slots: int,
                 delivery: CudaDelivery | None = None, resume_ttl: float = DEFAULT_RESUME_TTL,
                 **kwargs: Any) -> None:
        self._epoch_sampler = _EpochSampler(self)
        super().__init__(stream, batch_size=None, collate_fn=_to_transport, **kwargs)
        self.epochs = epochs
        self._stream = stream
        self._copy = copy
        self._delivery = delivery  # device= or pin_memory=True: adapters/cuda.py
        self._slots = slots
        self.resume_ttl = resume_ttl
        self._prefetch_factor = self.prefetch_factor
        self._closed = False
        self._delivering: Any = lambda: None  # a weak reference to the epoch handed out last
        self._meter = InputMeter(epochs, gather=lambda figures: _all_gather(figures) if _world() else [figures])
        end_when_dropped(self, epochs)
        if delivery is not None:
            delivery.bind(self)
        # What users and trainers read is what the loader does (DataLoader itself forms no batches, and
        # pins none: the delivery does). DataLoader refuses these two sets after __init__, as usual.
        object.__setattr__(self, "batch_size", epochs.options.batch_size)
        object.__setattr__(self, "drop_last", epochs.options.drop_last)
        self.pin_memory = delivery is not None and delivery.pin

    def _get_iterator(self) -> Any:
        # DataLoader would pin every batch once more in a thread of its own: the delivery pinned its slab.
        self.__dict__["pin_memory"] = False
        try:
            return super()._get_iterator()
        finally:
            self.__dict__["pin_memory"] = self._delivery is not None and self._delivery.pin

    @property
    def registered_bytes(self) -> int:
        """Slab bytes page-locked for CUDA now (``device=`` or ``pin_memory=True``; else ``0``)."""
        return self._delivery.registered_bytes if self._delivery is not None else 0

    def close(self) -> None:
        """Wait for every copy from a slab, unregister the slabs, stop the workers, end the
        epoch and remove the slabs' names. Idempotent; garbage collection does the same. The pin of
        an epoch left unfinished stays until its ``resume_ttl`` expiry, for a resume from its state."""
        if self._closed:
            return
        self._closed = True
        if (delivering := self._delivering()) is not None:
            delivering.close()  # non-persistent workers stop with their epoch's iterator, not at its collection
        if self._delivery is not None:
            self._delivery.close()
        if self._iterator is not None:  # persistent workers
            self._iterator._shutdown_workers()
            self._iterator = None
        end_epochs(self.epochs, self.last_epoch)  # its pin kept, if unfinished: a state saved in it may be resumed
        self._stream.feed.close()

    def __enter__(self) -> GrowcacheLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def sampler(self) -> Sampler:
        """DataLoader's endless stand-in sampler of an iterable dataset, with ``set_epoch``: trainers
        (Lightning) set the epoch on a loader's sampler, and this one passes it to the loader."""
        return self._epoch_sampler

    @sampler.setter
    def sampler(self, _value: Any) -> None:
        pass  # DataLoader.__init__ sets its own stand-in; ours replaces it

    def __len__(self) -> int:
        # No length, even during an epoch: trainers read a loader's length once and stop every
        # later epoch there (Lightning, as Keras does), and this cache grows between epochs.
        raise TypeError(
            "a growcache loader has no len(): the cache grows, so every epoch has its own length, known once "
            "iter(loader) plans it: loader.last_epoch.batches(). Trainers read this TypeError as an unknown length "
            "(Lightning then never cuts a grown epoch short)")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:  # type: ignore[override]
        if self._closed:
            raise RuntimeError("this growcache loader was closed: build a new one with make_torch_loader")
        context = self.multiprocessing_context
        method = context.get_start_method() if context is not None else torch.multiprocessing.get_start_method()
        previous = self._delivering()  # the epoch handed out last, if it lives
        if previous is not None and not (self.persistent_workers and self.num_workers):
            previous.close()  # held by `it = iter(loader)`: its workers stop before new ones reclaim the slabs
        began = self._meter.clock()
        # super().__iter__() starts the workers, or resets persistent ones (the feed ends the
        # abandoned epoch they may still have read only then).
        self.last_epoch, iterator = self._stream.feed.start_epoch(
            self.epochs, self._start_workers, slots=self._slots, start_method=method,
            registered=self._delivery is not None)
        release_kept_pins(self.last_epoch)  # the run went on: states of its earlier epochs are stale
        self._meter.begin(self.last_epoch, began)
        self._delivering = weakref.ref(delivering := self._deliver(self.last_epoch, iterator))
        return delivering

    def _start_workers(self) -> Any:
        # torch resets persistent workers, dead ones too: one killed worker (SIGKILL, the OOM killer)
        # would fail this epoch and every later one. Fresh workers read it instead.
        if self._iterator is not None and not all(w.is_alive() for w in self._iterator._workers):
            self._iterator._shutdown_workers()
            self._iterator = None
        # Slabs cut short by a small /dev/shm: prefetch only what their slots hold, rather than
        # send the rest through torch's own shared memory, in the same full /dev/shm.
        short = self._slots - self._stream.feed.slots
        if self.num_workers and self._stream.feed.slots and short > 0:
            self.prefetch_factor = max(1, self._prefetch_factor - short)
        return super().__iter__()

    def _deliver(self, epoch: Epoch, iterator: Iterator[Any]) -> Iterator[dict[str, torch.Tensor]]:
        finished = failed = False
        batches = self._host_batches(iterator)
        # What state_dict() counts: handed to the loop, not prefetched; taken round-robin (in_order),
        # the count also lets the epoch's lease go of shards read.
        round_robin = getattr(self, "in_order", True)
        try:
            for batch in self._meter.timed(batches if self._delivery is None else self._delivery.batches(batches),
                                           epoch):
                epoch.consume(round_robin=round_robin, reader=self._stream.feed.handed_over())
                yield batch
            finished = True
        except BaseException as exc:
            failed = not isinstance(exc, GeneratorExit)
            raise
        finally:
            batches = None  # with its generators goes their reference to `iterator`
            if failed and self._iterator is not None:  # no loop reads on in a failed epoch: its persistent workers
                self._iterator._shutdown_workers()  # stop, and it ends now with its lease (else held until a GC)
                self._iterator = None
            if finished or failed or not (self.persistent_workers and self.num_workers):
                del iterator  # non-persistent workers shut down with their iterator
                if not finished:
                    keep_pin(epoch)  # a state saved in it may be resumed
                epoch.end()
            # Otherwise persistent workers read on until the next iter() resets them; it ends the epoch.

    def _host_batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        # CPU batches; or, for a delivery, slot batches left unopened (it opens them its way).
        slabs = self._stream.feed.slabs
        for item in self._stream.feed.received(iterator, self.epochs):
            if not isinstance(item, SlotHandle):
                yield _to_transport(item)
            elif self._delivery is not None:
                yield SlotBatch(slabs[item.slab], item)
            else:
                arrays = slabs[item.slab].open(item, copy=self._copy, copy_below=COPY_BELOW)
                yield {n: torch.from_numpy(a) for n, a in arrays.items()}


def make_torch_loader(
    cache: Cache | str | os.PathLike,
    batch_size: int,
    *,
    num_workers: int = 2,
    shuffle_buffer: int | None = None,
    seed: int = 0,
    drop_last: bool = False,
    pin_memory: bool = False,
    device: Any = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int = 2,
    even_batches: bool = True,
    verify: bool = True,
    on_corrupt: str = "raise",
    wait_for_shards: float = 0.0,
    reader: str = "growcache",
    copy: bool = False,
    multiprocessing_context: Any = None,
    split: str = "shared",
    run_id: str | None = None,
    worker_init_fn: Any = None,
    timeout: float = 0,
    generator: torch.Generator | None = None,
    pin_memory_device: str = "",
    in_order: bool = True,
    resume_ttl: float = DEFAULT_RESUME_TTL,
    **refused: Any,
) -> GrowcacheLoader:
    """A ``DataLoader`` over a growing cache: each ``iter()`` is one epoch on a fresh snapshot.

    Batches are dicts of ``torch.Tensor`` with the schema's dtypes and shapes (a leading
    batch dimension). Each epoch reads every record of its snapshot exactly once, split
    as whole shards over ``rank x worker``; see :mod:`growcache.epoch` for DDP.

    Args:
        cache: a :class:`~growcache.Cache` or its directory (which must hold a schema; one not
            there yet is waited for up to ``wait_for_shards``, never created).
        batch_size: records per batch.
        num_workers: DataLoader worker processes; ``0`` reads in the training process.
            Default: ``2``.
        pin_memory: page-locked batches for your own ``.to(device, non_blocking=True)``
            (features above 256 KiB per batch are views of a CUDA-registered slab, reused only
            once the copies you enqueued on the current stream before dropping the batch are
            done). Without CUDA it warns and is ignored. Default: ``False``.
        device: ``"cuda"`` (each epoch's current device), ``"cuda:N"``, an index or a ``torch.device``:
            batches arrive on that GPU, copied from registered slabs on a side stream one
            batch ahead; ``pin_memory`` and ``copy`` then do nothing. Default: ``None`` (CPU).
        persistent_workers: keep workers between epochs. Default: ``num_workers > 0``.
        prefetch_factor: batches in flight per worker. Default: ``2``.
        reader: ``"growcache"``: the core's :class:`~growcache.vector_reader.VectorReader`
            (fixed-layout shards a piece at a time, others record by record). ``"tfrecord"``:
            the ``tfrecord`` package frames each record. Default: ``"growcache"``.
        copy: copy each batch out of shared memory (a memcpy in the training process) instead
            of zero-copy views. Default: ``False``.
        multiprocessing_context: passed to ``DataLoader``. Default: ``None``.
        worker_init_fn, timeout, generator, pin_memory_device, in_order: as in ``DataLoader``
            (``generator`` seeds the workers' torch RNG; growcache's order comes from ``seed``;
            ``in_order`` needs torch 2.6 or later). Defaults: ``DataLoader``'s.
        resume_ttl: seconds each epoch's snapshot stays pinned in the cache from the epoch's
            first ``loader.state_dict()``, so that ``loader.load_state_dict(state)`` after a kill
            finds it (the epoch's end releases the pin earlier); ``0`` pins nothing. See
            :mod:`growcache.resume`.
            Default: ``43200`` (12 hours).

    The epoch arguments (``shuffle_buffer``, ``seed``, ``drop_last``, ``even_batches``,
    ``verify``, ``on_corrupt`` into ``loader.skipped``, ``wait_for_shards``, ``split``,
    ``run_id``) mean what they mean in ``make_tf_dataset``, with the same defaults: see
    :class:`growcache.epoch.EpochOptions`, in the API reference too.

    Raises:
        SchemaError: the cache has no schema.
        EmptyCacheError: no cache at the path after ``wait_for_shards``.
        DeviceError: ``device`` names CUDA, or a CUDA device, that this process cannot use.
        TypeError: a ``DataLoader`` argument the loader sets itself (``shuffle``,
            ``sampler``, ``batch_sampler``, ``collate_fn``), with what to use instead; or
            ``in_order=False`` on a torch without it.
        ValueError: a bad argument.
    """
    for name in refused:
        hint = _REFUSED.get(name, "it is not an argument of make_torch_loader")
        raise TypeError(f"make_torch_loader() got {name}=: {hint}")
    options = EpochOptions(batch_size, seed=seed, shuffle_buffer=shuffle_buffer, drop_last=drop_last,
                           even_batches=even_batches, verify=verify, on_corrupt=on_corrupt,
                           wait_for_shards=wait_for_shards, split=split, run_id=run_id)
    cache = reader_cache(cache, options.wait_for_shards)
    if reader not in _FRAMES:
        raise ValueError(f"reader must be one of {sorted(_FRAMES)}, got {reader!r}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if isinstance(resume_ttl, bool) or not isinstance(resume_ttl, (int, float)) or not 0 <= resume_ttl <= 10**9:
        raise ValueError(f"resume_ttl must be seconds >= 0, got {resume_ttl!r}")
    passed = {"worker_init_fn": worker_init_fn, "timeout": timeout, "generator": generator,
              "pin_memory_device": pin_memory_device, "in_order": in_order}
    if "in_order" not in inspect.signature(DataLoader.__init__).parameters:
        if not in_order:
            raise TypeError(f"in_order=False needs torch 2.6 or later (this is torch {torch.__version__})")
        del passed["in_order"]
    epochs = Epochs(cache, options, readers=max(num_workers, 1), world=_world, all_gather=_all_gather,
                    holder=f"torch loader pid {os.getpid()}")
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    delivery = delivery_for(device, pin_memory, copy)
    context = multiprocessing_context
    if isinstance(context, str):
        context = torch.multiprocessing.get_context(context)
    mp = context if context is not None else torch.multiprocessing
    stream = _CacheStream(epochs.reader, reader, WorkerFeed(mp, num_workers))
    extra: dict[str, Any] = {"prefetch_factor": prefetch_factor} if num_workers else {}
    return GrowcacheLoader(
        epochs, stream, copy=copy, delivery=delivery, resume_ttl=float(resume_ttl),
        # In flight to the trainer, one held by it, and one shuffle window being filled.
        slots=prefetch_factor + 1 + epochs.reader.window_batches + (EXTRA_SLOTS if delivery else 0),
        num_workers=num_workers, persistent_workers=persistent_workers,
        multiprocessing_context=context, **passed, **extra,
    )
