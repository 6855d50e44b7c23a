"""The project's import graph, read from the source with ``ast``, and the layering rules it must
keep (DESIGN.md, Layout): no import circle between modules, package arrows one way only.

Every import statement counts: top-level, inside a function, under ``if TYPE_CHECKING:``
(an import that only type checkers run still ties the modules together for a reader). Imports
by string (``importlib.import_module(name)``) are not seen.

Package order, lowest first (:data:`LAYERS`): a package may import any package on a lower
layer, never one on its own layer (prefill_worker and decode_worker are peers) or above.
:data:`FORBIDDEN_EXTERNAL` names what a package never imports (engine: neither Ray nor gRPC).

The checks are pure functions of an edge list, so a test can feed them a made-up graph.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

LAYERS: tuple[tuple[str, ...], ...] = (
    ("engine",), ("kv_transfer",), ("rank",), ("prefill_worker", "decode_worker"),
    ("orchestrator",))
PACKAGES: tuple[str, ...] = tuple(p for layer in LAYERS for p in layer)
LEVEL: dict[str, int] = {p: i for i, layer in enumerate(LAYERS) for p in layer}
ARROWS = " -> ".join(layer[0] if len(layer) == 1 else "{" + ", ".join(layer) + "}"
                     for layer in reversed(LAYERS))
FORBIDDEN_EXTERNAL: dict[str, frozenset[str]] = {"engine": frozenset({"ray", "grpc"})}


@dataclass(frozen=True)
class Edge:
    """``source`` (a project module) imports ``target`` at ``line``.

    ``target`` is the project module imported (the deepest one that exists: ``from a import
    b`` names module ``a.b`` when there is one, else ``a``), or, for a module outside the
    project, its dotted name as written.
    """

    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def package_of(module: str) -> str:
    """Top-level package of a dotted module name."""
    return module.split(".", 1)[0]


def find_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages`` under ``root``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """Absolute name of a (possibly relative) ``from``-import's module."""
    if level == 0:
        return name or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: Mapping[str, Path] | set[str]) -> list[str]:
    """The modules one import statement names (see :class:`Edge` for ``target``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _resolve(module, is_package, node.level, node.module)
    out = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return list(dict.fromkeys(out))


def edges_of(source: str, module: str, is_package: bool,
             known: Mapping[str, Path] | set[str]) -> list[Edge]:
    """Every import of one module's ``source`` text (the whole tree, not only the top)."""
    edges = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges += [Edge(module, t, node.lineno)
                      for t in _targets(node, module, is_package, known)]
    return edges


def scan(root: Path, packages: Iterable[str] = PACKAGES) -> list[Edge]:
    """Every import edge of every module of ``packages`` under ``root``."""
    modules = find_modules(root, packages)
    edges = []
    for module, path in modules.items():
        edges += edges_of(path.read_text(), module, path.name == "__init__.py", modules)
    return edges


def cycles(edges: Iterable[Edge], modules: Iterable[str]) -> list[list[str]]:
    """Import circles between ``modules``: one module path per strongly connected group of
    two or more modules, ``[a, b, ..., a]``, each a real circle of edges."""
    nodes = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in nodes}
    for e in edges:
        if e.source in nodes and e.target in nodes and e.source != e.target:
            graph[e.source].add(e.target)
    return sorted(_circle_in(group, graph) for group in _groups(graph) if len(group) > 1)


def _groups(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of ``graph`` (Tarjan, iterative), in sorted node order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def _circle_in(group: list[str], graph: Mapping[str, set[str]]) -> list[str]:
    """A shortest circle through the group's first module (breadth-first inside the group)."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in its own group {group}")


def wrong_way(edges: Iterable[Edge]) -> list[str]:
    """Imports against the package order (:data:`LAYERS`) and of forbidden outside packages
    (:data:`FORBIDDEN_EXTERNAL`), one line each naming the module and the line."""
    problems = []
    for e in edges:
        src, dst = package_of(e.source), package_of(e.target)
        if src not in LEVEL:
            continue
        if dst in LEVEL and dst != src and LEVEL[dst] >= LEVEL[src]:
            why = "peers never import each other" if LEVEL[dst] == LEVEL[src] else \
                f"{dst} is above {src}"
            problems.append(f"{e} ({why}; arrows: {ARROWS})")
        if dst in FORBIDDEN_EXTERNAL.get(src, ()):
            problems.append(f"{e} ({src} never imports {dst})")
    return problems
