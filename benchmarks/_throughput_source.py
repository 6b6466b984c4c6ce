"""The sample source of the growth scenario in ``throughput.py``: incompressible records at a set rate.

It lives in its own module, free of framework imports, so that ``SamplerPool``'s spawned
workers can unpickle it without importing TensorFlow or torch.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np

_IDS = itertools.count()


class RateLimitedSource:
    """``sample(rng) -> {"id", "x"}`` that produces at most ``bytes_per_s`` of payload in each process.

    Each sampler worker holds its own copy, so a pool of ``N`` workers writes up to
    ``N * bytes_per_s``. Ids are ``pid << 32 | counter``: unique across workers of a run.

    Args:
        floats: float32 values in ``x``.
        bytes_per_s: payload rate limit of one worker; ``0`` for no limit.
    """

    def __init__(self, floats: int, bytes_per_s: float) -> None:
        self.floats = floats
        self.bytes_per_s = bytes_per_s
        self._next = 0.0

    def __call__(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        if self.bytes_per_s > 0:
            now = time.monotonic()
            if self._next > now:
                time.sleep(self._next - now)
            self._next = max(self._next, now) + (self.floats * 4 + 8) / self.bytes_per_s
        x = rng.integers(0, 2**32, self.floats, dtype=np.uint32).view(np.float32)
        return {"id": np.int64((os.getpid() << 32) | next(_IDS)), "x": x}
