"""No import cycles among the project's modules: a static scan of ``libs/deepinfer`` (the generated protobuf code in
``libs/deepinfer/v1`` left out), the kernels (the top-level ``kernels/``, installed as ``deepinfer.kernels``) and the
top-level ``services`` package.

Every ``import`` / ``from ... import`` statement counts, wherever it stands (module level, inside a function, under
``if TYPE_CHECKING:``): a module depends on each project module an import names, resolved to the longest module
path that exists (``from deepinfer.kernels import moe`` names ``deepinfer.kernels.moe``; ``from
deepinfer.kernels.moe import moe_triton`` names ``deepinfer.kernels.moe``). A package does not depend on the
modules it contains, nor a module on the packages above it (Python imports those first anyway). A cycle is a
strongly connected group of two or more modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "deepinfer": ROOT / "libs" / "deepinfer",
    "deepinfer.kernels": ROOT / "kernels",
    "services": ROOT / "services",
}
EXCLUDED = [ROOT / "libs" / "deepinfer" / "v1"]  # generated protobuf / gRPC code


def _modules() -> dict[str, Path]:
    """Every module of the scanned packages by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if any(path.is_relative_to(x) for x in EXCLUDED):
                continue
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported_names(name: str, path: Path) -> list[str]:
    """The dotted names every import statement of module ``name`` (file ``path``) may refer to."""
    is_package = path.name == "__init__.py"
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target in _imported_names(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def test_the_scan_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_scan_sees_both_packages() -> None:
    graph = import_graph()
    assert "deepinfer.engine.scheduler" in graph and "services.scheduler" in graph
    assert "deepinfer.kernels.formats" in graph["deepinfer.quant.formats"]  # kernels/, as deepinfer.kernels
    assert not any(m.startswith("deepinfer.v1") for m in graph)
    assert "deepinfer.engine.interfaces" in graph["deepinfer.engine.scheduler"]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    report = "\n".join(f"  {' <-> '.join(group)}" for group in found)
    assert not found, f"{len(found)} import cycle(s) (strongly connected groups of modules):\n{report}"
