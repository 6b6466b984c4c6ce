"""A command's claim on its cache directory, and the removal of one it created in vain.

``growcache import`` and ``growcache sample`` create their cache directory when it is missing;
a first command that fails before it publishes anything removes it again (see
:class:`CacheClaim`), so that the next command does not take the capacity and schema it stored
for the user's.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import stat
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import _sampler_stats
from .errors import CacheFormatError
from .manifest import (
    _WRITE_TEMP,
    EPOCHS_DIR,
    LEASES_DIR,
    LOCK_FILE,
    METADATA_FILE,
    SHARDS_DIR,
    SOURCES_DIR,
    STATE_FILE,
    Manifest,
    _scandir,
    make_dir,
    read_state_file,
)
from .schema import Schema
from .shard import scan_shards
from .writer import remove_abandoned_temporaries

if TYPE_CHECKING:
    from .cache import Cache

__all__ = ["CLAIM_LOCK_WAIT", "CacheClaim"]

logger = logging.getLogger(__name__)

#: Seconds a command that failed waits for its new cache's lock before it leaves the directory
#: in place: a process holding the lock that long is using the cache.
CLAIM_LOCK_WAIT = 5.0
# The mode Cache() gives a directory it creates (its default mode=0o700; the commands give no other).
_DIR_MODE = 0o700
# Times a claim makes its missing directory again when failed commands removed it meanwhile.
_HOLD_TRIES = 100
# What a cache holds that nothing was ever published into: its files, then its directories,
# the one a process writing into the cache without the lock writes into (shards/) first.
_NEW_CACHE_FILES = (STATE_FILE, METADATA_FILE, LOCK_FILE)
_NEW_CACHE_DIRS = (SHARDS_DIR, _sampler_stats.DIRECTORY, EPOCHS_DIR, LEASES_DIR, SOURCES_DIR)


class CacheClaim:
    """A command's use of a cache directory, and the removal of one it created in vain.

    ``growcache import`` and ``growcache sample`` create their cache directory when it is
    missing. A first command that fails before it publishes anything would leave it behind,
    with the capacity and schema it stored, and the next command would take them for the
    user's. A claim made before the cache is opened makes the directory when it is missing
    (:attr:`created`; with the mode ``Cache()`` gives a directory by default, 0o700, and the
    missing directories above it) and holds it from then on; :meth:`release` removes it
    again when the command failed, and only when all of this holds:

    - it is the directory this claim made, and no other command holding a claim uses it:
      every claim holds a shared ``flock`` on the directory from its making (or, for one
      that was there, from the claim) until its command ends, so before its command's
      ``Cache()`` opens it, and the removal takes it exclusively (two first imports into one
      new directory: the one that fails leaves it to the other). A claim made while another
      command's removal is under way waits for it, then makes the directory again;
    - under the cache's lock (waited for up to :data:`CLAIM_LOCK_WAIT` seconds): nothing was
      ever published into it; its metadata is as this command last stored it (see
      :meth:`opened`), so no one else stored a schema or capacity; no sampler pool ran on it
      but this command's (:meth:`sampler_started`); no shard is being written, no lease,
      epoch file or sampler stats file is there, and no file growcache does not write.

    Otherwise it stays, and :meth:`release` says why. Directories the claim made above the
    cache go too while they are empty. A Ctrl-C during the removal lands once it is done.
    What no check can see: a program that opened the new cache through the API (not with a
    command) while the command ran, and wrote nothing to it yet (a loader waiting for the
    first shards), finds it gone at its next write.

    Args:
        path: the cache directory, before the command opens or creates it.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(path))
        #: The claim made the directory (it was missing): the command creates the cache in it.
        self.created = False
        #: :meth:`release` removed the directory.
        self.removed = False
        self._parents: list[str] = []  # the directories above it the claim made, deepest first
        self._stored: tuple[str | None, Schema | None, int] | None = None
        self._runs = 0
        self._fd: int | None = None
        # The claim makes a missing directory itself and holds it from now on, before its command's
        # Cache() creates or opens the cache in it: a claim that held nothing until its command told
        # of an open let another command's failure remove the cache its command had just opened.
        self._hold(make=True)

    def opened(self, cache: Cache) -> None:
        """The command opened ``cache`` at this path, and what it holds is what the command stored."""
        if os.path.abspath(cache.path) != self.path:
            return  # another directory (a relative path after a chdir): not what this claim is about
        self._hold()
        self._stored = (cache.cache_id, cache.schema, cache.capacity)

    def sampler_started(self) -> None:
        """The command starts a sampler pool on the cache (each start is counted in the cache)."""
        self._runs += 1

    def release(self, *, failed: bool) -> str | None:
        """End the claim. After a failure, remove the directory if the command created it and it
        holds nothing but what the command wrote.

        Returns:
            Why the directory the command created stays although nothing was published into
            it, or ``None`` (it was removed, was not created by the command, or holds shards).
        """
        try:
            if failed and self.created:
                return self._remove()
            if failed and not os.path.lexists(self.path):
                with _ctrl_c_deferred():
                    self._remove_parents()  # made above a directory the claim could not make
            return None
        finally:
            self._let_go()

    def _hold(self, *, make: bool = False) -> None:
        """Hold the shared ``flock`` on the directory now at the path (best effort: on a filesystem
        without locks, another command cannot tell that this one uses it, and keeps it); with
        ``make``, make the directory (and the missing ones above it) first where it is missing."""
        if self._fd is not None:
            if self._current():
                return
            # Removed (or replaced) since, by something outside the claims (a user's rm -r): who
            # made the directory there now cannot be told, so it is not this claim's to remove.
            self._let_go()
            self.created = False
        for _ in range(_HOLD_TRIES):
            made = self._make() if make else False
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                if make:
                    continue  # removed between its making and its opening: made again
                return
            except OSError:  # a link or a file there: the command's Cache() says what is wrong
                return
            self._fd = fd
            if made:
                try:
                    os.fchmod(fd, _DIR_MODE)  # exactly the mode Cache() gives a directory it creates
                except OSError as exc:
                    logger.debug("cannot set mode %o on %s: %s", _DIR_MODE, self.path, exc)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a removal in progress: an instant
            except OSError as exc:
                logger.debug("cannot lock %s (%s): another command cannot tell that this one uses it", self.path,
                             exc)
            if self._current():
                self.created = made
                return
            # A failed command removed it while this claim waited: make it again (or hold the one there now).
            self._let_go()
            if not make:
                return
        logger.debug("cache directory %s was removed %d times while a command claimed it", self.path, _HOLD_TRIES)

    def _make(self) -> bool:
        """Make the directory, and the missing ones above it (recorded); whether this call made it."""
        missing = []
        parent = os.path.dirname(self.path)
        while not os.path.lexists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                continue  # made by another process meanwhile: not this claim's
            except OSError:
                return False  # the command's Cache() says what is wrong
            self._parents.insert(0, directory)
        try:
            os.mkdir(self.path, _DIR_MODE)
        except OSError:  # there already, or it cannot be made here: the command's Cache() says why
            return False
        return True

    def _current(self) -> bool:
        """Whether the held directory is the one at the path now."""
        try:
            return self._fd is not None and os.path.samestat(os.fstat(self._fd), os.lstat(self.path))
        except OSError:
            return False

    def _let_go(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def _remove(self) -> str | None:
        from filelock import FileLock, Timeout

        if not self._current():
            # Not the directory this claim made (removed or replaced since, by something outside the
            # claims): not its to remove. The directories it made above it go while they are empty.
            if not os.path.lexists(self.path):
                with _ctrl_c_deferred():
                    self._remove_parents()
            return None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "another growcache command is using it"
        except OSError as exc:
            return f"its filesystem cannot lock it ({exc.strerror}), so whether another process uses it cannot be told"
        lock_path = os.path.join(self.path, LOCK_FILE)
        try:
            if not stat.S_ISREG(os.lstat(lock_path).st_mode):
                return f"{LOCK_FILE} there is not a file growcache wrote"
        except FileNotFoundError:
            pass  # the command failed before the cache was made whole: the lock file is made now
        except OSError as exc:
            return f"its lock file cannot be read ({exc.strerror})"
        try:
            with FileLock(lock_path, timeout=CLAIM_LOCK_WAIT):
                if not self._current():  # replaced while the lock was waited for: the lock is another's
                    return None
                kept = self._unused()
                if kept is None:
                    with _ctrl_c_deferred():  # a Ctrl-C lands once the removal is whole, not half done
                        kept = self._remove_layout()
                        if kept is None:
                            self.removed = True
                            self._remove_parents()
        except Timeout:
            return f"another process has held its lock for {CLAIM_LOCK_WAIT:g} s"
        except OSError as exc:
            return f"it could not be removed ({exc})"
        if kept is not None:
            return kept or None  # "": a cache in use (shards were published into it, or it is another's now)
        logger.debug("removed cache directory %s: the command that created it failed before publishing", self.path)
        return None

    def _unused(self) -> str | None:
        """``None`` when the directory holds only what this command wrote and nothing was published;
        else why it stays (``""``: shards were published into it). Assumes you hold the lock."""
        for name in os.listdir(self.path):
            what = _kind(os.path.join(self.path, name))
            if (name in _NEW_CACHE_FILES and what == "file") or (name in _NEW_CACHE_DIRS and what == "dir"):
                continue
            if _WRITE_TEMP.search(name) and what == "file":
                continue  # a killed process's metadata write: no write is in progress while the lock is held
            return f"it holds {name}, which is not what a new cache holds"
        manifest = Manifest(self.path)
        try:
            found = read_state_file(manifest.state_path, manifest.state_path)
            metadata = manifest.read_metadata()
        except CacheFormatError as exc:
            return f"its metadata is damaged ({exc})"
        state = found[0] if found is not None else {}
        if state.get("published", 0) != 0:
            return ""
        if state.get("sampler_runs", 0) not in range(self._runs + 1):
            return "another process ran a sampler pool on it"
        if metadata is not None:
            if self._stored is None:
                return "another process made it a cache"
            cache_id, schema, capacity = self._stored
            stored = Schema.from_dict(metadata["schema"]) if metadata.get("schema") else None
            if (metadata.get("cache_id"), stored, metadata.get("capacity")) != (cache_id, schema, capacity):
                return "another process stored a schema or capacity in it meanwhile, so it uses the cache"
        shards_dir = os.path.join(self.path, SHARDS_DIR)
        remove_abandoned_temporaries(shards_dir)  # this command's workers' that died
        listing = scan_shards(shards_dir)
        if listing.shards:
            return ""
        if listing.temporaries:
            return "another process is writing shards into it"
        if listing.foreign or listing.irregular:
            return f"{SHARDS_DIR}/ holds files growcache did not write"
        for name, what in ((LEASES_DIR, "a reader holds a lease on it"),
                           (EPOCHS_DIR, "a reader's epoch files are in it"),
                           (_sampler_stats.DIRECTORY, "a sampler pool runs on it")):
            if _scandir(os.path.join(self.path, name)):
                return what
        sources = _scandir(os.path.join(self.path, SOURCES_DIR))
        if sources and not self._runs:
            return "another process's shard source keeps its state in it"
        if any(not entry.is_file(follow_symlinks=False) for entry in sources):
            return f"{SOURCES_DIR}/ holds files growcache did not write"
        return None

    def _remove_layout(self) -> str | None:
        """Remove what :meth:`_unused` found: ``None`` when all went, else why not (``""``: another
        process made a cache there again meanwhile). Assumes you hold the lock.

        Everything goes through the descriptor of the directory this claim made, never through the
        path: a path swapped for a link to another cache after the last check would otherwise have
        that cache's files unlinked. Only the last ``rmdir`` takes the path (it removes an empty
        directory or nothing)."""
        fd = self._fd
        assert fd is not None
        gone: list[str] = []
        for name in _NEW_CACHE_DIRS:
            if name == SOURCES_DIR:  # this command's sampler pool's shard source state
                _unlink_files_in(fd, name)
            try:
                os.rmdir(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                # Something was written into it since it was checked: another process uses the cache
                # now. The directories removed so far come back, so that the cache stays whole.
                mode = stat.S_IMODE(os.fstat(fd).st_mode)
                for made in gone:
                    make_dir(made, mode, dir_fd=fd)
                return f"another process started to use it meanwhile ({name}/: {exc.strerror})"
            gone.append(name)
        names = [entry.name for entry in os.scandir(fd) if _WRITE_TEMP.search(entry.name)]
        for name in (*names, *_NEW_CACHE_FILES):  # the lock file last
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        try:
            os.rmdir(self.path)
        except OSError as exc:  # another process opened the path since the lock file went: the cache is its own
            logger.debug("cache directory %s stays, made a cache again by another process: %s", self.path, exc)
            return ""
        return None

    def _remove_parents(self) -> None:
        for parent in self._parents:
            try:
                os.rmdir(parent)
            except OSError:  # not empty: something else is there now
                return


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold back a Ctrl-C (SIGINT) until the block is done, then raise it (main thread only)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # not the thread Python's handlers run in, or a handler Python cannot put back
        return
    caught: list[tuple[int, Any]] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(*caught[0])
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt


def _kind(path: str) -> str:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "gone"
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def _unlink_files_in(fd: int, name: str) -> None:
    """Unlink the regular files of the directory ``name`` of the directory ``fd`` (links not followed)."""
    try:
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:  # missing, or not a directory now: the rmdir that follows says what is there
        return
    try:
        for entry in os.scandir(sub):
            if entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=sub)
    finally:
        os.close(sub)
