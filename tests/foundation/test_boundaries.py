"""The layout's boundaries, read from the code's own imports (every ``import`` statement, at module level or inside a
function): the shared libraries never import a service; a service imports only itself and the shared libraries;
the model code never imports the kernels (it reaches them through the op interface of a backend)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) of every import statement in ``path`` (relative imports resolved)."""
    out, package = [], module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                out.append((node.lineno, node.module or ""))
    return out


def modules(top: Path, prefix: str) -> list[tuple[Path, str]]:
    found = []
    for path in sorted(top.rglob("*.py")):
        rel = path.relative_to(top).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        found.append((path, ".".join([prefix, *parts])))
    return found


def violations(top: Path, prefix: str, forbidden) -> list[str]:
    bad = []
    for path, module in modules(top, prefix):
        for line, target in imports(path, module):
            why = forbidden(module, target)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target} ({why})")
    return bad


def test_the_shared_libraries_never_import_a_service() -> None:
    def forbidden(module: str, target: str) -> str | None:
        return "libs must not depend on services" if target.split(".")[0] == "services" else None

    bad = violations(ROOT / "libs" / "deepinfer", "deepinfer", forbidden)
    assert not bad, "\n".join(bad)


def test_services_never_import_each_other() -> None:
    def forbidden(module: str, target: str) -> str | None:
        parts, own = target.split("."), module.split(".")[:2]
        if parts[0] == "services" and len(parts) > 1 and parts[:2] != own:
            return "each service owns its code; what two services share belongs in libs/deepinfer"
        return None

    bad = violations(ROOT / "services", "services", forbidden)
    assert not bad, "\n".join(bad)


def test_the_model_code_never_imports_the_kernels() -> None:
    def forbidden(module: str, target: str) -> str | None:
        if target == "deepinfer.kernels" or target.startswith("deepinfer.kernels."):
            return "models reach the kernels through a backend's ops"
        return None

    bad = violations(ROOT / "libs" / "deepinfer" / "models", "deepinfer.models", forbidden)
    assert not bad, "\n".join(bad)


def test_the_scan_sees_imports() -> None:
    """The checks above would pass on a scan that finds nothing: it finds this file's own imports."""
    found = {t for _, t in imports(Path(__file__), "foundation.test_boundaries")}
    assert {"ast", "pathlib", "__future__"} <= found
