"""CUDA delivery for ``make_torch_loader``: slabs registered once, batches moved by DMA.

The slabs are shared memory that lives for the whole run, so the training process registers
each one with CUDA once (``cudaHostRegister``, through ``torch.cuda.cudart()``) when it first
meets a batch of it. From then on a slot's bytes are page-locked: the GPU's copy engine
reads them directly, and the training process does no per-batch copy.

* ``device=`` (:meth:`CudaDelivery.device_batches`): each batch is copied with
  ``non_blocking=True`` on a side stream into tensors from torch's caching allocator, one
  batch ahead, so the copy of batch k+1 overlaps the work on batch k. The consumer's current
  stream waits for the copy's event, and every tensor is ``record_stream``-ed on it, so the
  allocator never reuses its memory under the consumer's kernels. The slot goes back to its
  worker only when that event has completed (:func:`growcache.device_release.deliver`).
* ``pin_memory=True`` (:meth:`CudaDelivery.pinned_batches`): the batch's large features are
  zero-copy views of the registered slot, so ``is_pinned()`` is true and the consumer's own
  ``.to(device, non_blocking=True)`` is a DMA. The loader cannot see those copies: a slot is
  freed only after the consumer dropped every view of it *and* an event recorded later on
  the current stream of every device with a context has completed (:meth:`ReleaseQueue.guard`
  and ``fence``).

Tensors that are not in a registered slot reach the device through pinned staging memory
from torch's caching host allocator, which tracks its own blocks against the copies that read
them: small features under ``pin_memory=True`` (users keep labels and ids, and a kept view
would hold a slot), every batch with ``num_workers=0`` or when a worker could not get a slot,
and every batch of a slab whose registration failed.
"""

from __future__ import annotations

import logging
import os
import resource
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from growcache.device_release import InFlight, ReleaseQueue, deliver
from growcache.errors import DeviceError
from growcache.transport import COPY_BELOW, Slab, SlotHandle

__all__ = ["EXTRA_SLOTS", "CudaDelivery", "SlotBatch", "delivery_for", "resolve_device"]

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable: the memory is page-locked for every CUDA context, so a process
# that uses several devices can copy a slab to any of them.
_REGISTER_PORTABLE = 1
#: Slots each slab needs beyond the CPU path's: with ``device=``, one batch's copy is in
#: flight ahead of the consumer and one waits for its event; with ``pin_memory=True``, one
#: dropped batch waits for the next fence and one for that fence's event.
EXTRA_SLOTS = 2
_WARNED: set[str] = set()


class SlotBatch(NamedTuple):
    """A batch still in its slot: what the loader hands :class:`CudaDelivery`."""

    slab: Slab
    handle: SlotHandle


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of torch"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES is unset"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU or driver ({shown}); "
            "check nvidia-smi and the container's GPU access")


