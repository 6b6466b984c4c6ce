"""Epoch planning: which reader reads which whole shards, and how many records it yields.

A pure function of its inputs, so every rank and every worker computes the same plan
from the same snapshot without talking to each other, and tests need no processes.

A *reader* is one ``(rank, worker)`` pair; there are ``world_size * num_workers`` of them
(``num_workers=0`` counts as one reader per rank, the training process itself). Reader
``rank * workers + worker`` belongs to ``rank``.

The plan:

1. Shuffles the snapshot's shards by ``(seed, epoch)``; every rank draws the same order.
2. Splits them as whole shards over all readers, balanced by record count (greedy:
   largest shard first to the reader with the fewest records). Whole shards keep reads
   sequential and make "exactly once" trivial to prove: each shard has one reader.
3. With ``even_batches=True`` and more than one rank, sets each reader's *quota* (the
   records it yields) so that every rank yields the same number of batches, because a
   DDP rank that runs out of batches first leaves the others blocked in an all-reduce.
   Batches are formed inside each reader, so a rank's batch count is the sum of its
   readers' counts. The choice follows ``drop_last``, as ``DistributedSampler`` does:

   * ``drop_last=False`` (**top up**): every rank yields as many batches as the rank
     with the most. A short rank re-reads records from the start of *its own* shards
     (cycling), so ranks stay disjoint; only those top-up records repeat, and only when
     ranks hold unequal record counts. If a rank got no shard at all (fewer shards than
     ranks), it tops up from the whole snapshot and then records do repeat across ranks.
   * ``drop_last=True`` (**drop**): every rank yields as many full batches as the rank
     with the fewest; the rest of the other ranks' records are not read this epoch
     (the newest shards come back in later epochs, in another order).

   A reader that skips a corrupt shard (``on_corrupt="skip"``) makes up its quota from the
   other shards of its rank, never reading the corrupt one again, so that the batch counts
   stay equal. With one rank, or ``even_batches=False``, every reader yields all its records.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "EpochPlan",
    "ReadPoints",
    "consumed_when",
    "plan_epoch",
    "read_points",
    "reader_seed",
    "round_robin_progress",
    "shuffle_seed",
]

_MAX_INDEX = 2**63 - 1


def shuffle_seed(seed: int, epoch: int) -> np.random.Generator:
    """The generator every rank uses to order epoch ``epoch``'s shards."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int(epoch) & 0xFFFFFFFFFFFFFFFF, 0x6763])


def reader_seed(seed: int, epoch: int, reader: int) -> int:
    """The seed of reader ``reader``'s record shuffle in epoch ``epoch`` (both adapters use it)."""
    mask = 0xFFFFFFFFFFFFFFFF  # numpy seeds must be non-negative; a negative user seed is fine
    return int(np.random.default_rng([int(seed) & mask, int(epoch) & mask, int(reader) & mask]).integers(2**62))


@dataclass(frozen=True)
class EpochPlan:
    """What every reader of one epoch reads.

    Attributes:
        epoch: the epoch number.
        world_size: ranks.
        workers: readers per rank (``max(num_workers, 1)``).
        batch_size: records per batch.
        drop_last: whether a reader's final partial batch is dropped.
        shards: per reader, indices into the snapshot's shard list, in reading order.
            ``np.int64`` arrays (they cross into worker processes as arrays).
        quotas: per reader, records it yields. Below its shards' total it stops early
            (drop); above, it cycles through its shards again (top up).
        cycle: per reader, shard indices to cycle through for a top up or to make up for a
            skipped corrupt shard: its own shards, then the other shards of its rank, so that
            a reader whose only shard is corrupt still yields its quota from its rank's records
            (all shards, in epoch order, when its rank has none).
    """

    epoch: int
    world_size: int
    workers: int
    batch_size: int
    drop_last: bool
    shards: tuple[np.ndarray, ...]
    quotas: np.ndarray
    cycle: tuple[np.ndarray, ...]

    def reader(self, rank: int, worker: int) -> int:
        """Index of the reader that is ``worker`` of ``rank``."""
        return rank * self.workers + worker

    def batches(self, reader: int) -> int:
        """Batches reader ``reader`` yields."""
        return _batches(int(self.quotas[reader]), self.batch_size, self.drop_last)

    def rank_batches(self, rank: int) -> int:
        """Batches rank ``rank`` yields over all its readers."""
        return sum(self.batches(self.reader(rank, w)) for w in range(self.workers))

    def rank_records(self, rank: int) -> int:
        """Records rank ``rank`` yields (top-up records included)."""
        return int(sum(self.quotas[self.reader(rank, w)] for w in range(self.workers)))


