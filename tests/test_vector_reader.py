"""VectorReader, the vectorized reader of fixed-layout shards, against the record-by-record BatchReader.

Every test reads the same share with both readers and compares everything they produce:
each batch's rows (byte for byte), the order of batches, ``Skipped`` notes, and the error
that ends the read (type, file, offset, reason). Every read path of the vectorized reader
runs (the fused C loop; with numpy, payloads copied out of a read buffer, and read straight
into their rows), with heap
batches, with a shared-memory slab, and with batches at descending addresses (the last
two allow a window-wide view, which takes another copy path),
and with pieces small enough that every boundary case (a piece ending inside a window, a
window inside a piece) occurs.
"""

from __future__ import annotations

import os
import pickle
import platform
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _fullfs
import growcache.vector_reader as vector_reader
from conftest import ID_SCHEMA, id_sample, write_shards
from growcache import Cache, CorruptShardError, Schema
from growcache.batching import BatchReader, ReaderShare, Skipped
from growcache.example import ExampleCodec
from growcache.records import frame_pieces
from growcache.transport import BatchLayout, Slab
from growcache.vector_reader import VectorReader

MODES = ["fused", "copy", "direct"]


@pytest.fixture(params=[*MODES, "copy-gil-held", "direct-gil-held"])
def mode(request, monkeypatch):
    """Which path the vectorized reader takes, with small pieces so that they split windows;
    ``-gil-held``: its CRCs keep the GIL, as in a DataLoader worker."""
    mode, _, held = request.param.partition("-")
    _set_mode(monkeypatch, mode)
    if held:
        monkeypatch.setattr(BatchReader, "release_gil", False)
    return mode


def _set_mode(monkeypatch, mode: str, piece_bytes: int = 300) -> None:
    """``fused``: the C loop, with reads of ``piece_bytes // 4`` bytes, so that they end inside
    headers, payloads and footers; ``copy`` and ``direct``: the two numpy paths."""
    if mode == "fused" and not vector_reader.FUSED:
        _fused_loop_unavailable()
    monkeypatch.setattr(VectorReader, "fused", mode == "fused")
    monkeypatch.setattr(vector_reader, "_FUSED_PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(vector_reader, "_SCRATCH_BYTES", max(1, piece_bytes // 4))
    monkeypatch.setattr(vector_reader, "_DIRECT_BYTES", 1 if mode == "direct" else 1 << 40)
    monkeypatch.setattr(vector_reader, "_PIECE_BYTES", piece_bytes)


def _fused_loop_unavailable() -> None:
    """Skip a test of the fused loop where it cannot run; fail where it should have been built."""
    why = "growcache._frames is not built (no C compiler at install), or this CPU is not an x86-64 with SSE 4.2"
    if _fullfs.in_ci() or (platform.machine() in ("x86_64", "AMD64") and shutil.which("cc")):
        pytest.fail(f"{why}: the fused read loop must run here; reinstall with a C compiler on the PATH "
                    "(pip install -e . builds growcache/_frames.c)", pytrace=False)
    pytest.skip(why)


def test_the_fused_loop_is_built_where_it_can_be():
    if not vector_reader.FUSED:
        _fused_loop_unavailable()
    assert VectorReader.fused


def share_of(paths, records, quota: int = -1, seed: int = 0, cycle=()) -> ReaderShare:
    return ReaderShare(
        paths=np.array([os.fsencode(p) for p in paths], dtype=np.bytes_),
        records=np.array(records, dtype=np.int64),
        shards=np.arange(len(paths)),
        quota=quota,
        cycle=np.array(cycle, dtype=np.int64),
        shuffle_seed=seed,
    )


def cache_share(cache: Cache, **kwargs) -> ReaderShare:
    shards = cache.list_shards()
    return share_of([s.path for s in shards], [s.records for s in shards], **kwargs)


def _garbage(shape, dtype) -> np.ndarray:
    """An array whose bytes are not zero, so that a row never written cannot pass for one."""
    array = np.empty(shape, dtype)
    array.reshape(-1).view(np.uint8).fill(0xAB)
    return array


class _Downward:
    """Batches carved from one buffer, from its end down: a window's batches then sit at
    equally spaced, descending addresses (a slab hands them out ascending)."""

    def __init__(self, schema: Schema, batch_size: int, slots: int) -> None:
        self.layout = BatchLayout.from_schema(schema, batch_size)
        self.memory = np.zeros(slots * self.layout.slot_nbytes, np.uint8)
        self.free = list(range(slots))

    def acquire(self, rows):
        if not self.free:
            return None
        slot = self.free.pop()
        start = slot * self.layout.slot_nbytes
        return ("down", slot), self.layout.arrays(self.memory[start:start + self.layout.slot_nbytes], rows)

    def give_back(self, key):
        self.free.append(key[1])


ALLOCATORS = ["heap", "slab", "downward"]


def outcome(reader: BatchReader, share: ReaderShare, allocator: str = "heap") -> list:
    """Everything a read produces, comparable across readers; checks every batch is accounted for."""
    allocated, settled, out = [], [], []
    ring = None
    if allocator == "slab":
        ring = Slab(BatchLayout.from_schema(reader.schema, reader.batch_size), reader.window_batches + 1)
    elif allocator == "downward":
        ring = _Downward(reader.schema, reader.batch_size, reader.window_batches + 1)

    def allocate(rows):
        claimed = ring.acquire(rows) if ring is not None else None
        if claimed is None:
            claimed = (f"heap{len(allocated)}", {n: _garbage((rows, *s.shape), s.dtype) for n, s in reader.schema.items()})
        allocated.append(claimed[0])
        return claimed

    def release(key):
        settled.append(key)
        if ring is not None and not isinstance(key, str):
            ring.give_back(key)

    try:
        for item in reader.batches(share, allocate, release):
            if isinstance(item, Skipped):
                out.append(("skipped", item))
                continue
            key, arrays, rows = item
            out.append(("batch", rows, {n: a[:rows].tobytes() for n, a in arrays.items()}))
            release(key)
    except CorruptShardError as exc:
        out.append(("corrupt", exc.path, exc.offset, exc.reason))
    except Exception as exc:  # noqa: BLE001 - any other error must be the same error too
        out.append(("error", type(exc).__name__, str(exc)))
    else:
        assert sorted(map(str, allocated)) == sorted(map(str, settled)), "a batch was allocated and never settled"
    return out


def compare(schema, share, allocator="heap", **kwargs) -> tuple[list, VectorReader]:
    """Read ``share`` with both readers; assert equal outcomes; return it and the vector reader."""
    old = outcome(BatchReader(schema, **kwargs), share, allocator)
    new_reader = VectorReader(schema, **kwargs)
    new = outcome(new_reader, share, allocator)
    assert new == old
    return new, new_reader


def rows_of(result) -> int:
    return sum(item[1] for item in result if item[0] == "batch")


# -- schemas the suite already uses ------------------------------------------------------------
DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "float32", "float64", "complex64", "complex128"]


