"""Store access shared by every source: the :class:`Source` base and the machinery of sources
that read an fsspec store (a lazy filesystem per process, listing, retries, redaction).

The sample sources (:mod:`growcache.sources`), the TFRecord file reader of ``growcache
import`` (:mod:`growcache.importer`) and the shard sources (:mod:`growcache.shard_source`)
build on it; it depends on none of them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import os
import random
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._concurrent import current_ticket
from ._retry import ListingFailed, Redactor, RetryPolicy, describe_error, is_stall, is_throttle, is_transient
from .errors import GrowcacheError, MissingExtraError, SourceError, TransientSourceError

__all__ = ["Sample", "Source", "StoreSource"]

logger = logging.getLogger(__name__)

Sample = dict[str, np.ndarray]

_GLOB_CHARS = frozenset("*?[")
# This process's id, renewed in a forked child: a filesystem made before a fork must not be
# used after it, and os.getpid() is a system call on every sample.
_this_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _this_pid.__setitem__(0, os.getpid()))
# fsspec protocol -> growcache extra that installs its backend.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class Source:
    """Base class of samplers' sources: ``source(rng)`` returns one sample.

    Subclasses implement :meth:`sample`. A source must pickle: the sampler pool sends it
    to spawned worker processes.

    With ``SamplerPool(..., concurrency=N)``, a source runs concurrently only if it says it
    can, in one of three ways (checked in this order):

    * ``async def sample_async(self, rng)``: up to N coroutines in flight on one event loop;
    * ``def sample_many(self, rngs)``: one call with up to N RNGs, returning one sample each,
      in their order;
    * ``thread_safe = True`` (a class attribute, or ``FunctionSource(fn, thread_safe=True)``):
      up to N threads call :meth:`sample` at once.

    Otherwise it runs one sample at a time, as with ``concurrency=1``. Whichever way, each
    sample gets its own RNG, so which samples are drawn does not depend on the order they
    finish in.

    Attributes:
        thread_safe: :meth:`sample` may be called from several threads at once.
            Default: ``False``.
    """

    thread_safe: bool = False

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
        relist_every: float | None = None,
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or not all(isinstance(u, str) and u for u in urls):
            raise ValueError(f"url must be a non-empty URL string or list of URLs, got {url!r}")
        if relist_every is not None and (isinstance(relist_every, (bool, np.bool_))
                                         or not isinstance(relist_every, numbers.Real)
                                         or not relist_every > 0 or not math.isfinite(relist_every)):
            raise ValueError(f"relist_every must be a positive number of seconds or None (list once), "
                             f"got {relist_every!r}")
        self.urls = urls
        #: Seconds between listings of the URLs' globs in each sampler process (``None``: once).
        self.relist_every = None if relist_every is None else float(relist_every)
        self._storage_options = dict(storage_options or {})
        self._redact = Redactor(self._storage_options, urls)
        self.retry = retry or RetryPolicy()
        # Per-process state, rebuilt lazily after pickling (see __getstate__).
        self._fs: Any = None
        self._fs_pid: int | None = None
        self._protocol: str = ""
        self._paths: list[str] | None = None
        self._paths_listed_at = 0.0  # time.monotonic() of the last listing (tried), for relist_every
        self._listed_in: int | None = None  # the process that made (or tried) that listing
        self._versions: dict[str, str] = {}  # object_version of each path the last listing gave
        self._relisting: threading.Thread | None = None
        self._relist_failures = 0  # listings failed (or empty) in a row: one WARNING per run of them
        # Bumped whenever what was cached of an object is dropped (a relisting found it changed or
        # gone): a read in flight meanwhile does not cache what it read (a header of the old file).
        self._forgets = 0
        self._sizes: dict[str, int] = {}  # object sizes the listing gave or the store told (-1: it did not)
        # The store told no size for an object: the others are not asked either (fsspec's http asks
        # by a GET of the whole object once HEAD tells nothing), and are fetched as of unknown size.
        self._unsized = False
        self._sizing: dict[str, asyncio.Future[int]] = {}  # sizes asked now: one request per object
        self._named: frozenset[str] | None = None  # paths of the URLs without a glob (made with the fs)
        self._lock = threading.RLock()
        self._pool_connections: int | None = None  # requests a sampler keeps in flight, set by it
        self._outage_since: float | None = None
        #: The store answered a request of this process (or of an earlier sampler of its pool):
        #: an outage from now on is ridden out under ``retry.outage_budget``.
        self.store_answered = False
        #: Bytes, requests and retries of this process (for tests and stats).
        self.bytes_fetched = 0
        self.requests = 0
        self.retries = 0

    # -- pickling: the filesystem (sockets, event loop threads) never travels ----------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_fs=None, _fs_pid=None, bytes_fetched=0, requests=0, retries=0, _lock=None, _sizing={},
                     _outage_since=None, store_answered=False, _relisting=None, _listed_in=None,
                     _relist_failures=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _count(self, requests: int = 0, nbytes: int = 0, retries: int = 0) -> None:
        # Concurrent samples share these counters: `+=` on an attribute is not atomic.
        with self._lock:
            self.requests += requests
            self.bytes_fetched += nbytes
            self.retries += retries

    def set_concurrency(self, requests: int) -> None:
        """Size the store client's connection pool for ``requests`` in flight (before first use).

        s3fs keeps 10 connections unless ``config_kwargs={"max_pool_connections": N}`` says
        otherwise; a value the user set in ``storage_options`` is kept.
        """
        self._pool_connections = max(1, int(requests))

    def concurrent_mode(self) -> str:
        """How a sampler runs this source's samples concurrently: ``"async"`` on an async
        filesystem (one event loop, fsspec's ``_cat_file``), ``"threads"`` on a sync one."""
        return "async" if getattr(self.fs, "async_impl", False) else "threads"

    def prepare(self) -> None:
        """Make the filesystem and list the paths now, from a thread outside the event loop."""
        self.paths()

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
        fs = self._fs
        if fs is None or self._fs_pid != _this_pid[0]:
            with self._lock:
                if self._fs is None or self._fs_pid != _this_pid[0]:
                    self._make_fs()
                fs = self._fs
        return fs

    def _make_fs(self) -> None:
        """Assumes you hold ``self._lock``."""
        import fsspec.core

        protocol = self.urls[0].split("://", 1)[0].lower() if "://" in self.urls[0] else "file"
        try:
            options = _client_options(protocol, self._storage_options, self.retry, self._pool_connections)
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
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self._protocol = protocol
        self._fs, self._fs_pid = fs, _this_pid[0]

    def _url(self, path: str) -> str:
        """The URL of a store path, for messages (credentials removed)."""
        self.fs  # noqa: B018 - sets _protocol
        # Paths of some filesystems (http) are whole URLs already.
        bare = self._protocol in ("file", "local") or "://" in path
        return self._redact(path if bare else f"{self._protocol}://{path}")

    def _io(self, what: str | _Reading, url: str | Callable[[], str], fn: Callable[[], Any], *,
            outage: bool = True) -> Any:
        """Run one store call with retries; turn store errors into growcache errors.

        Three layers: the :class:`RetryPolicy`'s tries; the in-flight limit of the sampler
        (told of each throttled try); and, once the store has answered, the outage budget.
        ``url`` is the URL for messages, or a function that makes it (called only when a try fails).
        ``outage=False``: the call gives up after the policy's tries, never rides out an outage
        (a background listing, tried again later).
        """
        attempts = None  # made at the first failure: most calls succeed at once
        while True:
            try:
                return self._timed(fn)
            except GrowcacheError:
                raise
            except Exception as exc:
                attempts = attempts or _Attempts(self, what, url, outage)
                pause = attempts.pause_after(exc)
            time.sleep(pause)

    async def _aio(self, what: str | _Reading, url: str | Callable[[], str], fn: Callable[[], Any]) -> Any:
        """:meth:`_io` for a coroutine function ``fn``, in the event loop of the sampler."""
        attempts = None
        while True:
            try:
                return await self._atimed(fn)
            except GrowcacheError:
                raise
            except Exception as exc:
                attempts = attempts or _Attempts(self, what, url)
                pause = attempts.pause_after(exc)
            await asyncio.sleep(pause)

    def _request(self) -> _Request:
        """One request: counted in flight by the sample's flow, timed if it is answered."""
        return _Request(self, current_ticket())

    def _timed(self, fn: Callable[[], Any]) -> Any:
        with self._request():
            return fn()

    async def _atimed(self, fn: Callable[[], Any]) -> Any:
        with self._request():
            return await fn()

    def _on_retry(self, what: str, url: str, exc: BaseException, attempt: int, delay: float) -> None:
        self._count(retries=1)
        detail = self._redact(describe_error(exc))
        ticket = current_ticket()
        if ticket is not None and is_throttle(exc):
            ticket.flow.throttled(url, detail)
        # DEBUG: a store that recovers needs no line per retry; one that does not gets one error.
        logger.debug("%s %s failed (attempt %d of %d): %s; retrying in %.2f s", what, url, attempt,
                     self.retry.attempts, detail, delay)

    # -- outages -------------------------------------------------------------------------------
    def _answered(self) -> None:
        self.store_answered = True
        if self._outage_since is not None:
            with self._lock:
                since, self._outage_since = self._outage_since, None
            if since is not None:
                logger.warning("%s answers again: the outage lasted %.0f s", self._redact(self.urls[0]),
                               time.monotonic() - since)

    def _rides_out(self, exc: BaseException) -> bool:
        return is_transient(exc) and self.store_answered and self.retry.outage_budget > 0

    def _outage_begins(self, url: str, exc: BaseException) -> float:
        """When the outage began (logged once, by the first request that sees it)."""
        with self._lock:
            if self._outage_since is not None:
                return self._outage_since
            self._outage_since = since = time.monotonic()
        logger.warning(
            "%s is failing (%s: %s): riding the outage out for up to %.0f s (RetryPolicy.outage_budget); the cache "
            "keeps serving training meanwhile", self._redact(self.urls[0]), url, self._redact(describe_error(exc)),
            self.retry.outage_budget)
        return since

    def _outage_pause(self, since: float) -> float | None:
        """Seconds to wait before the next try of an outage, or ``None`` once the budget is spent."""
        left = self.retry.outage_budget - (time.monotonic() - since)
        if left <= 0:
            return None
        cap = max(self.retry.max_delay, 0.05)
        return min(left, random.uniform(cap / 2, cap))

    def _outage_failure(self, what: str, url: str, exc: BaseException, since: float) -> SourceError:
        # Permanent: a restart would ride out another whole budget.
        return SourceError(
            f"{what} {url} failed: the store has not answered for {time.monotonic() - since:.0f} s, longer than "
            f"the outage budget of {self.retry.outage_budget:g} s: {self._redact(describe_error(exc))}. Check the "
            "store, or allow longer outages with retry=RetryPolicy(outage_budget=...)."
        )

    def _failure(self, what: str, url: str, exc: BaseException, attempts: int, start: float) -> GrowcacheError:
        detail = self._redact(describe_error(exc))
        if is_transient(exc):
            stalled = (f" The store sent no bytes for {self.retry.stall_timeout:g} s (stall_timeout)."
                       if is_stall(exc) else "")
            never = "" if self.store_answered else " The store has not answered once."
            return TransientSourceError(
                f"{what} {url} kept failing after {attempts} attempt{'s' if attempts != 1 else ''} in "
                f"{time.monotonic() - start:.1f} s: "
                f"{detail}.{stalled}{never} The store is unreachable, silent, throttling or failing: check the "
                "endpoint and network, or allow more time with retry=RetryPolicy(attempts=..., deadline=...) "
                "(growcache sample: --retries, --retry-deadline)."
            )
        return SourceError(f"{what} {url} failed: {detail}. {_hint(exc)}")

    def _fetch(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        fs = self.fs

        def read() -> bytes:
            try:
                data = fs.cat_file(path, start=start, end=end)
            except BaseException:
                self._count(requests=1)
                raise
            self._count(requests=1, nbytes=len(data))
            return self._in_range(path, data, start, end)

        # The URL and what was done are only spelled out for a message (thousands of reads a second).
        return self._io(_Reading(start, end), lambda: self._url(path), read)

    def _in_range(self, path: str, data: bytes, start: int | None, end: int | None) -> bytes:
        # A server that ignores Range answers 200 with the whole object: taken as the range, a
        # file read in chunks came back once per chunk (every record imported again, each CRC valid).
        if start is not None and end is not None and len(data) > end - start:
            raise SourceError(
                f"{self._url(path)} answered a read of bytes {start}-{end} with {len(data)} bytes: the store ignores "
                "byte ranges (an HTTP server that answers Range with the whole object). Serve the files from one "
                "that honours Range requests (S3, GCS, nginx, aiohttp's FileResponse)")
        return data

    async def _afetch(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """:meth:`_fetch` through the async filesystem's ``_cat_file``, in the sampler's event loop."""
        fs = self.fs

        async def read() -> bytes:
            try:
                data = await fs._cat_file(path, start=start, end=end)
            except BaseException:
                self._count(requests=1)
                raise
            self._count(requests=1, nbytes=len(data))
            return self._in_range(path, data, start, end)

        return await self._aio(_Reading(start, end), lambda: self._url(path), read)

    async def _afetch_unsized(self, path: str) -> bytes | None:
        """A whole object whose size the store does not tell, read as it streams in, each piece
        claimed in the byte budget before it is read: the samples in flight stay within
        ``max_bytes_in_flight`` and such objects are still fetched many at a time (a claim of the
        whole budget fetched each alone). ``None`` where the filesystem cannot stream."""
        fs, ticket = self.fs, current_ticket()
        if ticket is None or not hasattr(fs, "open_async"):
            return None
        flow = ticket.flow
        piece = max(4096, min(1 << 20, flow.max_bytes // max(flow.concurrency, 1)))

        async def read() -> bytes:
            parts, held = [], 0
            try:
                # fsspec's http asks the size first unless given one (it is not told: any will do)
                sized = {"size": 0} if self._protocol in ("http", "https") else {}
                stream = await fs.open_async(path, "rb", **sized)
                try:
                    while True:
                        await ticket.acquire_async(piece)
                        held += piece
                        data = await stream.read(piece)
                        ticket.settle(piece, len(data))
                        held += len(data) - piece
                        if not data:
                            break
                        parts.append(data)
                finally:
                    await stream.close()
            except BaseException:
                ticket.give_back(held)  # a retry claims again
                self._count(requests=1)
                raise
            self._count(requests=1, nbytes=held)
            return b"".join(parts)

        try:
            return await self._aio(_Reading(None, None), lambda: self._url(path), read)
        except SourceError as exc:
            if isinstance(exc.__cause__, NotImplementedError):
                return None
            raise

    # -- the byte budget of a sampler's samples in flight -------------------------------------
    def _claim_bytes(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more fit in the sampler's bytes in flight, then hold them."""
        ticket = current_ticket()
        if ticket is not None:
            ticket.acquire(nbytes)

    async def _aclaim_bytes(self, nbytes: int) -> None:
        ticket = current_ticket()
        if ticket is not None:
            await ticket.acquire_async(nbytes)

    def _unclaim_bytes(self, nbytes: int) -> None:
        """Give back ``nbytes`` claimed for a read the sample no longer holds."""
        ticket = current_ticket()
        if ticket is not None and nbytes:
            ticket.give_back(nbytes)

    def _size(self, path: str) -> int | None:
        """The size of object ``path``: from the listing, else asked once (only by a concurrent sampler,
        whose byte budget needs it before the fetch); ``None`` where the store does not tell it."""
        size = self._sizes.get(path)
        ticket = current_ticket()
        if size is None and not self._unsized and ticket is not None and ticket.flow.concurrency > 1:
            fs = self.fs
            size = self._told(path, self._io("sizing", self._url(path), lambda: _sized(lambda: fs.size(path))))
        return None if size is None or size < 0 else size

    async def _asize(self, path: str) -> int | None:
        size = self._sizes.get(path)
        if size is None and not self._unsized:
            asking = self._sizing.get(path)  # samples of one object drawn together ask once
            if asking is None:
                asking = self._sizing[path] = asyncio.ensure_future(self._ask_size(path))
                asking.add_done_callback(lambda done: self._asked(path, done))
            size = await asyncio.shield(asking)
        return None if size is None or size < 0 else size

    def _asked(self, path: str, done: asyncio.Future[int]) -> None:
        self._sizing.pop(path, None)
        if not done.cancelled():
            done.exception()  # retrieved: its samples were cancelled (stop()) or raise it themselves

    async def _ask_size(self, path: str) -> int:
        fs = self.fs

        async def info() -> Any:
            try:
                return await fs._info(path)
            except FileNotFoundError as exc:
                error = _not_found(exc)
                if error is exc:
                    raise
            raise error

        return self._told(path, (await self._aio("sizing", self._url(path), info)).get("size"))

    def _told(self, path: str, size: Any) -> int:
        """Remember the size the store gave for ``path``: -1 where it gave none (an HTTP server
        answering without Content-Length)."""
        told = int(size) if isinstance(size, int) and size >= 0 else -1
        if told < 0 and not self._unsized:
            self._unsized = True
            logger.warning("%s does not tell its size: objects whose size the listing did not give are claimed "
                           "piece by piece as they stream in, the first time, so that the samples in flight stay "
                           "within max_bytes_in_flight (then their size is known)", self._url(path))
        self._sizes[path] = told
        return told

    def _claim_object(self, size: int | None) -> int:
        """Claim a whole object's bytes in the byte budget (all of it where its size is unknown: the
        object is then fetched alone). Returns the bytes claimed, for :meth:`_settle`."""
        nbytes = _object_claim(size)
        self._claim_bytes(nbytes)
        return nbytes

    async def _aclaim_object(self, size: int | None) -> int:
        nbytes = _object_claim(size)
        await self._aclaim_bytes(nbytes)
        return nbytes

    def _settle(self, path: str, claimed: int, data: bytes) -> None:
        """A whole object came in: hold its real size in the budget, and know it from now on."""
        ticket = current_ticket()
        if ticket is not None:
            ticket.settle(claimed, len(data))
        if self._sizes.get(path) != len(data):
            # Also a size out of date (the object was rewritten since it was listed or told): claimed
            # at every draw, each fetch would hold its real size over max_bytes_in_flight.
            self._sizes[path] = len(data)

    def paths(self) -> list[str]:
        """The store paths this source samples from, sorted.

        Listed once per process, then, with :attr:`relist_every`, again in a background thread
        each time that many seconds have passed: objects added to the bucket are drawn from the
        next listing on, objects gone from it are no longer drawn, and an object whose size or
        version changed is read afresh (a ``.npy`` header is read again; a URL named without a
        glob has its object's details asked at each listing). Samples go on from the last listing
        meanwhile; a listing that fails (after the retry policy's tries, never riding out an
        outage) or matches nothing is logged, once per run of them, and the last one kept. A
        listing carried from another process (pickled to a sampler) that is older than
        :attr:`relist_every` is renewed before anything is drawn from it.

        Raises:
            SourceError: the glob matches nothing, or the bucket or directory is missing.
        """
        if self._paths is None:
            with self._lock:
                return self._list()
        if self.relist_every is not None and time.monotonic() - self._paths_listed_at >= self.relist_every:
            if self._listed_in != _this_pid[0] and not _in_event_loop():
                # A listing older than relist_every, carried from another process (the training
                # process's check(), pickled to each sampler and to each restarted one): listed again
                # now, before anything is drawn from it, as a first listing is.
                with self._lock:
                    if self._listed_in != _this_pid[0]:
                        self._listed_in = _this_pid[0]
                        self._relist()
            else:
                self._relist_soon()
        return self._paths

    def _list(self) -> list[str]:
        """Assumes you hold ``self._lock``."""
        if self._paths is None:
            found, sizes, versions = self._list_now()
            if not found:
                raise SourceError(self._redact(
                    f"no objects match {', '.join(self.urls)}: check the bucket, prefix and pattern "
                    "(object names are case-sensitive; '**' matches across directories)"
                ))
            self._sizes.update(sizes)
            self._versions = versions
            self._paths = sorted(found)
            self._paths_listed_at = time.monotonic()
            self._listed_in = _this_pid[0]
        return self._paths

    def _list_now(self, outage: bool = True) -> tuple[set[str], dict[str, int], dict[str, str]]:
        """The paths the URLs name now, the sizes and versions the listing gave of them.

        With :attr:`relist_every`, the details of each path named without a glob are asked too
        (one request each): its version, so that a rewritten file is read afresh. A named path
        that is missing stays the fetch's error, as without relisting."""
        fs = self.fs
        found: set[str] = set()
        sizes: dict[str, int] = {}
        versions: dict[str, str] = {}
        for url in self.urls:
            path = fs._strip_protocol(url)
            if _GLOB_CHARS & set(path):
                listing = self._io("listing", self._redact(url), lambda p=path: glob_listing(fs, p), outage=outage)
                files = {p: info for p, info in listing.items() if info.get("type", "file") != "directory"}
            else:
                files = {}
                found.add(path)
                if self.relist_every is not None:
                    info = self._named_info(url, path, outage)
                    if isinstance(info, dict) and info.get("type", "file") != "directory":
                        files = {path: info}
            found.update(files)
            sizes.update({p: int(info["size"]) for p, info in files.items()
                          if isinstance(info.get("size"), int) and info["size"] >= 0})
            if self.relist_every is not None:  # for the relisting alone: 130 MB a million objects
                versions.update((p, object_version(info)) for p, info in files.items())
        self._named = frozenset(fs._strip_protocol(url) for url in self.urls if not _GLOB_CHARS & set(url))
        return found, sizes, versions

    def _named_info(self, url: str, path: str, outage: bool) -> Any:
        """The store's details of ``path``, named without a glob; ``None`` if it is missing."""
        fs = self.fs
        try:
            return self._io("listing", self._redact(url), lambda: _sized(lambda: fs.info(path)), outage=outage)
        except SourceError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise

    def _relist_soon(self) -> None:
        """Start one background listing unless one runs or the last is recent."""
        running = self._relisting
        if running is not None and running.is_alive():
            return  # every sample asks while a listing runs (a large bucket: a minute): no lock for that
        with self._lock:
            running = self._relisting
            if (running is not None and running.is_alive()) or self.relist_every is None \
                    or time.monotonic() - self._paths_listed_at < self.relist_every:
                return
            # Listing is blocking I/O (the sync filesystem): never in a sampler's event loop thread.
            self._relisting = threading.Thread(target=self._relist, name="growcache-relist", daemon=True)
            self._relisting.start()

    def _relist(self) -> None:
        """List again and take the new listing (see :meth:`paths`).

        A transient failure is tried as the retry policy says, never ridden out as an outage: the
        next listing comes in :attr:`relist_every` seconds anyway, and samples go on meanwhile."""
        urls = ", ".join(self._redact(u) for u in self.urls)
        self._listed_in = _this_pid[0]
        try:
            fs = self.fs
            try:
                fs.invalidate_cache()  # fsspec's listings cache would hide what changed
            except Exception:  # noqa: BLE001 - a filesystem without one
                pass
            found, sizes, versions = self._list_now(outage=False)
        except Exception as exc:  # noqa: BLE001 - a failed relisting must not stop the sampling
            self._paths_listed_at = time.monotonic()
            self._relist_failed("a new listing (relist_every=%g s) failed: %s; samples are still drawn from the last "
                                "listing (%d objects), and it is tried again every %g s", self.relist_every,
                                self._redact(str(exc)).rstrip("."), len(self._paths or ()), self.relist_every)
            return
        if not found:
            self._paths_listed_at = time.monotonic()
            self._relist_failed("listing %s again matched no objects; samples are still drawn from the last listing "
                                "(%d objects)", urls, len(self._paths or ()))
            return
        # Compared and sorted outside the lock, which every sample of the process takes (2 s for a
        # million objects); only relistings write _versions. Counted against the last listing, not
        # against the paths drawn from: a path a sample left out (gone, or truncated while written)
        # and listed again is drawn again, unlogged.
        listed = self._versions.keys() | (self._named or frozenset())
        gone = listed - found
        changed = {p for p in found & self._versions.keys() if p in versions and versions[p] != self._versions[p]}
        paths = sorted(found)
        with self._lock:
            self._paths_listed_at = time.monotonic()
            for path in gone | changed:
                self._drop(path)
            self._sizes.update(sizes)
            self._versions = versions
            self._paths = paths  # a new list: samples in other threads index the old one meanwhile
            failures, self._relist_failures = self._relist_failures, 0
        added = len(found - listed)
        if failures:
            logger.warning("listing %s works again, after %d failed or empty listing%s: %d objects", urls, failures,
                           "s" if failures != 1 else "", len(found))
        if added or gone or changed:
            logger.info("listed %s again: %d objects (%d new, %d gone, %d changed)",
                        urls, len(found), added, len(gone), len(changed))

    def _relist_failed(self, message: str, *args: Any) -> None:
        """A relisting failed or matched nothing: a WARNING for the first of a run of them, DEBUG after."""
        self._relist_failures += 1
        if self._relist_failures == 1:
            logger.warning(message + " (further failures are logged at DEBUG until a listing works)", *args)
        else:
            logger.debug(message, *args)

    def _choose(self, rng: np.random.Generator) -> str:
        paths = self.paths()
        return paths[int(rng.integers(len(paths)))]

    def _passes_over(self, path: str, exc: BaseException, claimed: int = 0) -> bool:
        """True if ``path``, found by a glob, is gone from the store (``exc`` says not found): it is
        left out of this process's paths with one WARNING, and the sample draws another path with
        its RNG. A live bucket loses objects; one of thousands deleted once failed the whole pool.
        A path the URLs name without a glob stays an error (a typo, or data the user asked for).

        ``claimed``: bytes the sample claimed for ``path``, given back to the byte budget.
        """
        cause = exc.__cause__ if isinstance(exc, SourceError) else None
        if not isinstance(cause, FileNotFoundError) or path in (self._named or ()):
            return False
        self._unclaim_bytes(claimed)
        self._leave_out(path, "vanished from the store since it was listed")
        return True

    def _leave_out(self, path: str, why: str) -> None:
        """Sample no more from ``path`` in this process (its WARNING once); raise once no path is left."""
        with self._lock:
            paths = self._paths or []
            left = [p for p in paths if p != path]
            if len(left) == len(paths):
                return  # another sample left it out first
            self._paths = left  # a new list: samples in other threads index the old one meanwhile
            self._drop(path)
        logger.warning("%s %s; it is left out of this sampler's draws (%d objects left)", self._url(path), why,
                       len(left))
        if not left:
            raise SourceError(self._redact(
                f"every object matching {', '.join(self.urls)} is gone from the store or changed since it was "
                "listed: check the bucket and prefix, and restart the pool once the data is back"))

    def _drop(self, path: str, size: bool = True) -> None:
        """Drop what this process cached about ``path`` (its size too unless ``size=False``); a read
        of it in flight does not cache what it read (see :attr:`_forgets`). Assumes you hold ``self._lock``."""
        self._forgets += 1
        if size:
            self._sizes.pop(path, None)
        self._forget(path)

    def _forget(self, path: str) -> None:
        """Drop what a subclass cached about ``path``. Assumes you hold ``self._lock``."""

    def check(self) -> None:
        self.paths()


class _Attempts:
    """The tries of one store call: the retry policy's, then an outage's (see :meth:`StoreSource._io`)."""

    def __init__(self, source: StoreSource, what: str | _Reading, url: str | Callable[[], str],
                 outage: bool = True) -> None:
        self.source, self.what, self.outage = source, str(what), outage
        self.url = url if isinstance(url, str) else url()
        self.delays = source.retry.delays()
        self.start = time.monotonic()
        self.attempt = 0
        self.outage_since: float | None = None

    def pause_after(self, exc: Exception) -> float:
        """Seconds to wait before the next try after ``exc``; raises the error that ends the call."""
        source, retry = self.source, self.source.retry
        self.attempt += 1
        if not is_transient(exc):
            raise source._failure(self.what, self.url, exc, self.attempt, self.start) from exc
        if self.outage_since is None:
            delay = next(self.delays, None)
            if delay is not None and (retry.deadline is None
                                      or time.monotonic() - self.start + delay <= retry.deadline):
                source._on_retry(self.what, self.url, exc, self.attempt, delay)
                return delay
            if not (self.outage and source._rides_out(exc)):
                raise source._failure(self.what, self.url, exc, self.attempt, self.start) from exc
            self.outage_since = source._outage_begins(self.url, exc)
        pause = source._outage_pause(self.outage_since)
        if pause is None:
            raise source._outage_failure(self.what, self.url, exc, self.outage_since) from exc
        return pause


class _Request:
    """Context of one store request (see :meth:`StoreSource._request`); a class, not a generator
    context manager: it wraps every request, thousands a second."""

    __slots__ = ("source", "ticket", "began")

    def __init__(self, source: StoreSource, ticket: Any) -> None:
        self.source, self.ticket = source, ticket

    def __enter__(self) -> None:
        if self.ticket is not None:
            self.ticket.flow.request_started()
        self.began = time.monotonic()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.ticket is not None:
            self.ticket.flow.request_ended(time.monotonic() - self.began if exc_type is None else None)
        if exc_type is None:
            self.source._answered()


class _Reading:
    """What a ranged read does, spelled out only if a message needs it."""

    __slots__ = ("start", "end")

    def __init__(self, start: int | None, end: int | None) -> None:
        self.start, self.end = start, end

    def __str__(self) -> str:
        return "reading" if self.start is None else f"reading bytes {self.start}-{self.end} of"


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


def _client_options(protocol: str, storage_options: Mapping[str, Any], retry: RetryPolicy,
                    connections: int | None = None) -> dict[str, Any]:
    """``storage_options`` with the store client's timeouts and retries taken from ``retry``,
    and the connection pool sized for ``connections`` requests in flight.

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
        if connections is not None and connections > 10:  # botocore's default pool holds 10
            config.setdefault("max_pool_connections", connections)
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


# fsspec info keys that name an object's version, the most precise first. One is used: a
# listing and a metadata request of one store must give the same version, and some fields
# differ between the two (S3's LastModified has milliseconds in a listing, not in a HEAD).
_VERSION_KEYS = ("generation", "VersionId", "ETag", "etag", "md5Hash", "mtime", "LastModified", "updated", "created")


def object_version(info: Any) -> str:
    """An object's version from fsspec's details of it: its size and the first field the store
    names its content by (a rewrite changes it)."""
    if not isinstance(info, dict):
        return "?"
    key = next((k for k in _VERSION_KEYS if info.get(k) is not None), None)
    return f"size={info.get('size')}" + (f";{key}={info[key]}" if key else "")


def _in_event_loop() -> bool:
    """True in a thread that runs an asyncio event loop (a sampler's: no blocking call there)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _object_claim(size: int | None) -> int:
    """Bytes a sample claims for a whole object of ``size`` (``None``: unknown, the whole budget);
    none outside a sampler."""
    ticket = current_ticket()
    if ticket is None:
        return 0
    return ticket.flow.max_bytes if size is None else size


def _not_found(exc: FileNotFoundError) -> BaseException:
    """The error of a size request that raised ``exc``. fsspec's http ``info`` asks by HEAD, then by
    GET, and raises FileNotFoundError for whatever made the GET fail: a 503 or a refused connection
    is the store's passing trouble, to retry (and ride out), not an object gone from the store.

    Raise it outside the ``except`` block: inside, the FileNotFoundError raised from it would become
    its context, a cycle."""
    cause = exc.__cause__
    return cause if isinstance(cause, Exception) and is_transient(cause) else exc


def _sized(size: Callable[[], Any]) -> Any:
    """``size()``, a size or details request of a sync filesystem; the error to retry where it is
    one (:func:`_not_found`)."""
    try:
        return size()
    except FileNotFoundError as exc:
        error = _not_found(exc)
        if error is exc:
            raise
    raise error


_GLOBBING = threading.Lock()
# A child forked while another thread globbed would find the lock held for good.
os.register_at_fork(after_in_child=lambda: globals().update(_GLOBBING=threading.Lock()))


def glob_listing(fs: Any, path: str) -> dict[str, Any]:
    """``fs.glob(path, detail=True)``, raising where a folder of the walk could not be listed.

    fsspec's glob walks the folders above its matches and leaves out any folder whose listing
    fails (its walk's ``on_error="omit"``, not passed down to the levels below): a throttled or
    failing prefix of S3 (an ``OSError`` from s3fs) or a refused connection vanished from the
    dataset without a word, and a failed first level read as "nothing matches". A folder gone
    meanwhile (not found) is still left out: a live bucket loses prefixes.
    """
    failed: list[tuple[str, BaseException]] = []
    name = "_ls" if getattr(fs, "async_impl", False) else "ls"

    def note(folder: str, exc: Exception) -> None:
        if not isinstance(exc, FileNotFoundError) or _not_found(exc) is not exc:
            failed.append((folder, exc))

    if name == "_ls":
        async def listing(folder: str, *args: Any, **kwargs: Any) -> Any:
            try:
                return await original(folder, *args, **kwargs)
            except Exception as exc:
                note(folder, exc)
                raise
    else:
        def listing(folder: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            try:
                return original(folder, *args, **kwargs)
            except Exception as exc:
                note(folder, exc)
                raise

    # Only this instance, only for this call: the folders the walk lists go through ``listing``.
    # One glob at a time in a process: fsspec shares a filesystem instance between its users.
    with _GLOBBING:
        original = getattr(fs, name)
        setattr(fs, name, listing)
        try:
            found = fs.glob(path, detail=True)
        finally:
            fs.__dict__.pop(name, None)
    if failed:
        folder, exc = failed[0]
        raise ListingFailed(folder) from exc
    return found


def _hint(exc: BaseException) -> str:
    if isinstance(exc, ListingFailed) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, FileNotFoundError):
        return "Check that the bucket and object exist and the URL is spelled right."
    if isinstance(exc, PermissionError):
        return "Check the credentials in storage_options and the bucket's access policy."
    return "This error is not retryable; fix its cause and start again."
