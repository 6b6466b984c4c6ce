"""The core's epoch (growcache.epoch, growcache.rendezvous) without any framework: groups, options,
agreement through epoch files between real processes, the first rank's lease, stale files."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest

from conftest import ID_SCHEMA, write_shards
from growcache import Cache, EmptyCacheError, EpochSyncError
from growcache import rendezvous as rendezvous_module
from growcache.epoch import EpochOptions, Epochs, Group, node_name, run_id
from growcache.rendezvous import EPOCHS_DIR, FileRendezvous, remove_stale_epoch_files


def test_groups_of_shared_and_node_splits():
    assert Group.of("shared", 3, 4) == Group(3, 4, "shared", 3, 4, 0, 1)
    nodes = ["a", "a", "b", "b", "b"]
    group = Group.of("node", 3, 5, nodes)
    assert (group.rank, group.size, group.name, group.first_world_rank, group.groups) == (1, 3, "node:b", 2, 2)
    assert Group.of("node", 0, 1).size == 1
    with pytest.raises(ValueError, match="node of each"):
        Group.of("node", 0, 2, ["a"])


def test_group_from_launcher_environment(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROWCACHE_NODE", "rack7")
    assert Group.from_env("shared") == Group(5, 8, "shared", 5, 8, 0, 1)
    assert Group.from_env("node") == Group(1, 4, "node:rack7", 5, 8, 4, 2)
    assert node_name() == "rack7"
    monkeypatch.setenv("RANK", "9")
    with pytest.raises(ValueError, match="RANK=9"):
        Group.from_env("shared")


def test_run_id_comes_from_the_argument_or_the_launcher(monkeypatch):
    for name in ("GROWCACHE_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE",
                 "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert run_id() == ""
    monkeypatch.setenv("TF_CONFIG", "not json")
    assert run_id() == ""
    # Two jobs on one cache without a launcher's id read each other's epoch files under one name:
    # what no two live jobs share (their cluster's addresses, their rendezvous port) keeps them apart.
    cluster = {"worker": ["h1:2222", "h2:2222"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    mine = run_id()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"task": {"index": 0, "type": "worker"}, "cluster": cluster}))
    assert run_id() == mine and mine.startswith("tf-")  # every worker of the job: one id
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["h1:2223", "h2:2223"]}}))
    assert run_id() not in ("", mine)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert run_id() == "master-10.0.0.1:29500"
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-h1-123@1")
    assert run_id() == "pmix-prterun-h1-123@1"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert run_id() == "slurm-77."
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "te")
    assert run_id() == "te"
    monkeypatch.setenv("GROWCACHE_RUN_ID", "mine")
    assert run_id() == "mine" and run_id("explicit") == "explicit"


@pytest.mark.parametrize("bad,match", [
    ({"batch_size": 0}, "batch_size"), ({"seed": 1.5}, "seed"), ({"shuffle_buffer": -1}, "shuffle_buffer"),
    ({"on_corrupt": "ignore"}, "on_corrupt"), ({"split": "world"}, "split"), ({"wait_for_shards": -1}, "wait"),
])
def test_options_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        EpochOptions(**{"batch_size": 4, **bad})
    assert EpochOptions(4, seed=None).seed == 0  # None still means the default


def test_one_rank_epoch_leases_plans_and_ends(id_cache):
    written = write_shards(id_cache, [5, 7, 3])
    epochs = Epochs(id_cache, EpochOptions(4), readers=2, world=(0, 1))
    epoch = epochs.start()
    assert epochs.epoch == 1 and id_cache.stats().leases == 1
    shares = [epoch.share(r) for r in range(2)]
    assert sorted(int(i) for s in shares for i in s.shards) == [0, 1, 2]
    assert all(s.quota == -1 and s.cycle.size == 0 for s in shares)  # one rank: no top up
    assert epoch.records() == len(written) and epoch.batches() == epoch.plan.rank_batches(0)
    epoch.end()
    epoch.end()  # idempotent
    assert id_cache.stats().leases == 0 and epochs.open_epochs() == []


def test_empty_cache_waits_then_raises(id_cache):
    with pytest.raises(EmptyCacheError, match="after waiting 0.1 s"):
        Epochs(id_cache, EpochOptions(4, wait_for_shards=0.1), world=(0, 1)).start()


def test_more_than_four_open_epochs_end_the_oldest(id_cache, caplog):
    write_shards(id_cache, [3])
    epochs = Epochs(id_cache, EpochOptions(2), world=(0, 1), abandon_hint=". Do the thing.")
    started = [epochs.start() for _ in range(6)]
    assert [e.ended for e in started] == [True, True, False, False, False, False]
    assert id_cache.stats().leases == 4 and "Do the thing." in caplog.text


def _file_rank(cache_path: str, rank: int, world: int, epochs_to_run: int, out: str, publish: bool) -> None:
    """A rank in a process of its own, without any process group: it agrees through epoch files."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    cache = Cache(cache_path)
    epochs = Epochs(cache, EpochOptions(2, run_id="test"), world=(rank, world))
    seen = []
    for epoch in range(epochs_to_run):
        current = epochs.start()
        seen.append({"epoch": current.number, "seqs": [s.seq for s in current.shards],
                     "shards": [int(i) for i in current.share(0).shards], "batches": current.batches()})
        if publish and rank == 0:
            write_shards(cache, [3], first_id=1000 * (epoch + 1))  # the cache changes between epochs
        current.end()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(seen, f)


