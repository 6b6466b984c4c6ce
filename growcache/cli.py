"""The ``growcache`` command line. Exit codes: 0 ok, 1 failure, 2 usage error.

Each subcommand is one entry of :data:`COMMANDS`: its name, a one-line help, a function
that adds its arguments and the function that runs it. A new subcommand is a new entry.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ._progress import DEFAULT_INTERVAL, Progress
from ._size import format_size, parse_size
from .errors import GrowcacheError, SchemaError
from .manifest import METADATA_FILE

__all__ = ["COMMANDS", "Command", "build_parser", "main", "parse_storage_options", "run_sample_command"]

logger = logging.getLogger("growcache")


class _UsageError(Exception):
    pass


class _Failed(Exception):
    """A failure (exit 1) whose message the command completed: what became of the cache it created."""


class _Parser(argparse.ArgumentParser):
    # argparse exits on its own; raising lets main() return 2 and stay testable.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{self.prog}: error: {message}")


@dataclass(frozen=True)
class Command:
    """One subcommand: ``add_arguments(parser)`` declares its flags, ``run(args)`` returns the exit code."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


# The longest wait a flag may ask for. Longer ones (inf, 1e300) overflow every timed wait
# (time.sleep, Event.wait, socket timeouts) mid-run with an OverflowError.
_MAX_SECONDS = 365 * 86400.0


# Sampler (and loader) processes a command starts at the most: 8 per CPU of the machine, or 64
# where that is fewer. Each is a process of its own that imports numpy and fsspec: 100000 of
# them never got going, and Ctrl-C then took minutes to stop them. A far store wants more
# requests in flight, and those come from --concurrency, not from more processes.
_WORKERS_PER_CPU = 8
_MIN_WORKER_LIMIT = 64
# SamplerPool's own bound on the samples one worker keeps in flight.
_MAX_CONCURRENCY = 4096
# The pool counts records in shared 64-bit integers: a larger --records wrapped around
# (2**64 + 10 sampled 10 records; 2**64 sampled none and exited 0).
_MAX_RECORDS = 1 << 62


def _max_workers() -> int:
    return max(_MIN_WORKER_LIMIT, _WORKERS_PER_CPU * (os.cpu_count() or 1))


def _check_workers(flag: str, value: Any, *, least: int = 1, instead: str = "") -> None:
    """A usage error (ValueError) for a count of processes below ``least`` or past :func:`_max_workers`."""
    if value is None or value < least:
        raise ValueError(f"{flag} must be at least {least}, got {value}")
    limit = _max_workers()
    if value > limit:
        raise ValueError(
            f"{flag} {value} is more processes than this machine can run usefully: give at most {limit} "
            f"({_WORKERS_PER_CPU} per CPU, {os.cpu_count() or 1} CPUs here; {_MIN_WORKER_LIMIT} where that is fewer); "
            f"each is a process of its own, and thousands of them never get going{instead}")


_MORE_IN_FLIGHT = (f". For more requests in flight, raise --concurrency (samples each sampler process keeps in flight, "
                   f"up to {_MAX_CONCURRENCY}) instead")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= _MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds up to {_MAX_SECONDS:.0f} (a year), "
                                         f"got {text!r}")
    return value


def _progress_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar or status lines")
    parser.add_argument("--status-interval", type=_positive_float, default=DEFAULT_INTERVAL, metavar="S",
                        help="without a terminal (nohup, SLURM, CI logs), write a one-line status every S seconds "
                             f"instead of a bar (default: {DEFAULT_INTERVAL:g})")


def _progress(args: argparse.Namespace, desc: str, **kwargs: Any) -> Progress:
    return Progress(desc, interval=getattr(args, "status_interval", DEFAULT_INTERVAL),
                    quiet=getattr(args, "quiet", False), **kwargs)


def _existing_cache(path: str):
    from .cache import Cache

    # os.stat, not os.path.isdir/exists: they answer False on EACCES too, and a cache this user
    # may not read is a failure to report, not a usage error.
    metadata = os.path.join(path, "growcache.json")
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise _UsageError(f"{path} is not a directory: give the path of a growcache cache")
        os.lstat(metadata)
    except FileNotFoundError as exc:
        what = "is not a growcache cache (no growcache.json)" if exc.filename == metadata else \
            "is not a directory (nothing is there)"
        raise _UsageError(f"{path} {what}: give the path of a growcache cache") from None
    except NotADirectoryError:
        raise _UsageError(f"{path} is not a directory: give the path of a growcache cache") from None
    except OSError as exc:
        raise OSError(exc.errno, f"cannot read cache {path} ({exc.strerror} on {exc.filename}): run as a user that "
                                 "may read it (its owner, or a member of the group it was shared with)") from None
    return Cache(path)


def _cache_dir_argument(path: str) -> None:
    """A usage error when the cache path of a command that creates caches names something else than a directory."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing: the command creates it; unreadable: the command says so
        return
    if not stat.S_ISDIR(mode):
        raise _UsageError(f"{path} is a file, not a directory: give the cache directory (created if missing)")


def _time(ts: float | None) -> str:
    return "-" if ts is None else _dt.datetime.fromtimestamp(ts).isoformat(timespec="seconds")


# -- status, verify, prune ----------------------------------------------------------------------
def _status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the cache directory")
    p.add_argument("--watch", action="store_true",
                   help="refresh a live view (fill rate, evictions, leases and pinned bytes, samplers' request latency) "
                        "every --interval seconds until Ctrl-C: redrawn on a terminal, one line per interval without")
    p.add_argument("--interval", type=_positive_float, default=2.0, metavar="S", help="seconds between refreshes "
                   "(default: 2)")
    p.add_argument("--count", type=int, default=None, metavar="N", help="stop after N refreshes (default: never)")


def _passed_over(progress: Any) -> str:
    """``; passed over: 1 vanished, 2 corrupt`` for a shard source's pass, or nothing."""
    counts = [(progress.vanished, "vanished"), (progress.changed, "changed"), (progress.corrupt, "corrupt")]
    shown = [f"{n} {what}" for n, what in counts if n]
    return f"; passed over: {', '.join(shown)}" if shown else ""


