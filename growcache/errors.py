"""Error classes of growcache.

Every class subclasses a builtin, so callers can keep catching ``ValueError``,
``OSError`` or ``RuntimeError`` as they do for other libraries. Messages name the
file, the byte offset or the feature at fault, and say how to fix the problem.
"""

from __future__ import annotations

__all__ = [
    "CacheFormatError",
    "CacheFullError",
    "CompressedFileError",
    "CorruptShardError",
    "DeviceError",
    "EmptyCacheError",
    "EpochSyncError",
    "ForeignLoaderError",
    "GrowcacheError",
    "MissingExtraError",
    "MissingShardsError",
    "RefusedFileError",
    "SamplerError",
    "SchemaError",
    "SchemaMismatchError",
    "SharedMemoryFullError",
    "SourceError",
    "TransientSourceError",
]


class GrowcacheError(Exception):
    """Base class of every error growcache raises on purpose."""


class SchemaError(GrowcacheError, ValueError):
    """A schema is malformed, or a sample does not match it (feature, expected, actual)."""


class SchemaMismatchError(SchemaError):
    """A cache was reopened, or a shard added, with a schema that differs from the stored one."""


class SharedMemoryFullError(GrowcacheError, OSError):
    """``/dev/shm`` has no room for one batch per ``spawn``/``forkserver`` reader (``ENOSPC``).

    The message names ``/dev/shm``'s size, its free space, the bytes needed and the fixes: more
    shared memory for the container, smaller batches, fewer workers, fork workers.
    """


class CorruptShardError(GrowcacheError, ValueError):
    """A shard failed a CRC32C check or ended mid-record (or vanished while an epoch read it).

    Attributes:
        path: the shard file.
        offset: byte offset of the record that failed.
        reason: what was wrong at that offset.
    """

    _FIX = ("The shard cannot be trusted: run `growcache verify --remove-corrupt CACHE_DIR` "
            "to drop it (other shards are untouched), or read with on_corrupt='skip'.")

    def __init__(self, path: str, offset: int, reason: str, fix: str | None = None) -> None:
        self.path = str(path)
        self.offset = int(offset)
        self.reason = reason
        self._fix = fix
        super().__init__(f"corrupt shard {self.path} at byte offset {self.offset}: {reason}. {fix or self._FIX}")

    def __reduce__(self):  # keep (path, offset, reason, fix) across process boundaries
        return (type(self), (self.path, self.offset, self.reason, self._fix))


class CacheFormatError(GrowcacheError, ValueError):
    """A cache directory's metadata is missing, unreadable or from a newer format version."""


class CacheFullError(GrowcacheError, RuntimeError):
    """A shard cannot fit in the byte budget: it is larger than the budget, or leases pin the rest."""


class EmptyCacheError(GrowcacheError, RuntimeError):
    """An epoch was requested from a cache that holds no published shard."""


class MissingExtraError(GrowcacheError, ImportError):
    """An optional dependency (a framework or a filesystem) is not installed."""


class SourceError(GrowcacheError, OSError):
    """A remote store failed permanently (no such bucket, access denied, empty glob)."""


class TransientSourceError(SourceError):
    """A remote store kept failing with retryable errors after every retry."""


class SamplerError(GrowcacheError, RuntimeError):
    """A sampler worker failed; the message carries the worker's traceback."""


class RefusedFileError(GrowcacheError, ValueError):
    """A file cannot be taken into a cache: it is not a regular file (a directory, a device,
    a FIFO or a socket), or it is a shard that a lease still holds, or one of this cache."""


class DeviceError(GrowcacheError, RuntimeError):
    """A device that was asked for cannot be used: no CUDA in this torch build or on this
    machine, or no device with that index."""


class CompressedFileError(GrowcacheError, ValueError):
    """A GZIP- or ZLIB-compressed TFRecord file was given where a cache needs a plain one
    (``growcache import`` decompresses it)."""


class MissingShardsError(GrowcacheError, ValueError):
    """A resume state names shards that are gone from the cache (another machine's cache, a wiped
    disk, an expired pin). ``names`` and ``records`` say what; ``on_missing="skip"`` goes on without them."""

    def __init__(self, message: str, names: tuple[str, ...] = (), records: int = 0) -> None:
        super().__init__(message)
        self.names = names
        self.records = records

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (str(self), self.names, self.records))


class EpochSyncError(GrowcacheError, RuntimeError):
    """The ranks of a group could not agree on an epoch: the first rank's epoch did not arrive
    in time, or a shard it leased is gone."""


class ForeignLoaderError(GrowcacheError, RuntimeError):
    """growcache's dataset is read by a ``DataLoader`` that ``make_torch_loader`` did not build.

    Accelerate's ``prepare(..., loader)``, and wrappers like it, rebuild one around
    ``loader.dataset``, so no epoch was started for it. Without a message, says how to fix it.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(message or (
            "growcache's dataset is being read by a DataLoader that make_torch_loader did not build, so no epoch "
            "was started for it: Accelerate's accelerator.prepare(..., loader), and wrappers like it, rebuild the "
            "loader around loader.dataset. Pass only the model and optimizer: `model, optimizer = "
            "accelerator.prepare(model, optimizer)`, and iterate growcache's loader itself; it already splits each "
            "epoch over the ranks of torch.distributed, with equal batch counts (docs/pytorch.md, Integrations). "
            "To set the epoch, call set_epoch on growcache's loader, not on its dataset. To resume mid-epoch "
            "(Accelerate's skip_first_batches builds such a DataLoader), restore loader.load_state_dict(state) from "
            "a loader.state_dict() saved with your checkpoint (accelerator.register_for_checkpointing(loader) has "
            "save_state/load_state do it): the next iter() finishes that epoch, batch by batch (docs/pytorch.md, "
            "Resuming mid-epoch)."))