def test_ranks_without_a_process_group_agree_through_epoch_files(id_cache, tmp_path):
    write_shards(id_cache, [4, 6, 5, 3])
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_file_rank, args=(id_cache.path, r, 3, 4, str(tmp_path), True)) for r in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    for epoch in range(4):
        runs = [ranks[r][epoch] for r in range(3)]
        assert all(run["seqs"] == runs[0]["seqs"] for run in runs) and runs[0]["epoch"] == epoch
        assert len({run["batches"] for run in runs}) == 1
        owned = [set(run["shards"]) for run in runs]
        assert set().union(*owned) == set(range(len(runs[0]["seqs"])))
        assert sum(map(len, owned)) == len(runs[0]["seqs"])  # whole shards, each on one rank
    assert len(ranks[0][3]["seqs"]) == 7  # the growth reached later epochs
    assert os.listdir(os.path.join(id_cache.path, EPOCHS_DIR)) == [] and id_cache.stats().leases == 0


def test_first_rank_keeps_its_lease_until_every_rank_leased(id_cache, tmp_path):
    write_shards(id_cache, [4, 4])
    leader = Epochs(id_cache, EpochOptions(2, run_id="hold"), world=(0, 2))
    first = leader.start()
    first.end()  # the first rank is done before the other one even started
    assert id_cache.stats().leases == 1
    assert id_cache.evict(to=0) == []  # its shards survive eviction: rank 1 has yet to lease them
    follower = subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, 'tests'); from growcache import Cache; "
        "from growcache.epoch import Epochs, EpochOptions; "
        f"e = Epochs(Cache({id_cache.path!r}), EpochOptions(2, run_id='hold'), world=(1, 2)).start(); "
        "print(sorted(s.seq for s in e.shards)); e.end()")],
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert follower.returncode == 0, follower.stderr
    assert follower.stdout.strip() == str([s.seq for s in first.shards])
    deadline = threading.Event()
    for _ in range(200):  # the keeper thread ends the first rank's lease within a few polls
        if id_cache.stats().leases == 0:
            break
        deadline.wait(0.02)
    assert id_cache.stats().leases == 0


def test_a_rank_without_its_first_rank_fails_clearly(id_cache, monkeypatch):
    write_shards(id_cache, [4])
    monkeypatch.setattr(rendezvous_module, "AGREE_TIMEOUT_S", 0.3)
    epochs = Epochs(id_cache, EpochOptions(2, run_id="alone"), world=(1, 2))
    with pytest.raises(EpochSyncError, match="waited 0 s for epoch 0 .*first rank") as info:
        epochs.start()
    assert os.path.join(id_cache.path, EPOCHS_DIR) in str(info.value) and "GROWCACHE_RUN_ID" in str(info.value)
    assert id_cache.stats().leases == 0


