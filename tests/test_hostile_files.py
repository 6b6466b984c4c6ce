"""Files written by strangers: `growcache import`, `growcache schema` and the shard source's
readers keep memory bounded, give every record one meaning, and answer bad values with
growcache's own errors naming the file and the offset (issue 29, and issue 32's odd inputs).

Memory is measured in a fresh interpreter (its own VmHWM), as tests/test_security.py does.
"""

from __future__ import annotations

import gzip
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tfrecords import _ld, bytes_feature, compress, example, float_feature, framed, int64_feature, labelled, tensor_proto

from growcache import Cache, CorruptShardError, Schema, SchemaError
from growcache._protowire import varint
from growcache import example as example_module
from growcache.example import ExampleCodec, RecordChecker
from growcache.importer import import_files, infer_schema
from growcache.records import frame_header, iter_records

LABELLED = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (64,))})
MiB = 1 << 20


def _peak_rss_of(code: str) -> tuple[int, str]:
    """Run ``code`` in a fresh interpreter: (its peak RSS above its start after imports, its stdout)."""
    script = (
        "import re, growcache, growcache.importer, growcache.shard_source, numpy\n"
        "def _hwm(): return int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024\n"
        "_BASE = _hwm()\n" + code + "\nprint('PEAK', _hwm() - _BASE)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    return int(result.stdout.rsplit("PEAK", 1)[1]), result.stdout


def _gzip_bomb(path, claimed: int) -> int:
    """A GZIP file whose first record header claims ``claimed`` bytes of zeros that follow;
    returns the file's size (about a thousandth of what it inflates to)."""
    zeros = bytes(MiB)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9) as f:
        f.write(frame_header(claimed))
        for _ in range(claimed // MiB):
            f.write(zeros)
    return os.path.getsize(path)


# -- bounded memory ------------------------------------------------------------------------------
def test_a_gzip_bomb_is_refused_in_bounded_memory_by_schema_import_and_the_shard_source(tmp_path):
    bomb = tmp_path / "bomb.tfrecord.gz"
    size = _gzip_bomb(bomb, 1 << 30)
    assert size < 2 * MiB  # 1 MB that inflates to 1 GiB: it cost 2.1 GB
    peak, out = _peak_rss_of(f"""
import growcache
from growcache.importer import import_files, infer_schema
try:
    infer_schema({str(bomb)!r})
except growcache.CorruptShardError as exc:
    print("SCHEMA", exc.offset, exc.reason)
report = import_files({str(bomb)!r}, {str(tmp_path / "cache")!r}, schema={LABELLED.to_dict()!r})
print("IMPORT", report.refused)
source = growcache.TFRecordShardSource({str(bomb)!r})
try:
    source.probe(growcache.Schema({LABELLED.to_dict()!r}))
except growcache.CorruptShardError as exc:
    print("PROBE", exc.offset)
""")
    assert "SCHEMA 0 a record of 1073741824 bytes, longer than the 67108864 bytes" in out, out
    assert "--max-record" in out and "PROBE 0" in out and "IMPORT [(" in out and "longer than" in out
    assert peak < 64 * MiB, f"a {size}-byte GZIP file took {peak / MiB:.0f} MiB"


def test_a_tiny_tensor_claiming_a_huge_shape_allocates_nothing(tmp_path):
    # 141 bytes: a float32 tensor of shape (16384, 16384) whose one float_val fills it (1 GiB).
    value = b"\x08\x01" + _ld(2, _ld(2, b"\x08" + varint(16384)) * 2) + _ld(5, np.float32(1).tobytes())
    record = example([("label", int64_feature([1])), ("t", bytes_feature(value))])
    (tmp_path / "a.tfrecord").write_bytes(framed([record] * 2))
    schema = Schema({"label": ("int64", (), "int64_list"), "t": ("float32", (4,), "tensor")})
    peak, out = _peak_rss_of(f"""
import growcache
from growcache.example import ExampleCodec, RecordChecker
from growcache.importer import import_files, infer_schema
schema = growcache.Schema({schema.to_dict()!r})
try:
    ExampleCodec(schema).decode({record!r})
except growcache.SchemaError as exc:
    print("DECODE", exc)
report = import_files({str(tmp_path / "a.tfrecord")!r}, {str(tmp_path / "cache")!r}, schema=schema)
print("IMPORT", report.refused)
try:
    infer_schema({str(tmp_path / "a.tfrecord")!r})
except growcache.SchemaError as exc:
    print("INFER", exc)
""")
    assert "DECODE feature 't': expected a serialized tensor of dtype float32 shape (4,), found dtype float32 " \
           "shape (16384, 16384)" in out, out
    assert "at byte offset 0" in out.split("IMPORT")[1] and "INFER" in out and "--max-record" in out
    assert peak < 64 * MiB, f"peak {peak / MiB:.0f} MiB for a 141-byte value"


def test_a_record_longer_than_the_schema_allows_is_refused_before_it_is_read(tmp_path):
    # A sparse file: one record that claims 512 MiB. The schema's records are under 200 bytes.
    path = tmp_path / "long.tfrecord"
    with open(path, "wb") as f:
        f.write(framed([labelled(0, 0)]) + frame_header(512 * MiB))
        f.truncate(os.path.getsize(path) + 512 * MiB + 4)
    peak, out = _peak_rss_of(f"""
from growcache.importer import import_files
report = import_files({str(path)!r}, {str(tmp_path / "cache")!r}, schema={LABELLED.to_dict()!r})
print("REFUSED", report.refused)
""")
    assert "REFUSED" in out and f"a record of {512 * MiB} bytes, longer than the" in out, out
    assert f"at byte offset {len(framed([labelled(0, 0)]))}" in out
    assert peak < 64 * MiB, f"peak {peak / MiB:.0f} MiB"


@pytest.mark.parametrize("compression, width, count", [
    ("GZIP", 2 * MiB, 40),  # inflates 1000-fold: was inflated by the 8 MiB chunk
    (None, 100_000, 300),  # small records: the read chunks and the writes dominate
])
def test_import_memory_stays_within_four_records_and_16_mib(tmp_path, compression, width, count):
    schema = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (width,))})
    codec = ExampleCodec(schema)
    records = [codec.encode({"label": i, "x": np.full(width, i % 7, np.uint8)}) for i in range(count)]
    (tmp_path / "big.tfrecord").write_bytes(compress(framed(records), compression))
    peak, out = _peak_rss_of(f"""
from growcache.importer import import_files
report = import_files({str(tmp_path / "big.tfrecord")!r}, {str(tmp_path / "cache")!r}, schema={schema.to_dict()!r},
                      capacity="1GB", max_shard_bytes="16MB")
print("IMPORTED", report.records, report.refused)
""")
    assert f"IMPORTED {count} []" in out, out
    bound = 4 * codec.max_record_bytes + 16 * MiB
    assert peak <= bound, f"peak {peak / MiB:.1f} MiB, bound {bound / MiB:.1f} MiB"


