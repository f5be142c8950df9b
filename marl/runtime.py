"""What runs a multi-agent workflow: ``@workflow``, its spec and the bound workflow.

``@workflow(name, agents=..., joints=..., min_agents=..., multi_turn=...)`` turns an
``async def fn(ep, team, **options)`` (written in the agent API, :mod:`polyrl.marl.api`)
into a :class:`WorkflowSpec`, registered in ``WORKFLOWS`` with its options dataclass
(:func:`polyrl.marl.config.workflow_options`). At config time the spec checks the recipe
(``validate_config``); at run time it builds a :class:`MarlWorkflow`, which plays every
episode of a step at once through the batching :class:`~polyrl.marl.batching.Runtime`,
builds the record (:mod:`polyrl.marl.record`), fits the optional critic after credit
(``learn``) and reports what the rollout cost (``rollout_metrics``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.core.config import ConfigError
from polyrl.core.interfaces import Phase, TakesImageTurns, takes_images
from polyrl.core.options import bind
from polyrl.core.record import strings
from polyrl.core.registry import ENGINES, KL_ESTIMATORS, POLICY_LOSSES, WORKFLOWS, nearest
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.rollout.paint import paints_images
from polyrl.core.rollout.workflow import run_sync
from polyrl.marl.api import AgentHandle, AgentInfo, Episode, Team
from polyrl.marl.batching import Runtime
from polyrl.marl.config import (
    JOINT_MODES,
    AgentSpec,
    MarlOptions,
    check_critic,
    function_params,
    resolve_agents,
    workflow_options,
)
from polyrl.marl.critic import CentralCritic
from polyrl.marl.record import JOINT_POLICY, RESERVED_POLICY_NAMES, build_record
from polyrl.marl.sheets import write_sheet

__all__ = ["JOINT_POLICY", "MarlWorkflow", "WorkflowSpec", "workflow"]


class MarlWorkflow:
    """A multi-agent workflow bound to a run: ``rollout(items, params) -> record``."""

    def __init__(self, spec: WorkflowSpec, ctx: Any, options: MarlOptions) -> None:
        self.spec, self.ctx, self.options = spec, ctx, options
        cfg = ctx.cfg
        agents = spec.resolve_agents(options.agents, cfg.policies)
        self.agents: dict[str, AgentInfo] = {}
        for i, a in enumerate(agents):
            if a.policy not in ctx.policies:
                hint = nearest(a.policy, list(ctx.policies))
                raise ConfigError(
                    f"agent {a.name!r}: unknown policy {a.policy!r}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                )
            self.agents[a.name] = AgentInfo(
                a.name,
                i,
                a.policy,
                a.role or "",
                bool(a.train),
                ctx.policies[a.policy].tokenizer,
                a.max_new_tokens,
                a.temperature,
                policy if isinstance(policy := ctx.policies[a.policy], TakesImageTurns) else None,
                paints_images(ctx.engines[a.policy]),
            )
        self.losses = {a.policy: a.loss.overrides() for a in agents if a.loss.overrides()}
        # the function's own keyword arguments: the options beyond the marl fields
        self.kwargs = {p: getattr(options, p) for p in spec.params}
        self.tree = bool(getattr(options, "tree", False))
        self.prompt_field = getattr(getattr(cfg, "data", None), "prompt_field", "prompt")
        self.last_stats: dict[str, float] = {}
        self.critic = CentralCritic(options.critic) if options.critic.model else None
        self._fit_gen = torch.Generator().manual_seed(int(getattr(cfg, "seed", 0) or 0))
        self._rollouts = 0  # names each rollout's joined images apart
        self._sheets = 0  # contact sheets written (evaluations of a team that paints)
        self.last_episodes: list[Episode] = []

    def rollout(self, items: list, params: SamplingParams, phase: Phase = "train") -> TensorDict:
        record = run_sync(self.arollout(items, params))
        run_dir = getattr(self.ctx, "run_dir", None)
        if phase == "eval" and self.spec.painters and run_dir is not None:
            self._sheets += 1  # what each member saw and did: marl/sheets.py
            write_sheet(run_dir, self.last_episodes, self._sheets)
        return record

    async def arollout(self, items: list, params: SamplingParams) -> TensorDict:
        t0 = time.perf_counter()
        self._rollouts += 1
        runtime = Runtime(self.ctx.engines, params, key=f"marl:{self._rollouts}")
        ids = itertools.count(1)  # joint ids; 0 is the root node
        episodes = [
            Episode(
                k,
                it,
                group_size=params.n,
                mode=self.options.joint,
                tree=self.tree,
                prompt_field=self.prompt_field,
                ids=ids,
            )
            for k, it in enumerate(items)
        ]
        tasks = [asyncio.ensure_future(self._play(ep, runtime)) for ep in episodes]
        await runtime.drive(tasks)
        self.last_episodes = episodes
        stats = {
            "marl/episodes": float(len(episodes)),
            "marl/episode_errors": float(sum(bool(ep.error) for ep in episodes)),
            "marl/generate_rounds": float(runtime.rounds),
            "marl/engine_calls": float(len(runtime.batcher.sizes)),  # a mixed call counts once
            "marl/acts": float(runtime.acts),
            "marl/generate_s": runtime.generate_s,
            "marl/rollout_s": time.perf_counter() - t0,
        }
        stats |= {f"marl/generate_calls/{p}": float(c) for p, c in runtime.calls.items()}
        painted = [m.painting for ep in episodes for m in ep.messages if m.painting is not None]
        if painted:  # text-encoder cuts: counted, never silent
            stats["marl/paintings"] = float(len(painted))
            stats["marl/paint_prompts_cut"] = float(sum(p.cut_tokens > 0 for p in painted))
            stats["marl/paint_errors"] = float(sum(bool(p.error) for p in painted))
        self.last_stats = stats
        record = build_record(episodes, self.agents, ids, critic=self.critic is not None)
        if self.critic is not None:
            metas = strings(record, "meta")
            rows = [i for i, m in enumerate(metas) if "critic_state" in m]
            baseline = torch.full((record.batch_size[0],), float("nan"))
            if rows:
                baseline[rows] = self.critic.values([metas[i]["critic_state"] for i in rows])
            record["baseline"] = baseline
        return record

    def member_algorithm(self, name: str, algo: Any) -> Any:
        """Policy ``name``'s loss settings: the recipe's ``algorithm`` with its agents'
        ``loss`` fields in place (core.rollout.paint.MemberAlgorithm)."""
        own = self.losses.get(name)
        return dataclasses.replace(algo, **own) if own else algo

    def rollout_metrics(self) -> dict[str, float]:
        """What the last rollout cost: episodes and their errors, generate rounds and calls
        per policy, acts, seconds (``ReportsRollout``; the core logs it every step)."""
        return dict(self.last_stats)

    def learn(self, record: TensorDict) -> dict[str, float]:
        """After credit: fit the centralized critic on this step's (joint state, return)
        pairs (valid agent rows). Nothing to learn without a critic."""
        if self.critic is None:
            return {}
        if "returns" not in record.keys():  # noqa: SIM118 (TensorDict)
            raise ValueError(
                "the critic learns from the credit's 'returns' column; "
                "algorithm.credit=magrpo writes it when rollout.args.critic is set"
            )
        metas, valid = strings(record, "meta"), record["valid"].tolist()
        returns = record["returns"]
        rows = [
            i
            for i, m in enumerate(metas)
            if "critic_state" in m and valid[i] and bool(torch.isfinite(returns[i]))
        ]
        return self.critic.fit(
            [metas[i]["critic_state"] for i in rows],
            returns[rows],
            baseline=record["baseline"][rows],
            generator=self._fit_gen,
        )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold besides the policies: the critic (if any)."""
        return {
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "fit_gen": self._fit_gen.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["critic"] is None) != (self.critic is None):
            raise ValueError(
                "checkpoint and recipe disagree about rollout.args.critic "
                f"(checkpoint has {'no ' if state['critic'] is None else 'a '}critic)"
            )
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        self._fit_gen.set_state(state["fit_gen"])

    async def _play(self, ep: Episode, runtime: Runtime) -> None:
        team = Team({name: AgentHandle(info, ep, runtime) for name, info in self.agents.items()})
        try:
            await self.spec.fn(ep, team, **self.kwargs)
            if not ep.joints:
                raise RuntimeError("the workflow formed no joint action (call ep.joint)")
        except Exception as e:  # recorded on the episode's rows, which leave the update
            ep.error = f"episode raised {type(e).__name__}: {e}"