def test_ranks_agreeing_through_files_without_a_run_id_are_warned_once(id_cache, monkeypatch, caplog):
    for name in ("GROWCACHE_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PMIX_NAMESPACE", "MASTER_ADDR",
                 "MASTER_PORT", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    write_shards(id_cache, [4])
    monkeypatch.setattr(rendezvous_module, "AGREE_TIMEOUT_S", 0.2)
    with caplog.at_level("WARNING", logger="growcache"):
        for _ in range(2):
            with pytest.raises(EpochSyncError):
                Epochs(id_cache, EpochOptions(2), world=(1, 2)).start()
    warned = [r for r in caplog.records if "without a run id" in r.getMessage()]
    assert len(warned) == 1 and "GROWCACHE_RUN_ID" in warned[0].getMessage(), caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="growcache"), pytest.raises(EpochSyncError):
        Epochs(id_cache, EpochOptions(2, run_id="mine"), world=(1, 2)).start()
    assert "without a run id" not in caplog.text


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_epoch_files_of_a_crashed_first_rank_are_ignored_and_removed(id_cache, monkeypatch):
    write_shards(id_cache, [4])
    follower = FileRendezvous(id_cache.path, ("run", "shared", 0, 0, 2), 1, 2)
    stale = {"epoch": 0, "seed": 0, "seqs": [1], "names": [], "pid": _dead_pid(), "start_time": None,
             "host": None, "created": 0}
    with open(follower.path(0), "w") as f:
        json.dump(stale, f)
    with open(follower.ack_path(9, 1), "w") as f:
        f.write("{}")
    os.utime(follower.ack_path(9, 1), (0, 0))  # an old acknowledgement nobody waits for
    monkeypatch.setattr(rendezvous_module, "AGREE_TIMEOUT_S", 0.2)
    with pytest.raises(EpochSyncError, match="which is gone"):
        FileRendezvous(id_cache.path, ("run", "shared", 0, 0, 2), 1, 2).share(0, lambda: None)
    assert remove_stale_epoch_files(id_cache.path) == 2
    assert os.listdir(os.path.join(id_cache.path, EPOCHS_DIR)) == []
    with open(follower.path(0), "w") as f:
        json.dump(stale, f)
    Cache(id_cache.path)  # opening a cache removes them like the other temporaries
    assert os.listdir(os.path.join(id_cache.path, EPOCHS_DIR)) == []


def test_ranks_in_one_process_agree_in_memory_whoever_starts_first(id_cache):
    write_shards(id_cache, [4, 6, 2])
    epochs = [Epochs(id_cache, EpochOptions(2), world=(r, 2)) for r in range(2)]
    results: dict[int, list] = {}

    def run(rank: int) -> None:
        got = []
        for _ in range(3):
            epoch = epochs[rank].start()
            got.append(([s.seq for s in epoch.shards], epoch.batches()))
            if rank == 1:  # rank 1 publishes after its starts: rank 0 may start first or second
                write_shards(id_cache, [2], first_id=500 + len(got) * 10)
            epoch.end()
        results[rank] = got

    run(1)  # rank 1 alone takes every epoch first ...
    run(0)  # ... and rank 0, started later, reads exactly what rank 1 took
    assert results[0] == results[1]
    assert not os.path.exists(os.path.join(id_cache.path, EPOCHS_DIR))


_ONE_PIPELINE_OF_TWO = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from growcache import Cache
from growcache.epoch import EpochOptions, Epochs
cache = Cache(sys.argv[1])
pipelines = [Epochs(cache, EpochOptions(2), world=(r, 2)) for r in range(2)]
pipelines[0].start().end()  # the other pipeline of this process never starts the epoch
print("leases", cache.stats().leases, flush=True)
"""


def test_a_process_exits_at_once_when_only_its_own_pipelines_have_yet_to_lease(id_cache):
    # The first rank's lease waits for ranks of other processes at exit; ranks of this process
    # (tf.distribute's input pipelines) can never lease once it exits, so it must not wait for them.
    write_shards(id_cache, [4, 4])
    result = subprocess.run([sys.executable, "-c", _ONE_PIPELINE_OF_TWO, id_cache.path], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["leases", "1"], "held for the other pipeline while the process runs"
    assert "waiting up to" not in result.stderr
    assert os.listdir(os.path.join(id_cache.path, "leases")) == [], "the lease ends with the process"


def test_a_failed_epoch_start_fails_every_rank_and_a_retry_starts_afresh(tmp_path):
    cache = Cache(tmp_path / "c", capacity="1GB", schema=ID_SCHEMA)
    epochs = [Epochs(cache, EpochOptions(2), world=(r, 2)) for r in range(2)]
    for rank in (1, 0):  # rank 1 takes the epoch in memory: the cache is empty
        with pytest.raises(EmptyCacheError):
            epochs[rank].start()
    write_shards(cache, [4, 4])
    started = [epochs[rank].start() for rank in (0, 1)]  # the retry of epoch 0 reads the new shards
    assert [e.number for e in started] == [0, 0] and len(started[0].shards) == len(started[1].shards) == 2
    for epoch in started:
        epoch.end()