def _random_sample(schema: Schema, rng: np.random.Generator) -> dict:
    out = {}
    for name, spec in schema.items():
        raw = rng.integers(0, 256, max(spec.nbytes, 0), dtype=np.uint8)
        array = raw.view(spec.dtype).reshape(spec.shape) if spec.nbytes else np.zeros(spec.shape, spec.dtype)
        if spec.dtype.kind == "b":
            array = raw.astype(bool).reshape(spec.shape)
        out[name] = array
    return out


SCHEMAS = {
    "id": ID_SCHEMA,
    "dtypes": Schema({f"f_{d}": (d, (3, 2)) for d in DTYPES} | {"scalar": ("float64", ())}),
    "zero_dims": Schema({"empty": ("float32", (0, 3)), "x": ("float32", (5,)), "z": ("int16", (2, 0))}),
    "features_700": Schema({f"f{i:03d}": ("float32", (4,)) for i in range(700)}),
}


def _fill(cache: Cache, counts: list[int], seed: int = 0, big_endian: bool = False) -> None:
    rng = np.random.default_rng(seed)
    for count in counts:
        with cache.writer() as writer:
            for _ in range(count):
                sample = _random_sample(cache.schema, rng)
                if big_endian:
                    sample = {n: a.astype(a.dtype.newbyteorder(">")) for n, a in sample.items()}
                writer.write(sample)


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_matches_record_reader_on_every_schema(tmp_path, mode, name, allocator):
    schema = SCHEMAS[name]
    cache = Cache(tmp_path / "c", capacity="1GB", schema=schema)
    _fill(cache, [5, 0, 3, 9] if name != "features_700" else [3, 4])
    for batch_size, shuffle, drop_last, quota in [(1, 0, False, -1), (4, 0, False, -1), (3, 5, False, -1),
                                                  (4, 8, True, -1), (2, 3, False, 7)]:
        result, reader = compare(schema, cache_share(cache, quota=quota, seed=batch_size), allocator,
                                 batch_size=batch_size, shuffle_buffer=shuffle, drop_last=drop_last)
        assert rows_of(result) > 0
        assert reader.records_fast == reader.records_read > 0  # clean shards never fall back


