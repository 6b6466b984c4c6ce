"""Retries for remote stores: backoff with jitter, error classification, secret redaction.

fsspec backends raise a zoo of exception types (builtins, botocore, aiohttp, gcsfs's
``HttpError``). They are classified here by what they mean, without importing any of those
packages: a transient error is worth retrying, everything else is permanent.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Redactor", "RetryPolicy", "describe_error", "is_stall", "is_throttle", "is_transient"]

logger = logging.getLogger("growcache.sources")

T = TypeVar("T")

# Errors a store raises when a request may succeed if simply tried again.
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestLimitExceeded",
    "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException", "InternalError",
    "ServiceUnavailable", "BandwidthLimitExceeded", "rateLimitExceeded", "backendError",
})
_TRANSIENT_ERRNOS = frozenset({
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN,
})
# botocore, aiohttp, urllib3, fsspec, requests, google-auth and gcsfs names, matched by class
# name so none is imported. The last three are what gcsfs's own retry loop retries (growcache
# turns that loop off): gcsfs raises requests' ProxyError for an HTTP 502, ChecksumError for
# bytes damaged in transit, and google-auth's RefreshError when a token refresh fails.
_TRANSIENT_NAMES = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ClientConnectorError", "ServerDisconnectedError", "ClientPayloadError", "ServerTimeoutError",
    "ClientOSError", "ProxyConnectionError", "ResponseStreamingError", "IncompleteRead",
    "FSTimeoutError", "ProtocolError", "RemoteDisconnected",
    "ProxyError", "ChunkedEncodingError", "ContentDecodingError", "ChecksumError", "RefreshError",
})
# Errors that retrying cannot fix, whatever their cause says.
_PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


@dataclass(frozen=True)
class RetryPolicy:
    """How often, how long and how patiently to retry transient store errors.

    The delay before retry ``n`` (0-based) is drawn uniformly from ``[d/2, d]`` with
    ``d = min(max_delay, initial_delay * multiplier**n)``: exponential backoff with jitter,
    so many workers hitting a throttled store do not retry in lockstep.

    Two bounds keep a failing or silent store from stalling a sampler for long:

    * ``deadline`` bounds a failing call: no retry starts once it would begin later than
      ``deadline`` seconds after the first try. The store client's own retries (botocore's,
      s3fs's, gcsfs's) are turned off, so they do not multiply with these.
    * ``stall_timeout`` bounds a read that gets no bytes: a connection that is not
      accepted, or a response that sends nothing, for this many seconds fails as a
      transient error (and is retried under the deadline). It is set as the socket
      connect and read timeout of the s3://, gs:// and http(s):// clients, unless
      ``storage_options`` set their own.

    A third bound rides out outages: once the store has answered at least once, a request
    whose tries are spent goes on trying, ``max_delay`` apart (with jitter), until the store
    answers again or ``outage_budget`` seconds have passed since the outage began. The
    outage is logged once when it begins and once when it ends; the cache goes on serving
    training meanwhile. A store that never answered fails after the tries above, at once.

    Args:
        attempts: tries in all, the first included. Default: ``6``.
        initial_delay: seconds before the first retry. Default: ``0.2``.
        max_delay: cap of one delay, in seconds. Default: ``10.0``.
        multiplier: growth of the delay per retry. Default: ``2.0``.
        deadline: seconds after the first try after which no retry starts; ``None`` for
            attempts only. Default: ``30.0``.
        stall_timeout: seconds without a byte after which a connect or read fails.
            Default: ``30.0``.
        outage_budget: seconds an outage of a store that answered before is ridden out;
            ``0`` fails after the tries above, as a store never reached does.
            Default: ``600.0``.
    """

    attempts: int = 6
    initial_delay: float = 0.2
    max_delay: float = 10.0
    multiplier: float = 2.0
    deadline: float | None = 30.0
    stall_timeout: float = 30.0
    outage_budget: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int of at least 1, got {self.attempts!r}")
        if self.initial_delay < 0 or self.max_delay < 0 or self.multiplier < 1:
            raise ValueError("RetryPolicy delays must be >= 0 and multiplier >= 1")
        if self.deadline is not None and not self.deadline > 0:
            raise ValueError(f"RetryPolicy.deadline must be positive seconds or None, got {self.deadline!r}")
        if not self.stall_timeout > 0:
            raise ValueError(f"RetryPolicy.stall_timeout must be positive seconds, got {self.stall_timeout!r}")
        if isinstance(self.outage_budget, bool) or not isinstance(self.outage_budget, (int, float)) \
                or not self.outage_budget >= 0:
            raise ValueError(f"RetryPolicy.outage_budget must be seconds >= 0, got {self.outage_budget!r}")

    def delays(self, jitter: random.Random | None = None) -> Iterator[float]:
        """The ``attempts - 1`` sleeps between tries (the deadline is applied by :meth:`call`)."""
        jitter = jitter or random.Random()
        for n in range(self.attempts - 1):
            ceiling = min(self.max_delay, self.initial_delay * self.multiplier**n)
            yield jitter.uniform(ceiling / 2, ceiling)

    def call(self, fn: Callable[[], T], *, on_retry: Callable[[BaseException, int, float], None] | None = None) -> T:
        """Call ``fn`` until it succeeds, retrying transient errors; re-raise the last error.

        Permanent errors are raised at once. A transient error is raised when the attempts
        are used up, or when the next try would start past the deadline.
        ``on_retry(error, attempt, delay)`` runs before each sleep.
        """
        delays = self.delays()
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:  # classified below; anything permanent is re-raised unchanged
                if not is_transient(exc):
                    raise
                delay = next(delays, None)
                if delay is None:
                    raise
                if self.deadline is not None and time.monotonic() - start + delay > self.deadline:
                    raise
                if on_retry is not None:
                    on_retry(exc, attempt, delay)
                time.sleep(delay)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 16:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend([current.__cause__, current.__context__])


def _http_status(exc: BaseException) -> tuple[int | None, str | None]:
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):  # botocore ClientError
        code = (response.get("Error") or {}).get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return (int(status) if isinstance(status, int) else None), (str(code) if code else None)
    for attr in ("status", "code", "status_code"):  # aiohttp, gcsfs HttpError, requests
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value, None
    return None, None


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` (or an error it was raised from) is worth retrying.

    Transient: connection refused/reset, timeouts, HTTP 408/429/5xx and throttling codes,
    and what gcsfs's own retry loop retries (a 502, a checksum mismatch, an expired token).
    Permanent: missing objects or buckets, access denied, and anything unrecognised (an
    unknown error fails fast with a clear message rather than retrying forever).
    """
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    for error in _chain(exc):
        status, code = _http_status(error)
        if code is not None and code in _TRANSIENT_CODES:
            return True
        if status == 401 and "Invalid Credentials" in str(error):
            return True  # GCS: the token expired in flight; the next try sends a refreshed one
        if status is not None:
            return status in _TRANSIENT_STATUS or status >= 500
        names = {cls.__name__ for cls in type(error).__mro__}
        if names & _TRANSIENT_NAMES:
            return True
        if isinstance(error, (ConnectionError, TimeoutError)):
            return True
        if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
            return True
    return False