class WorkflowSpec:
    """What ``@workflow`` registers: builds a :class:`MarlWorkflow` and checks recipes.

    ``options`` is this workflow's options dataclass (``rollout.args``, see
    :func:`polyrl.marl.config.workflow_options`); ``params`` the names among them that
    go to the function as keyword arguments.
    """

    def __init__(
        self,
        fn: Callable,
        name: str,
        roles: dict[str, str] | None,
        joints: tuple[str, ...],
        min_agents: int,
        multi_turn: bool,
        painters: tuple[str, ...] = (),
        lookers: tuple[str, ...] = (),
    ) -> None:
        self.fn, self.name, self.roles = fn, name, roles
        self.painters, self.lookers = painters, lookers
        self.joints, self.min_agents, self.multi_turn = joints, min_agents, multi_turn
        self.params = tuple(p.name for p in function_params(name, fn))
        self.options = workflow_options(name, fn, joints, multi_turn)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", name)

    def __call__(self, ctx: Any, **options: Any) -> MarlWorkflow:
        """``workflow(ctx, **rollout.args)``: the core unpacks the bound options here."""
        typed = bind(self.options, options, "rollout.args", "<workflow>", f"workflow {self.name!r}")
        return MarlWorkflow(self, ctx, typed)

    def validate_config(self, cfg: Any) -> None:
        """Called by ``Config.validate`` after the options are bound: what needs the whole
        recipe (agents vs roles and policies, the critic, the credit) before models load."""
        for name in cfg.policies:
            if name in RESERVED_POLICY_NAMES:
                raise ConfigError(f"policy name {name!r} is reserved for joint-action rows")
        from polyrl.marl.credit import MARL_CREDITS

        if cfg.algorithm.credit not in MARL_CREDITS:
            hint = nearest(cfg.algorithm.credit, list(MARL_CREDITS))
            raise ConfigError(
                f"workflow {self.name!r} forms joint actions; algorithm.credit="
                f"{cfg.algorithm.credit!r} cannot credit them. Set algorithm.credit="
                f"{hint or MARL_CREDITS[0]!r} (one of {', '.join(MARL_CREDITS)})."
            )
        opts = cfg.rollout.args
        agents = self.resolve_agents(opts.agents, cfg.policies)
        self._check_kinds(cfg, agents)
        check_critic(opts.critic)
        credit = cfg.algorithm.credit_args
        if opts.critic.model and (credit.counterfactual or credit.shaping_alpha):
            raise ConfigError(
                "rollout.args.critic replaces the group baseline; it does not combine "
                "with algorithm.credit_args.counterfactual or "
                "algorithm.credit_args.shaping_alpha (set those off)"
            )
        if credit.counterfactual and opts.joint != "cross":
            raise ConfigError(
                "algorithm.credit_args.counterfactual needs rollout.args.joint: cross (the "
                "alternatives of one agent with the others fixed come from the cross "
                f"product of the agents' samples); workflow {self.name!r} has joint "
                f"{opts.joint!r}"
            )

    def resolve_agents(
        self, agents: Sequence[AgentSpec], policies: dict[str, Any]
    ) -> list[AgentSpec]:
        """The recipe's ``rollout.args.agents`` resolved against this workflow's roles and
        ``policies`` (:func:`polyrl.marl.config.resolve_agents`)."""
        return resolve_agents(
            agents,
            workflow=self.name,
            roles=self.roles,
            policies=policies,
            min_agents=self.min_agents,
        )

    def _check_kinds(self, cfg: Any, agents: list) -> None:
        """Each agent's policy takes what the workflow sends it, checked from the engine
        classes the recipe names (before any model loads): a painter's engine paints
        images, a looker's takes images, a text agent's engine does not paint; and each
        agent's own loss settings name registered parts, one set per policy."""
        losses: dict[str, dict] = {}
        for a in agents:
            pcfg = cfg.policies[a.policy]
            engine = ENGINES.get(pcfg.engine.name) if pcfg.engine.name in ENGINES else None
            paints = engine is not None and paints_images(engine)
            where = f"rollout.args.agents: agent {a.name!r} (policy {a.policy!r}, kind " + (
                f"{pcfg.kind!r}, engine {pcfg.engine.name!r})"
            )
            if a.name in self.painters and not paints:
                raise ConfigError(
                    f"{where}: workflow {self.name!r} asks it to paint images, which its "
                    "engine cannot; give it a diffusion policy (kind: diffusion, engine.name: "
                    "diffusion)"
                )
            if a.name not in self.painters and paints:
                raise ConfigError(
                    f"{where}: its policy paints images, but workflow {self.name!r} sends it "
                    f"text to answer; painters of this workflow: {list(self.painters) or 'none'}"
                )
            if a.name in self.lookers and not takes_images(engine):
                raise ConfigError(
                    f"{where}: workflow {self.name!r} shows it images, which its engine does "
                    "not take; give it a vision-language policy (kind: qwen_vl, engine.name: "
                    "hf_vl)"
                )
            own = a.loss.overrides()
            if "policy_loss" in own and own["policy_loss"] not in POLICY_LOSSES:
                raise ConfigError(
                    f"{where}: loss.policy_loss={own['policy_loss']!r} is not a policy loss"
                )
            if "kl_estimator" in own and own["kl_estimator"] not in KL_ESTIMATORS:
                raise ConfigError(
                    f"{where}: loss.kl_estimator={own['kl_estimator']!r} is not a KL estimator"
                )
            if own and losses.setdefault(a.policy, own) != own:
                raise ConfigError(
                    f"{where}: agents on policy {a.policy!r} give it different loss settings "
                    f"({losses[a.policy]} and {own}); one policy trains with one loss"
                )