def test_big_endian_input_reads_back_as_written(tmp_path, mode):
    schema = Schema({"x": ("int32", (4,)), "y": ("float64", (2, 2))})
    cache = Cache(tmp_path / "c", capacity="1GB", schema=schema)
    _fill(cache, [6], seed=3, big_endian=True)
    result, _ = compare(schema, cache_share(cache), batch_size=4)
    expected = [_random_sample(schema, rng) for rng in [np.random.default_rng(3)] for _ in range(6)]
    got = np.frombuffer(b"".join(item[2]["x"] for item in result), "<i4").reshape(6, 4)
    assert np.array_equal(got, np.stack([s["x"] for s in expected]))


def test_values_are_the_samples_written(tmp_path, mode):
    # Independent of the old reader: every id's payload is recomputed from the id.
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    ids = write_shards(cache, [7, 5, 9])
    result, reader = compare(ID_SCHEMA, cache_share(cache, seed=4), "slab", batch_size=4, shuffle_buffer=8)
    seen = []
    for _, rows, arrays in result:
        batch_ids = np.frombuffer(arrays["id"], np.int64)
        xs = np.frombuffer(arrays["x"], np.float32).reshape(rows, 4, 8)
        for record_id, x in zip(batch_ids.tolist(), xs):
            assert np.array_equal(x, id_sample(record_id)["x"])
        seen += batch_ids.tolist()
    assert sorted(seen) == ids and seen != ids  # every record once, shuffled
    assert reader.records_fast == len(ids)


def test_top_up_cycles_through_shards_as_the_record_reader_does(tmp_path, mode):
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [3, 4])
    share = cache_share(cache, quota=17, seed=2, cycle=[1, 0])
    result, _ = compare(ID_SCHEMA, share, batch_size=3, shuffle_buffer=4)
    assert rows_of(result) == 17


def test_int64_list_features_take_the_vectorized_path_in_growcache_shards_only(tmp_path):
    from tfrecords import bytes_feature, example, framed, int64_feature

    schema = Schema({"label": ("int16", (2,), "int64_list"), "x": ("float32", (3,))})
    cache = Cache(tmp_path / "c", capacity="1GB", schema=schema)
    with cache.writer() as writer:  # 10-byte varints: one layout whatever the values
        for i in range(6):
            writer.write({"label": np.array([i * 1000, -i], np.int16), "x": np.full(3, i, np.float32)})
    result, reader = compare(schema, cache_share(cache), batch_size=4, shuffle_buffer=8)
    assert reader.records_fast == 6 and rows_of(result) == 6
    # TensorFlow writes the shortest varints: records of several lengths, read record by record.
    records = [example([("label", int64_feature([i * 1000, -i])), ("x", bytes_feature(np.full(3, i, "<f4").tobytes()))])
               for i in range(6)]
    (tmp_path / "tf.tfrecord").write_bytes(framed(records))
    cache.add_shard(tmp_path / "tf.tfrecord")
    result, reader = compare(schema, cache_share(cache), batch_size=4)
    assert reader.records_fast == 6 and rows_of(result) == 12


# -- corruption -----------------------------------------------------------------------------
def _frame_of(cache: Cache) -> int:
    return ExampleCodec(cache.schema).record_nbytes + 16


def _flip(path: str, position: int, bit: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ bit]))


