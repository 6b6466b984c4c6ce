"""Who owns a file in a cache, and whether that owner still lives.

Leases, temporary shards and shared-memory slabs carry their owner's ``(pid, start time)``
(which survives pid reuse) and a tag of the *process table* it lives in (:func:`this_host`:
the kernel's boot id and pid namespace). Where the tag is ours, the process table decides.
Another table (another machine sharing the cache's filesystem, or another container's pid
namespace) is out of reach, so an owner there proves it lives with a *heartbeat*: every
process refreshes the modification time of the files it owns every
:func:`heartbeat_interval` seconds, and such a file whose heartbeat is older than
:func:`owner_expiry` belongs to a dead owner. A hostname is never trusted to tell machines
apart: containers share hostnames, and get new ones when they restart.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import select
import signal
import socket
import threading
import time

from .errors import GrowcacheError

logger = logging.getLogger(__name__)

#: Seconds without a heartbeat after which another machine's lease or temporary is dead.
DEFAULT_OWNER_EXPIRY_S = 60.0
_EXPIRY_ENV = "GROWCACHE_OWNER_EXPIRY"
_NODE_ENV = "GROWCACHE_NODE"
_FAULT_ENV = "GROWCACHE_FAULT"
_PID_MAX = 4194304  # Linux's largest pid_max (PID_MAX_LIMIT on 64-bit)


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


@functools.lru_cache(maxsize=1)
def start_times_known() -> bool:
    """Whether this platform tells a process's start time (Linux's ``/proc``): where it does
    not, owners are stored without one, and only the pid identifies them."""
    return process_start_time(os.getpid()) is not None


def this_process() -> tuple[int, int | None]:
    """``(pid, start time)`` of the calling process."""
    pid = os.getpid()
    return pid, process_start_time(pid)


def node_name() -> str:
    """This machine's name: ``$GROWCACHE_NODE`` if set, else the hostname.

    Set ``GROWCACHE_NODE`` where the hostname does not name the machine: containers that
    share one hostname, or get a new one at every restart.
    """
    return os.environ.get(_NODE_ENV) or socket.gethostname()


@functools.lru_cache(maxsize=1)
def _process_table() -> str:
    # Same boot and same pid namespace: exactly the processes whose pids this process can check.
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # no procfs: the hostname is the best there is
        boot = socket.gethostname()
    try:
        namespace = os.stat("/proc/self/ns/pid")
        table = f"{namespace.st_dev}:{namespace.st_ino}"
    except OSError:
        table = ""
    return f"{boot}/{table}"


def this_host() -> str:
    """A short tag of this process table, stored with every lease, temporary and slab name.

    Processes with the same tag can check each other's pids. ``$GROWCACHE_NODE``, where set,
    is part of the tag: processes with different values never judge each other's pids (only
    heartbeats). It never joins two tables: containers of one machine named alike for
    ``split="node"`` still have pid namespaces of their own, where another's pid means nothing.
    """
    node = os.environ.get(_NODE_ENV)
    table = _process_table()
    return hashlib.sha1((f"node:{node}/{table}" if node else table).encode()).hexdigest()[:8]


#: The range an owner expiry may take, in seconds: below half a second the heartbeat thread would
#: spin (it beats six times per expiry); above a day a dead owner's files would outlive any job.
MIN_OWNER_EXPIRY_S, MAX_OWNER_EXPIRY_S = 0.5, 86400.0


class SettingError(GrowcacheError, ValueError):
    """An environment variable growcache reads holds a value out of its range."""


def owner_expiry() -> float:
    """Seconds after its last heartbeat that this process's files count as dead elsewhere.

    ``$GROWCACHE_OWNER_EXPIRY`` overrides the default of 60 s. Each owner stores the expiry it
    beats for in its files, and other processes judge the files by that stored value (never
    by their own setting), so processes with different settings never remove each other's
    live files.

    Raises:
        SettingError: the variable is not a number of seconds in
            [:data:`MIN_OWNER_EXPIRY_S`, :data:`MAX_OWNER_EXPIRY_S`].
    """
    text = os.environ.get(_EXPIRY_ENV)
    if not text:
        return DEFAULT_OWNER_EXPIRY_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not MIN_OWNER_EXPIRY_S <= value <= MAX_OWNER_EXPIRY_S:  # NaN and inf fail here too
        raise SettingError(
            f"{_EXPIRY_ENV}={text!r} is not a number of seconds between {MIN_OWNER_EXPIRY_S:g} and "
            f"{MAX_OWNER_EXPIRY_S:g}: it is how long another machine waits after a process's last heartbeat "
            f"before it judges the process dead. Unset it for the default of {DEFAULT_OWNER_EXPIRY_S:g} s."
        )
    return value


def stored_expiry(value: object) -> float | None:
    """An expiry read from a file (see :func:`owner_expiry`), or ``None`` if it is not a valid one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and MIN_OWNER_EXPIRY_S <= value <= MAX_OWNER_EXPIRY_S:
        return float(value)
    return None


