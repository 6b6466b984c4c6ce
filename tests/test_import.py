"""Existing TFRecord files into a cache: import (plain, GZIP, ZLIB; local and remote), schema inference."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from stores import gcs, gcs_server, s3, s3_server  # noqa: F401
from tfrecords import bytes_feature, compress, example, float_feature, framed, int64_feature, labelled, tensor_proto

from growcache import Cache, CompressedFileError, CorruptShardError, Schema, SchemaError
from growcache.example import ExampleCodec
from growcache.importer import detect_compression, import_files, infer_schema, parse_schema
from growcache.records import iter_records

from conftest import ID_SCHEMA, write_shards

LABELLED = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (64,))})


def _records(cache: Cache) -> list[bytes]:
    return [bytes(r) for s in cache.list_shards() for _, r in iter_records(s.path)]


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_detect_compression(compression):
    data = compress(framed([labelled(0, i) for i in range(3)]), compression)
    assert detect_compression(data[:64]) == compression


def test_import_copies_records_unchanged_from_plain_gzip_and_zlib_files(tmp_path):
    expected = []
    for shard, compression in enumerate([None, "GZIP", "ZLIB"]):
        records = [labelled(shard, i) for i in range(7)]
        expected.extend(records)
        (tmp_path / f"part-{shard}.tfrecord").write_bytes(compress(framed(records), compression))
    report = import_files(str(tmp_path / "part-*"), tmp_path / "cache", schema=LABELLED, capacity="1MB",
                          max_shard_records=3)
    cache = Cache(tmp_path / "cache")
    assert (report.files, report.records, report.refused) == (3, 21, [])
    assert [s.records for s in cache.list_shards()] == [3, 3, 1] * 3
    assert _records(cache) == expected  # byte for byte, in file order
    codec = ExampleCodec(LABELLED)
    assert [int(codec.decode(r)["label"]) for r in _records(cache)][:8] == [0, 1, 2, 3, 4, 5, 6, 1000]


def test_import_into_a_cache_without_schema_stores_the_inferred_one(tmp_path, caplog):
    t = np.arange(6, dtype=np.int16).reshape(2, 3)
    records = [example([("i", int64_feature([i, -i])), ("f", float_feature([0.5])), ("t", bytes_feature(tensor_proto(t))),
                        ("raw", bytes_feature(bytes(12)))]) for i in range(4)]
    (tmp_path / "a.tfrecord").write_bytes(framed(records))
    with caplog.at_level(logging.WARNING, logger="growcache"):
        report = import_files(str(tmp_path / "a.tfrecord"), tmp_path / "cache")
    expected = Schema({"i": ("int64", (2,), "int64_list"), "f": ("float32", (), "float_list"),
                       "t": ("int16", (2, 3), "tensor"), "raw": ("uint8", (12,))})
    assert report.schema == expected and Cache(tmp_path / "cache").schema == expected
    assert "'raw'" in caplog.text and "carry no dtype" in caplog.text  # raw bytes: the dtype is a guess, said so
    out = ExampleCodec(expected).decode(_records(Cache(tmp_path / "cache"))[3])
    assert out["i"].tolist() == [3, -3] and np.array_equal(out["t"], t)


def test_a_file_that_disagrees_with_the_schema_is_refused_whole_and_named(tmp_path):
    good = [labelled(0, i) for i in range(4)]
    bad = good[:3] + [example([("label", float_feature([1.0])), ("x", bytes_feature(bytes(64)))])]
    (tmp_path / "a-good.tfrecord").write_bytes(framed(good))
    (tmp_path / "b-bad.tfrecord").write_bytes(framed(bad))
    report = import_files(str(tmp_path / "*.tfrecord"), tmp_path / "cache", schema=LABELLED, max_shard_records=2)
    assert report.files == 1 and report.records == 4
    (path, reason), = report.refused
    assert path.endswith("b-bad.tfrecord")
    offset = len(framed(good[:3]))
    assert f"at byte offset {offset}" in reason and "'label'" in reason and "float_list" in reason
    assert _records(Cache(tmp_path / "cache")) == good  # none of the refused file's records
    assert not [n for n in os.listdir(tmp_path / "cache" / "shards") if n.startswith(".tmp")]


def test_an_int64_value_out_of_range_is_refused_with_its_offset(tmp_path):
    records = [example([("label", int64_feature([v]))]) for v in (1, 255, 256)]
    (tmp_path / "a.tfrecord").write_bytes(framed(records))
    report = import_files(str(tmp_path / "a.tfrecord"), tmp_path / "cache",
                          schema=Schema({"label": ("uint8", (), "int64_list")}))
    (_, reason), = report.refused
    assert f"at byte offset {len(framed(records[:2]))}" in reason and "256 is out of range for dtype uint8" in reason


def test_a_corrupt_record_is_refused_with_its_offset(tmp_path):
    data = bytearray(framed([labelled(0, i) for i in range(3)]))
    frame = len(data) // 3
    data[frame + 30] ^= 0x40
    (tmp_path / "a.tfrecord").write_bytes(bytes(data))
    report = import_files(str(tmp_path / "a.tfrecord"), tmp_path / "cache", schema=LABELLED)
    (_, reason), = report.refused
    assert f"at byte offset {frame}" in reason and "data CRC32C mismatch" in reason


def test_a_truncated_gzip_file_is_refused(tmp_path):
    data = compress(framed([labelled(0, i) for i in range(50)]), "GZIP")
    (tmp_path / "a.tfrecord.gz").write_bytes(data[:-20])
    report = import_files(str(tmp_path / "a.tfrecord.gz"), tmp_path / "cache", schema=LABELLED)
    (_, reason), = report.refused
    assert "truncated" in reason


def test_add_shard_names_compression_and_the_import_command(tmp_path):
    path = tmp_path / "a.tfrecord.gz"
    path.write_bytes(compress(framed([labelled(0, i) for i in range(3)]), "GZIP"))
    cache = Cache(tmp_path / "cache", schema=LABELLED)
    with pytest.raises(CompressedFileError) as info:
        cache.add_shard(path)
    message = str(info.value)
    assert "GZIP-compressed" in message and "growcache import" in message and "remove-corrupt" not in message
    assert not cache.list_shards()


def test_add_shard_reads_int64_lists_and_range_checks_them(tmp_path):
    path = tmp_path / "a.tfrecord"
    path.write_bytes(framed([labelled(0, i) for i in range(3)]))
    cache = Cache(tmp_path / "cache", schema=LABELLED)
    assert cache.add_shard(path).records == 3
    small = Cache(tmp_path / "small", schema={"label": ("int8", (), "int64_list"), "x": ("uint8", (64,))})
    path.write_bytes(framed([labelled(0, 1), labelled(1, 2)]))
    with pytest.raises(SchemaError, match="1002 is out of range for dtype int8"):
        small.add_shard(path)


@pytest.mark.parametrize("records, fragment", [
    ([example([("v", int64_feature([1, 2]))]), example([("v", int64_feature([1, 2, 3]))])],
     "int64_list int64 shape (2,) in the record at byte offset 0 but int64_list int64 shape (3,)"),
    ([example([("v", bytes_feature(b"ab"))]), example([("v", bytes_feature(b"abc"))])], "VarLenFeature"),
    ([example([("v", bytes_feature(b"a", b"b"))])], "bytes_list with 2 values"),
    ([example([("v", int64_feature([1]))]), example([("w", int64_feature([1]))])], "differ from the first record's"),
])
def test_infer_schema_refuses_variable_features(tmp_path, records, fragment):
    (tmp_path / "a.tfrecord").write_bytes(framed(records))
    with pytest.raises(SchemaError) as info:
        infer_schema(str(tmp_path / "a.tfrecord"))
    assert fragment in str(info.value)


def test_parse_schema_reads_what_growcache_schema_prints():
    schema = Schema({"x": ("float32", (2, 3)), "label": ("int64", (), "int64_list")})
    assert parse_schema(repr(schema)) == schema
    assert parse_schema('{"label": ["int64", [], "int64_list"], "x": ["float32", [2, 3]]}') == schema
    with pytest.raises(SchemaError, match="cannot read a schema"):
        parse_schema("Schema(x=1")


@pytest.mark.parametrize("store_name", ["s3", "gcs"])
def test_import_from_object_stores(request, tmp_path, store_name):
    store = request.getfixturevalue(store_name)
    expected = []
    for shard, compression in enumerate([None, "GZIP"]):
        records = [labelled(shard, i) for i in range(5)]
        expected.extend(records)
        store.put(f"data/train-{shard:05d}-of-00002", compress(framed(records), compression))
    assert infer_schema(f"{store.url}/data/train-00001-of-00002", storage_options=store.storage_options) == \
        Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (64,))})
    report = import_files(f"{store.url}/data/train-*", tmp_path / "cache", storage_options=store.storage_options)
    assert report.records == 10 and not report.refused
    assert _records(Cache(tmp_path / "cache")) == expected


def test_missing_remote_files_say_so(s3, tmp_path):
    from growcache.errors import SourceError

    with pytest.raises(SourceError, match="no objects match"):
        import_files(f"{s3.url}/nothing-*", tmp_path / "cache", schema=LABELLED, storage_options=s3.storage_options)


def test_empty_file_is_refused(tmp_path):
    (tmp_path / "a.tfrecord").write_bytes(b"")
    report = import_files(str(tmp_path / "a.tfrecord"), tmp_path / "cache", schema=LABELLED)
    (_, reason), = report.refused
    assert "holds no records" in reason
    with pytest.raises(CorruptShardError, match="holds no records"):
        infer_schema(str(tmp_path / "a.tfrecord"))


def test_cli_schema_import_and_status(tmp_path, capsys):
    from growcache.cli import main

    (tmp_path / "a.tfrecord.gz").write_bytes(compress(framed([labelled(0, i) for i in range(5)]), "GZIP"))
    (tmp_path / "b.tfrecord").write_bytes(framed([labelled(1, i) for i in range(4)]))
    bad = framed([example([("label", float_feature([1.0])), ("x", bytes_feature(bytes(64)))])])
    (tmp_path / "c.tfrecord").write_bytes(bad)
    assert main(["schema", str(tmp_path / "a.tfrecord.gz")]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == "Schema({'label': ('int64', (), 'int64_list'), 'x': ('uint8', (64,))})"
    cache = str(tmp_path / "cache")
    assert main(["import", "-q", str(tmp_path / "*.tfrecord*"), cache, "--schema", printed,
                 "--max-shard-records", "2"]) == 1  # c.tfrecord is refused
    out = capsys.readouterr().out
    assert f"REFUSED {tmp_path / 'c.tfrecord'}" in out and "'label'" in out
    assert "imported 2 files: 9 records in 5 shards" in out
    assert main(["import", str(tmp_path / "b.tfrecord"), cache, "--schema", "{'x': 1"]) == 2
    assert main(["import", str(tmp_path / "b.tfrecord"), cache, "--max-shard-records", "0"]) == 2
    assert main(["schema", str(tmp_path / "missing.tfrecord")]) == 1


def test_status_shows_pass_progress(tmp_path, capsys):
    from growcache import TFRecordShardSource
    from growcache.cli import main
    from growcache.shard_source import FetchJob

    os.makedirs(tmp_path / "remote")
    for shard in range(3):
        (tmp_path / "remote" / f"train-{shard}").write_bytes(framed([labelled(shard, i) for i in range(2)]))
    cache = Cache(tmp_path / "cache", schema=LABELLED)
    source = TFRecordShardSource(str(tmp_path / "remote" / "train-*"))
    for shard in source.fetch(FetchJob(cache, 0, 0, lambda: False)):
        cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit)
    assert main(["status", cache.path]) == 0
    assert "pass 1, 1 of 3 shards fetched (0 in flight); the cache holds 1 of 3 whole" in capsys.readouterr().out


_WAITING_PIECE = """
import os, subprocess, sys, time
from growcache import Cache
from growcache.importer import _TempShard

