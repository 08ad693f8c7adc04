"""Imports only go down the layers (DEVELOPERS.md): a parse of every project file's imports, lazy ones inside
functions included, so an upward import fails here before it becomes a cycle.

Layers, bottom first; a file may import its own layer and those below it:
    core          device module, shared constants (imports nothing of the project)
    kernels       device kernels, each beside its torch reference (may use core)
    models        pure PyTorch; kernel slots hold the kernels' torch references
    parallelisms  meshes and everything that shards
    training      config schema, data, loss, optimizer, metrics, checkpoints
    train.py, scripts/
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "kernels", "models", "parallelisms", "training", "train")  # bottom first
TOP_LEVEL = {"core": "core", "kernels": "kernels", "models": "models", "parallelisms": "parallelisms",
             "training": "training", "train": "train", "scripts": "train"}  # top-level name -> layer


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name, or None for anything outside the project (torch, stdlib, ...)."""
    return TOP_LEVEL.get(module.split(".")[0])


def project_files(root: Path) -> list[Path]:
    files = [root / "train.py"]
    for folder in ("core", "kernels", "models", "parallelisms", "training", "scripts"):
        files += sorted((root / folder).rglob("*.py"))
    return [f for f in files if f.is_file()]


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file: ``import a.b``, ``from a.b import c`` (relative ones
    resolved) and ``importlib.import_module("a.b")`` with a literal name; at any depth (imports inside functions
    count)."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            # ``from . import x`` at the root names top-level modules
            found += [(node.lineno, base)] if base else [(node.lineno, alias.name) for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def import_edges(root: Path) -> list[tuple[str, int, str, str, str]]:
    """(file, line, module, from layer, to layer) for every project import of every project file."""
    edges = []
    for path in project_files(root):
        here = layer_of(_module_name(path, root))
        for line, module in imported_modules(path, root):
            there = layer_of(module)
            if there is not None:
                edges.append((str(path.relative_to(root)), line, module, here, there))
    return edges


def upward_imports(root: Path) -> list[str]:
    return sorted({f"{file}:{line} imports {module} ({here} -> {there})"
                   for file, line, module, here, there in import_edges(root)
                   if LAYERS.index(there) > LAYERS.index(here)})


def test_imports_only_go_down() -> None:
    assert project_files(ROOT) and import_edges(ROOT)  # the parse found the project and its imports
    upward = upward_imports(ROOT)
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_a_lazy_upward_import_is_caught(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "train.py").write_text("import kernels.x\n")
    (tmp_path / "kernels" / "x.py").write_text(
        "import torch\nfrom core import device\nfrom . import y\n\n\ndef f():\n    from models.layers import RMSNorm\n"
        "    import importlib\n    return importlib.import_module('training.data')\n")
    assert upward_imports(tmp_path) == ["kernels/x.py:7 imports models.layers (kernels -> models)",
                                        "kernels/x.py:9 imports training.data (kernels -> training)"]


def test_no_script_shadows_a_standard_library_module() -> None:
    # `python scripts/x.py` puts scripts/ first on sys.path: a scripts/tokenize.py would be imported by linecache
    # (through inspect, dataclasses, ...) in place of the standard library's tokenize, breaking every script
    shadowing = sorted(p.name for p in (ROOT / "scripts").glob("*.py") if p.stem in sys.stdlib_module_names)
    assert not shadowing, f"scripts named like standard library modules: {shadowing}; rename them"
