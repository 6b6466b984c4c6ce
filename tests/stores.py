"""Real object stores for tests: a moto S3 server and a GCS emulator on 127.0.0.1.

Servers are module-scoped (start-up costs a second) and reset before each test. fsspec's
instance caches are cleared around each test so no filesystem talks to a previous server.
Server packages are imported inside the fixtures, so importing this module (as spawned
sampler processes do when they unpickle a test's sample function) stays cheap.

``CountingProxy`` is a plain TCP relay that counts the bytes a server actually sends: the
byte-range tests measure real network traffic with it.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = [
    "CountingProxy",
    "S3Server",
    "SilentServer",
    "Store",
    "free_port",
    "gcs",
    "gcs_server",
    "hold_port",
    "memory_store",
    "refused_port",
    "s3",
    "s3_server",
]

BUCKET = "growcache-test"  # a valid DNS name, as S3 and GCS require


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Nothing keeps it free: a test that another pytest worker runs may bind it next. For an
    endpoint that must refuse connections use :func:`refused_port`.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hold_port(port: int = 0) -> socket.socket:
    """A socket bound to ``port`` on 127.0.0.1 (a free one for 0) that never listens: while it is
    open, connections to the port are refused, as by a dead server, and no other process binds
    the port by asking for any free one (another pytest worker's servers do). SO_REUSEADDR, so
    that a server restarted on the port (with SO_REUSEADDR too) can bind it once this closes, and
    this can bind it while the stopped server's connections wait in TIME_WAIT."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


_REFUSING: list[socket.socket] = []  # never closed: their ports refuse for this process's life


def refused_port() -> int:
    """A TCP port on 127.0.0.1 that refuses every connection for the rest of this process: a dead
    endpoint. A port merely found free (bound, then closed) may be bound meanwhile by a test that
    another pytest worker runs, and then answer."""
    sock = hold_port()
    _REFUSING.append(sock)
    return sock.getsockname()[1]


def clear_fsspec_caches() -> None:
    """Forget cached filesystem instances, so a new test never reuses an old connection."""
    import fsspec

    # Only backends already imported: importing gcsfs here would fix its feature flag early.
    for module, protocol in (("s3fs", "s3"), ("gcsfs", "gs")):
        if module in sys.modules:
            fsspec.get_filesystem_class(protocol).clear_instance_cache()
    fsspec.filesystem("memory").store.clear()
    fsspec.filesystem("memory").pseudo_dirs[:] = [""]


@dataclass
class Store:
    """A store for one test: its URL prefix and the storage_options that reach it."""

    url: str  # e.g. "s3://growcache-test", no trailing slash
    storage_options: dict[str, Any] = field(default_factory=dict)

    def fs(self):
        import fsspec.core

        return fsspec.core.url_to_fs(self.url, **self.storage_options)[0]

    def put(self, name: str, data: bytes) -> str:
        """Upload ``data`` as ``name`` under the prefix; return its URL."""
        url = f"{self.url}/{name}"
        fs = self.fs()
        path = fs._strip_protocol(url)
        if fs.protocol in ("file", ("file", "local")) or "file" in fs.protocol:
            fs.makedirs(fs._parent(path), exist_ok=True)
        fs.pipe_file(path, data)
        return url


class S3Server:
    """moto's ThreadedMotoServer on one port, so it can be stopped and started again.

    Its buckets live in moto's in-process backends, so they survive a restart. The port is held
    from the start to the end (:func:`hold_port` while the server is stopped): a port found free
    and bound only later, at a start or restart, could be taken meanwhile by a test that another
    pytest worker runs (and moto's start then waits for good on a server that never binds).
    """

    def __init__(self) -> None:
        self._held: socket.socket | None = hold_port()
        self.port = self._held.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None
        #: Faults on demand: listing prefix -> [HTTP status, S3 error code, how many more times]. A
        #: bucket listing (GET with ``prefix=``) of that prefix gets that error while the count lasts.
        self.fail_listings: dict[str, list] = {}

    def _faulty(self, app: Any) -> Any:
        """``app`` (moto's WSGI application), failing the listings that ``fail_listings`` names."""
        from urllib.parse import parse_qs

        def serve(environ: dict, start_response: Any) -> Any:
            prefix = parse_qs(environ.get("QUERY_STRING", "")).get("prefix", [None])[0]
            fault = self.fail_listings.get(prefix) if environ["REQUEST_METHOD"] == "GET" else None
            if fault and fault[2] > 0:
                fault[2] -= 1
                body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault[1]}</Code>'
                        f"<Message>{fault[1]} (a fault the test asked for)</Message></Error>").encode()
                start_response(f"{fault[0]} {fault[1]}", [("Content-Type", "application/xml"),
                                                          ("Content-Length", str(len(body)))])
                return [body]
            return app(environ, start_response)

        return serve

    def start(self) -> None:
        from moto.moto_server import threaded_moto_server as moto

        faulty = self._faulty

        class Server(moto.ThreadedMotoServer):
            # moto's own entry point, with its application wrapped by the faults of the test.
            def _server_entry(self) -> None:
                app = faulty(moto.DomainDispatcherApplication(moto.create_backend_app))
                self._server = moto.make_server(self._ip_address, self._port, app, True,
                                                request_handler=moto.MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._server = Server("127.0.0.1", self.port, verbose=False)
        if self._held is not None:
            self._held.close()  # the server binds the port a moment later (werkzeug: SO_REUSEADDR)
            self._held = None
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            # werkzeug's shutdown leaves the listening socket open: close it so that
            # clients get "connection refused", as from a dead server.
            self._server._server.server_close()
            self._server = None
            try:
                self._held = hold_port(self.port)
            except OSError:  # not held: refused all the same, as before this guard
                self._held = None

    def close(self) -> None:
        """Stop the server, and let go of its port."""
        self.stop()
        if self._held is not None:
            self._held.close()
            self._held = None

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        options: dict[str, Any] = {
            "key": "growcache-test-key",
            "secret": "growcache-test-secret",
            "client_kwargs": {"endpoint_url": self.endpoint},
            # botocore's own retries of a refused connection take ~10 s; growcache retries on top.
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
        }
        options.update(extra)
        return options


@pytest.fixture(scope="module")
def s3_server():
    """A moto S3 server on 127.0.0.1 for the whole module."""
    pytest.importorskip("moto.moto_server.threaded_moto_server")
    pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    saved = {k: os.environ.get(k) for k in ("AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE",
                                             "AWS_SHARED_CREDENTIALS_FILE")}
    # Never read the developer's real AWS configuration or probe instance metadata.
    os.environ.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull,
                      AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3(s3_server):
    """An empty bucket on the module's S3 server (the server is reset first)."""
    if s3_server._server is None:  # a previous test left it stopped
        s3_server.start()
    s3_server.reset()
    s3_server.fail_listings.clear()
    clear_fsspec_caches()
    store = Store(f"s3://{BUCKET}", s3_server.storage_options())
    store.fs().mkdir(BUCKET)
    yield store
    clear_fsspec_caches()


@pytest.fixture(scope="module")
def gcs_server():
    """A gcp-storage-emulator server on 127.0.0.1 for the whole module; yields its endpoint."""
    saved = os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    # Without this, gcsfs probes a gRPC endpoint for 60 s before every first call. gcsfs
    # reads it when imported, so set it first (spawned processes inherit it), and register
    # the plain class in case another test imported gcsfs before.
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    gcsfs = pytest.importorskip("gcsfs")
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    import fsspec
    import gcsfs.core

    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
    server = emulator.create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    port = server._api._httpd.server_address[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", None)
        else:
            os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = saved


@pytest.fixture
def gcs(gcs_server):
    """An empty bucket on the module's GCS emulator (wiped first)."""
    server, endpoint = gcs_server
    server.wipe()
    clear_fsspec_caches()
    store = Store(f"gs://{BUCKET}", {"endpoint_url": endpoint, "token": "anon"})
    store.fs().mkdir(BUCKET)
    yield store
    clear_fsspec_caches()


@pytest.fixture
def memory_store():
    """An empty fsspec memory filesystem (one process only)."""
    clear_fsspec_caches()
    yield Store("memory://growcache-test")
    clear_fsspec_caches()


class CountingProxy:
    """A TCP relay from 127.0.0.1:<port> to ``target``, counting the bytes each way.

    ``received`` is what the server sent to clients: the bytes a client really fetched,
    HTTP headers included.
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.received = 0
        self.sent = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self._lock:
            self.received = self.sent = 0

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, server, "sent"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, "received"), daemon=True).start()

    def observe(self, direction: str, data: bytes) -> None:
        """Called with the lock held for every chunk relayed (``"sent"``: to the server); a hook."""

    def _pipe(self, src: socket.socket, dst: socket.socket, counter: str) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    setattr(self, counter, getattr(self, counter) + len(data))
                    self.observe(counter, data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte.

    A store behind a wedged load balancer looks like this to a client: the connect
    succeeds, the request goes out, and no response ever comes. ``connections`` counts
    the connections accepted.
    """

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self._clients: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._clients.append(client)  # held open, never answered

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for client in self._clients:
            client.close()

    def __enter__(self) -> "SilentServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
