"""Progress of long command-line work: a bar on a terminal, a status line every few seconds elsewhere.

Under nohup, SLURM or a CI log, a tqdm bar is either silent (tqdm turns itself off without
a terminal) or a smear of carriage returns. There, :class:`Progress` writes one plain line
every ``interval`` seconds, and a last one at the end. On a terminal it draws a tqdm bar,
and log lines are routed through tqdm so that they do not break it.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from typing import Any, TextIO

from ._size import format_size

__all__ = ["DEFAULT_INTERVAL", "Progress"]

DEFAULT_INTERVAL = 10.0
_RATE_WINDOW_S = 10.0


class Progress:
    """A count towards an optional total, shown while a block of work runs.

    Use it as a context manager and call :meth:`update` with the running count::

        with Progress("verify", total=nbytes, unit="B") as progress:
            for shard in shards:
                ...
                progress.update(done, "3 corrupt")

    Args:
        desc: what the work is, shown first (``"sample"``).
        total: the count at which the work is done, or ``None`` if open-ended.
        unit: ``"B"`` shows counts and rates as sizes (``"12.5 MB"``, ``"80.1 MB/s"``);
            any other unit is appended to plain counts (``"1200 rec"``).
        interval: seconds between status lines without a terminal. Default: ``10.0``.
        quiet: show nothing. Default: ``False``.
        stream: where to write. Default: ``sys.stderr``.
        last_line: without a terminal, write a last status line at the end. Default: ``True``.
    """

    def __init__(self, desc: str, *, total: float | None = None, unit: str = "", interval: float = DEFAULT_INTERVAL,
                 quiet: bool = False, stream: TextIO | None = None, last_line: bool = True) -> None:
        if not interval > 0:
            raise ValueError(f"the status interval must be positive seconds, got {interval!r}")
        self.desc = desc
        self.total = total
        self.unit = unit
        self.interval = interval
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.last_line = last_line
        self.n = 0.0
        self.postfix = ""
        self._started = time.monotonic()
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        self._lock = threading.Lock()
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        self._ticker: threading.Thread | None = None
        self._done = threading.Event()

    @property
    def tty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        with self._lock:  # the count starts here: one update, at the end of short work, still gives a rate
            self._samples.append((self._started, self.n))
        if self.quiet:
            return self
        if self.tty:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit=self.unit or "it", unit_scale=self.unit == "B",
                             file=self.stream, dynamic_ncols=True)
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm())
        else:
            self._ticker = threading.Thread(target=self._tick, name="growcache-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float, postfix: str | None = None) -> None:
        """Set the running count to ``n`` (and the text shown after it to ``postfix``)."""
        now = time.monotonic()
        with self._lock:
            self.n = n
            if postfix is not None:
                self.postfix = postfix
            self._samples.append((now, n))
            while len(self._samples) > 2 and now - self._samples[0][0] > _RATE_WINDOW_S:
                self._samples.popleft()
        if self._bar is not None:
            if postfix is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(n - self._bar.n)

    def rate(self) -> float:
        """Units per second over the last few seconds (0 before two updates)."""
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def line(self) -> str:
        """The status as one line of text."""
        if self.total:
            done = (f"{self._amount(self.n, bare=self.unit != 'B')} of {self._amount(self.total)} "
                    f"({100 * self.n / self.total:.0f}%)")
        else:
            done = self._amount(self.n)
        elapsed = int(time.monotonic() - self._started)
        parts = [f"{self.desc}: {done}", f"{self._amount(self.rate())}/s", f"{elapsed // 60}:{elapsed % 60:02d} elapsed"]
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def _amount(self, value: float, *, bare: bool = False) -> str:
        if self.unit == "B":
            return format_size(value)
        text = f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"
        return f"{text} {self.unit}" if self.unit and not bare else text

    def _tick(self) -> None:
        while not self._done.wait(self.interval):
            self._write(self.line())

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe must not end the work
            pass

    def close(self) -> None:
        """End the display: close the bar, or write the last status line. Idempotent."""
        if self._done.is_set():
            return
        self._done.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
            if self.last_line:
                self._write(self.line())
