"""Security: hostile object names, planted credentials, planted pickles, file permissions.

* Object names from a remote store are only ever store paths: keys with ``../`` or an absolute
  path are sampled like any other, and nothing is written outside the cache directory.
* ``storage_options`` credentials never reach a log, an error message, ``stats()``, a ``repr``
  or the output of ``growcache sample`` and ``growcache status``.
* Nothing read from a cache is unpickled: pickles planted as metadata, state, a lease or a
  shard are refused with a clear error and never executed.
* A new cache and every file it creates are owner-only whatever the umask, unless
  ``Cache(mode=...)`` asks otherwise.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
import traceback

import numpy as np
import pytest
from stores import refused_port, s3, s3_server  # noqa: F401

from conftest import ID_SCHEMA, id_sample, write_shards
from growcache import Cache, CacheFormatError, CorruptShardError, SamplerError, SourceError
from growcache.example import ExampleCodec
from growcache.records import iter_records
from growcache.cli import run_sample_command
from growcache.sampler import SamplerPool
from growcache.shard import ShardInfo
from growcache.sources import ObjectSource, RetryPolicy

FAST = RetryPolicy(attempts=2, initial_delay=0.01, max_delay=0.02)


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _files(root) -> set[str]:
    return {os.path.join(d, n) for d, _, names in os.walk(root) for n in names}


# -- hostile object names -------------------------------------------------------------------
HOSTILE_KEYS = [
    "data/ok.npy",
    "data/../../evil.npy",
    "data/../../../../../tmp/growcache-evil.npy",
    "data/a/../../../../../../etc/growcache-evil.npy",
    "data//x/../../shards/000000000001-1r-1b.tfrecord.npy",
    "/abs/growcache-evil.npy",
]


def _naive_destinations(key: str, *bases: str) -> list[str]:
    """Where a careless ``os.path.join(base, key)`` would have written ``key``."""
    places = [os.path.normpath(os.path.join(base, key)) for base in bases]
    places += [os.path.normpath(os.path.join(base, os.path.basename(key))) for base in bases]
    return places + [os.path.normpath("/" + key.lstrip("/"))]


def test_hostile_object_names_are_sampled_and_never_become_local_paths(s3_server, s3, tmp_path, monkeypatch):
    for index, key in enumerate(HOSTILE_KEYS):
        s3.fs().pipe_file(f"{s3.url[5:]}/{key}", _npy(np.full(3, index, np.float32)))
    assert len(s3.fs().find(s3.url[5:])) == len(HOSTILE_KEYS)
    work = tmp_path / "work" / "a" / "b" / "c"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)  # a relative "../../evil.npy" would land inside tmp_path
    cache_dir = tmp_path / "deep" / "x" / "y" / "cache"
    before = _files(tmp_path)
    source = ObjectSource(f"{s3.url}/**/*.npy", storage_options=s3.storage_options)
    assert sorted(p.split("/", 1)[1] for p in source.paths()) == sorted(HOSTILE_KEYS), "every key is listed"
    cache = Cache(cache_dir, capacity="16MB", schema={"x": ("float32", (3,))})
    with SamplerPool(cache, source, workers=1, shard_size="4KB", max_shard_age=0.2) as pool:
        pool.wait_for(records=150, timeout=120)
    # The command line takes the same path: `growcache sample URL CACHE --storage-option ...`.
    cli_cache = tmp_path / "deep" / "cli-cache"
    assert run_sample_command(_sample_args(f"{s3.url}/**/*.npy", cli_cache, s3.storage_options, records=40)) == 0

    codec = ExampleCodec(cache.schema)
    values = {int(codec.decode(record)["x"][0]) for c in (cache, Cache(cli_cache)) for shard in c.list_shards()
              for _, record in iter_records(shard.path)}
    assert values == set(range(len(HOSTILE_KEYS))), "every hostile key was sampled, as a store path"
    created = _files(tmp_path) - before
    for path in created:
        assert path.startswith((str(cache_dir) + os.sep, str(cli_cache) + os.sep)), f"{path} is outside the cache"
    for c in (cache, Cache(cli_cache)):
        for path in _files(c.path):
            name = os.path.relpath(path, c.path)
            assert name in ("growcache.json", "state.json", ".lock") or (
                name.startswith("shards" + os.sep) and ShardInfo.from_path(path) is not None), name
    for key in HOSTILE_KEYS:
        for place in _naive_destinations(key, str(cache_dir), str(cache_dir / "shards"), str(work)):
            if place.startswith(str(cache_dir / "shards")) and ShardInfo.from_path(place):
                continue  # a published shard's own name
            assert not os.path.exists(place), f"{key!r} became the local file {place}"


def _sample_args(source: str, cache, storage_options: dict, **extra) -> argparse.Namespace:
    """`growcache sample` arguments as the parser produces them."""
    options = [f"{k}={v}" if isinstance(v, str) else f"{k}={json.dumps(v)}" for k, v in storage_options.items()]
    args = dict(source=source, cache=str(cache), capacity=16 * 10**6, workers=1, window=None, feature="x",
                dtype=None, shape=None, storage_option=options, records=None, shard_size=4096,
                max_shard_age=0.2, seed=0, quiet=True)
    args.update(extra)
    return argparse.Namespace(**args)


# -- planted credentials ----------------------------------------------------------------------
KEY = "PLANTEDKEYID7f3a"
SECRET = "PLANTED-s3cr3t-9d1e/c0ffee+5eed"


def _cli(*argv: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "growcache.cli", *argv], capture_output=True, text=True,
                          timeout=180, env=env)


def test_planted_credentials_appear_in_no_output(s3_server, s3, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, growcache's and the store libraries'
    s3.put("data/a.npy", _npy(np.ones(3, np.float32)))
    options = s3_server.storage_options(key=KEY, secret=SECRET)
    texts: dict[str, str] = {}

    # Sampling that works: the pool, its figures, the cache's figures.
    cache = Cache(tmp_path / "ok", capacity="16MB", schema={"x": ("float32", (3,))})
    source = ObjectSource(f"{s3.url}/data/*.npy", storage_options=options)
    pool = SamplerPool(cache, source, workers=1, shard_size="4KB", max_shard_age=0.2)
    with pool:
        pool.wait_for(records=20, timeout=120)
        texts["pool repr"] = repr(pool)
    texts.update({"source repr": repr(source), "pool stats": repr(pool.stats()), "cache stats": repr(cache.stats()),
                  "cache repr": repr(cache)})

    # Failures: a bucket that does not exist, a store that does not answer.
    for name, url, opts in [
        ("missing bucket", "s3://no-such-bucket-growcache/*.npy", options),
        ("dead store", f"{s3.url}/data/*.npy",
         dict(options, client_kwargs={"endpoint_url": f"http://127.0.0.1:{refused_port()}"})),
    ]:
        failing = ObjectSource(url, storage_options=opts, retry=FAST)
        with pytest.raises(SourceError) as direct:
            failing(np.random.default_rng(0))
        texts[f"{name}: error"] = "".join(traceback.format_exception(direct.value))
        cache_dir = tmp_path / name.replace(" ", "-")
        with pytest.raises(SamplerError) as info:
            with SamplerPool(Cache(cache_dir, capacity="16MB", schema={"x": ("float32", (3,))}), failing,
                             workers=1, max_restarts=0) as failed_pool:
                failed_pool.wait_for(records=1, timeout=120)
        texts[f"{name}: pool error"] = "".join(traceback.format_exception(info.value)) + info.value.worker_traceback
        texts[f"{name}: pool stats"] = repr(failed_pool.stats())

    # The command line: sample (working and failing, quiet and verbose) and status.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    flags = [f"--storage-option={o}" for o in _sample_args("", "", options).storage_option]
    cli_cache = str(tmp_path / "cli")
    quick = ["--shard-size=4KB", "--max-shard-age=0.2"]
    for name, argv in [
        ("sample", ["sample", f"{s3.url}/data/*.npy", cli_cache, "--records=20", *quick, *flags]),
        ("sample -v", ["-v", "sample", f"{s3.url}/data/*.npy", str(tmp_path / "cli-v"), "--records=20", *quick,
                       *flags]),
        ("sample missing bucket", ["sample", "s3://no-such-bucket-growcache/*.npy", str(tmp_path / "cli2"),
                                   "--records=1", *flags]),
        ("status", ["status", cli_cache]),
        ("verify", ["verify", "-q", cli_cache]),
    ]:
        result = _cli(*argv, env=env)
        texts[f"cli {name}"] = result.stdout + result.stderr
        assert result.returncode == (1 if "missing" in name else 0), texts[f"cli {name}"]
    assert "no-such-bucket-growcache" in texts["cli sample missing bucket"]
    texts["logs"] = "\n".join(f"{r.name}: {r.getMessage()}" for r in caplog.records)
    texts["growcache logs"] = "\n".join(f"{r.name}: {r.getMessage()}" for r in caplog.records
                                        if r.name.startswith("growcache"))

    assert {"botocore.endpoint", "s3fs"} <= {r.name for r in caplog.records}, "the store libraries' logs are grepped"
    for name, text in texts.items():
        assert SECRET not in text, f"the secret key leaked into {name}"
        # botocore's DEBUG logs of request headers name the access key id (never the secret):
        # see test_verbose_command_line_never_prints_the_access_key_id.
        if name not in ("logs", "cli sample -v"):
            assert KEY not in text, f"the access key id leaked into {name}"
    assert "s3://no-such-bucket-growcache" in texts["missing bucket: pool error"]
    assert "***" in texts["source repr"] and "127.0.0.1" in texts["dead store: error"]


# `-v` once set the root logger to DEBUG, and botocore's DEBUG log of each request's
# Authorization header (the access key id, never the secret) reached stderr.
def test_verbose_command_line_never_prints_the_access_key_id(s3_server, s3, tmp_path):
    s3.put("data/a.npy", _npy(np.ones(3, np.float32)))
    options = s3_server.storage_options(key=KEY, secret=SECRET)
    flags = [f"--storage-option={o}" for o in _sample_args("", "", options).storage_option]
    result = _cli("-v", "sample", f"{s3.url}/data/*.npy", str(tmp_path / "c"), "--records=5", "--max-shard-age=0.2",
                  "-q", *flags, env=dict(os.environ, PYTHONPATH=os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert KEY not in result.stdout + result.stderr


# -- planted pickles --------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates a directory: proof that something was unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant_metadata(cache: Cache, evil: bytes) -> None:
    with open(os.path.join(cache.path, "growcache.json"), "wb") as f:
        f.write(evil)
    Cache(cache.path)


def _plant_shard(cache: Cache, evil: bytes) -> None:
    path = os.path.join(cache.shards_dir, ShardInfo.file_name(99, 1, len(evil)))
    with open(path, "wb") as f:
        f.write(evil)
    report = cache.verify()
    for _ in iter_records(path):
        pass
    raise report.corrupt[0]


def _plant_added_shard(cache: Cache, evil: bytes) -> None:
    path = os.path.join(os.path.dirname(cache.path), "evil.tfrecord")
    with open(path, "wb") as f:
        f.write(evil)
    cache.add_shard(path)


@pytest.mark.parametrize("plant, error, fragment", [
    (_plant_metadata, CacheFormatError, "growcache.json is not valid JSON"),
    (_plant_shard, CorruptShardError, "000000000099-1r-"),
    (_plant_added_shard, CorruptShardError, "evil.tfrecord"),
], ids=["metadata", "shard", "added-shard"])
def test_planted_pickles_are_refused_never_unpickled(tmp_path, plant, error, fragment):
    cache = Cache(tmp_path / "cache", schema=ID_SCHEMA)
    write_shards(cache, [3])
    marker = str(tmp_path / "unpickled")
    evil = pickle.dumps(_Payload(marker))
    assert b"mkdir" in evil
    with pytest.raises(error, match=fragment):
        plant(cache, evil)
    assert not os.path.exists(marker), "a planted pickle was executed"


def test_planted_pickle_state_is_rebuilt_without_being_unpickled(tmp_path, caplog):
    # The counters can be derived from the shards present: a damaged state file is rebuilt.
    cache = Cache(tmp_path / "cache", schema=ID_SCHEMA)
    write_shards(cache, [3, 2])
    marker = str(tmp_path / "unpickled")
    with open(os.path.join(cache.path, "state.json"), "wb") as f:
        f.write(pickle.dumps(_Payload(marker)))
    with caplog.at_level("WARNING", logger="growcache"):
        stats = cache.stats()
    assert "state.json is not valid JSON" in caplog.text and "rebuilt" in caplog.text
    assert (stats.published, stats.shards) == (2, 2)
    assert not os.path.exists(marker), "a planted pickle was executed"


def test_planted_pickle_lease_expires_without_being_unpickled(tmp_path, caplog):
    # A damaged lease must not stop every publish and snapshot: it is treated as expired.
    cache = Cache(tmp_path / "cache", schema=ID_SCHEMA)
    write_shards(cache, [3])
    marker = str(tmp_path / "unpickled")
    planted = os.path.join(cache.path, "leases", f"{os.getpid()}-planted.json")
    with open(planted, "wb") as f:
        f.write(pickle.dumps(_Payload(marker)))
    with caplog.at_level("WARNING", logger="growcache"), cache.snapshot() as snapshot:
        assert len(snapshot) == 1 and cache.stats().leases == 1
    assert "planted.json is not valid JSON" in caplog.text and "treated as expired" in caplog.text
    write_shards(cache, [2], first_id=10)  # publishing still works
    Cache(cache.path)  # reopening removes expired leases
    assert not os.path.exists(planted) and not os.path.exists(marker)


# -- permissions ------------------------------------------------------------------------------
def _modes(cache: Cache, elsewhere) -> dict[str, int]:
    """Permission bits of the cache's directories and of every kind of file it creates."""
    write_shards(cache, [2])
    with cache.writer() as writer:
        writer.write(id_sample(7))
        modes = {"temporary shard": stat.S_IMODE(os.stat(writer.path).st_mode)}
    foreign = os.path.join(elsewhere, "foreign.tfrecord")
    with open(foreign, "wb") as f:
        f.write(open(cache.list_shards()[0].path, "rb").read())
    os.chmod(foreign, 0o644)  # a world-readable file added to the cache becomes the cache's
    added = cache.add_shard(foreign)
    with cache.snapshot():
        leases = os.path.join(cache.path, "leases")
        paths = {
            "cache dir": cache.path,
            "shards dir": cache.shards_dir,
            "leases dir": leases,
            "metadata": os.path.join(cache.path, "growcache.json"),
            "state": os.path.join(cache.path, "state.json"),
            "lock": os.path.join(cache.path, ".lock"),
            "shard": cache.list_shards()[0].path,
            "added shard": added.path,
            "lease": os.path.join(leases, os.listdir(leases)[0]),
        }
        modes.update({name: stat.S_IMODE(os.stat(path).st_mode) for name, path in paths.items()})
    return modes


