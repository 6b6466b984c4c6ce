"""How fast samplers fill a cache from a far store: published samples in MB/s and samples/s.

The store is a real HTTP range server (aiohttp's ``web.FileResponse``: Range, sendfile) in a
process of its own, behind a latency relay in another process: a TCP relay that holds each
request for ``--latency-ms`` (plus up to ``--jitter-ms``) before passing it on, as an object
store takes about 50 ms to answer a range GET. The data are random windows of ``.npy``
arrays read with ``NpyWindowSource``.

Contenders, each on the same store and windows:

* ``SamplerPool`` with each ``--workers`` count at each ``--concurrency``, into a fresh cache
  (its figures come from the pool's own counters and the workers' ``/proc`` CPU times);
* ``plain_32_threads``: one process, 32 threads each calling ``fs.cat_file`` on random windows:
  the reference client the issue's targets compare against;
* ``floor_fetch_write_c64``: none of growcache's sampler, only what a sampler cannot skip: 64 reads
  in flight on one event loop through ``_cat_file``, and a writer thread that frames each window as
  a TFRecord record with its CRC32C (growcache's framing functions), appends it to 64 MiB files, fsyncs, renames and deletes the oldest past
  2 GiB. Its CPU per GB is the floor of "fetch and shard writing" with these libraries on this host;
* ``bare_fetch_c64`` and ``floor_bare_write_c64``: no HTTP library either: 64 bare HTTP/1.1 keep-alive
  connections on one event loop, each receiving its bodies into one reused buffer (asyncio's
  ``BufferedProtocol``), only fetching, or also writing each window as the floor does, inline on
  the same thread. The second is the least CPU per GB any sampler could spend here;
* ``ideal``: in-flight x window size / latency, for 32 in flight.

Reported per contender: MB/s and samples/s over a measured window after the first sample,
sampler CPU seconds per GB (for a pool also split by thread: the event loop that fetches, the sample
loop that frames, checksums and writes records, and the rest: publishing, fsync, eviction), peak RSS of
the sampler processes, and the time from ``start()``
of a pool on an empty cache to its first published shard and to the first batch (32 records)
read and decoded from the cache.

Run::

    .venv/bin/python benchmarks/fill.py --latency-ms 50,100 --window-kib 1024,16 --json fill.json

``--quick`` runs a tiny configuration in seconds (it checks the benchmark works; its figures
mean nothing). ``--markdown`` prints the table for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import subprocess
import sys
import tempfile
import shutil
import threading
import time
from typing import Any, Callable

import numpy as np

ROW_BYTES = 16 << 10  # one row of each array; a window is a whole number of rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the store: an HTTP range server and a latency relay, each a process ----------------------------
def serve_files(root: str, port: int) -> None:
    from aiohttp import web

    async def handle(request: Any) -> Any:
        return web.FileResponse(os.path.join(root, os.path.basename(request.match_info["name"])))

    app = web.Application()
    app.router.add_get("/{name}", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def relay(listen: int, upstream: int, latency_s: float, jitter_s: float) -> None:
    """Each chunk from a client (a request: no pipelining on HTTP/1.1) waits ``latency_s`` before
    it goes on; answers pass straight back."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: bool) -> None:
        try:
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    break
                if delay:
                    await asyncio.sleep(latency_s + random.uniform(0, jitter_s))
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    async def main() -> None:
        server = await asyncio.start_server(client, "127.0.0.1", listen, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class Store:
    """The server and relay processes; ``url`` reaches the files through the relay."""

    def __init__(self, root: str, latency_ms: float, jitter_ms: float) -> None:
        self.server_port, self.port = _free_port(), _free_port()
        me = os.path.abspath(__file__)
        self.procs = [
            subprocess.Popen([sys.executable, me, "--serve", root, str(self.server_port)]),
            subprocess.Popen([sys.executable, me, "--relay", str(self.port), str(self.server_port),
                              str(latency_ms / 1e3), str(jitter_ms / 1e3)]),
        ]
        self.url = f"http://127.0.0.1:{self.port}"
        for port in (self.server_port, self.port):
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(10)


def make_arrays(root: str, count: int, nbytes: int) -> list[str]:
    rng = np.random.default_rng(0)
    names = []
    for i in range(count):
        name = f"arr{i}.npy"
        path = os.path.join(root, name)
        rows = max(1, nbytes // ROW_BYTES)
        if not os.path.exists(path) or os.path.getsize(path) < rows * ROW_BYTES:
            np.save(path, rng.integers(0, 255, size=(rows, ROW_BYTES), dtype=np.uint8))
        names.append(name)
    return names


# -- contenders -----------------------------------------------------------------------------------
def _stat_cpu_s(path: str) -> float:
    """User + system CPU seconds from a ``/proc/.../stat`` file."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += _stat_cpu_s(f"/proc/{pid}/stat")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _thread_cpu_s(pids: list[int]) -> dict[str, float]:
    """CPU seconds of the sampler processes split by thread: ``main`` (the sample loop: framing, CRC and
    writing each record), ``loop`` (the busiest other live thread: the event loop that fetches) and
    ``other`` (the rest, threads that already exited included: publishing, fsync, eviction, stats).
    The three add up to :func:`_cpu_s`."""
    split = {"main": 0.0, "loop": 0.0, "other": _cpu_s(pids)}
    for pid in pids:
        try:
            threads = {int(tid): _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat") for tid in os.listdir(f"/proc/{pid}/task")}
        except (OSError, IndexError, ValueError):
            continue
        main = threads.pop(pid, 0.0)
        loop = max(threads.values(), default=0.0)
        split["main"] += main
        split["loop"] += loop
        split["other"] -= main + loop
    return split


def first_batch(cache: Any, batch: int) -> bool:
    """Read the first ``batch`` records the cache publishes, decoded into arrays, as a reader would:
    ``True`` once a whole batch was read (``False``: not enough records published yet)."""
    from growcache.example import ExampleCodec
    from growcache.records import iter_records

    codec, rows = ExampleCodec(cache.schema), []
    snapshot = cache.snapshot(holder="fill benchmark")
    try:
        for shard in snapshot.shards:
            for _, record in iter_records(shard.path):
                rows.append(codec.decode(record)["x"])
                if len(rows) == batch:
                    np.stack(rows)
                    return True
    finally:
        snapshot.close()
    return False


def run_pool(urls: list[str], window: int, workers: int, concurrency: int, seconds: float, tmp: str,
             batch: int = 32) -> dict:
    """``SamplerPool`` into a fresh cache: its fill rate, CPU, RSS, and the time from ``start()`` to
    the first published shard and to the first batch of ``batch`` records read from the cache."""
    from growcache import Cache, SamplerPool, Schema
    from growcache.sources import NpyWindowSource

    schema = Schema({"x": ("uint8", (window, ROW_BYTES))})
    folder = tempfile.mkdtemp(dir=tmp)
    cache = Cache(folder, capacity="2GiB", schema=schema)
    source = NpyWindowSource(urls, window)
    sample_bytes = window * ROW_BYTES
    pool = SamplerPool(cache, source, workers=workers, concurrency=concurrency, shard_size="64MiB", seed=1)
    started = time.monotonic()
    pool.start()
    first: dict[str, float | None] = {"shard": None, "batch": None}

    def look() -> None:  # the first shard, then the first batch, as soon as each is there
        if first["shard"] is None and pool.stats().shards:
            first["shard"] = time.monotonic() - started
        if first["shard"] is not None and first["batch"] is None and first_batch(cache, batch):
            first["batch"] = time.monotonic() - started

    try:
        while pool.stats().records_written < max(2, concurrency // 2) and time.monotonic() - started < 60:
            look()
            time.sleep(0.01)
        t0, s0, split0 = time.monotonic(), pool.stats(), _thread_cpu_s(pool.pids)
        end = t0 + seconds
        while time.monotonic() < end:
            look()
            time.sleep(0.02)
        t1, s1, split1 = time.monotonic(), pool.stats(), _thread_cpu_s(pool.pids)
        while first["batch"] is None and time.monotonic() - started < 30:
            look()
            time.sleep(0.02)
    finally:
        final = pool.stop()
        shutil.rmtree(folder, ignore_errors=True)  # each contender's cache goes: dozens of them fill a disk
    samples = s1.records_written - s0.records_written
    payload = samples * sample_bytes
    return {"MBps": payload / (t1 - t0) / 1e6, "samples_per_s": samples / (t1 - t0),
            "cpu_s_per_GB": (sum(split1.values()) - sum(split0.values())) / (payload / 1e9) if payload else None,
            "cpu_split_s_per_GB": {k: (split1[k] - split0[k]) / (payload / 1e9) for k in split0} if payload else None,
            "peak_rss_MB": max(final.worker_peak_rss) / 2**20, "first_shard_s": first["shard"],
            "first_batch_s": first["batch"],
            "latency_p50_ms": s1.latency_p50 * 1e3, "latency_p99_ms": s1.latency_p99 * 1e3,
            "throttle_events": s1.throttle_events}


def run_plain(urls: list[str], window: int, threads: int, seconds: float) -> dict:
    """``threads`` threads each calling ``fs.cat_file`` on random windows, in this process."""
    import fsspec

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    header = 128  # np.save's header for these arrays
    rows = [fs.size(u) // ROW_BYTES for u in urls]
    counts = [0] * threads
    stop = threading.Event()

    def loop(n: int) -> None:
        rng = random.Random(n)
        while not stop.is_set():
            i = rng.randrange(len(urls))
            start = header + rng.randrange(rows[i] - window) * ROW_BYTES
            fs.cat_file(urls[i], start=start, end=start + window * ROW_BYTES)
            counts[n] += 1

    pool = [threading.Thread(target=loop, args=(n,), daemon=True) for n in range(threads)]
    for t in pool:
        t.start()
    try:
        measured = _measured(lambda: sum(counts), seconds, window)
    finally:
        stop.set()
        for t in pool:
            t.join(30)
    return {**measured, "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class _FloorWriter:
    """What a sampler cannot skip to write a window: frame it as a TFRecord record with its CRC32C
    (growcache's ``frame_header``/``frame_footer``), append it to a 64 MiB file with ``writev``, fsync
    and rename each full file, and delete the oldest past ``keep_bytes`` (as eviction does)."""

    def __init__(self, folder: str, shard_bytes: int = 64 << 20, keep_bytes: int = 2 << 30) -> None:
        from growcache.records import crc32c, frame_footer, frame_header

        self._frame = (frame_header, frame_footer, crc32c)
        self.folder, self.shard_bytes, self.keep_bytes = folder, shard_bytes, keep_bytes
        self.fd: int | None = None
        self.size = self.count = self.written = 0
        self.files: list[str] = []

    def write(self, data: Any) -> None:
        header, footer, crc = self._frame
        if self.fd is None:
            self.path = os.path.join(self.folder, f"tmp-{self.count}")
            self.fd, self.size = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), 0
            self.count += 1
        os.writev(self.fd, [header(len(data)), data, footer(crc(data))])
        self.size += len(data) + 16
        self.written += 1
        if self.size >= self.shard_bytes:
            os.fsync(self.fd)
            os.close(self.fd)
            os.rename(self.path, self.path + ".tfrecord")
            self.files.append(self.path + ".tfrecord")
            self.fd = None
            while len(self.files) * self.shard_bytes > self.keep_bytes:
                os.unlink(self.files.pop(0))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _measured(count: Callable[[], int], seconds: float, window: int) -> dict:
    """Rate and CPU of this process over ``seconds``, after a warm-up, as ``count()`` counts windows."""
    time.sleep(min(1.0, seconds / 3))
    c0, t0, cpu0 = count(), time.monotonic(), time.process_time()
    time.sleep(seconds)
    c1, t1, cpu1 = count(), time.monotonic(), time.process_time()
    payload = (c1 - c0) * window * ROW_BYTES
    return {"MBps": payload / (t1 - t0) / 1e6, "samples_per_s": (c1 - c0) / (t1 - t0),
            "cpu_s_per_GB": (cpu1 - cpu0) / (payload / 1e9) if payload else None, "first_shard_s": None}


def run_floor(urls: list[str], window: int, concurrency: int, seconds: float, tmp: str) -> dict:
    """The least work a sampler must do, with none of growcache's code: fetch and write, nothing else.

    One event loop keeps ``concurrency`` reads in flight through the filesystem's ``_cat_file`` (as
    a sampler's engine does); one writer thread writes each window as :class:`_FloorWriter` does.
    Its CPU per GB is the floor of "fetch and shard writing" with these libraries on this host: the
    sampler's figure is read against it.
    """
    import queue

    import fsspec

    folder = tempfile.mkdtemp(dir=tmp)
    done: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    out = _FloorWriter(folder)

    def writer() -> None:
        while (data := done.get()) is not None:
            out.write(data)
        out.close()

    async def fetch_all(stop: threading.Event) -> None:
        fs = fsspec.filesystem("http", asynchronous=True, skip_instance_cache=True)
        session = await fs.set_session()
        header = 128  # np.save's header for these arrays
        rows = [(await fs._info(u))["size"] // ROW_BYTES for u in urls]

        async def one(n: int) -> None:
            rng = random.Random(n)
            while not stop.is_set():
                i = rng.randrange(len(urls))
                start = header + rng.randrange(rows[i] - window) * ROW_BYTES
                done.put(await fs._cat_file(urls[i], start=start, end=start + window * ROW_BYTES))

        await asyncio.gather(*(one(n) for n in range(concurrency)))
        await session.close()

    stop = threading.Event()
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    fetcher = threading.Thread(target=lambda: asyncio.run(fetch_all(stop)), daemon=True)
    fetcher.start()
    try:
        return _measured(lambda: out.written, seconds, window)
    finally:
        stop.set()
        fetcher.join(30)
        done.put(None)
        thread.join(30)
        shutil.rmtree(folder, ignore_errors=True)


class _BareRange(asyncio.BufferedProtocol):
    """A bare HTTP/1.1 keep-alive connection for range GETs of a known length, receiving each
    body into one reused buffer: no HTTP library, no copy but the kernel's. A measuring probe for
    the plain server of this benchmark (no TLS, redirects, chunked bodies or errors), not a client."""

    def __init__(self, capacity: int) -> None:
        self.buffer = bytearray(capacity + 64 * 1024)
        self.view = memoryview(self.buffer)
        self.got, self.end, self.body = 0, -1, 0
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.end < 0:
            head_end = self.buffer.find(b"\r\n\r\n", 0, self.got)
            if head_end < 0:
                return
            lines = bytes(self.buffer[:head_end]).split(b"\r\n")
            length = next(int(v) for k, _, v in (h.partition(b":") for h in lines[1:])
                          if k.strip().lower() == b"content-length")
            self.body, self.end = head_end + 4, head_end + 4 + length
        if self.got >= self.end and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or ConnectionError("the server closed the connection"))

    async def get(self, host: str, path: str, start: int, end: int) -> memoryview:
        self.got, self.end = 0, -1
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nRange: bytes={start}-{end - 1}\r\n\r\n".encode())
        await self.waiter
        return self.view[self.body:self.end]


def run_bare(urls: list[str], window: int, concurrency: int, seconds: float, tmp: str, write: bool) -> dict:
    """The least any sampler could do, with no HTTP library either: ``concurrency`` bare keep-alive
    connections (:class:`_BareRange`) on one event loop, each body written (``write``) inline on that
    one thread by :class:`_FloorWriter`, so no hand-over between threads. With ``write=False`` it
    only fetches: the cheapest fetch of a window on this host."""
    from urllib.parse import urlsplit

    import fsspec

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    rows = [fs.size(u) // ROW_BYTES for u in urls]
    parts = [urlsplit(u) for u in urls]
    folder = tempfile.mkdtemp(dir=tmp)
    out = _FloorWriter(folder)
    counted = [0]

    async def fetch_all(stop: threading.Event) -> None:
        loop = asyncio.get_running_loop()

        async def one(n: int) -> None:
            rng = random.Random(n)
            _, conn = await loop.create_connection(lambda: _BareRange(window * ROW_BYTES),
                                                   parts[0].hostname, parts[0].port)
            try:
                while not stop.is_set():
                    i = rng.randrange(len(urls))
                    start = 128 + rng.randrange(rows[i] - window) * ROW_BYTES  # np.save's header: 128
                    body = await conn.get(parts[i].netloc, parts[i].path, start, start + window * ROW_BYTES)
                    if write:
                        out.write(body)
                    counted[0] += 1
            finally:
                conn.transport.close()

        await asyncio.gather(*(one(n) for n in range(concurrency)))

    stop = threading.Event()
    fetcher = threading.Thread(target=lambda: asyncio.run(fetch_all(stop)), daemon=True)
    fetcher.start()
    try:
        return _measured(lambda: counted[0], seconds, window)
    finally:
        stop.set()
        fetcher.join(30)
        out.close()
        shutil.rmtree(folder, ignore_errors=True)


def main(args: argparse.Namespace) -> dict:
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        if args.update_docs:
            update_docs(results)
            plot(results, os.path.join(os.path.dirname(DOCS), "img", "fill.png"))
        print(markdown(results))
        return results
    results: dict[str, Any] = {"runs": [], "host_cores": os.cpu_count(), "args": vars(args),
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "load_average": [os.getloadavg()[0]]}
    tmp = tempfile.mkdtemp(prefix="growcache-fill-")
    data = args.dir or os.path.join(tmp, "data")
    os.makedirs(data, exist_ok=True)
    names = make_arrays(data, args.arrays, args.array_bytes)
    try:
        for latency in args.latency_ms:
            store = Store(data, latency, args.jitter_ms)
            try:
                urls = [f"{store.url}/{n}" for n in names]
                for kib in args.window_kib:
                    window = max(1, kib * 1024 // ROW_BYTES)
                    size = window * ROW_BYTES
                    run = {"latency_ms": latency, "window_bytes": size, "contenders": {}}
                    run["contenders"]["plain_32_threads"] = run_plain(urls, window, 32, args.seconds)
                    run["contenders"]["floor_fetch_write_c64"] = run_floor(urls, window, 64, args.seconds, tmp)
                    run["contenders"]["bare_fetch_c64"] = run_bare(urls, window, 64, args.seconds, tmp, write=False)
                    run["contenders"]["floor_bare_write_c64"] = run_bare(urls, window, 64, args.seconds, tmp, write=True)
                    for name in ("floor_fetch_write_c64", "bare_fetch_c64", "floor_bare_write_c64"):
                        print(f"{latency} ms {size >> 10} KiB {name}: {run['contenders'][name]}", flush=True)
                    for workers in args.workers:
                        for concurrency in args.concurrency:
                            name = f"pool_{workers}w_c{concurrency}"
                            run["contenders"][name] = run_pool(urls, window, workers, concurrency, args.seconds, tmp)
                            print(f"{latency} ms {size >> 10} KiB {name}: {run['contenders'][name]}", flush=True)
                    ideal = 32 * size / (latency / 1e3) / 1e6 if latency else None
                    run["contenders"]["ideal_32"] = {"MBps": ideal, "samples_per_s": ideal and ideal * 1e6 / size}
                    results["runs"].append(run)
            finally:
                store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the caches; arrays kept in --dir stay
    results["load_average"].append(os.getloadavg()[0])  # other work on the host skews every figure
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        print(markdown(results))
    if args.update_docs and not args.quick:
        update_docs(results)
        plot(results, os.path.join(os.path.dirname(DOCS), "img", "fill.png"))
    return results


def markdown(results: dict) -> str:
    lines = ["| latency | window | contender | MB/s | samples/s | x plain 32 | CPU s/GB | of which fetch loop / "
             "sample loop / other | peak RSS MB | first shard s | first batch s |",
             "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for run in results["runs"]:
        plain = run["contenders"]["plain_32_threads"]["MBps"]
        for name, c in run["contenders"].items():
            def fmt(v: Any, spec: str = ".1f") -> str:
                return "" if v is None else format(v, spec)
            ratio = c["MBps"] / plain if c.get("MBps") is not None and plain else None
            split = c.get("cpu_split_s_per_GB")
            split_text = " / ".join(f"{split[k]:.2f}" for k in ("loop", "main", "other")) if split else ""
            lines.append(f"| {run['latency_ms']:g} ms | {run['window_bytes'] >> 10} KiB | `{name}` | {fmt(c['MBps'])} | "
                         f"{fmt(c.get('samples_per_s'), '.0f')} | {fmt(ratio, '.2f')} | "
                         f"{fmt(c.get('cpu_s_per_GB'), '.2f')} | {split_text} | {fmt(c.get('peak_rss_MB'), '.0f')} | "
                         f"{fmt(c.get('first_shard_s'), '.2f')} | {fmt(c.get('first_batch_s'), '.2f')} |")
    return "\n".join(lines)


DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")
BEGIN, END = "<!-- fill:begin (benchmarks/fill.py --update-docs writes this block) -->", "<!-- fill:end -->"


def update_docs(results: dict, path: str = DOCS) -> None:
    """Replace the generated fill block of ``docs/benchmarks.md`` (added at the end the first time)."""
    a = results.get("args", {})
    block = (f"{BEGIN}\n\nMeasured {results.get('date', '')} on {results['host_cores']} cores: "
             f"{a.get('arrays')} arrays of {a.get('array_bytes', 0) >> 20} MiB, the relay's jitter "
             f"{a.get('jitter_ms', 0):g} ms, {a.get('seconds')} s measured per contender{_load(results)}.\n\n"
             f"![fill rate against concurrency](img/fill.png)\n\n{markdown(results)}\n\n{END}")
    with open(path) as f:
        text = f.read()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"  # the first run: at the end
    with open(path, "w") as f:
        f.write(text)


def _load(results: dict) -> str:
    load = results.get("load_average")
    if not load:
        return ""
    return f"; the host's load average {load[0]:.1f} at the start, {load[-1]:.1f} at the end"


def plot(results: dict, path: str) -> None:
    """Fill rate against concurrency, one panel per window size, a line per latency and worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({run["window_bytes"] for run in results["runs"]}, reverse=True)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for run in (r for r in results["runs"] if r["window_bytes"] == size):
            lat = run["latency_ms"]
            for workers in sorted({int(n.split("_")[1][:-1]) for n in run["contenders"] if n.startswith("pool_")}):
                points = sorted((int(n.rsplit("_c", 1)[1]), c["MBps"]) for n, c in run["contenders"].items()
                                if n.startswith(f"pool_{workers}w_"))
                ax.plot(*zip(*points), marker="o", label=f"{lat:g} ms, {workers} worker{'s' * (workers > 1)}")
            ax.axhline(run["contenders"]["plain_32_threads"]["MBps"], linestyle="--", linewidth=1,
                       label=f"{lat:g} ms, plain 32 threads")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (samples in flight per sampler process)")
        ax.set_ylabel("published MB/s")
        ax.set_title(f"{size >> 10} KiB windows")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency-ms", type=lambda t: [float(x) for x in t.split(",")], default=[50.0])
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--window-kib", type=_ints, default=[1024, 16])
    p.add_argument("--workers", type=_ints, default=[1, 2])
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32, 64, 128])
    p.add_argument("--arrays", type=int, default=4)
    p.add_argument("--array-bytes", type=int, default=64 << 20)
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per contender")
    p.add_argument("--dir", default=None, help="keep the arrays here and reuse them")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny and short: checks that it works")
    p.add_argument("--update-docs", action="store_true", help="rewrite the generated fill block of docs/benchmarks.md")
    p.add_argument("--from-json", default=None, help="render (and with --update-docs write) a saved run; run nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.latency_ms, args.window_kib, args.workers, args.concurrency = [20.0], [16], [1], [1, 8]
        args.arrays, args.array_bytes, args.seconds = 2, 1 << 20, 0.5
    return args


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve_files(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--relay":
        relay(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
    else:
        main(parse_args())
