"""Typed options of the multi-agent workflows (``rollout.args``), checked at config time.

Each ``@workflow`` gets one options dataclass (:func:`workflow_options`): the fields every
multi-agent workflow has (:class:`MarlOptions`: ``agents``, ``critic``), ``joint`` as a
``Literal`` of exactly the joint modes that workflow supports, ``tree`` only for
multi-turn workflows, and the workflow function's own keyword parameters (their
``Annotated[T, "doc"]`` docs are the options' docs)::

    rollout:
      workflow: signaling
      args:
        agents:
          - {name: speaker, policy: speaker}
          - {name: listener, policy: listener}
        joint: aligned
        tree: true

The core binds ``rollout.args`` to that class at load (an unknown key names the nearest
valid one and the workflow); ``WorkflowSpec.validate_config`` then checks what needs the
whole recipe (:func:`resolve_agents`, :func:`check_critic`) before any model loads.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from polyrl.core.config import AT_LEAST_1, NONNEGATIVE, POSITIVE, ConfigError, doc, doc_factory
from polyrl.core.options import Options, field_meta
from polyrl.core.registry import nearest

JOINT_MODES = ("aligned", "cross")


@dataclass
class MemberLoss:
    """An agent's own loss settings: each one set replaces the recipe's ``algorithm`` field
    of that name in its policy's update (a diffusion painter: Flow-GRPO's clip range and
    Gaussian KL; DiffusionNFT's loss); null: the recipe's."""

    policy_loss: str | None = doc(None, "policy loss (algorithm.policy_loss)")
    clip_ratio_low: float | None = doc(None, "algorithm.clip_ratio_low")
    clip_ratio_high: float | None = doc(None, "algorithm.clip_ratio_high")
    clip_ratio_c: float | None = doc(None, "algorithm.clip_ratio_c (.inf: no dual clip)")
    kl_coef: float | None = doc(None, "algorithm.kl_coef")
    kl_estimator: str | None = doc(
        None, "algorithm.kl_estimator (gaussian_mean: a diffusion policy's own)"
    )
    loss_agg: str | None = doc(None, "algorithm.loss_agg")

    def overrides(self) -> dict[str, Any]:
        return {
            f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None
        }


@dataclass
class AgentSpec:
    """One agent: a name, the policy it acts with, its role prompt, whether it trains."""

    name: str = dataclasses.field(
        metadata={"doc": "agent name the workflow addresses (team[name])"}
    )
    policy: str = doc(
        "",
        "policy it acts with (a key of `policies`); empty: the policy named like "
        "the agent, else the only policy",
    )
    role: str | None = doc(
        None,
        "role prompt, sent as the system message of every act(); "
        "null: the workflow's default for this agent",
    )
    train: bool | None = doc(
        None,
        "false: acts, but its rows are not trained (frozen agent on a "
        "shared policy); null: its policy's train flag",
    )
    max_new_tokens: int | None = doc(None, "response limit of this agent (default: rollout's)")
    temperature: float | None = doc(None, "sampling temperature of this agent (default: rollout's)")
    loss: MemberLoss = doc_factory(
        MemberLoss, "its policy's own loss settings (null fields: the recipe's algorithm)"
    )


@dataclass
class CriticOptions:
    """A centralized critic: a value head over the joint transcript (see marl/critic.py)."""

    model: str = doc(
        "",
        "critic backbone (local path or hub id; a causal LM whose last hidden "
        "state feeds a scalar head); empty: no critic, group baselines",
    )
    build: str | None = doc(
        None, "model builder to run first when the path is missing (e.g. tiny_qwen2)"
    )
    build_args: dict = doc({}, "arguments of the builder")
    lr: float = doc(1e-4, "AdamW learning rate of the critic's backbone and head", bound=POSITIVE)
    epochs: int = doc(1, "passes over each step's (state, return) pairs", bound=AT_LEAST_1)
    micro_batch_size: int = doc(64, "states per forward/backward", bound=AT_LEAST_1)
    max_grad_norm: float = doc(1.0, "gradient clipping of the critic (0: off)", bound=NONNEGATIVE)


@dataclass
class MarlOptions(Options):
    """What every multi-agent workflow takes; ``@workflow`` adds ``joint``, ``tree`` (if
    multi-turn) and the workflow function's keyword parameters."""

    agents: list[AgentSpec] = doc(
        [],
        "the agents, in the order the workflow sees them; empty: one per role the "
        "workflow names, each on the policy of that name (or the only policy)",
    )
    joint: str = doc("aligned", "how the agents' samples form joint actions")
    critic: CriticOptions = doc_factory(
        CriticOptions,
        "centralized critic: with a model, an agent's advantage is its return "
        "minus the critic's value of the joint state it acted in (PPO-style), "
        "instead of a group baseline",
    )


