"""Exact mid-epoch resume under DDP (issue 30): two gloo ranks with uneven halves (one rank tops
up), SIGKILLed at a random batch mid-epoch after saving each rank's loader state (or, for the
agreement checks, stopped), restarted from those states in new
processes: on every rank, the batches before the save plus the resumed ones equal the
uninterrupted epoch, batch by batch, and ranks stay even (each step is an all-reduce)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket

import pytest

torch = pytest.importorskip("torch")

from conftest import ID_SCHEMA, write_shards  # noqa: E402
from growcache import Cache  # noqa: E402

SHARDS = [37, 50, 23, 41, 60, 13, 29]


def _free_port() -> int:
    """A port number that was free a moment ago, for MASTER_PORT: growcache names the run by it.
    The ranks meet through a file of this launch instead: bound by rank 0 seconds later, the
    port could be taken meanwhile by a test that another pytest worker runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, cache: str, out: str, mode: str, stop: int, load: list | None = None,
          on_missing: str = "raise", batch_size: int = 8, replan: bool = False) -> None:
    import datetime

    import torch.distributed as dist

    import growcache

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # growcache names the run by these
    # A rank left waiting in an all-reduce fails after this, rather than hang the test. One file per
    # launch (a test launches twice: the cut run and the resume).
    dist.init_process_group("gloo", init_method=f"file://{out}/gloo-rendezvous-{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4 * 8, 1))
    loader = growcache.make_torch_loader(cache, batch_size, num_workers=0, shuffle_buffer=20, seed=3)
    state_path = os.path.join(out, f"state{rank}.json")
    seen, error = [], None
    try:
        if mode == "resume":
            name = f"state{rank}.json" if load is None else load[rank]
            if name is not None:
                with open(os.path.join(out, name)) as f:
                    loader.load_state_dict(json.load(f), on_missing=on_missing, replan=replan or batch_size != 8)
        else:
            loader.set_epoch(1)
        for step, batch in enumerate(loader, 1):
            model(batch["x"].reshape(len(batch["x"]), -1)).sum().backward()  # an all-reduce per step
            seen.append(batch["id"].tolist())
            if mode == "cut" and step <= stop:  # a checkpoint every step, the last one at `stop`
                with open(os.path.join(out, f"state{rank}-{step}.json"), "w") as f:
                    json.dump(loader.state_dict(), f)
            if step == stop:
                with open(state_path, "w") as f:
                    json.dump(loader.state_dict(), f)
                if mode == "kill":  # both ranks saved, then each dies as a preempted job does
                    with open(os.path.join(out, f"{mode}{rank}.json"), "w") as f:
                        json.dump({"batches": seen}, f)
                    dist.barrier()
                    os.kill(os.getpid(), signal.SIGKILL)
                break
    except growcache.EpochSyncError as exc:
        error = str(exc)
    with open(os.path.join(out, f"{mode}{rank}.json"), "w") as f:
        json.dump({"batches": seen, "tops_up": loader.epochs.tops_up, "error": error,
                   "epoch": loader.last_epoch.number if loader.last_epoch else None}, f)
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path, mode: str, stop: int = -1, **kwargs) -> list[dict]:
    import torch.multiprocessing as mp

    try:
        mp.spawn(_rank, args=(2, _free_port(), str(tmp_path / "cache"), str(tmp_path), mode, stop,
                              kwargs.get("load"), kwargs.get("on_missing", "raise"), kwargs.get("batch_size", 8),
                              kwargs.get("replan", False)),
                 nprocs=2, join=True)
    except mp.ProcessExitedException as exc:  # spawn then ends the other rank too
        if mode != "kill" or exc.signal_name != "SIGKILL":
            raise
    else:
        assert mode != "kill", "the ranks were to be killed"
    return [json.loads((tmp_path / f"{mode}{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
def test_two_ranks_resume_mid_epoch_batch_by_batch_with_the_top_up(tmp_path):
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, SHARDS)
    whole = _run(tmp_path, "ref")
    assert whole[0]["tops_up"] and len(whole[0]["batches"]) == len(whole[1]["batches"])
    ids = [i for rank in whole for batch in rank["batches"] for i in batch]
    assert len(ids) > len(set(ids)) == sum(SHARDS)  # one rank topped up, re-reading its own records
    stop = random.Random(os.getpid()).randrange(2, len(whole[0]["batches"]) - 1)
    print(f"both ranks killed after batch {stop} of {len(whole[0]['batches'])}")
    before = _run(tmp_path, "kill", stop=stop)
    assert Cache(tmp_path / "cache").stats().pins == 2  # each killed rank's pin outlives it
    write_shards(cache, [40, 40], first_id=10_000)  # the cache grows meanwhile
    after = _run(tmp_path, "resume")
    for rank in range(2):
        assert before[rank]["batches"] + after[rank]["batches"] == whole[rank]["batches"], rank
    assert Cache(tmp_path / "cache").stats().pins == 0


@pytest.mark.timeout(300)
def test_ranks_agree_on_the_resume_or_all_raise_and_a_gone_shard_keeps_batch_counts_equal(tmp_path):
    from growcache.batching import window_batches
    from growcache.planning import plan_epoch

    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, SHARDS)
    whole, before = _run(tmp_path, "ref"), _run(tmp_path, "cut", stop=7)
    # States of other steps, or a rank that loads none: every rank raises, naming what each resumes.
    for load in (["state0-7.json", "state1-5.json"], ["state0-7.json", None]):
        after = _run(tmp_path, "resume", load=load)
        for rank in range(2):
            assert after[rank]["batches"] == [], (load, rank)
            error = after[rank]["error"] or ""
            assert "cannot resume together" in error and "at batch 7" in error, (load, rank, error)
            assert ("at batch 5" if load[1] else "afresh") in error, (load, rank, error)
    assert Cache(tmp_path / "cache").stats().pins == 2  # kept for a retry with the right states
    # replan=True over batches of 13: equal batch counts (each step an all-reduce), each rank's records
    # not yet consumed once, plus the top up that evens the ranks out.
    after = _run(tmp_path, "resume", batch_size=13)
    assert len(after[0]["batches"]) == len(after[1]["batches"]) > 0 and after[0]["epoch"] == 1
    for rank in range(2):
        rest = [i for b in after[rank]["batches"] for i in b]
        done = {i for b in before[rank]["batches"] for i in b}
        assert set(rest) | done == {i for b in whole[rank]["batches"] for i in b}, rank
        topped = len([i for b in whole[rank]["batches"][7:] for i in b if i in done])  # the planned top up
        assert len(rest) - len(set(rest) - done) <= topped + 13, rank  # and at most a batch to even ranks out
    # replan=True over one process with 2 workers (another world size): the rest of both ranks' streams,
    # each record not yet consumed once (with the saved plan's top up), from either rank's state.
    from collections import Counter

    import growcache

    with growcache.make_torch_loader(cache, 8, num_workers=2, shuffle_buffer=20, seed=3) as loader:
        loader.load_state_dict(json.loads((tmp_path / "state1.json").read_text()), replan=True)
        rest = Counter(i for b in loader for i in b["id"].tolist())
        assert loader.last_epoch.number == 1 and loader.last_epoch.ended
    ids = lambda runs: Counter(i for run in runs for b in run["batches"] for i in b)  # noqa: E731
    assert rest == ids(whole) - ids(before)
    # The shard rank 1 was reading at its save goes: the window its resume re-reads is cut short.
    state = json.loads((tmp_path / "state1.json").read_text())
    names = [name for name, _, _ in state["snapshot"]["shards"]]
    records = [r for _, _, r in state["snapshot"]["shards"]]
    plan = plan_epoch(records, epoch=1, seed=3, world_size=2, num_workers=0, batch_size=8)
    start = state["progress"] // window_batches(20, 8) * window_batches(20, 8) * 8
    for shard in plan.shards[1]:
        start -= records[shard]
        if start < 0:
            break
    gone = names[int(shard)]
    os.unlink(tmp_path / "cache" / "shards" / gone)
    after = _run(tmp_path, "resume", on_missing="skip")
    counts = [len(before[r]["batches"]) + len(after[r]["batches"]) for r in range(2)]
    assert counts == [len(whole[0]["batches"])] * 2, "every rank yields the planned batch count"
    seq = int(gone.split("-")[0])
    assert not {i for b in after[1]["batches"] for i in b} & set(range(sum(SHARDS[:seq - 1]), sum(SHARDS[:seq])))
    assert before[0]["batches"] + after[0]["batches"] == whole[0]["batches"]  # the other rank, as before


def _file_rank(rank: int, cache: str, out: str) -> None:
    """A rank of two without a process group (RANK/WORLD_SIZE only): the ranks agree through epoch
    files in the cache. One reference epoch, one cut at batch 7 saving every step, then resumes
    from the states each scenario names, a fresh loader each (ranks build them in the same order)."""
    import time

    import growcache

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", GROWCACHE_RUN_ID="file-resume")
    os.environ.pop("MASTER_ADDR", None)

    def loader():
        return growcache.make_torch_loader(cache, 8, num_workers=0, shuffle_buffer=20, seed=3)

    result: dict = {}
    with loader() as ref:
        ref.set_epoch(1)
        result["whole"] = [b["id"].tolist() for b in ref]
    with loader() as cut:
        cut.set_epoch(1)
        for step, batch in enumerate(cut, 1):
            result.setdefault("before", []).append(batch["id"].tolist())
            with open(os.path.join(out, f"file{rank}-{step}.json"), "w") as f:
                json.dump(cut.state_dict(), f)
            if step == 7:
                break
    with open(os.path.join(out, f"saved{rank}"), "w") as f:
        f.write("1")
    while not os.path.exists(os.path.join(out, f"saved{1 - rank}")):  # both saved before any resumes
        time.sleep(0.05)
    for name, steps in [("agree", (7, 7)), ("steps", (7, 5)), ("fresh1", (7, None)), ("fresh0", (None, 7))]:
        batches, error, later = [], None, None
        with loader() as resumed:
            try:
                if steps[rank] is None:
                    resumed.set_epoch(1)  # a restarted rank that forgot to load its state
                else:
                    with open(os.path.join(out, f"file{rank}-{steps[rank]}.json")) as f:
                        resumed.load_state_dict(json.load(f))
                batches = [b["id"].tolist() for b in resumed]
            except growcache.EpochSyncError as exc:
                error = str(exc)
            with open(os.path.join(out, f"{name}-done{rank}"), "w") as f:
                f.write("1")
            if rank == 0 and error is None and name != "agree":
                # A first rank that starts afresh does not wait for the others' answers: one that
                # read the epoch hears of the refusal at its next epoch's start.
                while not os.path.exists(os.path.join(out, f"{name}-done1")):
                    time.sleep(0.05)
                try:
                    next(iter(resumed))
                except growcache.EpochSyncError as exc:
                    later = str(exc)
        result[name] = {"batches": batches, "error": error, "later": later}
    if rank == 0:
        # A rank that raised told this one so (its acknowledgement): the epoch files and leases go
        # within polls, not after the agreement timeout (60 s), nor at this process's exit.
        epochs_dir = os.path.join(cache, "epochs")
        for _ in range(200):
            if not os.listdir(epochs_dir) and growcache.Cache(cache).stats().leases == 0:
                break
            time.sleep(0.05)
        result["left"] = [os.listdir(epochs_dir), growcache.Cache(cache).stats().leases]
    with open(os.path.join(out, f"file{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.mark.timeout(300)
def test_ranks_without_a_process_group_check_the_resume_through_epoch_files(tmp_path):
    """Without a process group only the group's first rank writes the epoch file (with its resume
    note): every other rank checks its own note against it, and raises naming both when they
    differ, refusing the epoch in its acknowledgement file. The first rank hears it there: resuming,
    it waits for every rank's answer and raises naming both notes too; starting afresh (it waits
    for no rank), at its epoch's start if the refusal is there already, else at its next epoch's
    start. It lets its epoch file (and lease) go once the others leased or refused."""
    import multiprocessing

    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, SHARDS)
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_file_rank, args=(r, str(tmp_path / "cache"), str(tmp_path))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(240)
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"file{r}.json").read_text()) for r in range(2)]
    for rank, run in enumerate(ranks):
        assert len(run["before"]) == 7 and run["before"] == run["whole"][:7], rank
        # The same step on both: each rank goes on exactly where it stopped.
        assert run["agree"]["error"] is None and run["before"] + run["agree"]["batches"] == run["whole"], rank
    assert len(ranks[0]["whole"]) == len(ranks[1]["whole"]) > 7
    # Rank 1 resumes another step, or none, than the first rank: it raises, naming both.
    for name, mine, first in [("steps", "at batch 5", "at batch 7"), ("fresh1", "afresh", "at batch 7"),
                              ("fresh0", "at batch 7", "afresh")]:
        error = ranks[1][name]["error"] or ""
        assert ranks[1][name]["batches"] == [] and "cannot resume together" in error, (name, error)
        assert mine in error and first in error, (name, error)
        # The first rank hears the refusal: it raises naming both notes, never reading on alone.
        told = ranks[0][name]["error"] or ranks[0][name]["later"] or ""
        assert "refused the first rank's epoch file" in told and mine in told and first in told, (name, told)
    for name in ("steps", "fresh1"):  # resuming, it waits for rank 1's answer: it reads nothing
        assert ranks[0][name]["error"] and ranks[0][name]["batches"] == [], name
    if ranks[0]["fresh0"]["error"] is None:  # it read its fresh epoch before it heard of the refusal
        assert ranks[0]["fresh0"]["batches"] == ranks[0]["whole"]
    assert ranks[0]["left"] == [[], 0]  # the first rank let go: rank 1 acknowledged even as it raised


