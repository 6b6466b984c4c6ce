"""``growcache sample --tfrecord``: a bucket of existing TFRecord files through a cache from the command line.

The real console script, on a real local directory and on the moto S3 server, stopped with
Ctrl-C as a terminal sends it; the Python API's TFRecordShardSource is what it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
from conftest import ctrl_c_on_exit_or_kill
from stores import s3, s3_server  # noqa: F401
from tfrecords import compress, framed, labelled

from growcache import Cache, Schema
from growcache.cli import main
from growcache.records import iter_records
from growcache.shard_source import pass_progress

SHARDS = 4
RECORDS = 6
SCHEMA = Schema({"label": ("int64", (), "int64_list"), "x": ("uint8", (64,))})


def _exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "growcache")


def _remote_files() -> dict[str, bytes]:
    """Four TFRecord files, two of them GZIP-compressed, as TFRecordWriter writes them."""
    return {f"train-{k:05d}-of-{SHARDS:05d}": compress(framed([labelled(k, i) for i in range(RECORDS)]),
                                                        "GZIP" if k % 2 else None)
            for k in range(SHARDS)}


def _sample_until_every_shard_is_held(url: str, cache_dir: str, *flags: str) -> tuple[str, str]:
    """Run ``growcache sample --tfrecord`` until the cache holds every remote shard, then Ctrl-C it."""
    proc = subprocess.Popen([_exe(), "sample", "--tfrecord", url, cache_dir, "--workers", "2", "-q", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with ctrl_c_on_exit_or_kill(proc) as ctrl_c:
        deadline = time.monotonic() + 120
        while not any(p.held == SHARDS for p in (pass_progress(Cache(cache_dir)) if os.path.isdir(
                os.path.join(cache_dir, "shards")) else [])):
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"growcache sample exited ({proc.returncode}) early:\n{out}\n{err}")
            assert time.monotonic() < deadline, "the cache never held every remote shard"
            time.sleep(0.1)
        out, err = ctrl_c()  # a terminal's Ctrl-C reaches the samplers too
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out}\n{err}"
    return out, err


def _records_of(cache_dir: str) -> list[bytes]:
    return sorted(bytes(r) for shard in Cache(cache_dir).list_shards() for _, r in iter_records(shard.path))


def _expected() -> list[bytes]:
    return sorted(labelled(k, i) for k in range(SHARDS) for i in range(RECORDS))


def test_sample_tfrecord_copies_a_local_directory_of_tfrecord_files(tmp_path):
    remote = tmp_path / "bucket"
    remote.mkdir()
    for name, data in _remote_files().items():
        (remote / name).write_bytes(data)
    cache_dir = str(tmp_path / "cache")
    out, err = _sample_until_every_shard_is_held(f"file://{remote}/train-*", cache_dir, "--max-shard-records", "4")
    cache = Cache(cache_dir)
    assert cache.schema == SCHEMA  # inferred from the first file, as growcache import does
    assert _records_of(cache_dir) == _expected()  # every record once, byte for byte, GZIP files inflated
    assert max(s.records for s in cache.list_shards()) == 4  # --max-shard-records cut the remote files
    assert f"into {cache.path}; it holds {SHARDS * RECORDS} records" in out, out
    assert "Traceback" not in err, err


def test_sample_tfrecord_copies_an_s3_bucket_and_never_shows_the_secret(s3_server, s3, tmp_path):
    for name, data in _remote_files().items():
        s3.put(f"dataset/{name}", data)
    options = s3_server.storage_options()
    flags = ["--storage-option", f"client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}",
             "--storage-option", f"key={options['key']}", "--storage-option", f"secret={options['secret']}",
             "--schema", repr(SCHEMA)]
    cache_dir = str(tmp_path / "cache")
    out, err = _sample_until_every_shard_is_held(f"{s3.url}/dataset/train-*", cache_dir, *flags)
    assert _records_of(cache_dir) == _expected()
    assert options["secret"] not in out + err


def test_sample_tfrecord_wrong_input_names_the_fix(tmp_path, capsys):
    remote = tmp_path / "bucket"
    remote.mkdir()
    for name, data in _remote_files().items():
        (remote / name).write_bytes(data)
    arrays = tmp_path / "arrays"
    arrays.mkdir()
    np.save(arrays / "a.npy", np.zeros((8, 3), np.float32))
    tfrecords, npys, cache_dir = f"file://{remote}/train-*", f"file://{arrays}/*.npy", str(tmp_path / "cache")

    # Flags of the sample sources make no sense with whole shards: a usage error naming the clash.
    for flags, named in ((["--window", "4"], "--window"), (["--records", "10"], "--records"),
                         (["--dtype", "uint8", "--shape", "64"], "--dtype"), (["--feature", "y"], "--feature")):
        assert main(["sample", "--tfrecord", tfrecords, cache_dir, "-q", *flags]) == 2
        err = capsys.readouterr().err
        assert named in err and "--tfrecord" in err, err
    assert main(["sample", npys, cache_dir, "--window", "4", "--schema", repr(SCHEMA), "-q"]) == 2
    assert "--schema" in capsys.readouterr().err

    # TFRecord files sampled as arrays: the error says they are TFRecord files and which flag reads them.
    assert main(["sample", tfrecords, cache_dir, "--records", "4", "-q"]) == 1
    err = capsys.readouterr().err
    assert "TFRecord" in err and "--tfrecord" in err, err
    # .npy arrays given to --tfrecord: not TFRecord files, and the flag to drop.
    assert main(["sample", "--tfrecord", npys, cache_dir, "-q"]) == 1
    err = capsys.readouterr().err
    assert "a.npy" in err and "not a TFRecord file" in err and "drop --tfrecord" in err, err
    # Files that do not fit the cache's schema: one error before any worker starts.
    Cache(tmp_path / "other", capacity="1MB", schema=Schema({"x": ("float32", (4,))}))
    assert main(["sample", "--tfrecord", tfrecords, str(tmp_path / "other"), "-q"]) == 1
    err = capsys.readouterr().err
    assert "train-00000-of-00004" in err and "schema" in err, err
    assert not os.path.exists(os.path.join(cache_dir, "shards")) or Cache(cache_dir).list_shards() == []


def test_sample_help_describes_tfrecord(capsys):
    assert main(["sample", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--tfrecord" in text and "TFRecord files" in text and "Ctrl-C" in text


def test_ctrl_c_while_the_samplers_start_prints_no_traceback(tmp_path):
    # Spawned samplers unpickle their arguments before growcache's code runs in them: a Ctrl-C
    # there once printed a KeyboardInterrupt traceback per worker.
    remote = tmp_path / "bucket"
    remote.mkdir()
    for name, data in _remote_files().items():
        (remote / name).write_bytes(data)
    proc = subprocess.Popen([_exe(), "sample", "--tfrecord", f"file://{remote}/train-*", str(tmp_path / "cache"),
                             "--workers", "2", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with ctrl_c_on_exit_or_kill(proc) as ctrl_c:
        lines = []
        for line in proc.stderr:  # the pool logs this once it has started its workers' processes
            lines.append(line)
            if "sampler pool started" in line:
                break
        out, err = ctrl_c()
    err = "".join(lines) + err
    assert proc.returncode == 0, err
    assert "sampler pool started" in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err
