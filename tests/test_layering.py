"""Imports only go down the layers (DEVELOPERS.md): a parse of every project file's imports, lazy ones inside
functions included, so an upward import fails here before it becomes a cycle.

Layers, bottom first (``LAYERS``); a file may import its own layer and those below it:
    core          device module, shared constants, atomic writes (imports nothing of the project)
    data          training/data/: tokenizers, documents, shards, the cache, packing, the loader (may use core)
    kernels       device kernels, each beside its torch reference, in subpackages by what they serve (may use data
                  and core; none uses data)
    models        pure PyTorch; kernel slots hold the kernels' torch references
    parallelisms  meshes and everything that shards
    training      config schema, loss, optimizer, metrics, checkpoints, the planner, launch
    train.py, scripts/

DEVELOPERS.md's layer diagram and README.md's repository layout list the same layers top first; a test below parses
both and checks that they keep this order.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "data", "kernels", "models", "parallelisms", "training", "train")  # bottom first
TOP_LEVEL = {"core": "core", "kernels": "kernels", "models": "models", "parallelisms": "parallelisms",
             "training": "training", "train": "train", "scripts": "train"}  # top-level name -> layer


# The layer each line of a documented layer list names by its first word (DEVELOPERS.md's diagram, README.md's
# repository layout); a line starting with anything else (conf/, tests/, an indented file or continuation) names none.
DOCUMENTED_FOLDERS = {"train.py": "train", "scripts/": "train", "training/": "training",
                      "parallelisms/": "parallelisms", "models/": "models", "kernels/": "kernels",
                      "training/data/": "data", "core/": "core"}
DOCUMENTED_LISTS = (("DEVELOPERS.md", "## Layers: imports only go down"), ("README.md", "## Repository layout"))


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name, or None for anything outside the project (torch, stdlib, ...)."""
    if module == "training.data" or module.startswith("training.data."):
        return "data"  # a floor of its own inside training/ (training/data/__init__.py)
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
    (tmp_path / "kernels" / "moe").mkdir(parents=True)  # a subpackage of kernels/ is the kernels layer
    (tmp_path / "train.py").write_text("import kernels.moe.x\n")
    (tmp_path / "kernels" / "moe" / "x.py").write_text(
        "import torch\nfrom core import device\nfrom . import y\n\n\ndef f():\n    from models.layers import RMSNorm\n"
        "    import importlib\n    from .. import installed\n"
        "    return importlib.import_module('training.checkpoint')\n")
    assert upward_imports(tmp_path) == [
        "kernels/moe/x.py:10 imports training.checkpoint (kernels -> training)",
        "kernels/moe/x.py:7 imports models.layers (kernels -> models)"]


def test_the_data_floor_imports_core_only(tmp_path: Path) -> None:
    (tmp_path / "training" / "data").mkdir(parents=True)
    (tmp_path / "train.py").write_text("from training.data.loader import f\n")
    (tmp_path / "training" / "data" / "loader.py").write_text(
        "from core.files import atomic_write\nfrom training.data.cache import g\nfrom training.checkpoint import h\n"
        "from kernels.tokenwise.norm import rms_norm\n")
    assert upward_imports(tmp_path) == ["training/data/loader.py:3 imports training.checkpoint (data -> training)",
                                        "training/data/loader.py:4 imports kernels.tokenwise.norm (data -> kernels)"]


# kernels/ at its top level: only what every group of kernels shares; each kernel and its torch reference sit in the
# subpackage of what they serve (kernels/__init__.py lists them), so the folder shows the architecture.
KERNELS_TOP_LEVEL = {"__init__.py", "config.py", "installed.py", "registry.py"}


def ungrouped_kernels(root: Path) -> list[str]:
    """What breaks the grouping of kernels/: a file at its top level beyond ``KERNELS_TOP_LEVEL``, or a folder under
    it that is not a package."""
    top = root / "kernels"
    found = [f"kernels/{p.name}: a kernel file at the top level; put it in the subpackage it serves"
             for p in sorted(top.iterdir()) if p.is_file() and p.name not in KERNELS_TOP_LEVEL]
    return found + [f"{p.relative_to(root)}/ has no __init__.py" for p in sorted(top.rglob("*"))
                    if p.is_dir() and p.name != "__pycache__" and not (p / "__init__.py").is_file()]


def test_kernels_sit_in_subpackages_by_what_they_serve() -> None:
    assert KERNELS_TOP_LEVEL <= {p.name for p in (ROOT / "kernels").iterdir()}
    assert sum(1 for p in (ROOT / "kernels").iterdir() if (p / "__init__.py").is_file()) >= 2  # the groups
    ungrouped = ungrouped_kernels(ROOT)
    assert not ungrouped, "kernels/ out of its groups:\n" + "\n".join(ungrouped)


