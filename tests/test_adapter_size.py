"""The two framework adapters stay thin (issue 13): what is not wiring belongs to the core.

The bound counts every line, docstrings included. Arguments both adapters share are
documented once, on :class:`growcache.epoch.EpochOptions`, not in each adapter.
"""

from __future__ import annotations

from pathlib import Path

ADAPTERS = Path(__file__).resolve().parent.parent / "adapters"
# Issue 13 asked for "at most about 600" for the two together; 627 when it closed. Issue 31's
# stall figures wire in with 11 lines (the eager TensorFlow iterator times next(), the torch
# loader hands its epochs to growcache.metrics). Issues 28, 30 and 32 wire in 41 more lines of
# torch loader: prefetch cut to the slots a small /dev/shm holds, the resume (resume_ttl, the
# batches consumed, the pin kept or released; the mechanism is growcache.resume) and the
# DataLoader attributes that report what the loader does. Issue 30's TensorFlow resume wires in
# 20 lines (resume_ttl, state_dict/load_state_dict, the replay's skip, the eager iterator's
# count); the mechanism is growcache.pull_feed and growcache.resume. Closing the epoch a new iter()
# replaces, before its workers could write into reclaimed slabs, takes 4 lines of torch loader. Review:
# 8 more lines of torch loader replace persistent DataLoader workers of which one died (torch reset
# the dead one with the rest, and every later epoch failed), and stop non-persistent ones at close();
# 4 move a batch without a slot into torch's shared memory in the worker itself, or send it pickled when
# /dev/shm is full (torch's queue thread dropped it there, and the trainer waited for good). Session 18:
# 4 more stop the persistent workers of an epoch that failed (a worker died or raised) and end it with
# its lease at once (a loop that built a new loader after the error kept it until a garbage collection);
# 1 ends the epochs of a loader dropped without close() (growcache.resume.end_when_dropped).
MAX_LINES = 727


def test_the_two_adapters_together_stay_within_their_line_budget():
    sizes = {name: len((ADAPTERS / name).read_text().splitlines()) for name in ("tf_dataset.py", "torch_loader.py")}
    assert sum(sizes.values()) <= MAX_LINES, (
        f"adapters/tf_dataset.py and torch_loader.py hold {sizes} lines, {sum(sizes.values())} together, over "
        f"{MAX_LINES}: move what is not framework wiring into growcache/ (epoch.py, worker_feed.py, pull_feed.py)")


def test_shared_epoch_arguments_are_documented_once_on_epoch_options():
    from growcache.epoch import EpochOptions

    doc = EpochOptions.__doc__ or ""
    for name in ("seed", "shuffle_buffer", "drop_last", "even_batches", "verify", "on_corrupt", "wait_for_shards",
                 "split", "run_id"):
        assert f"    {name}: " in doc, f"EpochOptions does not document {name}"
        for adapter in ("tf_dataset.py", "torch_loader.py"):
            text = (ADAPTERS / adapter).read_text()
            assert f"        {name}: " not in text, f"{adapter} documents {name} again: refer to EpochOptions"
            # make_tf_dataset calls drop_last drop_remainder, and its pipelines always even out.
            if (adapter, name) not in {("tf_dataset.py", "drop_last"), ("tf_dataset.py", "even_batches")}:
                assert f"``{name}``" in text, f"{adapter} does not name {name} among its epoch arguments"