@pytest.fixture
def no_umask():
    """Umask 0: owner-only permissions must come from growcache, not from the umask."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_new_cache_and_all_its_files_are_owner_only_whatever_the_umask(tmp_path, no_umask):
    modes = _modes(Cache(tmp_path / "c", schema=ID_SCHEMA), tmp_path)
    assert {name: oct(mode) for name, mode in modes.items() if mode & 0o077} == {}
    assert all(mode & 0o700 in (0o600, 0o700) for mode in modes.values())


def test_mode_argument_sets_directories_and_files(tmp_path, no_umask):
    modes = _modes(Cache(tmp_path / "c", schema=ID_SCHEMA, mode=0o750), tmp_path)
    dirs = {"cache dir", "shards dir", "leases dir"}
    assert {name: oct(mode) for name, mode in modes.items() if name in dirs} == {name: "0o750" for name in dirs}
    assert {name: oct(mode) for name, mode in modes.items() if name not in dirs} == {
        name: "0o640" for name in modes if name not in dirs}


@pytest.fixture
def usual_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_cache_a_group_shares_gets_its_mode_under_the_usual_umask(tmp_path, usual_umask):
    # os.mkdir and os.open take the umask off: Cache(mode=0o770) made 0o750 directories under
    # umask 022, and another member of the group failed its first snapshot with EACCES on leases/.
    from growcache.rendezvous import FileRendezvous

    cache = Cache(tmp_path / "c", schema=ID_SCHEMA, mode=0o770)
    FileRendezvous(cache.path, ("run",), 0, 2, file_mode=cache.file_mode, dir_mode=cache.dir_mode)
    modes = _modes(cache, tmp_path)
    dirs = {"cache dir": 0o770, "shards dir": 0o770, "leases dir": 0o770,
            "epochs dir": stat.S_IMODE(os.stat(os.path.join(cache.path, "epochs")).st_mode)}
    files = {name: modes[name] for name in ("metadata", "state", "lock", "lease", "added shard")}
    assert {name: oct(modes.get(name, mode)) for name, mode in dirs.items()} == {name: "0o770" for name in dirs}
    assert {name: oct(mode) for name, mode in files.items()} == {name: "0o660" for name in files}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_shard_and_stats_file_takes_the_caches_mode_whatever_the_umask(tmp_path, umask):
    # Shards (a writer's, an added copy's, an import's) and the samplers' stats files were created
    # with the umask taken off: under 077, mode=0o770 made 0o600 shards the group could not read.
    from growcache import _sampler_stats
    from growcache.importer import import_files

    old = os.umask(umask)
    try:
        cache = Cache(tmp_path / "c", schema=ID_SCHEMA, mode=0o770)
        modes = _modes(cache, tmp_path)
        import_files(cache.list_shards()[0].path, cache)
        _sampler_stats.write(cache.path, 0, {"records": 1}, dir_mode=cache.dir_mode, file_mode=cache.file_mode)
        stats = _sampler_stats.stats_path(cache.path, 0)
        imported = max(cache.list_shards(), key=lambda s: s.seq).path
    finally:
        os.umask(old)
    modes.update({"imported shard": stat.S_IMODE(os.stat(imported).st_mode),
                  "stats file": stat.S_IMODE(os.stat(stats).st_mode),
                  "stats dir": stat.S_IMODE(os.stat(os.path.dirname(stats)).st_mode)})
    dirs = {"cache dir", "shards dir", "leases dir", "stats dir"}
    assert {name: oct(mode) for name, mode in modes.items()} == {
        name: "0o770" if name in dirs else "0o660" for name in modes}


def _id_sample(rng):
    return id_sample(int(rng.integers(0, 1000)))


def test_the_sampler_stats_files_take_the_caches_mode(tmp_path, no_umask):
    # They were owner-only whatever the cache's mode: in a cache a group shares, another member's
    # `growcache status` saw no samplers, and its own pools could not write theirs.
    import time

    from growcache import _sampler_stats

    cache = Cache(tmp_path / "c", capacity="64MB", schema=ID_SCHEMA, mode=0o770)
    folder = os.path.join(cache.path, _sampler_stats.DIRECTORY)
    with SamplerPool(cache, _id_sample, workers=1, shard_size="4KB") as pool:
        deadline = time.monotonic() + 60
        while not (os.path.isdir(folder) and os.listdir(folder)) and time.monotonic() < deadline:
            time.sleep(0.1)
        (name,) = os.listdir(folder)
        modes = (stat.S_IMODE(os.stat(folder).st_mode), stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode))
        pool.stop()
    assert (oct(modes[0]), oct(modes[1])) == ("0o770", "0o660")


def test_prune_removes_the_stats_files_of_pools_long_gone_and_nothing_else(tmp_path):
    # One file per killed pool (and a write temporary, where the kill fell mid-write) piled up
    # for good: readers pass them over by age, nothing removed them.
    import time

    from growcache import _sampler_stats

    cache = Cache(tmp_path / "c", capacity="64MB", schema=ID_SCHEMA)
    folder = os.path.join(cache.path, _sampler_stats.DIRECTORY)
    os.mkdir(folder, 0o700)
    old = time.time() - _sampler_stats.STALE_S - 60
    names = {"dead": "host-101-0.json", "dead-temporary": "host-101-0.json." + "ab" * 16 + ".tmp",
             "live": "host-102-0.json", "not ours": "notes.txt"}
    for kind, name in names.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write("{}")
        if kind != "live":
            os.utime(os.path.join(folder, name), (old, old))
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    os.utime(outside, (old, old))
    os.symlink(outside, os.path.join(folder, "host-103-0.json"))  # never followed, never removed through
    cache.prune()
    assert sorted(os.listdir(folder)) == ["host-102-0.json", "host-103-0.json", "notes.txt"]
    assert outside.exists()


def test_a_numeric_credential_is_masked_too():
    # The CLI parses --storage-option values as JSON, so password=81234567 arrives as an int.
    from growcache._retry import Redactor

    options = {"password": 81234567, "client_kwargs": {"token": 3}, "anon": False}
    redact = Redactor(options)
    shown = redact.options_repr(options)
    assert "81234567" not in shown and "'password': '***'" in shown and "'anon': False" in shown
    assert redact("cannot open with password 81234567 (attempt 3)") == "cannot open with password *** (attempt 3)"


# -- hostile cache contents and hard kills (issue 17) -----------------------------------------
def _shard_digests(cache: Cache) -> dict[str, str]:
    import hashlib

    return {s.path: hashlib.sha256(open(s.path, "rb").read()).hexdigest() for s in cache.list_shards()}


def _peak_rss_of(code: str) -> tuple[int, str]:
    """Run ``code`` in a fresh interpreter; return (its peak RSS in bytes, its stdout).

    The peak is the interpreter's own VmHWM, not ``ru_maxrss``: Linux carries ``ru_maxrss``
    across exec, so a child of a large pytest process starts out with the parent's peak.
    """
    script = code + (
        "\nimport re; print('PEAK', int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    peak = int(result.stdout.rsplit("PEAK", 1)[1])
    return peak, result.stdout


def test_a_crafted_length_is_refused_before_any_allocation_by_every_core_reader(tmp_path):
    # 112 bytes whose length field has a valid CRC and claims 2**40 bytes (TensorFlow's own
    # reader dies with SIGSEGV on it): growcache's readers and verify report it, allocate nothing.
    from growcache.records import frame_header

    cache = Cache(tmp_path / "c", capacity="1MB", schema=ID_SCHEMA)
    write_shards(cache, [2])
    crafted = os.path.join(cache.shards_dir, ShardInfo.file_name(5, 1, 112))
    with open(crafted, "wb") as f:
        f.write(frame_header(2**40) + bytes(100))
    peak, out = _peak_rss_of(f"""
