"""A published shard: its identity, its file name, and its lifecycle.

A shard's file name carries its publish sequence number, record count and byte size,
so listing the cache needs neither a lock nor a ``stat`` per file, and a listing can
never disagree with the file it names.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field

__all__ = ["ShardInfo", "ShardListing", "ShardState", "scan_shards"]

SHARD_SUFFIX = ".tfrecord"
TMP_PREFIX = ".tmp-"
# At most 18 digits per count: every value fits an int64 (plans are numpy int64 arrays).
_SHARD_NAME = re.compile(r"^([0-9]{12})-([0-9]{1,18})r-([0-9]{1,18})b\.tfrecord$")
#: The smallest TFRecord frame: an 8-byte length, two 4-byte CRCs and no payload. A name that
#: claims more records than its bytes can frame is no shard growcache wrote.
MIN_RECORD_BYTES = 16
#: The largest sequence number a shard name can carry (twelve digits).
MAX_SEQ = 10**12 - 1


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
        """Parse a published shard's file name; ``None`` if it is not one.

        A name is untrusted: one whose counts no shard could have (sequence number 0, no
        record, or more records than its bytes can frame) is not a shard; ``verify`` reports
        such a file as corrupt.
        """
        match = _SHARD_NAME.match(os.path.basename(path))
        if match is None:
            return None
        seq, records, nbytes = (int(g) for g in match.groups())
        if _impossible(seq, records, nbytes):
            return None
        return cls(seq=seq, path=path, records=records, nbytes=nbytes)

    @staticmethod
    def file_name(seq: int, records: int, nbytes: int) -> str:
        """The file name a shard is published under."""
        return f"{seq:012d}-{records}r-{nbytes}b{SHARD_SUFFIX}"


def _impossible(seq: int, records: int, nbytes: int) -> str:
    if seq < 1:
        return "its sequence number is 0"
    if records < 1:
        return "it names no record"
    if records * MIN_RECORD_BYTES > nbytes:
        return (f"it claims {records} records in {nbytes} bytes, and a record takes at least "
                f"{MIN_RECORD_BYTES} bytes")
    return ""


def impossible_name(path: str) -> str:
    """Why ``path`` is named like a shard but claims what no shard holds; ``""`` otherwise."""
    match = _SHARD_NAME.match(os.path.basename(path))
    return "" if match is None else _impossible(*(int(g) for g in match.groups()))


@dataclass
class ShardListing:
    """What a shard directory holds, by kind (see :func:`scan_shards`).

    Attributes:
        shards: published shards (regular files named like one), oldest first.
        temporaries: names of regular ``.tmp-*`` files (shards being written, or abandoned).
        foreign: paths of regular files that growcache did not write, including files named
            like a shard whose counts no shard could have (:func:`impossible_name`).
        irregular: paths of entries that are not regular files: directories, symbolic links,
            devices, sockets. Readers and eviction never touch them.
    """

    shards: list[ShardInfo] = field(default_factory=list)
    temporaries: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    irregular: list[str] = field(default_factory=list)


def scan_shards(shards_dir: str) -> ShardListing:
    """List ``shards_dir`` without a lock and, on most filesystems, without a ``stat`` per entry.

    Only regular files count as shards or temporaries: a directory or a symbolic link named
    like a shard would otherwise reach readers (which fail on it, or read outside the cache)
    and eviction (which cannot unlink a directory, and would stop every publish).
    """
    listing = ShardListing()
    try:
        entries = list(os.scandir(shards_dir))
    except FileNotFoundError:
        return listing
    for entry in entries:
        try:
            regular = entry.is_file(follow_symlinks=False)
        except OSError:  # removed between the listing and the check
            continue
        if not regular:
            listing.irregular.append(entry.path)
        elif entry.name.startswith(TMP_PREFIX):
            listing.temporaries.append(entry.name)
        else:
            info = ShardInfo.from_path(entry.path)
            if info is None:
                listing.foreign.append(entry.path)
            else:
                listing.shards.append(info)
    listing.shards.sort()
    listing.foreign.sort()
    listing.irregular.sort()
    return listing
