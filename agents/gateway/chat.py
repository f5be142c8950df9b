"""OpenAI Chat Completions (``POST <base_url>/chat/completions``): the body checked by
:func:`~polyrl.agents.gateway.requests.parse_request`, the answer and its stream shaped
from the server's :class:`~polyrl.agents.gateway.episodes.Call`.

Streaming sends one ``chat.completion.chunk`` per sampled token while the engine decodes
(its text and, asked for, its log-probs; :mod:`~polyrl.agents.gateway.stream`), then the
tool calls and the finish reason.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from polyrl.agents.gateway.api import ApiContext
from polyrl.agents.gateway.episodes import Call, EpisodeState
from polyrl.agents.gateway.errors import RequestError
from polyrl.agents.gateway.requests import Request, parse_request
from polyrl.agents.gateway.stream import Reply, entry, piece
from polyrl.agents.gateway.tokens import logprob_entries


class ChatAPI:
    """OpenAI Chat Completions as the gateway's :class:`~polyrl.agents.gateway.api.WireAPI`."""

    paths: tuple[str, ...] = ("/chat/completions",)

    def parse(self, body: Any, ctx: ApiContext, ep: EpisodeState) -> Request:
        return parse_request(body, ctx.models, ctx.defaults, ctx.limits)

    def answer(self, req: Request, call: Call, tok: Any, ep: EpisodeState) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(call.choices):
            entry: dict[str, Any] = {
                "index": i,
                "message": c.message,
                "finish_reason": c.finish,
                "logprobs": None,
            }
            if req.logprobs:
                content = logprob_entries(tok, c.tokens, req.top_logprobs)
                entry["logprobs"] = {"content": content, "refusal": None}
            choices.append(entry)
        completion = sum(len(c.ids) for c in call.choices)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(call.prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(call.prompt_ids) + completion,
            },
        }

    def stream(self, req: Request, tok: Any, ep: EpisodeState, prompt_len: int) -> ChatStream:
        return ChatStream(self, req, tok, ep)

    def error_body(self, e: RequestError) -> dict[str, Any]:
        return e.body()


class ChatStream:
    """Server-Sent Events ``chat.completion.chunk``s as the engine samples: per choice a
    role chunk, then one chunk per sampled token (the text it makes safe to show, its
    log-prob entry if asked), then, once the call ends, the text still held back, the tool
    calls and the finish reason; usage last if asked."""

    def __init__(self, api: ChatAPI, req: Request, tok: Any, ep: EpisodeState) -> None:
        self.api, self.req, self.tok, self.ep = api, req, tok, ep
        self.head = {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model,
        }
        self.replies = [Reply(tok, req, think=False) for _ in range(req.n)]
        self.shown = [""] * req.n

    def _event(self, choices: list, **extra: Any) -> bytes:
        return b"data: " + orjson.dumps(self.head | {"choices": choices} | extra) + b"\n\n"

    def opening(self) -> list[bytes]:
        return [
            self._event([{"index": i, "delta": {"role": "assistant", "content": ""}}])
            for i in range(self.req.n)
        ]

    def token(self, choice: int, token: int, logprob: float, top: Any) -> list[bytes]:
        req, reply = self.req, self.replies[choice]
        if not reply.add(token):
            return []
        text = piece(self.shown[choice], reply.view()[1])
        self.shown[choice] += text
        lps = None
        if req.logprobs:
            lps = {
                "content": [entry(self.tok, token, logprob, top, req.top_logprobs)],
                "refusal": None,
            }
        return [self._event([{"index": choice, "delta": {"content": text}, "logprobs": lps}])]

    def failed(self, error: RequestError) -> list[bytes]:
        return [b"data: " + orjson.dumps(error.body()) + b"\n\n"]

    def closing(self, call: Call) -> list[bytes]:
        done = self.api.answer(self.req, call, self.tok, self.ep)
        out = []
        for i, c in enumerate(done["choices"]):
            message = c["message"]
            if rest := piece(self.shown[i], message["content"] or ""):
                out.append(
                    self._event([{"index": i, "delta": {"content": rest}, "logprobs": None}])
                )
            if message.get("tool_calls"):
                calls = [{"index": k} | tc for k, tc in enumerate(message["tool_calls"])]
                out.append(self._event([{"index": i, "delta": {"tool_calls": calls}}]))
            out.append(
                self._event([{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}])
            )
        if self.req.usage_chunk:
            out.append(self._event([], usage=done["usage"]))
        out.append(b"data: [DONE]\n\n")
        return out