def workflow(
    name: str | None = None,
    *,
    agents: Sequence[str] | dict[str, str] | None = None,
    joints: Sequence[str] = ("aligned",),
    min_agents: int = 1,
    multi_turn: bool = False,
    painters: Sequence[str] = (),
    lookers: Sequence[str] = (),
) -> Callable[[Callable], WorkflowSpec]:
    """Turn ``async def fn(ep, team, **options)`` into a workflow registered as ``name``
    (default: the function's name).

    ``agents``: the agent names the function addresses (with default role prompts when a
    dict); None for workflows over any number of agents. ``joints``: the joint modes it
    supports (``ep.combine`` handles both "aligned" and "cross"); ``rollout.args.joint``
    accepts exactly these. ``multi_turn``: it chains joint actions over turns
    (``ep.joint(parent=...)``), which adds the ``rollout.args.tree`` option. The function's
    keyword parameters after ``(ep, team)`` are its other options; annotate each as
    ``Annotated[T, "doc"]`` so ``polyrl config`` documents it. ``painters``: the agents
    it calls ``paint()`` on (their engines must paint images, and no other agent's may);
    ``lookers``: the agents it shows images (their engines must take images). Both are
    checked when the recipe loads.
    """
    roles = (
        dict(agents)
        if isinstance(agents, dict)
        else ({a: "" for a in agents} if agents is not None else None)
    )
    bad = [j for j in joints if j not in JOINT_MODES]
    if bad or not joints:
        raise ValueError(f"unknown joint modes {bad or list(joints)}; use {JOINT_MODES}")

    def wrap(fn: Callable) -> WorkflowSpec:
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError(f"workflow {fn.__name__!r} must be an async function (ep, team)")
        spec = WorkflowSpec(
            fn,
            name or fn.__name__,
            roles,
            tuple(joints),
            min_agents,
            bool(multi_turn),
            tuple(painters),
            tuple(lookers),
        )
        WORKFLOWS.register(spec.name, spec, options=spec.options)
        return spec

    return wrap
