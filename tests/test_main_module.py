"""``python -m growcache`` runs the ``growcache`` command: same output, same exit codes, and
sampler processes (spawned, with this module as the parent's main) work under it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import growcache
from growcache import Cache


def _both(*args: str, cwd=None) -> list[subprocess.CompletedProcess]:
    """Run ``growcache ARGS`` and ``python -m growcache ARGS``."""
    command = os.path.join(os.path.dirname(sys.executable), "growcache")
    return [subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
            for prefix in ([command], [sys.executable, "-m", "growcache"])]


def test_python_m_growcache_answers_as_the_command_does(tmp_path):
    command, module = _both("--version")
    assert module.returncode == command.returncode == 0
    assert module.stdout == command.stdout == f"growcache {growcache.__version__}\n"
    command, module = _both()
    assert module.returncode == command.returncode == 2, "a bare command is a usage error"
    assert module.stderr == command.stderr and module.stderr.startswith("usage: growcache")
    command, module = _both("status", str(tmp_path / "missing"))
    assert module.returncode == command.returncode == 2 and module.stderr == command.stderr


def test_python_m_growcache_sample_runs_its_spawned_samplers(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    np.save(remote / "a.npy", np.arange(400 * 3, dtype=np.int32).reshape(400, 3))
    result = subprocess.run([sys.executable, "-m", "growcache", "sample", f"file://{remote}/*.npy",
                             str(tmp_path / "cache"), "--window", "4", "--records", "40", "--workers", "2"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    stats = Cache(tmp_path / "cache").stats()
    assert 40 <= stats.records <= 42 and stats.temporaries == 0
    assert f"sampled {stats.records} records" in result.stdout
