"""The tree's layering, read from the source: no import cycle between kestrel's modules or its
packages (lazy imports inside functions count too), and kernels at the bottom (they import
nothing from kestrel)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.joinpath("kestrel").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {n for n in names if n.startswith("kestrel.")}


def module_graph() -> dict[str, set[str]]:
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    return {
        m: {o for n in imported(p) if (o := owner(n)) not in (None, m)} for m, p in mods.items()
    }


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else module  # kestrel.<package or top-level module>


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a path, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycle_between_modules():
    assert cycle(module_graph()) is None


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        edges = {package(t) for t in targets} - {package(module)}
        packages.setdefault(package(module), set()).update(edges)
    assert cycle(packages) is None


@pytest.mark.parametrize("module", [m for m in modules() if m.startswith("kestrel.kernels")])
def test_kernels_import_nothing_from_kestrel(module):
    assert {t for t in module_graph()[module] if package(t) != "kernels"} == set()


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
