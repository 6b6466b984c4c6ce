"""One contender (or one growth run) of ``throughput.py``, in a process of its own.

``throughput.py`` starts ``python _throughput_worker.py SPEC.json`` once per contender; the
worker writes its figures to ``spec["out"]``. Each process imports at most one framework:
TensorFlow and the ``tfrecord`` package cannot share a process (both register
``tensorflow.BytesList`` in protobuf's pool), and one framework's threads must not skew
another's figures. The module's top level imports no framework, because ``SamplerPool``'s
spawned workers import it again as ``__mp_main__``.

The "training process" is this process. Its CPU time is ``getrusage(RUSAGE_SELF)``, which
counts every thread (TensorFlow's C++ parsing threads included), minus the monitor thread
of this module. DataLoader workers are child processes and are counted apart.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import resource
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

MiB = 1 << 20


class Unavailable(Exception):
    """The contender cannot run here; the message says why."""


# --------------------------------------------------------------------------- page cache
def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned buffer. The kernel copies into a buffer whose address is 16 bytes past a
    page boundary (a large ``bytearray``) at a fraction of the speed on some CPUs (4 KiB
    aliasing of source and destination): 0.46 s/GB against 0.12 here, for 1 MiB reads."""
    return memoryview(mmap.mmap(-1, nbytes))


def resident_fraction(paths: list[str]) -> float | None:
    """Fraction of the files' pages in the page cache (``mincore``), or None where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name or not hasattr(mmap, "PAGESIZE"):
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = pages = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: never written back
            try:
                address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) != 0:
                    return None
                resident += int((np.frombuffer(vec, np.uint8) & 1).sum())
                pages += n
            finally:
                mapped.close()
    return resident / pages if pages else None


def warm(paths: list[str]) -> dict:
    """One plain read of every file: the same warming before every timed epoch of every contender."""
    buffer = aligned_buffer(MiB)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while got := os.preadv(fd, [buffer], offset):
                offset += got
        finally:
            os.close(fd)
    return {"warm_s": time.perf_counter() - start, "resident_before": resident_fraction(paths)}


def evict(paths: list[str]) -> dict:
    """Drop the files' pages from the page cache (``POSIX_FADV_DONTNEED``), so the next epoch
    reads from disk; says how much stayed (a tmpfs, or pages another process maps, cannot go)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"resident_before": resident_fraction(paths)}


def contender_files(name: str, size: dict) -> list[str]:
    """The files contender ``name`` reads: these are warmed (or evicted) before its epochs."""
    if name == "webdataset":
        return list(size["tar_paths"])
    if name == "cuda_ceiling":
        return []
    if name == "tfrecord_indexed" or name.startswith("tfrecord_pinned_"):
        return list(size["paths"]) + list(size["index_paths"])
    return list(size["paths"])


