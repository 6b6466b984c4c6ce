"""Store access shared by every source: the :class:`Source` base and the machinery of sources
that read an fsspec store (a lazy filesystem per process, listing, retries, redaction).

The sample sources (:mod:`growcache.sources`), the TFRecord file reader of ``growcache
import`` (:mod:`growcache.importer`) and the shard sources (:mod:`growcache.shard_source`)
build on it; it depends on none of them.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._retry import Redactor, RetryPolicy, describe_error, is_stall, is_transient
from .errors import GrowcacheError, MissingExtraError, SourceError, TransientSourceError

__all__ = ["Sample", "Source", "StoreSource"]

logger = logging.getLogger(__name__)

Sample = dict[str, np.ndarray]

_GLOB_CHARS = frozenset("*?[")
# fsspec protocol -> growcache extra that installs its backend.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class Source:
    """Base class of samplers' sources: ``source(rng)`` returns one sample.

    Subclasses implement :meth:`sample`. A source must pickle: the sampler pool sends it
    to spawned worker processes.
    """

    def sample(self, rng: np.random.Generator) -> Sample:
        """Return one sample, drawn with ``rng``, as a dict of feature name -> array."""
        raise NotImplementedError

    def __call__(self, rng: np.random.Generator) -> Sample:
        return self.sample(rng)

    def redact(self, text: str) -> str:
        """``text`` with any credential this source holds replaced by ``***``."""
        return text

    def check(self) -> None:
        """Contact the store once and raise now if the source cannot work (optional)."""



class StoreSource(Source):
    """Shared machinery: lazy per-process filesystem, listing, retries, redaction."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or not all(isinstance(u, str) and u for u in urls):
            raise ValueError(f"url must be a non-empty URL string or list of URLs, got {url!r}")
        self.urls = urls
        self._storage_options = dict(storage_options or {})
        self._redact = Redactor(self._storage_options, urls)
        self.retry = retry or RetryPolicy()
        # Per-process state, rebuilt lazily after pickling (see __getstate__).
        self._fs: Any = None
        self._fs_pid: int | None = None
        self._protocol: str = ""
        self._paths: list[str] | None = None
        #: Bytes, requests and retries of this process (for tests and stats).
        self.bytes_fetched = 0
        self.requests = 0
        self.retries = 0

    # -- pickling: the filesystem (sockets, event loop threads) never travels ----------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_fs=None, _fs_pid=None, bytes_fetched=0, requests=0, retries=0)
        return state

    def __repr__(self) -> str:
        url = self.urls[0] if len(self.urls) == 1 else self.urls
        return self._redact(
            f"{type(self).__name__}({url!r}{self._repr_extra()}, "
            f"storage_options={self._redact.options_repr(self._storage_options)})"
        )

    def _repr_extra(self) -> str:
        return ""

    def redact(self, text: str) -> str:
        return self._redact(text)

    # -- filesystem ------------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem for the source's URL (created on first use).

        It is this source's own instance (not fsspec's shared cache), with the store
        client's timeouts and retries set from :attr:`retry` where ``storage_options``
        leave them unset.
        """
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec.core

            protocol = self.urls[0].split("://", 1)[0].lower() if "://" in self.urls[0] else "file"
            try:
                options = _client_options(protocol, self._storage_options, self.retry)
                fs, _ = fsspec.core.url_to_fs(self.urls[0], skip_instance_cache=True, **options)
            except ImportError as exc:
                extra = _EXTRAS.get(protocol)
                hint = f"pip install 'growcache[{extra}]'" if extra else f"install the fsspec backend of {protocol}://"
                raise MissingExtraError(self._redact(f"reading {self.urls[0]} needs a package: {exc}. {hint}")) from exc
            except (TypeError, ValueError) as exc:
                raise SourceError(self._redact(
                    f"cannot open {self.urls[0]} with storage_options "
                    f"{self._redact.options_repr(self._storage_options)}: {exc}"
                )) from exc
            if protocol in _S3 and isinstance(getattr(fs, "retries", None), int):
                fs.retries = 1  # s3fs retries each request 5 times on its own; RetryPolicy alone retries
            if protocol in _GCS:
                _without_gcsfs_retries(fs)
            self._fs, self._fs_pid = fs, os.getpid()
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            self._protocol = protocol
        return self._fs

    def _url(self, path: str) -> str:
        """The URL of a store path, for messages (credentials removed)."""
        self.fs  # noqa: B018 - sets _protocol
        # Paths of some filesystems (http) are whole URLs already.
        bare = self._protocol in ("file", "local") or "://" in path
        return self._redact(path if bare else f"{self._protocol}://{path}")

    def _io(self, what: str, url: str, fn: Callable[[], Any]) -> Any:
        """Run one store call with retries; turn store errors into growcache errors."""
        attempts = 1
        start = time.monotonic()

        def on_retry(exc: BaseException, attempt: int, delay: float) -> None:
            nonlocal attempts
            attempts = attempt + 1
            self.retries += 1
            # DEBUG: a store that recovers needs no line per retry; one that does not gets one error.
            logger.debug("%s %s failed (attempt %d of %d): %s; retrying in %.2f s", what, url, attempt,
                         self.retry.attempts, self._redact(describe_error(exc)), delay)

        try:
            return self.retry.call(fn, on_retry=on_retry)
        except GrowcacheError:
            raise
        except Exception as exc:
            detail = self._redact(describe_error(exc))
            if is_transient(exc):
                stalled = (f" The store sent no bytes for {self.retry.stall_timeout:g} s (stall_timeout)."
                           if is_stall(exc) else "")
                raise TransientSourceError(
                    f"{what} {url} kept failing after {attempts} attempt{'s' if attempts != 1 else ''} in "
                    f"{time.monotonic() - start:.1f} s: "
                    f"{detail}.{stalled} The store is unreachable, silent, throttling or failing: check the "
                    "endpoint and network, or allow more time with retry=RetryPolicy(attempts=..., deadline=...) "
                    "(growcache sample: --retries, --retry-deadline)."
                ) from exc
            raise SourceError(f"{what} {url} failed: {detail}. {_hint(exc)}") from exc

    def _fetch(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        fs = self.fs
        url = self._url(path)

        def read() -> bytes:
            self.requests += 1
            data = fs.cat_file(path, start=start, end=end)
            self.bytes_fetched += len(data)
            return data

        what = "reading" if start is None else f"reading bytes {start}-{end} of"
        return self._io(what, url, read)

    def paths(self) -> list[str]:
        """The store paths this source samples from, sorted (listed once per process).

        Raises:
            SourceError: the glob matches nothing, or the bucket or directory is missing.
        """
        if self._paths is None:
            fs = self.fs
            found: set[str] = set()
            for url in self.urls:
                path = fs._strip_protocol(url)
                if _GLOB_CHARS & set(path):
                    listing = self._io("listing", self._redact(url), lambda p=path: fs.glob(p, detail=True))
                    found.update(p for p, info in listing.items() if info.get("type", "file") != "directory")
                else:
                    found.add(path)
            if not found:
                raise SourceError(self._redact(
                    f"no objects match {', '.join(self.urls)}: check the bucket, prefix and pattern "
                    "(object names are case-sensitive; '**' matches across directories)"
                ))
            self._paths = sorted(found)
        return self._paths

    def _choose(self, rng: np.random.Generator) -> str:
        paths = self.paths()
        return paths[int(rng.integers(len(paths)))]

    def check(self) -> None:
        self.paths()


_S3 = frozenset({"s3", "s3a"})
_GCS = frozenset({"gs", "gcs"})


def _without_gcsfs_retries(fs: Any) -> None:
    """Let :class:`RetryPolicy` alone retry this gcsfs instance's requests.

    gcsfs wraps its request method in a retry loop fixed when the class is defined: 6 tries
    with backoff up to 32 s, and a logged traceback when they run out. A refused endpoint then
    took 34 s per growcache attempt, past the policy's deadline. The instance gets the
    unwrapped method instead (what the loop wraps, ``__wrapped__``); a gcsfs that wraps it
    otherwise keeps its own retries.
    """
    plain = getattr(getattr(type(fs), "_request", None), "__wrapped__", None)
    if callable(plain):
        fs._request = types.MethodType(plain, fs)


def _client_options(protocol: str, storage_options: Mapping[str, Any], retry: RetryPolicy) -> dict[str, Any]:
    """``storage_options`` with the store client's timeouts and retries taken from ``retry``.

    Explicit options always win: a key the user set is never overridden. Only the
    clients growcache knows are configured: botocore (s3), aiohttp (gs, http, https).
    """
    options = dict(storage_options)
    stall = retry.stall_timeout
    if protocol in _S3:
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", stall)
        config.setdefault("read_timeout", stall)
        # botocore retries a refused connection 4 times with backoff on its own.
        config.setdefault("retries", {"total_max_attempts": 1})
        options["config_kwargs"] = config
    elif protocol in _GCS or protocol in ("http", "https"):
        import aiohttp

        # No total: a large object may take long; what must not happen is silence.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=stall, sock_read=stall)
        if protocol in _GCS:
            options.setdefault("requests_timeout", timeout)
        else:
            client = dict(options.get("client_kwargs") or {})
            client.setdefault("timeout", timeout)
            options["client_kwargs"] = client
    return options


def _hint(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "Check that the bucket and object exist and the URL is spelled right."
    if isinstance(exc, PermissionError):
        return "Check the credentials in storage_options and the bucket's access policy."
    return "This error is not retryable; fix its cause and start again."
