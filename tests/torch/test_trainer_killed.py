"""A training process killed with SIGKILL mid-epoch takes its DataLoader workers with it, and the
shared-memory slabs they mapped go at the next sweep, whatever the start method. Under
``forkserver`` torch's own watchdog watches the fork server, not the trainer: the workers used to
live on, mapping their slabs, until someone killed them by hand."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from conftest import write_shards  # noqa: E402
from growcache.transport import remove_dead_segments  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TRAINER = """
import json, multiprocessing, sys, time
import growcache

if __name__ == "__main__":
    loader = growcache.make_torch_loader(sys.argv[1], 4, num_workers=2, multiprocessing_context=sys.argv[2],
                                         shuffle_buffer=0, persistent_workers=False)
    for number, batch in enumerate(loader):
        if number == 2:
            print(json.dumps({"workers": [p.pid for p in multiprocessing.active_children()],
                              "slabs": [s.name for s in loader._stream.feed.slabs if s.name]}), flush=True)
            time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["forkserver", "spawn", "fork"])
def test_a_killed_trainers_workers_exit_and_its_slabs_are_swept(id_cache, tmp_path, context):
    write_shards(id_cache, [400] * 4)  # far more batches than the workers prefetch
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    trainer = subprocess.Popen([sys.executable, str(script), id_cache.path, context], stdout=subprocess.PIPE,
                               text=True, env=env)
    try:
        started = json.loads(trainer.stdout.readline())
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
    assert len(started["workers"]) == 2 and (context == "fork" or len(started["slabs"]) == 2), started
    deadline = time.monotonic() + 30  # torch's watchdog looks every 5 s; growcache's at once
    while (alive := [p for p in started["workers"] if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"{context}: workers {alive} outlived their trainer by 30 s"
    deadline = time.monotonic() + 10
    while (left := [n for n in started["slabs"] if os.path.exists("/dev/shm/" + n.lstrip("/"))]) \
            and time.monotonic() < deadline:
        remove_dead_segments()  # what the next loader's start does
        time.sleep(0.1)
    assert not left, f"{context}: slabs {left} outlived their trainer's workers"
