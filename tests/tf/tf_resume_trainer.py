"""A training process for tests/tf/test_tf_resume.py: reads epoch 1 of a cache with
make_tf_dataset in an eager loop, logs each batch's ids, saves ds.state_dict() every few
batches as a checkpoint would, and SIGKILLs itself at a given batch (no cleanup runs: a
preemption).

Usage: python tf_resume_trainer.py '{"cache": DIR, "out": DIR, "kill_at": N, "save_every": N, ...}'
"""

from __future__ import annotations

import json
import os
import signal
import sys

from growcache.adapters.tf_dataset import make_tf_dataset
from growcache.manifest import atomic_write_bytes


def main(args: dict) -> None:
    ds = make_tf_dataset(args["cache"], 8, shuffle_buffer=20, seed=3, cycle_length=args["cycle_length"],
                         resume_ttl=3600)
    ds.epochs.set_epoch(1)
    state_path = os.path.join(args["out"], "state.json")
    with open(os.path.join(args["out"], "kill.log"), "a") as log:
        for number, batch in enumerate(ds, 1):
            log.write(json.dumps(batch["id"].numpy().tolist()) + "\n")
            log.flush()
            if number % args["save_every"] == 0:  # a checkpoint: written whole, then renamed
                atomic_write_bytes(state_path, json.dumps(ds.state_dict()).encode())
            if number == args["kill_at"]:
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
