"""Sources: where a sampler gets its samples, over any fsspec store.

A source is a picklable callable ``sample(rng) -> dict[str, ndarray]``. Three kinds:

* :class:`ObjectSource`: a random whole object from a glob, decoded by a named decoder
  (``".npy"``, ``"raw"``) or a callable;
* :class:`NpyWindowSource`: a random window of rows of a large ``.npy`` array, read by
  byte range, so a 4 MB window of a 1 GB remote array transfers about 4 MB;
* :class:`FunctionSource`: any picklable ``sample(rng)`` function.

Shard sources, which give a sampler pool whole TFRecord shards instead of samples
(:class:`~growcache.shard_source.TFRecordShardSource`), are importable from here too.

Stores are reached through ``fsspec.core.url_to_fs(url, **storage_options)``; the
filesystem is created lazily in each process, so sources travel to spawned sampler
processes by pickle. Transient store errors are retried with backoff and jitter
(:class:`RetryPolicy`), then raised as :class:`TransientSourceError`; permanent ones
(no such bucket, access denied, empty glob) raise :class:`SourceError` at once. Every
message names the URL; credentials from ``storage_options`` never appear in messages,
logs or ``repr``. Object names from the store are only ever used as store paths, never
as local file names.
"""

from __future__ import annotations

import ast
import functools
import io
import logging
import math
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._retry import RetryPolicy, describe_error
from .errors import GrowcacheError, SchemaError, SourceError
from .schema import Schema
from .shard_source import ShardSource, TFRecordShardSource  # noqa: F401 - importable from here too
from .store import Sample, Source, StoreSource

__all__ = [
    "FunctionSource",
    "NpyWindowSource",
    "ObjectSource",
    "RetryPolicy",
    "Source",
    "as_source",
    "open_source",
]

_MAX_NPY_HEADER = 1 << 20

logger = logging.getLogger(__name__)

Decoder = Callable[[bytes, str], "np.ndarray | Mapping[str, Any]"]

_NPY_MAGIC = b"\x93NUMPY"


class FunctionSource(Source):
    """Wraps a picklable callable ``fn(rng) -> dict[str, ndarray]`` as a :class:`Source`.

    Args:
        fn: a module-level function (or any picklable callable); lambdas and closures do
            not pickle and cannot reach spawned sampler processes.
        thread_safe: ``fn`` may run in several threads at once, so a sampler with
            ``concurrency=N`` keeps N calls in flight. Left ``False``, it is called one
            sample at a time whatever the concurrency. Default: ``False``.
    """

    def __init__(self, fn: Callable[[np.random.Generator], Mapping[str, Any]], *, thread_safe: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"FunctionSource needs a callable sample(rng) -> dict, got {type(fn).__name__}")
        self.fn = fn
        self.thread_safe = bool(thread_safe)

    def sample(self, rng: np.random.Generator) -> Sample:
        return dict(self.fn(rng))

    def __repr__(self) -> str:
        safe = ", thread_safe=True" if self.thread_safe else ""
        return f"FunctionSource({getattr(self.fn, '__qualname__', self.fn)!r}{safe})"


def as_source(source: Source | Callable[[np.random.Generator], Mapping[str, Any]]) -> Source:
    """``source`` itself if it is a :class:`Source`, else a :class:`FunctionSource` of it."""
    if isinstance(source, Source):
        return source
    if callable(source):
        return FunctionSource(source)
    raise TypeError(
        f"a source is a growcache.sources.Source or a callable sample(rng) -> dict of arrays, "
        f"got {type(source).__name__}"
    )


# -- whole objects -------------------------------------------------------------------------
def _decode_npy(data: bytes, path: str) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