def heartbeat_interval() -> float:
    """Seconds between heartbeats: a sixth of :func:`owner_expiry` (10 s by default), so five
    heartbeats in a row can be late before a living owner is judged dead."""
    return owner_expiry() / 6


def is_alive(pid: int, start_time: int | None, host: str | None = None, heartbeat: float | None = None,
             expiry: float | None = None) -> bool:
    """True if the owner ``(pid, start_time)`` on machine ``host`` still runs.

    Args:
        pid, start_time: the owner process (``start_time`` ``None``: any process with that pid).
        host: the owner's process-table tag; ``None`` (files of old versions) or
            :func:`this_host` means ours, where the process table decides.
        heartbeat: modification time of the owner's file. An owner in another process table
            lives while it is younger than ``expiry``; ``None`` counts it alive.
        expiry: the expiry the owner stored in its file. Default: :func:`owner_expiry`
            (files of versions that stored none).
    """
    if host is not None and host != this_host():
        return heartbeat is None or time.time() - heartbeat <= (owner_expiry() if expiry is None else expiry)
    # 0 and -1 would probe process groups, not a process; a pid past any kernel's pid_max (a
    # crafted file's) is no process, and os.kill would raise OverflowError on it.
    if not isinstance(pid, int) or not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: maybe the owner, maybe one that got its pid: /proc tells
    fields = _stat_fields(pid)
    if fields is None:  # no /proc: trust the signal probe
        return True
    if fields[0] in (b"Z", b"X"):  # exited, waiting to be reaped
        return False
    return start_time is None or int(fields[19]) == start_time


_WATCHED: set[int] = set()
_WATCHED_LOCK = threading.Lock()


def exit_with(pid: int, start_time: int | None) -> None:
    """End this process (``os._exit(0)``) as soon as process ``(pid, start_time)`` ends.

    For a reader process whose training process is ``pid``: torch's watchdog watches a worker's
    parent, which under ``forkserver`` is the fork server, and a SIGKILLed trainer left its
    readers, and the shared-memory slabs they map, behind for good. A daemon thread waits on a
    pidfd (Linux 5.3+: no polling, immune to pid reuse), else probes the pid every second.
    Once per process and pid; nothing when ``pid`` is this process.
    """
    with _WATCHED_LOCK:
        if pid == os.getpid() or pid in _WATCHED:
            return
        _WATCHED.add(pid)
    try:
        handle: int | None = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os._exit(0)
    except (AttributeError, OSError):  # not Linux, a kernel before 5.3, a seccomp filter, no fd left
        handle = None
    if start_time is not None and process_start_time(pid) not in (start_time, None):
        os._exit(0)  # the pid went to another process: the trainer is gone
    threading.Thread(target=_exit_when_gone, args=(pid, start_time, handle), daemon=True,
                     name=f"growcache-exit-with-{pid}").start()


