"""A real HTTP range server for tests, with faults on demand: latency, throttling, errors, stalls.

aiohttp's ``web.FileResponse`` serves the files of a directory (Range requests, HEAD), in a
thread of the test process with its own event loop. The test steers the faults by setting
attributes while samplers in other processes fetch, and reads what the server saw: requests,
requests in flight and their peak, bytes in flight and their peak, statuses sent.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any

from stores import hold_port

__all__ = ["FaultyHTTPStore", "wait_until"]


def wait_until(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _range_bytes(header: str | None, size: int) -> int:
    """Bytes a ``Range: bytes=a-b`` header asks for (the whole file without one)."""
    if not header or not header.startswith("bytes="):
        return size
    first, _, last = header[6:].partition("-")
    try:
        start = int(first) if first else size - int(last)
        end = int(last) + 1 if (first and last) else size
    except ValueError:
        return size
    return max(0, min(end, size) - max(start, 0))


class FaultyHTTPStore:
    """Serves ``root`` at ``http://127.0.0.1:<port>/``; a context manager.

    Attributes a test sets (any time):
        latency: seconds each GET waits before its answer.
        throttle_until: ``time.monotonic()`` before which every GET gets 503 SlowDown.
        fail_next: statuses the next GETs get, one each (e.g. ``[500]``).
        fail_paths: URL path -> status that path always gets (e.g. ``{"/b.npy": 403}``).
        hang_next: how many of the next GETs get no answer at all (until the server closes).
        down: refuse every connection (the listening socket is closed) while true; set with
            :meth:`go_down` and :meth:`come_back`.

    The port is held from the start to the end (``stores.hold_port`` while nothing listens): a
    port found free and bound only later, at the start or when the store comes back, could be
    taken meanwhile by a test that another pytest worker runs.
        hide_sizes: tell no object's size: HEAD is refused (405) and a GET's body comes chunked,
            without Content-Length, as some dynamic servers send it.
        fail_heads: statuses the next HEADs get, one each (``fail_next`` is for GETs).
        hang_paths: URL paths whose GETs get no answer at all (until the server closes).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._held: socket.socket | None = hold_port()
        self.port = self._held.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.latency = 0.0
        self.throttle_until = 0.0
        self.fail_next: list[int] = []
        self.fail_paths: dict[str, int] = {}
        self.hang_next = 0
        self.hang_paths: set[str] = set()
        self.hide_sizes = False
        self.fail_heads: list[int] = []
        self.served: list[tuple[float, float, int]] = []  # (began, ended, bytes) of each body sent whole
        self.requests = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.bytes_in_flight = 0
        self.peak_bytes_in_flight = 0
        self.statuses: dict[int, int] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        # Connections cut by go_down() end in asyncio noise on the server side: not the test's concern.
        self._loop.set_exception_handler(lambda loop, context: None)
        self._runner: Any = None
        self._site: Any = None
        self._hung: list[asyncio.Future[None]] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="faulty-http-store", daemon=True)

    # -- life ----------------------------------------------------------------------------------
    def __enter__(self) -> FaultyHTTPStore:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/{name:.*}", self._serve)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await self._listen()

    async def _listen(self) -> None:
        from aiohttp import web

        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        if self._held is not None:
            self._held.close()  # the site binds the port at once, in this same call
            self._held = None
        await self._site.start()

    async def _stop(self) -> None:
        for hung in self._hung:
            if not hung.done():
                hung.set_result(None)
        await self._runner.cleanup()
        if self._held is not None:
            self._held.close()
            self._held = None

    def go_down(self) -> None:
        """Refuse connections (and drop the open ones) until :meth:`come_back`."""
        async def down() -> None:
            await self._site.stop()
            # Keep-alive connections would still be served: close every one.
            for proto in list(getattr(self._runner.server, "connections", [])):
                proto.force_close()
            try:
                self._held = hold_port(self.port)  # refused, and kept for come_back()
            except OSError:  # not held: refused all the same, as before this guard
                self._held = None
        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)

    def come_back(self) -> None:
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)

    def put(self, name: str, data: bytes) -> str:
        with open(os.path.join(self.root, name), "wb") as f:
            f.write(data)
        return f"{self.url}/{name}"

    def peak_served_at_once(self, *, bodies: bool = False) -> int:
        """The most bytes (``bodies``: the most bodies) of bodies sent whole (a request dropped
        before its end is not counted) that were being sent at one time."""
        with self._lock:
            served = [(b, e, 1 if bodies else n) for b, e, n in self.served]
        events = sorted([(b, n) for b, _, n in served] + [(e, -n) for _, e, n in served],
                        key=lambda event: (event[0], event[1]))  # an end before a start at one time
        peak = now = 0
        for _, change in events:
            now += change
            peak = max(peak, now)
        return peak

    async def _chunked(self, request: Any, path: str, began: float) -> Any:
        from aiohttp import web

        with open(path, "rb") as f:
            data = f.read()
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for at in range(0, len(data), 65536):
            await response.write(data[at:at + 65536])
        await response.write_eof()
        if request.headers.get("Accept-Encoding") != "identity":  # not a size probe (fsspec drops its body)
            with self._lock:
                self.served.append((began, time.monotonic(), len(data)))
        return response

    # -- serving -------------------------------------------------------------------------------
    def _count(self, status: int) -> None:
        with self._lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1

    async def _serve(self, request: Any) -> Any:
        from aiohttp import web

        path = os.path.join(self.root, request.match_info["name"])
        if request.method == "HEAD" and (self.hide_sizes or self.fail_heads):
            with self._lock:
                status = self.fail_heads.pop(0) if self.fail_heads else 405
            self._count(status)
            return web.Response(status=status)
        if request.method == "HEAD" or not os.path.isfile(path):
            self._count(200 if os.path.isfile(path) else 404)
            return web.FileResponse(path) if os.path.isfile(path) else web.Response(status=404)
        nbytes = _range_bytes(request.headers.get("Range"), os.path.getsize(path))
        with self._lock:
            self.requests += 1
            self.in_flight += 1
            self.bytes_in_flight += nbytes
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self.peak_bytes_in_flight = max(self.peak_bytes_in_flight, self.bytes_in_flight)
            fail = self.fail_next.pop(0) if self.fail_next else self.fail_paths.get(request.path)
            hang = self.hang_next > 0 and fail is None
            if hang:
                self.hang_next -= 1
            hang = hang or request.path in self.hang_paths
        began = time.monotonic()
        try:
            if hang:
                hung = self._loop.create_future()
                self._hung.append(hung)
                await hung
                raise ConnectionResetError("the server closed")
            if self.latency:
                await asyncio.sleep(self.latency)
            if time.monotonic() < self.throttle_until:
                self._count(503)
                return web.Response(status=503, text="<Error><Code>SlowDown</Code></Error>")
            if fail is not None:
                self._count(fail)
                return web.Response(status=fail, text=f"failed on purpose with {fail}")
            self._count(206 if "Range" in request.headers else 200)
            if self.hide_sizes:
                return await self._chunked(request, path, began)
            return web.FileResponse(path)
        finally:
            with self._lock:
                self.in_flight -= 1
                self.bytes_in_flight -= nbytes
