from __future__ import annotations

import os
import subprocess
import sys

from growcache import Cache
from growcache.cli import main

from conftest import write_shards


def test_status_verify_prune(id_cache, capsys):
    write_shards(id_cache, [3, 3, 3])
    assert main(["status", id_cache.path]) == 0
    out = capsys.readouterr().out
    assert "shards       3" in out and "records      9" in out and "% of budget" in out

    assert main(["verify", "-q", id_cache.path]) == 0
    assert "0 corrupt" in capsys.readouterr().out

    bad = id_cache.list_shards()[1]
    with open(bad.path, "r+b") as f:
        f.seek(30)
        f.write(b"\x00\x01\x02")
    assert main(["verify", "-q", id_cache.path]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT {bad.path} at byte offset 0" in out and "1 corrupt" in out

    assert main(["verify", "-q", "--remove-corrupt", id_cache.path]) == 1
    assert f"REMOVED {bad.path}" in capsys.readouterr().out
    assert len(Cache(id_cache.path).list_shards()) == 2

    assert main(["prune", id_cache.path, "--to", "1"]) == 0
    assert "evicted 2 shards" in capsys.readouterr().out
    assert Cache(id_cache.path).list_shards() == []


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main([]) == 2
    assert main(["status"]) == 2
    assert main(["prune", str(tmp_path), "--to", "lots"]) == 2
    assert main(["status", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["status", str(tmp_path)]) == 2


def test_console_script_is_installed(id_cache):
    exe = os.path.join(os.path.dirname(sys.executable), "growcache")
    result = subprocess.run([exe, "status", id_cache.path], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "budget" in result.stdout
