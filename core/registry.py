"""Named registries through which recipes pick parts and plugins extend the core.

A recipe names a part by a short registered name (``"grpo"``) or by an import path
(``"my_pkg.rewards:score"``). Plugins register their parts when imported; installed
plugins are found through the ``polyrl.plugins`` entry-point group, so the core never
imports a plugin by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from polyrl.core import options as opts
from polyrl.core.config import UserError, nearest

if TYPE_CHECKING:  # the parts' contracts, for the registries' types only
    from polyrl.core.interfaces import (
        Advantage,
        Credit,
        Engine,
        KLEstimator,
        Policy,
        PolicyLoss,
        Reward,
        Task,
        Workflow,
    )

T = TypeVar("T")

_plugins_loaded = False


class UnknownNameError(UserError, KeyError):
    """A recipe named a part that no registry holds."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


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


class PartFileError(UserError, ImportError):
    """A recipe's ``./file.py:Name`` could not be imported (a syntax error, a missing
    import, an error while it runs): names the file, the line and the error."""


def _file_failure(path: str, file: Path, e: Exception) -> str:
    """'<file>, line N: <error>' for an exception raised while ``file`` was imported."""
    line = e.lineno if isinstance(e, SyntaxError) and e.filename == str(file) else None
    tb = e.__traceback__
    while tb is not None:  # the deepest frame in the user's file
        if tb.tb_frame.f_code.co_filename == str(file):
            line = tb.tb_lineno
        tb = tb.tb_next
    where = f"{file}, line {line}" if line else str(file)
    what = f"{type(e).__name__}: {e.msg if isinstance(e, SyntaxError) else e}"
    hint = " (install it, or put the module beside the file)" if isinstance(e, ImportError) else ""
    return f"{path!r}: {where}: {what}{hint}; fix the file and run again"