_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestLimitExceeded",
    "TooManyRequestsException", "rateLimitExceeded", "BandwidthLimitExceeded",
})
_CONNECTION_NAMES = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ClientConnectorError",
    "ServerDisconnectedError", "ClientOSError", "ProxyConnectionError", "RemoteDisconnected",
})


def is_throttle(exc: BaseException) -> bool:
    """True if ``exc`` says to send fewer requests at once: throttling (HTTP 429 or 503, S3's
    ``SlowDown``) or a refused, reset or dropped connection."""
    for error in _chain(exc):
        status, code = _http_status(error)
        if (code is not None and code in _THROTTLE_CODES) or status in (429, 503):
            return True
        if {cls.__name__ for cls in type(error).__mro__} & _CONNECTION_NAMES:
            return True
        if isinstance(error, ConnectionError) or (isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS
                                                  and not isinstance(error, TimeoutError)):
            return True
    return False


_TIMEOUT_NAMES = frozenset({"ReadTimeoutError", "ConnectTimeoutError", "ServerTimeoutError", "FSTimeoutError",
                            "ConnectionTimeoutError", "SocketTimeoutError"})


def is_stall(exc: BaseException) -> bool:
    """True if ``exc`` (or an error it was raised from) is a connect or read timeout."""
    for error in _chain(exc):
        if isinstance(error, TimeoutError) or {cls.__name__ for cls in type(error).__mro__} & _TIMEOUT_NAMES:
            return True
    return False


