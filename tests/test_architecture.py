"""The Python package's shape: an import graph without cycles, and no private reach-ins into _core handles.

Every import counts, function-local ones included (a local import hides a cycle, it does not remove it).
A parent package's own __init__ is not an edge of its submodules (Python runs it first, but it only
re-exports).
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python" / "dasllama"


def _modules():
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    out["dasllama._core"] = (None, False)  # the extension: a leaf
    return out


def _graph():
    mods = _modules()
    graph = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        if path is None:
            continue
        pkg = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # `from . import x` names a submodule when one exists, else a name of the package.
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = subs + ([mod] if len(subs) < len(node.names) else [])
            for t in targets:
                while t and t not in mods:  # dasllama._core, dasllama.x.y -> the module that exists
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def _cycle(graph):
    color = {m: 0 for m in graph}
    stack = []

    def visit(m):
        color[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if color[n] == 1:
                return stack[stack.index(n):] + [n]
            if color[n] == 0:
                c = visit(n)
                if c:
                    return c
        stack.pop()
        color[m] = 2
        return None

    for m in sorted(graph):
        if color[m] == 0:
            c = visit(m)
            if c:
                return c
    return None


def test_import_graph_has_no_cycles():
    graph = _graph()
    assert "dasllama.llm" in graph and graph["dasllama.chat.turns"], "the graph builder found nothing"
    c = _cycle(graph)
    assert c is None, "import cycle: " + " -> ".join(c)


# The _core handles behind the wrapper classes, and the modules that own them.
OWNERS = {"_m": {"dasllama.handles", "dasllama.llm", "dasllama.kv"},
          "_s": {"dasllama.handles", "dasllama.llm", "dasllama.kv", "dasllama.audio"},
          "_p": {"dasllama.handles", "dasllama.llm", "dasllama.kv"},
          "_c": {"dasllama.handles", "dasllama.kv"},
          "_enc": {"dasllama.audio"},
          "_f": {"dasllama.gguf"}}


def test_no_private_reach_ins():
    bad = []
    for name, (path, _) in _modules().items():
        if path is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in OWNERS and name not in OWNERS[node.attr]:
                bad.append(f"{name}:{node.lineno} .{node.attr}")
    assert not bad, "private handles reached from outside their owners: " + ", ".join(bad)


def _module_aliases(tree, name, is_pkg, mods):
    """Local names bound to dasllama modules by the imports of one module (``from .. import llm``)."""
    pkg = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in mods:
                    out.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods and a.asname:
                    out.add(a.asname)
    return out


def test_no_private_module_names_from_outside():
    """``llm._check`` or ``llm._core`` from another module is a reach-in too: a module's seam is its
    public names (``_core`` is imported directly by whoever needs the extension)."""
    mods = _modules()
    bad = []
    for name, (path, is_pkg) in mods.items():
        if path is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = _module_aliases(tree, name, is_pkg, mods)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not bad, "private names of other modules used: " + ", ".join(bad)
