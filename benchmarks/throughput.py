"""Read throughput of growcache's adapters beside the tools users would pick instead, on the same shards.

One run measures, on one shard set per record size (incompressible float32 records written
with ``growcache.Cache(...).writer()``), each contender in a process of its own:

* ``plain_read``: sequential ``readinto`` of the shard files by one reader, the base of every
  ratio ("x plain");
* ``plain_read_cores``: the same with one reader thread per core over disjoint shards: the
  limit, since a loader with two workers reads on two cores;
* ``tf_raw_records``: ``tf.data.TFRecordDataset`` records, batched, not parsed;
* ``tf_handwritten``: the best hand-written tf.data pipeline (interleave, batch,
  ``parse_example``, ``decode_raw``);
* ``growcache_tf``: ``growcache.make_tf_dataset``;
* ``tfrecord_indexed`` / ``tfrecord_unindexed``: the ``tfrecord`` package as its README shows
  (``TFRecordDataset`` + ``DataLoader(num_workers=2)``), with and without index files.
  Without them every worker reads every record: unique records are counted and the
  duplication is flagged;
* ``growcache_torch_1w`` / ``growcache_torch_2w``: ``growcache.make_torch_loader``;
* ``webdataset``: WebDataset over the same records written as tar shards.

``--workers 2,4,8,12`` replaces the two growcache torch contenders by one per worker count
(``growcache_torch_<N>w``). ``--device cuda`` adds, per worker count (default 2), the delivery
to a GPU: ``growcache_cuda_<N>w`` (``make_torch_loader(device="cuda")``),
``growcache_pinned_<N>w`` (``pin_memory=True`` plus the user's own
``.to("cuda", non_blocking=True)``), ``tfrecord_pinned_<N>w`` (the ``tfrecord`` package,
index files, ``DataLoader(N, pin_memory=True)`` plus the same copy) and ``cuda_ceiling`` (one
pinned batch-sized host tensor copied to the GPU per batch). Their MB/s is payload delivered
to the GPU. Without CUDA, ``--device cuda`` exits with a message; with ``--update-docs`` a
GPU run writes its own block of ``docs/benchmarks.md``, so a CPU run never overwrites it and
the reverse.

Then a growth scenario: a ``SamplerPool`` writes at a set rate into a cache with a small
byte budget while each adapter trains epoch after epoch.

Every contender gets the same page cache: before each of its timed epochs, one plain read of
the files it reads warms them, and ``mincore`` records how much of them is resident. One more
epoch per round runs on a cold cache (its files evicted with ``POSIX_FADV_DONTNEED``; not on a
tmpfs), reported in rows of its own.

Figures: payload MB/s of unique records, records/s, ratio to the plain read, the training
process's CPU seconds per GB, peak RSS, time to the first batch; median of ``--repeats``
epochs after one warm-up epoch, with min and max. Output: JSON, a markdown table, PNG plots;
``--update-docs`` writes them into ``docs/benchmarks.md`` and ``docs/img/``, unless a
contender's median beats the limit, the highest repeat of either plain read (a measurement
error: the run is refused, with the reason, and the command exits 1).

Usage::

    python benchmarks/throughput.py [--total 2GiB] [--repeats 3] [--json out.json] [--plots DIR]
                                    [--dir SCRATCH] [--update-docs] [--quick] [--no-cold]
                                    [--workers 2,4,8,12] [--device cuda] [--metrics-ab N]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import numpy as np

import growcache

logger = logging.getLogger("growcache.bench")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_throughput_worker.py")
SET_FORMAT = 1  # bump when the shard set's layout changes, so old sets are not reused

# name -> (label in tables, framework the process imports)
CONTENDERS = {
    "plain_read": ("plain readinto, one reader", "none"),
    "plain_read_cores": ("plain readinto, one reader per core (the limit)", "none"),
    "tf_raw_records": ("tf.data TFRecordDataset, raw records", "tensorflow"),
    "tf_handwritten": ("tf.data hand-written (interleave+parse_example)", "tensorflow"),
    "growcache_tf": ("growcache make_tf_dataset, no record shuffle", "tensorflow"),
    "growcache_tf_shuffled": ("growcache make_tf_dataset, default shuffle", "tensorflow"),
    "tfrecord_indexed": ("tfrecord pkg + DataLoader(2), index files", "torch"),
    "tfrecord_unindexed": ("tfrecord pkg + DataLoader(2), no index", "torch"),
    "growcache_torch_1w": ("growcache make_torch_loader, 1 worker", "torch"),
    "growcache_torch_2w": ("growcache make_torch_loader, 2 workers", "torch"),
    "webdataset": ("WebDataset tars + WebLoader(2)", "torch"),
}
TORCH_ADAPTERS = ("growcache_torch_1w", "growcache_torch_2w")
# Contenders named ``<kind>_<N>w`` for any worker count N: kind -> (label, framework).
SWEPT = {
    "growcache_torch": ("growcache make_torch_loader, {n} workers", "torch"),
    "growcache_cuda": ("growcache make_torch_loader(device='cuda'), {n} workers", "torch"),
    "growcache_pinned": ("growcache pin_memory=True + own .to('cuda'), {n} workers", "torch"),
    "tfrecord_pinned": ("tfrecord pkg + DataLoader({n}, pin_memory=True), index files", "torch"),
}
GPU_KINDS = ("growcache_cuda", "growcache_pinned", "tfrecord_pinned")
CEILING = ("cuda_ceiling", ("pinned host tensor -> GPU (the ceiling)", "torch"))
# GPU targets (issue 12), 8 workers: device='cuda' vs the same run's no-copy delivery, vs the
# tfrecord package with pin_memory=True (1 MiB), and its training-process CPU.
GPU_TARGET_VS_NO_COPY = 0.8
GPU_TARGET_VS_TFRECORD = {"1MiB": 4.0}
GPU_TARGET_CPU_S_PER_GB = 0.05


def contender_info(name: str) -> tuple[str, str]:
    """(label in tables, framework) of contender ``name``; ``KeyError`` if there is none."""
    if name in CONTENDERS:
        return CONTENDERS[name]
    if name == CEILING[0]:
        return CEILING[1]
    kind, _, workers = name.rpartition("_")
    if kind in SWEPT and workers.endswith("w") and workers[:-1].isdigit():
        label, framework = SWEPT[kind]
        return label.format(n=int(workers[:-1])), framework
    raise KeyError(name)


def _workers(name: str) -> int | None:
    tail = name.rpartition("_")[2]
    return int(tail[:-1]) if tail.endswith("w") and tail[:-1].isdigit() else None

# References: the plain reads. The limit is the fastest repeat of either (a loader with two
# workers reads on two cores, which one reader does not; yet where one core fills the memory
# bandwidth, two readers only contend); ratios ("x plain") are to the one-reader read's median,
# as the targets were set.
PLAIN, LIMITS = "plain_read", ("plain_read_cores", "plain_read")

# (target name, record size) -> minimum ratio, or maximum CPU s/GB. Measured on warm-cache rows.
TARGETS_MIN_RATIO = {"torch_vs_tf_adapter": 1.0, "torch_vs_tfrecord_indexed": 2.0, "tf_vs_handwritten": 0.95}
TARGET_VS_PLAIN = {"1MiB": 0.6, "16KiB": 0.3}  # issue 16
TARGET_CPU_S_PER_GB = {"1MiB": 0.04, "16KiB": 0.04}  # training process, issue 16
TARGET_WORKER_CPU_S_PER_GB = {"1MiB": 0.2, "16KiB": 0.4}  # DataLoader workers, issue 16
TARGET_TF_DEFAULTS_VS_HANDWRITTEN = 1.5  # growcache_tf_shuffled MB/s over tf_handwritten's, issue 16
TARGET_TF_DEFAULTS_CPU_VS_HANDWRITTEN = 0.5  # its training-process CPU s/GB over tf_handwritten's
RESIDENT_WARM = 0.98  # a warm-cache epoch below this residency is flagged


# --------------------------------------------------------------------------------- args
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="throughput.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", default="2GiB", help="payload bytes per record size (default 2GiB)")
    parser.add_argument("--sizes", default="1MiB,16KiB", help="record payload sizes (default 1MiB,16KiB)")
    parser.add_argument("--shard-size", default="256MiB", help="bytes per shard (default 256MiB)")
    parser.add_argument("--batch-bytes", default="16MiB",
                        help="payload bytes per batch; batch size = this / record size (default 16MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per contender (default 3)")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="untimed epochs first (default 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole list of contenders this many times, each time in fresh processes, "
                             "and pool the epochs: on a shared machine, a burst of someone else's load then "
                             "hits every contender alike (default 1)")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated subset of: " + ", ".join(CONTENDERS) + ", cuda_ceiling, or "
                             + ", ".join(f"{k}_<N>w" for k in SWEPT) + " (default: all of the first list, "
                             "adjusted by --workers and --device)")
    parser.add_argument("--workers", default=None,
                        help="worker counts for the torch contenders, e.g. 2,4,8,12: growcache_torch_<N>w (and with "
                             "--device cuda the GPU contenders) for each (default: 1 and 2 workers; 2 on the GPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda adds the GPU delivery contenders and writes its own docs block (default cpu)")
    parser.add_argument("--dir", default=None,
                        help="keep shard sets here and reuse them when the parameters match "
                             "(default: a temporary directory, removed at the end)")
    parser.add_argument("--json", default=None, help="write all figures to this JSON file")
    parser.add_argument("--plots", default=None, help="write PNG plots into this directory")
    parser.add_argument("--update-docs", action="store_true",
                        help="write the table and plots into docs/benchmarks.md and docs/img/")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one contender may take (default 900)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks that it runs")
    parser.add_argument("--no-cold", dest="cold", action="store_false",
                        help="skip the cold-cache epoch (files evicted from the page cache) of each contender")
    parser.add_argument("--metrics-ab", type=int, default=0, metavar="N",
                        help="also run growcache's torch loader (2 workers, first record size) with its input figures "
                             "on and off in alternating epochs, N of each: median MB/s and min-max (issue 31)")
    growth = parser.add_argument_group("growth scenario")
    growth.add_argument("--no-growth", dest="growth", action="store_false", help="skip the growth scenario")
    growth.add_argument("--growth-seconds", type=float, default=20, help="training time per adapter (default 20)")
    growth.add_argument("--growth-rate", default="128MB", help="sampler payload bytes per second (default 128MB)")
    growth.add_argument("--growth-budget", default="384MiB", help="cache capacity (default 384MiB)")
    growth.add_argument("--growth-shard", default="16MiB", help="sampler shard size (default 16MiB)")
    growth.add_argument("--growth-record", default="1MiB", help="record payload size (default 1MiB)")
    growth.add_argument("--growth-samplers", type=int, default=2, help="sampler processes (default 2)")
    growth.add_argument("--growth-step-ms", type=float, default=20,
                        help="emulated model compute per batch, a sleep (default 20)")
    args = parser.parse_args(argv)
    if args.quick:
        args.total, args.shard_size, args.batch_bytes = "16MiB", "2MiB", "2MiB"
        args.repeats, args.warmup_epochs = 1, 1
        args.growth_seconds, args.growth_rate, args.growth_budget = 2, "16MB", "4MiB"
        args.growth_shard, args.growth_record, args.growth_step_ms = "512KiB", "64KiB", 5
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        counts = [int(n) for n in args.workers.split(",")] if args.workers else None
    except ValueError:
        parser.error(f"--workers takes worker counts such as 2,4,8,12, got {args.workers!r}")
    if counts is not None and min(counts) < 1:
        parser.error("--workers counts must be >= 1")
    if args.contenders is None:
        names = list(CONTENDERS)
        if counts:
            at = names.index(TORCH_ADAPTERS[0])
            names[at:at + len(TORCH_ADAPTERS)] = [f"growcache_torch_{n}w" for n in counts]
        if args.device == "cuda":
            names += [f"{kind}_{n}w" for n in counts or [2] for kind in GPU_KINDS] + [CEILING[0]]
        args.contenders = ",".join(names)
    unknown = set()
    for name in args.contenders.split(","):
        try:
            contender_info(name)
        except KeyError:
            unknown.add(name)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}, cuda_ceiling, "
                     + ", ".join(f"{k}_<N>w" for k in SWEPT))
    args.gpu = _require_cuda(parser) if args.device == "cuda" else None
    return args


def _require_cuda(parser: argparse.ArgumentParser) -> str:
    """The GPU's name; a usage error unless torch sees a CUDA device (asked in a child
    process: this process imports no framework)."""
    probe = ("import torch; ok = torch.cuda.is_available(); print(torch.__version__, torch.version.cuda, ok); "
             "print(torch.cuda.get_device_name(0) if ok else '')")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        parser.error("--device cuda: asking torch for a CUDA device timed out")
    lines = out.stdout.splitlines()
    words = lines[0].split() if lines else []
    if out.returncode != 0 or len(words) != 3:
        parser.error(f"--device cuda needs torch, which failed to import: {out.stderr.strip()[-300:]}")
    if words[2] != "True":
        parser.error(f"--device cuda needs a CUDA device, and torch {words[0]} (CUDA {words[1]}) sees none: run it on "
                     "a GPU machine, or leave --device out to measure the CPU contenders")
    return lines[1].strip() if len(lines) > 1 else "?"


# ---------------------------------------------------------------------------- shard sets
def _set_key(label: str, record_bytes: int, total: int, shard: int) -> str:
    return f"{label}-r{record_bytes}-t{total}-s{shard}-v{SET_FORMAT}"


def build_shard_set(root: str, label: str, record_bytes: int, total: int, shard: int) -> dict:
    """Write (or reuse) the shard set of one record size; return its description."""
    set_dir = os.path.join(root, _set_key(label, record_bytes, total, shard))
    marker = os.path.join(set_dir, "ready.json")
    floats = record_bytes // 4
    schema = growcache.Schema({"id": ("int64", ()), "x": ("float32", (floats,))})
    per_shard = max(1, shard // record_bytes)
    records = max(1, total // record_bytes)
    reused = os.path.exists(marker)
    if not reused:
        shutil.rmtree(set_dir, ignore_errors=True)
        cache = growcache.Cache(os.path.join(set_dir, "cache"), capacity=2 * total + (64 << 20), schema=schema)
        start = time.perf_counter()
        next_id = 0
        for first in range(0, records, per_shard):
            count = min(per_shard, records - first)
            rng = np.random.default_rng(first)
            block = rng.integers(0, 2**32, (count, floats), dtype=np.uint32).view(np.float32)
            with cache.writer() as writer:
                for row in block:
                    writer.write({"id": np.int64(next_id), "x": row})
                    next_id += 1
        logger.info("wrote %s shard set: %d records in %.1f s", label, records, time.perf_counter() - start)
    cache = growcache.Cache(os.path.join(set_dir, "cache"))
    shards = cache.list_shards()
    paths = [s.path for s in shards]
    desc = {
        "label": label, "record_bytes": record_bytes, "floats": floats, "dir": set_dir,
        "cache": cache.path, "paths": paths, "records_per_path": [s.records for s in shards],
        "index_paths": [os.path.join(set_dir, "index", f"{i:05d}.index") for i in range(len(paths))],
        "tar_paths": [os.path.join(set_dir, "wds", f"{i:05d}.tar") for i in range(len(paths))],
        "records": sum(s.records for s in shards), "file_bytes": sum(s.nbytes for s in shards),
        "payload_bytes_per_record": schema.record_payload_bytes, "reused": reused,
    }
    if not reused:
        os.makedirs(os.path.join(set_dir, "index"))
        os.makedirs(os.path.join(set_dir, "wds"))
    return desc


def _write_marker(desc: dict) -> None:
    with open(os.path.join(desc["dir"], "ready.json"), "w") as f:
        json.dump({k: desc[k] for k in ("label", "record_bytes", "records", "file_bytes")}, f)


# ------------------------------------------------------------------------------ workers
def _run_worker(spec: dict, scratch: str, timeout: float) -> dict:
    """Run one worker process; return its result, or a failure record with stderr's tail."""
    fd, spec_path = tempfile.mkstemp(prefix="spec-", suffix=".json", dir=scratch)
    out_path = spec_path[:-5] + "-out.json"
    with os.fdopen(fd, "w") as f:
        json.dump(dict(spec, out=out_path), f)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, WORKER, spec_path], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"available": False, "failed": True, "reason": f"timed out after {timeout:.0f} s"}
    finally:
        elapsed = time.perf_counter() - start
    try:
        with open(out_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"available": False, "failed": True,
                  "reason": f"worker exited {proc.returncode} without a result: {proc.stderr[-2000:]}"}
    finally:
        for path in (spec_path, out_path):
            if os.path.exists(path):
                os.remove(path)
    result["process_seconds"] = elapsed
    if result.get("failed"):
        logger.warning("%s failed: %s\n%s", spec.get("contender") or spec.get("mode"), result.get("reason"),
                       result.get("traceback", proc.stderr[-2000:]))
    return result


