"""A real size-limited filesystem for full-disk tests, made by the first way this machine allows.

A full disk is simulated only with a filesystem that really fills: writes past its size fail
with ``ENOSPC`` from the kernel, as on a real disk. The ways, tried in this order:

``tmpfs``
    ``mount -t tmpfs`` as root.
``sudo-tmpfs``
    the same through passwordless ``sudo`` (a CI runner's user), owned by this user.
``loop-image``
    an ext2 image file, loop-mounted (root or passwordless ``sudo``), for hosts that refuse tmpfs.
``userns-tmpfs``
    a tmpfs mounted inside an unprivileged user and mount namespace (``unshare -rm``), held by
    a small holder process and reached through ``/proc/<holder>/root``: no root needed where
    the kernel allows unprivileged user namespaces.

``GROWCACHE_TEST_FULLFS=loop-image,userns-tmpfs`` restricts the ways tried (to test one of them).
Every use is recorded in :data:`USED`; the test session's summary lists which way each test got.
Under ``CI=true`` a test that gets none fails, naming what to enable, instead of skipping.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest

METHODS = ("tmpfs", "sudo-tmpfs", "loop-image", "userns-tmpfs")

#: ``(test id, how)`` for every size-limited filesystem asked for in this session.
USED: list[tuple[str, str]] = []

_HOW = {
    "tmpfs": "a tmpfs mount",
    "sudo-tmpfs": "a tmpfs mounted through sudo",
    "loop-image": "a loop-mounted ext2 image",
    "userns-tmpfs": "a tmpfs in an unprivileged user namespace",
}


class _Unavailable(Exception):
    """This way of making a size-limited filesystem does not work here; the message says why."""


def in_ci() -> bool:
    """``CI`` is set as CI services set it (``true``/``1``/``yes``)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise _Unavailable(f"{' '.join(cmd[:3])}... failed: {result.stderr.strip() or result.returncode}")


def _privileged() -> list[str]:
    """The command prefix that runs ``mount`` with privilege: nothing as root, else ``sudo -n``."""
    if shutil.which("mount") is None:
        raise _Unavailable("no mount command")
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") is None:
        raise _Unavailable("not root and no sudo")
    if subprocess.run(["sudo", "-n", "true"], capture_output=True, timeout=30).returncode != 0:
        raise _Unavailable("not root and sudo needs a password")
    return ["sudo", "-n"]


def _unmounter(prefix: list[str], path: str) -> Callable[[], None]:
    def unmount() -> None:
        if subprocess.run([*prefix, "umount", path], capture_output=True, timeout=60).returncode != 0:
            subprocess.run([*prefix, "umount", "-l", path], capture_output=True, timeout=60)
    return unmount


def _tmpfs_options(size: int, inodes: int | None, owned: bool = True) -> str:
    owner = f",uid={os.getuid()},gid={os.getgid()}" if owned else ""
    return f"size={size},mode=0700{owner}" + (f",nr_inodes={inodes}" if inodes else "")


def _tmpfs(path: str, size: int, inodes: int | None, *, as_root: bool) -> tuple[str, Callable[[], None]]:
    if (os.geteuid() == 0) != as_root:
        raise _Unavailable("not root" if as_root else "root mounts without sudo")
    prefix = _privileged()
    _run([*prefix, "mount", "-t", "tmpfs", "-o", _tmpfs_options(size, inodes), "tmpfs", path])
    return path, _unmounter(prefix, path)


def _loop_image(path: str, size: int, inodes: int | None) -> tuple[str, Callable[[], None]]:
    prefix = _privileged()
    mkfs = shutil.which("mkfs.ext2") or shutil.which("mke2fs")
    if mkfs is None:
        raise _Unavailable("no mkfs.ext2")
    image = path.rstrip("/") + ".img"
    with open(image, "wb") as f:
        f.truncate(max(size, 256 << 10))
    # 1 KiB blocks and no reserved blocks, so that nearly all of `size` is usable.
    _run([mkfs, "-q", "-F", "-m", "0", "-b", "1024", *(["-N", str(inodes)] if inodes else []), image])
    _run([*prefix, "mount", "-o", "loop", image, path])
    unmount = _unmounter(prefix, path)
    try:
        _run([*prefix, "chown", f"{os.getuid()}:{os.getgid()}", path])
        _run([*prefix, "chmod", "0700", path])
    except BaseException:
        unmount()
        raise

    def cleanup() -> None:
        unmount()
        os.unlink(image)
    return path, cleanup


