"""The agent API and the runtime that batches every agent's generations per policy.

A multi-agent workflow is a plain ``async`` function over one episode and its team::

    @workflow("signaling", agents={"speaker": "...", "listener": "..."})
    async def signaling(ep, team):
        msgs = await team["speaker"].act(f"Target: {ep.row['target']}", n=ep.G)
        answers = await ep.gather(team["listener"].act(f"Message: {m.text}") for m in msgs)
        for m, a in zip(msgs, answers):
            ep.joint([m, a], final=a.text)      # joint action g: the g-th of each agent

**Batching.** All episodes of a step run concurrently on one event loop. ``act()`` does not
generate: it queues a request and waits. When every episode is blocked, the runtime flushes
the queue with *one* ``engine.generate`` per policy (per distinct sampling setting), resolves
the waiting acts, and repeats. Two agents on one policy share its call.

**CTDE.** An agent's context is exactly the text its ``act()`` is given, after its role
prompt; nothing else (other agents' prompts, the dataset row) reaches it unless the
workflow writes it into that text.

**The record.** Each completion of an ``act()`` is one row: the agent's policy, agent id,
prompt ids, the exact sampled ids with the engine's log-probs, a loss mask over the
response, and group keys (prompt uid, agent id, turn, node). Each joint action declared with
``ep.joint`` is one more row (policy ``"<joint>"``, never trained) whose response is the
joint's final output and whose prompt is the readable transcript: the recipe's reward terms
score these rows, once per joint action. Agent rows enter the record *pending* (not valid,
no error) so rewards skip them; the ``magrpo`` credit turns joint rewards into per-agent
values and advantages and makes them valid. An episode that raises has its error written on
all its rows, which leave the update and are counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.core.config import ConfigError
from polyrl.core.engine import SamplingParams
from polyrl.core.options import bind
from polyrl.core.record import mark_invalid, strings, text_record
from polyrl.core.registry import WORKFLOWS, nearest
from polyrl.core.workflow import run_sync
from polyrl.marl.config import (
    JOINT_MODES,
    MarlOptions,
    check_critic,
    function_params,
    resolve_agents,
    workflow_options,
)
from polyrl.marl.critic import CentralCritic, joint_state

JOINT_POLICY = "<joint>"  # the policy column of joint-action rows: no policy trains them
RESERVED_POLICY_NAMES = (JOINT_POLICY,)


# ----------------------------------------------------------------------------- data


@dataclass(eq=False)
class Message:
    """One completion of one ``act()``: becomes one record row."""

    agent: str
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_ids: list[int]
    prompt_text: str
    observation: str  # what the workflow passed to act() (the last user message)
    episode: Episode = field(repr=False)
    turn: int = -1  # set by the first joint action it joins
    node: int = 0
    joints: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Joint:
    """A joint action: one node of the episode tree, scored as one record row."""

    id: int
    turn: int
    parent: Joint | None
    messages: list[Message]
    final: str
    info: dict
    score: bool

    def path(self) -> list[Joint]:
        """The joint actions from the root down to this one."""
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass
class AgentInfo:
    """An agent as the runtime knows it (built once per run from the recipe)."""

    name: str
    agent_id: int
    policy: str
    role: str
    train: bool
    tokenizer: Any
    max_new_tokens: int | None = None
    temperature: float | None = None

    def render(self, prompt: str | Sequence[dict]) -> tuple[str, str]:
        """(full prompt text, observation): the role prompt, then what the workflow passed."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in prompt]
            if not messages:
                raise ValueError(f"agent {self.name!r}: act() got an empty message list")
        if self.role and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.role}, *messages]
        observation = str(messages[-1].get("content", ""))
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            if isinstance(text, list):
                text = text[0]
        else:
            text = "\n\n".join(str(m["content"]) for m in messages)
        return text, observation


@dataclass(eq=False)
class _Request:
    agent: AgentInfo
    text: str
    observation: str
    params: SamplingParams
    future: asyncio.Future
    episode: Episode


# ----------------------------------------------------------------------------- agent API


