"""The DataLoader attributes users and trainers read report what a growcache loader does
(issue 32: ``loader.drop_last`` read ``False`` after ``drop_last=True``, ``batch_size`` ``None``).

DataLoader itself is built with ``batch_size=None`` (the workers form the batches) and without
its own pinning (the loader pins its slabs): those settings stay inside.
"""

from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

from conftest import write_shards  # noqa: E402
from growcache import make_torch_loader  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_attributes_report_the_loaders_batches(id_cache, workers, drop_last):
    write_shards(id_cache, [10, 7])
    kwargs = {"prefetch_factor": 3} if workers else {}
    with make_torch_loader(id_cache, 4, num_workers=workers, drop_last=drop_last, **kwargs) as loader:
        assert (loader.batch_size, loader.drop_last, loader.num_workers) == (4, drop_last, workers)
        assert loader.persistent_workers is bool(workers) and loader.prefetch_factor == (3 if workers else None)
        assert loader.pin_memory is False and loader.timeout == 0
        sizes = [len(batch["id"]) for batch in loader]
        # 10 and 17 records are no multiple of 4: partial batches come unless dropped.
        assert max(sizes) == loader.batch_size and (min(sizes) == loader.batch_size) is loader.drop_last
        # As on any DataLoader, the batching attributes are fixed once it is built.
        for name in ("batch_size", "drop_last"):
            with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
                setattr(loader, name, 1)


def test_pin_memory_without_cuda_reports_unpinned_batches(id_cache):
    if HAS_CUDA:
        pytest.skip("this machine has CUDA: test_pin_memory_reports_pinned_batches_that_torch_does_not_pin_again")
    write_shards(id_cache, [4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no CUDA device is available: batches are not pinned"
        loader = make_torch_loader(id_cache, 2, num_workers=0, pin_memory=True)
    with loader:
        assert loader.pin_memory is False
        assert not any(batch["x"].is_pinned() for batch in loader)


def test_pin_memory_reports_pinned_batches_that_torch_does_not_pin_again(id_cache):
    if not HAS_CUDA:
        reason = f"needs a CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"
        if os.environ.get("GROWCACHE_REQUIRE_CUDA"):
            pytest.fail(f"GROWCACHE_REQUIRE_CUDA is set but this test {reason}")
        pytest.skip(reason)
    write_shards(id_cache, [64] * 4)
    with make_torch_loader(id_cache, 32, num_workers=2, pin_memory=True) as loader:
        assert loader.pin_memory is True
        for batch in loader:
            assert batch["x"].is_pinned()
            # DataLoader's own pin thread would copy every batch once more into memory of its own.
            assert loader._iterator is not None and loader._iterator._pin_memory is False