MARL_FIELDS = ("agents", "joint", "critic", "tree")
JOINT_DOC = (
    "aligned: the g-th sample of each agent form joint action g (G joint actions); "
    "cross: every combination (G^N), a completion's value is the mean (or sum, "
    "algorithm.credit_args.cross_value) over the joint actions it is in"
)
TREE_DOC = (
    "multi-turn: each joint action branches into G children per turn and groups are "
    "siblings (else the G lines continue one to one and groups are per turn)"
)


def function_params(name: str, fn: Callable) -> list[inspect.Parameter]:
    """The keyword parameters of ``async def fn(ep, team, ...)``: the workflow's own options."""
    params = list(inspect.signature(fn).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) < 2 or not all(p.kind in positional for p in params[:2]):
        raise TypeError(f"workflow {name!r}: the function must take (ep, team, ...)")
    out = []
    for p in params[2:]:
        if p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            raise TypeError(
                f"workflow {name!r}: takes *{p.name}/**{p.name}, so its options cannot be "
                "checked; give each option as a keyword parameter with a default"
            )
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(f"workflow {name!r}: option {p.name!r} must be a keyword parameter")
        if p.name in MARL_FIELDS:
            raise TypeError(
                f"workflow {name!r}: parameter {p.name!r} clashes with the rollout.args "
                f"every multi-agent workflow has ({', '.join(MARL_FIELDS)}); rename it"
            )
        out.append(p)
    return out


def workflow_options(
    name: str, fn: Callable, joints: Sequence[str], multi_turn: bool
) -> type[MarlOptions]:
    """The options dataclass of one workflow: :class:`MarlOptions`, ``joint`` limited to
    ``joints``, ``tree`` when ``multi_turn``, then ``fn``'s keyword parameters."""
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as e:
        raise TypeError(f"workflow {name!r}: its annotations cannot be resolved ({e})") from e
    fields: list[tuple] = [
        (
            "joint",
            Literal[tuple(joints)],
            dataclasses.field(default=joints[0], metadata={"doc": JOINT_DOC}),
        )
    ]
    if multi_turn:
        fields.append(("tree", bool, dataclasses.field(default=False, metadata={"doc": TREE_DOC})))
    for p in function_params(name, fn):
        tp, meta = field_meta(hints.get(p.name, Any))  # doc, and a Bound if any
        if p.default is inspect.Parameter.empty:
            f = dataclasses.field(metadata=meta)
        elif isinstance(p.default, (list, dict, set)):
            f = dataclasses.field(default_factory=lambda v=p.default: type(v)(v), metadata=meta)
        else:
            f = dataclasses.field(default=p.default, metadata=meta)
        fields.append((p.name, tp, f))
    title = "".join(w.capitalize() for w in name.replace("-", "_").split("_")) + "Options"
    cls = dataclasses.make_dataclass(title, fields, bases=(MarlOptions,), kw_only=True)
    cls.__doc__ = (inspect.getdoc(fn) or "").split("\n\n")[0]
    # Importable as <module>.<function name>.options (the decorator leaves the spec there),
    # so pickle finds the class by reference (Ray ships the recipe to its actors).
    cls.__module__ = getattr(fn, "__module__", __name__)
    cls.__qualname__ = f"{getattr(fn, '__name__', name)}.options"
    return cls


