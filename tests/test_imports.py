"""The project's import graph: one-way dependencies (docs/design.md, "Package layout").

Every import statement of every module in ``tagc``, ``fsdp_integration`` and ``gpt2_bench`` is
read with ``ast``, the ones inside functions and ``if TYPE_CHECKING:`` blocks included (a
type-only cycle is still two modules that cannot be read apart), and resolved to the project
module it loads.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.source_tree import ROOT, modules

PACKAGES = ("tagc", "fsdp_integration", "gpt2_bench", "testbed", "backward_drain")
HEAVY = ("datasets", "tiktoken", "matplotlib")  # the experiments' dependencies, never the library's


MODULES = modules(PACKAGES)


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom under ``tree``, at any depth."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _imported_names(module: str, path: Path) -> set[str]:
    """Absolute dotted names ``module`` imports: ``a.b.c`` for ``import a.b.c`` and for
    ``from a.b import c`` when ``c`` is a module, else ``a.b`` (a parent package that only
    holds the module is not counted: every import runs it, it depends on nothing here)."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        submodules = {f"{base}.{alias.name}" for alias in node.names} & set(MODULES)
        names.update(submodules)
        if len(submodules) < len(node.names):
            names.add(base)
    return names


def _project_module(name: str) -> str | None:
    """The project module ``name`` loads (its longest dotted prefix that is one), if any."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


IMPORTS = {module: _imported_names(module, path) for module, path in MODULES.items()}
GRAPH = {module: {t for t in map(_project_module, names) if t is not None and t != module}
         for module, names in IMPORTS.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_walk_sees_the_project():
    assert {"tagc", "tagc.hooks.core.engine", "fsdp_integration.simple_fsdp", "gpt2_bench.train", "testbed.hosts"} <= set(  # noqa: E501
        MODULES
    )
    assert "tagc.kernels.ops" in GRAPH["tagc.kernels.dispatch"]  # a function-level import counts
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize(
    "importer, forbidden",
    [
        (
            "fsdp_integration",
            ("tagc", "gpt2_bench", "testbed"),
        ),  # the FSDP wrapper knows nothing of TAGC: TAGC installs itself
        (
            "tagc",
            ("gpt2_bench", "fsdp_integration", "testbed"),
        ),  # the library knows nothing of its experiments nor of a wrapper
        ("testbed", ("gpt2_bench",)),  # the tooling serves the experiments, never the reverse
        ("backward_drain", ("tagc", "fsdp_integration", "gpt2_bench", "testbed")),  # torch only: both wrappers share it
    ],
)
def test_dependencies_point_one_way(importer, forbidden):
    wrong = sorted(f"{module} imports {name}" for module, names in IMPORTS.items()
                   if module.split(".")[0] == importer for name in names if name.split(".")[0] in forbidden)
    assert wrong == []


def test_kernel_modules_are_leaves():
    """``ops`` and ``dispatch`` import the Triton kernel modules, never the reverse."""
    kernels = {"tagc.kernels.compress", "tagc.kernels.peel", "tagc.kernels.radix_select"}
    for kernel in kernels:
        assert not GRAPH[kernel] & (kernels | {"tagc.kernels.ops", "tagc.kernels.dispatch", "tagc.kernels"}), kernel


def test_import_tagc_loads_no_experiment_dependency():
    code = f"import sys, tagc; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
