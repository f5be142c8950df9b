"""Typed recipe configuration: dataclasses loaded from YAML with ``a.b=c`` overrides.

Every part owns its config dataclass next to its code; :class:`Config` composes them.
Each field carries a one-line doc (``doc(default, "why")``) that ``polyrl config``
prints. An unknown key is an error naming the closest valid key; a key given twice in a
recipe is an error naming both lines (YAML itself would keep the last).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml


@dataclasses.dataclass(frozen=True)
class Bound:
    """The numbers a field may hold beyond its type, checked by the loader on every value a
    recipe gives it (``doc(..., bound=...)``, or an extra of ``Annotated[int, "doc",
    Bound(...)]`` for a part's derived options). ``low``/``high`` are inclusive, ``above``
    exclusive; ``finite=False`` admits +-inf. NaN is refused for every number field,
    bounded or not, and inf unless a field's bound admits it: no setting trains on them."""

    low: float | None = None
    above: float | None = None
    high: float | None = None
    finite: bool = True

    def need(self) -> str:
        """What the bound asks, as the error says it."""
        parts = [f">= {self.low:g}"] if self.low is not None else []
        parts += [f"> {self.above:g}"] if self.above is not None else []
        parts += [f"<= {self.high:g}"] if self.high is not None else []
        return " and ".join(parts) if parts else "a number"

    def holds(self, x: float) -> bool:
        return (
            (self.low is None or x >= self.low)
            and (self.above is None or x > self.above)
            and (self.high is None or x <= self.high)
        )


NONNEGATIVE = Bound(low=0)  # coefficients, weights, counts where 0 means off
POSITIVE = Bound(above=0)  # rates, scales
AT_LEAST_1 = Bound(low=1)  # sizes and counts of what must happen at least once
SHARE = Bound(low=0, high=1)  # fractions, discounts


def doc(
    default: Any,
    text: str,
    *,
    options: Any = None,
    chooser: str = "",
    bound: Bound | None = None,
) -> Any:
    """A dataclass field with a default and a one-line description.

    ``options`` marks a field that holds the options of the part that the sibling field
    ``chooser`` names, looked up in that registry (``rollout.args`` of ``rollout.workflow``);
    ``polyrl config`` lists every part's options under it. ``bound``: the numbers the field
    may hold (:class:`Bound`), checked when a recipe sets it.
    """
    meta = {"doc": text} | ({"options": options, "chooser": chooser} if options else {})
    meta |= {"bound": bound} if bound is not None else {}
    nested = dataclasses.is_dataclass(default)  # a bool: `default` itself stays Any
    if isinstance(default, (list, dict, set)) or nested:
        value = default
        factory = (
            (lambda: type(value)(value)) if not nested else (lambda: dataclasses.replace(value))
        )
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def doc_factory(factory: Any, text: str) -> Any:
    """A dataclass field built by ``factory`` (for nested configs)."""
    return field(default_factory=factory, metadata={"doc": text})


# Loading: YAML + overrides -> nested dataclasses, with strict keys and type checks.


class UserError(Exception):
    """An error in what the user gave (recipe, data, run directory), not in PolyRL: the
    CLI prints its message alone and exits with status 2 (``--debug``: the traceback)."""


class ConfigError(UserError, ValueError):
    """A recipe is wrong: names the key, the file and the fix."""


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to ``name``, for 'did you mean' hints."""
    hits = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.5)
    return hits[0] if hits else None


# A relative file path to a part, as a recipe writes it: ``./my_part.py:Name``.
_FILE_PART = re.compile(r"^(?![/~])[^\s:]*\.py:[A-Za-z_][\w.]*$")


def anchor_files(data: Any, base: Path) -> Any:
    """``data`` (a recipe's mapping) with each relative ``file.py:Name`` that names a file in
    ``base`` (the recipe's folder) made absolute, so the part resolves the same from any
    working directory, process or Ray worker, and two recipes never see each other's files.
    Paths with no such file are left as written (looked up in the working directory)."""
    if isinstance(data, dict):
        return {k: anchor_files(v, base) for k, v in data.items()}
    if isinstance(data, list):
        return [anchor_files(v, base) for v in data]
    if isinstance(data, str) and _FILE_PART.match(data):
        file, _, attr = data.rpartition(":")
        found = base / file
        if found.is_file():
            return f"{found.resolve()}:{attr}"
    return data


def _convert(tp: Any, value: Any, where: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r} ({source})")
    if origin is typing.Literal:
        # YAML 1.1 reads an unquoted off/on as a boolean: a choice named so is what was meant
        if isinstance(value, bool) and ("on" if value else "off") in args:
            return "on" if value else "off"
        if value not in args:
            hint = nearest(str(value), [str(a) for a in args])
            raise ConfigError(
                f"{where}={value!r} in {source} is not one of {list(args)}"
                + (f"; did you mean {hint!r}?" if hint else "")
            )
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where} in {source} must be a mapping, got {value!r}")
        return from_dict(tp, value, where, source)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} in {source} must be a list, got {value!r}")
        item = args[0] if args else Any
        return [_convert(item, v, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} in {source} must be a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _convert(vt, v, f"{where}.{k}", source) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where} in {source} must be a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where} in {source} must be a number, got {value!r}") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} in {source} must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} in {source} must be true or false, got {value!r}")
        return value
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{where} in {source} must be a string, got {value!r}")
        if isinstance(value, bool):  # YAML reads yes/no/on/off/true/false as booleans
            raise ConfigError(
                f"{where} in {source} must be a string, got the boolean {value}; "
                "quote the value to keep it as text"
            )
        return str(value)
    return value


def from_dict(cls: type, data: dict, prefix: str = "", source: str = "<config>") -> Any:
    """Build dataclass ``cls`` from a mapping; unknown keys fail naming the nearest one."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            hint = nearest(str(key), list(fields))
            full = f"{prefix}.{hint}" if prefix and hint else hint
            raise ConfigError(
                f"unknown key {where!r} in {source}"
                + (f"; did you mean {full!r}?" if hint else "")
                + f" Valid keys here: {', '.join(sorted(fields))}."
            )
        kwargs[key] = _convert(hints[key], value, where, source)
        check_bound(fields[key].metadata.get("bound"), kwargs[key], where, source)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix or 'config'} in {source}: {e}") from None
    return obj


def check_bound(bound: Bound | None, value: Any, where: str, source: str) -> None:
    """``value`` (a number, or a list of them) as :class:`Bound` ``bound`` allows: never
    NaN, inf only where the bound admits it."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_bound(bound, v, f"{where}[{i}]", source)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    bound = bound or Bound()
    if math.isnan(value) or (math.isinf(value) and bound.finite):
        raise ConfigError(
            f"{where}={value!r} in {source}: must be a finite number"
            + (f" ({bound.need()})" if bound != Bound() else "")
            + "; nothing trains on NaN or inf"
        )
    if not bound.holds(value):
        raise ConfigError(f"{where}={value!r} in {source}: must be {bound.need()}")


def parse_overrides(overrides: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> nested dict; values are parsed as YAML scalars/lists."""
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, _, raw = item.partition("=")
        value = yaml.safe_load(raw) if raw != "" else ""
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = (
            deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def _duplicate_key(node: yaml.Node, where: str = "", seen: set | None = None) -> str | None:
    """The first key given twice in one mapping of a composed YAML document, as "key (line
    a and line b)"; PyYAML itself keeps the last silently. Merge keys (``<<``) may be
    overridden, as YAML allows."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already walked
        return None
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
            line = key_node.start_mark.line + 1
            dotted = f"{where}.{key}" if where else str(key)
            if key in lines:
                return f"{dotted!r} (line {lines[key]} and line {line})"
            lines[key] = line
            found = _duplicate_key(value_node, dotted, seen)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _duplicate_key(item, f"{where}[{i}]", seen)
            if found:
                return found
    return None


def _self_alias(
    node: yaml.Node, where: str = "", above: tuple = (), done: set | None = None
) -> str | None:
    """The first place where an alias refers to a node that contains it (``a: &x [*x]``):
    such a value is infinite, so nothing could read it. "key (line n)", or None. A node
    aliased many times is walked once (``done``)."""
    done = set() if done is None else done
    if any(node is a for a in above):
        return f"{where or 'the top level'!r} (line {node.start_mark.line + 1})"
    if id(node) in done:
        return None
    above = (*above, node)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            found = _self_alias(value_node, f"{where}.{key}" if where else str(key), above, done)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _self_alias(item, f"{where}[{i}]", above, done)
            if found:
                return found
    done.add(id(node))
    return None


def load(cls: type, path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Load ``cls`` from a YAML recipe plus command-line overrides."""
    data: dict = {}
    source = "<defaults>"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe {str(path)!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
            root = yaml.compose(text, Loader=yaml.SafeLoader)
            loop = _self_alias(root) if root is not None else None
            if loop:
                raise ConfigError(
                    f"recipe {str(path)!r}: the alias at {loop} refers to a value that "
                    "contains it, so the value never ends; alias another key's value instead"
                )
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"recipe {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
                "save it as UTF-8"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {str(path)!r} must be a YAML mapping at the top level")
        twice = _duplicate_key(root) if root is not None else None
        if twice:
            raise ConfigError(
                f"recipe {str(path)!r} gives the key {twice}; YAML would keep only the "
                "last silently. Remove one of them"
            )
        source = str(path)
        data = anchor_files(  # './my_part.py:Name' beside the recipe
            data, path.expanduser().resolve().parent
        )
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
        source += " (+ command-line overrides)"
    cfg = from_dict(cls, data, "", source)
    if hasattr(cfg, "validate"):
        cfg.validate(source=source)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _type_name(tp: Any) -> str | None:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return (
        getattr(tp, "__name__", None) if not typing.get_args(tp) else str(tp).replace("typing.", "")
    )


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


def _part_options(key: str, f: dataclasses.Field, seen: dict) -> list[str]:
    """Each registered part's options under an options field (``rollout.args``)."""
    registry, chooser = f.metadata["options"], f.metadata["chooser"]
    if registry.kind in seen:
        return [
            f"{key}: {f.metadata.get('doc', '')} (options per {registry.kind}: as "
            f"{seen[registry.kind]})"
        ]
    seen[registry.kind] = key
    lines = [f"{key}: {f.metadata.get('doc', '')}; the options of each {registry.kind}:"]
    for name in registry.names():
        try:
            options = registry.options(name)
        except TypeError as e:
            lines.append(f"  [{chooser}: {name}] options not declared ({e})")
            continue
        if not dataclasses.fields(options):
            lines.append(f"  [{chooser}: {name}] (no options)")
            continue
        about = (options.__doc__ or "").strip().splitlines()
        lines.append(f"  [{chooser}: {name}] " + (about[0] if about else ""))
        sub = describe(options, key)
        lines += [f"    {line}" for line in sub]
    return lines


def describe(cls: type, prefix: str = "", seen: dict | None = None) -> list[str]:
    """One line per field: dotted key, type, default and doc (for ``polyrl config``).

    Options fields list the options of every registered part they can hold."""
    seen = {} if seen is None else seen
    lines = []
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a part's options annotated with names its module imports lazily
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if "options" in f.metadata:
            lines += _part_options(key, f, seen)
            continue
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            lines.append(f"{key}: {f.metadata.get('doc', '')}")
            lines += describe(tp, key, seen)
            continue
        # Mappings and lists of configs (policies.<name>.*, reward.terms[].*) list their keys too.
        args = typing.get_args(tp)
        item = args[-1] if args else None
        if (
            isinstance(item, type)
            and dataclasses.is_dataclass(item)
            and typing.get_origin(tp) in (dict, list)
        ):
            lines.append(f"{key}: {f.metadata.get('doc', '')}")
            lines += describe(
                item,
                f"{key}.<name>" if typing.get_origin(tp) is dict else f"{key}[]",
                seen,
            )
            continue
        lines.append(f"{key} ({_type_name(tp)} = {_default(f)}): {f.metadata.get('doc', '')}")
    return lines
