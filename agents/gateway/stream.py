"""Token-by-token streaming for the gateway's APIs: the engine's tokens reach the HTTP
client while the engine still decodes.

:class:`Live` is one streamed request: the server gives each choice's engine request an
``on_token`` sink (``core.rollout.engine.Request.on_token``, for engines whose caps
declare ``streams_tokens``), which the engine calls from its worker thread at every
decoding step; the sink puts the token on an asyncio queue of the server's loop
(``loop.call_soon_threadsafe``), and the API's event generator reads the queue. When the
engine call ends, the finished :class:`~polyrl.agents.gateway.server.Call` (the record's
exact ids and log-probs) closes the stream; an engine that cannot stream (vLLM's offline
``LLM.generate``) sends every token then.

:class:`Reply` says how much of a choice's text is safe to show while it grows: never a
character split across tokens, never text a stop string or a tool call will cut from the
answer (the longest tail that could start one is held back), never a ``<think>`` block
before it is closed (Responses and Messages show it as a reasoning block). So the deltas an
agent reads, joined, are the final answer's text.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Container, Coroutine
from typing import Any

from polyrl.agents.gateway.api import StreamEvents
from polyrl.agents.gateway.episodes import Call
from polyrl.agents.gateway.errors import failure
from polyrl.agents.gateway.requests import Request
from polyrl.agents.gateway.tokens import THINK_CLOSE, THINK_OPEN, split_think, token_entry

TOOL_OPEN = "<tool_call>"
_END = object()


class Live:
    """One streamed request: per choice, the tokens the engine sampled so far, then the
    call. The sampling runs as its own task, so a client that goes away mid-stream leaves
    the call to finish and be filed in the episode as usual."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.prompt_len = 0  # set once the prompt is built
        self._head: Any = None

    def sink(self, choice: int) -> Callable[[int, int, float, Any], None]:
        """``Request.on_token`` of choice ``choice`` (called on the engine's thread)."""

        def on_token(sample: int, token: int, logprob: float, top: Any) -> None:
            item = (choice, token, logprob, top)
            with contextlib.suppress(RuntimeError):  # the server's loop is gone (shut down)
                self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

        return on_token

    def start(self, sampling: Coroutine[Any, Any, Call]) -> None:
        self.task = self.loop.create_task(sampling)
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled():
            task.exception()  # read here: a client that left never asks for it
        self.queue.put_nowait(_END)

    async def first(self) -> None:
        """Wait for the first token, or for the call's end; a call that failed before any
        token raises here, so the client gets an HTTP error, not a broken stream."""
        self._head = await self.queue.get()
        if self._head is _END:
            self.call()

    async def tokens(self) -> AsyncIterator[tuple[int, int, float, Any]]:
        """(choice, token id, log-prob, top alternatives) as the engine samples them."""
        item = self._head if self._head is not None else await self.queue.get()
        self._head = None
        while item is not _END:
            yield item
            item = await self.queue.get()
        self.queue.put_nowait(_END)  # a second reader ends too

    def call(self) -> Call:
        """The finished call (raises the sampling's error)."""
        assert self.task is not None and self.task.done()
        return self.task.result()


