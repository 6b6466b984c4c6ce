"""Eviction policies: pure functions that choose which shards to delete.

A policy never touches the disk and never reads the clock, so it is tested with plain
lists. The cache calls it under its lock and deletes what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from .shard import ShardInfo

__all__ = ["EvictionPolicy", "choose_evictions_fifo"]

EvictionPolicy = Callable[[Sequence[ShardInfo], Collection[int], int, int, float], "list[ShardInfo] | None"]


def choose_evictions_fifo(
    shards: Sequence[ShardInfo],
    leased: Collection[int],
    capacity: int,
    incoming: int = 0,
    now: float = 0.0,
) -> list[ShardInfo] | None:
    """Choose the oldest unleased shards to delete so ``incoming`` more bytes fit.

    Args:
        shards: the published shards, any order.
        leased: sequence numbers held by a live lease; never chosen.
        capacity: the byte budget.
        incoming: bytes about to be published. Default: ``0``.
        now: the current time, for policies that weigh age (FIFO ignores it).

    Returns:
        The shards to delete, oldest first, or ``None`` when no choice of unleased
        shards makes room, so the caller has to wait for a lease to end.
    """
    total = sum(s.nbytes for s in shards) + incoming
    victims: list[ShardInfo] = []
    for shard in sorted(shards):
        if total <= capacity:
            break
        if shard.seq in leased:
            continue
        victims.append(shard)
        total -= shard.nbytes
    return victims if total <= capacity else None
