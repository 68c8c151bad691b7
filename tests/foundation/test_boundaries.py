"""The layout's boundaries, read from the code's own imports (every ``import`` statement, at module level or inside a
function): the shared libraries never import a service; a service imports only itself and the shared libraries;
the model code never imports the kernels (it reaches them through the op interface of a backend) nor a backend; the
backend folders never import each other (but nvidia and ascend build on the reference op set); the engine imports
no DeepSeek model package (it reaches a model through its family); the kernels import nothing of the engine; the
benchmarks never import from tests/ (tests may import bench/)."""

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


def test_the_model_code_never_imports_a_backend() -> None:
    """The model talks to the op interface (``deepinfer.ops``: ``Ops``, ``get_ops``) only; which op set runs it is the
    engine's choice (``deepinfer.backends``)."""

    def forbidden(module: str, target: str) -> str | None:
        if target == "deepinfer.backends" or target.startswith("deepinfer.backends."):
            return "models call the op interface (deepinfer.ops), never a backend"
        return None

    bad = violations(ROOT / "libs" / "deepinfer" / "models", "deepinfer.models", forbidden)
    assert not bad, "\n".join(bad)


# the backend folders each backend folder may import: the nvidia and ascend op sets subclass ReferenceOps
BACKENDS_BUILT_ON = {"nvidia": {"reference"}, "ascend": {"reference"}, "reference": set()}


def test_the_backends_never_import_each_other() -> None:
    """Each backend folder owns its ops; only the reference op set is shared, as the base the nvidia and ascend op sets
    subclass (``NvidiaOps(..., ReferenceOps)``, ``AscendOps(ReferenceOps)``)."""
    top = ROOT / "libs" / "deepinfer" / "backends"
    folders = {p.name for p in top.iterdir() if (p / "__init__.py").is_file()}
    assert set(BACKENDS_BUILT_ON) == folders, "every backend folder has an entry in BACKENDS_BUILT_ON"

    def forbidden(module: str, target: str) -> str | None:
        own, parts = module.split(".")[2:3], target.split(".")
        if not own or parts[:2] != ["deepinfer", "backends"] or len(parts) < 3 or parts[2] not in folders:
            return None
        if parts[2] != own[0] and parts[2] not in BACKENDS_BUILT_ON[own[0]]:
            return f"the {own[0]} backend must not import the {parts[2]} backend"
        return None

    bad = violations(top, "deepinfer.backends", forbidden)
    assert not bad, "\n".join(bad)


def test_the_engine_imports_no_model_package() -> None:
    """The engine knows a model through its family (``engine/model_api.py``, looked up by ``model_type`` in
    ``engine/models.py``): no module of ``deepinfer.engine`` imports a DeepSeek model package, so V4 and V4.1 plug in
    as any other model would."""

    def forbidden(name: str) -> bool:  # deepinfer.models.deepseek_v4*, deepinfer.models.deepseek_v41*
        parts = name.split(".")
        return parts[:2] == ["deepinfer", "models"] and len(parts) > 2 and parts[2].startswith("deepseek_v4")

    found = [
        (path, line, module, name)
        for path, module in modules(ROOT / "libs" / "deepinfer" / "engine", "deepinfer.engine")
        for line, name in imported_names(path, module)  # ``from deepinfer.models import deepseek_v4`` included
    ]
    assert len({module for _, _, module, _ in found}) > 15, "the scan sees the engine"
    why = "the engine reaches a model through its family (engine.model_api, engine.models)"
    bad = [f"{p.relative_to(ROOT)}:{line}: {m} imports {n} ({why})" for p, line, m, n in found if forbidden(n)]
    assert not bad, "\n".join(bad)


def imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, name) of what every import statement of ``path`` brings in: ``import a.b`` is ``a.b`` and ``from a
    import b`` is ``a.b`` (so ``from deepinfer import envs`` is ``deepinfer.envs``; relative imports resolved)."""
    out, package = [], module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def test_the_kernels_import_nothing_of_the_engine() -> None:
    """The kernels (the top-level ``kernels/``, installed as ``deepinfer.kernels``) import nothing of ``deepinfer`` but
    ``deepinfer.kernels``: what a kernel needs of the engine (a setting, a reference op) its caller hands it, and the
    number formats they compute in are defined with them (``kernels/formats.py``)."""

    def forbidden(name: str) -> str | None:
        parts = name.split(".")
        if parts[0] == "deepinfer" and parts[1:2] != ["kernels"]:
            return "the kernels import nothing of the engine"
        if parts[0] == "kernels":
            return "the kernels are deepinfer.kernels"
        return None

    found = [
        (path, line, module, name)
        for path, module in modules(ROOT / "kernels", "deepinfer.kernels")
        for line, name in imported_names(path, module)
    ]
    assert len({module for _, _, module, _ in found}) > 30, "the scan sees the kernels"
    bad = [f"{p.relative_to(ROOT)}:{line}: {m} imports {n} ({why})" for p, line, m, n in found if (why := forbidden(n))]
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_kernels_folder_by_its_name() -> None:
    """``kernels/`` is the package ``deepinfer.kernels``: imported as a top-level ``kernels`` (the repository's root is
    on the path in a source checkout) its modules would load a second time, with their own state."""

    def forbidden(module: str, target: str) -> str | None:
        return "import deepinfer.kernels" if target.split(".")[0] == "kernels" else None

    tops = [("libs/deepinfer", "deepinfer"), ("kernels", "deepinfer.kernels"), ("services", "services")]
    tops += [("bench", "bench"), ("tests", "tests")]
    bad = [b for folder, prefix in tops for b in violations(ROOT / folder, prefix, forbidden)]
    assert not bad, "\n".join(bad)


def _depth(root: Path, parts: list[str]) -> int:
    """How many leading parts of a dotted name lie under ``root`` as a package folder or a module file."""
    depth = 0
    for i in range(1, len(parts) + 1):
        path = root.joinpath(*parts[:i])
        if not (path.is_dir() or path.with_suffix(".py").is_file()):
            break
        depth = i
    return depth


def _loads(path: Path, module: str) -> list[tuple[int, str]]:
    """What ``path`` may load: every import statement's module, ``x.y`` of each ``from x import y``, the module
    named in ``import_module("...")`` / ``__import__("...")``, and any string outside a docstring that is a path
    into tests/ (``"tests"``, ``"tests/..."``)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    out = imports(path, module)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
            "import_module",
            "__import__",
        ):
            out += [(node.lineno, a.value) for a in node.args[:1] if isinstance(a, ast.Constant)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value == "tests" or node.value.startswith("tests/"):
                out.append((node.lineno, "tests"))
    return out


def test_bench_never_imports_tests() -> None:
    """bench/ runs with ``PYTHONPATH=libs:.``, tests/ off the path: what a benchmark and a test both need lives in
    libs/deepinfer (what the product offers, e.g. the reference models) or in bench/ (which tests may import), never
    in tests/. A name bench loads that resolves deeper under tests/ than under the repository's root or libs/ is one
    (``models.*``, ``serving.*``, ``conftest``, and ``bench.smoke_support``: tests/bench joins the namespace package
    ``bench``), and so is a helper module of tests/ by its own name (``smoke_support``), ``tests.*`` or a path into
    tests/."""
    tests = ROOT / "tests"
    # the tests' helper modules, top-level names where pytest puts their folder on the path (smoke_support, mesh, ...)
    helpers = {p.stem for p in tests.rglob("*.py") if not p.name.startswith("test_")}

    def forbidden(module: str, target: str) -> str | None:
        parts = target.split(".")
        ours = max(_depth(ROOT, parts), _depth(ROOT / "libs", parts))
        if parts[0] == "tests" or _depth(tests, parts) > ours or (parts[0] in helpers and not ours):
            return "code bench and tests share belongs in libs/deepinfer or bench/, never in tests/"
        return None

    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module} loads {target} ({why})"
        for path, module in modules(ROOT / "bench", "bench")
        for line, target in _loads(path, module)
        if (why := forbidden(module, target))
    ]
    assert not bad, "\n".join(bad)


def test_the_scan_sees_imports() -> None:
    """The checks above would pass on a scan that finds nothing: it finds this file's own imports."""
    found = {t for _, t in imports(Path(__file__), "foundation.test_boundaries")}
    assert {"ast", "pathlib", "__future__"} <= found