@pytest.mark.timeout(300)
def test_a_state_saved_by_one_process_is_finished_by_two_ranks_with_replan(tmp_path):
    """replan=True from one process (2 workers) to 2 gloo ranks: both ranks load the one state;
    together they deliver every record the process had not consumed, none it had, in equal
    batch counts (each step an all-reduce), duplicates only from the top up that evens them."""
    from collections import Counter

    import growcache

    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, SHARDS)
    with growcache.make_torch_loader(cache, 8, num_workers=2, shuffle_buffer=20, seed=3) as loader:
        loader.set_epoch(1)
        whole = Counter(i for b in loader for i in b["id"].tolist())
    assert sorted(whole) == list(range(sum(SHARDS))) and set(whole.values()) == {1}
    with growcache.make_torch_loader(cache, 8, num_workers=2, shuffle_buffer=20, seed=3) as loader:
        loader.set_epoch(1)
        before = Counter()
        for step, batch in enumerate(loader, 1):
            before.update(batch["id"].tolist())
            if step == 9:
                (tmp_path / "single.json").write_text(json.dumps(loader.state_dict()))
                break
    after = _run(tmp_path, "resume", load=["single.json", "single.json"], replan=True)
    assert len(after[0]["batches"]) == len(after[1]["batches"]) > 0 and after[0]["epoch"] == 1
    rest = Counter(i for run in after for b in run["batches"] for i in b)
    assert set(rest) == set(whole) - set(before), "every record not yet consumed, and only those"
    assert sum(rest.values()) - len(rest) < 2 * 8, "duplicates: at most the top up evening out the ranks"
    ranks = [{i for b in run["batches"] for i in b} for run in after]
    assert len(ranks[0] & ranks[1]) <= 8 < min(map(len, ranks)), "the ranks split the rest, but for the top up"