def _cmd_status(args: argparse.Namespace) -> int:
    from .shard_source import pass_progress

    cache = _existing_cache(args.path)
    if args.watch:
        from ._watch import watch

        if args.count is not None and args.count < 1:
            raise _UsageError(f"--count must be at least 1, got {args.count}")
        return watch(cache, interval=args.interval, count=args.count)
    s = cache.stats()
    rows = [
        ("path", s.path),
        *((("access", f"read-only ({cache._read_only}): status and verify work, writing commands do not"),)
          if cache._read_only else ()),
        ("schema", repr(cache.schema)),
        ("shards", f"{s.shards}"),
        ("records", f"{s.records}"),
        ("bytes", f"{format_size(s.bytes)} of {format_size(s.capacity)} ({100 * s.budget_use:.1f}% of budget)"),
        ("published", f"{s.published} shards, {format_size(s.published_bytes)}"),
        ("evicted", f"{s.evicted} shards, {format_size(s.evicted_bytes)}"),
        ("leases", f"{s.leases} live, holding {s.leased_shards} shards ({format_size(s.leased_bytes)})"),
        ("pinned", f"{s.pins} resume pins, holding {s.pinned_shards} shards ({format_size(s.pinned_bytes)}); "
                   "growcache prune --unpin NAME drops one"),
        *((("pin", f"{p['name']}: {p.get('holder') or '?'}, run {p.get('run') or '?'}, {len(p['seqs'])} shards, "
                   f"until {_time(p['until'])}") for p in cache.pins())),
        ("temporaries", f"{s.temporaries} shards being written"),
        *((("irregular", f"{path}: not a regular file, ignored by readers and eviction; remove it by hand")
           for path in getattr(s, "irregular", ()))),
        ("oldest", _time(s.oldest_publish_time)),
        ("newest", _time(s.newest_publish_time)),
        *((("source", f"{p.source}: pass {p.pass_number}, {p.fetched} of {p.total} shards fetched "
                      f"({p.in_flight} in flight); the cache holds {p.held} of {p.known} whole"
                      + _passed_over(p))
           for p in pass_progress(cache))),
        *_sampler_rows(cache),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _sampler_rows(cache: Any) -> list[tuple[str, str]]:
    """One ``samplers`` row per sampler pool running on the cache (from its stats file)."""
    from ._sampler_stats import read_all

    return [("samplers", f"pid {p['pid']} on {p['host']}: {p['workers']} workers, {p['records']} records in "
                         f"{p['shards']} shards, {p['mb_per_s']:.1f} MB/s, {p['requests_in_flight']} requests in "
                         f"flight (limit {p['in_flight_limit']}), latency p50/p95/p99 "
                         f"{p['latency_p50'] * 1e3:.0f}/{p['latency_p95'] * 1e3:.0f}/{p['latency_p99'] * 1e3:.0f} ms, "
                         f"{p['throttle_events']} throttled, {p['restarts']} restarts"
                         + (", FAILED" if p["failed"] else ""))
            for p in read_all(cache.path)]


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the cache directory")
    p.add_argument("--remove-corrupt", action="store_true", help="delete corrupt shards no lease holds")
    _progress_arguments(p)


def _cmd_verify(args: argparse.Namespace) -> int:
    cache = _existing_cache(args.path)
    shards = cache.list_shards()
    done = 0

    with _progress(args, "verify", total=sum(s.nbytes for s in shards), unit="B") as progress:
        def checked(shard: Any) -> None:
            nonlocal done
            done += shard.nbytes
            progress.update(done)

        report = cache.verify(remove_corrupt=args.remove_corrupt, progress=checked)
    for error in report.corrupt:
        print(f"CORRUPT {error.path} at byte offset {error.offset}: {error.reason}")
    for path in report.foreign:
        print(f"FOREIGN {path}: not a growcache shard; it is ignored by readers and can be deleted")
    for path in getattr(report, "irregular", ()):
        print(f"IRREGULAR {path}: not a regular file; it is ignored by readers and eviction and can be deleted")
    for path in report.removed:
        print(f"REMOVED {path}")
    for path in getattr(report, "kept_leased", ()):
        print(f"KEPT {path}: corrupt, but a live lease holds it (an epoch is reading it); run verify "
              "--remove-corrupt again once that epoch ends")
    print(f"{report.shards} shards, {report.records} records checked, {len(report.corrupt)} corrupt")
    return 0 if report.ok else 1


def _prune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the cache directory")
    p.add_argument("--to", type=_size_arg, default=None, help="target size, e.g. 10GB (default: the capacity)")
    p.add_argument("--unpin", action="append", default=[], metavar="NAME",
                   help="drop the resume pin NAME (as growcache status lists it; 'all' for every pin) before "
                        "evicting: a run that would resume from it then finds its shards gone. Expired pins are "
                        "dropped anyway")


def _cmd_prune(args: argparse.Namespace) -> int:
    cache = _existing_cache(args.path)
    names = [p["name"] for p in cache.pins()] if "all" in args.unpin else args.unpin
    for name in names:
        try:
            dropped = cache.unpin(name)
        except ValueError as exc:
            raise _UsageError(f"--unpin {name}: {exc} (growcache status lists the pins)") from None
        print(f"{'dropped' if dropped else 'no'} pin {name}")
    removed = cache.prune(args.to)
    print(f"evicted {len(removed)} shards ({format_size(sum(s.nbytes for s in removed))}); "
          f"{format_size(cache.stats().bytes)} left")
    return 0


# -- sample ---------------------------------------------------------------------------------------
def parse_storage_options(pairs: Sequence[str] | None, flag: str = "--storage-option") -> dict[str, Any]:
    """``["a=1", "client_kwargs.endpoint_url=http://h"]`` -> nested dict; values parsed as JSON if they are.

    Values are credentials often, so no message ever shows one: a malformed option is
    named by its key, or by its position when it has no key.

    Raises:
        ValueError: an option is not ``KEY=VALUE``, a value that starts like JSON does not
            parse, or a key is set both to a value and to nested keys.
    """
    options: dict[str, Any] = {}
    for position, pair in enumerate(pairs or [], 1):
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip() or any(c.isspace() for c in key):
            raise ValueError(
                f"{flag} number {position} is not KEY=VALUE (its text is not shown: it may hold a credential). "
                f"Write {flag} KEY=VALUE, nested keys with dots: client_kwargs.endpoint_url=https://..."
            )
        try:
            value: Any = json.loads(raw)
        except ValueError as exc:
            if raw.lstrip()[:1] in ("{", "[", '"'):
                raise ValueError(
                    f"{flag} {key}: the value starts like JSON but does not parse ({exc.msg} at character "
                    f"{exc.pos}; the value is not shown: it may hold a credential). Quote it for the shell, "
                    f"e.g. {flag} '{key}={{\"name\": \"value\"}}', or set nested keys one by one with dots."
                ) from None
            value = raw
        node = options
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{flag} {key}: {part} is already set to a value; set either {part} or its keys")
        if isinstance(node.get(leaf), dict) and not isinstance(value, dict):
            raise ValueError(f"{flag} {key}: its nested keys are set already; set either {key} or its keys")
        node[leaf] = value
    return options


def _check_shard_size(shard_size: int | str | None, capacity: int | str | None) -> None:
    if shard_size is None or capacity is None:
        return
    shard_bytes, capacity_bytes = parse_size(shard_size, name="--shard-size"), parse_size(capacity, name="--capacity")
    if shard_bytes > capacity_bytes:
        raise ValueError(f"--shard-size {shard_size} is larger than the cache's capacity of {capacity_bytes} bytes: "
                         "lower --shard-size or raise --capacity")


def _parse_shape(text: Any) -> Any:
    """``--shape 256,256`` (or ``256x256``) as a tuple; anything but positive whole numbers is a usage error.

    Every part counts: ``3,x``, ``3,,4`` or ``3,`` name their bad (or empty) part, never read as a shorter shape.
    """
    if not isinstance(text, str):
        return text
    parts = text.split(",") if "," in text else text.split("x")
    for position, part in enumerate(parts, 1):
        if not part.strip():
            problem = "is empty" if len(parts) == 1 else f"has an empty part (part {position} of {len(parts)})"
        elif not re.fullmatch(r"[0-9]+", part.strip()) or int(part) < 1:
            problem = f"has {part.strip()!r} where a positive whole number belongs"
        else:
            continue
        raise ValueError(f"--shape {text!r} {problem}: write the dimensions as positive whole numbers separated by "
                         "commas, e.g. --shape 256,256 (or --shape 64 for one dimension)")
    return tuple(int(part) for part in parts)


def _check_record_fits(cache: Any, shard_size: int | str | None) -> None:
    """A usage error, in the command's flags, when one record of the cache's schema cannot fit in a shard."""
    from .example import ExampleCodec
    from .records import FOOTER_BYTES, HEADER_BYTES
    from .sampler import default_shard_size

    frame = ExampleCodec(cache.schema).record_nbytes + HEADER_BYTES + FOOTER_BYTES
    if shard_size is not None:
        if frame > parse_size(shard_size, name="--shard-size"):  # "1KB" from a caller's Namespace, as elsewhere
            raise ValueError(f"--shard-size {shard_size} is smaller than one record ({format_size(frame)}): raise "
                             f"--shard-size to at least {frame} (a few percent of the capacity is typical)")
        return
    size = default_shard_size(cache.capacity)
    if frame > size:
        # The capacity may be one stored before this run (by an earlier one, or the API): say where it comes from.
        raise ValueError(
            f"cache {cache.path} has a capacity of {format_size(cache.capacity)}, and its shards (a quarter of it, "
            f"{format_size(size)}) cannot hold one record ({format_size(frame)}): raise --capacity to at least "
            f"{format_size(4 * frame)} (the cache keeps the new capacity), or give --shard-size between "
            f"{format_size(frame)} and the capacity"
        )


def _sample_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="fsspec URL or glob of the objects, e.g. s3://bucket/arrays/*.npy "
                                  "(with --tfrecord: of TFRecord files, e.g. gs://bucket/train-*)")
    p.add_argument("cache", help="the cache directory (created if missing)")
    p.add_argument("--tfrecord", action="store_true",
                   help="SOURCE is existing TFRecord files (plain, GZIP or ZLIB): copy them whole through the cache, "
                        "every record's CRCs and schema checked, in a new shuffled order each pass (the oldest "
                        "evicted at the budget and fetched again in the next pass), until Ctrl-C. Takes no "
                        "--window, --dtype, --shape, --feature or --records")
    p.add_argument("--schema", default=None,
                   help="with --tfrecord: the records' schema as `growcache schema` prints it (default: the cache's; "
                        "for a new cache, inferred from the first file)")
    p.add_argument("--max-shard-records", type=int, default=None, metavar="N",
                   help="with --tfrecord: cut files into cache shards of at most N records (--shard-size cuts by size)")
    p.add_argument("--capacity", type=_size_arg, default=None, help="byte budget, e.g. 500GB (default: the stored one)")
    p.add_argument("--workers", type=int, default=1, help="sampler processes (default: 1)")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="samples each sampler process keeps in flight: concurrent range requests to the store "
                        "(default: SamplerPool's, 64; 1 = one request at a time)")
    p.add_argument("--window", type=int, default=None,
                   help="rows per sample: random windows of .npy arrays read by byte range (default: whole objects)")
    p.add_argument("--relist-every", type=_positive_float, default=None, metavar="SECONDS",
                   help="list the source's globs again this often in each sampler process, so that objects added "
                        "to a live bucket are sampled (default: list once)")
    p.add_argument("--feature", default=None, help="feature name of the sampled array (default: x)")
    p.add_argument("--dtype", default=None, help="dtype of raw (non-.npy) objects; needs --shape")
    p.add_argument("--shape", default=None, help="shape of raw objects, e.g. 256,256")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to fsspec; nested keys with dots (client_kwargs.endpoint_url=http://...); repeatable")
    p.add_argument("--records", type=int, default=None,
                   help="sample this many records, publish them (the last shards may be small) and stop "
                        "(default: run until Ctrl-C)")
    p.add_argument("--shard-size", type=_size_arg, default=None, help="rotate shards at this size (default: the pool's)")
    p.add_argument("--max-shard-age", type=float, default=10.0, help="rotate shards after this many seconds (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the samplers' random streams (default: 0)")
    p.add_argument("--retries", type=int, default=None, metavar="N",
                   help="tries per store request, the first included (default: RetryPolicy's, 6)")
    p.add_argument("--retry-deadline", type=_positive_float, default=None, metavar="S",
                   help="no retry of a failing store request starts after S seconds (default: RetryPolicy's, 30)")
    p.add_argument("--stall-timeout", type=_positive_float, default=None, metavar="S",
                   help="a store connection that sends no bytes for S seconds fails and is retried "
                        "(default: RetryPolicy's, 30)")
    _progress_arguments(p)


def _retry_policy(args: Any) -> Any:
    from .sources import RetryPolicy

    fields = {name: getattr(args, flag, None) for name, flag in
              (("attempts", "retries"), ("deadline", "retry_deadline"), ("stall_timeout", "stall_timeout"))}
    if fields["attempts"] is not None and fields["attempts"] < 1:
        raise ValueError(f"--retries must be at least 1, got {fields['attempts']}")
    return RetryPolicy(**{k: v for k, v in fields.items() if v is not None})


def _mismatch_hint(args: Any, schema: Any, sample: dict[str, Any]) -> str:
    """How a ``growcache sample`` user makes the source fit the cache's schema."""
    feature = getattr(args, "feature", None) or "x"
    if feature not in schema:
        return f"--feature names the stored feature: the cache stores {list(schema)}"
    stored, given = schema[feature], np.asarray(sample[feature])
    hints = []
    if given.shape != stored.shape:
        if getattr(args, "window", None) is not None and given.shape[1:] == stored.shape[1:] and stored.shape:
            hints.append(f"--window {stored.shape[0]} gives the stored shape")
        elif getattr(args, "shape", None) is not None:
            hints.append(f"--shape {','.join(map(str, stored.shape))} gives the stored shape")
        else:
            hints.append("the store's arrays have another shape")
    if given.dtype != stored.dtype:
        hints.append(f"--dtype {stored.dtype.name} decodes raw objects as the stored dtype"
                     if getattr(args, "dtype", None) is not None else "the store's arrays have another dtype")
    return "; ".join(hints) + ". A cache keeps one schema: give a new cache directory for other data"


_SAMPLE_FLAGS = (("window", "--window"), ("dtype", "--dtype"), ("shape", "--shape"), ("feature", "--feature"),
                 ("records", "--records"), ("relist_every", "--relist-every"))
_TFRECORD_FLAGS = (("schema", "--schema"), ("max_shard_records", "--max-shard-records"))


def _check_source_flags(args: Any) -> bool:
    """Whether ``args`` name TFRecord files (``--tfrecord``); flags of the other kind of source are usage errors."""
    tfrecord = bool(getattr(args, "tfrecord", False))
    if tfrecord:
        given = [flag for name, flag in _SAMPLE_FLAGS if getattr(args, name, None) is not None]
        if given:
            raise ValueError(
                f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for sampling arrays; --tfrecord copies "
                f"whole TFRecord files with their records unchanged: drop {' and '.join(given)}"
                + (" (--tfrecord runs until Ctrl-C; `growcache import` copies the files once and exits)"
                   if "--records" in given else "")
            )
    else:
        given = [flag for name, flag in _TFRECORD_FLAGS if getattr(args, name, None) is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} go{'es' if len(given) == 1 else ''} with --tfrecord (a source of "
                             "TFRecord files); sampled arrays take their schema from the first sample and are cut into "
                             "shards by --shard-size")
    return tfrecord


def _open_tfrecord_source(args: Any, options: dict[str, Any], claim: Any) -> tuple[Any, Any]:
    """``growcache sample --tfrecord``: the TFRecordShardSource and its cache, its first records checked."""
    from .cache import Cache
    from .errors import CorruptShardError, SourceError
    from .importer import parse_schema
    from .shard_source import TFRecordShardSource

    records = getattr(args, "max_shard_records", None)
    if records is not None and records < 1:
        raise ValueError(f"--max-shard-records must be at least 1, got {records}")
    try:
        schema = parse_schema(args.schema) if getattr(args, "schema", None) is not None else None
    except SchemaError as exc:
        raise ValueError(f"--schema: {exc}") from None
    source = TFRecordShardSource(args.source, storage_options=options, retry=_retry_policy(args),
                                 max_shard_records=records)
    cache = _opened(claim, Cache(args.cache, capacity=getattr(args, "capacity", None), schema=schema))
    try:
        found = source.probe(cache.schema)
    except CorruptShardError as exc:
        raise SourceError(source.redact(
            f"{exc.path} is not a TFRecord file, or is damaged ({exc.reason} at byte offset {exc.offset}): "
            "--tfrecord copies TFRecord files (plain, GZIP or ZLIB) as tf.io.TFRecordWriter writes them; "
            "drop --tfrecord to sample .npy arrays or raw objects"
        )) from None
    except SchemaError as exc:
        if cache.schema is None:
            raise
        raise SchemaError(f"{source.redact(args.source)} does not fit the schema {cache.schema!r} of cache "
                          f"{cache.path}: {exc}. A cache keeps one schema: give a new cache directory for other "
                          "data") from None
    if cache.schema is None:
        cache = _opened(claim, Cache(args.cache, capacity=getattr(args, "capacity", None), schema=found))
        logger.info("cache %s: schema %r inferred from the first file", cache.path, found)
    return source, cache


def _open_sample_source(args: Any, options: dict[str, Any], shape: Any, seed: int, claim: Any) -> tuple[Any, Any]:
    """``growcache sample`` of arrays: the source and its cache, one sample drawn and checked."""
    from .cache import Cache
    from .errors import SourceError, TransientSourceError
    from .sampler import describe_mismatch
    from .schema import Schema
    from .sources import open_source

    source = open_source(args.source, window=getattr(args, "window", None),
                         feature=getattr(args, "feature", None) or "x", dtype=getattr(args, "dtype", None),
                         shape=shape, storage_options=options, retry=_retry_policy(args),
                         relist_every=getattr(args, "relist_every", None))
    cache = _opened(claim, Cache(args.cache, capacity=getattr(args, "capacity", None)))
    try:
        probe = source(np.random.default_rng(seed))
    except (SchemaError, SourceError) as exc:
        if isinstance(exc, TransientSourceError) or not _holds_tfrecords(source):
            raise
        raise type(exc)(f"{exc} The objects are TFRecord files: add --tfrecord to copy them through the cache "
                        "(growcache sample --tfrecord SOURCE CACHE)") from None
    if cache.schema is None:
        schema = Schema({k: (np.asarray(v).dtype.newbyteorder("<").name, np.asarray(v).shape) for k, v in probe.items()})
        cache = _opened(claim, Cache(args.cache, capacity=getattr(args, "capacity", None), schema=schema))
        logger.info("cache %s: schema %r taken from the source", cache.path, schema)
    else:
        problem = describe_mismatch(cache.schema, probe)
        if problem is not None:
            raise SchemaError(f"{source.redact(args.source)} does not fit cache {cache.path}: {problem}. "
                              f"{_mismatch_hint(args, cache.schema, probe)}.")
    return source, cache


def _opened(claim: Any, cache: Any) -> Any:
    """``cache``, which the command just opened (and stored its schema or capacity in), told to ``claim``."""
    if claim is not None:
        claim.opened(cache)
    return cache


def _holds_tfrecords(source: Any) -> bool:
    """Whether the first object of ``source`` starts as a TFRecord file does (plain, GZIP or ZLIB)."""
    from .records import starts_tfrecord

    try:
        head = source._fetch(source.paths()[0], 0, 256)
    except Exception:  # the error being reported says more than this guess could
        return False
    return starts_tfrecord(head)


def run_sample_command(args: Any, *, claim: Any = None) -> int:
    """``growcache sample``: grow a cache from a source URL until Ctrl-C or ``--records``.

    ``args`` carries the flags of ``growcache sample`` (missing optional ones take their
    defaults). When the cache has no schema yet, it is taken from one sample drawn here;
    when it has one, that sample must fit it. Both check the store before any worker starts,
    so a store that cannot be reached, or data of another shape, is one error, at once.
    With ``tfrecord`` set, the source is a :class:`~growcache.TFRecordShardSource` and the
    first records of its first file play that sample's part (the schema is ``schema``, the
    cache's, or inferred from them). ``claim``, a :class:`~growcache.cache_claim.CacheClaim`
    on ``args.cache``, is told of each open of the cache and of the pool's start (the
    command removes a cache it created with it when it fails). Default: ``None``.

    Returns:
        0 when it stopped as asked (``--records`` reached or Ctrl-C).

    Raises:
        ValueError: a usage error (the CLI exits 2).
        GrowcacheError: the store, the source or the samplers failed (the CLI exits 1).
    """
    from .sampler import SamplerPool

    # ValueErrors here are usage errors: the CLI reports them and exits 2.
    tfrecord = _check_source_flags(args)
    shape = _parse_shape(getattr(args, "shape", None))
    dtype = getattr(args, "dtype", None)
    if (dtype is None) != (shape is None):
        raise ValueError("--dtype and --shape go together: raw objects need both; .npy objects need neither")
    if dtype is not None:
        try:
            np.dtype(dtype)
        except TypeError:
            raise ValueError(f"--dtype {dtype!r} is not a dtype numpy knows: write one such as float32, uint8, "
                             "int64 or <f4") from None
    workers = getattr(args, "workers", 1)
    _check_workers("--workers", workers, instead=_MORE_IN_FLIGHT)
    concurrency = getattr(args, "concurrency", None)
    if concurrency is not None and not 1 <= concurrency <= _MAX_CONCURRENCY:
        raise ValueError(f"--concurrency must be from 1 to {_MAX_CONCURRENCY} (samples each sampler process keeps in "
                         f"flight), got {concurrency}" + ("; for more in flight, add --workers"
                                                          if concurrency > _MAX_CONCURRENCY else ""))
    seed = getattr(args, "seed", 0) or 0
    if seed < 0:
        raise ValueError(f"--seed must be 0 or more, got {seed}")
    target = getattr(args, "records", None)
    if target is not None and not 1 <= target <= _MAX_RECORDS:
        raise ValueError(f"--records must be from 1 to {_MAX_RECORDS} (2**62), got {target}: leave it out to sample "
                         "until Ctrl-C")
    shard_size = getattr(args, "shard_size", None)
    _check_shard_size(shard_size, getattr(args, "capacity", None))
    options = parse_storage_options(getattr(args, "storage_option", None))
    if tfrecord:
        source, cache = _open_tfrecord_source(args, options, claim)
    else:
        source, cache = _open_sample_source(args, options, shape, seed, claim)
    _check_shard_size(shard_size, cache.capacity)
    _check_record_fits(cache, shard_size)
    pool = SamplerPool(cache, source, workers=workers, shard_size=shard_size,
                       max_shard_age=getattr(args, "max_shard_age", 10.0), seed=seed, stop_after=target,
                       **({} if concurrency is None else {"concurrency": concurrency}))
    interrupted = False
    with _progress(args, "sample", total=target, unit="rec") as progress:
        try:
            if claim is not None:
                claim.sampler_started()
            pool.start()  # a Ctrl-C while the workers start stops them as cleanly as one later
            while True:
                pool.raise_if_failed()
                s = pool.stats()
                cs = cache.stats()
                progress.update(s.records_written, f"{s.records} published, {format_size(s.mb_per_s * 1e6)}/s, "
                                                   f"cache {format_size(cs.bytes)} of {format_size(cs.capacity)}, "
                                                   f"{cs.evicted} evicted")
                if s.finished:
                    break
                time.sleep(0.25)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            final = pool.stop(raise_on_failure=False)
    if final.failed:
        pool.raise_if_failed()
    cs = cache.stats()
    print(f"{'interrupted: ' if interrupted else ''}sampled {final.records} records in {final.shards} shards "
          f"({format_size(final.bytes)}) into {cache.path}; it holds {cs.records} records in {cs.shards} shards "
          f"({format_size(cs.bytes)} of {format_size(cs.capacity)})")
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    from .cache_claim import CacheClaim

    _cache_dir_argument(args.cache)
    claim = CacheClaim(args.cache)
    try:
        code = run_sample_command(args, claim=claim)
    except BaseException as exc:
        # A ValueError is a bad --storage-option, --shape or window given on the command line.
        _fail(claim, exc, usage=isinstance(exc, ValueError) and not isinstance(exc, GrowcacheError))
    claim.release(failed=False)
    return code


def _fail(claim: Any, exc: BaseException, *, usage: bool = False) -> NoReturn:
    """Raise the failure ``exc`` of a command, once the cache directory the command created (and
    published nothing into) is removed, or with why it stays, and what to do, added to its message."""
    kept = claim.release(failed=True)
    note = ""
    if kept is not None:
        text = str(exc).rstrip()
        note = (f"{' ' if text.endswith(('.', ')')) else '. '}The cache directory {claim.path}, which this command "
                f"created, stays although nothing was published into it: {kept}. Once nothing uses it, remove it "
                f"(rm -r {claim.path}): it keeps the capacity and schema this command stored")
    if usage:
        raise _UsageError(f"{exc}{note}") from exc
    if not note:
        raise exc
    if isinstance(exc, (GrowcacheError, OSError)):
        raise _Failed(f"{exc}{note}") from exc
    logger.warning(note.lstrip(". "))  # Ctrl-C: the command prints no error of its own
    raise exc


# -- demo -----------------------------------------------------------------------------------------
def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--framework", choices=["torch", "tf", "both"], default="torch",
                   help="which adapter trains (default torch; 'both' runs each in turn on the same cache)")
    p.add_argument("--source", default=None,
                   help="fsspec URL/glob of .npy arrays (default: an embedded local store, created on first run)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for --source (repeatable)")
    p.add_argument("--workdir", default=".growcache-demo", help="where the embedded store and cache live")
    p.add_argument("--cache", default=None, help="cache directory (default: WORKDIR/cache)")
    p.add_argument("--capacity", default="24MB", help="cache byte budget (default 24MB)")
    p.add_argument("--shard-size", default="2MB", help="bytes per shard (default 2MB)")
    p.add_argument("--epochs", type=int, default=8, help="epochs per framework (default 8)")
    p.add_argument("--workers", type=int, default=2, help="sampler processes (default 2)")
    p.add_argument("--loader-workers", type=int, default=1, help="DataLoader workers (default 1)")
    p.add_argument("--batch-size", type=int, default=32)
    # 2 workers x 2 MB/s fill the 24 MB default budget in about four 1.5 s epochs: the table
    # shows the cache growing, then evicting.
    p.add_argument("--store-mbps", type=float, default=2.0,
                   help="bandwidth per sampler worker, to act like a remote store (default 2; 0 = unthrottled)")
    p.add_argument("--epoch-seconds", type=float, default=1.5,
                   help="minimum seconds per epoch: the tiny model trains fast, this lets the cache grow")
    p.add_argument("--quick", action="store_true", help="3 short epochs (for tests)")
    _progress_arguments(p)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    try:
        # Bad arguments are ValueErrors: usage errors, exit 2.
        args.storage_options = parse_storage_options(args.storage_option)
        parse_size(args.capacity, name="--capacity")
        parse_size(args.shard_size, name="--shard-size")
        _check_workers("--workers", args.workers)
        _check_workers("--loader-workers", args.loader_workers, least=0)
        return run_demo(args)
    except ValueError as exc:  # also a --cache that is not a cache
        if isinstance(exc, GrowcacheError):
            raise
        raise _UsageError(str(exc)) from exc