class ObjectSource(StoreSource):
    """A random whole object from a glob, decoded into a sample.

    Args:
        url: a URL or glob (``"s3://bucket/train/*.npy"``), or a list of them.
        decoder: ``".npy"`` (``numpy.load``, no pickles), ``"raw"`` (bytes as ``dtype`` and
            ``shape``), or a callable ``decode(data: bytes, path: str)`` that returns an
            array or a dict of arrays; ``path`` is the object's store path (for labels).
            It is called once at a time, unless it has ``thread_safe = True`` (an attribute of
            the function or its class): then a sampler with ``concurrency > 1`` may call it from
            several threads at once (local files). Default: ``".npy"``.
        feature: the feature name an array result is stored under. Default: ``"x"``.
        dtype: element type of ``"raw"`` objects.
        shape: shape of ``"raw"`` objects.
        storage_options: passed to fsspec (credentials, ``client_kwargs``, ...).
        retry: retry policy of transient errors. Default: ``RetryPolicy()``.
        relist_every: seconds between listings of the globs in each sampler process, so that
            objects added to a live bucket are drawn and objects gone from it are not; listing
            runs in the background, and an object whose size or version changed is fetched
            afresh (a URL without a glob has its details asked at each listing). ``None`` lists
            once per process. Default: ``None``.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        decoder: str | Decoder = ".npy",
        feature: str = "x",
        dtype: Any = None,
        shape: Sequence[int] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        relist_every: float | None = None,
    ) -> None:
        super().__init__(url, storage_options=storage_options, retry=retry, relist_every=relist_every)
        if isinstance(decoder, str):
            name = decoder.lower().lstrip(".")
            if name == "npy":
                decoder = _decode_npy
            elif name == "raw":
                if dtype is None or shape is None:
                    raise ValueError("decoder='raw' needs dtype= and shape= (e.g. dtype='uint8', shape=(224, 224, 3))")
                decoder = _RawDecoder(np.dtype(dtype).str, tuple(int(d) for d in shape))
            else:
                raise ValueError(f"unknown decoder {decoder!r}: use '.npy', 'raw' or a callable decode(data, path)")
        elif not callable(decoder):
            raise TypeError(f"decoder must be '.npy', 'raw' or a callable, got {type(decoder).__name__}")
        elif not getattr(decoder, "thread_safe", False):
            decoder = _OneAtATime(decoder)
        self.decoder = decoder
        self.feature = feature

    def _repr_extra(self) -> str:
        return f", decoder={getattr(self.decoder, '__name__', self.decoder)!r}, feature={self.feature!r}"

    def sample(self, rng: np.random.Generator) -> Sample:
        while True:
            path, claimed = self._choose(rng), 0
            try:
                claimed = self._claim_object(self._size(path))
                data = self._fetch(path)
            except SourceError as exc:
                if self._passes_over(path, exc, claimed):
                    continue
                raise
            self._settle(path, claimed, data)
            return self._decode(path, data)

    async def sample_async(self, rng: np.random.Generator) -> Sample:
        """:meth:`sample` through the async filesystem (a sampler with ``concurrency > 1`` calls it)."""
        while True:
            path, claimed = self._choose(rng), 0
            try:
                size = await self._asize(path)
                data = await self._afetch_unsized(path) if size is None else None
                if data is None:
                    claimed = await self._aclaim_object(size)
                    data = await self._afetch(path)
                else:
                    claimed = len(data)  # held piece by piece as it streamed in
            except SourceError as exc:
                if self._passes_over(path, exc, claimed):
                    continue
                raise
            self._settle(path, claimed, data)
            return self._decode(path, data)

    def _decode(self, path: str, data: bytes) -> Sample:
        try:
            result = self.decoder(data, path)
        except GrowcacheError:
            raise
        except Exception as exc:
            raise SchemaError(self._redact(
                f"cannot decode {self._url(path)} with {getattr(self.decoder, '__name__', self.decoder)}: "
                f"{describe_error(exc)}. Check that the objects match the decoder."
            )) from exc
        if isinstance(result, Mapping):
            return dict(result)
        return {self.feature: result}


class _OneAtATime:
    """A user's decoder that did not declare ``thread_safe = True``: one call at a time, as
    samplers called it before they kept requests in flight (a pool of threads fetches local
    files, and each decoded what it fetched)."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self._lock = threading.Lock()

    @property
    def __name__(self) -> str:  # shown in messages and repr
        return getattr(self.decoder, "__name__", repr(self.decoder))

    def __getstate__(self) -> dict[str, Any]:
        return {"decoder": self.decoder}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.decoder, self._lock = state["decoder"], threading.Lock()

    def __call__(self, data: bytes, path: str) -> Any:
        with self._lock:
            return self.decoder(data, path)


