"""``core/torch_compat.py`` is the one place outside ``kernels/`` that names a private torch API (DEVELOPERS.md): a
parse of every other project file, and each shim on the torch that runs the test (CI: 2.13 and 2.11)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.futures import Future
from torch.testing._internal.distributed.fake_pg import FakeStore

from core import torch_compat
from tests.test_layering import ROOT, project_files

pytestmark = pytest.mark.torch_apis  # private torch APIs, by definition

COMPAT = ROOT / "core" / "torch_compat.py"
# Private attributes of torch objects reached through a name of ours (a mesh, a group, a tensor, a module, an op).
PRIVATE_ATTRIBUTES = {"_unflatten", "_flatten", "_concatenate", "_get_backend", "_version", "_base", "_parameters",
                      "_buffers", "_modules", "_schema", "_local_tensor", "_spec", "_StridedShard"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """The root name and the attribute names of ``a.b.c`` (root None where it is not a plain name)."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def private_torch_uses(path: Path) -> list[str]:
    """Each private torch name ``path`` uses, as "line: what"."""
    tree = ast.parse(path.read_text(), filename=str(path))
    torch_names = {"torch"}  # names bound to torch or one of its modules (dist, nn, F, ...)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add(alias.asname or "torch")
                    if any(map(_private, alias.name.split("."))):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            private = [a.name for a in node.names if _private(a.name)]
            if any(map(_private, node.module.split("."))) or private:
                found.append(f"{node.lineno}: from {node.module} import {', '.join(private) or '...'}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root, attrs = _chain(node)
            if root in torch_names or (node.attr in PRIVATE_ATTRIBUTES and root not in ("self", "cls")):
                found.append(f"{node.lineno}: {root or '...'}.{'.'.join(attrs)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in torch_names
              and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value))):
            found.append(f"{node.lineno}: {node.func.id}({node.args[0].id}, {node.args[1].value!r})")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_private_torch_apis_only_in_torch_compat_and_kernels() -> None:
    outside = [p for p in project_files(ROOT) if p != COMPAT and p.relative_to(ROOT).parts[0] != "kernels"]
    uses = {str(p.relative_to(ROOT)): found for p in outside if (found := private_torch_uses(p))}
    assert not uses, f"private torch APIs outside core/torch_compat.py (add a shim there): {uses}"


def test_the_check_sees_each_kind_of_use(tmp_path: Path) -> None:
    source = tmp_path / "uses.py"
    source.write_text("import torch\nimport torch.distributed as dist\nfrom torch.distributed.tensor._utils import f\n"
                      "from torch.distributed.tensor.placement_types import _StridedShard\n"
                      "torch._foreach_mul_([], 1.0)\ndist.distributed_c10d._world\nmesh._concatenate([])\n"
                      "hasattr(torch, '_grouped_mm')\ntorch.__version__\nself._version\ntorch.ops.aten.mm.default\n")
    assert [use.split(":")[0] for use in private_torch_uses(source)] == ["3", "4", "5", "6", "7", "8"]
    assert private_torch_uses(COMPAT)  # what the shims wrap


def test_version() -> None:
    assert torch_compat.MIN_TORCH <= torch_compat.TORCH_VERSION <= torch_compat.MAX_TORCH, torch.__version__
    assert torch.__version__.startswith("{}.{}.".format(*torch_compat.TORCH_VERSION))


def test_premul_sum_factor() -> None:
    factor = torch_compat.premul_sum_factor(dist._make_nccl_premul_sum(2.0))
    assert factor == 2.0 if torch_compat.TORCH_VERSION >= (2, 13) else factor in (None, 2.0)
    assert torch_compat.premul_sum_factor(dist.ReduceOp.SUM) is None


def test_work_from_future() -> None:
    future: Future = Future()
    future.set_result([torch.ones(2)])
    work = torch_compat.work_from_future(future)
    assert work.wait() and work.get_future().value()[0].tolist() == [1.0, 1.0]


def test_mesh_layouts() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
        mesh = torch_compat.unflatten_mesh(world, 0, (2, 2, 2), ("a", "b", "c"))
        assert mesh.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]] and mesh.mesh_dim_names == ("a", "b", "c")
        ac = torch_compat.flatten_mesh(mesh["a", "c"], "ac")
        assert ac.mesh.tolist() == [2, 3, 6, 7] and ac.mesh_dim_names == ("ac",)
        both = torch_compat.concatenate_meshes([ac, mesh["b"]])
        assert both.mesh.tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]] and both.mesh_dim_names == ("ac", "b")
        assert repr(torch_compat.StridedShard(0, split_factor=2)) == "_StridedShard(dim=0, sf=2)"
    finally:
        dist.destroy_process_group()


def test_tensor_and_module_internals() -> None:
    t = torch.zeros(2, 3)
    row = t[0]
    assert torch_compat.view_base(row) is t and torch_compat.view_base(t) is None
    before = torch_compat.version_counter(t)
    row.add_(1)
    assert torch_compat.version_counter(t) == before + 1
    linear = torch.nn.Linear(2, 2, bias=False)
    assert list(torch_compat.own_parameters(linear)) == ["weight", "bias"]  # bias: a None slot
    assert torch_compat.op_schema_name(torch.ops.aten.mm.default) == "aten::mm"
    assert all((torch_compat.PROFILER_RANGE_OPS, torch_compat.SAC_PRIVATE_GEMM_OPS,
                torch_compat.SAC_PRIVATE_ATTENTION_OPS))