# -- import, schema -------------------------------------------------------------------------------
def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", metavar="SRC",
                   help="TFRecord files (plain, GZIP or ZLIB): paths, globs or fsspec URLs such as gs://bucket/train-*")
    p.add_argument("cache", help="the cache directory (created if missing)")
    p.add_argument("--schema", default=None,
                   help="the records' schema as `growcache schema` prints it (default: the cache's; for a new cache, "
                        "inferred from the first file)")
    p.add_argument("--capacity", type=_size_arg, default=None, help="byte budget, e.g. 500GB (default: the stored one)")
    p.add_argument("--max-shard-records", type=int, default=None, help="cut files into shards of at most N records")
    p.add_argument("--max-shard-size", type=_size_arg, default=None, help="cut files into shards of at most this size")
    _max_record_argument(p)
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to fsspec; nested keys with dots; repeatable")
    _progress_arguments(p)


def _max_record_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-record", type=_size_arg, default=None, metavar="SIZE",
                   help="while no schema says how long a record may be (it is being inferred), refuse longer records "
                        "before reading them (default: 64MiB)")


def _cmd_import(args: argparse.Namespace) -> int:
    from .cache_claim import CacheClaim
    from .importer import ImportReport, TFRecordFiles, import_files, parse_schema

    try:  # bad flags are usage errors, exit 2
        options = parse_storage_options(args.storage_option)
        schema = parse_schema(args.schema) if args.schema is not None else None
    except ValueError as exc:
        raise _UsageError(str(exc)) from exc
    if args.max_shard_records is not None and args.max_shard_records < 1:
        raise _UsageError(f"--max-shard-records must be at least 1, got {args.max_shard_records}")
    _cache_dir_argument(args.cache)
    claim = CacheClaim(args.cache)
    report = ImportReport()  # filled in as the import goes: a Ctrl-C still tells what was imported
    interrupted = False
    try:
        files = TFRecordFiles(args.sources, storage_options=options)
        # The bar's total: the files' sizes, from the listing (and the filesystem, for local files).
        # A file named on a store has none without a request of its own: the bar then counts, open-ended.
        total = files.total_size(files.paths())
        with _progress(args, "import", total=total, unit="B") as progress:
            read = [0, 0]  # bytes of the files read, bytes shown

            def on_bytes(nbytes: int) -> None:
                read[0] += nbytes
                if read[0] - read[1] >= 1 << 20:
                    read[1] = read[0]
                    progress.update(read[0])

            try:
                import_files(files, args.cache, schema=schema, capacity=args.capacity,
                             max_shard_records=args.max_shard_records, max_shard_bytes=args.max_shard_size,
                             max_record_bytes=args.max_record, progress=on_bytes, report=report, claim=claim)
            except KeyboardInterrupt:
                interrupted = True
            progress.update(read[0])
    except BaseException as exc:
        _fail(claim, exc)
    code = 1 if report.refused or report.stopped or interrupted else 0
    kept = claim.release(failed=code != 0)
    for path, reason in report.refused:
        print(f"REFUSED {path}: {reason}")
    if report.stopped is not None:
        print(f"STOPPED: {report.stopped}")
    left = report.left if interrupted or report.stopped is not None else []
    for path in left:  # import these, and only these, to finish: a file imported twice has its records twice
        print(f"NOT IMPORTED {path}")
    held = ""
    if claim.removed:
        held = f"; nothing was imported, so the cache directory {claim.path} that it created was removed"
    elif kept is not None:
        held = (f"; nothing was imported into the cache directory {claim.path} that it created, which stays: {kept}. "
                f"Once nothing uses it, remove it (rm -r {claim.path}): it keeps the capacity and schema stored in it")
    elif os.path.exists(os.path.join(args.cache, METADATA_FILE)):
        from .cache import Cache

        cs = Cache(args.cache).stats()
        held = (f"; the cache holds {cs.records} records in {cs.shards} shards ({format_size(cs.bytes)} of "
                f"{format_size(cs.capacity)})")
        if report.evicted:
            held += f", {report.evicted} shards ({report.evicted_records} records) evicted to keep the budget"
            logger.warning("cache %s evicted %d shards (%d records) during the import to stay within its budget of "
                           "%s: the oldest went, files imported in this run among them. To keep a whole dataset, "
                           "give the cache room for it (--capacity)", args.cache, report.evicted,
                           report.evicted_records, format_size(cs.capacity))
    print(f"{'interrupted (Ctrl-C): ' if interrupted else ''}imported {report.files} files: {report.records} records "
          f"in {report.shards} shards ({format_size(report.bytes)}); {len(report.refused)} refused"
          f"{'; stopped early' if report.stopped else ''}"
          f"{f'; {len(left)} not imported' if left else ''}{held}; schema {report.schema!r}")
    return code


