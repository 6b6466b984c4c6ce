"""The docs cannot rot: their code runs, and their figures are the benchmark's.

Every code block marked ``<!-- runnable -->`` in README.md and docs/ runs in a fresh
interpreter in an empty temporary directory (so TensorFlow blocks and PyTorch blocks never
share a process), twice, as a user who runs a snippet again in the same directory would.

Every measured figure lives in docs/benchmarks.md, written by the benchmark. A throughput,
CPU-per-GB, latency or ratio figure on any other page must be one that benchmarks.md holds.
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


# Runs a block twice in one interpreter (the second run reuses the imports): what the first run
# left on disk must not break the second. A fresh dict of globals each time, as a new script gets.
_TWICE = """
import sys
code = compile(open(sys.argv[1]).read(), "<doc block>", "exec")
for run in (1, 2):
    print(f"--- run {run}", flush=True)
    exec(code, {"__name__": "__main__"})
"""


@pytest.mark.parametrize("code", BLOCKS)
def test_runnable_block(code, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "block.py").write_text(code)
    result = subprocess.run([sys.executable, "-c", _TWICE, str(tmp_path / "block.py")], cwd=work,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert "--- run 2" in result.stdout


_NUMBER = r"\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?"
# A throughput, a CPU cost, a latency, or a ratio written against the number ("0.97x", not "8 x 7").
_FIGURE = re.compile(rf"(?<![\w.\-/])({_NUMBER})(?: ?(MB/s|GB/s|ms)\b| ?(?:CPU )?(s/GB)|(x|×)(?![\w\d]))")
_UNIT_IN_HEADER = re.compile(r"(MB/s|GB/s|s/GB|ms\b|×|\bx\b)")
# Figures that are not measurements: goals, stated as such wherever they appear.
NOT_MEASURED = {
    ("300-600", "MB/s"): "the throughput range growcache is built for (index.md, The problem)",
    ("600", "MB/s"): "the throughput goal",
}


def _unit(match: re.Match) -> str:
    unit = next(u for u in match.groups()[1:] if u)
    return "x" if unit in ("x", "×") else unit


def _figures(text: str) -> set[tuple[str, str]]:
    """Every (number, unit) in prose, and in the cells of tables whose column header names a unit."""
    found = {(m.group(1), _unit(m)) for m in _FIGURE.finditer(text)}
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and re.match(r"^\|[\s:|-]+\|$", lines[i + 1])):
            continue
        units = []
        for header in line.strip("|").split("|"):
            unit = _UNIT_IN_HEADER.search(header)
            units.append(None if unit is None else ("x" if unit.group(1) in ("x", "×") else unit.group(1)))
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            for cell, unit in zip(row.strip("|").split("|"), units):
                if unit is not None:
                    found |= {(number, unit) for number in re.findall(_NUMBER, cell)}
    return found


def test_figures_on_every_page_are_those_of_benchmarks_md():
    measured = _figures((ROOT / "docs" / "benchmarks.md").read_text())
    stray = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name == "benchmarks.md":
            continue
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            if fenced:  # code and sample output, not claims
                continue
            for match in _FIGURE.finditer(line):
                figure = (match.group(1), _unit(match))
                if figure not in measured and figure not in NOT_MEASURED:
                    stray.append(f"{path.name}:{number}: {match.group(0)!r}")
    assert stray == [], ("figures that docs/benchmarks.md does not hold; link to it, or quote its figures: "
                         + ", ".join(stray))


def test_the_figure_check_sees_prose_tables_and_ratios():
    text = "ran at 0.97x, 1.2-2.2 GB/s and 0.034 CPU s/GB in 15-28 ms; 8 × 7 slots, 2 x 3"
    assert _figures(text) == {("0.97", "x"), ("1.2-2.2", "GB/s"), ("0.034", "s/GB"), ("15-28", "ms")}
    table = "| what | MB/s median | notes |\n|---|---:|---|\n| a | 5234 (4990-5245) | 3 rounds |\n"
    assert _figures(table) == {("5234", "MB/s"), ("4990-5245", "MB/s")}


def test_api_reference_is_current():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "make_api.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
