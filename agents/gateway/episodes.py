"""What the gateway files per episode: each request's :class:`Call` and its
:class:`Choice` s (the record's rows), the prompt's :class:`Images`, and the episode's
:class:`EpisodeState` (its secrets, its calls, what it has spent). The server fills them;
the APIs answer from them; the workflow builds the record from them.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from polyrl.agents.gateway.limits import Spent
from polyrl.core.rollout.data import PromptItem
from polyrl.core.segment import Tokens


@dataclass
class Choice:
    """One answer: the engine's prompt and sampled token segments (every per-token fact it
    recorded, the record's row), cut to the request's ``max_tokens``, and what was sent."""

    prompt: Tokens  # the request's prompt as the engine took it (Completion.prompt)
    tokens: Tokens  # the sampled tokens (Completion.tokens)
    finish: str  # stop | length | tool_calls
    message: dict  # what the gateway answered (role, content, tool_calls)
    key: tuple  # the normalised message, matched when the agent sends it back
    stop_hit: str | None = None  # the stop string the answer was cut at

    @property
    def ids(self) -> list[int]:
        return self.tokens.ids


@dataclass
class Images:
    """A prompt's images as a VLM policy took them (core ``TakesImageTurns``): the
    per-turn handles, where each image's ids start in the prompt, and all of them joined
    (what the engine and the record's ``vision`` column get)."""

    handles: list
    starts: list[int]
    joined: Any


@dataclass
class Call:
    """One chat completion request of an episode and what the engine answered."""

    model: str
    keys: list[tuple]  # the request's messages, normalised
    tools_key: str
    prompt_ids: list[int]
    choices: list[Choice]
    stitched: bool
    anchor: str  # the last non-assistant message (GiGPO-style grouping)
    temperature: float
    images: Images | None = None  # the prompt's images (a VLM's request); None: none
    held: int = 0  # bytes charged to the episode for it (gateway_limits)


@dataclass
class EpisodeState:
    """One episode: its URL token and its key, the two secrets only its own agent is given
    (every request must carry both), and what its requests filed and cost."""

    id: int
    token: str
    item: PromptItem
    sample: int
    calls: list[Call] = field(default_factory=list)
    open: bool = True
    error: str = ""
    result: Any = None
    asked: int = 0  # completion requests received: the next one's sequence number
    posted: dict[int, float] = field(default_factory=dict)  # turn -> rewards the agent posted
    responses: dict[str, list] = field(default_factory=dict)  # Responses API: id -> messages
    response_bytes: dict[str, int] = field(default_factory=dict)  # id -> bytes it holds
    key: str = field(default_factory=lambda: "pk-" + secrets.token_urlsafe(24))
    spent: Spent = field(default_factory=Spent)
    lock: threading.Lock = field(default_factory=threading.Lock)
    tracer: Any = None  # the timeline recording this episode's step (core.observe.timeline), if any