@dataclass(frozen=True)
class _RawDecoder:
    dtype: str
    shape: tuple[int, ...]

    @property
    def __name__(self) -> str:  # shown in messages and repr
        return f"raw {np.dtype(self.dtype).name}{list(self.shape)}"

    def __call__(self, data: bytes, path: str) -> np.ndarray:
        dtype = np.dtype(self.dtype)
        expected = int(np.prod(self.shape, dtype=np.int64)) * dtype.itemsize
        if len(data) != expected:
            raise ValueError(f"object has {len(data)} bytes, dtype {dtype.name} shape {self.shape} needs {expected}")
        return np.frombuffer(data, dtype=dtype).reshape(self.shape)


# -- windows of .npy arrays ----------------------------------------------------------------
@dataclass(frozen=True)
class NpyHeader:
    """Where the rows of a ``.npy`` file lie: dtype, shape and byte offset of the data."""

    dtype: np.dtype
    shape: tuple[int, ...]
    data_offset: int

    # Cached: every sample asks (numpy's prod alone cost a tenth of a small window's sampling).
    @functools.cached_property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 0

    @functools.cached_property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


class NpyWindowSource(StoreSource):
    """A random window of consecutive rows of a large ``.npy`` array, read by byte range.

    Each file's header is read once per process with one small range read; each sample
    then fetches only its window's bytes (``fs.cat_file(path, start, end)``). A file is
    drawn uniformly, then a start row uniformly among the ``rows - window + 1`` choices.

    Args:
        url: a URL or glob of ``.npy`` files, or a list of them.
        window: rows per sample (along the first axis).
        feature: the feature name of the window. Default: ``"x"``.
        storage_options: passed to fsspec.
        retry: retry policy of transient errors. Default: ``RetryPolicy()``.
        relist_every: seconds between listings of the globs in each sampler process (as for
            :class:`ObjectSource`); a file whose size or version changed has its header read
            again. ``None`` lists once per process. Default: ``None``.
        header_bytes: size of the first range read, enough for any ordinary header.
            Default: ``4096``.

    Raises:
        SourceError: (on first use of a file) it is not a ``.npy`` file, is Fortran-ordered,
            holds Python objects, or has fewer rows than ``window``.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        window: int,
        *,
        feature: str = "x",
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        header_bytes: int = 4096,
        relist_every: float | None = None,
    ) -> None:
        super().__init__(url, storage_options=storage_options, retry=retry, relist_every=relist_every)
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window must be a positive number of rows, got {window!r}")
        self.window = int(window)
        self.feature = feature
        self.header_bytes = max(64, int(header_bytes))
        self._headers: dict[str, NpyHeader] = {}

    def _repr_extra(self) -> str:
        return f", window={self.window}, feature={self.feature!r}"

    def header(self, path: str) -> NpyHeader:
        """The parsed header of ``path`` (one range read, cached in this process)."""
        cached = self._headers.get(path)
        if cached is not None:
            return cached
        forgets = self._forgets
        head = self._fetch(path, 0, self.header_bytes)
        more = self._header_length(path, head)
        if more > len(head):  # a rare long header: read the rest of it
            head += self._fetch(path, len(head), more)
        return self._parse_header(path, head, forgets)

    async def aheader(self, path: str) -> NpyHeader:
        """:meth:`header` in the sampler's event loop (concurrent first reads may read it twice)."""
        cached = self._headers.get(path)
        if cached is not None:
            return cached
        forgets = self._forgets
        head = await self._afetch(path, 0, self.header_bytes)
        more = self._header_length(path, head)
        if more > len(head):
            head += await self._afetch(path, len(head), more)
        return self._parse_header(path, head, forgets)

    def _header_length(self, path: str, head: bytes) -> int:
        """How many bytes from the start of the file the header takes (its magic and length checked)."""
        url = self._url(path)
        if len(head) < 10 or not head.startswith(_NPY_MAGIC):
            raise SourceError(f"{url} is not a .npy file (no NUMPY magic). Give .npy files saved with numpy.save.")
        major = head[6]
        if major == 1:
            hlen, hstart = struct.unpack("<H", head[8:10])[0], 10
        elif major in (2, 3):
            hlen, hstart = struct.unpack("<I", head[8:12])[0], 12
        else:
            raise SourceError(f"{url} is a .npy file of unknown format version {major}.{head[7]}")
        if hlen > _MAX_NPY_HEADER:
            raise SourceError(f"{url} has a .npy header of {hlen} bytes, more than {_MAX_NPY_HEADER}: it is damaged "
                              "or not an array growcache can sample. Re-save it with numpy.save.")
        return hstart + hlen

    def _parse_header(self, path: str, head: bytes, forgets: int | None = None) -> NpyHeader:
        """The header in ``head``, cached unless what was cached of some object was dropped since
        ``forgets`` (:attr:`_forgets` before the read): a relisting that found ``path`` rewritten
        while its old header was read must not see the old header cached after it."""
        url = self._url(path)
        major = head[6]
        hstart = 10 if major == 1 else 12
        hlen = self._header_length(path, head) - hstart
        try:
            # Parsed here for every version: numpy's own readers differ between its releases
            # (version 3.0 has no public one) and refuse headers past 10,000 bytes.
            text = bytes(head[hstart:hstart + hlen]).decode("utf-8" if major == 3 else "latin-1")
            fields = ast.literal_eval(text)
            if not isinstance(fields, dict) or not {"descr", "fortran_order", "shape"} <= fields.keys():
                raise ValueError(f"the header {text.strip()!r} lacks descr, fortran_order or shape")
            dtype = np.lib.format.descr_to_dtype(fields["descr"])
            shape, fortran = fields["shape"], bool(fields["fortran_order"])
            # int() would take '8' as (8,), 8.5 as 8 and True as 1: only a tuple of ints is a shape.
            if not (isinstance(shape, tuple)
                    and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise ValueError(f"its shape {shape!r} is not a tuple of non-negative integers")
        except (ValueError, SyntaxError, TypeError) as exc:
            raise SourceError(f"{url} has a damaged .npy header: {exc}. Re-save the array with numpy.save.") from exc
        if fortran and len(shape) > 1:
            raise SourceError(
                f"{url} is Fortran-ordered, so a window of rows is not one byte range. "
                "Save it C-ordered: numpy.save(path, numpy.ascontiguousarray(array))."
            )
        if dtype.hasobject:
            raise SourceError(f"{url} holds Python objects (dtype {dtype}); windows need a numeric dtype.")
        if not shape:
            raise SourceError(f"{url} holds a 0-d array; windows need at least one axis of rows.")
        # Python ints: numpy's int64 product wraps around silently on a damaged or hostile shape.
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        if hstart + hlen + max(shape[0], 1) * row_bytes >= 2**63:
            raise SourceError(
                f"{url} has a .npy header whose shape {shape} of {dtype} describes more bytes than any file can "
                "hold (2**63): the header is damaged. Re-save the array with numpy.save.")
        try:  # the cache's schema decides which dtypes a window may have (void, structured, str: none)
            Schema({"window": (dtype, ())})
        except SchemaError as exc:
            raise SourceError(
                f"{url} holds dtype {dtype}, which a cache cannot store ({exc}). Re-save the array with a numeric "
                "dtype, for example numpy.save(path, array.view(numpy.uint8)) for raw bytes.") from None
        header = NpyHeader(dtype, tuple(shape), hstart + hlen)
        if header.rows < self.window:
            raise SourceError(
                f"{url} has {header.rows} rows, fewer than window={self.window}. "
                "Lower the window or leave out small files."
            )
        with self._lock:
            if forgets is None or forgets == self._forgets:
                self._headers[path] = header
        return header

    def sample(self, rng: np.random.Generator) -> Sample:
        while True:
            path, claimed = self._choose(rng), 0
            try:
                cached = path in self._headers
                header = self.header(path)
                first, start, end = self._window(header, rng)
                self._claim_bytes(end - start)
                claimed = end - start
                return self._unpack(path, header, first, start, end, self._fetch(path, start, end))
            except SourceError as exc:
                if not (self._passes_over(path, exc, claimed) or self._changed(path, exc, cached, claimed)):
                    raise

    async def sample_async(self, rng: np.random.Generator) -> Sample:
        """:meth:`sample` through the async filesystem (a sampler with ``concurrency > 1`` calls it)."""
        while True:
            path, claimed = self._choose(rng), 0
            try:
                cached = path in self._headers
                header = await self.aheader(path)
                first, start, end = self._window(header, rng)
                await self._aclaim_bytes(end - start)
                claimed = end - start
                return self._unpack(path, header, first, start, end, await self._afetch(path, start, end))
            except SourceError as exc:
                if not (self._passes_over(path, exc, claimed) or self._changed(path, exc, cached, claimed)):
                    raise

    def _changed(self, path: str, exc: SourceError, cached: bool, claimed: int) -> bool:
        """True if a window came back short because ``path`` was rewritten shorter since its header was
        read: the header is read again at the next draw of it. A file short under a header read just now
        is truncated: left out if a glob found it, else the error stands."""
        if not isinstance(exc, _ShortWindow) or (not cached and path in (self._named or ())):
            return False
        self._unclaim_bytes(claimed)
        if cached:
            with self._lock:
                self._drop(path, size=False)
            logger.warning("%s changed since its .npy header was read: reading the header again", self._url(path))
        else:
            self._leave_out(path, "is shorter than its .npy header says (truncated)")
        return True

    def _forget(self, path: str) -> None:
        self._headers.pop(path, None)

    def _window(self, header: NpyHeader, rng: np.random.Generator) -> tuple[int, int, int]:
        """The first row of a random window, and the byte range of its rows."""
        first = int(rng.integers(header.rows - self.window + 1))
        start = header.data_offset + first * header.row_bytes
        return first, start, start + self.window * header.row_bytes

    def _unpack(self, path: str, header: NpyHeader, first: int, start: int, end: int, data: bytes) -> Sample:
        if len(data) != end - start:
            raise _ShortWindow(
                f"{self._url(path)} returned {len(data)} bytes for rows {first}-{first + self.window}, expected "
                f"{end - start}: the file is shorter than its header says (truncated or replaced while read)."
            )
        window = np.frombuffer(data, dtype=header.dtype).reshape((self.window, *header.shape[1:]))
        return {self.feature: window}


class _ShortWindow(SourceError):
    """A window read came back shorter than the file's header says it is."""


def open_source(
    url: str | Sequence[str],
    *,
    window: int | None = None,
    feature: str = "x",
    decoder: str | Decoder | None = None,
    dtype: Any = None,
    shape: Sequence[int] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    relist_every: float | None = None,
) -> Source:
    """The source a URL names: windows of ``.npy`` arrays if ``window`` is given, else whole objects.

    Whole objects are decoded by ``decoder``; default ``"raw"`` when ``dtype`` and ``shape``
    are given, else ``".npy"``. ``relist_every``: as for :class:`ObjectSource`.
    """
    if window is not None:
        if decoder is not None:
            raise ValueError("window= reads .npy arrays by byte range; it takes no decoder")
        return NpyWindowSource(url, window, feature=feature, storage_options=storage_options, retry=retry,
                               relist_every=relist_every)
    if decoder is None:
        decoder = "raw" if dtype is not None and shape is not None else ".npy"
    return ObjectSource(url, decoder=decoder, feature=feature, dtype=dtype, shape=shape,
                        storage_options=storage_options, retry=retry, relist_every=relist_every)
