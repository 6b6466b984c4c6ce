"""benchmarks/fill.py and benchmarks/serial_rate.py run end to end on tiny data (no speed asserted) and report every figure."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fill_benchmark_quick(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import fill
    finally:
        sys.path.pop(0)
    out = tmp_path / "fill.json"
    args = fill.parse_args(["--quick", "--concurrency", "8", "--json", str(out)])
    args.concurrency, args.seconds = [8], 0.3
    results = fill.main(args)
    assert json.loads(out.read_text())["runs"] == results["runs"]
    (run,) = results["runs"]
    pool, plain = run["contenders"]["pool_1w_c8"], run["contenders"]["plain_32_threads"]
    assert pool["MBps"] > 0 and pool["samples_per_s"] > 0 and plain["MBps"] > 0
    assert pool["first_shard_s"] is not None and 0 < pool["peak_rss_MB"] < 1000
    assert pool["first_batch_s"] >= pool["first_shard_s"]
    # the pool's CPU split by thread adds up to its CPU; the fetch-and-write floor ran and wrote
    split = pool["cpu_split_s_per_GB"]
    assert set(split) == {"loop", "main", "other"} and min(split.values()) >= 0
    assert abs(sum(split.values()) - pool["cpu_s_per_GB"]) < 1e-6 * max(1.0, pool["cpu_s_per_GB"])
    for name in ("floor_fetch_write_c64", "bare_fetch_c64", "floor_bare_write_c64"):
        floor = run["contenders"][name]
        assert floor["MBps"] > 0 and floor["cpu_s_per_GB"] > 0, name
    table = fill.markdown(results)
    assert "`pool_1w_c8`" in table and "`ideal_32`" in table and "`floor_bare_write_c64`" in table
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    fill.update_docs(results, str(docs))
    fill.update_docs(results, str(docs))  # replaces its block, never adds a second
    assert docs.read_text().count(fill.BEGIN) == 1


_SPLIT_PROBE = """
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import fill

def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass

gone = threading.Thread(target=burn, args=(0.3,))  # exits before the split is read: "other"
gone.start()
gone.join()
pause, idle, stop = threading.Event(), threading.Event(), threading.Event()
spun = [0.0]

def spin():
    while not pause.is_set():
        burn(0.05)
        spun[0] = time.thread_time()
    idle.set()
    stop.wait()  # alive, idle: still a live thread while the split is read

busy = threading.Thread(target=spin)
busy.start()
burn(0.2)
# The busy thread runs until it has spent 0.6 s of CPU, however long that takes: a fixed sleep
# gave it under 0.4 s on a host whose cores other processes (another test) keep busy.
deadline = time.monotonic() + 60
while spun[0] < 0.6 and time.monotonic() < deadline:
    time.sleep(0.02)
pause.set()
idle.wait(60)  # its last burn ended: nothing but the main thread runs while the split is read
split, total = fill._thread_cpu_s([os.getpid()]), fill._cpu_s([os.getpid()])
stop.set()
busy.join()
print(json.dumps([split, total]))
"""


def test_thread_split_adds_up():
    """The CPU split puts a busy thread in ``loop``, the main thread in ``main``, and the rest (exited
    threads included) in ``other``, adding up to the process's CPU. In a process of its own: this
    one holds other tests' threads."""
    import subprocess

    probe = subprocess.run([sys.executable, "-c", _SPLIT_PROBE, os.path.join(ROOT, "benchmarks")],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    split, total = json.loads(probe.stdout)
    assert -0.02 <= total - sum(split.values()) <= 0.03, (split, total)  # only the main thread ran between
    assert split["loop"] >= 0.4, split  # the busy thread
    assert split["main"] >= 0.15, split  # the burn, plus imports
    assert split["other"] >= 0.25, split  # the thread that exited


def test_serial_rate_benchmark_quick():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import serial_rate
    finally:
        sys.path.pop(0)
    result = serial_rate.main(serial_rate.parse_args(["--quick"]))
    assert result["best_window_samples_per_s"] >= result["samples_per_s"] > 0
