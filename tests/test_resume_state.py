"""The resume state and pins of growcache.resume, without a framework (issue 30): every field of a
state is checked and a damaged or hostile one is refused naming the field; a cache gets an id; pins
are leases that outlive their writer until an absolute expiry, checked on read like every lease."""

from __future__ import annotations

import copy
import json
import os
import time

import pytest

from conftest import ID_SCHEMA, write_shards
from growcache import Cache, MissingShardsError
from growcache.epoch import EpochOptions, Epochs, trainer_epoch
from growcache.resume import check_state, load_state, loader_state, split_progress


@pytest.fixture
def epochs(id_cache):
    write_shards(id_cache, [9, 4, 7])
    return Epochs(id_cache, EpochOptions(4, shuffle_buffer=0))


@pytest.fixture
def state(epochs):
    epoch = epochs.start()
    epoch.consumed = 2
    saved = json.loads(json.dumps(loader_state(epochs, epoch)))
    epoch.end()
    return saved


def test_a_state_is_small_plain_json_naming_the_cache_snapshot_plan_and_progress(epochs, state):
    assert state["version"] == 1 and state["epoch"] == 0 and state["seed"] == 0 and state["progress"] == 2
    assert state["cache_id"] == epochs.cache.cache_id and len(state["cache_id"]) == 32
    assert [s[2] for s in state["snapshot"]["shards"]] == [9, 4, 7]
    assert state["plan"] == {"world_size": 1, "rank": 0, "group_size": 1, "group_rank": 0, "split": "shared",
                             "even_batches": True, "workers": 1, "batch_size": 4, "shuffle_buffer": 0,
                             "drop_last": False, "reader": "growcache"}
    assert check_state(state) == state


def _with(state, path, value):
    hostile = copy.deepcopy(state)
    *parents, last = path
    target = hostile
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return hostile


@pytest.mark.parametrize("path, value, field", [
    (("epoch",), -1, "'epoch'"),
    (("epoch",), 3.9, "'epoch'"),
    (("epoch",), True, "'epoch'"),
    (("epoch",), 2**70, "'epoch'"),
    (("seed",), "0", "'seed'"),
    (("version",), 3, "'version'"),
    (("delivered",), [2], "unknown fields"),  # a version 1 state names no reader's batches
    (("format",), "torchdata", "'format'"),
    (("progress",), -3, "'progress'"),
    (("cache_id",), "../../x", "'cache_id'"),
    (("plan", "workers"), 0, "'plan.workers'"),
    (("plan", "workers"), 2**40, "'plan.workers'"),  # planned reader by reader: a MemoryError, or minutes
    (("plan", "group_size"), 10**6, "'plan.group_size'"),
    (("plan", "batch_size"), False, "'plan.batch_size'"),
    (("plan", "split"), "everyone", "'plan.split'"),
    (("plan", "drop_last"), 0, "'plan.drop_last'"),
    (("plan", "rank"), 5, "'plan'"),
    (("plan", "extra"), 1, "'plan'"),
    (("plan", "reader"), "pytorch", "'plan.reader'"),
    (("plan", "reader"), None, "'plan.reader'"),
    (("snapshot", "shards", 0, 0), "../../../etc/passwd", r"'snapshot.shards\[0\]'"),
    (("snapshot", "shards", 0, 2), 10**6, r"'snapshot.shards\[0\]'"),
    (("snapshot", "shards"), [], "'snapshot.shards'"),
    (("snapshot", "skipped"), ["000000000099-1r-100b.tfrecord"], "'snapshot.skipped'"),
    (("pin",), {"name": "../../growcache.json", "until": 1.0}, "'pin'"),
    (("pin",), {"name": "pin-" + "0" * 32 + ".json", "until": float("nan")}, "'pin'"),
    (("surprise",), 1, "unknown fields"),
    (("plan",), KeyError, "lacks fields"),
])
def test_a_damaged_or_hostile_state_is_refused_naming_the_field(epochs, state, path, value, field):
    with pytest.raises(ValueError, match=field):
        load_state(epochs, _with(state, path, value))
    assert epochs.resume is None


