"""Exact mid-epoch resume of make_torch_loader (issue 30): a training process killed with SIGKILL at
a random batch, restarted from its last saved state, delivers the rest of the epoch batch by batch
as the uninterrupted run did, while the cache grew and evicted during the downtime; the epoch's pin
kept its shards. In-process: persistent workers, set_epoch after a load, a second save moving the
pin, pin expiry, a missing shard raised and skipped, a changed layout refused."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

import growcache  # noqa: E402
from conftest import ID_SCHEMA, grow_while_down, write_shards  # noqa: E402
from growcache import Cache, MissingShardsError, make_torch_loader  # noqa: E402

TRAINER = os.path.join(os.path.dirname(__file__), "resume_trainer.py")
# Only the tests folder (conftest): the whole of sys.path put stdlib and the venv ahead of the
# child's own setup, and the child failed to start in a full suite run.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARDS = [37, 50, 23, 41, 60, 13, 29]  # 253 records, 32-33 batches of 8


def _train(tmp_path, **args) -> subprocess.CompletedProcess:
    args = {"cache": str(tmp_path / "cache"), "out": str(tmp_path), **args}
    return subprocess.run([sys.executable, TRAINER, json.dumps(args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": TESTS})


def _log(tmp_path, mode: str) -> list[list[int]]:
    path = tmp_path / f"{mode}.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_killed_run_resumes_batch_by_batch_while_the_cache_grows_and_evicts(tmp_path, workers):
    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, SHARDS)
    first = {s.path for s in cache.list_shards()}
    ref = _train(tmp_path, mode="ref", workers=workers)
    assert ref.returncode == 0, ref.stderr
    expected = _log(tmp_path, "ref")
    rng = random.Random(f"{workers}-{time.time_ns()}")
    kill_at, save_every = rng.randrange(5, len(expected) - 2), rng.choice([2, 3])
    killed = _train(tmp_path, mode="kill", workers=workers, kill_at=kill_at, save_every=save_every)
    assert killed.returncode == -9, killed.stderr
    saved = json.loads((tmp_path / "state.json").read_text())
    before = _log(tmp_path, "kill")
    assert len(before) == kill_at and saved["progress"] == kill_at // save_every * save_every
    # The downtime: the cache grows past its budget and evicts; the killed run's pin keeps the shards
    # the rest of the epoch reads (it let go of those read whole before the last save).
    cache, pinned = grow_while_down(tmp_path / "cache", first)
    stats = cache.stats()
    assert stats.pins == 1 and stats.pinned_bytes == sum(os.path.getsize(p) for p in pinned)
    resumed = _train(tmp_path, mode="resume", workers=workers)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["state"] == 2  # the resumed epoch ended: the next state is epoch 2
    rest = _log(tmp_path, "resume")
    print(f"kill at batch {kill_at}, saved at {saved['progress']} of {len(expected)}")
    assert before[:saved["progress"]] + rest == expected
    assert Cache(tmp_path / "cache").stats().pins == 0  # the resumed epoch's end released the pin


def _ids(batches) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


@pytest.fixture
def grown(id_cache):
    write_shards(id_cache, SHARDS)
    return id_cache


def _reference(cache, epoch=1, **kwargs) -> list[list[int]]:
    with make_torch_loader(cache, 8, shuffle_buffer=20, seed=3, resume_ttl=0, **kwargs) as loader:
        loader.set_epoch(epoch)
        return _ids(loader)


def _cut(cache, taken: int, epoch=1, **kwargs) -> tuple[list[list[int]], dict]:
    loader = make_torch_loader(cache, 8, shuffle_buffer=20, seed=3, **kwargs)
    loader.set_epoch(epoch)
    iterator = iter(loader)
    got = [next(iterator)["id"].tolist() for _ in range(taken)]
    state = json.loads(json.dumps(loader.state_dict()))  # JSON all the way
    del iterator
    loader.close()
    return got, state


def test_persistent_workers_resume_and_set_epoch_of_the_same_epoch_keeps_the_resume(grown):
    expected = _reference(grown, num_workers=2)
    got, state = _cut(grown, 11, num_workers=2)
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=2, persistent_workers=True) as loader:
        loader.load_state_dict(state)
        loader.set_epoch(1)  # a trainer announcing the saved epoch again
        assert got + _ids(loader) == expected
        assert loader.last_epoch.number == 1
        assert len(_ids(loader)) > 0 and loader.last_epoch.number == 2  # then a fresh snapshot, the next epoch


def test_a_state_of_fewer_batches_than_handed_over_resumes_there_also_at_the_epochs_end(grown):
    # A loop that reads ahead of its steps (Lightning's fetcher) asks for the state of the batches
    # it processed: after the epoch's last batch was handed over, one step before the end, that is
    # still the epoch, not the next one.
    expected = _reference(grown, num_workers=0)
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        loader.set_epoch(1)
        iterator = iter(loader)
        got = [next(iterator)["id"].tolist() for _ in range(len(expected))]
        assert loader.state_dict()["epoch"] == 2  # every batch handed over: the next epoch
        state = json.loads(json.dumps(loader.state_dict(consumed=len(expected) - 1)))
        assert (state["epoch"], state["progress"]) == (1, len(expected) - 1) and state["snapshot"]
        assert loader.state_dict(consumed=len(expected) + 5)["epoch"] == 2  # at most those handed over
        for wrong in (-1, 2.0, True, "3"):
            with pytest.raises(ValueError, match="consumed is the batches the training loop took"):
                loader.state_dict(consumed=wrong)
        del iterator
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        loader.load_state_dict(state)
        assert got[:-1] + _ids(loader) == expected


def test_the_same_state_loaded_twice_keeps_its_pin(grown):
    # A trainer's restore, then the user's own load_state_dict: the second released the pin the
    # first had adopted (the same file), and the resumed epoch's shards were left to eviction.
    expected = _reference(grown, num_workers=0)
    got, state = _cut(grown, 9, num_workers=0)
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        loader.load_state_dict(state)
        loader.load_state_dict(state)
        assert [p["name"] for p in grown.pins()] == [state["pin"]["name"]]
        assert got + _ids(loader) == expected
    assert grown.pins() == []


def _slow_first_worker(worker_id: int) -> None:
    if worker_id == 0:
        time.sleep(3)  # a cold disk, a busy core: the other worker's batches overtake its own


def test_batches_taken_out_of_order_resume_exactly(id_cache, caplog):
    # DataLoader(in_order=False): the saved progress was split over the workers as if taken in
    # turn, and the resume never delivered the slow worker's first batches; then it read again
    # those a fast worker had delivered past the slow one's. Each worker's batches are saved now.
    write_shards(id_cache, [24, 24])
    options = dict(num_workers=2, shuffle_buffer=0, in_order=False, persistent_workers=False)
    with make_torch_loader(id_cache, 4, worker_init_fn=_slow_first_worker, **options) as cut:
        before = []
        for step, batch in enumerate(cut, 1):
            before += batch["id"].tolist()
            if step == 4:
                with caplog.at_level(logging.WARNING, logger="growcache.resume"):
                    state = json.loads(json.dumps(cut.state_dict()))
                break
    with make_torch_loader(id_cache, 4, **options) as resumed:
        resumed.load_state_dict(state)
        rest = [i for batch in resumed for i in batch["id"].tolist()]
    assert sorted(before + rest) == list(range(48)), "every record once: none lost, none read again"
    assert state["progress"] == 4 and state["delivered"][0] < state["delivered"][1]  # the slow worker was behind
    assert "out of order" not in caplog.text


def test_set_epoch_to_another_epoch_drops_the_resume_and_its_pin(grown):
    _, state = _cut(grown, 5, num_workers=0)
    assert grown.stats().pins == 1
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        loader.load_state_dict(state)
        loader.set_epoch(4)
        assert _ids(loader) == _reference(grown, epoch=4, num_workers=0)
    assert grown.stats().pins == 0


def test_the_same_loader_reloading_its_state_keeps_the_pin_its_dropped_iterator_kept(grown):
    # The dropped iterator keeps its pin for a resume; the resume adopts the same pin file as another
    # object, and the resumed epoch's start released "the earlier epoch's" kept pin: that very file.
    expected = _reference(grown, num_workers=0)
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        loader.set_epoch(1)
        iterator = iter(loader)
        got = [next(iterator)["id"].tolist() for _ in range(9)]
        state = json.loads(json.dumps(loader.state_dict()))
        iterator.close()  # the loop broke out mid-epoch
        loader.load_state_dict(state)
        rest = []
        for batch in loader:
            rest.append(batch["id"].tolist())
            assert [p["name"] for p in grown.pins()] == [state["pin"]["name"]]
        assert got + rest == expected
    assert grown.pins() == [] and grown.stats().pins == 0  # the resumed epoch's end released it


def test_an_epoch_is_pinned_from_its_first_state_dict_and_a_loader_never_asked_pins_nothing(grown):
    # A pin written at every epoch's start held a killed or abandoned epoch's whole snapshot for
    # resume_ttl (12 hours) even where no state was ever saved: the soak's killed readers kept
    # the cache over its budget. The epoch's own lease holds every shard until the first save.
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        iterator = iter(loader)
        next(iterator)
        assert grown.pins() == []
        del iterator  # abandoned, never asked for its state
    assert grown.pins() == [] and grown.stats().pins == 0
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        assert [p["name"] for p in grown.pins()] == [state["pin"]["name"]]
        del iterator
    assert [p["name"] for p in grown.pins()] == [state["pin"]["name"]]  # kept for the resume


def test_a_second_save_names_the_next_epochs_pin_and_the_first_is_released(grown):
    pins = lambda: {p["name"] for p in grown.pins()}  # noqa: E731
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        iterator = iter(loader)
        next(iterator)
        first = loader.state_dict()["pin"]["name"]
        assert pins() == {first}
        list(iterator)
        assert pins() == set()  # epoch read to its end: released
        iterator = iter(loader)
        next(iterator)
        second = loader.state_dict()
        assert second["pin"]["name"] != first and pins() == {second["pin"]["name"]}
        assert second["pin"]["until"] == pytest.approx(time.time() + growcache.resume.DEFAULT_RESUME_TTL, abs=60)


def test_an_expired_pin_lets_eviction_take_the_shards_and_the_resume_names_them(grown, caplog):
    expected = _reference(grown, num_workers=0)
    got, state = _cut(grown, 13, num_workers=0, resume_ttl=0.5)
    assert grown.stats().pins == 1
    time.sleep(0.6)
    assert grown.stats().pins == 0
    evicted = grown.evict(to=grown.stats().bytes // 2)  # nothing leases them now
    assert evicted
    gone = {os.path.basename(s.path) for s in evicted}
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        with pytest.raises(MissingShardsError) as raised:
            loader.load_state_dict(state)
        assert set(raised.value.names) == gone
        assert raised.value.records == sum(s.records for s in evicted)
        assert f"({raised.value.records} records)" in str(raised.value)
        with caplog.at_level(logging.WARNING, logger="growcache"):
            loader.load_state_dict(state, on_missing="skip")
            rest = _ids(loader)
        assert "finishing the epoch without them" in caplog.text
        lost = {i for s in evicted for i in range(*_id_range(s))}
        delivered = [i for batch in got + rest for i in batch]
        # None lost but the gone shards' records; where a gone shard was in the window the save fell
        # in, that window is delivered whole: at most one window (24 records) again.
        assert len(delivered) - len(set(delivered)) <= 24
        assert set(delivered) | lost >= {i for batch in expected for i in batch}
        assert not set(i for batch in rest for i in batch) & lost
        assert {os.path.basename(n.path) for n in loader.skipped} >= gone - _names_read(got, evicted)


def _id_range(shard) -> tuple[int, int]:
    start = sum(SHARDS[:shard.seq - 1])
    return start, start + shard.records


def _names_read(got, evicted) -> set[str]:
    read = {i for batch in got for i in batch}
    return {os.path.basename(s.path) for s in evicted if set(range(*_id_range(s))) & read}


def test_a_changed_layout_is_refused_naming_the_change(grown):
    _, state = _cut(grown, 4, num_workers=0)
    with make_torch_loader(grown, 16, shuffle_buffer=20, seed=3, num_workers=0) as loader:
        with pytest.raises(ValueError, match=r"batch_size 8 -> 16"):
            loader.load_state_dict(state)
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=4, num_workers=0) as loader:
        with pytest.raises(ValueError, match=r"'seed' is 3"):
            loader.load_state_dict(state)


def test_the_state_of_older_growcache_still_loads(grown):
    with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0, resume_ttl=0) as loader:
        loader.load_state_dict({"epoch": 5})
        assert _ids(loader) == _reference(grown, epoch=5, num_workers=0)
        assert loader.last_epoch.number == 5


@pytest.mark.parametrize("saved, now", [(2, 0), (0, 2), (2, 1)])
def test_another_worker_count_replans_the_rest_every_record_once_with_a_warning(grown, caplog, saved, now):
    expected = _reference(grown, num_workers=saved)
    got, state = _cut(grown, 7, num_workers=saved)
    with caplog.at_level(logging.WARNING, logger="growcache"):
        with make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=now) as loader:
            loader.load_state_dict(state)
            rest = _ids(loader)
            assert loader.last_epoch.number == 1
    assert "re-planned" in caplog.text
    delivered = sorted(i for batch in got + rest for i in batch)
    assert delivered == sorted(i for batch in expected for i in batch)  # every record, once
    assert got == expected[:7]


def test_the_pin_lets_go_of_shards_read_whole_as_the_epoch_goes_on(grown):
    with make_torch_loader(grown, 8, shuffle_buffer=0, seed=3, num_workers=0) as loader:
        iterator = iter(loader)
        sizes = []
        for _ in range(loader.last_epoch.batches() - 1):
            next(iterator)
            loader.state_dict()  # a checkpoint: the pin shrinks to what the rest of the epoch reads
            [pin] = grown.pins()
            sizes.append(len(pin["seqs"]))
        assert sizes[0] == len(SHARDS) and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True)
        state = json.loads(json.dumps(loader.state_dict()))
        [pin] = grown.pins()
        expected_rest = _ids(iterator)
    read = {s.path for s in grown.list_shards() if s.seq not in pin["seqs"]}
    assert len(read) == len(SHARDS) - 1
    for path in read:  # evicted once read: the resume needs none of them
        os.unlink(path)
    with make_torch_loader(grown, 8, shuffle_buffer=0, seed=3, num_workers=0) as loader:
        loader.load_state_dict(state)
        assert _ids(loader) == expected_rest


def test_accelerate_checkpoints_the_loader_and_skip_first_batches_points_to_the_resume(grown, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    import warnings

    warnings.filterwarnings("ignore", module="accelerate")
    expected = _reference(grown, num_workers=0)
    loader = make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0)
    loader.set_epoch(1)
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.register_for_checkpointing(loader)
    iterator = iter(loader)
    got = [next(iterator)["id"].tolist() for _ in range(9)]
    accelerator.save_state(str(tmp_path / "checkpoint"))
    with pytest.raises(growcache.ForeignLoaderError, match=r"load_state_dict\(state\).*Resuming mid-epoch"):
        next(iter(accelerate.skip_first_batches(loader, 9)))
    del iterator
    loader.close()
    resumed = make_torch_loader(grown, 8, shuffle_buffer=20, seed=3, num_workers=0)
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.register_for_checkpointing(resumed)
    accelerator.load_state(str(tmp_path / "checkpoint"))
    assert got + _ids(resumed) == expected
    resumed.close()


@pytest.mark.parametrize("saved, now", [(0, 0), (2, 2), (2, 0)])
@pytest.mark.parametrize("batch, buffer", [(16, 0), (5, 30)])
def test_replan_finishes_the_epoch_over_another_batch_size_and_shuffle_each_record_once(grown, caplog, saved, now,
                                                                                         batch, buffer):
    expected = _reference(grown, num_workers=saved)
    got, state = _cut(grown, 7, num_workers=saved)
    with make_torch_loader(grown, batch, shuffle_buffer=buffer, seed=3, num_workers=now) as loader:
        with pytest.raises(ValueError, match=r"replan=True"):
            loader.load_state_dict(state)
        with caplog.at_level(logging.WARNING, logger="growcache"):
            loader.load_state_dict(state, replan=True)
            rest = _ids(loader)
        assert loader.last_epoch.number == 1 and loader.last_epoch.ended
        assert len(_ids(loader)) and loader.last_epoch.number == 2  # then a fresh snapshot, in the new layout
    assert "replan=True re-plans the rest" in caplog.text
    assert got == expected[:7]
    delivered = sorted(i for b in got + rest for i in b)
    assert delivered == sorted(i for b in expected for i in b)  # every record, once
    assert sum(len(b) == batch for b in rest) >= len(rest) - max(saved, 1)  # full batches but each stream's last
