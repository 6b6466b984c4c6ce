"""Exact mid-epoch resume under DDP (issue 30): two gloo ranks with uneven halves (one rank tops
up), stopped mid-epoch after saving each rank's loader state, restarted from those states in new
processes: on every rank, the batches before the save plus the resumed ones equal the
uninterrupted epoch, batch by batch, and ranks stay even (each step is an all-reduce)."""

from __future__ import annotations

import json
import os
import socket

import pytest

torch = pytest.importorskip("torch")

from conftest import ID_SCHEMA, write_shards  # noqa: E402
from growcache import Cache  # noqa: E402

SHARDS = [37, 50, 23, 41, 60, 13, 29]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, cache: str, out: str, mode: str, stop: int) -> None:
    import torch.distributed as dist

    import growcache

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4 * 8, 1))
    loader = growcache.make_torch_loader(cache, 8, num_workers=0, shuffle_buffer=20, seed=3)
    state_path = os.path.join(out, f"state{rank}.json")
    if mode == "resume":
        with open(state_path) as f:
            loader.load_state_dict(json.load(f))
    else:
        loader.set_epoch(1)
    seen = []
    for step, batch in enumerate(loader, 1):
        model(batch["x"].reshape(len(batch["x"]), -1)).sum().backward()  # an all-reduce per step
        seen.append(batch["id"].tolist())
        if step == stop:
            with open(state_path, "w") as f:
                json.dump(loader.state_dict(), f)
            break
    with open(os.path.join(out, f"{mode}{rank}.json"), "w") as f:
        json.dump({"batches": seen, "tops_up": loader.epochs.tops_up}, f)
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path, mode: str, stop: int = -1) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path / "cache"), str(tmp_path), mode, stop), nprocs=2, join=True)
    return [json.loads((tmp_path / f"{mode}{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
def test_two_ranks_resume_mid_epoch_batch_by_batch_with_the_top_up(tmp_path):
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, SHARDS)
    whole = _run(tmp_path, "ref")
    assert whole[0]["tops_up"] and len(whole[0]["batches"]) == len(whole[1]["batches"])
    ids = [i for rank in whole for batch in rank["batches"] for i in batch]
    assert len(ids) > len(set(ids)) == sum(SHARDS)  # one rank topped up, re-reading its own records
    before = _run(tmp_path, "cut", stop=7)
    write_shards(cache, [40, 40], first_id=10_000)  # the cache grows meanwhile
    after = _run(tmp_path, "resume")
    for rank in range(2):
        assert before[rank]["batches"] + after[rank]["batches"] == whole[rank]["batches"], rank
    assert Cache(tmp_path / "cache").stats().pins == 0
