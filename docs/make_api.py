"""Regenerate docs/api.md from the docstrings of growcache's public names.

The source is parsed with ``ast`` rather than imported, so the adapters' frameworks (which
cannot share one process) are never loaded. ``python docs/make_api.py --check`` exits 1 when
docs/api.md is stale; a test runs it.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = {"growcache": ROOT / "growcache", "growcache.adapters": ROOT / "adapters"}
OUT = ROOT / "docs" / "api.md"

SECTIONS = [
    ("Cache and shards", ["Cache", "CacheStats", "VerifyReport", "Snapshot", "ShardInfo", "ShardState", "ShardWriter"]),
    ("Schema", ["Schema", "FeatureSpec"]),
    ("Sampling", ["SamplerPool"]),
    # The adapters' shared epoch arguments are documented once, on the core's EpochOptions.
    ("Framework adapters", ["make_tf_dataset", "fit_growing", "growcache.adapters.keras.BackupAndRestore",
                            "make_torch_loader", "growcache.epoch.EpochOptions"]),
    ("Is training waiting on data?", ["input_stats", "InputStats", "InputFigures", "growcache.metrics.CacheFigures",
                                      "growcache.adapters.keras.InputStatsCallback",
                                      "growcache.adapters.lightning.InputStatsCallback"]),
    ("Sizes", ["parse_size", "format_size"]),
]


def _module_file(module: str) -> Path:
    for prefix, folder in sorted(PACKAGE.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix):].lstrip(".")
            return folder / (rest.replace(".", "/") + ".py" if rest else "__init__.py")
    raise KeyError(module)


def _public_names() -> tuple[list[str], dict[str, str]]:
    """``__all__`` of growcache and the module each name comes from."""
    tree = ast.parse((PACKAGE["growcache"] / "__init__.py").read_text())
    names: list[str] = []
    origin: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            names = [ast.literal_eval(e) for e in node.value.elts]
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                origin[alias.asname or alias.name] = f"growcache.{node.module}"
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LAZY" for t in node.targets):
            for key, value in zip(node.value.keys, node.value.values):
                origin[ast.literal_eval(key)] = ast.literal_eval(value.elts[0])
    return names, origin


# Modules whose own __all__ is documented whole, beside the names of ``growcache``.
MODULES = [
    ("Sources", "growcache.sources",
     "Where a `SamplerPool` gets its samples, over any fsspec store. Import these from `growcache.sources`."),
]


def _module_names(module: str) -> tuple[list[str], dict[str, str]]:
    """``__all__`` of a growcache module and the module each name is defined in."""
    tree = ast.parse(_module_file(module).read_text())
    names: list[str] = []
    origin: dict[str, str] = {}
    package = module.rsplit(".", 1)[0]
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            names = [ast.literal_eval(e) for e in node.value.elts]
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                origin[alias.asname or alias.name] = f"{package}.{node.module}"
    return names, {n: origin.get(n, module) for n in names}


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, skip_self: bool) -> str:
    args = ast.unparse(node.args).replace("mode: int=448", "mode: int=0o700")
    if skip_self:
        args = args.split(",", 1)[1].strip() if "," in args else ""
    return f"({args})"


def _doc(node: ast.AST) -> str:
    text = inspect.cleandoc(ast.get_docstring(node) or "Undocumented.")
    first, _, rest = text.partition("\n")
    # The summary line reads as prose; Args/Returns/Raises keep their layout in a text block.
    return first + (f"\n\n```text\n{rest.strip()}\n```" if rest.strip() else "")


def _render(name: str, module: str) -> str:
    try:
        path = _module_file(module)
        tree = ast.parse(path.read_text())
    except (KeyError, FileNotFoundError):
        return f"### `{name}`\n\n*Not available in this checkout ({module}).*\n"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return f"### `{name}{_signature(node, False)}`\n\n*{module}*\n\n{_doc(node)}\n"
        if isinstance(node, ast.ClassDef) and node.name == name:
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            sig = _signature(init, True) if init else ""
            parts = [f"### `class {name}{sig}`\n\n*{module}*\n\n{_doc(node)}\n"]
            for member in node.body:
                if not isinstance(member, ast.FunctionDef) or member.name.startswith("_"):
                    continue
                decorators = {ast.unparse(d) for d in member.decorator_list}
                if "property" in decorators:
                    parts.append(f"#### `{name}.{member.name}` (property)\n\n{_doc(member)}\n")
                else:
                    kind = "classmethod " if "classmethod" in decorators else ""
                    sig = _signature(member, skip_self=True)
                    parts.append(f"#### `{kind}{name}.{member.name}{sig}`\n\n{_doc(member)}\n")
            return "\n".join(parts) + "\n"
    return f"### `{name}`\n\n*Not found in {module}.*\n"


def render() -> str:
    names, origin = _public_names()
    errors = [n for n in names if n.endswith("Error")]
    lines = ["# API reference", "",
             "Generated from the docstrings by `python docs/make_api.py`; a test keeps it current.",
             "Everything listed is importable from `growcache` (adapters resolve lazily).", ""]
    placed = set()
    for title, members in SECTIONS:
        lines += [f"## {title}", ""]
        for name in members:
            if "." in name:  # documented where it is defined, not exported from growcache
                module, _, short = name.rpartition(".")
                lines.append(_render(short, module))
            elif name in names:
                lines.append(_render(name, origin.get(name, "growcache")))
                placed.add(name)
    lines += ["## Errors", "", "Every error subclasses `GrowcacheError` and a builtin (`growcache/errors.py`).", ""]
    for name in errors:
        lines.append(_render(name, "growcache.errors"))
        placed.add(name)
    rest = [n for n in names if n not in placed]
    if rest:
        lines += ["## Other", ""] + [_render(n, origin.get(n, "growcache")) for n in rest]
    for title, module, intro in MODULES:
        members, where = _module_names(module)
        lines += [f"## {title} (`{module}`)", "", intro, ""]
        lines += [_render(name, where[name]) for name in members]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            sys.stderr.write("docs/api.md is stale: run python docs/make_api.py\n")
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
