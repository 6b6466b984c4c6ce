"""Every code block marked ``<!-- runnable -->`` in README.md and docs/ runs, so the docs cannot rot.

Each block runs in a fresh interpreter in an empty temporary directory, so TensorFlow
blocks and PyTorch blocks never share a process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*runnable\s*-->\s*\n```python\n(.*?)\n```", re.S)


def _blocks() -> list:
    params = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in MARKER.finditer(text):
            line = text[: match.start()].count("\n") + 2
            params.append(pytest.param(match.group(1), id=f"{path.name}:{line}"))
    return params


BLOCKS = _blocks()


def test_docs_have_runnable_blocks():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("code", BLOCKS)
def test_runnable_block(code, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=240, env=env)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def test_api_reference_is_current():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "make_api.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
