"""Typed recipe configuration: dataclasses loaded from YAML with ``a.b=c`` overrides.

Every part owns its config dataclass next to its code; :class:`Config` composes them.
Each field carries a one-line doc (``doc(default, "why")``) that ``polyrl train --help-config``
prints. An unknown key is an error naming the closest valid key.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and a one-line description."""
    if isinstance(default, (list, dict, set)) or dataclasses.is_dataclass(default):
        value = default
        factory = (lambda: type(value)(value)) if not dataclasses.is_dataclass(value) else (
            lambda: dataclasses.replace(value))
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


def doc_factory(factory: Any, text: str) -> Any:
    """A dataclass field built by ``factory`` (for nested configs)."""
    return field(default_factory=factory, metadata={"doc": text})