class AgentHandle:
    """``team[name]`` inside one episode: ``await agent.act(prompt, n=...)``."""

    def __init__(self, info: AgentInfo, episode: Episode, runtime: Runtime) -> None:
        self.info, self._ep, self._rt = info, episode, runtime

    @property
    def name(self) -> str:
        return self.info.name

    async def act(
        self,
        prompt: str | Sequence[dict],
        n: int | None = None,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
    ) -> Message | list[Message]:
        """Sample from this agent's policy. ``n=None``: one Message; ``n=k``: a list of k.

        ``prompt`` is the agent's observation (a user message) or a list of chat messages;
        the role prompt is put in front as the system message.
        """
        if n is not None and n < 1:
            raise ValueError(f"agent {self.name!r}: act(n={n}) must ask for at least one sample")
        text, observation = self.info.render(prompt)
        params = self._rt.params_for(self.info, 1 if n is None else n, max_new_tokens, temperature)
        future = asyncio.get_running_loop().create_future()
        self._rt.submit(_Request(self.info, text, observation, params, future, self._ep))
        prompt_ids, completions = await future
        msgs = [
            self._ep._add(
                Message(
                    self.name,
                    c.text,
                    list(c.token_ids),
                    list(c.logprobs),
                    c.finish_reason,
                    prompt_ids,
                    text,
                    observation,
                    self._ep,
                )
            )
            for c in completions
        ]
        return msgs[0] if n is None else msgs


class Team(dict):
    """name -> AgentHandle for one episode."""


class Episode:
    """One dataset row played out by the team; collects messages and joint actions."""

    def __init__(
        self,
        index: int,
        item: Any,
        *,
        group_size: int,
        mode: str,
        tree: bool,
        prompt_field: str,
        ids: Iterable[int],
    ) -> None:
        self.index = index
        self.item = item
        self.uid = int(item.uid)
        self.row: dict = item.row if isinstance(item.row, dict) else {}
        self.answer = item.answer
        raw = self.row.get(prompt_field)
        self.task: Any = raw if raw is not None else item.prompt_text
        self.G = group_size
        self.mode = mode
        self.tree = tree
        self.messages: list[Message] = []
        self.joints: list[Joint] = []
        self.error = ""
        self.info: dict = {}
        self._ids = ids

    def _add(self, msg: Message) -> Message:
        self.messages.append(msg)
        return msg

    async def gather(self, awaitables: Iterable[Awaitable]) -> list:
        """``asyncio.gather`` over an iterable: run several acts at once, keep their order."""
        return list(await asyncio.gather(*awaitables))

    def joint(
        self,
        messages: Sequence[Message],
        *,
        final: str,
        parent: Joint | None = None,
        info: dict | None = None,
        score: bool = True,
    ) -> Joint:
        """Declare a joint action of ``messages``; ``final`` is the output rewards score.

        ``parent``: the previous turn's joint action (multi-turn); the turn is its turn + 1.
        ``score=False``: an intermediate turn without a reward of its own (reward 0).
        """
        if parent is not None and parent not in self.joints:
            raise ValueError("ep.joint: parent is not a joint action of this episode")
        turn = 0 if parent is None else parent.turn + 1
        node = parent.id if (parent is not None and self.tree) else 0
        if not messages:
            raise ValueError("ep.joint: a joint action needs at least one message")
        for m in messages:
            if not isinstance(m, Message) or m.episode is not self:
                raise ValueError("ep.joint: every message must come from an act() of this episode")
            if m.joints and (m.turn, m.node) != (turn, node):
                raise ValueError(
                    f"ep.joint: a message of agent {m.agent!r} is already in a joint "
                    f"action of turn {m.turn}; one message belongs to one turn"
                )
        j = Joint(
            next(self._ids), turn, parent, list(messages), str(final), dict(info or {}), bool(score)
        )
        for m in messages:
            m.turn, m.node = turn, node
            m.joints.append(j.id)
        self.joints.append(j)
        return j

    def combine(
        self,
        groups: Sequence[Sequence[Message]],
        final: Callable[[tuple[Message, ...]], str],
        *,
        parent: Joint | None = None,
        score: bool = True,
    ) -> list[Joint]:
        """Joint actions over the agents' samples: aligned (the g-th of each) or cross
        (every combination), as the recipe's ``rollout.args.joint`` says."""
        if self.mode == "aligned":
            sizes = {len(g) for g in groups}
            if len(sizes) > 1:
                raise ValueError(f"aligned joint actions need equal sample counts, got {sizes}")
            combos: Iterable[tuple[Message, ...]] = zip(*groups, strict=True)
        else:
            combos = itertools.product(*groups)
        return [self.joint(list(c), final=final(c), parent=parent, score=score) for c in combos]


