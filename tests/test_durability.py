"""Every file a cache publishes is on disk before its name is: the data is fsynced before the
rename that publishes it, and the directory after, so a power failure brings back either the
old state or a whole new file, never a published name over missing data.

A power failure cannot be staged in a test; the order of the system calls is what makes the
guarantee, so the tests watch that order through ``os.fsync`` and ``os.replace`` (each still
does its real work) on real caches and files.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from tfrecords import framed, labelled

from conftest import ID_SCHEMA
from growcache import Cache, Schema
from growcache.importer import import_files
from growcache.manifest import atomic_write_bytes


@pytest.fixture
def calls(monkeypatch):
    """``("fsync", path)`` and ``("replace", src, dst)``, in the order they ran."""
    seen: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        real_replace(src, dst, **kwargs)
        seen.append(("replace", os.fspath(src), os.fspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return seen


def _published(calls: list[tuple[str, ...]], final: str) -> tuple[int, str]:
    """The index of the rename that published ``final``, and the name it had before."""
    (index,) = [i for i, c in enumerate(calls) if c[0] == "replace" and c[2] == final]
    return index, calls[index][1]


def _assert_durably_published(calls: list[tuple[str, ...]], final: str) -> None:
    index, temporary = _published(calls, final)
    assert ("fsync", temporary) in calls[:index], f"{final} was published before its data was fsynced: {calls}"
    directory = os.path.dirname(final)
    assert ("fsync", directory) in calls[index + 1:], f"{directory} was not fsynced after {final} was published"


def _write(cache: Cache, ids: range, **options) -> str:
    with cache.writer(**options) as writer:
        for i in ids:
            writer.write({"id": np.int64(i), "x": np.full(ID_SCHEMA["x"].shape, i, np.float32)})
    return cache.list_shards()[-1].path


def test_a_written_shard_is_fsynced_before_it_is_published_and_its_directory_after(tmp_path, calls):
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    _assert_durably_published(calls, _write(cache, range(5)))


def test_durable_false_leaves_the_shard_to_the_page_cache(tmp_path, calls):
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    path = _write(cache, range(5), durable=False)
    _, temporary = _published(calls, path)
    assert ("fsync", temporary) not in calls


def test_an_added_shard_is_fsynced_before_it_is_published(tmp_path, calls):
    source = Cache(tmp_path / "src", capacity="1GB", schema=ID_SCHEMA)
    path = _write(source, range(4))
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    calls.clear()
    _assert_durably_published(calls, cache.add_shard(path).path)


def test_imported_shards_are_fsynced_before_they_are_published(tmp_path, calls):
    (tmp_path / "part-0.tfrecord").write_bytes(framed([labelled(0, i) for i in range(7)]))
    schema = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (64,))})
    import_files(str(tmp_path / "part-*"), tmp_path / "c", schema=schema, capacity="1MB", max_shard_records=3)
    shards = Cache(tmp_path / "c").list_shards()
    assert len(shards) == 3
    for shard in shards:
        _assert_durably_published(calls, shard.path)


def test_a_metadata_file_is_replaced_whole_and_durably(tmp_path, calls):
    target = str(tmp_path / "state.json")
    atomic_write_bytes(target, b"{}")
    _assert_durably_published(calls, target)
    assert open(target, "rb").read() == b"{}"
