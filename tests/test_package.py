"""The package's shape: the import graph is a tree (no cycle, lazy imports
included), no library module imports the package ``__init__``, and no
module is over ~600 lines (one job each)."""

import ast
import sys
from pathlib import Path

from paths import ROOT

SRC = ROOT / "src"
PACKAGE = SRC / "hookloop"
#: runnable examples are leaves, written as users write scripts (``from
#: hookloop import Loop``): nothing in the library imports them at import time
LEAVES = ("hookloop.examples",)


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known) -> list[tuple[str, int, bool]]:
    """``(imported module, line, names the package root itself)`` for every
    import in the module, top-level and inside functions alike."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "hookloop" or alias.name.startswith("hookloop."):
                    target = alias.name if alias.name in known else alias.name.rsplit(".", 1)[0]
                    out.append((target, node.lineno, alias.name == "hookloop"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == "hookloop" or target.startswith("hookloop.")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.append((sub, node.lineno, False))  # a submodule
                elif target in known:
                    out.append((target, node.lineno, target == "hookloop"))
    return out


def test_no_import_cycle_lazy_imports_included():
    known = modules()
    graph = {name: {t for t, _, _ in imports(name, path, known) if t != name}
             for name, path in known.items()}
    cycles = []
    state: dict = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_library_module_imports_the_package_init():
    known = modules()
    offenders = []
    for name, path in known.items():
        if name == "hookloop" or name.startswith(LEAVES):
            continue
        for target, line, root in imports(name, path, known):
            if root:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports the package hookloop itself")
    assert not offenders, "\n".join(offenders)


def test_the_checker_finds_a_cycle(tmp_path, monkeypatch):
    """The cycle check can fail: two modules importing each other lazily."""
    pkg = tmp_path / "src" / "hookloop"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "src")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    try:
        test_no_import_cycle_lazy_imports_included()
    except AssertionError as exc:
        assert "hookloop.a -> hookloop.b -> hookloop.a" in str(exc)
    else:
        raise AssertionError("the cycle between a and b was not found")
