"""The package layout: the dependency rule, the extras, the plugin entry points, test folders.

The core never imports a plugin; a plugin imports the core and no other plugin (except that
``marl`` builds on ``agents``). Imports are read with ``ast``, so strings and comments that
mention a plugin do not count, and imports inside functions do.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import entry_points, packages_distributions
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ("agents", "marl", "multimodal", "diffusion")
PACKAGES = ("core", *PLUGINS)
# Which other plugins each plugin may import.
ALLOWED = {"agents": set(), "marl": {"agents"}, "multimodal": set(), "diffusion": set()}


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package, *rel = path.relative_to(root).with_suffix("").parts
    here = ["polyrl", package, *rel][:-1]  # relative imports start from the file's package
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def plugins_named(names: set[str]) -> set[str]:
    """Plugins that a set of imported module names reaches."""
    found = set()
    for name in names:
        parts = name.split(".")
        if len(parts) >= 2 and parts[0] == "polyrl" and parts[1] in PLUGINS:
            found.add(parts[1])
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_every_package_has_sources():
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file(), f"{package}/__init__.py is missing"


def test_import_parser_sees_every_form(tmp_path):
    """The checker itself: plain, from, nested and relative imports count; strings do not."""
    pkg = tmp_path / "marl" / "sub"
    pkg.mkdir(parents=True)
    src = pkg / "mod.py"
    src.write_text(
        "import polyrl.agents.x\nfrom polyrl import diffusion\n"
        "def f():\n    from polyrl.multimodal.y import z\n"
        "from ..other import w\n# import polyrl.core\ns = 'polyrl.agents'\n"
    )
    names = imported_modules(src, tmp_path)
    assert plugins_named(names) == {"agents", "diffusion", "multimodal", "marl"}
    assert "polyrl.marl.other.w" in names
    init = tmp_path / "core" / "__init__.py"
    init.parent.mkdir()
    init.write_text("from . import record\nfrom .tasks import arithmetic\n")
    assert {"polyrl.core.record", "polyrl.core.tasks.arithmetic"} <= imported_modules(
        init, tmp_path
    )


@pytest.mark.parametrize("path", sources("core"), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_imports_no_plugin(path):
    bad = plugins_named(imported_modules(path))
    assert not bad, (
        f"{path.relative_to(ROOT)} imports plugin(s) {sorted(bad)}; the core "
        "must reach plugins only through registries and entry points"
    )


@pytest.mark.parametrize(
    "path", [p for pl in PLUGINS for p in sources(pl)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_plugin_imports_only_core(path):
    package = path.relative_to(ROOT).parts[0]
    others = plugins_named(imported_modules(path)) - {package}
    bad = others - ALLOWED[package]
    assert not bad, (
        f"{path.relative_to(ROOT)} (plugin {package!r}) imports plugin(s) "
        f"{sorted(bad)}; a plugin may import only polyrl.core"
        + (f" and {sorted(ALLOWED[package])}" if ALLOWED[package] else "")
    )


def test_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    missing = {*PLUGINS, "vllm", "all", "test"} - extras
    assert not missing, f"pyproject.toml lacks extras {sorted(missing)}"
    everything = " ".join(project["optional-dependencies"]["all"])
    for plugin in PLUGINS:
        assert plugin in everything, f"the 'all' extra does not include {plugin!r}"


# Core modules whose third-party import is optional: the vLLM engine is picked by name,
# and run.loggers' wandb / mlflow and run.prometheus_port's prometheus_client come with the
# `loggers` extra (checked at recipe load).
OPTIONAL_CORE_IMPORTS = {"vllm", "wandb", "mlflow", "prometheus_client"}


def test_core_imports_are_base_dependencies():
    """`pip install polyrl[marl]` must train: whatever the core imports is a base dependency."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {
        re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower().replace("_", "-")
        for req in project["dependencies"]
    }
    dists = packages_distributions()
    needed: dict[str, str] = {}
    for path in sources("core"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if (
                not top
                or top in {"polyrl", "__future__"}
                or top in sys.stdlib_module_names
                or top in OPTIONAL_CORE_IMPORTS
            ):
                continue
            for dist in dists.get(top, [top]):
                needed.setdefault(dist.lower().replace("_", "-"), str(path.relative_to(ROOT)))
    assert {"torch", "transformers", "verl", "ray"} <= set(needed)  # the scan sees imports
    missing = {dist: where for dist, where in needed.items() if dist not in base}
    assert not missing, f"the core imports packages that are not base dependencies: {missing}"


def test_plugin_entry_points():
    eps = {ep.name: ep for ep in entry_points(group="polyrl.plugins")}
    assert set(PLUGINS) <= set(eps), (
        f"missing polyrl.plugins entry points: {sorted(set(PLUGINS) - set(eps))}"
    )
    for plugin in PLUGINS:
        assert eps[plugin].value == f"polyrl.{plugin}"
        assert eps[plugin].load().__name__ == f"polyrl.{plugin}"


def test_tests_mirror_packages():
    tests = ROOT / "tests"
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if len(rel.parts) == 1:
            continue  # top-level tests (layout, examples) and conftest.py
        assert rel.parts[0] in (*PACKAGES, "helpers"), (
            f"tests/{rel} is not under a package folder; put it in tests/<package>/ for one "
            f"of {', '.join(PACKAGES)}, in tests/helpers/ if other tests import it, or at "
            "the top of tests/"
        )
    assert not list(tests.rglob("__init__.py")), "tests/ must not be a package"
