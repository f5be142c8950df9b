"""Environments: a small, text-first, gym-like interface, one instance per episode.

An environment is any object with three methods; each may be a plain or an ``async def``::

    reset(task: dict) -> observation            # task = the dataset row
    step(action: str) -> (observation, reward, done, info)   # or a StepResult
    close() -> None                              # optional

An *observation* is the text the policy reads next: a string (sent as a user message), a
chat message ``{"role": ..., "content": ...}`` (``role: "tool"`` for tool results) or a
list of them. For a vision-language policy it may carry images: a ``PIL.Image``, a list
mixing strings and images (one user message), or a message whose ``content`` is a list of
parts (a string, an image, ``{"type": "text", "text": ...}``, ``{"type": "image", "image":
<PIL.Image>}``); the multi-turn workflow keeps them in the conversation. The environment keeps its state on the instance, never globally: the
multi-turn workflow builds one instance per episode, so hundreds of episodes can be in
flight at once. ``info`` may carry ``success`` (bool; the episode's success flag) and
``anchor`` (the state key GiGPO groups steps by; default: the observation text).

An environment's options are its constructor's keyword parameters (``Annotated[T, "doc"]``
gives each its doc); a recipe sets them in ``rollout.args.env_args``, checked against the
environment when the recipe loads. Register an environment under a short name, or name it
in a recipe by import path::

    from polyrl.agents import Environment, register_env

    @register_env("countdown")
    class Countdown(Environment):
        def reset(self, task):
            self.left = int(task["start"])
            return f"{self.left} left. Say 'dec'."
        def step(self, action):
            self.left -= action.strip() == "dec"
            return f"{self.left} left.", float(self.left == 0), self.left == 0, {}

    # recipe: rollout.args: {env: countdown}   or   {env: "my_pkg.envs:Countdown"}

An environment that takes ``**kwargs`` declares its options instead:
``register_env("name", options=MyOptions)`` with an :class:`~polyrl.core.options.Options`
dataclass.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polyrl.core.options import Options, bind
from polyrl.core.registry import ENVIRONMENTS

Message = dict[str, Any]
Observation = str | Message | list[Message]


@dataclass
class StepResult:
    """What one ``step`` returns; a plain 4-tuple works too."""

    observation: Observation
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Optional base class: documents the interface and gives ``close`` a default.

    Subclasses implement ``reset`` and ``step`` (sync or async). ``max_turns`` (if set)
    caps the episode length on top of the workflow's own limit.
    """

    max_turns: int | None = None

    def __init__(self) -> None:
        """No options; a subclass's keyword parameters are its options."""

    def reset(self, task: dict[str, Any]) -> Observation:  # pragma: no cover - interface
        raise NotImplementedError

    def step(self, action: str) -> StepResult | tuple:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        return None


def register_env(name: str, *, options: type | None = None) -> Callable[[type], type]:
    """Class decorator: register an environment under ``name`` in ``ENVIRONMENTS``
    (``options``: its declared options dataclass, needed when it takes ``**kwargs``)."""

    def add(cls: type) -> type:
        ENVIRONMENTS.register(name, cls, options=options)
        return cls

    return add


@dataclass
class _NoOptions(Options):
    """Takes no options."""


def env_options(
    name: str,
    value: Any = None,
    where: str = "rollout.args.env_args",
    source: str = "<config>",
) -> Options:
    """Environment ``name``'s options from ``value`` (a mapping, or already typed), checked
    against what the environment declares: an unknown key names the nearest valid one, a
    wrong type says what was expected."""
    cls = ENVIRONMENTS.get(name)
    if not callable(cls):
        raise TypeError(f"environment {name!r} resolved to {type(cls).__name__}, not a class")
    if isinstance(cls, type) and cls.__init__ is object.__init__:  # a class without __init__
        return bind(_NoOptions, value, where, source, f"environment {name!r}")
    return ENVIRONMENTS.bind(name, value, where, source)


