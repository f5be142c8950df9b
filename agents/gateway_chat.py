"""OpenAI Chat Completions (``POST <base_url>/chat/completions``): the body checked by
:func:`~polyrl.agents.gateway_requests.parse_request`, the answer and its stream shaped
from the server's :class:`~polyrl.agents.gateway_server.Call`.

Streaming sends one ``chat.completion.chunk`` per sampled token while the engine decodes
(its text and, asked for, its log-probs; :mod:`~polyrl.agents.gateway_stream`), then the
tool calls and the finish reason.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson

from polyrl.agents.gateway_requests import Request, parse_request
from polyrl.agents.gateway_stream import Live, Reply, entry, failure, piece, unsent
from polyrl.agents.gateway_tokens import logprob_entries

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


async def stream(live: Live, req: Request, tok: Any, ep: EpisodeState):
    """Server-Sent Events ``chat.completion.chunk``s as the engine samples: per choice a
    role chunk, then one chunk per sampled token (the text it makes safe to show, its
    log-prob entry if asked), then, once the call ends, the text still held back, the tool
    calls and the finish reason; usage last if asked."""
    head = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": req.model,
    }

    def event(choices: list, **extra) -> bytes:
        return b"data: " + orjson.dumps(head | {"choices": choices} | extra) + b"\n\n"

    replies = [Reply(tok, req, think=False) for _ in range(req.n)]
    shown = [""] * req.n

    def token(i: int, tid: int, lp: float, top: Any) -> bytes | None:
        reply = replies[i]
        if not reply.add(tid):
            return None
        text = piece(shown[i], reply.view()[1])
        shown[i] += text
        lps = None
        if req.logprobs:
            lps = {"content": [entry(tok, tid, lp, top, req.top_logprobs)], "refusal": None}
        return event([{"index": i, "delta": {"content": text}, "logprobs": lps}])

    for i in range(req.n):
        yield event([{"index": i, "delta": {"role": "assistant", "content": ""}}])
    async for i, tid, lp, top in live.tokens():
        if (chunk := token(i, tid, lp, top)) is not None:
            yield chunk
    try:
        call = live.call()
    except Exception as e:
        yield b"data: " + orjson.dumps(failure(e, live.timeout).body()) + b"\n\n"
        return
    done = answer(req, call, tok, ep)
    for i, c in enumerate(done["choices"]):
        for item in unsent(replies[i], call, i):  # an engine that cannot stream: all now
            if (chunk := token(*item)) is not None:
                yield chunk
        message = c["message"]
        if rest := piece(shown[i], message["content"] or ""):
            yield event([{"index": i, "delta": {"content": rest}, "logprobs": None}])
        if message.get("tool_calls"):
            calls = [{"index": k} | tc for k, tc in enumerate(message["tool_calls"])]
            yield event([{"index": i, "delta": {"tool_calls": calls}}])
        yield event([{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}])
    if req.usage_chunk:
        yield event([], usage=done["usage"])
    yield b"data: [DONE]\n\n"
