"""DDP on a cache that grows and evicts while ranks train (issue 13's growth scenario).

Two gloo ranks train a tiny DDP model for 20 epochs (four posing as two machines with
``split="node"``, for 8) on caches of at most 16 shards, while ``SamplerPool``s publish many shards per
epoch. Every epoch, the ranks of a group must lease the same shards, deliver every record of
them with no record on two ranks, and yield equal batch counts; see ``tests/contract/growth.py``.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tfrecord")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contract"))

import growth  # noqa: E402


def _free_port() -> int:
    """A port number that was free a moment ago, for MASTER_PORT: growcache names the run by it.
    The ranks never listen on it; they meet through a file in the test's directory. Bound by
    rank 0 seconds later, once the spawned ranks have imported torch, the port could be taken
    meanwhile by a test that another pytest worker runs (its servers, its own ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, cache_dirs: list[str], out: str, split: str, per_node: int,
          epochs: int) -> None:
    import torch.distributed as dist

    import growcache

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GROWCACHE_NODE=f"node-{rank // per_node}")
    # growcache names the run by MASTER_ADDR:MASTER_PORT; the ranks meet through a file (see _free_port).
    dist.init_process_group("gloo", init_method=f"file://{out}/gloo-rendezvous", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cache_dir = cache_dirs[rank // per_node]
    loader = growcache.make_torch_loader(cache_dir, growth.BATCH, num_workers=1, split=split, shuffle_buffer=0)
    recorder = growth.Recorder(cache_dir, lambda: loader.last_epoch.shards)

    def batches():
        for batch in loader:
            loss = model(batch["x"]).pow(2).mean()
            opt.zero_grad()
            loss.backward()  # an all-reduce: a rank with fewer batches would hang the others
            opt.step()
            yield batch["id"].numpy()

    for _ in range(epochs):
        recorder.wait_for_growth()
        recorder.epoch(batches())
    recorder.save(os.path.join(out, f"rank{rank}.json"))
    dist.barrier()
    dist.destroy_process_group()


def _train(tmp_path, world: int, nodes: int, split: str, epochs: int = growth.EPOCHS) -> list:
    import json

    import torch.multiprocessing as mp

    with growth.growing_caches([tmp_path / f"node-{n}" for n in range(nodes)]) as caches:
        mp.spawn(_rank, args=(world, _free_port(), [c.path for c in caches], str(tmp_path), split, world // nodes,
                              epochs), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(600)
def test_two_ranks_agree_on_every_epoch_of_a_growing_cache(tmp_path):
    growth.check(_train(tmp_path, world=2, nodes=1, split="shared"), groups=[[0, 1]])


# The 20-epoch scenario runs above; split="node" takes the same path per machine, and 8 epochs
# of a cache that is full and turning over from the first one show its agreement per machine.
@pytest.mark.timeout(600)
def test_four_ranks_on_two_machines_agree_per_machine_with_split_node(tmp_path):
    growth.check(_train(tmp_path, world=4, nodes=2, split="node", epochs=8), groups=[[0, 1], [2, 3]], epochs=8)