class ListingFailed(OSError):
    """A folder's listing failed within a glob; the store's error is its ``__cause__`` (which decides
    whether it is retried). Raised by :func:`growcache.store.glob_listing`."""

    def __init__(self, folder: str) -> None:
        super().__init__(f"listing the folder {folder} failed")
        self.folder = folder


def describe_error(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, adding the HTTP status or error code when known."""
    if isinstance(exc, ListingFailed) and exc.__cause__ is not None:
        return (f"{describe_error(exc.__cause__)}, listing the folder {exc.folder}: the glob's matches would be "
                "incomplete")
    status, code = None, None
    for error in _chain(exc):
        status, code = _http_status(error)
        if status or code:
            break
    extra = ", ".join(x for x in (f"HTTP {status}" if status else "", code or "") if x)
    text = f"{type(exc).__name__}: {exc}"
    return f"{text} ({extra})" if extra else text


# storage_options keys whose values are credentials; matched anywhere in the key name.
_SECRET_KEY = re.compile(r"secret|token|password|passwd|key|credential|auth|session|signature|sas|private|cert",
                         re.IGNORECASE)
# Values of secret-looking keys that are modes, not secrets.
_NOT_SECRET = frozenset({"anon", "google_default", "cache", "cloud", "browser", "true", "false", "none", ""})
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
# Below these lengths a secret occurs in messages by chance ("a", "3", "2024"): it is hidden
# only where it stands as a value, never inside other words or numbers.
_ANYWHERE, _ANYWHERE_DIGITS = 4, 6
# A value: after "=" or ":" (spaces and a quote allowed between), or quoted, and ending there.
_AS_VALUE = r"(?P<lead>[=:]\s*['\"]?|['\"])(?:{})(?=['\"&,;)\]}}\s]|$)"


class Redactor:
    """Removes credentials of ``storage_options`` (and URL user info) from any text.

    A secret of 4 characters or more (6 for digits only) is replaced wherever it appears; a
    shorter one only where it stands as a value: after ``=`` or ``:`` (``secret=ab``,
    ``'token': 'ab'``) or quoted, so that a one-letter secret cannot garble a message.

    Args:
        storage_options: the options given to fsspec; the values (strings and numbers) of
            every key that looks like a credential (``key``, ``secret``, ``token``,
            ``password``, ...) are secrets, at any nesting depth.
        urls: URLs whose user info (``user:password@``) is a secret too.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None, urls: Iterable[str] = ()) -> None:
        secrets: set[str] = set()
        _collect(storage_options or {}, False, secrets)
        for url in urls:  # user info in a URL ("https://user:password@host/...") is a credential
            match = _URL_USERINFO.match(url)
            if match:
                userinfo = url[len(match.group("scheme")):match.end() - 1]
                secrets.update(part for part in (userinfo, *userinfo.split(":", 1)[1:]) if part)
        by_length = sorted(secrets, key=len, reverse=True)
        self._secrets = [s for s in by_length if len(s) >= (_ANYWHERE_DIGITS if s.isdigit() else _ANYWHERE)]
        short = [s for s in by_length if s not in self._secrets]
        self._short = re.compile(_AS_VALUE.format("|".join(map(re.escape, short)))) if short else None

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        if self._short is not None:
            text = self._short.sub(r"\g<lead>***", text)
        return _URL_USERINFO.sub(r"\g<scheme>***@", text)

    def options_repr(self, storage_options: Mapping[str, Any] | None) -> str:
        """``storage_options`` as text with every credential shown as ``***``."""
        return self(repr(_masked(storage_options or {}, False)))


def _collect(value: Any, secret: bool, out: set[str]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _collect(item, secret or bool(_SECRET_KEY.search(str(key))), out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, secret, out)
    elif secret and value is not None and not isinstance(value, bool):
        # Numbers too: the CLI parses option values as JSON, so password=81234567 is an int.
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if text.lower() not in _NOT_SECRET:
            out.add(text)


def _masked(value: Any, secret: bool) -> Any:
    if isinstance(value, Mapping):
        return {k: _masked(v, secret or bool(_SECRET_KEY.search(str(k)))) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_masked(v, secret) for v in value)
    if secret and value is not None and not isinstance(value, bool) and str(value).lower() not in _NOT_SECRET:
        return "***"
    return value
