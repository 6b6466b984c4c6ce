"""Process identity that survives pid reuse: ``(pid, start time)``, and the machine it runs on."""

from __future__ import annotations

import functools
import hashlib
import os
import socket


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses; fields resume after the last ')'.
    return stat[stat.rindex(b")") + 2:].split()


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or ``None`` if unknown."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def this_process() -> tuple[int, int | None]:
    """``(pid, start time)`` of the calling process."""
    pid = os.getpid()
    return pid, process_start_time(pid)


@functools.lru_cache(maxsize=1)
def this_host() -> str:
    """A short tag of this machine (from its hostname), stored with every lease and temporary."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def is_alive(pid: int, start_time: int | None, host: str | None = None) -> bool:
    """True if the process ``pid`` that started at ``start_time`` still runs.

    A process of another machine (``host`` set and not :func:`this_host`) counts as alive:
    this machine's process table says nothing about it, and judging it dead would delete
    what it is using when a cache sits on a filesystem that several machines share.
    """
    if host is not None and host != this_host():
        return True
    if not isinstance(pid, int) or pid <= 0:  # 0 and -1 would probe process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    if fields is None:  # no /proc: trust the signal probe
        return True
    if fields[0] in (b"Z", b"X"):  # exited, waiting to be reaped
        return False
    return start_time is None or int(fields[19]) == start_time
