"""The suite's rule on skips (tests/conftest.py), run as CI runs it: a pytest of its own, with a
required component made missing by a stand-in package that fails to import, as an absent one does.

* TensorFlow missing: a failure naming what to install under ``CI=true``; a skip with its
  reason elsewhere (a developer without TensorFlow can still run the rest).
* ``tfrecord`` (part of the ``[test]`` extra) missing: a failure naming the extra, CI or not.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_without(module: str, test_file: str, tmp_path, ci: bool) -> subprocess.CompletedProcess:
    hidden = tmp_path / "hidden"
    (hidden / module).mkdir(parents=True)
    (hidden / module / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{module}' (hidden by test_ci_skips)\", name={module!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), ROOT, env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    # Its own --basetemp: a second pytest session would otherwise prune this one's temporary directories.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp_path / "basetemp"), test_file], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.timeout(300)
def test_a_missing_tensorflow_fails_under_ci_and_names_the_install(tmp_path):
    result = _run_without("tensorflow", "tests/tf/test_core_format.py", tmp_path, ci=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "required-component-missing" in result.stdout
    assert "could not import 'tensorflow'" in result.stdout and "pip install tensorflow-cpu" in result.stdout


@pytest.mark.timeout(300)
def test_a_missing_tensorflow_is_a_reported_skip_outside_ci(tmp_path):
    result = _run_without("tensorflow", "tests/tf/test_core_format.py", tmp_path, ci=False)
    assert result.returncode == 5, result.stdout + result.stderr  # no test ran, none failed
    assert "SKIPPED" in result.stdout and "could not import 'tensorflow'" in result.stdout


@pytest.mark.timeout(300)
def test_a_missing_test_extra_package_fails_everywhere_and_names_the_extra(tmp_path):
    result = _run_without("tfrecord", "tests/test_tfrecord_package.py", tmp_path, ci=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "required-component-missing" in result.stdout and "[test] extra" in result.stdout
