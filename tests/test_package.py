"""Packaging contract: light import, lazy adapters, sorted public API, py.typed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import growcache


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_import_growcache_imports_no_framework():
    result = _run(
        """
        import importlib, pkgutil, sys
        import growcache
        # every core module, so a framework import added anywhere in the core is caught
        for info in pkgutil.iter_modules(growcache.__path__):
            if info.name != "adapters":
                importlib.import_module("growcache." + info.name)
        print(sorted(m for m in ("torch", "tensorflow", "tfrecord", "keras") if m in sys.modules))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_all_is_sorted_and_resolvable():
    assert growcache.__all__ == sorted(growcache.__all__)
    eager = [n for n in growcache.__all__ if n not in growcache._LAZY]
    for name in eager:
        assert getattr(growcache, name) is not None


def test_missing_framework_names_the_extra():
    result = _run(
        """
        import sys
        sys.modules["torch"] = None  # what Python does for a package that is not installed
        import growcache
        try:
            growcache.make_torch_loader
        except ImportError as exc:
            print(type(exc).__name__, exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "MissingExtraError" in result.stdout
    assert "growcache[torch]" in result.stdout


def test_tensorflow_and_growcache_import_in_either_order():
    for order in ("import tensorflow, growcache", "import growcache, tensorflow"):
        result = _run(
            f"""
            {order}
            import growcache.cache, growcache.example, growcache.records
            print("ok")
            """
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().endswith("ok")


def test_py_typed_ships():
    assert (Path(growcache.__file__).parent / "py.typed").exists()