def _userns_tmpfs(path: str, size: int, inodes: int | None) -> tuple[str, Callable[[], None]]:
    if shutil.which("unshare") is None:
        raise _Unavailable("no unshare command")
    # The holder mounts in its own mount namespace, says "ready", then waits for its stdin to
    # close: the mount lives exactly as long as the holder, and dies with this process.
    script = 'mount -t tmpfs -o "$1" tmpfs "$2" && echo ready && read -r _'
    holder = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh",
                               _tmpfs_options(size, inodes, owned=False), path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if holder.stdout.readline().strip() != "ready":
        holder.kill()
        _, err = holder.communicate(timeout=30)
        raise _Unavailable(f"unshare -rm + mount -t tmpfs failed: {err.strip() or holder.returncode}")

    def cleanup() -> None:
        holder.stdin.close()
        try:
            holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
        holder.stdout.close()
        holder.stderr.close()
    # Paths under /proc/<pid>/root resolve in the holder's mount namespace, for this process
    # and for every process it starts.
    return f"/proc/{holder.pid}/root{path}", cleanup


_MAKERS = {"tmpfs": functools.partial(_tmpfs, as_root=True), "sudo-tmpfs": functools.partial(_tmpfs, as_root=False),
           "loop-image": _loop_image, "userns-tmpfs": _userns_tmpfs}


def _methods() -> list[str]:
    wanted = os.environ.get("GROWCACHE_TEST_FULLFS", "").strip()
    if not wanted:
        return list(METHODS)
    methods = [m.strip() for m in wanted.split(",") if m.strip()]
    unknown = [m for m in methods if m not in _MAKERS]
    if unknown:
        raise ValueError(f"GROWCACHE_TEST_FULLFS names unknown ways {unknown}; choose from {', '.join(METHODS)}")
    return methods


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]


@contextlib.contextmanager
def size_limited_fs(path: str, size: int, inodes: int | None = None) -> Iterator[tuple[str | None, str]]:
    """A filesystem of about ``size`` bytes (and at most ``inodes`` files) at ``path``.

    Yields ``(root, how)``: ``root`` is where the filesystem is reached (``path`` itself, or a
    ``/proc/<pid>/root`` path for a user-namespace mount) and ``how`` names the way used. Where
    no way works, yields ``(None, reasons)`` outside CI; under ``CI=true`` it fails the test
    instead, naming what to enable. The filesystem is removed on exit.
    """
    path = os.path.realpath(path)
    os.makedirs(path, exist_ok=True)
    reasons = []
    for method in _methods():
        try:
            root, cleanup = _MAKERS[method](path, size, inodes)
        except _Unavailable as exc:
            reasons.append(f"{method}: {exc}")
            continue
        USED.append((_current_test(), f"{_HOW[method]} ({method})"))
        try:
            yield root, f"{_HOW[method]} ({method})"
        finally:
            cleanup()
        return
    why = "; ".join(reasons)
    if in_ci():
        pytest.fail(f"CI=true requires a size-limited filesystem for the full-disk tests, and none could be "
                    f"made here ({why}). Run the tests as root, give the CI user passwordless sudo, or allow "
                    "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, and on Ubuntu "
                    "kernel.apparmor_restrict_unprivileged_userns=0).", pytrace=False)
    USED.append((_current_test(), f"none, the full-disk check did not run ({why})"))
    yield None, why


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still add on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: str, ballast: str, leave: int) -> int:
    """Grow the file ``ballast`` until ``path``'s filesystem has at most ``leave`` bytes free.

    Returns the bytes added. Other writers may take space meanwhile: a write that finds the
    disk full simply stops.
    """
    added = 0
    with open(ballast, "ab", buffering=0) as f:
        while (want := free_bytes(path) - leave) > 0:
            try:
                added += f.write(b"\0" * min(want, 8 << 20))
            except OSError:
                break
    return added
