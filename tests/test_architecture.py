"""The layout's rules, checked on the code's own imports: data flows one way.

An AST walk over every module of attnlab (imports inside functions included): no library module
imports the command line, and the packages form no cycle (docs/architecture.md).
"""
import ast
from pathlib import Path

import attnlab

ROOT = Path(attnlab.__file__).parent


def _imports() -> dict[str, set[str]]:
    """module name -> attnlab modules it imports (absolute names)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("attnlab")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                if base.startswith("attnlab"):
                    found.add(base)
        out[name] = found
    return out


def _package(module: str) -> str:
    """attnlab.model.llama -> model; attnlab.engine -> engine."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_library_module_imports_the_cli():
    bad = [(m, i) for m, imps in _imports().items() for i in imps
           if i.startswith("attnlab.cli") and not m.startswith("attnlab.cli") and m != "attnlab.__main__"]
    assert not bad, bad


def test_packages_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for m, imps in _imports().items():
        for i in imps:
            a, b = _package(m), _package(i)
            if a != b and a not in ("cli", "__main__", "attnlab"):
                graph.setdefault(a, set()).add(b)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    cycles = sorted(p for p in graph if p in reach(p))
    assert not cycles, {p: sorted(graph[p]) for p in cycles}


def test_the_network_knows_nothing_above_it():
    """model/ never imports the cache, the engine, sparsity or anything downstream."""
    above = ("attnlab.kv", "attnlab.engine", "attnlab.sparsity", "attnlab.session", "attnlab.serve",
             "attnlab.eval", "attnlab.options")
    bad = [(m, i) for m, imps in _imports().items() if m.startswith("attnlab.model") for i in imps
           if i.startswith(above)]
    assert not bad, bad