# ----------------------------------------------------------------------------- runtime


class Runtime:
    """Queues act() requests of all episodes; flushes one generate per policy per round."""

    def __init__(self, engines: dict[str, Any], params: SamplingParams) -> None:
        self.engines = engines
        self.params = params
        self.pending: list[_Request] = []
        self.calls: Counter[str] = Counter()
        self.rounds = 0
        self.acts = 0
        self.done = 0
        self.generate_s = 0.0
        self._wake: asyncio.Future | None = None

    def params_for(
        self, agent: AgentInfo, n: int, max_new_tokens: int | None, temperature: float | None
    ) -> SamplingParams:
        p = self.params
        temp = p.temperature
        if p.temperature > 0:  # a greedy evaluation stays greedy
            temp = (
                temperature
                if temperature is not None
                else (agent.temperature if agent.temperature is not None else p.temperature)
            )
        return dataclasses.replace(
            p,
            n=n,
            temperature=temp,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids),
            max_new_tokens=max_new_tokens or agent.max_new_tokens or p.max_new_tokens,
        )

    def submit(self, request: _Request) -> None:
        self.pending.append(request)
        self.acts += 1
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _settle(self) -> None:
        """Yield until nothing moves any more: every live episode waits on an act()."""
        stable, last = 0, None
        while stable < 3:
            await asyncio.sleep(0)
            sig = (len(self.pending), self.acts, self.done, len(asyncio.all_tasks()))
            stable = stable + 1 if sig == last else 0
            last = sig

    async def drive(self, tasks: list[asyncio.Task]) -> None:
        try:
            while True:
                await self._settle()
                if self.pending:
                    self.flush()
                    continue
                live = [t for t in tasks if not t.done()]
                if not live:
                    return
                # Episodes wait on something else (an async tool, a sandbox): sleep until a
                # new request arrives or an episode ends.
                self._wake = asyncio.get_running_loop().create_future()
                await asyncio.wait([self._wake, *live], return_when=asyncio.FIRST_COMPLETED)
                self._wake = None
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    def flush(self) -> None:
        """One engine.generate per (policy, sampling setting) for everything queued."""
        requests, self.pending = self.pending, []
        self.rounds += 1
        groups: dict[tuple, list[_Request]] = defaultdict(list)
        for r in requests:
            p = r.params
            groups[
                (
                    r.agent.policy,
                    p.temperature,
                    p.top_p,
                    p.max_new_tokens,
                    tuple(p.stop),
                    tuple(p.stop_token_ids),
                )
            ].append(r)
        for (policy, *_), reqs in groups.items():
            self._generate(policy, reqs)

    def _generate(self, policy: str, reqs: list[_Request]) -> None:
        tokenizer = reqs[0].agent.tokenizer
        special = not getattr(tokenizer, "chat_template", None)
        ids = tokenizer([r.text for r in reqs], add_special_tokens=special)["input_ids"]
        counts = [r.params.n for r in reqs]
        if len(set(counts)) == 1:  # the engine samples n per prompt itself
            prompts, owner = ids, list(range(len(reqs)))
            params = dataclasses.replace(reqs[0].params, n=counts[0])
        else:  # mixed n: one prompt copy per sample, still one call
            owner = [j for j, k in enumerate(counts) for _ in range(k)]
            prompts = [ids[j] for j in owner]
            params = dataclasses.replace(reqs[0].params, n=1)
        t0 = time.perf_counter()
        completions = self.engines[policy].generate(prompts, params)
        self.generate_s += time.perf_counter() - t0
        self.calls[policy] += 1
        out: list[list] = [[] for _ in reqs]
        for c in completions:
            out[owner[c.prompt_index]].append(c)
        for j, r in enumerate(reqs):
            if len(out[j]) != r.params.n:
                raise RuntimeError(
                    f"engine of policy {policy!r} returned {len(out[j])} "
                    f"completions for a prompt that asked for {r.params.n}"
                )
            if not r.future.done():  # an episode that already failed may have cancelled it
                r.future.set_result((list(ids[j]), out[j]))


# ----------------------------------------------------------------------------- workflow


