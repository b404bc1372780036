"""The layout's rules, measured on the code itself (ARCHITECTURE.md, "Packages"):

- the packages form layers, compaction_kernels < compactor < sglang_ext < harness <
  benchmarks, and no module imports one of a higher layer;
- no import cycle, between modules and between the subpackages of a package (an import
  inside a function counts, and so does one under `if TYPE_CHECKING:`: a type that needs its
  user's module back is a circle all the same);
- no module over 400 lines (generated gRPC code aside);
- no `sys.path` edits under benchmarks/: scripts run with `python -m`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("compaction_kernels", "compactor", "sglang_ext", "harness", "benchmarks")
MAX_LINES = 400


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the layered packages."""
    out = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if "gen" in rel.parts or "results" in rel.parts:
                continue
            parts = list(rel.with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `name` imports (in functions and TYPE_CHECKING blocks too)."""
    tree = ast.parse(path.read_text())

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            found |= {resolve(f"{base}.{a.name}") or resolve(base) for a in node.names}
    return {m for m in found if m is not None and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_module_imports_a_higher_layer(graph: dict[str, set[str]]) -> None:
    layer = {pkg: i for i, pkg in enumerate(LAYERS)}
    up = [f"{m} -> {t}" for m, ts in graph.items() for t in sorted(ts)
          if layer[t.split(".")[0]] > layer[m.split(".")[0]]]  # fmt: skip
    assert up == []


def test_no_import_cycle_between_modules_or_subpackages(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []

    def group(m: str) -> str:  # a subpackage, or a module loose in its package
        parts = m.split(".")
        return ".".join(parts[:2]) if (ROOT / "/".join(parts[:2])).is_dir() else m

    grouped: dict[str, set[str]] = {}
    for m, ts in graph.items():
        grouped.setdefault(group(m), set()).update(group(t) for t in ts if group(t) != group(m))
    assert cycles(grouped) == []


def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    path = tmp_path / "m.py"
    path.write_text("import sglang_ext.x\nfrom typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    import harness\n"
                    "def f():\n    from compactor import spec\n")  # fmt: skip
    known = dict.fromkeys(["sglang_ext.x", "harness", "compactor", "compactor.spec"], path)
    assert imports("m", path, known) == {"sglang_ext.x", "harness", "compactor.spec"}


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert long == {}


def test_benchmarks_run_as_modules_without_path_edits() -> None:
    edits = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py")
             if "sys.path.insert" in p.read_text() or "sys.path[" in p.read_text()]  # fmt: skip
    assert edits == []
    assert all((d / "__init__.py").is_file() for d in (ROOT / "benchmarks").iterdir()
               if d.is_dir() and d.name not in ("results", "__pycache__"))  # fmt: skip


def test_tests_share_helpers_through_helper_modules_only() -> None:
    """A test module imports no other test module: shared helpers live in a folder's `_*.py`
    modules (or its conftest.py, for fixtures)."""
    found = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])  # fmt: skip
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests"):
                names += [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                      if n.startswith("tests.") and (".test_" in n or n.endswith(".conftest"))]  # fmt: skip
    assert found == []
