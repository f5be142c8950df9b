"""Anthropic Messages API (``POST <base_url>/messages``), as the ``anthropic`` client calls
it (``anthropic.Anthropic(base_url=endpoint.base_url, api_key=endpoint.api_key)``).

The body becomes Chat Completions messages (the same normalisation, stitching and record
as ``chat/completions``): ``system`` a system message; a user message's ``tool_result``
blocks tool messages (each must answer a ``tool_use`` of the conversation), its text and
``image`` blocks (base64 sources) a user message; an assistant message's text, its
``tool_use`` blocks the ``tool_calls`` and a ``thinking`` block the ``<think>...</think>``
text the policy wrote. Errors are Anthropic's shape (``{"type": "error", "error": {"type",
"message"}}``). Not part of Anthropic's API but accepted: ``top_logprobs`` (0 to 20) or
``logprobs: true`` add the sampled tokens' log-probs as a ``logprobs`` field.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson

from polyrl.agents.gateway.api import ApiContext
from polyrl.agents.gateway.episodes import Call, Choice, EpisodeState
from polyrl.agents.gateway.errors import RequestError
from polyrl.agents.gateway.requests import (
    Request,
    check_count,
    check_top_logprobs,
    parse_request,
)
from polyrl.agents.gateway.stream import ReasoningEvents, piece
from polyrl.agents.gateway.tokens import join_think, logprob_entries, split_think

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_body(e: RequestError) -> dict[str, Any]:
    kind = KINDS.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _bad(message: str) -> RequestError:
    return RequestError(400, message)


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks")
    for k, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _bad(f"{where}.content[{k}] must be a block with a type")
    return content


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise _bad(
            f"{where}: an image block needs a base64 source ({{type: base64, media_type, "
            "data}}); the gateway fetches nothing"
        )
    media = source.get("media_type", "image/png")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source.get('data')}"}}


def _parts(blocks: list[dict], where: str) -> Any:
    """Text and image blocks as Chat Completions content."""
    parts = []
    for k, b in enumerate(blocks):
        at = f"{where}.content[{k}]"
        if b["type"] == "text":
            parts.append({"type": "text", "text": str(b.get("text", ""))})
        elif b["type"] == "image":
            parts.append(_image(b, at))
        else:
            raise _bad(f"{at}: block type {b['type']!r} is not served here; use text or image")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def to_messages(messages: Any) -> list[dict]:
    """Anthropic messages as Chat Completions messages (see the module's docstring)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    out: list[dict] = []
    calls: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            role = m.get("role") if isinstance(m, dict) else None
            raise _bad(f"{where}.role={role!r}: use user or assistant (system goes in system)")
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "assistant":
            text, thinking, tool_calls = [], None, []
            for k, b in enumerate(blocks):
                at = f"{where}.content[{k}]"
                if b["type"] == "text":
                    text.append(str(b.get("text", "")))
                elif b["type"] == "thinking":
                    thinking = (thinking or "") + str(b.get("thinking", ""))
                elif b["type"] == "tool_use":
                    if not b.get("id") or not isinstance(b.get("name"), str):
                        raise _bad(f"{at}: a tool_use block needs id and name")
                    args = json.dumps(b.get("input") or {})
                    tool_calls.append(
                        {
                            "id": str(b["id"]),
                            "type": "function",
                            "function": {"name": b["name"], "arguments": args},
                        }
                    )
                    calls.add(str(b["id"]))
                else:
                    raise _bad(f"{at}: block type {b['type']!r} is not served in an assistant turn")
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": join_think(thinking, "".join(text)),
            }
            if tool_calls:
                msg["tool_calls"] = tool_calls
            out.append(msg)
            continue
        rest = []
        for k, b in enumerate(blocks):
            at = f"{where}.content[{k}]"
            if b["type"] != "tool_result":
                rest.append(b)
                continue
            use = str(b.get("tool_use_id"))
            if use not in calls:
                raise _bad(
                    f"{at}: tool_result for tool_use_id={b.get('tool_use_id')!r}, which no "
                    "tool_use block of this conversation made"
                )
            content = b.get("content", "")
            content = content if isinstance(content, str) else _parts(_blocks(content, at), at)
            out.append({"role": "tool", "content": content, "tool_call_id": use})
        if rest or not any(b["type"] == "tool_result" for b in blocks):
            out.append({"role": "user", "content": _parts(rest, where)})
    return out


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list")
    out = []
    for k, t in enumerate(tools):
        kind = t.get("type", "custom") if isinstance(t, dict) else None
        if kind != "custom" or not isinstance(t.get("name"), str):
            raise _bad(
                f"tools[{k}]: type {kind!r} is not served; only client tools "
                "({name, description, input_schema}) are"
            )
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def parse(body: Any, ctx: ApiContext) -> Request:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    messages = body.get("messages")
    if isinstance(messages, list):
        check_count(len(messages), ctx.limits)
    if body.get("max_tokens") is None:
        raise _bad("max_tokens is required")
    system = body.get("system")
    if isinstance(system, list):
        system = _parts(_blocks(system, "system"), "system")
    if system is not None and not isinstance(system, str):
        raise _bad("system must be a string or a list of text blocks")
    if body.get("top_k") is not None:
        raise _bad("top_k is not supported (the engines sample with temperature and top_p)")
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind not in (None, "auto", "none"):
        raise _bad("tool_choice: only {type: auto} and {type: none} are supported")
    top = check_top_logprobs(body.get("top_logprobs"))
    head = [{"role": "system", "content": system}] if system else []
    chat = {
        "model": body.get("model"),
        "messages": head + to_messages(messages),
        "max_tokens": body.get("max_tokens"),
        "stop": body.get("stop_sequences"),
        "tools": _tools(body.get("tools")),
        "tool_choice": kind,
        "logprobs": bool(body.get("logprobs")) or top > 0,
        "top_logprobs": top or None,
        "stream": body.get("stream"),
    }
    for key in ("temperature", "top_p", "seed"):
        chat[key] = body.get(key)
    try:
        req = parse_request(chat, ctx.models, ctx.defaults, ctx.limits)
    except RequestError as e:
        if e.param == "stop":
            e.message = e.message.replace("stop", "stop_sequences", 1)
        raise
    return req