def test_an_ungrouped_kernel_is_caught(tmp_path: Path) -> None:
    (tmp_path / "kernels" / "moe" / "deep").mkdir(parents=True)
    (tmp_path / "kernels" / "loss").mkdir()
    for name in (*KERNELS_TOP_LEVEL, "triton_norm.py", "moe/__init__.py", "moe/permute.py"):
        (tmp_path / "kernels" / name).write_text("")
    assert ungrouped_kernels(tmp_path) == [
        "kernels/triton_norm.py: a kernel file at the top level; put it in the subpackage it serves",
        "kernels/loss/ has no __init__.py", "kernels/moe/deep/ has no __init__.py"]


def test_no_script_shadows_a_standard_library_module() -> None:
    # `python scripts/x.py` puts scripts/ first on sys.path: a scripts/tokenize.py would be imported by linecache
    # (through inspect, dataclasses, ...) in place of the standard library's tokenize, breaking every script
    shadowing = sorted(p.name for p in (ROOT / "scripts").glob("*.py") if p.stem in sys.stdlib_module_names)
    assert not shadowing, f"scripts named like standard library modules: {shadowing}; rename them"


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles of the module graph (a -> b when a imports b or a name of b, at any depth), each as its modules in
    order; one per strongly connected component of more than one module."""
    modules = {_module_name(p, root) for p in project_files(root)}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in project_files(root):
        here = _module_name(path, root)
        for _, module in imported_modules(path, root):
            while module and module not in modules:  # ``from a.b import c``: a.b, or a.b.c when c is a module
                module = module.rpartition(".")[0]
            if module and module != here and not here.startswith(module + "."):  # a package's own __init__ is not
                graph[here].add(module)                                           # a cycle of its submodules
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(graph[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return cycles


def test_no_two_modules_import_each_other() -> None:
    cycles = import_cycles(ROOT)
    assert not cycles, "import cycles (break each: one side owns what both need):\n" + "\n".join(map(str, cycles))


def test_an_import_cycle_is_caught(tmp_path: Path) -> None:
    (tmp_path / "parallelisms" / "dispatchers").mkdir(parents=True)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "parallelisms" / "dispatchers" / "__init__.py").write_text("from .base import Dispatcher\n")
    (tmp_path / "parallelisms" / "dispatchers" / "base.py").write_text(
        "def f():\n    from parallelisms.dispatchers.config import DispatcherConfig\n")
    (tmp_path / "parallelisms" / "dispatchers" / "config.py").write_text(
        "from parallelisms.dispatchers.base import dispatcher_class\n")
    assert import_cycles(tmp_path) == [["parallelisms.dispatchers.base", "parallelisms.dispatchers.config"]]


def documented_order(text: str, heading: str) -> list[str]:
    """The layers, top first, in the order the first fenced block after ``heading`` lists them: the layer of each
    line's first word (``DOCUMENTED_FOLDERS``), a layer named on consecutive lines counted once."""
    assert heading in text, f"no heading {heading!r}"
    block = text.split(heading, 1)[1].split("```", 2)[1]  # the fence's language, then the block's lines
    order: list[str] = []
    for line in block.splitlines()[1:]:
        layer = DOCUMENTED_FOLDERS.get(line.split()[0].rstrip(",")) if line[:1].strip() else None
        if layer is not None and order[-1:] != [layer]:
            order.append(layer)
    return order


def test_the_docs_list_the_layers_in_their_order() -> None:
    for doc, heading in DOCUMENTED_LISTS:
        order = documented_order((ROOT / doc).read_text(), heading)
        assert order == list(reversed(LAYERS)), (
            f"{doc}, '{heading}' lists the layers {order}, top first; tests/test_layering.py's LAYERS, the imports "
            f"allowed, is {list(reversed(LAYERS))}: list them in that order")


def test_a_documented_list_out_of_order_is_caught() -> None:
    text = ("## Layers\n\n```\ntrain.py, scripts/   the loop\ntraining/   config\n    continued\n"
            "parallelisms/ x\nmodels/ x\ntraining/data/ x\nkernels/ x\ncore/ x\nconf/ Hydra\n```\n")
    assert documented_order(text, "## Layers") == ["train", "training", "parallelisms", "models", "data", "kernels",
                                                   "core"]
    assert documented_order(text, "## Layers") != list(reversed(LAYERS))