def _merge_rounds(previous: dict | None, new: dict) -> dict:
    """Pool the epochs of one contender's rounds; peaks are the highest of any round."""
    if previous is None or not previous.get("available") or not new.get("available"):
        return new if previous is None or previous.get("available") else previous
    for label, size in new["sizes"].items():
        old = previous["sizes"][label]
        old["warmup"] += size["warmup"]
        old["runs"] += size["runs"]
        old["cold"] += size.get("cold", [])
        for key in ("peak_rss_train", "peak_rss_workers_sum", "peak_rss_worker_max"):
            old[key] = max(old[key], size[key])
    previous["process_seconds"] += new.get("process_seconds", 0)
    return previous


# ------------------------------------------------------------------------------ figures
def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(name: str, label: str, raw: dict, size: dict, plain_MBps: float | None, cold: bool = False) -> dict | None:
    """The reported figures of one contender on one record size, from its warm-cache epochs
    (or, with ``cold``, its cold-cache ones; ``None`` if it has none)."""
    runs = raw["cold"] if cold else raw["runs"]
    if not runs:
        return None
    payload = size["payload_bytes_per_record"]
    out: dict = {"note": raw["note"]}
    if name in LIMITS:
        delivered = [size["file_bytes"] for _ in runs]
        unique = [r["records"] for r in runs]
    else:
        unique = [r["unique_records"] if r["unique_records"] is not None else r["records"] for r in runs]
        delivered = [u * payload for u in unique]
    walls = [r["wall_s"] for r in runs]
    mbps = [d / w / 1e6 for d, w in zip(delivered, walls)]
    out["MBps"] = _spread(mbps)
    out["records_per_s"] = _spread([u / w for u, w in zip(unique, walls)])
    out["vs_plain"] = out["MBps"]["median"] / plain_MBps if plain_MBps else None
    out["train_cpu_s_per_GB"] = _spread([r["train_cpu_s"] / (d / 1e9) for r, d in zip(runs, delivered)])
    out["workers_cpu_s_per_GB"] = _spread([r["workers_cpu_s"] / (d / 1e9) for r, d in zip(runs, delivered)])
    out["first_batch_s"] = _spread([r["first_batch_s"] for r in runs])
    resident = [r["resident_before"] for r in runs if r.get("resident_before") is not None]
    out["resident"] = _spread(resident) if resident else None
    # The first epoch of each process (start-up included); the median over rounds.
    firsts = [r for r in raw["warmup"] + raw["runs"] if r.get("epoch_in_process") == 0]
    out["first_batch_first_epoch_s"] = statistics.median(r["first_batch_s"] for r in firsts) if firsts else None
    out["peak_rss_train_MiB"] = raw["peak_rss_train"] / 2**20
    out["peak_rss_workers_MiB"] = raw["peak_rss_workers_sum"] / 2**20
    out["records_delivered"] = runs[-1]["records"]
    out["records_expected"] = size["records"]
    out["unique_records"] = runs[-1]["unique_records"]
    out["duplicates"] = runs[-1]["duplicates"]
    out["duplication"] = (runs[-1]["records"] / runs[-1]["unique_records"]) if runs[-1]["unique_records"] else None
    out["complete"] = min(unique) == size["records"]
    out["ids_in_range"] = runs[-1].get("ids_in_range")
    return out


