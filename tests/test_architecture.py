"""The layout's rules, checked on the code's own imports: data flows one way.

The rules are data: the package table of docs/architecture.md (who may import what). An AST walk over every
module of attnlab (imports inside functions included) checks each import against it; no library module
imports the command line, and the packages form no cycle.
"""
import ast
import re
import sys
from pathlib import Path

import attnlab

ROOT = Path(attnlab.__file__).parent
DOC = ROOT.parent / "docs" / "architecture.md"
TOP = ("attnlab", "__main__")  # the package's own __init__ (the public API) and `python -m attnlab`


def rules() -> dict[str, set[str] | None]:
    """package -> the packages it may import (None: anything), from the table under '## Packages'."""
    table = DOC.read_text().split("## Packages", 1)[1].split("\n\n", 2)[1]
    out = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = [n.removesuffix(".py").removesuffix("/") for n in re.findall(r"`([^`]+)`", cells[0])]
        allowed = None if cells[-1] == "anything" else set(re.findall(r"`([^`]+)`", cells[-1]))
        out.update({n: allowed for n in names})
    return out


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


def test_every_import_is_one_the_table_allows():
    table = rules()
    assert {"errors", "kernels", "model", "kv", "engine", "cli"} <= set(table), "the table did not parse"
    packages = {_package(m) for m in _imports()} - set(TOP)
    assert packages <= set(table), f"packages without a row in {DOC.name}: {sorted(packages - set(table))}"
    bad = sorted((m, i) for m, imps in _imports().items() for i in imps
                 if _package(m) not in TOP and table[_package(m)] is not None
                 and _package(i) != _package(m) and _package(i) not in table[_package(m)])
    assert not bad, bad


def test_the_check_catches_a_forbidden_import(monkeypatch):
    """The model importing the cache: the walk sees it and the table forbids it."""
    real = _imports()
    monkeypatch.setattr(sys.modules[__name__], "_imports", lambda: {**real, "attnlab.model.llama": {"attnlab.kv.cache"}})
    try:
        test_every_import_is_one_the_table_allows()
    except AssertionError as e:
        assert "attnlab.kv.cache" in str(e)
    else:
        raise AssertionError("a model -> kv import passed the check")


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
