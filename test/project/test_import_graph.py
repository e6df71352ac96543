"""The package's modules import one another without a circle (function-local imports counted): a module can be
read, and changed, knowing only what it imports. The kernels' bindings still import one another (int4_kernel,
product_kernel, kernel_pool: the C ABI's Python side, issue 59 item 4) and are the one exception left."""
from __future__ import annotations

import ast
import os

import simllm_ros

ROOT = os.path.dirname(simllm_ros.__file__)
EXCEPTED = "simllm_ros.kernels."


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                mod = "simllm_ros." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod.removesuffix(".__init__")] = path
    return out


def _graph(mods: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{node.module}" if node.module else up
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            # a module's own package (its __init__) is not an edge: importing a sibling runs it anyway
            graph[mod] |= {t for t in targets if t in mods and t != mod and not mod.startswith(t + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_outside_the_kernels_bindings_is_in_an_import_circle():
    circles = [c for c in _circles(_graph(_modules())) if not all(m.startswith(EXCEPTED) for m in c)]
    assert not circles, f"import circles: {circles}"