@pytest.mark.parametrize("delivered", [[1], [3], [-1, 3], [True, 1], [1.0, 1], "2", [1, 1, 0], "between epochs"])
def test_a_damaged_count_per_reader_is_refused_naming_the_field(epochs, state, delivered):
    hostile = dict(copy.deepcopy(state), version=2, delivered=delivered)
    hostile["plan"]["workers"] = 2
    if delivered == "between epochs":  # no snapshot: no reader's batches to name
        hostile = dict(hostile, snapshot=None, plan=None, progress=0, pin=None, delivered=[0, 0])
    with pytest.raises(ValueError, match="'delivered'"):
        load_state(epochs, hostile)
    assert epochs.resume is None


def test_a_count_per_reader_beyond_that_readers_batches_is_refused(epochs, state):
    # Adding up to the progress, it was clamped at the resume to the reader's batches: the epoch
    # counted batches its readers never give (a DDP rank then runs out before the others).
    hostile = dict(copy.deepcopy(state), version=2, progress=4, delivered=[4, 0])
    hostile["plan"]["workers"] = 2  # readers of 9 and of 4 + 7 records: 3 batches of 4 each
    with pytest.raises(ValueError, match=r"'delivered' is \[4, 0\].*\(\[3, 3\]\)"):
        load_state(epochs, hostile)
    assert epochs.resume is None
    load_state(epochs, dict(hostile, progress=3, delivered=[3, 0]))  # every batch of one reader
    assert epochs.resume is not None


def test_a_saved_shard_larger_than_the_cache_is_refused_not_replayed(epochs, state):
    # Passed whole by the saved progress, a shard gone from the cache is not needed, but the
    # resume replays one shuffle draw per window before its point: 10**13 records stalled it.
    records, nbytes = 10**13, 10**18 - 1
    hostile = copy.deepcopy(state)
    hostile["snapshot"]["shards"].append([f"000000000777-{records}r-{nbytes}b.tfrecord", nbytes, records])
    hostile["progress"] = 10**12
    with pytest.raises(ValueError, match=r"'snapshot.shards\[3\]' .* more than the whole capacity of cache"):
        load_state(epochs, hostile)
    assert epochs.resume is None


@pytest.mark.parametrize("hostile", [{}, [], None, "state", {"epoch": -1}, {"epoch": 3.9}, {"epoch": True},
                                     {"epoch": "3"}])
def test_old_style_and_empty_states_are_checked_too(epochs, hostile):
    with pytest.raises(ValueError):
        load_state(epochs, hostile)


def test_the_old_state_still_loads(epochs):
    load_state(epochs, {"epoch": 7})
    assert epochs.epoch == 7 and epochs.resume is None


def test_a_state_resumes_only_in_its_kind_of_reader(epochs, state):
    # TensorFlow's TFRecordDataset replay delivers another order than growcache's readers: a state
    # of one kind finishing the epoch in the other would silently read a third order.
    with pytest.raises(ValueError, match="'plan.reader' is 'growcache', but this pipeline reads with 'tensorflow'"):
        load_state(epochs, state, reader="tensorflow")
    assert epochs.resume is None
    replayed = _with(state, ("plan", "reader"), "tensorflow")
    with pytest.raises(ValueError, match="'plan.reader' is 'tensorflow', but this pipeline reads with 'growcache'"):
        load_state(epochs, replayed)
    load_state(epochs, replayed, reader="tensorflow")
    assert epochs.resume is not None and epochs.resume.state["plan"]["reader"] == "tensorflow"
    # Between epochs a state names no order yet: any reader starts the next epoch from it.
    load_state(epochs, {**state, "snapshot": None, "progress": 0, "pin": None}, reader="tensorflow")
    assert epochs.resume is None and epochs.epoch == 0


def test_a_state_saved_before_plan_reader_is_growcaches(epochs, state):
    older = _with(state, ("plan", "reader"), KeyError)
    assert check_state(older)["plan"]["reader"] == "growcache"
    with pytest.raises(ValueError, match="'plan.reader'"):
        load_state(epochs, older, reader="tensorflow")
    load_state(epochs, older)
    assert epochs.resume is not None and epochs.resume.state["progress"] == 2