# kind -> (how to damage the 7-record shard, byte offset the error names, in frames; None: the file's end)
CORRUPTIONS = {
    "length": (lambda path, frame: _flip(path, 2 * frame + 1), 2),
    "length_crc": (lambda path, frame: _flip(path, 2 * frame + 9), 2),
    "structure": (lambda path, frame: _flip(path, 2 * frame + 13), 2),
    "payload": (lambda path, frame: _flip(path, 2 * frame + frame - 20), 2),
    "data_crc": (lambda path, frame: _flip(path, 2 * frame + frame - 2), 2),
    "truncated_mid_record": (lambda path, frame: os.truncate(path, 4 * frame + 30), 4),
    "truncated_at_a_record": (lambda path, frame: os.truncate(path, 4 * frame), 4),
    "bytes_appended": (lambda path, frame: open(path, "ab").write(b"\0" * frame), 7),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("on_corrupt", ["raise", "skip"])
@pytest.mark.parametrize("verify", [True, False])
def test_each_corruption_is_reported_at_the_same_file_and_offset(tmp_path, mode, corruption, on_corrupt, verify):
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [6, 7, 5])
    target = cache.list_shards()[1]
    damage, at = CORRUPTIONS[corruption]
    frame = _frame_of(cache)
    damage(target.path, frame)
    unchecked = corruption in ("payload", "data_crc", "structure") and not verify
    for shuffle in (0, 6):
        result, _ = compare(ID_SCHEMA, cache_share(cache, seed=5), batch_size=4, shuffle_buffer=shuffle,
                            on_corrupt=on_corrupt, verify=verify)
        reports = [(i[1].path, i[1].offset) if i[0] == "skipped" else (i[1], i[2])
                   for i in result if i[0] in ("corrupt", "skipped")]
        if unchecked:  # nothing checks the payload then: both readers deliver the same bytes
            assert corruption == "structure" or rows_of(result) == 18
            continue
        assert reports == [(target.path, at * frame)]
        window = 8 if shuffle else 4  # rows that come out together
        assert rows_of(result) == (18 - 7 + at if on_corrupt == "skip" else (6 + at) // window * window)


# A reader that neither reports the cut nor steps past it would spin on the empty read: the
# timeout turns that into a failure in seconds.
@pytest.mark.timeout(30)
@pytest.mark.parametrize("on_corrupt", ["raise", "skip"])
def test_a_shard_that_shrinks_during_the_read_is_reported_where_it_now_ends(tmp_path, mode, on_corrupt):
    # A file cut while a reader is inside it (a user's tool rewriting it in place): it passed
    # the size check at open, so only the read itself can find the end. Not comparable with
    # the record-by-record reader, whose buffered file may have read past the cut already.
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [12])
    path = cache.list_shards()[0].path
    cut = 9 * _frame_of(cache) + 30
    reader = VectorReader(ID_SCHEMA, batch_size=2, on_corrupt=on_corrupt)
    ids, reports = [], []
    batches = reader.batches(cache_share(cache), lambda rows: (None, {n: _garbage((rows, *s.shape), s.dtype)
                                                                      for n, s in ID_SCHEMA.items()}), lambda key: None)
    try:
        for item in batches:
            if isinstance(item, Skipped):
                reports.append((item.path, item.offset, item.reason))
                continue
            if not ids:
                os.truncate(path, cut)
            ids += item[1]["id"][:item[2]].tolist()
    except CorruptShardError as exc:
        reports.append((exc.path, exc.offset, exc.reason))
    assert reports == [(path, cut, "file shrank while it was read")]
    assert ids == list(range(9 if on_corrupt == "skip" else 8))  # every record before the cut, in order


# Payloads long enough for every loop of the fused CRC-and-copy (three streams of 8 KiB and of
# 256 bytes, then words and bytes), streamed past the cache (4 KiB or more) at rows that do not
# start on a 16-byte boundary; records then span several reads of the scratch buffer.
LARGE = Schema({"tag": ("uint8", (3,)), "big": ("uint8", (70001,)), "f": ("float32", (5003,)),
                "odd": ("uint8", (1000,))})


@pytest.mark.parametrize("scratch", [vector_reader._SCRATCH_BYTES, 256 << 10, 10_000, 4097])
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_fused_loop_on_large_payloads_matches_record_reader(tmp_path, monkeypatch, scratch, allocator):
    _set_mode(monkeypatch, "fused", piece_bytes=1 << 20)
    monkeypatch.setattr(vector_reader, "_SCRATCH_BYTES", scratch)
    cache = Cache(tmp_path / "c", capacity="1GB", schema=LARGE)
    _fill(cache, [5, 4, 6], seed=scratch)
    for batch_size, shuffle in [(4, 0), (3, 6)]:
        result, reader = compare(LARGE, cache_share(cache, seed=batch_size), allocator,
                                 batch_size=batch_size, shuffle_buffer=shuffle)
        assert rows_of(result) == 15 and reader.records_fast == 15


@pytest.mark.parametrize("where", [100, 8300, 16_700, 24_600, 50_000, 70_000, 75_000, 90_000])
def test_fused_loop_detects_a_flip_in_any_stream_of_a_large_payload(tmp_path, monkeypatch, where):
    """A bit flipped in each of the three CRC streams, in the short-block and word tails, and
    in the structure bytes between large payloads, is reported where the record reader reports it."""
    _set_mode(monkeypatch, "fused", piece_bytes=1 << 20)
    monkeypatch.setattr(vector_reader, "_SCRATCH_BYTES", 256 << 10)
    cache = Cache(tmp_path / "c", capacity="1GB", schema=LARGE)
    _fill(cache, [3, 4])
    frame = _frame_of(cache)
    assert 90_000 < frame - 4
    target = cache.list_shards()[1]
    _flip(target.path, frame + where)
    result, _ = compare(LARGE, cache_share(cache), batch_size=2, on_corrupt="raise")
    assert result[-1][:3] == ("corrupt", target.path, frame), result[-1][:3]