def test_without_a_schema_records_over_max_record_are_refused_with_a_clear_message(tmp_path, capsys):
    from growcache.cli import main

    (tmp_path / "a.tfrecord").write_bytes(framed([labelled(0, i) for i in range(3)]))
    assert main(["schema", str(tmp_path / "a.tfrecord"), "--max-record", "64"]) == 1
    err = capsys.readouterr().err
    assert "longer than the 64 bytes" in err and "at byte offset 0" in err, err
    assert "verify" not in err  # advice for a cache's shards, not for a file
    assert main(["schema", str(tmp_path / "a.tfrecord")]) == 0  # the default (64 MiB) takes them
    assert "'label'" in capsys.readouterr().out
    with pytest.raises(CorruptShardError, match="longer than the 64 bytes"):
        infer_schema(str(tmp_path / "a.tfrecord"), max_record_bytes=64)


# -- one meaning per record -----------------------------------------------------------------------
def _list_twice() -> bytes:
    # Feature { int64_list {value: 1} int64_list {value: 2} }: protobuf merges it into [1, 2].
    feature = _ld(3, _ld(1, varint(1))) + _ld(3, _ld(1, varint(2)))
    return example([("label", feature), ("x", bytes_feature(bytes(64)))])


def _key_twice() -> bytes:
    return example([("label", int64_feature([1])), ("x", bytes_feature(bytes(64))), ("label", int64_feature([2]))])


def _value_twice() -> bytes:
    entry = _ld(1, b"label") + _ld(2, int64_feature([1])) + _ld(2, int64_feature([2]))
    return _ld(1, _ld(1, entry) + _ld(1, _ld(1, b"x") + _ld(2, bytes_feature(bytes(64)))))


