"""OpenAI Responses API (``POST <base_url>/responses``), as the ``openai`` client's
``responses.create`` and the OpenAI Agents SDK call it.

The body's items become Chat Completions messages (the same normalisation, stitching and
record as ``chat/completions``): ``instructions`` a system message; ``message`` items
their role's message; an assistant's ``function_call`` items the ``tool_calls`` of the
assistant message they follow; ``function_call_output`` a tool message (its ``call_id``
must name a call of the conversation); a ``reasoning`` item the ``<think>...</think>``
text the policy wrote, put back in front of the answer it preceded. So an agent sending
back the gateway's output items sends exactly the reply it got, and the next prompt is
stitched onto the sampled ids. ``previous_response_id`` continues a stored response (the
gateway keeps each episode's responses unless ``store: false``): only new items are sent.
"""

from __future__ import annotations

import time
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

LOGPROBS = "message.output_text.logprobs"


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param)


def _text_parts(content: Any, where: str) -> Any:
    """A message item's content as Chat Completions content (a string, or text and
    ``image_url`` parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", "input")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _bad(
                    f"{where}.content[{k}]: an input_image needs image_url (a data URL); "
                    "file_id is not served",
                    "input",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _bad(
                f"{where}.content[{k}]: type {kind!r} is not supported; use input_text, "
                "output_text or input_image (a data URL)",
                "input",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def to_messages(items: Any, known_calls: set[str]) -> list[dict]:
    """Input items as Chat Completions messages (see the module's docstring); a
    ``function_call_output`` must answer a call in ``known_calls`` or in the items."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    thinking: str | None = None  # a reasoning item waiting for its answer
    calls = set(known_calls)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(
                    f"{where}.role={role!r}: use user, system, developer or assistant", "input"
                )
            content = _text_parts(item.get("content"), where)
            if role == "assistant":
                if not isinstance(content, str):
                    raise _bad(f"{where}: an assistant message carries text only", "input")
                out.append({"role": "assistant", "content": join_think(thinking, content)})
                thinking = None
            else:
                out.append({"role": role, "content": content})
        elif kind == "reasoning":
            texts = [
                str(c.get("text", ""))
                for c in item.get("content") or []
                if isinstance(c, dict) and c.get("type") == "reasoning_text"
            ]
            thinking = (thinking or "") + "".join(texts)
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not call_id:
                raise _bad(f"{where}: a function_call needs name, arguments (a string) and call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.call_id must be a string, got {type(call_id).__name__}")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            last = out[-1] if out else None
            if thinking is None and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:  # a call with no text before it
                out.append({"role": "assistant", "content": join_think(thinking, "")})
                out[-1]["tool_calls"] = [call]
                thinking = None
            calls.add(str(call_id))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if str(call_id) not in calls:
                raise _bad(
                    f"{where}: function_call_output for call_id={call_id!r}, which no "
                    "function_call of this conversation made",
                    "input",
                )
            content = output if isinstance(output, str) else _text_parts(output, where)
            out.append({"role": "tool", "content": content, "tool_call_id": str(call_id)})
        else:
            raise _bad(
                f"{where}: item type {kind!r} is not served; send message, function_call, "
                "function_call_output or reasoning items",
                "input",
            )
    return out


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not t.get("name"):
            kind = t.get("type") if isinstance(t, dict) else t
            raise _bad(
                f"tools[{k}]: type {kind!r} is not served; only function tools "
                "({type: function, name, parameters}) are",
                "tools",
            )
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def parse(body: Any, ctx: ApiContext, ep: EpisodeState) -> Request:
    """A Responses body as a :class:`Request` (its API fields in ``req.api``)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    history: list[dict] = []
    held = 0  # bytes the continued history holds (charged again: its keys are rebuilt)
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise _bad(
                f"previous_response_id must be a string (a response's id), got "
                f"{type(prev).__name__}",
                "previous_response_id",
            )
        with ep.lock:
            stored = ep.responses.get(prev)
            held = ep.response_bytes.get(prev, 0)
        if stored is None:
            raise _bad(
                f"previous_response_id={prev!r} is no stored response of this episode "
                "(responses with store: false are not kept)",
                "previous_response_id",
            )
        history = stored
    items = body.get("input")
    check_count(
        (len(items) if isinstance(items, list) else 1) + len(history),
        ctx.limits,
        "input items",
        "input",
    )
    known = {tc["id"] for m in history for tc in m.get("tool_calls", [])}
    messages = history + to_messages(items, known)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("text.format: only {type: text} is served (no structured outputs)", "text")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _bad("include must be a list", "include")
    top = check_top_logprobs(body.get("top_logprobs"))
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise _bad("store must be true or false", "store")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) or choice == "required":
        raise _bad("tool_choice: only 'auto' and 'none' are supported", "tool_choice")
    chat = {
        "model": body.get("model"),
        "messages": system + messages,
        "tools": _tools(body.get("tools")),
        "tool_choice": choice,
        "logprobs": LOGPROBS in include or top > 0,
        "top_logprobs": top or None,
        "stream": body.get("stream"),
    }
    for key in ("temperature", "top_p", "seed"):
        chat[key] = body.get(key)
    chat["max_tokens"] = body.get("max_output_tokens")
    try:
        req = parse_request(chat, ctx.models, ctx.defaults, ctx.limits)
    except RequestError as e:
        if e.param == "max_tokens":
            e.param = "max_output_tokens"
            e.message = e.message.replace("max_tokens", "max_output_tokens")
            e.args = (e.message,)
        raise
    req.api = {
        "instructions": instructions,
        "history": messages,
        "previous_response_id": prev,
        "store": store,
        "tools": body.get("tools") or [],
        "tool_choice": choice or "auto",
        "metadata": body.get("metadata") or {},
        "history_bytes": held,
    }
    return req


def _reasoning_item(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": "rs_" + uuid.uuid4().hex,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _message_item(content: list[dict]) -> dict:
    return {
        "type": "message",
        "id": "msg_" + uuid.uuid4().hex,
        "status": "completed",
        "role": "assistant",
        "content": content,
    }


def _output(req: Request, choice: Choice, tok: Any) -> list[dict]:
    """A choice as output items: reasoning (``<think>`` text), the message, its calls."""
    text = choice.message["content"] or ""
    reasoning, answer_text = split_think(text)
    items: list[dict] = []
    if reasoning is not None:
        items.append(_reasoning_item(reasoning))
    calls = choice.message.get("tool_calls") or []
    if answer_text or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": answer_text, "annotations": []}
        if req.logprobs:
            part["logprobs"] = logprob_entries(tok, choice.tokens, req.top_logprobs)
        items.append(_message_item([part]))
    for c in calls:
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + uuid.uuid4().hex,
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def _shell(req: Request, rid: str) -> dict:
    """The response object before its output: what ``response.created`` carries."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "incomplete_details": None,
        "error": None,
        "instructions": req.api["instructions"],
        "max_output_tokens": req.max_tokens,
        "model": req.model,
        "output": [],
        "parallel_tool_calls": True,
        "previous_response_id": req.api["previous_response_id"],
        "reasoning": {"effort": None, "summary": None},
        "store": req.api["store"],
        "temperature": req.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.api["tool_choice"],
        "tools": req.api["tools"],
        "top_logprobs": req.top_logprobs,
        "top_p": req.top_p,
        "truncation": "disabled",
        "metadata": req.api["metadata"],
        "usage": None,
    }


