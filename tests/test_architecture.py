"""The Python package's shape: an import graph without cycles, and no private reach-ins into _core handles.

Every import counts, function-local ones included (a local import hides a cycle, it does not remove it).
A parent package's own __init__ is not an edge of its submodules (Python runs it first, but it only
re-exports).
"""
from __future__ import annotations

import ast
import pathlib
import re

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


def _from_module(node, pkg):
    """The absolute module a `from ... import` in package `pkg` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = pkg.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


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
                mod = _from_module(node, pkg)
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
          "_enc": {"dasllama.audio", "dasllama.vision"},
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
            mod = _from_module(node, pkg)
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


# -- architectures are data -----------------------------------------------------------------------------
# A family's name may be written where it is registered (the family files, the tables) but never tested
# on a shared path: no `arch == "gemma3"`, no `fam != "qwen2.5o"`, no `rfind("gemma", 0)`.
CPP_ROOTS = [ROOT.parents[1] / d for d in ("cpp", "cuda", "vulkan")]
REGISTRY_FILES = {"cpp/model/arch.cpp", "cpp/model/llama.cpp", "cpp/model/qwen.cpp", "cpp/model/gemma.cpp",
                  "cpp/model/phi.cpp"}
# tokenizer.ggml.model "llama" names the SentencePiece vocabulary format, not the architecture; "gemma4"
# names the SentencePiece-style BPE vocabulary (merges given) that Gemma-4's files carry.
NOT_FAMILIES = {"cpp/tokenizer/": {"llama", "gemma4"}}


def _family_words():
    from dasllama import _core

    names = set(_core.registered_archs()) | set(_core.AudioEncoder.families())
    stems = {re.match(r"[a-z]+", n).group(0) for n in names}  # "gemma" of gemma3: a prefix test is a test too
    return names | stems


def _strip_cpp_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def test_no_family_tests_on_shared_cpp_paths():
    words = _family_words()
    assert {"llama", "gemma3", "qwen2.5o", "whisper"} <= words, words
    alt = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
    pat = re.compile(rf'(?:==|!=)\s*"({alt})"|"({alt})"\s*(?:==|!=)|(?:rfind|starts_with|compare|find)\(\s*"({alt})"')
    bad = []
    for root in CPP_ROOTS:
        for p in sorted(root.rglob("*")):
            if p.suffix not in (".cpp", ".h", ".cu", ".cuh", ".comp", ".glsl"):
                continue
            rel = p.relative_to(ROOT.parents[1]).as_posix()
            if rel in REGISTRY_FILES:
                continue
            allowed = set().union(*[v for k, v in NOT_FAMILIES.items() if rel.startswith(k)])
            src = _strip_cpp_comments(p.read_text(encoding="utf-8", errors="replace"))
            for m in pat.finditer(src):
                name = next(g for g in m.groups() if g)
                if name not in allowed:
                    bad.append(f"{rel}:{src.count(chr(10), 0, m.start()) + 1} {m.group(0)}")
    assert not bad, "family names tested on shared paths (register a trait instead): " + ", ".join(bad)


def test_no_family_tests_in_python():
    """Tables keyed by family (chat templates, audio framing) are data; a comparison with a family name is a branch."""
    words = _family_words()
    bad = []
    for name, (path, _) in _modules().items():
        if path is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            consts = []
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    consts += [e.value for e in elts if isinstance(e, ast.Constant)]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "endswith")):
                consts += [a.value for a in node.args if isinstance(a, ast.Constant)]
            hit = [c for c in consts if isinstance(c, str) and c in words]
            if hit:
                bad.append(f"{name}:{node.lineno} {hit}")
    assert not bad, "family names tested in the Python package: " + ", ".join(bad)


# -- optional dependencies stay behind their extras -------------------------------------------------------
# The library never imports its server (only the CLI does), and only dasllama.server.ray imports Ray.

def _third_party_imports(path):
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_only_the_ray_module_imports_ray():
    users = [name for name, (path, _) in _modules().items() if path is not None and "ray" in _third_party_imports(path)]
    assert users == ["dasllama.server.ray"], users


def test_the_library_never_imports_its_server():
    graph = _graph()
    top = ("dasllama.server", "dasllama.cli", "dasllama.__main__")  # the layers above the library
    bad = [f"{m} -> {t}" for m, ts in graph.items() if not m.startswith(top)
           for t in ts if t.startswith("dasllama.server")]
    assert not bad, bad
    # and at run time: importing the library loads neither the HTTP stack nor Ray
    import subprocess
    import sys

    code = ("import sys, dasllama, dasllama.chat, dasllama.llm; "
            "print(sorted(m for m in ('ray', 'starlette', 'uvicorn', 'dasllama.server') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
