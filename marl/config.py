"""Typed arguments of a multi-agent workflow (``rollout.args``), checked at config time.

A recipe declares its agents and how their actions form joint actions under
``rollout.args``; everything else there is passed to the workflow function as keyword
arguments::

    rollout:
      workflow: signaling
      args:
        agents:
          - {name: speaker, policy: speaker}
          - {name: listener, policy: listener}
        joint: aligned
        credit: {per_agent_norm: false}

``Config.validate`` calls the registered workflow's ``validate_config(cfg)``, so an unknown
agent, policy or key fails before any model loads, naming the closest valid name.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Any, Literal

from polyrl.core.config import ConfigError, doc, doc_factory, from_dict
from polyrl.core.registry import nearest

JOINT_MODES = ("aligned", "cross")


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


@dataclass
class CreditOptions:
    """How the joint structure becomes per-agent values (read by the ``magrpo`` credit)."""

    cross_value: Literal["mean", "sum"] = doc(
        "mean", "cross mode: a completion's value is the mean or the sum over its joint actions"
    )
    per_agent_norm: bool = doc(False, "normalise advantages to mean 0 / std 1 per agent id")
    counterfactual: bool = doc(
        False,
        "leave-one-out: credit R minus the mean reward of the joint "
        "actions where only this agent acted differently (cross mode)",
    )
    shaping_alpha: float = doc(
        0.0,
        "MAPoRL-style shaping R + alpha (R - Q), Q the agent's "
        "counterfactual value (cross) or its group's mean return",
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
    lr: float = doc(1e-4, "AdamW learning rate of backbone and head")
    epochs: int = doc(1, "passes over each step's (state, return) pairs")
    micro_batch_size: int = doc(64, "states per forward/backward")
    max_grad_norm: float = doc(1.0, "gradient clipping (0: off)")


@dataclass
class MarlArgs:
    """The workflow arguments PolyRL itself reads; other keys go to the workflow function."""

    agents: list[AgentSpec] = doc(
        [],
        "the agents; empty: one per role the workflow names, each on "
        "the policy of that name (or the only policy)",
    )
    joint: Literal["aligned", "cross"] = doc(
        "aligned",
        "aligned: the g-th sample of each agent form joint action g (G joint actions); "
        "cross: every combination (G^N); a completion's value sums/means over them",
    )
    tree: bool = doc(
        False,
        "multi-turn: each joint action branches into G children per turn and "
        "groups are siblings (else the G lines continue one to one and groups "
        "are per turn)",
    )
    credit: CreditOptions = doc_factory(CreditOptions, "credit options (see CreditOptions)")
    critic: CriticOptions = doc_factory(
        CriticOptions,
        "centralized critic: with a model, an agent's advantage is its return "
        "minus the critic's value of the joint state it acted in (PPO-style), "
        "instead of a group baseline",
    )


MARL_KEYS = tuple(f.name for f in dataclasses.fields(MarlArgs))


def split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(PolyRL's keys, the workflow function's keys) of ``rollout.args``."""
    ours = {k: v for k, v in args.items() if k in MARL_KEYS}
    return ours, {k: v for k, v in args.items() if k not in MARL_KEYS}


def parse_args(
    raw: dict[str, Any],
    *,
    workflow: str,
    fn: Any,
    roles: dict[str, str] | None,
    policies: dict[str, Any],
    joints: tuple[str, ...] = ("aligned",),
    min_agents: int = 1,
    source: str = "<config>",
) -> tuple[MarlArgs, dict[str, Any]]:
    """Parse and check ``rollout.args`` against the workflow and the recipe's policies."""
    ours, kwargs = split_args(dict(raw))
    accepted = _accepted_kwargs(fn)
    if accepted is not None:
        for key in kwargs:
            if key not in accepted:
                hint = nearest(key, [*MARL_KEYS, *accepted])
                raise ConfigError(
                    f"unknown key 'rollout.args.{key}' for workflow {workflow!r} in {source}"
                    + (f"; did you mean 'rollout.args.{hint}'?" if hint else "")
                    + f" Valid keys: {', '.join(sorted([*MARL_KEYS, *accepted]))}."
                )
    args = from_dict(MarlArgs, ours, "rollout.args", source)
    if not args.agents:
        if not roles:
            raise ConfigError(
                f"workflow {workflow!r} needs rollout.args.agents: a list of "
                "{name, policy, role} entries"
            )
        args.agents = [AgentSpec(name=r) for r in roles]
    names = [a.name for a in args.agents]
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
    if len(args.agents) < min_agents:
        raise ConfigError(
            f"workflow {workflow!r} needs at least {min_agents} agents, "
            f"rollout.args.agents has {len(args.agents)}"
        )
    for i, agent in enumerate(args.agents):
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
    if args.joint not in joints:
        raise ConfigError(
            f"rollout.args.joint={args.joint!r}: workflow {workflow!r} supports {', '.join(joints)}"
        )
    if args.critic.model and (args.credit.counterfactual or args.credit.shaping_alpha):
        raise ConfigError(
            "rollout.args.critic replaces the group baseline; it does not combine "
            "with credit.counterfactual or credit.shaping_alpha (set those off)"
        )
    if args.critic.model and (args.critic.epochs < 1 or args.critic.micro_batch_size < 1):
        raise ConfigError("rollout.args.critic: epochs and micro_batch_size must be >= 1")
    local = os.path.expanduser(args.critic.model)
    if (
        args.critic.model
        and not args.critic.build
        and local.startswith(("/", "."))
        and not os.path.exists(local)
    ):
        raise ConfigError(
            f"rollout.args.critic.model={args.critic.model!r} does not exist "
            "(give a model directory, a hub id, or a build: to create it)"
        )
    if args.credit.counterfactual and args.joint != "cross":
        raise ConfigError(
            "rollout.args.credit.counterfactual needs joint: cross (the "
            "alternatives of one agent with the others fixed come from the "
            "cross product of the agents' samples)"
        )
    return args, kwargs


def _accepted_kwargs(fn: Any) -> list[str] | None:
    """Keyword arguments a workflow function takes after (ep, team); None: any."""
    try:
        params = list(inspect.signature(fn).parameters.values())[2:]
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