def answer(
    req: Request, call: Call, tok: Any, ep: EpisodeState, rid: str | None = None
) -> dict[str, Any]:
    """The response object; stored (``store``) for a later ``previous_response_id``."""
    choice = call.choices[0]
    rid = rid or "resp_" + uuid.uuid4().hex
    if req.api["store"]:
        with ep.lock:
            ep.responses[rid] = req.api["history"] + [dict(choice.message)]
            ep.response_bytes[rid] = call.held
    done = choice.finish != "length"
    usage_out = len(choice.ids)
    return _shell(req, rid) | {
        "status": "completed" if done else "incomplete",
        "incomplete_details": None if done else {"reason": "max_output_tokens"},
        "output": _output(req, choice, tok),
        "usage": {
            "input_tokens": len(call.prompt_ids),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(call.prompt_ids) + usage_out,
        },
    }


class ResponsesAPI:
    """OpenAI Responses as the gateway's :class:`~polyrl.agents.gateway.api.WireAPI`."""

    paths: tuple[str, ...] = ("/responses",)

    def parse(self, body: Any, ctx: ApiContext, ep: EpisodeState) -> Request:
        return parse(body, ctx, ep)

    def answer(self, req: Request, call: Call, tok: Any, ep: EpisodeState) -> dict[str, Any]:
        return answer(req, call, tok, ep)

    def stream(self, req: Request, tok: Any, ep: EpisodeState, prompt_len: int) -> ResponsesStream:
        return ResponsesStream(req, tok, ep)

    def error_body(self, e: RequestError) -> dict[str, Any]:
        return e.body()