def test_a_loaded_state_resumes_inside_trainer_epoch_and_a_second_start_joins_it(epochs, state):
    # fit_growing runs every epoch inside trainer_epoch: the saved epoch's first start there must be
    # the resume, not a fresh snapshot read from batch 0.
    load_state(epochs, state)
    with trainer_epoch(0):
        resumed = epochs.start()
        assert resumed.consumed == 2 and resumed.loaded_state is not None and epochs.resume is None
        assert epochs.start() is resumed  # Keras' extra iterator of the same epoch joins it
        epochs.leave(resumed.token, False)
        epochs.leave(resumed.token, False)
    assert resumed.ended


def test_another_caches_state_is_refused(epochs, state, tmp_path):
    other = Cache(tmp_path / "other", capacity="1GB", schema=ID_SCHEMA)
    write_shards(other, [9, 4, 7])  # the same names and sizes: only the id tells them apart
    with pytest.raises(ValueError, match="'cache_id'.*another cache"):
        load_state(Epochs(other, EpochOptions(4, shuffle_buffer=0)), state)


def test_an_old_cache_gets_an_id_at_its_first_writable_open(tmp_path):
    cache = Cache(tmp_path / "c", schema=ID_SCHEMA)
    path = tmp_path / "c" / "growcache.json"
    metadata = json.loads(path.read_text())
    del metadata["cache_id"]
    path.write_text(json.dumps(metadata))
    again = Cache(tmp_path / "c")
    assert again.cache_id and again.cache_id != cache.cache_id
    assert Cache(tmp_path / "c").cache_id == again.cache_id
    metadata["cache_id"] = 42
    path.write_text(json.dumps(metadata))
    with pytest.raises(ValueError, match="cache_id"):
        Cache(tmp_path / "c")


def _round_robin(counts, consumed):
    """What a DataLoader's in-order workers deliver: one batch each in turn, skipping those done."""
    done, left, worker, order = [0] * len(counts), list(counts), 0, []
    while len(order) < consumed:
        if left[worker]:
            order.append(worker)
            done[worker] += 1
            left[worker] -= 1
        worker = (worker + 1) % len(counts)
    following = next((w % len(counts) for w in range(worker, worker + len(counts)) if left[w % len(counts)]), 0)
    return done, following


@pytest.mark.parametrize("counts", [[5], [3, 3], [4, 1, 6], [0, 2, 9], [7, 7, 2, 5]])
def test_split_progress_is_a_dataloaders_round_robin(counts):
    for consumed in range(sum(counts) + 1):
        assert split_progress(counts, consumed) == _round_robin(counts, consumed), consumed


def test_a_pin_outlives_its_writer_until_its_expiry_and_eviction_respects_it(id_cache):
    write_shards(id_cache, [5, 5, 5])
    shards = id_cache.list_shards()
    name = id_cache.pin([shards[0].seq], until=time.time() + 0.5, holder="test", run="r1")
    stats = id_cache.stats()
    assert (stats.pins, stats.pinned_shards, stats.pinned_bytes, stats.leases) == (1, 1, shards[0].nbytes, 0)
    assert [p["name"] for p in id_cache.pins()] == [name] and id_cache.pins()[0]["run"] == "r1"
    assert shards[0] not in id_cache.evict(to=0)
    assert os.path.exists(shards[0].path)
    time.sleep(0.6)
    assert id_cache.pins() == [] and id_cache.read_pin(name) is None
    assert shards[0] in id_cache.evict(to=0)


@pytest.mark.parametrize("field, value", [("until", "tomorrow"), ("until", True), ("until", 1e300),
                                          ("run", 7), ("seqs", ["1"])])
def test_a_damaged_pin_is_treated_as_expired(id_cache, field, value):
    write_shards(id_cache, [5])
    name = id_cache.pin([id_cache.list_shards()[0].seq], until=time.time() + 3600)
    path = os.path.join(id_cache.path, "leases", name)
    with open(path) as f:
        pin = json.load(f)
    pin[field] = value
    with open(path, "w") as f:
        json.dump(pin, f)
    assert id_cache.pins() == [] and id_cache.read_pin(name) is None
    assert id_cache.evict(to=0)


