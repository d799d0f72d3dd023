"""Imports point down: no import cycle among the modules of stratacl_jax/ and
benchmarks/, and the supernode model sits below the emulator and the ops.

The graph is read from the source with `ast`, not from a running import: an
import inside a function body is an edge too (a cycle hidden in a function is
still a cycle, only one that fails later, at call time)."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("stratacl_jax", "benchmarks")

SUPERNODE = "stratacl_jax.supernode"
# What the supernode model must not reach, even through other modules: the
# emulator sits above it (and re-exports it), and so do the ops.
ABOVE_SUPERNODE = ("stratacl_jax", "stratacl_jax.emulator", "stratacl_jax.moe", "stratacl_jax.moe._dispatch",
                   "stratacl_jax.moe._combine", "stratacl_jax.moe._across", "stratacl_jax.moe.layer",
                   "stratacl_jax.moe.reference", "stratacl_jax.all_reduce",
                   "stratacl_jax.all_gather", "stratacl_jax.reduce_scatter", "stratacl_jax.all_to_all",
                   "stratacl_jax.broadcast", "stratacl_jax.ppermute", "stratacl_jax.ragged_all_to_all")


def find_modules(root: pathlib.Path, packages=PACKAGES) -> dict:
    """Dotted module name -> path, for every .py under the packages (a
    package's __init__.py is the package's own name)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_package(name: str, modules: dict) -> bool:
    return modules[name].name == "__init__.py"


def _resolve_relative(importer: str, level: int, module: str | None, modules: dict) -> str:
    package = importer if _is_package(importer, modules) else importer.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def imports_of(importer: str, modules: dict) -> set:
    """The project modules `importer` imports, anywhere in its body. Importing
    a.b.c also runs a and a.b: those count too, unless they are packages the
    importer is itself inside (already running when it is imported)."""
    tree = ast.parse(modules[importer].read_text(), filename=str(modules[importer]))
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(importer, node.level, node.module, modules) if node.level
                    else node.module)
            for alias in node.names:
                # `from pkg import x`: the submodule x if there is one, else a name of pkg.
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    edges = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in modules and name != importer and not importer.startswith(name + "."):
                edges.add(name)
    return edges


def import_graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict:
    modules = find_modules(root, packages)
    return {name: imports_of(name, modules) for name in modules}


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan),
    each sorted; a module that imports itself is one too."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
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
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def one_cycle(graph: dict, component: list) -> list:
    """A concrete import loop through the component, start to start."""
    inside = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no loop through {start} in {component}")


def reachable(graph: dict, sources) -> set:
    seen, todo = set(), list(sources)
    while todo:
        v = todo.pop()
        for w in graph[v]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def describe_cycles(graph: dict) -> str:
    return "\n".join(" -> ".join(one_cycle(graph, c)) + f"   (component: {', '.join(c)})"
                     for c in cycles(graph))


def test_no_import_cycles():
    graph = import_graph()
    assert "stratacl_jax.all_reduce" in graph and "benchmarks.collectives" in graph  # the walk found them
    if cycles(graph):
        pytest.fail("import cycles:\n" + describe_cycles(graph), pytrace=False)


def test_supernode_sits_below_emulator_and_ops():
    graph = import_graph()
    supernode = [m for m in graph if m == SUPERNODE or m.startswith(SUPERNODE + ".")]
    assert len(supernode) > 1, f"no modules in {SUPERNODE}"
    bad = {m: sorted(reachable(graph, [m]) & set(ABOVE_SUPERNODE)) for m in supernode}
    bad = {m: above for m, above in bad.items() if above}
    if bad:
        pytest.fail("the supernode model imports (directly or through other modules) what sits above it:\n"
                    + "\n".join(f"{m} -> {', '.join(above)}" for m, above in sorted(bad.items())), pytrace=False)


def _write(root: pathlib.Path, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_walk_sees_every_kind_of_import(tmp_path):
    """The checker itself: a cycle closed by a function-local `from . import`,
    one through `from .x import name` and one through a package's __init__
    are found; a submodule importing its own package's sibling is not a
    cycle with the package."""
    _write(tmp_path, {
        "pkg/__init__.py": "from . import a\n",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def late():\n    from . import a\n",
        "pkg/c.py": "from .d import thing\n",
        "pkg/d.py": "import pkg.c\nthing = 1\n",
        "pkg/sub/__init__.py": "from ..e import f\n",
        "pkg/sub/g.py": "x = 1\n",
        "pkg/e.py": "from .sub import g\nf = 1\n",
        "pkg/h.py": "from .sub.g import x\n",
    })
    graph = import_graph(tmp_path, ("pkg",))
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.e", "pkg.sub"]], describe_cycles(graph)
    assert graph["pkg.h"] == {"pkg.sub", "pkg.sub.g"}  # a submodule's import runs its package too
    assert graph["pkg.sub.g"] == set()
    assert one_cycle(graph, ["pkg.a", "pkg.b"]) == ["pkg.a", "pkg.b", "pkg.a"]