@pytest.mark.parametrize("delta", [0, 16, 100, 2047, 2048, 3000, 4095])
def test_fused_loop_places_and_checks_payloads_at_every_row_alignment(tmp_path, delta):
    """Each payload goes to a row at ``delta`` bytes (mod 4 KiB) from where it lies in the read
    buffer: the loop takes one fused pass or, where the two would alias (delta 0 included),
    two passes. Both place every byte and find a flipped one."""
    if not vector_reader.FUSED:
        _fused_loop_unavailable()
    schema = Schema({"x": ("uint8", (30_011,))})
    fixed = vector_reader._FixedFrames(ExampleCodec(schema))
    payloads = [np.random.default_rng(n).integers(0, 256, 30_011, np.uint8) for n in range(5)]
    path = tmp_path / "frames.tfrecord"
    _write_frames(path, [ExampleCodec(schema).encode({"x": x}) for x in payloads])
    _, scratch = vector_reader._aligned(1 << 20)  # holds the whole file: one read, from offset 0
    start = fixed.payloads[0][0]
    sources = [np.frombuffer(scratch, np.uint8).ctypes.data + n * fixed.frame + start for n in range(len(payloads))]
    rows = np.zeros((len(payloads), 30_011 + 8192), np.uint8)
    starts = [(source + delta - rows[n].ctypes.data) % 4096 for n, source in enumerate(sources)]
    addresses = np.array([rows[n].ctypes.data + at for n, at in enumerate(starts)], np.uint64)
    for address, source in zip(addresses, sources):
        assert (int(address) - source) % 4096 == delta

    def place():
        fd = os.open(path, os.O_RDONLY)
        try:
            return vector_reader._frames.place(fd, 0, len(payloads), fixed.template, fixed.segments, 1,
                                               addresses.tobytes(), scratch, True)
        finally:
            os.close(fd)

    assert place() == (len(payloads), vector_reader._PLACED)
    for n, at in enumerate(starts):
        assert np.array_equal(rows[n, at:at + 30_011], payloads[n]), n
    _flip(path, 3 * fixed.frame + start + 20_000)
    assert place() == (3, vector_reader._BAD_CRC)


@pytest.mark.parametrize("value", [0x07, 0xFF])  # a feature key renamed; a malformed key field
def test_a_record_damaged_under_a_valid_crc_mid_piece_is_counted_as_the_record_reader_does(tmp_path, mode, value):
    # The records of the piece placed before it count as read: the direct path counted them
    # lost when the record was of another schema (Skipped.records 7 where the record reader said 6).
    codec = ExampleCodec(ID_SCHEMA)
    records = [codec.encode(id_sample(i)) for i in range(9)]
    damaged = bytearray(records[3])
    damaged[8] = value  # in the structure, not a payload: the first key's bytes
    records[3] = bytes(damaged)
    path = tmp_path / "x.tfrecord"
    _write_frames(path, records)
    named = tmp_path / f"000000000001-9r-{os.path.getsize(path)}b.tfrecord"
    os.rename(path, named)
    for batch_size, shuffle_buffer in ((2, 0), (2, 6), (3, 4)):
        result, _ = compare(ID_SCHEMA, share_of([str(named)], [9]), batch_size=batch_size,
                            shuffle_buffer=shuffle_buffer, on_corrupt="skip")
        skipped = [item[1] for item in result if item[0] == "skipped"]
        assert len(skipped) == 1 and skipped[0].records == 6, result


VARINT_SCHEMA = Schema({"id": ("int64", (), "int64_list"), "labels": ("int16", (3,), "int64_list"),
                        "x": ("float32", (4, 8))})