def _batches(records: int, batch_size: int, drop_last: bool) -> int:
    return records // batch_size if drop_last else -(-records // batch_size)


def plan_epoch(
    shard_records: Sequence[int] | np.ndarray,
    *,
    epoch: int,
    seed: int,
    world_size: int = 1,
    num_workers: int = 0,
    batch_size: int = 1,
    drop_last: bool = False,
    even_batches: bool = True,
    target_batches: int | None = None,
) -> EpochPlan:
    """Plan one epoch for every reader of every rank.

    Args:
        shard_records: records of each snapshot shard, in snapshot order.
        epoch: epoch number; with ``seed`` it fixes the shard order.
        seed: shuffle seed, the same on every rank.
        world_size: number of ranks. Default: ``1``.
        num_workers: loader workers per rank; ``0`` reads in the training process.
            Default: ``0``.
        batch_size: records per batch. Default: ``1``.
        drop_last: drop each reader's final partial batch; with ``even_batches`` it also
            selects "drop" over "top up" (see the module docstring). Default: ``False``.
        even_batches: make every rank yield the same number of batches. Default: ``True``.
        target_batches: with ``even_batches``, the batch count every rank must yield, when
            ranks beyond this plan take part (node-local caches: each node plans its own
            cache, and all nodes agree on one count). It must be at least every rank's own
            count for a top up, at most for a drop. Default: ``None`` (the most, or with
            ``drop_last`` the fewest, of this plan's ranks).

    Returns:
        The :class:`EpochPlan`.

    Raises:
        ValueError: a negative record count, or a non-positive size.
    """
    records = np.asarray(shard_records, dtype=np.int64).reshape(-1)
    if world_size < 1 or num_workers < 0 or batch_size < 1:
        raise ValueError(
            f"world_size ({world_size}) and batch_size ({batch_size}) must be >= 1, num_workers ({num_workers}) >= 0"
        )
    if records.size and records.min() < 0:
        raise ValueError("shard record counts must be >= 0")
    workers = max(num_workers, 1)
    n_readers = world_size * workers

    order = shuffle_seed(seed, epoch).permutation(records.size)
    # Greedy longest-first balancing. The stable sort keeps the shuffled order among equal
    # sizes, so equal shards land on readers in a different order every epoch.
    by_size = order[np.argsort(-records[order], kind="stable")]
    load = np.zeros(n_readers, dtype=np.int64)
    owner = np.empty(records.size, dtype=np.int64)
    # Readers are filled rank-major by load; ties go to the lowest (rank, worker) index
    # within the least-loaded *rank*, so ranks balance first, then workers within a rank.
    for shard in by_size:
        rank_load = load.reshape(world_size, workers).sum(axis=1)
        rank = int(np.argmin(rank_load))
        worker = int(np.argmin(load[rank * workers:(rank + 1) * workers]))
        reader = rank * workers + worker
        owner[shard] = reader
        load[reader] += records[shard]
    # Each reader reads its shards in the epoch's shuffled order (not by size).
    position = np.empty(records.size, dtype=np.int64)
    position[order] = np.arange(records.size)
    shards = []
    for reader in range(n_readers):
        mine = np.flatnonzero(owner == reader)
        shards.append(mine[np.argsort(position[mine], kind="stable")].astype(np.int64))

    quotas = load.copy()
    cycle = list(shards)
    if even_batches and (world_size > 1 or target_batches is not None):
        quotas, cycle = _even_out(shards, quotas, world_size, workers, batch_size, drop_last, order, records,
                                  target_batches)
    return EpochPlan(
        epoch=int(epoch),
        world_size=int(world_size),
        workers=workers,
        batch_size=int(batch_size),
        drop_last=bool(drop_last),
        shards=tuple(shards),
        quotas=np.asarray(quotas, dtype=np.int64),
        cycle=tuple(np.asarray(c, dtype=np.int64) for c in cycle),
    )