def test_a_linked_pin_is_not_followed_and_pin_names_are_checked(id_cache, tmp_path):
    write_shards(id_cache, [5])
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"pid": 1, "start_time": 0, "seqs": [1], "until": time.time() + 3600}))
    name = "pin-" + "a" * 32 + ".json"
    os.symlink(outside, os.path.join(id_cache.path, "leases", name))
    assert id_cache.pins() == [] and id_cache.read_pin(name) is None
    for bad in ("../growcache.json", "pin-x.json", "pin-" + "a" * 32 + ".json/../../x"):
        with pytest.raises(ValueError):
            id_cache.read_pin(bad)
        with pytest.raises(ValueError):
            id_cache.unpin(bad)


def test_status_shows_the_pins_and_prune_drops_a_named_one(id_cache, capsys):
    from growcache.cli import main

    write_shards(id_cache, [5, 5])
    seqs = [s.seq for s in id_cache.list_shards()]
    kept = id_cache.pin(seqs[:1], until=time.time() + 3600, holder="torch loader pid 1 epoch 3", run="job-7")
    dropped = id_cache.pin(seqs[1:], until=time.time() + 3600, holder="another", run="job-8")
    assert main(["status", id_cache.path]) == 0
    out = capsys.readouterr().out
    assert "2 resume pins, holding 2 shards" in out
    assert f"{kept}: torch loader pid 1 epoch 3, run job-7, 1 shards, until" in out
    assert main(["prune", id_cache.path, "--to", "1", "--unpin", dropped]) == 0
    assert f"dropped pin {dropped}" in capsys.readouterr().out
    assert [s.seq for s in id_cache.list_shards()] == seqs[:1]  # the kept pin held its shard through --to 0
    assert main(["prune", id_cache.path, "--unpin", "../growcache.json"]) == 2
    assert main(["prune", id_cache.path, "--to", "1", "--unpin", "all"]) == 0
    assert id_cache.list_shards() == [] and id_cache.pins() == []


def test_prune_unpin_all_drops_a_lease_with_an_until_under_another_name(id_cache, capsys):
    from growcache import _proc
    from growcache.cli import main

    write_shards(id_cache, [5])
    seq = id_cache.list_shards()[0].seq
    path = os.path.join(id_cache.path, "leases", "1-abc.json")  # not written by growcache: no pin- name
    with open(path, "w") as f:
        json.dump({"pid": 1, "start_time": 1, "host": _proc.this_host(), "created": time.time(), "holder": "x",
                   "seqs": [seq], "until": time.time() + 3600}, f)
    assert [p["name"] for p in id_cache.pins()] == ["1-abc.json"]  # it pins its shard as a pin does
    assert main(["prune", id_cache.path, "--to", "1", "--unpin", "all"]) == 0
    assert "dropped pin 1-abc.json" in capsys.readouterr().out
    assert not os.path.exists(path) and id_cache.pins() == [] and id_cache.list_shards() == []


def test_a_state_before_the_first_epoch_leaves_the_group_unresolved(id_cache):
    write_shards(id_cache, [3])
    epochs = Epochs(id_cache, EpochOptions(4), world=lambda: (0, 1))
    state = json.loads(json.dumps(loader_state(epochs, None)))
    assert state["plan"] is None and state["snapshot"] is None and epochs._group is None
    assert check_state(state)["epoch"] == 0
    load_state(epochs, state)
    with pytest.raises(ValueError, match="'progress'"):
        load_state(epochs, dict(state, progress=3))


