"""The gateway's requests: OpenAI Chat Completions bodies checked, messages normalised.

A :class:`RequestError` is an OpenAI-style error answer; :func:`parse_request` turns a body
into a :class:`Request` or raises one naming the field. Messages are normalised into what
the chat template renders and into comparison keys (how stitching recognises an earlier
turn), their images decoded by :mod:`polyrl.agents.gateway.images`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from polyrl.agents.gateway import images as gateway_images
from polyrl.agents.gateway.errors import RequestError
from polyrl.agents.gateway.options import GatewayOptions
from polyrl.core.rollout.engine import SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
MAX_TOP_LOGPROBS = 20


def tool_calls_key(calls: Any, where: str) -> tuple:
    if not calls:
        return ()
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(400, f"{where}.tool_calls[{k}] needs function.name")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        out.append((fn["name"], json.dumps(parsed, sort_keys=True)))
    return tuple(out)


def normalise_messages(
    messages: Any, limits: GatewayOptions = GatewayOptions()
) -> tuple[list[dict], list[tuple], list]:
    """Messages as the chat template gets them, their comparison keys and their images
    (decoded, in order; see :mod:`polyrl.agents.gateway.images`)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    check_count(len(messages), limits)
    rendered: list[dict] = []
    keys: list[tuple] = []
    images: list = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                400, f"{where}.role={role!r}: use one of {', '.join(ROLES)}", param="messages"
            )
        if role == "developer":
            role = "system"
        try:
            body, text = gateway_images.content(m.get("content"), where, limits, images)
        except gateway_images.ImagePartError as e:
            raise RequestError(400, str(e), param=f"{where}.content") from None
        calls = tool_calls_key(m.get("tool_calls"), where) if role == "assistant" else ()
        msg = {"role": role, "content": body}
        if calls:
            msg["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                for n, a in calls
            ]
        if role == "tool" and m.get("name"):
            msg["name"] = str(m["name"])
        rendered.append(msg)
        keys.append((role, text, calls, str(m.get("name") or "") if role == "tool" else ""))
    return rendered, keys, images


def fold_calls(msg: dict) -> dict:
    """An assistant message's tool calls written into its content as Hermes blocks (the
    form the gateway parses replies in), for chat templates that ignore ``tool_calls``."""
    if not msg.get("tool_calls"):
        return msg
    blocks = [
        "<tool_call>"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "</tool_call>"
        for c in msg["tool_calls"]
    ]
    return {"role": msg["role"], "content": msg["content"] + "\n".join(blocks)}


# --------------------------------------------------------------------------- request checks


def check_count(
    n: int, limits: GatewayOptions, what: str = "messages", param: str = "messages"
) -> None:
    """A conversation longer than ``max_messages`` is refused before it is rendered."""
    if n > limits.max_messages:
        raise RequestError(
            400,
            f"the request has {n} {what}, more than this gateway takes "
            f"(rollout.args.max_messages={limits.max_messages}); send a shorter history",
            param=param,
        )


def check_stop(stop: Any, limits: GatewayOptions, key: str = "stop") -> list[str]:
    """Stop strings as a list, within ``max_stop`` strings of ``max_stop_chars``."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, f"{key} must be a string or a list of non-empty strings", key)
    if len(stop) > limits.max_stop:
        raise RequestError(
            400,
            f"{key} takes at most {limits.max_stop} sequences (rollout.args.max_stop), "
            f"got {len(stop)}",
            param=key,
        )
    long = [len(s) for s in stop if len(s) > limits.max_stop_chars]
    if long:
        raise RequestError(
            400,
            f"{key}: a sequence of {long[0]} characters is longer than "
            f"rollout.args.max_stop_chars={limits.max_stop_chars}",
            param=key,
        )
    return stop


def check_top_logprobs(value: Any, key: str = "top_logprobs") -> int:
    """``top_logprobs``: 0 to 20 alternatives per sampled token."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20:
        raise RequestError(
            400, f"{key} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}", key
        )
    return value


def _number(
    body: dict, key: str, default: Any, lo: float, hi: float, *, integer: bool = False
) -> Any:
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not (lo <= value <= hi):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"{key} must be {kind} in [{lo}, {hi}], got {value!r}", param=key)
    return value


@dataclass
class Request:
    model: str
    messages: list[dict]
    keys: list[tuple]
    temperature: float
    top_p: float
    max_tokens: int
    n: int
    stop: list[str]
    logprobs: bool
    tools: list[dict] | None
    stream: bool = False
    usage_chunk: bool = False  # stream_options.include_usage
    tools_key: str = "null"  # the tools as canonical JSON (stitching compares it)
    seed: int | None = None  # the request's own sampling stream (SamplingParams.seed)
    images: list = field(default_factory=list)  # the messages' images, decoded, in order
    top_logprobs: int = 0  # alternatives per sampled token the answer lists (0: none)
    max_tokens_given: bool = True  # False: the default budget, shortened to fit the context
    api: dict = field(default_factory=dict)  # what the request's own API answers with


def parse_request(
    body: Any,
    models: list[str],
    defaults: SamplingParams,
    limits: GatewayOptions = GatewayOptions(),
) -> Request:
    """Check a Chat Completions body; a :class:`RequestError` says what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(400, "stream must be true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise RequestError(
            400, "stream_options needs stream: true and an object", param="stream_options"
        )
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(400, "model is required (a policy name)", param="model")
    if model not in models:
        raise RequestError(
            404,
            f"The model {model!r} does not exist; this gateway serves: {', '.join(models)}",
            code="model_not_found",
            param="model",
        )
    messages, keys, images = normalise_messages(body.get("messages"), limits)
    cap = defaults.max_new_tokens
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number({key: max_tokens}, key, cap, 1, cap, integer=True)
    stop = check_stop(body.get("stop"), limits)
    logprobs = body.get("logprobs", False)
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise RequestError(400, "logprobs must be true or false", param="logprobs")
    top_logprobs = check_top_logprobs(body.get("top_logprobs"))
    if top_logprobs and not logprobs:
        raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(400, "seed must be an integer", param="seed")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list)
        or not all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise RequestError(
            400, "tools must be a list of {type: function, function: {name, ...}}", param="tools"
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(
            400, "tool_choice: only 'auto' and 'none' are supported", param="tool_choice"
        )
    if choice == "none":
        tools = None
    return Request(
        model=model,
        messages=messages,
        keys=keys,
        temperature=float(_number(body, "temperature", defaults.temperature, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", defaults.top_p, 1e-9, 1.0)),
        max_tokens=int(max_tokens),
        n=int(_number(body, "n", 1, 1, MAX_N, integer=True)),
        stop=stop,
        logprobs=logprobs,
        tools=tools or None,
        stream=bool(stream),
        usage_chunk=bool((options or {}).get("include_usage")),
        tools_key=json.dumps(tools or None, sort_keys=True),
        seed=seed,
        images=images,
        top_logprobs=top_logprobs,
        max_tokens_given=body.get(key) is not None,
    )
