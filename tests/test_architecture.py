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


# ---------------------------------------------------------------------------- error messages
# Below the CLI a UserError names a setting with `errors.setting`, never as a flag: a library
# caller reads the parameter's name, a command-line user the flag (`UserError.for_cli`).

LIBRARY = ("flexevict/api.py", "flexevict/runtime", "flexevict/planner", "flexevict/evaluation",
           "flexevict/jobs", "flexevict/io", "flexevict/core", "policies")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"`(?:python|pip|ray) [^`]*`")   # a shell command to run, with its flags
ERRORS = {"UserError", "DoesNotFit", "RowError"}   # RowError's reason becomes a UserError's


def library_files() -> list[str]:
    out = []
    for entry in LIBRARY:
        path = os.path.join(ROOT, entry)
        if path.endswith(".py"):
            out.append(entry)
            continue
        for folder, _, files in os.walk(path):
            out += sorted(os.path.relpath(os.path.join(folder, f), ROOT) for f in files
                          if f.endswith(".py"))
    return out


def message_text(node: ast.AST) -> str:
    """The literal text of a message expression in source order: string constants and the
    literal parts of f-strings (implicit concatenation is one node already)."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else ""
    return "".join(message_text(child) for child in ast.iter_child_nodes(node))


def flags_in_errors(path: str) -> list[str]:
    """'file:line: flags' for each error call whose message text names a flag."""
    found = []
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read(), path)):
        if isinstance(node, ast.Call) and getattr(node.func, "id",
                                                  getattr(node.func, "attr", None)) in ERRORS:
            text = "\n".join(message_text(a) for a in [*node.args,
                                                       *(k.value for k in node.keywords)])
            flags = FLAG.findall(COMMAND.sub("", text))
            if flags:
                found.append(f"{path}:{node.lineno}: {' '.join(flags)}")
    return found


@pytest.mark.parametrize("path", library_files())
def test_library_errors_name_settings_not_flags(path):
    """`--budget-tokens` in a library message is the CLI's word: write
    f"{setting('budget_tokens')}" (errors.FLAGS for a flag that is not the name with dashes)."""
    assert not flags_in_errors(path), flags_in_errors(path)


def test_the_flag_finder_finds_flags_and_lets_commands_be():
    tree = ast.parse('raise UserError(f"--top-p {x} must be <= 1; run `pip install --no-deps y` '
                     'or `python -m flexevict.calibrate --out FILE`, not x--y")')
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call))
    text = message_text(call.args[0])
    assert FLAG.findall(COMMAND.sub("", text)) == ["--top-p"]


def test_one_error_reads_as_names_in_the_library_and_as_flags_in_the_cli():
    from flexevict.errors import UserError
    from test_cli import run                     # the bench CLI's main, in this process
    from flexevict.policies.registry import get_policy
    from flexevict.runtime.placement import Placement
    with pytest.raises(UserError) as e:
        Placement.from_percent([100, 0, 50, 60, 100, 0])
    message = str(e.value)
    assert message.startswith("percent for cache: GPU 50 + CPU 60") and "--" not in message
    with pytest.raises(UserError) as e:
        get_policy("streaming", budget=0.5, sinks=-1)       # a FLAGS entry: --policy-arg
    assert str(e.value).startswith("policy_args sinks must be >= 0") and "--" not in str(e.value)
    for argv, flag in ((["--percent", "100", "0", "50", "60", "100", "0"],
                        "--percent for cache: GPU 50 + CPU 60"),
                       (["--policy", "streaming", "--budget", "0.5", "--policy-arg", "sinks=-1"],
                        "--policy-arg sinks must be >= 0")):
        proc = run("bench", "--model", "opt-125m", *argv)
        assert proc.returncode == 2, proc.stderr
        assert f"flexevict.bench: error: {flag}" in proc.stderr, proc.stderr


CLI_MODULES = ("flexevict.generate", "flexevict.eval", "flexevict.plan", "flexevict.calibrate",
               "flexevict.convert", "flexevict.bench.throughput", "flexevict.bench.kernels")


def cli_flags() -> set[str]:
    """Every --flag the command-line tools define (their parsers, built by `--help`)."""
    import argparse
    import contextlib
    import importlib
    import io
    from unittest import mock
    flags, add = set(), argparse._ActionsContainer.add_argument

    def record(self, *names, **kwargs):
        flags.update(n for n in names if n.startswith("--"))
        return add(self, *names, **kwargs)
    with mock.patch.object(argparse._ActionsContainer, "add_argument", record):
        for module in CLI_MODULES:
            with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit):
                importlib.import_module(module).main(["--help"])
    return flags


def test_every_setting_a_library_message_names_is_a_flag_of_the_cli():
    """`setting("x")` reads as `as_flag("x")` on the command line: a flag the CLI has (else an
    errors.FLAGS entry is missing)."""
    from flexevict.errors import as_flag
    named = {}
    for path in library_files():
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read(), path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setting" and \
                    node.args and isinstance(node.args[0], ast.Constant):
                named.setdefault(node.args[0].value, f"{path}:{node.lineno}")
    assert len(named) > 20
    flags = cli_flags()
    assert {"--percent", "--policy-arg", "--no-weight-cache", "--compress-cache"} <= flags
    missing = {f"{where}: setting({name!r}) -> {as_flag(name)}" for name, where in named.items()
               if as_flag(name) not in flags}
    assert not missing, sorted(missing)


# ---------------------------------------------------------------------------- signatures
# A function that needs more than 8 parameters takes the dataclass they belong to instead
# (a kernel call takes its buffer and layout, a run its Placement), as the C++ binding does.
MAX_PARAMETERS = 8


def wide_functions(path: str) -> list[str]:
    """'file:line name(n)' for each function of `path` with more than MAX_PARAMETERS
    parameters (self and cls not counted; *args and **kwargs count one each)."""
    found = []
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read(), path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            n = len(names) - (names[:1] in (["self"], ["cls"])) + bool(a.vararg) + bool(a.kwarg)
            if n > MAX_PARAMETERS:
                found.append(f"{path}:{node.lineno} {node.name}({n})")
    return found


def test_no_function_takes_more_than_eight_parameters():
    files = [os.path.relpath(os.path.join(folder, f), ROOT)
             for top in ("flexevict", "policies", "bench")
             for folder, _, names in os.walk(os.path.join(ROOT, top))
             if "__pycache__" not in folder
             for f in names if f.endswith(".py")]
    assert len(files) > 50
    assert [w for f in files for w in wide_functions(f)] == []


def test_the_signature_check_counts_parameters(tmp_path):
    (tmp_path / "m.py").write_text("class A:\n    def f(self, a, b, c, d, e, f, g, h): pass\n"
                                   "def g(a, b, c, d, e, f, g, *h, i=1): pass\n")
    assert wide_functions(str(tmp_path / "m.py")) == [f"{tmp_path / 'm.py'}:3 g(9)"]


def calls_of(name: str) -> dict[str, list[str]]:
    """Where the library calls a function or method `name`: module -> the functions (dotted
    within the module) whose bodies call it, outside the policies package that defines it."""
    found = {}
    for module, path in modules().items():
        if module.startswith("flexevict.policies") or module in EXTENSIONS:
            continue
        tree = ast.parse(open(path).read(), path)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                callee = node.func if isinstance(node, ast.Call) else None
                if getattr(callee, "attr", getattr(callee, "id", None)) == name:
                    found.setdefault(module, []).append(fn.name)
    return {m: sorted(set(f)) for m, f in found.items()}


def test_the_decode_step_around_a_policy_has_one_copy_and_the_calibration_times_it():
    """The policy's decode hooks are called around attention in one function, the model's
    `cache_attention`; the calibration prices a policy through it, never through a copy of it
    (the kernels bench times `after_attention` alone, on purpose)."""
    assert calls_of("before_attention") == {"flexevict.core.model": ["cache_attention"]}
    assert calls_of("after_attention") == {"flexevict.core.model": ["cache_attention"],
                                          "flexevict.bench.kernels": ["cascade_op"]}
    assert "_policy_decode" in calls_of("cache_attention")["flexevict.planner.calibration"]