import growcache
from growcache.records import iter_records
report = growcache.Cache({cache.path!r}).verify()
print("CORRUPT", [(c.path, c.offset) for c in report.corrupt])
try:
    list(iter_records({crafted!r}))
except growcache.CorruptShardError as exc:
    print("RAISED", exc.path, exc.offset)
""")
    assert f"CORRUPT [({crafted!r}, 0)]" in out and f"RAISED {crafted} 0" in out, out
    assert peak < 512 << 20, f"peak RSS {peak >> 20} MiB"


def test_verify_checks_a_huge_claimed_record_in_bounded_memory(tmp_path):
    # A sparse file whose one record claims 1 GiB: verify used to allocate all of it first.
    from growcache.records import frame_header

    cache = Cache(tmp_path / "c", capacity="4GB", schema=ID_SCHEMA)
    length = 1 << 30
    path = os.path.join(cache.shards_dir, ShardInfo.file_name(1, 1, length + 16))
    with open(path, "wb") as f:
        f.write(frame_header(length))
        f.truncate(length + 16)  # a hole: the disk holds next to nothing
    peak, out = _peak_rss_of(f"""
import growcache
report = growcache.Cache({cache.path!r}).verify()
print("REPORT", report.shards, [(c.path, c.offset, c.reason) for c in report.corrupt])
""")
    assert f"REPORT 1 [({path!r}, 0, 'data CRC32C mismatch (corrupt record payload)')]" in out, out
    assert peak < 256 << 20, f"verify peaked at {peak >> 20} MiB for a 1 GiB record"


def _plant_irregular_entries(cache: Cache, outside: str) -> dict[str, str]:
    """A directory and a symbolic link named like shards (the directory as the oldest entry),
    and a directory and a link named like leases; the links point at files outside the cache."""
    os.makedirs(outside, exist_ok=True)
    target = os.path.join(outside, "precious.tfrecord")
    with open(target, "wb") as f:
        f.write(open(cache.list_shards()[0].path, "rb").read())
    lease_target = os.path.join(outside, "precious.json")
    with open(lease_target, "w") as f:
        json.dump({"pid": 999999, "start_time": 1, "seqs": [1]}, f)
    planted = {
        "dir shard": os.path.join(cache.shards_dir, ShardInfo.file_name(0, 1, 100)),
        "link shard": os.path.join(cache.shards_dir, ShardInfo.file_name(90, 1, os.path.getsize(target))),
        "dir lease": os.path.join(cache.path, "leases", "1-dir.json"),
        "link lease": os.path.join(cache.path, "leases", "2-link.json"),
    }
    os.mkdir(planted["dir shard"])
    os.symlink(target, planted["link shard"])
    os.mkdir(planted["dir lease"])
    os.symlink(lease_target, planted["link lease"])
    return planted


def test_non_regular_entries_are_reported_and_never_read_evicted_or_followed(tmp_path):
    cache = Cache(tmp_path / "c", capacity=3 * 1456, schema=ID_SCHEMA)  # 3 shards of 8 records
    write_shards(cache, [8, 8])
    outside = str(tmp_path / "outside")
    planted = _plant_irregular_entries(cache, outside)
    before = {name: open(os.path.join(outside, name), "rb").read() for name in os.listdir(outside)}
    seqs = [s.seq for s in cache.list_shards()]
    assert seqs == [1, 2]
    with cache.snapshot() as snapshot:
        assert [s.seq for s in snapshot] == [1, 2]
    write_shards(cache, [8, 8], first_id=100)  # evicts shard 1, with the directory as the oldest entry
    assert [s.seq for s in cache.list_shards()] == [2, 3, 4]
    assert [s.seq for s in cache.prune(to=0)] == [2, 3, 4]
    write_shards(cache, [8], first_id=200)
    report = cache.verify()
    assert report.corrupt == [] and report.shards == 1 and not report.ok
    assert sorted(report.irregular) == sorted(planted.values())
    assert sorted(cache.stats().irregular) == sorted(planted.values())
    assert all(os.path.lexists(p) for p in planted.values()), "growcache never deletes what it did not write"
    assert {name: open(os.path.join(outside, name), "rb").read() for name in os.listdir(outside)} == before
    from growcache.cli import main

    assert main(["verify", "-q", cache.path]) == 1
    assert main(["status", cache.path]) == 0


@pytest.mark.parametrize("which", ["leases", "shards"])
def test_a_symlinked_leases_or_shards_directory_is_refused(tmp_path, which):
    cache = Cache(tmp_path / "c", schema=ID_SCHEMA)
    write_shards(cache, [2])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "settings.json").write_text('{"keep": true}')
    (outside / "123-notes.json").write_text('{"pid": 999999, "seqs": [1]}')
    (outside / ShardInfo.file_name(1, 2, 10)).write_bytes(b"0123456789")
    before = sorted(os.listdir(outside))
    moved = tmp_path / f"old-{which}"
    os.rename(os.path.join(cache.path, which), moved)
    os.symlink(outside, os.path.join(cache.path, which))
    for action in (lambda: Cache(cache.path), lambda: cache.prune(to=0), lambda: write_shards(cache, [2])):
        with pytest.raises(CacheFormatError, match=f"{which} is a symbolic link.*Replace it with a directory"):
            action()
    assert sorted(os.listdir(outside)) == before
    assert (outside / "settings.json").read_text() == '{"keep": true}'


def test_add_shard_moves_no_outside_file_and_copies_a_links_content(tmp_path, id_cache, no_umask):
    write_shards(id_cache, [3])
    good = open(id_cache.list_shards()[0].path, "rb").read()
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "data.tfrecord"
    target.write_bytes(good)
    os.chmod(target, 0o644)
    link = tmp_path / "link.tfrecord"
    os.symlink(target, link)
    info = id_cache.add_shard(link, move=True)
    assert not os.path.lexists(link), "move=True takes the link itself away"
    assert target.read_bytes() == good and stat.S_IMODE(os.stat(target).st_mode) == 0o644
    assert stat.S_ISREG(os.lstat(info.path).st_mode) and os.stat(info.path).st_ino != os.stat(target).st_ino
    target.write_bytes(b"rewritten from outside")
    assert open(info.path, "rb").read() == good, "the published shard shares nothing with the outside file"
    # A hard link is not moved either: the other name could rewrite the shard.
    other = outside / "other-name.tfrecord"
    source = tmp_path / "hard.tfrecord"
    source.write_bytes(good)
    os.link(source, other)
    info = id_cache.add_shard(source, move=True)
    assert os.stat(info.path).st_ino != os.stat(other).st_ino and not source.exists()
    # A refused file keeps its mode, even when moved in and back.
    bad = outside / "bad.tfrecord"
    bad.write_bytes(good[:-3])
    os.chmod(bad, 0o644)
    bad_link = tmp_path / "bad-link.tfrecord"
    os.symlink(bad, bad_link)
    for path in (bad_link, bad):
        with pytest.raises(CorruptShardError):
            id_cache.add_shard(path, move=True)
        assert stat.S_IMODE(os.stat(bad).st_mode) == 0o644 and os.path.lexists(path)


@pytest.mark.parametrize("kind", ["directory", "fifo", "/dev/zero", "/dev/null"])
def test_add_shard_refuses_what_is_not_a_regular_file(tmp_path, id_cache, kind):
    from growcache.errors import RefusedFileError

    path = str(tmp_path / "thing.tfrecord")
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)  # opening one for reading would wait for a writer forever
    else:
        os.symlink(kind, path)
    for move in (False, True):
        with pytest.raises(RefusedFileError, match="not a regular file"):
            id_cache.add_shard(path, move=move)
        assert os.path.lexists(path)
    assert id_cache.list_shards() == [] and os.listdir(id_cache.shards_dir) == []


def test_add_shard_refuses_a_leased_shard_and_one_of_its_own(tmp_path, id_cache):
    from growcache.errors import RefusedFileError

    other = Cache(tmp_path / "other", schema=ID_SCHEMA)
    write_shards(other, [3])
    write_shards(id_cache, [2], first_id=100)
    shard = other.list_shards()[0]
    child = subprocess.Popen([sys.executable, "-c", f"import growcache, time; s = growcache.Cache({other.path!r})"
                              ".snapshot(holder='reader'); print(len(s), flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "1"
        for move in (True, False):
            with pytest.raises(RefusedFileError, match="live lease still holds.*'reader'"):
                id_cache.add_shard(shard.path, move=move)
        assert os.path.exists(shard.path)
    finally:
        child.kill()
        child.wait()
    assert id_cache.add_shard(shard.path).records == 3  # the lease ended: a copy is fine
    with pytest.raises(RefusedFileError, match="already a shard of cache"):
        id_cache.add_shard(id_cache.list_shards()[0].path, move=True)


_SLAB_OWNER = """
import sys, time
from growcache.transport import BatchLayout, Slab
slab = Slab(BatchLayout.build([("x", "float32", (256,))], 64), slots=4, anonymous=False)
print(slab.name, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("next_start", ["cache open", "prune", "loader start"])
def test_shared_memory_of_a_killed_process_group_is_removed_at_the_next_start(tmp_path, next_start):
    # scancel, docker kill and OOM kills take the whole process group, resource tracker included.
    import fcntl
    import signal

    from growcache.transport import BatchLayout, Slab

    cache = Cache(tmp_path / "c", schema=ID_SCHEMA)
    child = subprocess.Popen([sys.executable, "-c", _SLAB_OWNER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    name = child.stdout.readline().strip()
    assert name and os.path.exists(f"/dev/shm/{name}")
    Cache(cache.path)  # the owner lives: its segment stays
    assert os.path.exists(f"/dev/shm/{name}")
    # Across the kill this process holds the shared lock that every process mapping a segment
    # holds: a test that another pytest worker runs meanwhile opens caches and starts loaders,
    # whose sweeps would otherwise remove the dead segment before the check below. A lock stops
    # no unlink, so the check still shows that nothing (no resource tracker) removed it; the lock
    # goes before the next start, which must then remove it.
    held = os.open(f"/dev/shm/{name}", os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_SH)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        assert os.path.exists(f"/dev/shm/{name}"), "the kill leaves the segment behind"
    finally:
        os.close(held)
    if next_start == "cache open":
        Cache(cache.path)
    elif next_start == "prune":
        cache.prune()
    else:
        Slab(BatchLayout.build([("x", "uint8", (1,))], 1), slots=1, anonymous=False).unlink()
    assert not os.path.exists(f"/dev/shm/{name}")


def _hostname_prefix(name: str) -> list[str]:
    """A command prefix that runs a process under hostname ``name`` (a UTS namespace)."""
    for prefix in (["unshare", "--uts"], ["unshare", "--user", "--map-root-user", "--uts"]):
        if subprocess.run([*prefix, "hostname", name], capture_output=True).returncode == 0:
            return [*prefix, "sh", "-c", f'hostname {name} && exec "$0" "$@"']
    pytest.fail("cannot run a process under another hostname here (unshare --uts, with or without a user "
                "namespace, is refused)")


def _other_process_table() -> tuple[list[str], dict[str, str]]:
    """A command prefix (and environment) whose process runs where this one cannot check its
    pid: a new pid namespace, as in a restarted container or on another machine."""
    for prefix in (["unshare", "--pid", "--fork", "--mount-proc"],
                   ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix, {}
    return [], {"GROWCACHE_NODE": "another-machine"}  # growcache's documented override of the table's identity


def _lease_holder(cache: Cache, prefix: list[str], env: dict[str, str]) -> subprocess.Popen:
    code = (f"import growcache, time; s = growcache.Cache({cache.path!r}).snapshot(holder='old trainer'); "
            "print(len(s), flush=True); time.sleep(120)")
    child = subprocess.Popen([*prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, **env), start_new_session=True)
    assert child.stdout.readline().strip() == "2"
    return child


def _kill_group(child: subprocess.Popen) -> str:
    import signal

    os.killpg(child.pid, signal.SIGKILL)
    return child.communicate(timeout=30)[1]


def test_the_leases_of_a_trainer_killed_under_another_hostname_expire_at_once(tmp_path):
    # A container restarted under a new hostname: the hostname never decided whose pid is checkable.
    cache = Cache(tmp_path / "c", capacity=2 * 1456, schema=ID_SCHEMA)
    write_shards(cache, [8, 8])
    child = _lease_holder(cache, _hostname_prefix("old-hostname"), {})
    write_shards(cache, [8], first_id=100)
    Cache(cache.path)
    assert cache.stats().leases == 1, "a living holder keeps its lease"
    _kill_group(child)
    assert [s.seq for s in cache.prune()] == [1]
    stats = cache.stats()
    assert stats.leases == 0 and stats.bytes <= stats.capacity


def test_leases_of_a_trainer_in_another_process_table_live_by_heartbeat_and_expire(tmp_path, monkeypatch):
    import time

    expiry = 1.5
    monkeypatch.setenv("GROWCACHE_OWNER_EXPIRY", str(expiry))
    cache = Cache(tmp_path / "c", capacity=2 * 1456, schema=ID_SCHEMA)
    write_shards(cache, [8, 8])
    prefix, env = _other_process_table()
    child = _lease_holder(cache, prefix, env)
    try:
        write_shards(cache, [8], first_id=100)
        time.sleep(2.5 * expiry)
        Cache(cache.path)  # opening removes dead holders' leases; this one's heartbeat keeps it
        assert cache.stats().leases == 1 and len(cache.list_shards()) == 3
    finally:
        _kill_group(child)
    Cache(cache.path)  # just killed: its last heartbeat is still fresh, and its pid is not ours to check
    assert cache.stats().leases == 1
    time.sleep(expiry + 0.5)
    cache.prune()
    stats = cache.stats()
    assert stats.leases == 0 and os.listdir(os.path.join(cache.path, "leases")) == []
    assert [s.seq for s in cache.list_shards()] == [2, 3] and stats.bytes <= stats.capacity


def test_a_stopped_trainer_in_another_process_table_loses_its_lease_after_the_expiry_and_says_so(
        tmp_path, monkeypatch):
    import signal
    import time

    expiry = 1.5
    monkeypatch.setenv("GROWCACHE_OWNER_EXPIRY", str(expiry))
    cache = Cache(tmp_path / "c", capacity=2 * 1456, schema=ID_SCHEMA)
    write_shards(cache, [8, 8])
    child = _lease_holder(cache, *_other_process_table())
    try:
        os.killpg(child.pid, signal.SIGSTOP)
        time.sleep(expiry + 1.0)
        cache.prune()
        assert cache.stats().leases == 0
        os.killpg(child.pid, signal.SIGCONT)
        time.sleep(1.0)  # a few heartbeats: the first one finds its lease gone
    finally:
        err = _kill_group(child)
    assert "was removed while this process still held it" in err and "stopped or frozen" in err


def test_an_equal_growcache_node_in_another_pid_namespace_never_judges_its_pids(tmp_path, monkeypatch):
    # Containers of one machine named alike for split="node" (docs/pytorch.md) may share a cache
    # but never a pid namespace: the other container's pid names another process here, or none.
    monkeypatch.setenv("GROWCACHE_NODE", "machine-a")
    prefix, env = _other_process_table()
    if env:
        pytest.fail("cannot start a process in a new pid namespace here (unshare --pid is refused)")
    cache = Cache(tmp_path / "c", capacity=2 * 1456, schema=ID_SCHEMA)
    write_shards(cache, [8, 8])
    child = _lease_holder(cache, prefix, {})  # GROWCACHE_NODE=machine-a too
    try:
        write_shards(cache, [8], first_id=100)
        Cache(cache.path)  # opening removes dead holders' leases
        assert cache.stats().leases == 1, "a living holder's lease was removed"
        assert [s.seq for s in cache.prune()] == [3], "prune evicts only what no living holder leased"
    finally:
        err = _kill_group(child)
    assert "was removed while this process still held it" not in err


_DELETED_UNDER_ME = """
import shutil, sys, time
import growcache
cache = growcache.Cache(sys.argv[1])
snapshot = cache.snapshot()
shutil.rmtree(sys.argv[1])
time.sleep(1.0)  # ten heartbeats
"""


def test_a_lease_whose_cache_was_deleted_is_not_blamed_on_another_machine(tmp_path):
    cache = Cache(tmp_path / "c", schema=ID_SCHEMA)
    write_shards(cache, [4])
    result = subprocess.run([sys.executable, "-c", _DELETED_UNDER_ME, cache.path], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, GROWCACHE_OWNER_EXPIRY="0.6"))
    assert result.returncode == 0, result.stderr
    assert "was removed while this process still held it: its directory is gone" in result.stderr
    assert "another machine" not in result.stderr
