"""Imports of polyrl's own heavy dependencies, made where first needed (they cost seconds)."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, needed_by: str, package: str) -> ModuleType:
    """``module`` imported; if it is missing, an ImportError that names what needs it
    (``needed_by``) and the ``package`` polyrl's install should have brought."""
    try:
        return importlib.import_module(module)
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            f"{needed_by} needs {package}, a dependency of polyrl that is missing: "
            "reinstall polyrl (pip install polyrl, or ./install.sh in a checkout)"
        ) from err
