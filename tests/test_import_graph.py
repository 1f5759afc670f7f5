"""The package's import graph, read from the source (``ast``; nothing is imported):
dependencies point down the layers below, with no cycle between packages, and only the
command line parses arguments.

    cli -> testing -> bench, train, llm -> engine -> strategies -> state -> ops

``corpus`` (the held-out text), ``progress`` (the progress bar and JSON files) and
``version`` depend on nothing and sit at the bottom beside ``ops``. The package root
(``replayssm/__init__.py``) is the public face: it may import anything, and nothing
inside the package imports names from it.
"""

import ast
from pathlib import Path

import pytest

import replayssm

SRC = Path(replayssm.__file__).parent

#: package (or top-level module) -> layer; an import must go to a lower layer
LAYERS = {
    "ops": 0, "corpus": 0, "progress": 0, "version": 0,
    "state": 1,
    "strategies": 2,
    "engine": 3,
    "bench": 4, "train": 4, "llm": 4,
    "testing": 5,
    "cli": 6,
}
#: the only package that may parse arguments
ARGPARSE_UNITS = {"cli"}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_edges(root: Path) -> list[tuple[str, str, str, int]]:
    """``(importing module, imported module, file, line)`` for every import of the
    package at ``root`` (function-level imports included), relative ones resolved;
    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module."""
    top = root.name
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(root, p) for p in files}
    edges = []
    for path in files:
        mod = _module_name(root, path)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            else:
                continue
            for t in targets:
                if t == top or t.startswith(top + "."):
                    edges.append((mod, t, path.name, node.lineno))
    return edges


def unit_of(module: str) -> str:
    """The package a module belongs to (``""`` for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(root: Path, layers: dict[str, int]) -> list[str]:
    """Upward or sideways imports between packages, imports of the root's names, cycles
    between packages, and packages without a layer."""
    out = []
    graph: dict[str, set[str]] = {}
    for src, dst, fname, line in import_edges(root):
        a, b = unit_of(src), unit_of(dst)
        if a == b:
            continue
        where = f"{src} ({fname}:{line}) imports {dst}"
        if b == "":
            out.append(f"{where}: names of the package root are for users, not for the package")
            continue
        if a == "":
            continue  # the root is the public face: it re-exports from anywhere
        graph.setdefault(a, set()).add(b)
        for unit in (a, b):
            if unit not in layers:
                out.append(f"{where}: {unit!r} has no layer in LAYERS")
        if a in layers and b in layers and layers[b] >= layers[a]:
            out.append(f"{where}: {a} (layer {layers[a]}) may only import lower layers, {b} is {layers[b]}")
    # A cycle would also show above as an upward import; report it as one all the same.
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                out.append("cycle between packages: " + " -> ".join(path[path.index(v):] + [v]))
            elif v not in state:
                visit(v, path + [v])
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [u])
    return out


def test_dependencies_point_down_without_cycles():
    assert violations(SRC, LAYERS) == []


def test_every_package_has_a_layer():
    units = {unit_of(_module_name(SRC, p)) for p in SRC.rglob("*.py")} - {""}
    assert units <= set(LAYERS), sorted(units - set(LAYERS))


def test_only_the_command_line_parses_arguments():
    bad = [f"{src} ({fname}:{line})" for src, dst, fname, line in _argparse_imports(SRC)
           if unit_of(src) not in ARGPARSE_UNITS]
    assert bad == []


def _argparse_imports(root: Path):
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if "argparse" in names:
                yield _module_name(root, path), "argparse", path.name, node.lineno


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("files,expect", [
    ({"__init__.py": "", "ops/__init__.py": "", "ops/a.py": "from ..engine import b\n",
      "engine/__init__.py": "", "engine/b.py": "from ..ops import a\n"}, ["ops.a", "cycle between packages"]),
    ({"__init__.py": "", "ops/__init__.py": "def f():\n    from pkg.engine.b import g\n",
      "engine/__init__.py": "", "engine/b.py": ""}, ["pkg.ops (__init__.py:2) imports pkg.engine.b"]),
    ({"__init__.py": "X = 1\n", "engine/__init__.py": "from .. import X\n"}, ["names of the package root"]),
    ({"__init__.py": "", "extra/__init__.py": "from ..ops import a\n", "ops/__init__.py": "", "ops/a.py": ""},
     ["'extra' has no layer"]),
    ({"__init__.py": "", "bench/__init__.py": "from ..train import t\n", "train/__init__.py": "", "train/t.py": ""},
     ["bench (layer 4) may only import lower layers, train is 4"]),
])
def test_the_checker_finds_upward_imports_cycles_and_root_names(tmp_path, files, expect):
    """The check above can fail: on a made-up package it reports each kind of fault."""
    found = violations(_write(tmp_path, files), LAYERS)
    for text in expect:
        assert any(text in v for v in found), (text, found)


def test_the_checker_accepts_downward_imports(tmp_path):
    root = _write(tmp_path, {"__init__.py": "from .cli import main\n", "ops/__init__.py": "", "ops/a.py": "",
                             "cli/__init__.py": "from ..ops import a\nfrom . import args\n", "cli/args.py": "",
                             "engine/__init__.py": "from ..ops.a import f\nfrom .. import corpus\n",
                             "corpus.py": ""})
    assert violations(root, LAYERS) == []