def _even_out(
    shards: list[np.ndarray],
    load: np.ndarray,
    world_size: int,
    workers: int,
    batch_size: int,
    drop_last: bool,
    order: np.ndarray,
    records: np.ndarray,
    target_batches: int | None = None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Quotas that give every rank the same batch count (see the module docstring)."""
    quotas = load.copy()
    cycle = _rank_cycles(shards, world_size, workers, order, records)
    per_rank = [
        sum(_batches(int(load[r * workers + w]), batch_size, drop_last) for w in range(workers))
        for r in range(world_size)
    ]
    if drop_last:
        target = min(per_rank) if target_batches is None else int(target_batches)
        if target > min(per_rank):
            raise ValueError(f"target_batches={target} is more than a rank holds ({min(per_rank)}) with drop_last")
        for rank in range(world_size):
            readers = range(rank * workers, (rank + 1) * workers)
            counts = _take_from_fullest([int(load[i]) // batch_size for i in readers], per_rank[rank] - target)
            for i, count in zip(readers, counts):
                quotas[i] = count * batch_size
        return quotas, cycle

    target = max(per_rank) if target_batches is None else int(target_batches)
    if target < max(per_rank):
        raise ValueError(f"target_batches={target} is less than a rank yields ({max(per_rank)}) without drop_last")
    for rank in range(world_size):
        missing = target - per_rank[rank]
        # One more batch per reader in turn: ceil((q + B) / B) == ceil(q / B) + 1, so a step adds
        # one batch and the fewest repeated records (a partial batch stays partial). Computed
        # in closed form: a count comes from the cache directory, so no loop may run once per batch.
        rounds, extra = divmod(missing, workers)
        for j in range(workers):
            quotas[rank * workers + j] += (rounds + (j < extra)) * batch_size
    return quotas, cycle


def _take_from_fullest(counts: list[int], excess: int) -> list[int]:
    """Take ``excess`` units from ``counts``, one at a time from the largest (the lowest index
    among equals), in closed form: the result of that loop without its ``excess`` steps."""
    if excess <= 0:
        return counts
    # The level L every count above it is cut to: the lowest with sum(max(c - L, 0)) <= excess.
    low, high = 0, max(counts)
    while low < high:
        mid = (low + high) // 2
        if sum(max(c - mid, 0) for c in counts) <= excess:
            high = mid
        else:
            low = mid + 1
    level = low
    cut = [min(c, level) for c in counts]
    left = excess - sum(counts) + sum(cut)
    for i, c in enumerate(cut):  # what remains comes one each from the lowest-indexed at the level
        if left and c == level and level > 0:
            cut[i] -= 1
            left -= 1
    return cut


def _rank_cycles(shards: list[np.ndarray], world_size: int, workers: int, order: np.ndarray,
                 records: np.ndarray) -> list[np.ndarray]:
    """Per reader: its own shards, then the rest of its rank's (the whole snapshot in epoch
    order if its rank has no records). A quota is a promise of batches to DDP: a reader whose
    own shards turn out corrupt under ``on_corrupt="skip"`` keeps it from its rank's others,
    where cycling its own would leave its rank short and the other ranks hung in an all-reduce."""
    cycles = []
    for rank in range(world_size):
        readers = range(rank * workers, (rank + 1) * workers)
        for i in readers:
            mine = [shards[i]] + [shards[j] for j in readers if j != i]
            cycle = np.concatenate(mine).astype(np.int64)
            cycles.append(cycle if records[cycle].sum() else order.astype(np.int64))
    return cycles


# -- what the rest of an epoch reads ---------------------------------------------------------------
def round_robin_progress(counts: Sequence[int], consumed: int) -> tuple[list[int], int]:
    """Batches each reader had delivered after ``consumed`` batches taken round-robin (reader 0
    first, readers that ran out left out: a ``DataLoader``'s order over its workers), and the
    reader that delivers next (``0`` once all are done)."""
    counts = [int(c) for c in counts]
    consumed = min(int(consumed), sum(counts))
    low, high = 0, max(counts, default=0)
    while low < high:  # the most whole rounds t with sum(min(c, t)) <= consumed
        mid = (low + high + 1) // 2
        if sum(min(c, mid) for c in counts) <= consumed:
            low = mid
        else:
            high = mid - 1
    done = [min(c, low) for c in counts]
    left = consumed - sum(done)
    going = [w for w, c in enumerate(counts) if c > low]
    for w in going[:left]:
        done[w] += 1
    following = going[left] if left < len(going) else 0
    return done, following


def consumed_when(counts: Sequence[int], worker: int, delivered: int) -> int:
    """The inverse of :func:`round_robin_progress`: the fewest batches consumed round-robin after
    which reader ``worker`` has delivered ``delivered`` batches (more than it yields: never, a
    count above every reader's total)."""
    if delivered <= 0:
        return 0
    if delivered > counts[worker]:
        return sum(counts) + 1
    return sum(min(int(c), delivered - 1) for c in counts) + sum(1 for c in counts[:worker] if c >= delivered) + 1


@dataclass(frozen=True)
class ReadPoints:
    """When each shard of a rank's epoch is read for the last time (see :func:`read_points`).

    Attributes:
        counts: batches each reader of the rank yields.
        points: per reader, ``(delivered, shard)`` pairs, ascending: once the reader delivered
            ``delivered`` batches, it (and a resume from that point) never opens ``shard`` again.
        kept: shards read up to the epoch's end (a top up reads them again).
    """

    counts: tuple[int, ...]
    points: tuple[tuple[tuple[int, int], ...], ...]
    kept: frozenset[int]

    def passed(self, worker: int, delivered: int) -> int:
        """How many of reader ``worker``'s :attr:`points` are passed after ``delivered`` batches."""
        return bisect.bisect_right(self.points[worker], (int(delivered), _MAX_INDEX))

    def left(self, consumed: int) -> set[int]:
        """Shards the rest of the epoch reads after ``consumed`` batches taken round-robin (a resume
        from there included)."""
        return self.left_after(round_robin_progress(self.counts, consumed)[0])

    def left_after(self, delivered: Sequence[int]) -> set[int]:
        """Shards the rest of the epoch reads once each reader delivered ``delivered[reader]``
        batches (taken in any order; a resume from there included)."""
        return {shard for worker, points in enumerate(self.points)
                for _, shard in points[self.passed(worker, delivered[worker]):]} | self.kept

    def batches_to_change(self, delivered: Sequence[int]) -> int:
        """The fewest batches more, taken in any order, after which :meth:`left_after` may hold
        fewer shards than after ``delivered`` (at least 1)."""
        gaps = [points[index][0] - delivered[worker] for worker, points in enumerate(self.points)
                if (index := self.passed(worker, delivered[worker])) < len(points)]
        return max(1, min(gaps, default=2**62))

    def next_change(self, consumed: int) -> int:
        """The fewest batches consumed, more than ``consumed``, after which :meth:`left` may hold
        fewer shards (``sum(counts) + 1``: none)."""
        done, _ = round_robin_progress(self.counts, consumed)
        best = sum(self.counts) + 1
        for worker, points in enumerate(self.points):
            index = self.passed(worker, done[worker])
            if index < len(points):
                best = min(best, consumed_when(self.counts, worker, points[index][0]))
        return best


def read_points(plan: EpochPlan, rank: int, records: Sequence[int], window_batches: int, *, tops_up: bool,
                exact: bool = True) -> ReadPoints:
    """When rank ``rank``'s readers read each shard of the epoch for the last time.

    A reader reads its shards, then (with ``tops_up``) its cycle, until its quota. A resume of
    it after ``d`` delivered batches passes over the whole shuffle windows of ``window_batches``
    batches they fill (:class:`~growcache.batching.BatchReader`) and opens no shard wholly inside
    them, so a shard ending at record ``e`` of the reader's stream is passed once
    ``d >= ceil(e / window rows) * window_batches``; a live reader is ahead of its delivered
    batches, never behind. Shards past a drop's quota are never read; the cycle records a top up
    reads stay to the end. Other ranks' shards are none of this rank's.

    Args:
        exact: the readers skip nothing (no shard corrupt or gone): quotas end the stream where the
            plan says. ``False`` keeps every shard past a quota and a top up's whole cycle (a
            reader making up for a skipped shard reads on into it). Default: ``True``.
    """
    records = [int(r) for r in records]
    rows = max(int(window_batches), 1) * plan.batch_size
    counts, points, kept = [], [], set()
    for worker in range(plan.workers):
        reader = plan.reader(rank, worker)
        counts.append(plan.batches(reader))
        own = sum(records[int(i)] for i in plan.shards[reader])
        quota = int(plan.quotas[reader]) if tops_up else own
        mine, start = [], 0
        for shard in (int(i) for i in plan.shards[reader]):
            end = start + records[shard]
            if exact and start >= quota:
                mine.append((0, shard))  # past a drop's quota: never read
            elif records[shard]:
                mine.append((-(-end // rows) * window_batches, shard))
            else:  # an empty shard is opened unless a resume skips beyond where it stands
                mine.append(((start // rows + 1) * window_batches, shard))
            start = end
        points.append(tuple(sorted(mine)))
        cycle = [int(i) for i in plan.cycle[reader] if records[int(i)]]
        total = sum(records[i] for i in cycle)
        if not tops_up or not cycle:
            continue
        if not exact or quota - own >= total:
            kept.update(cycle)
        elif quota > own:
            position = 0
            for shard in cycle:
                if position < quota - own:
                    kept.add(shard)
                position += records[shard]
    points = [tuple(point for point in mine if point[1] not in kept) for mine in points]
    return ReadPoints(tuple(counts), tuple(points), frozenset(kept))
