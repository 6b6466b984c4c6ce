"""The torch loader creates no named semaphore of its own (issue 17: hard kills leak nothing).

Under ``spawn`` and ``forkserver``, ``multiprocessing`` names its semaphores in ``/dev/shm``
(``sem.mp-*``) until its resource tracker removes them, and a kill of the whole process group
(``scancel``, ``docker kill``, an OOM kill of the cgroup) takes the tracker along. DataLoader's
own queues and events are PyTorch's; growcache must add none to them.
"""

from __future__ import annotations

import gc
import os

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader  # noqa: E402

from growcache.adapters.torch_loader import make_torch_loader  # noqa: E402
from conftest import named_semaphores, write_shards  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"),
                                reason="named POSIX semaphores live in /dev/shm on Linux only")


def test_a_loader_with_two_spawned_workers_adds_no_named_semaphore(id_cache):
    write_shards(id_cache, [6] * 4)
    before = named_semaphores()
    plain = DataLoader(list(range(16)), batch_size=4, num_workers=2, multiprocessing_context="spawn")
    epoch = iter(plain)
    next(epoch)
    torchs = named_semaphores() - before
    del epoch, plain
    gc.collect()

    before = named_semaphores()
    loader = make_torch_loader(id_cache, 4, num_workers=2, multiprocessing_context="spawn", persistent_workers=True)
    epoch = iter(loader)
    next(epoch)
    during = named_semaphores() - before
    for _ in epoch:  # a second epoch on the same workers: the plan channel is reused, not renewed
        pass
    for _ in loader:
        pass
    after = named_semaphores() - before
    loader.close()

    assert torchs, "the measurement must see the semaphores of DataLoader's own queues"
    assert len(during) <= len(torchs) and len(after) <= len(torchs), (
        f"a growcache loader with 2 spawned workers has {len(during)} named semaphores open mid-epoch and "
        f"{len(after)} after a second epoch; a plain DataLoader has {len(torchs)}: growcache must add none")
