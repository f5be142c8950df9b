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

**Images.** An observation may carry images (``PIL.Image``): an image, a list mixing
strings and images (one user message), or messages whose ``content`` is such a list. Only
an agent whose policy takes image turns (:class:`~polyrl.core.interfaces.TakesImageTurns`)
may receive them; the runtime encodes each act's images once and sends them as the
engine request's ``vision``, and the agent's rows carry them in the record's ``vision``
column.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from polyrl.core.rollout.engine import Completion, SamplingParams
from polyrl.core.rollout.paint import Painting
from polyrl.core.segment import Tokens

# ----------------------------------------------------------------------------- data


@dataclass(eq=False)
class Message:
    """One completion of one ``act()``: becomes one record row."""

    agent: str
    text: str
    tokens: Tokens  # what the agent sampled, with every fact recorded (Completion.tokens)
    finish_reason: str
    prompt: Tokens  # what its policy was given (Completion.prompt)
    prompt_text: str
    observation: str  # what the workflow passed to act() (the last user message)
    episode: Episode = field(repr=False)
    vision: Any = field(default=None, repr=False)  # the prompt's images joined; None: none
    painting: Any = field(default=None, repr=False)  # paint(): its core.rollout.paint.Painting
    group: Any = None  # advantage group within (prompt, agent, turn); None: the joint's node
    turn: int = -1  # set by the first joint action it joins
    node: int = 0
    joints: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.tokens.ids

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    @property
    def image(self) -> Any:
        """A painting's pixels (``[3, H, W]`` in [0, 1]); None for a text message."""
        return None if self.painting is None else self.painting.image

    def to_pil(self) -> Any:
        """The painting as a PIL image (what an agent that takes images is shown)."""
        from PIL import Image

        if self.painting is None:
            raise ValueError(f"agent {self.agent!r}: this message is text, not a painting")
        pixels = self.painting.image
        if pixels.dim() == 4:  # a video: its first frame
            pixels = pixels[:, 0]
        arr = (pixels.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        return Image.fromarray(arr)


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
    vision: Any = None  # the policy, when it takes image turns (TakesImageTurns); else None
    paints: bool = False  # its engine serves image requests (core.rollout.paint.PaintsImages)

    def render(self, prompt: Any) -> tuple[str, str]:
        """(full prompt text, observation): the role prompt, then what the workflow passed."""
        return self.render_images(prompt)[:2]

    def render_images(self, prompt: Any) -> tuple[str, str, list]:
        """(full prompt text, observation, images): as :meth:`render`, each image one
        placeholder of the chat template, the images in placeholder order."""
        if isinstance(prompt, str) or _is_image(prompt) or _is_parts(prompt):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in prompt]
            if not messages:
                raise ValueError(f"agent {self.name!r}: act() got an empty message list")
        images: list = []
        for m in messages:
            m["content"] = _content(m.get("content", ""), images, self.name)
        if images and self.vision is None:
            raise TypeError(
                f"agent {self.name!r}: act() got {len(images)} image(s) but its policy "
                f"{self.policy!r} cannot take images (it does not implement TakesImageTurns); "
                "give this agent a vision-language policy (kind: qwen_vl, engine hf_vl) or "
                "describe the image to it in text"
            )
        if self.role and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.role}, *messages]
        observation = _text(messages[-1]["content"])
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            if isinstance(text, list):
                text = text[0]
        else:
            text = "\n\n".join(_text(m["content"]) for m in messages)
        return text, observation, images