@pytest.mark.parametrize("batch, buffer, drop_last", [(4, 10, False), (3, 0, False), (5, 12, True)])
def test_delivered_records_replays_the_readers_shuffle_and_last_window(id_cache, batch, buffer, drop_last):
    # What a resume re-planned over another batch size knows of a saved reader: the records its
    # first d batches held, found without reading. Checked against a real reader's batches, every d,
    # the last (partial, compacted) shuffle window included.
    import numpy as np

    from growcache.batching import BatchReader, ReaderShare, delivered_records

    ids = write_shards(id_cache, [9, 4, 7, 11])
    shards = id_cache.list_shards()
    share = ReaderShare(np.array([os.fsencode(s.path) for s in shards]), np.array([s.records for s in shards]),
                        np.arange(len(shards)), shuffle_seed=77)
    reader = BatchReader(ID_SCHEMA, batch, shuffle_buffer=buffer, drop_last=drop_last)
    allocate = lambda rows: (None, {k: np.zeros((rows, *v.shape), v.dtype) for k, v in ID_SCHEMA.items()})  # noqa: E731
    batches = [arrays["id"][:rows].reshape(-1).tolist() for _, arrays, rows in reader.batches(share, allocate)]
    for d in range(len(batches) + 1):
        skip, positions = delivered_records(77, len(ids), d, batch, buffer, drop_last)
        assert set(ids[:skip]) | {ids[p] for p in positions} == {i for b in batches[:d] for i in b}, d


@pytest.mark.parametrize("damaged", ["{", "[]", "null", json.dumps({"epoch": "1"}), json.dumps({"epoch": True}),
                                     "[" * 100_000 + "]" * 100_000])
def test_a_damaged_resume_note_of_another_rank_is_a_disagreement_not_a_traceback(damaged):
    """Another rank's note comes through an epoch file in the cache directory: checked field by field."""
    from types import SimpleNamespace

    from growcache.rendezvous import disagreement

    good = json.dumps({"epoch": 1, "seed": 3, "progress": 7, "layout": {"batch_size": 8}, "group": "g",
                       "cache": "c", "snapshot": "abc"})
    group = SimpleNamespace(world_rank=1)
    assert disagreement([good, good], group, collective=False) == ""
    for notes in ([good, damaged], [damaged, damaged], [damaged, ""]):
        assert "damaged resume note" in disagreement(notes, group, collective=False), notes


def test_batches_taken_out_of_order_are_saved_per_reader(id_cache, caplog):
    # DataLoader(in_order=False): a state's progress was split over the readers round-robin as if
    # taken in turn, so a resume skipped batches a slow reader never delivered (and repeated
    # others); then it resumed where every reader had delivered in turn, reading batches again.
    # Each reader's batches are saved now.
    write_shards(id_cache, [16, 16, 16, 16])  # two readers, 8 batches each, taken in turn: 0 1 0 1 ...
    epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    epoch = epochs.start()
    assert epoch.read_points().counts == (8, 8)
    for reader in (1, 1, 1, 0):  # reader 0 slow: reader 1 delivered 3 while reader 0 delivered 1
        epoch.consume(round_robin=False, reader=reader)
    with caplog.at_level("WARNING", logger="growcache.resume"):
        state = loader_state(epochs, epoch)
    assert (state["version"], state["progress"], state["delivered"]) == (2, 4, [1, 3])
    assert check_state(json.loads(json.dumps(state)))["delivered"] == [1, 3]
    assert "out of order" not in caplog.text  # nothing is read again
    assert loader_state(epochs, epoch, consumed=3)["delivered"] == [0, 3]  # the last, reader 0's, not trained on
    epoch.consume(round_robin=False, reader=0)
    epoch.consume(round_robin=False, reader=0)
    in_turn = loader_state(epochs, epoch)
    assert (in_turn["version"], in_turn["progress"], "delivered" in in_turn) == (1, 6, False)  # 3 each: in turn
    epoch.consume(round_robin=False, reader=None)  # a reader unknown: the count's start is what is known
    with caplog.at_level("WARNING", logger="growcache.resume"):
        assert loader_state(epochs, epoch)["progress"] == 0
        loader_state(epochs, epoch)
    assert len([r for r in caplog.records if "out of order" in r.getMessage()]) == 1  # once per epoch
    epoch.end()

    in_turn = epochs.start()
    for reader in (0, 1, 0):
        in_turn.consume(reader=reader)
    state = loader_state(epochs, in_turn)
    assert (state["version"], state["progress"], "delivered" in state) == (1, 3, False)
    in_turn.end()