def figures_of(results: dict, sets: dict, names: list[str], cold: bool = False) -> dict:
    """``{record size: {contender: figures}}`` of the warm-cache (or cold-cache) epochs."""
    out: dict = {}
    for label, desc in sets.items():
        plain = results["raw"].get(PLAIN, {})
        plain_fig = summarize(PLAIN, label, plain["sizes"][label], desc, None, cold) if plain.get("available") else None
        plain_MBps = plain_fig["MBps"]["median"] if plain_fig else None
        per: dict = {}
        for name in names:
            raw = results["raw"].get(name, {})
            if raw.get("available"):
                fig = summarize(name, label, raw["sizes"][label], desc, plain_MBps, cold)
                if fig is not None:
                    per[name] = fig
        out[label] = per
    return out


def limit_violations(results: dict) -> list[dict]:
    """Contenders that beat the limit by more than the noise between its repeats.

    The limit is what the machine has shown it can read: the highest repeat of either plain
    read (one reader per core, or one reader: on a machine whose memory bandwidth one core
    already fills, two readers only contend, and on a noisy disk either may draw the fast
    repeat). A contender beats it by more than the noise when its median MB/s is above that.
    No reader can deliver bytes faster than they can be read, so such a run measured
    something else: a page cache warm for one and cold for the other, a load burst, or a
    "limit" that does not use the cores the contender uses.

    The highest repeat of *either* reference, rather than of the one with the faster median,
    is the fairer bar on a disk whose cold reads vary threefold between repeats: a repeat the
    plain read once achieved is a speed the machine can read at.
    """
    found = []
    for cache, table in (("warm", results.get("figures", {})), ("cold", results.get("figures_cold", {}))):
        for label, per in table.items():
            limit = max((n for n in LIMITS if n in per), key=lambda n: per[n]["MBps"]["max"], default=None)
            if limit is None:
                continue
            ceiling = per[limit]["MBps"]["max"]
            for name, fig in per.items():
                if name in LIMITS or name == "cuda_ceiling":
                    continue
                if fig["MBps"]["median"] > ceiling:
                    found.append({"cache": cache, "records": label, "contender": name, "limit": limit,
                                  "MBps": fig["MBps"]["median"], "limit_max": ceiling,
                                  "limit_median": per[limit]["MBps"]["median"],
                                  "resident": fig.get("resident"), "limit_resident": per[limit].get("resident")})
    return found


