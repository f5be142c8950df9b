"""Named registries through which recipes pick parts and plugins extend the core.

A recipe names a part by a short registered name (``"grpo"``) or by an import path
(``"my_pkg.rewards:score"``). Plugins register their parts when imported; installed
plugins are found through the ``polyrl.plugins`` entry-point group, so the core never
imports a plugin by name.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_plugins_loaded = False


class UnknownNameError(KeyError):
    """A recipe named a part that no registry holds."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def nearest(name: str, candidates: list[str] | tuple[str, ...] | set[str]) -> str | None:
    """The closest candidate to ``name``, for 'did you mean' hints."""
    hits = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.5)
    return hits[0] if hits else None


def load_plugins() -> list[str]:
    """Import every installed plugin so its parts register themselves."""
    global _plugins_loaded
    names = []
    if not _plugins_loaded:
        _plugins_loaded = True
        for ep in entry_points(group="polyrl.plugins"):
            ep.load()
            names.append(ep.name)
    return names


def import_path(path: str) -> Any:
    """Resolve ``package.module:Name`` (or ``package.module.Name``) to an object."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path; write it as 'package.module:Name'")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """A name -> object table for one kind of part (rewards, engines, losses, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name``; used bare as a decorator when ``obj`` is None."""

        def add(item: T) -> T:
            if name in self._items and self._items[name] is not item:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = item
            return item

        return add if obj is None else add(obj)

    def get(self, name: str) -> T:
        """Look ``name`` up; import paths always resolve, even if never registered."""
        if name in self._items:
            return self._items[name]
        if ":" in name:
            return import_path(name)
        if load_plugins() and name in self._items:
            return self._items[name]
        hint = nearest(name, self._items)
        msg = f"unknown {self.kind} {name!r}"
        msg += f"; did you mean {hint!r}?" if hint else "."
        msg += f" Registered: {', '.join(sorted(self._items)) or '(none)'}."
        msg += " Or give an import path 'package.module:Name'."
        raise UnknownNameError(msg)

    def check(self, name: str) -> None:
        """Fail early (at config time) if ``name`` cannot be resolved."""
        self.get(name)

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))


# The core's registries. Plugins add to these; they never edit the core.
ADVANTAGES: Registry[Callable] = Registry("advantage estimator")
CREDIT: Registry[Callable] = Registry("credit assignment")
POLICY_LOSSES: Registry[Callable] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable] = Registry("KL estimator")
REWARDS: Registry[Callable] = Registry("reward")
ENGINES: Registry[Callable] = Registry("engine")
POLICIES: Registry[Callable] = Registry("policy kind")
WORKFLOWS: Registry[Callable] = Registry("workflow")
MODELS: Registry[Callable] = Registry("model builder")
TASKS: Registry[Callable] = Registry("task")
DATASETS: Registry[Callable] = Registry("dataset kind")
ENVIRONMENTS: Registry[Callable] = Registry("environment")
BACKENDS: Registry[Callable] = Registry("distributed backend")
# Recipes shipped inside a package, runnable by name (`polyrl train signaling`).
RECIPES: Registry[Any] = Registry("packaged recipe")
