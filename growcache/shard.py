"""A published shard: its identity, its file name, and its lifecycle.

A shard's file name carries its publish sequence number, record count and byte size,
so listing the cache needs neither a lock nor a ``stat`` per file, and a listing can
never disagree with the file it names.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass

__all__ = ["ShardInfo", "ShardState"]

SHARD_SUFFIX = ".tfrecord"
TMP_PREFIX = ".tmp-"
_SHARD_NAME = re.compile(r"^(\d{12})-(\d+)r-(\d+)b\.tfrecord$")


class ShardState(enum.Enum):
    """Lifecycle of a shard: ``WRITING -> READY -> EVICTED``.

    * ``WRITING``: a temporary ``.tmp-*`` file that only its writer sees; abandoned
      temporaries of dead writers are removed when a cache is opened or pruned.
    * ``READY``: published by an atomic rename; immutable from then on.
    * ``EVICTED``: deleted by the byte budget; never while a lease holds it.
    """

    WRITING = "writing"
    READY = "ready"
    EVICTED = "evicted"


@dataclass(frozen=True, order=True)
class ShardInfo:
    """One published shard.

    Attributes:
        seq: publish sequence number; larger is newer.
        path: absolute path of the shard file.
        records: number of records.
        nbytes: size of the file in bytes.
    """

    seq: int
    path: str
    records: int
    nbytes: int

    @classmethod
    def from_path(cls, path: str) -> ShardInfo | None:
        """Parse a published shard's file name; ``None`` if it is not one."""
        match = _SHARD_NAME.match(os.path.basename(path))
        if match is None:
            return None
        seq, records, nbytes = (int(g) for g in match.groups())
        return cls(seq=seq, path=path, records=records, nbytes=nbytes)

    @staticmethod
    def file_name(seq: int, records: int, nbytes: int) -> str:
        """The file name a shard is published under."""
        return f"{seq:012d}-{records}r-{nbytes}b{SHARD_SUFFIX}"
