"""A real size-limited filesystem for full-disk tests: a tmpfs mount, where the machine allows one."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def size_limited_fs(path: str, size: int, inodes: int | None = None) -> Iterator[tuple[str | None, str]]:
    """Mount a tmpfs of ``size`` bytes (and at most ``inodes`` files) at ``path``.

    Yields ``(path, "")``, or ``(None, reason)`` where mounting is not allowed (not root, no
    ``mount``, a sandbox that refuses it). The mount is removed on exit.
    """
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        yield None, "mounting a tmpfs needs root"
        return
    options = f"size={size},mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        yield None, f"mount -t tmpfs failed: {result.stderr.strip() or result.returncode}"
        return
    try:
        yield path, ""
    finally:
        if subprocess.run(["umount", path], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)


def free_bytes(path: str) -> int:
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