def _schema_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a TFRecord file (plain, GZIP or ZLIB): a path or fsspec URL")
    p.add_argument("--records", type=int, default=16, help="records to read (default: 16)")
    _max_record_argument(p)
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to fsspec; nested keys with dots; repeatable")


def _cmd_schema(args: argparse.Namespace) -> int:
    from .errors import CorruptShardError
    from .importer import damaged_file, infer_schema

    try:
        options = parse_storage_options(args.storage_option)
    except ValueError as exc:
        raise _UsageError(str(exc)) from exc
    if args.records < 1:
        raise _UsageError(f"--records must be at least 1, got {args.records}")
    try:
        schema = infer_schema(args.file, records=args.records, storage_options=options,
                              max_record_bytes=args.max_record)
    except CorruptShardError as exc:  # a user's file, not a cache shard: no verify advice
        print(f"growcache schema: {exc.path}: {damaged_file(exc)}", file=sys.stderr)
        return 1
    print(repr(schema))
    return 0


# -- bench ----------------------------------------------------------------------------------------
_BENCH = os.path.join("benchmarks", "throughput.py")


def _cmd_bench(args: argparse.Namespace) -> int:
    # The benchmark suite lives in the source checkout, not in the wheel. It runs in a process
    # of its own, as it does from the shell: its contenders import TensorFlow and torch.
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(checkout, _BENCH)
    if not os.path.exists(script):
        raise _UsageError(
            f"growcache bench runs {_BENCH} from a source checkout of growcache, and this growcache "
            f"({os.path.dirname(os.path.abspath(__file__))}) was installed without one. Clone the growcache "
            f"repository, then run `make venv` and `.venv/bin/growcache bench` (or `python {_BENCH}`) in it."
        )
    command = [sys.executable, script, *args.bench_args]
    if {"-h", "--help"} & set(args.bench_args):
        result = subprocess.run(command, capture_output=True, text=True)
        sys.stdout.write(result.stdout.replace("usage: throughput.py", "usage: growcache bench"))
        sys.stderr.write(result.stderr.replace("throughput.py: error", "growcache bench: error"))
        return result.returncode
    return subprocess.run(command).returncode


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="FLAGS",
                   help=f"flags of {_BENCH} (growcache bench --help lists them)")