def _content(choice: Choice) -> list[dict]:
    text = choice.message["content"] or ""
    thinking, answer_text = split_think(text)
    blocks: list[dict] = []
    if thinking is not None:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    calls = choice.message.get("tool_calls") or []
    if answer_text or not calls:
        blocks.append({"type": "text", "text": answer_text})
    for c in calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": c["id"],
                "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"]),
            }
        )
    return blocks


def answer(req: Request, call: Call, tok: Any, mid: str | None = None) -> dict[str, Any]:
    choice = call.choices[0]
    out: dict[str, Any] = {
        "id": mid or "msg_" + uuid.uuid4().hex,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": _content(choice),
        "stop_reason": "stop_sequence" if choice.stop_hit else STOP[choice.finish],
        "stop_sequence": choice.stop_hit,
        "usage": {
            "input_tokens": len(call.prompt_ids),
            "output_tokens": len(choice.ids),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    if req.logprobs:
        entries = logprob_entries(tok, choice.tokens, req.top_logprobs)
        out["logprobs"] = {"content": entries}
    return out


class MessagesAPI:
    """Anthropic Messages as the gateway's :class:`~polyrl.agents.gateway.api.WireAPI`."""

    # the second: an Anthropic client given the OpenAI-style base_url (it adds /v1 itself)
    paths: tuple[str, ...] = ("/messages", "/v1/messages")

    def parse(self, body: Any, ctx: ApiContext, ep: EpisodeState) -> Request:
        return parse(body, ctx)

    def answer(self, req: Request, call: Call, tok: Any, ep: EpisodeState) -> dict[str, Any]:
        return answer(req, call, tok)

    def stream(self, req: Request, tok: Any, ep: EpisodeState, prompt_len: int) -> MessagesStream:
        return MessagesStream(req, tok, prompt_len)

    def error_body(self, e: RequestError) -> dict[str, Any]:
        return error_body(e)


def _event(kind: str, **data: Any) -> bytes:
    return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind} | data) + b"\n\n"


class MessagesStream(ReasoningEvents):
    """Anthropic streaming events as the engine samples: message_start; a thinking block
    once its ``<think>`` block is closed; the text block with one ``text_delta`` per sampled
    token (the text it makes safe to show; asked for, the log-prob entries of the tokens
    since the last delta); once the call ends, the text still held back, the tool_use
    blocks, message_delta (the stop reason and usage) and message_stop."""

    REASONING, ANSWER = "thinking", "text"

    def __init__(self, req: Request, tok: Any, prompt_len: int) -> None:
        super().__init__(req, tok)
        self.prompt_len = prompt_len
        self.mid = "msg_" + uuid.uuid4().hex
        self.sent: list[str] = []  # the block types begun, in order

    def opening(self) -> list[bytes]:
        start: dict[str, Any] = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.prompt_len,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        return [_event("message_start", message=start)]

    def _begin(self, block: dict) -> list[bytes]:
        self.sent.append(block["type"])
        index = len(self.sent) - 1
        if block["type"] == "thinking":
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
            return [
                _event("content_block_start", index=index, content_block=empty),
                _event("content_block_delta", index=index, delta=delta),
                _event("content_block_stop", index=index),
            ]
        empty = {"type": "text", "text": ""}
        return [_event("content_block_start", index=index, content_block=empty)]

    def _delta(self, text: str) -> bytes:
        self.shown, lps, self.pending = self.shown + text, self.pending, []
        extra = {"logprobs": lps} if self.req.logprobs else {}
        index = self.sent.index("text")
        return _event("content_block_delta", index=index,
                      delta={"type": "text_delta", "text": text}, **extra)  # fmt: skip

    def _begin_reasoning(self, text: str) -> list[bytes]:
        return self._begin({"type": "thinking", "thinking": text})

    def _begin_answer(self) -> list[bytes]:
        return self._begin({"type": "text"})

    def failed(self, error: RequestError) -> list[bytes]:
        return [_event("error", error=error_body(error)["error"])]

    def closing(self, call: Call) -> list[bytes]:
        message = answer(self.req, call, self.tok, self.mid)
        out = []
        for block in message["content"]:
            kind = block["type"]
            if kind in ("thinking", "text") and kind not in self.sent:
                out += self._begin(block)
            if kind == "text":
                if (rest := piece(self.shown, block["text"])) or self.pending:
                    out.append(self._delta(rest))
                out.append(_event("content_block_stop", index=self.sent.index("text")))
            elif kind == "tool_use":
                self.sent.append(kind)
                index = len(self.sent) - 1
                opened = block | {"input": {}}
                out.append(_event("content_block_start", index=index, content_block=opened))
                partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                out.append(_event("content_block_delta", index=index, delta=partial))
                out.append(_event("content_block_stop", index=index))
        stop = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        out.append(
            _event(
                "message_delta",
                delta=stop,
                usage={"output_tokens": message["usage"]["output_tokens"]},
            )
        )
        out.append(_event("message_stop"))
        return out
