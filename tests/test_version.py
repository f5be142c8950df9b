"""The version is written once (polyrl/__init__.py) and the installed metadata agrees."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest

import polyrl

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_version_is_the_package_version():
    """Fails when pyproject and __init__ drift, or the install is stale (pip install -e .)."""
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", polyrl.__version__)
    assert version("polyrl") == polyrl.__version__


def test_pyproject_reads_the_version_instead_of_repeating_it():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "polyrl.__version__"}
