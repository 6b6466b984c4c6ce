"""Shared fixtures: small caches whose every record can be recomputed from its id.

Also the suite's rule on skips: a component the suite needs is never skipped silently.
A missing torch, ``tfrecord`` or ``[test]``-extra package fails the tests that need it, with
a message naming what to install; under ``CI=true`` so does a missing TensorFlow, and
``_fullfs`` fails a full-disk test that gets no size-limited filesystem.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import _fullfs  # noqa: E402
from growcache import Cache, Schema  # noqa: E402

# A shell that starts a command in the background (`make test &`, nohup, a CI step without job
# control) starts it with SIGINT ignored, and every child inherits that: the tests that press
# Ctrl-C on `growcache sample` would then wait for an exit that never comes.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_TEST_EXTRA = "pip install -e '.[test]' (the [test] extra)"
_CPU_TORCH = ("pip install torch --index-url https://download.pytorch.org/whl/cpu (the CPU wheel, as `make test` "
              "installs it; the [test] extra leaves torch out so that it never pulls a CUDA build)")
_TRAINERS = "pip install -e '.[test-trainers]' after a CPU torch (tests/integrations need Lightning and Accelerate)"
_TENSORFLOW = "pip install tensorflow-cpu (as `make test` does), or pip install -e '.[tf]'"

#: Top-level module -> what installs it, for modules the suite needs everywhere.
REQUIRED = {
    "torch": _CPU_TORCH,
    **{name: _TEST_EXTRA for name in ("tfrecord", "moto", "s3fs", "gcsfs", "gcp_storage_emulator", "hypothesis",
                                      "psutil", "matplotlib", "webdataset", "pytest_timeout")},
    **{name: _TRAINERS for name in ("lightning", "accelerate")},
}
#: Modules whose absence may skip outside CI, but fails the run under ``CI=true``.
REQUIRED_IN_CI = {"tensorflow": _TENSORFLOW, "keras": _TENSORFLOW}

_IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")


def _required_install(reason: str) -> str | None:
    """What to install, if ``reason`` is an ``importorskip`` of a module the suite needs here."""
    match = _IMPORT_SKIP.search(reason)
    if match is None:
        return None
    top = match.group(1).split(".")[0]
    return REQUIRED.get(top) or (REQUIRED_IN_CI.get(top) if _fullfs.in_ci() else None)


def _missing_message(reason: str, install: str) -> str:
    return f"a component the test suite requires is missing ({reason.removeprefix('Skipped: ')}); install it: {install}"


class _MissingComponent(pytest.Item):
    """Stands in for a test module that skipped itself for a missing required module, and fails."""

    def __init__(self, *, message: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.message = message

    def runtest(self) -> None:
        pytest.fail(self.message, pytrace=False)

    def reportinfo(self):
        return self.path, None, self.name


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    # A module-level importorskip skips the whole module at collection: turn it into one failing
    # test (a collection error would abort the whole run instead).
    if report.skipped and isinstance(report.longrepr, tuple):
        install = _required_install(report.longrepr[2])
        if install is not None:
            item = _MissingComponent.from_parent(collector, name="required-component-missing",
                                                 message=_missing_message(report.longrepr[2], install))
            report = pytest.CollectReport(report.nodeid, "passed", None, [item])
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # Full-disk tests record which filesystem they got; the report carries it to the summary,
    # which an xdist controller prints for its workers.
    while _fullfs.USED:
        report.user_properties.append(("fullfs", _fullfs.USED.pop(0)))
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        install = _required_install(report.longrepr[2])
        if install is not None:
            report.outcome = "failed"
            report.longrepr = _missing_message(report.longrepr[2], install)
    return report


def pytest_terminal_summary(terminalreporter):
    # Which real filesystem each full-disk test filled, or that it had none.
    used = [value for reports in terminalreporter.stats.values() for report in reports
            for key, value in getattr(report, "user_properties", ()) if key == "fullfs"]
    if used:
        terminalreporter.section("size-limited filesystems for full-disk tests")
        for test, how in used:
            terminalreporter.line(f"{test}: {how}")

ID_SCHEMA = Schema({"id": ("int64", ()), "x": ("float32", (4, 8))})


def id_sample(record_id: int) -> dict[str, np.ndarray]:
    """The sample for ``record_id``: its payload is derived from the id, so readers can check it."""
    rng = np.random.default_rng(record_id)
    return {"id": np.int64(record_id), "x": rng.standard_normal((4, 8)).astype(np.float32)}


def write_shards(cache: Cache, shard_records: list[int], first_id: int = 0) -> list[int]:
    """Publish one shard per entry of ``shard_records``; return every id written."""
    ids = []
    next_id = first_id
    for count in shard_records:
        with cache.writer() as writer:
            for _ in range(count):
                writer.write(id_sample(next_id))
                ids.append(next_id)
                next_id += 1
    return ids


def leases_after_teardown(cache: Cache, timeout: float = 10.0) -> int:
    """The cache's leases once a dropped TensorFlow iterator's teardown had time to end its epoch.

    TensorFlow runs a dataset's finalizer (growcache's leave) when the last reference to the C++
    iterator goes; after an error, a background thread of the pipeline may hold that reference
    for a moment after the Python iterator is gone, so the epoch ends just after, not at once.
    """
    import gc
    import time

    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        leases = cache.stats().leases
        if leases == 0 or time.monotonic() > deadline:
            return leases
        time.sleep(0.05)


def grow_while_down(path, first: set[str]) -> tuple[Cache, set[str]]:
    """A killed run's downtime: its cache at ``path`` grows past a budget of 1.5x what it holds
    and evicts, while the killed run's pin keeps the shards (all among ``first``, the epoch's
    snapshot) that the rest of its epoch reads. Returns the cache, reopened with that budget,
    and the paths of the pinned shards."""
    cache = Cache(path)
    cache = Cache(path, capacity=cache.stats().bytes * 3 // 2)
    [pin] = cache.pins()
    pinned = {s.path for s in cache.list_shards() if s.seq in pin["seqs"]}
    assert pinned and pinned <= first
    write_shards(cache, [40] * 12, first_id=10_000)
    assert cache.stats().evicted > 0 and pinned <= {s.path for s in cache.list_shards()}
    return cache, pinned


@pytest.fixture
def id_cache(tmp_path):
    """An empty cache with :data:`ID_SCHEMA` and a roomy budget."""
    return Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)


class LookCountingCache(Cache):
    """A cache that counts the snapshots taken of it (an epoch's looks for shards), and publishes
    a shard of 3 records (ids 0-2) just before look number ``publish_at``.

    It shows waiting by events, not by the clock: an epoch that waits for a first shard looks
    again and again, and reads the shard that appeared while it waited.
    """

    def __init__(self, path, publish_at: int | None = None) -> None:
        super().__init__(path, capacity="1GB", schema=ID_SCHEMA)
        self.looks = 0
        self.publish_at = publish_at

    def snapshot(self, **kwargs):
        self.looks += 1
        if self.looks == self.publish_at:
            write_shards(self, [3])
        return super().snapshot(**kwargs)


def named_semaphores() -> set[str]:
    """The names in ``/dev/shm`` of the named POSIX semaphores this process has open.

    A kill of the whole process group leaves these behind (see docs/pitfalls.md). glibc's
    ``sem_open`` maps each semaphore's file, so this process's maps list its own by inode
    (under a temporary name); those still linked under a name in ``/dev/shm`` are the ones that
    can leak. Other processes' (tests running beside this one) never count.
    """
    with open("/proc/self/maps") as maps:
        fields = (line.split() for line in maps)
        inodes = {int(f[4]) for f in fields if len(f) >= 6 and f[5].startswith("/dev/shm/sem.")}
    return {entry.name for entry in os.scandir("/dev/shm") if entry.name.startswith("sem.") and entry.inode() in inodes}


@contextlib.contextmanager
def ctrl_c_on_exit_or_kill(proc: subprocess.Popen):
    """Around a ``growcache`` command started with ``start_new_session=True``: the block presses
    Ctrl-C through the yielded function (SIGINT to the whole process group, as a terminal does,
    then the command's ``(stdout, stderr)``); whatever the block leaves running is SIGKILLed."""

    def ctrl_c(timeout: float = 120) -> tuple[str, str]:
        os.killpg(proc.pid, signal.SIGINT)
        return proc.communicate(timeout=timeout)

    try:
        yield ctrl_c
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
