"""make_torch_loader as a DataLoader among the tools that drive one: the DataLoader arguments that
make sense for an iterable dataset are honoured, the others refused with the reason; a
DataLoader that growcache did not build fails at once instead of waiting for a plan; the loader's
sampler passes set_epoch on (Lightning calls it), and its state_dict names the epoch to resume."""

from __future__ import annotations

import functools
import os
import time

import pytest

torch = pytest.importorskip("torch")

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

make_torch_loader = growcache.make_torch_loader


def _note_worker(directory: str, worker_id: int, delay: float = 0.0) -> None:
    """A worker_init_fn: leaves a file naming the worker and its torch seed."""
    with open(os.path.join(directory, f"worker{worker_id}"), "w") as f:
        f.write(str(torch.initial_seed()))
    time.sleep(delay)


def _ids(loader) -> list[int]:
    return sorted(i for batch in loader for i in batch["id"].tolist())


def test_worker_init_fn_generator_and_in_order_are_honoured(id_cache, tmp_path):
    written = write_shards(id_cache, [9, 4, 7, 5])
    seeds = []
    for run in range(3):
        notes = tmp_path / f"run{run}"
        notes.mkdir()
        generator = torch.Generator().manual_seed(11 if run < 2 else 12)
        loader = make_torch_loader(id_cache, 4, num_workers=2, worker_init_fn=functools.partial(_note_worker, str(notes)),
                                   generator=generator, in_order=False, persistent_workers=False)
        assert _ids(loader) == written
        assert sorted(os.listdir(notes)) == ["worker0", "worker1"]
        seeds.append([(notes / f"worker{w}").read_text() for w in range(2)])
    # The generator seeds the workers' torch RNG, as in DataLoader: same generator seed, same seeds.
    assert seeds[0] == seeds[1] != seeds[2]


def test_timeout_is_honoured(id_cache, tmp_path):
    write_shards(id_cache, [8])
    loader = make_torch_loader(id_cache, 4, num_workers=1, timeout=0.2,
                               worker_init_fn=functools.partial(_note_worker, str(tmp_path), delay=1.0))
    with pytest.raises(RuntimeError, match="timed out"):
        next(iter(loader))
    loader.close()
    assert id_cache.stats().leases == 0


def test_pin_memory_device_is_accepted_as_dataloader_takes_it(id_cache):
    written = write_shards(id_cache, [6])
    loader = make_torch_loader(id_cache, 4, num_workers=0, pin_memory_device="cuda")
    assert loader.pin_memory_device == "cuda"
    assert _ids(loader) == written


@pytest.mark.parametrize(("name", "reason"), [
    ("sampler", "plans each epoch itself"),
    ("batch_sampler", "batches are formed in the workers"),
    ("shuffle", "shuffle_buffer"),
    ("collate_fn", "batches are formed in the workers"),
])
def test_arguments_that_cannot_apply_say_why(id_cache, name, reason):
    write_shards(id_cache, [4])
    with pytest.raises(TypeError, match=reason):
        make_torch_loader(id_cache, 4, **{name: None})


@pytest.mark.timeout(60)  # the old failure was a 300 s wait for an epoch plan
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_growcache_did_not_build_fails_at_once(id_cache, workers):
    written = write_shards(id_cache, [8, 8])
    loader = make_torch_loader(id_cache, 4, num_workers=workers)
    # One foreign worker is enough (torch takes 5 s to join each worker that raised).
    foreign = DataLoader(loader.dataset, batch_size=None, num_workers=min(workers, 1))
    with pytest.raises(RuntimeError, match=r"prepare\(model, optimizer\)") as raised:
        next(iter(foreign))
    assert type(raised.value).__name__ == "ForeignLoaderError"  # growcache.ForeignLoaderError, a RuntimeError
    # What Accelerate calls on the dataset of a loader it rebuilt, before it iterates.
    with pytest.raises(RuntimeError, match="set_epoch on growcache's loader") as raised:
        loader.dataset.set_epoch(1)
    assert type(raised.value).__name__ == "ForeignLoaderError"
    assert _ids(loader) == written  # growcache's own loader is unaffected, before and after
    del foreign, raised  # the traceback holds the foreign iterator, and its worker
    assert _ids(loader) == written
    loader.close()


def test_the_sampler_passes_set_epoch_on_and_state_dict_names_the_epoch_to_resume(id_cache):
    write_shards(id_cache, [5, 7, 6, 4])
    loader = make_torch_loader(id_cache, 4, num_workers=0, seed=1)
    assert loader.state_dict()["epoch"] == 0
    loader.sampler.set_epoch(3)  # Lightning sets the epoch on a loader's sampler
    iterator = iter(loader)
    next(iterator)
    assert loader.last_epoch.number == 3
    assert (loader.state_dict()["epoch"], loader.state_dict()["progress"]) == (3, 1)  # mid-epoch: resumed there
    # Lightning announces an epoch after its iterator was made: that must not make epoch 3 repeat.
    loader.sampler.set_epoch(3)
    list(iterator)
    assert loader.state_dict()["epoch"] == 4 and loader.state_dict()["snapshot"] is None
    fresh = make_torch_loader(id_cache, 4, num_workers=0, seed=1)
    fresh.load_state_dict(loader.state_dict())
    list(fresh)
    assert fresh.last_epoch.number == 4
    loader.set_epoch(2)  # not the epoch being read: read it next
    list(loader)
    assert loader.last_epoch.number == 2