def _file_module(file: str, path: str) -> ModuleType:
    """Import a user's ``.py`` file (once) as a module of its own, no PYTHONPATH needed.

    While it runs, its folder comes first on ``sys.path``, so it can import the modules
    beside it (``import helpers`` in ``my_agent.py``) as a script would."""
    found = Path(file).expanduser()
    if not found.is_file():
        where = Path.cwd() if not found.is_absolute() else found.parent
        raise UnknownNameError(
            f"{path!r}: no file {file!r} in {str(where)!r} (a path in a recipe is looked up "
            "beside the recipe first, then in the working directory)"
        )
    found = found.resolve()
    digest = hashlib.sha1(str(found).encode()).hexdigest()[:8]
    module_name = f"polyrl_user.{found.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, found)
    assert spec is not None and spec.loader is not None  # a .py file: a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before exec: dataclasses and pickling look it up
    folder = str(found.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file is input: name it, its line and the error
        del sys.modules[module_name]
        raise PartFileError(_file_failure(path, found, e)) from e
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        sys.path.remove(folder)  # the first occurrence: the one put there above
    return module


def import_path(path: str) -> Any:
    """Resolve ``package.module:Name``, ``package.module.Name`` or ``path/to/file.py:Name``."""
    if ":" in path:
        module_name, _, attr = path.rpartition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path; write it as 'package.module:Name'")
    if module_name.endswith(".py"):
        module = _file_module(module_name, path)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.split(".")[0] != e.name.split(".")[0]:
                raise  # the module exists; something it imports is missing
            raise UnknownNameError(
                f"{path!r}: no module {module_name!r} can be imported ({e}). Give an "
                "installed module, or a file path such as './my_part.py:Name'"
            ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UnknownNameError(
                f"{path!r}: module {module_name!r} has no attribute {attr!r}"
                + (f"; did you mean {hint!r}?" if (hint := nearest(part, dir(obj))) else "")
            )
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """A name -> object table for one kind of part (rewards, engines, losses, ...).

    Parts of a kind that takes recipe options (``options_key``, e.g. ``rollout.args``)
    declare them when they register (see :mod:`polyrl.core.options`). With
    ``keywords=True`` a part receives its options as keyword arguments after ``skip``
    positional ones, and a part that declares none has its keyword parameters as options;
    otherwise the part reads them from its config and takes none unless it declares them.
    """

    def __init__(
        self,
        kind: str,
        *,
        options_key: str | None = None,
        keywords: bool = True,
        call: str | None = None,
        skip: int = 0,
        reserved: tuple[str, ...] = (),
    ) -> None:
        self.kind = kind
        self.options_key = options_key
        self._keywords, self._call, self._skip, self._reserved = keywords, call, skip, reserved
        self._items: dict[str, T] = {}
        self._declared: dict[int, type] = {}  # id(part) -> its declared options
        self._traits: dict[int, dict[str, Any]] = {}  # id(part) -> facts given at registration

    @overload
    def register(
        self,
        name: str,
        obj: None = None,
        *,
        options: type | None = None,
        traits: dict[str, Any] | None = None,
    ) -> Callable[[T], T]: ...

    @overload
    def register(
        self,
        name: str,
        obj: T,
        *,
        options: type | None = None,
        traits: dict[str, Any] | None = None,
    ) -> T: ...

    def register(
        self,
        name: str,
        obj: T | None = None,
        *,
        options: type | None = None,
        traits: dict[str, Any] | None = None,
    ) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name`` (with its typed ``options``, a dataclass that
        subclasses :class:`polyrl.core.options.Options`); a decorator when ``obj`` is None.

        ``traits`` are facts about the part its callers need (a reward's ``batched``), kept
        here rather than set on the object, and read back with :meth:`traits`."""

        def add(item: T) -> T:
            if name in self._items and self._items[name] is not item:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            if traits is not None:
                had = self._traits.get(id(item))
                if had is not None and had != traits:
                    raise ValueError(
                        f"{self.kind} {name!r} is registered already with traits {had}, "
                        f"not {traits}"
                    )
                self._traits[id(item)] = dict(traits)
            if options is not None:
                opts.check_declared(
                    options,
                    item,
                    name=f"{self.kind} {name!r}",
                    call=self._call,
                    skip=self._skip if self._keywords else -1,
                )
                self._declared[id(item)] = options
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
        msg += " Or give an import path 'package.module:Name' or a file './my_file.py:Name'."
        raise UnknownNameError(msg)

    def traits(self, part: Any) -> dict[str, Any]:
        """What ``part`` (a registered object, however it was named) was registered with."""
        return dict(self._traits.get(id(part), {}))

    def check(self, name: str) -> None:
        """Fail early (at config time) if ``name`` cannot be resolved."""
        self.get(name)

    def options(self, name: str) -> type[opts.Options]:
        """The options dataclass of part ``name``: declared, else (for kinds that take
        keywords) its keyword parameters, else none."""
        part = self.get(name)
        declared = self._declared.get(id(part))
        if declared is not None:
            return declared
        if not self._keywords:
            return _NO_OPTIONS
        key = (id(part), name)
        if not callable(getattr(part, self._call, None) if self._call else part):
            raise UnknownNameError(_not_a_part(self.kind, name, part, self._call))
        if key not in _derived:
            _derived[key] = opts.derive(
                part,
                name=name.rpartition(":")[2] if ":" in name else name,
                call=self._call,
                skip=self._skip,
                reserved=self._reserved,
            )
        return _derived[key]

    def bind(self, name: str, value: Any, where: str, source: str = "<config>") -> opts.Options:
        """A recipe's options for part ``name``, checked and typed (see ``options``)."""
        return opts.bind(self.options(name), value, where, source, f"{self.kind} {name!r}")

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))


def _not_a_part(kind: str, name: str, part: Any, call: str | None) -> str:
    """Why ``part`` cannot be a ``kind``, naming where it is defined."""
    import inspect

    try:
        where = f" ({inspect.getsourcefile(part)}, line {inspect.getsourcelines(part)[1]})"
    except (TypeError, OSError):
        where = ""
    what = f"{type(part).__name__} {getattr(part, '__name__', repr(part)[:40])}{where}"
    need = f"has no {call}() method" if call else "is not callable"
    return (
        f"{name!r} is not a {kind}: the {what} {need}. Name the "
        f"{'module or object with ' + call + '()' if call else 'function or class'} instead"
    )


@dataclasses.dataclass
class _NoOptions(opts.Options):
    """Takes no options."""


_NO_OPTIONS = _NoOptions
_derived: dict[tuple[int, str], type] = {}


# The core's registries. Plugins add to these; they never edit the core.
# The scoring parts' signatures are in core/interfaces.py (Advantage, Credit, ...).
ADVANTAGES: Registry[Advantage] = Registry("advantage estimator")
# credit(record, algorithm_config, **options)
CREDIT: Registry[Credit] = Registry(
    "credit assignment", options_key="algorithm.credit_args", skip=2
)
# loss(logprobs, old_logprobs, advantages, mask, algorithm_config, agg, *, weights=None):
# reads loss_args; weights [B,R] (rollout correction) multiply each token's loss
POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "policy loss", options_key="algorithm.loss_args", keywords=False
)
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
# Parts with recipe options; the comment says how each is called.
# reward(sample_or_samples, **options)
REWARDS: Registry[Reward] = Registry("reward", options_key="reward.terms[].args", skip=1)
# engine(policy, seed=..., **options)
ENGINES: Registry[Callable[..., Engine]] = Registry(
    "engine", options_key="policies.<name>.engine.args", skip=1, reserved=("seed",)
)
# policy_kind(name, cfg, ...): reads cfg.args
POLICIES: Registry[type[Policy]] = Registry(
    "policy kind", options_key="policies.<name>.args", keywords=False
)
# workflow(ctx, **options)
WORKFLOWS: Registry[Callable[..., Workflow]] = Registry(
    "workflow", options_key="rollout.args", skip=1
)
# builder(path, **options): writes a model folder at path (untyped: a decorated builder
# would take the registry's type, and builders call each other with their own signatures)
MODELS: Registry[Callable] = Registry(
    "model builder", options_key="policies.<name>.build_args", skip=1
)
# task.write_dataset(out_dir, seed=..., **options): a module or an object (interfaces.Task;
# a module registers itself, sys.modules[__name__])
TASKS: Registry[Task] = Registry(
    "task", options_key="task.args", call="write_dataset", skip=1, reserved=("seed",)
)
# dataset_kind(cfg, tokenizer, name=...): reads cfg.args
DATASETS: Registry[Callable] = Registry("dataset kind", options_key="data.args", keywords=False)
# environment(**options)
ENVIRONMENTS: Registry[Callable] = Registry("environment")
# backend(cfg): reads cfg.distributed.args
BACKENDS: Registry[Callable] = Registry(
    "distributed backend", options_key="distributed.args", keywords=False
)
# Recipes shipped inside a package, runnable by name (`polyrl train signaling`).
RECIPES: Registry[Path] = Registry("packaged recipe")
# `polyrl serve NAME --config FILE`: service(config_path, overrides) -> exit status
SERVICES: Registry[Callable[[str, list[str]], int]] = Registry("service")