def _saved_out_of_order(cache, readers):
    """A state of two readers of 8 batches each (batches of 4), saved after the batches of ``readers``."""
    write_shards(cache, [16, 16, 16, 16])
    epochs = Epochs(cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    epoch = epochs.start()
    for reader in readers:
        epoch.consume(round_robin=False, reader=reader)
    state = json.loads(json.dumps(loader_state(epochs, epoch)))
    epoch.end()
    return state


def test_a_state_saved_out_of_order_resumes_each_reader_after_its_own_batches(id_cache):
    state = _saved_out_of_order(id_cache, (1, 1, 1, 0, 1))
    resumed_epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    load_state(resumed_epochs, state)
    resumed = resumed_epochs.start()
    assert (resumed.skips, resumed.rotation, resumed.consumed) == ((1, 4), 0, 5)
    assert resumed.share(0).skip_batches == 1 and resumed.share(1).skip_batches == 4
    # Taken in turn after the resume, the batches are still counted per reader: a second save
    # names each reader's own.
    for reader in (0, 1, 0):
        resumed.consume(reader=reader)
    again = loader_state(resumed_epochs, resumed)
    assert (again["progress"], again["delivered"]) == (8, [3, 5])
    resumed.end()


def test_a_state_saved_out_of_order_read_on_in_turn_by_unnamed_readers_saves_each_readers_again(id_cache):
    # TensorFlow's pipeline takes a resumed epoch's batches in turn, reader 0 first, naming none:
    # they were counted for no reader, and every later state fell back to the resume's point.
    state = _saved_out_of_order(id_cache, (1, 1, 1, 1, 1, 1, 0))
    resumed_epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    load_state(resumed_epochs, state)
    resumed = resumed_epochs.start()
    resumed.consume()
    resumed.consume(3)  # 0 1 0 1: then reader 1 has delivered its 8
    assert loader_state(resumed_epochs, resumed)["delivered"] == [3, 8]
    assert loader_state(resumed_epochs, resumed, consumed=10)["delivered"] == [3, 7]  # the last, reader 1's
    resumed.consume(2)  # reader 0's alone
    assert loader_state(resumed_epochs, resumed)["delivered"] == [5, 8]
    resumed.end()
    load_state(resumed_epochs, state)
    resumed = resumed_epochs.start()
    resumed.consume(round_robin=False, reader=1)  # not reader 0's turn: the order is not in turn
    resumed.consume()
    assert loader_state(resumed_epochs, resumed)["delivered"] == [1, 6]  # where the count began
    resumed.end()


def test_batches_taken_out_of_order_in_a_resumed_epoch_count_for_the_readers_it_rotated(id_cache):
    # Resumed after one batch, reader process 1 reads the saved plan's reader 0 (the readers are
    # rotated so that the next batch is the saved order's): counted as reader 1's, its batches
    # made the state skip batches the saved reader 1 never delivered.
    write_shards(id_cache, [12, 12])  # two readers, 3 batches each
    epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    epoch = epochs.start()
    epoch.consume()
    state = json.loads(json.dumps(loader_state(epochs, epoch)))
    epoch.end()
    resumed_epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    load_state(resumed_epochs, state)
    resumed = resumed_epochs.start()
    assert resumed.rotation == 1
    resumed.consume(round_robin=False, reader=1)
    resumed.consume(round_robin=False, reader=1)  # saved reader 0's second and third; reader 1 none
    state = loader_state(resumed_epochs, resumed)
    assert (state["progress"], state["delivered"]) == (3, [3, 0])
    resumed.end()


def test_an_epoch_taken_out_of_order_lets_go_of_what_every_reader_passed_and_no_more(id_cache):
    # Taken out of order, an epoch's lease held its whole snapshot to the end (a full cache then
    # stalled its samplers); counted per reader, it lets go of the shards a reader passed.
    write_shards(id_cache, [8] * 8)  # two readers, four shards each, a batch of 4 per half shard
    epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    epoch = epochs.start()
    points = epoch.read_points()
    seqs = epoch.agreed.seqs
    fast = [seqs[shard] for _, shard in points.points[1]]
    slow = [seqs[shard] for _, shard in points.points[0]]
    for _ in range(points.counts[1]):  # reader 1 delivers everything, reader 0 nothing
        epoch._trim_after = 0.0  # trims are spaced by their cost: not waited for here
        epoch.consume(round_robin=False, reader=1)
    assert not set(fast) & epoch.held, "the shards reader 1 passed are let go"
    assert set(slow) <= epoch.held, "reader 0, which delivered nothing, still reads all of its own"
    state = json.loads(json.dumps(loader_state(epochs, epoch)))
    assert state["delivered"] == [0, points.counts[1]]
    epoch.end()


@pytest.mark.parametrize("seed", range(6))
def test_random_out_of_order_saves_resume_every_record_exactly_once(id_cache, seed):
    # Real readers' batches, taken in a random order by reader (a slow worker, a fast one), saved
    # at a random batch, some saves naming fewer batches than taken (a trainer that fetched
    # ahead): the batches before the save and the resumed epoch's hold each record once.
    import numpy as np

    rng = np.random.default_rng(seed)
    write_shards(id_cache, [int(n) for n in rng.integers(3, 30, size=7)])
    options = EpochOptions(4, shuffle_buffer=int(rng.choice([0, 9, 20])))
    read = _read_streams

    for trial in range(4):
        epochs = Epochs(id_cache, options, readers=3)
        epochs.epoch = trial
        epoch = epochs.start()
        streams = read(epoch, 3)
        everything = sorted(i for stream in streams for b in stream for i in b)
        taken, at = [], [0, 0, 0]
        for _ in range(int(rng.integers(0, sum(map(len, streams)) + 1))):
            open_ = [r for r in range(3) if at[r] < len(streams[r])]
            r = int(rng.choice(open_, p=np.array([1.0 + 4 * (r == 2) for r in open_]) / sum(1.0 + 4 * (r == 2)
                                                                                               for r in open_)))
            taken.append(streams[r][at[r]])
            at[r] += 1
            epoch.consume(round_robin=False, reader=r)
        consumed = len(taken) - int(rng.integers(0, 3)) if taken else 0
        state = json.loads(json.dumps(loader_state(epochs, epoch, consumed=max(consumed, 0))))
        epoch.end()
        before = [i for b in taken[:max(consumed, 0)] for i in b]
        resumed_epochs = Epochs(id_cache, options, readers=3)
        load_state(resumed_epochs, state)
        if state["snapshot"] is None:  # the whole epoch was taken
            assert sorted(before) == everything
            continue
        resumed = resumed_epochs.start()
        rest = [i for stream in read(resumed, 3) for b in stream for i in b]
        resumed.end()
        assert sorted(before + rest) == everything, (seed, trial, state.get("delivered"), state["progress"])


def _read_streams(epoch, readers):
    """Each reader's batches of ``epoch`` (batches of 4), as lists of ids, read by growcache's reader."""
    import numpy as np

    from growcache.batching import BatchReader

    reader = BatchReader(ID_SCHEMA, 4, shuffle_buffer=epoch.epochs.reader.shuffle_buffer)
    allocate = lambda rows: (None, {k: np.zeros((rows, *v.shape), v.dtype) for k, v in ID_SCHEMA.items()})  # noqa: E731
    return [[arrays["id"][:rows].reshape(-1).tolist() for _, arrays, rows in reader.batches(epoch.share(r), allocate)]
            for r in range(readers)]


def test_a_state_saved_out_of_order_finds_its_shards_in_a_cache_that_evicted_what_its_pin_let_go(tmp_path):
    # The pin keeps only what each reader reads after its own batches; the resume checked for the
    # shards a resume from the progress split round-robin reads, so it refused with
    # MissingShardsError a state whose fast reader's passed shards a full cache had evicted.
    from conftest import grow_while_down
    from growcache.resume import keep_pin, pin_epoch

    cache = Cache(tmp_path / "cache", capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [8] * 8)  # two readers, four shards each, two batches of 4 per shard
    first = {s.path for s in cache.list_shards()}
    options = EpochOptions(4, shuffle_buffer=0)
    epochs = Epochs(cache, options, readers=2)
    epoch = epochs.start()
    pin_epoch(epoch, 3600)
    streams = _read_streams(epoch, 2)
    everything = sorted(i for stream in streams for batch in stream for i in batch)
    slow_first = epoch.shards[epoch.read_points().points[0][0][1]].path
    taken, at = [], [0, 0]
    for reader in (1, 1, 1, 1, 1, 1, 0, 1):  # reader 0 slow: 3 of reader 1's shards are passed
        taken.extend(streams[reader][at[reader]])
        at[reader] += 1
        epoch.consume(round_robin=False, reader=reader)
    state = json.loads(json.dumps(loader_state(epochs, epoch)))
    assert state["delivered"] == [1, 7]
    keep_pin(epoch)  # the run is killed
    epoch.end()
    cache, _ = grow_while_down(tmp_path / "cache", first)
    assert not first <= {s.path for s in cache.list_shards()}, "shards of the epoch were evicted"
    resumed_epochs = Epochs(cache, options, readers=2)
    load_state(resumed_epochs, state)  # on_missing="raise": nothing the rest of the epoch reads is gone
    resumed = resumed_epochs.start()
    rest = [i for stream in _read_streams(resumed, 2) for batch in stream for i in batch]
    resumed.end()
    assert sorted(taken + rest) == everything
    # The other way round: reader 0 still reads its first shard, which the progress in turn (4 batches
    # each) passed; gone, it was skipped without the MissingShardsError on_missing="raise" asks for.
    os.unlink(slow_first)
    with pytest.raises(MissingShardsError, match=os.path.basename(slow_first)):
        load_state(Epochs(cache, options, readers=2), state)


def test_a_save_behind_the_resume_point_of_a_state_saved_out_of_order_skips_no_batch_never_taken(id_cache):
    # A save naming fewer batches than the resumed epoch began at (a trainer that fetched ahead
    # saves one less) guessed each reader's count as if the batches had been taken in turn: with
    # a slow reader 0 ([1, 4] at 5 batches), the guess gave reader 0 a batch it may never have
    # delivered (at 4 batches it had [0, 4] or [1, 3]), which a resume then skipped.
    write_shards(id_cache, [16, 16, 16, 16])
    epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    epoch = epochs.start()
    for reader in (1, 1, 1, 0, 1):
        epoch.consume(round_robin=False, reader=reader)
    state = json.loads(json.dumps(loader_state(epochs, epoch)))
    epoch.end()
    assert state["delivered"] == [1, 4]
    resumed_epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    load_state(resumed_epochs, state)
    resumed = resumed_epochs.start()
    behind = loader_state(resumed_epochs, resumed, consumed=4)
    for possible in ([0, 4], [1, 3]):
        assert all(saved <= was for saved, was in zip(behind["delivered"], possible)), behind["delivered"]
    assert behind["progress"] == sum(behind["delivered"])
    resumed.end()


def test_a_count_the_loop_gives_back_takes_back_the_readers_counts_too(id_cache):
    # TensorFlow's pipeline sets the count to what Keras says the loop took, which can be fewer
    # than the batches it counted (prefetched): in an epoch counted per reader (resumed from a
    # state saved out of order) the readers' counts stayed ahead, and a save named batches the
    # loop never trained on, which the next resume skipped.
    state = _saved_out_of_order(id_cache, (1, 1, 1, 0, 1))  # [1, 4] at 5 batches
    resumed_epochs = Epochs(id_cache, EpochOptions(4, shuffle_buffer=0), readers=2)
    load_state(resumed_epochs, state)
    resumed = resumed_epochs.start()
    resumed.consume()  # taken in turn, naming no reader (TensorFlow's interleave)
    after_one = loader_state(resumed_epochs, resumed)
    resumed.consume(2)
    from growcache.pull_feed import IteratorEpochs

    IteratorEpochs(resumed_epochs)._count(resumed, 6)  # Keras says the loop took one of the three
    again = loader_state(resumed_epochs, resumed)
    assert (again["progress"], again["delivered"]) == (after_one["progress"], after_one["delivered"]) == (6, [2, 4])
    resumed.end()