def _violation_text(v: dict) -> str:
    def res(r: dict | None) -> str:
        return "?" if r is None else f"{r['min']:.0%}-{r['max']:.0%}"

    return (f"{v['contender']} ({v['records']}, {v['cache']} cache) delivered {v['MBps']:.0f} MB/s (median), above "
            f"every repeat of either plain read (highest {v['limit_max']:.0f} MB/s, by {v['limit']}, whose median "
            f"is {v['limit_median']:.0f}); "
            f"page cache residency before its epochs {res(v['resident'])}, before the limit's {res(v['limit_resident'])}")


def evaluate_targets(figures: dict) -> list[dict]:
    """Each target of the adapter issues, measured, marked met or missed."""
    targets = []

    def mbps(label: str, name: str) -> float | None:
        entry = figures.get(label, {}).get(name)
        return entry["MBps"]["median"] if entry else None

    for label in figures:
        adapters = [n for n in figures[label] if n in TORCH_ADAPTERS or n.startswith("growcache_torch_")]
        torch_best = max(adapters or TORCH_ADAPTERS, key=lambda n: mbps(label, n) or -1.0)
        torch = mbps(label, torch_best)
        tf_adapter, handwritten = mbps(label, "growcache_tf"), mbps(label, "tf_handwritten")
        indexed, plain = mbps(label, "tfrecord_indexed"), mbps(label, "plain_read")

        def add(name: str, what: str, measured: float | None, target: float, higher_is_better: bool = True,
                unit: str = "x") -> None:
            met = None if measured is None else (measured >= target if higher_is_better else measured <= target)
            targets.append({"target": name, "records": label, "what": what, "measured": measured,
                            "goal": f"{'>=' if higher_is_better else '<='} {target}{unit}", "met": met})

        who = f"{torch_best} (the faster torch adapter)" if torch is not None else "torch adapter"
        add("torch_vs_tf_adapter", f"{who} / growcache_tf",
            torch / tf_adapter if torch and tf_adapter else None, TARGETS_MIN_RATIO["torch_vs_tf_adapter"])
        add("torch_vs_tfrecord_indexed", f"{who} / tfrecord_indexed",
            torch / indexed if torch and indexed else None, TARGETS_MIN_RATIO["torch_vs_tfrecord_indexed"])
        if label in TARGET_VS_PLAIN:
            add("torch_vs_plain", f"{who} / plain_read",
                torch / plain if torch and plain else None, TARGET_VS_PLAIN[label])
        entry = figures.get(label, {}).get(torch_best)
        if label in TARGET_CPU_S_PER_GB:
            add("torch_train_cpu", f"{who}: training-process CPU s/GB",
                entry["train_cpu_s_per_GB"]["median"] if entry else None, TARGET_CPU_S_PER_GB[label],
                higher_is_better=False, unit=" s/GB")
        if label in TARGET_WORKER_CPU_S_PER_GB:
            add("torch_worker_cpu", f"{who}: worker CPU s/GB",
                entry["workers_cpu_s_per_GB"]["median"] if entry else None, TARGET_WORKER_CPU_S_PER_GB[label],
                higher_is_better=False, unit=" s/GB")
        add("tf_vs_handwritten", "growcache_tf / tf_handwritten",
            tf_adapter / handwritten if tf_adapter and handwritten else None, TARGETS_MIN_RATIO["tf_vs_handwritten"])
        defaults = mbps(label, "growcache_tf_shuffled")
        add("tf_defaults_vs_handwritten", "growcache_tf_shuffled (defaults, record shuffle on) / tf_handwritten",
            defaults / handwritten if defaults and handwritten else None, TARGET_TF_DEFAULTS_VS_HANDWRITTEN)
        cpu_defaults = figures.get(label, {}).get("growcache_tf_shuffled")
        cpu_handwritten = figures.get(label, {}).get("tf_handwritten")
        add("tf_defaults_cpu_vs_handwritten", "growcache_tf_shuffled / tf_handwritten, training-process CPU s/GB",
            cpu_defaults["train_cpu_s_per_GB"]["median"] / cpu_handwritten["train_cpu_s_per_GB"]["median"]
            if cpu_defaults and cpu_handwritten else None, TARGET_TF_DEFAULTS_CPU_VS_HANDWRITTEN,
            higher_is_better=False)
        for name in [n for n in figures[label] if n.startswith("growcache_cuda_")]:
            n = _workers(name)
            gpu = mbps(label, name)
            no_copy, pinned_tfrecord = mbps(label, f"growcache_torch_{n}w"), mbps(label, f"tfrecord_pinned_{n}w")
            add("gpu_vs_no_copy", f"{name} / growcache_torch_{n}w (no device copy, same run)",
                gpu / no_copy if gpu and no_copy else None, GPU_TARGET_VS_NO_COPY)
            add("gpu_train_cpu", f"{name}: training-process CPU s/GB",
                figures[label][name]["train_cpu_s_per_GB"]["median"], GPU_TARGET_CPU_S_PER_GB,
                higher_is_better=False, unit=" s/GB")
            if label in GPU_TARGET_VS_TFRECORD:
                add("gpu_vs_tfrecord_pinned", f"{name} / tfrecord_pinned_{n}w",
                    gpu / pinned_tfrecord if gpu and pinned_tfrecord else None, GPU_TARGET_VS_TFRECORD[label])
    return targets