def _exit_when_gone(pid: int, start_time: int | None, handle: int | None) -> None:
    if handle is not None:
        waiting = select.poll()  # not select(): a forked worker's descriptors may pass 1024
        waiting.register(handle, select.POLLIN)
        while not waiting.poll():  # readable once the process has ended
            pass
    else:
        while is_alive(pid, start_time):
            time.sleep(1.0)
    os._exit(0)


# -- heartbeats ---------------------------------------------------------------------------------
class _Heartbeat:
    """One daemon thread per process that refreshes the files this process owns."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paths: set[str] = set()
        self.lost: set[str] = set()
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()
        self.expiry: float | None = None

    def beat_expiry(self) -> float:
        # Read once per process, in the caller's thread (a bad value raises there, never in the
        # heartbeat thread), so every file this process owns states the expiry it beats for.
        with self.lock:
            if self.expiry is None:
                self.expiry = owner_expiry()
            return self.expiry

    def add(self, path: str) -> None:
        self.beat_expiry()
        with self.lock:
            self.paths.add(path)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="growcache-heartbeat", daemon=True)
                self.thread.start()

    def discard(self, path: str) -> None:
        with self.lock:
            self.paths.discard(path)
            self.lost.discard(path)

    def _run(self) -> None:
        while not self.wake.wait(self.beat_expiry() / 6):
            with self.lock:
                paths = list(self.paths)
            for path in paths:
                try:
                    os.utime(path)
                except FileNotFoundError:
                    with self.lock:
                        if path not in self.paths or path in self.lost:
                            continue
                        self.lost.add(path)
                    if not os.path.isdir(os.path.dirname(path)):
                        # No machine judged anything: the directory itself went (the cache was
                        # deleted under a running process).
                        logger.warning("%s was removed while this process still held it: its directory is gone "
                                       "(was the cache deleted while a process used it?)", path)
                        continue
                    # A process stopped (SIGSTOP, a suspended VM) for longer than the expiry
                    # lost its lease to another machine's cleanup: say so once.
                    logger.warning("%s was removed while this process still held it: its heartbeat stopped for "
                                   "longer than %g s (a stopped or frozen process?), so another machine judged "
                                   "its owner dead. Shards it leased may be evicted under this epoch.",
                                   path, self.beat_expiry())
                except OSError as exc:
                    logger.debug("heartbeat of %s failed: %s", path, exc)

    def reset_after_fork(self) -> None:
        # The child owns none of its parent's files, and inherits no thread.
        self.lock = threading.Lock()
        self.paths, self.lost, self.thread = set(), set(), None
        self.wake = threading.Event()
        self.expiry = None


_HEARTBEAT = _Heartbeat()
os.register_at_fork(after_in_child=_HEARTBEAT.reset_after_fork)


def keep_alive(path: str) -> None:
    """Refresh ``path``'s modification time every :func:`heartbeat_interval` until :func:`let_go`."""
    _HEARTBEAT.add(path)


def beat_expiry() -> float:
    """The expiry this process's heartbeat beats for (:func:`owner_expiry`, read once per
    process); every file it keeps alive stores it, for other processes to judge it by.

    Raises:
        SettingError: ``$GROWCACHE_OWNER_EXPIRY`` is out of range.
    """
    return _HEARTBEAT.beat_expiry()


def let_go(path: str) -> None:
    """Stop the heartbeat of ``path`` (it was closed, published or removed)."""
    _HEARTBEAT.discard(path)


# -- fault injection ----------------------------------------------------------------------------
def fault_point(name: str) -> None:
    """Test hook: SIGKILL this process here if ``$GROWCACHE_FAULT`` equals ``name``.

    growcache's own tests use it to kill a process at an exact step (for example
    ``publish:state-written``, between the counters' write and the shard's rename, with the
    cache's lock held). Nothing else sets the variable, and an unset one costs one lookup.
    """
    if os.environ.get(_FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