def resolve_device(device: Any) -> torch.device | None:
    """The CUDA device that ``device`` names, or ``None`` for batches left on the CPU.

    Args:
        device: ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an index ``N`` or a ``torch.device``.
            ``"cuda"`` without an index stays unresolved here: it means the current device
            of each epoch (each rank's own under DDP).

    Raises:
        ValueError: ``device`` is not a device, or not a CUDA or CPU one.
        DeviceError: CUDA, or that device, is not available to this process.
    """
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"  # a LOCAL_RANK: torch reads an int as an accelerator, which fails without one
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"make_torch_loader(device={device!r}): not a device ({exc}); pass 'cuda', 'cuda:N', "
                         "a torch.device, or None for CPU batches") from None
    if dev.type == "cpu":
        return None  # batches are CPU tensors already: `device = "cuda" if ... else "cpu"` just works
    if dev.type != "cuda":
        raise ValueError(f"make_torch_loader(device={device!r}): growcache moves batches to CUDA devices only; "
                         f"pass device=None and move each batch yourself (batch[k].to({str(dev)!r}))")
    if not torch.cuda.is_available():
        raise DeviceError(f"make_torch_loader(device={device!r}) but CUDA is not available: {_no_cuda_reason()}. "
                          "Pass device=None for CPU batches.")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise DeviceError(f"make_torch_loader(device={device!r}) but this process sees {count} CUDA device(s), "
                          f"cuda:0 to cuda:{count - 1} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return dev


def delivery_for(device: Any, pin_memory: bool, copy: bool) -> CudaDelivery | None:
    """The delivery ``make_torch_loader(device=, pin_memory=, copy=)`` asks for; ``None``: plain
    CPU batches.

    Raises:
        ValueError, DeviceError: as :func:`resolve_device`.
    """
    target = resolve_device(device)
    if target is None:
        if not pin_memory:
            return None
        if not torch.cuda.is_available():
            # As DataLoader does: pinning needs an accelerator; without one it is a no-op, not an error.
            warnings.warn("make_torch_loader(pin_memory=True) but no CUDA device is available: batches are not "
                          "pinned", stacklevel=3)
            return None
    return CudaDelivery(target, pin=target is None, copy=copy, copy_below=COPY_BELOW)


def _memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"


def _take_stale_error(device: torch.device) -> None:
    # A failed runtime call stays the thread's "last error", and torch reads the last error
    # after its next kernel launch: an unrelated operation would fail with it. One tiny
    # kernel takes it out here (torch clears it as it raises).
    try:
        torch.ones(1, device=device)
    except RuntimeError:
        pass


class _Registry:
    """Slabs registered with CUDA, each once, until :meth:`close`.

    A slab is held here while registered: its memory must not be unmapped before it is
    unregistered.
    """

    def __init__(self) -> None:
        self._registered: dict[int, tuple[Slab, int, int]] = {}  # id -> (slab, address, bytes)
        self._failed: dict[int, Slab] = {}
        self.closed = False

    @property
    def registered_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self._registered.values())

    def pinned(self, slab: Slab, device: torch.device) -> bool:
        """Register ``slab``'s slots once; whether they are page-locked now."""
        key = id(slab)
        if key in self._registered:
            return True
        if key in self._failed or self.closed:
            return False
        address = slab.slot_bytes(0).ctypes.data
        nbytes = slab.slots * slab.layout.slot_nbytes
        started = time.perf_counter()
        with torch.cuda.device(device):
            cudart = torch.cuda.cudart()
            error = cudart.cudaHostRegister(address, nbytes, _REGISTER_PORTABLE)
        if int(error) != 0:
            self._failed[key] = slab
            _take_stale_error(device)
            _warn_once("register", (
                f"growcache could not register a {nbytes / 2**20:.1f} MiB slab with CUDA (cudaHostRegister failed: "
                f"{cudart.cudaGetErrorString(error)}; the locked-memory limit, ulimit -l, is {_memlock_limit()}). "
                "Batches of it are staged through pinned memory in the training process instead: correct, at the "
                "cost of one memcpy per batch. In a container, raise the limit (docker run --ulimit memlock=-1) "
                "or lower prefetch_factor / batch_size to register less."))
            return False
        self._registered[key] = (slab, address, nbytes)
        logger.info("registered slab %d with CUDA: %d slots x %.1f MiB = %.1f MiB in %.1f ms", slab.index, slab.slots,
                    slab.layout.slot_nbytes / 2**20, nbytes / 2**20, (time.perf_counter() - started) * 1e3)
        return True

    def close(self) -> None:
        """Unregister every slab. Every copy that reads one must have completed."""
        self.closed = True
        registered, self._registered = self._registered, {}
        self._failed = {}
        for slab, address, _ in registered.values():
            error = torch.cuda.cudart().cudaHostUnregister(address)
            if int(error) != 0:
                logger.warning("cudaHostUnregister of slab %d failed: %s", slab.index,
                               torch.cuda.cudart().cudaGetErrorString(error))


