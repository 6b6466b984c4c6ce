"""A snapshot: the shards that exist now, pinned by a lease until it is closed."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Sequence

from . import _proc
from .shard import ShardInfo

__all__ = ["Snapshot"]


def _release(lease_path: str | None, owner_pid: int) -> None:
    # A forked child holds a copy of the object; only the process that took the lease ends it.
    if lease_path and os.getpid() == owner_pid:
        _proc.let_go(lease_path)
        try:
            os.unlink(lease_path)
        except FileNotFoundError:
            pass


class Snapshot(Sequence[ShardInfo]):
    """The immutable list of published shards at one moment, in publish order.

    While the snapshot is open, its lease keeps eviction from deleting any of its shards.
    Close it (or use ``with``) when the epoch is done: that also trims the cache back to its
    budget at once, deleting shards that only this lease kept. It is also released when
    garbage collected (the trim then waits for the next publish or snapshot), and it
    expires by itself if the owning process dies. A pickled snapshot is a plain list of
    shards: the lease never travels to another process.

    Attributes:
        shards: the shards, oldest first.
    """

    def __init__(
        self,
        shards: Sequence[ShardInfo],
        lease_path: str | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.shards: tuple[ShardInfo, ...] = tuple(shards)
        self._lease_path = lease_path
        self._on_close = on_close
        self._owner_pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release, lease_path, self._owner_pid)

    def __getitem__(self, index):  # type: ignore[override]
        return self.shards[index]

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self) -> Iterator[ShardInfo]:
        return iter(self.shards)

    def __repr__(self) -> str:
        state = "leased" if self.leased else "released"
        return f"<Snapshot {len(self)} shards, {self.records} records, {self.nbytes} bytes, {state}>"

    def __reduce__(self):
        return (Snapshot, (self.shards,))

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def records(self) -> int:
        """Records in all shards."""
        return sum(s.records for s in self.shards)

    @property
    def nbytes(self) -> int:
        """Bytes of all shard files."""
        return sum(s.nbytes for s in self.shards)

    @property
    def paths(self) -> list[str]:
        """Shard paths, oldest first."""
        return [s.path for s in self.shards]

    @property
    def leased(self) -> bool:
        """True while this snapshot's lease is held."""
        return self._lease_path is not None and self._finalizer.alive

    def close(self) -> None:
        """Release the lease and trim the cache to its budget; idempotent."""
        if self._finalizer.alive:
            self._finalizer()
            on_close, self._on_close = self._on_close, None
            if on_close is not None and self._lease_path is not None and os.getpid() == self._owner_pid:
                on_close()
