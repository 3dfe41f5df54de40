"""moelane's import layers, read from the source with `ast`: no import cycle between modules, and no module imports a
layer above its own. Every import counts: `import` and `from ... import`, at module level or inside a function (and
`importlib.import_module` of a literal name).

Layers, low to high; a module may import its own group and the layers below it, and groups of one layer may not
import each other:

    errors, assets
    kernels                  the weight products (one op at every precision) and the quantised formats
    device                   where a model computes: --device parsed, a model's weights moved there
    model                    the model's math, loading a checkpoint, the expert provider seam
    pager                    the seam of the pager: trace.py, plan.py, and the planner both sides run
    pager.live | pager.lab   the store a running model uses | offline work on traces
    moelane.load             loading.py and the package itself: a model with its store, built and attached
    lanes | dist             the engine (its drafters load a draft model through `model`) | experts spread over the
                             ranks of a distributed run (torch.distributed)
    server                   the HTTP server over the engine
    commands                 the command line, and `python -m moelane`
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import moelane

# (groups of module-name prefixes) per layer, low to high; a module belongs to the group of its longest prefix
LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("moelane.errors", "moelane.assets"),),
    (("moelane.kernels",),),
    (("moelane.device",),),
    (("moelane.model",),),
    (("moelane.pager",),),
    (("moelane.pager.live",), ("moelane.pager.lab",)),
    (("moelane.loading", "moelane"),),  # ("moelane" is the package's __init__ only, not a prefix of every module)
    (("moelane.lanes",), ("moelane.dist",)),
    (("moelane.server",),),
    (("moelane.commands", "moelane.__main__"),),
)
Graph = dict[str, set[str]]


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under `root` (a package's own module is its __init__.py), by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The modules of `known` that module `name` (its source at `path`) imports."""

    def resolve(target: str) -> str | None:  # the module itself, or the package that holds the imported name
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "importlib.import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                targets = [arg.value]
        for target in targets:
            if (module := resolve(target)) is not None and module != name:
                yield module


def import_graph(root: Path, package: str) -> Graph:
    known = modules(root, package)
    return {name: set(imported(name, path, known)) for name, path in known.items()}


def group_of(module: str, layers: tuple[tuple[tuple[str, ...], ...], ...] = LAYERS) -> tuple[int, int] | None:
    """(layer, group) of a module: that of its longest matching prefix (the bare package name matches only itself)."""
    best: tuple[int, int, int] | None = None
    for rank, groups in enumerate(layers):
        for index, prefixes in enumerate(groups):
            for prefix in prefixes:
                top = "." not in prefix
                if (module == prefix or (not top and module.startswith(prefix + "."))) and (
                    best is None or len(prefix) > best[0]
                ):
                    best = (len(prefix), rank, index)
    return None if best is None else best[1:]


def cycles(graph: Graph) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module, as a path round it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(path_round([v, *component], graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def path_round(component: list[str], graph: Graph) -> list[str]:
    """A cycle through the component's first module, for the message (`a -> b -> a`)."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError("a strongly connected component has a cycle through each member")


def violations(graph: Graph, layers: tuple[tuple[tuple[str, ...], ...], ...] = LAYERS) -> list[str]:
    """Each import that reaches up a layer or across to a sibling group, and each module that has no layer."""
    out = [f"{m} has no layer: add it to LAYERS" for m in sorted(graph) if group_of(m, layers) is None]
    for module in sorted(graph):
        for target in sorted(graph[module]):
            here, there = group_of(module, layers), group_of(target, layers)
            if here is None or there is None:
                continue
            if there[0] > here[0]:
                out.append(f"{module} imports {target}, a higher layer")
            elif there[0] == here[0] and there[1] != here[1]:
                out.append(f"{module} imports {target}, a sibling it must not know")
    return out


SOURCE = Path(moelane.__file__).parent


def test_moelane_has_no_import_cycle() -> None:
    assert [" -> ".join(c) for c in cycles(import_graph(SOURCE, "moelane"))] == []


def test_no_module_imports_a_higher_layer_or_a_sibling() -> None:
    graph = import_graph(SOURCE, "moelane")
    assert {"moelane.pager.live.store", "moelane.pager.lab.replay", "moelane.commands.run"} <= set(graph)
    assert violations(graph) == []


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("where", ["module", "function"])
def test_the_checks_find_a_planted_cycle_and_upward_and_sideways_imports(tmp_path: Path, where: str) -> None:
    """The same checks over a tiny package with one of each fault, at module level or inside a function."""

    def imports(line: str) -> str:
        return line + "\n" if where == "module" else f"def f():\n    {line}\n"

    write(tmp_path, {
        "__init__.py": "",
        "errors.py": imports("from moelane.model import lm"),  # up a layer
        "model/__init__.py": "",
        "model/lm.py": imports("from . import load"),  # lm -> load -> lm
        "model/load.py": imports("import moelane.model.lm"),
        "pager/__init__.py": "",
        "pager/live/__init__.py": "",
        "pager/live/store.py": imports("from moelane.pager.lab.replay import replay"),  # across to a sibling
        "pager/lab/__init__.py": "",
        "pager/lab/replay.py": imports("from moelane.pager import trace"),  # down: allowed
        "pager/trace.py": imports("import importlib; importlib.import_module('moelane.server')"),  # up, dynamically
        "server/__init__.py": "",
        "commands/__init__.py": imports("from moelane.pager.live import store"),  # down: allowed
        "stray.py": "",  # in no layer
    })  # fmt: skip
    graph = import_graph(tmp_path, "moelane")
    assert [" -> ".join(c) for c in cycles(graph)] == ["moelane.model.lm -> moelane.model.load -> moelane.model.lm"]
    assert violations(graph) == [
        "moelane.stray has no layer: add it to LAYERS",
        "moelane.errors imports moelane.model.lm, a higher layer",
        "moelane.pager.live.store imports moelane.pager.lab.replay, a sibling it must not know",
        "moelane.pager.trace imports moelane.server, a higher layer",
    ]