def held(text: str, marks: list[str]) -> int:
    """The length of the longest tail of ``text`` that could begin one of ``marks``."""
    best = 0
    for m in marks:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class Reply:
    """One choice's tokens as they arrive and the text safe to show so far (see the
    module's docstring). ``think``: a leading ``<think>`` block is reasoning (Responses,
    Messages); ``tools``: the request has tools, so a ``<tool_call>`` block is cut from the
    text and surrounding whitespace may be stripped from it."""

    def __init__(self, tok: Any, req: Request, *, think: bool) -> None:
        self.tok, self.limit, self.stops = tok, req.max_tokens, list(req.stop or [])
        self.tools, self.think = bool(req.tools), think
        self.ids: list[int] = []
        # Detokenized incrementally: ``text`` is ids[:read]'s, whole characters; a new
        # token's text is what decoding ids[start:] adds to decoding ids[start:read], so a
        # token's text sees the token before it (SentencePiece's leading spaces) and a
        # reply costs linear, not quadratic, decoding. Tokenizers that clean up spaces
        # across tokens decode the whole reply each time instead.
        self.text, self.start, self.read = "", 0, 0
        self.whole = bool(getattr(tok, "clean_up_tokenization_spaces", False))

    def add(self, token: int) -> bool:
        """Take the next token; False past the request's budget (a longer call's rows)."""
        if len(self.ids) >= self.limit:
            return False
        self.ids.append(token)
        if self.whole:
            self.text = self.tok.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
            return True
        decode = self.tok.decode
        before = decode(self.ids[self.start : self.read], skip_special_tokens=True)
        after = decode(self.ids[self.start :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.start, self.read = self.read, len(self.ids)
        return True

    def view(self) -> tuple[str | None, str, bool]:
        """(reasoning, answer, decided): the closed reasoning block (None: none yet), the
        answer text safe to show, and whether the reply's shape is known (no ``<think>``
        block still possible or open)."""
        text = self.text
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        text = text[: min(cuts)] if cuts else text[: len(text) - held(text, self.stops)]
        if self.tools:
            if text[:1].isspace():  # stripped or not: only the end tells
                return None, "", False
            at = text.find(TOOL_OPEN)
            text = text[:at] if at >= 0 else text[: len(text) - held(text, [TOOL_OPEN])]
            text = text.rstrip()
        if self.think:
            if THINK_OPEN.startswith(text) or (
                text.startswith(THINK_OPEN) and THINK_CLOSE not in text
            ):
                return None, "", False
            reasoning, answer = split_think(text)
            return reasoning, answer, True
        return None, text, True


class ReasoningEvents(ABC):
    """The token step of the APIs that show a closed ``<think>`` block as a reasoning block
    of its own before the answer (Responses, Messages). Each sampled token goes to the
    :class:`Reply`; asked for, its log-prob entry waits in ``pending`` for the next delta.
    The reasoning block begins once it is closed, the answer block once there is text to
    show or the reply's shape is known (without tools), and from then on each token sends
    the answer text it makes safe to show (``shown``: the answer text sent so far).

    A subclass makes its API's events: it names the two blocks as ``sent`` records them
    (``REASONING``, ``ANSWER``) and begins them, and sends the deltas."""

    REASONING: str
    ANSWER: str
    sent: Container[str]  # the blocks begun

    def __init__(self, req: Request, tok: Any) -> None:
        self.req, self.tok = req, tok
        self.reply = Reply(tok, req, think=True)
        self.shown = ""
        self.pending: list[dict] = []  # log-prob entries not sent yet

    @abstractmethod
    def _begin_reasoning(self, text: str) -> list[bytes]:
        """Begin the reasoning block (``text``: the closed ``<think>`` block's)."""

    @abstractmethod
    def _begin_answer(self) -> list[bytes]:
        """Begin the answer block, empty."""

    @abstractmethod
    def _delta(self, text: str) -> bytes:
        """The answer's next ``text`` with the log-prob entries ``pending`` (then sent)."""

    def token(self, choice: int, token: int, logprob: float, top: Any) -> list[bytes]:
        req = self.req
        if not self.reply.add(token):
            return []
        if req.logprobs:
            self.pending.append(entry(self.tok, token, logprob, top, req.top_logprobs))
        reasoning, text, decided = self.reply.view()
        out = []
        if reasoning is not None and self.REASONING not in self.sent:
            out += self._begin_reasoning(reasoning)
        if self.ANSWER not in self.sent and (text or (decided and not req.tools)):
            out += self._begin_answer()
        if self.ANSWER in self.sent:
            out.append(self._delta(piece(self.shown, text)))
        return out


def piece(shown: str, text: str) -> str:
    """What ``text`` adds to the ``shown`` text ("" when it does not extend it)."""
    return text[len(shown) :] if text.startswith(shown) else ""


def entry(tok: Any, token: int, logprob: float, top: Any, k: int) -> dict:
    """A token's OpenAI log-prob entry, with its ``k`` likeliest alternatives."""
    out = token_entry(tok, token, logprob)
    alts = []
    if k and top is not None:
        alts = [token_entry(tok, a, b) for a, b in zip(top[0][:k], top[1][:k], strict=True)]
    out["top_logprobs"] = alts
    return out


async def drive(live: Live, events: StreamEvents) -> AsyncIterator[bytes]:
    """The streamed answer's bytes: the API's opening events, one token's events as the
    engine samples it, the tokens that did not come live (every one of an engine that
    cannot stream), then the closing events of the finished call; a call that fails after
    the stream began ends it with the API's error event."""
    for chunk in events.opening():
        yield chunk
    seen: dict[int, int] = {}  # per choice: the tokens given so far
    async for choice, token, logprob, top in live.tokens():
        seen[choice] = seen.get(choice, 0) + 1
        for chunk in events.token(choice, token, logprob, top):
            yield chunk
    try:
        call = live.call()
    except Exception as e:
        for chunk in events.failed(failure(e, live.timeout)):
            yield chunk
        return
    for i, c in enumerate(call.choices):
        rest = c.tokens[seen.get(i, 0) :]
        tops: list[Any] = rest.top or [None] * len(rest)
        for tid, lp, top in zip(rest.ids, rest.materialised("logprobs"), tops, strict=True):
            for chunk in events.token(i, tid, lp, top):
                yield chunk
    for chunk in events.closing(call):
        yield chunk