def make_env_factory(name: str, args: Any = None) -> Callable[[], Any]:
    """A zero-argument callable building a fresh environment per episode.

    ``name`` is a registered name or ``package.module:Class``; ``args`` are its options
    (:func:`env_options`), passed to the constructor. Unknown names and options fail here,
    at workflow construction, not mid-rollout.
    """
    cls = ENVIRONMENTS.get(name)
    options = env_options(name, args)
    return lambda: cls(**options)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def as_step_result(value: Any, where: str = "step") -> StepResult:
    """Accept a StepResult or an (observation, reward, done[, info]) tuple."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) in (3, 4):
        result = StepResult(value[0], value[1], value[2], value[3] if len(value) == 4 else {})
    else:
        raise TypeError(
            f"{where} must return (observation, reward, done, info) or a "
            f"StepResult, not {type(value).__name__}"
        )
    try:
        result.reward = float(result.reward)
    except (TypeError, ValueError):
        raise TypeError(f"{where} returned a non-numeric reward {result.reward!r}") from None
    if result.reward != result.reward:  # NaN
        raise ValueError(f"{where} returned a NaN reward")
    result.done = bool(result.done)
    if result.info is None:
        result.info = {}
    if not isinstance(result.info, dict):
        raise TypeError(f"{where} returned info of type {type(result.info).__name__}, not dict")
    as_messages(result.observation, where)
    return result


def is_image(value: Any) -> bool:
    """Whether ``value`` is an image an observation may carry (a ``PIL.Image``)."""
    from PIL import Image

    return isinstance(value, Image.Image)


def _is_part(value: Any) -> bool:
    return (
        isinstance(value, str) or is_image(value) or (isinstance(value, dict) and "type" in value)
    )


def content_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string as it is, else a list of ``{"type": "text", "text"}``
    and ``{"type": "image", "image"}`` parts (the image is checked where it is used)."""
    if isinstance(content, str):
        return content
    items = content if isinstance(content, list) else [content]
    parts = []
    for p in items:
        if isinstance(p, str):
            parts.append({"type": "text", "text": p})
        elif is_image(p):
            parts.append({"type": "image", "image": p})
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif isinstance(p, dict) and p.get("type") == "image":
            parts.append({"type": "image", "image": p.get("image")})
        else:
            raise TypeError(
                f"{where}: a content part must be a string, a PIL image, {{'type': 'text', "
                f"'text': ...}} or {{'type': 'image', 'image': ...}}, not {p!r:.80}"
            )
    return parts


def as_messages(obs: Observation, where: str = "observation", role: str = "user") -> list[Message]:
    """An observation as a list of chat messages (a string, an image or a list of strings
    and images becomes one ``role`` message)."""
    if isinstance(obs, str):
        return [{"role": role, "content": obs}]
    if is_image(obs) or (
        isinstance(obs, list) and obs and all(_is_part(p) for p in obs) and not _messages(obs)
    ):
        return [{"role": role, "content": content_parts(obs, where)}]
    if isinstance(obs, dict):
        obs = [obs]
    if _messages(obs):
        return [{**m, "content": content_parts(m["content"], where)} for m in obs]
    raise TypeError(
        f"{where}: an observation must be a string, an image, a message "
        f"{{'role', 'content'}} or a non-empty list of messages, not {obs!r:.80}"
    )


def _messages(obs: Any) -> bool:
    return (
        isinstance(obs, list)
        and bool(obs)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in obs
        )
    )


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(
            p["text"] if p.get("type") == "text" else "<image>"
            for p in content
            if isinstance(p, dict)
        )
    return str(content)


def observation_text(obs: Observation) -> str:
    """The observation's text (message contents joined; an image reads ``<image>``), used as
    the default GiGPO anchor."""
    return "\n".join(_text(m["content"]) for m in as_messages(obs))