class ResponsesStream(ReasoningEvents):
    """Responses streaming events as the engine samples: created; a reasoning item once
    its ``<think>`` block is closed; the message item with one
    ``response.output_text.delta`` per sampled token (the text it makes safe to show, the
    log-prob entries of the tokens since the last delta); once the call ends, the text
    still held back, the function calls, and completed (the exact response)."""

    REASONING, ANSWER = "reasoning", "message"

    def __init__(self, req: Request, tok: Any, ep: EpisodeState) -> None:
        super().__init__(req, tok)
        self.ep = ep
        self.seq = 0
        self.rid = "resp_" + uuid.uuid4().hex
        self.sent: dict[str, tuple[int, str]] = {}  # item type -> (output index, id) begun

    def _event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq} | data
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + orjson.dumps(body) + b"\n\n"

    def opening(self) -> list[bytes]:
        start = _shell(self.req, self.rid)
        return [
            self._event("response.created", response=start),
            self._event("response.in_progress", response=start),
        ]

    def _begin(self, item: dict) -> list[bytes]:
        index = len(self.sent)
        self.sent[item["type"]] = (index, item["id"])
        if item["type"] == "reasoning":
            return [
                self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        empty = {"type": "output_text", "text": "", "annotations": []}
        opened = item | {"status": "in_progress", "content": []}
        base = {"output_index": index, "item_id": item["id"]}
        return [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event("response.content_part.added", **base, content_index=0, part=empty),
        ]

    def _delta(self, text: str) -> bytes:
        index, item_id = self.sent["message"]
        self.shown, lps, self.pending = self.shown + text, self.pending, []
        return self._event("response.output_text.delta", output_index=index, item_id=item_id,
                           content_index=0, delta=text, logprobs=lps)  # fmt: skip

    def _begin_reasoning(self, text: str) -> list[bytes]:
        return self._begin(_reasoning_item(text))

    def _begin_answer(self) -> list[bytes]:
        return self._begin(_message_item([]))

    def failed(self, error: RequestError) -> list[bytes]:
        return [
            self._event(
                "error",
                code=error.code,
                message=error.message,
                param=error.param,
                error=error.body()["error"],
            )  # fmt: skip
        ]

    def closing(self, call: Call) -> list[bytes]:
        response = answer(self.req, call, self.tok, self.ep, self.rid)
        sent, event, out = self.sent, self._event, []
        for item in response["output"]:
            kind = item["type"]
            if kind in sent:  # begun while the engine sampled: the same item
                item["id"] = sent[kind][1]
            elif kind in ("reasoning", "message"):
                out += self._begin(item)
            if kind == "message":
                index, part = sent["message"][0], item["content"][0]
                if (rest := piece(self.shown, part["text"])) or self.pending:
                    out.append(self._delta(rest))
                base = {"output_index": index, "item_id": item["id"]}
                out.append(event("response.output_text.done", **base, content_index=0,
                                 text=part["text"], logprobs=part.get("logprobs") or []))  # fmt: skip
                out.append(event("response.content_part.done", **base, content_index=0, part=part))
                out.append(event("response.output_item.done", output_index=index, item=item))
            elif kind == "function_call":
                index = len(sent)
                sent[item["id"]] = (index, item["id"])
                base = {"output_index": index, "item_id": item["id"]}
                opened = item | {"status": "in_progress", "arguments": ""}
                out.append(event("response.output_item.added", output_index=index, item=opened))
                out.append(event("response.function_call_arguments.delta", **base,
                                 delta=item["arguments"]))  # fmt: skip
                out.append(event("response.function_call_arguments.done", **base,
                                 arguments=item["arguments"], name=item["name"]))  # fmt: skip
                out.append(event("response.output_item.done", output_index=index, item=item))
        done = response["status"] == "completed"
        out.append(
            event("response.completed" if done else "response.incomplete", response=response)
        )
        return out
