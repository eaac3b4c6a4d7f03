"""The layering of the code base (docs/design.md): lower layers never import higher ones, and no two files
import each other, directly or through others. Every import counts, the ones inside functions too: a lazy
import is still a dependency.

Layers, lowest first (a module may import its own layer and the ones below):

    0 core           boomfx/core (Program, devices, errors, units, layer naming)
    1 passes         passes/ (boomfx.passes)
    2 kernels_db     kernels_db/ (boomfx.kernels_db)
    3 memory, simulate
    4 training
    5 frontend       (capture builds training programs)
    6 report         (dataclasses and renderers)
    7 analysis       (the per-point evaluation that fills the Report)
    8 the surfaces   cli, integrations, and the stages built on the analysis (serving, distributed, validate)
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"boomfx": ROOT / "boomfx", "boomfx.passes": ROOT / "passes", "boomfx.kernels_db": ROOT / "kernels_db"}

LAYERS = {
    "boomfx.core": 0,
    "boomfx.passes": 1,
    "boomfx.kernels_db": 2,
    "boomfx.memory": 3, "boomfx.simulate": 3,
    "boomfx.training": 4,
    "boomfx.frontend": 5,
    "boomfx.report": 6,
    "boomfx.analysis": 7,
    "boomfx.cli": 8, "boomfx.integrations": 8, "boomfx.serving": 8, "boomfx.distributed": 8, "boomfx.validate": 8,
}
ROOT_PACKAGE_LAYER = 0   # boomfx/__init__.py: lazy names only (importlib at attribute access, no imports)


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in sorted(directory.rglob("*.py")):
            rel = path.relative_to(directory).with_suffix("")
            parts = list(rel.parts)
            if package == "boomfx" and parts[0] in ("passes", "kernels_db"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """boomfx modules that ``name`` imports (resolved to the deepest existing module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                pkg = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                base = f"{pkg}.{base}" if base else pkg
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != name and target.startswith("boomfx"):
                found.add(target)
    return found


def _layer(name: str) -> Optional[int]:
    if name == "boomfx":
        return ROOT_PACKAGE_LAYER
    best = None
    for prefix, layer in LAYERS.items():
        if name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return best[1] if best else None


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(name for name in MODULES if _layer(name) is None)
    assert not unplaced, f"modules outside every layer (add their package to LAYERS): {unplaced}"


def test_lower_layers_never_import_higher_ones() -> None:
    bad = [f"{src} (layer {_layer(src)}) imports {dst} (layer {_layer(dst)})"
           for src, deps in GRAPH.items() for dst in deps
           if _layer(dst) is not None and _layer(src) is not None and _layer(dst) > _layer(src)]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles_between_files() -> None:
    graph = nx.DiGraph()
    graph.add_nodes_from(GRAPH)
    # a package's __init__ importing its own submodules is a re-export, not a dependency between peers
    graph.add_edges_from((src, dst) for src, deps in GRAPH.items() for dst in deps
                         if not dst.startswith(src + "."))
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, f"files that import each other: {cycles}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The walk counts imports inside functions (they are still dependencies)."""
    assert "boomfx.training.trace" in GRAPH["boomfx.frontend.capture"]      # imported inside _capture
    assert "boomfx.core.program" in GRAPH["boomfx.passes.liveness"]
    assert _layer("boomfx.passes.costs.matmul") == 1 and _layer("boomfx.kernels_db.collectors.conv") == 2


def _module_level_env_reads(tree: ast.Module) -> list[int]:
    """Line numbers of ``os.environ`` / ``os.getenv`` read outside any function or class body."""
    lines = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_environment_read_at_import_time(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text())
    assert not _module_level_env_reads(tree), f"{name} reads the environment when imported"


def test_every_package_is_installed() -> None:
    """pyproject.toml lists each package (a non-editable install ships only those)."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages <= listed, f"packages missing from pyproject.toml: {sorted(packages - listed)}"