@pytest.mark.parametrize("damage", ["unterminated", "too long", "four values"])
def test_a_broken_int64_list_under_a_valid_crc_is_named_at_its_record_and_skipped(tmp_path, mode, damage):
    # int64_list varints were decoded a window at a time when the window closed: a broken one
    # raised a SchemaError without file or offset there (maybe for a record of another shard of
    # the window), and on_corrupt="skip" closed the half-closed window again and raised anyway.
    codec = ExampleCodec(VARINT_SCHEMA)
    samples = [{"id": np.int64(i - 4), "labels": np.array([i, -i, 300], np.int16), "x": id_sample(i)["x"]}
               for i in range(9)]
    records = [codec.encode(sample) for sample in samples]
    at = next(offset for name, offset, _ in codec.layout if name == "labels")  # 3 values of 10 bytes each
    damaged = bytearray(records[3])
    if damage == "unterminated":
        damaged[at + 29] |= 0x80  # the last value's last byte
    elif damage == "too long":
        damaged[at + 9] |= 0x80  # the first value runs on into the second
    else:
        damaged[at + 28] &= 0x7F  # the third value ends a byte early: a fourth one follows
    records[3] = bytes(damaged)
    path = tmp_path / "x.tfrecord"
    _write_frames(path, records)
    named = str(tmp_path / f"000000000001-9r-{os.path.getsize(path)}b.tfrecord")
    os.rename(path, named)
    frame = os.path.getsize(named) // 9
    for batch_size, shuffle_buffer in ((2, 0), (2, 6), (3, 4), (4, 16)):
        result, _ = compare(VARINT_SCHEMA, share_of([named], [9]), batch_size=batch_size,
                            shuffle_buffer=shuffle_buffer, on_corrupt="skip")
        skipped = [item[1] for item in result if item[0] == "skipped"]
        assert len(skipped) == 1 and skipped[0].records == 6, result  # the 3 records before it are read
        assert rows_of(result) == 3, result
        result, _ = compare(VARINT_SCHEMA, share_of([named], [9]), batch_size=batch_size,
                            shuffle_buffer=shuffle_buffer)
        assert result[-1][:2] == ("corrupt", named), result
        if damage == "four values":  # well-formed varints, another count: off the schema, as a renamed feature
            assert result[-1][2] == 0 and "'labels'" in result[-1][3] and "4 values" in result[-1][3], result
        else:
            assert result[-1][2] == 3 * frame and "int64_list varint" in result[-1][3], result


