"""Random damage to a cache's shards, shared by the property tests of every reader
(``test_bad_inputs.py``, ``torch/test_hostile_shards.py``, ``tf/test_hostile_shards.py``).

Imports neither torch, nor TensorFlow, nor the ``tfrecord`` package.
"""

from __future__ import annotations

from hypothesis import strategies as st

from conftest import ID_SCHEMA, write_shards
from growcache import Cache


def damage_shards(cache: Cache, data) -> set[str]:
    """Write random bytes over random regions of random shards (some cut short or grown);
    return the paths whose bytes changed."""
    shards = cache.list_shards()
    chosen = data.draw(st.lists(st.sampled_from(shards), min_size=1, max_size=len(shards), unique=True))
    changed = set()
    for shard in chosen:
        original = open(shard.path, "rb").read()
        blob = bytearray(original)
        for _ in range(data.draw(st.integers(1, 3))):
            start = data.draw(st.integers(0, len(blob) - 1))
            patch = data.draw(st.binary(min_size=1, max_size=48))
            blob[start:start + len(patch)] = patch
        ending = data.draw(st.sampled_from(["keep", "cut", "grow"]))
        if ending == "cut":
            del blob[data.draw(st.integers(0, len(blob) - 1)):]
        elif ending == "grow":
            blob += data.draw(st.binary(min_size=1, max_size=64))
        with open(shard.path, "wb") as f:
            f.write(blob)
        if bytes(blob) != original:
            changed.add(shard.path)
    return changed


def damaged_cache(root: str, data) -> tuple[Cache, set[str], dict[str, list[int]]]:
    """A cache of 4 shards of 6 records whose ids say their payload, randomly damaged:
    ``(cache, damaged paths, record ids of every shard)``."""
    cache = Cache(root, capacity="1GB", schema=ID_SCHEMA)
    write_shards(cache, [6] * 4)
    ids = {s.path: list(range(6 * i, 6 * i + 6)) for i, s in enumerate(cache.list_shards())}
    return cache, damage_shards(cache, data), ids
