"""Credentials never reach the spawned samplers' own logs.

``caplog`` sees only the test process. Sampler workers are spawned interpreters that log to
their inherited stderr, so this runs a whole training script in a subprocess, with growcache
logging at DEBUG to a file, and reads back everything it and its workers wrote: the log file,
stdout, and the stderr the workers share with it.
"""

from __future__ import annotations

import http.server
import io
import os
import subprocess
import sys
import threading
import textwrap

import numpy as np
import pytest

PASSWORD = "PLANTEDpw-7e1c9b"  # in the store URL's userinfo
TOKEN = "PLANTEDtok-51d0aa"  # in a storage option (an HTTP header)
ROWS = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)

SCRIPT = textwrap.dedent("""
    import logging
    import sys

    from growcache import Cache, SamplerError, SamplerPool
    from growcache.sources import NpyWindowSource, RetryPolicy

    if __name__ == "__main__":
        url, missing, token, cache_dir, log_file = sys.argv[1:]
        logging.basicConfig(filename=log_file, level=logging.DEBUG,
                            format="%(processName)s %(name)s %(levelname)s %(message)s")
        options = {"headers": {"X-Api-Token": token}}
        retry = RetryPolicy(attempts=20, initial_delay=0.01, max_delay=0.05)
        schema = {"x": ("float32", (4, 8))}
        # A flaky store: the workers retry (and log each retry), then sample.
        source = NpyWindowSource(url, 4, storage_options=options, retry=retry)
        with SamplerPool(Cache(cache_dir + "-ok", capacity="16MB", schema=schema), source, workers=2,
                         shard_size="4KB", max_shard_age=0.2) as pool:
            stats = pool.wait_for(records=60, timeout=120)
        print("sampled", stats.records, "retried", repr(pool.stats()), repr(source))
        # A store path that does not exist: the workers fail, and the failure is printed.
        failing = NpyWindowSource(missing, 4, storage_options=options, retry=retry)
        try:
            with SamplerPool(Cache(cache_dir + "-bad", capacity="16MB", schema=schema), failing, workers=2,
                             max_restarts=0) as pool:
                pool.wait_for(records=1, timeout=120)
        except SamplerError as exc:
            print("failed:", exc)
            print("worker traceback:", exc.worker_traceback)
        else:
            sys.exit("the missing object did not fail the pool")
""")


class _FlakyNpyStore(http.server.BaseHTTPRequestHandler):
    """Serves one .npy with byte ranges; every third request is a 503, any other path a 404."""

    body = b""
    requests = 0
    lock = threading.Lock()

    def _answer(self, with_body: bool) -> None:
        with self.lock:
            type(self).requests += 1
            flaky = type(self).requests % 3 == 0
        if self.path != "/data/a.npy":
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if flaky:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body, start = self.body, 0
        ranged = self.headers.get("Range")
        if ranged:
            first, last = ranged.removeprefix("bytes=").split("-")
            start = int(first)
            end = min(int(last) + 1 if last else len(body), len(body))
            body = body[start:end]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(self.body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(False)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def flaky_store():
    buffer = io.BytesIO()
    np.save(buffer, ROWS)
    handler = type("Handler", (_FlakyNpyStore,), {"body": buffer.getvalue(), "requests": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://alice:{PASSWORD}@127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_spawned_samplers_log_no_credential(flaky_store, tmp_path):
    base, handler = flaky_store
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log_file, stderr_file = tmp_path / "growcache.log", tmp_path / "stderr.txt"
    with open(stderr_file, "w") as stderr:  # the workers inherit this file as their stderr
        result = subprocess.run(
            [sys.executable, str(script), f"{base}/data/a.npy", f"{base}/data/missing.npy", TOKEN,
             str(tmp_path / "cache"), str(log_file)],
            stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
                os.path.abspath(__file__))), os.environ.get("PYTHONPATH")]))},
        )
    texts = {"stdout": result.stdout, "stderr (the workers' logs)": stderr_file.read_text(),
             "log file": log_file.read_text()}
    assert result.returncode == 0, texts
    workers_log = texts["stderr (the workers' logs)"]
    # The checks below are not vacuous: the workers really logged, at DEBUG, each retry of the
    # flaky store, naming its URL (masked); the failure reached the parent's output.
    assert handler.requests > 20
    retries = [line for line in workers_log.splitlines() if line.startswith("growcache sampler") and "retrying" in line]
    assert retries, f"the workers logged no retry:\n{workers_log}"
    assert "failed:" in texts["stdout"] and "/data/missing.npy" in texts["stdout"]
    assert "sampled" in texts["stdout"]
    for name, text in texts.items():
        assert PASSWORD not in text, f"the URL's password leaked into {name}"
        assert TOKEN not in text, f"the token option leaked into {name}"
    assert any("/data/a.npy" in line and "***" in line for line in retries), retries[:3]
