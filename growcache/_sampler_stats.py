"""The samplers' stats files: a running pool's figures, for ``growcache status`` and the epoch meters.

Each running :class:`~growcache.SamplerPool` rewrites one small JSON file,
``samplers/<host>-<pid>-<n>.json`` in the cache directory (``n``: the pool's number in its
process, as one process may run several pools on one cache), about once a second (atomically,
not fsynced: the figures die with the pool) and removes it when it stops. The file's
modification time is its heartbeat: a file older than :data:`FRESH_S` belongs to a pool
that is gone, and is not shown.

The directory is untrusted input like the rest of the cache: a link (the directory or a
file) is never followed, and a file whose fields are not all of the right type and range is
passed over with one debug line.
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat
import time
from collections.abc import Mapping
from typing import Any

from . import _proc
from .errors import CacheFormatError
from .manifest import _WRITE_TEMP, _dumps, _unlink_quiet, atomic_write_bytes, make_dir, read_state_file

logger = logging.getLogger("growcache.sampler")

DIRECTORY = "samplers"
FRESH_S = 15.0  # a pool rewrites its file each second; one this old is a dead pool's
STALE_S = 600.0  # ... and removed by prune once this old (a pool stopped with SIGSTOP writes it again)
_NAME = re.compile(r"^[A-Za-z0-9_.]{1,64}-[0-9]{1,10}-[0-9]{1,10}\.json$")
_MAX_INT = 2**62
_INTS = ("pid", "workers", "concurrency", "records", "bytes", "shards", "requests_in_flight", "in_flight_limit",
         "throttle_events", "restarts")
_FLOATS = {"mb_per_s": 1e7, "latency_p50": 1e6, "latency_p95": 1e6, "latency_p99": 1e6}
# Summed over the pools of a cache by read_sampler_stats; the latencies are the slowest pool's.
_SUMMED = ("workers", "records", "bytes", "shards", "requests_in_flight", "in_flight_limit", "throttle_events",
           "restarts", "mb_per_s")


def stats_path(cache_path: str, pool: int) -> str:
    """The stats file of this process's pool number ``pool``."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", _proc.this_host())[:64] or "host"
    return os.path.join(cache_path, DIRECTORY, f"{host}-{os.getpid()}-{pool}.json")


def write(cache_path: str, pool: int, figures: Mapping[str, Any], *, dir_mode: int = 0o700,
          file_mode: int = 0o600) -> None:
    """Rewrite the stats file of this process's pool ``pool`` (best effort: a figure never stops
    sampling), with the cache's modes: in a cache a group shares, its members see each other's pools."""
    path = stats_path(cache_path, pool)
    folder = os.path.dirname(path)
    try:
        make_dir(folder, dir_mode)
        if not stat.S_ISDIR(os.lstat(folder).st_mode):  # a link put there: write nothing through it
            return
        atomic_write_bytes(path, _dumps(dict(figures)), file_mode, durable=False)
    except OSError as exc:
        logger.debug("cannot write the sampler stats file %s: %s", path, exc)


def remove(cache_path: str, pool: int) -> None:
    try:
        _unlink_quiet(stats_path(cache_path, pool))
    except OSError:
        pass


def remove_stale(cache_path: str, now: float | None = None) -> int:
    """Remove the stats files (and write temporaries) of pools gone for :data:`STALE_S`; how many.

    Readers pass them over by age already; this keeps a long-lived cache's folder from growing
    by one file per killed pool (``prune`` calls it)."""
    folder = os.path.join(cache_path, DIRECTORY)
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):  # a link put there: delete nothing through it
            return 0
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    now = time.time() if now is None else now
    removed = 0
    for entry in entries:
        if not _NAME.match(_WRITE_TEMP.sub("", entry.name)):  # a stats file, or its write's temporary
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and now - info.st_mtime > STALE_S and _unlink_quiet(entry.path):
                removed += 1
        except OSError:
            continue
    return removed


def check(data: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The figures of one stats file, every field checked; raises :class:`CacheFormatError`."""
    out: dict[str, Any] = {}
    for name in _INTS:
        value = data.get(name)
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_INT):
            raise CacheFormatError(f"{label}: {name} is {value!r}, not an integer from 0 to 2**62")
        out[name] = value
    for name, top in _FLOATS.items():
        value = data.get(name)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and 0 <= value <= top):
            raise CacheFormatError(f"{label}: {name} is {value!r}, not a number from 0 to {top:g}")
        out[name] = float(value)
    failed = data.get("failed")
    if not isinstance(failed, bool):
        raise CacheFormatError(f"{label}: failed is {failed!r}, not true or false")
    out["failed"] = failed
    host = data.get("host")
    if not (isinstance(host, str) and len(host) <= 255):
        raise CacheFormatError(f"{label}: host is {host!r}, not a short string")
    out["host"] = host
    return out


def read_all(cache_path: str, now: float | None = None) -> list[dict[str, Any]]:
    """The checked figures of every pool running on the cache now (fresh files only), oldest pid first."""
    folder = os.path.join(cache_path, DIRECTORY)
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return []
        entries = list(os.scandir(folder))
    except OSError:
        return []
    now = time.time() if now is None else now
    pools = []
    for entry in entries:
        if not _NAME.match(entry.name):
            continue
        label = f"sampler stats file {entry.path}"
        try:
            found = read_state_file(entry.path, label)
            if found is None:
                continue
            data, heartbeat = found
            if now - heartbeat > FRESH_S:
                continue  # its pool is gone
            pools.append(check(data, label))
        except (CacheFormatError, OSError) as exc:
            logger.debug("%s is passed over: %s", label, exc)
    return sorted(pools, key=lambda p: p["pid"])


def read_sampler_stats(cache: Any) -> dict[str, Any] | None:
    """The figures of the sampler pools running on ``cache`` (a :class:`~growcache.Cache` or a
    directory), summed over pools, the latencies the slowest pool's; ``None`` if none runs.

    Read from the stats files the pools write (see :mod:`growcache._sampler_stats`), so it
    works from any process: ``growcache status``, a training job whose samplers run elsewhere.
    """
    path = os.fspath(getattr(cache, "path", cache))
    pools = read_all(path)
    if not pools:
        return None
    out: dict[str, Any] = {"pools": len(pools)}
    for name in _SUMMED:
        out[name] = sum(p[name] for p in pools)
    for name in ("latency_p50", "latency_p95", "latency_p99"):
        out[name] = max(p[name] for p in pools)
    return out
