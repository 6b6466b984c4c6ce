"""``growcache status --watch``: a live view of a cache, refreshed every few seconds.

Fill rate, evictions, leases and the bytes they pin come from the cache's own counters
(:meth:`~growcache.Cache.stats`: right whichever process publishes or evicts), the samplers'
rate, requests in flight and latency from their stats files. On a terminal the view is
redrawn in place; without one (``nohup``, SLURM, CI logs) it is one line per interval.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from typing import Any, TextIO

from ._size import format_size
from .metrics import sampler_reader, sampler_summary

__all__ = ["watch"]


def watch(cache: Any, *, interval: float = 2.0, count: int | None = None, out: TextIO | None = None,
          tty: bool | None = None) -> int:
    """Show ``cache`` every ``interval`` seconds, ``count`` times (default until Ctrl-C); return 0.

    Args:
        cache: an open :class:`~growcache.Cache`.
        interval: seconds between refreshes.
        count: refreshes before returning. Default: ``None`` (until interrupted).
        out: where to write. Default: ``sys.stdout``.
        tty: redraw in place. Default: whether ``out`` is a terminal.
    """
    out = sys.stdout if out is None else out
    tty = out.isatty() if tty is None else tty
    samplers = sampler_reader(cache)
    before: tuple[float, Any] | None = None
    drawn = 0
    shown = 0
    try:
        while count is None or shown < count:
            if shown:
                time.sleep(interval)
            now, stats = time.monotonic(), cache.stats()
            pools = samplers() if samplers is not None else None
            if tty:
                lines = _view(cache.path, stats, before and (now - before[0], before[1]), pools, interval)
                # Up to the first line of the previous view, then clear from there down.
                out.write((f"\x1b[{drawn}F\x1b[J" if drawn else "") + "\n".join(lines) + "\n")
                drawn = len(lines)
            else:
                out.write(_line(stats, before and (now - before[0], before[1]), pools) + "\n")
            out.flush()
            before = (now, stats)
            shown += 1
    except KeyboardInterrupt:  # the way to stop watching
        pass
    return 0


def _now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def _since(stats: Any, previous: tuple[float, Any] | None) -> tuple[str, str]:
    """(fill, evicted) over the last interval; ``-`` before there is one."""
    if previous is None:
        return "-", "-"
    seconds, old = previous
    published = stats.published_bytes - old.published_bytes
    rate = published / seconds if seconds > 0 else 0.0
    fill = f"{format_size(rate)}/s (+{stats.published - old.published} shards, {format_size(published)})"
    evicted = f"{stats.evicted - old.evicted} shards ({format_size(stats.evicted_bytes - old.evicted_bytes)})"
    return fill, evicted


def _view(path: str, stats: Any, previous: tuple[float, Any] | None, pools: Any, interval: float) -> list[str]:
    fill, evicted = _since(stats, previous)
    rows = [
        ("cache", f"{path}   {_now()}   (every {interval:g} s; Ctrl-C to stop)"),
        ("shards", f"{stats.shards} shards, {stats.records} records"),
        ("bytes", f"{format_size(stats.bytes)} of {format_size(stats.capacity)} ({100 * stats.budget_use:.1f}% of "
                  "budget)"),
        ("fill rate", fill),
        ("evicted", f"{evicted} in the last interval" if previous is not None else "-"),
        ("leases", f"{stats.leases} live, pinning {stats.leased_shards} shards ({format_size(stats.leased_bytes)})"),
        ("samplers", sampler_summary(pools).removeprefix("samplers ") or "none running (no fresh stats file)"),
    ]
    width = max(len(k) for k, _ in rows)
    return [f"{key:<{width}}  {value}" for key, value in rows]


def _line(stats: Any, previous: tuple[float, Any] | None, pools: Any) -> str:
    fill, evicted = _since(stats, previous)
    text = (f"{_now()} shards {stats.shards}, {format_size(stats.bytes)} of {format_size(stats.capacity)} "
            f"({100 * stats.budget_use:.1f}%), fill {fill}, evicted {evicted}, leases {stats.leases} pinning "
            f"{format_size(stats.leased_bytes)}")
    summary = sampler_summary(pools)
    return f"{text}; {summary}" if summary else text
