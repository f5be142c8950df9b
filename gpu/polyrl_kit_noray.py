"""Offline GPU kit only: lets verl import where Ray is not installed.

verl (PolyRL's source of advantage estimators, losses and answer checkers) does
``import ray`` at the top of ``verl.protocol`` but calls Ray only inside functions that
PolyRL's local mode never reaches. Ray's wheel (~70 MB) does not fit the kit, so
``gpu/run.sh`` puts this module, and a ``.pth`` line importing it, into the kit's venv.

While a ``verl`` module executes, ``sys.modules["ray"]`` is a placeholder: its attributes
can be named (verl's annotations do) but calling one raises ImportError naming the
missing Ray. Once the outermost verl import ends
the placeholder is removed again, so anything else (PolyRL's ``distributed.backend=ray``,
``pytest.importorskip("ray")``) still sees that Ray is not installed. Where a real Ray is
importable this does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_MESSAGE = (
    "Ray is not installed (the offline GPU kit cannot carry it): verl asked for ray.{name}. "
    "Run without distributed.backend=ray, or install ray."
)


class _MissingMeta(type):
    """``ray.X`` at import time (annotations, isinstance, base classes) is a class; calling
    it, or reaching further into it, raises ImportError naming what verl asked for."""

    def __call__(cls, *args, **kwargs):
        raise ImportError(_MESSAGE.format(name=cls.__qualname__))

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(f"{cls.__qualname__}.{name}")


def _missing(name: str) -> type:
    return _MissingMeta(name.rsplit(".", 1)[-1], (), {"__qualname__": name})


class _RayPlaceholder(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(name)


_PLACEHOLDER = _RayPlaceholder("ray", "placeholder for the missing Ray (gpu/polyrl_kit_noray.py)")
_depth = 0


class _VerlLoader(importlib.abc.Loader):
    """Runs a verl module's own loader with the placeholder in ``sys.modules["ray"]``."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        global _depth
        if _depth == 0 and "ray" not in sys.modules:
            sys.modules["ray"] = _PLACEHOLDER
        _depth += 1
        try:
            self.inner.exec_module(module)
        finally:
            _depth -= 1
            if _depth == 0 and sys.modules.get("ray") is _PLACEHOLDER:
                del sys.modules["ray"]

    def __getattr__(self, name: str):  # get_resource_reader, is_package, ...
        return getattr(self.inner, name)


class _VerlFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.ray_missing: bool | None = None

    def find_spec(self, name, path=None, target=None):
        if name != "verl" and not name.startswith("verl."):
            return None
        if self.ray_missing is None:
            self.ray_missing = importlib.machinery.PathFinder.find_spec("ray") is None
        if not self.ray_missing:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _VerlLoader(spec.loader)
        return spec


if not any(isinstance(f, _VerlFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _VerlFinder())