def test_the_fused_loop_refuses_a_plan_whose_sizes_would_wrap(tmp_path):
    # Only a Python caller's plan can hold such numbers (file bytes are compared, never trusted),
    # but a wrapped product passed the bounds checks: the loop then ran on, or wrote past `rows`.
    if not vector_reader.FUSED:
        _fused_loop_unavailable()
    fixed = vector_reader._FixedFrames(ExampleCodec(ID_SCHEMA))
    _, scratch = vector_reader._aligned(1 << 16)
    (tmp_path / "empty").write_bytes(b"")  # the old loop ended here, placing nothing, instead of refusing
    plans = {
        "count * columns * 8": (0, 2**61, 1, np.zeros(2, np.uint64).tobytes()),  # 2**64: 0
        "count * frame": (0, 2**64 // fixed.frame + 1, 0, b""),
        "offset + count * frame": (2**62, 2**62 // fixed.frame + 1, 0, b""),
    }
    fd = os.open(tmp_path / "empty", os.O_RDONLY)
    try:
        for what, (offset, count, columns, addresses) in plans.items():
            with pytest.raises(ValueError, match="inconsistent frame plan"):
                vector_reader._frames.place(fd, offset, count, fixed.template, fixed.segments, columns, addresses,
                                            scratch, True)
    finally:
        os.close(fd)


def _foreign_record(codec: ExampleCodec, sample: dict) -> bytes:
    """The same Example with its features in reverse order, as other writers may emit it."""
    def entry(key: bytes, payload: bytes) -> bytes:
        def field(number: int, body: bytes) -> bytes:
            return bytes([number << 3 | 2]) + _varint(len(body)) + body
        return field(1, field(1, key) + field(2, field(1, field(1, payload))))
    body = b"".join(entry(n.encode(), np.ascontiguousarray(sample[n]).tobytes()) for n in reversed(list(codec.schema)))
    return b"\x0a" + _varint(len(body)) + body


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _records_of(path) -> list[bytes]:
    """The records of a file of valid frames (its CRCs are not checked)."""
    data, records, at = open(path, "rb").read(), [], 0
    while at < len(data):
        length = int.from_bytes(data[at:at + 8], "little")
        records.append(data[at + 12:at + 12 + length])
        at += 16 + length
    return records


def _write_frames(path, records: list[bytes]) -> None:
    with open(path, "wb") as f:
        for record in records:
            buffers, _ = frame_pieces([record])
            f.write(b"".join(bytes(b) for b in buffers))


def test_records_of_another_layout_and_length_take_the_record_path(tmp_path, mode):
    # An unnamed file (no count to check): fixed frames, then one of the same length in
    # another feature order, then records of other lengths from record 6 on.
    codec = ExampleCodec(ID_SCHEMA)
    records = [codec.encode(id_sample(i)) for i in range(6)]
    records[2] = _foreign_record(codec, id_sample(2))
    assert len(records[2]) == len(records[0]) and not codec.has_layout(records[2])
    # Longer by an unknown field of exactly one frame, so that the file's size still divides
    # into frames and the vectorized path starts, then meets a header it does not expect.
    frame = len(records[0]) + 16
    records += [records[0] + b"\x7a" + _varint(frame - 3) + b"\0" * (frame - 3), records[1]]
    records += [codec.encode(id_sample(i)) for i in range(8, 11)]
    path = tmp_path / "foreign.tfrecord"
    _write_frames(path, records)
    result, reader = compare(ID_SCHEMA, share_of([path], [len(records)], seed=1), batch_size=3, shuffle_buffer=4)
    assert rows_of(result) == 11
    assert 0 < reader.records_fast < 11


def test_a_named_shard_holding_a_record_of_another_length(tmp_path, mode):
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [5, 3])
    shard = cache.list_shards()[0]  # not the last: a reader stops at its quota, before a last shard's end
    codec = ExampleCodec(ID_SCHEMA)
    records = [codec.encode(id_sample(i)) for i in range(5)]
    records[3] = records[3] + b"\x78\x01"  # valid, 2 bytes longer: the file no longer fits its name
    _write_frames(shard.path, records)
    for on_corrupt in ("raise", "skip"):
        result, reader = compare(ID_SCHEMA, cache_share(cache), batch_size=2, on_corrupt=on_corrupt)
        reports = [i for i in result if i[0] in ("corrupt", "skipped")]
        assert len(reports) == 1 and shard.path in str(reports[0])
        assert reader.records_fast == (3 if on_corrupt == "skip" else 0)  # only the clean shard went fast


def test_a_directory_named_like_a_shard_fails_as_in_the_record_reader(tmp_path, mode):
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [3])
    shard = cache.list_shards()[0]
    fake = os.path.join(os.path.dirname(shard.path), "000000000099-3r-%db.tfrecord" % shard.nbytes)
    os.mkdir(fake)
    result, _ = compare(ID_SCHEMA, share_of([shard.path, fake], [3, 3]), batch_size=2, on_corrupt="skip")
    skipped = [item[1] for item in result if item[0] == "skipped"]
    assert [(s.path, s.offset, s.records) for s in skipped] == [(fake, 0, 3)] and rows_of(result) == 3, result
    result, _ = compare(ID_SCHEMA, share_of([shard.path, fake], [3, 3]), batch_size=2)
    assert result[-1][:3] == ("corrupt", fake, 0) and "cannot be read" in result[-1][3], result


def test_a_shard_deleted_while_its_epoch_reads_is_named_and_skipped_as_a_corrupt_one(tmp_path, mode):
    # Its lease keeps growcache's eviction off it, so a person or another machine's cleanup deleted
    # it: a bare FileNotFoundError, no fix, and on_corrupt="skip" did not apply.
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [3, 4, 5])
    shards = cache.list_shards()
    share = share_of([s.path for s in shards], [3, 4, 5])
    os.unlink(shards[1].path)
    result, _ = compare(ID_SCHEMA, share, batch_size=2, on_corrupt="skip")
    skipped = [item[1] for item in result if item[0] == "skipped"]
    assert [(s.path, s.records) for s in skipped] == [(shards[1].path, 4)] and rows_of(result) == 8, result
    result, _ = compare(ID_SCHEMA, share, batch_size=2)
    assert result[-1][:3] == ("corrupt", shards[1].path, 0), result
    with pytest.raises(CorruptShardError, match="deleted or replaced while this epoch's lease held it") as info:
        list(VectorReader(ID_SCHEMA, 2).batches(share, lambda n: (None, {
            "id": np.empty(n, np.int64), "x": np.empty((n, 4, 8), np.float32)})))
    assert "GROWCACHE_NODE" in str(info.value) and "verify --remove-corrupt" not in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).args == info.value.args  # as it crosses from a worker


# -- properties -------------------------------------------------------------------------------
@st.composite
def schemas(draw):
    count = draw(st.integers(1, 4))
    features = {}
    for index in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        features[f"f{index}"] = (dtype, shape)
    return Schema(features)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), counts=st.lists(st.integers(0, 12), min_size=1, max_size=3), data=st.data())
