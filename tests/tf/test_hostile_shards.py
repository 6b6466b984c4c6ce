"""Random damage to random shards, read by make_tf_dataset with on_corrupt="skip" (issue 17's
property test; the verify part is in tests/test_bad_inputs.py, the PyTorch part in tests/torch/).

No damaged shard reaches TensorFlow's reader (whose own framing crashes on some lengths): every
epoch ends normally, every damaged shard is noted by its file with the records it lost, every
delivered record is intact and delivered once, and every record of an undamaged shard is
delivered.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import id_sample
from growcache import Cache
from hostile import check_failing_examples_leave_nothing_behind, damaged_cache

tf = pytest.importorskip("tensorflow")

from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402


def _check_epoch(cache: Cache, damaged: set[str], ids: dict[str, list[int]], *, planted_failure: bool = False) -> None:
    ds = make_tf_dataset(cache, 4, on_corrupt="skip")
    batches = iter(ds)
    # A failing example must let go of its iterator here: hypothesis keeps each failure's
    # traceback (and with it this frame) while it shrinks, and a live iterator holds its epoch's
    # lease, reader threads and batch slabs until then.
    try:
        delivered = collections.Counter()
        for batch in batches:
            if planted_failure:
                raise AssertionError("planted failure, with the iterator reading")
            for record_id, x in zip(batch["id"].numpy().tolist(), batch["x"].numpy()):
                np.testing.assert_array_equal(x, id_sample(record_id)["x"])
                delivered[record_id] += 1
        if planted_failure:
            raise AssertionError("planted failure, after the epoch")
        assert max(delivered.values(), default=1) == 1, "a record was delivered twice"
        notes = {note.path: note for note in ds.skipped}
        assert set(notes) == damaged, "exactly the damaged shards are skipped, each named by its file"
        for path, shard_ids in ids.items():
            got = sum(delivered[i] for i in shard_ids)
            if path in damaged:
                # The rest of the shard from the damage on (or all of it) is skipped and counted.
                assert got + notes[path].records == len(shard_ids), (path, got, notes[path])
            else:
                assert got == len(shard_ids), path
    finally:
        batches = ds = None  # an eager iterator has no close(): TensorFlow tears it down with its last reference


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_tf_epoch_over_random_damage_skips_only_damaged_shards_and_delivers_intact_records(tmp_path_factory, data):
    _check_epoch(*damaged_cache(str(tmp_path_factory.mktemp("c") / "cache"), data))


def test_a_failing_example_of_the_property_test_leaves_nothing_behind(tmp_path_factory):
    check_failing_examples_leave_nothing_behind(
        tmp_path_factory, lambda cache: _check_epoch(cache, set(), {}, planted_failure=True))