cache = Cache(sys.argv[1])
data = open(sys.argv[2], "rb").read()
piece = _TempShard(cache, 0)
frame = len(data) // 3  # three records of one size
for i in range(3):
    piece.add(data, i * frame, (i + 1) * frame, i * frame)
copied = piece.finish()
time.sleep(3)  # three expiries: only a heartbeat keeps the piece young
other = dict(os.environ, GROWCACHE_NODE="another-machine")
other.pop("GROWCACHE_OWNER_EXPIRY")
subprocess.run([sys.executable, "-c", f"from growcache import Cache; Cache({cache.path!r}).prune()"], env=other,
               check=True)
info = cache._publish(copied.path, copied.records, copied.nbytes)
print(info.records)
"""


def test_an_imported_piece_waiting_to_publish_is_kept_alive_for_other_machines(tmp_path):
    # Pieces of an import (and of a TFRecordShardSource sampler) wait for the rest of their file or
    # for room; without a heartbeat, a process of another process table judged them abandoned
    # after the owner expiry and removed them, and their publish failed.
    source = Cache(tmp_path / "src", schema=ID_SCHEMA)
    write_shards(source, [3])
    cache = Cache(tmp_path / "cache", capacity="1MB", schema=ID_SCHEMA)
    done = subprocess.run([sys.executable, "-c", _WAITING_PIECE, cache.path, source.list_shards()[0].path],
                          env=dict(os.environ, GROWCACHE_OWNER_EXPIRY="1"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["3"], done.stderr[-2000:]
    assert [s.records for s in cache.list_shards()] == [3]


def test_a_store_that_ignores_byte_ranges_is_refused_not_imported_twice(tmp_path):
    # Python's own http.server answers a Range request with 200 and the whole file: read in
    # chunks, a 5 MB file came back once per chunk, and every record was published twice.
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    import contextlib

    from growcache import SourceError, TFRecordShardSource
    from growcache.shard_source import FetchJob

    served = tmp_path / "served"
    served.mkdir()
    (served / "big.tfrecord").write_bytes(framed([labelled(0, i, width=4096) for i in range(1300)]))  # > 4 MiB

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/big.tfrecord"
    try:
        report = import_files(url, str(tmp_path / "cache"), capacity="100MB")
        assert report.records == 0 and len(report.refused) == 1
        assert "ignores byte ranges" in report.refused[0][1] and "Range" in report.refused[0][1]
        # A shard source reading its shard in order (concurrency 1): the same chunked reads.
        cache = Cache(tmp_path / "copies", capacity="100MB", schema=infer_schema(str(served / "big.tfrecord")))
        job = FetchJob(cache, 0, 0, lambda: False, concurrency=1)
        with pytest.raises(SourceError, match="ignores byte ranges"):
            with contextlib.closing(TFRecordShardSource(url, chunk_bytes=4096).fetch(job)) as shards:
                for shard in shards:
                    cache._publish(shard.path, shard.records, shard.nbytes, before_publish=shard.commit)
        assert cache.list_shards() == []
    finally:
        server.shutdown()


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_file_cut_in_pieces_is_imported_whole_or_not_at_all(tmp_path, monkeypatch, failure):
    # Its second piece failed to publish (a full disk writing the cache's state, Ctrl-C): the first
    # stayed in the cache while the report said nothing of the file was kept, and importing it
    # again, as advised, held its records twice.
    source = tmp_path / "a.tfrecord"
    source.write_bytes(framed([labelled(0, i) for i in range(10)]))
    cache = Cache(tmp_path / "cache", capacity="10MB")
    publish, calls = Cache._publish, []

    def second_fails(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise failure
        return publish(self, *args, **kwargs)

    monkeypatch.setattr(Cache, "_publish", second_fails)
    if isinstance(failure, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            import_files(str(source), cache, max_shard_records=3)
    else:
        report = import_files(str(source), cache, max_shard_records=3)
        assert report.records == 0 and "nothing of that file was kept" in report.stopped
    assert len(calls) == 2 and Cache(cache.path).list_shards() == []
    assert [n for n in os.listdir(cache.shards_dir) if n.startswith(".")] == []  # no temporary left
    monkeypatch.undo()
    assert import_files(str(source), cache, max_shard_records=3).records == 10
    assert sum(s.records for s in Cache(cache.path).list_shards()) == 10
