"""The agent API a multi-agent workflow is written in: an episode and its team.

A multi-agent workflow is a plain ``async`` function over one episode and its team::

    @workflow("signaling", agents={"speaker": "...", "listener": "..."})
    async def signaling(ep, team):
        msgs = await team["speaker"].act(f"Target: {ep.row['target']}", n=ep.G)
        answers = await ep.gather(team["listener"].act(f"Message: {m.text}") for m in msgs)
        for m, a in zip(msgs, answers):
            ep.joint([m, a], final=a.text)      # joint action g: the g-th of each agent

``team[name].act(prompt, n=...)`` samples from the agent's policy (through the batching
:class:`~polyrl.marl.batching.Runtime`); ``ep.joint`` / ``ep.combine`` declare the joint
actions the recipe's rewards score.

**CTDE.** An agent's context is exactly the text its ``act()`` is given, after its role
prompt; nothing else (other agents' prompts, the dataset row) reaches it unless the
workflow writes it into that text.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polyrl.core.engine import SamplingParams

if TYPE_CHECKING:
    from polyrl.marl.batching import Runtime

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
class Request:
    """One act() waiting in the runtime's queue for its policy's next generate call."""

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
        self._rt.submit(Request(self.info, text, observation, params, future, self._ep))
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