class MarlWorkflow:
    """A multi-agent workflow bound to a run: ``rollout(items, params) -> record``."""

    def __init__(self, spec: WorkflowSpec, ctx: Any, options: MarlOptions) -> None:
        self.spec, self.ctx, self.options = spec, ctx, options
        cfg = ctx.cfg
        agents = resolve_agents(
            options.agents,
            workflow=spec.name,
            roles=spec.roles,
            policies=cfg.policies,
            min_agents=spec.min_agents,
        )
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
            )
        # the function's own keyword arguments: the options beyond the marl fields
        self.kwargs = {p: getattr(options, p) for p in spec.params}
        self.tree = bool(getattr(options, "tree", False))
        self.prompt_field = getattr(getattr(cfg, "data", None), "prompt_field", "prompt")
        self.last_stats: dict[str, float] = {}
        self.critic = CentralCritic(options.critic) if options.critic.model else None
        self._fit_gen = torch.Generator().manual_seed(int(getattr(cfg, "seed", 0) or 0))

    def rollout(self, items: list, params: SamplingParams) -> TensorDict:
        return run_sync(self.arollout(items, params))

    async def arollout(self, items: list, params: SamplingParams) -> TensorDict:
        t0 = time.perf_counter()
        runtime = Runtime(self.ctx.engines, params)
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
        stats = {
            "marl/episodes": float(len(episodes)),
            "marl/episode_errors": float(sum(bool(ep.error) for ep in episodes)),
            "marl/generate_rounds": float(runtime.rounds),
            "marl/acts": float(runtime.acts),
            "marl/generate_s": runtime.generate_s,
            "marl/rollout_s": time.perf_counter() - t0,
        }
        stats |= {f"marl/generate_calls/{p}": float(c) for p, c in runtime.calls.items()}
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
        finally:
            runtime.done += 1


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
    ) -> None:
        self.fn, self.name, self.roles = fn, name, roles
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
        resolve_agents(
            opts.agents,
            workflow=self.name,
            roles=self.roles,
            policies=cfg.policies,
            min_agents=self.min_agents,
        )
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


