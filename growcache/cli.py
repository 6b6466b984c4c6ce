"""The ``growcache`` command line. Exit codes: 0 ok, 1 failure, 2 usage error."""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import os
import sys
from collections.abc import Sequence

from ._size import format_size, parse_size
from .errors import GrowcacheError

__all__ = ["main"]

logger = logging.getLogger("growcache")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse exits on its own; raising lets main() return 2 and stay testable.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{self.prog}: error: {message}")


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _existing_cache(path: str):
    from .cache import Cache

    if not os.path.isdir(path):
        raise _UsageError(f"{path} is not a directory: give the path of a growcache cache")
    if not os.path.exists(os.path.join(path, "growcache.json")):
        raise _UsageError(f"{path} is not a growcache cache (no growcache.json)")
    return Cache(path)


def _time(ts: float | None) -> str:
    return "-" if ts is None else _dt.datetime.fromtimestamp(ts).isoformat(timespec="seconds")


def _cmd_status(args: argparse.Namespace) -> int:
    cache = _existing_cache(args.path)
    s = cache.stats()
    rows = [
        ("path", s.path),
        ("schema", repr(cache.schema)),
        ("shards", f"{s.shards}"),
        ("records", f"{s.records}"),
        ("bytes", f"{format_size(s.bytes)} of {format_size(s.capacity)} ({100 * s.budget_use:.1f}% of budget)"),
        ("published", f"{s.published} shards, {format_size(s.published_bytes)}"),
        ("evicted", f"{s.evicted} shards, {format_size(s.evicted_bytes)}"),
        ("leases", f"{s.leases} live, holding {s.leased_shards} shards ({format_size(s.leased_bytes)})"),
        ("temporaries", f"{s.temporaries} shards being written"),
        ("oldest", _time(s.oldest_publish_time)),
        ("newest", _time(s.newest_publish_time)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    cache = _existing_cache(args.path)
    shards = cache.list_shards()
    with tqdm(total=sum(s.nbytes for s in shards), unit="B", unit_scale=True, desc="verify",
              disable=args.quiet or None) as bar:
        report = cache.verify(remove_corrupt=args.remove_corrupt, progress=lambda s: bar.update(s.nbytes))
    for error in report.corrupt:
        print(f"CORRUPT {error.path} at byte offset {error.offset}: {error.reason}")
    for path in report.foreign:
        print(f"FOREIGN {path}: not a growcache shard; it is ignored by readers and can be deleted")
    for path in report.removed:
        print(f"REMOVED {path}")
    print(f"{report.shards} shards, {report.records} records checked, {len(report.corrupt)} corrupt")
    return 0 if report.ok else 1


def _cmd_prune(args: argparse.Namespace) -> int:
    cache = _existing_cache(args.path)
    removed = cache.prune(args.to)
    print(f"evicted {len(removed)} shards ({format_size(sum(s.nbytes for s in removed))}); "
          f"{format_size(cache.stats().bytes)} left")
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    from .sampler import run_sample_command

    try:
        return run_sample_command(args)
    except ValueError as exc:  # a bad --storage-option, --shape or window given on the command line
        if isinstance(exc, GrowcacheError):
            raise
        raise _UsageError(str(exc)) from exc


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    try:
        return run_demo(args)
    except ValueError as exc:  # a bad --cache, --capacity, --shard-size or --storage-option
        if isinstance(exc, GrowcacheError):
            raise
        raise _UsageError(str(exc)) from exc


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib.util

    # The benchmark suite lives in the source checkout (benchmarks/), not in the wheel.
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "throughput.py")
    if not os.path.exists(script):
        raise _UsageError(f"growcache bench runs benchmarks/throughput.py from a source checkout; {script} is missing")
    spec = importlib.util.spec_from_file_location("growcache_throughput", script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(script))
    spec.loader.exec_module(module)
    try:
        module.main(module.parse_args(args.bench_args))
    except SystemExit as exc:  # --help, or the benchmark's own usage error
        return 2 if exc.code not in (0, None) else 0
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = _Parser(prog="growcache", description="Grow a local TFRecord cache of a remote dataset and read it.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log growcache at DEBUG level (store libraries stay at INFO: their DEBUG logs name credentials)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("status", help="shards, bytes, records, leases and budget use of a cache")
    p.add_argument("path")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("verify", help="check every CRC; exit 1 and list corrupt shards with offsets")
    p.add_argument("path")
    p.add_argument("--remove-corrupt", action="store_true", help="delete corrupt shards no lease holds")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("prune", help="remove abandoned temporaries and evict oldest shards down to a size")
    p.add_argument("path")
    p.add_argument("--to", type=_size_arg, default=None, help="target size, e.g. 10GB (default: the capacity)")
    p.set_defaults(func=_cmd_prune)

    p = sub.add_parser("sample", help="grow a cache from a store URL with sampler processes until Ctrl-C or --records")
    p.add_argument("source", help="fsspec URL or glob of the objects, e.g. s3://bucket/arrays/*.npy")
    p.add_argument("cache", help="the cache directory (created if missing)")
    p.add_argument("--capacity", type=_size_arg, default=None, help="byte budget, e.g. 500GB (default: the stored one)")
    p.add_argument("--workers", type=int, default=1, help="sampler processes (default: 1)")
    p.add_argument("--window", type=int, default=None,
                   help="rows per sample: random windows of .npy arrays read by byte range (default: whole objects)")
    p.add_argument("--feature", default="x", help="feature name of the sampled array (default: x)")
    p.add_argument("--dtype", default=None, help="dtype of raw (non-.npy) objects; needs --shape")
    p.add_argument("--shape", default=None, help="shape of raw objects, e.g. 256,256")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to fsspec; nested keys with dots (client_kwargs.endpoint_url=http://...); repeatable")
    p.add_argument("--records", type=int, default=None, help="stop after this many records (default: run until Ctrl-C)")
    p.add_argument("--shard-size", type=_size_arg, default=None, help="rotate shards at this size (default: the pool's)")
    p.add_argument("--max-shard-age", type=float, default=10.0, help="rotate shards after this many seconds (default: 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the samplers' random streams (default: 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_sample)

    from .demo import add_demo_arguments

    p = sub.add_parser("demo", help="the whole product on an embedded store: sample, cache, train, per-epoch table")
    add_demo_arguments(p)
    p.set_defaults(func=_cmd_demo)

    # Its flags belong to benchmarks/throughput.py; main() hands them over untouched.
    sub.add_parser("bench", help="framework throughput benchmark (benchmarks/throughput.py; --help for its flags)",
                   add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``growcache`` command with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        args = argparse.Namespace(command="bench", func=_cmd_bench, bench_args=argv[1:], verbose=False)
    else:
        try:
            args = build_parser().parse_args(argv)
        except _UsageError as exc:
            print(exc, file=sys.stderr)
            return 2
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
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
    except (GrowcacheError, OSError) as exc:
        print(f"growcache {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    sys.exit(main())