def resolve_agents(
    agents: Sequence[AgentSpec],
    *,
    workflow: str,
    roles: dict[str, str] | None,
    policies: dict[str, Any],
    min_agents: int = 1,
) -> list[AgentSpec]:
    """The recipe's agents with every default filled in (new objects; the recipe's stay as
    written): names checked against the workflow's roles, policies against ``policies``."""
    if not agents:
        if not roles:
            raise ConfigError(
                f"workflow {workflow!r} needs rollout.args.agents: a list of "
                "{name, policy, role} entries"
            )
        agents = [AgentSpec(name=r) for r in roles]
    out = [dataclasses.replace(a) for a in agents]
    names = [a.name for a in out]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"rollout.args.agents names agent {name!r} twice")
    if roles:
        for name in names:
            if name not in roles:
                hint = nearest(name, list(roles))
                raise ConfigError(
                    f"rollout.args.agents: workflow {workflow!r} has no agent {name!r}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                    + f" Its agents: {', '.join(roles)}."
                )
        missing = [r for r in roles if r not in names]
        if missing:
            raise ConfigError(
                f"rollout.args.agents lacks {', '.join(map(repr, missing))}: "
                f"workflow {workflow!r} needs agents {', '.join(roles)}"
            )
    if len(out) < min_agents:
        raise ConfigError(
            f"workflow {workflow!r} needs at least {min_agents} agents, "
            f"rollout.args.agents has {len(out)}"
        )
    for i, agent in enumerate(out):
        where = f"rollout.args.agents[{i}] ({agent.name})"
        if not agent.policy:
            if agent.name in policies:
                agent.policy = agent.name
            elif len(policies) == 1:
                agent.policy = next(iter(policies))
            else:
                raise ConfigError(
                    f"{where}: say which policy it uses (policy: one of "
                    f"{', '.join(policies)}); no policy is named {agent.name!r}"
                )
        if agent.policy not in policies:
            hint = nearest(agent.policy, list(policies))
            raise ConfigError(
                f"{where}: unknown policy {agent.policy!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" Policies: {', '.join(policies)}."
            )
        if agent.role is None:
            agent.role = (roles or {}).get(agent.name, "")
        policy_trains = bool(getattr(policies[agent.policy], "train", True))
        if agent.train and not policy_trains:
            raise ConfigError(
                f"{where}: train is true but policy {agent.policy!r} has "
                "train: false; a frozen policy cannot train an agent"
            )
        if agent.train is None:
            agent.train = policy_trains
    return out


def check_critic(critic: CriticOptions) -> None:
    """What a critic's options must hold before a model loads (``rollout.args.critic``)."""
    if not critic.model:
        return
    for key, value, ok, need in (
        ("lr", critic.lr, math.isfinite(critic.lr) and critic.lr > 0, "a finite number > 0"),
        ("epochs", critic.epochs, critic.epochs >= 1, ">= 1"),
        ("micro_batch_size", critic.micro_batch_size, critic.micro_batch_size >= 1, ">= 1"),
        ("max_grad_norm", critic.max_grad_norm, critic.max_grad_norm >= 0, ">= 0 (0: off)"),
    ):
        if not ok:
            raise ConfigError(f"rollout.args.critic.{key}={value!r}: must be {need}")
    local = os.path.expanduser(critic.model)
    if not critic.build and local.startswith(("/", ".")) and not os.path.exists(local):
        raise ConfigError(
            f"rollout.args.critic.model={critic.model!r} does not exist "
            "(give a model directory, a hub id, or a build: to create it)"
        )
