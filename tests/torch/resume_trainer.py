"""A training process for tests/torch/test_resume.py: reads one epoch of a cache with
make_torch_loader, logs each batch's ids, saves loader.state_dict() every few batches as a
checkpoint would, and can SIGKILL itself at a given batch (no cleanup runs: a preemption).

Usage: python resume_trainer.py '{"cache": DIR, "out": DIR, "mode": "ref"|"kill"|"resume", ...}'
"""

from __future__ import annotations

import json
import os
import signal
import sys

import growcache
from growcache.manifest import atomic_write_bytes


def main(args: dict) -> None:
    loader = growcache.make_torch_loader(args["cache"], args.get("batch_size", 8), num_workers=args["workers"],
                                         shuffle_buffer=args.get("shuffle_buffer", 20), seed=3,
                                         resume_ttl=args.get("ttl", 3600))
    state_path = os.path.join(args["out"], "state.json")
    if args["mode"] == "resume":
        with open(state_path) as f:
            loader.load_state_dict(json.load(f), on_missing=args.get("on_missing", "raise"))
    else:
        loader.set_epoch(args.get("epoch", 1))
    with open(os.path.join(args["out"], f"{args['mode']}.log"), "a") as log:
        for number, batch in enumerate(loader, 1):
            log.write(json.dumps(batch["id"].tolist()) + "\n")
            log.flush()
            if args["mode"] != "kill":
                continue
            if number % args["save_every"] == 0:  # a checkpoint: written whole, then renamed
                atomic_write_bytes(state_path, json.dumps(loader.state_dict()).encode())
            if number == args["kill_at"]:
                os.kill(os.getpid(), signal.SIGKILL)
    print(json.dumps({"epoch": loader.last_epoch.number, "state": loader.state_dict()["epoch"]}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
