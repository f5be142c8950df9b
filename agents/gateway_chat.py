"""OpenAI Chat Completions (``POST <base_url>/chat/completions``): the body checked by
:func:`~polyrl.agents.gateway_requests.parse_request`, the answer and its stream shaped
from the server's :class:`~polyrl.agents.gateway_server.Call`.

Streaming sends one ``chat.completion.chunk`` per sampled token (its text and, asked for,
its log-probs), then the tool calls, then the finish reason.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson

from polyrl.agents.gateway_requests import Request, parse_request
from polyrl.agents.gateway_tokens import logprob_entries, pieces

if TYPE_CHECKING:
    from polyrl.agents.gateway_server import Call, EpisodeState, GatewayServer


def parse(body: Any, server: GatewayServer, ep: EpisodeState) -> Request:
    return parse_request(body, list(server.engines), server.defaults, server.limits)


def answer(req: Request, call: Call, tok: Any, ep: EpisodeState) -> dict:
    choices = []
    for i, c in enumerate(call.choices):
        entry: dict[str, Any] = {
            "index": i,
            "message": c.message,
            "finish_reason": c.finish,
            "logprobs": None,
        }
        if req.logprobs:
            content = logprob_entries(tok, c.ids, c.logprobs, c.tops, req.top_logprobs)
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


def events(answer: dict, req: Request, call: Call, tok: Any):
    """Server-Sent Events ``chat.completion.chunk``s: per choice, one chunk per sampled
    token (the text it adds to the content, its log-prob entry if asked), the tool calls,
    the finish reason; usage last if asked."""
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def event(choices: list, **extra) -> bytes:
        return b"data: " + orjson.dumps(head | {"choices": choices} | extra) + b"\n\n"

    for c, choice in zip(answer["choices"], call.choices, strict=True):
        i, message = c["index"], c["message"]
        yield event([{"index": i, "delta": {"role": "assistant", "content": ""}}])
        content = message["content"] or ""
        entries = (c["logprobs"] or {}).get("content")
        for k, piece in enumerate(pieces(tok, choice.ids, content)):
            lp = {"content": [entries[k]], "refusal": None} if entries else None
            yield event([{"index": i, "delta": {"content": piece}, "logprobs": lp}])
        if message.get("tool_calls"):
            calls = [{"index": k} | tc for k, tc in enumerate(message["tool_calls"])]
            yield event([{"index": i, "delta": {"tool_calls": calls}}])
        yield event([{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}])
    if req.usage_chunk:
        yield event([], usage=answer["usage"])
    yield b"data: [DONE]\n\n"
