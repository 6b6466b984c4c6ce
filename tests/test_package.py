"""Packaging contract: light import, lazy adapters, sorted public API, py.typed."""

from __future__ import annotations

import ast
import json
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


FRAMEWORKS = ("tensorflow", "torch", "tfrecord", "keras")


def _framework_imports(path: Path) -> list[str]:
    """Every import of a framework in a module, at any depth: top level, functions, methods, try blocks."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"{path.name}:{node.lineno} imports {name}" for name in names
                  if name.split(".")[0] in FRAMEWORKS]
    return found


def test_no_core_module_imports_a_framework_anywhere():
    # Importing the modules (above) only sees top-level imports; an import inside a function
    # runs later, in a training process or a sampler worker. Read every module's source instead,
    # in a fresh interpreter: in a full run, CPython 3.11's ast.parse raised "SystemError: AST
    # constructor recursion depth mismatch" after earlier tests had moved the recursion limit.
    result = _run(
        f"""
        import json, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import growcache
        from test_package import _framework_imports
        modules = sorted(Path(growcache.__file__).parent.rglob("*.py"))
        print(json.dumps([len(modules), [hit for path in modules for hit in _framework_imports(path)]]))
        """
    )
    assert result.returncode == 0, result.stderr
    count, offenders = json.loads(result.stdout)
    assert count > 10
    assert offenders == [], "growcache/ must stay framework-free; move this to adapters/: " + ", ".join(offenders)


def test_the_framework_scan_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import torch.nn\n\nclass C:\n    def g(self):\n"
                      "        from tensorflow import keras\n        importlib.import_module('tfrecord')\n")
    assert len(_framework_imports(module)) == 3


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
    # Both orders at once, each in a fresh interpreter: importing TensorFlow is most of the cost.
    orders = ("import tensorflow, growcache", "import growcache, tensorflow")
    code = """
        {order}
        import growcache.cache, growcache.example, growcache.records
        print("ok")
        """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code.format(order=order))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for order in orders]
    for order, proc in zip(orders, procs):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{order}:\n{stderr[-2000:]}"
        assert stdout.strip().endswith("ok"), order


def test_py_typed_ships():
    assert (Path(growcache.__file__).parent / "py.typed").exists()
