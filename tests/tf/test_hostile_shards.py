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
from hostile import damaged_cache

tf = pytest.importorskip("tensorflow")

from growcache.adapters.tf_dataset import make_tf_dataset  # noqa: E402


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_tf_epoch_over_random_damage_skips_only_damaged_shards_and_delivers_intact_records(tmp_path_factory, data):
    cache, damaged, ids = damaged_cache(str(tmp_path_factory.mktemp("c") / "cache"), data)
    ds = make_tf_dataset(cache, 4, on_corrupt="skip")
    delivered = collections.Counter()
    for batch in ds:
        for record_id, x in zip(batch["id"].numpy().tolist(), batch["x"].numpy()):
            np.testing.assert_array_equal(x, id_sample(record_id)["x"])
            delivered[record_id] += 1
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