# ------------------------------------------------------------------------------ reports
def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def _resident(fig: dict) -> str:
    r = fig.get("resident")
    if r is None:
        return "n/a"
    return f"{r['min']:.0%}" if round(r["min"], 2) == round(r["max"], 2) else f"{r['min']:.0%}-{r['max']:.0%}"


def contender_table(results: dict) -> str:
    """The warm-cache rows: every timed epoch after the same warming read of the contender's files."""
    lines = ["| records | contender | MB/s median (min-max) | records/s | × plain | train CPU s/GB | "
             "worker CPU s/GB | peak RSS train / workers MiB | 1st batch: epoch 1 / later s | resident | notes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, per in results["figures"].items():
        for name in results["contenders"]:
            raw = results["raw"].get(name, {})
            title = contender_info(name)[0]
            fig = per.get(name)
            if fig is None:
                lines.append(f"| {label} | {title} | — | — | — | — | — | — | — | — | unavailable: "
                             f"{raw.get('reason', 'not run')[:160]} |")
                continue
            m = fig["MBps"]
            notes = []
            if fig["duplicates"]:
                notes.append(f"**{fig['duplication']:.1f}× duplication**: {fig['records_delivered']} records "
                             f"delivered, {fig['unique_records']} unique; MB/s counts unique")
            elif fig["unique_records"] is not None and not fig["complete"]:
                notes.append(f"incomplete: {fig['unique_records']} of {fig['records_expected']} records")
            if fig.get("resident") and fig["resident"]["min"] < RESIDENT_WARM:
                notes.append("**partly cold**")
            if name == "tf_raw_records":
                notes.append("not parsed")
            if contender_info(name)[1] == "tensorflow":
                notes.append("train CPU includes TF's C++ threads")
            lines.append(
                f"| {label} | {title} | {m['median']:.0f} ({m['min']:.0f}-{m['max']:.0f}) | "
                f"{fig['records_per_s']['median']:.0f} | {_fmt(fig['vs_plain'], '.2f')} | "
                f"{fig['train_cpu_s_per_GB']['median']:.3f} | {fig['workers_cpu_s_per_GB']['median']:.2f} | "
                f"{fig['peak_rss_train_MiB']:.0f} / {fig['peak_rss_workers_MiB']:.0f} | "
                f"{_fmt(fig['first_batch_first_epoch_s'], '.2f')} / {fig['first_batch_s']['median']:.3f} | "
                f"{_resident(fig)} | {'; '.join(notes)} |")
    return "\n".join(lines)


def cold_table(results: dict) -> str:
    """The cold-cache rows: one epoch per round after the contender's files were evicted."""
    lines = ["| records | contender | MB/s median (min-max) | × plain (cold) | train CPU s/GB | worker CPU s/GB | "
             "resident before |", "|---|---|---:|---:|---:|---:|---:|"]
    for label, per in results.get("figures_cold", {}).items():
        for name in results["contenders"]:
            fig = per.get(name)
            if fig is None:
                continue
            m = fig["MBps"]
            lines.append(f"| {label} | {contender_info(name)[0]} | {m['median']:.0f} ({m['min']:.0f}-{m['max']:.0f}) | "
                         f"{_fmt(fig['vs_plain'], '.2f')} | {fig['train_cpu_s_per_GB']['median']:.3f} | "
                         f"{fig['workers_cpu_s_per_GB']['median']:.2f} | {_resident(fig)} |")
    return "\n".join(lines)


def targets_table(targets: list[dict]) -> str:
    lines = ["| target | records | measured | goal | |", "|---|---|---:|---:|---|"]
    for t in targets:
        state = "n/a (not measured)" if t["met"] is None else ("met" if t["met"] else "**missed**")
        unit = " s/GB" if "s/GB" in t["goal"] else "x"
        lines.append(f"| {t['what']} | {t['records']} | {_fmt(t['measured'], '.3f')}{unit if t['measured'] is not None else ''} "
                     f"| {t['goal']} | {state} |")
    return "\n".join(lines)


def growth_table(results: dict) -> str:
    lines = []
    for adapter, run in results.get("growth", {}).items():
        if not run.get("available"):
            lines.append(f"**{adapter}**: unavailable: {run.get('reason')}\n")
            continue
        lines.append(f"**{adapter}** (first shard after {run['first_shard_s']:.2f} s)\n")
        lines.append("| epoch | start s | shards in snapshot | new | evicted | records | MB/s | read MB/s "
                     "| 1st batch s | sampler MB/s | cache MiB at end |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for e in run["epochs"]:
            lines.append(f"| {e['epoch']} | {e['t_start']:.1f} | {e['snapshot_shards']} | {e['new_shards']} | "
                         f"{e['evicted_shards']} | {e['records']} | {e['MBps']:.0f} | {e['read_MBps']:.0f} | "
                         f"{e['first_batch_s']:.3f} | {e['sampler_MBps']:.0f} | {e['cache_bytes_end'] / 2**20:.0f} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, directory: str) -> list[str]:
    """PNG plots: MB/s per contender with the plain read as a line; growth over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    written = []
    labels = list(results["figures"])
    fig, axes = plt.subplots(1, len(labels), figsize=(6.5 * len(labels), 4.8), squeeze=False)
    for ax, label in zip(axes[0], labels):
        per = results["figures"][label]
        names = [n for n in results["contenders"] if n in per and n not in LIMITS]
        med = [per[n]["MBps"]["median"] for n in names]
        err = [[m - per[n]["MBps"]["min"] for n, m in zip(names, med)],
               [per[n]["MBps"]["max"] - m for n, m in zip(names, med)]]
        colors = ["tab:green" if n.startswith("growcache") else "tab:gray" for n in names]
        ax.barh(range(len(names)), med, xerr=err, color=colors, capsize=3)
        ax.set_yticks(range(len(names)), [contender_info(n)[0] for n in names], fontsize=8)
        ax.invert_yaxis()
        styles = {"plain_read_cores": ("tab:red", "--", "plain read, all cores (the limit)"),
                  "plain_read": ("tab:orange", ":", "plain read, one reader")}
        for name in LIMITS:
            if name in per:
                color, style, what = styles[name]
                value = per[name]["MBps"]["median"]
                ax.axvline(value, color=color, linestyle=style, label=f"{what}: {value:.0f} MB/s")
        if any(name in per for name in LIMITS):
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel("payload MB/s of unique records (median, min-max)")
        ax.set_title(f"{label} records")
    fig.suptitle(f"Read throughput, {results['machine']['cpus']} cores, warm page cache "
                 f"({_residency_summary(results)} resident before each timed epoch)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(directory, _plot_name(results))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    growth = {k: v for k, v in results.get("growth", {}).items() if v.get("available")}
    if growth:
        fig, axes = plt.subplots(2, len(growth), figsize=(6.5 * len(growth), 6), squeeze=False, sharex="col")
        for col, (adapter, run) in enumerate(growth.items()):
            top, bottom = axes[0][col], axes[1][col]
            for e in run["epochs"]:
                top.hlines(e["MBps"], e["t_start"], e["t_end"], color="tab:green")
                top.hlines(e["sampler_MBps"], e["t_start"], e["t_end"], color="tab:orange")
            top.plot([], [], color="tab:green", label="training MB/s (per epoch)")
            top.plot([], [], color="tab:orange", label="sampler MB/s (per epoch)")
            top.set_ylabel("MB/s")
            top.set_title(f"{adapter}: growth under a {run['budget'] / 2**20:.0f} MiB budget")
            top.legend(fontsize=8)
            t = [p["t"] for p in run["timeline"]]
            bottom.plot(t, [p["cache_bytes"] / 2**20 for p in run["timeline"]], label="cache MiB")
            bottom.step([e["t_start"] for e in run["epochs"]],
                        [e["snapshot_records"] * run["payload_bytes_per_record"] / 2**20 for e in run["epochs"]],
                        where="post", label="epoch snapshot MiB")
            bottom.axhline(run["budget"] / 2**20, color="tab:red", linestyle="--", label="budget")
            bottom.set_xlabel("seconds")
            bottom.set_ylabel("MiB")
            bottom.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, _plot_name(results, "growth"))
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                     platform.processor())
    except OSError:
        info["cpu_model"] = platform.processor()
    try:
        info["memory_GiB"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        pass
    versions = {"growcache": growcache.__version__, "numpy": np.__version__}
    for dist in ("tensorflow", "tensorflow-cpu", "torch", "tfrecord", "webdataset", "matplotlib", "psutil"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    info["versions"] = versions
    return info


DOC_BEGIN = "<!-- throughput:begin (generated by benchmarks/throughput.py --update-docs) -->"
DOC_END = "<!-- throughput:end -->"
# A GPU run (--device cuda) has a block of its own: neither kind of run overwrites the other.
GPU_DOC_BEGIN = "<!-- throughput-gpu:begin (generated by benchmarks/throughput.py --device cuda --update-docs) -->"
GPU_DOC_END = "<!-- throughput-gpu:end -->"


def _on_gpu(results: dict) -> bool:
    return results.get("args", {}).get("device") == "cuda"


def _plot_name(results: dict, what: str = "throughput") -> str:
    return f"{what}-gpu.png" if _on_gpu(results) else f"{what}.png"


def _residency_summary(results: dict) -> str:
    values = [v for per in results.get("figures", {}).values() for f in per.values() if f.get("resident")
              for v in (f["resident"]["min"], f["resident"]["max"])]
    if not values:
        return "n/a"
    low, high = min(values), max(values)
    return f"{low:.0%}" if round(low, 2) == round(high, 2) else f"{low:.0%}-{high:.0%}"


def markdown(results: dict) -> str:
    m = results["machine"]
    data = ", ".join(f"{d['label']}: {d['records']} records in {len(d['paths'])} shards, "
                     f"{d['file_bytes'] / 2**30:.2f} GiB" for d in results["sets"].values())
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"Machine: {m['cpus']} cores ({m.get('cpu_model', '?')}), {m.get('memory_GiB', 0):.0f} GiB memory, "
        f"{m['platform']}, Python {m['python']}, load average {m['load_before'][0]:.2f} before the run; "
        + (f"GPU: {results['args']['gpu']}; " if results["args"].get("gpu") else "")
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
        f"Data: {data}. Batches of {results['args']['batch_bytes']} payload. "
        f"Each contender, in {results['args']['rounds']} round(s) of fresh processes, per record size: "
        f"{results['args']['warmup_epochs']} warm-up epoch, "
        + ("1 cold-cache epoch (its files evicted from the page cache first), " if results["args"].get("cold") else "")
        + f"then {results['args']['repeats']} timed epoch(s), each after the same plain read of the files it reads "
        f"(shards; index files or tars where it reads those), with the residency checked by `mincore` before the "
        f"epoch: **{_residency_summary(results)} resident** over all warm-cache epochs. The median over all timed "
        "epochs is shown (min-max); × plain is the ratio to the one-reader plain read of the same run.",
        "",
        "### Throughput, warm page cache",
        "",
        contender_table(results),
        "",
    ]
    if results.get("figures_cold"):
        lines += ["### Throughput, cold page cache (first read from disk)", "", cold_table(results), ""]
    violations = results.get("limit_violations", [])
    lines += ["### Limit check", "",
              ("**Failed**: " + "; ".join(_violation_text(v) for v in violations) + ".") if violations else
              "Passed: no contender's median beats the limit (the highest repeat of either of "
              f"{' and '.join(LIMITS)}), warm or cold.",
              "", "### Targets", "", targets_table(results["targets"]), ""]
    if results.get("metrics_ab"):
        lines += ["### Input figures on against off", "", metrics_ab_text(results["metrics_ab"]), ""]
    if results.get("growth"):
        g = results["args"]
        lines += ["### Growth scenario", "",
                  f"{g['growth_samplers']} samplers write {g['growth_record']} records at {g['growth_rate']}/s in "
                  f"{g['growth_shard']} shards into a {g['growth_budget']} cache while each adapter trains for "
                  f"{g['growth_seconds']:.0f} s, sleeping {g['growth_step_ms']:.0f} ms per batch as a model's compute. "
                  "MB/s counts the sleep; read MB/s leaves it out.", "", growth_table(results)]
    return "\n".join(lines)


def metrics_ab_text(ab: dict) -> str:
    """Markdown of ``--metrics-ab``: MB/s with growcache's input figures on and off."""
    if not ab.get("available"):
        return f"Not measured: {ab.get('reason')}"
    on, off = ab["MBps"]["on"], ab["MBps"]["off"]
    return (f"growcache make_torch_loader, {ab['workers']} workers, {ab['label']} records, epochs alternating "
            f"metrics on and off, {on['repeats']} each: on **{on['median']:.1f} MB/s** "
            f"({on['min']:.1f}-{on['max']:.1f}), off **{off['median']:.1f} MB/s** ({off['min']:.1f}-{off['max']:.1f}), "
            f"on/off {on['median'] / off['median']:.3f}. Run-to-run noise is several percent: evidence, not the "
            "target (that is benchmarks/metrics_overhead.py's per-batch cost).")


def update_docs(results: dict, docs_dir: str) -> None:
    img = os.path.join(docs_dir, "img")
    plot(results, img)
    begin, end = (GPU_DOC_BEGIN, GPU_DOC_END) if _on_gpu(results) else (DOC_BEGIN, DOC_END)
    block = [begin, "", markdown(results), "", f"![Throughput per contender](img/{_plot_name(results)})", ""]
    if any(v.get("available") for v in results.get("growth", {}).values()):
        block += [f"![Growth scenario](img/{_plot_name(results, 'growth')})", ""]
    block.append(end)
    path = os.path.join(docs_dir, "benchmarks.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n" + begin + "\n" + end + "\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + "\n".join(block) + tail
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(block) + "\n"
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


# --------------------------------------------------------------------------------- main
def main(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    names = list(dict.fromkeys(args.contenders.split(",")))
    root = args.dir or tempfile.mkdtemp(prefix="growcache-throughput-")
    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="run-", dir=root)
    total = growcache.parse_size(args.total)
    shard = growcache.parse_size(args.shard_size)
    batch_bytes = growcache.parse_size(args.batch_bytes)
    started = time.perf_counter()
    load = os.getloadavg()
    if load[0] > 0.5 * (os.cpu_count() or 1):
        logger.warning("load average %.2f before the run: other processes share the CPUs, figures will be low "
                       "and noisy", load[0])
    results: dict = {"machine": dict(machine(), load_before=load), "args": vars(args), "contenders": names,
                     "command": "python benchmarks/throughput.py " + " ".join(
                         shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:])),
                     "raw": {}, "figures": {}, "growth": {}}
    try:
        sets = {}
        for label in args.sizes.split(","):
            record_bytes = growcache.parse_size(label)
            desc = build_shard_set(root, label, record_bytes, total, shard)
            desc["batch_size"] = max(1, batch_bytes // record_bytes)
            sets[label] = desc
        todo = [d for d in sets.values() if not d["reused"]]
        if todo:
            logger.info("writing index files and WebDataset tars")
            prep = _run_worker({"mode": "prepare", "sizes": todo}, scratch, args.timeout * 2)
            if prep.get("failed"):
                raise RuntimeError(f"preparing the shard sets failed: {prep['reason']}")
            for desc in todo:
                _write_marker(desc)
        results["sets"] = {k: {kk: vv for kk, vv in v.items()} for k, v in sets.items()}

        # The TF adapter is measured like the hand-written pipeline, without a record shuffle
        # buffer (growcache_tf_shuffled shows its defaults). The torch adapter has none.
        options = {"tf_adapter_kwargs": {"shuffle_buffer": 0}, "torch_adapter_kwargs": {}}
        for round_ in range(args.rounds):
            for name in names:
                logger.info("running %s%s", name, f" (round {round_ + 1} of {args.rounds})" if args.rounds > 1 else "")
                spec = {"mode": "contender", "contender": name, "sizes": list(sets.values()),
                        "epochs": args.repeats, "warmup_epochs": args.warmup_epochs, "options": options,
                        "cold": args.cold}
                raw = _run_worker(spec, scratch, args.timeout)
                results["raw"][name] = _merge_rounds(results["raw"].get(name), raw)
                if not raw.get("available"):
                    logger.warning("%s unavailable: %s", name, raw.get("reason"))
        if args.metrics_ab:
            logger.info("metrics on against off, %d epochs each", args.metrics_ab)
            spec = {"mode": "metrics_ab", "sizes": list(sets.values()), "repeats": args.metrics_ab, "workers": 2}
            results["metrics_ab"] = _run_worker(spec, scratch, args.timeout)
        results["figures"] = figures_of(results, sets, names)
        results["figures_cold"] = figures_of(results, sets, names, cold=True) if args.cold else {}
        results["limit_violations"] = limit_violations(results)
        results["targets"] = evaluate_targets(results["figures"])

        if args.growth:
            for adapter in ("tf", "torch"):
                logger.info("growth scenario: %s", adapter)
                gdir = tempfile.mkdtemp(prefix=f"growth-{adapter}-", dir=scratch)
                record = growcache.parse_size(args.growth_record)
                spec = {"mode": "growth", "adapter": adapter, "dir": gdir, "record_bytes": record,
                        "batch_size": max(1, batch_bytes // record), "budget": growcache.parse_size(args.growth_budget),
                        "shard_size": growcache.parse_size(args.growth_shard),
                        "rate": growcache.parse_size(args.growth_rate), "workers": args.growth_samplers,
                        "seconds": args.growth_seconds, "min_epochs": 3, "max_epochs": 1000,
                        "step_ms": args.growth_step_ms, "loader_workers": 2,
                        "tf_adapter_kwargs": options["tf_adapter_kwargs"],
                        "torch_adapter_kwargs": options["torch_adapter_kwargs"]}
                results["growth"][adapter] = _run_worker(spec, scratch, args.timeout + args.growth_seconds)
                shutil.rmtree(gdir, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    results["seconds"] = time.perf_counter() - started
    results["machine"]["load_after"] = os.getloadavg()
    results["table"] = contender_table(results)
    results["markdown"] = markdown(results)
    if args.plots:
        results["plots"] = plot(results, args.plots)
    if args.update_docs:
        results["published"] = publish(results, os.path.join(REPO, "docs"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    sys.stdout.write(results["markdown"] + "\n")
    return results


def publish(results: dict, docs_dir: str) -> bool:
    """:func:`update_docs`, unless a contender beat the limit (then say why, and write nothing)."""
    violations = results.get("limit_violations") or []
    if violations:
        logger.error("not updating the docs: a contender beat the limit by more than the noise between its "
                     "repeats, so this run did not measure what the docs claim. %s. Run it again on a quiet "
                     "machine; if it repeats, the limit is not one.", "; ".join(map(_violation_text, violations)))
        return False
    update_docs(results, docs_dir)
    return True


if __name__ == "__main__":
    outcome = main(parse_args())
    sys.exit(1 if outcome.get("published") is False else 0)
