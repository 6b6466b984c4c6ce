"""growcache: train on a dataset far larger than local disk from a growing local shard cache.

Sampler processes pull samples from a remote store into a local cache of TFRecord shards;
each epoch reads every shard that exists at its start, and the oldest shards are evicted
when the cache reaches its byte budget. ``make_tf_dataset`` and ``make_torch_loader`` read
the cache from TensorFlow and PyTorch; both import their framework only when called.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._size import format_size, parse_size
from .cache import Cache, CacheStats, VerifyReport
from .errors import (
    CacheFormatError,
    CacheFullError,
    CompressedFileError,
    CorruptShardError,
    DeviceError,
    EmptyCacheError,
    EpochSyncError,
    ForeignLoaderError,
    GrowcacheError,
    MissingExtraError,
    MissingShardsError,
    RefusedFileError,
    SamplerError,
    SchemaError,
    SchemaMismatchError,
    SharedMemoryFullError,
    SourceError,
    TransientSourceError,
)
from .metrics import InputFigures, InputStats, input_stats
from .schema import FeatureSpec, Schema
from .shard import ShardInfo, ShardState
from .snapshot import Snapshot
from .writer import ShardWriter

__version__ = "0.1.0"

__all__ = [
    "Cache",
    "CacheFormatError",
    "CacheFullError",
    "CacheStats",
    "CompressedFileError",
    "CorruptShardError",
    "DeviceError",
    "EmptyCacheError",
    "EpochSyncError",
    "FeatureSpec",
    "ForeignLoaderError",
    "GrowcacheError",
    "InputFigures",
    "InputStats",
    "MissingExtraError",
    "MissingShardsError",
    "RefusedFileError",
    "SamplerError",
    "SamplerPool",
    "Schema",
    "SchemaError",
    "SchemaMismatchError",
    "ShardInfo",
    "ShardState",
    "ShardWriter",
    "SharedMemoryFullError",
    "Snapshot",
    "SourceError",
    "TFRecordShardSource",
    "TransientSourceError",
    "VerifyReport",
    "fit_growing",
    "format_size",
    "input_stats",
    "make_tf_dataset",
    "make_torch_loader",
    "parse_size",
]
assert __all__ == sorted(__all__), "keep __all__ sorted"  # noqa: S101 - guards the source, not input

# name -> (module, framework it imports, extra that installs it). Resolved on first use so
# that `import growcache` never imports tensorflow, torch or the `tfrecord` package.
_LAZY = {
    "SamplerPool": ("growcache.sampler", None, None),
    "TFRecordShardSource": ("growcache.shard_source", None, None),
    "make_tf_dataset": ("growcache.adapters.tf_dataset", "tensorflow", "tf"),
    "fit_growing": ("growcache.adapters.keras", "tensorflow", "tf"),
    "make_torch_loader": ("growcache.adapters.torch_loader", "torch", "torch"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'growcache' has no attribute {name!r}")
    module_name, framework, extra = _LAZY[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if framework is not None and missing.split(".")[0] in (framework, "tfrecord"):
            raise MissingExtraError(
                f"growcache.{name} needs {missing.split('.')[0]}, which is not installed: "
                f"pip install 'growcache[{extra}]'"
            ) from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
