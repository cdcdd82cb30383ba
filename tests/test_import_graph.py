"""No import circle between modules, counting every import: the ones inside functions and under
TYPE_CHECKING as well, which import-linter's package layers do not see between modules of one package."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("leap_core", "leap_io", "serving", "harness", "registry", "store", "training", "flows", "ops", "leap_cli")
STUDIES = ("study_harness", "evaluation", "experiments", "study_cli")


def module_files() -> dict[str, Path]:
    """Every module of the product and the studies by dotted name (a package by its own name)."""
    files: dict[str, Path] = {}
    for base, packages in ((REPO, PRODUCT), (REPO / "studies", STUDIES)):
        for package in packages:
            for path in sorted((base / package).rglob("*.py")):
                parts = list(path.relative_to(base).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                files[".".join(parts)] = path
    return files


def imported_names(source: str, module: str, is_package: bool) -> Iterable[str]:
    """Every dotted name an import statement anywhere in `source` can bind, relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a import b` reaches a.b when b is a module, else a)."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, (source, is_package) in sources.items():
        for target in imported_names(source, name, is_package):
            while target and target not in sources:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module: each is an import circle."""
    names = sorted(graph)
    index = {name: i for i, name in enumerate(names)}
    edges = [(index[a], index[b]) for a in names for b in graph[a]]
    rows, cols = zip(*edges) if edges else ((), ())
    adjacency = csr_matrix((np.ones(len(edges)), (rows, cols)), shape=(len(names), len(names)))
    _, labels = connected_components(adjacency, directed=True, connection="strong")
    groups: dict[int, list[str]] = {}
    for name, label in zip(names, labels):
        groups.setdefault(int(label), []).append(name)
    return [group for group in groups.values() if len(group) > 1]


def test_no_module_imports_itself_back_through_others() -> None:
    files = module_files()
    assert len(files) > 200 and "serving.plugin" in files and "evaluation.report" in files
    sources = {name: (path.read_text(encoding="utf-8"), path.name == "__init__.py") for name, path in files.items()}
    found = circles(import_graph(sources))
    assert found == [], f"import circles: {found}"


def test_the_check_finds_a_circle_hidden_inside_a_function() -> None:
    sources = {
        "pkg": ("", True),
        "pkg.a": ("from pkg.b import thing\n", False),
        "pkg.b": ("def thing():\n    from . import c\n", False),
        "pkg.c": ("import pkg.a\n", False),
        "pkg.d": ("from pkg import a\n", False),
    }
    assert circles(import_graph(sources)) == [["pkg.a", "pkg.b", "pkg.c"]]