def _is_image(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # no PIL: nothing can be an image
        return False
    return isinstance(value, Image.Image)


def _is_parts(value: Any) -> bool:
    """A list of strings, images and ``{"type": ...}`` parts (not chat messages, which have
    a role): one user message's content."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(p, str) or _is_image(p) or (isinstance(p, dict) and "role" not in p)
            for p in value
        )
    )


def _content(content: Any, images: list, agent: str) -> str | list[dict]:
    """A message's content for the chat template: a string as it is, else text parts and
    one ``{"type": "image"}`` per image (the image appended to ``images``)."""
    if isinstance(content, str):
        return content
    parts = []
    for p in content if isinstance(content, list) else [content]:
        if isinstance(p, str):
            parts.append({"type": "text", "text": p})
        elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif _is_image(p) or (isinstance(p, dict) and _is_image(p.get("image"))):
            images.append(p if _is_image(p) else p["image"])
            parts.append({"type": "image"})
        else:
            raise TypeError(
                f"agent {agent!r}: a content part of act() must be a string, a PIL image, "
                f"{{'type': 'text', 'text': ...}} or {{'type': 'image', 'image': <PIL "
                f"image>}}, not {p!r:.80}"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] if p["type"] == "text" else "<image>" for p in content)


# ----------------------------------------------------------------------------- agent API


class Runtime(Protocol):
    """What an agent's handle asks of the episode runtime that serves its acts
    (:class:`polyrl.marl.batching.Runtime`): declared here, so the runtime builds on this
    module and not the other way round."""

    def params_for(
        self, agent: AgentInfo, n: int, max_new_tokens: int | None, temperature: float | None
    ) -> SamplingParams: ...

    async def act(
        self, agent: AgentInfo, text: str, images: Sequence[Any], params: SamplingParams
    ) -> tuple[list[int], list[Completion], Any]: ...

    async def paint(
        self, agent: AgentInfo, text: str, n: int, seed: int | None
    ) -> list[Painting]: ...


class AgentHandle:
    """``team[name]`` inside one episode: ``await agent.act(prompt, n=...)``."""

    def __init__(self, info: AgentInfo, episode: Episode, runtime: Runtime) -> None:
        self.info, self._ep, self._rt = info, episode, runtime

    @property
    def name(self) -> str:
        return self.info.name

    async def act(
        self,
        prompt: Any,
        n: int | None = None,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        group: Any = None,
    ) -> Message | list[Message]:
        """Sample from this agent's policy. ``n=None``: one Message; ``n=k``: a list of k.

        ``prompt`` is the agent's observation (a user message: text, an image, or a list of
        strings and images) or a list of chat messages; the role prompt is put in front as
        the system message. Images need a policy that takes image turns. ``group``: the
        samples' advantage group within (prompt, agent, turn) (say, the painting a judge
        looked at: its answers compete only with each other); None: the joint's node.
        """
        if n is not None and n < 1:
            raise ValueError(f"agent {self.name!r}: act(n={n}) must ask for at least one sample")
        text, observation, images = self.info.render_images(prompt)
        params = self._rt.params_for(self.info, 1 if n is None else n, max_new_tokens, temperature)
        _, completions, vision = await self._rt.act(self.info, text, images, params)
        msgs = [
            self._ep._add(
                Message(
                    self.name,
                    c.text,
                    c.tokens,
                    c.finish_reason,
                    c.prompt,
                    text,
                    observation,
                    self._ep,
                    vision=vision,
                    group=group,
                )
            )
            for c in completions
        ]
        return msgs[0] if n is None else msgs

    async def paint(
        self,
        prompt: str | Message,
        n: int | None = None,
        *,
        seed: int | None = None,
        group: Any = None,
    ) -> Message | list[Message]:
        """Images from this agent's painter (a policy whose engine paints: a diffusion
        policy). ``prompt``: text, or another agent's message (its text). ``n=None``: one
        Message, ``n=k``: a list of k, each holding its painting (``m.image``,
        ``m.to_pil()``). ``seed``: the starting noise from this seed. The paintings of one
        prompt form the painter's advantage group (per-prompt statistics, Flow-GRPO), unless
        ``group`` names another key.
        """
        if not self.info.paints:
            raise TypeError(
                f"agent {self.name!r}: paint() needs a policy whose engine paints images; "
                f"policy {self.info.policy!r} does not (give it kind: diffusion, engine "
                "diffusion), or call act() for text"
            )
        if n is not None and n < 1:
            raise ValueError(f"agent {self.name!r}: paint(n={n}) must ask for at least one image")
        text = prompt.text if isinstance(prompt, Message) else prompt
        if not isinstance(text, str):
            raise TypeError(
                f"agent {self.name!r}: paint() takes a text prompt or a message, not "
                f"{type(prompt).__name__}"
            )
        text = text.strip()
        paintings = await self._rt.paint(self.info, text, 1 if n is None else n, seed)
        msgs = [
            self._ep._add(
                Message(
                    self.name,
                    p.prompt_text,
                    Tokens.given([]),
                    "stop" if not p.error else "error",
                    Tokens.given([]),
                    text,
                    text,
                    self._ep,
                    painting=p,
                    group=("prompt", text) if group is None else group,
                )
            )
            for p in paintings
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