class _SideStreamCopies:
    """:class:`~growcache.device_release.CopyEngine` onto one device, on a side stream."""

    def __init__(self, device: torch.device, registry: _Registry) -> None:
        self.device = device
        self.registry = registry
        self.stream = torch.cuda.Stream(device)

    def start(self, host: SlotBatch | dict[str, torch.Tensor]) -> InFlight:
        keep = None
        if isinstance(host, SlotBatch) and self.registry.pinned(host.slab, self.device):
            keep = host.slab.open(host.handle)  # views of the registered slot: the DMA reads them
            sources = {k: torch.from_numpy(v) for k, v in keep.items()}
        else:
            sources = _staged(host)
        with torch.cuda.stream(self.stream):  # allocations and copies belong to the side stream
            batch = {k: t.to(self.device, non_blocking=True) for k, t in sources.items()}
            event = torch.cuda.Event(blocking=True)  # a wait on it sleeps instead of spinning
            event.record(self.stream)
        return InFlight(batch, event, keep)

    def hand_over(self, flight: InFlight) -> dict[str, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(flight.event)  # this batch's copy only, not the next one's behind it
        for tensor in flight.batch.values():
            # Allocated on the side stream: without this the allocator could hand the memory
            # to the next copy while the consumer's kernels still read it.
            tensor.record_stream(current)
        return flight.batch


def _pinned_copy(source: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A copy of ``source`` in pinned memory of torch's caching host allocator.

    Not ``Tensor.pin_memory()``: that returns the tensor itself when its memory is already
    page-locked, as a registered slot is, and the "copy" would still be the slot.
    """
    tensor = torch.from_numpy(source) if isinstance(source, np.ndarray) else source
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


def _staged(host: SlotBatch | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``host`` copied into pinned staging memory (its slot, if any, is free again when this
    returns: the copy is synchronous). torch's host allocator records the copies that read
    its blocks, and reuses none before they complete."""
    if isinstance(host, SlotBatch):
        return {k: _pinned_copy(v) for k, v in host.slab.open(host.handle).items()}
    return {k: _pinned_copy(t) for k, t in host.items()}


class _Closer:
    """What a finalizer may call: no reference back to the delivery or its loader."""

    def __init__(self, release: ReleaseQueue, registry: _Registry, pin: bool) -> None:
        self.release = release
        self.registry = registry
        self.pin = pin

    def __call__(self) -> None:
        if self.registry.closed:
            return
        try:
            if self.pin and torch.cuda.is_initialized():
                # A consumer's own copies from pinned views, of batches let go or still held:
                # everything enqueued on a current stream so far completes first.
                self.release.drain(_record_on_current)
                _record_on_current().synchronize()
            self.release.drain()
            self.registry.close()
            # Only now: from here on a batch let go is freed at once, as no copy from it can
            # be in flight (closed before that sync, a view dropped in between freed its slot
            # while the copy from it still ran).
            self.release.close()
        except Exception as exc:  # noqa: BLE001 - interpreter shutdown may have taken CUDA down first
            logger.debug("growcache CUDA delivery close: %s", exc)


class _AllOf(tuple):
    """Completion events taken as one: complete when every one of them is."""

    def query(self) -> bool:
        return all(event.query() for event in self)

    def synchronize(self) -> None:
        for event in self:
            event.synchronize()


def _record_on_current() -> _AllOf:
    """An event on the current stream of every device this process has a CUDA context on.

    ``x.to("cuda:N", non_blocking=True)`` enqueues on device N's current stream, whichever
    device is current (a DDP rank that never called ``torch.cuda.set_device``, a job on
    ``cuda:1``): an event on the current device's stream alone would not order that copy.
    """
    current = torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", lambda index: False)  # creates none
    events = []
    for index in range(torch.cuda.device_count()):
        if index == current or has_context(index):
            event = torch.cuda.Event(blocking=True)
            event.record(torch.cuda.current_stream(index))
            events.append(event)
    return _AllOf(events)


class CudaDelivery:
    """Moves batches of one loader from its slabs to a CUDA device, or hands out pinned views.

    One per loader, in the training process. :meth:`close` (or garbage collection of the
    owner passed to :meth:`bind`) waits for every copy and unregisters every slab.

    Args:
        device: from :func:`resolve_device`, or ``None`` with ``pin=True``.
        pin: hand out pinned CPU batches instead of device batches.
        copy: with ``pin``, copy every feature into pinned memory and free the slot at once.
        copy_below: with ``pin``, features of at most this many bytes per batch are copied
            into pinned memory rather than viewed in the slot.
    """

    def __init__(self, device: torch.device | None, *, pin: bool = False, copy: bool = False,
                 copy_below: int = 0) -> None:
        if device is None and not pin:
            raise ValueError("CudaDelivery needs a device, or pin=True")
        self.device = device
        self.pin = pin
        self.copy = copy
        self.copy_below = copy_below
        self.registry = _Registry()
        self.release = ReleaseQueue()
        self._engines: dict[torch.device, _SideStreamCopies] = {}
        self._closer = _Closer(self.release, self.registry, pin)

    @property
    def registered_bytes(self) -> int:
        """Bytes of slab memory page-locked for CUDA now: slabs x slots x slot bytes."""
        return self.registry.registered_bytes

    def bind(self, owner: Any) -> None:
        """Close when ``owner`` (the loader) is garbage collected, if not closed before."""
        weakref.finalize(owner, self._closer)

    def close(self) -> None:
        """Wait for every copy from a slab, then unregister every slab. Idempotent."""
        self._closer()

    def epoch_device(self) -> torch.device:
        """The device of the epoch starting now: ``"cuda"`` is the current device."""
        if self.device is None:
            raise ValueError("this delivery hands out pinned CPU batches; it has no device")
        if self.device.index is not None:
            return self.device
        return torch.device("cuda", torch.cuda.current_device())

    def batches(self, host_batches: Iterable[SlotBatch | dict[str, torch.Tensor]]
                ) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch: device batches, or pinned CPU batches with ``pin=True``."""
        return self.pinned_batches(host_batches) if self.device is None else self.device_batches(host_batches)

    def device_batches(self, host_batches: Iterable[SlotBatch | dict[str, torch.Tensor]]
                       ) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch of batches on the device, each ordered on the consumer's current stream."""
        device = self.epoch_device()
        engine = self._engines.get(device)
        if engine is None:
            engine = self._engines[device] = _SideStreamCopies(device, self.registry)
        return deliver(host_batches, engine, self.release)

    def pinned_batches(self, host_batches: Iterable[SlotBatch | dict[str, torch.Tensor]]
                       ) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch of pinned CPU batches for the consumer's own ``non_blocking`` copies.

        Contract: a copy from a batch must be enqueued on a stream that is current (for its
        device) when the next batch is requested (or on one that stream has waited on) before
        the batch is dropped. The slot is freed once the batch is dropped and an event recorded
        on the current stream of every device with a context, at a later request (or at
        close), has completed.
        """
        device = torch.device("cuda", torch.cuda.current_device())
        for host in host_batches:
            self.release.fence(_record_on_current)
            self.release.poll()
            yield self._pinned(host, device)
            del host

    def _pinned(self, host: SlotBatch | dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        if not isinstance(host, SlotBatch) or not self.registry.pinned(host.slab, device):
            return _staged(host)
        views = host.slab.open(host.handle)
        small = {k for k, v in views.items() if self.copy or v.nbytes <= self.copy_below}
        out: dict[str, Any] = {}
        for name in small:
            # Straight into pinned memory: one copy, as copy_below costs on the CPU path.
            out[name] = _pinned_copy(views[name])
        if len(small) < len(views):
            guarded = self.release.guard({k: v for k, v in views.items() if k not in small}, views)
            out.update((k, torch.from_numpy(v)) for k, v in guarded.items())
        return {k: out[k] for k in views}
