"""Imports point down: no cycle between gpuscope's parts.

A part is a subpackage (``gpuscope.alerts``, with ``alerts.rules`` in it) or a top-level module
(``gpuscope.snapshot``). Every import counts, wherever it is written: at the top, inside a function
(a lazy import is still a dependency), under ``TYPE_CHECKING``, and in the Python source a module
hands to a child interpreter (``python -c``), which names the module the child imports.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"gpuscope": ROOT / "agent", "gpuscope.exporters": ROOT / "exporters"}
# `import gpuscope.x` or `from gpuscope.x import y` at the start of a line of a string constant.
_IMPORT_IN_TEXT = re.compile(r"^\s*(?:from\s+(gpuscope(?:\.\w+)*)\s+import\s+([\w, ]+)"
                             r"|import\s+(gpuscope(?:\.\w+)*))", re.MULTILINE)

Edge = tuple[str, str]


def _modules() -> list[tuple[str, Path, bool]]:
    """(module name, file, is a package's __init__) for every source file."""
    found = []
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found.append((".".join([package, *parts]), path, is_package))
    return found


def _part(module: str) -> str | None:
    """The part a module belongs to: ``gpuscope.alerts.rules.x`` -> ``alerts``; None for gpuscope."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[0] == "gpuscope" else None


def _imported(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, int]]:
    """Every gpuscope module (or name in one) that ``module`` imports, with its line."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            # `from gpuscope import alerts` imports the part `alerts`.
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in _IMPORT_IN_TEXT.finditer(node.value):
                if match.group(1):
                    out += [(f"{match.group(1)}.{name.strip()}", node.lineno)
                            for name in match.group(2).split(",") if name.strip()]
                else:
                    out.append((match.group(3), node.lineno))
    return [(name, line) for name, line in out if name.startswith("gpuscope.")]


def import_graph() -> dict[Edge, list[str]]:
    """(from part, to part) -> where: "module:line imports name"."""
    edges: dict[Edge, list[str]] = defaultdict(list)
    for module, path, is_package in _modules():
        source = _part(module)
        tree = ast.parse(path.read_text(), str(path))
        for name, line in _imported(tree, module, is_package):
            target = _part(name)
            if source is not None and target is not None and target != source:
                edges[source, target].append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return edges


def cycles(edges: set[Edge]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan), each sorted."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        graph[a].append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def shortest_cycle(start: str, edges: set[Edge]) -> list[str]:
    """The shortest path from ``start`` back to itself (breadth first), as its parts in order."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for a, b in sorted(edges):
                if a != node:
                    continue
                if b == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if b not in came_from:
                    came_from[b] = node
                    following.append(b)
        frontier = following
    return [start]


def test_no_import_cycle_between_parts() -> None:
    graph = import_graph()
    remaining = set(graph)
    problems = []
    for component in cycles(remaining):
        inside = {(a, b) for a, b in remaining if a in component and b in component}
        loop = shortest_cycle(component[0], inside)
        lines = [f"  {a} -> {b}: " + "; ".join(graph[a, b][:3]) for a, b in pairwise(loop)]
        problems.append(f"{' -> '.join(loop)} (among {', '.join(component)})\n" + "\n".join(lines))
    assert not problems, "import cycles between gpuscope's parts:\n" + "\n".join(problems)


def test_finds_a_cycle_and_where_it_is() -> None:
    """The checker itself: a cycle through three parts is found whole, a chain is not a cycle."""
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert cycles({("a", "b"), ("b", "c")}) == []
    two_loops = {("a", "b"), ("b", "a"), ("a", "c"), ("c", "d"), ("d", "a")}
    assert shortest_cycle("a", two_loops) == ["a", "b", "a"]
    assert shortest_cycle("a", {("a", "c"), ("c", "d"), ("d", "a")}) == ["a", "c", "d", "a"]
    tree = ast.parse('from gpuscope.capture import model\nCHILD = """\nfrom gpuscope.cli.x import y\n"""\n'
                     "def f():\n    from ..alerts import engine\n")
    names = [name for name, _ in _imported(tree, "gpuscope.web.app", is_package=False)]
    assert sorted(names) == ["gpuscope.alerts.engine", "gpuscope.capture.model", "gpuscope.cli.x.y"]


# The modules that import pynvml (agent/nvml/__init__.py says why each does); the simulator's fake
# library installs itself under pynvml.
PYNVML_IMPORTERS = {"gpuscope.nvml.boundary", "gpuscope.nvml.decoding", "gpuscope.nvml.errors",
                    "gpuscope.nvml.gpm", "gpuscope.nvml.health", "gpuscope.nvml.mig"}


def test_pynvml_is_imported_by_the_nvml_boundary_only() -> None:
    importers = set()
    for module, path, _ in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name == "pynvml" or name.startswith("pynvml.") for name in names):
                importers.add(module)
    assert {m for m in importers if not m.startswith("gpuscope.simulate.")} == PYNVML_IMPORTERS


# Packages above the exporters: the HTTP side and the wiring that starts everything.
ABOVE_EXPORTERS = ("gpuscope.web", "gpuscope.agent", "gpuscope.cli")


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (an import inside a function counts too)."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_imported_modules_sees_imports_anywhere_in_a_module(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import gpuscope.web.app\ndef f():\n    from gpuscope import web\n")
    assert {"gpuscope.web.app", "gpuscope.web"} <= imported_modules(module)


def test_no_exporter_imports_the_web_side_or_the_wiring() -> None:
    sources = sorted((ROOT / "exporters").rglob("*.py"))
    assert sources, "no exporters found"
    upward = {
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sources for module in imported_modules(path)
        if any(module == above or module.startswith(above + ".") for above in ABOVE_EXPORTERS)
    }
    assert not upward, sorted(upward)