def workflow(
    name: str | None = None,
    *,
    agents: Sequence[str] | dict[str, str] | None = None,
    joints: Sequence[str] = ("aligned",),
    min_agents: int = 1,
    multi_turn: bool = False,
) -> Callable[[Callable], WorkflowSpec]:
    """Turn ``async def fn(ep, team, **options)`` into a workflow registered as ``name``
    (default: the function's name).

    ``agents``: the agent names the function addresses (with default role prompts when a
    dict); None for workflows over any number of agents. ``joints``: the joint modes it
    supports (``ep.combine`` handles both "aligned" and "cross"); ``rollout.args.joint``
    accepts exactly these. ``multi_turn``: it chains joint actions over turns
    (``ep.joint(parent=...)``), which adds the ``rollout.args.tree`` option. The function's
    keyword parameters after ``(ep, team)`` are its other options; annotate each as
    ``Annotated[T, "doc"]`` so ``polyrl config`` documents it.
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
            fn, name or fn.__name__, roles, tuple(joints), min_agents, bool(multi_turn)
        )
        WORKFLOWS.register(spec.name, spec, options=spec.options)
        return spec

    return wrap


# ----------------------------------------------------------------------------- record


def _transcript(joint: Joint) -> tuple[list[dict], str]:
    turns, lines = [], []
    for node in joint.path():
        for m in node.messages:
            turns.append(
                {"turn": node.turn, "agent": m.agent, "observation": m.observation, "text": m.text}
            )
            obs = m.observation.replace("\n", " / ")
            lines.append(f"[t{node.turn} {m.agent}] {obs} -> {m.text.strip()}")
    return turns, "\n".join(lines)


def build_record(
    episodes: list[Episode],
    agents: dict[str, AgentInfo],
    ids: Iterable[int],
    *,
    critic: bool = False,
) -> TensorDict:
    """One text record: joint-action rows first (for readable samples), then agent rows.

    A joint-action row (policy ``JOINT_POLICY``, ``agent_id`` -1, ``joint_id`` its id)
    carries in ``meta`` the structure the ``magrpo`` credit reads:

    - ``joint``: its id; ``parent``: the previous turn's joint id (0: a root), so returns
      flow up the episode tree; ``turn``: its depth;
    - ``episode``: the episode's index in the batch (counterfactuals compare joint actions
      of one episode only); ``scored``: false for a turn declared ``score=False``, whose
      reward counts as 0;

    and, for reading and for rewards: ``final`` (the scored text, also its response),
    ``transcript`` (every message on the path from the root, with turn, agent and
    observation), ``answer`` and ``row`` (the dataset row), ``info`` / ``episode_info``
    (what the workflow attached) and ``episode_error``.

    An agent row carries ``agent`` (its name), ``episode`` and ``joints`` (the ids of the
    joint actions its message is in: its value comes from their returns); with a critic
    (``critic=True``) also ``critic_state``, the joint-state text the critic values.

    Padding uses id 0 for every policy: pads sit under the masks, and 0 exists in every
    vocabulary (one record, no per-policy concatenation).
    """
    cols: dict[str, list] = defaultdict(list)
    errors: list[tuple[int, str]] = []
    pending: list[int] = []

    def add(**row: Any) -> int:
        for k, v in row.items():
            cols[k].append(v)
        return len(cols["uid"]) - 1

    for ep in episodes:
        joints = ep.joints or ([Joint(next(ids), 0, None, [], "", {}, True)] if ep.error else [])
        for j in joints:
            turns, text = _transcript(j)
            k = add(
                prompt_ids=[],
                response_ids=[],
                logprobs=[],
                loss_mask=[],
                policy=JOINT_POLICY,
                uid=ep.uid,
                agent_id=-1,
                turn=j.turn,
                node=j.parent.id if (j.parent is not None and ep.tree) else 0,
                joint_id=j.id,
                prompt_text=text,
                response_text=j.final,
                truncated=False,
                meta={
                    "answer": ep.answer,
                    "row": ep.row,
                    "final": j.final,
                    "transcript": turns,
                    "joint": j.id,
                    "parent": j.parent.id if j.parent is not None else 0,
                    "turn": j.turn,
                    "episode": ep.index,
                    "scored": j.score,
                    "info": j.info,
                    "episode_info": ep.info,
                    "episode_error": bool(ep.error),
                },
            )
            if ep.error:
                errors.append((k, ep.error))
            elif not j.score:
                pending.append(k)
    agent_rows = []
    for ep in episodes:
        by_id = {j.id: j for j in ep.joints}
        for m in ep.messages:
            info = agents[m.agent]
            extra = {}
            if critic and m.joints:
                above = by_id[m.joints[0]].parent
                lines = _transcript(above)[1].split("\n") if above is not None else []
                extra["critic_state"] = joint_state(str(ep.task), lines, max(m.turn, 0), m.agent)
            k = add(
                prompt_ids=m.prompt_ids,
                response_ids=m.token_ids,
                logprobs=m.logprobs,
                loss_mask=[1 if info.train else 0] * len(m.token_ids),
                policy=info.policy,
                uid=ep.uid,
                agent_id=info.agent_id,
                turn=max(m.turn, 0),
                node=m.node,
                joint_id=-1,
                prompt_text=m.prompt_text,
                response_text=m.text,
                truncated=m.finish_reason == "length",
                meta={
                    "answer": ep.answer,
                    "agent": m.agent,
                    "episode": ep.index,
                    "joints": list(m.joints),
                    **extra,
                },
            )
            agent_rows.append(k)
            err = ep.error or (
                "" if m.joints else f"agent {m.agent!r}: message is in no joint action (ep.joint)"
            )
            if err:
                errors.append((k, err))
            else:
                pending.append(k)  # the credit validates rows whose joints were scored
    if not cols["uid"]:
        raise RuntimeError("the workflow produced no rows")
    rec = text_record(
        prompt_ids=cols["prompt_ids"],
        response_ids=cols["response_ids"],
        rollout_logprobs=cols["logprobs"],
        policy=cols["policy"],
        uid=cols["uid"],
        pad_id=0,
        loss_mask=cols["loss_mask"],
        agent_id=cols["agent_id"],
        turn=cols["turn"],
        node=cols["node"],
        prompt_text=cols["prompt_text"],
        response_text=cols["response_text"],
        meta=cols["meta"],
        truncated=cols["truncated"],
    )
    rec["joint_id"] = torch.tensor(cols["joint_id"], dtype=torch.long)
    if pending:
        rec["valid"][torch.tensor(pending)] = False
    if errors:
        mark_invalid(rec, [k for k, _ in errors], [e for _, e in errors])
    return rec
