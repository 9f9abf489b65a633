"""The package's import graph has no cycle.

Importing every module in a fresh interpreter in each order is not enough (a function-local
import hides a cycle until the function runs), so this reads the graph from the source: every
import statement, at module level or inside a function, and the parent packages that importing
a submodule runs first (`import flexevict.core.kernels.quant` executes
`flexevict/core/kernels/__init__.py`).
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"flexevict": "flexevict", "flexevict.policies": "policies"}   # setup.py package_dir
EXTENSIONS = {"flexevict._C": "(compiled from cuda/)"}    # setup.py ext_modules: no imports


def modules() -> dict[str, str]:
    """Dotted module name -> source file, for every module of the installed packages."""
    out = {}
    for package, folder in PACKAGES.items():
        for path, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(path, f), os.path.join(ROOT, folder))
                    name = rel[:-3].replace(os.sep, ".").removesuffix("__init__").rstrip(".")
                    out[f"{package}.{name}".rstrip(".")] = os.path.join(path, f)
    return out | EXTENSIONS


def imported(module: str, path: str, known: dict) -> set[str]:
    """The known modules that `module` imports: each module an import statement names (a
    package counts when a name is taken from it that is not a submodule, e.g. a registry
    function), plus the parent packages that importing it runs first, except `module`'s own
    ancestors (Python runs those before `module` anyway)."""
    base = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = base.split(".")
            parent = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            origin = ".".join(p for p in (parent, node.module) if p)
            for a in node.names:
                sub = f"{origin}.{a.name}"
                named.add(sub if sub in known else origin)
    found = set()
    for name in named & set(known):
        found.add(name)
        parts = name.split(".")
        found |= {p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                  if not module.startswith(p + ".")}
    return found - {module}


def cycles(graph: dict[str, set]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    known = modules()
    graph = {m: set() if m in EXTENSIONS else imported(m, p, known) for m, p in known.items()}
    assert len(graph) > 40 and graph["flexevict.runtime.generation"]          # the graph is real
    assert cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("source,expected", [
    ("from . import engine", {"flexevict.runtime.engine"}),
    ("def f():\n    from ..core.kernels.quant import Packed4bit", {
        "flexevict.core", "flexevict.core.kernels", "flexevict.core.kernels.quant"}),
    ("from . import register", {"flexevict.runtime"}),      # a name from the parent package
    ("import flexevict.runtime.engine as E", {"flexevict.runtime.engine"}),
])
def test_function_local_and_parent_imports_count(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    known = {"flexevict": "", "flexevict.runtime": "", "flexevict.runtime.engine": "",
             "flexevict.core": "", "flexevict.core.kernels": "", "flexevict.core.kernels.quant": "",
             "flexevict.runtime.m": str(path)}
    assert imported("flexevict.runtime.m", str(path), known) == expected


# What each library package may import (its __init__ docstring says the same): the layers
# below the command-line modules, the API, the bench, jobs and evaluation.
LAYERS = {
    "flexevict.core": {"flexevict.errors", "flexevict._C"},
    "flexevict.policies": {"flexevict.core", "flexevict.errors"},
    "flexevict.io": {"flexevict.core", "flexevict.errors"},
    "flexevict.runtime": {"flexevict.core", "flexevict.errors", "flexevict.io",
                          "flexevict.policies"},
    "flexevict.planner": {"flexevict.core", "flexevict.errors", "flexevict.io",
                          "flexevict.policies", "flexevict.runtime"},
}


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_each_library_package_imports_only_the_layers_below_it():
    known = modules()
    crossing = []
    for module, path in known.items():
        allowed = LAYERS.get(package_of(module))
        if allowed is None or not path.endswith(".py"):
            continue
        for dep in imported(module, path, known):
            if package_of(dep) not in allowed | {package_of(module), "flexevict"}:
                crossing.append(f"{module} imports {dep}")
    assert not crossing, crossing


def test_the_planner_reads_no_command_line():
    """The planner's input is typed (PlacementRequest, Limits, Workload); flags are the CLI's."""
    for path in modules().values():
        if os.sep + "planner" + os.sep in path:
            tree = ast.parse(open(path).read())
            names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                     for a in n.names} | {n.module for n in ast.walk(tree)
                                          if isinstance(n, ast.ImportFrom)}
            assert "argparse" not in names and "flexevict.cli" not in names, path
            assert "args." not in open(path).read(), path


def test_setup_installs_every_package():
    """A package missing from setup.py's list works from the source tree and breaks an
    install (a non-editable pip install, a wheel)."""
    text = open(os.path.join(ROOT, "setup.py")).read()
    listed = set(re.findall(r'"(flexevict(?:\.[a-z_]+)*)"', text.split("packages=")[1]
                            .split("]")[0]))
    found = {"flexevict" + ("." + os.path.relpath(d, os.path.join(ROOT, "flexevict"))
                            .replace(os.sep, ".") if d != os.path.join(ROOT, "flexevict") else "")
             for d, _, files in os.walk(os.path.join(ROOT, "flexevict"))
             if "__init__.py" in files and "__pycache__" not in d}
    assert found <= listed, sorted(found - listed)
