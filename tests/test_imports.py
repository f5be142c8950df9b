"""No import circles among PolyRL's modules, lazy and TYPE_CHECKING imports included.

A circle closed by an import inside a function or under ``if TYPE_CHECKING:`` still ties
the two modules together: neither can be read, tested or moved without the other. So the
graph here is read from the source with ``ast``, every ``polyrl.*`` import counted wherever
it stands (module level, function level, type-checking blocks, relative imports), and
``from polyrl.core import x`` with ``x`` a module counts as importing ``polyrl.core.x``.
Importing a module is not counted as importing its parent packages (every submodule would
otherwise close a circle through its package's ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the source folders and their import names (pyproject.toml's package-dir)
PACKAGES = {
    "core": "polyrl.core",
    "agents": "polyrl.agents",
    "marl": "polyrl.marl",
    "multimodal": "polyrl.multimodal",
    "diffusion": "polyrl.diffusion",
}


def modules(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Every module of the source folders under its import name."""
    out = {}
    for folder, name in packages.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


def _known(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of the modules (None: not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``module`` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := _known(alias.name, known)) is not None:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                if f"{base}.{alias.name}" in known:  # a module imported from its package
                    out.add(f"{base}.{alias.name}")
                elif (target := _known(base, known)) is not None:
                    out.add(target)
    out.discard(module)
    return out


def graph(root: Path, packages: dict[str, str]) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of modules as one chain that
    starts and ends at its first module (a -> b -> ... -> a)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(edges):  # Tarjan's algorithm, iterative
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return [_chain(sorted(g), edges) for g in groups]


def _chain(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One circle through the group's first module, by breadth-first search inside it."""
    first, members = group[0], set(group)
    came: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(edges[node] & members):
                if child == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if child not in came:
                    came[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{group} is not strongly connected")


def test_no_import_circles():
    found = circles(graph(ROOT, PACKAGES))
    assert not found, "import circles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_finds_lazy_and_type_checking_circles(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from polyrl.pkg import b\n",
            "pkg/b.py": "def f():\n    from polyrl.pkg.c import g\n",  # lazy
            "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from . import a\ndef g(): pass\n",  # relative, under TYPE_CHECKING
            "pkg/sub/__init__.py": "from .d import x\n",
            "pkg/sub/d.py": "import polyrl.pkg.sub.e as e\nx = 1\n",
            "pkg/sub/e.py": "from ..sub import d\n",  # a module through its package
            "pkg/f.py": "import os\nfrom polyrl.other import y\n",  # not ours: ignored
        },
    )
    edges = graph(tmp_path, {"pkg": "polyrl.pkg"})
    assert edges["polyrl.pkg.sub"] == {"polyrl.pkg.sub.d"}
    assert edges["polyrl.pkg.f"] == set()
    found = sorted(circles(edges))
    assert found == [
        ["polyrl.pkg.a", "polyrl.pkg.b", "polyrl.pkg.c", "polyrl.pkg.a"],
        ["polyrl.pkg.sub.d", "polyrl.pkg.sub.e", "polyrl.pkg.sub.d"],
    ]


def test_the_check_passes_an_acyclic_set(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from polyrl.pkg import a\n",
            "pkg/a.py": "def f():\n    from polyrl.pkg import b\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from polyrl.pkg.c import g\n",
            "pkg/c.py": "import polyrl.core\ndef g(): pass\n",
        },
    )
    edges = graph(tmp_path, {"pkg": "polyrl.pkg"})
    assert edges["polyrl.pkg.b"] == {"polyrl.pkg.c"}
    assert circles(edges) == []
    # a name taken from the package (whose __init__ imports a) closes a circle
    (tmp_path / "pkg/c.py").write_text("from polyrl.pkg import name\n")
    assert circles(graph(tmp_path, {"pkg": "polyrl.pkg"})) == [
        ["polyrl.pkg", "polyrl.pkg.a", "polyrl.pkg.b", "polyrl.pkg.c", "polyrl.pkg"]
    ]