# --------------------------------------------------------------------------- measurement
class Monitor:
    """Samples RSS of this process and of its child processes (DataLoader workers) in a thread.

    Its own CPU time is measured with ``time.thread_time`` so that it can be subtracted from
    the training process's CPU figure.
    """

    def __init__(self, period: float = 0.05) -> None:
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self.period = period
        self.thread_cpu = 0.0
        self._lock = threading.Lock()
        self.reset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-monitor", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        with self._lock:
            self.peak_self = 0
            self.peak_children = 0
            self.peak_child = 0

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            start = time.thread_time()
            self.sample()
            self.add_thread_cpu(time.thread_time() - start)

    def add_thread_cpu(self, seconds: float) -> None:
        """Book CPU time of a measuring thread, to be left out of the training process's figure."""
        with self._lock:
            self.thread_cpu += seconds

    def sample(self) -> dict[str, int]:
        rss_self = self._proc.memory_info().rss
        rss_children = []
        for child in self._children():
            try:
                rss_children.append(child.memory_info().rss)
            except self._psutil.Error:
                pass
        with self._lock:
            self.peak_self = max(self.peak_self, rss_self)
            self.peak_children = max(self.peak_children, sum(rss_children))
            self.peak_child = max(self.peak_child, max(rss_children, default=0))
        return {"self": rss_self, "children": sum(rss_children), "child_max": max(rss_children, default=0)}

    def _children(self) -> list:
        try:
            return self._proc.children(recursive=True)
        except self._psutil.Error:
            return []

    def children_cpu(self) -> dict[int, float]:
        """CPU seconds (user + system) of each live child process, by pid."""
        out = {}
        for child in self._children():
            try:
                times = child.cpu_times()
                out[child.pid] = times.user + times.system
            except self._psutil.Error:
                pass
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rusage(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class CpuMark:
    """CPU seconds of this process and of its children between two moments.

    Children that were reaped in between are counted through ``RUSAGE_CHILDREN``; live ones
    (persistent DataLoader workers) through psutil, so neither kind is missed or counted twice.
    """

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.self0 = _rusage(resource.RUSAGE_SELF)
        self.thread0 = monitor.thread_cpu
        self.reaped0 = _rusage(resource.RUSAGE_CHILDREN)
        self.live0 = monitor.children_cpu()

    def self_cpu(self) -> float:
        return (_rusage(resource.RUSAGE_SELF) - self.self0) - (self.monitor.thread_cpu - self.thread0)

    def children_cpu(self) -> float:
        live = self.monitor.children_cpu()
        reaped = _rusage(resource.RUSAGE_CHILDREN) - self.reaped0
        # A child reaped in between is in `reaped` with its whole life: take off what it had used before.
        reaped -= sum(cpu for pid, cpu in self.live0.items() if pid not in live)
        return reaped + sum(cpu - self.live0.get(pid, 0.0) for pid, cpu in live.items())


def run_epoch(epoch_iterable: Callable[[], Iterable], count: Callable[[Any], tuple[int, Any]],
              monitor: Monitor, step_s: float = 0.0) -> tuple[dict, list]:
    """Iterate one epoch; return its figures and the id arrays it saw."""
    mark = CpuMark(monitor)
    start = time.perf_counter()
    iterator = iter(epoch_iterable())
    first = None
    records = 0
    ids = []
    batches = 0
    for batch in iterator:
        if first is None:
            first = time.perf_counter() - start
        n, batch_ids = count(batch)
        records += n
        batches += 1
        if batch_ids is not None:
            ids.append(batch_ids)
        del batch
        if step_s:
            time.sleep(step_s)
    wall = time.perf_counter() - start
    self_cpu = mark.self_cpu()
    del iterator  # shuts non-persistent DataLoader workers down, so their CPU is counted
    children_cpu = mark.children_cpu()
    return {"wall_s": wall, "first_batch_s": first if first is not None else wall, "records": records,
            "batches": batches, "train_cpu_s": self_cpu, "workers_cpu_s": children_cpu}, ids


def _unique(ids: list) -> tuple[int, int, int]:
    """(unique, min, max) of the ids seen."""
    if not ids:
        return 0, 0, 0
    allids = np.concatenate([np.asarray(i, dtype=np.int64).ravel() for i in ids])
    return int(np.unique(allids).size), int(allids.min()), int(allids.max())


# ----------------------------------------------------------------------------- contenders
class Pipeline:
    """What a contender gives the epoch loop: a fresh iterable per epoch and a batch counter."""

    def __init__(self, epoch: Callable[[], Iterable], count: Callable[[Any], tuple[int, Any]],
                 checks_ids: bool = True, note: str = "") -> None:
        self.epoch = epoch
        self.count = count
        self.checks_ids = checks_ids
        self.note = note


def _plain(size: dict, opts: dict) -> Pipeline:
    buffer = aligned_buffer(MiB)
    paths = size["paths"]
    per_file = size["records_per_path"]

    def epoch():
        for path, records in zip(paths, per_file):
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    yield 0
            yield records

    return Pipeline(epoch, lambda n: (n, None), checks_ids=False,
                    note="sequential readinto, page-aligned 1 MiB buffer, one reader")


def _plain_cores(size: dict, opts: dict) -> Pipeline:
    """One reader thread per core, each over its own files (readinto runs without the GIL)."""
    readers = os.cpu_count() or 1
    paths = size["paths"]
    buffers = [aligned_buffer(MiB) for _ in range(readers)]

    def read(mine: list[str], buffer: memoryview) -> None:
        for path in mine:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass

    def epoch():
        threads = [threading.Thread(target=read, args=(paths[i::readers], buffers[i])) for i in range(readers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        yield sum(size["records_per_path"])

    return Pipeline(epoch, lambda n: (n, None), checks_ids=False,
                    note=f"readinto as plain_read, {readers} reader threads (one per core) over disjoint shards: "
                         "the machine's limit")


def _tf_imports():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    return tf


def _tf_raw(size: dict, opts: dict) -> Pipeline:
    tf = _tf_imports()
    ds = tf.data.TFRecordDataset(size["paths"]).batch(size["batch_size"]).prefetch(tf.data.AUTOTUNE)
    return Pipeline(lambda: ds, lambda b: (int(b.shape[0]), None), checks_ids=False,
                    note="TFRecordDataset(paths).batch().prefetch(): serialized records, not parsed")


def _tf_parse_fn(tf, floats: int):
    spec = {"id": tf.io.FixedLenFeature([], tf.string), "x": tf.io.FixedLenFeature([], tf.string)}

    def parse(serialized):
        features = tf.io.parse_example(serialized, spec)
        return {"id": tf.reshape(tf.io.decode_raw(features["id"], tf.int64), [-1]),
                "x": tf.reshape(tf.io.decode_raw(features["x"], tf.float32), [-1, floats])}

    return parse


def _tf_handwritten(size: dict, opts: dict) -> Pipeline:
    tf = _tf_imports()
    cycle = max(1, min(opts.get("cycle_length", 4), len(size["paths"])))
    files = tf.data.Dataset.from_tensor_slices(size["paths"])
    ds = files.interleave(lambda p: tf.data.TFRecordDataset(p, buffer_size=opts.get("tf_buffer", 8 * MiB)),
                          cycle_length=cycle, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    ds = ds.batch(size["batch_size"])
    ds = ds.map(_tf_parse_fn(tf, size["floats"]), num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    return Pipeline(lambda: ds, lambda b: (int(b["id"].shape[0]), b["id"].numpy()),
                    note=f"interleave(TFRecordDataset, cycle_length={cycle}, AUTOTUNE, deterministic=False) "
                         "-> batch -> map(parse_example + decode_raw, AUTOTUNE) -> prefetch")


def _growcache_attr(name: str):
    import growcache

    try:
        return getattr(growcache, name)
    except (ImportError, AttributeError) as exc:
        raise Unavailable(f"growcache.{name} is not importable: {type(exc).__name__}: {exc}") from exc


def _tf_adapter(defaults: bool):
    def build(size: dict, opts: dict) -> Pipeline:
        _tf_imports()
        make_tf_dataset = _growcache_attr("make_tf_dataset")
        kwargs = {} if defaults else dict(opts.get("tf_adapter_kwargs", {}))
        ds = make_tf_dataset(size["cache"], size["batch_size"], **kwargs)

        def count(batch):
            features = batch[0] if isinstance(batch, tuple) else batch
            return int(features["id"].shape[0]), features["id"].numpy()

        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "defaults: record shuffle buffer on"
        return Pipeline(lambda: ds, count, note=f"make_tf_dataset(cache, batch_size; {shown})")

    return build


def _decode_tfrecord_example(features: dict) -> dict:
    # The README's transform idiom: turn the raw bytes features into arrays.
    return {"id": np.frombuffer(features["id"], dtype=np.int64)[0],
            "x": np.frombuffer(features["x"], dtype=np.float32)}


def _cuda_torch():
    import torch

    if not torch.cuda.is_available():
        raise Unavailable(f"needs a CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none")
    return torch


def _to_cuda_count(torch):
    """Counts a CPU batch after the user's own copy to the GPU, as a training loop moves it:
    every tensor with ``.to("cuda", non_blocking=True)``; the ids come back to be counted,
    which waits for the copies."""
    def count(batch):
        on_gpu = {k: t.to("cuda", non_blocking=True) for k, t in batch.items()}
        ids = on_gpu["id"].cpu().numpy()
        return int(ids.shape[0]), ids

    return count


def _tfrecord_package(indexed: bool, workers: int = 2, pin: bool = False):
    def build(size: dict, opts: dict) -> Pipeline:
        import torch
        from tfrecord.torch.dataset import TFRecordDataset

        if pin:
            _cuda_torch()
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        index_paths = size["index_paths"] if indexed else [None] * len(size["paths"])
        description = {"id": "byte", "x": "byte"}
        dataset = torch.utils.data.ChainDataset(
            [TFRecordDataset(p, i, description, transform=_decode_tfrecord_example)
             for p, i in zip(size["paths"], index_paths)])
        loader = torch.utils.data.DataLoader(dataset, batch_size=size["batch_size"], num_workers=workers,
                                             pin_memory=pin)
        note = ("ChainDataset of tfrecord.torch.TFRecordDataset(path, index, description, transform) per shard, "
                f"DataLoader(batch_size, num_workers={workers}{', pin_memory=True' if pin else ''}); "
                f"{'with' if indexed else 'without'} index files")
        if not indexed:
            note += ": every worker reads every record"
        if pin:
            note += "; each batch .to('cuda', non_blocking=True)"
            return Pipeline(lambda: loader, _to_cuda_count(torch), note=note)
        return Pipeline(lambda: loader, lambda b: (int(b["id"].shape[0]), b["id"].numpy()), note=note)

    return build


def _torch_adapter(workers: int, device: str | None = None, pin: bool = False):
    def build(size: dict, opts: dict) -> Pipeline:
        import torch  # noqa: F401 - the framework this contender measures

        if device or pin:
            torch = _cuda_torch()
        make_torch_loader = _growcache_attr("make_torch_loader")
        kwargs = dict(opts.get("torch_adapter_kwargs", {}))
        if device:
            kwargs["device"] = device
        if pin:
            kwargs["pin_memory"] = True
        loader = make_torch_loader(size["cache"], size["batch_size"], num_workers=workers, **kwargs)
        shown = "".join(f", {k}={v!r}" for k, v in kwargs.items())
        note = f"make_torch_loader(cache, batch_size, num_workers={workers}{shown}); other arguments at their defaults"
        if pin:
            return Pipeline(lambda: loader, _to_cuda_count(torch),
                            note=note + "; each batch .to('cuda', non_blocking=True) by the user")
        if device:
            # The ids come back to the host to be counted: that waits for the batch's copy.
            return Pipeline(lambda: loader, lambda b: (int(b["id"].shape[0]), b["id"].cpu().numpy()),
                            note=note + "; batches arrive on the GPU")
        return Pipeline(lambda: loader, lambda b: (int(b["id"].shape[0]), b["id"].numpy()), note=note)

    return build


def _cuda_ceiling(size: dict, opts: dict) -> Pipeline:
    """A pinned host buffer of one batch copied to the GPU once per batch: the DMA ceiling."""
    torch = _cuda_torch()
    nbytes = size["batch_size"] * size["payload_bytes_per_record"]
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    per_batch = size["batch_size"]
    batches, rest = divmod(size["records"], per_batch)

    def epoch():
        for k in range(batches + (1 if rest else 0)):
            target.copy_(source, non_blocking=True)
            yield per_batch if k < batches else rest
        torch.cuda.synchronize()

    return Pipeline(epoch, lambda n: (n, None), checks_ids=False,
                    note=f"one pinned {nbytes / MiB:.0f} MiB host tensor copied to the GPU per batch "
                         "(non_blocking, one stream): the host-to-device ceiling")


def _webdataset(size: dict, opts: dict) -> Pipeline:
    import webdataset as wds

    warnings.filterwarnings("ignore", category=UserWarning, module="webdataset")
    dataset = (wds.WebDataset(size["tar_paths"], shardshuffle=False, empty_check=False)
               .decode().to_tuple("x.npy", "id.cls").batched(size["batch_size"]))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=2)
    return Pipeline(lambda: loader, lambda b: (int(b[1].shape[0]), b[1].numpy()),
                    note="WebDataset(tars, shardshuffle=False).decode().to_tuple('x.npy','id.cls').batched(), "
                         "WebLoader(batch_size=None, num_workers=2); shards split by worker")


CONTENDERS: dict[str, Callable[[dict, dict], Pipeline]] = {
    "plain_read": _plain,
    "plain_read_cores": _plain_cores,
    "tf_raw_records": _tf_raw,
    "tf_handwritten": _tf_handwritten,
    "growcache_tf": _tf_adapter(defaults=False),
    "growcache_tf_shuffled": _tf_adapter(defaults=True),
    "tfrecord_indexed": _tfrecord_package(True),
    "tfrecord_unindexed": _tfrecord_package(False),
    "growcache_torch_1w": _torch_adapter(1),
    "growcache_torch_2w": _torch_adapter(2),
    "webdataset": _webdataset,
}


def versions() -> dict[str, str]:
    out = {"numpy": np.__version__}
    for name in ("tensorflow", "torch", "tfrecord", "webdataset", "growcache"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = getattr(module, "__version__", "?")
    return out


# Contenders with a worker count in their name (``--workers``, ``--device cuda``).
SWEPT: dict[str, Callable[[int], Callable[[dict, dict], Pipeline]]] = {
    "growcache_torch": lambda n: _torch_adapter(n),
    "growcache_cuda": lambda n: _torch_adapter(n, device="cuda"),
    "growcache_pinned": lambda n: _torch_adapter(n, pin=True),
    "tfrecord_pinned": lambda n: _tfrecord_package(True, n, pin=True),
}


def builder(name: str) -> Callable[[dict, dict], Pipeline]:
    """The builder of contender ``name``: a fixed one, ``cuda_ceiling``, or ``<kind>_<N>w``."""
    if name in CONTENDERS:
        return CONTENDERS[name]
    if name == "cuda_ceiling":
        return _cuda_ceiling
    kind, _, workers = name.rpartition("_")
    if kind in SWEPT and workers.endswith("w") and workers[:-1].isdigit():
        return SWEPT[kind](int(workers[:-1]))
    raise KeyError(f"unknown contender {name!r}")


def _measure(pipeline: Pipeline, size: dict, monitor: Monitor, epoch: int) -> dict:
    figures, ids = run_epoch(pipeline.epoch, pipeline.count, monitor)
    if pipeline.checks_ids:
        unique, lo, hi = _unique(ids)
        figures.update(unique_records=unique, duplicates=figures["records"] - unique,
                       ids_in_range=bool(lo >= 0 and hi < size["records"]))
    else:
        figures.update(unique_records=None, duplicates=None)
    figures["rss_self"] = monitor.sample()
    figures["epoch_in_process"] = epoch
    return figures


def run_contender(spec: dict) -> dict:
    """Per record size: warm-up epochs; a cold epoch (the contender's files evicted from the
    page cache first) unless ``spec["cold"]`` is false; then the timed epochs, each after the
    same warming read of the contender's files, with the residency checked (``mincore``)."""
    name = spec["contender"]
    monitor = Monitor()
    result: dict[str, Any] = {"contender": name, "available": True, "sizes": {}}
    try:
        for size in spec["sizes"]:
            label = size["label"]
            try:
                pipeline = builder(name)(size, spec.get("options", {}))
            except Unavailable as exc:
                return {"contender": name, "available": False, "reason": str(exc), "versions": versions()}
            files = contender_files(name, size)
            per_size: dict[str, Any] = {"note": pipeline.note, "warmup": [], "runs": [], "cold": []}
            monitor.reset()
            epoch = 0
            for _ in range(spec["warmup_epochs"]):
                state = warm(files)
                per_size["warmup"].append(dict(_measure(pipeline, size, monitor, epoch), **state))
                epoch += 1
            if spec.get("cold", True) and files:
                state = evict(files)
                per_size["cold"].append(dict(_measure(pipeline, size, monitor, epoch), **state))
                epoch += 1
            for _ in range(spec["epochs"]):
                state = warm(files)
                per_size["runs"].append(dict(_measure(pipeline, size, monitor, epoch), **state))
                epoch += 1
            per_size["peak_rss_train"] = monitor.peak_self
            per_size["peak_rss_workers_sum"] = monitor.peak_children
            per_size["peak_rss_worker_max"] = monitor.peak_child
            result["sizes"][label] = per_size
            del pipeline
    finally:
        monitor.stop()
    result["versions"] = versions()
    return result


# -------------------------------------------------------------------------------- growth
def run_growth(spec: dict) -> dict:
    """A SamplerPool writes into a small cache while one adapter trains epoch after epoch."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _throughput_source import RateLimitedSource

    import growcache

    adapter = spec["adapter"]
    try:
        SamplerPool = growcache.SamplerPool
    except (ImportError, AttributeError) as exc:
        return {"adapter": adapter, "available": False,
                "reason": f"growcache.SamplerPool is not importable: {type(exc).__name__}: {exc}"}
    floats = spec["record_bytes"] // 4
    schema = growcache.Schema({"id": ("int64", ()), "x": ("float32", (floats,))})
    cache = growcache.Cache(spec["dir"], capacity=spec["budget"], schema=schema)
    payload = schema.record_payload_bytes
    try:
        if adapter == "tf":
            _tf_imports()
            make = _growcache_attr("make_tf_dataset")
            # Built before the samplers publish anything, as a training script would be.
            data = make(cache, spec["batch_size"], wait_for_shards=60, **spec.get("tf_adapter_kwargs", {}))

            def count(batch):
                features = batch[0] if isinstance(batch, tuple) else batch
                return int(features["id"].shape[0]), features["id"].numpy()
        else:
            import torch  # noqa: F401

            make = _growcache_attr("make_torch_loader")
            data = make(cache, spec["batch_size"], num_workers=spec["loader_workers"], wait_for_shards=60,
                        **spec.get("torch_adapter_kwargs", {}))

            def count(batch):
                return int(batch["id"].shape[0]), batch["id"].numpy()
    except Unavailable as exc:
        return {"adapter": adapter, "available": False, "reason": str(exc)}

    monitor = Monitor()
    source = RateLimitedSource(floats, spec["rate"] / spec["workers"])
    timeline: list[dict] = []
    epochs: list[dict] = []
    stop = threading.Event()
    t_zero = time.perf_counter()

    def watch() -> None:
        while not stop.wait(spec.get("watch_period", 0.25)):
            start = time.thread_time()
            stats = cache.stats()
            timeline.append({"t": time.perf_counter() - t_zero, "cache_bytes": stats.bytes, "shards": stats.shards,
                             "published_bytes": stats.published_bytes, "evicted_bytes": stats.evicted_bytes})
            monitor.add_thread_cpu(time.thread_time() - start)

    watcher = threading.Thread(target=watch, name="bench-growth-watch", daemon=True)
    try:
        with SamplerPool(cache, source, workers=spec["workers"], shard_size=spec["shard_size"], seed=0) as pool:
            watcher.start()
            wait_start = time.perf_counter()
            pool.wait_for(records=1, timeout=60)
            while not cache.list_shards():  # records written are not yet a published shard
                if hasattr(pool, "raise_if_failed"):
                    pool.raise_if_failed()
                if time.perf_counter() - wait_start > 60:
                    raise RuntimeError("no shard was published within 60 s")
                time.sleep(0.01)
            first_shard_s = time.perf_counter() - wait_start
            previous: dict[int, Any] = {}
            deadline = time.perf_counter() + spec["seconds"]
            while len(epochs) < spec["max_epochs"] and (time.perf_counter() < deadline
                                                        or len(epochs) < spec["min_epochs"]):
                before = {s.seq: s for s in cache.list_shards()}
                stats0 = cache.stats()
                t_start = time.perf_counter() - t_zero
                figures, ids = run_epoch(lambda: data, count, monitor, step_s=spec["step_ms"] / 1000)
                stats1 = cache.stats()
                after = {s.seq: s for s in cache.list_shards()}
                snapshot = _estimate_snapshot(before, after, figures["records"])
                unique, _, _ = _unique(ids)
                read_s = figures["wall_s"] - figures["batches"] * spec["step_ms"] / 1000
                epochs.append({
                    "epoch": len(epochs), "t_start": t_start, "t_end": time.perf_counter() - t_zero,
                    "snapshot_shards": len(snapshot), "snapshot_records": sum(s.records for s in snapshot.values()),
                    "new_shards": len(set(snapshot) - set(previous)) if previous else len(snapshot),
                    "evicted_shards": len(set(previous) - set(snapshot)),
                    "records": figures["records"], "unique_records": unique,
                    "MBps": unique * payload / figures["wall_s"] / 1e6,
                    "read_MBps": unique * payload / max(read_s, 1e-9) / 1e6,
                    "first_batch_s": figures["first_batch_s"], "wall_s": figures["wall_s"],
                    "train_cpu_s": figures["train_cpu_s"], "other_cpu_s": figures["workers_cpu_s"],
                    "sampler_MBps": (stats1.published_bytes - stats0.published_bytes) / figures["wall_s"] / 1e6,
                    "cache_bytes_end": stats1.bytes, "loader_worker_rss_MiB": _forked_children_rss(),
                })
                previous = snapshot
            pool_stats = {k: getattr(pool, k) for k in ("restarts", "records", "shards") if hasattr(pool, k)}
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        monitor.stop()
    del data
    return {"adapter": adapter, "available": True, "first_shard_s": first_shard_s, "epochs": epochs,
            "timeline": timeline, "payload_bytes_per_record": payload, "pool": pool_stats,
            "budget": spec["budget"], "versions": versions(),
            "note": ("other_cpu_s counts child processes of the training process: DataLoader workers "
                     "and the SamplerPool's samplers")}


def _forked_children_rss() -> list[float]:
    """RSS (MiB) of each forked child (DataLoader workers share our command line; spawned
    samplers do not)."""
    import psutil

    me = psutil.Process()
    out = []
    for child in me.children():
        try:
            if child.cmdline() == me.cmdline():
                out.append(child.memory_info().rss / MiB)
        except psutil.Error:
            pass
    return out


def _estimate_snapshot(before: dict, after: dict, records: int) -> dict:
    """The epoch's snapshot, seen from outside the adapter: shards listed both before the
    epoch and after it, plus, in publish order, shards published meanwhile while the record
    count read still allows them (the adapter's own snapshot may be a moment later)."""
    snapshot = {seq: s for seq, s in before.items() if seq in after}
    total = sum(s.records for s in snapshot.values())
    for seq in sorted(set(after) - set(before)):
        if total + after[seq].records > records:
            break
        snapshot[seq] = after[seq]
        total += after[seq].records
    return snapshot


# ------------------------------------------------------------------------------- prepare
def prepare(spec: dict) -> dict:
    """Index files (the ``tfrecord`` package's tool) and WebDataset tars of the same records."""
    import webdataset as wds
    from tfrecord.tools.tfrecord2idx import create_index

    import growcache
    from growcache.example import ExampleCodec
    from growcache.records import iter_records

    for size in spec["sizes"]:
        for path, index in zip(size["paths"], size["index_paths"]):
            create_index(path, index + ".tmp")
            os.replace(index + ".tmp", index)
        codec = ExampleCodec(growcache.Cache(size["cache"]).schema)
        for path, tar in zip(size["paths"], size["tar_paths"]):
            with wds.TarWriter(tar + ".tmp") as sink:
                for _, record in iter_records(path):
                    sample = codec.decode(record, copy=False)
                    # One member per feature, as WebDataset users store arrays: x.npy and an integer label.
                    sink.write({"__key__": f"{int(sample['id']):010d}", "x.npy": sample["x"],
                                "id.cls": int(sample["id"])})
            os.replace(tar + ".tmp", tar)
    return {"available": True, "versions": versions()}


def run_metrics_ab(spec: dict) -> dict:
    """growcache's torch loader with its input figures on against off, alternating epochs
    (benchmarks/metrics_overhead.py's alternate_on_off), on the first shard set."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from metrics_overhead import alternate_on_off

    import growcache

    size = spec["sizes"][0]
    with growcache.make_torch_loader(growcache.Cache(size["cache"]), size["batch_size"],
                                     num_workers=spec["workers"]) as loader:
        mbps = alternate_on_off(loader, spec["repeats"],
                                lambda batch: batch["x"].numel() * batch["x"].element_size())
    return {"available": True, "label": size["label"], "workers": spec["workers"], "MBps": mbps}


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    try:
        modes = {"growth": run_growth, "prepare": prepare, "contender": run_contender,
                 "metrics_ab": run_metrics_ab}
        result = modes[spec["mode"]](spec)
    except Exception as exc:  # reported, not hidden: the orchestrator prints and records it
        result = {"available": False, "failed": True, "reason": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
