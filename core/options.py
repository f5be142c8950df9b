"""Typed options of registered parts, declared where each part registers.

A recipe gives a part its options as a mapping (``rollout.args``, ``task.args``,
``policies.<name>.engine.args``, ``reward.terms[].args``, ...). Each part declares what it
takes, in one of two ways:

- ``REGISTRY.register(name, part, options=MyOptions)``: a dataclass that subclasses
  :class:`Options`, its fields written with :func:`polyrl.core.config.doc`;
- or nothing: the part's keyword parameters are its options (``Annotated[int, "why"]``
  gives a parameter its doc).

At load time :func:`bind` turns the mapping into an instance of that dataclass: an unknown
key names the nearest valid one and the part, a wrong type says what was expected, so a
recipe fails before any model loads. An :class:`Options` instance unpacks like a mapping
(``part(**options)``), so a part receives its options as keyword arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from polyrl.core.config import Bound, ConfigError, from_dict, nearest


class Options:
    """Base of every options dataclass: unpacks as keyword arguments, field by field
    (nested option groups stay typed objects)."""

    if TYPE_CHECKING:  # every subclass is a dataclass (a type checker's view only)
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def check(self, where: str, source: str = "<config>") -> None:
        """Ranges and combinations the types cannot say; raise ConfigError naming
        ``where`` (the recipe key of these options) and ``source``. Run at load time."""


def field_meta(hint: Any) -> tuple[Any, dict[str, Any]]:
    """(type, field metadata) of an annotation: ``Annotated[T, "doc", Bound(...)]`` carries
    the doc and the numbers the option may hold (checked at load, as ``doc(bound=)``)."""
    if typing.get_origin(hint) is Annotated:
        base, *extra = typing.get_args(hint)
        meta: dict[str, Any] = {"doc": next((e for e in extra if isinstance(e, str)), "")}
        bound = next((e for e in extra if isinstance(e, Bound)), None)
        return base, meta | ({"bound": bound} if bound is not None else {})
    return hint, {"doc": ""}


def _target(part: Any, call: str | None) -> Callable:
    """The callable whose keyword parameters are a part's options."""
    fn = getattr(part, call) if call else part
    return fn.__init__ if inspect.isclass(fn) else fn


def derive(
    part: Any, *, name: str, call: str | None = None, skip: int = 0, reserved: tuple = ()
) -> type[Options]:
    """An options dataclass from a part's keyword parameters.

    ``skip`` leading positional parameters are what the core passes (a workflow's context,
    a reward's sample) and ``reserved`` names are keywords the core fills (``seed``).
    A part that takes ``**kwargs`` must declare its options instead: nothing could check
    a recipe's keys against it.
    """
    fn = _target(part, call)
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if inspect.isclass(part if call is None else getattr(part, call)):
        params = params[1:]  # self
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # annotations naming what the module imports lazily
        hints = {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    rest = params[skip:] if all(p.kind in positional for p in params[:skip]) else params
    fields = []
    for p in rest:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            raise TypeError(
                f"{name}: takes **{p.name}, so its options cannot be checked; register it "
                "with options=<an Options dataclass> that lists them"
            )
        if p.kind is inspect.Parameter.VAR_POSITIONAL or p.name in reserved:
            continue
        tp, meta = field_meta(hints.get(p.name, Any))
        if p.default is inspect.Parameter.empty:
            fields.append((p.name, tp, dataclasses.field(metadata=meta)))
        elif isinstance(p.default, (list, dict, set)):
            value = p.default
            fields.append(
                (
                    p.name,
                    tp,
                    dataclasses.field(
                        default_factory=functools.partial(type(value), value),
                        metadata=meta,
                    ),
                )
            )
        else:
            fields.append((p.name, tp, dataclasses.field(default=p.default, metadata=meta)))
    cls = dataclasses.make_dataclass(
        "".join(w.capitalize() for w in name.replace("-", "_").split("_")) + "Options",
        fields,
        bases=(Options,),
    )
    cls.__doc__ = (inspect.getdoc(part) or "").split("\n\n")[0]
    return cls


def check_declared(options: type, part: Any, *, name: str, call: str | None, skip: int) -> None:
    """A declared options dataclass must subclass :class:`Options`, and a part called with
    its fields as keywords must accept each of them."""
    if not (dataclasses.is_dataclass(options) and issubclass(options, Options)):
        raise TypeError(f"{name}: options= must be a dataclass subclassing polyrl Options")
    if skip < 0:  # the part reads its options from its config, not as keywords
        return
    fn = _target(part, call)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [f.name for f in dataclasses.fields(options) if f.name not in params]
    if missing:
        raise TypeError(f"{name}: declares options {missing} that its signature does not take")


def bind(options: type[Options], value: Any, where: str, source: str, part: str) -> Options:
    """``value`` (a recipe mapping, or already typed) as an instance of ``options``.

    ``part`` names the part for the message, e.g. "workflow 'chain'".
    """
    if isinstance(value, options):
        return value
    if isinstance(value, Options):  # typed for another part (the part was switched)
        value = dict(value)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} in {source} must be a mapping of {part}'s options")
    valid = [f.name for f in dataclasses.fields(options)]
    unknown = [k for k in value if k not in valid]
    if unknown:
        key = unknown[0]
        hint = nearest(str(key), valid)
        takes = f"its options: {', '.join(valid)}" if valid else "it takes no options"
        raise ConfigError(
            f"{where}.{key} in {source}: {part} has no option {key!r}"
            + (f"; did you mean {where}.{hint}?" if hint else "")
            + f" ({takes}; `polyrl config` lists each with its type and doc)."
        )
    bound = from_dict(options, value, where, source)
    bound.check(where, source)
    return bound
