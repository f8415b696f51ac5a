"""The package's module graph has no import circle (set-up flows one way: load, resolve, build, train).

Function-level imports count too: a lazy import that climbs back up the order is still a circle to a reader.
"""

import ast
import os

from helpers import ROOT

PACKAGE = os.path.join(ROOT, "accel_trainer")


def import_graph() -> dict[str, set[str]]:
    mods = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")} - {"__init__"}
    graph = {m: set() for m in mods}
    for m in mods:
        with open(os.path.join(PACKAGE, f"{m}.py")) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 1 or (node.module or "").startswith("accel_trainer"):
                parts = (node.module or "").split(".")
                target = parts[0] if node.level == 1 else (parts[1] if len(parts) > 1 else "")
                if target in mods:
                    graph[m].add(target)
                elif not target:  # from . import a, b / from accel_trainer import a, b
                    graph[m] |= {a.name for a in node.names if a.name in mods}
    return graph


def circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    found = set()

    def walk(start, node, path):
        for nxt in graph[node]:
            if nxt == start:
                found.add(tuple(path))
            elif nxt not in path:
                walk(start, nxt, path + [nxt])

    for m in graph:
        walk(m, m, [m])
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {
        ("a", "b", "c"),
        ("b", "c", "a"),
        ("c", "a", "b"),
    }


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert {"trainer", "world", "args", "accel"} <= set(graph) and graph["trainer"]  # the graph was read
    assert not circles(graph), sorted(circles(graph))