COMMANDS: list[Command] = [
    Command("status", "shards, bytes, records, leases and budget use of a cache", _status_arguments, _cmd_status),
    Command("verify", "check every CRC; exit 1 and list corrupt shards with offsets", _verify_arguments, _cmd_verify),
    Command("prune", "remove abandoned temporaries and evict oldest shards down to a size", _prune_arguments,
            _cmd_prune),
    Command("sample", "grow a cache from a store URL with sampler processes until Ctrl-C or --records",
            _sample_arguments, _cmd_sample),
    Command("demo", "the whole product on an embedded store: sample, cache, train, per-epoch table",
            _demo_arguments, _cmd_demo),
    Command("import", "copy existing TFRecord files (plain, GZIP, ZLIB; paths, globs, URLs) into a cache, each "
            "record checked", _import_arguments, _cmd_import),
    Command("schema", "print the schema of a TFRecord file's records, as Schema(...) accepts it", _schema_arguments,
            _cmd_schema),
    Command("bench", f"framework throughput benchmark ({_BENCH} of a source checkout; --help for its flags)",
            _bench_arguments, _cmd_bench),
]


def _version() -> str:
    from . import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = _Parser(prog="growcache", description="Grow a local TFRecord cache of a remote dataset and read it.")
    parser.add_argument("--version", action="version", version=f"growcache {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log growcache at DEBUG level (store libraries stay at INFO: their DEBUG logs name credentials)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        # bench passes every flag, --help included, to the benchmark script.
        p = sub.add_parser(command.name, help=command.help, description=command.help,
                           add_help=command.name != "bench")
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``growcache`` command with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["bench"]:
        args = argparse.Namespace(command="bench", func=_cmd_bench, bench_args=argv[1:], verbose=False)
    else:
        try:
            args = parser.parse_args(argv)
        except _UsageError as exc:
            print(exc, file=sys.stderr)
            return 2
        except SystemExit as exc:  # --help, --version
            return int(exc.code or 0)
        if args.command is None:  # bare `growcache`: what it can do
            parser.print_help(sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.verbose:
        # growcache's own loggers only: store libraries (botocore) log request headers at DEBUG,
        # and those name the access key id.
        logging.getLogger("growcache").setLevel(logging.DEBUG)
    try:
        return args.func(args)
    except _UsageError as exc:
        print(f"growcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (GrowcacheError, OSError, _Failed) as exc:
        print(f"growcache {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    sys.exit(main())