def test_property_random_schemas_read_identically(tmp_path_factory, monkeypatch, schema, counts, data):
    _set_mode(monkeypatch, data.draw(st.sampled_from(MODES)), data.draw(st.sampled_from([1, 300, 1 << 20])))
    root = tmp_path_factory.mktemp("prop")
    cache = Cache(root / "c", capacity="1GB", schema=schema)
    _fill(cache, counts, seed=data.draw(st.integers(0, 1000)))
    kwargs = dict(batch_size=data.draw(st.integers(1, 6)), shuffle_buffer=data.draw(st.sampled_from([0, 1, 5, 13])),
                  drop_last=data.draw(st.booleans()))
    quota = data.draw(st.sampled_from([-1, 0, 3, 11]))
    compare(schema, cache_share(cache, quota=quota, seed=data.draw(st.integers(0, 9))),
            data.draw(st.sampled_from(ALLOCATORS)), **kwargs)
    shutil.rmtree(root)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_random_corruption_is_reported_identically(tmp_path_factory, monkeypatch, data):
    _set_mode(monkeypatch, data.draw(st.sampled_from(MODES)), data.draw(st.sampled_from([1, 300, 1 << 20])))
    root = tmp_path_factory.mktemp("corrupt")
    schema = data.draw(st.sampled_from([ID_SCHEMA, VARINT_SCHEMA]))  # int64_list payloads: damage in varints
    cache = Cache(root / "c", capacity="1GB", schema=schema)
    counts = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
    if schema is ID_SCHEMA:
        write_shards(cache, counts)
    else:
        _fill(cache, counts, seed=data.draw(st.integers(0, 1000)))
    shards = cache.list_shards()
    for _ in range(data.draw(st.integers(1, 3))):
        shard = data.draw(st.sampled_from(shards))
        size = os.path.getsize(shard.path)
        kind = data.draw(st.sampled_from(["flip", "truncate", "overwrite", "reframe"]))
        records = _records_of(shard.path) if kind == "reframe" else []
        if records and all(records):  # a record's bytes changed under a valid frame and CRC
            index = data.draw(st.integers(0, len(records) - 1))
            record = bytearray(records[index])
            at = data.draw(st.integers(0, len(record) - 1))
            written = data.draw(st.binary(min_size=1, max_size=8))[:len(record) - at]
            record[at:at + len(written)] = written  # the same length: the shard's name still fits
            records[index] = bytes(record)
            _write_frames(shard.path, records)
        elif kind == "flip" and size:
            _flip(shard.path, data.draw(st.integers(0, size - 1)), 1 << data.draw(st.integers(0, 7)))
        elif kind == "truncate":
            os.truncate(shard.path, data.draw(st.integers(0, size)))
        elif size:
            at = data.draw(st.integers(0, size - 1))
            with open(shard.path, "r+b") as f:
                f.seek(at)
                f.write(data.draw(st.binary(min_size=1, max_size=24)))
    kwargs = dict(batch_size=data.draw(st.integers(1, 5)), shuffle_buffer=data.draw(st.sampled_from([0, 4, 9])),
                  on_corrupt=data.draw(st.sampled_from(["raise", "skip"])), verify=data.draw(st.booleans()))
    result, _ = compare(schema, cache_share(cache, seed=data.draw(st.integers(0, 9))),
                        data.draw(st.sampled_from(ALLOCATORS)), **kwargs)
    # Damage is a corrupt shard, named with its offset and skippable: never another error.
    assert not [item for item in result if item[0] == "error"], result
    shutil.rmtree(root)


@pytest.mark.parametrize("kind", [BatchReader, VectorReader])
def test_a_record_longer_than_the_schema_allows_is_refused_before_it_is_allocated(tmp_path, kind):
    # Without verify, one record of a sparse shard claimed 256 MiB: the reader allocated and read
    # all of it (a sparse file of terabytes: an OOM kill) before finding it no record of the schema.
    from growcache.records import frame_header

    path = str(tmp_path / "sparse.tfrecord")
    with open(path, "wb") as f:
        f.write(frame_header((256 << 20) - 16))
        f.truncate(256 << 20)  # a few real bytes
    reader = kind(ID_SCHEMA, 4, verify=False)
    got = outcome(reader, share_of([path], [1]))
    bound = ExampleCodec(ID_SCHEMA).max_record_bytes
    assert got == [("corrupt", path, 0, got[0][3])] and f"more than the {bound} bytes" in got[0][3], got