def _non_utf8_keys() -> bytes:
    # Two different keys that a lenient decode turns into one name ('\ufffd').
    body = b"".join(_ld(1, _ld(1, key) + _ld(2, int64_feature([i]))) for i, key in enumerate([b"\xff", b"\xfe"]))
    return _ld(1, body)


@pytest.mark.parametrize("record, fragment", [
    (_list_twice, "carries int64_list and then int64_list"),
    (_key_twice, "feature 'label' occurs twice"),
    (_value_twice, "two values"),
    (_non_utf8_keys, "is not UTF-8"),
])
def test_a_record_with_two_meanings_is_corrupt_for_the_codec_import_and_add_shard(tmp_path, record, fragment):
    schema, first = LABELLED, labelled(0, 0)
    if record is _non_utf8_keys:  # the one name a lenient decode gives both keys
        schema, first = Schema({"\ufffd": ("int64", (), "int64_list")}), example([("\ufffd", int64_feature([0]))])
    records = [first, record()]
    with pytest.raises(example_module.AmbiguousRecordError, match=fragment):
        ExampleCodec(schema).decode(records[1])
    with pytest.raises(CorruptShardError, match=fragment) as info:
        RecordChecker(ExampleCodec(schema), "f.tfrecord").check(records[1], 77)
    assert (info.value.path, info.value.offset) == ("f.tfrecord", 77)
    (tmp_path / "a.tfrecord").write_bytes(framed(records))
    report = import_files(str(tmp_path / "a.tfrecord"), tmp_path / "cache", schema=schema)
    (url, reason), = report.refused
    offset = len(framed(records[:1]))
    assert url.endswith("a.tfrecord") and fragment in reason and f"at byte offset {offset}" in reason
    cache = Cache(tmp_path / "cache")
    with pytest.raises(CorruptShardError, match=fragment):
        cache.add_shard(tmp_path / "a.tfrecord")
    assert cache.list_shards() == []


# -- values in files ------------------------------------------------------------------------------
def _half_tensor(bits: int) -> bytes:
    # float16 tensor of shape (1,) whose half_val (int32 bits) is ``bits``.
    return b"\x08\x13" + _ld(2, _ld(2, b"\x08\x01")) + b"\x68" + varint(bits)


@pytest.mark.parametrize("value, dtype, fragment", [
    (_half_tensor(70000), "float16", "not the bits of a float16"),
    (b"\x08\x06" + _ld(2, _ld(2, b"\x08\x01")) + b"\x38" + varint(300), "int8", "out of range for dtype int8"),
])
def test_a_bad_value_is_a_schema_error_naming_file_and_offset(tmp_path, value, dtype, fragment):
    schema = Schema({"t": (dtype, (1,), "tensor")})
    records = [example([("t", bytes_feature(tensor_proto(np.ones(1, dtype))))]), example([("t", bytes_feature(value))])]
    (tmp_path / "a.tfrecord").write_bytes(framed(records))
    with pytest.raises(SchemaError, match=f"f.tfrecord at byte offset 9: .*{fragment}"):
        RecordChecker(ExampleCodec(schema), "f.tfrecord").check(records[1], 9)
    report = import_files(str(tmp_path / "a.tfrecord"), tmp_path / "cache", schema=schema)
    (_, reason), = report.refused
    assert fragment in reason and f"at byte offset {len(framed(records[:1]))}" in reason


_FUZZ_SCHEMA = Schema({"label": ("int64", (), "int64_list"), "f": ("float32", (3,), "float_list"),
                       "t": ("float16", (2,), "tensor"), "x": ("uint8", (8,))})
_FUZZ_BASE = [
    example([("label", int64_feature([5])), ("f", float_feature([1, 2, 3], packed=False)),
             ("t", bytes_feature(b"\x08\x13" + _ld(2, _ld(2, b"\x08\x02")) + b"\x6a\x02\x01\x02")),
             ("x", bytes_feature(bytes(8)))]),
    ExampleCodec(_FUZZ_SCHEMA).encode({"label": 3, "f": np.ones(3, np.float32), "t": np.ones(2, np.float16),
                                       "x": np.zeros(8, np.uint8)}),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_FUZZ_BASE), st.lists(st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=4)),
                                             min_size=1, max_size=3))
def test_damaged_records_give_growcache_errors_only(base, patches):
    record = bytearray(base)
    for position, patch in patches:
        at = position % len(record)
        record[at:at + len(patch)] = patch
    try:
        RecordChecker(ExampleCodec(_FUZZ_SCHEMA), "f.tfrecord").check(bytes(record), 0)
    except (SchemaError, CorruptShardError) as exc:
        assert "f.tfrecord" in str(exc)


