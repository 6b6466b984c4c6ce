"""Run by tests/integrations/test_accelerate.py under torchrun (2 CPU ranks, gloo).

1. The recipe: ``accelerator.prepare(model, optimizer)`` and growcache's own loader, 3 epochs on
   a cache that rank 0 grows after each epoch; each rank writes its ids and batch counts.
2. ``prepare(..., loader)`` with ``dispatch_batches=False``: every rank iterates a rebuilt loader
   and must get growcache's error at once; each rank writes the message.
3. A mid-epoch checkpoint with docs/pytorch.md's recipe for several processes:
   ``accelerator.save_state`` and each rank's own ``loader.state_dict()``; a new loader on each
   rank finishes the epoch from it. ``register_for_checkpointing`` saves the main process's
   loader state only: each rank writes what another rank's loader does with it.
4. ``prepare(..., loader)`` with Accelerate's default for iterable datasets (rank 0 reads and
   dispatches): rank 0's error is left uncaught, as in a user's script, and must end the run.

Usage: torchrun --nproc_per_node 2 accelerate_ddp.py CACHE_DIR OUT_DIR SHARD_RECORDS
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings

import accelerate
import torch
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import growcache  # noqa: E402
from conftest import write_shards  # noqa: E402


def _save(accelerator, loader, directory: str) -> None:
    """docs/pytorch.md's save: Accelerate's state, and this rank's own loader state beside it."""
    accelerator.save_state(directory)
    os.makedirs(directory, exist_ok=True)  # save_state makes it on the main process only
    with open(os.path.join(directory, f"loader-{accelerator.process_index}.json"), "w") as f:
        json.dump(loader.state_dict(), f)


def _load(accelerator, loader, directory: str) -> None:
    accelerator.load_state(directory)
    with open(os.path.join(directory, f"loader-{accelerator.process_index}.json")) as f:
        loader.load_state_dict(json.load(f))  # the next iter(loader) finishes the saved epoch


def _resume(cache, out: str) -> dict:
    def loader():
        loader = growcache.make_torch_loader(cache, 4, num_workers=1, seed=7, shuffle_buffer=8)
        loader.set_epoch(5)
        return loader

    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(32, 1))
    with loader() as reference:
        whole = [b["id"].tolist() for b in reference]
    first = loader()
    iterator = iter(first)
    before = [next(iterator)["id"].tolist() for _ in range(3)]
    _save(accelerator, first, os.path.join(out, "checkpoint"))
    registered = accelerate.Accelerator(cpu=True)
    registered.register_for_checkpointing(first)
    registered.save_state(os.path.join(out, "registered"))
    del iterator
    first.close()
    accelerator.wait_for_everyone()

    # A new run: each rank's loader resumes from its own state.
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(32, 1))  # restored by load_state
    resumed = loader()
    _load(accelerator, resumed, os.path.join(out, "checkpoint"))
    after = [b["id"].tolist() for b in resumed]
    resumed.close()
    # register_for_checkpointing's custom_checkpoint_0.pkl holds the main process's state only.
    probe, registered = loader(), accelerate.Accelerator(cpu=True)
    registered.register_for_checkpointing(probe)
    try:
        registered.load_state(os.path.join(out, "registered"))
        foreign = None
    except ValueError as exc:
        foreign = str(exc)
    probe.close()
    return {"whole": whole, "before": before, "after": after, "registered_load": foreign}


def main() -> None:
    cache_dir, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
    warnings.filterwarnings("ignore")
    # A short collective timeout: if rank 0's failure did not end the run, rank 1 fails soon anyway.
    accelerator = accelerate.Accelerator(
        cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))])
    cache = growcache.Cache(cache_dir)
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = growcache.make_torch_loader(cache, 4, num_workers=1, seed=7, device=accelerator.device)
    record = {"epochs": [], "undispatched": None}
    for epoch in range(3):
        ids, batches = [], 0
        for batch in loader:
            loss = model(batch["x"].reshape(len(batch["x"]), -1)).pow(2).mean()
            accelerator.backward(loss)  # an all-reduce: uneven batch counts would hang here
            optimizer.step()
            optimizer.zero_grad()
            ids += batch["id"].tolist()
            batches += 1
        record["epochs"].append({"ids": ids, "batches": batches})
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_shards(cache, [shard], first_id=1000 * (epoch + 1))

    undispatched = accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    prepared = undispatched.prepare(growcache.make_torch_loader(cache, 4, num_workers=1))
    try:
        next(iter(prepared))
    except RuntimeError as exc:
        record["undispatched"] = str(exc)
    record["resume"] = _resume(cache, out)
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    accelerator.wait_for_everyone()

    dispatched = accelerate.Accelerator(cpu=True)
    prepared = dispatched.prepare(growcache.make_torch_loader(cache, 4, num_workers=1))
    for _batch in prepared:  # rank 0 raises here; rank 1 waits for rank 0's batches
        pass


if __name__ == "__main__":
    main()