# -- import: skip bad files, say why, end with a summary (issue 32) -------------------------------
def test_a_bad_first_file_is_skipped_with_file_advice_and_the_rest_imported(tmp_path, caplog, capsys):
    from growcache.cli import main

    (tmp_path / "a.tfrecord").write_bytes(b"this is not a TFRecord file at all" * 4)
    (tmp_path / "b.tfrecord").write_bytes(framed([labelled(1, i) for i in range(4)]))
    with caplog.at_level(logging.WARNING, logger="growcache"):
        report = import_files(str(tmp_path / "*.tfrecord"), tmp_path / "cache")  # no schema: inferred from b
    assert (report.files, report.records, report.stopped) == (1, 4, None)
    (url, reason), = report.refused
    assert url.endswith("a.tfrecord") and "not a TFRecord file, or damaged" in reason and "byte offset 0" in reason
    assert "verify" not in reason and "on_corrupt" not in reason  # advice for cache shards, not for a file
    assert "skipped" in caplog.text and "a.tfrecord" in caplog.text
    assert main(["import", "-q", str(tmp_path / "a.tfrecord"), str(tmp_path / "cache2")]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "STOPPED: no file holds records" in out and "imported 0 files" in out


def test_a_full_disk_ends_the_import_with_a_summary(tmp_path, capsys):
    from _fullfs import size_limited_fs

    from growcache.cli import main

    for i in range(12):  # 12 files of ~100 KB on a 1 MiB filesystem
        (tmp_path / f"part-{i:02d}.tfrecord").write_bytes(framed([labelled(i, j, width=1000) for j in range(100)]))
    schema = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (1000,))})
    with size_limited_fs(str(tmp_path / "fs"), 1 << 20) as (fs, reason):
        if fs is None:
            pytest.skip(f"no size-limited filesystem here: {reason}")
        cache = os.path.join(fs, "cache")
        code = main(["import", "-q", str(tmp_path / "part-*"), cache, "--schema", repr(schema), "--capacity", "1GB"])
        out = capsys.readouterr().out
        assert code == 1 and "STOPPED: the disk of the cache is full" in out, out
        imported = Cache(cache).stats().records
        assert 0 < imported < 1200 and f"{imported} records" in out and "stopped early" in out
        assert sum(1 for s in Cache(cache).list_shards() for _ in iter_records(s.path)) == imported


def test_a_record_claiming_most_of_a_sparse_file_is_checked_in_bounded_pieces(tmp_path):
    # add_shard and iter_records held the whole claimed record (+1 GiB for 1 GiB) before its CRC failed.
    length = 256 * MiB
    path = tmp_path / "sparse.tfrecord"
    with open(path, "wb") as f:
        f.write(frame_header(length))
        f.truncate(length + 16)  # a hole: the disk holds next to nothing
    Cache(tmp_path / "cache", capacity="4GB", schema=LABELLED)
    peak, out = _peak_rss_of(f"""
import growcache
from growcache.records import iter_records
try:
    growcache.Cache({str(tmp_path / "cache")!r}).add_shard({str(path)!r})
except growcache.CorruptShardError as exc:
    print("ADD", exc.offset, exc.reason)
try:
    list(iter_records({str(path)!r}))
except growcache.CorruptShardError as exc:
    print("ITER", exc.offset, exc.reason)
""")
    assert "ADD 0 data CRC32C mismatch" in out and "ITER 0 data CRC32C mismatch" in out, out
    assert peak < 64 * MiB, f"peak {peak / MiB:.0f} MiB for a record claiming 256 MiB of a sparse file"


def test_a_file_gone_from_the_store_is_skipped_and_the_rest_imported(tmp_path):
    (tmp_path / "a.tfrecord").write_bytes(framed([labelled(0, i) for i in range(3)]))
    (tmp_path / "c.tfrecord").write_bytes(framed([labelled(2, i) for i in range(3)]))
    files = [str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord"), str(tmp_path / "c.tfrecord")]
    report = import_files(files, tmp_path / "cache", schema=LABELLED)
    assert (report.files, report.records, report.stopped) == (2, 6, None)
    (url, reason), = report.refused
    assert url.endswith("b.tfrecord") and "No such file" in reason
